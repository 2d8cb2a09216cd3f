"""Float32 arrays whose values come from float16 or bfloat16, as a framework's low-precision outputs cast up."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

LOW_PRECISIONS = ("float16", "bfloat16")


def bfloat16_rounded(values: NDArray[np.floating]) -> NDArray[np.float32]:
    """``values`` rounded to bfloat16 (8 significant bits, round to nearest even), as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def low_precision(values: NDArray[np.floating], kind: str) -> NDArray[np.float32]:
    """``values`` stored in ``kind`` (float16 or bfloat16), then cast to float32."""
    if kind == "float16":
        return values.astype(np.float16).astype(np.float32)
    if kind == "bfloat16":
        return bfloat16_rounded(values)
    raise ValueError(f"unknown precision {kind!r}")
