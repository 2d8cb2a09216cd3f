"""The uncertainty head: what a deployed model answers with, and its NumPy reference.

Every adapter's ``with_uncertainty(model, ...)`` wraps a packed or inserted model so that its output is a dict with
the names below, computed in the framework's own graph (so it exports with the model). ``uncertainty_head`` computes
the same dict from member outputs with ``masksembles_core.metrics``: the oracle the adapters' heads are tested against.

Classification (members ``(n, B, K)`` logits or probabilities; ``K = 1`` logits are a sigmoid, as in ``metrics``):

- ``probabilities`` (B, K): the members' mean probability (``metrics.predictive_mean``);
- ``predictive_entropy``, ``expected_entropy``, ``mutual_information`` (B,), in nats;
- ``max_probability`` (B,): the largest mean probability (one minus ``metrics.msp_score``).

Regression (members ``(n, B, ...)``):

- point members (``head=None``): ``mean`` and ``variance``, the members' mean and spread (ddof=0);
- Gaussian members (``head="log_variance"`` or ``"variance"``: ``(n, B, ..., 2)`` holding a mean and a variance channel,
  as ``gaussian_nll_loss`` trains them, the variance floored at ``min_variance`` as the loss floors it): ``mean`` and
  ``variance`` of the equal-weight mixture, and its split into ``aleatoric`` + ``epistemic``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import metrics
from ._validation import check_gaussian_head

TASKS = ("classification", "regression")
CLASSIFICATION_OUTPUTS = (
    "probabilities",
    "predictive_entropy",
    "expected_entropy",
    "mutual_information",
    "max_probability",
)
POINT_REGRESSION_OUTPUTS = ("mean", "variance")
GAUSSIAN_REGRESSION_OUTPUTS = ("mean", "variance", "aleatoric", "epistemic")


@dataclass(frozen=True)
class HeadSpec:
    """A validated head: its task, what the members output and the names of the dict it answers with."""

    task: str
    logits: bool
    head: str | None
    min_variance: float

    @property
    def outputs(self) -> tuple[str, ...]:
        if self.task == "classification":
            return CLASSIFICATION_OUTPUTS
        return POINT_REGRESSION_OUTPUTS if self.head is None else GAUSSIAN_REGRESSION_OUTPUTS


def check_head(
    task: object = "classification", *, logits: object = True, head: object = None, min_variance: object = 1e-6
) -> HeadSpec:
    """Validate ``with_uncertainty``'s arguments (the same messages in every framework).

    Raises:
        ValueError: an unknown ``task``, ``head`` given for classification, or an unknown Gaussian ``head``.
        TypeError: ``logits`` is not a bool, or ``min_variance`` is not a number.
    """
    if not isinstance(task, str) or task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}; received {task!r}")
    if not isinstance(logits, bool):
        raise TypeError(f"logits must be a bool; received {type(logits).__name__}")
    if task == "classification":
        if head is not None:
            raise ValueError(
                f"head is for task='regression' (what a Gaussian member's channel 1 holds); received {head!r}"
            )
        return HeadSpec(task, logits, None, 1e-6)
    if head is None:
        return HeadSpec(task, logits, None, 1e-6)
    checked, floor = check_gaussian_head(head, min_variance)
    return HeadSpec(task, logits, checked, floor)


def gaussian_channels(members: NDArray[Any], head: str, min_variance: float) -> tuple[NDArray[Any], NDArray[Any]]:
    """Gaussian members ``(n, B, ..., 2)`` -> means and variances ``(n, B, ...)``, floored as the loss floors them."""
    if members.shape[-1] != 2:
        raise ValueError(
            f"Gaussian members (head={head!r}) need a last axis of 2 (mean, variance channel); received shape "
            f"{members.shape}"
        )
    means, channel = members[..., 0], members[..., 1]
    if head == "log_variance":
        return means, np.exp(np.maximum(channel, math.log(min_variance)))
    return means, np.maximum(channel, min_variance)


def uncertainty_head(
    members: ArrayLike,
    *,
    task: str = "classification",
    logits: bool = True,
    head: str | None = None,
    min_variance: float = 1e-6,
    member_axis: int = 0,
) -> dict[str, NDArray[np.float64]]:
    """The head's answer from member outputs, in float64: ``(n, B, ...)`` (``member_axis`` picks n) -> a dict.

    The names and values are those of ``masksembles_core.metrics`` (see the module docstring).
    """
    spec = check_head(task, logits=logits, head=head, min_variance=min_variance)
    if spec.task == "classification":
        probs = metrics.member_probabilities(members, logits=spec.logits, member_axis=member_axis)
        mean = probs.mean(axis=0)
        return {
            "probabilities": mean,
            "predictive_entropy": metrics.predictive_entropy(probs),
            "expected_entropy": metrics.expected_entropy(probs),
            "mutual_information": metrics.mutual_information(probs),
            "max_probability": mean.max(axis=-1),
        }
    outputs = np.moveaxis(np.asarray(members, dtype=np.float64), member_axis, 0)
    if spec.head is None:
        return {"mean": metrics.member_mean(outputs), "variance": metrics.member_variance(outputs)}
    means, variances = gaussian_channels(outputs, spec.head, spec.min_variance)
    mean, variance = metrics.gaussian_mixture(means, variances)
    aleatoric, epistemic = metrics.uncertainty_split(means, variances)
    return {"mean": mean, "variance": variance, "aleatoric": aleatoric, "epistemic": epistemic}
