"""The insertion rule shared by every framework's insert: first layers, start, adapter reasons, seeds, the report."""

from __future__ import annotations

import pytest

import masksembles_core as mc
from masksembles_core.insertion import (
    CONVERTED,
    INSERTED,
    LEFT,
    Candidate,
    LayerReport,
    check_insert_arguments,
    leave_converted,
    plan_conversion,
    plan_insertion,
    used_outside_its_call,
)

FIRST = ("stem.conv",)
ORDER = ("stem", "stem.conv", "layer1", "layer1.conv", "layer2", "layer2.dw", "layer2.conv", "head", "head.fc")
CANDIDATES = (
    Candidate("stem.conv", "Conv2d", 3, 1),
    Candidate("layer1.conv", "Conv2d", 16, 1),
    Candidate("layer2.dw", "Conv2d", 16, 1, reason="depthwise convolution"),
    Candidate("layer2.conv", "Conv2d", 16, 1),
    Candidate("head.fc", "Linear", 32, -1),
)


def actions(report: LayerReport) -> dict[str, str]:
    return {row.path: row.action for row in report.rows}


def test_defaults_skip_the_first_layer_and_adapter_reasons() -> None:
    report = plan_insertion(CANDIDATES, ORDER, 4, 2.0, first_layers=FIRST, seed=0)
    assert actions(report) == {
        "stem.conv": LEFT,
        "layer1.conv": INSERTED,
        "layer2.dw": LEFT,
        "layer2.conv": INSERTED,
        "head.fc": INSERTED,
    }
    reasons = {row.path: row.reason for row in report.unchanged}
    assert "first layer" in reasons["stem.conv"]
    assert reasons["layer2.dw"] == "depthwise convolution"
    assert [row.channels for row in report.changed] == [16, 16, 32]
    assert [row.channel_axis for row in report.changed] == [1, 1, -1]


def test_seeds_are_derived_per_inserted_layer() -> None:
    report = plan_insertion(CANDIDATES, ORDER, 4, 2.0, first_layers=FIRST, seed=7)
    assert [row.seed for row in report.changed] == [mc.derive_seed(7, i) for i in range(3)]
    assert all(row.seed is None for row in report.unchanged)
    again = plan_insertion(CANDIDATES, ORDER, 4, 2.0, first_layers=FIRST, seed=7)
    assert again == report
    fresh = [row.seed for row in plan_insertion(CANDIDATES, ORDER, 4, 2.0, first_layers=FIRST, seed=None).changed]
    assert len(set(fresh)) == 3


def test_include_first_and_start() -> None:
    report = plan_insertion(CANDIDATES, ORDER, 4, 2.0, first_layers=FIRST, seed=0, include_first=True)
    assert actions(report)["stem.conv"] == LEFT, "included, but 3 channels give fewer than 4 distinct masks"
    assert report.unchanged[0].reason.startswith("3 input channels: only 3 distinct masks")
    report = plan_insertion(CANDIDATES, ORDER, 3, 2.0, first_layers=FIRST, seed=0, include_first=True)
    assert actions(report)["stem.conv"] == INSERTED
    report = plan_insertion(CANDIDATES, ORDER, 4, 2.0, first_layers=FIRST, seed=0, start="layer2")
    assert [row.path for row in report.changed] == ["layer2.conv", "head.fc"]
    assert {row.path: row.reason for row in report.unchanged}["layer1.conv"] == "before start='layer2'"
    report = plan_insertion(CANDIDATES, ORDER, 4, 2.0, first_layers=FIRST, seed=0, start="head.fc")
    assert [row.path for row in report.changed] == ["head.fc"]


def test_start_must_name_a_layer() -> None:
    with pytest.raises(ValueError, match=r"start='layer9' names no layer of the model; its top-level layers are"):
        plan_insertion(CANDIDATES, ORDER, 4, 2.0, first_layers=FIRST, seed=0, start="layer9")


@pytest.mark.parametrize(
    "order",
    [
        ("stem", "blocks.0.conv", "blocks.1.conv", "head"),  # PyTorch
        ("stem", "blocks/conv", "blocks/conv_1", "head"),  # Keras (a nested model) and Flax linen
        ("stem", "blocks[0]", "blocks[1].conv", "head"),
    ],
    ids=["dots", "slashes", "brackets"],
)
def test_a_start_that_names_no_layer_lists_the_top_level_names(order: tuple[str, ...]) -> None:
    candidates = [Candidate(path, "Linear", 8, -1) for path in order]
    with pytest.raises(ValueError, match=r"its top-level layers are 'blocks', 'head', 'stem'$"):
        plan_insertion(candidates, order, 4, 2.0, seed=0, start="layer9")


def test_single_channel_inputs_are_left_alone() -> None:
    candidates = (Candidate("a", "Linear", 5, -1), Candidate("b", "Linear", 1, -1), Candidate("c", "Linear", 4, -1))
    report = plan_insertion(candidates, ("a", "b", "c"), 2, 2.0, seed=0, first_layers=("a",))
    assert actions(report) == {"a": LEFT, "b": LEFT, "c": INSERTED}
    assert "single input channel" in report.unchanged[1].reason


def test_nothing_to_insert_is_an_error_that_shows_the_report() -> None:
    message = r"(?s)insert found no layer to put masks before \(1 candidates\)\n.*first layer"
    with pytest.raises(ValueError, match=message):
        plan_insertion((Candidate("fc", "Linear", 8, -1),), ("fc",), 4, 2.0, seed=0, first_layers=("fc",))


def test_report_prints_as_a_markdown_table() -> None:
    text = str(plan_insertion(CANDIDATES, ORDER, 4, 2.0, first_layers=FIRST, seed=0))
    lines = text.splitlines()
    assert lines[0] == "insert: Masksembles n=4, scale=2 on 3 of 5 layers"
    assert lines[2].startswith("| layer | type | action |")
    assert len(lines) == 4 + len(CANDIDATES)
    assert f"| layer1.conv | Conv2d | inserted | 16 | 1 | {mc.derive_seed(0, 0)} |  |" in lines


@pytest.mark.parametrize(
    "arguments,error,message",
    [
        ((0, 2.0, None, None), ValueError, "n must be an integer >= 1; received 0"),
        ((4, 0.5, None, None), ValueError, "scale must be a finite real number >= 1; received 0.5"),
        ((4, 2.0, -1, None), ValueError, "seed must be an integer >= 0; received -1"),
        ((4, 2.0, 1.5, None), TypeError, "seed must be an integer >= 0"),
        ((4, 2.0, 0, 3), TypeError, "start must be a layer path"),
    ],
    ids=["n", "scale", "seed-negative", "seed-float", "start"],
)
def test_arguments_are_checked_in_one_order(arguments: tuple[object, ...], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        check_insert_arguments(*arguments)
    assert check_insert_arguments(4, 2, None, "layer3") == (4, 2.0, None)


def test_the_first_layer_is_the_networks_not_the_first_candidate() -> None:
    """With before=Linear on a CNN, the first candidate is the head: it does not read the raw input."""
    head = (Candidate("head.fc", "Linear", 32, -1),)
    report = plan_insertion(head, ORDER, 4, 2.0, seed=0, first_layers=FIRST)
    assert [row.path for row in report.changed] == ["head.fc"]
    report = plan_insertion(CANDIDATES[1:], ORDER, 4, 2.0, seed=0)
    assert [row.path for row in report.changed] == ["layer1.conv", "layer2.conv", "head.fc"]


def test_too_few_channels_for_distinct_masks_are_left_alone() -> None:
    candidates = (Candidate("a", "Linear", 5, -1), Candidate("b", "Linear", 3, -1), Candidate("c", "Linear", 6, -1))
    report = plan_insertion(candidates, ("a", "b", "c"), 4, 2.0, seed=0)
    assert actions(report) == {"a": INSERTED, "b": LEFT, "c": INSERTED}
    assert report.unchanged[0].reason == (
        "3 input channels: only 3 distinct masks of 2 ones exist, fewer than n=4 (members would share masks)"
    )
    single = plan_insertion(candidates, ("a", "b", "c"), 4, 1.0, seed=0)
    assert [row.action for row in single.rows] == [INSERTED] * 3, "S=1 masks are all ones by design"


def test_every_first_layer_of_a_multi_input_model_is_skipped() -> None:
    """An image branch and a feature branch: both layers that read a raw input are first layers."""
    order = ("image_conv", "features_fc", "conv", "head")
    candidates = (
        Candidate("image_conv", "Conv2D", 8, -1),
        Candidate("features_fc", "Dense", 12, -1),
        Candidate("conv", "Conv2D", 16, -1),
        Candidate("head", "Dense", 24, -1),
    )
    first = ("image_conv", "features_fc")
    report = plan_insertion(candidates, order, 4, 2.0, seed=0, first_layers=first)
    assert actions(report) == {"image_conv": LEFT, "features_fc": LEFT, "conv": INSERTED, "head": INSERTED}
    reason = "the network's first layer: it reads the raw input (include_first=True masks it)"
    assert {row.reason for row in report.unchanged} == {reason}
    included = plan_insertion(candidates, order, 4, 2.0, seed=0, first_layers=first, include_first=True)
    assert [row.action for row in included.rows] == [INSERTED] * 4
    assert [row.seed for row in included.changed] == [mc.derive_seed(0, i) for i in range(4)]
    none_first = plan_insertion(candidates, order, 4, 2.0, seed=0)
    assert none_first.rows == included.rows, "no first layers: every candidate is a later layer"
    with pytest.raises(TypeError, match="first_layers must be a collection of layer paths, not one str"):
        plan_insertion(candidates, order, 4, 2.0, seed=0, first_layers="image_conv")


DROPOUTS = (
    Candidate("input_drop", "Dropout", 6, -1),
    Candidate("narrow_drop", "Dropout", 3, -1),
    Candidate("zero", "Dropout", 8, -1, reason="p=0: it does nothing"),
    Candidate("drop", "Dropout", 8, -1, note="axis -1 from the input's rank (3-D)"),
    Candidate("single", "Dropout", 1, -1),
)


def test_plan_conversion_applies_the_insert_rules_to_dropouts() -> None:
    report = plan_conversion(DROPOUTS, 4, 2.0, seed=5, first_layers=("input_drop",))
    assert report.operation == "convert_dropout"
    assert actions(report) == {
        "input_drop": LEFT,
        "narrow_drop": LEFT,
        "zero": LEFT,
        "drop": CONVERTED,
        "single": LEFT,
    }
    reasons = {row.path: row.reason for row in report.rows}
    insert_reasons = {
        row.path: row.reason
        for row in plan_insertion(
            DROPOUTS, [c.path for c in DROPOUTS], 4, 2.0, seed=5, first_layers=("input_drop",)
        ).rows
    }
    assert reasons == insert_reasons, "the same rules, the same words"
    assert reasons["input_drop"] == "the network's first layer: it reads the raw input (include_first=True masks it)"
    assert reasons["narrow_drop"].startswith("3 input channels: only 3 distinct masks")
    assert reasons["drop"] == "axis -1 from the input's rank (3-D)", "a note is kept on a converted row"
    assert report.changed[0].seed == mc.derive_seed(5, 0)
    included = plan_conversion(DROPOUTS, 3, 2.0, seed=5, first_layers=("input_drop",), include_first=True)
    assert [row.path for row in included.changed] == ["input_drop", "narrow_drop", "drop"]
    assert [row.seed for row in included.changed] == [mc.derive_seed(5, i) for i in range(3)]


def test_plan_conversion_with_nothing_to_convert_is_an_error_that_shows_the_report() -> None:
    message = r"(?s)convert_dropout converted no dropout \(1 looked at; it converts Dropout layers\)\n.*p=0"
    with pytest.raises(ValueError, match=message):
        plan_conversion(DROPOUTS[2:3], 4, 2.0, seed=0, converts="Dropout layers")


def test_leave_converted_puts_rows_back_and_errs_when_none_is_left() -> None:
    report = plan_conversion(DROPOUTS, 3, 2.0, seed=5, first_layers=("input_drop",), include_first=True)
    left = leave_converted(report, {"drop", "zero"}, "skipped at inference", "Dropout layers")
    assert [row.path for row in left.changed] == ["input_drop", "narrow_drop"]
    row = next(row for row in left.rows if row.path == "drop")
    assert (row.action, row.channels, row.seed, row.reason) == (LEFT, None, None, "skipped at inference")
    assert next(row for row in left.rows if row.path == "zero") == next(r for r in report.rows if r.path == "zero")
    with pytest.raises(ValueError, match=r"(?s)converted no dropout \(5 looked at.*skipped at inference"):
        leave_converted(left, {"input_drop", "narrow_drop"}, "skipped at inference", "Dropout layers")


def test_the_reason_for_weights_used_outside_a_layers_call() -> None:
    assert used_outside_its_call("'blocks.0.attn' (Attention)", ["weight", "bias"]) == (
        "its weights (weight, bias) are used by 'blocks.0.attn' (Attention) outside its own call: a mask on its input "
        "would not apply there"
    )
    assert used_outside_its_call("custom layer 'tied' (Tied)").startswith("its weights are used by custom layer")
