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
import pytest
from flax import nnx

import masksembles_core as mc
from masksembles_flax import linen as masksembles_linen
from masksembles_flax import nnx as masksembles_nnx

DTYPES = ("bfloat16", "float16", "float32")


def special_values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 values exact in bfloat16/float16 (halves in [-16, 16]) with inf, -inf and NaN sprinkled in."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-32, 33, size=shape).astype(np.float32) / 2
    flat = x.reshape(-1)
    positions = rng.choice(flat.size, size=min(3, flat.size), replace=False)
    flat[positions] = [np.inf, -np.inf, np.nan][: positions.size]
    return x


def oracle(x: np.ndarray, masks: np.ndarray, channel_axis: int) -> np.ndarray:
    """The core's reference forward (float32 values exact in every tested dtype)."""
    with np.errstate(invalid="ignore"):
        return mc.apply_masks(x, masks, channel_axis=channel_axis)


def assert_same_bits(actual: jax.Array | np.ndarray, expected: np.ndarray) -> None:
    """Values equal bit for bit once widened to float32 (exact for every tested dtype); NaN at the same places."""
    actual32 = np.asarray(jnp.asarray(actual).astype(jnp.float32))
    expected32 = np.asarray(expected, dtype=np.float32)
    assert actual32.shape == expected32.shape
    assert np.array_equal(np.isnan(actual32), np.isnan(expected32)), "NaN positions differ"
    finite = ~np.isnan(expected32)
    assert np.array_equal(actual32[finite].view(np.uint32), expected32[finite].view(np.uint32))


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


class NnxMLP(nnx.Module):
    """NNX Linear -> Masksembles -> Linear on (B, 3)."""

    def __init__(self, *, mode: str = "grouped", seed: int = 0, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(3, 32, rngs=rngs)
        self.ensemble = masksembles_nnx.Masksembles(32, 4, 2.0, seed=seed, mode=mode, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.ensemble(nnx.relu(self.hidden(x))))
