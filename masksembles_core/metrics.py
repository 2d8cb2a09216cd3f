"""Uncertainty and evaluation metrics for ensemble outputs (NumPy only).

Member outputs have shape (n, B, K): ``n`` members (masks, dropout samples or ensemble
members), ``B`` samples, ``K`` classes; probabilities by default, logits with ``logits=True``.
Scoring functions take the predictive distribution (B, K) (``predictive_mean``) and integer
labels (B,). Entropies are in nats. Everything is computed in float64. Degenerate input
(NaN, wrong shapes, fewer than two classes, labels out of range, an empty set of scores)
raises ``ValueError`` with a message that says what was received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._validation import check_int

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

PROBABILITY_TOLERANCE = 1e-3


def _finite_float_array(name: str, values: ArrayLike) -> FloatArray:
    array = np.asarray(values)
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_) or np.iscomplexobj(array):
        raise ValueError(f"{name} must be a real numeric array; received dtype {array.dtype}")
    result = array.astype(np.float64)
    if not np.isfinite(result).all():
        bad = int((~np.isfinite(result)).sum())
        raise ValueError(f"{name} must be finite; received {bad} NaN or infinite value(s) in shape {array.shape}")
    return result


def _softmax(logits: FloatArray) -> FloatArray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    result: FloatArray = shifted / shifted.sum(axis=-1, keepdims=True)
    return result


def _check_probabilities(name: str, probs: FloatArray) -> FloatArray:
    if probs.shape[-1] < 2:
        raise ValueError(f"{name} needs at least 2 classes on the last axis; received shape {probs.shape}")
    if (probs < 0).any() or (probs > 1).any():
        raise ValueError(f"{name} must lie in [0, 1] (pass logits=True for logits); received values outside")
    error = np.abs(probs.sum(axis=-1) - 1.0).max(initial=0.0)
    if error > PROBABILITY_TOLERANCE:
        raise ValueError(
            f"{name} must sum to 1 over the last axis (within {PROBABILITY_TOLERANCE}); "
            f"a row's sum differs from 1 by {error:.3g} (pass logits=True for logits)"
        )
    return probs


def member_probabilities(members: ArrayLike, *, logits: bool = False) -> FloatArray:
    """Validated member probabilities: (n, B, K) probabilities or logits -> (n, B, K) float64.

    With ``logits=True`` a softmax over the last axis is applied first.
    """
    array = _finite_float_array("members", members)
    if array.ndim != 3:
        raise ValueError(f"members must have shape (n, B, K) (members, samples, classes); received shape {array.shape}")
    if 0 in array.shape[:2]:
        raise ValueError(f"members needs n >= 1 members and B >= 1 samples; received shape {array.shape}")
    return _check_probabilities("members", _softmax(array) if logits else array)


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
    """Total uncertainty: the entropy of the predictive mean, (n, B, K) -> (B,)."""
    return _entropy(predictive_mean(members, logits=logits))


def expected_entropy(members: ArrayLike, *, logits: bool = False) -> FloatArray:
    """Aleatoric uncertainty: the mean of the members' entropies, (n, B, K) -> (B,)."""
    result: FloatArray = _entropy(member_probabilities(members, logits=logits)).mean(axis=0)
    return result


def mutual_information(members: ArrayLike, *, logits: bool = False) -> FloatArray:
    """Epistemic uncertainty: predictive entropy minus expected entropy (>= 0), (n, B, K) -> (B,).

    Zero when all members agree; it measures how much the members disagree.
    """
    probs = member_probabilities(members, logits=logits)
    total = _entropy(probs.mean(axis=0))
    aleatoric = _entropy(probs).mean(axis=0)
    result: FloatArray = np.maximum(total - aleatoric, 0.0)  # Jensen: >= 0 up to rounding
    return result


def _regression_outputs(outputs: ArrayLike) -> FloatArray:
    array = _finite_float_array("outputs", outputs)
    if array.ndim < 2 or 0 in array.shape[:2]:
        raise ValueError(f"outputs must have shape (n, B, ...) with n >= 1 and B >= 1; received shape {array.shape}")
    return array


def member_mean(outputs: ArrayLike) -> FloatArray:
    """Regression prediction: the mean of the member outputs, (n, B, ...) -> (B, ...)."""
    result: FloatArray = _regression_outputs(outputs).mean(axis=0)
    return result


def member_variance(outputs: ArrayLike) -> FloatArray:
    """Regression uncertainty: the variance of the member outputs (ddof=0), (n, B, ...) -> (B, ...)."""
    result: FloatArray = _regression_outputs(outputs).var(axis=0)
    return result


def _probs_and_labels(probs: ArrayLike, labels: ArrayLike) -> tuple[FloatArray, IntArray]:
    array = _finite_float_array("probs", probs)
    if array.ndim != 2 or array.shape[0] == 0:
        raise ValueError(
            f"probs must have shape (B, K) with B >= 1 (use predictive_mean for member outputs); "
            f"received shape {array.shape}"
        )
    _check_probabilities("probs", array)
    label_array = np.asarray(labels)
    if label_array.dtype == np.bool_ or not np.issubdtype(label_array.dtype, np.integer):
        raise ValueError(f"labels must be an integer array; received dtype {label_array.dtype}")
    if label_array.shape != array.shape[:1]:
        raise ValueError(
            f"labels must have shape ({array.shape[0]},) to match probs {array.shape}; received {label_array.shape}"
        )
    classes = array.shape[1]
    if ((label_array < 0) | (label_array >= classes)).any():
        raise ValueError(f"labels must lie in [0, {classes}) for {classes} classes; received values outside")
    return array, label_array.astype(np.int64)


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


def _ood_scores(in_scores: ArrayLike, out_scores: ArrayLike) -> tuple[FloatArray, NDArray[np.bool_]]:
    """Concatenated scores (B_in + B_out,) and the OOD indicator (the positive class)."""
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


def ood_auroc(in_scores: ArrayLike, out_scores: ArrayLike) -> float:
    """Area under the ROC curve for telling OOD samples from in-distribution ones by a score.

    A higher score must mean "more likely OOD" (e.g. predictive entropy or mutual information).
    Ties count one half (the Mann–Whitney statistic), as in scikit-learn's ``roc_auc_score``.

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


def ood_aupr(in_scores: ArrayLike, out_scores: ArrayLike) -> float:
    """Area under the precision-recall curve with OOD as the positive class (average precision).

    ``sum_t (recall_t - recall_{t-1}) * precision_t`` over the distinct score thresholds, from
    the highest down: scikit-learn's ``average_precision_score``. A higher score must mean
    "more likely OOD". Its chance level is the OOD fraction ``B_out / (B_in + B_out)``.
    """
    scores, is_ood = _ood_scores(in_scores, out_scores)
    order = np.argsort(-scores, kind="stable")
    ordered, positives = scores[order], is_ood[order]
    last_of_threshold = np.flatnonzero(np.r_[ordered[1:] != ordered[:-1], True])
    true_positives = np.cumsum(positives)[last_of_threshold]
    precision = true_positives / (last_of_threshold + 1.0)
    recall = true_positives / true_positives[-1]
    return float((np.diff(recall, prepend=0.0) * precision).sum())


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
