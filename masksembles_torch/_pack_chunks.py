"""On CPU, a packed program proven to compute each sample from that sample alone runs on chunks of the batch (large
fresh buffers page-fault on every call): the proof over the traced graph and the module that runs the chunks.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from masksembles_core.packing import OUTPUT, Program, samples_per_chunk

from . import _packed_ops as ops
from ._pack_capture import _Capture, _Seen, _target_name
from ._pack_emit import MATMULS
from ._pack_graph import _axis_map, _leaves

# a CPU program proven per-sample whose largest tensor exceeds this size runs on chunks of the batch where it is at
# most this size: glibc hands large freed blocks back to the system (over 32 MiB at once, or when the top of its heap
# grows past twice the largest freed one), and every call then page-faults on them
CHUNK_BYTES = 16 * 2**20


def _samples_per_chunk(capture: _Capture, program: Program, example: Tensor) -> int:
    """How many samples a CPU program runs at a time, so that no tensor it makes is over ``CHUNK_BYTES`` (large fresh
    buffers page-fault on every call); 0 for one call on the whole batch, as when its largest tensor is at most that at
    the example's batch size. Tensors are sized as the program holds them (``_packed_scales``), not as the single model
    does: a member tensor holds its kept channels for every member, a folded one every channel of every member (BERT's
    attention scores, n times the single model's). Only a program proven to compute each sample's outputs from that
    sample alone is split: what falls back is an operation known to keep samples apart (``_keeps_samples``), every
    tensor the input reaches has one axis of exactly the batch size or none, no tensor without one is made from one with
    one (a reduction over the batch), none with one from none unless it broadcasts a tensor along it (a tensor built
    from the batch size), and every output has one."""
    by_name = {node.name: node for node in capture.gm.graph.nodes}
    scales = _packed_scales(program)
    fallbacks = [by_name[name] for name in (*program.fallbacks, *program.folded) if name != OUTPUT]
    if example.device.type != "cpu" or not all(_keeps_samples(capture, node) for node in fallbacks):
        return 0
    batch, largest = example.shape[0], 1

    def follows(seen: _Seen) -> bool | None:  # True: the batch is its one axis; False: no batch axis; None: neither
        if seen.parts:
            kinds = {follows(part) for part in seen.parts}
            return None if None in kinds or len(kinds) > 1 else kinds.pop()
        if not seen.tensor:
            return False
        axes = seen.batch_axes
        if not axes:
            return False
        if len(axes) != 1 or seen.shapes[0][axes[0]] != batch or seen.shapes[1][axes[0]] != batch + 1:
            return None
        return True

    for node in capture.dynamic:
        if node.op == "output":
            leaves = [leaf for leaf in _leaves(node.args[0]) if isinstance(leaf, fx.Node)]
            if not leaves or not all(follows(capture.seen[leaf]) for leaf in leaves):
                return 0
            continue
        seen = capture.seen[node]
        kind = follows(seen)
        if kind is None:
            return 0
        if kind and seen.tensor:  # not planned: as wide as the dense model's on the member-stacked batch
            scale = scales.get(node.name, len(program.members))
            largest = max(largest, round(seen.per_sample * (seen.dtype.itemsize if seen.dtype else 4) * scale))
        if node.op != "placeholder" and (seen.tensor or seen.parts):  # sizes and other values: each chunk its own
            inputs = [follows(capture.seen[n]) for n in node.all_input_nodes if n in capture.dynamic]
            if None in inputs or (kind != any(inputs) and not (kind and _broadcast(capture, node))):
                return 0
    return samples_per_chunk(batch, largest, CHUNK_BYTES)


def _packed_scales(program: Program) -> dict[str, float]:
    """Each planned node's tensor in the program ÷ the single model's: its copies (1 shared, else one per member)
    times the share of the channels each holds (its kept ones, padded; every one where it runs dense or folded)."""
    scales = {}
    for step in program.steps:
        copies = 1 if step.placement.shared else len(program.members)
        channels = step.node.channels
        scales[step.name] = copies * (step.placement.width / channels if channels > 0 else 1.0)
    return scales


def _batch_axis(capture: _Capture, node: fx.Node) -> int | None:
    seen = capture.seen[node]
    return seen.batch_axis if node in capture.dynamic and seen.tensor and seen.batch_axis >= 0 else None


def _called(node: fx.Node) -> str:
    """The name of the function or method a node calls ("" for a module, whose name says nothing of what it does)."""
    return "" if node.op == "call_module" else _target_name(node)


def _broadcast(capture: _Capture, node: fx.Node) -> bool:
    """``expand``/``broadcast_to`` whose batch axis is a broadcast of its input (a new axis or one of size 1): every
    sample gets the same values, whatever its place in the batch (a class token expanded to the batch)."""
    if _called(node) not in ("expand", "broadcast_to") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    axis, source = _batch_axis(capture, node), capture.seen[node.args[0]]
    if axis is None or not source.tensor:
        return False
    position = axis - (capture.seen[node].rank - source.rank)  # shapes align on the right
    return position < 0 or source.shapes[0][position] == 1


COMPARISONS = {operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, torch.eq, torch.ne}
COMPARISON_METHODS = {"eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"}


def _keeps_samples(capture: _Capture, node: fx.Node) -> bool:
    """An operation that falls back yet computes each sample from that sample alone, given that its tensors have
    one batch axis each (``_samples_per_chunk`` checks that): a tuple's element, ``unbind`` of another axis, a
    ``reshape``/``view`` with the batch first before and after (row-major order keeps each sample's block), a
    broadcast along the batch, a concatenation along another axis, a softmax over another axis, attention or a
    matmul of two activations of one rank whose batch axes are the same leading one (they mix the last two axes
    only), an elementwise operation or comparison whose tensors have their batch on the same axis, an index that only
    adds axes (``x[:, None, None, :]``), an embedding lookup on the batch's indices, and a move or reduction whose
    evaluation on batch indices gives them whole on its output's batch axis. Anything else is not proven and keeps
    the whole batch in one call."""
    name = _called(node)
    tensors = [n for n in node.all_input_nodes if n in capture.dynamic and capture.seen[n].tensor]
    axes = [_batch_axis(capture, n) for n in tensors]
    out = _batch_axis(capture, node)
    if node.op == "call_function" and node.target is operator.getitem:
        if len(tensors) == 1 and axes[0] is not None and out is not None and _new_axes_only(node.args[1]):
            return True  # x[:, None, None, :]: a view with axes of size 1 added
        return bool(node.args) and isinstance(node.args[0], fx.Node) and bool(capture.seen[node.args[0]].parts)
    if name == "unbind" and len(tensors) == 1 and axes[0] is not None:
        dim = capture.argument(node, "dim", 1, 0)
        return isinstance(dim, int) and dim % capture.seen[tensors[0]].rank != axes[0]
    if name in ("reshape", "view") and len(tensors) == 1:
        return axes == [0] and out == 0
    if name in ("expand", "broadcast_to"):
        return _broadcast(capture, node) or (
            len(tensors) == 1
            and axes[0] is not None
            and out is not None
            and capture.seen[node].rank - out == capture.seen[tensors[0]].rank - axes[0]  # the same axis, aligned right
        )
    if node.target in (torch.cat, torch.concat):
        dim = capture.argument(node, "dim", 1, 0)
        rank = capture.seen[node].rank
        return out is not None and isinstance(dim, int) and dim % rank != out and all(a == out for a in axes)
    if node.target is F.scaled_dot_product_attention or (node.target in MATMULS and len(tensors) == 2):
        rank = capture.seen[tensors[0]].rank if tensors else 0
        return bool(axes) and all(
            a is not None and a == axes[0] and a < rank - 2 and capture.seen[t].rank == rank
            for a, t in zip(axes, tensors, strict=True)
        )
    if name in ("softmax", "log_softmax") and len(tensors) == 1 and axes[0] is not None:
        dim = capture.argument(node, "dim", 1)
        return isinstance(dim, int) and dim % capture.seen[tensors[0]].rank != axes[0]
    embedding = node.op == "call_module" and isinstance(capture.gm.get_submodule(str(node.target)), nn.Embedding)
    if (embedding or node.target is F.embedding) and len(tensors) == 1:  # a lookup per index
        return axes[0] is not None and axes[0] == out
    if node.target in COMPARISONS or name in COMPARISON_METHODS:  # elementwise: the batch on the same axis
        return bool(axes) and out is not None and all(a == out for a in axes)
    classified = capture.classified.get(node)  # an operation that would compact, at full width as it reads fallbacks
    if classified is None or classified.kind not in ("channelwise", "combine", "mean_ratio") or out is None:
        return False
    if classified.rule == "map":  # a move or a reduction: the batch indices must come out whole on the batch axis
        return len(axes) == 1 and axes[0] is not None and _axis_map(capture, classified, axes[0]) == out
    return all(a == out for a in axes)


def _new_axes_only(index: object) -> bool:
    """An index of whole axes and new ones (``None``): ``x[:, None, None, :]``."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(part is None or part == slice(None) for part in parts)


def _in_chunks(packed: fx.GraphModule, example: Tensor, samples: int) -> tuple[nn.Module, fx.Graph]:
    """The root and graph of a program that runs ``packed`` on chunks of at most ``samples`` samples (the root holds
    it as ``per_chunk``)."""
    with torch.no_grad():
        layout = ops.leaf_batch_layout(packed(example[:1]), packed(example[:2]), 1)
    root = nn.Module()
    root.per_chunk = fx.GraphModule(packed, packed.graph, class_name="PerChunk")
    graph = fx.Graph()
    result = graph.call_function(ops.in_chunks, (graph.get_attr("per_chunk"), graph.placeholder("x"), samples, layout))
    graph.output(result)
    return root, graph


def _planned(capture: _Capture, chosen: Sequence[int]) -> list[int]:
    """The members to compute for ``chosen``: every member where a node runs per member on the member-stacked batch
    because it reads the batch (its size, as ``x.shape[0]`` or ``arange(B)``, or other samples, as a mean over the
    batch): in the dense model that batch holds every member's copy. Not for a node proven to compute each sample
    from that sample alone (``_keeps_samples``: a class token expanded to the batch size, a reshape with the batch
    first), whose rows do not depend on how many members the batch holds, nor for a Masksembles layer that falls back
    (the program's copy of it holds the computed members' masks, ``_Emitter._module``)."""
    per_member = any(
        op.kind == "fallback"
        and op.batch_dependent
        and not capture.calls_masks(op.node)
        and not _keeps_samples(capture, op.node)
        for op in capture.ops.values()
    )
    return list(range(capture.n)) if per_member else list(chosen)
