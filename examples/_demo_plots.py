"""Figures of the demo (matplotlib, Agg backend: PNG files only, no window)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from numpy.typing import NDArray

import masksembles_core as mc
from masksembles_core import plots
from masksembles_core.metrics import DiversityPoints, RegressionCalibration

FloatArray = NDArray[np.float64]
MODEL_COLORS = {
    "Single": "#4c9f95",
    "MC-Dropout": "#e0695f",
    "Masksembles": "#d3a53c",
    "Masksembles 2.3×": "#8a6a1c",
    "Deep Ensemble": "#9d7fb0",
}
TOY_COLORS = ("#d62728", "#1f77b4")  # red (label 0), blue (label 1)


def save(figure: Figure, path: Path) -> None:
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


def plot_toy(
    path: Path,
    xs: NDArray[np.float32],
    ys: NDArray[np.float32],
    entropy_maps: Mapping[str, FloatArray],
    points: NDArray[np.float32],
    labels: NDArray[np.int64],
) -> None:
    """One entropy map per model (low blue, high yellow, as in the paper) with the training points."""
    columns = 3
    rows = math.ceil(len(entropy_maps) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.9 * rows), squeeze=False)
    extent = (float(xs[0]), float(xs[-1]), float(ys[0]), float(ys[-1]))
    for axis, (name, entropy) in zip(axes.flat, entropy_maps.items(), strict=False):
        image = axis.imshow(entropy, origin="lower", extent=extent, cmap="viridis", vmin=0.0, vmax=math.log(2))
        for label, color in enumerate(TOY_COLORS):
            chosen = points[labels == label]
            axis.scatter(chosen[:, 0], chosen[:, 1], s=3, c=color, edgecolors="none")
        axis.set_title(name, fontsize=10)
        axis.set_xticks([-10, -5, 0, 5, 10])
    for axis in axes.flat[len(entropy_maps) :]:
        axis.axis("off")
    figure.colorbar(image, ax=axes, shrink=0.8, label="predictive entropy (nats)")
    figure.suptitle("Single model to ensembles: entropy of the prediction (data on x ∈ [−5, 5])")
    save(figure, path)


def plot_masks(path: Path, scales: Sequence[float], *, ones: int, channels: int, n: int, seed: int) -> None:
    """Masks for several S: the paper's algorithm (M ones, width grows with S) and fixed-width masks (C columns)."""
    figure, axes = plt.subplots(2, len(scales), figsize=(2.6 * len(scales), 3.4), squeeze=False)
    for column, scale in enumerate(scales):
        paper = mc.sample_masks(ones, n, scale, seed=seed)
        fixed = mc.generate_masks(channels, n, scale, seed=seed)
        for row, (masks, label) in enumerate(((paper, f"M={ones}"), (fixed, f"C={channels}"))):
            axis = axes[row, column]
            axis.imshow(masks, cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
            iou = mc.mask_stats(masks).mean_iou if n > 1 else 1.0
            axis.set_title(f"S={scale:g}, {label}, width {masks.shape[1]}\nIoU {iou:.2f}", fontsize=8)
            axis.set_yticks(range(n))
            axis.set_xticks([])
    axes[0, 0].set_ylabel("paper's algorithm\nmask", fontsize=8)
    axes[1, 0].set_ylabel("generate_masks\nmask", fontsize=8)
    figure.suptitle(f"N={n} masks (black = kept channel)")
    figure.tight_layout()
    save(figure, path)


def plot_theory(path: Path, *, draws: int, ones: int = 100, channels: int = 512) -> None:
    """Relative model size vs S for several N, and empirical vs analytical IoU(S)."""
    scales = np.linspace(1.0, 10.0, 19)
    dense = np.linspace(1.0, 10.0, 200)
    figure, (size_axis, iou_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for n in (1, 2, 4, 8, 16):
        analytic = [mc.expected_width(ones, n, s) / ones for s in dense]
        (line,) = size_axis.plot(dense, analytic, label=f"N={n}")
        measured = [
            np.mean([mc.sample_masks(ones, n, s, seed=d).shape[1] for d in range(draws)]) / ones for s in scales
        ]
        size_axis.plot(scales, measured, "o", color=line.get_color(), markersize=3)
    size_axis.set(xlabel="S", ylabel="total model size: layer width / M", title=f"Relative model size, M={ones} fixed")
    size_axis.legend(title="lines: M·S·(1−(1−1/S)^N)/M\ndots: measured", fontsize=8, title_fontsize=8)
    iou_axis.plot(dense, 1.0 / (2.0 * dense - 1.0), "k-", label="analytical 1/(2S−1)")
    makers: dict[str, Callable[[float, int], NDArray[np.bool_]]] = {
        f"paper's algorithm, M={ones}": lambda s, d: mc.sample_masks(ones, 4, s, seed=d),
        f"generate_masks, C={channels}": lambda s, d: mc.generate_masks(channels, 4, s, seed=d),
    }
    for label, make in makers.items():
        measured = [np.mean([mc.mask_stats(make(s, d)).mean_iou for d in range(draws)]) for s in scales]
        iou_axis.plot(scales, measured, "o", markersize=4, label=f"measured: {label}")
    iou_axis.set(xlabel="S", ylabel="mean pairwise IoU", title="Mask IoU, N=4", ylim=(0, 1.02))
    iou_axis.legend(fontsize=8)
    figure.tight_layout()
    save(figure, path)


def plot_corruptions(path: Path, results: Mapping[str, NDArray[np.float64]], corruptions: Sequence[str]) -> None:
    """Accuracy and ECE vs severity (0 = clean), one box per model: quartiles over seeds × corruptions.

    ``results[model]`` has shape (seeds, corruptions, 6 severities, 2) holding (accuracy, ECE).
    """
    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    models = list(results)
    width = 0.8 / len(models)
    for metric, (axis, name) in enumerate(zip(axes, ("accuracy", "ECE"), strict=True)):
        for index, model in enumerate(models):
            values = results[model][..., metric]
            severities = values.shape[2]
            per_severity = [values[:, :, s].ravel() if s else values[:, :1, 0].ravel() for s in range(severities)]
            color = MODEL_COLORS[model.split(" (")[0]]
            axis.boxplot(
                per_severity,
                positions=np.arange(severities) - 0.4 + width * (index + 0.5),
                widths=width * 0.85,
                whis=(0, 100),
                patch_artist=True,
                boxprops={"facecolor": color, "edgecolor": color},
                medianprops={"color": "black"},
                whiskerprops={"color": color},
                capprops={"color": color},
            )
        axis.set_xticks(range(6), ["clean", "1", "2", "3", "4", "5"])
        axis.set(xlabel="corruption severity", ylabel=name)
        axis.grid(axis="y", alpha=0.3)
    handles = [Rectangle((0, 0), 1, 1, color=MODEL_COLORS[m.split(" (")[0]]) for m in models]
    figure.suptitle(f"Digits under corruption ({', '.join(corruptions)})\nboxes: quartiles over seeds × corruptions")
    figure.tight_layout()
    figure.legend(handles, models, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(models), fontsize=9)
    save(figure, path)


class Pooled(NamedTuple):
    """A model's test-set member logits (n, seeds · B, K) of every seed together, and the labels (seeds · B,)."""

    logits: FloatArray
    labels: NDArray[np.int64]


def plot_reliability(path: Path, pooled: Mapping[str, Pooled], by_scale: Mapping[float, Pooled], *, bins: int) -> None:
    """Reliability diagrams of the final models (pooled over seeds), and Masksembles for every S swept."""
    figure, axes = plt.subplots(1, len(pooled) + 1, figsize=(3.3 * (len(pooled) + 1), 3.5), sharey=True)
    for axis, (name, model) in zip(axes, pooled.items(), strict=False):
        color = MODEL_COLORS[name.split(" (")[0]]
        plots.reliability(*model, logits=True, bins=bins, show_counts=True, color=color, label=name, ax=axis)
        axis.set_title(axis.get_title().replace(": ", "\n") + " (pooled)", fontsize=9)
    last = axes[-1]
    colors = plt.get_cmap("copper")(np.linspace(0.1, 0.9, max(len(by_scale), 1)))
    for color, (scale, model) in zip(colors, by_scale.items(), strict=False):
        plots.reliability(*model, logits=True, bins=bins, style="line", label=f"S={scale:g}", color=color, ax=last)
    last.set_title("Masksembles by S", fontsize=9)
    last.legend(fontsize=7)
    for axis in axes[1:]:
        axis.set_ylabel("")
    figure.suptitle("Reliability on the digits test set, all seeds pooled (numbers: samples per bin)", fontsize=10)
    figure.tight_layout()
    save(figure, path)


def plot_diversity(
    path: Path, points: Mapping[str, Sequence[DiversityPoints]], single_accuracy: Sequence[float]
) -> None:
    """The paper's diversity vs accuracy: one dot per pair of members (all seeds)."""
    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    axis.plot(single_accuracy, np.zeros(len(single_accuracy)), "s", color=MODEL_COLORS["Single"], label="Single")
    scale_colors = iter(plt.get_cmap("copper")(np.linspace(0.15, 0.85, len(points))))
    for name, per_seed in points.items():
        accuracy = np.concatenate([p.accuracy for p in per_seed])
        diversity = np.concatenate([p.diversity for p in per_seed])
        base = name.split(" (")[0]
        color = next(scale_colors) if base == "Masksembles" else MODEL_COLORS[base]
        marker = {"MC-Dropout": "^", "Deep Ensemble": "o", "Masksembles 2.3×": "D"}.get(base, "*")
        axis.plot(accuracy, diversity, marker, color=color, label=name, markersize=6, alpha=0.8, linestyle="none")
    low = min([*single_accuracy, *(p.accuracy.min() for s in points.values() for p in s)])
    grid = np.linspace(max(low - 0.02, 0.0), 0.999, 200)
    axis.plot(grid, np.minimum(2.0, 1.0 / (1.0 - grid)), "r--", linewidth=0.8, label="largest possible")
    axis.set(xlabel="accuracy (mean of the two members)", ylabel="diversity = disagreement / (1 − accuracy)")
    axis.set_ylim(bottom=-0.05, top=2.1)
    axis.legend(fontsize=7, loc="upper left")
    axis.set_title("Diversity vs accuracy of member pairs (digits test set)")
    figure.tight_layout()
    save(figure, path)


class RegressionCurves(NamedTuple):
    """One model's members on a grid: their means and variances, each (n, G)."""

    means: FloatArray
    variances: FloatArray


def plot_regression_toy(
    path: Path,
    grid: NDArray[np.float32],
    curves: Mapping[str, RegressionCurves],
    x: NDArray[np.float32],
    y: NDArray[np.float32],
    *,
    truth: FloatArray,
    gap: tuple[float, float],
    level: float,
    ratios: Mapping[str, float],
) -> None:
    """Per model: the data, the true function, the mean, the total and the epistemic interval, the gap shaded."""
    figure, axes = plt.subplots(1, len(curves), figsize=(4.0 * len(curves), 3.6), sharey=True, squeeze=False)
    for axis, (name, curve) in zip(axes[0], curves.items(), strict=True):
        axis.axvspan(*gap, color="0.92", zorder=0)
        plots.regression(grid, *curve, level=level, show_members=False, color=MODEL_COLORS[name], ax=axis)
        axis.plot(x, y, ".", color="0.35", markersize=2)
        axis.plot(grid, truth, "k--", linewidth=0.8)
        ratio = ratios[name]
        axis.set_title(name + ("" if math.isnan(ratio) else f"\nepistemic std gap ÷ data: {ratio:.2f}"), fontsize=9)
        axis.set_ylim(-4.0, 5.0)
    for axis in axes[0, 1:]:
        axis.set_ylabel("")
    figure.suptitle(
        f"Gaussian members: {level:.0%} interval of the mixture (light) and its epistemic part (dark); "
        "dashed: true function, grey: no training data",
        fontsize=9,
    )
    figure.tight_layout()
    save(figure, path)


def plot_regression_calibration(path: Path, curves: Mapping[str, RegressionCalibration]) -> None:
    """Observed vs nominal coverage of central intervals, one line per model."""
    figure, axis = plt.subplots(figsize=(4.5, 4.2))
    axis.plot([0, 1], [0, 1], "k--", linewidth=0.8)
    for name, curve in curves.items():
        label = f"{name} (error {curve.error:.3f})"
        axis.plot(curve.levels, curve.observed, "o-", color=MODEL_COLORS[name], markersize=3, label=label)
    axis.set(xlabel="nominal coverage of the central interval", ylabel="observed coverage", xlim=(0, 1), ylim=(0, 1))
    axis.legend(fontsize=7, loc="upper left")
    axis.set_title("Diabetes: regression calibration (test sets, all seeds pooled)", fontsize=9)
    figure.tight_layout()
    save(figure, path)
