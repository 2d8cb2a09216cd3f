"""Temperature scaling: scikit-learn's logistic regression, brute-force NLL minima, the optimality condition."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from sklearn.linear_model import LogisticRegression  # type: ignore[import-not-found, import-untyped, unused-ignore]

from masksembles_core import metrics
from tests.core.precision import LOW_PRECISIONS, low_precision


def direct_ensemble_nll(logits: np.ndarray, labels: np.ndarray, temperature: float) -> float:
    """NLL of mean_k softmax(logits[k] / T), logits (n, B, K), written out sample by sample in the log domain."""
    total = 0.0
    for b, label in enumerate(labels):
        log_probabilities = []
        for member in logits[:, b] / temperature:
            top = max(member)
            log_probabilities.append(member[label] - top - math.log(math.fsum(math.exp(v - top) for v in member)))
        top = max(log_probabilities)
        mean = math.fsum(math.exp(v - top) for v in log_probabilities) / len(log_probabilities)
        total -= top + math.log(mean)
    return total / len(labels)


def overconfident(members: int, batch: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits (members, batch, classes) that favour the label, scaled up so that the model is overconfident."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, batch)
    shared = rng.normal(size=(batch, classes))
    shared[np.arange(batch), labels] += 1.5
    return 3.0 * (shared + 0.7 * rng.normal(size=(members, batch, classes))), labels


def test_binary_sigmoid_logit_matches_sklearn_logistic_regression() -> None:
    # temperature scaling of one logit z is logistic regression on z without intercept: p = sigmoid(z / T)
    rng = np.random.default_rng(0)
    z = rng.normal(0.0, 3.0, 400)
    labels = (rng.random(400) < 1.0 / (1.0 + np.exp(-z / 2.5))).astype(np.int64)
    regression = LogisticRegression(C=1e12, fit_intercept=False, tol=1e-12, max_iter=10_000).fit(z[:, None], labels)
    expected = 1.0 / float(regression.coef_[0, 0])
    assert metrics.fit_temperature(z[:, None], labels) == pytest.approx(expected, rel=1e-5)
    # the same model as two softmax logits (0, z), shifted by any constant
    two_logits = np.stack([np.zeros_like(z), z], axis=1) + rng.normal(size=(400, 1))
    assert metrics.fit_temperature(two_logits, labels) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("members", [1, 4])
def test_fitted_temperature_is_the_brute_force_nll_minimum(members: int) -> None:
    logits, labels = overconfident(members, 60, 5, seed=members)
    fitted = metrics.fit_temperature(logits if members > 1 else logits[0], labels)
    grid = np.exp(np.linspace(math.log(0.3), math.log(30.0), 801))
    nll = np.array([direct_ensemble_nll(logits, labels, t) for t in grid])
    best = int(nll.argmin())
    assert 0 < best < grid.size - 1  # an interior minimum
    assert grid[best - 1] <= fitted <= grid[best + 1]
    assert direct_ensemble_nll(logits, labels, fitted) <= nll[best] + 1e-12
    assert fitted > 1.0  # the logits were made overconfident


def test_single_model_optimum_satisfies_the_first_order_condition() -> None:
    # d NLL / d(1/T) = mean_b (E_p[z_b] - z_b,y) = 0 at the optimum: expected and true-class logits agree on average
    logits, labels = overconfident(1, 200, 7, seed=3)
    scaled = logits[0] / metrics.fit_temperature(logits[0], labels)
    probs = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    expected_logit = (probs * logits[0]).sum(axis=1)
    gradient = (expected_logit - logits[0][np.arange(200), labels]).mean()
    assert abs(gradient) < 1e-7


def test_per_member_fits_each_member_alone() -> None:
    logits, labels = overconfident(3, 80, 4, seed=5)
    logits[1] *= 3.0  # one member much more overconfident than the others
    per_member = metrics.fit_temperature(logits, labels, per_member=True)
    assert per_member.shape == (3,)
    for k in range(3):
        assert per_member[k] == pytest.approx(metrics.fit_temperature(logits[k], labels), rel=1e-8)
    assert per_member[1] == pytest.approx(3.0 * per_member[0], rel=0.5)
    shared = metrics.fit_temperature(logits, labels)
    assert direct_ensemble_nll(logits, labels, shared) < direct_ensemble_nll(logits, labels, float(per_member[0]))


def test_temperature_scales_with_the_logits_and_apply_divides() -> None:
    logits, labels = overconfident(4, 50, 3, seed=7)
    fitted = metrics.fit_temperature(logits, labels)
    assert metrics.fit_temperature(logits * 2.0, labels) == pytest.approx(2.0 * fitted, rel=1e-7)
    assert metrics.fit_temperature(metrics.apply_temperature(logits, fitted), labels) == pytest.approx(1.0, rel=1e-7)
    np.testing.assert_array_equal(metrics.apply_temperature(logits, 2.0), logits / 2.0)
    per_member = np.array([1.0, 2.0, 4.0, 8.0])
    scaled = metrics.apply_temperature(logits, per_member)
    for k in range(4):
        np.testing.assert_allclose(scaled[k], logits[k] / per_member[k], rtol=1e-15)


def test_separable_and_tiny_sets_return_a_bound_with_a_warning() -> None:
    separable = np.array([[4.0, 0.0, 1.0], [0.0, 2.0, 1.0]])
    with pytest.warns(UserWarning, match="decreases to the lower bound"):
        assert metrics.fit_temperature(separable, np.array([0, 1])) == 0.01
    with pytest.warns(UserWarning, match="decreases to the lower bound"):
        assert metrics.fit_temperature(np.array([[[2.0, 0.0]]]), np.array([0]), bounds=(0.5, 2.0)) == 0.5
    with pytest.warns(UserWarning, match="increases to the upper bound: .*no better than a uniform guess"):
        assert metrics.fit_temperature(np.array([[3.0, 0.0]]), np.array([1])) == 100.0
    with pytest.warns(UserWarning, match=r"of members \[1\]"):
        per_member = metrics.fit_temperature(
            np.array([[[2.0, 0.0], [0.0, 1.0]], [[9.0, 0.0], [0.0, 9.0]]]), [0, 0], per_member=True
        )
    assert per_member[1] == 100.0 and 0.01 < per_member[0] < 100.0


def test_a_nll_that_does_not_depend_on_the_temperature_gives_one() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert metrics.fit_temperature(np.full((5, 3), 2.0), np.array([0, 1, 2, 0, 1])) == 1.0
        assert metrics.fit_temperature(np.zeros((2, 4, 1)), np.array([0, 1, 1, 0])) == 1.0


def test_huge_logits_do_not_overflow() -> None:
    logits, labels = overconfident(2, 40, 3, seed=9)
    fitted = metrics.fit_temperature(logits * 1e3, labels, bounds=(1.0, 1e5))
    assert fitted == pytest.approx(1e3 * metrics.fit_temperature(logits, labels), rel=1e-6)


@settings(max_examples=120, deadline=None)
@given(
    logits=arrays(
        np.float64,
        st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 4)),
        elements=st.floats(-60, 60, allow_nan=False),
    ),
    seed=st.integers(0, 2**16),
)
def test_any_small_set_gives_a_finite_temperature_within_bounds(logits: np.ndarray, seed: int) -> None:
    # logits that happen to be probabilities (rows in [0, 1] summing to 1) are refused by design, not a finite case
    assume(not (((logits >= 0) & (logits <= 1)).all() and np.allclose(logits.sum(-1), 1.0)))
    classes = max(logits.shape[2], 2)
    labels = np.random.default_rng(seed).integers(0, classes, logits.shape[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fitted = metrics.fit_temperature(logits, labels)
        per_member = metrics.fit_temperature(logits, labels, per_member=True)
    assert math.isfinite(fitted) and 0.01 <= fitted <= 100.0
    assert np.isfinite(per_member).all() and ((per_member >= 0.01) & (per_member <= 100.0)).all()
    grid = [0.01, 0.1, 1.0, 10.0, 100.0]
    assert (
        direct_ensemble_nll(_two_columns(logits), labels, fitted)
        <= min(direct_ensemble_nll(_two_columns(logits), labels, t) for t in grid) + 1e-9
    )


def _two_columns(logits: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros_like(logits), logits], axis=-1) if logits.shape[-1] == 1 else logits


@pytest.mark.parametrize("kind", LOW_PRECISIONS)
def test_low_precision_logits_are_accepted(kind: str) -> None:
    logits, labels = overconfident(4, 100, 5, seed=11)
    rounded = low_precision(logits, kind)
    assert rounded.dtype == np.float32
    assert metrics.fit_temperature(rounded, labels) == pytest.approx(metrics.fit_temperature(logits, labels), rel=2e-2)
    assert metrics.apply_temperature(rounded, 2.0).dtype == np.float64


GOOD_LOGITS = np.zeros((2, 3, 4))
WITH_NAN = GOOD_LOGITS.copy()
WITH_NAN[1, 2, 0] = np.nan

ERRORS: dict[str, tuple[Callable[[], object], str]] = {
    "nan": (
        lambda: metrics.fit_temperature(WITH_NAN, [0, 1, 2]),
        r"logits must be finite \(−inf, a masked class, is allowed\); received 1 NaN",
    ),
    "1d": (
        lambda: metrics.fit_temperature(np.zeros(3), [0, 1, 2]),
        r"logits must have shape \(n, B, K\) .* or \(B, K\) \(one member\)",
    ),
    "empty": (lambda: metrics.fit_temperature(np.zeros((0, 4)), []), r"logits needs n >= 1 members and B >= 1 samples"),
    "labels-range": (lambda: metrics.fit_temperature(GOOD_LOGITS, [0, 1, 4]), r"labels must lie in \[0, 4\)"),
    "binary-labels-range": (
        lambda: metrics.fit_temperature(np.zeros((3, 1)), [0, 1, 2]),
        r"labels must lie in \[0, 2\) for 2 classes",
    ),
    "labels-shape": (
        lambda: metrics.fit_temperature(GOOD_LOGITS, [0, 1]),
        r"labels must have shape \(3,\) to match logits \(2, 3, 4\)",
    ),
    "labels-float": (lambda: metrics.fit_temperature(GOOD_LOGITS, [0.0, 1.0, 2.0]), r"labels must be an integer"),
    "bounds-order": (lambda: metrics.fit_temperature(GOOD_LOGITS, [0, 1, 2], bounds=(2.0, 1.0)), r"0 < low < high"),
    "bounds-zero": (lambda: metrics.fit_temperature(GOOD_LOGITS, [0, 1, 2], bounds=(0.0, 1.0)), r"0 < low < high"),
    "apply-negative": (lambda: metrics.apply_temperature(GOOD_LOGITS, -1.0), r"temperature must be > 0"),
    "apply-nan": (lambda: metrics.apply_temperature(GOOD_LOGITS, np.nan), r"temperature must be finite"),
    "apply-members": (
        lambda: metrics.apply_temperature(GOOD_LOGITS, [1.0, 2.0, 3.0]),
        r"one per member \(n,\) for \(n, B, K\) logits \(member_axis=0\); received temperature shape \(3,\) "
        r"for logits \(2, 3, 4\)",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_raises_a_clear_error(case: str) -> None:
    call, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()
