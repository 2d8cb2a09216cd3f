"""masksembles_flax.linen as a conformance adapter (also home of the jax forward/backward both Flax adapters use)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from masksembles_flax.linen import MASKS_COLLECTION, Masksembles

FLAX_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


def jitted_forward_backward(
    layer: Callable[[jax.Array], Any], x: np.ndarray, grad_output: np.ndarray, dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """``layer`` and its input gradient under ``jax.jit`` in ``dtype``, returned in the storage dtype of ``x``.

    float64 runs with x64 enabled for this call only.
    """

    def forward_backward(x_in: jax.Array, grad_out: jax.Array) -> tuple[Any, Any]:
        y, pullback = jax.vjp(layer, x_in)
        (grad_input,) = pullback(grad_out)
        return y, grad_input

    with jax.enable_x64(dtype == "float64"):
        y, grad_input = jax.jit(forward_backward)(jnp.asarray(x).astype(dtype), jnp.asarray(grad_output).astype(dtype))
        assert y.dtype == grad_input.dtype == jnp.dtype(dtype)
        return np.asarray(y.astype(x.dtype)), np.asarray(grad_input.astype(x.dtype))


class FlaxLinenAdapter:
    dtypes = FLAX_DTYPES

    def masks_from_seed(self, channels: int, n: int, scale: float, seed: int) -> np.ndarray:
        variables = Masksembles(n=n, scale=scale, seed=seed).init(jax.random.key(0), jnp.zeros((n, channels)))
        return np.asarray(variables[MASKS_COLLECTION]["masks"])

    def forward_backward(
        self, masks: np.ndarray, x: np.ndarray, grad_output: np.ndarray, channel_axis: int, dtype: str
    ) -> tuple[np.ndarray, np.ndarray]:
        layer = Masksembles(n=masks.shape[0], scale=1.0, masks=masks, channel_axis=channel_axis)
        variables = layer.init(jax.random.key(0), jnp.zeros(x.shape))
        return jitted_forward_backward(lambda x_in: layer.apply(variables, x_in), x, grad_output, dtype)


def make_adapter(adapter_id: str) -> FlaxLinenAdapter:
    return FlaxLinenAdapter()
