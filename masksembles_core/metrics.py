"""Uncertainty and evaluation metrics for ensemble outputs (NumPy only).

Members: classification members have shape (n, B, K): ``n`` members (masks, dropout samples or
ensemble members), ``B`` samples, ``K`` classes; probabilities by default, logits with
``logits=True`` (a single logit column, K = 1, is a binary sigmoid logit:
``softmax([0, z]) = [1 - σ(z), σ(z)]``; a masked class may have the logit −inf). A (B, K) array is
one member. Every function that takes members has ``member_axis`` (default 0) for other layouts,
e.g. ``member_axis=1`` for torch-uncertainty's (B, n, K). Regression members are (n, B, ...):
means and variances of each member's Gaussian (always with the member axis, as (n, B) is also a
2-D array). Scoring functions take the predictive distribution (B, K) (``predictive_mean``) and
integer labels (B,). Entropies and log-likelihoods are in nats. Everything is computed in
float64, so float16 or bfloat16 outputs cast to float32 are accepted.

Probabilities must lie in [0, 1] and sum to 1 within ``PROBABILITY_TOLERANCE``; they are
renormalized, with a ``RenormalizationWarning`` when a row's sum is further from 1 than rounding
to the coarsest precision holding every value (bfloat16, float16, float32 or float64) explains.
Logits passed as probabilities (values outside [0, 1]) and probabilities passed as logits (every
row in [0, 1] summing to 1) are refused.

Conventions:

- OOD scores (``predictive_entropy``, ``mutual_information``, ``msp_score``, ``max_logit_score``,
  ``energy_score``, ``variation_ratio``, ``probability_variance``): higher means more likely OOD.
- Confidences for selective prediction (``risk_coverage``, ``aurc``, ...): higher means more
  likely correct (the negative of any OOD score is a confidence).

Degenerate input (NaN, wrong shapes, fewer than two classes, labels out of range, an empty set
of scores) raises ``ValueError`` with a message that names the argument and says what was received.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._validation import check_int

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

PROBABILITY_TOLERANCE = 1e-2  # a bfloat16 softmax rounds each probability by up to 2**-8 relative
TEMPERATURE_BOUNDS = (1e-2, 1e2)


class RenormalizationWarning(UserWarning):
    """Probabilities whose rows sum to 1 only within ``PROBABILITY_TOLERANCE``, not within their rounding."""


# --- validation ------------------------------------------------------------------------------


def _real_array(name: str, values: ArrayLike) -> NDArray[Any]:
    array = np.asarray(values)
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_) or np.iscomplexobj(array):
        raise ValueError(f"{name} must be a real numeric array; received dtype {array.dtype}")
    return array


def _not_finite(name: str, array: FloatArray, allowed: str = "") -> ValueError:
    bad = int((~np.isfinite(array)).sum())
    return ValueError(f"{name} must be finite{allowed}; received {bad} NaN or infinite value(s) in shape {array.shape}")


def _finite_float_array(name: str, values: ArrayLike) -> FloatArray:
    """``values`` as float64 (no copy when it already is), checked finite by two reductions (NaN propagates)."""
    result: FloatArray = np.asarray(_real_array(name, values), dtype=np.float64)
    if result.size and not (math.isfinite(result.min()) and math.isfinite(result.max())):
        raise _not_finite(name, result)
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
    if label_array.size and (label_array.min() < 0 or label_array.max() >= classes):
        raise ValueError(f"labels must lie in [0, {classes}) for {classes} classes; received values outside")
    return label_array.astype(np.int64, copy=False)


def _same_shape(names: Sequence[str], arrays: Sequence[FloatArray]) -> None:
    shapes = [array.shape for array in arrays]
    if len(set(shapes)) != 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in zip(names, shapes, strict=True))
        raise ValueError(f"{', '.join(names)} must have the same shape; received {listed}")


def _member_axis_first(name: str, array: NDArray[Any], member_axis: int, layout: str) -> NDArray[Any]:
    """``array`` with its member axis ``member_axis`` moved to the front; ``layout`` names the axes, e.g. (n, B, K)."""
    if isinstance(member_axis, bool) or not isinstance(member_axis, int | np.integer):
        raise TypeError(f"member_axis must be an integer; received {member_axis!r} ({type(member_axis).__name__})")
    if not -array.ndim <= member_axis < array.ndim:
        raise ValueError(f"member_axis {member_axis} is out of range for {name} {layout} of shape {array.shape}")
    return np.moveaxis(array, member_axis, 0) if member_axis % array.ndim else array


# --- members: probabilities and logits -------------------------------------------------------


def _log_softmax(logits: FloatArray) -> FloatArray:
    """Log-softmax over the last axis; a −inf logit (a masked class) gives −inf (every row has a finite logit)."""
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


_UNIT_ROUNDOFF = {"bfloat16": 2.0**-9, "float16": 2.0**-11, "float32": 2.0**-24}
_FLOAT64_SUM_TOLERANCE = 1e-12  # a float64 softmax of 10⁴ classes sums to 1 within about 1e-13


def _rounding_tolerance(probs: FloatArray) -> tuple[float, str]:
    """How far from 1 rounding alone moves a row's sum: 4 units of the coarsest precision holding every value."""
    as_float32 = probs.astype(np.float32)
    if not np.array_equal(as_float32, probs):
        return _FLOAT64_SUM_TOLERANCE, "float64"
    if not (as_float32.view(np.uint32) & np.uint32(0xFFFF)).any():
        precision = "bfloat16"
    elif np.array_equal(as_float32.astype(np.float16), as_float32):
        precision = "float16"
    else:
        precision = "float32"
    return 4.0 * _UNIT_ROUNDOFF[precision], precision


def _probabilities(name: str, values: ArrayLike, *, hint: str) -> FloatArray:
    """``values`` (..., K) checked as distributions over the last axis and renormalized to sum to 1.

    ``hint`` says what to do with logits (``pass logits=True``, or where the function has no such flag,
    what to pass instead).
    """
    probs = np.asarray(_real_array(name, values), dtype=np.float64)
    if probs.shape[-1] < 2:
        raise ValueError(f"{name} needs at least 2 classes on the last axis; received shape {probs.shape}")
    low, high = (probs.min(), probs.max()) if probs.size else (0.0, 1.0)
    if not (low >= 0.0 and high <= 1.0):  # NaN fails both
        if not (math.isfinite(low) and math.isfinite(high)):
            raise _not_finite(name, probs)
        raise ValueError(
            f"{name} must be probabilities in [0, 1]; received values from {low:.4g} to {high:.4g}, "
            f"which look like logits ({hint})"
        )
    sums = probs.sum(axis=-1, keepdims=True)
    error = float(np.abs(sums - 1.0).max(initial=0.0))
    if error > PROBABILITY_TOLERANCE:
        raise ValueError(
            f"{name} must sum to 1 over the last axis (within {PROBABILITY_TOLERANCE}); "
            f"a row's sum differs from 1 by {error:.3g} (logits: {hint})"
        )
    if error <= _FLOAT64_SUM_TOLERANCE:
        return probs
    tolerance, precision = _rounding_tolerance(probs)
    if error > tolerance:
        warnings.warn(
            f"{name}: a row sums to 1 ± {error:.3g}, more than rounding to {precision} explains "
            f"(± {tolerance:.2g}); the rows are renormalized to sum to 1",
            RenormalizationWarning,
            stacklevel=3,
        )
    result: FloatArray = probs / sums
    return result


def _logits(name: str, values: ArrayLike, *, hint: str) -> FloatArray:
    """``values`` (..., K) checked as logits: no NaN or +inf, −inf (a masked class) only beside a finite logit.

    With K >= 2, rows that all lie in [0, 1] and sum to 1 are probabilities, refused with ``hint``.
    """
    logits = np.asarray(_real_array(name, values), dtype=np.float64)
    if not logits.size:
        return logits
    low, high = logits.min(), logits.max()
    if math.isnan(low) or math.isnan(high) or high == math.inf:
        raise _not_finite(name, logits, " (−inf, a masked class, is allowed)")
    if low == -math.inf and (logits.max(axis=-1) == -math.inf).any():
        raise ValueError(f"{name} has a row whose logits are all −inf: no class is possible there")
    if logits.shape[-1] >= 2 and low >= 0.0 and high <= 1.0:
        error = float(np.abs(logits.sum(axis=-1) - 1.0).max())
        if error <= PROBABILITY_TOLERANCE:
            raise ValueError(
                f"{name} look like probabilities, not logits: every row lies in [0, 1] and sums to 1 ({hint})"
            )
    return logits


_AS_LOGITS = "pass logits=True"
_AS_PROBABILITIES = "pass logits=False"


def _members(name: str, values: ArrayLike, *, logits: bool, member_axis: int, hint: str | None = None) -> FloatArray:
    """Validated classification members as float64 (n, B, K): (B, K) is one member; ``member_axis`` is moved first.

    Probabilities are renormalized; logits keep their K (see ``_member_logits`` for K = 1).
    """
    array = _real_array(name, values)
    if array.ndim not in (2, 3):
        raise ValueError(
            f"{name} must have shape (n, B, K) (members, samples, classes; member_axis picks the members' axis) "
            f"or (B, K) (one member); received shape {array.shape}"
        )
    if 0 in array.shape:
        raise ValueError(
            f"{name} needs n >= 1 members and B >= 1 samples (and K >= 1 classes); received shape {array.shape}"
        )
    array = _member_axis_first(name, array, member_axis, "(n, B, K)") if array.ndim == 3 else array[None]
    if logits:
        return _logits(name, array, hint=hint or _AS_PROBABILITIES)
    return _probabilities(name, array, hint=hint or _AS_LOGITS)


def _member_logits(name: str, values: ArrayLike, *, member_axis: int, hint: str | None = None) -> FloatArray:
    """Validated member logits (n, B, K) (or (B, K)) -> float64 (n, B, max(K, 2))."""
    return _binary_expanded(_members(name, values, logits=True, member_axis=member_axis, hint=hint))


def member_probabilities(members: ArrayLike, *, logits: bool = False, member_axis: int = 0) -> FloatArray:
    """Validated member probabilities: (n, B, K) probabilities or logits -> (n, B, K) float64; (B, K) -> (1, B, K).

    With ``logits=True`` a softmax over the last axis is applied first (K = 1: a sigmoid, giving
    (n, B, 2)). Probabilities are checked to sum to 1 and renormalized.
    """
    if logits:
        return np.exp(_log_softmax(_member_logits("members", members, member_axis=member_axis)))
    return _members("members", members, logits=False, member_axis=member_axis)


def _entropy(probs: FloatArray) -> FloatArray:
    """Entropy in nats over the last axis, with 0 log 0 = 0."""
    logs = np.log(np.where(probs > 0, probs, 1.0))
    result: FloatArray = -np.einsum("...k,...k->...", probs, logs)
    return result


def predictive_mean(members: ArrayLike, *, logits: bool = False, member_axis: int = 0) -> FloatArray:
    """The ensemble's predictive distribution: the mean of the member probabilities, (n, B, K) -> (B, K)."""
    result: FloatArray = member_probabilities(members, logits=logits, member_axis=member_axis).mean(axis=0)
    return result


def predictive_entropy(members: ArrayLike, *, logits: bool = False, member_axis: int = 0) -> FloatArray:
    """Total uncertainty: the entropy of the predictive mean, (n, B, K) -> (B,). An OOD score."""
    return _entropy(predictive_mean(members, logits=logits, member_axis=member_axis))


def expected_entropy(members: ArrayLike, *, logits: bool = False, member_axis: int = 0) -> FloatArray:
    """Aleatoric uncertainty: the mean of the members' entropies, (n, B, K) -> (B,)."""
    probs = member_probabilities(members, logits=logits, member_axis=member_axis)
    result: FloatArray = _entropy(probs).mean(axis=0)
    return result


def mutual_information(members: ArrayLike, *, logits: bool = False, member_axis: int = 0) -> FloatArray:
    """Epistemic uncertainty: predictive entropy minus expected entropy (>= 0), (n, B, K) -> (B,).

    Zero when all members agree (and for one member); it measures how much the members disagree. An OOD score.
    """
    return _mutual_information(member_probabilities(members, logits=logits, member_axis=member_axis))


def _mutual_information(probs: FloatArray) -> FloatArray:
    total = _entropy(probs.mean(axis=0))
    aleatoric = _entropy(probs).mean(axis=0)
    result: FloatArray = np.maximum(total - aleatoric, 0.0)  # Jensen: >= 0 up to rounding
    return result


# --- regression: members with a Gaussian head -------------------------------------------------


def _regression_outputs(name: str, outputs: ArrayLike, member_axis: int) -> FloatArray:
    array = _finite_float_array(name, outputs)
    if array.ndim < 2 or 0 in array.shape[:2]:
        raise ValueError(f"{name} must have shape (n, B, ...) with n >= 1 and B >= 1; received shape {array.shape}")
    return _member_axis_first(name, array, member_axis, "(n, B, ...)")


def member_mean(outputs: ArrayLike, *, member_axis: int = 0) -> FloatArray:
    """Regression prediction: the mean of the member outputs, (n, B, ...) -> (B, ...)."""
    result: FloatArray = _regression_outputs("outputs", outputs, member_axis).mean(axis=0)
    return result


def member_variance(outputs: ArrayLike, *, member_axis: int = 0) -> FloatArray:
    """Regression uncertainty: the variance of the member outputs (ddof=0), (n, B, ...) -> (B, ...)."""
    result: FloatArray = _regression_outputs("outputs", outputs, member_axis).var(axis=0)
    return result


def _member_gaussians(
    means: ArrayLike, variances: ArrayLike, member_axis: int, names: tuple[str, str] = ("means", "variances")
) -> tuple[FloatArray, FloatArray]:
    mean_array = _regression_outputs(names[0], means, member_axis)
    variance_array = _regression_outputs(names[1], variances, member_axis)
    _same_shape(names, (mean_array, variance_array))
    if variance_array.min() < 0:
        raise ValueError(f"{names[1]} must be >= 0; received a minimum of {variance_array.min():.3g}")
    return mean_array, variance_array


def uncertainty_split(means: ArrayLike, variances: ArrayLike, *, member_axis: int = 0) -> tuple[FloatArray, FloatArray]:
    """Aleatoric and epistemic variance of Gaussian members, (n, B, ...) each -> two (B, ...).

    Aleatoric: the mean of the member variances (the noise the members predict). Epistemic:
    the variance of the member means (ddof=0; how much the members disagree). Their sum is the
    variance of the members' equal-weight mixture (the law of total variance).
    """
    mean_array, variance_array = _member_gaussians(means, variances, member_axis)
    return variance_array.mean(axis=0), mean_array.var(axis=0)


def gaussian_mixture(means: ArrayLike, variances: ArrayLike, *, member_axis: int = 0) -> tuple[FloatArray, FloatArray]:
    """Mean and variance of the equal-weight mixture of the members' Gaussians, (n, B, ...) -> two (B, ...).

    ``mean = mean_k means[k]``; ``variance = mean_k variances[k] + var_k means[k]`` (aleatoric +
    epistemic, see ``uncertainty_split``). ``gaussian_nll`` and ``interval_coverage`` of this
    moment-matched Gaussian are the usual ensemble regression scores (Lakshminarayanan et al. 2017).
    """
    mean_array, variance_array = _member_gaussians(means, variances, member_axis)
    return mean_array.mean(axis=0), variance_array.mean(axis=0) + mean_array.var(axis=0)


def _gaussian(mean: ArrayLike, variance: ArrayLike, targets: ArrayLike) -> tuple[FloatArray, FloatArray, FloatArray]:
    arrays = [_finite_float_array(name, a) for name, a in (("mean", mean), ("variance", variance), ("y", targets))]
    _same_shape(("mean", "variance", "y"), arrays)
    if arrays[0].size == 0:
        raise ValueError("mean, variance and y must hold at least one value; received empty arrays")
    if arrays[1].min() <= 0:
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


def _targets_of_members(y: ArrayLike, mean_array: FloatArray) -> FloatArray:
    y_array = _finite_float_array("y", y)
    if y_array.shape != mean_array.shape[1:]:
        raise ValueError(
            f"y must have shape {mean_array.shape[1:]} to match means {mean_array.shape}; received {y_array.shape}"
        )
    return y_array


def _positive_member_gaussians(
    means: ArrayLike, variances: ArrayLike, y: ArrayLike, member_axis: int
) -> tuple[FloatArray, FloatArray, FloatArray]:
    mean_array, variance_array = _member_gaussians(means, variances, member_axis)
    y_array = _targets_of_members(y, mean_array)
    if variance_array.min() <= 0:
        raise ValueError(f"variances must be > 0; received a minimum of {variance_array.min():.3g}")
    return mean_array, variance_array, y_array


def mixture_nll(means: ArrayLike, variances: ArrayLike, y: ArrayLike, *, member_axis: int = 0) -> float:
    """Mean negative log-likelihood of ``y`` (B, ...) under the exact equal-weight mixture of the members' Gaussians.

    ``-log((1/n) sum_k N(y; means[k], variances[k]))``, averaged over every element; means and
    variances (n, B, ...), variances > 0. Never larger than the members' mean ``gaussian_nll``
    (Jensen); unlike ``gaussian_nll`` of ``gaussian_mixture``, it keeps a multimodal mixture's shape.
    """
    mean_array, variance_array, y_array = _positive_member_gaussians(means, variances, y, member_axis)
    log_densities = -0.5 * (np.log(2.0 * np.pi * variance_array) + (y_array - mean_array) ** 2 / variance_array)
    log_mixture = _logsumexp(log_densities, axis=0) - math.log(mean_array.shape[0])
    return float(-log_mixture.mean())


_erfc = np.frompyfunc(math.erfc, 1, 1)  # the C library's erfc, exact to rounding (NumPy has no erf)


def _mean_absolute_gaussian(mean: FloatArray, std: FloatArray) -> FloatArray:
    """``E|X|`` for X ~ N(mean, std²), std > 0: ``mean (2Φ(mean/std) − 1) + 2 std φ(mean/std)``."""
    z = mean / std
    two_cdf_minus_one = 1.0 - np.asarray(_erfc(z / math.sqrt(2.0)), dtype=np.float64)  # 2Φ(z) − 1 = erf(z/√2)
    result: FloatArray = mean * two_cdf_minus_one + std * math.sqrt(2.0 / math.pi) * np.exp(-0.5 * z * z)
    return result


def crps_gaussian(mean: ArrayLike, variance: ArrayLike, y: ArrayLike) -> float:
    """Mean continuous ranked probability score of ``y`` under N(mean, variance), all (B, ...); lower is better.

    ``CRPS(F, y) = E|X − y| − ½ E|X − X'|`` (X, X' independent draws from F), in the units of ``y``; for a Gaussian,
    ``σ (z (2Φ(z) − 1) + 2φ(z) − 1/√π)`` with ``z = (y − mean) / σ`` (Gneiting & Raftery 2007), averaged over every
    element. For an ensemble pass ``gaussian_mixture``'s mean and variance, or use ``crps_mixture``.
    """
    mean_array, variance_array, y_array = _gaussian(mean, variance, y)
    std = np.sqrt(variance_array)
    return float((_mean_absolute_gaussian(y_array - mean_array, std) - std / math.sqrt(math.pi)).mean())


def crps_mixture(means: ArrayLike, variances: ArrayLike, y: ArrayLike, *, member_axis: int = 0) -> float:
    """Mean CRPS of ``y`` (B, ...) under the exact equal-weight mixture of the members' Gaussians (n, B, ...).

    ``(1/n) sum_k A(y − μ_k, σ_k²) − (1/2n²) sum_k,l A(μ_k − μ_l, σ_k² + σ_l²)`` with ``A(μ, σ²) = E|N(μ, σ²)|``
    (Grimit et al. 2006), averaged over every element; variances > 0. With one member it is ``crps_gaussian``.
    """
    mean_array, variance_array, y_array = _positive_member_gaussians(means, variances, y, member_axis)
    std = np.sqrt(variance_array)
    members = mean_array.shape[0]
    to_target = _mean_absolute_gaussian(y_array - mean_array, std).mean(axis=0)
    between = std.sum(axis=0) * (2.0 / math.sqrt(math.pi))  # k = l: A(0, 2σ²) = 2σ/√π
    for k in range(members - 1):  # k < l, counted twice; one row of pairs at a time bounds the memory
        pair_std = np.sqrt(variance_array[k] + variance_array[k + 1 :])
        between += 2.0 * _mean_absolute_gaussian(mean_array[k] - mean_array[k + 1 :], pair_std).sum(axis=0)
    return float((to_target - between / (2.0 * members**2)).mean())


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


_PREDICTIVE_HINT = "pass the predictive distribution, e.g. metrics.predictive_mean(logits, logits=True)"


def _probs_and_labels(probs: ArrayLike, labels: ArrayLike) -> tuple[FloatArray, IntArray]:
    shape = np.shape(probs)
    if len(shape) != 2 or shape[0] == 0:
        raise ValueError(
            f"probs must have shape (B, K) with B >= 1 (use predictive_mean for member outputs); received shape {shape}"
        )
    array = _probabilities("probs", probs, hint=_PREDICTIVE_HINT)
    return array, _labels(labels, classes=array.shape[1], against="probs", shape=array.shape)


def accuracy(probs: ArrayLike, labels: ArrayLike) -> float:
    """Fraction of samples whose most probable class is the label; probs (B, K), labels (B,)."""
    array, label_array = _probs_and_labels(probs, labels)
    return float((array.argmax(axis=1) == label_array).mean())


def _true_class_log_probabilities(
    logits: ArrayLike, labels: ArrayLike, member_axis: int, name: str = "logits"
) -> tuple[FloatArray, IntArray]:
    """Members' log-probabilities of the labels (n, B), from logits (n, B, K) or (B, K), and the labels."""
    array = _member_logits(name, logits, member_axis=member_axis)
    label_array = _labels(labels, classes=array.shape[2], against=name, shape=array.shape)
    true_class = _log_softmax(array)[:, np.arange(array.shape[1]), label_array]
    return true_class, label_array


def negative_log_likelihood(
    probs: ArrayLike, labels: ArrayLike, *, logits: bool = False, member_axis: int = 0, eps: float | None = None
) -> float:
    """Mean negative log-likelihood of the labels (nats).

    Args:
        probs: (B, K) predictive distribution, clipped to [eps, 1 - eps] before the log. With
            ``logits=True``: logits of one model (B, K) or of n members (n, B, K) (``member_axis``);
            the log of the predictive distribution ``mean_k softmax(logits[k])`` is computed by a
            log-softmax and a log-sum-exp, without clipping (a label on a −inf logit gives inf).
        labels: (B,) integer class labels.
        eps: for probabilities, the clipping bound in (0, 1/K) (default: float64's machine
            epsilon, scikit-learn's ``log_loss`` bound); not used for logits.
    """
    if logits:
        if eps is not None:
            raise ValueError("eps clips probabilities; the NLL of logits is computed without clipping (leave eps out)")
        true_class, _ = _true_class_log_probabilities(probs, labels, member_axis, name="probs")
        return float(-(_logsumexp(true_class, axis=0) - math.log(true_class.shape[0])).mean())
    array, label_array = _probs_and_labels(probs, labels)
    bound = float(np.finfo(np.float64).eps) if eps is None else eps
    classes = array.shape[1]
    if isinstance(bound, bool) or not isinstance(bound, int | float | np.floating) or not 0.0 < bound < 1.0 / classes:
        raise ValueError(
            f"eps must lie in (0, 1/K) = (0, {1.0 / classes:.4g}) for K = {classes} classes; received {eps!r}"
        )
    true_class = np.clip(array[np.arange(array.shape[0]), label_array], bound, 1.0 - bound)
    return float(-np.log(true_class).mean())


def brier_score(probs: ArrayLike, labels: ArrayLike) -> float:
    """Multi-class Brier score: the mean over samples of ``sum_k (p_k - onehot_k)^2``, in [0, 2]."""
    array, label_array = _probs_and_labels(probs, labels)
    onehot = np.eye(array.shape[1])[label_array]
    return float(((array - onehot) ** 2).sum(axis=1).mean())


# --- temperature scaling -----------------------------------------------------------------------

_GRID_PER_DECADE = 4  # starting points per decade of temperature for an ensemble, whose NLL may have two minima
_NEWTON_TOLERANCE = 1e-10  # relative step of 1/T at which the search stops


def _temperature_bounds(bounds: object) -> tuple[float, float]:
    pair = tuple(bounds) if isinstance(bounds, Sequence | np.ndarray) else ()
    numbers_given = all(not isinstance(b, bool) and isinstance(b, int | float | np.integer | np.floating) for b in pair)
    if len(pair) != 2 or not numbers_given:
        raise ValueError(f"bounds must be two temperatures (low, high); received {bounds!r}")
    low, high = float(pair[0]), float(pair[1])
    if not (math.isfinite(low) and math.isfinite(high) and 0.0 < low < high):
        raise ValueError(f"bounds must be two finite temperatures 0 < low < high; received {bounds!r}")
    return low, high


class _EnsembleNLL:
    """The NLL of ``mean_k softmax(s · logits[k])`` as a function of the inverse temperature s = 1/T.

    ``evaluate(s)`` gives the NLL and its first two derivatives in s in one pass over the logits
    (n, B, K). For one member the NLL is convex in s (a log-sum-exp of functions linear in s).
    """

    def __init__(self, logits: FloatArray, labels: IntArray) -> None:
        shifted = logits - logits.max(axis=2, keepdims=True)  # <= 0; the NLL does not change
        self.masked = np.isneginf(shifted)
        self.has_masked = bool(self.masked.any())
        self.shifted = np.where(self.masked, 0.0, shifted) if self.has_masked else shifted
        self.squared = self.shifted * self.shifted
        rows = np.arange(logits.shape[1])
        self.true_masked = self.masked[:, rows, labels]  # (n, B): the label is masked for that member
        self.true = self.shifted[:, rows, labels]
        self.members = logits.shape[0]

    def evaluate(self, s: float) -> tuple[float, float, float]:
        weights = np.exp(s * self.shifted)
        if self.has_masked:
            weights[self.masked] = 0.0
        total = weights.sum(axis=2)
        expected = np.einsum("nbk,nbk->nb", weights, self.shifted) / total  # E_p[z]
        variance = np.maximum(np.einsum("nbk,nbk->nb", weights, self.squared) / total - expected**2, 0.0)
        slope = self.true - expected  # d/ds of log p(label)
        log_likelihood = s * self.true - np.log(total)
        if self.members == 1:
            return float(-log_likelihood.mean()), float(-slope.mean()), float(variance.mean())
        if self.has_masked:
            log_likelihood[self.true_masked] = -math.inf
        mixture = _logsumexp(log_likelihood, axis=0)  # log sum_k p_k(label)
        posterior = np.exp(log_likelihood - mixture)  # each member's share of the likelihood
        first = (posterior * slope).sum(axis=0)
        second = (posterior * (slope * slope - variance)).sum(axis=0) - first * first
        nll = -(mixture - math.log(self.members)).mean()
        return float(nll), float(-first.mean()), float(-second.mean())


def _newton_minimum(objective: _EnsembleNLL, low: float, high: float, start: float) -> tuple[float, float]:
    """A local minimum (s, NLL) of the objective in [low, high], whose slope is < 0 at low and > 0 at high.

    Newton steps on s, kept inside the bracket (a bisection where a step would leave it or the
    curvature is not positive).
    """
    s, best = start, (math.inf, start)
    for _ in range(200):
        value, slope, curvature = objective.evaluate(s)
        best = min(best, (value, s))
        if slope < 0:
            low = s
        else:
            high = s
        step = -slope / curvature if curvature > 0 else math.inf
        following = s + step if low < s + step < high else (low + high) / 2.0
        if abs(following - s) <= _NEWTON_TOLERANCE * s or high - low <= _NEWTON_TOLERANCE * s:
            return following, value
        s = following
    return best[1], best[0]


def _fit_one_temperature(logits: FloatArray, labels: IntArray, bounds: tuple[float, float]) -> float:
    """The temperature in ``bounds`` minimizing the NLL of the mean of softmax(logits[k] / T), logits (n, B, K).

    One member: the NLL is convex in 1/T, so its slope at the two bounds says whether the minimum
    lies inside, where Newton's method finds it. Several members: the NLL may have several minima;
    its value and slope on a log-spaced grid of T (``_GRID_PER_DECADE`` points per decade) locate
    every minimum between grid points, Newton refines each, and the lowest wins. A minimum at a
    bound returns that bound; an NLL that does not depend on T returns 1 (clipped to ``bounds``).
    """
    objective = _EnsembleNLL(logits, labels)
    s_low, s_high = 1.0 / bounds[1], 1.0 / bounds[0]
    decades = math.log10(s_high / s_low)
    points = 2 if logits.shape[0] == 1 else max(3, math.ceil(_GRID_PER_DECADE * decades) + 1)
    grid = np.exp(np.linspace(math.log(s_low), math.log(s_high), points))
    grid[0], grid[-1] = s_low, s_high
    evaluated = [objective.evaluate(float(s)) for s in grid]
    values, slopes = np.array([e[0] for e in evaluated]), np.array([e[1] for e in evaluated])
    if np.abs(slopes).max() * (s_high - s_low) <= 1e-12 * max(1.0, abs(values[0])):
        return min(max(1.0, bounds[0]), bounds[1])  # the NLL does not depend on T (e.g. equal logits)
    candidates = [(float(v), float(s)) for v, s in zip(values, grid, strict=True)]
    for i in np.flatnonzero((slopes[:-1] < 0) & (slopes[1:] > 0)):
        low, high = float(grid[i]), float(grid[i + 1])
        start = 1.0 if points == 2 and low < 1.0 < high else (low if values[i] <= values[i + 1] else high)
        s, value = _newton_minimum(objective, low, high, start)
        candidates.append((value, s))
    value, s = min(candidates)
    if s == s_high:
        return bounds[0]
    if s == s_low:
        return bounds[1]
    return 1.0 / s


@overload
def fit_temperature(
    logits: ArrayLike,
    labels: ArrayLike,
    *,
    per_member: Literal[False] = False,
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
    member_axis: int = 0,
) -> float: ...


@overload
def fit_temperature(
    logits: ArrayLike,
    labels: ArrayLike,
    *,
    per_member: Literal[True],
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
    member_axis: int = 0,
) -> FloatArray: ...


def fit_temperature(
    logits: ArrayLike,
    labels: ArrayLike,
    *,
    per_member: bool = False,
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
    member_axis: int = 0,
) -> float | FloatArray:
    """Temperature scaling (Guo et al. 2017) fitted on validation logits, for one model or an ensemble.

    One temperature T for every member: the T in ``bounds`` that minimizes the NLL of the
    ensemble's prediction ``mean_k softmax(logits[k] / T)`` (for (B, K) logits, of the single
    model). Apply it with ``apply_temperature`` to the test logits before averaging. The search
    uses Newton steps on 1/T inside a bracket (one model: the NLL is convex in 1/T; an ensemble: a
    log-spaced grid first finds every minimum, the lowest wins): no SciPy, never a NaN. When the
    NLL is lowest at a bound (separable validation logits make it fall as T -> 0) the bound is
    returned with a ``UserWarning``; when it does not depend on T, 1 is returned.

    Args:
        logits: (B, K) logits of one model or (n, B, K) of n members; K = 1 is a binary
            sigmoid logit; −inf marks a masked class.
        labels: (B,) integer labels in [0, K) (in {0, 1} for K = 1).
        per_member: fit each member's own temperature on that member's own NLL instead.
        bounds: the range (low, high) searched, 0 < low < high.
        member_axis: the members' axis of 3-D logits.

    Returns:
        T (a float), or with ``per_member`` a (n,) array (n = 1 for (B, K) logits).
    """
    bounds = _temperature_bounds(bounds)
    array = _member_logits("logits", logits, member_axis=member_axis)
    label_array = _labels(labels, classes=array.shape[2], against="logits", shape=array.shape)
    rows = np.arange(array.shape[1])
    impossible = np.flatnonzero(np.isneginf(array[:, rows, label_array]).all(axis=0))
    if impossible.size:
        raise ValueError(
            f"labels fall on a masked class (logit −inf in every member) for samples {impossible[:5].tolist()}: "
            "the NLL is infinite at every temperature"
        )
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


def apply_temperature(logits: ArrayLike, temperature: ArrayLike, *, member_axis: int = 0) -> FloatArray:
    """``logits / temperature`` in float64, in the layout of ``logits``.

    One T > 0 for logits of any shape (..., K), or one T per member (n,) for (n, B, K) logits (the
    members on ``member_axis``) or n = 1 for (B, K) logits (as ``fit_temperature(per_member=True)`` returns).
    """
    array = _logits("logits", logits, hint="temperature scaling divides logits")
    temperatures = _finite_float_array("temperature", temperature)
    if temperatures.size and temperatures.min() <= 0:
        raise ValueError(f"temperature must be > 0; received {temperatures.tolist()}")
    if temperatures.ndim == 0 and array.ndim >= 1:
        result: FloatArray = array / temperatures
        return result
    if temperatures.ndim == 1 and array.ndim == 2 and temperatures.shape == (1,):
        one_member: FloatArray = array / temperatures[0]
        return one_member
    if temperatures.ndim == 1 and array.ndim == 3:
        moved = _member_axis_first("logits", array, member_axis, "(n, B, K)")
        if temperatures.shape[0] == moved.shape[0]:
            scaled: FloatArray = np.moveaxis(moved / temperatures[:, None, None], 0, member_axis)
            return scaled
    raise ValueError(
        f"temperature must be a number, or one per member (n,) for (n, B, K) logits (member_axis={member_axis}); "
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


def msp_score(members: ArrayLike, *, logits: bool = False, member_axis: int = 0) -> FloatArray:
    """One minus the maximum softmax probability of the predictive mean (Hendrycks & Gimpel 2017), (n, B, K) -> (B,)."""
    result: FloatArray = 1.0 - predictive_mean(members, logits=logits, member_axis=member_axis).max(axis=1)
    return result


_LOGIT_SCORE_HINT = "{} takes logits; for probabilities use msp_score or predictive_entropy"


def max_logit_score(logits: ArrayLike, *, member_axis: int = 0) -> FloatArray:
    """Minus the largest logit (Hendrycks et al. 2022), averaged over members: (n, B, K) logits -> (B,).

    Unlike probabilities, logits keep the magnitude of the evidence; a K = 1 sigmoid logit z
    counts as the logits (0, z).
    """
    array = _member_logits("members", logits, member_axis=member_axis, hint=_LOGIT_SCORE_HINT.format("max_logit_score"))
    result: FloatArray = -array.max(axis=2).mean(axis=0)
    return result


def energy_score(logits: ArrayLike, *, member_axis: int = 0) -> FloatArray:
    """The free energy ``-logsumexp_k z_k`` (Liu et al. 2020), averaged over members: (n, B, K) logits -> (B,)."""
    array = _member_logits("members", logits, member_axis=member_axis, hint=_LOGIT_SCORE_HINT.format("energy_score"))
    result: FloatArray = -_logsumexp(array, axis=2).mean(axis=0)
    return result


def variation_ratio(members: ArrayLike, *, logits: bool = False, member_axis: int = 0) -> FloatArray:
    """Fraction of members that do not vote for the most voted class, (n, B, K) -> (B,), in [0, 1 - 1/n].

    Each member votes for its most probable class; 0 when every member votes alike. Coarse
    (n + 1 distinct values at most), so ranking metrics see many ties.
    """
    return _variation_ratio(member_probabilities(members, logits=logits, member_axis=member_axis))


def _variation_ratio(probs: FloatArray) -> FloatArray:
    votes = probs.argmax(axis=2)  # (n, B)
    counts = (votes[:, :, None] == np.arange(probs.shape[2])).sum(axis=0)  # (B, K)
    result: FloatArray = 1.0 - counts.max(axis=1) / probs.shape[0]
    return result


def probability_variance(members: ArrayLike, *, logits: bool = False, member_axis: int = 0) -> FloatArray:
    """Variance of the member probabilities (ddof=0) summed over the classes, (n, B, K) -> (B,).

    The mean squared distance of the members' probability vectors from their mean: 0 when all
    members agree.
    """
    probs = member_probabilities(members, logits=logits, member_axis=member_axis)
    result: FloatArray = probs.var(axis=0).sum(axis=1)
    return result


_PROBABILITY_SCORES: dict[str, Callable[[FloatArray], FloatArray]] = {  # of validated member probabilities
    "entropy": lambda probs: _entropy(probs.mean(axis=0)),
    "msp": lambda probs: 1.0 - probs.mean(axis=0).max(axis=1),
    "mutual_information": _mutual_information,
    "variation_ratio": _variation_ratio,
    "probability_variance": lambda probs: probs.var(axis=0).sum(axis=1),
}
_LOGIT_SCORES: dict[str, Callable[[FloatArray], FloatArray]] = {  # of validated member logits
    "max_logit": lambda logits: -logits.max(axis=2).mean(axis=0),
    "energy": lambda logits: -_logsumexp(logits, axis=2).mean(axis=0),
}
OOD_SCORES = (*_PROBABILITY_SCORES, *_LOGIT_SCORES)


class _ValidatedMembers:
    """Members validated once: their probabilities (n, B, K) and, for logits, the logits; every OOD score of them."""

    def __init__(self, name: str, members: ArrayLike, *, logits: bool, member_axis: int) -> None:
        self.logits = _member_logits(name, members, member_axis=member_axis) if logits else None
        self.probs = (
            np.exp(_log_softmax(self.logits))
            if self.logits is not None
            else _members(name, members, logits=False, member_axis=member_axis)
        )

    def score(self, name: str) -> FloatArray:
        if name in _LOGIT_SCORES:
            if self.logits is None:
                raise ValueError(f"the {name} score needs logits (logits=True)")
            return _LOGIT_SCORES[name](self.logits)
        if name not in _PROBABILITY_SCORES:
            raise ValueError(f"score must be one of {OOD_SCORES}; received {name!r}")
        return _PROBABILITY_SCORES[name](self.probs)


def ood_score(
    name: str, members: ArrayLike, *, logits: bool = False, member_axis: int = 0, argument: str = "members"
) -> FloatArray:
    """The OOD score ``name`` of members (n, B, K) -> (B,), higher = more likely OOD.

    ``name`` is one of ``OOD_SCORES``: entropy, msp, mutual_information, variation_ratio,
    probability_variance (the functions of the same names), max_logit and energy (logits only).
    ``argument`` names the array in error messages (e.g. ``"ood_members"``).
    """
    return _ValidatedMembers(argument, members, logits=logits, member_axis=member_axis).score(name)


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
    return fpr_threshold(in_scores, out_scores, tpr, positive=positive)[0]


def fpr_threshold(
    in_scores: ArrayLike, out_scores: ArrayLike, tpr: float = 0.95, *, positive: Positive = "in"
) -> tuple[float, float]:
    """``fpr_at_tpr`` and the threshold it uses, in the scores' units: (FPR, threshold).

    ``positive="in"``: in-distribution samples are accepted when their score is <= the threshold;
    ``positive="ood"``: samples are flagged as OOD when their score is >= the threshold.
    """
    tpr = _fraction("tpr", tpr)
    scores, is_positive = _oriented(in_scores, out_scores, positive)
    positives = np.sort(scores[is_positive])[::-1]
    threshold = float(positives[_smallest_count(tpr, positives.size) - 1])
    false_positive_rate = float((scores[~is_positive] >= threshold).mean())
    return false_positive_rate, (threshold if positive == "ood" else -threshold)


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


def pairwise_diversity(
    members: ArrayLike, labels: ArrayLike, *, logits: bool = False, member_axis: int = 0
) -> DiversityPoints:
    """``diversity`` and mean accuracy of every pair of members; members (n, B, K) with n >= 2, labels (B,)."""
    probs = member_probabilities(members, logits=logits, member_axis=member_axis)
    if probs.shape[0] < 2:
        raise ValueError(f"pairwise_diversity needs at least 2 members; received shape {probs.shape}")
    predictions = probs.argmax(axis=2)
    label_array = _labels(labels, classes=probs.shape[2], against="members", shape=probs.shape)
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


def _classification_scores(members: int, logits: bool) -> tuple[str, ...]:
    """The OOD scores that mean something for ``members`` members (logit scores only for logits)."""
    with_one_member = ("entropy", "msp")
    disagreement = ("mutual_information", "variation_ratio", "probability_variance")  # 0 for one member
    return (*with_one_member, *(disagreement if members > 1 else ()), *(tuple(_LOGIT_SCORES) if logits else ()))


def _classification_summary(
    members: ArrayLike,
    labels: ArrayLike,
    ood_members: ArrayLike | None,
    *,
    logits: bool,
    member_axis: int,
    bins: int,
    coverage: float,
    tpr: float,
) -> Summary:
    validated = _ValidatedMembers("members", members, logits=logits, member_axis=member_axis)
    probs = validated.probs.mean(axis=0)
    label_array = _labels(labels, classes=probs.shape[1], against="members", shape=validated.probs.shape)
    confidence, correct = probs.max(axis=1), probs.argmax(axis=1) == label_array
    if validated.logits is not None:  # log-softmax and log-sum-exp: no clipping, no cap
        true_class = _log_softmax(validated.logits)[:, np.arange(probs.shape[0]), label_array]
        nll = float(-(_logsumexp(true_class, axis=0) - math.log(true_class.shape[0])).mean())
    else:
        nll = negative_log_likelihood(probs, label_array)
    result = Summary(
        accuracy=accuracy(probs, label_array),
        nll=nll,
        brier=brier_score(probs, label_array),
        ece=expected_calibration_error(probs, label_array, bins=bins),
        aurc=aurc(confidence, correct),
        e_aurc=excess_aurc(confidence, correct),
    )
    result[f"accuracy_at_coverage_{coverage:g}"] = accuracy_at_coverage(confidence, correct, coverage)
    if ood_members is not None:
        ood = _ValidatedMembers("ood_members", ood_members, logits=logits, member_axis=member_axis)
        if ood.probs.shape[::2] != validated.probs.shape[::2]:
            raise ValueError(
                f"ood_members must have the members and classes of members (n, ·, K) = {validated.probs.shape}; "
                f"received {ood.probs.shape} (members first)"
            )
        for name in _classification_scores(validated.probs.shape[0], logits):
            _add_detection(result, name, validated.score(name), ood.score(name), tpr)
    return result


def _per_sample(values: FloatArray) -> FloatArray:
    """(B, ...) -> (B,): the mean over a sample's outputs."""
    result: FloatArray = values.reshape(values.shape[0], -1).mean(axis=1)
    return result


def _regression_summary(
    means: ArrayLike,
    variances: ArrayLike,
    targets: ArrayLike,
    ood_means: ArrayLike | None,
    ood_variances: ArrayLike | None,
    *,
    member_axis: int,
    level: float,
    tpr: float,
) -> Summary:
    mean_array, variance_array = _member_gaussians(means, variances, member_axis, names=("members", "variances"))
    y = _finite_float_array("targets", targets)
    if y.shape != mean_array.shape[1:]:
        raise ValueError(
            f"targets must have shape {mean_array.shape[1:]} to match members {mean_array.shape} (members first); "
            f"received {y.shape}"
        )
    if variance_array.min() <= 0:
        raise ValueError(f"variances must be > 0; received a minimum of {variance_array.min():.3g}")
    aleatoric, epistemic = variance_array.mean(axis=0), mean_array.var(axis=0)
    mean, variance = mean_array.mean(axis=0), aleatoric + epistemic
    result = Summary(nll=gaussian_nll(mean, variance, y))
    result["rmse"] = float(np.sqrt(((y - mean) ** 2).mean()))
    result["mixture_nll"] = mixture_nll(mean_array, variance_array, y)
    result["crps"] = crps_gaussian(mean, variance, y)
    result["mixture_crps"] = crps_mixture(mean_array, variance_array, y)
    result[f"interval_coverage_{level:g}"] = interval_coverage(mean, variance, y, level=level)
    result["calibration_error"] = regression_calibration(mean, variance, y).error
    result["aleatoric_variance"] = float(aleatoric.mean())
    result["epistemic_variance"] = float(epistemic.mean())
    if ood_means is not None:
        if ood_variances is None:
            raise ValueError("ood_members of a regression summary need ood_variances")
        ood_mean_array, ood_variance_array = _member_gaussians(
            ood_means, ood_variances, member_axis, names=("ood_members", "ood_variances")
        )
        if ood_mean_array.shape[2:] != mean_array.shape[2:]:
            raise ValueError(
                f"ood_members must have the output shape of members {mean_array.shape[2:]}; "
                f"received {ood_mean_array.shape[2:]} (members first)"
            )
        ood_aleatoric, ood_epistemic = ood_variance_array.mean(axis=0), ood_mean_array.var(axis=0)
        totals = (_per_sample(variance), _per_sample(ood_aleatoric + ood_epistemic))
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
    member_axis: int = 0,
    bins: int = 15,
    coverage: float = 0.9,
    level: float = 0.9,
    tpr: float = 0.95,
) -> Summary:
    """Every metric of this module from member outputs, as a dict that prints as a Markdown table.

    Classification (``variances`` None): members (n, B, K) (or (B, K), one member) probabilities
    (logits with ``logits``), ``targets`` (B,) integer labels. Keys: accuracy, nll, brier, ece,
    aurc, e_aurc and ``accuracy_at_coverage_{coverage}`` of the predictive mean (confidence: its
    maximum; the NLL of logits without clipping); with ``ood_members`` (n, B_ood, K),
    ``ood_auroc_{score}``, ``ood_aupr_{score}`` (OOD positive) and ``ood_fpr{100·tpr}_{score}``
    (in-distribution positive) for the scores entropy, msp, and for n > 1 mutual_information,
    variation_ratio, probability_variance, and for logits max_logit, energy.

    Regression (``variances`` given): members are the member means (n, B, ...), ``variances``
    their variances (> 0), ``targets`` (B, ...). Keys: nll and crps (of the moment-matched
    ``gaussian_mixture``), rmse, mixture_nll and mixture_crps (of the exact mixture),
    ``interval_coverage_{level}``, calibration_error (``regression_calibration``),
    aleatoric_variance and epistemic_variance (means over samples); with ``ood_members`` and
    ``ood_variances``, the OOD metrics for the scores total_variance and epistemic_variance
    (per sample, averaged over its outputs).

    ``member_axis`` is the members' axis of ``members``, ``variances``, ``ood_members`` and ``ood_variances``.
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
            members,
            targets,
            ood_members,
            logits=logits,
            member_axis=member_axis,
            bins=bins,
            coverage=coverage,
            tpr=tpr,
        )
    if logits:
        raise ValueError("logits=True is for classification; a regression summary takes means and variances")
    return _regression_summary(
        members, variances, targets, ood_members, ood_variances, member_axis=member_axis, level=level, tpr=tpr
    )
