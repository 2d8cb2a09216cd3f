"""Regression with Gaussian members: the mixture, the split, NLL, coverage and calibration, against the stdlib."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import numpy as np
import pytest

from masksembles_core import metrics
from tests.core.precision import LOW_PRECISIONS, low_precision


def gaussian_members(n: int, shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Member means and variances (n, *shape), and targets drawn from the members' mixture."""
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, 1.0, (n, *shape))
    variances = rng.uniform(0.2, 2.0, (n, *shape))
    member = rng.integers(0, n, shape)
    chosen = np.take_along_axis(means, member[None], 0)[0], np.take_along_axis(variances, member[None], 0)[0]
    return means, variances, rng.normal(chosen[0], np.sqrt(chosen[1]))


@pytest.mark.parametrize("n,shape", [(1, (5,)), (4, (30,)), (3, (6, 2))], ids=["n1", "n4", "n3-vector"])
def test_mixture_and_split_match_direct_formulas(n: int, shape: tuple[int, ...]) -> None:
    means, variances, _ = gaussian_members(n, shape, seed=n)
    mean, variance = metrics.gaussian_mixture(means, variances)
    aleatoric, epistemic = metrics.uncertainty_split(means, variances)
    for index in np.ndindex(*shape):
        mus = [means[(k, *index)] for k in range(n)]
        sigmas2 = [variances[(k, *index)] for k in range(n)]
        mu = math.fsum(mus) / n
        second_moment = math.fsum(s + m * m for m, s in zip(mus, sigmas2, strict=True)) / n  # E[y^2] of the mixture
        assert mean[index] == pytest.approx(mu, rel=1e-12, abs=1e-15)
        assert variance[index] == pytest.approx(second_moment - mu * mu, rel=1e-10)
        assert aleatoric[index] == pytest.approx(math.fsum(sigmas2) / n, rel=1e-12)
        assert epistemic[index] == pytest.approx(math.fsum((m - mu) ** 2 for m in mus) / n, rel=1e-10, abs=1e-15)
    np.testing.assert_allclose(aleatoric + epistemic, variance, rtol=1e-12)
    if n == 1:
        np.testing.assert_array_equal(epistemic, 0.0)


def test_mixture_moments_match_sampling() -> None:
    means, variances = np.array([[-2.0], [0.0], [3.0]]), np.array([[0.5], [1.0], [0.1]])
    rng = np.random.default_rng(0)
    member = rng.integers(0, 3, 400_000)
    samples = rng.normal(means[member, 0], np.sqrt(variances[member, 0]))
    mean, variance = metrics.gaussian_mixture(means, variances)
    assert mean[0] == pytest.approx(samples.mean(), abs=0.02)
    assert variance[0] == pytest.approx(samples.var(), rel=0.01)


def test_gaussian_and_mixture_nll_match_the_stdlib_density() -> None:
    means, variances, y = gaussian_members(4, (25,), seed=1)
    mean, variance = metrics.gaussian_mixture(means, variances)
    direct = [-math.log(statistics.NormalDist(mean[b], math.sqrt(variance[b])).pdf(y[b])) for b in range(25)]
    assert metrics.gaussian_nll(mean, variance, y) == pytest.approx(math.fsum(direct) / 25, rel=1e-12)
    mixture = [
        -math.log(
            math.fsum(statistics.NormalDist(means[k, b], math.sqrt(variances[k, b])).pdf(y[b]) for k in range(4)) / 4
        )
        for b in range(25)
    ]
    assert metrics.mixture_nll(means, variances, y) == pytest.approx(math.fsum(mixture) / 25, rel=1e-12)
    assert metrics.mixture_nll(means[:1], variances[:1], y) == pytest.approx(
        metrics.gaussian_nll(means[0], variances[0], y), rel=1e-13
    )


def test_mixture_nll_stays_finite_far_from_every_member() -> None:
    # the densities underflow to 0 in float64; the log-sum-exp does not
    value = metrics.mixture_nll(np.array([[0.0], [1.0]]), np.array([[1e-4], [1e-4]]), np.array([100.0]))
    expected = 0.5 * math.log(2 * math.pi * 1e-4) + 99.0**2 / 2e-4 + math.log(2.0) - math.log1p(math.exp(-199 / 2e-4))
    assert value == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("level", [0.5, 0.8, 0.9, 0.95])
def test_interval_coverage_matches_the_normal_cdf(level: float) -> None:
    means, variances, y = gaussian_members(3, (500,), seed=2)
    mean, variance = metrics.gaussian_mixture(means, variances)
    inside = [
        abs(statistics.NormalDist(mean[b], math.sqrt(variance[b])).cdf(y[b]) - 0.5) <= level / 2 for b in range(500)
    ]
    assert metrics.interval_coverage(mean, variance, y, level=level) == pytest.approx(sum(inside) / 500, abs=1e-12)


def test_a_calibrated_gaussian_covers_the_nominal_level() -> None:
    rng = np.random.default_rng(3)
    mean, variance = rng.normal(size=20_000), rng.uniform(0.1, 3.0, 20_000)
    y = rng.normal(mean, np.sqrt(variance))
    for level in (0.5, 0.9):
        tolerance = 5 * math.sqrt(level * (1 - level) / 20_000)
        assert metrics.interval_coverage(mean, variance, y, level=level) == pytest.approx(level, abs=tolerance)
    curve = metrics.regression_calibration(mean, variance, y)
    assert curve.error < 0.01
    too_narrow = metrics.regression_calibration(mean, variance / 4, y)
    assert (too_narrow.observed < too_narrow.levels).all() and too_narrow.error > 0.1
    too_wide = metrics.regression_calibration(mean, variance * 4, y)
    assert (too_wide.observed > too_wide.levels).all()


def test_interval_bounds_are_included() -> None:
    z = statistics.NormalDist().inv_cdf(0.95)
    assert z == pytest.approx(1.6448536269514722)
    assert metrics.interval_coverage([0.0, 0.0], [1.0, 1.0], [z, z * (1 + 1e-12)], level=0.9) == 0.5


def test_calibration_curve_is_the_coverage_at_each_level() -> None:
    means, variances, y = gaussian_members(4, (200,), seed=4)
    mean, variance = metrics.gaussian_mixture(means, variances)
    levels = np.array([0.1, 0.5, 0.68, 0.99])
    curve = metrics.regression_calibration(mean, variance, y, levels=levels)
    expected = [metrics.interval_coverage(mean, variance, y, level=float(level)) for level in levels]
    np.testing.assert_array_equal(curve.levels, levels)
    np.testing.assert_allclose(curve.observed, expected, rtol=1e-15)
    assert curve.error == pytest.approx(np.abs(np.array(expected) - levels).mean(), rel=1e-12)
    np.testing.assert_allclose(metrics.regression_calibration(mean, variance, y).levels, np.arange(1, 20) / 20)


@pytest.mark.parametrize("kind", LOW_PRECISIONS)
def test_low_precision_outputs_are_accepted(kind: str) -> None:
    means, variances, y = gaussian_members(4, (100,), seed=5)
    rounded = [low_precision(a, kind) for a in (means, variances, y)]
    mean, variance = metrics.gaussian_mixture(rounded[0], rounded[1])
    assert mean.dtype == variance.dtype == np.float64
    exact = [a.astype(np.float64) for a in rounded]
    assert metrics.mixture_nll(*rounded) == pytest.approx(metrics.mixture_nll(*exact), rel=1e-13)
    assert metrics.gaussian_nll(mean, variance, rounded[2]) == pytest.approx(
        metrics.gaussian_nll(*metrics.gaussian_mixture(exact[0], exact[1]), exact[2]), rel=1e-13
    )


ONES = np.ones((2, 3))
ERRORS: dict[str, tuple[Callable[[], object], str]] = {
    "mixture-shapes": (
        lambda: metrics.gaussian_mixture(ONES, np.ones((2, 4))),
        r"means, variances must have the same shape; received means \(2, 3\), variances \(2, 4\)",
    ),
    "mixture-1d": (
        lambda: metrics.uncertainty_split(np.ones(3), np.ones(3)),
        r"means must have shape \(n, B, \.\.\.\)",
    ),
    "mixture-negative": (lambda: metrics.gaussian_mixture(ONES, -ONES), r"variances must be >= 0"),
    "mixture-nan": (lambda: metrics.gaussian_mixture(ONES * np.nan, ONES), r"means must be finite"),
    "nll-zero-variance": (lambda: metrics.gaussian_nll(ONES, 0 * ONES, ONES), r"variance must be > 0"),
    "nll-shapes": (
        lambda: metrics.gaussian_nll(ONES, ONES, np.ones(3)),
        r"mean, variance, y must have the same shape; received mean \(2, 3\), variance \(2, 3\), y \(3,\)",
    ),
    "nll-empty": (lambda: metrics.gaussian_nll([], [], []), r"at least one value"),
    "mixture-nll-y": (lambda: metrics.mixture_nll(ONES, ONES, ONES), r"y must have shape \(3,\) to match means"),
    "mixture-nll-zero": (lambda: metrics.mixture_nll(ONES, 0 * ONES, np.ones(3)), r"variances must be > 0"),
    "coverage-level": (
        lambda: metrics.interval_coverage(ONES, ONES, ONES, level=1.0),
        r"level must lie in \(0, 1\); received 1.0",
    ),
    "coverage-nan": (lambda: metrics.interval_coverage(ONES, ONES, ONES * np.nan), r"y must be finite"),
    "calibration-levels": (
        lambda: metrics.regression_calibration(ONES, ONES, ONES, levels=[0.5, 1.5]),
        r"levels must lie in \(0, 1\); received 1.5",
    ),
    "calibration-levels-2d": (
        lambda: metrics.regression_calibration(ONES, ONES, ONES, levels=[[0.5]]),
        r"levels must be a non-empty 1-D array",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_raises_a_clear_error(case: str) -> None:
    call, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()
