"""Metrics speed: each masksembles_core.metrics function ÷ its reference implementation on the same input.

    python benchmarks/bench_metrics.py [--rounds 5] [--samples 1000000] [--cases all|metrics|conformal]

B = 10⁶ samples (10⁵ for temperature scaling, as netcal is timed there), K = 10 classes, n = 4 members where a
metric takes members, float64. Ours and the reference are timed in turn within every round (interleaved medians),
so machine noise hits both alike; the table gives ours ÷ reference (below 1: ours is faster). The references:
scikit-learn (ranking metrics, log loss, Brier), SciPy (entropies), netcal (ECE, temperature scaling),
properscoring (Gaussian CRPS) and uncertainty-toolbox (regression calibration). Conformal prediction
(masksembles_core.conformal): ``calibrate_sets`` and ``.sets`` against MAPIE's ``SplitConformalClassifier``
(``conformalize`` and ``predict_set``, its estimator a prefit stand-in that returns the given probabilities) on
B = 10⁵ samples × K = 100 classes, one member, calibrated and predicted on the same arrays.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from _report import interleaved_medians, machine, publish

from masksembles_core import metrics

CLASSES = 10
MEMBERS = 4
TEMPERATURE_SAMPLES = 10**5
CONFORMAL_SAMPLES, CONFORMAL_CLASSES = 10**5, 100


class Case(NamedTuple):
    metric: str
    reference: str
    ours: Callable[[], object]
    theirs: Callable[[], object]
    samples: int


def cases(samples: int) -> list[Case]:
    import properscoring
    import uncertainty_toolbox
    from netcal.metrics import ECE
    from netcal.scaling import TemperatureScaling
    from scipy.special import softmax
    from scipy.stats import entropy
    from sklearn.metrics import average_precision_score, brier_score_loss, log_loss, roc_auc_score

    rng = np.random.default_rng(0)
    labels = rng.integers(0, CLASSES, samples)
    shared = rng.normal(size=(samples, CLASSES))
    shared[np.arange(samples), labels] += 2.0
    logits = 2.5 * (shared + 0.5 * rng.normal(size=(MEMBERS, samples, CLASSES)))
    members = softmax(logits, axis=-1)
    probs = members.mean(axis=0)
    scores, is_ood = rng.normal(size=samples), rng.random(samples) < 0.3
    scores[is_ood] += 1.0
    inside, outside = scores[~is_ood], scores[is_ood]
    binary = probs[:, :2] / probs[:, :2].sum(axis=1, keepdims=True)
    binary_labels = (labels % 2).astype(np.int64)
    mean, variance, y = rng.normal(size=samples), rng.uniform(0.1, 2.0, samples), rng.normal(size=samples)
    few = TEMPERATURE_SAMPLES
    confidences = softmax(logits[0, :few], axis=-1)
    few_labels = labels[:few]

    def netcal_temperature() -> object:
        return TemperatureScaling().fit(confidences, few_labels)

    def scipy_mutual_information() -> object:
        return entropy(members.mean(axis=0), axis=-1) - entropy(members, axis=-1).mean(axis=0)

    return [
        Case(
            "predictive_entropy",
            "scipy.stats.entropy of the mean",
            lambda: metrics.predictive_entropy(members),
            lambda: entropy(members.mean(axis=0), axis=-1),
            samples,
        ),
        Case(
            "mutual_information",
            "scipy.stats.entropy, total − expected",
            lambda: metrics.mutual_information(members),
            scipy_mutual_information,
            samples,
        ),
        Case(
            "negative_log_likelihood",
            "sklearn log_loss",
            lambda: metrics.negative_log_likelihood(probs, labels),
            lambda: log_loss(labels, probs, labels=list(range(CLASSES))),
            samples,
        ),
        Case(
            "brier_score (K = 2)",
            "sklearn brier_score_loss",
            lambda: metrics.brier_score(binary, binary_labels),
            lambda: brier_score_loss(binary_labels, binary[:, 1]),
            samples,
        ),
        Case(
            "expected_calibration_error",
            "netcal ECE",
            lambda: metrics.expected_calibration_error(probs, labels, bins=15),
            lambda: ECE(bins=15).measure(probs, labels),
            samples,
        ),
        Case(
            "ood_auroc",
            "sklearn roc_auc_score",
            lambda: metrics.ood_auroc(inside, outside),
            lambda: roc_auc_score(is_ood, scores),
            samples,
        ),
        Case(
            "ood_aupr",
            "sklearn average_precision_score",
            lambda: metrics.ood_aupr(inside, outside),
            lambda: average_precision_score(is_ood, scores),
            samples,
        ),
        Case(
            "crps_gaussian",
            "properscoring crps_gaussian",
            lambda: metrics.crps_gaussian(mean, variance, y),
            lambda: properscoring.crps_gaussian(y, mu=mean, sig=np.sqrt(variance)).mean(),
            samples,
        ),
        Case(
            "regression_calibration",
            "uncertainty-toolbox mean_absolute_calibration_error",
            lambda: metrics.regression_calibration(mean, variance, y, levels=np.linspace(0.01, 0.99, 100)),
            lambda: uncertainty_toolbox.metrics_calibration.mean_absolute_calibration_error(
                mean, np.sqrt(variance), y, vectorized=True
            ),
            samples,
        ),
        Case(
            "fit_temperature (one model)",
            "netcal TemperatureScaling",
            lambda: metrics.fit_temperature(logits[0, :few], labels[:few]),
            netcal_temperature,
            few,
        ),
    ]


def conformal_cases() -> list[Case]:
    """``calibrate_sets`` + ``.sets`` against MAPIE's conformalize + predict_set, LAC and APS (non-randomized sets:
    ``include_last_label=False``), α = 0.1, on the same (B, K) probabilities."""
    from mapie.classification import SplitConformalClassifier
    from scipy.special import softmax
    from sklearn.base import BaseEstimator, ClassifierMixin

    from masksembles_core import conformal

    class GivenProbabilities(ClassifierMixin, BaseEstimator):  # type: ignore[misc]
        """A prefit classifier whose input (B, K) is its predictive distribution."""

        classes_ = np.arange(CONFORMAL_CLASSES)

        def fit(self, x: np.ndarray, y: np.ndarray) -> GivenProbabilities:
            return self

        def __sklearn_is_fitted__(self) -> bool:
            return True

        def predict_proba(self, x: np.ndarray) -> np.ndarray:
            return x

        def predict(self, x: np.ndarray) -> np.ndarray:
            return x.argmax(axis=1)

    rng = np.random.default_rng(1)
    probs = softmax(2.0 * rng.normal(size=(CONFORMAL_SAMPLES, CONFORMAL_CLASSES)), axis=1)
    drawn = (rng.random((CONFORMAL_SAMPLES, 1)) > probs.cumsum(axis=1)).sum(axis=1)  # labels from the model itself
    labels = np.minimum(drawn, CONFORMAL_CLASSES - 1)

    def ours(score: conformal.SetScore) -> Callable[[], object]:
        return lambda: conformal.calibrate_sets(probs, labels, alpha=0.1, score=score).sets(probs)

    def mapie(score: str) -> Callable[[], object]:
        def run() -> object:
            classifier = SplitConformalClassifier(
                GivenProbabilities(), confidence_level=0.9, conformity_score=score, prefit=True, random_state=0
            )
            params = {"include_last_label": False} if score == "aps" else None
            return classifier.conformalize(probs, labels).predict_set(probs, conformity_score_params=params)

        return run

    return [
        Case(
            f"conformal.calibrate_sets + .sets ({score.upper()}, K = {CONFORMAL_CLASSES})",
            "MAPIE 1.6 SplitConformalClassifier conformalize + predict_set",
            ours(score),
            mapie(score),
            CONFORMAL_SAMPLES,
        )
        for score in ("lac", "aps")
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--samples", type=int, default=10**6)
    parser.add_argument(
        "--cases", choices=("all", "metrics", "conformal"), default="all", help="a part prints only (no write)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the references' own deprecation warnings
    rows = [
        "| metric | reference | B | ours (ms) | reference (ms) | ours ÷ reference |",
        "|---|---|---:|---:|---:|---:|",
    ]
    selected = [
        *(cases(args.samples) if args.cases in ("all", "metrics") else []),
        *(conformal_cases() if args.cases in ("all", "conformal") else []),
    ]
    for case in selected:
        times = interleaved_medians({"ours": case.ours, "theirs": case.theirs}, rounds=args.rounds, warmup=1)
        ours, theirs = times["ours"], times["theirs"]
        row = (
            f"| `{case.metric}` | {case.reference} | {case.samples:.0e} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} "
            f"| {ours / theirs:.2f}× |"
        )
        rows.append(row)
        print(row, flush=True)
    text = "\n".join(
        [
            "## Metrics against their reference implementations",
            "",
            f"Each `masksembles_core.metrics` function and its reference on the same float64 input: B samples, "
            f"K = {CLASSES} classes, n = {MEMBERS} members for the member metrics (`predictive_entropy` and "
            "`mutual_information` take member probabilities, so their time includes checking them). Medians of "
            f"{args.rounds} interleaved rounds, one run on {machine()}. Below 1×: ours is faster. "
            "`crps_gaussian` calls the C library's `erfc` element by element (NumPy has no vectorized erf and SciPy "
            "is not a dependency), where properscoring uses SciPy's. The conformal rows: B = 10⁵ samples × K = "
            f"{CONFORMAL_CLASSES} classes (one member), calibrated and predicted on the same probabilities; MAPIE's "
            "estimator is a prefit stand-in returning them, its APS sets non-randomized (`include_last_label=False`).",
            "",
            *rows,
        ]
    )
    publish("metrics", text, write=not args.no_write and args.cases == "all")  # the section holds every row


if __name__ == "__main__":
    main()
