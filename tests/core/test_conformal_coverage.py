"""The split-conformal guarantee, over 2000 random calibration/test splits of exchangeable synthetic data.

With n calibration samples and continuous scores the coverage averaged over splits lies in
[1 − α, 1 − α + 1/(n+1)] (it is ⌈(n+1)(1−α)⌉ / (n+1)); the test widens that by 3 Monte-Carlo standard errors.
The 2000 splits are computed at once: the scores by ``conformal.class_scores`` (or the interval formulas) of all
splits together, each split's threshold by the rank rule; a handful of splits go through ``calibrate_sets`` /
``calibrate_intervals`` themselves and must give the same coverages, so the vectorized path is the package's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from masksembles_core import conformal

SPLITS, CALIBRATION, TEST, CLASSES, MEMBERS = 2000, 100, 100, 5, 3
ALPHA = 0.1
THROUGH_THE_API = 5  # splits also run through calibrate_* and .sets / .intervals


def assert_guarantee(per_split: np.ndarray) -> None:
    """Mean coverage over splits in [1 − α, 1 − α + 1/(n+1)] widened by 3 standard errors of the mean."""
    assert per_split.shape == (SPLITS,)
    mean, error = per_split.mean(), per_split.std(ddof=1) / math.sqrt(SPLITS)
    low, high = 1 - ALPHA - 3 * error, 1 - ALPHA + 1 / (CALIBRATION + 1) + 3 * error
    assert low <= mean <= high, f"mean coverage {mean:.5f} outside [{low:.5f}, {high:.5f}] (MC error {error:.5f})"


def split_thresholds(calibration_scores: np.ndarray) -> np.ndarray:
    """The ⌈(n+1)(1−α)⌉-th smallest calibration score of each split, (SPLITS, n) -> (SPLITS, 1)."""
    rank = math.ceil((CALIBRATION + 1) * (1 - ALPHA))
    return np.sort(calibration_scores, axis=1)[:, rank - 1 : rank]


@pytest.fixture(scope="module")
def classification_splits() -> tuple[np.ndarray, np.ndarray]:
    """Member probabilities (MEMBERS, SPLITS, n + m, K) of an overconfident, noisy model and labels (SPLITS, n + m)
    drawn from the true class probabilities: every sample independent, so each split is exchangeable."""
    rng = np.random.default_rng(0)
    true_logits = rng.normal(0.0, 1.5, (SPLITS, CALIBRATION + TEST, CLASSES))
    true_probs = np.exp(true_logits) / np.exp(true_logits).sum(axis=-1, keepdims=True)
    labels = (rng.random((*true_probs.shape[:2], 1)) > true_probs.cumsum(axis=-1)).sum(axis=-1)
    member_logits = 2.0 * (true_logits + rng.normal(0.0, 0.7, (MEMBERS, *true_logits.shape)))
    member_probs = np.exp(member_logits - member_logits.max(axis=-1, keepdims=True))
    return member_probs / member_probs.sum(axis=-1, keepdims=True), np.minimum(labels, CLASSES - 1)


SET_CASES = {
    "lac": {"score": "lac"},
    "aps": {"score": "aps"},
    "raps": {"score": "raps", "penalty": 0.05, "k_reg": 1},
}


@pytest.mark.parametrize(
    ("case", "randomized"), [("lac", False), ("aps", False), ("raps", False), ("aps", True), ("raps", True)]
)
def test_sets_cover_one_minus_alpha(
    classification_splits: tuple[np.ndarray, np.ndarray], case: str, randomized: bool
) -> None:
    options = SET_CASES[case]
    members, labels = classification_splits
    flat = members.reshape(MEMBERS, -1, CLASSES)
    scores = conformal.class_scores(flat, **options).reshape(SPLITS, CALIBRATION + TEST, CLASSES)  # type: ignore[arg-type]
    label_scores = np.take_along_axis(scores, labels[..., None], axis=2)[..., 0]
    if randomized:  # one uniform draw per sample, times the probability of the class scored
        mean_probs = members.mean(axis=0)
        draws = np.random.default_rng(99).random(labels.shape)
        label_scores = label_scores - draws * np.take_along_axis(mean_probs, labels[..., None], axis=2)[..., 0]
    thresholds = split_thresholds(label_scores[:, :CALIBRATION])
    per_split = (label_scores[:, CALIBRATION:] <= thresholds).mean(axis=1)
    assert_guarantee(per_split)
    if randomized:
        return  # the API draws its own uniforms; its deterministic path is compared below
    for split in range(THROUGH_THE_API):
        predictor = conformal.calibrate_sets(
            members[:, split, :CALIBRATION],
            labels[split, :CALIBRATION],
            alpha=ALPHA,
            **options,  # type: ignore[arg-type]
        )
        assert predictor.threshold == thresholds[split, 0]
        sets = predictor.sets(members[:, split, CALIBRATION:])
        assert conformal.coverage(sets, labels[split, CALIBRATION:]) == per_split[split]


def regression_splits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Member means and variances (MEMBERS, SPLITS, n + m) of a heteroscedastic 1-D problem, targets (SPLITS, n + m)."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2.0, 2.0, (SPLITS, CALIBRATION + TEST))
    noise = 0.1 + 0.2 * np.abs(x)
    y = np.sin(x) + noise * rng.normal(size=x.shape)
    means = np.sin(x) + 0.15 * (1.0 + np.abs(x)) * rng.normal(size=(MEMBERS, *x.shape))
    variances = noise**2 * rng.uniform(0.5, 1.5, (MEMBERS, *x.shape))
    return means, variances, y


@pytest.mark.parametrize("case", ["absolute", "normalized by the spread", "normalized by the mixture"])
def test_intervals_cover_one_minus_alpha(case: str) -> None:
    means, variances, y = regression_splits(seed=len(case))
    center = means.mean(axis=0)
    scores = np.abs(y - center)
    with_variances = case == "normalized by the mixture"
    if case != "absolute":
        scale = np.sqrt((variances.mean(axis=0) if with_variances else 0.0) + means.var(axis=0))
        scores = scores / scale
    thresholds = split_thresholds(scores[:, :CALIBRATION])
    per_split = (scores[:, CALIBRATION:] <= thresholds).mean(axis=1)
    assert_guarantee(per_split)
    score: conformal.IntervalScore = "absolute" if case == "absolute" else "normalized"
    for split in range(THROUGH_THE_API):
        calibration, test = slice(None, CALIBRATION), slice(CALIBRATION, None)
        kept = {"variances": variances[:, split, calibration]} if with_variances else {}
        predictor = conformal.calibrate_intervals(
            means[:, split, calibration],
            y[split, calibration],
            alpha=ALPHA,
            score=score,
            **kept,  # type: ignore[arg-type]
        )
        assert predictor.quantile == pytest.approx(thresholds[split, 0], rel=1e-15)
        test_variances = variances[:, split, test] if with_variances else None
        lower, upper = predictor.intervals(means[:, split, test], test_variances)
        assert conformal.coverage((lower, upper), y[split, test]) == per_split[split]
