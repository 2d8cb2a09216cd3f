"""The capture as the core sees it (``masksembles_core.captured``, which solves the channel axes and builds the
core's graph): where each operation puts an axis of its input and which channels it keeps at zero, both evaluated on
the traced graph; and the members a program computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, fx

from masksembles_core import captured
from masksembles_core.captured import Probed, whole_axis, zero_channels
from masksembles_core.packing import BoolArray

from ._pack_capture import _Capture, _evaluate, _Op, _Seen, _target_name


class _Graph:
    """The capture as the core's ``CapturedGraph``: its operations, and the answers the core asks for, evaluated on
    the traced graph."""

    def __init__(self, capture: _Capture) -> None:
        self.capture = capture
        self.input = capture.input
        self.ops = capture.ops
        output = next(n for n in capture.gm.graph.nodes if n.op == "output").args[0]
        single = isinstance(output, fx.Node) and output in capture.values and capture.seen[output].tensor
        self.output: fx.Node | None = output if single else None
        self.output_leaves = [leaf for leaf in _leaves(output) if leaf in capture.values]
        self.batch = capture.seen[capture.input].shapes[0][0]
        self.probes: dict[fx.Node, Probed] = {}

    def probed(self, key: fx.Node) -> Probed:
        if key not in self.probes:
            seen = self.capture.seen[key]
            self.probes[key] = Probed(seen.shapes, self.batch, seen.tensor)
        return self.probes[key]

    def name(self, key: fx.Node) -> str:
        return key.name

    def fallback(self, key: fx.Node) -> _Op:
        return self.capture.fallback(key)

    def axis_map(self, op: _Op, source_axis: int) -> int | None:
        return _axis_map(self.capture, op, source_axis)

    def zero_map(self, op: _Op) -> BoolArray:
        """Evaluated on +0 and on -0, with the operation's own arguments (a per-sample zero input: the batch of one,
        its rows where tokens fold into the batch)."""
        source = op.tensors[0]
        seen = self.capture.seen[source]
        shape = list(seen.shapes[0])
        shape[seen.sole_batch_axis] = self.probed(source).rows_per_sample or 1
        zero = np.ones(self.capture.seen[op.node].shapes[0][op.axis], dtype=bool)
        for sign in (0.0, -0.0):
            value = torch.full(shape, sign, dtype=seen.dtype, device=self.capture.device)
            out = _evaluate(self.capture, op.node, {source: value})
            zero &= zero_channels((out == 0).cpu().numpy(), op.axis)
        return zero

    def zero_rule(self, op: _Op) -> tuple[str, tuple[int, ...]]:
        return op.zero_rule, op.zero_inputs

    def repeatable(self, key: fx.Node) -> bool:
        return _repeatable(self.capture.seen[key])


def _axis_map(capture: _Capture, op: _Op, source_axis: int) -> int | None:
    """The axis of ``op``'s value that holds, whole and in order, what its first input holds on ``source_axis``.

    Evaluated, not read from the operation's name: the operation runs on a tensor holding each position's index
    along ``source_axis``, and the result must hold those indices whole, in order, on one axis (times one positive
    factor: a sum over other axes)."""
    node, source = op.node, op.tensors[0]
    seen = capture.seen[source]
    shape = seen.shapes[0]
    if _target_name(node) == "getitem" and not _takes_whole(node.args[1], seen.rank, [source_axis]):
        return None
    ids = torch.arange(shape[source_axis], dtype=torch.float64)
    view = [1] * len(shape)
    view[source_axis] = shape[source_axis]
    try:
        out = _evaluate(capture, node, {source: ids.view(view).expand(shape).contiguous()})
    except Exception:  # the operation does not apply to this tensor as given
        return None
    return whole_axis(out.detach().double().cpu().numpy(), len(ids)) if isinstance(out, Tensor) else None


def _solve_axes(capture: _Capture) -> tuple[_Graph, dict[fx.Node, int]]:
    """The core's channel axes over the capture (``masksembles_core.captured.solve_axes``)."""
    graph = _Graph(capture)
    axis = captured.solve_axes(graph)
    for op in graph.ops.values():
        if op.kind == "mean_ratio" and op.axis != mean_ratio_axis(capture, op.node):
            op.kind = "channelwise"  # a mean over another axis than the channels': channel c from channel c alone
    return graph, axis


def mean_ratio_axis(capture: _Capture, node: fx.Node) -> int:
    """The axis of ``_packed_ops.mean_ratio(g, dim, eps)``'s mean (its channel axis where it is a ``"mean_ratio"``)."""
    return int(capture.argument(node, "dim", 1)) % capture.seen[node].rank


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


def _leaves(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _repeatable(seen: _Seen) -> bool:
    """Whether a shared value can be repeated for every member along its batch axis (or needs no repeat)."""
    if seen.parts:
        return all(_repeatable(part) for part in seen.parts)
    if not seen.tensor:
        return not seen.batch_dependent
    return not seen.batch_axes or seen.batch_axis >= 0
