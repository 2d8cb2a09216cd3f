"""The passes between the capture and the core's program: the channel axis of every compacted node (nodes that
cannot agree fall back), which channels each operation keeps at zero, the core's ``GraphNode`` list, the fallbacks that
must run per member, and the members a program computes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, fx

from masksembles_core.packing import (
    OUTPUT,
    AxisConflict,
    AxisRule,
    GraphNode,
    channel_axes,
    per_member_fallbacks,
)

from ._layers import Masksembles
from ._pack_capture import _Capture, _evaluate, _Op, _Seen, _target_name


def _solve_axes(capture: _Capture) -> dict[fx.Node, int]:
    """The channel axis of every compacted node and of what it reads; nodes that cannot agree fall back."""
    maps: dict[tuple[fx.Node, int], int | None] = {}
    while True:
        try:
            return _checked_axes(capture, maps)
        except AxisConflict as conflict:
            node = cast(fx.Node, conflict.node)
            capture.ops[node] = capture.fallback(node)


def _checked_axes(capture: _Capture, maps: dict[tuple[fx.Node, int], int | None]) -> dict[fx.Node, int]:
    """The core's axes for the compacted nodes' rules, then the layouts each node needs (its batch exactly on one axis,
    not the channels'; convolutions, BatchNorm and pooling with the batch first)."""
    compact = [op for op in capture.ops.values() if op.kind != "fallback"]
    rules = []
    for op in compact:
        if any(capture.seen[node].rank == 0 for node in (op.node, *op.tensors)):
            raise AxisConflict(op.node)  # a 0-d tensor (a sum of everything) has neither batch nor channel axis
        dim = capture.argument(op.node, "dim", 1, 0) if op.rule == "concat" else 0
        if not isinstance(dim, int):
            raise AxisConflict(op.node)
        mapped = None
        if op.rule == "map":
            mapped = functools.partial(_mapped_axis, capture, op, maps=maps)
        rules.append(
            AxisRule(op.node, tuple(op.tensors), op.rule, op.fixed_in, op.fixed_out,
                     dim % capture.seen[op.node].rank, mapped)
        )  # fmt: skip
    axis = cast(dict[fx.Node, int], channel_axes(rules, lambda node: capture.seen[cast(fx.Node, node)].rank))
    for op in compact:  # a flattened tensor that no other rule reads (the input): channels first, as nn.Flatten
        if op.kind == "flatten" and op.tensors[0] not in axis:
            if capture.seen[op.tensors[0]].rank < 2:
                raise AxisConflict(op.node)
            axis[op.tensors[0]] = 1
    for op in compact:
        for node in [op.node, *op.tensors]:
            seen = capture.seen[node]
            if seen.batch_axis < 0 or seen.batch_axis == axis[node] or (op.fixed_in == 1 and seen.batch_axis != 0):
                raise AxisConflict(op.node)
        if op.kind == "flatten" and axis[op.tensors[0]] not in (1, capture.seen[op.tensors[0]].rank - 1):
            raise AxisConflict(op.node)
    for op, rule in zip(compact, rules, strict=True):
        if op.rule == "concat":  # along the channels, or along another axis (then channel c of every part)
            op.kind = "concat" if axis[op.node] == rule.concat_dim else "combine"
        width = capture.seen[op.node].shapes[0][axis[op.node]]
        if op.kind == "combine" and any(capture.seen[t].shapes[0][axis[t]] != width for t in op.tensors):
            raise AxisConflict(op.node)  # one broadcasts along the channels (a (B, 1, 1, 1) tensor): full width
    for op in capture.ops.values():
        op.axis = axis.get(op.node, -1)
    return axis


def _mapped_axis(
    capture: _Capture, op: _Op, source_axis: int, maps: dict[tuple[fx.Node, int], int | None]
) -> int | None:
    key = (op.node, source_axis)
    if key not in maps:
        maps[key] = _evaluate_map(capture, op, source_axis)
    return maps[key]


def _evaluate_map(capture: _Capture, op: _Op, source_axis: int) -> int | None:
    """Where a move or reduction puts the channels that its input holds on ``source_axis`` (None: it mixes them).

    Evaluated, not read from the operation's name: the operation runs on a tensor holding each position's channel
    index, and the result must hold those indices whole, in order, on one axis (and likewise the batch indices).
    """
    node, source = op.node, op.tensors[0]
    seen = capture.seen[source]
    shape = seen.shapes[0]
    if source_axis == seen.batch_axis:
        return None
    if _target_name(node) == "getitem" and not _takes_whole(node.args[1], seen.rank, [source_axis, seen.batch_axis]):
        return None
    found = []
    for tracked in (source_axis, seen.batch_axis):
        ids = torch.arange(shape[tracked], dtype=torch.float64)
        view = [1] * len(shape)
        view[tracked] = shape[tracked]
        try:
            out = _evaluate(capture, node, {source: ids.view(view).expand(shape).contiguous()})
        except Exception:  # the operation does not apply to this tensor as given
            return None
        found.append(_whole_axis(out, ids))
    channel, batch = found
    if channel is None or batch is None or batch != capture.seen[node].batch_axis:
        return None
    return channel


def _takes_whole(index: Any, rank: int, axes: Sequence[int]) -> bool:
    """A ``getitem`` index made of slices, ints, None and one Ellipsis that takes all of ``axes``."""
    entries = index if isinstance(index, tuple) else (index,)
    if any(not isinstance(e, (slice, int, type(None), type(Ellipsis))) for e in entries):
        return False
    consumed = [e for e in entries if e is not None and e is not Ellipsis]
    if sum(e is Ellipsis for e in entries) > 1 or len(consumed) > rank:
        return False
    positions: list[Any] = []
    for e in entries:
        if e is Ellipsis:
            positions.extend([slice(None)] * (rank - len(consumed)))
        elif e is not None:
            positions.append(e)
    positions.extend([slice(None)] * (rank - len(positions)))
    return all(positions[a] == slice(None) for a in axes)


def _whole_axis(out: Any, ids: Tensor) -> int | None:
    """The axis of ``out`` that holds ``ids`` in order, constant along every other axis; None if none does."""
    if not isinstance(out, Tensor):
        return None
    for a in range(out.dim()):
        if out.shape[a] != len(ids):
            continue
        view = [1] * out.dim()
        view[a] = len(ids)
        if torch.equal(out.double(), ids.view(view).expand(out.shape)):
            return a
    return None


def _zero_map(capture: _Capture, op: _Op) -> np.ndarray:
    """Per output channel, whether the operation maps zero inputs to zero: evaluated on +0 and on -0, with the
    operation's own arguments (a per-sample zero input, the batch of one)."""
    source = op.tensors[0]
    seen = capture.seen[source]
    shape = list(seen.shapes[0])
    shape[seen.batch_axis] = 1
    zero = np.ones(capture.seen[op.node].shapes[0][op.axis], dtype=bool)
    for sign in (0.0, -0.0):
        out = _evaluate(capture, op.node, {source: torch.full(shape, sign, dtype=seen.dtype, device=capture.device)})
        others = [a for a in range(out.dim()) if a != op.axis]
        zero &= (out == 0).all(dim=others).cpu().numpy() if others else (out == 0).cpu().numpy()
    return zero


def _graph_nodes(capture: _Capture, axis: dict[fx.Node, int]) -> tuple[list[GraphNode], str]:
    """The core's view of the model, and the name of the node whose value is the output."""

    def channels(node: fx.Node) -> int:
        seen = capture.seen[node]
        return seen.shapes[0][axis[node]] if seen.tensor and node in axis else 1

    _member_frames(capture)
    nodes = [GraphNode(capture.input.name, "input", (), channels(capture.input))]
    for node, op in capture.ops.items():
        names = tuple(t.name for t in op.tensors)
        size = channels(node)
        if op.kind == "masks":
            masks = (cast(Masksembles, op.module).masks != 0).cpu().numpy()
            nodes.append(GraphNode(node.name, "masks", names, size, masks=masks))
        elif op.kind == "channelwise":
            zero = True if op.how == "identity" else _zero_map(capture, op)
            nodes.append(GraphNode(node.name, "channelwise", names, size, zero_preserving=zero))
        elif op.kind == "grouped":
            nodes.append(
                GraphNode(node.name, "grouped", names, size, zero_preserving=_zero_map(capture, op), groups=op.groups)
            )
        elif op.kind == "combine":
            nodes.append(GraphNode(node.name, "combine", names, size, zero_rule=op.zero_rule))
        elif op.kind == "concat":
            nodes.append(GraphNode(node.name, "concat", names, size, parts=tuple(channels(t) for t in op.tensors)))
        elif op.kind == "flatten":
            source = op.tensors[0]
            seen = capture.seen[source]
            spatial = math.prod(s for a, s in enumerate(seen.shapes[0]) if a not in (0, axis[source]))
            last = axis[source] == seen.rank - 1 and seen.rank > 2
            nodes.append(GraphNode(node.name, "flatten", names, size, spatial=spatial, channels_last=last))
        elif op.kind == "fallback":
            nodes.append(GraphNode(node.name, "fallback", names, size, batch_dependent=op.batch_dependent))
        else:
            nodes.append(GraphNode(node.name, op.kind, names, size))
    output = next(n for n in capture.gm.graph.nodes if n.op == "output").args[0]
    if isinstance(output, fx.Node) and output in capture.values and capture.seen[output].tensor:
        return nodes, output.name
    leaves = [leaf for leaf in _leaves(output) if leaf in capture.values]
    nodes.append(GraphNode(OUTPUT, "fallback", tuple(leaf.name for leaf in leaves), 1, batch_dependent=True))
    return nodes, OUTPUT


def _leaves(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _member_frames(capture: _Capture) -> None:
    """Mark the fallbacks that must run per member (``masksembles_core.packing.per_member_fallbacks``)."""
    nodes = [(node, op.kind, op.tensors, op.batch_dependent) for node, op in capture.ops.items()]
    for node in per_member_fallbacks(nodes, lambda node: _repeatable(capture.seen[cast(fx.Node, node)])):
        capture.ops[cast(fx.Node, node)].batch_dependent = True


def _repeatable(seen: _Seen) -> bool:
    """Whether a shared value can be repeated for every member along its batch axis (or needs no repeat)."""
    if seen.parts:
        return all(_repeatable(part) for part in seen.parts)
    if not seen.tensor:
        return not seen.batch_dependent
    return not seen.batch_axes or seen.batch_axis >= 0


def _planned(capture: _Capture, chosen: Sequence[int]) -> list[int]:
    """The members to compute for ``chosen``: every member where a node runs per member on the member-stacked batch
    because it reads the batch (its size, as ``x.shape[0]`` or ``arange(B)``, or other samples, as a mean over the
    batch): in the dense model that batch holds every member's copy. A Masksembles layer that falls back needs no
    other member (the program's copy of it holds the computed members' masks, ``_Emitter._module``)."""
    per_member = any(
        op.kind == "fallback" and op.batch_dependent and not capture.is_masksembles(op.node)
        for op in capture.ops.values()
    )
    return list(range(capture.n)) if per_member else list(chosen)
