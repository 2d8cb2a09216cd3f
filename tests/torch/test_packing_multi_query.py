"""Multi-query attention (Falcon's: one key/value head that every query head reads) folded into the heads: the
members' fused qkv outputs side by side hold (H + 2) heads per member; the query/key/value split takes the same heads
of every member's block, and the attention runs with ``enable_gqa`` (member i's query heads read member i's one
key/value head), exactly as predict. A key that mixes the heads stays a fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import masksembles_torch as mt
from tests.torch import zoo
from tests.torch.packing_checks import check_equal_to_predict, check_member_equal_to_predict, program_code

N = 4


class MultiQueryAttention(nn.Module):
    """``transformers``' ``FalconAttention`` with ``multi_query=True`` (no alibi, no rotary): one fused Linear to
    (heads + 2) heads, viewed (B, L, heads + 2, d), split ``[..., :-2, :]``, ``[..., [-2], :]``, ``[..., [-1], :]``,
    causal ``F.scaled_dot_product_attention`` broadcasting the one key/value head, a dense Linear. With
    ``mixed_key`` the key is the mean of the query heads instead (it mixes the heads)."""

    def __init__(self, dim: int = 16, heads: int = 4, mixed_key: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.mixed_key = heads, dim // heads, mixed_key
        self.query_key_value = nn.Linear(dim, (heads + 2) * self.head_dim)
        self.dense = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        fused = self.query_key_value(x)
        batch, length, _ = fused.shape
        fused = fused.view(batch, length, self.heads + 2, self.head_dim)
        query, key, value = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        if self.mixed_key:
            key = query.mean(2, keepdim=True)
        query = query.transpose(1, 2).reshape(batch, self.heads, length, self.head_dim)
        key = key.transpose(1, 2).reshape(batch, 1, length, self.head_dim)
        value = value.transpose(1, 2).reshape(batch, 1, length, self.head_dim)
        context = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.dense(context.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class Falcon(nn.Module):
    """Token embeddings, one pre-norm multi-query block and a classifier over the mean token."""

    def __init__(self, mixed_key: bool = False, dim: int = 16) -> None:
        super().__init__()
        self.words, self.norm = nn.Embedding(50, dim), nn.LayerNorm(dim)
        self.attention, self.head = MultiQueryAttention(dim, mixed_key=mixed_key), nn.Linear(dim, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.words(tokens)
        x = x + self.attention(self.norm(x))
        return self.head(x.mean(1))


def built(mixed_key: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return mt.insert(Falcon(mixed_key), N, 2.0, seed=0).eval()


def attention_fallbacks(packed: mt.PackedMasksembles) -> list[str]:
    return [row for row in packed.fallbacks if "attention" in row]


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_multi_query_attention_folds_into_the_heads(capture: str) -> None:
    """Nothing of the attention falls back (before: the split of the fused heads and everything after it, the
    attention's products counted in ``macs["fallback"]``); the program equals predict."""
    model = built()
    x = zoo.tokens(4)
    packed = mt.pack(model, x if capture == "fx" else (x,), program="packed")
    assert attention_fallbacks(packed) == [], packed.fallbacks
    code = program_code(packed)
    assert "index_members" in code and "enable_gqa = True" in code and "to_batch" not in code
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    check_equal_to_predict(model, packed, lambda batch: zoo.tokens(batch, seed=batch), N)
    if capture == "fx":
        check_member_equal_to_predict(model, zoo.tokens(5, seed=5), N)


def test_a_key_that_mixes_the_heads_does_not_fold() -> None:
    """The key as the mean of the query heads reads every head of the member's block: folded, it would read the
    other members' heads too. The attention runs at full width on the member-stacked batch, equal to predict."""
    model = built(mixed_key=True)
    packed = mt.pack(model, zoo.tokens(4), program="packed")
    assert attention_fallbacks(packed) and packed.macs["fallback"] > 0
    assert "enable_gqa = True" not in program_code(packed)
    check_equal_to_predict(model, packed, lambda batch: zoo.tokens(batch, seed=batch), N)
