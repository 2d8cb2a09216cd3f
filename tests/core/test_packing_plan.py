"""The framework-free planner behind packed inference: liveness rules and layouts."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import pytest

from masksembles_core.packing import (
    AxisConflict,
    AxisRule,
    Cost,
    FoldConflict,
    GraphNode,
    Move,
    Placement,
    block_indices,
    channel_axes,
    channel_indices,
    flatten_layout,
    gather_plan,
    kept_channels,
    moves_between,
    norm_affine,
    plan_program,
    program_macs,
)


def placements_of(nodes: list[GraphNode], output: str, members: range | list[int]) -> dict[str, Placement]:
    """Every node's placement in the program of ``members``."""
    return {step.name: step.placement for step in plan_program(nodes, output, members).steps}


MASKS = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=bool)


def chain(*middle: GraphNode) -> list[GraphNode]:
    nodes = [GraphNode("x", "input", (), 3), GraphNode("fc1", "mixing", ("x",), 4)]
    previous = "fc1"
    for node in middle:
        nodes.append(
            GraphNode(node.name, node.kind, (previous,), node.channels, node.zero_preserving, node.spatial, node.masks)
        )
        previous = node.name
    nodes.append(GraphNode("fc2", "mixing", (previous,), 2))
    return nodes


def test_masks_between_mixing_layers_keep_only_the_mask() -> None:
    nodes = chain(GraphNode("relu", "channelwise", (), 4), GraphNode("m", "masks", (), 4, masks=MASKS))
    for k in range(3):
        kept = kept_channels(nodes, "fc2", k)
        assert kept["fc1"].tolist() == MASKS[k].tolist(), "the producer computes only the member's channels"
        assert kept["m"].tolist() == MASKS[k].tolist()
        assert kept["fc2"].all() and kept["x"].all()


def test_non_zero_preserving_op_after_masks_keeps_the_zeros() -> None:
    nodes = chain(
        GraphNode("m", "masks", (), 4, masks=MASKS), GraphNode("bn", "channelwise", (), 4, zero_preserving=False)
    )
    kept = kept_channels(nodes, "fc2", 0)
    assert kept["bn"].all() and kept["m"].all(), "BatchNorm maps 0 elsewhere: the zeros must exist"
    assert kept["fc1"].tolist() == MASKS[0].tolist(), "but the producer need not compute them"


def test_a_node_that_keeps_nothing_gets_one_padding_position() -> None:
    disjoint = ~MASKS
    nodes = chain(
        GraphNode("m1", "masks", (), 4, masks=MASKS),
        GraphNode("bn", "channelwise", (), 4, zero_preserving=False),
        GraphNode("m2", "masks", (), 4, masks=disjoint),
    )
    kept = kept_channels(nodes, "fc2", 0)
    assert not kept["fc1"].any(), "m1 zeroes every channel m2 lets through: fc1's values never reach the output"
    placements = placements_of(nodes, "fc2", [0])
    assert placements["fc1"].layouts[0].tolist() == [-1]
    assert placements["m2"].layouts[0].tolist() == np.flatnonzero(disjoint[0]).tolist()


def test_residual_keeps_what_either_branch_needs() -> None:
    nodes = [
        GraphNode("x", "input", (), 4),
        GraphNode("m", "masks", ("x",), 4, masks=MASKS),
        GraphNode("conv", "mixing", ("m",), 4),
        GraphNode("add", "add", ("conv", "x"), 4),
        GraphNode("out", "mixing", ("add",), 2),
    ]
    kept = kept_channels(nodes, "out", 1)
    assert kept["add"].all() and kept["conv"].all()
    assert kept["m"].tolist() == MASKS[1].tolist()
    placements = placements_of(nodes, "out", range(3))
    assert placements["x"].shared and not placements["m"].shared and not placements["add"].shared
    assert [layout.tolist() for layout in placements["m"].layouts] == [[0, 1], [1, 2], [2, 3]]


def test_flatten_expands_channels() -> None:
    nodes = chain(GraphNode("m", "masks", (), 4, masks=MASKS), GraphNode("flat", "flatten", (), 8, spatial=2))
    nodes[-1] = GraphNode("fc2", "mixing", ("flat",), 2)
    placements = placements_of(nodes, "fc2", [2])
    assert placements["flat"].layouts[0].tolist() == [4, 5, 6, 7]
    assert flatten_layout(np.array([1, -1]), 3).tolist() == [3, 4, 5, -1, -1, -1]
    assert flatten_layout(np.array([1, -1]), 3, channels=4, channels_last=True).tolist() == [1, -1, 5, -1, 9, -1]


def test_channels_last_flatten() -> None:
    nodes = chain(
        GraphNode("m", "masks", (), 4, masks=MASKS), GraphNode("flat", "flatten", (), 8, spatial=2, channels_last=True)
    )
    nodes[-2] = GraphNode("flat", "flatten", ("m",), 8, spatial=2, channels_last=True)
    nodes[-1] = GraphNode("fc2", "mixing", ("flat",), 2)
    kept = kept_channels(nodes, "fc2", 0)
    assert kept["m"].tolist() == MASKS[0].tolist()
    placements = placements_of(nodes, "fc2", [0])
    assert placements["flat"].layouts[0].tolist() == [0, 1, 4, 5], "(s, c): s*4 + c for c in {0, 1}"


def test_shared_prefix_computes_the_union_once() -> None:
    nodes = chain(GraphNode("relu", "channelwise", (), 4), GraphNode("m", "masks", (), 4, masks=MASKS[:2]))
    placements = placements_of(nodes, "fc2", range(2))
    assert placements["fc1"].shared and placements["fc1"].layouts[0].tolist() == [0, 1, 2]
    plan = gather_plan(placements["relu"], placements["m"], [mask.astype(float) for mask in MASKS[:2]])
    assert plan is not None
    index, scale = plan
    assert index.tolist() == [0, 1, 1, 2] and scale.tolist() == [1, 1, 1, 1]


def test_gather_plan_zero_fill_and_padding() -> None:
    source = Placement(False, (np.array([0, 2]), np.array([1, -1])))
    target = Placement(False, (np.array([0, 1, 2]), np.array([1, -1, -1])))
    index, scale = gather_plan(source, target)  # type: ignore[misc]
    assert index.tolist() == [0, 0, 1, 2, 2, 2], "padding reads the first position of its own block"
    assert scale.tolist() == [1, 0, 1, 1, 1, 1], "channel 1 is a known zero for member 0; padding keeps 1"
    assert gather_plan(source, source) is None
    shared_source = Placement(True, (np.array([0, 1, 2]),))
    shared_target = Placement(True, (np.array([0, 2]),))
    index, scale = gather_plan(shared_source, shared_target)  # type: ignore[misc]
    assert index.tolist() == [0, 2] and scale.tolist() == [1, 1], "a shared target is computed once, not per member"
    index, scale = gather_plan(shared_source, Placement(True, (np.array([0, 1]),)))  # type: ignore[misc]
    assert index.tolist() == [0, 1] and scale.tolist() == [1, 1], "dropping trailing channels is a move too"
    wide = Placement(False, (np.array([0, 1, 2]), np.array([0, 1, 2])))
    narrow = Placement(False, (np.array([0, 1]), np.array([0, 1])))
    index, _ = gather_plan(wide, narrow)  # type: ignore[misc]
    assert index.tolist() == [0, 1, 3, 4]


def test_block_and_channel_indices() -> None:
    r, c, valid = block_indices([np.array([2, -1])], [np.array([0, 1, -1])])
    assert r.shape == c.shape == valid.shape == (1, 2, 3)
    assert valid.tolist() == [[[True, True, False], [False, False, False]]]
    index, ok = channel_indices([np.array([3, -1]), np.array([0, 1])])
    assert index.tolist() == [3, 0, 0, 1] and ok.tolist() == [True, False, True, True]


def test_graph_errors() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        kept_channels([GraphNode("x", "conv", (), 2)], "x", 0)
    with pytest.raises(ValueError, match=r"reads \['y'\] before they are defined"):
        kept_channels([GraphNode("x", "input", (), 2), GraphNode("z", "add", ("x", "y"), 2)], "z", 0)
    with pytest.raises(ValueError, match="output 'w' is not a node"):
        kept_channels([GraphNode("x", "input", (), 2)], "w", 0)


def test_norm_affine_is_batchnorm_in_eval() -> None:
    mean, var, weight, bias = np.array([1.0, -2.0]), np.array([4.0, 0.25]), np.array([2.0, 3.0]), np.array([0.5, 0.0])
    x = np.array([[3.0, -1.0], [0.0, 2.0]])
    scale, shift = norm_affine(mean, var, weight, bias, 1e-5)
    np.testing.assert_allclose(x * scale + shift, (x - mean) / np.sqrt(var + 1e-5) * weight + bias, rtol=1e-15)
    scale, shift = norm_affine(mean, var, None, None, 0.0)
    assert scale.tolist() == [0.5, 2.0] and shift.tolist() == [-0.5, 4.0]


# --- the program: grouped convolutions, combines, concatenations, channel norms, fallbacks and moves -------------


DISJOINT = np.array([[1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1]], dtype=bool)


def masked_input(*middle: GraphNode, channels: int = 6) -> list[GraphNode]:
    """x -> fc (mixing) -> masks (DISJOINT) -> middle... ; the last node reads the one before it."""
    nodes = [
        GraphNode("x", "input", (), 3),
        GraphNode("fc", "mixing", ("x",), channels),
        GraphNode("m", "masks", ("fc",), channels, masks=DISJOINT),
    ]
    previous = "m"
    for node in middle:
        inputs = node.inputs or (previous,)
        nodes.append(GraphNode(node.name, node.kind, inputs, node.channels, node.zero_preserving, node.spatial,
                               node.masks, node.channels_last, node.groups, node.zero_rule, node.parts,
                               node.batch_dependent))  # fmt: skip
        previous = node.name
    return nodes


def layouts(placement: Placement) -> list[list[int]]:
    return [layout.tolist() for layout in placement.layouts]


def test_depthwise_keeps_zero_only_without_bias() -> None:
    for bias_zero, expected in ((True, [[0, 1], [2, 3], [4, 5]]), (False, [list(range(6))] * 3)):
        nodes = masked_input(
            GraphNode("dw", "grouped", (), 6, zero_preserving=bias_zero, groups=6),
            GraphNode("out", "mixing", (), 2),
        )
        program = plan_program(nodes, "out", range(3))
        assert layouts(program.step("dw").placement) == expected
        step = program.step("dw")
        assert step.groups == len(expected[0]), "one group per kept channel, padded to the widest member"
        assert layouts(step.edges[0].placement) == expected, "depthwise: each output reads its own input channel"


def test_grouped_keeps_whole_groups() -> None:
    nodes = masked_input(
        GraphNode("g", "grouped", (), 6, zero_preserving=True, groups=3), GraphNode("out", "mixing", (), 2)
    )
    step = plan_program(nodes, "out", range(3)).step("g")
    assert layouts(step.placement) == [[0, 1], [2, 3], [4, 5]] and step.groups == 1
    nodes = masked_input(
        GraphNode("g", "grouped", (), 6, zero_preserving=False, groups=2),
        GraphNode("m2", "masks", (), 6, masks=DISJOINT[[1, 2, 0]]),
        GraphNode("out", "mixing", (), 2),
    )
    step = plan_program(nodes, "out", range(3)).step("g")
    padded = [-1, -1, -1]
    assert layouts(step.placement) == [[0, 1, 2, 3, 4, 5], [3, 4, 5, *padded], [0, 1, 2, *padded]], (
        "member 0 needs channels 2 and 3 (both groups), member 1 channels 4 and 5, member 2 channels 0 and 1"
    )
    assert step.groups == 2
    assert layouts(step.edges[0].placement) == [[0, 1, 2, 3, 4, 5], [3, 4, 5, *padded], [0, 1, 2, *padded]]


@pytest.mark.parametrize("rule,zero_after", [("all", False), ("any", True), ("never", False)])
def test_combine_rules(rule: str, zero_after: bool) -> None:
    nodes = [
        GraphNode("x", "input", (), 3),
        GraphNode("fc", "mixing", ("x",), 6),
        GraphNode("m", "masks", ("fc",), 6, masks=DISJOINT),
        GraphNode("gate", "mixing", ("x",), 6),
        GraphNode("c", "combine", ("m", "gate"), 6, zero_rule=rule),
        GraphNode("out", "mixing", ("c",), 2),
    ]
    kept = kept_channels(nodes, "out", 0)
    assert kept["c"].tolist() == (DISJOINT[0].tolist() if zero_after else [True] * 6)


def test_combine_rule_reads_only_its_zero_inputs() -> None:
    """select(predicate, a, b): zero where a and b are, whatever the predicate (which is not zero there)."""
    nodes = [
        GraphNode("x", "input", (), 3),
        GraphNode("fc", "mixing", ("x",), 6),
        GraphNode("m", "masks", ("fc",), 6, masks=DISJOINT),
        GraphNode("predicate", "channelwise", ("m",), 6, zero_preserving=False),
        GraphNode("scaled", "channelwise", ("m",), 6),
        GraphNode("select", "combine", ("predicate", "scaled", "m"), 6, zero_inputs=(1, 2)),
        GraphNode("out", "mixing", ("select",), 2),
    ]
    kept = kept_channels(nodes, "out", 0)
    assert kept["select"].tolist() == DISJOINT[0].tolist(), "both values are zero off the mask"
    placements = placements_of(nodes, "out", range(3))
    assert layouts(placements["select"]) == [[0, 1], [2, 3], [4, 5]], "the next layer reads the member's channels"
    every = [*nodes[:5], GraphNode("select", "combine", ("predicate", "scaled", "m"), 6), nodes[-1]]
    assert kept_channels(every, "out", 0)["select"].all(), "read over every input, the predicate keeps it live"
    with pytest.raises(ValueError, match=r"zero_inputs \(3,\) must be positions of a combine's inputs"):
        kept_channels([*nodes[:5], GraphNode("select", "combine", ("predicate", "m"), 6, zero_inputs=(3,))], "m", 0)


def padding_mask_graph(mask_source: str, rule: str = "any", hidden: str = "m") -> list[GraphNode]:
    """``(hidden * mask) -> Linear``, the mask (one channel, broadcast along the six) computed from ``mask_source``:
    the input (a padding mask from the token ids) or a masked value."""
    return [
        GraphNode("x", "input", (), 3),
        GraphNode("fc", "mixing", ("x",), 6),
        GraphNode("m", "masks", ("fc",), 6, masks=DISJOINT),
        GraphNode("mask", "fallback", (mask_source,), 1),
        GraphNode("masked", "combine", (hidden, "mask"), 6, zero_rule=rule, broadcast=(1,)),
        GraphNode("out", "mixing", ("masked",), 2),
    ]


def test_a_shared_operand_broadcast_along_the_channels_is_read_as_it_is_by_every_member() -> None:
    program = plan_program(padding_mask_graph("x"), "out", range(3))
    assert program.fallbacks == ("mask",)
    step = program.step("masked")
    assert step.node.kind == "combine" and not step.placement.dense
    assert layouts(step.placement) == [[0, 1], [2, 3], [4, 5]], "a product is zero where the masked value is"
    hidden, mask = step.edges
    assert layouts(hidden.placement) == [[0, 1], [2, 3], [4, 5]] and hidden.moves == ()
    assert mask.placement.shared and mask.placement.dense and layouts(mask.placement) == [[0]]
    assert mask.moves == (), "the mask is read once, as the input's program computed it"
    costs = {"fc": Cost(1), "out": Cost(1)}
    without = [*padding_mask_graph("x")[:3], GraphNode("out", "mixing", ("m",), 2)]
    assert program_macs(program, costs) == program_macs(plan_program(without, "out", range(3)), costs), (
        "the layers around the product compact as they do without it"
    )


def test_a_combine_whose_broadcast_operand_is_not_shared_falls_back() -> None:
    """A mask computed from a masked value (its norm over the channels) differs per member: each member's block
    cannot read one value, so the product runs on the member-stacked batch."""
    program = plan_program(padding_mask_graph("m"), "out", range(3))
    assert program.fallbacks == ("mask", "masked")
    step = program.step("masked")
    assert step.node.kind == "fallback" and step.placement.dense and not step.placement.shared
    assert [[m.kind for m in edge.moves] for edge in step.edges] == [["select", "to_batch"], []]
    assert kept_channels(padding_mask_graph("m"), "out", 0)["m"].tolist() == DISJOINT[0].tolist()


@pytest.mark.parametrize("rule,zero_after", [("any", True), ("all", False), ("never", False)])
def test_a_broadcast_operand_is_not_read_by_the_zero_rule(rule: str, zero_after: bool) -> None:
    """``x * mask`` is zero where x is, whatever the mask; ``x + mask`` is not."""
    kept = kept_channels(padding_mask_graph("x", rule), "out", 1)
    assert kept["masked"].tolist() == (DISJOINT[1].tolist() if zero_after else [True] * 6)
    assert kept["mask"].tolist() == [True], "the broadcast operand is needed whole"


def test_channel_wide_operands_follow_the_combine_rules_beside_a_broadcast_one() -> None:
    nodes = [
        *padding_mask_graph("x")[:4],
        GraphNode("gate", "mixing", ("x",), 6),
        GraphNode("sum", "combine", ("m", "mask", "gate"), 6, zero_rule="all", broadcast=(1,)),
        GraphNode("product", "combine", ("m", "mask", "gate"), 6, zero_rule="any", broadcast=(1,)),
        GraphNode("select", "combine", ("mask", "m", "m"), 6, zero_rule="all", zero_inputs=(1, 2), broadcast=(0,)),
        GraphNode("only", "combine", ("m", "mask"), 6, zero_rule="any", zero_inputs=(1,), broadcast=(1,)),
        GraphNode("cat", "concat", ("sum", "product", "select", "only"), 24, parts=(6, 6, 6, 6)),
        GraphNode("out", "mixing", ("cat",), 2),
    ]
    kept = kept_channels(nodes, "out", 2)
    assert kept["sum"].all(), "gate is not zero off the mask"
    assert kept["product"].tolist() == DISJOINT[2].tolist(), "zero where the masked value is"
    assert kept["select"].tolist() == DISJOINT[2].tolist(), "both values read by the rule are zero"
    assert kept["only"].all(), "a rule that reads only the broadcast operand knows no zero"


def test_broadcast_positions_must_be_inputs_of_a_fallback_or_a_combine_of_channel_wide_inputs() -> None:
    x = GraphNode("x", "input", (), 3)
    for node in (
        GraphNode("relu", "channelwise", ("x",), 3, broadcast=(0,)),
        GraphNode("c", "combine", ("x", "x"), 3, broadcast=(2,)),
        GraphNode("c", "combine", ("x",), 3, broadcast=(0,)),
    ):
        with pytest.raises(ValueError, match="must be inputs of a fallback, or of a combine"):
            plan_program([x, node], node.name, [0])
    with pytest.raises(ValueError, match="combine node 'c' has 3 channels"):
        plan_program([x, GraphNode("one", "fallback", ("x",), 1), GraphNode("c", "combine", ("x", "one"), 3)], "c", [0])


def test_concat_lays_parts_out_one_after_another() -> None:
    nodes = [
        GraphNode("x", "input", (), 3),
        GraphNode("fc", "mixing", ("x",), 6),
        GraphNode("m", "masks", ("fc",), 6, masks=DISJOINT),
        GraphNode("other", "mixing", ("x",), 2),
        GraphNode("cat", "concat", ("m", "other"), 8, parts=(6, 2)),
        GraphNode("out", "mixing", ("cat",), 2),
    ]
    program = plan_program(nodes, "out", range(3))
    assert layouts(program.step("cat").placement) == [[0, 1, 6, 7], [2, 3, 6, 7], [4, 5, 6, 7]]
    assert program.step("other").placement.shared
    assert [layouts(edge.placement) for edge in program.step("cat").edges] == [
        [[0, 1], [2, 3], [4, 5]],
        [[0, 1], [0, 1], [0, 1]],
    ]


def test_norm_reads_every_channel_zeros_written_by_the_move() -> None:
    nodes = masked_input(GraphNode("ln", "norm", (), 6), GraphNode("out", "mixing", (), 2))
    program = plan_program(nodes, "out", range(3))
    assert layouts(program.step("m").placement) == [[0, 1], [2, 3], [4, 5]], "the masks keep only what is live"
    step = program.step("ln")
    assert layouts(step.placement) == [list(range(6))] * 3
    (move,) = step.edges[0].moves
    assert move.kind == "select" and move.index is not None and move.scale is not None
    assert move.scale.reshape(3, 6).tolist() == DISJOINT.astype(float).tolist(), "dropped channels come in as 0"


def grn_scale(g: np.ndarray, channels: int, eps: float) -> np.ndarray:
    """GRN's ``g / (g.mean(channels) + eps)`` over the last axis, the mean's divisor ``channels``."""
    scale: np.ndarray = g / (g.sum(-1, keepdims=True) / channels + eps)
    return scale


def test_mean_ratio_computes_each_members_block_with_the_full_width_divisor() -> None:
    """GRN's ratio after a mask: each member's block holds only its live channels (no move in), and its mean over
    the block's channels divided by the full width is the dense mean, the dropped channels' zeros counted."""
    nodes = masked_input(GraphNode("ratio", "mean_ratio", (), 6), GraphNode("out", "mixing", (), 2))
    program = plan_program(nodes, "out", range(3))
    step = program.step("ratio")
    assert layouts(step.placement) == [[0, 1], [2, 3], [4, 5]] == layouts(step.edges[0].placement)
    assert step.edges[0].moves == (), "it reads the masks' blocks as they are"
    assert program.fallbacks == ()
    g = np.random.default_rng(0).random((4, 6)) + 0.5
    for k, layout in enumerate(layouts(step.placement)):
        dense = grn_scale(np.where(DISJOINT[k], g, 0.0), 6, 1e-6)
        np.testing.assert_allclose(grn_scale(g[:, layout], 6, 1e-6), dense[:, layout], rtol=1e-12)
        assert (dense[:, ~DISJOINT[k]] == 0).all(), "zero-preserving: the dropped channels stay zero"


def test_mean_ratio_that_is_not_zero_preserving_keeps_the_zeros_it_reads() -> None:
    """Without eps, 0 / 0 is not 0: every channel is computed, the dropped ones written as zeros by the move, and
    padding never enters the mean (the block is the full width)."""
    nodes = masked_input(
        GraphNode("ratio", "mean_ratio", (), 6, zero_preserving=False), GraphNode("out", "mixing", (), 2)
    )
    step = plan_program(nodes, "out", range(3)).step("ratio")
    assert layouts(step.placement) == [list(range(6))] * 3
    (move,) = step.edges[0].moves
    assert move.scale is not None and move.scale.reshape(3, 6).tolist() == DISJOINT.astype(float).tolist()


def test_mean_ratio_reads_every_channel_its_input_holds_and_keeps_the_ones_consumers_need() -> None:
    """A ratio of the whole output of a mixing layer (no mask between): it reads all of it, per member; a mask after
    it keeps each member's channels for the next layer."""
    nodes = [
        GraphNode("x", "input", (), 3),
        GraphNode("fc", "mixing", ("x",), 6),
        GraphNode("m", "masks", ("fc",), 6, masks=DISJOINT),
        GraphNode("fc2", "mixing", ("m",), 6),
        GraphNode("ratio", "mean_ratio", ("fc2",), 6),
        GraphNode("m2", "masks", ("ratio",), 6, masks=DISJOINT[::-1].copy()),
        GraphNode("out", "mixing", ("m2",), 2),
    ]
    program = plan_program(nodes, "out", range(3))
    assert layouts(program.step("fc2").placement) == [list(range(6))] * 3
    assert layouts(program.step("ratio").placement) == [list(range(6))] * 3
    assert layouts(program.step("m2").placement) == [[4, 5], [2, 3], [0, 1]]
    assert program.fallbacks == ()


def test_fallback_runs_dense_and_its_neighbours_move() -> None:
    nodes = masked_input(
        GraphNode("f", "fallback", (), 6),
        GraphNode("relu", "channelwise", (), 6),
        GraphNode("m2", "masks", (), 6, masks=DISJOINT),
        GraphNode("out", "mixing", (), 2),
    )
    program = plan_program(nodes, "out", range(3))
    assert program.fallbacks == ("f",)
    assert program.step("f").placement.dense and not program.step("f").placement.shared
    assert [m.kind for m in program.step("f").edges[0].moves] == ["select", "to_batch"]
    assert program.step("relu").placement.dense, "elementwise on dense input stays dense"
    assert [m.kind for m in program.step("m2").edges[0].moves] == ["to_channels", "select"]
    kept = kept_channels(nodes, "out", 1)
    assert kept["m"].tolist() == DISJOINT[1].tolist(), "known zeros are written back, not computed"


def test_shared_fallback_and_batch_dependent_fallback() -> None:
    nodes = [
        GraphNode("x", "input", (), 3),
        GraphNode("f", "fallback", ("x",), 3),
        GraphNode("g", "fallback", ("x",), 3, batch_dependent=True),
        GraphNode("fc", "mixing", ("f",), 6),
        GraphNode("m", "masks", ("fc",), 6, masks=DISJOINT),
        GraphNode("sum", "fallback", ("m", "g", "f"), 6),
        GraphNode("out", "mixing", ("sum",), 2),
    ]
    program = plan_program(nodes, "out", range(3))
    assert program.step("f").placement.shared and not program.step("g").placement.shared
    kinds = [[m.kind for m in edge.moves] for edge in program.step("sum").edges]
    assert kinds == [["select", "to_batch"], [], ["tile"]]


def test_a_batch_dependent_node_needs_the_input_of_a_member_that_needs_none_of_its_output() -> None:
    # x - x.mean(0) in predict averages every member's rows: member 0 needs none of its output (m2 drops every
    # channel of member 0), but members 1 and 2 read member 0's rows through the mean
    nodes = [
        GraphNode("x", "input", (), 4),
        GraphNode("m1", "masks", ("x",), 4, masks=MASKS),
        GraphNode("centred", "fallback", ("m1",), 4, batch_dependent=True),
        GraphNode("m2", "masks", ("centred",), 4, masks=np.array([[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]], bool)),
        GraphNode("out", "mixing", ("m2",), 2),
    ]
    assert not kept_channels(nodes, "out", 0)["centred"].any()
    assert kept_channels(nodes, "out", 0)["m1"].tolist() == MASKS[0].tolist()


def folded_region(mask_source: str) -> list[GraphNode]:
    """q/k/v Linear layers after masks, an attention region folded over them (the mask read as it is), its output
    read by a masked projection."""
    return [
        GraphNode("x", "input", (), 4),
        GraphNode("m", "masks", ("x",), 4, masks=MASKS),
        GraphNode("mask", "fallback", (mask_source,), 1),
        GraphNode("q", "mixing", ("m",), 4),
        GraphNode("v", "mixing", ("m",), 4),
        GraphNode("scores", "fallback", ("q", "mask"), 1, folded=True, broadcast=(1,)),
        GraphNode("context", "fallback", ("scores", "v"), 4, folded=True),
        GraphNode("m2", "masks", ("context",), 4, masks=np.array([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 1, 0]], bool)),
        GraphNode("proj", "mixing", ("m2",), 2),
    ]


def test_a_folded_fallback_holds_member_blocks_and_reads_a_broadcast_input_as_it_is() -> None:
    program = plan_program(folded_region("x"), "proj", range(3))
    assert program.fallbacks == ("mask",) and program.folded == ("scores", "context")
    assert program.step("mask").placement.shared and program.step("mask").placement.dense
    for name in ("scores", "context"):
        placement = program.step(name).placement
        assert not placement.shared and not placement.dense and placement.full and len(placement.layouts) == 3
    assert layouts(program.step("q").placement) == [list(range(4))] * 3, "the region reads every channel"
    assert [[m.kind for m in edge.moves] for edge in program.step("scores").edges] == [[], []], "no move in or out"
    assert [[m.kind for m in edge.moves] for edge in program.step("context").edges] == [[], []]
    assert [m.kind for m in program.step("m2").edges[0].moves] == ["select"], "the masks read the blocks"
    macs = program_macs(program, {"scores": Cost(fallback=10), "context": Cost(fallback=20), "proj": Cost(1)})
    assert macs == {"dense": 3 * (30 + 2 * 4), "packed": 3 * 30 + 3 * 2 * 2, "fallback": 0}


def test_a_folded_fallback_whose_broadcast_input_runs_per_member_conflicts() -> None:
    with pytest.raises(FoldConflict) as conflict:
        plan_program(folded_region("m"), "proj", range(3))
    assert conflict.value.node == "scores"
    with pytest.raises(ValueError, match="only a fallback folds"):
        plan_program([GraphNode("x", "input", (), 3), GraphNode("f", "channelwise", ("x",), 3, folded=True)], "f", [0])


def test_moves_between_placements() -> None:
    shared_full = Placement(True, (np.arange(4),))
    member_dense = Placement(False, (np.arange(4),) * 2, dense=True)
    shared_dense = Placement(True, (np.arange(4),), dense=True)
    member = Placement(False, (np.array([0, 1]), np.array([2, -1])))
    assert moves_between(shared_full, shared_dense, 2) == ()
    assert [m.kind for m in moves_between(shared_dense, member_dense, 2)] == ["tile"]
    assert [m.kind for m in moves_between(member_dense, member, 2)] == ["to_channels", "select"]
    (select, to_batch) = moves_between(member, member_dense, 2)
    assert to_batch.kind == "to_batch"
    assert select.index is not None and select.scale is not None
    assert select.index.tolist() == [0, 1, 0, 0, 2, 2, 2, 2] and select.scale.tolist() == [1, 1, 0, 0, 0, 0, 1, 0]
    assert Move("select", np.array([0, 1, 0, 1]), np.ones(4)).repeats == 2


def test_channel_axes_propagate_through_rules_and_report_the_conflicting_node() -> None:
    ranks: dict[Hashable, int] = {"x": 4, "conv": 4, "relu": 4, "perm": 4, "ln": 4, "fc": 4, "head": 2}

    def permuted(axis: int) -> int | None:  # permute(0, 2, 3, 1)
        return (0, 3, 1, 2)[axis] if axis else None

    rules = [
        AxisRule("conv", ("x",), "fixed", fixed_in=1, fixed_out=1),
        AxisRule("relu", ("conv",), "same"),
        AxisRule("perm", ("relu",), "map", mapped=permuted),
        AxisRule("ln", ("perm",), "fixed", fixed_in=3, fixed_out=3),
    ]
    assert channel_axes(rules, ranks.__getitem__) == {"x": 1, "conv": 1, "relu": 1, "perm": 3, "ln": 3}
    backwards = [AxisRule("relu", ("x",), "same"), AxisRule("fc", ("relu",), "fixed", fixed_in=3, fixed_out=3)]
    assert channel_axes(backwards, ranks.__getitem__) == {"x": 3, "relu": 3, "fc": 3}
    assert channel_axes([AxisRule("relu", ("x",), "same")], ranks.__getitem__) == {"x": 3, "relu": 3}, "last axis"
    clash = [*rules[:2], AxisRule("fc", ("relu",), "fixed", fixed_in=3, fixed_out=3)]
    with pytest.raises(AxisConflict) as conflict:
        channel_axes(clash, ranks.__getitem__)
    assert conflict.value.node == "fc"
    with pytest.raises(AxisConflict):
        channel_axes([AxisRule("head", ("x",), "fixed", fixed_in=1, fixed_out=3)], ranks.__getitem__)
