"""Statistics, paper formulas, the batch-grouping rule, tile/untile and the reference layer."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import masksembles_core as mc


def test_importing_the_core_imports_no_framework() -> None:
    code = (
        "import sys, masksembles_core\n"
        "loaded = [m for m in ('torch', 'tensorflow', 'keras', 'jax', 'flax') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mask_stats_hand_made() -> None:
    masks = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1]])
    stats = mc.mask_stats(masks)
    # pairs: (0,1) 1/3, (0,2) 2/4, (1,2) 2/4
    assert stats.ones_per_mask == (2, 2, 4)
    assert stats.mean_iou == pytest.approx((1 / 3 + 0.5 + 0.5) / 3)
    assert stats.min_iou == pytest.approx(1 / 3) and stats.max_iou == 0.5
    assert stats.coverage == 1.0
    assert stats.effective_scale == pytest.approx((1 + 1 / stats.mean_iou) / 2)
    assert stats.dropout_rate == pytest.approx(1 - 8 / 12)
    text = repr(stats)
    assert "n=3" in text and "channels=4" in text and "ones_per_mask=2..4" in text and "coverage=100.0%" in text


def test_mask_stats_edge_cases() -> None:
    single = mc.mask_stats(np.ones((1, 8)))
    assert math.isnan(single.mean_iou) and math.isnan(single.effective_scale)
    assert single.dropout_rate == 0.0
    disjoint = mc.mask_stats(np.eye(4))
    assert disjoint.mean_iou == 0.0 and disjoint.effective_scale == math.inf
    partial = mc.mask_stats(np.array([[1, 0, 0], [1, 0, 0]]))
    assert partial.coverage == pytest.approx(1 / 3)


def test_effective_scale_recovers_the_requested_scale() -> None:
    for scale in (1.5, 2.0, 4.0):
        stats = mc.mask_stats(mc.generate_masks(2048, 4, scale, seed=0))
        assert stats.effective_scale == pytest.approx(scale, rel=0.1)


def test_paper_formulas() -> None:
    assert mc.expected_iou(1.0) == 1.0
    assert mc.expected_iou(2.0) == pytest.approx(1 / 3)
    assert mc.expected_width(2, 4, 2.0) == pytest.approx(4 * (1 - 0.5**4))
    assert mc.expected_width(10, 1, 3.0) == pytest.approx(10)
    assert mc.expected_width(10, 5, 1.0) == pytest.approx(10)


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(1, 600), n=st.integers(1, 40))
def test_group_index_rule(batch: int, n: int) -> None:
    index = mc.group_index(batch, n)
    assert index.shape == (batch,) and index.dtype == np.int64
    assert np.array_equal(index, [(i * n) // batch for i in range(batch)])
    assert (np.diff(index) >= 0).all() and index[0] == 0 and index[-1] <= n - 1
    sizes = np.bincount(index, minlength=n)
    if batch >= n:
        assert sizes.max() - sizes.min() <= 1 and (sizes > 0).all()
    if batch % n == 0:
        assert np.array_equal(index, np.repeat(np.arange(n), batch // n)), "the classic contiguous split"


def test_group_index_edges() -> None:
    assert mc.group_index(0, 4).shape == (0,)
    assert mc.group_index(3, 4).tolist() == [0, 1, 2]
    assert mc.group_index(6, 4).tolist() == [0, 0, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="batch_size must be an integer >= 0; received -1"):
        mc.group_index(-1, 4)


def test_tile_untile() -> None:
    x = np.arange(6.0).reshape(3, 2)
    tiled = mc.tile(x, 4)
    assert tiled.shape == (12, 2)
    assert np.array_equal(mc.group_index(12, 4), np.repeat(np.arange(4), 3)), "block k gets mask k"
    members = mc.untile(tiled * 10, 4)
    assert members.shape == (4, 3, 2)
    for k in range(4):
        assert np.array_equal(members[k], x * 10)
    with pytest.raises(ValueError, match="multiple of n=4"):
        mc.untile(np.zeros((6, 2)), 4)


def test_tiled_forward_gives_every_member() -> None:
    masks = mc.generate_masks(8, 4, 2.0, seed=0)
    x = np.random.default_rng(0).normal(size=(5, 8))
    members = mc.untile(mc.apply_masks(mc.tile(x, 4), masks, channel_axis=1), 4)
    for k in range(4):
        assert np.array_equal(members[k], x * masks[k])


@pytest.mark.parametrize(
    "shape,axis", [((6, 5), 1), ((7, 5, 3), 1), ((7, 3, 5), -1), ((5, 5, 2, 3), 1), ((9, 2, 3, 5), 3)]
)
def test_apply_masks_matches_a_loop(shape: tuple[int, ...], axis: int) -> None:
    masks = mc.generate_masks(5, 3, 2.0, seed=1)
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    y = mc.apply_masks(x, masks, channel_axis=axis)
    assert y.dtype == np.float32 and y.shape == x.shape
    index = mc.group_index(shape[0], 3)
    for i in range(shape[0]):
        expected = np.moveaxis(
            np.moveaxis(x[i], axis - 1 if axis > 0 else axis, -1) * masks[index[i]], -1, axis - 1 if axis > 0 else axis
        )
        assert np.array_equal(y[i], expected)
    grad = mc.apply_masks_grad(np.ones_like(x), masks, channel_axis=axis)
    assert np.array_equal(grad, mc.apply_masks(np.ones_like(x), masks, channel_axis=axis))


def test_apply_masks_ieee_semantics() -> None:
    masks = np.array([[True, False]])
    x = np.array([[np.inf, np.inf], [np.nan, np.nan], [-2.0, -2.0], [3.0, 3.0]], dtype=np.float16)
    with np.errstate(invalid="ignore"):
        y = mc.apply_masks(x, masks, channel_axis=1)
    assert y.dtype == np.float16
    assert y[0, 0] == np.inf and np.isnan(y[0, 1]), "masked inf becomes NaN (inf * 0)"
    assert np.isnan(y[1]).all(), "NaN stays NaN, masked or not"
    assert y[2, 1] == 0 and np.signbit(y[2, 1]), "masked negative gives -0.0"
    assert y[3, 1] == 0 and not np.signbit(y[3, 1])


def test_apply_masks_errors() -> None:
    masks = np.ones((2, 4), dtype=bool)
    with pytest.raises(ValueError, match="expects 4 channels on axis 1"):
        mc.apply_masks(np.zeros((2, 3)), masks, channel_axis=1)
    with pytest.raises(ValueError, match="axis 0 is the batch"):
        mc.apply_masks(np.zeros((2, 4)), masks, channel_axis=0)
