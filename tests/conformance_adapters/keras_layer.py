"""masksembles_keras.Masksembles as a conformance adapter, on the backend Keras was started with.

The layer is built with the case's dtype as its dtype policy (Keras casts inputs to a layer's
compute dtype), run in the framework, and differentiated with the backend's own autodiff.
float64 on JAX exists only with x64 enabled, so that case runs under ``jax.enable_x64(True)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
from keras import ops

import masksembles_keras as mk

DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


def _vjp_tensorflow(fn: Callable[[Any], Any], x: Any, cotangent: Any) -> tuple[Any, Any]:
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    return y, tape.gradient(y, x, output_gradients=cotangent)


def _vjp_jax(fn: Callable[[Any], Any], x: Any, cotangent: Any) -> tuple[Any, Any]:
    import jax

    y, pullback = jax.vjp(fn, x)
    return y, pullback(cotangent)[0]


def _vjp_torch(fn: Callable[[Any], Any], x: Any, cotangent: Any) -> tuple[Any, Any]:
    import torch

    x = x.detach().requires_grad_(True)
    y = fn(x)
    (grad,) = torch.autograd.grad(y, x, grad_outputs=cotangent)
    return y, grad


VJP = {"tensorflow": _vjp_tensorflow, "jax": _vjp_jax, "torch": _vjp_torch}


@contextlib.contextmanager
def _dtype_scope(dtype: str) -> Iterator[None]:
    if keras.backend.backend() == "jax" and dtype == "float64":
        import jax

        with jax.enable_x64(True):
            yield
    else:
        yield


class KerasLayerAdapter:
    dtypes = DTYPES

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def masks_from_seed(self, channels: int, n: int, scale: float, seed: int) -> np.ndarray:
        layer = mk.Masksembles(n, scale, seed=seed)
        layer.build((None, channels))
        return np.asarray(layer.masks.numpy() != 0)

    def forward_backward(
        self, masks: np.ndarray, x: np.ndarray, grad_output: np.ndarray, channel_axis: int, dtype: str
    ) -> tuple[np.ndarray, np.ndarray]:
        with _dtype_scope(dtype):
            layer = mk.Masksembles(masks=masks, channel_axis=channel_axis, dtype=dtype)
            inputs = ops.cast(ops.convert_to_tensor(x), dtype)
            cotangent = ops.cast(ops.convert_to_tensor(grad_output), dtype)
            y, grad_input = VJP[self.backend](layer, inputs, cotangent)
            assert y.dtype == inputs.dtype and grad_input.dtype == inputs.dtype, (y.dtype, grad_input.dtype)
            storage = x.dtype.name
            return ops.convert_to_numpy(ops.cast(y, storage)), ops.convert_to_numpy(ops.cast(grad_input, storage))


def make_adapter(adapter_id: str) -> KerasLayerAdapter:
    backend = adapter_id.removeprefix("keras-")
    if keras.backend.backend() != backend:
        raise RuntimeError(
            f"adapter {adapter_id!r} needs KERAS_BACKEND={backend}; Keras runs on {keras.backend.backend()!r}"
        )
    return KerasLayerAdapter(backend)
