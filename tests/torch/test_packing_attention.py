"""Attention folded into the heads: the members' q/k/v Linear outputs, side by side on the channels, run as one
attention with n times the heads, exactly as predict; operations that mix heads are left as fallbacks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import masksembles_torch as mt
from tests.torch import zoo

N = 4


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def bert(**layer: int | bool) -> nn.Module:
    torch.manual_seed(0)
    return mt.insert(zoo.Bert(**layer), N, 2.0, seed=0).eval()


def attention_fallbacks(packed: mt.PackedMasksembles) -> list[str]:
    return [name for name in packed.fallbacks if "layers." in name]


def check_equal_to_predict(model: nn.Module, packed: nn.Module) -> None:
    for batch in (5, 8):
        x = zoo.tokens(batch, seed=batch)
        assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5


@pytest.mark.parametrize("name", ["vit", "vit_fused"])
def test_zoo_vits_fold_their_attention_and_equal_predict(name: str) -> None:
    model = mt.insert(zoo.build(name), N, 2.0, seed=0).eval()
    packed = mt.pack(model, zoo.images(2), program="packed")
    assert not [name for name in packed.fallbacks if "attn" in name]
    for batch in (5, 8):
        x = zoo.images(batch, seed=batch)
        assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5
    member = mt.extract_member(model, 1, zoo.images(2))
    x = zoo.images(5)
    assert relative_error(member(x), mt.predict(model, x, N)[1]) <= 1e-5


def test_bert_with_a_padding_mask_folds_its_attention() -> None:
    """Separate query/key/value Linear layers viewed as (B, L, 2*4, d): the (B, 1, 1, L) mask broadcasts over the
    members' heads as it did over one member's; the packed code has no move to the member-stacked batch."""
    model = bert()
    packed = mt.pack(model, zoo.tokens(4), program="packed")
    assert attention_fallbacks(packed) == [] and "to_batch" not in packed.code
    assert "reshape([-1, 8, 8, 8])" in packed.code, "2 heads of 8 channels, for 4 members"
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    check_equal_to_predict(model, packed)
    for k in (0, N - 1):
        member = mt.extract_member(model, k, zoo.tokens(4))
        x = zoo.tokens(5, seed=5)
        assert relative_error(member(x), mt.predict(model, x, N)[k]) <= 1e-5


def test_grouped_query_attention_stays_exact() -> None:
    """Keys and values with 1 head repeated for 2 query heads: folded or not, the result equals predict."""
    model = bert(kv_heads=1)
    packed = mt.pack(model, zoo.tokens(4), program="packed")
    check_equal_to_predict(model, packed)


def test_talking_heads_mix_heads_and_do_not_fold() -> None:
    """A Linear over the heads of the attention weights mixes the members' heads if folded: the region stays a
    fallback on the member-stacked batch, as before, and equals predict."""
    model = bert(talking=True)
    packed = mt.pack(model, zoo.tokens(4), program="packed")
    assert any("softmax" in name for name in attention_fallbacks(packed))
    check_equal_to_predict(model, packed)


def test_multihead_attention_module_still_falls_back_exactly() -> None:
    model = mt.insert(zoo.build("vit_torch"), N, 2.0, seed=0).eval()
    packed = mt.pack(model, zoo.images(2), program="packed")
    assert any("MultiheadAttention" in name for name in packed.fallbacks)
    x = zoo.images(5)
    assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5
