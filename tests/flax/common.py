"""Test helpers shared by the Flax tests: the NumPy oracle in any dtype, the core's error messages, two small models."""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from masksembles_flax import linen as masksembles_linen
from masksembles_flax import nnx as masksembles_nnx
from masksembles_flax.linen import MASKS_COLLECTION
from tests.conformance import assert_same_bits as shared_assert_same_bits
from tests.conformance import oracle, special_values

__all__ = [
    "DTYPES",
    "LinenMLP",
    "NnxMLP",
    "assert_float32_close",
    "assert_head_equals",
    "assert_same_bits",
    "oracle",
    "raises_like",
    "special_values",
    "train_linen_mlp",
]

DTYPES = ("bfloat16", "float16", "float32")


def assert_same_bits(actual: jax.Array | np.ndarray, expected: np.ndarray) -> None:
    """Bit for bit once widened to float32 (exact for every tested dtype); NaN at the same places."""
    shared_assert_same_bits(np.asarray(jnp.asarray(actual).astype(jnp.float32)), np.asarray(expected, np.float32))


def assert_float32_close(actual: Any, expected: np.ndarray, name: str = "") -> None:
    """float32, the expected shape, and within 64 float32 rounding units of ``expected`` (float64), scaled by its
    magnitude: values computed another way (packed sums reordered, compiled, exported) differ by a few units, the
    uncertainty head adds a few more; a wrong member, class or formula differs by orders of magnitude more."""
    got = np.asarray(actual)
    assert got.dtype == np.float32 and got.shape == expected.shape, name
    tolerance = 64 * float(np.finfo(np.float32).eps) * max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance, err_msg=name)


def assert_head_equals(answer: Any, expected: dict[str, np.ndarray]) -> None:
    """A ``with_uncertainty`` answer against ``masksembles_core.heads.uncertainty_head``'s: the same names in the same
    order, each value ``assert_float32_close``."""
    assert list(answer) == list(expected)
    for name, want in expected.items():
        assert_float32_close(answer[name], want, name)


def raises_like(core_call: Callable[[], Any]) -> AbstractContextManager[Any]:
    """``pytest.raises`` for the exception type and message that ``core_call`` raises.

    The message must start the raised one: JAX may append a note about its filtered traceback frames.
    """
    with pytest.raises(Exception) as info:
        core_call()
    return pytest.raises(info.type, match=f"^{re.escape(str(info.value))}")


class LinenMLP(nn.Module):
    """linen Dense -> Masksembles -> Dense on (B, 3); ``train`` switches random mode on."""

    mode: str = "grouped"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.relu(nn.Dense(32)(x))
        x = masksembles_linen.Masksembles(n=4, scale=2.0, seed=0, mode=self.mode)(x, deterministic=not train)
        return nn.Dense(1)(x)


def train_linen_mlp(
    model: LinenMLP, variables: Any, x: jax.Array, target: jax.Array, keys: jax.Array
) -> tuple[list[float], Any]:
    """Adam on the mean squared error, one jitted step per key; returns (losses, trained variables)."""
    params, masks = variables["params"], variables[MASKS_COLLECTION]
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params: Any, opt_state: Any, key: jax.Array) -> tuple[Any, Any, jax.Array]:
        def loss_fn(params: Any) -> jax.Array:
            y = model.apply({"params": params, MASKS_COLLECTION: masks}, x, train=True, rngs={"dropout": key})
            return jnp.mean((y - target) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = optimizer.init(params), []
    for key in keys:
        params, opt_state, loss = step(params, opt_state, key)
        losses.append(float(loss))
    return losses, {"params": params, MASKS_COLLECTION: masks}


class NnxMLP(nnx.Module):
    """NNX Linear -> Masksembles -> Linear on (B, 3)."""

    def __init__(self, *, mode: str = "grouped", seed: int = 0, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(3, 32, rngs=rngs)
        self.ensemble = masksembles_nnx.Masksembles(32, 4, 2.0, seed=seed, mode=mode, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.ensemble(nnx.relu(self.hidden(x))))
