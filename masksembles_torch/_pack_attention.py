"""Attention at packed speed: the members folded into the attention heads.

An attention region (the operations between the query/key/value Linear layers, or elementwise operations computed
per member after them (``q_proj(x) * scaling``), and the projection that reads their result: reshapes that split or
merge the channels as (heads, head_dim), moves, ``unbind``, ``q @ k^T``, softmax, a scale, an additive mask,
``torch.where``, Dropout in eval, ``F.scaled_dot_product_attention``; rotary embeddings' slices and concatenation of
the head dimension, grouped-query keys repeated for their query heads, multi-query attention's split of its fused
heads) falls back: nothing compacts it. Where
every member reads every channel of those Linear layers, the members' blocks side by side on the channel axis are
one wider layer's output with ``m`` times the heads, and every operation of the region treats heads apart: the region
runs once on (B, m*heads, L, d) and gives its result back in member blocks, (B, L, m*C), with no move in or out.

``fold_regions`` finds such regions on the capture (after the channel axes are solved) and tracks, for every value of
a region, its *fold*: the axis that holds the members' blocks and how many elements of that axis sit outside the
member index (1 for blocks side by side; 3 when a fused qkv Linear's output is split as (3, heads, head_dim): that
Linear then writes its output with the member index inside the 3, ``MemberLinear(output_split=3)``). Every operation
has a rule that says where its result's fold is, or that it mixes what a fold keeps apart; a region with an operation
that has no rule, or a rule that fails (a softmax over the heads, a matmul over them, a concatenation of heads, a mask
with a size other than 1 or one member's heads on the heads, talking heads), is left as it was: fallbacks on the
member-stacked batch. A mask (or position bias) with one member's heads, the same for every member, is repeated for
every member's heads where the region runs (``Region.repeats``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import fx, nn

from masksembles_core.captured import Probed

from ._pack_capture import DROPOUT_FUNCTIONS, DROPOUT_TYPES, _called, _Capture, _Op, _Seen
from ._pack_graph import _Graph, _takes_whole

RESHAPES = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}
RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten}
MOVES = {"transpose", "permute", "movedim", "swapaxes", "swapdims", "contiguous", "t"}
MOVE_FUNCTIONS = {torch.transpose, torch.permute, torch.movedim, torch.swapaxes}
SOFTMAX = {"softmax", "log_softmax"}
MATMULS = {torch.matmul, operator.matmul, "matmul", "__matmul__"}
WHERE = {torch.where, torch.ops.aten.where.self}  # (condition, input, other), each element from its own place
ELEMENTWISE_ENTRIES = ("channelwise", "combine", "add")  # computed per member, like a Linear layer's output


@dataclass(frozen=True)
class Fold:
    """Where a value's members sit: the blocks of ``axis``, each member's block after ``outer`` elements of it."""

    axis: int
    outer: int = 1


@dataclass
class Region:
    """One folded region: its operations, the Linear layers it reads (and the ``outer`` each one writes), the fold of
    each value, the folded shape (batch axis -1, per member) of each reshape and expand, the equal parts of each split
    of a fold's axis (GPT-2's fused qkv split into q, k and v), and the inputs from outside the region that hold one
    member's heads (a per-head position bias), with the axis each is repeated along for every member's heads."""

    ops: list[fx.Node]
    entries: dict[fx.Node, int]
    folds: dict[fx.Node, Fold | tuple[Fold, ...]] = field(default_factory=dict)
    shapes: dict[fx.Node, tuple[int, ...]] = field(default_factory=dict)
    chunks: dict[fx.Node, tuple[int, int]] = field(default_factory=dict)  # a split of a fold's axis: (parts, axis)
    repeats: dict[fx.Node, dict[fx.Node, int]] = field(default_factory=dict)  # per-head inputs: the axis to repeat
    indexes: dict[fx.Node, tuple[int, tuple[Any, ...], int]] = field(default_factory=dict)  # (axis, index, landing)
    shared_heads: set[fx.Node] = field(default_factory=set)  # attention whose keys/values have one head per member


Component = tuple[list[fx.Node], set[fx.Node]]  # a region's operations in graph order, and the Linear layers it reads


class _Rejected(Exception):
    """An operation that mixes what a fold keeps apart, or that has no rule."""


def fold_regions(graph: _Graph, axis: dict[fx.Node, int]) -> list[Region]:
    """The attention regions of the capture that fold, their operations marked ``folded`` (with the positions of
    their ``broadcast`` inputs)."""
    capture = graph.capture
    fallbacks = [key for key, op in graph.ops.items() if op.kind == "fallback" and not capture.calls_masks(key)]
    entries = [key for key, op in graph.ops.items() if _is_linear(op) or op.kind in ELEMENTWISE_ENTRIES]
    found = []
    for component in _components(graph, set(fallbacks), entries):
        region = _fold(graph, axis, component)
        if region is not None:
            found.append(region)
            for node in region.ops:
                op = graph.ops[node]
                side = [i for i, t in enumerate(op.tensors) if t not in region.folds and t not in region.entries]
                op.folded, op.broadcast = True, tuple(side)
                op.batch_dependent = capture.mixes_samples(node)  # shape arguments are replaced: no batch size read
    return found


def unfold(graph: _Graph, region: Region) -> None:
    """Run a region as plain fallbacks again."""
    for node in region.ops:
        graph.ops[node] = graph.fallback(node)


def _components(graph: _Graph, fallbacks: set[fx.Node], entries: list[fx.Node]) -> list[Component]:
    """The fallbacks reached from Linear layers through fallbacks only, in connected groups, each with the Linear
    layers that it reads (in graph order)."""
    order = {node: i for i, node in enumerate(graph.capture.gm.graph.nodes)}
    parent: dict[fx.Node, fx.Node] = {}

    def root(node: fx.Node) -> fx.Node:
        while parent.get(node, node) is not node:
            node = parent[node]
        return node

    reached: set[fx.Node] = set()
    for entry in entries:
        stack = [user for user in entry.users if user in fallbacks]
        for user in stack:
            parent.setdefault(user, user)
            parent[root(user)] = root(entry) if entry in parent else parent.setdefault(entry, entry)
        while stack:
            node = stack.pop()
            if node in reached:
                continue
            reached.add(node)
            for user in node.users:
                if user in fallbacks:
                    parent.setdefault(user, user)
                    parent[root(user)] = root(node)
                    stack.append(user)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in sorted(reached, key=order.__getitem__):
        groups.setdefault(root(node), []).append(node)
    result = []
    for members in groups.values():
        inside = set(members)
        read = {t for node in members for t in graph.ops[node].tensors if t in entries}
        result.append((members, {entry for entry in entries if entry in read and entry not in inside}))
    return result


def _fold(graph: _Graph, axis: dict[fx.Node, int], component: Component) -> Region | None:
    """The component as a folded region, trying each place the entries' member index may sit; None if none folds."""
    nodes, entries = component
    if not entries:
        return None
    candidates = sorted({1, *(outer for entry in entries for outer in _split_outers(graph, entry, set(nodes)))})
    for outer in candidates:
        region = Region(list(nodes), {entry: outer if outer in _split_outers(graph, entry, set(nodes)) else 1
                                      for entry in entries})  # fmt: skip
        try:
            _propagate(graph, axis, region)
        except _Rejected:
            continue
        return region
    return None


def _is_linear(op: _Op) -> bool:
    return op.kind == "mixing" and op.how == "linear"


def _split_outers(graph: _Graph, entry: fx.Node, inside: set[fx.Node]) -> list[int]:
    """Where an entry's member index may sit: 1, and, for a Linear layer only the region reads, inside each leading
    factor of the reshape that splits its channels (3 of (3, heads, head_dim))."""
    if not _is_linear(graph.ops[entry]):
        return [1]
    if any(user not in inside for user in entry.users if user in graph.ops) or len(entry.users) != 1:
        return [1]
    (user,) = entry.users
    parts = _equal_parts(graph, user)
    if parts is not None and parts[1] == graph.probed(entry).rank - 1:
        return [1, parts[0]]
    if _called(user) not in RESHAPES and user.target not in RESHAPE_FUNCTIONS:
        return [1]
    source, out = graph.probed(entry).shape, graph.probed(user).shape
    prefix, outers, product = math.prod(source[:-1]), [1], 1
    for a in range(len(out)):
        if math.prod(out[:a]) >= prefix and math.prod(out[:a]) % prefix == 0:
            product = math.prod(out[:a]) // prefix
            outers.append(product)
    return [o for o in dict.fromkeys(outers) if source[-1] % o == 0 and o < source[-1]]


def _equal_parts(graph: _Graph, node: fx.Node) -> tuple[int, int] | None:
    """A ``split`` into equal parts (as the probe saw them): how many, and along which axis; None otherwise."""
    if _called(node) != "split" or node.op == "call_module":
        return None
    seen, source = graph.capture.seen[node], graph.capture.seen[node.all_input_nodes[0]]
    dim = graph.capture.argument(node, "dim", 2, 0)
    if not isinstance(dim, int) or not seen.parts or any(not part.tensor for part in seen.parts):
        return None
    dim %= source.rank
    sizes = {part.shapes[0][dim] for part in seen.parts}
    if len(sizes) != 1 or sizes.pop() * len(seen.parts) != source.shapes[0][dim]:
        return None
    return len(seen.parts), dim


def _propagate(graph: _Graph, axis: dict[fx.Node, int], region: Region) -> None:
    """Every value's fold, operation by operation in graph order; raises ``_Rejected`` where one cannot be kept."""
    folds = region.folds
    inside = set(region.ops)
    for entry, outer in region.entries.items():
        if axis.get(entry) != graph.probed(entry).rank - 1:
            raise _Rejected(entry)
        folds[entry] = Fold(axis[entry], outer)
    for node in region.ops:
        op = graph.ops[node]
        if graph.capture.batch_args(node) and not (_is_reshape(node) or is_expand(node)):
            raise _Rejected(node)
        folds[node] = _rule(graph, region, node, op)
    for node in region.ops:  # exits: read outside the region, in member blocks on their channel axis (the sizes
        # read from a region value, ``x.shape[-1] // 2`` in ``rotate_half``, are answered as the dense model's)
        readers = [user for user in node.users if user not in inside and not graph.capture.is_query(user)]
        fold = folds[node]
        if readers and (not isinstance(fold, Fold) or fold.outer != 1 or axis.get(node) != fold.axis):
            raise _Rejected(node)
    del folds  # the entries stay in region.folds: emitting reads them


def _is_reshape(node: fx.Node) -> bool:
    return _called(node) in RESHAPES or node.target in RESHAPE_FUNCTIONS


def is_expand(node: fx.Node) -> bool:
    """``x.expand(...)``: a folded one is emitted with its folded sizes, as a reshape is."""
    return _called(node) == "expand"


def _rule(graph: _Graph, region: Region, node: fx.Node, op: _Op) -> Fold | tuple[Fold, ...]:
    """The fold of ``node``'s value from its inputs' folds."""
    folds = region.folds
    probed = graph.probed(node)
    ins = [t for t in op.tensors if t in folds]
    if not ins:
        raise _Rejected(node)
    first = folds[ins[0]]
    name = _called(node)
    if node.target is operator.getitem and isinstance(first, tuple):
        index = node.args[1]
        if not isinstance(index, int):
            raise _Rejected(node)
        return first[index]
    if not isinstance(first, Fold):
        raise _Rejected(node)
    source = graph.probed(ins[0])
    if _is_reshape(node):
        return _reshape(graph, region, node, first, source.shape, probed.shape, source.rows_axis, probed.rows_axis)
    parts = _equal_parts(graph, node) if len(op.tensors) == 1 else None
    if parts is not None:
        count, dim = parts
        if dim == source.rows_axis or (dim == first.axis and first.outer != count):
            raise _Rejected(node)
        if dim == first.axis:  # q, k and v of a Linear that writes (3, m, C): each part in member blocks
            region.chunks[node] = parts
            return tuple(Fold(dim) for _ in range(count))
        return tuple(first for _ in range(count))
    if name in ("unbind",):
        dim = graph.capture.argument(node, "dim", 1, 0)
        if not isinstance(dim, int) or dim % source.rank == first.axis:
            raise _Rejected(node)
        dim %= source.rank
        part = Fold(first.axis - (dim < first.axis), first.outer)
        return tuple(part for _ in range(source.shape[dim]))
    if is_expand(node) and len(op.tensors) == 1:
        return _expand(region, node, first, source, probed)
    if (node.target is operator.getitem or name == "unsqueeze") and len(op.tensors) == 1:
        try:
            return _indexed(graph, node, first, source)
        except _Rejected:
            if node.target is not operator.getitem:
                raise
            return _member_index(graph, region, node, first, source)
    if node.target in (torch.cat, torch.concat):
        return _concat(graph, region, node)
    if name == "repeat_interleave" and len(op.tensors) == 1:
        return _repeat_interleave(graph, node, first, source)
    if name in MOVES or node.target in MOVE_FUNCTIONS:
        landing = graph.axis_map(op, first.axis) if len(op.tensors) == 1 else None
        if landing is None:
            raise _Rejected(node)
        return Fold(landing, first.outer)
    if name in SOFTMAX:
        dim = graph.capture.argument(node, "dim", 1)
        if not isinstance(dim, int) or dim % source.rank == first.axis or len(op.tensors) != 1:
            raise _Rejected(node)
        return first
    if _passes_through(graph.capture, node):
        return first
    if node.target in MATMULS or name in MATMULS or node.target is F.scaled_dot_product_attention:
        return _attention(graph, region, node, op)
    classified = graph.capture.classified.get(node)
    if classified is not None and classified.kind in ("channelwise", "combine") and classified.rule == "same":
        return _elementwise(graph, region, node, op)
    if node.target in WHERE and len(node.args) == 3 and not node.kwargs:
        return _elementwise(graph, region, node, op)  # GPT-Neo's where(causal, scores, min): elementwise as well
    raise _Rejected(node)


def _indexed(graph: _Graph, node: fx.Node, fold: Fold, source: Probed) -> Fold:
    """A basic index (slices, ints, None, one Ellipsis) or ``unsqueeze`` copies each element of the fold's axis, and
    of the batch's, to its own place when it takes both whole (``rotate_half``'s ``q[..., : d // 2]`` slices the head
    dimension, ``k[:, :, None]`` adds an axis): the fold moves to where that axis lands."""
    if node.target is operator.getitem:
        index = node.args[1]
    else:  # unsqueeze(dim): a None before the axis at dim of the result
        dim = graph.capture.argument(node, "dim", 1)
        if not isinstance(dim, int):
            raise _Rejected(node)
        index = (*[slice(None)] * (dim % (source.rank + 1)), None)
    landing = _index_axes(index, source.rank)
    if landing is None or source.rows_axis < 0 or not _takes_whole(index, source.rank, [fold.axis, source.rows_axis]):
        raise _Rejected(node)
    return Fold(landing[fold.axis], fold.outer)


def _member_index(graph: _Graph, region: Region, node: fx.Node, fold: Fold, source: Probed) -> Fold:
    """A basic index that takes the batch whole and, on the fold's axis (members outermost), a slice or a list of
    positions of one head (Falcon's multi-query split of its fused qkv heads, ``qkv[..., :-2, :]``, ``qkv[..., [-2],
    :]``): in the dense model it takes those heads of the one member's block; folded, it takes them of every member's
    block (``Region.indexes``: emitted on the axis split as (members, heads), ``index_members``)."""
    index: Any = node.args[1]
    entries: list[Any] = list(index) if isinstance(index, tuple) else [index]
    lists = [i for i, e in enumerate(entries) if isinstance(e, list)]
    if fold.outer != 1 or source.rows_axis < 0 or len(lists) > 1:
        raise _Rejected(node)
    if lists and not all(isinstance(p, int) and not isinstance(p, bool) for p in entries[lists[0]]):
        raise _Rejected(node)
    plain = tuple(slice(None) if isinstance(e, list) else e for e in entries)  # the axes a list keeps, in place
    landing = _index_axes(plain, source.rank)
    if landing is None or not _takes_whole(plain, source.rank, [source.rows_axis]):
        raise _Rejected(node)
    explicit: list[Any] = []  # the index with its Ellipsis written out, and the axis it reads at each entry
    axes: list[int] = []
    consumed = sum(e is not None and e is not Ellipsis for e in entries)
    for e in entries:
        if e is Ellipsis:
            explicit += [slice(None)] * (source.rank - consumed)
            axes += [len([a for a in axes if a >= 0]) + i for i in range(source.rank - consumed)]
        else:
            explicit.append(e)
            axes.append(-1 if e is None else len([a for a in axes if a >= 0]))
    while len([a for a in axes if a >= 0]) < source.rank:  # the axes after the index's, whole
        explicit.append(slice(None))
        axes.append(len([a for a in axes if a >= 0]))
    at = axes.index(fold.axis)
    if isinstance(explicit[at], int) or landing[fold.axis] < 0:
        raise _Rejected(node)
    region.indexes[node] = (fold.axis, (*explicit[:at], slice(None), *explicit[at:]), landing[fold.axis])
    return Fold(landing[fold.axis], 1)


def _index_axes(index: Any, rank: int) -> list[int] | None:
    """Where a basic index puts each axis of a tensor of ``rank`` it keeps (an int removes its axis: -1); None for
    any other index."""
    entries = index if isinstance(index, tuple) else (index,)
    if any(not isinstance(e, (slice, int, type(None), type(Ellipsis))) or isinstance(e, bool) for e in entries):
        return None
    consumed = sum(e is not None and e is not Ellipsis for e in entries)
    if sum(e is Ellipsis for e in entries) > 1 or consumed > rank:
        return None
    axes: list[int] = []
    out = 0
    for e in entries:
        if e is None:
            out += 1
        elif e is Ellipsis:
            for _ in range(rank - consumed):
                axes.append(out)
                out += 1
        elif isinstance(e, int):
            axes.append(-1)
        else:
            axes.append(out)
            out += 1
    return axes + list(range(out, out + rank - len(axes)))


def _expand(region: Region, node: fx.Node, fold: Fold, source: Probed, out: Probed) -> Fold:
    """An expand that repeats neither the fold's axis nor the batch (``k[:, :, None].expand(B, kv, groups, L, d)``
    of grouped-query attention's ``repeat_kv``) repeats each member's values within its own block: the fold moves by
    the axes it adds in front; it is emitted with the folded sizes, the batch's left as it is (-1)."""
    added = out.rank - source.rank
    landing = fold.axis + added
    if added < 0 or source.rows_axis < 0 or out.rows_axis != source.rows_axis + added:
        raise _Rejected(node)
    if out.shape[landing] != source.shape[fold.axis]:  # the fold's axis is not repeated
        raise _Rejected(node)
    shape = list(out.shape)
    shape[out.rows_axis] = -1
    region.shapes[node] = tuple(shape)
    return Fold(landing, fold.outer)


def _repeat_interleave(graph: _Graph, node: fx.Node, fold: Fold, source: Probed) -> Fold:
    """``repeat_interleave(r, dim)`` with a number ``r``: along another axis than the fold's and the batch's it keeps
    the fold; along the fold's axis (grouped-query keys repeated for their query heads) it sends position o*m*w + i*w
    + j of (outer, members, w) to o*m*w*r + i*w*r + j*r + t, (outer, members, w*r): each member's block stays its own,
    the same fold."""
    capture = graph.capture
    repeats, dim = capture.argument(node, "repeats", 1), capture.argument(node, "dim", 2)
    if not isinstance(repeats, int) or not isinstance(dim, int) or capture.argument(node, "output_size", 3) is not None:
        raise _Rejected(node)
    if source.rows_axis < 0 or dim % source.rank == source.rows_axis:
        raise _Rejected(node)
    return fold


def _concat(graph: _Graph, region: Region, node: fx.Node) -> Fold:
    """``torch.cat`` of region values with one fold, along another axis than the fold's and the batch's
    (``rotate_half``'s ``cat((-x2, x1), dim=-1)``): each member's block of the fold's axis gathers its own blocks."""
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = graph.capture.argument(node, "dim", 1, 0)
    if not isinstance(tensors, (tuple, list)) or not isinstance(dim, int):
        raise _Rejected(node)
    folds = {region.folds.get(t) if isinstance(t, fx.Node) else None for t in tensors}
    ranks = {graph.probed(t).rank for t in tensors if isinstance(t, fx.Node)}
    fold = folds.pop() if len(folds) == 1 else None
    probed = graph.probed(node)
    if not isinstance(fold, Fold) or ranks != {probed.rank} or probed.rows_axis < 0:
        raise _Rejected(node)
    if dim % probed.rank in (fold.axis, probed.rows_axis):
        raise _Rejected(node)
    return fold


def _right(fold: Fold, rank: int, out_rank: int) -> Fold:
    """A fold seen from a result of rank ``out_rank`` that broadcasts a value of rank ``rank`` (aligned right)."""
    return Fold(fold.axis + out_rank - rank, fold.outer)


def _sides(graph: _Graph, region: Region, node: fx.Node, fold: Fold) -> None:
    """The values and constant tensors ``node`` reads from outside the region, aligned right with its result: each
    broadcasts over the fold (size 1, or no axis, where the fold sits), or holds one member's size there (T5's,
    BEiT's relative position bias on the heads, (1 or B, heads, L, L)) where the members' blocks are outermost on the
    fold's axis (``outer`` 1). In the dense model every member's head h reads the tensor's head h; the tensor is the
    same for every member (a constant, or a value the planner must find shared), so repeated once per member along
    that axis, members outermost, it gives every member's heads their own values (``region.repeats``). Raises
    ``_Rejected`` for any other size there."""
    capture = graph.capture
    out = graph.probed(node)
    for value in dict.fromkeys(node.all_input_nodes):
        if value in region.folds:
            continue
        if value in capture.dynamic:
            if not capture.seen[value].tensor:
                continue
            shapes = graph.probed(value).shapes
        else:
            constant = capture.constants.get(value)
            if not isinstance(constant, torch.Tensor):
                continue
            shapes = (tuple(constant.shape),)
        position = fold.axis - (out.rank - len(shapes[0]))
        sizes = {shape[position] for shape in shapes} if 0 <= position < len(shapes[0]) else {1}
        if sizes == {1}:
            continue
        if fold.outer != 1 or sizes != {out.shape[fold.axis]}:
            raise _Rejected(node)
        region.repeats.setdefault(node, {})[value] = position


def _elementwise(graph: _Graph, region: Region, node: fx.Node, op: _Op) -> Fold:
    """Scaling by a number, an additive mask, a sum of two region values, ``torch.where``: the same fold on every
    folded operand, and the other operands (constants included) size 1 where it sits or per head (``_sides``)."""
    rank = graph.probed(node).rank
    folded = [_right(region.folds[t], graph.probed(t).rank, rank) for t in op.tensors if t in region.folds]  # type: ignore[arg-type]
    if any(not isinstance(region.folds[t], Fold) for t in op.tensors if t in region.folds) or len(set(folded)) != 1:
        raise _Rejected(node)
    fold = folded[0]
    _sides(graph, region, node, fold)
    return fold


def _attention(graph: _Graph, region: Region, node: fx.Node, op: _Op) -> Fold:
    """A matmul of two region values or ``scaled_dot_product_attention``: the fold on the same batch-like axis of
    every operand (not the last two, which the products mix); an attention mask outside the region broadcasts.
    With ``enable_gqa`` (query head h reads key/value head h // (Hq / Hkv)), the fold is the heads axis with the
    members' blocks outermost: query head i*Hq + h of member i reads (i*Hq + h) // (Hq / Hkv) = i*Hkv + h // (Hq /
    Hkv), member i's own key/value head for h. Multi-query attention (Falcon: one key/value head that the dense
    model broadcasts over the query heads) is the same with Hkv = 1: folded, it runs with ``enable_gqa``
    (``Region.shared_heads``); a matmul's operands must have the same heads."""
    rank = graph.probed(node).rank
    sdpa = node.target is F.scaled_dot_product_attention
    operands = [t for t in op.tensors if t in region.folds]
    grouped = False
    if sdpa:
        capture = graph.capture
        gqa = capture.argument(node, "enable_gqa", 7, False)
        if capture.argument(node, "dropout_p", 4, 0.0) != 0.0 or not isinstance(gqa, bool):
            raise _Rejected(node)
        grouped = gqa
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        if isinstance(mask, fx.Node) and mask in region.folds:
            operands = [t for t in operands]  # a mask from the region is folded like q, k and v
        elif len(operands) != 3:
            raise _Rejected(node)
    elif len(operands) != 2 or len(op.tensors) != 2:
        raise _Rejected(node)
    folds = region.folds
    if any(not isinstance(folds[t], Fold) or graph.probed(t).rank != rank for t in operands):
        raise _Rejected(node)
    unique = {folds[t] for t in operands}
    if len(unique) != 1:
        raise _Rejected(node)
    fold = unique.pop()
    assert isinstance(fold, Fold)
    if fold.axis >= rank - 2:
        raise _Rejected(node)
    _sides(graph, region, node, fold)
    if grouped and (fold.axis != rank - 3 or fold.outer != 1):
        raise _Rejected(node)
    heads = [graph.probed(t).shape[fold.axis] for t in _attention_operands(node, operands)]
    if not grouped and len(set(heads)) > 1:  # keys/values broadcast over the query heads: one head, shared by all
        if not sdpa or heads[1:] != [1, 1] or fold.axis != rank - 3 or fold.outer != 1:
            raise _Rejected(node)
        region.shared_heads.add(node)  # member i's query heads read its own key/value head: enable_gqa
    return fold


def _attention_operands(node: fx.Node, operands: list[fx.Node]) -> list[fx.Node]:
    """The query, key and value of ``scaled_dot_product_attention`` (or a matmul's two operands), as it reads them."""
    if node.target is not F.scaled_dot_product_attention:
        return operands
    names = ("query", "key", "value")
    return [cast(fx.Node, node.kwargs[n] if n in node.kwargs else node.args[i]) for i, n in enumerate(names)]


def _reshape(
    graph: _Graph, region: Region, node: fx.Node, fold: Fold, source: tuple[int, ...], out: tuple[int, ...],
    source_batch: int, out_batch: int,
) -> Fold:  # fmt: skip
    """A reshape keeps the members apart when the elements outside the member index are the same before and after
    it: the result's fold is the axis (and the elements of it outside the member index) where that count ends; a
    member's one element (multi-query attention's one key/value head) stays on an axis of 1 where that count ends."""
    if source_batch < 0 or out_batch < 0 or source_batch == fold.axis:
        raise _Rejected(node)
    before = math.prod(source[: fold.axis]) * fold.outer
    landing = None
    if source[fold.axis] == 1 and fold.outer == 1:  # one head per member (multi-query keys): kept on an axis of 1
        landing = next((Fold(a, 1) for a in range(len(out)) if math.prod(out[:a]) == before and out[a] == 1), None)
    for a in range(len(out) if landing is None else 0):
        prefix = math.prod(out[:a])
        if prefix == before and out[a] > 1:
            landing = Fold(a, 1)
            break
        if prefix < before < prefix * out[a] and before % prefix == 0 and out[a] % (before // prefix) == 0:
            landing = Fold(a, before // prefix)
            break
    if landing is None or landing.axis == out_batch:
        raise _Rejected(node)
    shape = list(out)
    shape[out_batch] = -1
    region.shapes[node] = tuple(shape)
    return landing


# ---- attention written out operation by operation, run as one call

MULTIPLY = {"mul", "__mul__", "__rmul__", "multiply"}
DIVIDE = {"truediv", "div", "__truediv__", "true_divide", "divide"}
ADD = {"add", "__add__", "__radd__"}


@dataclass(frozen=True)
class WrittenAttention:
    """``softmax((q * a) @ k^T * b + mask, -1) @ v`` written out operation by operation (Hugging Face's eager
    attention, timm's non-fused one): the operations from the scores ``q @ k^T`` to the result, in graph order, the
    transpose of ``k`` and the scaled query (when the query is scaled) that the scores read, the operations that
    scale with the position of their factor (the factors give ``F.scaled_dot_product_attention`` its ``scale``), and
    where the mask is in the sum."""

    chain: tuple[fx.Node, ...]
    key_transposed: fx.Node
    query_scaled: fx.Node | None
    scales: tuple[tuple[fx.Node, int], ...]
    mask_position: int | None


def written_attentions(capture: _Capture) -> list[WrittenAttention]:
    """Every written-out attention of the capture whose intermediate values nothing else reads: q, k and v of one
    floating dtype and rank, with the same leading axes; scales by numbers (constants, or sizes such as
    ``q.shape[-1] ** -0.5``), an additive mask after them (of the scores' dtype, broadcast to their shape); a softmax
    over the last axis (in the scores' dtype); Dropout in eval and casts to the same dtype after it."""
    return [found for node in capture.gm.graph.nodes if (found := _written(capture, node)) is not None]


def _written(capture: _Capture, result: fx.Node) -> WrittenAttention | None:
    if not _is_matmul(result) or result not in capture.dynamic:
        return None
    chain, node = [result], result.args[0]
    while isinstance(node, fx.Node) and _passes_through(capture, node):
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node) or _called(node) != "softmax" or not node.args or node not in capture.dynamic:
        return None
    scores = capture.seen[node]
    dtype_position = 3 if node.target is F.softmax else 2  # F.softmax(input, dim, _stacklevel, dtype)
    dim, dtype = capture.argument(node, "dim", 1), capture.argument(node, "dtype", dtype_position, None)
    if not isinstance(dim, int) or dim % max(scores.rank, 1) != scores.rank - 1:
        return None
    if dtype is not None and dtype != scores.dtype:
        return None
    chain.append(node)
    node, mask_position = node.args[0], None
    if isinstance(node, fx.Node) and _called(node) in ADD and not node.kwargs and len(node.args) == 2:
        mask_position = next(
            (1 - i for i, a in enumerate(node.args) if _factor_position(capture, a) is not None or _is_matmul(a)), None
        )
        if mask_position is None or not _broadcast_mask(capture, node.args[mask_position], scores):
            return None
        chain.append(node)
        node = node.args[1 - mask_position]
    scales: list[tuple[fx.Node, int]] = []
    position = _factor_position(capture, node)
    if position is not None:
        scaled = cast(fx.Node, node)
        scales.append((scaled, position))
        chain.append(scaled)
        node = scaled.args[1 - position]
    if not _is_matmul(node):
        return None
    scores_node = cast(fx.Node, node)
    chain.append(scores_node)
    query, transposed = scores_node.args
    query_scaled, position = None, _factor_position(capture, query)
    if position is not None:
        query_scaled = cast(fx.Node, query)
        scales.append((query_scaled, position))
        query = query_scaled.args[1 - position]
    if not isinstance(transposed, fx.Node) or not _swaps_last_two(capture, transposed):
        return None
    key, value = transposed.args[0], result.args[1]
    if not all(isinstance(t, fx.Node) and t in capture.dynamic for t in (query, key, value)):
        return None
    q, k, v = (capture.seen[cast(fx.Node, t)] for t in (query, key, value))
    if not (q.tensor and k.tensor and v.tensor) or not q.rank == k.rank == v.rank >= 3 or q.dtype is None:
        return None
    if not q.dtype.is_floating_point or not q.dtype == k.dtype == v.dtype == scores.dtype:
        return None
    (qs, _), (ks, _), (vs, _) = q.shapes, k.shapes, v.shapes
    if qs[:-2] != ks[:-2] or ks[:-2] != vs[:-2] or qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        return None
    if any(len(n.users) != 1 for n in (*chain[1:], transposed, *([query_scaled] if query_scaled else []))):
        return None
    return WrittenAttention(tuple(reversed(chain)), transposed, query_scaled, tuple(scales), mask_position)


def _is_matmul(node: Any) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op != "call_module"
        and (node.target in MATMULS or _called(node) in MATMULS)
        and len(node.args) == 2
        and not node.kwargs
    )


def _passes_through(capture: _Capture, node: fx.Node) -> bool:
    """The value as it is: Dropout in eval (or with p 0), ``nn.Identity``, a cast to the dtype the value has."""
    if node.op == "call_module":
        return isinstance(capture.gm.get_submodule(str(node.target)), (*DROPOUT_TYPES, nn.Identity))
    if node.target in DROPOUT_FUNCTIONS:
        return capture.identity_dropout(node)
    cast_call = node.op == "call_method" and node.target in ("to", "type")
    if (cast_call or node.target is torch.ops.aten.to.dtype) and node.args and isinstance(node.args[0], fx.Node):
        before, after = capture.seen.get(node.args[0]), capture.seen.get(node)
        casts = [_value(capture, a) for a in (*node.args[1:], *node.kwargs.values()) if not isinstance(a, bool)]
        return (
            before is not None
            and after is not None
            and casts == [before.dtype]
            and before.dtype == after.dtype
            and before.shapes == after.shapes
        )
    return False


def _value(capture: _Capture, argument: Any) -> Any:
    """An argument's value: a constant, or a value read from the input that the probe saw the same at both batch
    sizes (``q.dtype``)."""
    if not isinstance(argument, fx.Node) or argument not in capture.dynamic:
        return capture.constant(argument)
    seen = capture.seen.get(argument)
    return seen.values[0] if seen is not None and not seen.tensor and seen.values[0] == seen.values[1] else None


def _factor_position(capture: _Capture, node: Any) -> int | None:
    """Where a product or quotient of one tensor by a number (a constant, or one read from the model; the tensor
    first for a quotient) has its factor; None for any other value."""
    if not isinstance(node, fx.Node) or node.kwargs or len(node.args) != 2 or node not in capture.dynamic:
        return None
    name = _called(node)
    if name not in MULTIPLY and name not in DIVIDE:
        return None
    tensors = [isinstance(a, fx.Node) and a in capture.seen and capture.seen[a].tensor for a in node.args]
    if tensors.count(True) != 1 or (name in DIVIDE and not tensors[0]):
        return None
    position = tensors.index(False)
    factor = _value(capture, node.args[position])
    return position if isinstance(factor, int | float) and not isinstance(factor, bool) and factor != 0 else None


def _broadcast_mask(capture: _Capture, mask: Any, scores: _Seen) -> bool:
    """An additive mask of the scores' dtype that broadcasts to their shape (at both probed batch sizes)."""
    if not isinstance(mask, fx.Node):
        return False
    seen = capture.seen.get(mask)
    if seen is not None and seen.tensor:
        shapes, dtype = seen.shapes, seen.dtype
    else:
        constant = capture.constants.get(mask)
        if not isinstance(constant, torch.Tensor):
            return False
        shapes, dtype = (tuple(constant.shape),) * 2, constant.dtype
    return dtype == scores.dtype and all(
        len(shape) <= len(target) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(target), strict=False))
        for shape, target in zip(shapes, scores.shapes, strict=True)
    )


def _swaps_last_two(capture: _Capture, node: fx.Node) -> bool:
    """``k.transpose(-1, -2)`` (any spelling of the last two axes)."""
    if _called(node) not in ("transpose", "swapaxes", "swapdims") or len(node.args) != 3 or node.kwargs:
        return False
    source = node.args[0]
    if not isinstance(source, fx.Node) or source not in capture.seen:
        return False
    rank = capture.seen[source].rank
    dims = node.args[1:]
    return all(isinstance(d, int) for d in dims) and {d % rank for d in dims} == {rank - 1, rank - 2}  # type: ignore[operator]


def fuse_written_attention(graph: fx.Graph, values: dict[str, fx.Node], attention: WrittenAttention) -> list[fx.Node]:
    """Replace an emitted written-out attention by one ``F.scaled_dot_product_attention`` call, where the emitted
    operations mirror the captured ones (each reads what its captured twin reads, and nothing else reads it); the
    emitted operations it removed (none where it left them as they were)."""
    feeds = [attention.key_transposed, *([attention.query_scaled] if attention.query_scaled else [])]
    captured = [*feeds, *attention.chain]
    emitted = {node: values.get(node.name) for node in captured}
    for node in captured:
        twin = emitted[node]
        if twin is None or twin.op != node.op or (node.op != "call_module" and twin.target != node.target):
            return []
        if node is not attention.chain[-1] and len(twin.users) != 1:
            return []
        for a, b in zip(node.args, twin.args, strict=True):  # the captured operations it reads, as emitted
            if isinstance(a, fx.Node) and a in emitted and b is not emitted[a]:
                return []
    scores, result = cast(fx.Node, emitted[attention.chain[0]]), cast(fx.Node, emitted[attention.chain[-1]])
    transposed = cast(fx.Node, emitted[attention.key_transposed])
    query = scores.args[0]
    for node, position in attention.scales:
        if node is attention.query_scaled:  # the query it scales, as emitted (its factor may be a node too)
            query = cast(fx.Node, emitted[node]).args[1 - position]
    mask = None
    if attention.mask_position is not None:
        added = next(emitted[node] for node in attention.chain if _called(node) in ADD)
        mask = cast(fx.Node, added).args[attention.mask_position]
    with graph.inserting_before(result):
        scale: Any = 1.0
        for node, position in attention.scales:  # the factors as emitted: numbers, or the sizes they are computed from
            factor = cast(fx.Node, emitted[node]).args[position]
            divide = _called(node) in DIVIDE
            if isinstance(factor, int | float) and isinstance(scale, float):
                scale = scale / factor if divide else scale * factor
            elif not divide and isinstance(scale, float) and scale == 1.0:
                scale = factor
            else:
                scale = graph.call_function(operator.truediv if divide else operator.mul, (scale, factor))
        fused = graph.call_function(
            F.scaled_dot_product_attention,
            (query, transposed.args[0], result.args[1]),
            {"attn_mask": mask, "scale": scale},
        )
    result.replace_all_uses_with(fused)
    removed = [cast(fx.Node, emitted[node]) for node in reversed(captured)]
    read = {a for node in removed for a in node.all_input_nodes}
    for node, twin in zip(reversed(captured), removed, strict=True):
        graph.erase_node(twin)
        del values[node.name]
    for node in read:  # queries only the removed operations read (``q.dtype`` for a cast)
        if not node.users and (node.target is getattr or node.target in ("size", "dim")):
            graph.erase_node(node)
            removed.append(node)
    values[attention.chain[-1].name] = fused
    return removed
