"""Every output of a packed program in ``predict``'s layout: a leaf with the batch on axis 0 as (n, B, ...), one with
the batch on another axis as ``predict`` returns it, the members' blocks on that axis ((L, n·B, H): XLNet's ``mems``),
whatever program runs it (packed, in chunks of the batch, dense, the whole model tiled) and member ``k``'s block for
an extracted member."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import masksembles_torch as mt
from masksembles_torch import _packing
from tests.torch.test_packing_patterns import masks

N = 4
packing_chunks = importlib.import_module("masksembles_torch._pack_chunks")


class SequenceFirst(nn.Module):
    """A conv net returning logits (B, 5) and its features sequence-first, (positions, B, C), as a recurrent or
    XLNet-style model lays out a sequence."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.masks1 = nn.Conv2d(3, 12, 3, padding=1), masks(12, 1)
        self.body, self.masks2 = nn.Sequential(nn.GELU(), nn.Conv2d(12, 12, 3)), masks(12, 2)
        self.head = nn.Linear(12, 5)

    def forward(self, x: Tensor) -> dict[str, Any]:  # (B, 3, 8, 8) -> {(B, 5), ((36, B, 12),)}
        features = self.masks2(self.body(self.masks1(self.stem(x))))
        return {"logits": self.head(features.mean((2, 3))), "sequence": (features.flatten(2).permute(2, 0, 1),)}


def assert_in_predicts_layout(result: dict[str, Any], expected: dict[str, Any]) -> None:
    assert result.keys() == expected.keys()
    torch.testing.assert_close(result["logits"], expected["logits"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result["sequence"], expected["sequence"], rtol=1e-5, atol=1e-6)


def member_block(expected: dict[str, Any], k: int, batch: int) -> dict[str, Any]:
    """Member ``k``'s part of ``predict``'s output: its index on the leading members axis, its block on the batch
    axis of a sequence-first leaf."""
    return {"logits": expected["logits"][k], "sequence": (expected["sequence"][0][:, k * batch : (k + 1) * batch],)}


@pytest.mark.parametrize("chunked", [False, True], ids=["one-call", "chunks"])
def test_a_leaf_with_the_batch_on_axis_1_comes_back_as_predict_returns_it(
    chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if chunked:  # the largest packed tensor, 4 members x 6 kept channels x 8 x 8 floats per sample: chunks of 3
        monkeypatch.setattr(packing_chunks, "CHUNK_BYTES", 3 * N * 6 * 8 * 8 * 4)
    model = SequenceFirst().eval()
    packed = mt.pack(model, torch.randn(10, 3, 8, 8), program="packed")
    assert ("in_chunks" in packed.code) is chunked
    dense = mt.pack(model, torch.randn(10, 3, 8, 8), program="dense")
    for batch in (1, 3, 7, 10):  # n·B is never the 36 positions: predict reads axis 0 of the sequence as no batch
        x = torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(batch))
        expected = mt.predict(model, x)
        assert expected["sequence"][0].shape == (36, N * batch, 12)
        assert_in_predicts_layout(packed(x), expected)
        assert_in_predicts_layout(dense(x), expected)
    member = mt.extract_member(model, 2, torch.randn(10, 3, 8, 8))
    x = torch.randn(7, 3, 8, 8)
    assert_in_predicts_layout(member(x), member_block(mt.predict(model, x), 2, 7))


@pytest.mark.verification_fallback
def test_the_whole_model_tiled_returns_predicts_layout_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where verification refuses every graph, the whole model runs tiled, its outputs chosen as predict's."""
    monkeypatch.setattr(_packing._Verifier, "mismatch", lambda self, packed: "refused for the test")
    model = SequenceFirst().eval()
    packed = mt.pack(model, torch.randn(6, 3, 8, 8), program="packed")
    assert packed.fallbacks[0].endswith("the whole model runs tiled")
    x = torch.randn(5, 3, 8, 8)
    expected = mt.predict(model, x)
    assert_in_predicts_layout(packed(x), expected)
    member = mt.extract_member(model, 1, torch.randn(6, 3, 8, 8))
    assert_in_predicts_layout(member(x), member_block(expected, 1, 5))
