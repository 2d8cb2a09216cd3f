"""Uncertainty and evaluation metrics: direct formulas, scikit-learn cross-checks and clear errors."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
    average_precision_score,
    brier_score_loss,
    log_loss,
    roc_auc_score,
    roc_curve,
)

from masksembles_core import metrics

LOG2 = math.log(2.0)


def random_members(n: int, batch: int, classes: int, seed: int) -> np.ndarray:
    """(n, batch, classes) member probabilities drawn from a Dirichlet."""
    return np.random.default_rng(seed).dirichlet(np.full(classes, 0.5), size=(n, batch))


def direct_entropy(p: np.ndarray) -> float:
    return -sum(float(v) * math.log(float(v)) for v in p if v > 0)


# --- uncertainty decomposition ----------------------------------------------------------


def test_decomposition_hand_made() -> None:
    agree = np.array([[[0.5, 0.5]], [[0.5, 0.5]]])  # two members, one sample: both 50/50
    disagree = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])  # each member sure, of a different class
    assert metrics.predictive_entropy(agree) == pytest.approx([LOG2])
    assert metrics.expected_entropy(agree) == pytest.approx([LOG2])
    assert metrics.mutual_information(agree) == pytest.approx([0.0], abs=1e-15)
    assert metrics.predictive_entropy(disagree) == pytest.approx([LOG2])
    assert metrics.expected_entropy(disagree) == pytest.approx([0.0])
    assert metrics.mutual_information(disagree) == pytest.approx([LOG2])
    np.testing.assert_array_equal(metrics.predictive_mean(disagree), [[0.5, 0.5]])


@pytest.mark.parametrize("n,batch,classes", [(1, 5, 2), (4, 30, 10), (7, 3, 3)], ids=["n1", "n4-K10", "n7-K3"])
def test_decomposition_matches_direct_formulas(n: int, batch: int, classes: int) -> None:
    members = random_members(n, batch, classes, seed=n * 100 + classes)
    total = metrics.predictive_entropy(members)
    aleatoric = metrics.expected_entropy(members)
    epistemic = metrics.mutual_information(members)
    for b in range(batch):
        mean = [sum(members[k, b, c] for k in range(n)) / n for c in range(classes)]
        assert total[b] == pytest.approx(direct_entropy(np.array(mean)), rel=1e-12)
        assert aleatoric[b] == pytest.approx(sum(direct_entropy(members[k, b]) for k in range(n)) / n, rel=1e-12)
    np.testing.assert_allclose(epistemic, total - aleatoric, atol=1e-12)
    assert (epistemic >= 0).all()
    assert (total <= math.log(classes) + 1e-12).all()
    if n == 1:
        np.testing.assert_array_equal(epistemic, 0.0)


def test_logits_flag_applies_a_stable_softmax() -> None:
    logits = np.random.default_rng(0).normal(size=(4, 6, 5)) * 3
    probs = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(metrics.predictive_mean(logits, logits=True), probs.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(
        metrics.mutual_information(logits, logits=True), metrics.mutual_information(probs), atol=1e-12
    )
    shifted = metrics.predictive_entropy(logits + 1000.0, logits=True)  # no overflow
    np.testing.assert_allclose(shifted, metrics.predictive_entropy(probs), rtol=1e-10)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_low_precision_probabilities_are_accepted(dtype: type[np.floating]) -> None:
    members = random_members(3, 8, 4, seed=1).astype(dtype)
    result = metrics.predictive_mean(members)
    assert result.dtype == np.float64
    exact = members.astype(np.float64)
    np.testing.assert_allclose(result, (exact / exact.sum(axis=-1, keepdims=True)).mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(result.sum(axis=-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("shape", [(4, 10), (3, 5, 2), (5, 2, 3, 4)], ids=["scalar", "vector", "image"])
def test_regression_mean_and_variance(shape: tuple[int, ...]) -> None:
    outputs = np.random.default_rng(2).normal(size=shape)
    n = shape[0]
    mean = sum(outputs[k] for k in range(n)) / n
    np.testing.assert_allclose(metrics.member_mean(outputs), mean, rtol=1e-12)
    variance = sum((outputs[k] - mean) ** 2 for k in range(n)) / n
    np.testing.assert_allclose(metrics.member_variance(outputs), variance, rtol=1e-12)
    identical = np.broadcast_to(outputs[:1], shape)
    np.testing.assert_allclose(metrics.member_variance(identical), 0.0, atol=1e-15)


# --- scores of the predictive distribution ------------------------------------------------


def probs_and_labels(batch: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.ones(classes), size=batch), rng.integers(0, classes, size=batch)


@pytest.mark.parametrize("batch,classes,seed", [(50, 2, 0), (200, 10, 1), (7, 3, 2)], ids=["K2", "K10", "K3-small"])
def test_nll_matches_sklearn_log_loss(batch: int, classes: int, seed: int) -> None:
    probs, labels = probs_and_labels(batch, classes, seed)
    expected = log_loss(labels, probs, labels=list(range(classes)))
    assert metrics.negative_log_likelihood(probs, labels) == pytest.approx(expected, rel=1e-10)


def test_nll_clips_a_zero_probability_like_sklearn() -> None:
    probs = np.array([[1.0, 0.0], [0.25, 0.75]])
    labels = np.array([1, 1])
    expected = log_loss(labels, probs, labels=[0, 1])
    assert metrics.negative_log_likelihood(probs, labels) == pytest.approx(expected, rel=1e-10)
    assert math.isfinite(expected)


@pytest.mark.parametrize("batch,classes,seed", [(40, 2, 3), (100, 10, 4)], ids=["K2", "K10"])
def test_brier_matches_direct_formula(batch: int, classes: int, seed: int) -> None:
    probs, labels = probs_and_labels(batch, classes, seed)
    direct = sum(
        sum((probs[b, c] - (1.0 if c == labels[b] else 0.0)) ** 2 for c in range(classes)) for b in range(batch)
    )
    assert metrics.brier_score(probs, labels) == pytest.approx(direct / batch, rel=1e-12)


def test_brier_two_classes_is_twice_sklearns_binary_brier() -> None:
    probs, labels = probs_and_labels(60, 2, seed=5)
    binary = brier_score_loss(labels, probs[:, 1])
    assert metrics.brier_score(probs, labels) == pytest.approx(2 * binary, rel=1e-12)


def test_accuracy() -> None:
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    assert metrics.accuracy(probs, np.array([0, 1, 1, 1])) == 0.75


# --- calibration ----------------------------------------------------------------------------


def direct_ece(probs: np.ndarray, labels: np.ndarray, bins: int) -> float:
    confidence = probs.max(axis=1)
    correct = probs.argmax(axis=1) == labels
    total = 0.0
    for i in range(bins):
        low, high = i / bins, (i + 1) / bins
        inside = (confidence > low) & (confidence <= high) if i > 0 else (confidence <= high)
        if inside.any():
            total += inside.sum() / len(labels) * abs(correct[inside].mean() - confidence[inside].mean())
    return total


@pytest.mark.parametrize("bins", [1, 5, 10, 15, 37])
def test_ece_matches_direct_formula(bins: int) -> None:
    probs, labels = probs_and_labels(500, 4, seed=bins)
    assert metrics.expected_calibration_error(probs, labels, bins=bins) == pytest.approx(
        direct_ece(probs, labels, bins), rel=1e-12, abs=1e-15
    )


def test_reliability_diagram_hand_made() -> None:
    # confidences 0.6, 0.6 (one right), 0.9 (right), 1.0 (wrong), with 5 bins of width 0.2
    probs = np.array([[0.6, 0.4], [0.4, 0.6], [0.9, 0.1], [0.0, 1.0]])
    labels = np.array([0, 0, 0, 0])
    diagram = metrics.reliability_diagram(probs, labels, bins=5)
    np.testing.assert_allclose(diagram.edges, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    np.testing.assert_array_equal(diagram.counts, [0, 0, 2, 0, 2])  # 0.6 sits on an edge: the lower bin
    assert diagram.accuracy[2] == 0.5 and diagram.confidence[2] == pytest.approx(0.6)
    assert diagram.accuracy[4] == 0.5 and diagram.confidence[4] == pytest.approx(0.95)
    assert np.isnan(diagram.accuracy[[0, 1, 3]]).all() and np.isnan(diagram.confidence[[0, 1, 3]]).all()
    assert diagram.ece == pytest.approx(2 / 4 * 0.1 + 2 / 4 * 0.45)


def test_ece_is_zero_when_confidence_matches_accuracy() -> None:
    probs = np.tile([0.75, 0.25], (8, 1))
    labels = np.array([0, 0, 0, 1, 0, 0, 0, 1])
    assert metrics.expected_calibration_error(probs, labels, bins=10) == pytest.approx(0.0, abs=1e-15)


# --- OOD detection --------------------------------------------------------------------------


def sklearn_ood(score: Callable[..., float], inside: np.ndarray, outside: np.ndarray) -> float:
    is_ood = np.r_[np.zeros(len(inside)), np.ones(len(outside))]
    return float(score(is_ood, np.r_[inside, outside]))


def sklearn_aupr_in(inside: np.ndarray, outside: np.ndarray) -> float:
    """Average precision with the in-distribution samples as positives, ranked by a low OOD score."""
    is_in = np.r_[np.ones(len(inside)), np.zeros(len(outside))]
    return float(average_precision_score(is_in, -np.r_[inside, outside]))


def sklearn_fpr_at_tpr(inside: np.ndarray, outside: np.ndarray, tpr: float, positive: str) -> float:
    """The smallest FPR on scikit-learn's ROC curve (every threshold kept) whose TPR reaches ``tpr``."""
    scores = np.r_[inside, outside]
    is_ood = np.r_[np.zeros(len(inside)), np.ones(len(outside))]
    labels, ranking = (is_ood, scores) if positive == "ood" else (1 - is_ood, -scores)
    fpr, true_positive_rate, _ = roc_curve(labels, ranking, drop_intermediate=False)
    return float(fpr[true_positive_rate >= tpr].min())


def assert_detection_matches_sklearn(inside: np.ndarray, outside: np.ndarray) -> None:
    assert metrics.ood_auroc(inside, outside) == pytest.approx(sklearn_ood(roc_auc_score, inside, outside), abs=1e-12)
    assert metrics.ood_aupr(inside, outside) == pytest.approx(
        sklearn_ood(average_precision_score, inside, outside), abs=1e-12
    )
    assert metrics.ood_aupr(inside, outside, positive="in") == pytest.approx(
        sklearn_aupr_in(inside, outside), abs=1e-12
    )
    for positive in ("in", "ood"):
        for tpr in (0.01, 0.5, 0.95, 1.0):
            assert metrics.fpr_at_tpr(inside, outside, tpr, positive=positive) == pytest.approx(
                sklearn_fpr_at_tpr(inside, outside, tpr, positive), abs=1e-12
            ), (positive, tpr)


OOD_CASES = {
    "continuous": (np.random.default_rng(0).normal(0, 1, 80), np.random.default_rng(1).normal(1, 1, 50)),
    "ties": (np.random.default_rng(2).integers(0, 4, 60).astype(float), np.random.default_rng(3).integers(1, 5, 40)),
    "all-tied": (np.zeros(5), np.zeros(3)),
    "separated": (np.arange(10.0), np.arange(10.0) + 20),
    "reversed": (np.arange(10.0) + 20, np.arange(10.0)),
    "one-each": (np.array([0.3]), np.array([0.7])),
}


@pytest.mark.parametrize("case", list(OOD_CASES))
def test_ood_detection_metrics_match_sklearn(case: str) -> None:
    inside, outside = OOD_CASES[case]
    assert_detection_matches_sklearn(inside, outside)


@settings(max_examples=150, deadline=None)
@given(
    inside=st.lists(st.integers(0, 6), min_size=1, max_size=40),
    outside=st.lists(st.integers(0, 6), min_size=1, max_size=40),
    spread=st.sampled_from([1e-3, 1.0, 1e6]),
)
def test_ood_metrics_match_sklearn_property(inside: list[int], outside: list[int], spread: float) -> None:
    assert_detection_matches_sklearn(np.array(inside) * spread, np.array(outside) * spread)


def test_ood_extremes() -> None:
    assert metrics.ood_auroc([0.1, 0.2], [0.3, 0.4]) == 1.0
    assert metrics.ood_auroc([0.3, 0.4], [0.1, 0.2]) == 0.0
    assert metrics.ood_aupr([0.1, 0.2], [0.3, 0.4]) == 1.0
    assert metrics.ood_aupr(np.zeros(3), np.zeros(1)) == 0.25  # all tied: the OOD fraction
    assert metrics.ood_aupr(np.zeros(3), np.zeros(1), positive="in") == 0.75  # the in-distribution fraction


def test_fpr_at_tpr_hand_made() -> None:
    inside = np.arange(20.0)  # in-distribution scores 0..19
    outside = np.array([5.5, 17.5, 18.5, 30.0])
    # in-distribution positive: accepting score <= 18 keeps 19/20 = 95 % of them, and OOD 5.5 and 17.5
    assert metrics.fpr_at_tpr(inside, outside) == 0.5
    assert metrics.fpr_at_tpr(inside, outside, 0.9) == 0.25  # score <= 17: 18/20 in, and OOD 5.5
    assert metrics.fpr_at_tpr(inside, outside, 0.5) == 0.25  # score <= 9
    # OOD positive: flagging score >= 17.5 catches 3 of 4 OOD (75 %) and in-distribution 18 and 19
    assert metrics.fpr_at_tpr(inside, outside, 0.75, positive="ood") == 0.1
    assert metrics.fpr_at_tpr(inside, outside, 1.0, positive="ood") == 14 / 20  # score >= 5.5
    assert metrics.fpr_at_tpr([0.1, 0.2], [0.3, 0.4]) == 0.0
    assert metrics.fpr_at_tpr([0.3, 0.4], [0.1, 0.2]) == 1.0


# --- diversity ------------------------------------------------------------------------------


def test_diversity_hand_made() -> None:
    labels = np.array([0, 0, 0, 0])
    # accuracies 0.5 and 0.5, disagreement on 2 of 4 samples: 0.5 / (1 - 0.5)
    assert metrics.diversity(np.array([0, 0, 1, 1]), np.array([0, 1, 1, 0]), labels) == 1.0
    assert metrics.diversity(np.array([0, 0, 1, 1]), np.array([0, 0, 1, 1]), labels) == 0.0
    # accuracies 0.75 and 0.25: mean error 0.5, disagreement on 3 of 4 samples
    assert metrics.diversity(np.array([0, 0, 0, 1]), np.array([0, 2, 2, 2]), labels) == 1.5


def test_pairwise_diversity() -> None:
    labels = np.array([0, 1, 0, 1, 0, 1])
    one_hot = np.eye(2)
    predictions = np.array([[0, 1, 0, 1, 1, 0], [0, 1, 1, 1, 0, 1], [0, 1, 0, 1, 1, 0]])
    points = metrics.pairwise_diversity(one_hot[predictions], labels)
    np.testing.assert_array_equal(points.pairs, [[0, 1], [0, 2], [1, 2]])
    np.testing.assert_allclose(points.accuracy, [(4 / 6 + 5 / 6) / 2, 4 / 6, (5 / 6 + 4 / 6) / 2])
    expected_01 = metrics.diversity(predictions[0], predictions[1], labels)
    np.testing.assert_allclose(points.diversity, [expected_01, 0.0, expected_01])
    assert expected_01 == pytest.approx((3 / 6) / (1 - 0.75))


# --- errors ---------------------------------------------------------------------------------

GOOD_MEMBERS = random_members(2, 3, 3, seed=0)
GOOD_PROBS, GOOD_LABELS = probs_and_labels(3, 3, seed=0)
WITH_NAN = GOOD_MEMBERS.copy()
WITH_NAN[0, 1, 2] = np.nan

ERRORS: dict[str, tuple[Callable[[], object], str]] = {
    "members-nan": (lambda: metrics.predictive_entropy(WITH_NAN), r"members must be finite; received 1 NaN"),
    "members-1d": (lambda: metrics.predictive_mean(GOOD_PROBS[0]), r"members must have shape \(n, B, K\)"),
    "members-empty": (lambda: metrics.predictive_mean(np.ones((0, 3, 2))), r"n >= 1 members and B >= 1 samples"),
    "one-class": (lambda: metrics.mutual_information(np.ones((2, 3, 1))), r"at least 2 classes"),
    "not-normalized": (lambda: metrics.predictive_mean(GOOD_MEMBERS * 0.5), r"must sum to 1 .*pass logits=True"),
    "negative": (
        lambda: metrics.expected_entropy(GOOD_MEMBERS - 0.5),
        r"members must be probabilities in \[0, 1\]; received values from -0.\d+ to 0.\d+, which look like logits "
        r"\(pass logits=True\)",
    ),
    "strings": (lambda: metrics.predictive_mean(np.array([[["a", "b"]]])), r"real numeric array"),
    "regression-1d": (lambda: metrics.member_variance(np.ones(3)), r"outputs must have shape \(n, B, \.\.\.\)"),
    "regression-inf": (lambda: metrics.member_mean(np.array([[np.inf]])), r"outputs must be finite"),
    "probs-3d": (lambda: metrics.accuracy(GOOD_MEMBERS, GOOD_LABELS), r"use predictive_mean for member outputs"),
    "probs-one-class": (lambda: metrics.brier_score(np.ones((3, 1)), GOOD_LABELS), r"probs needs at least 2 classes"),
    "labels-length": (
        lambda: metrics.negative_log_likelihood(GOOD_PROBS, GOOD_LABELS[:2]),
        r"labels must have shape \(3,\) to match probs \(3, 3\); received \(2,\)",
    ),
    "labels-float": (lambda: metrics.accuracy(GOOD_PROBS, GOOD_LABELS * 1.0), r"labels must be an integer array"),
    "labels-range": (lambda: metrics.brier_score(GOOD_PROBS, np.array([0, 1, 3])), r"labels must lie in \[0, 3\)"),
    "bins-zero": (
        lambda: metrics.expected_calibration_error(GOOD_PROBS, GOOD_LABELS, bins=0),
        r"bins must be an integer >= 1",
    ),
    "ood-no-out": (lambda: metrics.ood_auroc([0.1, 0.2], []), r"at least one in-distribution and one OOD score"),
    "ood-no-in": (lambda: metrics.ood_aupr([], [0.3]), r"received 0 in-distribution and 1 OOD"),
    "ood-nan": (lambda: metrics.ood_auroc([0.1, np.nan], [0.3]), r"in_scores must be finite"),
    "ood-2d": (lambda: metrics.ood_aupr([0.1], [[0.3]]), r"out_scores must be 1-D"),
    "fpr-empty": (lambda: metrics.fpr_at_tpr([], [0.3]), r"received 0 in-distribution and 1 OOD"),
    "fpr-tpr-zero": (lambda: metrics.fpr_at_tpr([0.1], [0.3], 0.0), r"tpr must lie in \(0, 1\]; received 0.0"),
    "fpr-tpr-large": (lambda: metrics.fpr_at_tpr([0.1], [0.3], 95), r"tpr must lie in \(0, 1\]; received 95.0"),
    "fpr-positive": (
        lambda: metrics.fpr_at_tpr([0.1], [0.3], positive="id"),  # type: ignore[arg-type]
        r"positive must be 'ood' or 'in'; received 'id'",
    ),
    "diversity-perfect": (
        lambda: metrics.diversity(np.array([0, 1]), np.array([0, 1]), np.array([0, 1])),
        r"diversity is undefined when both models are always right",
    ),
    "diversity-shapes": (
        lambda: metrics.diversity(np.array([0, 1]), np.array([0]), np.array([0, 1])),
        r"must be 1-D of the same non-zero length",
    ),
    "diversity-float": (
        lambda: metrics.diversity(np.array([0.0]), np.array([0]), np.array([0])),
        r"predictions_a must be an integer array",
    ),
    "pairwise-one-member": (
        lambda: metrics.pairwise_diversity(GOOD_MEMBERS[:1], GOOD_LABELS),
        r"needs at least 2 members",
    ),
    "pairwise-labels": (
        lambda: metrics.pairwise_diversity(GOOD_MEMBERS, GOOD_LABELS[:1]),
        r"labels must have shape \(3,\)",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_degenerate_input_raises_a_clear_error(case: str) -> None:
    call, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()
