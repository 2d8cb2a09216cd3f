"""masksembles_torch.Masksembles as a conformance adapter."""

from __future__ import annotations

import numpy as np
import torch

import masksembles_torch as mt


class TorchLayer:
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})

    def masks_from_seed(self, channels: int, n: int, scale: float, seed: int) -> np.ndarray:
        return mt.Masksembles(channels, n, scale, seed=seed).masks.numpy().astype(bool)

    def forward_backward(
        self, masks: np.ndarray, x: np.ndarray, grad_output: np.ndarray, channel_axis: int, dtype: str
    ) -> tuple[np.ndarray, np.ndarray]:
        torch_dtype = getattr(torch, dtype)
        layer = mt.Masksembles(masks=masks, channel_axis=channel_axis)
        inputs = torch.from_numpy(x).to(torch_dtype).requires_grad_(True)
        outputs = layer(inputs)
        outputs.backward(torch.from_numpy(grad_output).to(torch_dtype))
        assert outputs.dtype == torch_dtype and inputs.grad is not None
        return outputs.detach().to(torch.float64).numpy().astype(x.dtype), inputs.grad.to(torch.float64).numpy().astype(
            x.dtype
        )


def make_adapter(adapter_id: str) -> TorchLayer:
    return TorchLayer()
