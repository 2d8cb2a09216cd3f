"""The step every adapter's pack shares, from captured operations to the planner's graph, on synthetic graphs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from masksembles_core.captured import (
    CapturedOp,
    Probed,
    array_repeatable,
    graph_nodes,
    solve_axes,
    whole_axis,
    zero_channels,
)
from masksembles_core.packing import OUTPUT, GraphNode, plan_program

B = 4  # the probe batch: every value is seen at B and B + 1


def value(*shape: int, batch: int | None = 0) -> Probed:
    """A value of ``shape`` whose axis ``batch`` is the batch (None: no batch axis)."""
    second = list(shape)
    if batch is not None:
        assert shape[batch] == B
        second[batch] = B + 1
    return Probed((tuple(shape), tuple(second)), B)


@dataclass
class Graph:
    """A captured model written by hand: values, operations, and the answers an adapter would evaluate."""

    values: dict[str, Probed]
    ops: dict[str, CapturedOp[str]]
    input: str = "x"
    maps: dict[tuple[str, int], int | None] = field(default_factory=dict)  # (op, input axis) -> output axis
    zeros: dict[str, np.ndarray] = field(default_factory=dict)  # op -> its zero map (default: all zero-preserving)
    output_key: str | None = None
    leaves: Sequence[str] = ()
    asked: list[str] = field(default_factory=list)

    @property
    def output(self) -> str | None:
        return self.output_key

    @property
    def output_leaves(self) -> Sequence[str]:
        return self.leaves

    def probed(self, key: str) -> Probed:
        return self.values[key]

    def name(self, key: str) -> str:
        return key

    def fallback(self, key: str) -> CapturedOp[str]:
        return CapturedOp(key, "fallback", list(self.ops[key].tensors), rule="none")

    def axis_map(self, op: CapturedOp[str], source_axis: int) -> int | None:
        return self.maps.get((op.key, source_axis))

    def zero_map(self, op: CapturedOp[str]) -> np.ndarray:
        self.asked.append(op.key)
        return self.zeros.get(op.key, np.ones(self.values[op.key].shape[op.axis], dtype=bool))

    def zero_rule(self, op: CapturedOp[str]) -> tuple[str, tuple[int, ...]]:
        return op.zero_rule, op.zero_inputs

    def repeatable(self, key: str) -> bool:
        return array_repeatable(self.values[key])


def masks(n: int, channels: int, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).random((n, channels)) < 0.5
    rows[:, 0] = True
    return rows


def op(key: str, kind: str, *tensors: str, **settings: object) -> CapturedOp[str]:
    return CapturedOp(key, kind, list(tensors), **settings)  # type: ignore[arg-type]


def mlp(**replace: Callable[[], CapturedOp[str]]) -> Graph:
    """x (B, 8) -> masks -> linear (8 -> 6) -> relu -> linear (6 -> 3)."""
    ops = {
        "m": op("m", "masks", "x", rule="fixed", fixed_in=1, fixed_out=1, masks=masks(3, 8)),
        "fc1": op("fc1", "mixing", "m", rule="fixed", fixed_in=1, fixed_out=1),
        "relu": op("relu", "channelwise", "fc1"),
        "fc2": op("fc2", "mixing", "relu", rule="fixed", fixed_in=1, fixed_out=1),
    }
    ops.update({key: make() for key, make in replace.items()})
    values = {"x": value(B, 8), "m": value(B, 8), "fc1": value(B, 6), "relu": value(B, 6), "fc2": value(B, 3)}
    return Graph(values, ops, output_key="fc2")


def kinds(nodes: Sequence[GraphNode]) -> dict[str, str]:
    return {node.name: node.kind for node in nodes}


def test_a_chain_of_layers_becomes_the_planners_graph_and_plans() -> None:
    graph = mlp()
    axis = solve_axes(graph)
    assert axis == {"x": 1, "m": 1, "fc1": 1, "relu": 1, "fc2": 1}
    nodes, output = graph_nodes(graph, axis)
    assert output == "fc2"
    assert kinds(nodes) == {"x": "input", "m": "masks", "fc1": "mixing", "relu": "channelwise", "fc2": "mixing"}
    assert [node.channels for node in nodes] == [8, 8, 6, 6, 3]
    assert graph.asked == ["relu"]  # zero maps are asked of elementwise operations only
    program = plan_program(nodes, output, [0, 1, 2])
    assert program.fallbacks == ()


def test_an_operation_whose_axis_cannot_agree_falls_back_and_the_axes_are_solved_again() -> None:
    # a "fixed" rule that puts fc1's channels on axis 0, where fc1 (B, 6) has its batch
    graph = mlp(fc2=lambda: op("fc2", "mixing", "relu", rule="fixed", fixed_in=0, fixed_out=1))
    axis = solve_axes(graph)
    assert graph.ops["fc2"].kind == "fallback"
    assert axis["relu"] == 1 and "fc2" not in axis
    assert graph.ops["fc2"].axis == -1 and graph.ops["relu"].axis == 1


def test_a_layout_the_operation_cannot_keep_falls_back() -> None:
    # the operation needs the batch on axis 1 of what it reads (a conv with another layout)
    graph = mlp(fc2=lambda: op("fc2", "mixing", "relu", rule="fixed", fixed_in=1, fixed_out=1, batch_in=1))
    solve_axes(graph)
    assert graph.ops["fc2"].kind == "fallback"
    assert graph.ops["fc1"].kind == "mixing"


def test_a_value_with_no_exact_batch_axis_falls_back() -> None:
    graph = mlp()
    graph.values["relu"] = Probed(((2 * B, 6), (2 * B + 2, 6)), B)  # windows folded into the batch: (2B, 6)
    solve_axes(graph)
    assert [graph.ops[key].kind for key in ("fc1", "relu", "fc2")] == ["mixing", "fallback", "fallback"]


def test_elementwise_operations_that_read_only_fallbacks_become_fallbacks() -> None:
    graph = mlp(fc1=lambda: op("fc1", "fallback", "m", rule="none"))
    solve_axes(graph)
    assert graph.ops["relu"].kind == "fallback"  # so its axis constrains nothing
    assert graph.ops["fc2"].kind == "mixing"


def broadcast_sum(source: str, shape: tuple[int, ...] = (B, 1), batch: int | None = 0) -> Graph:
    """mlp with ``fc1 + s`` for its relu, ``s`` reduced from ``source`` (a fallback of ``shape``)."""
    graph = mlp(relu=lambda: op("relu", "combine", "fc1", "s"))
    ops = graph.ops
    graph.ops = {"m": ops["m"], "fc1": ops["fc1"], "s": op("s", "channelwise", source, rule="map"), **ops}
    graph.values["s"] = value(*shape, batch=batch)  # e.g. x.sum(1, keepdim=True)
    graph.maps = {("s", 0): 0}  # the batch stays; the channels are reduced away
    return graph


def test_an_operand_broadcast_along_the_channels_is_marked_and_read_as_it_is() -> None:
    graph = broadcast_sum("x")
    axis = solve_axes(graph)
    assert graph.ops["s"].kind == "fallback"  # no axis holds x's channels whole
    assert graph.ops["relu"].kind == "combine" and graph.ops["relu"].broadcast == (1,)
    assert axis["relu"] == 1 and "s" not in axis, "(B, 6) + (B, 1): the operand takes no channel axis"
    nodes, output = graph_nodes(graph, axis)
    relu = next(node for node in nodes if node.name == "relu")
    assert relu.broadcast == (1,) and [node.channels for node in nodes if node.name == "s"] == [1]
    program = plan_program(nodes, output, [0, 1, 2])
    assert program.fallbacks == ("s",) and not program.step("relu").placement.dense


def test_an_operand_without_the_channel_axis_broadcasts_and_one_of_other_channels_falls_back() -> None:
    graph = broadcast_sum("x", (1,), batch=None)  # right-aligned, (1,) lies on the channel axis of (B, 6)
    solve_axes(graph)
    assert graph.ops["relu"].kind == "combine" and graph.ops["relu"].broadcast == (1,)
    graph = broadcast_sum("x", (6,), batch=None)  # six channels, but of another rank: not laid out like fc1's
    solve_axes(graph)
    assert graph.ops["relu"].kind == "fallback"


def test_a_combine_whose_broadcast_operand_is_computed_per_member_falls_back_in_the_plan() -> None:
    graph = broadcast_sum("m")  # a norm of the masked value: one per member
    axis = solve_axes(graph)
    assert graph.ops["relu"].broadcast == (1,)
    program = plan_program(*graph_nodes(graph, axis), [0, 1, 2])
    assert program.fallbacks == ("s", "relu") and program.step("relu").placement.dense


def test_a_move_takes_the_axis_its_evaluation_gives_and_keeps_the_batch() -> None:
    graph = mlp(relu=lambda: op("relu", "channelwise", "fc1", rule="map"))
    graph.values["relu"] = value(6, B, batch=1)  # fc1.T
    graph.ops["fc2"] = op("fc2", "mixing", "relu", rule="fixed", fixed_in=0, fixed_out=1)
    graph.maps = {("relu", 0): 1, ("relu", 1): 0}
    axis = solve_axes(graph)
    assert graph.ops["relu"].kind == "channelwise" and axis["relu"] == 0 and axis["fc1"] == 1


def test_a_move_that_does_not_keep_the_batch_on_the_batch_axis_falls_back() -> None:
    graph = mlp(relu=lambda: op("relu", "channelwise", "fc1", rule="map"))
    graph.maps = {("relu", 0): 1, ("relu", 1): 0}  # says it swaps the axes, but relu's batch is on axis 0
    solve_axes(graph)
    assert graph.ops["relu"].kind == "fallback"


def test_concatenation_along_the_channels_keeps_its_parts_and_along_another_axis_is_a_combine() -> None:
    graph = mlp(relu=lambda: op("relu", "concat", "fc1", "fc1", rule="concat", concat_dim=1))
    graph.values["relu"] = value(B, 12)
    graph.ops["fc2"] = op("fc2", "mixing", "relu", rule="fixed", fixed_in=1, fixed_out=1)
    axis = solve_axes(graph)
    nodes, _ = graph_nodes(graph, axis)
    assert {node.name: node for node in nodes}["relu"].parts == (6, 6)

    graph = mlp(relu=lambda: op("relu", "concat", "fc1", "fc1", rule="concat", concat_dim=0))
    graph.values["relu"] = Probed(((2 * B, 6), (2 * B + 2, 6)), B)
    solve_axes(graph)
    assert graph.ops["relu"].kind == "fallback"  # along the batch: no exact batch axis

    graph = mlp()
    graph.values.update(fc1=value(B, 6, 5), relu=value(B, 6, 10))
    graph.ops["fc1"] = op("fc1", "mixing", "m", rule="fixed", fixed_in=1, fixed_out=1)
    graph.ops["relu"] = op("relu", "concat", "fc1", "fc1", rule="concat", concat_dim=2)
    graph.ops["fc2"] = op("fc2", "mixing", "relu", rule="fixed", fixed_in=1, fixed_out=1)
    graph.values["fc2"] = value(B, 3, 10)
    graph.values["m"] = value(B, 8, 5)
    graph.values["x"] = value(B, 8, 5)
    axis = solve_axes(graph)
    assert graph.ops["relu"].kind == "combine" and axis["relu"] == 1


@pytest.mark.parametrize(("channel_axis", "last"), [(1, False), (3, True)])
def test_a_flatten_reads_channels_first_or_last(channel_axis: int, last: bool) -> None:
    shape = [B, 5, 5, 5]
    shape[channel_axis] = 8
    ops = {
        "m": op("m", "masks", "x", rule="fixed", fixed_in=channel_axis, fixed_out=channel_axis, masks=masks(2, 8)),
        "flat": op("flat", "flatten", "m", rule="flatten"),
        "fc": op("fc", "mixing", "flat", rule="fixed", fixed_in=1, fixed_out=1),
    }
    values = {"x": value(*shape), "m": value(*shape), "flat": value(B, 200), "fc": value(B, 3)}
    graph = Graph(values, ops, output_key="fc")
    nodes, output = graph_nodes(graph, solve_axes(graph))
    flat = {node.name: node for node in nodes}["flat"]
    assert (flat.kind, flat.spatial, flat.channels_last) == ("flatten", 25, last)
    plan_program(nodes, output, [0, 1])


def test_a_flatten_of_a_tensor_whose_channels_sit_in_the_middle_falls_back() -> None:
    ops = {
        "m": op("m", "masks", "x", rule="fixed", fixed_in=2, fixed_out=2, masks=masks(2, 8)),
        "flat": op("flat", "flatten", "m", rule="flatten"),
    }
    values = {"x": value(B, 5, 8, 5), "m": value(B, 5, 8, 5), "flat": value(B, 200)}
    graph = Graph(values, ops, output_key="flat")
    solve_axes(graph)
    assert graph.ops["flat"].kind == "fallback"


def test_outputs_are_gathered_and_shared_fallbacks_without_a_batch_axis_run_per_member() -> None:
    graph = mlp()
    # a fallback computed from the input alone (shared) that folds the batch: (2B, 8); a per-member node reads it
    graph.ops = {"fold": op("fold", "fallback", "x", rule="none"), **graph.ops}
    graph.values["fold"] = Probed(((2 * B, 4), (2 * B + 2, 4)), B)
    graph.ops["both"] = op("both", "fallback", "fc2", "fold", rule="none")
    graph.values["both"] = value(B, 3)
    graph.output_key, graph.leaves = None, ("fc2", "both")
    nodes, output = graph_nodes(graph, solve_axes(graph))
    assert output == OUTPUT and nodes[-1].inputs == ("fc2", "both")
    assert graph.ops["fold"].batch_dependent  # repeated per member it would not be the dense model's value
    assert not graph.ops["fc1"].batch_dependent


def test_zero_channels_reduces_over_every_other_axis() -> None:
    result = np.zeros((2, 3, 4))
    result[1, 2, 0] = 1.0
    assert zero_channels(result, 1).tolist() == [True, True, False]
    assert zero_channels(result == 0, 2).tolist() == [False, True, True, True]
    assert zero_channels(np.array([0.0, 1.0]), 0).tolist() == [True, False]


def test_whole_axis_finds_the_indices_in_order_times_one_positive_factor() -> None:
    """An operation evaluated on each position's index along the axis asked about: a move keeps the indices, a sum
    over other axes multiplies them by one factor; a reversal, a mix of factors or a negative factor is no map."""
    ids = np.arange(4.0)
    assert whole_axis(np.broadcast_to(ids, (2, 3, 4)), 4) == 2
    assert whole_axis(np.broadcast_to(ids[:, None], (2, 4, 3)), 4) == 1
    assert whole_axis(np.broadcast_to(ids * 7, (2, 4)), 4) == 1, "a sum over 7 positions"
    assert whole_axis(np.broadcast_to(ids[::-1], (2, 4)), 4) is None
    assert whole_axis(np.stack([ids, 2 * ids]), 4) is None
    assert whole_axis(np.broadcast_to(-ids, (2, 4)), 4) is None
    assert whole_axis(np.zeros((2, 3)), 4) is None
