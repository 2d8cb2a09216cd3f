"""Helpers shared by the Keras tests: the backend, the core's error messages, dtype scopes, the NumPy oracle."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
from keras import ops

import masksembles_core as mc

BACKEND = keras.backend.backend()
# jit_compile=True is XLA on TensorFlow and JAX (on torch it would mean torch.compile, not asked for here)
JIT_COMPILE = (False, True) if BACKEND in ("tensorflow", "jax") else (False,)


def core_error(check: Callable[[], object]) -> tuple[type[Exception], str]:
    """The exception type and escaped message the core raises for ``check()`` (for ``pytest.raises``)."""
    try:
        check()
    except (TypeError, ValueError) as error:
        return type(error), re.escape(str(error))
    raise AssertionError("the core accepted the value")


@contextlib.contextmanager
def dtype_scope(dtype: str) -> Iterator[None]:
    """float64 exists on the JAX backend only with x64 enabled."""
    if BACKEND == "jax" and dtype == "float64":
        import jax

        with jax.enable_x64(True):
            yield
    else:
        yield


def to_numpy(x: Any) -> np.ndarray:
    """A tensor or variable as a NumPy array (bfloat16 widened to float32, exactly)."""
    if isinstance(x, keras.Variable):
        x = x.value
    if x.dtype == "bfloat16" or str(x.dtype).endswith("bfloat16"):
        x = ops.cast(x, "float32")
    return np.asarray(ops.convert_to_numpy(x))


def masks_of(layer: keras.layers.Layer) -> np.ndarray:
    """The masks a Masksembles layer holds, as a bool array (n, C)."""
    return np.asarray(to_numpy(layer.masks) != 0)


def oracle(x: np.ndarray, masks: np.ndarray, channel_axis: int) -> np.ndarray:
    """The core's reference forward."""
    with np.errstate(invalid="ignore"):
        return mc.apply_masks(x, masks, channel_axis=channel_axis)


def assert_same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal shape and bits once widened to float32/float64; NaN at the same places."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.array_equal(np.isnan(actual), np.isnan(expected)), "NaN positions differ"
    finite = ~np.isnan(expected)
    assert np.array_equal(np.signbit(actual[finite]), np.signbit(expected[finite])), "signs of zeros differ"
    assert np.array_equal(actual[finite], expected[finite])


def special_values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 values exact in bfloat16/float16 (halves in [-16, 16]) with inf, -inf and NaN sprinkled in."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-32, 33, size=shape).astype(np.float32) / 2
    flat = x.reshape(-1)
    positions = rng.choice(flat.size, size=min(3, flat.size), replace=False)
    flat[positions] = [np.inf, -np.inf, np.nan][: positions.size]
    return x
