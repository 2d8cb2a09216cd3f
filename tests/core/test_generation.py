"""Mask generation: the paper's algorithm and the fixed-width form."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import masksembles_core as mc
import masksembles_core.adapter as mca


def assert_fixed_width_invariants(masks: np.ndarray, channels: int, n: int) -> None:
    assert masks.shape == (n, channels)
    assert masks.dtype == np.bool_
    ones = masks.sum(axis=1)
    assert (ones == ones[0]).all(), f"unequal ones per mask: {ones}"
    assert masks.any(axis=0).all(), "a channel is used by no mask"


def distinct_rows(masks: np.ndarray) -> int:
    return len({row.tobytes() for row in masks})


def generate(channels: int, n: int, scale: float, seed: int) -> np.ndarray:
    """``generate_masks``, checking the distinctness promise and that it warns exactly when it cannot keep it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        masks = mc.generate_masks(channels, n, scale, seed=seed)
    possible = math.comb(channels, mc.ones_per_mask(channels, n, scale))
    assert distinct_rows(masks) == min(n, possible), "as many distinct masks as exist, up to n"
    expected = [mc.DuplicateMasksWarning] if possible < n and scale > 1.0 else []
    assert [w.category for w in caught] == expected, [str(w.message) for w in caught]
    return masks


@settings(max_examples=300, deadline=None)
@given(
    channels=st.integers(1, 3000),
    n=st.integers(1, 64),
    scale=st.floats(1.0, 1e6, allow_nan=False, allow_infinity=False),
    seed=st.integers(0, 2**63),
)
def test_generate_masks_invariants(channels: int, n: int, scale: float, seed: int) -> None:
    masks = generate(channels, n, scale, seed)
    assert_fixed_width_invariants(masks, channels, n)
    assert masks.sum(axis=1)[0] == mc.ones_per_mask(channels, n, scale)


@settings(max_examples=1000, deadline=None)
@given(
    channels=st.integers(2, 64),
    n=st.integers(1, 8),
    scale=st.one_of(st.sampled_from([1.0, 1.5, 2.0, 3.0, 5.0]), st.floats(1.0, 100.0)),
    seed=st.integers(0, 2**63),
)
def test_masks_are_distinct_whenever_possible(channels: int, n: int, scale: float, seed: int) -> None:
    """The widths where repeats are likely: distinct masks (or the warning), fixed width, full coverage."""
    assert_fixed_width_invariants(generate(channels, n, scale, seed), channels, n)


@pytest.mark.parametrize("channels", [4, 5, 6, 8])
def test_no_repeated_masks_where_the_first_generator_repeated_them(channels: int) -> None:
    """n=4, S=2 repeated a mask for 135, 80, 30 and 2 of these 200 seeds at 4, 5, 6 and 8 channels."""
    for seed in range(200):
        assert distinct_rows(generate(channels, 4, 2.0, seed)) == 4, seed


@pytest.mark.parametrize(
    "channels,n,scale,distinct",
    [(1, 4, 2.0, 1), (4, 8, 2.0, 6), (5, 16, 1.5, 10), (12, 1000, 2.0, 924), (4, 4, 1.1, 1)],
)
def test_too_few_distinct_masks_warns_with_the_numbers(channels: int, n: int, scale: float, distinct: int) -> None:
    ones = mc.ones_per_mask(channels, n, scale)
    message = (
        rf"{n} masks cannot all differ: the number of distinct masks with {ones} ones among {channels} channels "
        rf"is {distinct}, less than n, so members share masks \(channels={channels}, n={n}, scale={scale}\)"
    )
    with pytest.warns(mc.DuplicateMasksWarning, match=message):
        masks = mc.generate_masks(channels, n, scale, seed=0)
    assert distinct_rows(masks) == distinct
    assert_fixed_width_invariants(masks, channels, n)


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 300), n=st.integers(1, 32), scale=st.floats(1.0, 50.0), seed=st.integers(0, 2**32))
def test_sample_masks_is_the_papers_algorithm(m: int, n: int, scale: float, seed: int) -> None:
    masks = mc.sample_masks(m, n, scale, seed=seed)
    assert masks.shape[0] == n
    assert (masks.sum(axis=1) == m).all()
    assert masks.any(axis=0).all(), "all-zero columns must be dropped"
    assert m <= masks.shape[1] <= round(m * scale)


# Parameter sets on which the official masksembles 1.1.1 hangs or raises.
OFFICIAL_FAILURES = (
    [(c, 1, s) for c in (16, 64, 512) for s in (3.0, 4.0, 6.0, 20.0)]
    + [(c, n, 1.0) for c in (16, 64, 512) for n in (6, 8, 16, 32)]
    + [(c, 16, 1.5) for c in (16, 64, 512)]
    + [(c, n, s) for c in (1, 2, 9, 10, 32, 64) for n in (2, 4, 8) for s in (2.0, 3.0, 5.0, 6.0)]
    + [(128, 4, 7.0), (2048, 4, 100.0)]
)


@pytest.mark.parametrize("channels,n,scale", OFFICIAL_FAILURES, ids=lambda v: str(v))
def test_succeeds_where_official_package_fails(channels: int, n: int, scale: float) -> None:
    assert_fixed_width_invariants(generate(channels, n, scale, seed=0), channels, n)


@pytest.mark.parametrize("channels", [1, 3, 100])
@pytest.mark.parametrize("n", [1, 2, 4, 16])
def test_scale_one_is_a_single_model(channels: int, n: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # identical all-ones masks are the point here, not a repeat to warn about
        assert mc.generate_masks(channels, n, 1.0, seed=0).all()


@pytest.mark.parametrize("scale", [1.0, 3.0, 1e9])
def test_one_mask_uses_every_channel(scale: float) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mc.generate_masks(50, 1, scale, seed=0).all()


@pytest.mark.parametrize("channels,n", [(64, 4), (63, 4), (1000, 7), (12, 12)])
def test_large_scale_gives_disjoint_masks(channels: int, n: int) -> None:
    masks = mc.generate_masks(channels, n, 1e6, seed=0)
    uses = masks.sum(axis=0)
    if channels % n == 0:
        assert (uses == 1).all(), "a partition: every channel in exactly one mask"
    else:  # equal widths force ceil(C/n)*n - C shared channels
        assert uses.sum() - channels == n * -(-channels // n) - channels


def test_scale_controls_overlap_monotonically() -> None:
    ious = [mc.mask_stats(mc.generate_masks(256, 4, s, seed=1)).mean_iou for s in (1.0, 1.5, 2, 3, 5, 10, 100)]
    assert ious == sorted(ious, reverse=True)


def test_same_int_seed_same_masks_and_none_is_fresh() -> None:
    a = mc.generate_masks(128, 4, 2.0, seed=123)
    assert np.array_equal(a, mc.generate_masks(128, 4, 2.0, seed=np.int64(123)))
    assert not np.array_equal(a, mc.generate_masks(128, 4, 2.0, seed=124))
    draws = [mc.generate_masks(128, 4, 2.0) for _ in range(3)]
    assert not all(np.array_equal(draws[0], d) for d in draws[1:])


def test_generator_seed_is_used_and_advanced() -> None:
    rng = np.random.default_rng(5)
    first, second = mc.generate_masks(64, 4, 2.0, seed=rng), mc.generate_masks(64, 4, 2.0, seed=rng)
    assert not np.array_equal(first, second)
    assert np.array_equal(first, mc.generate_masks(64, 4, 2.0, seed=np.random.default_rng(5)))


@pytest.mark.parametrize(
    "seed,error", [(-1, ValueError), (1.5, TypeError), ("7", TypeError), (True, TypeError)], ids=str
)
def test_bad_seed(seed: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"seed must be None, an integer >= 0 or a numpy\.random\.Generator; received"):
        mc.generate_masks(8, 2, 2.0, seed=seed)  # type: ignore[arg-type]


def test_derive_seed_is_deterministic_and_distinct() -> None:
    seeds = [mc.derive_seed(42, i) for i in range(20)]
    assert seeds == [mc.derive_seed(42, i) for i in range(20)]
    assert len(set(seeds)) == 20
    assert mc.derive_seed(None, 0) != mc.derive_seed(None, 0)


def test_papers_iou_formula_for_fixed_width_masks() -> None:
    """n=4, channels=512, scale in [1, 6]: mean IoU within 0.03 of 1/(2S-1)."""
    for scale in np.linspace(1.0, 6.0, 21):
        ious = [mc.mask_stats(mc.generate_masks(512, 4, scale, seed=seed)).mean_iou for seed in range(20)]
        assert abs(np.mean(ious) - mc.expected_iou(scale)) <= 0.03, scale


@pytest.mark.parametrize("scale", [1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_papers_width_formula(scale: float, n: int) -> None:
    """Mean width of the paper's algorithm within 2% of m*S*(1-(1-1/S)^n)."""
    m = 100
    widths = [mc.sample_masks(m, n, scale, seed=seed).shape[1] for seed in range(300)]
    expected = mc.expected_width(m, n, scale) * round(m * scale) / (m * scale)
    assert abs(np.mean(widths) / expected - 1) <= 0.02


def test_papers_figure_example() -> None:
    """Fig. 'Masks generation algorithm': N=4, M=2, S=2 starts from 4 positions."""
    masks = mc.sample_masks(2, 4, 2.0, seed=0)
    assert masks.shape[1] <= 4 and (masks.sum(axis=1) == 2).all()


@pytest.mark.parametrize(
    "masks,message",
    [
        (np.ones(4), "2-D"),
        (np.ones((0, 4)), "n >= 1"),
        (np.ones((2, 0)), "channels >= 1"),
        (np.array([[1, 0], [0, 2]]), "only 0 and 1"),
        (np.array([[1.0, 0.5]]), "only 0 and 1"),
        (np.array([["a", "b"]]), "boolean or numeric"),
        (np.array([[1, 0], [0, 0], [0, 0]]), r"mask\(s\) \[1, 2\] are all zero"),
        (np.array([[np.nan, 1.0]]), "only 0 and 1"),
    ],
)
def test_validate_masks_errors(masks: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mc.validate_masks(masks)


@pytest.mark.parametrize("dtype", [bool, np.int8, np.uint8, np.int64, np.float16, np.float32, np.float64])
def test_validate_masks_accepts_binary(dtype: type) -> None:
    raw: np.ndarray = np.array([[1, 0, 1], [0, 1, 1]]).astype(dtype)
    result = mc.validate_masks(raw)
    assert result.dtype == np.bool_ and np.array_equal(result, raw.astype(bool))
    assert result is not raw


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=1, max_size=6))
def test_validate_masks_property(rows: list[list[bool]]) -> None:
    array = np.array(rows)
    if array.any(axis=1).all():
        assert np.array_equal(mc.validate_masks(array.astype(np.float32)), array)
    else:
        with pytest.raises(ValueError, match="all zero"):
            mc.validate_masks(array)


def test_layer_arguments_given_or_generated_masks() -> None:
    given_masks = np.array([[1, 0, 1], [0, 1, 1]])
    arguments = mca.layer_arguments(3, 2, 2.0, masks=given_masks, channel_axis=1)
    assert np.array_equal(arguments.masks_for(3), given_masks.astype(bool))
    arguments = mca.layer_arguments(None, None, None, masks=given_masks, channel_axis=-1)
    assert arguments.n == 2 and np.array_equal(arguments.masks_for(None), given_masks.astype(bool))
    with pytest.raises(ValueError, match="channels=4 does not match the masks' width 3"):
        arguments.masks_for(4)
    with pytest.raises(ValueError, match="n=3 does not match the 2 masks"):
        mca.layer_arguments(3, 3, 2.0, masks=given_masks, channel_axis=1)
    with pytest.raises(ValueError, match="channels=4 does not match the masks' width 3"):
        mca.layer_arguments(4, 2, 2.0, masks=given_masks, channel_axis=1)
    with pytest.raises(ValueError, match="n and scale are required when masks is not given"):
        mca.layer_arguments(None, 2, None, channel_axis=1)
    with pytest.raises(ValueError, match="channels is required when masks is not given"):
        mca.layer_arguments(None, 4, 2.0, channel_axis=1).masks_for(None)
    generated = mca.layer_arguments(16, 4, 2.0, seed=3, channel_axis=1).masks_for(16)
    assert np.array_equal(generated, mc.generate_masks(16, 4, 2.0, seed=3))
    rng = np.random.default_rng(5)
    from_generator = mca.layer_arguments(16, 4, 2.0, seed=rng, channel_axis=1).masks_for(16)
    assert np.array_equal(from_generator, mc.generate_masks(16, 4, 2.0, seed=np.random.default_rng(5)))


def test_generation_grid_is_fast_enough_to_not_matter() -> None:
    """Bounded work: the whole benchmark grid generates (timing lives in benchmarks/)."""
    for channels, scale in itertools.product((64, 256, 1024, 2048), (1.5, 2, 3, 5)):
        assert_fixed_width_invariants(mc.generate_masks(channels, 4, scale, seed=0), channels, 4)
