"""The jax.numpy code shared by the linen and NNX layers: the masked forward and the tile/untile/predict helpers."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar, cast

import jax
import jax.export
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


def apply_masks(
    x: jax.Array,
    masks: jax.Array,
    *,
    channel_axis: int,
    mask_index: jax.Array | None = None,
    samples: int | None = None,
) -> jax.Array:
    """Multiply each sample of ``x`` by its mask, in the dtype of ``x``.

    Args:
        x: input of shape (B, ...) with C channels on ``channel_axis``.
        masks: (n, C) bool masks.
        channel_axis: axis of ``x`` holding the channels (not 0).
        mask_index: (B,) int mask of each sample, or None for the grouping rule ``(i*n)//B`` of ``group_index``.
        samples: the model's batch size where the B rows of ``x`` are its samples folded with other axes
            (``samples * f`` rows, sample-major): row ``r`` gets the mask of sample ``r // f``
            (``group_index(B, n, samples=samples)``). None: the rows are the samples.

    Returns:
        array of the shape and dtype of ``x``.
    """
    n, channels = masks.shape
    axis = mca.check_input_shape(x.shape, channels=channels, channel_axis=channel_axis)
    batch = x.shape[0]
    per_sample = mca.rows_per_sample(batch, samples)
    # XLA's simplifier can turn x * convert(bool) into select(bool, x, 0) (it does for an (n, C) input, for one),
    # which maps masked inf/NaN to 0 instead of NaN and -x to +0; behind the barrier the factors are plain floats, so
    # the product stays an IEEE multiply, as in the NumPy reference. Its cost is nil (benchmarks/bench_flax_barrier.py,
    # jitted on CPU, jax 0.10.2): XLA drops the barrier after simplifying, and the compiled program is the same as
    # without it for an MLP activation, an NHWC feature map, the gather path, a CNN forward and its training step
    # (time ratios 0.95-1.01x, noise); where the select would apply, the multiply runs as fast (1.02x of 32 us).
    factors: jax.Array = jax.lax.optimization_barrier(masks.astype(x.dtype))  # type: ignore[no-untyped-call]
    if mask_index is None and (batch // per_sample) % n == 0:
        # n contiguous groups of B//n rows (each sample's rows in one): one broadcast multiply over a (n, B//n, ...)
        # view of the batch.
        groups = x.reshape((n, batch // n, *x.shape[1:]))
        return (groups * factors.reshape(mca.mask_shape(x.ndim + 1, axis + 1, channels, n))).reshape(x.shape)
    if mask_index is None:
        sample = jnp.arange(batch) if per_sample == 1 else jnp.arange(batch) // per_sample
        mask_index = (sample * n) // (batch // per_sample)
    return x * factors[mask_index].reshape(mca.mask_shape(x.ndim, axis, channels, batch))


GROUPED_MASKING = "masksembles_grouped_channel_axis_"

_MODEL_BATCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("masksembles_model_batch", default=None)
_GROUPED_AXES: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar("masksembles_axes", default=None)


@contextlib.contextmanager
def batch_size(samples: int) -> Iterator[None]:
    """Within the block, every Masksembles layer (linen and NNX) groups its rows by ``samples``, the model's batch
    size: a layer called on ``samples * f`` rows (windows or tokens folded into the batch, sample-major) gives row
    ``r`` the member of sample ``r // f``; other row counts keep the plain rule. Enter it where the model is called,
    inside the traced function under ``jit`` (it is read while tracing). An enclosing block's size wins. A symbolic
    size (``jax.export``) is kept as it is: the grouping's arithmetic on it is symbolic too."""
    checked = samples if jax.export.is_symbolic_dim(samples) else mca.check_int("samples", samples, minimum=1)
    token = _MODEL_BATCH.set(cast(int, checked)) if _MODEL_BATCH.get() is None else None  # symbolic: int arithmetic
    try:
        yield
    finally:
        if token is not None:
            _MODEL_BATCH.reset(token)


@contextlib.contextmanager
def batch_size_of_call(args: object) -> Iterator[None]:
    """``batch_size(B)`` for a model called on ``args`` (its arguments, e.g. ``(args, kwargs)``), B the size of axis 0
    of its first array (nothing where it has none)."""
    arrays = [leaf for leaf in jax.tree.leaves(args) if getattr(leaf, "ndim", 0) > 0]
    if not arrays:
        yield
        return
    samples = arrays[0].shape[0]  # an int, or a symbolic dimension (jax.export) that batch_size keeps
    with batch_size(cast(int, samples) if jax.export.is_symbolic_dim(samples) else int(samples)):
        yield


def folded_samples(rows: int) -> int | None:
    """The model's batch size from ``batch_size`` where it folds ``rows`` (more than one row per sample), else None
    (the plain rule)."""
    samples = _MODEL_BATCH.get()
    return samples if mca.rows_per_sample(rows, samples) != 1 else None


def masked(
    x: jax.Array,
    masks: jax.Array,
    *,
    channel_axis: int,
    batch_axis: int | None,
    layer: str,
    key: jax.Array | None = None,
) -> jax.Array:
    """The forward of every Masksembles layer (NNX, linen, and linen ``insert``'s): ``x`` times its samples' masks.

    Args:
        x: (B, ..., C, ...), or a sequence-first (L, B, ..., C) whose samples are on axis 1.
        masks: (n, C) bool masks.
        channel_axis: axis of ``x`` holding the channels (not 0).
        batch_axis: the layer's declared samples' axis (0, 1, or None: decided from the shape and the model's batch
            size, ``masksembles_core.adapter.sample_axis``).
        layer: the layer's name in the messages.
        key: ``mode="random"``: the key of each sample's uniform draw; None: the grouping rule, as the jit named by
            ``grouped_masking`` that ``predict`` and ``pack`` find.

    Returns:
        array of the shape and dtype of ``x``; along axis 1 the grouping rule runs on the (B, L, ...) view (its
        transposes are outside the named jit: ``pack`` sees a batch-first masking between two moves).

    Raises:
        ValueError: a bad shape, or a declared axis that does not hold the model's batch (``sample_axis``).
    """
    n, channels = masks.shape
    channel = mca.check_input_shape(x.shape, channels=channels, channel_axis=channel_axis)
    axis = mca.sample_axis(x.shape, channel, _MODEL_BATCH.get(), batch_axis, layer=layer)
    grouped = _GROUPED_AXES.get()
    if grouped is not None:
        grouped.add(axis)

    def rows_first(rows: jax.Array) -> jax.Array:
        if key is not None:
            index = grouped_mask_index(key, rows.shape[0], n)
            return apply_masks(rows, masks, channel_axis=channel, mask_index=index)
        return grouped_masking(channel, folded_samples(rows.shape[0]))(rows, masks)

    return rows_first(x) if axis == 0 else jnp.swapaxes(rows_first(jnp.swapaxes(x, 0, axis)), 0, axis)


@contextlib.contextmanager
def grouped_axes() -> Iterator[set[int]]:
    """Within the block, the axes along which the Masksembles layers called (or traced) there grouped their input:
    {0} for batch-first ones, with 1 where one ran on a sequence-first (L, B, ...) input."""
    axes: set[int] = set()
    token = _GROUPED_AXES.set(axes)
    try:
        yield axes
    finally:
        _GROUPED_AXES.reset(token)


def grouped_mask_index(key: jax.Array, rows: int, n: int) -> jax.Array:
    """``mode="random"``: a uniformly drawn mask index in [0, n) for each sample, shared by the sample's rows."""
    samples = folded_samples(rows)
    if samples is None:
        return random_mask_index(key, rows, n)
    return jnp.repeat(random_mask_index(key, samples, n), rows // samples, total_repeat_length=rows)


@functools.cache
def grouped_masking(channel_axis: int, samples: int | None = None) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``apply_masks`` by the grouping rule on the non-negative ``channel_axis``, as a jitted function.

    Its name, ``GROUPED_MASKING`` followed by the axis, marks a Masksembles layer in a traced program: ``pack`` and
    ``predict`` find every Masksembles layer of a model as one ``jit`` equation of that name, with the input and the
    (n, C) masks as its operands. Under an outer ``jit`` XLA inlines it; called eagerly it runs as one compiled
    function. ``samples``: the model's batch size, for rows that fold it with other axes (``apply_masks``).
    """

    def masking(x: jax.Array, masks: jax.Array) -> jax.Array:
        return apply_masks(x, masks, channel_axis=channel_axis, samples=samples)

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
    """Every member's output: ``model(tile(x, n))`` with each output leaf untiled to (n, B, ...), or, for a
    sequence-first leaf (L, n*B, ...), left with member ``k``'s block at ``[:, k*B:(k+1)*B]`` (``members``); ``n``
    checked by ``masksembles_flax.predict``."""
    with grouped_axes() as axes, batch_size(n * x.shape[0]):  # the layers check their samples' axis against it
        outputs = model(tile(x, n))
    result: T = jax.tree.map(lambda y: members(y, n, x.shape[0], sequence_first=1 in axes), outputs)
    return result


def members(y: jax.Array, n: int, batch: int, *, sequence_first: bool = False) -> jax.Array:
    """One output leaf of a model run on the tiled batch of ``n`` copies of ``batch`` samples, in ``predict``'s
    layout: (n*B, ...) untiled to (n, B, ...); a leaf whose axis 1, not axis 0, holds the n*B samples (sequence-first,
    (L, n*B, ...)) as it is, member ``k``'s block at ``[:, k*B:(k+1)*B]``.

    Args:
        sequence_first: a Masksembles layer of the model ran on a sequence-first input: a leaf whose axes 0 and 1 both
            hold n*B is refused (which one is the batch cannot be told).

    Raises:
        ValueError: that ambiguous leaf, or a leaf without the batch on axis 0 or 1 (``untile``).
    """
    rows = n * batch
    on_first = y.ndim > 0 and y.shape[0] == rows
    on_second = y.ndim > 1 and y.shape[1] == rows
    if on_first and on_second and sequence_first:
        raise ValueError(
            f"predict: an output of shape {tuple(y.shape)} holds the tiled batch of {n}x{batch} on axes 0 and 1, and "
            "the model runs sequence-first layers: whether it is batch-first or sequence-first cannot be told. Call "
            "predict on a batch whose n*B is not its sequence length"
        )
    return y if on_second and not on_first else untile(y, n)
