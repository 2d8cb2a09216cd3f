"""CRPS of a Gaussian and of the members' exact Gaussian mixture, against properscoring and uncertainty-toolbox.

Both references are in the test-metrics dependency group (every core session installs it): a missing one fails
the import here instead of skipping the cross-check.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import properscoring  # type: ignore[import-not-found, import-untyped, unused-ignore]
import pytest
import uncertainty_toolbox  # type: ignore[import-not-found, import-untyped, unused-ignore]
from scipy import stats  # type: ignore[import-not-found, import-untyped, unused-ignore]

from masksembles_core import metrics
from tests.core.precision import LOW_PRECISIONS, low_precision


def gaussians(n: int, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, 2.0, (n, batch)), rng.uniform(0.05, 3.0, (n, batch)), rng.normal(0.0, 2.0, batch)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_crps_gaussian_matches_properscoring_and_uncertainty_toolbox(seed: int) -> None:
    means, variances, y = gaussians(1, 500, seed)
    mean, variance = means[0], variances[0]
    expected = float(properscoring.crps_gaussian(y, mu=mean, sig=np.sqrt(variance)).mean())
    assert metrics.crps_gaussian(mean, variance, y) == pytest.approx(expected, rel=1e-12)
    toolbox = uncertainty_toolbox.metrics_scoring_rule.crps_gaussian(mean, np.sqrt(variance), y)
    assert metrics.crps_gaussian(mean, variance, y) == pytest.approx(float(toolbox), rel=1e-12)


def test_crps_gaussian_far_in_the_tails() -> None:
    mean, variance, y = np.zeros(4), np.full(4, 1e-4), np.array([40.0, -40.0, 1e-3, 0.0])
    expected = properscoring.crps_gaussian(y, mu=mean, sig=np.sqrt(variance))
    assert metrics.crps_gaussian(mean, variance, y) == pytest.approx(float(expected.mean()), rel=1e-12)


def mixture_crps_by_quadrature(means: np.ndarray, variances: np.ndarray, y: np.ndarray) -> float:
    """properscoring's CRPS by numerical integration of the mixture's CDF, sample by sample."""
    values = []
    for b in range(y.size):
        components = [stats.norm(m, math.sqrt(v)) for m, v in zip(means[:, b], variances[:, b], strict=True)]

        class Mixture:
            @staticmethod
            def cdf(x: np.ndarray, parts: list[stats.rv_continuous] = components) -> np.ndarray:
                return np.asarray(np.mean([part.cdf(x) for part in parts], axis=0), dtype=np.float64)

        stds = np.sqrt(variances[:, b])
        low, high = float((means[:, b] - 12 * stds).min()), float((means[:, b] + 12 * stds).max())
        values.append(properscoring.crps_quadrature(y[b : b + 1], Mixture(), xmin=low, xmax=high, tol=1e-6)[0])
    return float(np.mean(values))


@pytest.mark.parametrize("n", [2, 4])
def test_crps_mixture_matches_properscoring_quadrature(n: int) -> None:
    means, variances, y = gaussians(n, 12, seed=n)
    means[0] += 4.0  # a bimodal mixture, which a moment-matched Gaussian misses
    expected = mixture_crps_by_quadrature(means, variances, y)
    assert metrics.crps_mixture(means, variances, y) == pytest.approx(expected, rel=1e-7)
    mean, variance = metrics.gaussian_mixture(means, variances)
    assert metrics.crps_gaussian(mean, variance, y) != pytest.approx(expected, rel=1e-3)


def test_crps_mixture_of_one_member_and_of_narrow_members() -> None:
    means, variances, y = gaussians(1, 300, seed=5)
    assert metrics.crps_mixture(means, variances, y) == pytest.approx(
        metrics.crps_gaussian(means[0], variances[0], y), rel=1e-12
    )
    # members with tiny variances: the CRPS of the ensemble of their means (properscoring's crps_ensemble)
    means, _, y = gaussians(5, 300, seed=6)
    ensemble = properscoring.crps_ensemble(y, means.T).mean()
    assert metrics.crps_mixture(means, np.full_like(means, 1e-16), y) == pytest.approx(float(ensemble), rel=1e-6)


def test_crps_mixture_keeps_trailing_output_axes() -> None:
    rng = np.random.default_rng(7)
    means, variances, y = rng.normal(size=(3, 10, 2)), rng.uniform(0.5, 1.0, (3, 10, 2)), rng.normal(size=(10, 2))
    per_output = [metrics.crps_mixture(means[..., j], variances[..., j], y[:, j]) for j in range(2)]
    assert metrics.crps_mixture(means, variances, y) == pytest.approx(np.mean(per_output), rel=1e-12)


@pytest.mark.parametrize("kind", LOW_PRECISIONS)
def test_low_precision_inputs_are_scored_in_float64(kind: str) -> None:
    means, variances, y = (low_precision(a, kind) for a in gaussians(3, 50, seed=8))
    exact = [a.astype(np.float64) for a in (means, variances, y)]
    assert metrics.crps_mixture(means, variances, y) == pytest.approx(metrics.crps_mixture(*exact), rel=1e-13)


ONES = np.ones((2, 3))
ERRORS: dict[str, tuple[Callable[[], object], str]] = {
    "gaussian-zero-variance": (lambda: metrics.crps_gaussian(ONES, 0 * ONES, ONES), r"variance must be > 0"),
    "gaussian-shapes": (lambda: metrics.crps_gaussian(ONES, ONES, np.ones(3)), r"mean, variance, y must have the same"),
    "mixture-zero-variance": (lambda: metrics.crps_mixture(ONES, 0 * ONES, np.ones(3)), r"variances must be > 0"),
    "mixture-y": (lambda: metrics.crps_mixture(ONES, ONES, ONES), r"y must have shape \(3,\) to match means"),
    "mixture-nan": (lambda: metrics.crps_mixture(ONES * np.nan, ONES, np.ones(3)), r"means must be finite"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_raises_a_clear_error(case: str) -> None:
    call, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()
