"""Inference helpers: run every member on every sample."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

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

    The call is compiled where Keras compiles inference: a ``tf.function`` on TensorFlow (XLA where
    the model's ``jit_compile`` says so), ``jax.jit`` of ``stateless_call`` on JAX, made once per
    model and kept (a second call of the same shapes does not trace again); eager on PyTorch, as
    Keras runs it. A smaller last chunk is padded to ``batch_size`` samples (its last sample
    repeated) and the padded rows dropped, so chunking compiles one shape. A model that cannot be
    compiled (its call converts a traced value to NumPy, say) runs eagerly, from then on, silently.

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
    inference = _Inference.of(model, layers)
    parts = []
    with _no_autograd():
        for start in range(0, max(total, 1), step):
            rows = min(step, total - start)
            # Padding the last chunk keeps every compiled call at one shape. It is sound because the tiled padded
            # chunk keeps each member's group contiguous (member k reads rows k*step to (k+1)*step - 1 of it, its
            # real rows first: the grouping rule (i*n)//(n*step) gives each real row the member it has unpadded) and
            # the pads are dropped per member; and because chunking already presumes what padding needs: that a
            # sample's output does not depend on the other samples of its call (inference BatchNorm, per-sample
            # ops). A model whose output reads the whole batch gives other results for other batch sizes anyway.
            pad = step - rows if inference.compiles and 0 < rows < step else 0
            chunk = keras.tree.map_structure(
                functools.partial(_tiled_rows, start=start, rows=rows, pad=pad, n=n), inputs
            )
            outputs = inference(model, chunk)
            parts.append(keras.tree.map_structure(functools.partial(_members, rows=rows, n=n), outputs))
    if len(parts) == 1:
        return parts[0]
    return keras.tree.map_structure(lambda *members: np.concatenate(members, axis=1), *parts)


def _tiled_rows(array: np.ndarray, start: int, rows: int, pad: int, n: int) -> np.ndarray:
    """Rows ``start`` to ``start + rows`` of ``array`` and ``pad`` copies of the last of them (a real sample, valid
    input for any model), tiled ``n`` times: (n*(rows + pad), ...)."""
    chunk = array[start : start + rows]
    return mc.tile(chunk if pad == 0 else np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)]), n)


def _members(output: Any, rows: int, n: int) -> np.ndarray:
    """A model output on a tiled chunk -> NumPy (n, rows, ...): each member's first ``rows`` rows (pads dropped)."""
    return mc.untile(ops.convert_to_numpy(output), n)[:, :rows]


class _Inference:
    """A model's inference call ``model(x, training=False)``, compiled on TensorFlow and JAX, eager where that fails.

    One per model (``of``), kept while the model lives (it holds no reference to it) and made again when the model's
    layers change."""

    _made: ClassVar[weakref.WeakKeyDictionary[keras.layers.Layer, _Inference]] = weakref.WeakKeyDictionary()

    def __init__(self, model: Any, layers: Sequence[Any]) -> None:
        self.layers = [weakref.ref(layer) for layer in layers]
        self.compiled = _compiled_call(model) if isinstance(model, keras.layers.Layer) else None

    @classmethod
    def of(cls, model: Any, layers: Sequence[Any]) -> _Inference:
        """The model's ``_Inference``: made on its first call and whenever its layers changed since."""
        if not isinstance(model, keras.layers.Layer):
            return cls(model, layers)
        made = cls._made.get(model)
        if made is None or [ref() for ref in made.layers] != list(layers):
            made = cls._made[model] = cls(model, layers)
        return made

    @property
    def compiles(self) -> bool:
        return self.compiled is not None

    def __call__(self, model: Any, x: Any) -> Any:
        """``model(x, training=False)``: compiled, or eager where it does not compile (from then on) and while the
        model is not built (its first eager call builds it)."""
        compiled = self.compiled
        if compiled is None or not getattr(model, "built", True):
            return model(x, training=False)
        return mca.compiled_or_eager(lambda: compiled(x), lambda: model(x, training=False), self._run_eagerly)

    def _run_eagerly(self) -> None:
        self.compiled = None


def _compiled_call(model: keras.layers.Layer) -> Callable[[Any], Any] | None:
    """``model(x, training=False)`` compiled as Keras compiles inference on the backend, or None (PyTorch: eager, as
    Keras' ``predict`` runs without ``jit_compile``)."""
    backend = keras.backend.backend()
    model_ref = weakref.ref(model)

    def live() -> Any:
        """The model (the cache holds it weakly; it is alive while predict runs it)."""
        alive = model_ref()
        if alive is None:
            raise ReferenceError("the model was deleted")
        return alive

    if backend == "tensorflow":
        import tensorflow as tf

        jit_compile = bool(getattr(model, "jit_compile", False))
        function = tf.function(lambda x: live()(x, training=False), reduce_retracing=True, jit_compile=jit_compile)
        return cast(Callable[[Any], Any], function)
    if backend == "jax":
        import jax

        def stateless(trainable: list[Any], non_trainable: list[Any], x: Any) -> tuple[Any, list[Any]]:
            outputs, updated = live().stateless_call(trainable, non_trainable, x, training=False)
            # None for the values the call left alone (the same tracer): no copy out, no assignment back
            return outputs, [None if new is old else new for new, old in zip(updated, non_trainable, strict=True)]

        jitted = jax.jit(stateless)

        def call(x: Any) -> Any:
            model = live()
            variables = model.non_trainable_variables
            outputs, updated = jitted([v.value for v in model.trainable_variables], [v.value for v in variables], x)
            for variable, value in zip(variables, updated, strict=True):
                if value is not None:  # what the eager call would have changed
                    variable.assign(value)
            return outputs

        return call
    return None
