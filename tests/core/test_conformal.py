"""masksembles_core.conformal: the scores, thresholds, sets and intervals by their formulas on hand-made arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest

from masksembles_core import conformal, metrics

# three samples, three classes; sample 1 ties classes 0 and 1 (the lower index ranks first)
PROBS = np.array([[0.5, 0.3, 0.2], [0.25, 0.25, 0.5], [0.1, 0.6, 0.3]])


def test_lac_scores_are_one_minus_the_probability() -> None:
    np.testing.assert_array_equal(conformal.class_scores(PROBS, score="lac"), 1.0 - PROBS)


def test_aps_scores_are_the_mass_ranked_up_to_each_class() -> None:
    expected = np.array([[0.5, 0.8, 1.0], [0.75, 1.0, 0.5], [1.0, 0.6, 0.9]])
    np.testing.assert_allclose(conformal.class_scores(PROBS, score="aps"), expected, rtol=0, atol=1e-15)


def test_raps_adds_the_penalty_beyond_k_reg() -> None:
    ranks = np.array([[1, 2, 3], [2, 3, 1], [3, 1, 2]])
    aps = conformal.class_scores(PROBS, score="aps")
    raps = conformal.class_scores(PROBS, score="raps", penalty=0.25, k_reg=1)
    np.testing.assert_allclose(raps, aps + 0.25 * np.maximum(0, ranks - 1), rtol=0, atol=1e-15)
    np.testing.assert_array_equal(conformal.class_scores(PROBS, score="raps"), aps)  # no penalty: APS


def test_scores_are_of_the_members_predictive_mean() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 20, 6))
    for score in conformal.SET_SCORES:
        np.testing.assert_array_equal(
            conformal.class_scores(logits, score=score, logits=True),
            conformal.class_scores(metrics.predictive_mean(logits, logits=True), score=score),
        )
        batch_first = conformal.class_scores(logits.transpose(1, 0, 2), score=score, logits=True, member_axis=1)
        np.testing.assert_array_equal(batch_first, conformal.class_scores(logits, score=score, logits=True))


@pytest.mark.parametrize(("samples", "alpha"), [(9, 0.1), (10, 0.1), (19, 0.05), (57, 0.2), (100, 0.1), (31, 0.37)])
def test_the_threshold_is_the_ceil_n_plus_one_order_statistic(samples: int, alpha: float) -> None:
    rng = np.random.default_rng(samples)
    probs = rng.dirichlet(np.ones(4), size=samples)
    labels = rng.integers(0, 4, samples)
    label_scores = 1.0 - probs[np.arange(samples), labels]
    predictor = conformal.calibrate_sets(probs, labels, alpha=alpha, score="lac")
    rank = math.ceil((samples + 1) * (1 - alpha))
    assert predictor.threshold == np.sort(label_scores)[rank - 1]
    assert predictor.n_calibration == samples and predictor.members == 1 and predictor.classes == 4


def test_sets_hold_the_classes_whose_score_is_at_most_the_threshold() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 200, 5))
    labels = rng.integers(0, 5, 200)
    cases: tuple[tuple[conformal.SetScore, float, int], ...] = (("lac", 0.0, 0), ("aps", 0.0, 0), ("raps", 0.05, 2))
    for score, penalty, k_reg in cases:
        options = {"score": score, "logits": True, "penalty": penalty, "k_reg": k_reg}
        predictor = conformal.calibrate_sets(logits[:, :120], labels[:120], alpha=0.1, **options)  # type: ignore[arg-type]
        scores = conformal.class_scores(logits[:, 120:], **options)  # type: ignore[arg-type]
        np.testing.assert_array_equal(predictor.sets(logits[:, 120:], logits=True), scores <= predictor.threshold)
        # on the calibration samples: the ⌈(n+1)(1−α)⌉ smallest scores are inside, and any tied with the threshold
        # (APS's scores tie at 1, the whole mass, for the least probable class)
        calibration = predictor.sets(logits[:, :120], logits=True)[np.arange(120), labels[:120]].sum()
        assert calibration == math.ceil(121 * 0.9) if score == "lac" else calibration >= math.ceil(121 * 0.9)


@pytest.mark.parametrize("seed", range(6))
def test_sets_and_thresholds_with_ties_equal_the_full_score_matrix(seed: int) -> None:
    """``calibrate_sets`` and ``.sets`` rank APS/RAPS classes by a sort of the values alone; on probabilities full
    of ties and zeros they give exactly the threshold and sets of ``class_scores`` (a stable argsort)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, (300, 6)).astype(np.float64)
    counts[counts.sum(axis=1) == 0, 0] = 1.0
    probs = counts / counts.sum(axis=1, keepdims=True)  # multiples of 1/k: many ties, zeros
    labels = rng.integers(0, 6, 300)
    for options in ({"score": "aps"}, {"score": "raps", "penalty": 0.1, "k_reg": 2}):
        for alpha in (0.05, 0.2, 0.5):
            predictor = conformal.calibrate_sets(probs[:150], labels[:150], alpha=alpha, **options)
            scores = conformal.class_scores(probs, **options)
            calibration = scores[np.arange(150), labels[:150]]
            assert predictor.threshold == np.sort(calibration)[math.ceil(151 * (1 - alpha)) - 1]
            np.testing.assert_array_equal(predictor.sets(probs[150:]), scores[150:] <= predictor.threshold)


def test_by_class_thresholds_are_each_class_calibrated_alone() -> None:
    rng = np.random.default_rng(2)
    probs = rng.dirichlet(np.ones(3), size=90)
    labels = np.repeat([0, 1, 2], [20, 30, 40])
    predictor = conformal.calibrate_sets(probs, labels, alpha=0.1, score="aps", by_class=True)
    assert isinstance(predictor.threshold, np.ndarray) and predictor.threshold.shape == (3,)
    np.testing.assert_array_equal(predictor.n_calibration, [20, 30, 40])
    for c in range(3):
        alone = conformal.calibrate_sets(probs[labels == c], labels[labels == c], alpha=0.1, score="aps")
        assert predictor.threshold[c] == alone.threshold
    np.testing.assert_array_equal(
        predictor.sets(probs), conformal.class_scores(probs, score="aps") <= predictor.threshold
    )
    with pytest.raises(ValueError, match="read-only"):
        predictor.threshold[0] = 1.0


def test_randomized_scores_subtract_one_uniform_draw_per_sample() -> None:
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.ones(4), size=50)
    labels = rng.integers(0, 4, 50)
    predictor = conformal.calibrate_sets(probs, labels, alpha=0.2, score="aps", randomized=True, seed=7)
    draws = np.random.default_rng(7).random(50)
    label_scores = (
        conformal.class_scores(probs, score="aps")[np.arange(50), labels] - draws * probs[np.arange(50), labels]
    )
    assert predictor.threshold == np.sort(label_scores)[math.ceil(51 * 0.8) - 1]
    test_draws = np.random.default_rng(11).random((50, 1))
    expected = conformal.class_scores(probs, score="aps") - test_draws * probs <= predictor.threshold
    np.testing.assert_array_equal(predictor.sets(probs, seed=11), expected)
    deterministic = conformal.calibrate_sets(probs, labels, alpha=0.2, score="aps")
    assert predictor.threshold <= deterministic.threshold


def test_the_predictor_is_frozen_and_readable() -> None:
    predictor = conformal.calibrate_sets(PROBS, [0, 2, 1], alpha=0.5, score="raps", penalty=0.1, k_reg=1)
    with pytest.raises(AttributeError):
        predictor.alpha = 0.2  # type: ignore[misc]
    assert repr(predictor) == (
        f"ConformalSets(score='raps', alpha=0.5, threshold={predictor.threshold:.6g}, n_calibration=3, members=1, "
        "classes=3, penalty=0.1, k_reg=1)"
    )


def test_absolute_intervals_are_the_mean_plus_minus_the_quantile() -> None:
    rng = np.random.default_rng(4)
    means, y = rng.normal(size=(4, 40)), rng.normal(size=40)
    predictor = conformal.calibrate_intervals(means, y, alpha=0.1, score="absolute")
    residuals = np.abs(y - means.mean(axis=0))
    assert predictor.quantile == np.sort(residuals)[math.ceil(41 * 0.9) - 1]
    test = rng.normal(size=(4, 7))
    lower, upper = predictor.intervals(test)
    np.testing.assert_array_equal(lower, test.mean(axis=0) - predictor.quantile)
    np.testing.assert_array_equal(upper, test.mean(axis=0) + predictor.quantile)


def test_normalized_intervals_scale_by_the_members_spread_or_the_mixture_std() -> None:
    rng = np.random.default_rng(5)
    means, variances, y = rng.normal(size=(4, 40)), rng.uniform(0.1, 1.0, (4, 40)), rng.normal(size=40)
    spread = conformal.calibrate_intervals(means, y, alpha=0.1)
    mixture = conformal.calibrate_intervals(means, y, variances=variances, alpha=0.1)
    mean, variance = metrics.gaussian_mixture(means, variances)
    rank = math.ceil(41 * 0.9) - 1
    assert spread.quantile == np.sort(np.abs(y - mean) / means.std(axis=0))[rank]
    assert mixture.quantile == np.sort(np.abs(y - mean) / np.sqrt(variance))[rank]
    lower, upper = mixture.intervals(means, variances)
    np.testing.assert_allclose(upper - mean, mixture.quantile * np.sqrt(variance), rtol=1e-15)
    np.testing.assert_allclose(mean - lower, mixture.quantile * np.sqrt(variance), rtol=1e-15)
    # the calibration targets themselves: the ⌈(n+1)(1−α)⌉ with the smallest scores are inside
    assert conformal.coverage((lower, upper), y) == pytest.approx(math.ceil(41 * 0.9) / 40)
    lower, upper = spread.intervals(means.T, member_axis=1)
    np.testing.assert_allclose(upper - lower, 2 * spread.quantile * means.std(axis=0), rtol=1e-14)


def test_one_quantile_per_output_of_multi_output_targets() -> None:
    rng = np.random.default_rng(6)
    means, y = rng.normal(size=(3, 50, 2)), rng.normal(size=(50, 2))
    predictor = conformal.calibrate_intervals(means, y, alpha=0.2, score="absolute")
    assert isinstance(predictor.quantile, np.ndarray) and predictor.quantile.shape == (2,)
    for output in range(2):
        alone = conformal.calibrate_intervals(means[..., output], y[:, output], alpha=0.2, score="absolute")
        assert predictor.quantile[output] == alone.quantile


def test_coverage_size_and_width() -> None:
    sets = np.array([[True, False, False], [True, True, False], [False, True, True], [False, False, False]])
    labels = np.array([0, 2, 1, 1])
    assert conformal.coverage(sets, labels) == 0.5
    assert conformal.mean_set_size(sets) == 1.25
    stratified = conformal.size_stratified_coverage(sets, labels)
    np.testing.assert_array_equal(stratified.sizes, [0, 1, 2])
    np.testing.assert_array_equal(stratified.counts, [1, 1, 2])
    np.testing.assert_array_equal(stratified.coverage, [0.0, 1.0, 0.5])
    np.testing.assert_array_equal(conformal.class_conditional_coverage(sets, labels), [1.0, 0.5, 0.0])
    assert np.isnan(conformal.class_conditional_coverage(sets[:, :], np.array([0, 0, 1, 1]))[2])
    lower, upper = np.array([0.0, 1.0, -1.0]), np.array([1.0, 3.0, -0.5])
    assert conformal.coverage((lower, upper), np.array([1.0, 0.5, -0.75])) == pytest.approx(2 / 3)
    assert conformal.mean_width((lower, upper)) == pytest.approx(3.5 / 3)


def test_minimum_calibration_samples() -> None:
    assert [conformal.minimum_calibration_samples(a) for a in (0.5, 0.2, 0.1, 0.05, 0.01, 0.3)] == [1, 4, 9, 19, 99, 3]
    for alpha in np.linspace(0.01, 0.99, 99):
        needed = conformal.minimum_calibration_samples(float(alpha))
        assert math.ceil((needed + 1) * (1 - alpha)) <= needed  # enough
        assert needed == 1 or math.ceil(needed * (1 - alpha)) > needed - 1  # and one fewer is not


# --- bad input: a ValueError that names the argument ----------------------------------------------------------------

LABELS = np.array([0, 2, 1])


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_alpha_outside_zero_one(alpha: float) -> None:
    with pytest.raises(ValueError, match=r"alpha must lie in \(0, 1\)"):
        conformal.calibrate_sets(PROBS, LABELS, alpha=alpha)
    with pytest.raises(ValueError, match=r"alpha must lie in \(0, 1\)"):
        conformal.calibrate_intervals(np.ones((2, 3)), np.ones(3), alpha=alpha, score="absolute")


def test_too_few_calibration_samples_says_how_many() -> None:
    with pytest.raises(ValueError, match=r"alpha=0.1 needs at least 9 calibration samples .*; received 3"):
        conformal.calibrate_sets(PROBS, LABELS, alpha=0.1)
    with pytest.raises(ValueError, match=r"alpha=0.05 needs at least 19 calibration samples .*; received 18"):
        conformal.calibrate_intervals(np.zeros((1, 18)), np.zeros(18), alpha=0.05, score="absolute")
    probs = np.tile(PROBS, (4, 1))
    with pytest.raises(ValueError, match=r"by_class: alpha=0.2 needs at least 4 .* class 1: 2$"):
        conformal.calibrate_sets(probs, np.array([0, 2, 1, 0, 2, 0, 0, 2, 1, 2, 0, 2]), alpha=0.2, by_class=True)


def test_labels_out_of_range_or_not_integers() -> None:
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        conformal.calibrate_sets(PROBS, [0, 3, 1], alpha=0.5)
    with pytest.raises(ValueError, match=r"labels must be an integer array"):
        conformal.calibrate_sets(PROBS, [0.0, 1.0, 1.0], alpha=0.5)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        conformal.coverage(np.ones((3, 3), dtype=bool), [0, -1, 1])


def test_nan_or_inf() -> None:
    with pytest.raises(ValueError, match=r"members must be finite"):
        conformal.calibrate_sets(PROBS * np.nan, LABELS, alpha=0.5)
    with pytest.raises(ValueError, match=r"members must be finite"):
        conformal.calibrate_sets(np.where(PROBS > 0.4, np.inf, 0.0), LABELS, alpha=0.5, logits=True)
    with pytest.raises(ValueError, match=r"means must be finite"):
        conformal.calibrate_intervals(np.array([[np.nan, 1.0]]), np.ones(2), alpha=0.5, score="absolute")
    with pytest.raises(ValueError, match=r"y must be finite"):
        conformal.calibrate_intervals(np.ones((2, 2)), np.array([np.inf, 1.0]), alpha=0.5, score="absolute")
    with pytest.raises(ValueError, match=r"variances must be finite"):
        conformal.calibrate_intervals(np.ones((2, 2)), np.ones(2), variances=np.full((2, 2), np.nan), alpha=0.5)
    with pytest.raises(ValueError, match=r"upper must be finite"):
        conformal.coverage((np.zeros(2), np.array([1.0, np.nan])), np.zeros(2))


def test_calibration_and_test_members_must_agree_in_n_and_k() -> None:
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.ones(4), size=(3, 30))
    predictor = conformal.calibrate_sets(probs, rng.integers(0, 4, 30), alpha=0.2)
    with pytest.raises(ValueError, match=r"members must have the n = 3 members and K = 4 classes .* \(2, 30, 4\)"):
        predictor.sets(probs[:2])
    with pytest.raises(ValueError, match=r"members must have the n = 3 members and K = 4 classes .* \(3, 30, 5\)"):
        predictor.sets(rng.dirichlet(np.ones(5), size=(3, 30)))
    intervals = conformal.calibrate_intervals(rng.normal(size=(3, 30)), rng.normal(size=30), alpha=0.2)
    with pytest.raises(ValueError, match=r"means must have the n = 3 members and the output shape \(\)"):
        intervals.intervals(rng.normal(size=(4, 30)))
    with pytest.raises(ValueError, match=r"means must have the n = 3 members and the output shape \(\)"):
        intervals.intervals(rng.normal(size=(3, 30, 2)))
    with pytest.raises(ValueError, match=r"variances must be given exactly when they were at calibration"):
        intervals.intervals(rng.normal(size=(3, 30)), np.ones((3, 30)))


def test_negative_variances_and_zero_spread() -> None:
    means, y = np.array([[0.0, 1.0, 2.0], [0.5, 1.0, 2.5]]), np.zeros(3)
    with pytest.raises(ValueError, match=r"variances must be >= 0"):
        conformal.calibrate_intervals(means, y, variances=np.full((2, 3), -0.1), alpha=0.5)
    with pytest.raises(ValueError, match=r"σ, which is 0 for samples \[1\] \(1 of 3\): the members' point predictions"):
        conformal.calibrate_intervals(means, y, alpha=0.5)
    with pytest.raises(ValueError, match=r"σ, which is 0 for samples \[0, 1, 2\] \(3 of 3\): the members' mixture"):
        conformal.calibrate_intervals(np.ones((2, 3)), y, variances=np.zeros((2, 3)), alpha=0.5)
    predictor = conformal.calibrate_intervals(means[:, [0, 2]], y[:2], alpha=0.5)
    with pytest.raises(ValueError, match=r"σ, which is 0 for samples \[1\]"):
        predictor.intervals(means)
    with pytest.raises(ValueError, match=r"variances scale score='normalized'"):
        conformal.calibrate_intervals(means, y, variances=np.ones((2, 3)), alpha=0.5, score="absolute")


def test_unknown_scores_and_misplaced_options() -> None:
    with pytest.raises(ValueError, match=r"score must be one of \('lac', 'aps', 'raps'\); received 'thr'"):
        conformal.calibrate_sets(PROBS, LABELS, alpha=0.5, score="thr")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"score must be one of \('absolute', 'normalized'\); received 'cqr'"):
        conformal.calibrate_intervals(np.ones((2, 3)), np.ones(3), alpha=0.5, score="cqr")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"penalty and k_reg regularize score='raps'"):
        conformal.calibrate_sets(PROBS, LABELS, alpha=0.5, score="aps", penalty=0.1)
    with pytest.raises(ValueError, match=r"penalty must be a finite number >= 0"):
        conformal.calibrate_sets(PROBS, LABELS, alpha=0.5, score="raps", penalty=-1.0)
    with pytest.raises(ValueError, match=r"k_reg must be an integer >= 0"):
        conformal.calibrate_sets(PROBS, LABELS, alpha=0.5, score="raps", k_reg=-1)
    with pytest.raises(ValueError, match=r"randomized applies to score='aps' or 'raps'"):
        conformal.calibrate_sets(PROBS, LABELS, alpha=0.5, score="lac", randomized=True)
    with pytest.raises(ValueError, match=r"seed is for randomized=True"):
        conformal.calibrate_sets(PROBS, LABELS, alpha=0.5, seed=0)
    with pytest.raises(ValueError, match=r"seed is for randomized sets"):
        conformal.calibrate_sets(PROBS, LABELS, alpha=0.5).sets(PROBS, seed=0)


def test_probabilities_and_logits_are_checked_as_in_metrics() -> None:
    with pytest.raises(ValueError, match=r"members must be probabilities in \[0, 1\].*pass logits=True"):
        conformal.calibrate_sets(PROBS * 4 - 1, LABELS, alpha=0.5)
    with pytest.raises(ValueError, match=r"members look like probabilities, not logits"):
        conformal.calibrate_sets(PROBS, LABELS, alpha=0.5, logits=True)
    with pytest.raises(ValueError, match=r"labels must have shape \(3,\) to match members"):
        conformal.calibrate_sets(PROBS, [0, 1], alpha=0.5)


def test_sets_and_intervals_arguments_of_the_evaluation() -> None:
    with pytest.raises(ValueError, match=r"sets must be a \(B, K\) bool array"):
        conformal.mean_set_size(np.ones((3, 3)))
    with pytest.raises(ValueError, match=r"sets must be a \(B, K\) bool array"):
        conformal.coverage(np.ones(3, dtype=bool), [0, 1, 2])
    with pytest.raises(ValueError, match=r"lower, upper must have the same shape"):
        conformal.mean_width((np.zeros(2), np.ones(3)))
    with pytest.raises(ValueError, match=r"lower must be <= upper; 1 interval"):
        conformal.mean_width((np.array([0.0, 2.0]), np.ones(2)))
    with pytest.raises(ValueError, match=r"y must have the intervals' shape \(2,\)"):
        conformal.coverage((np.zeros(2), np.ones(2)), np.zeros(3))
