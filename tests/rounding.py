"""Comparing one result computed two ways: a tolerance from the dtype's rounding, not bit equality.

Results computed in different ways (in chunks vs in one call, on one batch size vs another, compiled vs eager,
sharded vs on one device, exported vs eager) may round differently: a kernel may accumulate a sum in another order
for another number of rows or on another CPU's instructions. Bit equality is kept only where the arithmetic is the
same by construction (masks, ``tile``/``untile``, a layer against the NumPy reference on the same inputs, a model
against itself after a save and load), and those places say so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ROUNDING_UNITS = 64  # units of the dtype's epsilon: far above a reordered sum's rounding, far below a wrong value


def rounding_tolerance(dtype: Any) -> float:
    """The relative tolerance for ``dtype``: ``ROUNDING_UNITS`` machine epsilons (0 for exact dtypes)."""
    dtype = np.dtype(dtype)
    return ROUNDING_UNITS * float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.inexact) else 0.0


def assert_rounding_close(actual: Any, expected: Any, *, err_msg: str = "") -> None:
    """``actual`` equals ``expected`` up to rounding: same shape and dtype, each value within ``rounding_tolerance``
    of ``expected``'s dtype relative to itself, or to the largest finite ``|expected|`` where values are near 0.

    Tensors of any framework that ``np.asarray`` reads (on the CPU, without gradient) are accepted.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape} {err_msg}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype} {err_msg}"
    tolerance = rounding_tolerance(expected.dtype)
    if tolerance == 0.0:
        np.testing.assert_array_equal(actual, expected, err_msg=err_msg)
        return
    finite = np.abs(expected[np.isfinite(expected)])
    scale = float(finite.max()) if finite.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=tolerance, atol=tolerance * scale, err_msg=err_msg)
