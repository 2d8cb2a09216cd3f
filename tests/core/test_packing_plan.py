"""The framework-free planner behind packed inference: liveness rules and layouts."""

from __future__ import annotations

import numpy as np
import pytest

from masksembles_core.packing import (
    GraphNode,
    Placement,
    block_indices,
    channel_indices,
    flatten_layout,
    gather_plan,
    kept_channels,
    norm_affine,
    plan_members,
)

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
    placements = plan_members(nodes, "fc2", [0])
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
    placements = plan_members(nodes, "out", range(3))
    assert placements["x"].shared and not placements["m"].shared and not placements["add"].shared
    assert [layout.tolist() for layout in placements["m"].layouts] == [[0, 1], [1, 2], [2, 3]]


def test_flatten_expands_channels() -> None:
    nodes = chain(GraphNode("m", "masks", (), 4, masks=MASKS), GraphNode("flat", "flatten", (), 8, spatial=2))
    nodes[-1] = GraphNode("fc2", "mixing", ("flat",), 2)
    placements = plan_members(nodes, "fc2", [2])
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
    placements = plan_members(nodes, "fc2", [0])
    assert placements["flat"].layouts[0].tolist() == [0, 1, 4, 5], "(s, c): s*4 + c for c in {0, 1}"


def test_shared_prefix_computes_the_union_once() -> None:
    nodes = chain(GraphNode("relu", "channelwise", (), 4), GraphNode("m", "masks", (), 4, masks=MASKS[:2]))
    placements = plan_members(nodes, "fc2", range(2))
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
