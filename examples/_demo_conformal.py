"""Conformal part of the demo (masksembles_core.conformal): prediction sets on the digits, intervals on the 1-D toy.

1. Digits: the in-distribution test images are split in half once (from the seed): a calibration half and a test
   half. Each final model (temperature-scaled) calibrates LAC, APS and RAPS sets at α = 0.1 and 0.05 on the first
   and is scored on the second: coverage, mean set size and the coverage of small, middle and large sets.
2. Regression toy: calibration points drawn like the test points (from the data's intervals); absolute intervals
   (μ ± q̂) against intervals normalized by the members' mixture std (μ ± q̂ σ), on the data and in the gap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from _demo_tables import Cell, Table, seed_stat
from numpy.typing import NDArray

from masksembles_core import conformal

FloatArray = NDArray[np.float64]
ALPHAS = (0.1, 0.05)
RAPS_PENALTY, RAPS_K_REG = 0.05, 1
SET_SCORES: dict[str, dict[str, object]] = {
    "LAC": {"score": "lac"},
    "APS": {"score": "aps"},
    "RAPS": {"score": "raps", "penalty": RAPS_PENALTY, "k_reg": RAPS_K_REG},
}
SIZE_GROUPS = ((0, 1, "size 0–1"), (2, 3, "size 2–3"), (4, math.inf, "size ≥ 4"))  # set sizes, both ends included
INTERVAL_ALPHA = 0.1
INTERVAL_SCORES = {"absolute": "μ ± q̂", "normalized": "μ ± q̂·σ (mixture std)"}


def calibration_halves(samples: int, seed: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """A random half of ``samples`` indices to calibrate on and the other half to test on."""
    order = np.random.default_rng(seed).permutation(samples)
    return np.sort(order[: samples // 2]), np.sort(order[samples // 2 :])


def set_scores(logits: FloatArray, labels: NDArray[np.int64], seed: int) -> dict[str, float]:
    """Coverage, mean size and size-group coverage of every score at every α, member logits (n, B, K) of the test
    images, calibrated on one half and scored on the other."""
    calibration, test = calibration_halves(labels.size, seed)
    scores: dict[str, float] = {}
    for name, options in SET_SCORES.items():
        for alpha in ALPHAS:
            predictor = conformal.calibrate_sets(
                logits[:, calibration],
                labels[calibration],
                alpha=alpha,
                logits=True,
                **options,  # type: ignore[arg-type]
            )
            sets = predictor.sets(logits[:, test], logits=True)
            key = f"{name} {alpha:g}"
            scores[f"{key} coverage"] = conformal.coverage(sets, labels[test])
            scores[f"{key} size"] = conformal.mean_set_size(sets)
            stratified = conformal.size_stratified_coverage(sets, labels[test])
            for low, high, group in SIZE_GROUPS:
                inside = (stratified.sizes >= low) & (stratified.sizes <= high)
                count = stratified.counts[inside].sum()
                covered = (stratified.coverage[inside] * stratified.counts[inside]).sum()
                scores[f"{key} {group}"] = covered / count if count else math.nan
    return scores


def digits_table(per_seed: dict[str, list[dict[str, float]]], calibration: int, test: int) -> Table:
    """One row per model, score and α: the mean ± std over seeds of ``set_scores``."""
    rows: list[tuple[Cell, ...]] = []
    for model, runs in per_seed.items():
        for name in SET_SCORES:
            for alpha in ALPHAS:
                key = f"{name} {alpha:g}"
                columns = ("coverage", "size", *(group for _, _, group in SIZE_GROUPS))
                cells = (seed_stat(nan_free([run[f"{key} {column}"] for run in runs])) for column in columns)
                rows.append((model, name, f"{alpha:g}", *cells))
    return Table(
        "Digits: conformal prediction sets (coverage ≥ 1 − α guaranteed)",
        ("Model", "Score", "α", "Coverage", "Mean set size", *(f"Coverage, {g}" for _, _, g in SIZE_GROUPS)),
        tuple(rows),
        note=(
            f"The temperature-scaled models of the main table. The test images are split in half per seed: "
            f"{calibration} calibrate (conformal.calibrate_sets), {test} are predicted. LAC: 1 − p_y; APS: the "
            f"probability mass of the classes ranked up to y; RAPS: APS + {RAPS_PENALTY:g}·max(0, rank − "
            f"{RAPS_K_REG}). Coverage: the fraction of sets holding the label (≥ 1 − α on average over splits); "
            "the size-stratified columns give the coverage of the sets of those sizes (Angelopoulos et al. 2021): "
            "a score that adapts to the model's uncertainty covers about 1 − α at every size. — : no set of that "
            "size in any seed. Mean ± std over seeds."
        ),
    )


def nan_free(values: Sequence[float]) -> list[float]:
    """The values that are not NaN (a size group empty in some seeds), or one NaN when all are."""
    kept = [value for value in values if not math.isnan(value)]
    return kept or [math.nan]


def interval_scores(
    calibration: tuple[FloatArray, FloatArray, FloatArray],
    evaluated: dict[str, tuple[FloatArray, FloatArray, FloatArray]],
) -> dict[str, float]:
    """Coverage and mean width of absolute and normalized intervals, calibrated on ``calibration`` and evaluated on
    each of ``evaluated``: ``(means, variances, targets)``, the members' means and variances (n, B) and y (B,)."""
    means, variances, targets = calibration
    scores: dict[str, float] = {}
    for score in INTERVAL_SCORES:
        given = {"variances": variances} if score == "normalized" else {}
        predictor = conformal.calibrate_intervals(means, targets, alpha=INTERVAL_ALPHA, score=score, **given)  # type: ignore[arg-type]
        for where, (test_means, test_variances, test_targets) in evaluated.items():
            bounds = predictor.intervals(test_means, test_variances if score == "normalized" else None)
            scores[f"{score} {where} coverage"] = conformal.coverage(bounds, test_targets)
            scores[f"{score} {where} width"] = conformal.mean_width(bounds)
    return scores


def regression_table(per_seed: dict[str, list[dict[str, float]]], calibration: int, test: int) -> Table:
    columns = [(where, kind) for where in ("test", "gap") for kind in ("coverage", "width")]
    rows = tuple(
        (model, INTERVAL_SCORES[score], *(seed_stat([run[f"{score} {w} {k}"] for run in runs]) for w, k in columns))
        for model, runs in per_seed.items()
        for score in INTERVAL_SCORES
    )
    return Table(
        f"Regression toy: conformal {1 - INTERVAL_ALPHA:.0%} intervals, absolute against normalized",
        ("Model", "Interval", "Test coverage", "Test width", "Gap coverage", "Gap width"),
        rows,
        note=(
            f"conformal.calibrate_intervals at α = {INTERVAL_ALPHA:g} on {calibration} fresh points from the data's "
            f"intervals; {test} test points from the same intervals and {test} from the gap. Absolute: one width "
            "everywhere; normalized: |y − μ| / σ with σ the members' mixture std (mean of their variances plus the "
            "variance of their means), so the interval widens where the members are unsure. The guarantee holds "
            "on the test points (drawn like the calibration points), not in the gap. Mean ± std over seeds."
        ),
    )
