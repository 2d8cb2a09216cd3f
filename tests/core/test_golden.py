"""The committed golden file is exactly what the generator and the reference produce today."""

from __future__ import annotations

import numpy as np

from tests.conformance import golden
from tests.golden.make_golden import build


def test_golden_file_is_reproducible() -> None:
    fresh = build()
    stored = golden()
    assert set(fresh) == set(stored)
    for key, value in fresh.items():
        value = np.asarray(value)
        assert value.dtype == stored[key].dtype, key
        assert np.array_equal(value, stored[key], equal_nan=value.dtype.kind == "f"), key
