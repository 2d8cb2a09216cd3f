"""A requested backend that cannot be imported fails the run instead of skipping its tests."""

from __future__ import annotations

import importlib
import os

import pytest

from tests.backends import BACKEND_MODULES, requested_backends


@pytest.mark.parametrize("backend", requested_backends())
def test_requested_backends_import(backend: str) -> None:
    for module in BACKEND_MODULES[backend]:
        importlib.import_module(module)
    if backend.startswith("keras-"):
        import keras

        wanted = backend.removeprefix("keras-")
        assert keras.backend.backend() == wanted, (
            f"backend {backend!r} requested but Keras runs on {keras.backend.backend()!r}; "
            f"KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}"
        )
