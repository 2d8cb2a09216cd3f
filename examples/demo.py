"""Masksembles' uncertainty and the paper's experiments, in one command (Durasov et al., CVPR 2021).

    python -m nox -s demo [-- --quick]
    python examples/demo.py [--framework torch|keras|flax] [--quick] [--output examples/output] [--seed 0]

1. Toy transition: red vs blue points around y = 2 sin x and y = 2 cos x on x in [-5, 5]; a
   Single MLP, Masksembles N=4, M=100, S in {1.1, 2, 3, 10} (the paper's mask algorithm, so the
   width grows with S) and a Deep Ensemble of 4. Entropy maps, and the mean entropy and mutual
   information away from the data.
2. Masks and theory: masks for several S, measured vs analytical IoU(S) = 1/(2S-1), relative
   model size M·S·(1-(1-1/S)^N)/M as a function of S and N.
3. Regression (examples/_demo_regression.py): members with a (mean, log-variance) head trained on
   each adapter's Gaussian NLL loss. A 1-D toy with noise growing with x and a gap in the data
   (intervals plotted; the epistemic spread in the gap and beyond the data divided by that on the
   data), and scikit-learn's diabetes (RMSE, NLL, 90% interval coverage, calibration error). Conformal
   intervals on the toy (examples/_demo_conformal.py): absolute vs normalized by the members' mixture std.
4. Digits: scikit-learn's 8x8 digits, a small CNN trained on classes 0-6 (30% train, 15%
   validation, 55% test, split once per class from --seed), classes 7-9 held out as OOD. Single,
   MC-Dropout (rate picked on validation NLL), Masksembles N=4 at the single model's layer widths
   (S picked on validation NLL), Masksembles at the paper's size (members as wide as the single
   model, 2.3x its parameters) and a Deep Ensemble of 4, each also temperature-scaled, over several
   seeds: accuracy, NLL, ECE, Brier, AURC, OOD AUROC/AUPR/FPR95 by every uncertainty score,
   parameters, training time; accuracy and ECE under 5 corruptions at 5 severities; reliability
   diagrams; diversity; conformal prediction sets (LAC, APS, RAPS at α = 0.1 and 0.05, calibrated on
   half of the test images).

Everything is seeded. The torch path takes about 2 minutes with ``--quick`` and about 10 minutes
in full on two CPU cores. ``--framework keras`` runs on the backend KERAS_BACKEND names (torch
and jax were tried); ``--framework flax`` uses linen and optax. Tables (Markdown and CSV) and
PNG plots go to ``--output``; results.md gathers the tables.
"""

from __future__ import annotations

import argparse
import importlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import _demo_conformal
import numpy as np
from _demo_common import Framework, ModelSpec, N, TrainConfig, Trained, masksembles_spec, train_ensemble
from _demo_data import (
    CORRUPTIONS,
    IN_CLASSES,
    OOD_CLASSES,
    SEVERITIES,
    TOY_INPUT_SCALE,
    DigitsSplit,
    corrupt,
    digits_split,
    distance_to_data,
    toy_grid,
    toy_points,
)
from _demo_plots import (
    Pooled,
    plot_corruptions,
    plot_diversity,
    plot_masks,
    plot_reliability,
    plot_theory,
    plot_toy,
)
from _demo_regression import run_diabetes, run_regression_toy
from _demo_tables import Cell, Stat, Table, seed_stat
from numpy.typing import NDArray
from tqdm.auto import tqdm

import masksembles_core as mc
from masksembles_core import metrics

FRAMEWORKS = {"torch": "_demo_torch", "keras": "_demo_keras", "flax": "_demo_flax"}
EXTRAS = {"torch": "PyTorch", "keras": "Keras 3 and a backend (KERAS_BACKEND)", "flax": "Flax and optax"}
TOY_ONES = 100  # M, the capacity of every toy member
TOY_SCALES = (1.1, 2.0, 3.0, 10.0)
TOY_FAR = 1.5  # "away from the data": farther than this from every training point
DIGITS_WIDTHS = (32, 64, 128)
PAPER_SIZE = 2.3  # the paper's CIFAR-10 Masksembles: 2.3x the single model's size, members as wide as it
SIZE_ROW = f"Masksembles {PAPER_SIZE:g}×"
DIGITS_MODELS = ("Single", "MC-Dropout", "Masksembles", SIZE_ROW, "Deep Ensemble")
ECE_BINS = 10
MASK_PICTURE_SCALES = (1.0, 1.5, 2.0, 3.0, 10.0)


@dataclass(frozen=True)
class Preset:
    """How much of each experiment to run."""

    toy_per_class: int
    toy_seeds: int
    toy_train: TrainConfig
    toy_resolution: int
    theory_draws: int
    digits_seeds: int
    digits_train: TrainConfig
    dropout_rates: tuple[float, ...]
    scales: tuple[float, ...]
    regression_points: int
    regression_seeds: int
    regression_train: TrainConfig
    diabetes_seeds: int
    diabetes_train: tuple[TrainConfig, ...]  # training lengths to pick from on validation


PRESETS = {
    "full": Preset(
        toy_per_class=200,
        toy_seeds=5,
        toy_train=TrainConfig(epochs=200, batch_size=100, learning_rate=5e-3),
        toy_resolution=160,
        theory_draws=20,
        digits_seeds=5,
        digits_train=TrainConfig(epochs=60, batch_size=32, learning_rate=2e-3),
        dropout_rates=(0.1, 0.25, 0.5),
        scales=(1.5, 2.0, 3.0, 5.0),
        regression_points=300,
        regression_seeds=5,
        regression_train=TrainConfig(epochs=300, batch_size=32, learning_rate=3e-3),
        diabetes_seeds=5,
        diabetes_train=tuple(TrainConfig(epochs, 32, 1e-3) for epochs in (10, 20, 40, 80)),
    ),
    "quick": Preset(
        toy_per_class=150,
        toy_seeds=1,
        toy_train=TrainConfig(epochs=150, batch_size=100, learning_rate=5e-3),
        toy_resolution=100,
        theory_draws=5,
        digits_seeds=2,
        digits_train=TrainConfig(epochs=20, batch_size=32, learning_rate=3e-3),
        dropout_rates=(0.1, 0.3),
        scales=(2.0, 4.0),
        regression_points=300,
        regression_seeds=1,
        regression_train=TrainConfig(epochs=150, batch_size=32, learning_rate=3e-3),
        diabetes_seeds=2,
        diabetes_train=tuple(TrainConfig(epochs, 32, 1e-3) for epochs in (10, 20, 40)),
    ),
    # checks that every file and row is produced; the numbers mean nothing
    "smoke": Preset(
        toy_per_class=40,
        toy_seeds=1,
        toy_train=TrainConfig(epochs=2, batch_size=40, learning_rate=1e-2),
        toy_resolution=24,
        theory_draws=1,
        digits_seeds=2,
        digits_train=TrainConfig(epochs=1, batch_size=64, learning_rate=1e-2),
        dropout_rates=(0.1, 0.3),
        scales=(2.0, 4.0),
        regression_points=60,
        regression_seeds=1,
        regression_train=TrainConfig(epochs=2, batch_size=32, learning_rate=1e-2),
        diabetes_seeds=1,
        diabetes_train=(TrainConfig(1, 64, 1e-2),),
    ),
}


def load_framework(name: str) -> Framework:
    """The demo's model code for ``name`` (``examples/_demo_<name>.py``), or exit saying what to install."""
    try:
        framework: Framework = importlib.import_module(FRAMEWORKS[name])
    except ImportError as error:
        raise SystemExit(
            f"--framework {name} needs {EXTRAS[name]} ({error}); e.g. python -m pip install -e '.[{name}]'"
        ) from error
    return framework


# --- 1. toy transition -------------------------------------------------------------------------


def toy_models(seed: int) -> dict[str, ModelSpec]:
    """Single (M hidden units), Masksembles with M ones per mask for each S (paper's algorithm), ensemble."""
    single = ModelSpec("mlp", (2,), 2, (TOY_ONES, TOY_ONES))
    models = {"Single": single}
    for scale in TOY_SCALES:
        masks = [mc.sample_masks(TOY_ONES, N, scale, seed=mc.derive_seed(seed, block)) for block in range(2)]
        models[f"Masksembles S={scale:g}"] = masksembles_spec(single, masks, scale)
    models["Deep Ensemble"] = single
    return models


def run_toy(framework: Framework, preset: Preset, base_seed: int, output: Path) -> Table:
    xs, ys, grid = toy_grid(preset.toy_resolution)
    names = list(toy_models(base_seed))
    per_seed: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    widths: dict[str, str] = {}
    parameters: dict[str, int] = {}
    maps: dict[str, NDArray[np.float64]] = {}
    first_points, first_labels = toy_points(preset.toy_per_class, base_seed)
    for seed in range(base_seed, base_seed + preset.toy_seeds):
        points, labels = toy_points(preset.toy_per_class, seed)
        far = distance_to_data(grid, points) > TOY_FAR
        inputs, grid_inputs = points / TOY_INPUT_SCALE, grid / TOY_INPUT_SCALE
        for name, spec in tqdm(toy_models(seed).items(), desc=f"toy seed {seed}", disable=None):
            if name == "Deep Ensemble":
                model: Trained = train_ensemble(framework, spec, inputs, labels, preset.toy_train, seed=seed, desc=name)
            else:
                model = framework.train(spec, inputs, labels, preset.toy_train, seed=seed, desc=name)
            logits = model.predict(grid_inputs)
            entropy = metrics.predictive_entropy(logits, logits=True)
            train_accuracy = metrics.accuracy(metrics.predictive_mean(model.predict(inputs), logits=True), labels)
            per_seed[name].append(
                (entropy[far].mean(), metrics.mutual_information(logits, logits=True)[far].mean(), train_accuracy)
            )
            widths[name] = "×".join(str(w) for w in spec.widths) + (
                f" (×{N} models)" if name == "Deep Ensemble" else ""
            )
            parameters[name] = model.parameters
            if seed == base_seed:
                maps[name] = entropy.reshape(len(ys), len(xs))
    plot_toy(output / "toy_transition.png", xs, ys, maps, first_points, first_labels)
    rows = tuple(
        (
            name,
            widths[name],
            parameters[name],
            seed_stat([v[0] for v in per_seed[name]]),
            seed_stat([v[1] for v in per_seed[name]]),
            seed_stat([v[2] for v in per_seed[name]]),
        )
        for name in names
    )
    return Table(
        "Toy transition: mean predictive entropy away from the data",
        ("Model", "Hidden widths", "Parameters", "Entropy away from data", "MI away from data", "Train accuracy"),
        rows,
        note=(
            f"Grid x ∈ [−10, 10], y ∈ [−6, 6]; 'away' = farther than {TOY_FAR} from every training point. "
            f"Entropy and mutual information (MI) in nats (max ln 2 = 0.693). Masksembles: N={N}, "
            f"M={TOY_ONES} ones per mask (the paper's algorithm, so the width grows with S). "
            f"Mean ± std over {preset.toy_seeds} seed(s) (data, weights and masks)."
        ),
    )


# --- 2. masks and theory -------------------------------------------------------------------------


def run_theory(preset: Preset, base_seed: int, output: Path) -> None:
    plot_masks(output / "masks.png", MASK_PICTURE_SCALES, ones=16, channels=48, n=N, seed=base_seed)
    plot_theory(output / "theory.png", draws=preset.theory_draws)


# --- 3. digits -----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Run:
    """One trained digits model of one seed: its member logits on every evaluation set and their scores."""

    model: Trained
    val: NDArray[np.float64]
    test: NDArray[np.float64]
    ood: NDArray[np.float64]
    scores: dict[str, float]
    temperature: float = 1.0


def evaluate(
    model: Trained,
    data: DigitsSplit,
    logits: tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]],
    temperature: float = 1.0,
) -> Run:
    """``metrics.summary`` of the test logits (OOD: classes 7-9), and the validation NLL."""
    val, test, ood = logits
    scores = dict(metrics.summary(test, data.y_test, logits=True, ood_members=ood, bins=ECE_BINS))
    scores["val_nll"] = metrics.negative_log_likelihood(metrics.predictive_mean(val, logits=True), data.y_val)
    return Run(model, val, test, ood, scores, temperature)


def predictions(model: Trained, data: DigitsSplit) -> Run:
    return evaluate(model, data, (model.predict(data.x_val), model.predict(data.x_test), model.predict(data.x_ood)))


def temperature_scaled(run: Run, data: DigitsSplit) -> Run:
    """``run`` with one temperature for all members, fitted on the validation logits."""
    temperature = metrics.fit_temperature(run.val, data.y_val)
    val, test, ood = (metrics.apply_temperature(logits, temperature) for logits in (run.val, run.test, run.ood))
    return evaluate(run.model, data, (val, test, ood), temperature)


def members_as_wide_as(single: ModelSpec, scale: float) -> tuple[int, ...]:
    """Layer widths whose ``generate_masks(width, N, scale)`` masks keep as many channels as ``single``'s layers."""
    widths = []
    for ones in single.widths:
        width = ones
        while mc.ones_per_mask(width, N, scale) < ones:  # rises by at most one per channel: stops at ``ones``
            width += 1
        widths.append(width)
    return tuple(widths)


def paper_size_scale(single: ModelSpec) -> float:
    """The S (step 0.01) at which members as wide as ``single`` make a network of ``PAPER_SIZE``× its parameters."""
    scales = np.round(np.arange(1.01, 5.0, 0.01), 2)
    ratios = [replace(single, widths=members_as_wide_as(single, s)).parameters / single.parameters for s in scales]
    return float(scales[int(np.argmin(np.abs(np.array(ratios) - PAPER_SIZE)))])


def digits_single(data: DigitsSplit) -> ModelSpec:
    return ModelSpec("cnn", data.x_train.shape[1:], len(IN_CLASSES), DIGITS_WIDTHS)


def digits_seed(
    framework: Framework, preset: Preset, data: DigitsSplit, seed: int, size_scale: float
) -> dict[str, list[tuple[str, Run]]]:
    """Every model of one seed: ``{method: [(setting, run), ...]}``, several settings for the swept methods."""
    x, y, config = data.x_train, data.y_train, preset.digits_train
    single = digits_single(data)
    size_widths = members_as_wide_as(single, size_scale)
    specs: dict[str, list[tuple[str, ModelSpec]]] = {
        "Single": [("", single)],
        "MC-Dropout": [
            (f"p={rate:g}", ModelSpec("cnn", x.shape[1:], len(IN_CLASSES), DIGITS_WIDTHS, "dropout", rate, N))
            for rate in preset.dropout_rates
        ],
        "Masksembles": [
            (
                f"S={scale:g}",
                masksembles_spec(
                    single,
                    [mc.generate_masks(w, N, scale, seed=mc.derive_seed(seed, i)) for i, w in enumerate(DIGITS_WIDTHS)],
                    scale,
                ),
            )
            for scale in preset.scales
        ],
        SIZE_ROW: [
            (
                f"S={size_scale:g}",
                masksembles_spec(
                    single,
                    [
                        mc.generate_masks(w, N, size_scale, seed=mc.derive_seed(seed, i))
                        for i, w in enumerate(size_widths)
                    ],
                    size_scale,
                ),
            )
        ],
    }
    runs: dict[str, list[tuple[str, Run]]] = {}
    with tqdm(total=sum(map(len, specs.values())) + 1, desc=f"digits seed {seed}", disable=None) as bar:
        for method, settings in specs.items():
            runs[method] = []
            for setting, spec in settings:
                model = framework.train(spec, x, y, config, seed=seed, desc=f"{method} {setting}")
                runs[method].append((setting, predictions(model, data)))
                bar.update()
        ensemble = train_ensemble(framework, single, x, y, config, seed=seed, desc="Deep Ensemble")
        runs["Deep Ensemble"] = [("", predictions(ensemble, data))]
        bar.update()
    return runs


def run_digits(
    framework: Framework, preset: Preset, base_seed: int, output: Path
) -> tuple[Table, Table, Table, Table, Table]:
    data = digits_split(base_seed)
    seeds = list(range(base_seed, base_seed + preset.digits_seeds))
    size_scale = paper_size_scale(digits_single(data))
    final: dict[str, list[Run]] = {name: [] for name in DIGITS_MODELS}
    sweep: dict[str, list[Run]] = {}
    picks: dict[str, list[str]] = {name: [] for name in DIGITS_MODELS}
    for seed in seeds:
        for method, options in digits_seed(framework, preset, data, seed, size_scale).items():
            best_setting, best_run = min(options, key=lambda option: option[1].scores["val_nll"])
            final[method].append(best_run)
            picks[method].append(best_setting)
            if len(options) > 1:
                for setting, run in options:
                    sweep.setdefault(f"{method} ({setting})", []).append(run)
    scaled = {name: [temperature_scaled(run, data) for run in runs] for name, runs in final.items()}

    main = main_table(final, scaled, picks, data, seeds, members_as_wide_as(digits_single(data), size_scale))
    sweep_table = sweep_table_of(sweep, picks, data, seeds)
    ood_table = ood_scores_table(final, seeds)
    shift = corruption_study(final, data, output)
    conformal_sets = {
        name: [_demo_conformal.set_scores(run.test, data.y_test, seed) for run, seed in zip(runs, seeds, strict=True)]
        for name, runs in scaled.items()
    }
    calibration = len(_demo_conformal.calibration_halves(len(data.y_test), base_seed)[0])
    conformal_table = _demo_conformal.digits_table(conformal_sets, calibration, len(data.y_test) - calibration)
    pooled = {name: pooled_test_set([run.test for run in runs], data) for name, runs in final.items()}
    by_scale = {
        scale: pooled_test_set([run.test for run in sweep[f"Masksembles (S={scale:g})"]], data)
        for scale in preset.scales
    }
    plot_reliability(output / "reliability.png", pooled, by_scale, bins=ECE_BINS)
    diversity = {f"Masksembles (S={s:g})": sweep[f"Masksembles (S={s:g})"] for s in preset.scales}
    diversity[f"{SIZE_ROW} ({picks[SIZE_ROW][0]})"] = final[SIZE_ROW]
    diversity["MC-Dropout (picked p)"] = final["MC-Dropout"]
    diversity["Deep Ensemble"] = final["Deep Ensemble"]
    plot_diversity(
        output / "diversity.png",
        {
            name: [metrics.pairwise_diversity(run.test, data.y_test, logits=True) for run in runs]
            for name, runs in diversity.items()
        },
        [run.scores["accuracy"] for run in final["Single"]],
    )
    return main, sweep_table, ood_table, shift, conformal_table


def pooled_test_set(members: Sequence[NDArray[np.float64]], data: DigitsSplit) -> Pooled:
    """The member logits of the test sets of all seeds together (n, seeds · B, K), and their labels."""
    return Pooled(np.concatenate(members, axis=1), np.tile(data.y_test, len(members)))


METRIC_COLUMNS = (  # (summary key, title, factor)
    ("accuracy", "Accuracy", 1.0),
    ("nll", "NLL", 1.0),
    ("ece", "ECE", 1.0),
    ("brier", "Brier", 1.0),
    ("aurc", "AURC ×10³", 1e3),
    ("ood_auroc_entropy", "OOD AUROC (entropy)", 1.0),
    ("ood_aupr_entropy", "OOD AUPR (entropy)", 1.0),
    ("ood_fpr95_entropy", "OOD FPR95 (entropy)", 1.0),
    ("ood_auroc_mutual_information", "OOD AUROC (MI)", 1.0),
    ("ood_aupr_mutual_information", "OOD AUPR (MI)", 1.0),
    ("ood_fpr95_mutual_information", "OOD FPR95 (MI)", 1.0),
)


SWEEP_COLUMNS = {
    "val_nll": "Val NLL",
    "accuracy": "Accuracy",
    "nll": "NLL",
    "ece": "ECE",
    "ood_auroc_mutual_information": "OOD AUROC (MI)",
}
OOD_SCORES = {
    "entropy": "predictive entropy",
    "mutual_information": "mutual information",
    "msp": "1 − max probability",
    "max_logit": "− max logit",
    "energy": "energy",
    "variation_ratio": "variation ratio",
    "probability_variance": "probability variance",
}


def metric_cells(runs: Sequence[Run]) -> tuple[Stat, ...]:
    """Mean ± std over seeds of every metric column; missing (one member: no MI) as NaN."""
    return tuple(
        seed_stat([factor * run.scores.get(key, math.nan) for run in runs]) for key, _, factor in METRIC_COLUMNS
    )


def main_table(
    final: dict[str, list[Run]],
    scaled: dict[str, list[Run]],
    picks: dict[str, list[str]],
    data: DigitsSplit,
    seeds: list[int],
    size_widths: tuple[int, ...],
) -> Table:
    single_parameters = final["Single"][0].model.parameters
    rows: list[tuple[Cell, ...]] = []
    for name, runs in final.items():
        parameters = runs[0].model.parameters
        size = f"{parameters / single_parameters:.2f}×"
        seconds = seed_stat([run.model.seconds for run in runs], digits=1)
        picked = ", ".join(filter(None, picks[name])) or "—"
        temperatures = seed_stat([run.temperature for run in scaled[name]], digits=2)
        rows.append((name, picked, *metric_cells(runs), parameters, size, seconds))
        rows.append((f"{name} + TS", f"T = {temperatures}", *metric_cells(scaled[name]), parameters, size, seconds))
    return Table(
        "Digits: in-distribution test set (classes 0–6) and OOD detection (classes 7–9)",
        (
            "Model",
            "Picked on validation",
            *(title for _, title, _ in METRIC_COLUMNS),
            "Parameters",
            "Size",
            "Train time (s)",
        ),
        tuple(rows),
        note=(
            f"Mean ± std over {len(seeds)} seeds ({seeds[0]}–{seeds[-1]}: weights, shuffling, masks, dropout). "
            f"{len(data.y_train)} train / {len(data.y_val)} validation / {len(data.y_test)} test images of classes "
            f"{IN_CLASSES[0]}–{IN_CLASSES[-1]}; {len(data.x_ood)} OOD images of classes {OOD_CLASSES[0]}–"
            f"{OOD_CLASSES[-1]}. N={N} members for MC-Dropout (samples), Masksembles (masks) and the ensemble. "
            f"Masksembles keeps the single model's layer widths {DIGITS_WIDTHS} (S picked on validation NLL); "
            f"{SIZE_ROW} is the paper's CIFAR-10 size setting: every mask keeps as many channels as the single "
            f"model's layer (members as wide as the single model) and S is set so that the network has "
            f"{PAPER_SIZE:g}× the single model's parameters (layer widths {size_widths} here). "
            "+ TS: the same models with one temperature for all members, fitted on the validation logits "
            "(metrics.fit_temperature) and applied before averaging. "
            f"ECE with {ECE_BINS} equal-width bins. AURC: area under the risk-coverage curve of the maximum "
            "probability, ×1000 (lower is better). OOD: higher score = more OOD; AUROC and AUPR with OOD as positives, "
            "FPR95 = fraction of OOD images accepted when 95 % of the in-distribution test images are (lower is "
            "better). MI = mutual information (one member: undefined). "
            "Size: parameters ÷ the single model's. Train time: the model (the ensemble: its 4 members), on this "
            "machine; temperature scaling adds no training."
        ),
    )


def sweep_table_of(
    sweep: dict[str, list[Run]], picks: dict[str, list[str]], data: DigitsSplit, seeds: list[int]
) -> Table:
    rows: list[tuple[Cell, ...]] = []
    for name, runs in sweep.items():
        method, option = name.split(" (")[0], name.split("(")[1].rstrip(")")
        pairs = [metrics.pairwise_diversity(run.test, data.y_test, logits=True).diversity.mean() for run in runs]
        rows.append(
            (
                method,
                option,
                *(seed_stat([run.scores[key] for run in runs]) for key in SWEEP_COLUMNS),
                seed_stat(pairs),
                f"{picks[method].count(option)}/{len(seeds)}",
            )
        )
    return Table(
        "Digits: the validation sweeps (MC-Dropout rate, Masksembles S at fixed layer widths)",
        ("Method", "Setting", *SWEEP_COLUMNS.values(), "Member diversity", "Picked"),
        tuple(rows),
        note=(
            f"Masksembles keeps the layer widths {DIGITS_WIDTHS} of the single model and uses "
            "`generate_masks(C, 4, S)`: each mask keeps C / (S·(1−(1−1/S)^4)) channels, so a larger S means "
            "less overlap and fewer channels per member. Member diversity: mean over member pairs of "
            "disagreement / (1 − accuracy). Picked: seeds for which the setting had the lowest validation NLL."
        ),
    )


def ood_scores_table(final: dict[str, list[Run]], seeds: list[int]) -> Table:
    """OOD detection of every final model by every score ``metrics.summary`` gives for it."""
    rows: tuple[tuple[Cell, ...], ...] = tuple(
        (
            name,
            title,
            *(
                seed_stat([run.scores[f"ood_{metric}_{score}"] for run in runs])
                for metric in ("auroc", "aupr", "fpr95")
            ),
        )
        for name, runs in final.items()
        for score, title in OOD_SCORES.items()
        if f"ood_auroc_{score}" in runs[0].scores
    )
    return Table(
        "Digits: OOD detection (classes 7–9) by each uncertainty score",
        ("Model", "Score", "AUROC", "AUPR", "FPR95"),
        rows,
        note=(
            "Every score is higher for inputs more likely OOD. AUROC and AUPR with OOD as positives; FPR95: "
            "fraction of OOD images accepted when 95 % of the in-distribution test images are. Scores of the "
            "members' disagreement (mutual information, variation ratio, probability variance) need more than "
            f"one member. Mean ± std over {len(seeds)} seeds."
        ),
    )


def corruption_study(final: dict[str, list[Run]], data: DigitsSplit, output: Path) -> Table:
    """Accuracy and ECE of the final models on every corruption and severity: PNG, CSV, and a summary table."""
    # every corruption at every severity in one prediction call per model; the clean column reuses run.test
    shifted = np.concatenate([corrupt(data.x_test, c, s) for c in CORRUPTIONS for s in SEVERITIES])
    results: dict[str, NDArray[np.float64]] = {}
    for name, runs in final.items():
        values = np.zeros((len(runs), len(CORRUPTIONS), len(SEVERITIES) + 1, 2))
        for seed_index, run in enumerate(runs):
            members = run.model.predict(shifted).reshape(run.test.shape[0], -1, *run.test.shape[1:])
            for index, test_members in enumerate([run.test, *members.swapaxes(0, 1)]):
                probs = metrics.predictive_mean(test_members, logits=True)
                scores_at = (
                    metrics.accuracy(probs, data.y_test),
                    metrics.expected_calibration_error(probs, data.y_test, bins=ECE_BINS),
                )
                if index == 0:
                    values[seed_index, :, 0] = scores_at
                else:
                    corruption, severity = divmod(index - 1, len(SEVERITIES))
                    values[seed_index, corruption, severity + 1] = scores_at
        results[name] = values
    plot_corruptions(output / "corruptions.png", results, list(CORRUPTIONS))
    rows = tuple(
        (name, corruption, severity, seed_stat(values[:, c, severity, 0]), seed_stat(values[:, c, severity, 1]))
        for name, values in results.items()
        for c, corruption in enumerate(CORRUPTIONS)
        for severity in SEVERITIES
    )
    Table("Digits under corruption", ("Model", "Corruption", "Severity", "Accuracy", "ECE"), rows).write(
        output / "digits_corruptions"
    )
    by_severity = values_by_severity(results)
    return Table(
        "Digits under corruption: mean over the 5 corruptions",
        ("Model", "Metric", "Clean", *(f"Severity {s}" for s in SEVERITIES)),
        by_severity,
        note=f"Corruptions: {', '.join(CORRUPTIONS)}. Mean ± std over seeds of the mean over corruptions.",
    )


def values_by_severity(results: dict[str, NDArray[np.float64]]) -> tuple[tuple[str | Stat, ...], ...]:
    """Rows (model, metric, clean, severity 1..5) from ``results[model]`` of shape (seeds, corruptions, 6, 2)."""
    return tuple(
        (name, metric, *(seed_stat(values[:, :, s, index].mean(axis=1)) for s in range(values.shape[2])))
        for name, values in results.items()
        for index, metric in enumerate(("accuracy", "ECE"))
    )


# --- main ----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", choices=list(FRAMEWORKS), default="torch")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a shorter run (about a minute)")
    size.add_argument("--smoke", action="store_true", help="a tiny run that only checks the outputs (seconds)")
    parser.add_argument("--output", type=Path, default=Path(__file__).resolve().parent / "output")
    parser.add_argument("--seed", type=int, default=0, help="first seed (each experiment uses consecutive seeds)")
    args = parser.parse_args(argv)
    preset_name = "smoke" if args.smoke else "quick" if args.quick else "full"
    preset = PRESETS[preset_name]
    framework = load_framework(args.framework)
    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    timings: list[str] = []

    def timed(label: str, since: float) -> None:
        timings.append(f"{label}: {time.perf_counter() - since:.0f} s")
        print(f"[{label} done in {time.perf_counter() - since:.0f} s]", flush=True)

    section = time.perf_counter()
    toy = run_toy(framework, preset, args.seed, output)
    toy.write(output / "toy_entropy")
    timed("toy transition", section)
    section = time.perf_counter()
    run_theory(preset, args.seed, output)
    timed("masks and theory", section)
    section = time.perf_counter()
    seeds = range(args.seed, args.seed + preset.regression_seeds)
    regression, regression_conformal = run_regression_toy(
        framework, seeds=seeds, points=preset.regression_points, config=preset.regression_train, output=output
    )
    regression.write(output / "regression_toy")
    regression_conformal.write(output / "regression_conformal")
    diabetes = run_diabetes(
        framework,
        seeds=range(args.seed, args.seed + preset.diabetes_seeds),
        configs=preset.diabetes_train,
        rates=preset.dropout_rates,
        scales=preset.scales,
        output=output,
    )
    diabetes.write(output / "diabetes_results")
    timed("regression", section)
    section = time.perf_counter()
    digits, sweep, ood, shift, digits_conformal = run_digits(framework, preset, args.seed, output)
    digits.write(output / "digits_results")
    sweep.write(output / "digits_sweep")
    ood.write(output / "digits_ood_scores")
    shift.write(output / "digits_shift")
    digits_conformal.write(output / "digits_conformal")
    timed("digits", section)
    total = time.perf_counter() - start

    tables = (toy, regression, regression_conformal, diabetes, digits, sweep, ood, shift, digits_conformal)
    summary = (
        f"# Masksembles demo results ({args.framework}, {preset_name} run, seed {args.seed})\n\n"
        f"Wall time {total:.0f} s ({'; '.join(timings)}).\n\n"
        + "\n\n".join(table.markdown() for table in tables)
        + "\n\nPlots: toy_transition.png, masks.png, theory.png, regression_toy.png, diabetes_calibration.png, "
        "corruptions.png, reliability.png, diversity.png (digits_corruptions.csv holds the corruption numbers).\n"
    )
    (output / "results.md").write_text(summary)
    for table in (regression, diabetes, digits):
        print()
        print(table.markdown())
    print(f"\nAll results in {output} (results.md, *.csv, *.png); wall time {total:.0f} s.")


if __name__ == "__main__":
    main()
