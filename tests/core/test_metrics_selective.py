"""Selective prediction: risk-coverage, AURC, E-AURC and accuracy at a coverage, against brute-force loops."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masksembles_core import metrics
from tests.core.precision import LOW_PRECISIONS, low_precision


def risks_of_order(order: list[int], correct: np.ndarray) -> list[float]:
    """Error rate of the first k samples of ``order``, for k = 1..B."""
    errors, risks = 0, []
    for k, index in enumerate(order, start=1):
        errors += not correct[index]
        risks.append(errors / k)
    return risks


def brute_force_risks(confidence: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """The risk curve averaged over every ordering by decreasing confidence (every way of breaking ties)."""
    groups = [[i for i in range(len(confidence)) if confidence[i] == value] for value in sorted(set(confidence))[::-1]]
    tie_breaks = itertools.product(*map(itertools.permutations, groups))
    orders = [list(itertools.chain.from_iterable(parts)) for parts in tie_breaks]
    average: np.ndarray = np.array([risks_of_order(order, correct) for order in orders]).mean(axis=0)
    return average


def test_distinct_confidences_hand_made() -> None:
    confidence = np.array([0.9, 0.2, 0.6, 0.8, 0.4])
    correct = np.array([True, False, False, True, True])
    # by confidence: 0.9 right, 0.8 right, 0.6 wrong, 0.4 right, 0.2 wrong
    curve = metrics.risk_coverage(confidence, correct)
    np.testing.assert_allclose(curve.coverage, [0.2, 0.4, 0.6, 0.8, 1.0])
    np.testing.assert_allclose(curve.risk, [0.0, 0.0, 1 / 3, 1 / 4, 2 / 5])
    assert metrics.aurc(confidence, correct) == pytest.approx((1 / 3 + 1 / 4 + 2 / 5) / 5)
    # a perfect ranking (3 right first) has risks 0, 0, 0, 1/4, 2/5
    assert metrics.excess_aurc(confidence, correct) == pytest.approx((1 / 3 + 1 / 4 + 2 / 5 - 1 / 4 - 2 / 5) / 5)
    assert metrics.accuracy_at_coverage(confidence, correct, 0.4) == 1.0
    assert metrics.accuracy_at_coverage(confidence, correct, 0.5) == pytest.approx(2 / 3)  # ceil(2.5) = 3 samples
    assert metrics.accuracy_at_coverage(confidence, correct, 1.0) == pytest.approx(3 / 5)


def test_ties_count_in_proportion() -> None:
    # two samples tied at the top, one right and one wrong: the first answer is right half the time
    curve = metrics.risk_coverage(np.array([0.7, 0.7, 0.1]), np.array([True, False, True]))
    np.testing.assert_allclose(curve.risk, [0.5, 0.5, 1 / 3])
    assert metrics.aurc(np.zeros(4), np.array([1, 0, 0, 1])) == pytest.approx(0.5)  # all tied: the error rate


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=7),
)
def test_curve_matches_the_average_over_every_tie_break(data: list[tuple[int, bool]]) -> None:
    confidence = np.array([c for c, _ in data], dtype=np.float64)
    correct = np.array([r for _, r in data])
    expected = brute_force_risks(confidence, correct)
    np.testing.assert_allclose(metrics.risk_coverage(confidence, correct).risk, expected, atol=1e-12)
    assert metrics.aurc(confidence, correct) == pytest.approx(expected.mean(), abs=1e-12)
    b, right = len(data), int(correct.sum())
    optimal = math.fsum(max(k - right, 0) / k for k in range(1, b + 1)) / b  # every correct sample first
    assert metrics.excess_aurc(confidence, correct) == pytest.approx(expected.mean() - optimal, abs=1e-12)
    assert metrics.excess_aurc(confidence, correct) >= -1e-12
    for coverage in (0.3, 0.5, 1.0):
        k = math.ceil(round(coverage * b, 9))
        assert metrics.accuracy_at_coverage(confidence, correct, coverage) == pytest.approx(1 - expected[k - 1])


def test_the_input_order_does_not_matter() -> None:
    rng = np.random.default_rng(0)
    confidence = rng.integers(0, 5, 200).astype(float)
    correct = rng.random(200) < 0.7
    permutation = rng.permutation(200)
    np.testing.assert_allclose(
        metrics.risk_coverage(confidence, correct).risk,
        metrics.risk_coverage(confidence[permutation], correct[permutation]).risk,
        rtol=1e-12,
    )


def test_perfect_and_reversed_rankings() -> None:
    correct = np.array([True] * 6 + [False] * 4)
    assert metrics.excess_aurc(correct.astype(float), correct) == pytest.approx(0.0, abs=1e-15)
    assert metrics.excess_aurc(-correct.astype(float), correct) > 0.3
    assert metrics.aurc(np.arange(5.0), np.ones(5, dtype=bool)) == 0.0
    assert metrics.aurc(np.arange(5.0), np.zeros(5, dtype=np.int64)) == 1.0


@pytest.mark.parametrize("kind", LOW_PRECISIONS)
def test_low_precision_confidence_is_accepted(kind: str) -> None:
    rng = np.random.default_rng(1)
    confidence = rng.random(300)
    correct = rng.random(300) < confidence
    rounded = low_precision(confidence, kind)
    assert metrics.aurc(rounded, correct) == pytest.approx(metrics.aurc(rounded.astype(np.float64), correct))
    assert abs(metrics.aurc(rounded, correct) - metrics.aurc(confidence, correct)) < 0.01


ERRORS: dict[str, tuple[Callable[[], object], str]] = {
    "confidence-nan": (lambda: metrics.aurc([0.5, np.nan], [True, False]), r"confidence must be finite"),
    "confidence-2d": (lambda: metrics.aurc([[0.5]], [[True]]), r"confidence must be 1-D with at least one sample"),
    "empty": (lambda: metrics.risk_coverage([], []), r"confidence must be 1-D with at least one sample"),
    "correct-float": (lambda: metrics.aurc([0.5, 0.2], [1.0, 0.0]), r"correct must be a bool array"),
    "correct-labels": (lambda: metrics.excess_aurc([0.5, 0.2], [0, 2]), r"correct must be a bool array"),
    "correct-shape": (
        lambda: metrics.aurc([0.5, 0.2], [True]),
        r"correct must have the shape of confidence \(2,\); received \(1,\)",
    ),
    "coverage-zero": (
        lambda: metrics.accuracy_at_coverage([0.5], [True], 0.0),
        r"coverage must lie in \(0, 1\]; received 0.0",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_raises_a_clear_error(case: str) -> None:
    call, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()
