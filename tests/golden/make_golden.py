"""Regenerate the conformance golden file from the NumPy reference.

    python tests/golden/make_golden.py

Writes ``conformance_v2.npz`` next to this script. Bump the version in the file name when
the cases change on purpose; a test checks that the committed file equals what this script
produces, so an accidental change of the generator or the oracle fails loudly.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

import masksembles_core as mc

GOLDEN_PATH = Path(__file__).with_name("conformance_v2.npz")

# (channels, n, scale, seed): masks that every adapter must reproduce bit for bit from the seed.
MASK_CASES = [
    (16, 4, 2.0, 0),
    (64, 4, 3.0, 1),
    (7, 3, 1.5, 2),
    (32, 1, 5.0, 3),
    (5, 8, 1.5, 4),  # more masks than channels; the first draw repeats masks, so this pins their replacement
    (24, 4, 1.0, 5),
    (256, 6, 10.0, 12345),
]

CHANNELS = 6
N = 4
LAYER_SEED = 2021
# name -> (shape without batch and with C in place, channel_axis)
LAYOUTS: dict[str, tuple[tuple[int, ...], int]] = {
    "bc": ((CHANNELS,), 1),
    "bcl": ((CHANNELS, 5), 1),
    "blc": ((5, CHANNELS), -1),
    "bchw": ((CHANNELS, 3, 4), 1),
    "bhwc": ((3, 4, CHANNELS), -1),
    "bcdhw": ((CHANNELS, 2, 3, 2), 1),
    "bdhwc": ((2, 3, 2, CHANNELS), -1),
}
BATCH_SIZES = (8, 6, 4, 3)  # divisible by n, not divisible, equal to n, smaller than n
# bfloat16 has no NumPy dtype: its cases store float32 values that bfloat16 represents exactly.
DTYPES = ("float16", "bfloat16", "float32", "float64")
STORAGE = {"float16": "float16", "bfloat16": "float32", "float32": "float32", "float64": "float64"}


def case_name(layout: str, batch: int, dtype: str) -> str:
    return f"{layout}-b{batch}-{dtype}"


def exact_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Multiples of 1/8 in [-16, 16): exact in float16, bfloat16, float32 and float64."""
    return rng.integers(-128, 128, size=shape).astype(np.float64) / 8.0


def build() -> dict[str, Any]:
    arrays: dict[str, Any] = {}
    for channels, n, scale, seed in MASK_CASES:
        arrays[f"masks/{channels}-{n}-{scale}-{seed}"] = mc.generate_masks(channels, n, scale, seed=seed)
    masks = mc.generate_masks(CHANNELS, N, 2.0, seed=LAYER_SEED)
    arrays["layer_masks"] = masks
    rng = np.random.default_rng(7)
    cases = []
    for layout, (inner, channel_axis) in LAYOUTS.items():
        for batch in BATCH_SIZES:
            shape = (batch, *inner)
            x = exact_values(rng, shape)
            flat = x.reshape(-1)
            flat[rng.choice(flat.size, size=3, replace=False)] = [np.inf, -np.inf, np.nan]
            grad_output = exact_values(rng, shape)
            for dtype in DTYPES:
                name = case_name(layout, batch, dtype)
                storage = STORAGE[dtype]
                x_cast = x.astype(storage)
                g_cast = grad_output.astype(storage)
                with np.errstate(invalid="ignore"):
                    arrays[f"{name}/x"] = x_cast
                    arrays[f"{name}/y"] = mc.apply_masks(x_cast, masks, channel_axis=channel_axis)
                    arrays[f"{name}/grad_output"] = g_cast
                    arrays[f"{name}/grad_input"] = mc.apply_masks_grad(g_cast, masks, channel_axis=channel_axis)
                cases.append({"name": name, "layout": layout, "dtype": dtype, "channel_axis": channel_axis})
    meta = {
        "version": 2,
        "n": N,
        "channels": CHANNELS,
        "mask_cases": [list(c) for c in MASK_CASES],
        "cases": cases,
    }
    arrays["meta"] = np.array(json.dumps(meta))
    return arrays


def serialize(arrays: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


if __name__ == "__main__":
    GOLDEN_PATH.write_bytes(serialize(build()))
    print(f"wrote {GOLDEN_PATH} ({GOLDEN_PATH.stat().st_size} bytes)")
