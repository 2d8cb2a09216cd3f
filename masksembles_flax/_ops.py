"""The jax.numpy code shared by the linen and NNX layers: the masked forward and the tile/untile/predict helpers."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp

import masksembles_core.adapter as mca

T = TypeVar("T")

MASKS_COLLECTION = "masksembles"  # linen: the variable collection of the masks


def input_channels(shape: Sequence[int], channel_axis: int) -> int:
    """Channel count of an input of ``shape``, after the core's rank and channel-axis checks."""
    rank = len(shape)
    # An out-of-range axis has no channel count to read; the core check then raises its axis error before comparing it.
    channels = int(shape[channel_axis]) if -rank <= channel_axis < rank else 1
    mca.check_input_shape(shape, channels=channels, channel_axis=channel_axis)
    return channels


def apply_masks(x: jax.Array, masks: jax.Array, *, channel_axis: int, mask_index: jax.Array | None = None) -> jax.Array:
    """Multiply each sample of ``x`` by its mask, in the dtype of ``x``.

    Args:
        x: input of shape (B, ...) with C channels on ``channel_axis``.
        masks: (n, C) bool masks.
        channel_axis: axis of ``x`` holding the channels (not 0).
        mask_index: (B,) int mask of each sample, or None for the grouping rule ``(i*n)//B`` of ``group_index``.

    Returns:
        array of the shape and dtype of ``x``.
    """
    n, channels = masks.shape
    axis = mca.check_input_shape(x.shape, channels=channels, channel_axis=channel_axis)
    batch = x.shape[0]
    # XLA's simplifier can turn x * convert(bool) into select(bool, x, 0) (it does for an (n, C) input, for one),
    # which maps masked inf/NaN to 0 instead of NaN and -x to +0; behind the barrier the factors are plain floats, so
    # the product stays an IEEE multiply, as in the NumPy reference. Its cost is nil (benchmarks/bench_flax_barrier.py,
    # jitted on CPU, jax 0.10.2): XLA drops the barrier after simplifying, and the compiled program is the same as
    # without it for an MLP activation, an NHWC feature map, the gather path, a CNN forward and its training step
    # (time ratios 0.95-1.01x, noise); where the select would apply, the multiply runs as fast (1.02x of 32 us).
    factors: jax.Array = jax.lax.optimization_barrier(masks.astype(x.dtype))  # type: ignore[no-untyped-call]
    if mask_index is None and batch % n == 0:
        # n contiguous groups of B//n samples: one broadcast multiply over a (n, B//n, ...) view of the batch.
        groups = x.reshape((n, batch // n, *x.shape[1:]))
        return (groups * factors.reshape(mca.mask_shape(x.ndim + 1, axis + 1, channels, n))).reshape(x.shape)
    if mask_index is None:
        mask_index = (jnp.arange(batch) * n) // batch
    return x * factors[mask_index].reshape(mca.mask_shape(x.ndim, axis, channels, batch))


GROUPED_MASKING = "masksembles_grouped_channel_axis_"


@functools.cache
def grouped_masking(channel_axis: int) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``apply_masks`` by the grouping rule on the non-negative ``channel_axis``, as a jitted function.

    Its name, ``GROUPED_MASKING`` followed by the axis, marks the NNX layer in a traced program: ``pack`` finds every
    Masksembles layer of a model as one ``jit`` equation of that name, with the input and the (n, C) masks as its
    operands. Under an outer ``jit`` XLA inlines it; called eagerly it runs as one compiled function.
    """

    def masking(x: jax.Array, masks: jax.Array) -> jax.Array:
        return apply_masks(x, masks, channel_axis=channel_axis)

    masking.__name__ = masking.__qualname__ = f"{GROUPED_MASKING}{channel_axis}"
    return jax.jit(masking)


def random_mask_index(key: jax.Array, batch_size: int, n: int) -> jax.Array:
    """The paper's training rule: an independent, uniformly drawn mask index in [0, n) for each of the B samples."""
    return jax.random.randint(key, (batch_size,), 0, n)


def tile(x: jax.Array, n: int) -> jax.Array:
    """Repeat ``x`` of shape (B, ...) ``n`` times along the batch: shape (n*B, ...), copy ``k`` in block ``k``."""
    n = mca.check_n(n)
    return jnp.broadcast_to(x[None], (n, *x.shape)).reshape((n * x.shape[0], *x.shape[1:]))


def untile(y: jax.Array, n: int) -> jax.Array:
    """Reshape ``y`` of shape (n*B, ...) to (n, B, ...); ``y[k]`` is member ``k``'s output."""
    batch = mca.check_tiled_batch(y.shape[0], n)
    return y.reshape((n, batch, *y.shape[1:]))


def predict(model: Callable[[jax.Array], T], x: jax.Array, n: int) -> T:
    """Every member's output on every sample: ``model(tile(x, n))`` with each output leaf untiled to (n, B, ...).

    ``model`` maps a batch to outputs (an array or a pytree of arrays with the batch on axis 0) and must run its
    Masksembles layers by the grouping rule (mode "grouped", or deterministic).
    """
    result: T = jax.tree.map(lambda y: untile(y, n), model(tile(x, n)))
    return result
