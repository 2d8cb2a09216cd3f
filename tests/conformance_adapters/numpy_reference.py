"""The NumPy reference itself as a conformance adapter: proves the golden file is reproducible."""

from __future__ import annotations

import numpy as np

import masksembles_core as mc


class NumpyReference:
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})

    def masks_from_seed(self, channels: int, n: int, scale: float, seed: int) -> np.ndarray:
        return mc.generate_masks(channels, n, scale, seed=seed)

    def forward_backward(
        self, masks: np.ndarray, x: np.ndarray, grad_output: np.ndarray, channel_axis: int, dtype: str
    ) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(invalid="ignore"):
            y = mc.apply_masks(x, masks, channel_axis=channel_axis)
            grad_input = mc.apply_masks_grad(grad_output, masks, channel_axis=channel_axis)
        return y, grad_input


def make_adapter(adapter_id: str) -> NumpyReference:
    return NumpyReference()
