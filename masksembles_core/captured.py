"""From a captured model to the planner's graph, shared by every framework's ``pack``.

An adapter captures its model once (torch.fx or ``torch.export`` nodes, jaxpr equations, Keras layers and operations)
and classifies every run-time value into a ``CapturedOp``: its core kind (``masksembles_core.packing.KINDS``), the
run-time values it reads, and how its channel axis relates to theirs. It then answers, by evaluating each operation
with its own arguments, the two questions the core cannot: where an axis of an operation's input lands in its output
(``CapturedGraph.axis_map``) and which output channels stay zero on zero inputs (``CapturedGraph.zero_map``).

From there this module does the rest the same way for every framework:

- ``solve_axes``: the channel axis of every compacted value; an operation whose axis cannot agree with its
  neighbours', or whose layout the program cannot keep (its batch not on exactly one axis, or on the channels'; rows
  that fold the tokens into the batch only where each sample's rows stay together, in order), becomes a fallback
  and the axes are solved again; an operand of an elementwise combine that broadcasts along the channels (size 1 on
  the solved channel axis, or no such axis after right-aligned broadcasting, where the result has the channels) is
  marked ``broadcast`` instead: it no longer takes the combine's axis, and the axes are solved again (the planner
  reads it as it is, or runs the combine as a fallback where the operand is not shared);
- ``graph_nodes``: the ``GraphNode`` list ``plan_program`` reads, with zero maps, flatten layouts, concatenation parts,
  and the fallbacks that must run per member (``per_member_fallbacks``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, cast

import numpy as np

from .packing import OUTPUT, AxisConflict, AxisRule, BoolArray, GraphNode, channel_axes, per_member_fallbacks

ELEMENTWISE_KINDS = ("channelwise", "combine", "concat", "flatten", "mean_ratio")  # compacted while an input is
K = TypeVar("K", bound=Hashable)  # how an adapter names a run-time value (an fx node, a jaxpr variable)


@dataclass(frozen=True)
class Probed:
    """A run-time value as the capture saw it: its shape at each probe batch size (``batch``, ``batch + 1``, ...);
    ``tensor`` is False for anything else (a tuple, a size)."""

    shapes: tuple[tuple[int, ...], ...]
    batch: int
    tensor: bool = True

    @property
    def shape(self) -> tuple[int, ...]:
        return self.shapes[0]

    @property
    def rank(self) -> int:
        return len(self.shapes[0])

    @property
    def batch_axes(self) -> tuple[int, ...]:
        """Axes whose size follows the batch."""
        return tuple(a for a in range(self.rank) if len({shape[a] for shape in self.shapes}) > 1)

    @property
    def batch_axis(self) -> int:
        """The one axis that follows the batch, if its size is exactly the batch at every probe (else -1)."""
        axes = self.batch_axes
        sizes = list(range(self.batch, self.batch + len(self.shapes)))
        return axes[0] if len(axes) == 1 and [shape[axes[0]] for shape in self.shapes] == sizes else -1

    @property
    def rows_per_sample(self) -> int:
        """Rows per sample of the one axis that follows the batch, where every probe gives each sample the same
        number of rows there (1 on an exact batch axis, L where each sample's L tokens are rows, (B*L, C)); else 0."""
        axes = self.batch_axes
        if len(axes) != 1 or len(self.shapes) < 2:
            return 0
        sizes = [shape[axes[0]] for shape in self.shapes]
        rows = sizes[1] - sizes[0]
        return rows if rows > 0 and sizes == [rows * (self.batch + i) for i in range(len(sizes))] else 0

    @property
    def rows_axis(self) -> int:
        """The axis of ``rows_per_sample`` (the batch axis when it is exactly the batch), else -1."""
        return self.batch_axes[0] if self.rows_per_sample else -1


@dataclass(eq=False)
class CapturedOp(Generic[K]):
    """One run-time value of a captured model as the core sees it; adapters subclass it with what emitting needs.

    ``rule`` says how the channel axis goes through (``AxisRule``): ``"same"``, ``"fixed"`` (``fixed_in`` to
    ``fixed_out``), ``"concat"`` (along ``concat_dim``), ``"flatten"``, ``"map"`` (``CapturedGraph.axis_map``) or
    ``"none"`` (a fallback). ``batch_in``/``batch_out``: the axis the operation needs the batch on, in what it reads
    and what it writes (-1: any). ``keeps_zeros``: zero-preserving without evaluating it (a view). ``masks``: a
    Masksembles layer's (n, C) masks. ``batch_dependent``: a fallback that runs per member (it reads the batch).
    ``folded``/``broadcast``: a fallback that runs on the members' channel blocks (``GraphNode``); ``broadcast`` of a
    combine: its operands broadcast along the channels (``solve_axes`` finds them). ``regroups_rows``: a reshape the
    adapter proved to regroup the batch's rows with the axes after them and to keep each sample's rows together, in
    sample order (``(B, L, C) -> (B*L, C)`` and back: its rows per sample may differ from its input's).
    ``sample_rows``: a fallback whose value the adapter proved to hold each sample's rows together, in sample order,
    on its one batch-proportional axis (Swin's attention on (B*windows, L, C)): on the member-stacked batch, the dense
    model's member blocks, which a compacted operation may read.
    """

    key: K
    kind: str
    tensors: list[K]
    rule: str = "same"
    fixed_in: int = -1
    fixed_out: int = -1
    concat_dim: int = 0
    batch_in: int = -1
    batch_out: int = -1
    groups: int = 1
    zero_rule: str = "all"
    zero_inputs: tuple[int, ...] = ()
    keeps_zeros: bool = False
    masks: BoolArray | None = field(default=None, repr=False)
    batch_dependent: bool = False
    folded: bool = False
    broadcast: tuple[int, ...] = ()
    regroups_rows: bool = False
    sample_rows: bool = False
    axis: int = -1  # the solved channel axis of its value (-1: none)

    @property
    def compacted(self) -> bool:
        return self.kind != "fallback"

    @property
    def channel_operands(self) -> list[K]:
        """The operands that hold the channels on the same axis as the value (all but the ``broadcast`` ones)."""
        return [t for i, t in enumerate(self.tensors) if i not in self.broadcast]


Op = TypeVar("Op", bound=CapturedOp)  # type: ignore[type-arg]  # an adapter's CapturedOp subclass


class CapturedGraph(Protocol[K, Op]):
    """What an adapter's capture gives the core. ``ops`` holds every run-time value but ``input``, in topological
    order; ``output`` is the key of a model that returns one tensor (else None: its ``output_leaves`` are gathered
    by an ``OUTPUT`` fallback)."""

    input: K
    ops: dict[K, Op]

    @property
    def output(self) -> K | None: ...

    @property
    def output_leaves(self) -> Sequence[K]: ...

    def probed(self, key: K) -> Probed:
        """The value's shapes at the probe batch sizes."""
        ...

    def name(self, key: K) -> str:
        """The value's node name in the core's graph (unique)."""
        ...

    def fallback(self, key: K) -> Op:
        """The value's operation as the dense model runs it (with ``batch_dependent`` where it reads the batch)."""
        ...

    def axis_map(self, op: Op, source_axis: int) -> int | None:
        """The axis of ``op``'s value that holds, whole and in order, what its first input holds on ``source_axis``
        (None: nowhere whole); found by evaluating the operation on index tensors or from its parameters."""
        ...

    def zero_map(self, op: Op) -> BoolArray:
        """Per channel of ``op``'s value (on ``op.axis``), whether it is zero whenever the inputs are zero: the
        operation evaluated on +0 and on -0 with its own arguments."""
        ...

    def zero_rule(self, op: Op) -> tuple[str, tuple[int, ...]]:
        """A combine's ``zero_rule`` and ``zero_inputs`` (``GraphNode``)."""
        ...

    def repeatable(self, key: K) -> bool:
        """Whether a shared value can be repeated for every member along its batch axis (or needs no repeat):
        ``array_repeatable`` for an array."""
        ...


def solve_axes(graph: CapturedGraph[K, Op]) -> dict[K, int]:
    """The channel axis of every compacted value and of what it reads, written to each op's ``axis``. Operations that
    cannot agree become fallbacks (``graph.fallback``) and the axes are solved again; so are they once the operands
    of a combine that broadcast along the channels are marked; elementwise operations that read only fallbacks become
    fallbacks first (the plan runs them at full width anyway, and so their axes constrain nothing)."""
    maps: dict[tuple[K, int], int | None] = {}
    while True:
        _demote_dense(graph)
        try:
            axis = _checked_axes(graph, maps)
        except AxisConflict as conflict:
            key = cast(K, conflict.node)
            graph.ops[key] = graph.fallback(key)
            continue
        if _mark_broadcasts(graph, axis):
            continue
        for key, op in graph.ops.items():
            op.axis = axis.get(key, -1)
        return axis


def _demote_dense(graph: CapturedGraph[K, Op]) -> None:
    changed = True
    while changed:
        changed = False
        for key, op in graph.ops.items():
            if op.kind in ELEMENTWISE_KINDS and all(t in graph.ops and not graph.ops[t].compacted for t in op.tensors):
                graph.ops[key] = graph.fallback(key)
                changed = True


def mapped_axis(
    graph: CapturedGraph[K, Op], op: Op, source_axis: int, maps: dict[tuple[K, int], int | None]
) -> int | None:
    """Where a move or reduction puts the channels its input holds on ``source_axis``: None unless they come out whole
    and the input's batch rows land, whole and in order, on the output's."""
    source = graph.probed(op.tensors[0])
    batch = source.rows_axis
    if source_axis == batch or batch < 0:
        return None

    def landing(axis: int) -> int | None:
        if (op.key, axis) not in maps:
            maps[(op.key, axis)] = graph.axis_map(op, axis)
        return maps[(op.key, axis)]

    if landing(batch) != graph.probed(op.key).rows_axis:
        return None
    return landing(source_axis)


def _checked_axes(graph: CapturedGraph[K, Op], maps: dict[tuple[K, int], int | None]) -> dict[K, int]:
    """The core's axes for the compacted operations' rules, then the layouts each one needs."""
    compact = [op for op in graph.ops.values() if op.compacted]
    rules = []
    for op in compact:
        if any(graph.probed(key).rank == 0 for key in (op.key, *op.tensors)):
            raise AxisConflict(op.key)  # a 0-d value (a sum of everything) has neither batch nor channel axis
        mapped = functools.partial(mapped_axis, graph, op, maps=maps) if op.rule == "map" else None
        inputs = tuple(_aligned_operands(graph, op))
        rules.append(AxisRule(op.key, inputs, op.rule, op.fixed_in, op.fixed_out, op.concat_dim, mapped))
    axis = cast(dict[K, int], channel_axes(rules, lambda key: graph.probed(cast(K, key)).rank))
    for op in compact:  # a flattened value that no other rule reads (the input): channels first, as nn.Flatten
        if op.kind == "flatten" and op.tensors[0] not in axis:
            if graph.probed(op.tensors[0]).rank < 2:
                raise AxisConflict(op.key)
            axis[op.tensors[0]] = 1
    for op in compact:
        _check_layout(graph, op, axis)
    for op in compact:
        if op.rule == "concat":  # along the channels, or along another axis (then channel c of every part)
            op.kind = "concat" if axis[op.key] == op.concat_dim else "combine"
        if op.rule == "same" or op.kind == "combine":
            width, aligned = graph.probed(op.key).shape[axis[op.key]], _aligned_operands(graph, op)
            mismatch = any(t not in aligned or graph.probed(t).shape[axis[t]] != width for t in op.channel_operands)
            if (mismatch or op.broadcast) and not _broadcasting(graph, op, axis[op.key]):
                raise AxisConflict(op.key)  # an operand of other channels, or a move of them: full width
    return axis


def _aligned_operands(graph: CapturedGraph[K, Op], op: Op) -> list[K]:
    """The operands whose channel axis is the value's: of its rank (right-aligned broadcasting puts a lower-rank
    operand's axes elsewhere) where an elementwise combine reads them, and not ``broadcast``."""
    operands = op.channel_operands
    if op.kind != "combine" or op.rule != "same":
        return operands
    rank = graph.probed(op.key).rank
    return [t for t in operands if graph.probed(t).rank == rank]


def _broadcasting(graph: CapturedGraph[K, Op], op: Op, channel_axis: int) -> list[int]:
    """The positions of the operands of an elementwise combine that broadcast along its channels: size 1 on the
    channel axis, or no such axis, right-aligned, while the value has more channels. Empty unless every other operand
    is of the value's rank and channels, not marked ``broadcast``, and there is one."""
    if op.kind != "combine" or op.rule != "same":
        return []
    out = graph.probed(op.key)
    width = out.shape[channel_axis]
    found, wide = [], 0
    for position, tensor in enumerate(op.tensors):
        probed = graph.probed(tensor)
        at = channel_axis - (out.rank - probed.rank)
        if width > 1 and (at < 0 or probed.shape[at] == 1):
            found.append(position)
        elif position not in op.broadcast and probed.rank == out.rank and probed.shape[at] == width:
            wide += 1
        else:
            return []
    return found if wide else []


def _mark_broadcasts(graph: CapturedGraph[K, Op], axis: Mapping[K, int]) -> bool:
    """Mark the operands of each elementwise combine that broadcast along its channels (``_broadcasting``), where
    some are not marked yet; whether any were (the axes are then solved again, without them)."""
    marked = False
    for op in graph.ops.values():
        if op.compacted and op.key in axis:
            found = tuple(_broadcasting(graph, op, axis[op.key]))
            if found and found != op.broadcast:
                op.broadcast = found
                marked = True
    return marked


def _check_layout(graph: CapturedGraph[K, Op], op: Op, axis: Mapping[K, int]) -> None:
    """Every value a compacted operation touches has its batch's rows on exactly one axis, not the channels', and
    where the operation needs it (``batch_in``/``batch_out``); a flatten reads its channels first or last. An operand
    read as it is (``broadcast``, or not of the value's rank) needs its batch on one exact axis, or none.

    Rows that fold the tokens into the batch ((B*L, C): ``rows_per_sample`` above 1) are the dense model's member
    blocks on the member-stacked batch only where each sample's rows are together, in sample order: so the operation
    keeps the rows per sample of what it reads (or ``regroups_rows``, proven by the adapter), and an operand with
    more than one row per sample is itself compacted or a fallback the adapter proved to keep them so
    (``sample_rows``; a fallback's rows are not otherwise known to be in sample order)."""
    for key in op.tensors:
        if key not in _aligned_operands(graph, op) and not array_repeatable(graph.probed(key)):
            raise AxisConflict(op.key)
    rows = graph.probed(op.key).rows_per_sample
    for key in (op.key, *_aligned_operands(graph, op)):
        probed = graph.probed(key)
        needed = op.batch_out if key == op.key else op.batch_in
        if probed.rows_axis < 0 or probed.rows_axis == axis[key] or needed not in (-1, probed.rows_axis):
            raise AxisConflict(op.key)
        if key != op.key and probed.rows_per_sample != rows and not op.regroups_rows:
            raise AxisConflict(op.key)
        proven = key in graph.ops and (graph.ops[key].compacted or graph.ops[key].sample_rows)
        if key != op.key and probed.rows_per_sample > 1 and not proven:
            raise AxisConflict(op.key)
    if op.kind == "flatten":
        source = graph.probed(op.tensors[0])
        if axis[op.tensors[0]] not in (1, source.rank - 1):
            raise AxisConflict(op.key)


def graph_nodes(graph: CapturedGraph[K, Op], axis: Mapping[K, int]) -> tuple[list[GraphNode], str]:
    """The core's view of the captured model (after ``solve_axes``), and the name of the node whose value is the
    output. Marks the fallbacks that must run per member first (``per_member_fallbacks``)."""

    def channels(key: K) -> int:
        probed = graph.probed(key)
        return probed.shape[axis[key]] if probed.tensor and key in axis else 1

    _member_frames(graph)
    name = graph.name
    nodes = [GraphNode(name(graph.input), "input", (), channels(graph.input))]
    for key, op in graph.ops.items():
        names = tuple(name(t) for t in op.tensors)
        size = channels(key)
        if op.kind == "masks":
            nodes.append(GraphNode(name(key), "masks", names, size, masks=op.masks))
        elif op.kind in ("channelwise", "grouped", "mean_ratio"):
            zero = True if op.keeps_zeros else graph.zero_map(op)
            nodes.append(GraphNode(name(key), op.kind, names, size, zero_preserving=zero, groups=op.groups))
        elif op.kind == "combine":
            op.zero_rule, op.zero_inputs = graph.zero_rule(op)
            rule, inputs, broadcast = op.zero_rule, op.zero_inputs, op.broadcast
            nodes.append(
                GraphNode(name(key), "combine", names, size, zero_rule=rule, zero_inputs=inputs, broadcast=broadcast)
            )
        elif op.kind == "concat":
            nodes.append(GraphNode(name(key), "concat", names, size, parts=tuple(channels(t) for t in op.tensors)))
        elif op.kind == "flatten":
            source = graph.probed(op.tensors[0])
            spatial = math.prod(s for a, s in enumerate(source.shape) if a not in (0, axis[op.tensors[0]]))
            last = axis[op.tensors[0]] == source.rank - 1 and source.rank > 2
            nodes.append(GraphNode(name(key), "flatten", names, size, spatial=spatial, channels_last=last))
        elif op.kind == "fallback":
            dependent, folded, broadcast = op.batch_dependent, op.folded, op.broadcast
            node = GraphNode(
                name(key), "fallback", names, size, batch_dependent=dependent, folded=folded, broadcast=broadcast
            )
            nodes.append(node)
        else:
            nodes.append(GraphNode(name(key), op.kind, names, size))
    if graph.output is not None:
        return nodes, name(graph.output)
    leaves = tuple(dict.fromkeys(name(leaf) for leaf in graph.output_leaves))
    nodes.append(GraphNode(OUTPUT, "fallback", leaves, 1, batch_dependent=True))
    return nodes, OUTPUT


def _member_frames(graph: CapturedGraph[K, Op]) -> None:
    """Mark the fallbacks that must run per member (``per_member_fallbacks``). A folded fallback reads its
    ``broadcast`` inputs as they are, on the batch (they must be shared), never repeated for every member: they are
    not its inputs there (Swin's shifted-window mask, (B*windows, 1, L, L), which has no exact batch axis to repeat
    along)."""
    nodes = [
        (key, op.kind, [t for i, t in enumerate(op.tensors) if not (op.folded and i in op.broadcast)],
         op.batch_dependent)
        for key, op in graph.ops.items()
    ]  # fmt: skip
    for key in per_member_fallbacks(nodes, lambda key: graph.repeatable(cast(K, key))):
        graph.ops[cast(K, key)].batch_dependent = True


def array_repeatable(probed: Probed) -> bool:
    """An array can be repeated for every member unless it follows the batch without an exact batch axis."""
    return not (probed.batch_axes and probed.batch_axis < 0)


def whole_axis(result: np.ndarray, size: int) -> int | None:
    """The axis of ``result`` that holds 0, 1, ..., size-1 in order, times one positive factor (a sum over other
    axes), the same along every other axis; None if none does. ``result`` is an operation's output on an input that
    holds each position's index along the axis asked about (an adapter's ``axis_map``)."""
    values = np.asarray(result, dtype=np.float64)
    factor = float(values.max()) / (size - 1) if size > 1 and values.size else 1.0
    for axis in range(values.ndim):
        if values.shape[axis] != size:
            continue
        view = [1] * values.ndim
        view[axis] = size
        ids = np.arange(size, dtype=np.float64).reshape(view) * factor
        if factor > 0 and np.array_equal(values, np.broadcast_to(ids, values.shape)):
            return axis
    return None


def zero_channels(result: np.ndarray, axis: int) -> BoolArray:
    """Per index of ``axis``, whether ``result`` (an operation's output on zero inputs, as a bool "is zero" array or
    as values) is zero everywhere along the other axes."""
    value = np.asarray(result)
    zero = value if value.dtype == np.bool_ else value == 0
    others = tuple(a for a in range(zero.ndim) if a != axis)
    return np.asarray(zero.all(axis=others) if others else zero, dtype=bool)
