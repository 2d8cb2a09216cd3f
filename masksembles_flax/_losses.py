"""Gaussian negative log-likelihood for members with a (mean, variance) head, in ``jax.numpy``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import masksembles_core.adapter as mca


def gaussian_nll_loss(
    output: jax.Array, target: jax.Array, *, head: str = "log_variance", min_variance: float = 1e-6
) -> jax.Array:
    """Per-element negative log-likelihood of ``target`` under N(mean, σ²) predicted by a two-channel head.

    ``0.5 * (log(2π σ²) + (target - mean)² / σ²)``, with ``σ²`` floored at ``min_variance``: its
    mean is the value ``masksembles_core.metrics.gaussian_nll`` reports. Like optax's losses it
    is not reduced: take ``.mean()`` in the training step. Works under ``jit``, ``grad`` and
    ``vmap``; ``masksembles_flax.predict`` returns the members' (n, B, ..., 2) outputs for
    ``metrics.gaussian_mixture``.

    Args:
        output: (B, ..., 2): channel 0 the mean, channel 1 log σ² (``head="log_variance"``) or
            σ² (``head="variance"``, e.g. after a softplus).
        target: (B, ...) or (B, ..., 1).
        head: what channel 1 holds.
        min_variance: the smallest variance used (> 0).

    Returns:
        (B, ...) losses.
    """
    head, floor = mca.check_gaussian_head(head, min_variance)
    if mca.check_gaussian_target(output.shape, target.shape):
        target = target[..., 0]
    mean, channel = output[..., 0], output[..., 1]
    if head == "log_variance":
        log_variance = jnp.maximum(channel, math.log(floor))
        inverse_variance = jnp.exp(-log_variance)
    else:
        variance = jnp.maximum(channel, floor)
        log_variance, inverse_variance = jnp.log(variance), 1.0 / variance
    losses: jax.Array = 0.5 * (log_variance + jnp.square(target - mean) * inverse_variance + math.log(2.0 * math.pi))
    return losses
