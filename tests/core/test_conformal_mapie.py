"""masksembles_core.conformal against MAPIE 1.6 on the same arrays: LAC and APS sets, absolute intervals.

MAPIE is in the test-metrics dependency group (every core session installs it): a missing one fails the import
here instead of skipping. Its estimators here are prefit stand-ins whose ``predict_proba`` / ``predict`` return the
given predictive distribution / mean, so both libraries see the same numbers. The conventions that differ, and how
the tests bridge them:

- Threshold: MAPIE's ``np.quantile(scores, ⌈(n+1)(1−α)⌉ / n, method="lower")`` is the same order statistic.
- Tolerance: MAPIE puts a class in a set when its score is within ``EPSILON`` = 1e-8 *above* the threshold; the
  test arrays are checked to have no test score in (threshold, threshold + 1e-8].
- APS calibration: MAPIE 1.6 always randomizes the calibration scores (``score − U·p_y``, U from its
  ``random_state``); a ``RandomState`` whose uniform draws are 0 gives the non-randomized score.
- APS sets: ``include_last_label=False`` gives the classes whose cumulative mass is at most the threshold, as
  here, except that MAPIE never returns an empty set (it keeps the most probable class); the tests add the top
  class where our set is empty. (The default ``include_last_label=True`` also adds the class that crosses the
  threshold, a larger set than the score's.)
- Ties: MAPIE ranks classes by ``np.argsort`` (ties in an unspecified order), this package by class index; the
  probabilities here are continuous (no ties).

TorchCP 1.2.1 is not compared: importing it imports torchsort (a source distribution whose build needs CUDA_HOME)
and torchvision (whose PyPI wheels are CUDA builds), which the CPU test environments cannot take. Its definitions,
read from its source, are the ones tested here: the threshold is ``torch.kthvalue(scores, ⌈(n+1)(1−α)⌉)``, a set
holds the classes whose score is <= it (empty sets allowed), APS is the cumulative sum in ``torch.sort`` order
(ties in an unspecified order), all in float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mapie.classification import SplitConformalClassifier  # type: ignore[import-not-found, import-untyped, unused-ignore]
from mapie.regression import SplitConformalRegressor  # type: ignore[import-not-found, import-untyped, unused-ignore]
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin  # type: ignore[import-not-found, import-untyped, unused-ignore]

from masksembles_core import conformal

MAPIE_EPSILON = 1e-8


class GivenProbabilities(ClassifierMixin, BaseEstimator):  # type: ignore[misc, unused-ignore]
    """A prefit classifier whose input is its predictive distribution (B, K)."""

    def __init__(self, classes: int = 2) -> None:
        self.classes = classes

    def fit(self, x: np.ndarray, y: np.ndarray) -> GivenProbabilities:
        return self

    def __sklearn_is_fitted__(self) -> bool:
        return True

    @property
    def classes_(self) -> np.ndarray:
        return np.arange(self.classes)

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    def predict(self, x: np.ndarray) -> np.ndarray:
        labels: np.ndarray = np.asarray(x).argmax(axis=1)
        return labels


class GivenMean(RegressorMixin, BaseEstimator):  # type: ignore[misc, unused-ignore]
    """A prefit regressor whose input (B, 1) is its prediction."""

    fitted_ = True  # MAPIE's fitted check looks for such an attribute

    def fit(self, x: np.ndarray, y: np.ndarray) -> GivenMean:
        return self

    def __sklearn_is_fitted__(self) -> bool:
        return True

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)[:, 0]


class ZeroDraws(np.random.RandomState):
    """A RandomState whose uniform draws are 0: MAPIE's randomized APS calibration score without its draw."""

    def uniform(self, low: Any = 0.0, high: Any = 1.0, size: Any = None) -> np.ndarray:  # type: ignore[override]
        return np.zeros(size)


def members_and_labels(seed: int, batch: int, classes: int, spread: float) -> tuple[np.ndarray, np.ndarray]:
    """Member probabilities (4, batch, classes) and labels drawn from their mean (continuous: no ties); a larger
    ``spread`` of the logits makes a more confident model."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, spread, (batch, classes))[None] + rng.normal(0.0, 0.5, (4, batch, classes))
    members = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    mean = members.mean(axis=0)
    labels = np.minimum((rng.random((batch, 1)) > mean.cumsum(axis=1)).sum(axis=1), classes - 1)
    return members, labels


def mapie_sets(
    score: str, mean: np.ndarray, labels: np.ndarray, test: np.ndarray, alpha: float
) -> tuple[float, np.ndarray]:
    """MAPIE's threshold and sets (B, K) for ``score`` calibrated on (mean, labels)."""
    classifier = SplitConformalClassifier(
        GivenProbabilities(mean.shape[1]),
        confidence_level=1 - alpha,
        conformity_score=score,
        prefit=True,
        random_state=ZeroDraws(),
    )
    classifier.conformalize(mean, labels)
    params = {"include_last_label": False} if score == "aps" else None
    _, sets = classifier.predict_set(test, conformity_score_params=params)
    (threshold,) = classifier._mapie_classifier.conformity_score_function_.quantiles_
    return float(threshold), sets[:, :, 0]


@pytest.mark.parametrize("score", ["lac", "aps"])
@pytest.mark.parametrize(
    ("seed", "batch", "classes", "spread", "alpha"),
    [(0, 300, 10, 1.5, 0.1), (1, 200, 4, 1.5, 0.05), (2, 500, 30, 1.0, 0.3), (3, 400, 5, 4.0, 0.4)],
)
def test_sets_equal_mapie(score: str, seed: int, batch: int, classes: int, spread: float, alpha: float) -> None:
    members, labels = members_and_labels(seed, batch, classes, spread)
    calibration, test = slice(None, batch // 2), slice(batch // 2, None)
    predictor = conformal.calibrate_sets(members[:, calibration], labels[calibration], alpha=alpha, score=score)  # type: ignore[arg-type]
    mean = members.mean(axis=0)
    threshold, expected = mapie_sets(score, mean[calibration], labels[calibration], mean[test], alpha)
    assert predictor.threshold == pytest.approx(threshold, rel=0, abs=1e-15)
    test_scores = conformal.class_scores(members[:, test], score=score)  # type: ignore[arg-type]
    borderline = (test_scores > predictor.threshold) & (test_scores <= predictor.threshold + MAPIE_EPSILON)
    assert not borderline.any()  # MAPIE's tolerance would take these in
    sets = predictor.sets(members[:, test])
    if score == "aps":  # MAPIE keeps the most probable class in a set that would be empty
        empty = ~sets.any(axis=1)
        sets[empty, mean[test][empty].argmax(axis=1)] = True
        assert empty.any() == (alpha == 0.4)  # the confident model at a large α does give empty sets
    np.testing.assert_array_equal(sets, expected)


@pytest.mark.parametrize(("seed", "alpha"), [(0, 0.1), (1, 0.05), (2, 0.2)])
def test_absolute_intervals_equal_mapie(seed: int, alpha: float) -> None:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3.0, 3.0, 400)
    means = np.sin(x) + 0.2 * rng.normal(size=(4, 400))
    y = np.sin(x) + 0.3 * rng.normal(size=400)
    mean = means.mean(axis=0)
    calibration, test = slice(None, 250), slice(250, None)
    regressor = SplitConformalRegressor(
        GivenMean(), confidence_level=1 - alpha, conformity_score="absolute", prefit=True
    )
    regressor.conformalize(mean[calibration, None], y[calibration])
    _, bounds = regressor.predict_interval(mean[test, None])
    predictor = conformal.calibrate_intervals(means[:, calibration], y[calibration], alpha=alpha, score="absolute")
    lower, upper = predictor.intervals(means[:, test])
    np.testing.assert_allclose(lower, bounds[:, 0, 0], rtol=0, atol=1e-14)
    np.testing.assert_allclose(upper, bounds[:, 1, 0], rtol=0, atol=1e-14)
