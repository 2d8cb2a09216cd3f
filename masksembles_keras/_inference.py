"""Inference helpers: run every member on every sample."""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import numpy as np
from keras import ops

import masksembles_core as mc
import masksembles_core.adapter as mca

from ._layers import Masksembles


def tile(x: Any, n: int) -> Any:
    """Repeat the batch ``n`` times: (B, ...) -> (n*B, ...); copy ``k`` goes through member ``k``."""
    return ops.tile(x, (mca.check_n(n),) + (1,) * (len(x.shape) - 1))


def untile(y: Any, n: int) -> Any:
    """(n*B, ...) -> (n, B, ...): ``y[k]`` is member ``k``'s output (the batch may be unknown)."""
    n = mca.check_n(n)
    batch = y.shape[0]
    per_member = -1 if batch is None else mca.check_tiled_batch(batch, n)
    return ops.reshape(y, (n, per_member, *ops.shape(y)[1:]))


def _no_autograd() -> contextlib.AbstractContextManager[object]:
    """On the torch backend, no autograd graph for inference calls (as ``model.predict`` does)."""
    if keras.backend.backend() == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def predict(model: keras.Model, x: Any, n: int | None = None, *, batch_size: int | None = None) -> Any:
    """Every member's output for every sample of ``x``: (B, ...) -> NumPy (n, B, ...).

    Calls ``model(tile(chunk, n), training=False)`` on ``batch_size`` samples of ``x`` at a time
    (all at once when None), so each call sees the whole tiled chunk and the grouping rule gives
    copy ``k`` mask ``k``; ``training=False`` is inference (BatchNorm moving statistics, dropout
    off), so the model's state is never changed. ``model.predict`` must not be used on a tiled
    input: it splits the batch into batches, and under a distribution strategy into per-replica
    batches. ``x`` and the outputs may be nested structures (multi-input or multi-output models).

    Args:
        n: the number of members; None reads it from the model's Masksembles layers (nested
            models' too).

    Raises:
        ValueError: ``n`` differs from the n of the model's Masksembles layers, the layers have
            different n, or ``n`` is None and the model has no Masksembles layer.
    """
    layers = model._flatten_layers(include_self=True, recursive=True) if isinstance(model, keras.layers.Layer) else []
    n = mca.check_members([layer.n for layer in layers if isinstance(layer, Masksembles)], n)
    inputs = keras.tree.map_structure(ops.convert_to_numpy, x)
    total = int(keras.tree.flatten(inputs)[0].shape[0])
    step = total if batch_size is None else mca.check_int("batch_size", batch_size, minimum=1)
    step = max(step, 1)
    parts = []
    with _no_autograd():
        for start in range(0, max(total, 1), step):
            chunk = keras.tree.map_structure(lambda a, s=start: mc.tile(a[s : s + step], n), inputs)
            outputs = model(chunk, training=False)
            parts.append(keras.tree.map_structure(lambda y: mc.untile(ops.convert_to_numpy(y), n), outputs))
    return keras.tree.map_structure(lambda *members: np.concatenate(members, axis=1), *parts)
