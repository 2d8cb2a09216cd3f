"""OOD scores (higher = more likely OOD): direct per-sample formulas, the sign convention, clear errors."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from masksembles_core import metrics
from tests.core.precision import LOW_PRECISIONS, low_precision


def random_logits(n: int, batch: int, classes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, size=(n, batch, classes))


def softmax_row(row: np.ndarray) -> list[float]:
    weights = [math.exp(v - max(row)) for v in row]
    return [w / math.fsum(weights) for w in weights]


@pytest.mark.parametrize("n,batch,classes", [(1, 6, 2), (4, 20, 5), (5, 7, 3)], ids=["n1-K2", "n4-K5", "n5-K3"])
def test_scores_match_direct_formulas(n: int, batch: int, classes: int) -> None:
    logits = random_logits(n, batch, classes, seed=n + classes)
    probs = np.array([[softmax_row(logits[k, b]) for b in range(batch)] for k in range(n)])
    msp = metrics.msp_score(logits, logits=True)
    max_logit = metrics.max_logit_score(logits)
    energy = metrics.energy_score(logits)
    ratio = metrics.variation_ratio(logits, logits=True)
    variance = metrics.probability_variance(probs)
    for b in range(batch):
        mean = [math.fsum(probs[k, b, c] for k in range(n)) / n for c in range(classes)]
        assert msp[b] == pytest.approx(1.0 - max(mean), abs=1e-14)
        assert max_logit[b] == pytest.approx(-sum(max(logits[k, b]) for k in range(n)) / n, rel=1e-13)
        free_energies = [-math.log(math.fsum(math.exp(v) for v in logits[k, b])) for k in range(n)]
        assert energy[b] == pytest.approx(sum(free_energies) / n, rel=1e-12)
        votes = Counter(int(np.argmax(probs[k, b])) for k in range(n))
        assert ratio[b] == pytest.approx(1.0 - max(votes.values()) / n, abs=1e-15)
        spread = sum((probs[k, b, c] - mean[c]) ** 2 for k in range(n) for c in range(classes)) / n
        assert variance[b] == pytest.approx(spread, rel=1e-10, abs=1e-15)
    if n == 1:
        np.testing.assert_array_equal(ratio, 0.0)
        np.testing.assert_allclose(variance, 0.0, atol=1e-15)


def test_a_sigmoid_logit_counts_as_the_logits_zero_and_z() -> None:
    z = np.array([[[-3.0], [0.0], [2.0]], [[1.0], [-1.0], [4.0]]])  # (2 members, 3 samples, 1 logit)
    two = np.concatenate([np.zeros_like(z), z], axis=-1)
    np.testing.assert_allclose(metrics.energy_score(z), -np.log1p(np.exp(z[..., 0])).mean(axis=0), rtol=1e-14)
    np.testing.assert_allclose(metrics.max_logit_score(z), -np.maximum(z[..., 0], 0.0).mean(axis=0))
    np.testing.assert_allclose(metrics.predictive_mean(z, logits=True)[:, 1], (1 / (1 + np.exp(-z[..., 0]))).mean(0))
    for score in (metrics.msp_score, metrics.variation_ratio, metrics.probability_variance):
        np.testing.assert_allclose(score(z, logits=True), score(two, logits=True), rtol=1e-14)


SCORES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "entropy": lambda z: metrics.predictive_entropy(z, logits=True),
    "mutual information": lambda z: metrics.mutual_information(z, logits=True),
    "msp": lambda z: metrics.msp_score(z, logits=True),
    "max logit": metrics.max_logit_score,
    "energy": metrics.energy_score,
    "variation ratio": lambda z: metrics.variation_ratio(z, logits=True),
    "probability variance": lambda z: metrics.probability_variance(z, logits=True),
}


@pytest.mark.parametrize("name", list(SCORES))
def test_every_score_is_higher_for_the_uncertain_sample(name: str) -> None:
    # sample 0: four members sure of class 0; sample 1: members split between classes with small logits
    sure = [[8.0, 0.0, 0.0]] * 4
    unsure = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    scores = SCORES[name](np.array([sure, unsure]).transpose(1, 0, 2))
    assert scores.shape == (2,)
    assert scores[1] > scores[0]


PROBABILITY_SCORES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "entropy": metrics.predictive_entropy,
    "mutual information": metrics.mutual_information,
    "msp": metrics.msp_score,
    "variation ratio": metrics.variation_ratio,
    "probability variance": metrics.probability_variance,
}


@pytest.mark.parametrize("kind", LOW_PRECISIONS)
def test_low_precision_outputs_are_accepted_and_scored_in_float64(kind: str) -> None:
    logits = random_logits(4, 30, 10, seed=2)
    rounded_logits = low_precision(logits, kind)
    # probabilities computed in low precision do not sum to 1 exactly: accepted, and renormalized
    rounded_probs = low_precision(metrics.member_probabilities(logits, logits=True), kind)
    assert np.abs(rounded_probs.sum(axis=-1) - 1.0).max() > 1e-4
    for name, score in SCORES.items():
        result = score(rounded_logits)
        assert result.dtype == np.float64
        np.testing.assert_allclose(result, score(rounded_logits.astype(np.float64)), rtol=1e-13, err_msg=name)
    for name, score in PROBABILITY_SCORES.items():
        exact = rounded_probs.astype(np.float64)
        renormalized = exact / exact.sum(axis=-1, keepdims=True)
        np.testing.assert_allclose(score(rounded_probs), score(renormalized), rtol=1e-12, atol=1e-15, err_msg=name)


ERRORS: dict[str, tuple[Callable[[], object], str]] = {
    "energy-4d": (lambda: metrics.energy_score(np.zeros((2, 3, 4, 1))), r"members must have shape \(n, B, K\)"),
    "max-logit-nan": (lambda: metrics.max_logit_score(np.full((1, 2, 3), np.nan)), r"members must be finite"),
    "max-logit-empty": (lambda: metrics.max_logit_score(np.zeros((1, 2, 0))), r"K >= 1 classes"),
    "msp-one-class": (lambda: metrics.msp_score(np.ones((2, 3, 1))), r"at least 2 classes"),
    "ratio-not-normalized": (
        lambda: metrics.variation_ratio(np.full((2, 3, 2), 0.4)),
        r"must sum to 1 .*pass logits=True",
    ),
    "variance-strings": (lambda: metrics.probability_variance(np.array([[["a"]]])), r"real numeric array"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_raises_a_clear_error(case: str) -> None:
    call, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()
