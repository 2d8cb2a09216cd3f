"""Regression part of the demo: members with a Gaussian (mean, log-variance) head, trained on each adapter's loss.

1. A 1-D toy with noise that grows with x and no data on (-1.5, 1.5): the predictive mean, the 90 % interval of the
   mixture and its epistemic part; the epistemic spread in the gap and beyond the data divided by that on the data.
2. scikit-learn's diabetes (442 patients, 10 features), a random 60/20/20 split per seed: RMSE, NLL, 90 %
   interval coverage and calibration error for Single, MC-Dropout, Masksembles and a Deep Ensemble.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import _demo_conformal as conformal_intervals
import numpy as np
from _demo_common import Framework, ModelSpec, N, TrainConfig, Trained, masksembles_spec, train_ensemble
from _demo_data import (
    REGRESSION_DATA,
    REGRESSION_GAP,
    REGRESSION_INPUT_SCALE,
    REGRESSION_PLOT,
    RegressionSplit,
    diabetes_split,
    regression_mean,
    regression_points,
)
from _demo_plots import RegressionCurves, plot_regression_calibration, plot_regression_toy
from _demo_tables import Cell, Table, seed_stat
from numpy.typing import NDArray
from tqdm.auto import tqdm

import masksembles_core as mc
from masksembles_core import metrics

FloatArray = NDArray[np.float64]
LEVEL = 0.9  # the prediction intervals
MIN_VARIANCE = 1e-6  # the variance floor of the adapters' Gaussian NLL losses
TOY_WIDTHS = (64, 64)
TOY_RATE = 0.1
TOY_SCALE = 3.0
TOY_TEST_POINTS = 1000
CALIBRATION_POINTS = 500  # the conformal intervals' calibration points, drawn like the test points
TOY_RESOLUTION = 241
DIABETES_WIDTHS = (32, 32)
MODELS = ("Single", "MC-Dropout", "Masksembles", "Deep Ensemble")


def gaussians(outputs: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Member outputs (n, B, 2) = (mean, log-variance) -> means and variances (n, B), floored as in the losses."""
    return outputs[..., 0], np.exp(np.maximum(outputs[..., 1], math.log(MIN_VARIANCE)))


def train(
    framework: Framework,
    name: str,
    spec: ModelSpec,
    x: NDArray[np.float32],
    y: NDArray[np.float32],
    config: TrainConfig,
    seed: int,
) -> Trained:
    if name == "Deep Ensemble":
        return train_ensemble(framework, spec, x, y, config, seed=seed, desc=name)
    return framework.train(spec, x, y, config, seed=seed, desc=name)


# --- 1. the toy with a gap -------------------------------------------------------------------------


def toy_specs(seed: int) -> dict[str, ModelSpec]:
    single = ModelSpec("mlp", (1,), 2, TOY_WIDTHS, task="regression")
    masks = [mc.generate_masks(w, N, TOY_SCALE, seed=mc.derive_seed(seed, i)) for i, w in enumerate(TOY_WIDTHS)]
    return {
        "Single": single,
        "MC-Dropout": ModelSpec("mlp", (1,), 2, TOY_WIDTHS, "dropout", TOY_RATE, N, task="regression"),
        "Masksembles": masksembles_spec(single, masks, TOY_SCALE),
        "Deep Ensemble": single,
    }


def toy_regions(x: FloatArray) -> dict[str, NDArray[np.bool_]]:
    """Grid points on the data's intervals, in the gap, and beyond the data."""
    (low, split), (resume, high) = REGRESSION_DATA
    on_data = ((x >= low) & (x <= split)) | ((x >= resume) & (x <= high))
    return {"data": on_data, "gap": (x > REGRESSION_GAP[0]) & (x < REGRESSION_GAP[1]), "beyond": (x < low) | (x > high)}


def run_regression_toy(
    framework: Framework, *, seeds: Sequence[int], points: int, config: TrainConfig, output: Path
) -> tuple[Table, Table]:
    """The toy's table and its conformal intervals' table (``_demo_conformal.regression_table``)."""
    grid = np.linspace(*REGRESSION_PLOT, TOY_RESOLUTION).astype(np.float32)
    regions = toy_regions(grid.astype(np.float64))
    per_seed: dict[str, list[dict[str, float]]] = {name: [] for name in MODELS}
    conformal_per_seed: dict[str, list[dict[str, float]]] = {name: [] for name in MODELS}
    parameters: dict[str, int] = {}
    curves: dict[str, RegressionCurves] = {}
    first_x, first_y = regression_points(points, seeds[0])
    for seed in seeds:
        x, y = regression_points(points, seed)
        x_test, y_test = regression_points(TOY_TEST_POINTS, mc.derive_seed(seed, 1))
        x_gap, y_gap = regression_points(TOY_TEST_POINTS, mc.derive_seed(seed, 2), gap=True)
        x_calibration, y_calibration = regression_points(CALIBRATION_POINTS, mc.derive_seed(seed, 3))
        for name, spec in tqdm(toy_specs(seed).items(), desc=f"regression toy seed {seed}", disable=None):
            model = train(framework, name, spec, x / REGRESSION_INPUT_SCALE, y, config, seed)
            parameters[name] = model.parameters
            scores: dict[str, float] = {}
            evaluated = {}
            for where, (inputs, targets) in {"test": (x_test, y_test), "gap": (x_gap, y_gap)}.items():
                members = gaussians(model.predict(inputs / REGRESSION_INPUT_SCALE))
                evaluated[where] = (*members, targets.astype(np.float64))
                mean, variance = metrics.gaussian_mixture(*members)
                scores[f"{where}_nll"] = metrics.gaussian_nll(mean, variance, targets)
                scores[f"{where}_coverage"] = metrics.interval_coverage(mean, variance, targets, level=LEVEL)
            calibration = gaussians(model.predict(x_calibration / REGRESSION_INPUT_SCALE))
            conformal_per_seed[name].append(
                conformal_intervals.interval_scores((*calibration, y_calibration.astype(np.float64)), evaluated)
            )
            means, variances = gaussians(model.predict(grid[:, None] / REGRESSION_INPUT_SCALE))
            epistemic = metrics.uncertainty_split(means, variances)[1]
            spread = {where: float(np.sqrt(epistemic[inside]).mean()) for where, inside in regions.items()}
            for where in ("gap", "beyond"):  # one member has no spread: no ratio
                scores[f"{where}_ratio"] = spread[where] / spread["data"] if means.shape[0] > 1 else math.nan
            scores |= {f"{where}_spread": value for where, value in spread.items()}
            per_seed[name].append(scores)
            if seed == seeds[0]:
                curves[name] = RegressionCurves(means, variances)
    plot_regression_toy(
        output / "regression_toy.png",
        grid,
        curves,
        first_x[:, 0],
        first_y,
        truth=regression_mean(grid),
        gap=REGRESSION_GAP,
        level=LEVEL,
        ratios={name: float(np.mean([s["gap_ratio"] for s in per_seed[name]])) for name in MODELS},
    )
    columns = (
        ("test_nll", "Test NLL"),
        ("test_coverage", f"Test {LEVEL:.0%} coverage"),
        ("gap_nll", "Gap NLL"),
        ("gap_coverage", f"Gap {LEVEL:.0%} coverage"),
        ("data_spread", "Epistemic std on data"),
        ("gap_spread", "Epistemic std in gap"),
        ("beyond_spread", "Epistemic std beyond data"),
        ("gap_ratio", "Gap ÷ data"),
        ("beyond_ratio", "Beyond ÷ data"),
    )
    rows: tuple[tuple[Cell, ...], ...] = tuple(
        (name, parameters[name], *(seed_stat([s[key] for s in per_seed[name]]) for key, _ in columns))
        for name in MODELS
    )
    (low, split), (resume, high) = REGRESSION_DATA
    intervals = conformal_intervals.regression_table(conformal_per_seed, CALIBRATION_POINTS, TOY_TEST_POINTS)
    return Table(
        "Regression toy: the epistemic spread in the gap and beyond the data",
        ("Model", "Parameters", *(title for _, title in columns)),
        rows,
        note=(
            f"y = sin(1.2x) + 0.15x² − 1 plus N(0, σ(x)²) noise, σ from 0.05 at x = −4 to 0.35 at x = 4; "
            f"{points} training points on [{low:g}, {split:g}] ∪ [{resume:g}, {high:g}], none in the gap "
            f"({REGRESSION_GAP[0]:g}, {REGRESSION_GAP[1]:g}). MLP {TOY_WIDTHS[0]}×{TOY_WIDTHS[1]} with a "
            f"(mean, log-variance) head trained on the Gaussian NLL; MC-Dropout p={TOY_RATE:g}, Masksembles "
            f"S={TOY_SCALE:g} at the single model's widths, N={N}. NLL and coverage of the members' mixture "
            f"(moment-matched Gaussian) on {TOY_TEST_POINTS} fresh points from the data's intervals (test) and "
            f"from the gap. Epistemic std: the mean over a grid on [{REGRESSION_PLOT[0]:g}, "
            f"{REGRESSION_PLOT[1]:g}] of the members' spread sqrt(var_k mean_k), on the data's intervals, in the "
            f"gap and beyond ±{high:g}; a ratio > 1 means the band widens away from the data. "
            f"Mean ± std over {len(seeds)} seed(s) (data, weights, masks)."
        ),
    ), intervals


# --- 2. diabetes -----------------------------------------------------------------------------------


DIABETES_COLUMNS = (
    ("rmse", "RMSE"),
    ("nll", "NLL"),
    ("mixture_nll", "NLL (exact mixture)"),
    (f"interval_coverage_{LEVEL:g}", f"{LEVEL:.0%} coverage"),
    ("calibration_error", "Calibration error"),
)


@dataclass(frozen=True)
class Candidate:
    """One trained setting of a method and its validation NLL."""

    setting: str
    config: TrainConfig
    model: Trained
    val_nll: float


def validation_nll(model: Trained, data: RegressionSplit) -> float:
    mean, variance = metrics.gaussian_mixture(*gaussians(model.predict(data.x_val)))
    return metrics.gaussian_nll(mean, variance, data.y_val)


def diabetes_settings(
    features: int, seed: int, rates: Sequence[float], scales: Sequence[float]
) -> dict[str, list[tuple[str, ModelSpec]]]:
    """The settings swept for each method: none for Single, the dropout rate, the Masksembles S."""
    single = ModelSpec("mlp", (features,), 2, DIABETES_WIDTHS, task="regression")
    masks = [
        [mc.generate_masks(w, N, scale, seed=mc.derive_seed(seed, i)) for i, w in enumerate(DIABETES_WIDTHS)]
        for scale in scales
    ]
    return {
        "Single": [("", single)],
        "MC-Dropout": [
            (f"p={rate:g}", ModelSpec("mlp", (features,), 2, DIABETES_WIDTHS, "dropout", rate, N, task="regression"))
            for rate in rates
        ],
        "Masksembles": [
            (f"S={scale:g}", masksembles_spec(single, layer_masks, scale))
            for scale, layer_masks in zip(scales, masks, strict=True)
        ],
    }


def diabetes_seed(
    framework: Framework,
    seed: int,
    *,
    configs: Sequence[TrainConfig],
    rates: Sequence[float],
    scales: Sequence[float],
) -> tuple[RegressionSplit, dict[str, Candidate]]:
    """One split: every method's setting and training length picked on validation NLL, and an ensemble of the Single."""
    data = diabetes_split(seed)
    settings = diabetes_settings(data.x_train.shape[1], seed, rates, scales)
    total = sum(map(len, settings.values())) * len(configs) + 1
    picked: dict[str, Candidate] = {}
    with tqdm(total=total, desc=f"diabetes seed {seed}", disable=None) as bar:
        for method, options in settings.items():
            candidates = []
            for setting, spec in options:
                for config in configs:
                    model = framework.train(spec, data.x_train, data.y_train, config, seed=seed, desc=method)
                    label = ", ".join(filter(None, (setting, f"{config.epochs} ep.")))
                    candidates.append(Candidate(label, config, model, validation_nll(model, data)))
                    bar.update()
            picked[method] = min(candidates, key=lambda candidate: candidate.val_nll)
        config = picked["Single"].config
        single = settings["Single"][0][1]
        ensemble = train_ensemble(framework, single, data.x_train, data.y_train, config, seed=seed, desc="Ensemble")
        label = f"{config.epochs} ep. (Single's)"
        picked["Deep Ensemble"] = Candidate(label, config, ensemble, validation_nll(ensemble, data))
        bar.update()
    return data, picked


def run_diabetes(
    framework: Framework,
    *,
    seeds: Sequence[int],
    configs: Sequence[TrainConfig],
    rates: Sequence[float],
    scales: Sequence[float],
    output: Path,
) -> Table:
    per_seed: dict[str, list[dict[str, float]]] = {name: [] for name in MODELS}
    picks: dict[str, list[str]] = {name: [] for name in MODELS}
    parameters: dict[str, int] = {}
    seconds: dict[str, list[float]] = {name: [] for name in MODELS}
    pooled: dict[str, list[tuple[FloatArray, FloatArray, FloatArray]]] = {name: [] for name in MODELS}
    sizes = diabetes_split(seeds[0])
    for seed in seeds:
        data, picked = diabetes_seed(framework, seed, configs=configs, rates=rates, scales=scales)
        for name, candidate in picked.items():
            means, variances = gaussians(candidate.model.predict(data.x_test))
            per_seed[name].append(metrics.summary(means, data.y_test, variances=variances, level=LEVEL))
            pooled[name].append((*metrics.gaussian_mixture(means, variances), data.y_test.astype(np.float64)))
            picks[name].append(candidate.setting)
            parameters[name] = candidate.model.parameters
            seconds[name].append(candidate.model.seconds)
    curves = {
        name: metrics.regression_calibration(*(np.concatenate(parts) for parts in zip(*pooled[name], strict=True)))
        for name in MODELS
    }
    plot_regression_calibration(output / "diabetes_calibration.png", curves)
    rows: tuple[tuple[Cell, ...], ...] = tuple(
        (
            name,
            "; ".join(picks[name]),
            *(seed_stat([s[key] for s in per_seed[name]]) for key, _ in DIABETES_COLUMNS),
            parameters[name],
            seed_stat(seconds[name], digits=1),
        )
        for name in MODELS
    )
    return Table(
        "Diabetes: Gaussian regression on held-out patients",
        ("Model", "Picked on validation", *(title for _, title in DIABETES_COLUMNS), "Parameters", "Train time (s)"),
        rows,
        note=(
            f"scikit-learn's diabetes: {len(sizes.y_train)} train / {len(sizes.y_val)} validation / "
            f"{len(sizes.y_test)} test patients, a new random split per seed; features and target standardized "
            f"with the training set (RMSE and NLL in target standard deviations). MLP {DIABETES_WIDTHS[0]}×"
            f"{DIABETES_WIDTHS[1]} with a (mean, log-variance) head trained on the Gaussian NLL; the training length "
            f"({', '.join(str(c.epochs) for c in configs)} epochs, batch {configs[0].batch_size}, Adam at "
            f"{configs[0].learning_rate:g}), the dropout rate and S are picked on validation NLL; the "
            f"ensemble's {N} members train as long as the picked Single. NLL: of the moment-matched Gaussian of the "
            f"members' mixture; NLL (exact mixture): of the mixture itself; coverage of the central {LEVEL:.0%} "
            "interval; calibration error: mean |observed − nominal| coverage over the levels 0.05–0.95 "
            f"(diabetes_calibration.png, all seeds pooled). Mean ± std over {len(seeds)} seeds."
        ),
    )
