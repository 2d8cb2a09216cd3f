"""Functions of the model's own code that torch.fx keeps as one call (registered with ``torch.fx.wrap``):
``pack`` captures such a model with torch.export, which records the operations inside, each classified by its own
rule. torchvision's Swin (``tests/torch/torchvision_swin.py``) runs its whole window attention in one such function:
it now folds into the heads as the ``transformers`` and timm layouts do (tests/torch/test_packing_windows.py).

A wrapped function that mixes the samples keeps doing so: the operation that mixes runs on the member-stacked batch
as the dense model runs it; one that torch.export cannot capture either (a Python branch on the batch's values) stays
one call, run as the dense model runs it. Every program equals ``predict`` and ``packed.macs`` counts what it runs."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor, nn

import masksembles_torch as mt
from tests.torch import torchvision_swin
from tests.torch.packing_checks import check_equal_to_predict, check_member_equal_to_predict
from tests.torch.test_packing_macs import macs_per_sample

N = 4
COMPUTING = ("matmul", "linear", "softmax", "roll", "pad", "shifted_window_attention", "_patch_merging_pad")


def swin() -> nn.Module:
    return mt.insert(torchvision_swin.build(), N, 2.0, seed=0).eval()


def first_attention_products() -> int:
    """Multiply-adds per sample of q @ k^T and attention @ v in the first block: a 7x7 grid padded to four 4x4
    windows, 2 heads of 8 channels."""
    windows, heads, length, head_dim = 4, 2, 16, 8
    return 2 * windows * heads * length * length * head_dim


def test_torchvision_swin_packs_with_its_window_attention_folded() -> None:
    """Before, ``shifted_window_attention`` was one call at full width (55% of the packed program's multiply-adds
    with one stage); with two stages, pack failed (the traced call wrote 0 into torch.fx's immutable copy of
    ``shift_size``). Now every block's attention after the first Masksembles layer folds, with its pad, roll and
    mask; the first block's attention reads no masked value (insert cannot place a mask in front of weights passed to
    a function), so it runs once per sample: its products are the only fallback multiply-adds."""
    model = swin()
    packed = mt.pack(model, torchvision_swin.images(4), program="packed")
    computing = [row for row in packed.fallbacks if any(name in row for name in COMPUTING)]
    assert all(row.startswith("features.1.0.attn:") for row in computing), packed.fallbacks
    assert not [row for row in packed.fallbacks if row.startswith("verification")], packed.fallbacks
    assert packed.macs["fallback"] == first_attention_products(), packed.macs
    assert packed.macs["packed"] == macs_per_sample(packed, torchvision_swin.images) < packed.macs["dense"]
    assert packed.macs["dense"] == N * macs_per_sample(model, torchvision_swin.images)
    check_equal_to_predict(model, packed, lambda batch: torchvision_swin.images(batch, seed=batch), N)


@pytest.mark.slow
def test_one_member_of_torchvision_swin_equals_its_part() -> None:
    check_member_equal_to_predict(swin(), torchvision_swin.images(5, seed=5), N)


def centered_on_the_batch(x: Tensor) -> Tensor:
    """Each sample less the mean over the batch: every sample's result reads every other sample."""
    return x - x.mean(0, keepdim=True)


torch.fx.wrap("centered_on_the_batch")


def clipped_where_any_is_large(x: Tensor) -> Tensor:
    """Clipped to [-1, 1] where any value of the batch is beyond 3: a branch on the values, which neither torch.fx
    nor torch.export can record, decided by every sample at once."""
    if bool((x.abs() > 3).any()):
        return x.clamp(-1.0, 1.0)
    return x


torch.fx.wrap("clipped_where_any_is_large")


class WrappedBetweenLinears(nn.Module):
    """(B, 8) -> (B, 3): Linear, ``function`` (a wrapped one), Linear, GELU, Linear."""

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function
        self.first, self.second, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.first(x)  # the functions called by their global names, which torch.fx.wrap patches while it traces
        x = centered_on_the_batch(x) if self.function == "centered" else clipped_where_any_is_large(x)
        return self.head(torch.nn.functional.gelu(self.second(x)))


def rows(batch: int, seed: int = 0, scale: float = 1.0) -> Tensor:
    return scale * torch.randn(batch, 8, generator=torch.Generator().manual_seed(seed))


def scaled_rows(scale: float, batch: int) -> Tensor:
    return rows(batch, seed=batch, scale=scale)


def wrapped_model(function: str) -> nn.Module:
    torch.manual_seed(0)
    return mt.insert(WrappedBetweenLinears(function), N, 2.0, seed=0).eval()


def test_a_wrapped_function_that_mixes_the_samples_runs_on_the_member_stacked_batch() -> None:
    """The mean over the batch inside the wrapped function (seen by torch.export) reads every member's samples in
    ``predict``: it runs as the dense model runs it, and the program equals predict."""
    model = wrapped_model("centered")
    packed = mt.pack(model, rows(4), program="packed")
    assert [row for row in packed.fallbacks if "mean" in row], packed.fallbacks
    assert not [row for row in packed.fallbacks if row.startswith("verification")], packed.fallbacks
    assert packed.macs["packed"] == macs_per_sample(packed, rows)
    check_equal_to_predict(model, packed, lambda batch: rows(batch, seed=batch), N)


def test_a_wrapped_function_torch_export_cannot_capture_stays_one_call() -> None:
    """A branch on the batch's values: torch.export fails on it, so the torch.fx capture is kept, the function one
    fallback on the member-stacked batch (on batches that take either branch), equal to predict."""
    model = wrapped_model("clipped")
    packed = mt.pack(model, rows(4), program="packed")
    assert [row for row in packed.fallbacks if "clipped_where_any_is_large" in row], packed.fallbacks
    assert not [row for row in packed.fallbacks if row.startswith("verification")], packed.fallbacks
    assert packed.macs["packed"] == macs_per_sample(packed, rows)
    for scale in (0.01, 10.0):  # no value beyond 3 after the first Linear, and many
        check_equal_to_predict(model, packed, functools.partial(scaled_rows, scale), N)
