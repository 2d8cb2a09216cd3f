"""``packed.macs`` counts every multiply-add of the program it reports on: compared with
``torch.utils.flop_counter.FlopCounterMode`` (flops / 2) run on the program itself and on the model, per sample (the
difference between two batch sizes), for the packed and the dense program and the whole model tiled, through torch.fx
and torch.export captures. Attention runs on its math path here (two matmuls), which FlopCounterMode counts; it does
not count the CPU's fused kernel."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import masksembles_torch as mt

from . import replicas, zoo

N = 4
KEYS = {"packed", "dense", "fallback"}


def macs_per_sample(run: Callable[[torch.Tensor], Any], images: Callable[[int], torch.Tensor]) -> int:
    """FlopCounterMode's multiply-adds of ``run`` per sample: at batch 3 less at batch 2, attention on its math path."""
    counts = []
    for batch in (2, 3):
        with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            run(images(batch))
        counts.append(counter.get_total_flops())
    return (counts[1] - counts[0]) // 2


@pytest.mark.parametrize(
    ("library", "name", "what"),
    [
        (zoo, "convnext", "depthwise convolutions, token MLPs with padded hidden units"),
        (zoo, "vit_fused", "F.scaled_dot_product_attention, fused into the program"),
        (replicas, "swin", "window attention: matmuls on windows folded into the batch, at full width"),
        (replicas, "levit", "attention products that run at full width"),
    ],
)
@pytest.mark.parametrize("program", ["packed", "dense"])
def test_macs_equal_the_flop_counters_count_of_the_program_and_of_the_members(
    library: ModuleType, name: str, what: str, program: str
) -> None:
    masked = mt.insert(library.build(name), N, 2.0, seed=0).eval()
    packed = mt.pack(masked, library.images(2), program=program)
    assert packed.program == program and set(packed.macs) == KEYS
    assert packed.macs["packed"] == macs_per_sample(packed, library.images), what
    assert packed.macs["dense"] == N * macs_per_sample(masked, library.images), what
    if program == "dense":
        assert packed.macs["fallback"] == packed.macs["packed"]
        assert packed.macs["dense"] == mt.pack(masked, library.images(2), program="packed").macs["dense"]


def test_a_torch_export_capture_counts_its_convolutions() -> None:
    """EfficientNet given as a tuple of inputs goes through torch.export, whose convolutions are ATen calls."""
    masked = mt.insert(zoo.build("efficientnet"), N, 2.0, seed=0).eval()
    packed = mt.pack(masked, (zoo.images(2),), program="packed")
    assert set(packed.macs) == KEYS
    assert packed.macs["packed"] == macs_per_sample(lambda x: packed(x), zoo.images)
    assert packed.macs["dense"] == N * macs_per_sample(masked, zoo.images)


class WindowAttentionFunction(nn.Module):
    """A Linear, attention by a function torch.fx keeps as one call (as torchvision's ``shifted_window_attention``;
    ``pack`` captures the model with torch.export, which sees its operations), masks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.masks = mt.Masksembles1D(8, N, 2.0, seed=0)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, 8)
        return self.head(self.masks(attention(self.qkv(x)).mean(1)))


@torch.fx.wrap
def attention(qkv: torch.Tensor) -> torch.Tensor:
    q, k, v = qkv.chunk(3, -1)
    return (q @ k.transpose(-2, -1)).softmax(-1) @ v


def test_a_function_traced_as_one_call_counts_what_it_runs() -> None:
    torch.manual_seed(0)
    model = WindowAttentionFunction().eval()

    def tokens(batch: int) -> torch.Tensor:
        return torch.randn(batch, 5, 8, generator=torch.Generator().manual_seed(batch))

    packed = mt.pack(model, tokens(2), program="packed")
    attention_products = 2 * 5 * 5 * 8
    assert packed.macs["fallback"] == attention_products, "it runs once on the batch, before the masks"
    assert packed.macs["packed"] == macs_per_sample(packed, tokens)
    assert packed.macs["dense"] == N * macs_per_sample(model, tokens) == N * (5 * 8 * 24 + attention_products + 8 * 3)
