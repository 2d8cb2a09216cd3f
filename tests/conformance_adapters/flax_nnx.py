"""masksembles_flax.nnx as a conformance adapter."""

from __future__ import annotations

import numpy as np

from masksembles_flax.nnx import Masksembles
from tests.conformance_adapters.flax_linen import FLAX_DTYPES, jitted_forward_backward


class FlaxNnxAdapter:
    dtypes = FLAX_DTYPES

    def masks_from_seed(self, channels: int, n: int, scale: float, seed: int) -> np.ndarray:
        return np.asarray(Masksembles(channels, n, scale, seed=seed).masks[...])

    def forward_backward(
        self, masks: np.ndarray, x: np.ndarray, grad_output: np.ndarray, channel_axis: int, dtype: str
    ) -> tuple[np.ndarray, np.ndarray]:
        layer = Masksembles(masks.shape[1], masks.shape[0], 1.0, masks=masks, channel_axis=channel_axis)
        return jitted_forward_backward(layer, x, grad_output, dtype)


def make_adapter(adapter_id: str) -> FlaxNnxAdapter:
    return FlaxNnxAdapter()
