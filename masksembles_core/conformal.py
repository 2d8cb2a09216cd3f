"""Split conformal prediction from member outputs: prediction sets and intervals with a coverage guarantee (NumPy only).

Calibrate on held-out samples the model never trained on, then predict sets (classification) or intervals
(regression) that contain the truth with probability at least ``1 − alpha`` on exchangeable test samples
(Vovk et al. 2005; Angelopoulos & Bates 2023). Inputs follow ``masksembles_core.metrics``: classification members
(n, B, K) probabilities (logits with ``logits=True``; (B, K) is one member; ``member_axis`` for other layouts),
regression members (n, B, ...), the same checks and messages.

Classification scores are computed on the members' predictive mean ``p`` (B, K) (after any temperature applied to
the logits), for every class j of a sample:

- ``"lac"`` (least ambiguous set-valued classifier, TorchCP's THR): ``1 − p_j``;
- ``"aps"`` (adaptive prediction sets): ``Σ_{i: p_i > p_j} p_i + p_j``, the probability mass of the classes ranked
  up to j, ties in p broken by class index (the lower index ranks first);
- ``"raps"`` (regularized APS): the APS score ``+ penalty · max(0, rank(j) − k_reg)``, rank 1 for the top class.

The threshold is the ⌈(n+1)(1−α)⌉-th smallest of the n calibration scores (scores of the true labels); a set holds
every class whose own score is at most the threshold, so it may be empty. With ``randomized=True`` (APS and RAPS
only) a uniform draw U per sample subtracts ``U · p_j`` from every score of that sample, at calibration and at
prediction (Romano et al. 2020): the scores no longer tie (APS's tie at 1 for the last-ranked class), so the average
coverage is ⌈(n+1)(1−α)⌉/(n+1), just above 1 − α, rather than anything above it, and the sets are smaller, at the
price of depending on the draws.

Regression: the score of a sample is ``|y − μ|`` (``"absolute"``) or ``|y − μ| / σ`` (``"normalized"``), μ the
members' mean, σ the square root of the Gaussian mixture's variance (mean of the members' variances plus the
variance of their means, ``metrics.gaussian_mixture``) when the members predict variances, else of the variance of
their point predictions. The interval is ``μ ± q̂`` or ``μ ± q̂ σ``, q̂ the same order statistic, per output.

Every bad input raises a ``ValueError`` (a ``TypeError`` for a non-number ``alpha``) that names the argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import metrics
from ._validation import check_int

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]
ArrayT = TypeVar("ArrayT", bound=NDArray[Any])

SetScore = Literal["lac", "aps", "raps"]
IntervalScore = Literal["absolute", "normalized"]
SET_SCORES: tuple[SetScore, ...] = ("lac", "aps", "raps")
INTERVAL_SCORES: tuple[IntervalScore, ...] = ("absolute", "normalized")


# --- the order statistic --------------------------------------------------------------------------------------------


def _alpha(alpha: float) -> float:
    return metrics._fraction("alpha", alpha, include_one=False)


def _rank(samples: int, alpha: float) -> int:
    """⌈(n+1)(1−α)⌉, the rank (1-based) of the calibration score that is the threshold (MAPIE's rounding)."""
    return math.ceil((samples + 1) * (1.0 - alpha))


def minimum_calibration_samples(alpha: float) -> int:
    """The fewest calibration samples for which α can be met: the smallest n with ⌈(n+1)(1−α)⌉ <= n (⌈1/α⌉ − 1)."""
    alpha = _alpha(alpha)
    needed = max(1, math.ceil(1.0 / alpha) - 2)
    while _rank(needed, alpha) > needed:
        needed += 1
    return needed


def _threshold(scores: FloatArray, alpha: float, what: str) -> FloatArray:
    """The ⌈(n+1)(1−α)⌉-th smallest of ``scores`` (n, ...) along axis 0; ``what`` names the samples in errors."""
    samples = scores.shape[0]
    rank = _rank(samples, alpha)
    if rank > samples:
        raise ValueError(
            f"alpha={alpha:g} needs at least {minimum_calibration_samples(alpha)} calibration samples "
            f"(⌈1/α⌉ − 1){what}; received {samples}"
        )
    result: FloatArray = np.partition(scores, rank - 1, axis=0)[rank - 1]
    return result


def _frozen(array: ArrayT) -> ArrayT:
    """``array``, made read-only (the predictors are frozen)."""
    array.setflags(write=False)
    return array


# --- classification: prediction sets -------------------------------------------------------------------------------


def _score_name(score: str, allowed: tuple[str, ...]) -> str:
    if score not in allowed:
        raise ValueError(f"score must be one of {allowed}; received {score!r}")
    return score


def _rank_scores(descending: FloatArray, score: str, penalty: float, k_reg: int) -> FloatArray:
    """The APS/RAPS score of the class at each rank (B, K), from each row's probabilities in decreasing order.

    The cumulative sum in rank order, so a class's score counts the classes ranked before it exactly once. The rows
    sum to 1 (validated and renormalized), so the last-ranked class scores exactly 1, and rounding never lifts a
    partial mass above it. Non-decreasing along each row (RAPS's penalty too): a set is a prefix of the ranking.
    """
    cumulative = np.cumsum(descending, axis=1)
    np.minimum(cumulative, 1.0, out=cumulative)
    cumulative[:, -1] = 1.0
    if score == "raps" and penalty > 0.0:
        cumulative += penalty * np.maximum(0, np.arange(1, descending.shape[1] + 1) - k_reg)
    return cumulative


def _class_scores(probs: FloatArray, score: str, penalty: float, k_reg: int) -> FloatArray:
    """The score of every class of every sample (B, K) of the predictive distribution ``probs`` (B, K).

    APS and RAPS rank each row by decreasing probability, stably: a lower class index ranks first among ties.
    """
    if score == "lac":
        lac: FloatArray = 1.0 - probs
        return lac
    order = np.argsort(-probs, axis=1, kind="stable")
    by_rank = _rank_scores(np.take_along_axis(probs, order, axis=1), score, penalty, k_reg)
    scores = np.empty_like(by_rank)
    np.put_along_axis(scores, order, by_rank, axis=1)
    return scores


def _descending(probs: FloatArray) -> FloatArray:
    """Each row's probabilities in decreasing order: the values of the stable ranking, without its permutation."""
    result: FloatArray = np.sort(probs, axis=1)[:, ::-1]
    return result


def _label_scores(probs: FloatArray, labels: IntArray, score: str, penalty: float, k_reg: int) -> FloatArray:
    """``_class_scores(probs, ...)[rows, labels]`` (B,), the same numbers, from a sort of the values alone: the
    label's rank counts the classes more probable than it and the equally probable ones of lower index."""
    rows = np.arange(probs.shape[0])
    label_probs = probs[rows, labels]
    if score == "lac":
        lac: FloatArray = 1.0 - label_probs
        return lac
    above = (probs > label_probs[:, None]).sum(axis=1)
    tied_before = ((probs == label_probs[:, None]) & (np.arange(probs.shape[1]) < labels[:, None])).sum(axis=1)
    result: FloatArray = _rank_scores(_descending(probs), score, penalty, k_reg)[rows, above + tied_before]
    return result


def _prefix_sets(probs: FloatArray, threshold: float, score: str, penalty: float, k_reg: int) -> BoolArray:
    """``_class_scores(probs, ...) <= threshold`` (B, K) for APS/RAPS, from a sort of the values alone: the set is
    the first ``L`` classes of the ranking, L the number of rank scores at most the threshold; those are the classes
    more probable than the L-th value and, among the classes equal to it, as many as fit, lowest index first."""
    descending = _descending(probs)
    included = (_rank_scores(descending, score, penalty, k_reg) <= threshold).sum(axis=1)
    last = descending[np.arange(probs.shape[0]), np.maximum(included - 1, 0)][:, None]
    above, tied = probs > last, probs == last
    room = (included - above.sum(axis=1))[:, None]
    result: BoolArray = (above | (tied & (np.cumsum(tied, axis=1) <= room))) & (included > 0)[:, None]
    return result


def class_scores(
    members: ArrayLike,
    *,
    score: SetScore = "aps",
    logits: bool = False,
    member_axis: int = 0,
    penalty: float = 0.0,
    k_reg: int = 0,
) -> FloatArray:
    """The (non-randomized) score of every class of every sample, members (n, B, K) -> (B, K).

    The quantity ``calibrate_sets`` thresholds: a set holds the classes whose score is at most the threshold.
    """
    score = _score_name(score, SET_SCORES)  # type: ignore[assignment]
    penalty, k_reg = _penalty(score, penalty, k_reg)
    probs = metrics.predictive_mean(members, logits=logits, member_axis=member_axis)
    return _class_scores(probs, score, penalty, k_reg)


def _randomized(scores: FloatArray, probs: FloatArray, rng: np.random.Generator) -> FloatArray:
    """``scores − U · probs`` with one U ~ Uniform[0, 1) per sample (row)."""
    result: FloatArray = scores - rng.random((probs.shape[0], 1)) * probs
    return result


@dataclass(frozen=True, repr=False)
class ConformalSets:
    """A calibrated set predictor (``calibrate_sets``); ``sets(members)`` gives the (B, K) prediction sets.

    Attributes:
        alpha: the miscoverage level; the sets contain the true class with probability >= 1 − alpha.
        score: ``"lac"``, ``"aps"`` or ``"raps"``.
        threshold: the calibrated threshold: a float, or (K,) one per class with ``by_class`` (read-only).
        n_calibration: the number of calibration samples (with ``by_class``: (K,) per class, read-only).
        members: n, the number of members calibrated on (test members must have as many).
        classes: K.
        penalty, k_reg: RAPS's regularization (0 for LAC and APS).
        by_class: one threshold per class (class-conditional coverage).
        randomized: APS or RAPS with a uniform draw per sample (see the module's docstring).
    """

    alpha: float
    score: SetScore
    threshold: float | FloatArray
    n_calibration: int | IntArray
    members: int
    classes: int
    penalty: float = 0.0
    k_reg: int = 0
    by_class: bool = False
    randomized: bool = False

    def __repr__(self) -> str:
        threshold = (
            f"{self.threshold:.6g}"
            if isinstance(self.threshold, float)
            else f"per class {np.array2string(self.threshold, precision=4, threshold=6)}"
        )
        regularization = f", penalty={self.penalty:g}, k_reg={self.k_reg}" if self.score == "raps" else ""
        extras = "".join([", by_class=True" if self.by_class else "", ", randomized=True" if self.randomized else ""])
        return (
            f"ConformalSets(score={self.score!r}, alpha={self.alpha:g}, threshold={threshold}, "
            f"n_calibration={np.sum(self.n_calibration)}, members={self.members}, classes={self.classes}"
            f"{regularization}{extras})"
        )

    def sets(
        self, members: ArrayLike, *, logits: bool = False, member_axis: int = 0, seed: int | None = None
    ) -> BoolArray:
        """The prediction sets (B, K) bool of test members (n, B, K): the classes whose score is <= the threshold.

        ``seed`` seeds the uniform draws of a randomized predictor (None: fresh entropy); it is refused otherwise.
        """
        if seed is not None and not self.randomized:
            raise ValueError("seed is for randomized sets (calibrate_sets(..., randomized=True)); leave it out")
        probs = metrics.member_probabilities(members, logits=logits, member_axis=member_axis)
        if probs.shape[0] != self.members or probs.shape[2] != self.classes:
            raise ValueError(
                f"members must have the n = {self.members} members and K = {self.classes} classes the sets were "
                f"calibrated on; received (n, B, K) = {probs.shape} (members first)"
            )
        mean = probs.mean(axis=0)
        if self.score != "lac" and isinstance(self.threshold, float) and not self.randomized:
            return _prefix_sets(mean, self.threshold, self.score, self.penalty, self.k_reg)
        scores = _class_scores(mean, self.score, self.penalty, self.k_reg)
        if self.randomized:
            scores = _randomized(scores, mean, np.random.default_rng(seed))
        result: BoolArray = scores <= self.threshold
        return result


def _penalty(score: str, penalty: float, k_reg: int) -> tuple[float, int]:
    if isinstance(penalty, bool) or not isinstance(penalty, int | float | np.integer | np.floating):
        raise ValueError(f"penalty must be a number >= 0; received {penalty!r} ({type(penalty).__name__})")
    penalty_value = float(penalty)
    if not (math.isfinite(penalty_value) and penalty_value >= 0.0):
        raise ValueError(f"penalty must be a finite number >= 0; received {penalty!r}")
    k_reg = check_int("k_reg", k_reg, minimum=0)
    if score != "raps" and (penalty_value != 0.0 or k_reg != 0):
        raise ValueError(f"penalty and k_reg regularize score='raps'; received them with score={score!r}")
    return penalty_value, k_reg


def calibrate_sets(
    members: ArrayLike,
    labels: ArrayLike,
    *,
    alpha: float,
    score: SetScore = "aps",
    logits: bool = False,
    member_axis: int = 0,
    penalty: float = 0.0,
    k_reg: int = 0,
    by_class: bool = False,
    randomized: bool = False,
    seed: int | None = None,
) -> ConformalSets:
    """Calibrate prediction sets with coverage >= 1 − ``alpha`` on held-out members (n, B, K) and labels (B,).

    Args:
        members: calibration members (n, B, K) probabilities, or logits with ``logits``; (B, K) is one member.
        labels: (B,) integer labels in [0, K).
        alpha: the miscoverage level in (0, 1); B must be at least ⌈1/α⌉ − 1 (per class with ``by_class``).
        score: ``"lac"``, ``"aps"`` or ``"raps"`` (see the module's docstring).
        member_axis: the members' axis of 3-D members.
        penalty, k_reg: RAPS's ``penalty · max(0, rank − k_reg)`` (penalty >= 0, k_reg >= 0 an integer).
        by_class: one threshold per class from that class's calibration samples (class-conditional coverage:
            every class is covered with probability >= 1 − alpha, if each has enough samples).
        randomized: APS/RAPS with a uniform draw per sample (coverage just above 1 − alpha on average, smaller sets).
        seed: seeds the calibration draws of a randomized predictor.
    """
    alpha = _alpha(alpha)
    score = _score_name(score, SET_SCORES)  # type: ignore[assignment]
    penalty, k_reg = _penalty(score, penalty, k_reg)
    if randomized not in (True, False):
        raise ValueError(f"randomized must be a bool; received {randomized!r}")
    if randomized and score == "lac":
        raise ValueError("randomized applies to score='aps' or 'raps'; LAC's sets do not depend on a draw")
    if seed is not None and not randomized:
        raise ValueError("seed is for randomized=True; leave it out")
    probs = metrics.member_probabilities(members, logits=logits, member_axis=member_axis)
    label_array = metrics._labels(labels, classes=probs.shape[2], against="members", shape=probs.shape)
    mean = probs.mean(axis=0)
    rows = np.arange(mean.shape[0])
    scores = _label_scores(mean, label_array, score, penalty, k_reg)
    if randomized:
        scores = scores - np.random.default_rng(seed).random(scores.shape[0]) * mean[rows, label_array]
    members_count, classes = probs.shape[0], probs.shape[2]
    if not by_class:
        threshold = float(_threshold(scores, alpha, ""))
        return ConformalSets(
            alpha, score, threshold, int(scores.shape[0]), members_count, classes, penalty, k_reg, False, randomized
        )
    counts = np.bincount(label_array, minlength=probs.shape[2]).astype(np.int64)
    needed = minimum_calibration_samples(alpha)
    short = np.flatnonzero(counts < needed)
    if short.size:
        listed = ", ".join(f"class {c}: {counts[c]}" for c in short[:10])
        raise ValueError(
            f"by_class: alpha={alpha:g} needs at least {needed} calibration samples of every class (⌈1/α⌉ − 1); "
            f"received {listed}{' ...' if short.size > 10 else ''}"
        )
    order = np.argsort(label_array, kind="stable")
    starts = np.r_[0, np.cumsum(counts)]
    per_class = np.array(
        [_threshold(scores[order[starts[c] : starts[c + 1]]], alpha, f" of class {c}") for c in range(counts.size)]
    )
    return ConformalSets(
        alpha, score, _frozen(per_class), _frozen(counts), members_count, classes, penalty, k_reg, True, randomized
    )


# --- regression: prediction intervals ------------------------------------------------------------------------------


def _center_and_scale(
    means: ArrayLike, variances: ArrayLike | None, member_axis: int
) -> tuple[FloatArray, FloatArray, int]:
    """μ and σ (B, ...) of members (n, B, ...), and n: the mixture's σ with ``variances``, else the members' spread."""
    if variances is None:
        member_means = metrics._regression_outputs("means", means, member_axis)
        return member_means.mean(axis=0), np.sqrt(member_means.var(axis=0)), member_means.shape[0]
    member_means, member_variances = metrics._member_gaussians(means, variances, member_axis)
    mean = member_means.mean(axis=0)
    return mean, np.sqrt(member_variances.mean(axis=0) + member_means.var(axis=0)), member_means.shape[0]


def _positive_scale(sigma: FloatArray, source: str) -> None:
    zero = np.flatnonzero((sigma == 0.0).reshape(sigma.shape[0], -1).any(axis=1))
    if zero.size:
        listed = zero[:10].tolist()
        raise ValueError(
            f"score='normalized' divides by σ, which is 0 for samples {listed}{' ...' if zero.size > 10 else ''} "
            f"({zero.size} of {sigma.shape[0]}): {source} (pass variances, or use score='absolute')"
        )


_SPREAD_SOURCES = (
    "the members' point predictions agree there",
    "the members' mixture variance (mean of the variances + variance of the means)",
)


@dataclass(frozen=True, repr=False)
class ConformalIntervals:
    """A calibrated interval predictor (``calibrate_intervals``); ``intervals(means)`` gives (lower, upper).

    Attributes:
        alpha: the miscoverage level; each interval contains its target with probability >= 1 − alpha.
        score: ``"absolute"`` (μ ± q̂) or ``"normalized"`` (μ ± q̂ σ).
        quantile: q̂, a float for scalar targets, else one per output (the targets' trailing shape, read-only).
        n_calibration: the number of calibration samples.
        members: n, the number of members calibrated on (test members must have as many).
        with_variances: σ comes from the members' variances (the Gaussian mixture), not their spread.
    """

    alpha: float
    score: IntervalScore
    quantile: float | FloatArray
    n_calibration: int
    members: int
    with_variances: bool

    def __repr__(self) -> str:
        quantile = (
            f"{self.quantile:.6g}"
            if isinstance(self.quantile, float)
            else np.array2string(self.quantile, precision=4, threshold=6)
        )
        sigma = ", σ from the variances" if self.with_variances else ""
        return (
            f"ConformalIntervals(score={self.score!r}, alpha={self.alpha:g}, quantile={quantile}, "
            f"n_calibration={self.n_calibration}, members={self.members}{sigma})"
        )

    def intervals(
        self, means: ArrayLike, variances: ArrayLike | None = None, *, member_axis: int = 0
    ) -> tuple[FloatArray, FloatArray]:
        """(lower, upper), each (B, ...), of test members (n, B, ...) (and their variances, as at calibration)."""
        if (variances is not None) != self.with_variances:
            given = "were" if self.with_variances else "were not"
            raise ValueError(f"variances must be given exactly when they were at calibration (they {given})")
        mean, sigma, members = _center_and_scale(means, variances, member_axis)
        quantile = np.asarray(self.quantile)
        if members != self.members or mean.shape[1:] != quantile.shape:
            raise ValueError(
                f"means must have the n = {self.members} members and the output shape {quantile.shape} the "
                f"intervals were calibrated on; received (n, B, ...) = {(members, *mean.shape)} (members first)"
            )
        if self.score == "absolute":
            half_width = np.broadcast_to(quantile, mean.shape)
        else:
            _positive_scale(sigma, _SPREAD_SOURCES[self.with_variances])
            half_width = quantile * sigma
        return mean - half_width, mean + half_width


def calibrate_intervals(
    means: ArrayLike,
    y: ArrayLike,
    *,
    variances: ArrayLike | None = None,
    alpha: float,
    score: IntervalScore = "normalized",
    member_axis: int = 0,
) -> ConformalIntervals:
    """Calibrate intervals with coverage >= 1 − ``alpha`` on held-out members (n, B, ...) and targets y (B, ...).

    Args:
        means: the members' point predictions (n, B, ...) (their Gaussians' means with ``variances``).
        y: (B, ...) the targets; one threshold per output of the trailing shape.
        variances: (n, B, ...) the members' variances (>= 0; members trained with the Gaussian NLL): σ is then the
            mixture's standard deviation; without, the standard deviation of the members' means.
        alpha: the miscoverage level in (0, 1); B must be at least ⌈1/α⌉ − 1.
        score: ``"absolute"`` (|y − μ|) or ``"normalized"`` (|y − μ| / σ; σ must be > 0 on every sample).
        member_axis: the members' axis of ``means`` and ``variances``.
    """
    alpha = _alpha(alpha)
    score = _score_name(score, INTERVAL_SCORES)  # type: ignore[assignment]
    if score == "absolute" and variances is not None:
        raise ValueError("variances scale score='normalized'; score='absolute' does not use them (leave them out)")
    mean, sigma, members = _center_and_scale(means, variances, member_axis)
    targets = metrics._finite_float_array("y", y)
    if targets.shape != mean.shape:
        raise ValueError(
            f"y must have shape {mean.shape} to match means {(members, *mean.shape)} (members first); "
            f"received {targets.shape}"
        )
    residuals = np.abs(targets - mean)
    if score == "normalized":
        _positive_scale(sigma, _SPREAD_SOURCES[variances is not None])
        residuals = residuals / sigma
    quantile = _threshold(residuals, alpha, "")
    value: float | FloatArray = float(quantile) if quantile.ndim == 0 else _frozen(quantile)
    return ConformalIntervals(alpha, score, value, int(mean.shape[0]), members, variances is not None)


# --- evaluation ----------------------------------------------------------------------------------------------------


def _sets(sets: ArrayLike) -> BoolArray:
    array = np.asarray(sets)
    if array.dtype != np.bool_ or array.ndim != 2 or 0 in array.shape:
        raise ValueError(
            f"sets must be a (B, K) bool array with B >= 1 (ConformalSets.sets); received dtype {array.dtype}, "
            f"shape {array.shape}"
        )
    return array


def _sets_and_labels(sets: ArrayLike, labels: ArrayLike) -> tuple[BoolArray, IntArray]:
    array = _sets(sets)
    return array, metrics._labels(labels, classes=array.shape[1], against="sets", shape=array.shape)


def _bounds(intervals: tuple[ArrayLike, ArrayLike]) -> tuple[FloatArray, FloatArray]:
    if not isinstance(intervals, tuple) or len(intervals) != 2:
        raise ValueError("intervals must be a pair (lower, upper) (ConformalIntervals.intervals)")
    lower, upper = (metrics._finite_float_array(name, a) for name, a in zip(("lower", "upper"), intervals, strict=True))
    metrics._same_shape(("lower", "upper"), (lower, upper))
    if lower.size == 0:
        raise ValueError("lower and upper must hold at least one interval; received empty arrays")
    if (lower > upper).any():
        raise ValueError(f"lower must be <= upper; {int((lower > upper).sum())} interval(s) have lower > upper")
    return lower, upper


def _covered(predictions: ArrayLike | tuple[ArrayLike, ArrayLike], truth: ArrayLike) -> BoolArray:
    """Whether each set holds its label (B,), or each interval its target (B, ...)."""
    if isinstance(predictions, tuple):
        lower, upper = _bounds(predictions)
        targets = metrics._finite_float_array("y", truth)
        if targets.shape != lower.shape:
            raise ValueError(f"y must have the intervals' shape {lower.shape}; received {targets.shape}")
        inside: BoolArray = (lower <= targets) & (targets <= upper)
        return inside
    sets, labels = _sets_and_labels(predictions, truth)
    held: BoolArray = sets[np.arange(sets.shape[0]), labels]
    return held


def coverage(predictions: ArrayLike | tuple[ArrayLike, ArrayLike], truth: ArrayLike) -> float:
    """The fraction of the truth inside the predictions: ``coverage(sets, labels)`` (sets (B, K) bool, labels
    (B,)) or ``coverage((lower, upper), y)`` (each (B, ...), bounds included)."""
    return float(_covered(predictions, truth).mean())


def mean_set_size(sets: ArrayLike) -> float:
    """The mean number of classes in a set, sets (B, K) bool."""
    return float(_sets(sets).sum(axis=1).mean())


def mean_width(intervals: tuple[ArrayLike, ArrayLike]) -> float:
    """The mean of ``upper − lower`` over every interval, (lower, upper) each (B, ...)."""
    lower, upper = _bounds(intervals)
    return float((upper - lower).mean())


class SizeStratifiedCoverage(NamedTuple):
    """Coverage per set size (see ``size_stratified_coverage``); only the sizes that occur."""

    sizes: IntArray  # (S,) the set sizes that occur, increasing
    counts: IntArray  # (S,) how many sets have that size
    coverage: FloatArray  # (S,) the fraction of those sets that hold their label


def size_stratified_coverage(sets: ArrayLike, labels: ArrayLike) -> SizeStratifiedCoverage:
    """The coverage of the sets of each size (Angelopoulos et al. 2021), sets (B, K) bool, labels (B,).

    Marginal coverage can hide sets that fail where the model is unsure: a good predictor covers about 1 − α at
    every size. The size-stratified coverage metric (SSCV) is the worst gap, ``abs(coverage − (1 − α)).max()``.
    """
    array, label_array = _sets_and_labels(sets, labels)
    sizes = array.sum(axis=1)
    held = array[np.arange(array.shape[0]), label_array]
    present, counts = np.unique(sizes, return_counts=True)
    covered = np.bincount(sizes, weights=held, minlength=array.shape[1] + 1)[present]
    return SizeStratifiedCoverage(present.astype(np.int64), counts.astype(np.int64), covered / counts)


def class_conditional_coverage(sets: ArrayLike, labels: ArrayLike) -> FloatArray:
    """The coverage of each class (K,): the fraction of its samples whose set holds it; NaN for a class with none."""
    array, label_array = _sets_and_labels(sets, labels)
    held = array[np.arange(array.shape[0]), label_array]
    counts = np.bincount(label_array, minlength=array.shape[1])
    with np.errstate(invalid="ignore", divide="ignore"):
        result: FloatArray = np.bincount(label_array, weights=held, minlength=array.shape[1]) / counts
    return result
