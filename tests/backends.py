"""Which framework backends a test run covers.

``MASKSEMBLES_TEST_BACKENDS`` is a comma-separated list of backend names (default: ``numpy``).
Tests for a backend that is not requested are skipped with that reason; a requested backend
that cannot be imported makes ``test_requested_backends_import`` fail, so a nox session can
never pass by skipping everything it was asked to test.
"""

from __future__ import annotations

import os

import pytest

# backend name -> modules that must import (and, for Keras, the KERAS_BACKEND it needs)
BACKEND_MODULES: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy", "masksembles_core"),
    "torch": ("torch", "masksembles_torch"),
    "transformers": ("torch", "masksembles_torch", "transformers"),  # Hugging Face models (tests/torch)
    "keras-tensorflow": ("tensorflow", "keras", "masksembles_keras"),
    "keras-jax": ("jax", "keras", "masksembles_keras"),
    "keras-torch": ("torch", "keras", "masksembles_keras"),
    "keras_hub": ("keras", "keras_hub", "masksembles_keras"),  # keras-hub models (tests/keras), any Keras backend
    "flax": ("jax", "flax", "masksembles_flax"),
}


def requested_backends() -> tuple[str, ...]:
    raw = os.environ.get("MASKSEMBLES_TEST_BACKENDS", "numpy")
    names = tuple(name.strip() for name in raw.split(",") if name.strip())
    unknown = [name for name in names if name not in BACKEND_MODULES]
    if unknown:
        raise ValueError(f"unknown backends in MASKSEMBLES_TEST_BACKENDS: {unknown}; known: {list(BACKEND_MODULES)}")
    return names


def require_backend(name: str) -> None:
    """Skip the calling test unless backend ``name`` was requested."""
    if name not in requested_backends():
        pytest.skip(f"backend {name!r} not requested (MASKSEMBLES_TEST_BACKENDS={requested_backends()})")
