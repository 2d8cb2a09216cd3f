"""Shared parameter validation: the same type and message from every adapter."""

from __future__ import annotations

import math

import numpy as np
import pytest

import masksembles_core as mc
import masksembles_core.adapter as mca

BAD_N = [
    (0, ValueError, "n must be an integer >= 1; received 0"),
    (-3, ValueError, "n must be an integer >= 1; received -3"),
    (2.5, TypeError, r"n must be an integer >= 1; received 2.5 \(float\)"),
    (4.0, TypeError, r"n must be an integer >= 1; received 4.0 \(float\)"),
    (True, TypeError, r"n must be an integer >= 1; received True \(bool\)"),
    ("4", TypeError, r"n must be an integer >= 1; received '4' \(str\)"),
    (None, TypeError, r"n must be an integer >= 1; received None \(NoneType\)"),
]
BAD_SCALE = [
    (0.5, ValueError, r"scale must be a finite real number >= 1; received 0.5"),
    (-2.0, ValueError, r"scale must be a finite real number >= 1; received -2.0"),
    (math.nan, ValueError, r"scale must be a finite real number >= 1; received nan"),
    (math.inf, ValueError, r"scale must be a finite real number >= 1; received inf"),
    (True, TypeError, r"scale must be a finite real number >= 1; received True \(bool\)"),
    ("2", TypeError, r"scale must be a finite real number >= 1; received '2' \(str\)"),
]
BAD_CHANNELS = [
    (0, ValueError, "channels must be an integer >= 1; received 0"),
    (3.0, TypeError, r"channels must be an integer >= 1; received 3.0 \(float\)"),
    (False, TypeError, r"channels must be an integer >= 1; received False \(bool\)"),
]


@pytest.mark.parametrize("value,error,message", BAD_N, ids=lambda v: repr(v))
def test_bad_n(value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        mc.generate_masks(16, value, 2.0)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        mc.sample_masks(4, value, 2.0)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        mc.group_index(8, value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value,error,message", BAD_SCALE, ids=lambda v: repr(v))
def test_bad_scale(value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        mc.generate_masks(16, 4, value)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        mc.expected_iou(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value,error,message", BAD_CHANNELS, ids=lambda v: repr(v))
def test_bad_channels(value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        mc.generate_masks(value, 4, 2.0)  # type: ignore[arg-type]


def test_numpy_scalars_are_accepted() -> None:
    masks = mc.generate_masks(np.int32(16), np.int64(4), np.float32(2.0), seed=0)  # type: ignore[arg-type]
    assert masks.shape == (4, 16)


@pytest.mark.parametrize("mode", ["grouped", "random"])
def test_modes(mode: str) -> None:
    assert mca.check_mode(mode) == mode


@pytest.mark.parametrize("mode", ["Grouped", "", None, 1])
def test_bad_mode(mode: object) -> None:
    with pytest.raises(ValueError, match=r"mode must be one of \('grouped', 'random'\); received"):
        mca.check_mode(mode)


@pytest.mark.parametrize("program", ["auto", "packed", "dense"])
def test_programs(program: str) -> None:
    assert mca.check_program(program) == program


@pytest.mark.parametrize("program", ["fast", "Dense", None])
def test_bad_program(program: object) -> None:
    with pytest.raises(ValueError, match=r"program must be one of \('auto', 'packed', 'dense'\); received"):
        mca.check_program(program)


def test_channel_axis() -> None:
    assert mca.check_channel_axis(-1) == -1
    with pytest.raises(ValueError, match="axis 0 is the batch"):
        mca.check_channel_axis(0)
    with pytest.raises(TypeError, match="channel_axis must be a non-zero integer"):
        mca.check_channel_axis(1.0)


def test_check_input_shape() -> None:
    assert mca.check_input_shape((8, 16, 4, 4), channels=16, channel_axis=1) == 1
    assert mca.check_input_shape((None, 4, 4, 16), channels=16, channel_axis=-1) == 3
    with pytest.raises(
        ValueError, match=r"expects 16 channels on axis 1, layout \(B, C, D2, D3\); received shape \(8, 3, 4, 4\)"
    ):
        mca.check_input_shape((8, 3, 4, 4), channels=16, channel_axis=1)
    with pytest.raises(
        ValueError, match=r"Masksembles2D expects an input of rank 4; received shape \(8, 16\) \(rank 2\)"
    ):
        mca.check_input_shape((8, 16), channels=16, channel_axis=1, ranks=(4,), layer="Masksembles2D")
    with pytest.raises(ValueError, match=r"rank >= 2"):
        mca.check_input_shape((8,), channels=16, channel_axis=1)
    with pytest.raises(ValueError, match="channel_axis=5 is not a non-batch axis"):
        mca.check_input_shape((8, 16), channels=16, channel_axis=5)
    with pytest.raises(ValueError, match="channel_axis=-2 is not a non-batch axis"):
        mca.check_input_shape((8, 16), channels=16, channel_axis=-2)


def test_gaussian_head_and_floor() -> None:
    assert mca.check_gaussian_head("log_variance", 1e-6) == ("log_variance", 1e-6)
    assert mca.check_gaussian_head("variance", 1) == ("variance", 1.0)
    with pytest.raises(ValueError, match=r"head must be one of \('log_variance', 'variance'\); received 'std'"):
        mca.check_gaussian_head("std", 1e-6)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"min_variance must be a finite number > 0; received"):
            mca.check_gaussian_head("variance", bad)
    with pytest.raises(TypeError, match=r"min_variance must be a finite number > 0; received '1' \(str\)"):
        mca.check_gaussian_head("variance", "1")


@pytest.mark.parametrize(
    "output,target,squeeze",
    [((8, 2), (8,), False), ((8, 2), (8, 1), True), ((None, 2), (8,), False), ((4, 3, 2), (4, 3), False)],
)
def test_gaussian_target_shapes(output: tuple[int | None, ...], target: tuple[int, ...], squeeze: bool) -> None:
    assert mca.check_gaussian_target(output, target) is squeeze


@pytest.mark.parametrize(
    "output,target,message",
    [
        ((8, 3), (8,), r"expects outputs of shape \(B, \.\.\., 2\) .*received shape \(8, 3\)"),
        ((2,), (), r"expects outputs of shape \(B, \.\.\., 2\)"),
        ((8, 2), (8, 2), r"target of a Gaussian NLL loss must have shape \(8,\) \(or \(8, 1\)\) .*received \(8, 2\)"),
        ((8, 2), (4,), r"must have shape \(8,\) .*received \(4,\)"),
    ],
)
def test_bad_gaussian_target_shapes(output: tuple[int, ...], target: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mca.check_gaussian_target(output, target)


def test_check_batch_sizes() -> None:
    assert mca.check_batch_sizes([("inputs['input_ids']", 5), ("inputs['attention_mask']", 5)]) == 5
    with pytest.raises(ValueError, match=r"the same size in all; received inputs\[0\]: 5, inputs\[1\]: 4$"):
        mca.check_batch_sizes([("inputs[0]", 5), ("inputs[1]", 4)])
    with pytest.raises(ValueError, match=r"^the inputs hold no tensor or array to take the batch from$"):
        mca.check_batch_sizes([])
