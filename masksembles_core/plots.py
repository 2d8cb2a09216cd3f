"""The pictures of ``masksembles_core.metrics`` and ``conformal``: reliability, risk-coverage, OOD scores, regression
intervals, conformal sets and intervals.

Each function takes the arrays the metrics take (members (n, B, K) or (B, K), ``logits``,
``member_axis``), draws on ``ax`` (a new figure's Axes when None) and returns that Axes. The
numbers drawn are the metrics' own: the bars of ``reliability`` are ``metrics.reliability_diagram``,
the curve of ``risk_coverage`` is ``metrics.risk_coverage``, the threshold of ``ood_scores`` is the
one ``metrics.fpr_at_tpr`` uses. matplotlib is an optional dependency
(``pip install masksembles-kit[plots]``), imported when a function is called.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from . import conformal, metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def _axes(ax: Axes | None) -> Axes:
    """``ax``, or the Axes of a new figure; matplotlib is imported here, on first use."""
    if ax is not None:
        return ax
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "masksembles_core.plots needs matplotlib: pip install 'masksembles-kit[plots]' (or matplotlib)"
        ) from error
    return plt.figure().add_subplot()


def reliability(
    members: ArrayLike,
    labels: ArrayLike,
    *,
    logits: bool = False,
    member_axis: int = 0,
    bins: int = 15,
    style: Literal["bars", "line"] = "bars",
    show_counts: bool = False,
    label: str | None = None,
    color: Any = None,
    ax: Axes | None = None,
) -> Axes:
    """Reliability diagram of the predictive mean: accuracy against confidence in ``bins`` equal-width bins.

    ``style="bars"``: one bar per non-empty bin (height: its accuracy), the ECE in the title and,
    with ``show_counts``, the number of samples above each bar. ``style="line"``: the bins' mean
    confidence against their accuracy, labelled ``label`` (to compare models on one Axes). The
    diagonal is a calibrated model.
    """
    probs = metrics.predictive_mean(members, logits=logits, member_axis=member_axis)
    diagram = metrics.reliability_diagram(probs, labels, bins=bins)
    axes = _axes(ax)
    filled = diagram.counts > 0
    if style == "bars":
        centers = (diagram.edges[:-1] + diagram.edges[1:]) / 2.0
        axes.bar(
            centers[filled],
            diagram.accuracy[filled],
            width=np.diff(diagram.edges)[filled],
            color=color,
            edgecolor="black",
            linewidth=0.5,
            label=label,
        )
        if show_counts:
            for center, height, count in zip(
                centers[filled], diagram.accuracy[filled], diagram.counts[filled], strict=True
            ):
                axes.text(center, min(height, 0.93) + 0.02, str(count), ha="center", fontsize=6)
        axes.set_title(f"{label + ': ' if label else ''}ECE {diagram.ece:.3f}", fontsize=9)
    elif style == "line":
        line_label = f"{label} (ECE {diagram.ece:.3f})" if label else f"ECE {diagram.ece:.3f}"
        axes.plot(
            diagram.confidence[filled], diagram.accuracy[filled], "o-", color=color, markersize=3, label=line_label
        )
    else:
        raise ValueError(f"style must be 'bars' or 'line'; received {style!r}")
    axes.plot([0, 1], [0, 1], "k--", linewidth=0.8)
    axes.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="accuracy")
    return axes


def risk_coverage(
    members: ArrayLike,
    labels: ArrayLike,
    *,
    logits: bool = False,
    member_axis: int = 0,
    score: str = "msp",
    label: str | None = None,
    color: Any = None,
    ax: Axes | None = None,
) -> Axes:
    """Risk-coverage curve of selective prediction: the error rate of the most confident fraction of samples.

    The confidence is minus the OOD score ``score`` (one of ``metrics.OOD_SCORES``; the default,
    msp, ranks by the largest probability of the predictive mean); the legend gives the AURC.
    """
    validated = metrics._ValidatedMembers("members", members, logits=logits, member_axis=member_axis)
    probs = validated.probs.mean(axis=0)
    label_array = metrics._labels(labels, classes=probs.shape[1], against="members", shape=validated.probs.shape)
    correct = probs.argmax(axis=1) == label_array
    confidence = -validated.score(score)
    curve = metrics.risk_coverage(confidence, correct)
    axes = _axes(ax)
    aurc = float(curve.risk.mean())
    axes.plot(curve.coverage, curve.risk, color=color, label=f"{label or score} (AURC {aurc:.4f})")
    axes.set(xlim=(0, 1), xlabel="coverage (fraction of samples answered)", ylabel="risk (error rate)")
    axes.legend(fontsize=8)
    return axes


def ood_scores(
    members: ArrayLike,
    ood_members: ArrayLike,
    *,
    score: str = "mutual_information",
    logits: bool = False,
    member_axis: int = 0,
    tpr: float = 0.95,
    bins: int = 40,
    colors: tuple[Any, Any] = ("tab:blue", "tab:red"),
    ax: Axes | None = None,
) -> Axes:
    """Histograms of an OOD score on in-distribution and OOD members, with the FPR-at-``tpr`` threshold.

    Both histograms share ``bins`` bins and are densities. The dashed line is the threshold of
    ``metrics.fpr_at_tpr`` (in-distribution positive): in-distribution samples at or below it
    make ``tpr`` of them; the title gives the AUROC and the FPR (the OOD samples at or below it).
    """
    inside = metrics.ood_score(score, members, logits=logits, member_axis=member_axis)
    outside = metrics.ood_score(score, ood_members, logits=logits, member_axis=member_axis, argument="ood_members")
    false_positive_rate, threshold = metrics.fpr_threshold(inside, outside, tpr)
    auroc = metrics.ood_auroc(inside, outside)
    axes = _axes(ax)
    edges = np.histogram_bin_edges(np.concatenate([inside, outside]), bins=bins).tolist()
    axes.hist(inside, bins=edges, density=True, alpha=0.6, color=colors[0], label="in-distribution")
    axes.hist(outside, bins=edges, density=True, alpha=0.6, color=colors[1], label="OOD")
    axes.axvline(threshold, color="black", linestyle="--", linewidth=1.0, label=f"{100 * tpr:g} % TPR threshold")
    axes.set(xlabel=score.replace("_", " "), ylabel="density")
    axes.set_title(f"AUROC {auroc:.3f}, FPR at {100 * tpr:g} % TPR {false_positive_rate:.3f}", fontsize=9)
    axes.legend(fontsize=8)
    return axes


def regression(
    x: ArrayLike,
    means: ArrayLike,
    variances: ArrayLike,
    y: ArrayLike | None = None,
    *,
    member_axis: int = 0,
    level: float = 0.9,
    show_members: bool = True,
    color: Any = "tab:blue",
    ax: Axes | None = None,
) -> Axes:
    """Gaussian members over a 1-D input: the mixture's mean, its central ``level`` interval and its epistemic part.

    x (B,), means and variances (n, B) (``member_axis``); the light band is ``mean ± z·sqrt(aleatoric + epistemic)``
    (``metrics.gaussian_mixture``), the dark band ``mean ± z·sqrt(epistemic)``, z = Φ⁻¹((1 + level)/2); thin lines
    are the members' means (``show_members``), dots the targets ``y`` (B,) when given. Points are drawn in the
    order of x.
    """
    level = metrics._fraction("level", level, include_one=False)
    x_array = metrics._finite_float_array("x", x)
    aleatoric, epistemic = metrics.uncertainty_split(means, variances, member_axis=member_axis)
    member_means = metrics._regression_outputs("means", means, member_axis)
    if x_array.ndim != 1 or member_means.shape[1:] != x_array.shape:
        raise ValueError(
            f"x must be 1-D with one value per sample of means {member_means.shape} (members first); "
            f"received shape {x_array.shape}"
        )
    order = np.argsort(x_array, kind="stable")
    grid, mean = x_array[order], member_means.mean(axis=0)[order]
    z = statistics.NormalDist().inv_cdf((1.0 + level) / 2.0)
    total, disagreement = z * np.sqrt((aleatoric + epistemic)[order]), z * np.sqrt(epistemic[order])
    axes = _axes(ax)
    axes.fill_between(grid, mean - total, mean + total, color=color, alpha=0.25, linewidth=0, label=f"{level:.0%}")
    axes.fill_between(grid, mean - disagreement, mean + disagreement, color=color, alpha=0.6, linewidth=0)
    if show_members:
        for member in member_means[:, order]:
            axes.plot(grid, member, color=color, linewidth=0.5, alpha=0.8)
    axes.plot(grid, mean, color="black", linewidth=1.0, label="mean")
    if y is not None:
        y_array = metrics._finite_float_array("y", y)
        if y_array.shape != x_array.shape:
            raise ValueError(f"y must have the shape of x {x_array.shape}; received {y_array.shape}")
        axes.plot(x_array, y_array, ".", color="0.35", markersize=2)
    axes.set(xlabel="x", ylabel="y")
    return axes


def conformal_sets(sets: ArrayLike, labels: ArrayLike, *, color: Any = "tab:blue", ax: Axes | None = None) -> Axes:
    """Histogram of the conformal set sizes, with the coverage of each size above its bar.

    sets (B, K) bool (``ConformalSets.sets``), labels (B,). The bars count the sets of each size that occurs
    (``conformal.size_stratified_coverage``); the title gives the coverage and the mean set size.
    """
    stratified = conformal.size_stratified_coverage(sets, labels)
    axes = _axes(ax)
    axes.bar(stratified.sizes, stratified.counts, width=0.8, color=color, edgecolor="black", linewidth=0.5)
    for size, count, covered in zip(stratified.sizes, stratified.counts, stratified.coverage, strict=True):
        axes.text(size, count, f"{covered:.2f}", ha="center", va="bottom", fontsize=7)
    axes.set(xlabel="set size", ylabel="sets")
    overall, size = conformal.coverage(sets, labels), conformal.mean_set_size(sets)
    axes.set_title(f"coverage {overall:.3f}, mean size {size:.2f} (coverage per size above the bars)", fontsize=9)
    return axes


def conformal_intervals(
    x: ArrayLike,
    lower: ArrayLike,
    upper: ArrayLike,
    y: ArrayLike | None = None,
    *,
    color: Any = "tab:blue",
    ax: Axes | None = None,
) -> Axes:
    """Conformal intervals over a 1-D input: the band from ``lower`` to ``upper`` and the targets, missed ones in red.

    x, lower, upper and y (B,) (``ConformalIntervals.intervals``); drawn in the order of x. The title gives the
    mean width and, with ``y``, the coverage.
    """
    x_array = metrics._finite_float_array("x", x)
    bounds = conformal._bounds((lower, upper))
    if x_array.ndim != 1 or bounds[0].shape != x_array.shape:
        raise ValueError(f"x must be 1-D with one value per interval {bounds[0].shape}; received shape {x_array.shape}")
    order = np.argsort(x_array, kind="stable")
    axes = _axes(ax)
    axes.fill_between(x_array[order], bounds[0][order], bounds[1][order], color=color, alpha=0.3, linewidth=0)
    title = f"mean width {conformal.mean_width(bounds):.3g}"
    if y is not None:
        y_array = metrics._finite_float_array("y", y)
        if y_array.shape != x_array.shape:
            raise ValueError(f"y must have the shape of x {x_array.shape}; received {y_array.shape}")
        inside = (bounds[0] <= y_array) & (y_array <= bounds[1])
        axes.plot(x_array[inside], y_array[inside], ".", color="0.35", markersize=2, label="covered")
        axes.plot(x_array[~inside], y_array[~inside], ".", color="tab:red", markersize=3, label="missed")
        title = f"coverage {inside.mean():.3f}, {title}"
    axes.set(xlabel="x", ylabel="y")
    axes.set_title(title, fontsize=9)
    return axes
