"""Masksembles layers for Keras 3: masks in a non-trainable weight, forward in ``keras.ops`` only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, cast

import keras
import numpy as np
from keras import ops
from numpy.typing import ArrayLike

import masksembles_core as mc
import masksembles_core.adapter as mca

SERIALIZATION_PACKAGE = "masksembles"


def _constant_initializer(values: np.ndarray) -> Any:
    """An initializer that returns ``values`` (a bool array) cast to the requested dtype."""

    def initialize(shape: Sequence[int], dtype: Any = None) -> Any:
        return ops.cast(ops.convert_to_tensor(values), dtype)

    return initialize


def _grouped_index(rows: Any, n: int, samples: Any = None) -> Any:
    """The grouping rule in ``keras.ops`` (``masksembles_core.group_index``), for a known or unknown ``rows``.

    With ``samples`` (an int or a scalar tensor), row ``r`` of ``samples * f`` rows gets the mask of sample
    ``r // f``; where ``samples`` does not divide ``rows``, each row is its own sample.
    """
    if samples is None:
        return ops.floor_divide(ops.arange(rows, dtype="int32") * n, rows)
    rows_t, samples_t = ops.cast(rows, "int32"), ops.cast(samples, "int32")
    folded = ops.logical_and(rows_t > 0, ops.equal(ops.mod(rows_t, samples_t), 0))
    per_sample = ops.where(folded, ops.floor_divide(rows_t, samples_t), 1)
    sample = ops.floor_divide(ops.arange(rows, dtype="int32"), per_sample)
    return ops.floor_divide(sample * n, ops.floor_divide(rows_t, per_sample))


def _apply_masks(x: Any, masks: Any, *, channel_axis: int, index: Any = None, samples: Any = None) -> Any:
    """Multiply sample ``i`` of ``x`` by mask ``(i * n) // B`` (or by mask ``index[i]``).

    One broadcast multiply by the per-sample masks, (B, C) viewed as (B, 1, ..., C, ...), for
    every batch size (known, unknown or not a multiple of n). ``x`` is never reshaped: a reshape
    of the batch into (n, B/n, ...) copies ``x`` twice outside a compiled function on JAX, and
    reshards a batch-sharded ``x`` under data parallelism; the (B, C) gather is tiny.

    Args:
        x: (B, ...) tensor with C channels on the non-negative axis ``channel_axis``.
        masks: (n, C) masks, cast to ``x.dtype`` (0 and 1 are exact in every float dtype).
        channel_axis: non-negative axis of the channels (not 0).
        index: optional (B,) integer tensor, the mask of each sample (random mode).
        samples: the model's batch size where the B rows of ``x`` are its samples folded with other
            axes (``_grouped_index``); None when the rows are the samples.

    Returns:
        tensor of the shape and dtype of ``x``.
    """
    n, channels = masks.shape
    if index is None:
        # The grouping rule in the framework, (i * n) // B, so an unknown batch works too.
        index = _grouped_index(ops.shape(x)[0], n, samples)
    per_sample = ops.take(ops.cast(masks, x.dtype), index, axis=0)
    return x * ops.reshape(per_sample, mca.mask_shape(len(x.shape), channel_axis, channels, -1))


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class Masksembles(keras.layers.Layer):  # type: ignore[misc]  # keras is untyped: Layer is Any to mypy
    """Masksembles over the channels of any layout (Durasov et al., CVPR 2021).

    Holds ``n`` fixed binary masks over the C channels of its input, created in ``build()``
    from the input shape. Sample ``i`` of a batch of ``B`` is multiplied by mask
    ``(i * n) // B``: the batch is ``n`` contiguous groups and group ``k`` goes through member
    ``k``. Any batch size works, including an unknown (``None``) batch and a partial last
    batch. At inference, ``masksembles_keras.predict`` (or ``tile`` and ``untile``) runs every
    member on every sample.

    Args:
        n: number of masks (may be None when ``masks`` is given).
        scale: overlap control, >= 1: 1 is a single model, large values disjoint masks.
        seed: int for reproducible masks (and random-mode draws), a ``numpy.random.Generator`` (an int is drawn
            from it once, for the config), or None (fresh entropy).
        masks: optional (n, C) binary masks to use instead of generated ones.
        channel_axis: axis of the channels in the input (-1 for channels-last, 1 for
            channels-first).
        mode: ``"grouped"`` (the batch-grouping rule, always) or ``"random"`` (in training each
            sample draws a mask uniformly at random from a ``keras.random.SeedGenerator``;
            grouped in inference).
        **kwargs: base layer arguments (``name``, ``dtype``, ``trainable``, ...).

    Shape:
        input (B, ...) with C channels on ``channel_axis``; output the same shape. The layer
        computes in its dtype policy's compute dtype, like every Keras layer (inputs are cast
        to it; the masks are cast to the input dtype), so ``mixed_float16`` outputs float16.

    The masks are a non-trainable weight named ``masks`` of shape (n, C): ``.keras`` files and
    ``save_weights`` keep them bit for bit, and loading overwrites whatever ``build()`` made
    with the saved masks, so a loaded model never depends on regenerating them.

    Distributed training: under ``keras.distribution.DataParallel`` (JAX) the layer sees the
    global batch, so grouping is exactly the single-device one. Under
    ``tf.distribute.MirroredStrategy`` each replica calls the layer on its own per-replica
    batch and groups that batch (every replica trains all ``n`` members when its batch has at
    least ``n`` samples). ``masksembles_keras.predict`` calls the model outside the replicas.
    """

    ranks: ClassVar[Sequence[int] | None] = None

    def __init__(
        self,
        n: int | None = None,
        scale: float | None = None,
        *,
        seed: int | np.random.Generator | None = None,
        masks: ArrayLike | None = None,
        channel_axis: int = -1,
        mode: str = "grouped",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        arguments = mca.layer_arguments(None, n, scale, seed=seed, masks=masks, channel_axis=channel_axis, mode=mode)
        generator = arguments.seed
        # the config holds an int: one drawn from a generator
        self.seed = int(generator.integers(2**31 - 1)) if isinstance(generator, np.random.Generator) else generator
        self.n, self.scale, self.given_masks = arguments.n, arguments.scale, arguments.masks
        self.channel_axis, self.mode = arguments.channel_axis, arguments.mode
        self.channels: int | None = None
        self.supports_masking = True
        if self.mode == "random":
            self.seed_generator = keras.random.SeedGenerator(self.seed)

    def _check_shape(self, shape: Sequence[int | None], channels: int | None) -> int:
        """Check ``shape`` (the core's errors); return its non-negative channel axis.

        With ``channels`` None only the rank and the axis are checked.
        """
        if channels is None:
            rank = len(shape)
            received = shape[self.channel_axis] if -rank <= self.channel_axis < rank else None
            channels = 1 if received is None else int(received)
        return mca.check_input_shape(
            tuple(shape), channels=channels, channel_axis=self.channel_axis, ranks=self.ranks, layer=type(self).__name__
        )

    def build(self, input_shape: Sequence[int | None]) -> None:
        if self.given_masks is None:
            axis = self._check_shape(input_shape, None)
            channels = mca.check_channels(input_shape[axis])
            values = mc.generate_masks(channels, self.n, cast(float, self.scale), seed=self.seed)
        else:
            self._check_shape(input_shape, int(self.given_masks.shape[1]))
            values = self.given_masks
        self.channels = int(values.shape[1])
        self.masks = self.add_weight(
            name="masks",
            shape=values.shape,
            initializer=_constant_initializer(values),
            trainable=False,
            autocast=False,
        )

    def call(self, inputs: Any, training: bool | None = None, samples: Any = None) -> Any:
        """(B, ...) -> (B, ...); ``training`` only matters in random mode.

        ``samples``: the model's batch size (an int or a scalar tensor, e.g. ``ops.shape(images)[0]``) where the
        B rows of ``inputs`` fold the model's samples with other axes (windows, tokens: ``samples * f`` rows in the
        sample-major order of ``reshape``): row ``r`` then goes through the member of sample ``r // f``, so a
        sample meets one member in every layer. None: the rows are the samples.
        """
        axis = self._check_shape(tuple(inputs.shape), self.channels)
        index = None
        if self.mode == "random" and training:
            draws = ops.shape(inputs)[0] if samples is None else samples
            index = keras.random.randint((draws,), 0, self.n, seed=self.seed_generator)
            if samples is not None:  # one draw per sample, shared by its rows
                index = ops.take(index, _grouped_index(ops.shape(inputs)[0], draws, samples))
        return _apply_masks(inputs, self.masks, channel_axis=axis, index=index, samples=samples)

    def compute_output_shape(self, input_shape: Sequence[int | None]) -> tuple[int | None, ...]:
        self._check_shape(input_shape, self.channels)
        return tuple(input_shape)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "n": self.n,
            "scale": self.scale,
            "seed": self.seed,
            "channel_axis": self.channel_axis,
            "mode": self.mode,
        }
        if self.given_masks is not None:
            config["masks"] = self.given_masks.astype(np.int8).tolist()
        return {**super().get_config(), **config}


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class Masksembles1D(Masksembles):
    """Masksembles for (B, C) or (B, steps, C) inputs (after ``Dense``, ``Conv1D``; like ``SpatialDropout1D``)."""

    ranks = (2, 3)


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class Masksembles2D(Masksembles):
    """Masksembles for (B, H, W, C) inputs, or (B, C, H, W) with ``channel_axis=1`` (like ``SpatialDropout2D``)."""

    ranks = (4,)


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class Masksembles3D(Masksembles):
    """Masksembles for (B, D, H, W, C) inputs, or (B, C, D, H, W) with ``channel_axis=1`` (as ``SpatialDropout3D``)."""

    ranks = (5,)
