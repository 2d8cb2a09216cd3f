"""Cross-framework conformance harness.

The golden file (``tests/golden/conformance_v2.npz``, made by ``make_golden.py`` from the NumPy
reference) holds masks generated from fixed seeds and, for many layouts, batch sizes and
dtypes, inputs with inf/NaN entries, the reference outputs, output gradients and reference
input gradients. Each adapter id maps to a module in ``tests/conformance_adapters`` that
defines ``make_adapter(adapter_id)``, returning an object with:

- ``backend``: the backend name in ``tests.backends`` that must be requested to run it;
- ``dtypes``: the golden dtypes it supports;
- ``masks_from_seed(channels, n, scale, seed) -> bool ndarray``: the masks a layer built with
  that seed holds, read back from the layer;
- ``forward_backward(masks, x, grad_output, channel_axis, dtype) -> (y, grad_input)``: the
  layer built from ``masks`` applied to ``x`` (stored in NumPy, cast to ``dtype`` in the
  framework), and the input gradient for ``grad_output``, both returned as NumPy arrays of
  the storage dtype of ``x``.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

import masksembles_core as mc

GOLDEN_PATH = Path(__file__).parent / "golden" / "conformance_v2.npz"

# adapter id -> module under tests/conformance_adapters
ADAPTER_MODULES = {
    "numpy": "numpy_reference",
    "torch": "torch_layer",
    "keras-tensorflow": "keras_layer",
    "keras-jax": "keras_layer",
    "keras-torch": "keras_layer",
    "flax-linen": "flax_linen",
    "flax-nnx": "flax_nnx",
}
ADAPTER_BACKENDS = {
    "numpy": "numpy",
    "torch": "torch",
    "keras-tensorflow": "keras-tensorflow",
    "keras-jax": "keras-jax",
    "keras-torch": "keras-torch",
    "flax-linen": "flax",
    "flax-nnx": "flax",
}


class Adapter(Protocol):
    dtypes: frozenset[str]

    def masks_from_seed(self, channels: int, n: int, scale: float, seed: int) -> np.ndarray: ...

    def forward_backward(
        self, masks: np.ndarray, x: np.ndarray, grad_output: np.ndarray, channel_axis: int, dtype: str
    ) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class Case:
    name: str
    layout: str
    dtype: str
    channel_axis: int


@cache
def golden() -> dict[str, Any]:
    with np.load(GOLDEN_PATH) as data:
        return {key: data[key] for key in data.files}


def meta() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(str(golden()["meta"]))
    return result


def cases() -> list[Case]:
    return [Case(**case) for case in meta()["cases"]]


def mask_cases() -> list[tuple[int, int, float, int]]:
    return [(int(c), int(n), float(s), int(seed)) for c, n, s, seed in meta()["mask_cases"]]


def load_adapter(adapter_id: str) -> Adapter:
    module = importlib.import_module(f"tests.conformance_adapters.{ADAPTER_MODULES[adapter_id]}")
    adapter: Adapter = module.make_adapter(adapter_id)
    return adapter


def special_values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 values exact in bfloat16/float16 (halves in [-16, 16]) with inf, -inf and NaN sprinkled in."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-32, 33, size=shape).astype(np.float32) / 2
    flat = x.reshape(-1)
    positions = rng.choice(flat.size, size=min(3, flat.size), replace=False)
    flat[positions] = [np.inf, -np.inf, np.nan][: positions.size]
    return x


def oracle(x: np.ndarray, masks: np.ndarray, channel_axis: int) -> np.ndarray:
    """The core's reference forward, without the warning NumPy gives for inf * 0."""
    with np.errstate(invalid="ignore"):
        return mc.apply_masks(x, masks, channel_axis=channel_axis)


def assert_same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    """``assert_bit_identical`` after widening ``actual`` to ``expected``'s dtype (exact from any narrower float)."""
    assert_bit_identical(np.asarray(actual).astype(expected.dtype), expected)


def assert_bit_identical(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal shape, dtype and bits; NaNs must sit at the same positions (payloads may differ)."""
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    nan_actual, nan_expected = np.isnan(actual), np.isnan(expected)
    assert np.array_equal(nan_actual, nan_expected), "NaN positions differ"
    bits = np.dtype(f"u{actual.dtype.itemsize}")
    differ = actual[~nan_actual].view(bits) != expected[~nan_expected].view(bits)
    assert not differ.any(), (
        f"{int(differ.sum())} values differ in bits, e.g. {actual[~nan_actual][differ][:5]} "
        f"!= {expected[~nan_expected][differ][:5]}"
    )
