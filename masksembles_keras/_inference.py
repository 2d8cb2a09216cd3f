"""Inference helpers: run every member on every sample, and convert dropout models."""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import numpy as np
from keras import ops

import masksembles_core as mc

from ._layers import Masksembles, Masksembles1D, Masksembles2D, Masksembles3D


def tile(x: Any, n: int) -> Any:
    """Repeat the batch ``n`` times: (B, ...) -> (n*B, ...); copy ``k`` goes through member ``k``."""
    return ops.tile(x, (mc.check_n(n),) + (1,) * (len(x.shape) - 1))


def untile(y: Any, n: int) -> Any:
    """(n*B, ...) -> (n, B, ...): ``y[k]`` is member ``k``'s output (the batch may be unknown)."""
    n = mc.check_n(n)
    batch = y.shape[0]
    per_member = -1 if batch is None else mc.check_tiled_batch(batch, n)
    return ops.reshape(y, (n, per_member, *ops.shape(y)[1:]))


def _no_autograd() -> contextlib.AbstractContextManager[object]:
    """On the torch backend, no autograd graph for inference calls (as ``model.predict`` does)."""
    if keras.backend.backend() == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def predict(model: keras.Model, x: Any, n: int, *, batch_size: int | None = None) -> Any:
    """Every member's output for every sample of ``x``: (B, ...) -> NumPy (n, B, ...).

    Calls ``model(tile(chunk, n), training=False)`` on ``batch_size`` samples of ``x`` at a time
    (all at once when None), so each call sees the whole tiled chunk and the grouping rule gives
    copy ``k`` mask ``k``. ``model.predict`` must not be used on a tiled input: it splits the
    batch into batches, and under a distribution strategy into per-replica batches. ``x`` and
    the outputs may be nested structures (multi-input or multi-output models).
    """
    n = mc.check_n(n)
    inputs = keras.tree.map_structure(ops.convert_to_numpy, x)
    total = int(keras.tree.flatten(inputs)[0].shape[0])
    step = total if batch_size is None else mc.check_int("batch_size", batch_size, minimum=1)
    step = max(step, 1)
    parts = []
    with _no_autograd():
        for start in range(0, max(total, 1), step):
            chunk = keras.tree.map_structure(lambda a, s=start: mc.tile(a[s : s + step], n), inputs)
            outputs = model(chunk, training=False)
            parts.append(keras.tree.map_structure(lambda y: mc.untile(ops.convert_to_numpy(y), n), outputs))
    return keras.tree.map_structure(lambda *members: np.concatenate(members, axis=1), *parts)


def _replacement(layer: keras.layers.Layer, n: int, scale: float, seed: int) -> Masksembles | None:
    """The Masksembles layer that replaces a dropout ``layer``, or None for any other layer."""
    channels_first = getattr(layer, "data_format", "channels_last") == "channels_first"
    axis = 1 if channels_first else -1
    if isinstance(layer, keras.layers.SpatialDropout3D):
        return Masksembles3D(n, scale, seed=seed, channel_axis=axis)
    if isinstance(layer, keras.layers.SpatialDropout2D):
        return Masksembles2D(n, scale, seed=seed, channel_axis=axis)
    if isinstance(layer, keras.layers.SpatialDropout1D):
        return Masksembles1D(n, scale, seed=seed)
    if isinstance(layer, keras.layers.Dropout):
        return Masksembles(n, scale, seed=seed)
    return None


def convert_dropout(model: keras.Model, n: int, scale: float, *, seed: int | None = None) -> keras.Model:
    """A copy of ``model`` with every ``Dropout``/``SpatialDropout1D/2D/3D`` replaced by Masksembles.

    The MC-Dropout drop-in of the paper, for Sequential and functional models (nested ones
    included; subclassed models cannot be rebuilt). ``Dropout`` becomes ``Masksembles`` on the
    last axis, ``SpatialDropout1D`` ``Masksembles1D``, ``SpatialDropout2D/3D``
    ``Masksembles2D/3D`` on the channels of their ``data_format``; each reads its channel count
    from the input it is built on. Every other layer keeps its trained weights (copied, so the
    original model is left alone). The ``i``-th dropout layer met gets masks from
    ``masksembles_core.derive_seed(seed, i)``. The copy is not compiled.

    Raises:
        ValueError: the model is not built, or holds no dropout layer.
    """
    n = mc.check_n(n)
    scale = mc.check_scale(scale)
    if seed is not None:
        mc.check_int("seed", seed, minimum=0)
    if not model.built:
        raise ValueError("convert_dropout needs a built model (give it an Input, or call it once on data)")
    copies: list[tuple[keras.layers.Layer, keras.layers.Layer]] = []
    converted = 0

    def clone(layer: keras.layers.Layer) -> keras.layers.Layer:
        nonlocal converted
        replacement = _replacement(layer, n, scale, mc.derive_seed(seed, converted))
        if replacement is not None:
            converted += 1
            return replacement
        copy = type(layer).from_config(layer.get_config())
        copies.append((layer, copy))
        return copy

    result = keras.models.clone_model(model, clone_function=clone, recursive=True)
    if not converted:
        raise ValueError("convert_dropout found no Dropout/SpatialDropout1D/2D/3D layer in the model")
    for original, copy in copies:
        copy.set_weights(original.get_weights())
    return result
