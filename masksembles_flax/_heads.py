"""The uncertainty head in jax.numpy, shared by the NNX and linen ``with_uncertainty``: members -> the core's dict.

``uncertainty_outputs`` computes in the graph what ``masksembles_core.heads.uncertainty_head`` (the NumPy oracle)
computes in float64, with the same names (``HeadSpec.outputs``) and the same rules: log-softmax logits (a single
column is a sigmoid logit, i.e. two classes), renormalized probabilities, ``0 log 0 = 0``, mutual information clamped
at 0, Gaussian variance channels floored at ``min_variance`` as the loss floors them. It runs in float32 at least.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from masksembles_core import metrics
from masksembles_core.heads import HeadSpec


def check_members_first(members: jax.Array, n: int, batch: int) -> jax.Array:
    """``members`` of a model run on the batch tiled ``n`` times, as (n, B, ...): refused where the model returned a
    sequence-first output ((L, n*B, ...), kept so by ``predict``), whose members the head cannot read on axis 0."""
    if members.shape[:2] != (n, batch):
        raise ValueError(
            f"with_uncertainty needs the model's output with the tiled batch of {n}x{batch} samples on axis 0; its "
            f"members came out as shape {tuple(members.shape)} (a sequence-first output, (L, B, ...), must be "
            "transposed to batch-first in the model)"
        )
    return members


def uncertainty_outputs(members: jax.Array, spec: HeadSpec, member_axis: int = 0) -> dict[str, jax.Array]:
    """Members ``(n, B, ...)`` (``member_axis`` picks n) -> the head's dict, keys in ``spec.outputs`` order (an
    ``OrderedDict``: ``jit`` and ``jax.export`` keep its order, where they sort a plain dict's keys).

    Classification: members (n, B, K) logits or probabilities -> ``probabilities`` (B, K) (K = 2 for one logit)
    and ``predictive_entropy``, ``expected_entropy``, ``mutual_information``, ``max_probability`` (B,). Regression:
    (n, B, ...) -> ``mean``, ``variance`` (B, ...), or Gaussian members (n, B, ..., 2) -> ``mean``, ``variance``,
    ``aleatoric``, ``epistemic`` (B, ...).

    Concrete members (not traced) are checked as the core checks them, with its messages: logits that look like
    probabilities and the reverse, non-finite values, a Gaussian head without two channels. Traced members (``jit``,
    ``jax.export``) are not checked: their values are unknown while tracing.

    Raises:
        ValueError: ``member_axis`` out of range, classification members that are not (n, B, K), regression members
            with fewer than two axes, or (concrete members) values the core refuses.
    """
    if not -members.ndim <= member_axis < members.ndim:
        raise ValueError(f"member_axis {member_axis} is out of range for members of shape {members.shape}")
    members = jnp.moveaxis(members, member_axis, 0)
    if spec.task == "classification" and members.ndim != 3:
        raise ValueError(
            f"a classification head needs members (n, B, K) (members, samples, classes); received {members.shape}"
        )
    if members.ndim < 2:
        raise ValueError(f"a regression head needs members (n, B, ...); received shape {members.shape}")
    if spec.head is not None and members.shape[-1] != 2:
        raise ValueError(
            f"Gaussian members (head={spec.head!r}) need a last axis of 2 (mean, variance channel); received shape "
            f"{members.shape}"
        )
    if not isinstance(members, jax.core.Tracer):
        _check_like_the_core(np.asarray(members), spec)
    members = members.astype(jnp.promote_types(members.dtype, jnp.float32))
    if spec.task == "classification":
        return _classification(members, spec.logits)
    if spec.head is None:
        return OrderedDict(mean=members.mean(axis=0), variance=members.var(axis=0))
    means, channel = members[..., 0], members[..., 1]
    if spec.head == "log_variance":
        variances = jnp.exp(jnp.maximum(channel, math.log(spec.min_variance)))
    else:
        variances = jnp.maximum(channel, spec.min_variance)
    aleatoric, epistemic = variances.mean(axis=0), means.var(axis=0)
    return OrderedDict(
        mean=means.mean(axis=0), variance=aleatoric + epistemic, aleatoric=aleatoric, epistemic=epistemic
    )


def _classification(members: jax.Array, logits: bool) -> dict[str, jax.Array]:
    """(n, B, K) float members -> the classification dict (see ``uncertainty_outputs``)."""
    if logits:
        if members.shape[-1] == 1:  # a sigmoid logit z: the two classes' logits (0, z), as the core expands it
            members = jnp.concatenate([jnp.zeros_like(members), members], axis=-1)
        log_probs = jax.nn.log_softmax(members, axis=-1)
        probs = jnp.exp(log_probs)
    else:
        probs = members / members.sum(axis=-1, keepdims=True)
        log_probs = jnp.log(jnp.where(probs > 0, probs, 1.0))
    mean = probs.mean(axis=0)
    predictive = _entropy(mean, jnp.log(jnp.where(mean > 0, mean, 1.0)))
    expected = _entropy(probs, log_probs).mean(axis=0)
    return OrderedDict(
        probabilities=mean,
        predictive_entropy=predictive,
        expected_entropy=expected,
        mutual_information=jnp.maximum(predictive - expected, 0.0),  # Jensen: >= 0 up to rounding
        max_probability=mean.max(axis=-1),
    )


def _entropy(probs: jax.Array, log_probs: jax.Array) -> jax.Array:
    """Entropy in nats over the last axis, with 0 log 0 = 0 (a masked class's -inf log included)."""
    result: jax.Array = -jnp.sum(jnp.where(probs > 0, probs * log_probs, 0.0), axis=-1)
    return result


def _check_like_the_core(members: np.ndarray, spec: HeadSpec) -> None:
    """The core's checks of concrete members (n, B, ...), with its messages (``uncertainty_head`` runs the same)."""
    if spec.task == "classification":
        metrics.member_probabilities(members, logits=spec.logits)
    else:
        metrics.member_mean(members)
