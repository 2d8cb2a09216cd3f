"""Helpers shared by the Keras tests: the backend, the core's error messages, dtype scopes, the NumPy oracle."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
from keras import ops

from tests.conformance import assert_same_bits, oracle, special_values

__all__ = [
    "BACKEND",
    "JIT_COMPILE",
    "assert_file_round_trip_keeps_masks",
    "assert_same_bits",
    "core_error",
    "data",
    "dtype_scope",
    "layer_at",
    "layer_paths",
    "masks_of",
    "masksembles_layers",
    "oracle",
    "run",
    "special_values",
    "to_numpy",
]

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


def layer_paths(model: keras.Model, prefix: str = "") -> Iterator[tuple[str, keras.layers.Layer]]:
    """(path, layer) for the layers of ``model`` and of its nested models (``"block/dense"``), depth first."""
    for layer in model.layers:
        yield prefix + layer.name, layer
        if isinstance(layer, keras.Model):
            yield from layer_paths(layer, f"{prefix}{layer.name}/")


def layer_at(model: keras.Model, path: str) -> keras.layers.Layer:
    """The layer at ``path`` (``"block/dense"``: layer ``dense`` of the nested model ``block``)."""
    layer = model
    for name in path.split("/"):
        layer = layer.get_layer(name)
    return layer


def run(model: keras.Model, x: Any) -> Any:
    """The outputs of ``model`` on ``x`` in inference mode (a direct call: no predict function to compile)."""
    return keras.tree.map_structure(to_numpy, model(x, training=False))


def masksembles_layers(model: keras.Model) -> dict[str, Any]:
    """The Masksembles layers of ``model`` (nested ones included) by path."""
    import masksembles_keras as mk

    return {path: layer for path, layer in layer_paths(model) if isinstance(layer, mk.Masksembles)}


def data(model: keras.Model, batch: int = 5, seed: int = 0) -> np.ndarray:
    """A standard-normal float32 batch shaped like ``model``'s first input."""
    shape = (batch, *model.inputs[0].shape[1:])
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def assert_file_round_trip_keeps_masks(model: keras.Model, path: Path) -> None:
    """Saved as ``path`` (a .keras file) and loaded: the same Masksembles layers (path, type, masks), the same
    members' outputs."""
    import masksembles_keras as mk

    model.save(path)
    loaded = keras.saving.load_model(path)
    saved = masksembles_layers(model)
    assert set(masksembles_layers(loaded)) == set(saved)
    for key, layer in masksembles_layers(loaded).items():
        assert type(layer) is type(saved[key]) and np.array_equal(masks_of(layer), masks_of(saved[key])), key
    x = data(model)
    assert np.array_equal(mk.predict(loaded, x, 4), mk.predict(model, x, 4))
