"""masksembles_core.plots: each function draws on the Axes it is given, returns it, and draws the metrics' values.

matplotlib is in the test-metrics dependency group (every core session installs it): a missing one fails the
import here instead of skipping.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from masksembles_core import conformal, metrics, plots


def classification(seed: int, batch: int = 300) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Member logits (4, batch, 5), labels, and flatter OOD member logits (4, batch // 2, 5)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 5, batch)
    logits = rng.normal(0.0, 1.0, (4, batch, 5))
    logits[:, np.arange(batch), labels] += 2.5
    return 2.0 * logits, labels, rng.normal(0.0, 1.0, (4, batch // 2, 5))


def xs(line: Line2D) -> np.ndarray:
    return np.asarray(line.get_xdata(), dtype=np.float64)


def ys(line: Line2D) -> np.ndarray:
    return np.asarray(line.get_ydata(), dtype=np.float64)


def heights(ax: Axes) -> np.ndarray:
    return np.array([bar.get_height() for bar in ax.patches if isinstance(bar, Rectangle)])


@pytest.fixture
def ax() -> Iterator[Axes]:
    figure, axes = plt.subplots()
    yield axes
    plt.close(figure)


def test_reliability_bars_are_the_reliability_diagram(ax: Axes) -> None:
    logits, labels, _ = classification(0)
    assert plots.reliability(logits, labels, logits=True, bins=10, show_counts=True, ax=ax) is ax
    diagram = metrics.reliability_diagram(metrics.predictive_mean(logits, logits=True), labels, bins=10)
    filled = diagram.counts > 0
    np.testing.assert_allclose(heights(ax), diagram.accuracy[filled], rtol=1e-12)
    np.testing.assert_allclose([bar.get_width() for bar in ax.patches if isinstance(bar, Rectangle)], 0.1, rtol=1e-12)
    assert [text.get_text() for text in ax.texts] == [str(count) for count in diagram.counts[filled]]
    assert f"ECE {diagram.ece:.3f}" in ax.get_title()


def test_reliability_line_of_batch_first_members(ax: Axes) -> None:
    logits, labels, _ = classification(1)
    plots.reliability(logits.transpose(1, 0, 2), labels, logits=True, member_axis=1, style="line", label="A", ax=ax)
    diagram = metrics.reliability_diagram(metrics.predictive_mean(logits, logits=True), labels, bins=15)
    filled = diagram.counts > 0
    line = ax.lines[0]
    np.testing.assert_allclose(xs(line), diagram.confidence[filled], rtol=1e-12)
    np.testing.assert_allclose(ys(line), diagram.accuracy[filled], rtol=1e-12)
    assert line.get_label() == f"A (ECE {diagram.ece:.3f})"


def test_risk_coverage_is_the_metrics_curve(ax: Axes) -> None:
    logits, labels, _ = classification(2)
    assert plots.risk_coverage(logits, labels, logits=True, score="mutual_information", ax=ax) is ax
    probs = metrics.predictive_mean(logits, logits=True)
    correct = probs.argmax(axis=1) == labels
    curve = metrics.risk_coverage(-metrics.mutual_information(logits, logits=True), correct)
    np.testing.assert_allclose(xs(ax.lines[0]), curve.coverage, rtol=1e-12)
    np.testing.assert_allclose(ys(ax.lines[0]), curve.risk, rtol=1e-12)
    aurc = metrics.aurc(-metrics.mutual_information(logits, logits=True), correct)
    assert ax.lines[0].get_label() == f"mutual_information (AURC {aurc:.4f})"
    default = plots.risk_coverage(metrics.member_probabilities(logits, logits=True), labels)
    np.testing.assert_allclose(ys(default.lines[0]), metrics.risk_coverage(probs.max(axis=1), correct).risk)
    plt.close("all")


@pytest.mark.parametrize("score", ["mutual_information", "energy"])
def test_ood_scores_histograms_and_threshold(ax: Axes, score: str) -> None:
    logits, _, ood = classification(3)
    assert plots.ood_scores(logits, ood, score=score, logits=True, bins=20, ax=ax) is ax
    inside, outside = metrics.ood_score(score, logits, logits=True), metrics.ood_score(score, ood, logits=True)
    edges = np.histogram_bin_edges(np.r_[inside, outside], bins=20)
    in_density = np.histogram(inside, bins=edges, density=True)[0]
    out_density = np.histogram(outside, bins=edges, density=True)[0]
    np.testing.assert_allclose(heights(ax), np.r_[in_density, out_density], rtol=1e-12)
    (threshold,) = set(xs(ax.lines[0]))
    fpr = metrics.fpr_at_tpr(inside, outside, 0.95)
    assert (inside <= threshold).mean() >= 0.95 and (outside <= threshold).mean() == pytest.approx(fpr)
    assert f"FPR at 95 % TPR {fpr:.3f}" in ax.get_title()
    assert f"AUROC {metrics.ood_auroc(inside, outside):.3f}" in ax.get_title()


def test_ood_scores_names_the_argument_at_fault(ax: Axes) -> None:
    logits, _, ood = classification(4)
    with pytest.raises(ValueError, match=r"ood_members must be finite"):
        plots.ood_scores(logits, ood * np.nan, logits=True, ax=ax)


def test_regression_draws_mean_intervals_members_and_targets(ax: Axes) -> None:
    rng = np.random.default_rng(5)
    x = rng.uniform(-3.0, 3.0, 60)
    means, variances = np.sin(x) + 0.2 * rng.normal(size=(4, 60)), rng.uniform(0.01, 0.1, (4, 60))
    y = np.sin(x) + 0.1 * rng.normal(size=60)
    assert plots.regression(x, means, variances, y, level=0.8, ax=ax) is ax
    order = np.argsort(x)
    mean, variance = metrics.gaussian_mixture(means, variances)
    _, epistemic = metrics.uncertainty_split(means, variances)
    z = statistics.NormalDist().inv_cdf(0.9)
    *members, mean_line, targets = ax.lines
    assert len(members) == 4
    np.testing.assert_allclose(ys(mean_line), mean[order], rtol=1e-12)
    np.testing.assert_allclose(ys(members[2]), means[2, order], rtol=1e-12)
    np.testing.assert_allclose(ys(targets), y)
    for band, spread in zip(ax.collections, (variance, epistemic), strict=True):  # the total, then the epistemic band
        drawn = np.round(np.asarray(band.get_paths()[0].vertices, dtype=np.float64)[:, 1], 10)
        for edge in (mean + z * np.sqrt(spread), mean - z * np.sqrt(spread)):
            assert np.isin(np.round(edge, 10), drawn).all()


def test_regression_with_members_on_the_last_axis_and_no_targets(ax: Axes) -> None:
    rng = np.random.default_rng(6)
    x = np.linspace(0.0, 1.0, 20)
    means, variances = rng.normal(size=(20, 3)), rng.uniform(0.1, 0.2, (20, 3))
    plots.regression(x, means, variances, member_axis=1, show_members=False, ax=ax)
    (mean_line,) = ax.lines
    np.testing.assert_allclose(ys(mean_line), means.mean(axis=1), rtol=1e-12)
    with pytest.raises(ValueError, match=r"x must be 1-D with one value per sample of means \(3, 20\)"):
        plots.regression(x[:5], means, variances, member_axis=1, ax=ax)


def test_conformal_sets_histogram_and_coverage_per_size(ax: Axes) -> None:
    logits, labels, _ = classification(8)
    predictor = conformal.calibrate_sets(logits[:, :150], labels[:150], alpha=0.1, score="aps", logits=True)
    sets = predictor.sets(logits[:, 150:], logits=True)
    assert plots.conformal_sets(sets, labels[150:], ax=ax) is ax
    stratified = conformal.size_stratified_coverage(sets, labels[150:])
    np.testing.assert_array_equal(heights(ax), stratified.counts)
    np.testing.assert_array_equal(
        [bar.get_x() + bar.get_width() / 2 for bar in ax.patches if isinstance(bar, Rectangle)], stratified.sizes
    )
    assert [text.get_text() for text in ax.texts] == [f"{c:.2f}" for c in stratified.coverage]
    assert f"coverage {conformal.coverage(sets, labels[150:]):.3f}" in ax.get_title()
    assert f"mean size {conformal.mean_set_size(sets):.2f}" in ax.get_title()


def test_conformal_intervals_band_and_missed_targets(ax: Axes) -> None:
    rng = np.random.default_rng(9)
    x = rng.uniform(-3.0, 3.0, 80)
    means, y = np.sin(x) + 0.3 * rng.normal(size=(4, 80)), np.sin(x) + 0.2 * rng.normal(size=80)
    lower, upper = conformal.calibrate_intervals(means[:, :40], y[:40], alpha=0.2).intervals(means[:, 40:])
    assert plots.conformal_intervals(x[40:], lower, upper, y[40:], ax=ax) is ax
    order = np.argsort(x[40:])
    drawn = np.round(np.asarray(ax.collections[0].get_paths()[0].vertices, dtype=np.float64)[:, 1], 10)
    assert np.isin(np.round(lower[order], 10), drawn).all() and np.isin(np.round(upper[order], 10), drawn).all()
    covered, missed = ax.lines
    inside = (lower <= y[40:]) & (y[40:] <= upper)
    np.testing.assert_array_equal(ys(covered), y[40:][inside])
    np.testing.assert_array_equal(ys(missed), y[40:][~inside])
    assert 0 < len(ys(missed)) < 40
    assert f"coverage {inside.mean():.3f}, mean width {(upper - lower).mean():.3g}" == ax.get_title()
    with pytest.raises(ValueError, match=r"x must be 1-D with one value per interval \(40,\)"):
        plots.conformal_intervals(x, lower, upper, ax=ax)


def test_a_new_figure_when_no_axes_is_given() -> None:
    logits, labels, _ = classification(7, batch=50)
    axes = plots.reliability(logits, labels, logits=True)
    assert isinstance(axes, Axes) and len(axes.patches) > 0
    plt.close("all")
