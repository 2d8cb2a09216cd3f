"""Uncertainty and evaluation metrics for ensemble outputs (NumPy only).

Classification members have shape (n, B, K): ``n`` members (masks, dropout samples or ensemble
members), ``B`` samples, ``K`` classes; probabilities by default, logits with ``logits=True``
(a single logit column, K = 1, is a binary sigmoid logit: ``softmax([0, z]) = [1 - σ(z), σ(z)]``).
Scoring functions take the predictive distribution (B, K) (``predictive_mean``) and integer
labels (B,). Regression members predict a Gaussian: means and variances of shape (n, B, ...).
Entropies and log-likelihoods are in nats. Everything is computed in float64, so float16 or
bfloat16 outputs cast to float32 are accepted (probabilities must sum to 1 within
``PROBABILITY_TOLERANCE`` and are renormalized).

Conventions:

- OOD scores (``predictive_entropy``, ``mutual_information``, ``msp_score``, ``max_logit_score``,
  ``energy_score``, ``variation_ratio``, ``probability_variance``): higher means more likely OOD.
- Confidences for selective prediction (``risk_coverage``, ``aurc``, ...): higher means more
  likely correct (the negative of any OOD score is a confidence).

Degenerate input (NaN, wrong shapes, fewer than two classes, labels out of range, an empty set
of scores) raises ``ValueError`` with a message that says what was received.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._validation import check_int

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

PROBABILITY_TOLERANCE = 1e-2  # a bfloat16 softmax rounds each probability by up to 2**-8 relative
TEMPERATURE_BOUNDS = (1e-2, 1e2)

# --- validation ------------------------------------------------------------------------------


def _finite_float_array(name: str, values: ArrayLike) -> FloatArray:
    array = np.asarray(values)
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_) or np.iscomplexobj(array):
        raise ValueError(f"{name} must be a real numeric array; received dtype {array.dtype}")
    result = array.astype(np.float64)
    if not np.isfinite(result).all():
        bad = int((~np.isfinite(result)).sum())
        raise ValueError(f"{name} must be finite; received {bad} NaN or infinite value(s) in shape {array.shape}")
    return result


def _fraction(name: str, value: float, *, include_one: bool = True) -> float:
    """``value`` as a float in (0, 1] (or (0, 1) without ``include_one``)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"{name} must be a real number; received {value!r} ({type(value).__name__})")
    result = float(value)
    upper_ok = result <= 1.0 if include_one else result < 1.0
    if not (result > 0.0 and upper_ok):
        allowed = "(0, 1]" if include_one else "(0, 1)"
        raise ValueError(f"{name} must lie in {allowed}; received {result!r}")
    return result


def _labels(labels: ArrayLike, *, classes: int, against: str, shape: tuple[int, ...]) -> IntArray:
    """Integer labels in [0, classes) of shape (B,), B = ``shape[-2]`` of the array named ``against``."""
    label_array = np.asarray(labels)
    if label_array.dtype == np.bool_ or not np.issubdtype(label_array.dtype, np.integer):
        raise ValueError(f"labels must be an integer array; received dtype {label_array.dtype}")
    batch = shape[-2]
    if label_array.shape != (batch,):
        raise ValueError(f"labels must have shape ({batch},) to match {against} {shape}; received {label_array.shape}")
    if ((label_array < 0) | (label_array >= classes)).any():
        raise ValueError(f"labels must lie in [0, {classes}) for {classes} classes; received values outside")
    return label_array.astype(np.int64)


def _same_shape(names: Sequence[str], arrays: Sequence[FloatArray]) -> None:
    shapes = [array.shape for array in arrays]
    if len(set(shapes)) != 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in zip(names, shapes, strict=True))
        raise ValueError(f"{', '.join(names)} must have the same shape; received {listed}")


# --- members: probabilities and logits -------------------------------------------------------


def _log_softmax(logits: FloatArray) -> FloatArray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    result: FloatArray = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return result


def _logsumexp(values: FloatArray, axis: int) -> FloatArray:
    top = values.max(axis=axis, keepdims=True)
    result: FloatArray = (top + np.log(np.exp(values - top).sum(axis=axis, keepdims=True))).squeeze(axis)
    return result


def _binary_expanded(logits: FloatArray) -> FloatArray:
    """Logits (..., K); a single column (a sigmoid logit z) becomes the two logits (0, z)."""
    if logits.shape[-1] == 1:
        return np.concatenate([np.zeros_like(logits), logits], axis=-1)
    return logits


def _check_probabilities(name: str, probs: FloatArray) -> FloatArray:
    """``probs`` validated as distributions over the last axis and renormalized to sum to 1."""
    if probs.shape[-1] < 2:
        raise ValueError(f"{name} needs at least 2 classes on the last axis; received shape {probs.shape}")
    if (probs < 0).any() or (probs > 1).any():
        raise ValueError(f"{name} must lie in [0, 1] (pass logits=True for logits); received values outside")
    sums = probs.sum(axis=-1, keepdims=True)
    error = np.abs(sums - 1.0).max(initial=0.0)
    if error > PROBABILITY_TOLERANCE:
        raise ValueError(
            f"{name} must sum to 1 over the last axis (within {PROBABILITY_TOLERANCE}); "
            f"a row's sum differs from 1 by {error:.3g} (pass logits=True for logits)"
        )
    result: FloatArray = probs / sums
    return result


def _members(members: ArrayLike) -> FloatArray:
    array = _finite_float_array("members", members)
    if array.ndim != 3:
        raise ValueError(f"members must have shape (n, B, K) (members, samples, classes); received shape {array.shape}")
    if 0 in array.shape:
        raise ValueError(
            f"members needs n >= 1 members and B >= 1 samples (and K >= 1 classes); received shape {array.shape}"
        )
    return array


def _member_logits(logits: ArrayLike) -> FloatArray:
    """Validated member logits (n, B, K) -> float64 (n, B, max(K, 2))."""
    return _binary_expanded(_members(logits))


def member_probabilities(members: ArrayLike, *, logits: bool = False) -> FloatArray:
    """Validated member probabilities: (n, B, K) probabilities or logits -> (n, B, K) float64.

    With ``logits=True`` a softmax over the last axis is applied first (K = 1: a sigmoid, giving
    (n, B, 2)). Probabilities are checked to sum to 1 and renormalized.
    """
    if logits:
        return np.exp(_log_softmax(_member_logits(members)))
    return _check_probabilities("members", _members(members))


def _entropy(probs: FloatArray) -> FloatArray:
    """Entropy in nats over the last axis, with 0 log 0 = 0."""
    logs = np.log(np.where(probs > 0, probs, 1.0))
    result: FloatArray = -(probs * logs).sum(axis=-1)
    return result


def predictive_mean(members: ArrayLike, *, logits: bool = False) -> FloatArray:
    """The ensemble's predictive distribution: the mean of the member probabilities, (n, B, K) -> (B, K)."""
    result: FloatArray = member_probabilities(members, logits=logits).mean(axis=0)
    return result


def predictive_entropy(members: ArrayLike, *, logits: bool = False) -> FloatArray:
    """Total uncertainty: the entropy of the predictive mean, (n, B, K) -> (B,). An OOD score."""
    return _entropy(predictive_mean(members, logits=logits))


def expected_entropy(members: ArrayLike, *, logits: bool = False) -> FloatArray:
    """Aleatoric uncertainty: the mean of the members' entropies, (n, B, K) -> (B,)."""
    result: FloatArray = _entropy(member_probabilities(members, logits=logits)).mean(axis=0)
    return result


def mutual_information(members: ArrayLike, *, logits: bool = False) -> FloatArray:
    """Epistemic uncertainty: predictive entropy minus expected entropy (>= 0), (n, B, K) -> (B,).

    Zero when all members agree; it measures how much the members disagree. An OOD score.
    """
    probs = member_probabilities(members, logits=logits)
    total = _entropy(probs.mean(axis=0))
    aleatoric = _entropy(probs).mean(axis=0)
    result: FloatArray = np.maximum(total - aleatoric, 0.0)  # Jensen: >= 0 up to rounding
    return result


# --- regression: members with a Gaussian head -------------------------------------------------


def _regression_outputs(outputs: ArrayLike, name: str = "outputs") -> FloatArray:
    array = _finite_float_array(name, outputs)
    if array.ndim < 2 or 0 in array.shape[:2]:
        raise ValueError(f"{name} must have shape (n, B, ...) with n >= 1 and B >= 1; received shape {array.shape}")
    return array


def member_mean(outputs: ArrayLike) -> FloatArray:
    """Regression prediction: the mean of the member outputs, (n, B, ...) -> (B, ...)."""
    result: FloatArray = _regression_outputs(outputs).mean(axis=0)
    return result


def member_variance(outputs: ArrayLike) -> FloatArray:
    """Regression uncertainty: the variance of the member outputs (ddof=0), (n, B, ...) -> (B, ...)."""
    result: FloatArray = _regression_outputs(outputs).var(axis=0)
    return result


def _member_gaussians(means: ArrayLike, variances: ArrayLike) -> tuple[FloatArray, FloatArray]:
    mean_array = _regression_outputs(means, "means")
    variance_array = _regression_outputs(variances, "variances")
    _same_shape(("means", "variances"), (mean_array, variance_array))
    if (variance_array < 0).any():
        raise ValueError(f"variances must be >= 0; received a minimum of {variance_array.min():.3g}")
    return mean_array, variance_array


def uncertainty_split(means: ArrayLike, variances: ArrayLike) -> tuple[FloatArray, FloatArray]:
    """Aleatoric and epistemic variance of Gaussian members, (n, B, ...) each -> two (B, ...).

    Aleatoric: the mean of the member variances (the noise the members predict). Epistemic:
    the variance of the member means (ddof=0; how much the members disagree). Their sum is the
    variance of the members' equal-weight mixture (the law of total variance).
    """
    mean_array, variance_array = _member_gaussians(means, variances)
    return variance_array.mean(axis=0), mean_array.var(axis=0)


def gaussian_mixture(means: ArrayLike, variances: ArrayLike) -> tuple[FloatArray, FloatArray]:
    """Mean and variance of the equal-weight mixture of the members' Gaussians, (n, B, ...) -> two (B, ...).

    ``mean = mean_k means[k]``; ``variance = mean_k variances[k] + var_k means[k]`` (aleatoric +
    epistemic, see ``uncertainty_split``). ``gaussian_nll`` and ``interval_coverage`` of this
    moment-matched Gaussian are the usual ensemble regression scores (Lakshminarayanan et al. 2017).
    """
    mean_array, variance_array = _member_gaussians(means, variances)
    return mean_array.mean(axis=0), variance_array.mean(axis=0) + mean_array.var(axis=0)


def _gaussian(mean: ArrayLike, variance: ArrayLike, targets: ArrayLike) -> tuple[FloatArray, FloatArray, FloatArray]:
    arrays = [_finite_float_array(name, a) for name, a in (("mean", mean), ("variance", variance), ("y", targets))]
    _same_shape(("mean", "variance", "y"), arrays)
    if arrays[0].size == 0:
        raise ValueError("mean, variance and y must hold at least one value; received empty arrays")
    if (arrays[1] <= 0).any():
        raise ValueError(f"variance must be > 0; received a minimum of {arrays[1].min():.3g}")
    return arrays[0], arrays[1], arrays[2]


def gaussian_nll(mean: ArrayLike, variance: ArrayLike, y: ArrayLike) -> float:
    """Mean negative log-likelihood (nats) of ``y`` under N(mean, variance), all of shape (B, ...).

    ``0.5 * (log(2π variance) + (y - mean)² / variance)``, averaged over every element; for an
    ensemble pass ``gaussian_mixture``'s mean and variance.
    """
    mean_array, variance_array, y_array = _gaussian(mean, variance, y)
    per_element = 0.5 * (np.log(2.0 * np.pi * variance_array) + (y_array - mean_array) ** 2 / variance_array)
    return float(per_element.mean())


def mixture_nll(means: ArrayLike, variances: ArrayLike, y: ArrayLike) -> float:
    """Mean negative log-likelihood of ``y`` (B, ...) under the exact equal-weight mixture of the members' Gaussians.

    ``-log((1/n) sum_k N(y; means[k], variances[k]))``, averaged over every element; means and
    variances (n, B, ...), variances > 0. Never larger than the members' mean ``gaussian_nll``
    (Jensen); unlike ``gaussian_nll`` of ``gaussian_mixture``, it keeps a multimodal mixture's shape.
    """
    mean_array, variance_array = _member_gaussians(means, variances)
    y_array = _finite_float_array("y", y)
    if y_array.shape != mean_array.shape[1:]:
        raise ValueError(
            f"y must have shape {mean_array.shape[1:]} to match means {mean_array.shape}; received {y_array.shape}"
        )
    if (variance_array <= 0).any():
        raise ValueError(f"variances must be > 0; received a minimum of {variance_array.min():.3g}")
    log_densities = -0.5 * (np.log(2.0 * np.pi * variance_array) + (y_array - mean_array) ** 2 / variance_array)
    log_mixture = _logsumexp(log_densities, axis=0) - math.log(mean_array.shape[0])
    return float(-log_mixture.mean())


def _coverage(mean: ArrayLike, variance: ArrayLike, y: ArrayLike, levels: FloatArray) -> FloatArray:
    """Fraction of ``y`` within ``mean ± Φ⁻¹((1 + level) / 2) * sqrt(variance)``, for each of ``levels`` (L,)."""
    mean_array, variance_array, y_array = _gaussian(mean, variance, y)
    standardized = (np.abs(y_array - mean_array) / np.sqrt(variance_array)).ravel()
    half_widths = np.array([statistics.NormalDist().inv_cdf((1.0 + level) / 2.0) for level in levels])
    result: FloatArray = (standardized[None, :] <= half_widths[:, None]).mean(axis=1)
    return result


def interval_coverage(mean: ArrayLike, variance: ArrayLike, y: ArrayLike, *, level: float = 0.9) -> float:
    """Fraction of ``y`` inside the central ``level`` interval of N(mean, variance), all of shape (B, ...).

    The interval is ``mean ± z * sqrt(variance)`` with ``z = Φ⁻¹((1 + level) / 2)`` (1.645 for
    0.9), bounds included. A calibrated model covers about ``level`` of the targets.
    """
    level = _fraction("level", level, include_one=False)
    return float(_coverage(mean, variance, y, np.array([level]))[0])


class RegressionCalibration(NamedTuple):
    """Observed vs nominal coverage of central intervals (see ``regression_calibration``)."""

    levels: FloatArray  # (L,) nominal coverage of each interval
    observed: FloatArray  # (L,) fraction of targets inside it
    error: float  # mean |observed - levels|: 0 for a calibrated model


def regression_calibration(
    mean: ArrayLike, variance: ArrayLike, y: ArrayLike, *, levels: ArrayLike | None = None
) -> RegressionCalibration:
    """The calibration curve of a Gaussian regressor: ``interval_coverage`` at every level of ``levels``.

    Args:
        mean, variance, y: (B, ...) predictive mean, variance (> 0) and targets.
        levels: (L,) nominal levels in (0, 1); default 0.05, 0.10, ..., 0.95.

    Returns:
        the levels, the observed coverage at each (above the diagonal: intervals too wide,
        below: too narrow) and the mean absolute gap between the two.
    """
    level_array = np.arange(1, 20) / 20.0 if levels is None else _finite_float_array("levels", levels)
    if level_array.ndim != 1 or level_array.size == 0:
        raise ValueError(f"levels must be a non-empty 1-D array; received shape {level_array.shape}")
    for level in level_array:
        _fraction("levels", float(level), include_one=False)
    observed = _coverage(mean, variance, y, level_array)
    return RegressionCalibration(level_array, observed, float(np.abs(observed - level_array).mean()))


# --- scores of the predictive distribution ----------------------------------------------------


def _probs_and_labels(probs: ArrayLike, labels: ArrayLike) -> tuple[FloatArray, IntArray]:
    array = _finite_float_array("probs", probs)
    if array.ndim != 2 or array.shape[0] == 0:
        raise ValueError(
            f"probs must have shape (B, K) with B >= 1 (use predictive_mean for member outputs); "
            f"received shape {array.shape}"
        )
    array = _check_probabilities("probs", array)
    return array, _labels(labels, classes=array.shape[1], against="probs", shape=array.shape)


def accuracy(probs: ArrayLike, labels: ArrayLike) -> float:
    """Fraction of samples whose most probable class is the label; probs (B, K), labels (B,)."""
    array, label_array = _probs_and_labels(probs, labels)
    return float((array.argmax(axis=1) == label_array).mean())


def negative_log_likelihood(
    probs: ArrayLike, labels: ArrayLike, *, eps: float = float(np.finfo(np.float64).eps)
) -> float:
    """Mean negative log-likelihood of the labels (nats); probabilities are clipped to [eps, 1 - eps].

    Args:
        probs: (B, K) predictive distribution.
        labels: (B,) integer class labels.
        eps: clipping bound (the default is scikit-learn's ``log_loss`` bound for float64).
    """
    array, label_array = _probs_and_labels(probs, labels)
    true_class = np.clip(array[np.arange(array.shape[0]), label_array], eps, 1.0 - eps)
    return float(-np.log(true_class).mean())


def brier_score(probs: ArrayLike, labels: ArrayLike) -> float:
    """Multi-class Brier score: the mean over samples of ``sum_k (p_k - onehot_k)^2``, in [0, 2]."""
    array, label_array = _probs_and_labels(probs, labels)
    onehot = np.eye(array.shape[1])[label_array]
    return float(((array - onehot) ** 2).sum(axis=1).mean())


# --- temperature scaling -----------------------------------------------------------------------

_TEMPERATURE_GRID = 41  # log-spaced starting points; the golden-section search refines the best one
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def _golden_section(function: Callable[[float], float], low: float, high: float, tolerance: float) -> float:
    """A minimizer of a unimodal ``function`` on [low, high], to within ``tolerance``."""
    left, right = high - _GOLDEN * (high - low), low + _GOLDEN * (high - low)
    f_left, f_right = function(left), function(right)
    while high - low > tolerance:
        if f_left <= f_right:
            high, right, f_right = right, left, f_left
            left = high - _GOLDEN * (high - low)
            f_left = function(left)
        else:
            low, left, f_left = left, right, f_right
            right = low + _GOLDEN * (high - low)
            f_right = function(right)
    return (low + high) / 2.0


def _temperature_bounds(bounds: tuple[float, float]) -> tuple[float, float]:
    low, high = (float(b) for b in bounds)
    if not (math.isfinite(low) and math.isfinite(high) and 0.0 < low < high):
        raise ValueError(f"bounds must be two finite temperatures 0 < low < high; received {bounds!r}")
    return low, high


def _fit_one_temperature(logits: FloatArray, labels: IntArray, bounds: tuple[float, float]) -> float:
    """The temperature minimizing the NLL of the mean of softmax(logits[k] / T), logits (n, B, K).

    The NLL is scanned on a log-spaced grid of T over ``bounds`` and the best grid point's bracket
    refined by golden-section search on log T; for one member the NLL is convex in 1/T, so this
    finds the global minimum. A minimum within 1e-9 (relative) of a bound returns that bound.
    """
    members, batch, _ = logits.shape
    rows = np.arange(batch)

    def nll(log_temperature: float) -> float:
        true_class = _log_softmax(logits * math.exp(-log_temperature))[:, rows, labels]  # (n, B)
        return float(-(_logsumexp(true_class, axis=0) - math.log(members)).mean())

    low, high = math.log(bounds[0]), math.log(bounds[1])
    grid = np.linspace(low, high, _TEMPERATURE_GRID)
    values = np.array([nll(float(u)) for u in grid])
    if values.max() - values.min() <= 1e-12 * max(1.0, abs(values.min())):
        return min(max(1.0, bounds[0]), bounds[1])  # the NLL does not depend on T (e.g. equal logits)
    best = int(values.argmin())
    tolerance = 1e-10
    log_temperature = _golden_section(
        nll, float(grid[max(best - 1, 0)]), float(grid[min(best + 1, grid.size - 1)]), tolerance
    )
    if log_temperature - low < 10 * tolerance:
        return bounds[0]
    if high - log_temperature < 10 * tolerance:
        return bounds[1]
    return math.exp(log_temperature)


@overload
def fit_temperature(
    logits: ArrayLike,
    labels: ArrayLike,
    *,
    per_member: Literal[False] = False,
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
) -> float: ...


@overload
def fit_temperature(
    logits: ArrayLike, labels: ArrayLike, *, per_member: Literal[True], bounds: tuple[float, float] = TEMPERATURE_BOUNDS
) -> FloatArray: ...


def fit_temperature(
    logits: ArrayLike,
    labels: ArrayLike,
    *,
    per_member: bool = False,
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
) -> float | FloatArray:
    """Temperature scaling (Guo et al. 2017) fitted on validation logits, for one model or an ensemble.

    One temperature T for every member: the T in ``bounds`` that minimizes the NLL of the
    ensemble's prediction ``mean_k softmax(logits[k] / T)`` (for (B, K) logits, of the single
    model). Apply it with ``apply_temperature`` to the test logits before averaging. The search is
    a log-spaced grid refined by golden-section search on log T: no gradients, no SciPy, never a
    NaN. When the NLL is lowest at a bound (separable validation logits make it fall as T -> 0)
    the bound is returned with a ``UserWarning``; when it does not depend on T, 1 is returned.

    Args:
        logits: (B, K) logits of one model or (n, B, K) of n members; K = 1 is a binary
            sigmoid logit.
        labels: (B,) integer labels in [0, K) (in {0, 1} for K = 1).
        per_member: fit each member's own temperature on that member's own NLL instead.
        bounds: the range (low, high) searched, 0 < low < high.

    Returns:
        T (a float), or with ``per_member`` a (n,) array (n = 1 for (B, K) logits).
    """
    array = _finite_float_array("logits", logits)
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3 or 0 in array.shape:
        raise ValueError(f"logits must have shape (B, K) or (n, B, K) with n, B, K >= 1; received {np.shape(logits)}")
    array = _binary_expanded(array)
    label_array = _labels(labels, classes=array.shape[2], against="logits", shape=np.shape(logits))
    bounds = _temperature_bounds(bounds)
    groups = [array[k : k + 1] for k in range(array.shape[0])] if per_member else [array]
    temperatures = np.array([_fit_one_temperature(group, label_array, bounds) for group in groups])
    reasons = (
        "decreases to the lower bound: the logits separate the validation classes (typical of a tiny set)",
        "increases to the upper bound: the logits predict the labels no better than a uniform guess",
    )
    for bound, reason in zip(bounds, reasons, strict=True):
        hit = np.flatnonzero(temperatures == bound).tolist()
        if hit:
            which = f"of members {hit}" if per_member else "of the model"
            warnings.warn(
                f"fit_temperature: the validation NLL {which} keeps falling as T {reason}; returning T = {bound:g}",
                stacklevel=2,
            )
    return temperatures if per_member else float(temperatures[0])


def apply_temperature(logits: ArrayLike, temperature: ArrayLike) -> FloatArray:
    """``logits / temperature`` in float64: logits (..., K) and T > 0, or (n, B, K) and one T per member (n,)."""
    array = _finite_float_array("logits", logits)
    temperatures = _finite_float_array("temperature", temperature)
    if (temperatures <= 0).any():
        raise ValueError(f"temperature must be > 0; received {temperatures.tolist()}")
    if temperatures.ndim == 0 and array.ndim >= 1:
        return array / temperatures
    if temperatures.ndim == 1 and array.ndim == 3 and temperatures.shape[0] == array.shape[0]:
        result: FloatArray = array / temperatures[:, None, None]
        return result
    raise ValueError(
        f"temperature must be a number, or one per member (n,) for (n, B, K) logits; "
        f"received temperature shape {temperatures.shape} for logits {array.shape}"
    )


# --- calibration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReliabilityDiagram:
    """Reliability-diagram data over ``bins`` equal-width confidence bins (see ``reliability_diagram``).

    Attributes:
        edges: (bins + 1,) bin edges, 0 to 1; bin i holds confidences in (edges[i], edges[i+1]]
            (the first bin also holds 0).
        confidence: (bins,) mean confidence in each bin, NaN where the bin is empty.
        accuracy: (bins,) accuracy in each bin, NaN where the bin is empty.
        counts: (bins,) number of samples in each bin.
        ece: expected calibration error, ``sum_i counts[i]/B * |accuracy[i] - confidence[i]|``.
    """

    edges: FloatArray
    confidence: FloatArray
    accuracy: FloatArray
    counts: IntArray
    ece: float


def reliability_diagram(probs: ArrayLike, labels: ArrayLike, *, bins: int = 15) -> ReliabilityDiagram:
    """Calibration of the top-class confidence over ``bins`` equal-width bins (Guo et al. 2017).

    Args:
        probs: (B, K) predictive distribution; confidence is its maximum, the prediction its argmax.
        labels: (B,) integer class labels.
        bins: number of equal-width bins on [0, 1], >= 1.
    """
    bins = check_int("bins", bins, minimum=1)
    array, label_array = _probs_and_labels(probs, labels)
    confidence = array.max(axis=1)
    correct = (array.argmax(axis=1) == label_array).astype(np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.searchsorted(edges[1:-1], confidence, side="left")
    counts = np.bincount(index, minlength=bins).astype(np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_confidence = np.bincount(index, weights=confidence, minlength=bins) / counts
        mean_accuracy = np.bincount(index, weights=correct, minlength=bins) / counts
    gaps = np.where(counts > 0, np.abs(mean_accuracy - mean_confidence), 0.0)
    ece = float((counts * gaps).sum() / array.shape[0])
    return ReliabilityDiagram(edges, mean_confidence, mean_accuracy, counts, ece)


def expected_calibration_error(probs: ArrayLike, labels: ArrayLike, *, bins: int = 15) -> float:
    """Expected calibration error of the top-class confidence over ``bins`` equal-width bins."""
    return reliability_diagram(probs, labels, bins=bins).ece


# --- OOD scores: higher means more likely out-of-distribution ----------------------------------


def msp_score(members: ArrayLike, *, logits: bool = False) -> FloatArray:
    """One minus the maximum softmax probability of the predictive mean (Hendrycks & Gimpel 2017), (n, B, K) -> (B,)."""
    result: FloatArray = 1.0 - predictive_mean(members, logits=logits).max(axis=1)
    return result


def max_logit_score(logits: ArrayLike) -> FloatArray:
    """Minus the largest logit (Hendrycks et al. 2022), averaged over members: (n, B, K) logits -> (B,).

    Unlike probabilities, logits keep the magnitude of the evidence; a K = 1 sigmoid logit z
    counts as the logits (0, z).
    """
    result: FloatArray = -_member_logits(logits).max(axis=2).mean(axis=0)
    return result


def energy_score(logits: ArrayLike) -> FloatArray:
    """The free energy ``-logsumexp_k z_k`` (Liu et al. 2020), averaged over members: (n, B, K) logits -> (B,)."""
    result: FloatArray = -_logsumexp(_member_logits(logits), axis=2).mean(axis=0)
    return result


def variation_ratio(members: ArrayLike, *, logits: bool = False) -> FloatArray:
    """Fraction of members that do not vote for the most voted class, (n, B, K) -> (B,), in [0, 1 - 1/n].

    Each member votes for its most probable class; 0 when every member votes alike. Coarse
    (n + 1 distinct values at most), so ranking metrics see many ties.
    """
    probs = member_probabilities(members, logits=logits)
    votes = probs.argmax(axis=2)  # (n, B)
    counts = (votes[:, :, None] == np.arange(probs.shape[2])).sum(axis=0)  # (B, K)
    result: FloatArray = 1.0 - counts.max(axis=1) / probs.shape[0]
    return result


def probability_variance(members: ArrayLike, *, logits: bool = False) -> FloatArray:
    """Variance of the member probabilities (ddof=0) summed over the classes, (n, B, K) -> (B,).

    The mean squared distance of the members' probability vectors from their mean: 0 when all
    members agree.
    """
    result: FloatArray = member_probabilities(members, logits=logits).var(axis=0).sum(axis=1)
    return result


# --- OOD detection from scores -----------------------------------------------------------------

Positive = Literal["ood", "in"]


def _ood_scores(in_scores: ArrayLike, out_scores: ArrayLike) -> tuple[FloatArray, BoolArray]:
    """Concatenated scores (B_in + B_out,) and the OOD indicator."""
    inside = _finite_float_array("in_scores", in_scores)
    outside = _finite_float_array("out_scores", out_scores)
    for name, array in (("in_scores", inside), ("out_scores", outside)):
        if array.ndim != 1:
            raise ValueError(f"{name} must be 1-D (one score per sample); received shape {array.shape}")
    if inside.size == 0 or outside.size == 0:
        raise ValueError(
            "OOD detection needs at least one in-distribution and one OOD score; "
            f"received {inside.size} in-distribution and {outside.size} OOD scores"
        )
    is_ood = np.concatenate([np.zeros(inside.size, dtype=np.bool_), np.ones(outside.size, dtype=np.bool_)])
    return np.concatenate([inside, outside]), is_ood


def _oriented(in_scores: ArrayLike, out_scores: ArrayLike, positive: Positive) -> tuple[FloatArray, BoolArray]:
    """Scores where higher means the ``positive`` class, and the positive indicator."""
    scores, is_ood = _ood_scores(in_scores, out_scores)
    if positive == "ood":
        return scores, is_ood
    if positive == "in":
        return -scores, ~is_ood
    raise ValueError(f"positive must be 'ood' or 'in'; received {positive!r}")


def _smallest_count(fraction: float, total: int) -> int:
    """The smallest k in [1, total] with ``k / total >= fraction`` (fraction in (0, 1])."""
    return int(np.searchsorted(np.arange(1, total + 1) / total, fraction, side="left")) + 1


def ood_auroc(in_scores: ArrayLike, out_scores: ArrayLike) -> float:
    """Area under the ROC curve for telling OOD samples from in-distribution ones by a score.

    A higher score must mean "more likely OOD" (e.g. predictive entropy or mutual information).
    Ties count one half (the Mann–Whitney statistic), as in scikit-learn's ``roc_auc_score``.
    The value does not depend on which class is called positive.

    Args:
        in_scores: (B_in,) scores of in-distribution samples.
        out_scores: (B_out,) scores of OOD samples.
    """
    scores, is_ood = _ood_scores(in_scores, out_scores)
    order = np.argsort(scores, kind="stable")
    ordered = scores[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], ordered.size]
    ranks = np.empty(scores.size)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)  # 1-based, ties averaged
    positives = int(is_ood.sum())
    negatives = scores.size - positives
    u_statistic = ranks[is_ood].sum() - positives * (positives + 1) / 2.0
    return float(u_statistic / (positives * negatives))


def ood_aupr(in_scores: ArrayLike, out_scores: ArrayLike, *, positive: Positive = "ood") -> float:
    """Area under the precision-recall curve (average precision) of OOD detection by a score.

    ``sum_t (recall_t - recall_{t-1}) * precision_t`` over the distinct score thresholds, from
    the most positive down: scikit-learn's ``average_precision_score``. A higher score must mean
    "more likely OOD". ``positive="ood"`` (AUPR-Out, the default): OOD samples are the positives,
    chance level ``B_out / (B_in + B_out)``; ``positive="in"`` (AUPR-In): in-distribution samples
    are the positives, detected by a low score.
    """
    scores, is_positive = _oriented(in_scores, out_scores, positive)
    order = np.argsort(-scores, kind="stable")
    ordered, positives = scores[order], is_positive[order]
    last_of_threshold = np.flatnonzero(np.r_[ordered[1:] != ordered[:-1], True])
    true_positives = np.cumsum(positives)[last_of_threshold]
    precision = true_positives / (last_of_threshold + 1.0)
    recall = true_positives / true_positives[-1]
    return float((np.diff(recall, prepend=0.0) * precision).sum())


def fpr_at_tpr(in_scores: ArrayLike, out_scores: ArrayLike, tpr: float = 0.95, *, positive: Positive = "in") -> float:
    """False-positive rate at the first threshold whose true-positive rate reaches ``tpr`` ("FPR95").

    A higher score must mean "more likely OOD". ``positive="in"`` (the default, as in ODIN and
    the energy-score paper): in-distribution samples are the positives, accepted when their score
    is at most a threshold; the threshold keeps ``tpr`` of them, and the result is the fraction
    of OOD samples accepted with them. ``positive="ood"``: the threshold flags ``tpr`` of the OOD
    samples, and the result is the fraction of in-distribution samples flagged. Thresholds are
    the scores themselves (ties move together), as in scikit-learn's ``roc_curve``. Lower is
    better; 0 for perfectly separated scores.

    Args:
        in_scores: (B_in,) scores of in-distribution samples.
        out_scores: (B_out,) scores of OOD samples.
        tpr: the true-positive rate to reach, in (0, 1].
        positive: which class the true-positive rate is about, ``"in"`` or ``"ood"``.
    """
    tpr = _fraction("tpr", tpr)
    scores, is_positive = _oriented(in_scores, out_scores, positive)
    positives = np.sort(scores[is_positive])[::-1]
    threshold = positives[_smallest_count(tpr, positives.size) - 1]
    return float((scores[~is_positive] >= threshold).mean())


# --- selective prediction: higher confidence means more likely correct -------------------------


def _confidence_and_correct(confidence: ArrayLike, correct: ArrayLike) -> tuple[FloatArray, BoolArray]:
    confidence_array = _finite_float_array("confidence", confidence)
    if confidence_array.ndim != 1 or confidence_array.size == 0:
        raise ValueError(f"confidence must be 1-D with at least one sample; received shape {confidence_array.shape}")
    correct_array = np.asarray(correct)
    is_binary = correct_array.dtype == np.bool_ or (
        np.issubdtype(correct_array.dtype, np.integer) and np.isin(correct_array, (0, 1)).all()
    )
    if not is_binary:
        raise ValueError(f"correct must be a bool array (or integers 0/1); received dtype {correct_array.dtype}")
    if correct_array.shape != confidence_array.shape:
        raise ValueError(
            f"correct must have the shape of confidence {confidence_array.shape}; received {correct_array.shape}"
        )
    return confidence_array, correct_array.astype(np.bool_)


class RiskCoverage(NamedTuple):
    """The risk-coverage curve of selective prediction (see ``risk_coverage``)."""

    coverage: FloatArray  # (B,) k / B for k = 1..B
    risk: FloatArray  # (B,) error rate among the k most confident samples


def risk_coverage(confidence: ArrayLike, correct: ArrayLike) -> RiskCoverage:
    """Error rate of the k most confident predictions, for every k (Geifman & El-Yaniv 2017).

    A model that abstains below a confidence threshold answers a fraction ``coverage`` of the
    samples with error rate ``risk``. Samples with equal confidence cannot be told apart: inside
    a group of ties, the errors count in proportion (the expected risk when ties are broken at
    random), so the curve never depends on the order of the input.

    Args:
        confidence: (B,) any confidence score, higher = more likely correct (e.g. the maximum
            probability, or minus an OOD score).
        correct: (B,) bool, whether each prediction is right.
    """
    confidence_array, correct_array = _confidence_and_correct(confidence, correct)
    order = np.argsort(-confidence_array, kind="stable")
    ordered = confidence_array[order]
    errors = np.cumsum(~correct_array[order])
    group_ends = np.flatnonzero(np.r_[ordered[1:] != ordered[:-1], True]) + 1  # samples up to each tie group's end
    counts = np.arange(1, ordered.size + 1)
    expected_errors = np.interp(counts, np.r_[0, group_ends], np.r_[0.0, errors[group_ends - 1]])
    return RiskCoverage(counts / ordered.size, expected_errors / counts)


def aurc(confidence: ArrayLike, correct: ArrayLike) -> float:
    """Area under the risk-coverage curve: the mean of ``risk_coverage(...).risk`` over the B coverages.

    Lower is better. It mixes accuracy and ranking: compare models with ``excess_aurc``.
    """
    return float(risk_coverage(confidence, correct).risk.mean())


def excess_aurc(confidence: ArrayLike, correct: ArrayLike) -> float:
    """AURC minus the AURC of a perfect ranking of the same predictions (all correct ones first); 0 is ideal.

    The E-AURC of Geifman et al. (2019): the part of the AURC due to the confidence ranking
    alone, not to the error rate.
    """
    _, correct_array = _confidence_and_correct(confidence, correct)
    return aurc(confidence, correct) - aurc(correct_array, correct_array)


def accuracy_at_coverage(confidence: ArrayLike, correct: ArrayLike, coverage: float = 0.9) -> float:
    """Accuracy on the ``ceil(coverage * B)`` most confident samples (ties in proportion, as in ``risk_coverage``)."""
    coverage = _fraction("coverage", coverage)
    curve = risk_coverage(confidence, correct)
    return float(1.0 - curve.risk[_smallest_count(coverage, curve.risk.size) - 1])


# --- diversity ---------------------------------------------------------------------------------


def diversity(predictions_a: ArrayLike, predictions_b: ArrayLike, labels: ArrayLike) -> float:
    """The paper's diversity of two models (after Fort et al. 2019): disagreement ÷ (1 − accuracy).

    The fraction of samples on which the predicted labels differ, divided by the error rate
    ``1 - accuracy``, where accuracy is the mean of the two models' accuracies. 0 for identical
    predictions; at most ``min(2, 1 / (1 - accuracy))``.

    Args:
        predictions_a, predictions_b: (B,) predicted class labels of the two models.
        labels: (B,) true class labels.

    Raises:
        ValueError: shapes differ, no samples, or both models are always right (diversity is undefined).
    """
    arrays = [np.asarray(a) for a in (predictions_a, predictions_b, labels)]
    for name, array in zip(("predictions_a", "predictions_b", "labels"), arrays, strict=True):
        if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{name} must be an integer array of class labels; received dtype {array.dtype}")
    first, second, truth = arrays
    if not first.shape == second.shape == truth.shape or first.ndim != 1 or first.size == 0:
        raise ValueError(
            f"predictions_a, predictions_b and labels must be 1-D of the same non-zero length; "
            f"received shapes {first.shape}, {second.shape}, {truth.shape}"
        )
    error_rate = 1.0 - ((first == truth).mean() + (second == truth).mean()) / 2.0
    if error_rate == 0.0:
        raise ValueError("diversity is undefined when both models are always right (error rate 0)")
    return float((first != second).mean() / error_rate)


class DiversityPoints(NamedTuple):
    """One point per pair of members (i < j), as in the paper's diversity-vs-accuracy plot."""

    pairs: IntArray  # (P, 2) member indices
    accuracy: FloatArray  # (P,) mean accuracy of the two members
    diversity: FloatArray  # (P,) ``diversity`` of the two members


def pairwise_diversity(members: ArrayLike, labels: ArrayLike, *, logits: bool = False) -> DiversityPoints:
    """``diversity`` and mean accuracy of every pair of members; members (n, B, K) with n >= 2, labels (B,)."""
    probs = member_probabilities(members, logits=logits)
    if probs.shape[0] < 2:
        raise ValueError(f"pairwise_diversity needs at least 2 members; received shape {probs.shape}")
    predictions = probs.argmax(axis=2)
    label_array = _probs_and_labels(probs[0], labels)[1]
    first, second = np.triu_indices(probs.shape[0], k=1)
    member_accuracy = (predictions == label_array).mean(axis=1)
    values = [diversity(predictions[i], predictions[j], label_array) for i, j in zip(first, second, strict=True)]
    return DiversityPoints(
        pairs=np.stack([first, second], axis=1).astype(np.int64),
        accuracy=(member_accuracy[first] + member_accuracy[second]) / 2.0,
        diversity=np.array(values, dtype=np.float64),
    )


# --- summary --------------------------------------------------------------------------------------


class Summary(dict[str, float]):
    """Metric name -> value, in a fixed order; ``str()`` (hence ``print``) gives a Markdown table."""

    def __str__(self) -> str:
        rows = [f"| {name} | {value:.4f} |" for name, value in self.items()]
        return "\n".join(["| Metric | Value |", "|---|---:|", *rows])


def _add_detection(result: Summary, name: str, inside: FloatArray, outside: FloatArray, tpr: float) -> None:
    result[f"ood_auroc_{name}"] = ood_auroc(inside, outside)
    result[f"ood_aupr_{name}"] = ood_aupr(inside, outside)
    result[f"ood_fpr{100 * tpr:g}_{name}"] = fpr_at_tpr(inside, outside, tpr)


def _classification_scores(members: int, logits: bool) -> dict[str, Callable[[ArrayLike], FloatArray]]:
    """The OOD scores that mean something for ``members`` members (logit scores only for logits)."""
    scores: dict[str, Callable[[ArrayLike], FloatArray]] = {
        "entropy": lambda m: predictive_entropy(m, logits=logits),
        "msp": lambda m: msp_score(m, logits=logits),
    }
    if members > 1:  # with one member these are 0 for every sample
        scores["mutual_information"] = lambda m: mutual_information(m, logits=logits)
        scores["variation_ratio"] = lambda m: variation_ratio(m, logits=logits)
        scores["probability_variance"] = lambda m: probability_variance(m, logits=logits)
    if logits:
        scores["max_logit"] = max_logit_score
        scores["energy"] = energy_score
    return scores


def _classification_summary(
    members: ArrayLike,
    labels: ArrayLike,
    ood_members: ArrayLike | None,
    *,
    logits: bool,
    bins: int,
    coverage: float,
    tpr: float,
) -> Summary:
    member_array = _members(members)
    probs, label_array = _probs_and_labels(predictive_mean(member_array, logits=logits), labels)
    confidence, correct = probs.max(axis=1), probs.argmax(axis=1) == label_array
    result = Summary(
        accuracy=accuracy(probs, label_array),
        nll=negative_log_likelihood(probs, label_array),
        brier=brier_score(probs, label_array),
        ece=expected_calibration_error(probs, label_array, bins=bins),
        aurc=aurc(confidence, correct),
        e_aurc=excess_aurc(confidence, correct),
    )
    result[f"accuracy_at_coverage_{coverage:g}"] = accuracy_at_coverage(confidence, correct, coverage)
    if ood_members is not None:
        ood_array = _members(ood_members)
        if ood_array.shape[::2] != member_array.shape[::2]:
            raise ValueError(
                f"ood_members must have the members and classes of members (n, ·, K) = {member_array.shape}; "
                f"received {ood_array.shape}"
            )
        for name, score in _classification_scores(member_array.shape[0], logits).items():
            _add_detection(result, name, score(member_array), score(ood_array), tpr)
    return result


def _per_sample(values: FloatArray) -> FloatArray:
    """(B, ...) -> (B,): the mean over a sample's outputs."""
    result: FloatArray = values.reshape(values.shape[0], -1).mean(axis=1)
    return result


def _regression_summary(
    means: ArrayLike,
    variances: ArrayLike,
    y: ArrayLike,
    ood_means: ArrayLike | None,
    ood_variances: ArrayLike | None,
    *,
    level: float,
    tpr: float,
) -> Summary:
    mean, variance = gaussian_mixture(means, variances)
    aleatoric, epistemic = uncertainty_split(means, variances)
    result = Summary(nll=gaussian_nll(mean, variance, y))
    result["rmse"] = float(np.sqrt(((_finite_float_array("y", y) - mean) ** 2).mean()))
    result["mixture_nll"] = mixture_nll(means, variances, y)
    result[f"interval_coverage_{level:g}"] = interval_coverage(mean, variance, y, level=level)
    result["calibration_error"] = regression_calibration(mean, variance, y).error
    result["aleatoric_variance"] = float(aleatoric.mean())
    result["epistemic_variance"] = float(epistemic.mean())
    if ood_means is not None:
        if ood_variances is None:
            raise ValueError("ood_members of a regression summary need ood_variances")
        ood_aleatoric, ood_epistemic = uncertainty_split(ood_means, ood_variances)
        if ood_epistemic.shape[1:] != epistemic.shape[1:]:
            raise ValueError(
                f"ood_members must have the output shape of members {epistemic.shape[1:]}; "
                f"received {ood_epistemic.shape[1:]}"
            )
        totals = (_per_sample(aleatoric + epistemic), _per_sample(ood_aleatoric + ood_epistemic))
        _add_detection(result, "total_variance", *totals, tpr)
        _add_detection(result, "epistemic_variance", _per_sample(epistemic), _per_sample(ood_epistemic), tpr)
    return result


def summary(
    members: ArrayLike,
    targets: ArrayLike,
    *,
    logits: bool = False,
    variances: ArrayLike | None = None,
    ood_members: ArrayLike | None = None,
    ood_variances: ArrayLike | None = None,
    bins: int = 15,
    coverage: float = 0.9,
    level: float = 0.9,
    tpr: float = 0.95,
) -> Summary:
    """Every metric of this module from member outputs, as a dict that prints as a Markdown table.

    Classification (``variances`` None): members (n, B, K) probabilities (logits with ``logits``),
    ``targets`` (B,) integer labels. Keys: accuracy, nll, brier, ece, aurc, e_aurc and
    ``accuracy_at_coverage_{coverage}`` of the predictive mean (confidence: its maximum);
    with ``ood_members`` (n, B_ood, K), ``ood_auroc_{score}``, ``ood_aupr_{score}`` (OOD
    positive) and ``ood_fpr{100·tpr}_{score}`` (in-distribution positive) for the scores entropy,
    msp, and for n > 1 mutual_information, variation_ratio, probability_variance, and for logits
    max_logit, energy.

    Regression (``variances`` given): members are the member means (n, B, ...), ``variances``
    their variances, ``targets`` (B, ...). Keys: nll (of ``gaussian_mixture``), rmse,
    mixture_nll, ``interval_coverage_{level}``, calibration_error (``regression_calibration``),
    aleatoric_variance and epistemic_variance (means over samples); with ``ood_members`` and
    ``ood_variances``, the OOD metrics for the scores total_variance and epistemic_variance
    (per sample, averaged over its outputs).
    """
    bins = check_int("bins", bins, minimum=1)
    coverage, level, tpr = (
        _fraction("coverage", coverage),
        _fraction("level", level, include_one=False),
        _fraction("tpr", tpr),
    )
    if variances is None:
        if ood_variances is not None:
            raise ValueError("ood_variances is for regression: pass variances too")
        return _classification_summary(
            members, targets, ood_members, logits=logits, bins=bins, coverage=coverage, tpr=tpr
        )
    if logits:
        raise ValueError("logits=True is for classification; a regression summary takes means and variances")
    return _regression_summary(members, variances, targets, ood_members, ood_variances, level=level, tpr=tpr)
