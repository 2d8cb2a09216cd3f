"""Which operations compute each sample from that sample alone: proven from the operation and its batch axes
(``_pack_samples``), evaluated on random rows only where no proof applies, and never assumed from a layer's type."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from torch import fx, nn

import masksembles_torch as mt
from tests.torch.test_packing_patterns import masks, relative_error

N = 4
_packing = importlib.import_module("masksembles_torch._packing")
_pack_capture = importlib.import_module("masksembles_torch._pack_capture")


class BatchConvFirst(nn.Module):
    """A convolution along the batch before any mask: (B, C, H, W) -> (H*W, C, B), Conv1d over B, and back. In the
    dense model it runs on the member-stacked batch, where each member's first sample meets the last one before it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.along_batch = nn.Conv2d(3, 8, 3, padding=1), nn.Conv1d(8, 8, 3, padding=1)
        self.masks, self.head = masks(8, 1), nn.Conv2d(8, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = self.along_batch(y.permute(2, 3, 1, 0).flatten(0, 1)).unflatten(0, y.shape[2:]).permute(3, 2, 0, 1)
        return self.head(self.masks(y))


class PerSampleLayers(nn.Module):
    """Conv2d, BatchNorm2d, pooling, GroupNorm, Linear and LayerNorm with the batch on axis 0, masks between them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.pool = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.AvgPool2d(2)
        self.group, self.masks1 = nn.GroupNorm(2, 8), masks(8, 1)
        self.linear, self.norm, self.masks2 = nn.Linear(8, 12), nn.LayerNorm(12), masks(12, 2, axis=-1)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.masks1(self.group(self.pool(self.bn(self.conv(x)))))
        return self.head(self.masks2(self.norm(self.linear(y.flatten(2).transpose(1, 2))))).mean(1)


def evaluated_nodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the nodes ``_Capture.mixes_samples`` runs on random rows from now on."""
    names: list[str] = []
    evaluate = _pack_capture._evaluate

    def recorded(capture: Any, node: fx.Node, values: Any, run: int = 0) -> Any:
        names.append(node.name)
        return evaluate(capture, node, values, run)

    monkeypatch.setattr(_pack_capture, "_evaluate", recorded)
    return names


def test_layers_that_read_other_axes_than_the_batch_are_proven_per_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer of the model reads axes besides its channels, none the batch: each is proven to keep samples
    apart without running it, and the dense program (every node a fallback) needs no evaluation either."""
    model = PerSampleLayers().eval()
    x = torch.randn(5, 3, 6, 6)
    capture = _packing._Capture(model, x)
    evaluated = evaluated_nodes(monkeypatch)
    layers = [node for node in capture.classified if node.op == "call_module" and "masks" not in str(node.target)]
    assert {str(node.target) for node in layers} >= {"conv", "bn", "pool", "group", "linear", "norm"}
    assert not any(capture.mixes_samples(node) for node in layers)
    capture.reset(dense=True)
    assert evaluated == []
    assert relative_error(mt.pack(model, x, program="dense")(x), mt.predict(model, x, N)) <= 1e-5


def test_a_convolution_along_the_batch_before_the_masks_runs_on_the_member_stacked_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Conv1d run along the batch (the batch on its length axis): not proven, evaluated, found to mix samples, so
    it runs per member on the member-stacked batch as in the dense model, not once on the shared input (where each
    member's first sample would meet zero padding instead of the previous member's last sample)."""
    torch.manual_seed(0)
    model = BatchConvFirst().eval()
    x = torch.randn(6, 3, 4, 4)
    capture = _packing._Capture(model, x)
    evaluated = evaluated_nodes(monkeypatch)
    conv = next(node for node in capture.classified if node.target == "along_batch")
    assert capture.mixes_samples(conv) and conv.name in evaluated
    for program in ("packed", "dense"):
        assert relative_error(mt.pack(model, x, program=program)(x), mt.predict(model, x, N)) <= 1e-5
