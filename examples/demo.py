"""Masksembles' uncertainty and the paper's experiments, in one command (Durasov et al., CVPR 2021).

    python -m nox -s demo [-- --quick]
    python examples/demo.py [--framework torch|keras|flax] [--quick] [--output examples/output] [--seed 0]

1. Toy transition: red vs blue points around y = 2 sin x and y = 2 cos x on x in [-5, 5]; a
   Single MLP, Masksembles N=4, M=100, S in {1.1, 2, 3, 10} (the paper's mask algorithm, so the
   width grows with S) and a Deep Ensemble of 4. Entropy maps, and the mean entropy and mutual
   information away from the data.
2. Masks and theory: masks for several S, measured vs analytical IoU(S) = 1/(2S-1), relative
   model size M·S·(1-(1-1/S)^N)/M as a function of S and N.
3. Digits: scikit-learn's 8x8 digits, a small CNN trained on classes 0-6 (30% train, 15%
   validation, 55% test, split once per class from --seed), classes 7-9 held out as OOD. Single,
   MC-Dropout (rate picked on validation NLL), Masksembles N=4 at the single model's layer widths
   (S picked on validation NLL) and a Deep Ensemble of 4, over several seeds: accuracy, NLL, ECE,
   Brier, OOD AUROC/AUPR by predictive entropy and by mutual information, parameters, training
   time; accuracy and ECE under 5 corruptions at 5 severities; reliability diagrams; diversity.

Everything is seeded. The torch path takes about 1 minute with ``--quick`` and about 7 minutes
in full on two CPU cores. ``--framework keras`` runs on the backend KERAS_BACKEND names (torch
and jax were tried); ``--framework flax`` uses linen and optax. Tables (Markdown and CSV) and
PNG plots go to ``--output``; results.md gathers the tables.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _demo_common import Ensemble, Framework, ModelSpec, TrainConfig, Trained
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
from _demo_plots import plot_corruptions, plot_diversity, plot_masks, plot_reliability, plot_theory, plot_toy
from _demo_tables import Cell, Stat, Table, seed_stat
from numpy.typing import NDArray
from tqdm.auto import tqdm

import masksembles_core as mc
from masksembles_core import metrics

FRAMEWORKS = {"torch": "_demo_torch", "keras": "_demo_keras", "flax": "_demo_flax"}
EXTRAS = {"torch": "PyTorch", "keras": "Keras 3 and a backend (KERAS_BACKEND)", "flax": "Flax and optax"}
N = 4  # masks, dropout samples and ensemble members
TOY_ONES = 100  # M, the capacity of every toy member
TOY_SCALES = (1.1, 2.0, 3.0, 10.0)
TOY_FAR = 1.5  # "away from the data": farther than this from every training point
DIGITS_WIDTHS = (32, 64, 128)
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


def train_ensemble(
    framework: Framework,
    spec: ModelSpec,
    x: NDArray[np.float32],
    y: NDArray[np.int64],
    config: TrainConfig,
    *,
    seed: int,
    desc: str,
) -> Ensemble:
    """``N`` independently initialized and shuffled copies of ``spec``."""
    return Ensemble(
        tuple(
            framework.train(spec, x, y, config, seed=mc.derive_seed(seed, 100 + k), desc=f"{desc} {k + 1}/{N}")
            for k in range(N)
        )
    )


def masksembles_spec(base: ModelSpec, masks: Sequence[NDArray[np.bool_]], scale: float) -> ModelSpec:
    """``base`` with Masksembles layers holding ``masks`` (made with ``scale``); the widths become the masks' widths."""
    return ModelSpec(
        base.arch,
        base.in_shape,
        base.classes,
        tuple(m.shape[1] for m in masks),
        method="masksembles",
        samples=masks[0].shape[0],
        masks=tuple(masks),
        scale=scale,
    )


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
            members = model.predict(grid_inputs)
            entropy = metrics.predictive_entropy(members)
            train_accuracy = metrics.accuracy(metrics.predictive_mean(model.predict(inputs)), labels)
            per_seed[name].append(
                (entropy[far].mean(), metrics.mutual_information(members)[far].mean(), train_accuracy)
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


@dataclass
class Run:
    """One trained digits model of one seed, with its member probabilities on every evaluation set."""

    model: Trained
    val: NDArray[np.float64]
    test: NDArray[np.float64]
    ood: NDArray[np.float64]


def predictions(model: Trained, data: DigitsSplit) -> Run:
    return Run(model, model.predict(data.x_val), model.predict(data.x_test), model.predict(data.x_ood))


def digits_seed(framework: Framework, preset: Preset, data: DigitsSplit, seed: int) -> dict[str, list[tuple[str, Run]]]:
    """Every model of one seed: ``{method: [(setting, run), ...]}``, several settings for the swept methods."""
    x, y, config = data.x_train, data.y_train, preset.digits_train
    single = ModelSpec("cnn", x.shape[1:], len(IN_CLASSES), DIGITS_WIDTHS)
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


def scores(run: Run, data: DigitsSplit) -> dict[str, float]:
    """Test accuracy, NLL, ECE, Brier and OOD detection by entropy and by mutual information."""
    probs = metrics.predictive_mean(run.test)
    result = {
        "accuracy": metrics.accuracy(probs, data.y_test),
        "nll": metrics.negative_log_likelihood(probs, data.y_test),
        "ece": metrics.expected_calibration_error(probs, data.y_test, bins=ECE_BINS),
        "brier": metrics.brier_score(probs, data.y_test),
        "val_nll": metrics.negative_log_likelihood(metrics.predictive_mean(run.val), data.y_val),
    }
    for name, score in (("entropy", metrics.predictive_entropy), ("mi", metrics.mutual_information)):
        if name == "mi" and run.test.shape[0] == 1:
            result |= {"auroc_mi": float("nan"), "aupr_mi": float("nan")}  # one member: MI is 0 everywhere
            continue
        inside, outside = score(run.test), score(run.ood)
        result[f"auroc_{name}"] = metrics.ood_auroc(inside, outside)
        result[f"aupr_{name}"] = metrics.ood_aupr(inside, outside)
    return result


def run_digits(framework: Framework, preset: Preset, base_seed: int, output: Path) -> tuple[Table, Table, Table]:
    data = digits_split(base_seed)
    seeds = list(range(base_seed, base_seed + preset.digits_seeds))
    final: dict[str, list[Run]] = {"Single": [], "MC-Dropout": [], "Masksembles": [], "Deep Ensemble": []}
    sweep: dict[str, list[Run]] = {}
    picks: dict[str, list[str]] = {"MC-Dropout": [], "Masksembles": []}
    for seed in seeds:
        for method, options in digits_seed(framework, preset, data, seed).items():
            best_setting, best_run = min(options, key=lambda option: scores(option[1], data)["val_nll"])
            final[method].append(best_run)
            if method in picks:
                picks[method].append(best_setting)
                for setting, run in options:
                    sweep.setdefault(f"{method} ({setting})", []).append(run)

    main = main_table(final, picks, data, seeds)
    sweep_table = sweep_table_of(sweep, picks, data, seeds)
    shift = corruption_study(final, data, output)
    diagrams = {name: pooled_reliability([run.test for run in runs], data, len(seeds)) for name, runs in final.items()}
    by_scale = {
        scale: pooled_reliability([run.test for run in sweep[f"Masksembles (S={scale:g})"]], data, len(seeds))
        for scale in preset.scales
    }
    plot_reliability(output / "reliability.png", diagrams, by_scale)
    diversity = {f"Masksembles (S={s:g})": sweep[f"Masksembles (S={s:g})"] for s in preset.scales}
    diversity["MC-Dropout (picked p)"] = final["MC-Dropout"]
    diversity["Deep Ensemble"] = final["Deep Ensemble"]
    plot_diversity(
        output / "diversity.png",
        {name: [metrics.pairwise_diversity(run.test, data.y_test) for run in runs] for name, runs in diversity.items()},
        [scores(run, data)["accuracy"] for run in final["Single"]],
    )
    return main, sweep_table, shift


def pooled_reliability(
    members: Sequence[NDArray[np.float64]], data: DigitsSplit, seeds: int
) -> metrics.ReliabilityDiagram:
    """Reliability over the test sets of all seeds together."""
    probs = np.concatenate([metrics.predictive_mean(m) for m in members])
    return metrics.reliability_diagram(probs, np.tile(data.y_test, seeds), bins=ECE_BINS)


METRIC_COLUMNS = (
    ("accuracy", "Accuracy"),
    ("nll", "NLL"),
    ("ece", "ECE"),
    ("brier", "Brier"),
    ("auroc_entropy", "OOD AUROC (entropy)"),
    ("aupr_entropy", "OOD AUPR (entropy)"),
    ("auroc_mi", "OOD AUROC (MI)"),
    ("aupr_mi", "OOD AUPR (MI)"),
)


def metric_cells(runs: Sequence[Run], data: DigitsSplit) -> tuple[Stat, ...]:
    per_seed = [scores(run, data) for run in runs]
    return tuple(seed_stat([s[key] for s in per_seed]) for key, _ in METRIC_COLUMNS)


def main_table(final: dict[str, list[Run]], picks: dict[str, list[str]], data: DigitsSplit, seeds: list[int]) -> Table:
    rows: tuple[tuple[Cell, ...], ...] = tuple(
        (
            name,
            ", ".join(picks.get(name, [])) or "—",
            *metric_cells(runs, data),
            runs[0].model.parameters,
            seed_stat([run.model.seconds for run in runs], digits=1),
        )
        for name, runs in final.items()
    )
    return Table(
        "Digits: in-distribution test set (classes 0–6) and OOD detection (classes 7–9)",
        ("Model", "Picked on validation", *(title for _, title in METRIC_COLUMNS), "Parameters", "Train time (s)"),
        rows,
        note=(
            f"Mean ± std over {len(seeds)} seeds ({seeds[0]}–{seeds[-1]}: weights, shuffling, masks, dropout). "
            f"{len(data.y_train)} train / {len(data.y_val)} validation / {len(data.y_test)} test images of classes "
            f"{IN_CLASSES[0]}–{IN_CLASSES[-1]}; {len(data.x_ood)} OOD images of classes {OOD_CLASSES[0]}–"
            f"{OOD_CLASSES[-1]}. N={N} members for MC-Dropout (samples), Masksembles (masks) and the ensemble. "
            f"ECE with {ECE_BINS} equal-width bins. MI = mutual information (one member: undefined). "
            "Train time: the selected model (the ensemble: its 4 members), on this machine."
        ),
    )


def sweep_table_of(
    sweep: dict[str, list[Run]], picks: dict[str, list[str]], data: DigitsSplit, seeds: list[int]
) -> Table:
    rows = []
    for name, runs in sweep.items():
        method, option = name.split(" (")[0], name.split("(")[1].rstrip(")")
        per_seed = [scores(run, data) for run in runs]
        pairs = [metrics.pairwise_diversity(run.test, data.y_test).diversity.mean() for run in runs]
        rows.append(
            (
                method,
                option,
                seed_stat([s["val_nll"] for s in per_seed]),
                seed_stat([s["accuracy"] for s in per_seed]),
                seed_stat([s["nll"] for s in per_seed]),
                seed_stat([s["ece"] for s in per_seed]),
                seed_stat([s["auroc_mi"] for s in per_seed]),
                seed_stat(pairs),
                f"{picks[method].count(option)}/{len(seeds)}",
            )
        )
    return Table(
        "Digits: the validation sweeps (MC-Dropout rate, Masksembles S at fixed layer widths)",
        ("Method", "Setting", "Val NLL", "Accuracy", "NLL", "ECE", "OOD AUROC (MI)", "Member diversity", "Picked"),
        tuple(rows),
        note=(
            f"Masksembles keeps the layer widths {DIGITS_WIDTHS} of the single model and uses "
            "`generate_masks(C, 4, S)`: each mask keeps C / (S·(1−(1−1/S)^4)) channels, so a larger S means "
            "less overlap and fewer channels per member. Member diversity: mean over member pairs of "
            "disagreement / (1 − accuracy). Picked: seeds for which the setting had the lowest validation NLL."
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
                probs = metrics.predictive_mean(test_members)
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
    digits, sweep, shift = run_digits(framework, preset, args.seed, output)
    digits.write(output / "digits_results")
    sweep.write(output / "digits_sweep")
    shift.write(output / "digits_shift")
    timed("digits", section)
    total = time.perf_counter() - start

    summary = (
        f"# Masksembles demo results ({args.framework}, {preset_name} run, seed {args.seed})\n\n"
        f"Wall time {total:.0f} s ({'; '.join(timings)}).\n\n"
        + "\n\n".join(table.markdown() for table in (toy, digits, sweep, shift))
        + "\n\nPlots: toy_transition.png, masks.png, theory.png, corruptions.png, reliability.png, diversity.png "
        "(digits_corruptions.csv holds the corruption numbers).\n"
    )
    (output / "results.md").write_text(summary)
    print()
    print(toy.markdown())
    print()
    print(digits.markdown())
    print(f"\nAll results in {output} (results.md, *.csv, *.png); wall time {total:.0f} s.")


if __name__ == "__main__":
    main()
