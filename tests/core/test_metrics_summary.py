"""``metrics.summary``: every value is the one the individual function gives, and it prints as a Markdown table."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from masksembles_core import metrics


def classification(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Member logits (n, 40, 4), labels (40,) and OOD member logits (n, 30, 4) with flatter logits."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, 40)
    logits = rng.normal(0.0, 1.0, (n, 40, 4))
    logits[:, np.arange(40), labels] += 2.5
    return logits, labels, rng.normal(0.0, 1.0, (n, 30, 4))


def test_classification_summary_holds_every_metric() -> None:
    logits, labels, ood = classification(4, seed=0)
    result = metrics.summary(logits, labels, logits=True, ood_members=ood, bins=10, coverage=0.8)
    probs = metrics.predictive_mean(logits, logits=True)
    confidence, correct = probs.max(axis=1), probs.argmax(axis=1) == labels
    expected = {
        "accuracy": metrics.accuracy(probs, labels),
        "nll": metrics.negative_log_likelihood(probs, labels),
        "brier": metrics.brier_score(probs, labels),
        "ece": metrics.expected_calibration_error(probs, labels, bins=10),
        "aurc": metrics.aurc(confidence, correct),
        "e_aurc": metrics.excess_aurc(confidence, correct),
        "accuracy_at_coverage_0.8": metrics.accuracy_at_coverage(confidence, correct, 0.8),
    }
    scores = {
        "entropy": metrics.predictive_entropy(logits, logits=True),
        "msp": metrics.msp_score(logits, logits=True),
        "mutual_information": metrics.mutual_information(logits, logits=True),
        "variation_ratio": metrics.variation_ratio(logits, logits=True),
        "probability_variance": metrics.probability_variance(logits, logits=True),
        "max_logit": metrics.max_logit_score(logits),
        "energy": metrics.energy_score(logits),
    }
    ood_scores = {
        "entropy": metrics.predictive_entropy(ood, logits=True),
        "msp": metrics.msp_score(ood, logits=True),
        "mutual_information": metrics.mutual_information(ood, logits=True),
        "variation_ratio": metrics.variation_ratio(ood, logits=True),
        "probability_variance": metrics.probability_variance(ood, logits=True),
        "max_logit": metrics.max_logit_score(ood),
        "energy": metrics.energy_score(ood),
    }
    for name, inside in scores.items():
        expected[f"ood_auroc_{name}"] = metrics.ood_auroc(inside, ood_scores[name])
        expected[f"ood_aupr_{name}"] = metrics.ood_aupr(inside, ood_scores[name])
        expected[f"ood_fpr95_{name}"] = metrics.fpr_at_tpr(inside, ood_scores[name], 0.95)
    assert result == pytest.approx(expected, rel=1e-12)
    assert list(result)[:7] == list(expected)[:7]
    assert result["ood_auroc_entropy"] > 0.7  # the OOD logits are flatter: a real signal, not a tie


def test_one_member_and_probabilities_leave_out_the_scores_they_cannot_give() -> None:
    logits, labels, ood = classification(1, seed=1)
    probs = metrics.member_probabilities(logits, logits=True)
    result = metrics.summary(probs, labels, ood_members=metrics.member_probabilities(ood, logits=True))
    assert {key.removeprefix("ood_auroc_") for key in result if key.startswith("ood_auroc_")} == {"entropy", "msp"}
    assert "accuracy_at_coverage_0.9" in result and "ood_fpr95_msp" in result
    assert set(metrics.summary(probs, labels)) == {
        "accuracy", "nll", "brier", "ece", "aurc", "e_aurc", "accuracy_at_coverage_0.9"
    }  # fmt: skip


def test_regression_summary_holds_every_metric() -> None:
    rng = np.random.default_rng(2)
    means, variances = rng.normal(size=(4, 50)), rng.uniform(0.5, 1.5, (4, 50))
    y = rng.normal(size=50)
    ood_means, ood_variances = rng.normal(0.0, 3.0, (4, 20)), rng.uniform(0.5, 1.5, (4, 20))
    result = metrics.summary(
        means, y, variances=variances, ood_members=ood_means, ood_variances=ood_variances, level=0.8, tpr=0.9
    )
    mean, variance = metrics.gaussian_mixture(means, variances)
    aleatoric, epistemic = metrics.uncertainty_split(means, variances)
    ood_aleatoric, ood_epistemic = metrics.uncertainty_split(ood_means, ood_variances)
    expected = {
        "nll": metrics.gaussian_nll(mean, variance, y),
        "rmse": float(np.sqrt(np.mean((mean - y) ** 2))),
        "mixture_nll": metrics.mixture_nll(means, variances, y),
        "crps": metrics.crps_gaussian(mean, variance, y),
        "mixture_crps": metrics.crps_mixture(means, variances, y),
        "interval_coverage_0.8": metrics.interval_coverage(mean, variance, y, level=0.8),
        "calibration_error": metrics.regression_calibration(mean, variance, y).error,
        "aleatoric_variance": float(aleatoric.mean()),
        "epistemic_variance": float(epistemic.mean()),
    }
    for name, inside, outside in (
        ("total_variance", variance, ood_aleatoric + ood_epistemic),
        ("epistemic_variance", epistemic, ood_epistemic),
    ):
        expected[f"ood_auroc_{name}"] = metrics.ood_auroc(inside, outside)
        expected[f"ood_aupr_{name}"] = metrics.ood_aupr(inside, outside)
        expected[f"ood_fpr90_{name}"] = metrics.fpr_at_tpr(inside, outside, 0.9)
    assert result == pytest.approx(expected, rel=1e-12)
    vector = metrics.summary(
        means[..., None].repeat(3, -1), y[:, None].repeat(3, -1), variances=variances[..., None].repeat(3, -1)
    )
    assert vector["nll"] == pytest.approx(expected["nll"])  # (B, 3) outputs: the same values, averaged


def test_summary_prints_as_a_markdown_table() -> None:
    logits, labels, _ = classification(2, seed=3)
    result = metrics.summary(logits, labels, logits=True)
    lines = str(result).splitlines()
    assert lines[:2] == ["| Metric | Value |", "|---|---:|"]
    assert len(lines) == len(result) + 2
    for line, (name, value) in zip(lines[2:], result.items(), strict=True):
        assert line == f"| {name} | {value:.4f} |"
    assert isinstance(result, dict)


LOGITS, LABELS, OOD = classification(2, seed=4)
ERRORS: dict[str, tuple[Callable[[], object], str]] = {
    "ood-classes": (
        lambda: metrics.summary(LOGITS, LABELS, logits=True, ood_members=OOD[..., :3]),
        r"ood_members must have the members and classes of members",
    ),
    "ood-members": (
        lambda: metrics.summary(LOGITS, LABELS, logits=True, ood_members=OOD[:1]),
        r"ood_members must have the members and classes",
    ),
    "ood-variances-alone": (
        lambda: metrics.summary(LOGITS, LABELS, ood_variances=OOD),
        r"ood_variances is for regression: pass variances too",
    ),
    "regression-logits": (
        lambda: metrics.summary(LOGITS[..., 0], LABELS, logits=True, variances=np.ones((2, 40))),
        r"logits=True is for classification",
    ),
    "regression-ood-without-variances": (
        lambda: metrics.summary(LOGITS[..., 0], LABELS * 1.0, variances=np.ones((2, 40)), ood_members=OOD[..., 0]),
        r"need ood_variances",
    ),
    "regression-ood-shape": (
        lambda: metrics.summary(
            LOGITS[..., 0], LABELS * 1.0, variances=np.ones((2, 40)), ood_members=OOD, ood_variances=np.ones((2, 30, 4))
        ),
        r"ood_members must have the output shape of members \(\)",
    ),
    "labels": (lambda: metrics.summary(LOGITS, LABELS + 4, logits=True), r"labels must lie in \[0, 4\)"),
    "bins": (lambda: metrics.summary(LOGITS, LABELS, logits=True, bins=0), r"bins must be an integer >= 1"),
    "tpr": (lambda: metrics.summary(LOGITS, LABELS, logits=True, tpr=1.5), r"tpr must lie in \(0, 1\]"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_raises_a_clear_error(case: str) -> None:
    call, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()
