"""Gaussian negative log-likelihood for members with a (mean, variance) head."""

from __future__ import annotations

import math

import torch
from torch import Tensor

import masksembles_core.adapter as mca

REDUCTIONS = ("mean", "sum", "none")


def gaussian_nll_loss(
    output: Tensor,
    target: Tensor,
    *,
    head: str = "log_variance",
    min_variance: float = 1e-6,
    reduction: str = "mean",
) -> Tensor:
    """Negative log-likelihood of ``target`` under N(mean, σ²) predicted by a two-channel head.

    ``0.5 * (log(2π σ²) + (target - mean)² / σ²)`` per element, with ``σ²`` floored at
    ``min_variance``: the value ``masksembles_core.metrics.gaussian_nll`` reports, so training and
    evaluation use one scale. Members of a Masksembles model train on it like on any loss, and
    ``predict`` returns their (n, B, ..., 2) outputs for ``metrics.gaussian_mixture``.

    Args:
        output: (B, ..., 2): channel 0 the mean, channel 1 log σ² (``head="log_variance"``) or
            σ² (``head="variance"``, e.g. after a softplus).
        target: (B, ...) or (B, ..., 1).
        head: what channel 1 holds.
        min_variance: the smallest variance used (> 0).
        reduction: "mean" (over every element), "sum" or "none" (the (B, ...) losses).
    """
    head, floor = mca.check_gaussian_head(head, min_variance)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; received {reduction!r}")
    if mca.check_gaussian_target(output.shape, target.shape):
        target = target.squeeze(-1)
    mean, channel = output.unbind(-1)
    if head == "log_variance":
        log_variance = channel.clamp(min=math.log(floor))
        inverse_variance = torch.exp(-log_variance)
    else:
        variance = channel.clamp(min=floor)
        log_variance, inverse_variance = variance.log(), variance.reciprocal()
    losses = 0.5 * (log_variance + (target - mean).square() * inverse_variance + math.log(2.0 * math.pi))
    if reduction == "mean":
        return losses.mean()
    if reduction == "sum":
        return losses.sum()
    return losses
