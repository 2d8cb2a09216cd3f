"""Attention folded into the heads: the members' q/k/v Linear outputs, side by side on the channels, run as one
attention with n times the heads, exactly as predict; operations that mix heads are left as fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import masksembles_torch as mt
from tests.torch import zoo
from tests.torch.generated_models import Attention

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


class TokenAttention(nn.Module):
    """The token model the attention replicas below share: an embedding, q/k/v and output Linear layers of ``dim``
    (``heads`` heads, ``scaling`` the head size's inverse square root), a 2-class head, and ``split``: (B, L, dim) ->
    (B, heads, L, dim / heads)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.scaling = heads, (dim // heads) ** -0.5
        self.words = nn.Embedding(50, dim)
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.head = nn.Linear(dim, 2)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        return x.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)


class ScaledQuery(TokenAttention):
    """Whisper's and OPT's attention in ``transformers``: the query scaled right after its Linear layer,
    ``q_proj(x) * scaling``, before the heads split, and ``F.scaled_dot_product_attention(..., scale=1.0)``."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__(dim, heads)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.words(tokens)
        q, k, v = self.split(self.query(x) * self.scaling), self.split(self.key(x)), self.split(self.value(x))
        context = F.scaled_dot_product_attention(q, k, v, scale=1.0).transpose(1, 2).flatten(2)
        return self.head(self.out(context).mean(1))


def test_a_query_scaled_after_its_linear_layer_folds_into_the_heads() -> None:
    """The scaled query is computed per member like the Linear layer's output, and the region reads it in member
    blocks as it reads the key and value: the attention folds (before, it ran at full width on the member-stacked
    batch)."""
    torch.manual_seed(0)
    model = mt.insert(ScaledQuery(), N, 2.0, seed=0).eval()
    packed = mt.pack(model, zoo.tokens(4), program="packed")
    assert not [row for row in packed.fallbacks if "scaled_dot_product_attention" in row]
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    check_equal_to_predict(model, packed)
    member = mt.extract_member(model, 1, zoo.tokens(4))
    x = zoo.tokens(5, seed=5)
    assert relative_error(member(x), mt.predict(model, x, N)[1]) <= 1e-5


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


ATTENTION_STEPS = ("unflatten", "permute", "unbind", "scaled_dot_product_attention", "flatten", "Multihead")


def sequences(batch: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, zoo.SEQUENCE, 6, generator=generator)


def multihead(call: str, batch_first: bool = True, bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return mt.insert(zoo.Multihead(call, batch_first, bias), N, 2.0, seed=0).eval()


@pytest.mark.parametrize(
    ("call", "batch_first", "bias"),
    [("self", True, True), ("self", False, True), ("self", True, False), ("cross", True, True),
     ("cross", False, True), ("kdim", True, True), ("key_padding_mask", True, True),
     ("key_padding_mask", False, True), ("float_padding_mask", True, True), ("attn_mask", True, True),
     ("bool_attn_mask", True, True), ("bool_attn_mask", False, True), ("is_causal", True, True),
     ("is_causal", False, True), ("is_causal_weights", True, True), ("attn_and_padding_mask", True, True),
     ("attn_and_padding_mask", False, True), ("float_attn_and_padding_mask", True, True)],
    ids=["self", "sequence_first", "no_bias", "cross", "cross_sequence_first", "kdim_vdim", "padding",
         "padding_sequence_first", "float_padding", "float_attn_mask", "bool_attn_mask",
         "bool_attn_mask_sequence_first", "is_causal", "is_causal_sequence_first", "is_causal_weights",
         "attn_and_padding_mask",
         "attn_and_padding_mask_sequence_first", "float_attn_and_padding_mask"],
)  # fmt: skip
def test_multihead_attention_module_folds_into_heads(call: str, batch_first: bool, bias: bool) -> None:
    """``nn.MultiheadAttention`` is written out as its projections, heads and scaled dot-product attention with the
    masks merged as torch merges them (a key padding mask as SDPA's (B, 1, 1, S) mask; a (L, S) attention mask
    additive, broadcast over the batch and heads, plus the padding mask; the causal hint as SDPA's where torch uses
    it), which fold: nothing of it runs on the member-stacked batch, and it equals predict."""
    model = multihead(call, batch_first, bias)
    packed = mt.pack(model, sequences(4), program="packed")
    assert not any(what in name for name in packed.fallbacks for what in ATTENTION_STEPS)
    assert (packed.fallbacks == ()) is ("padding" not in call), "the padding mask alone, computed once (shared)"
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    assert "to_batch" not in packed.code
    assert ("is_causal = True" in packed.code) is (call == "is_causal"), "the hint without padding mask or weights"
    for batch in (5, 8):
        x = sequences(batch, seed=batch)
        assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5
    member = mt.extract_member(model, 2, sequences(4))
    x = sequences(5, seed=1)
    assert relative_error(member(x), mt.predict(model, x, N)[2]) <= 1e-5


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_multihead_attention_with_a_per_head_mask_folds_with_the_mask_repeated_for_every_member(
    batch_first: bool,
) -> None:
    """A (B * heads, L, S) attention mask is written out as (B, heads, L, S): each head has its own rows, computed
    from the tokens alone (the same for every member), so it is repeated once per member along the heads and the
    attention folds (before, it ran on the member-stacked batch); it equals predict and each member."""
    model = multihead("per_sample_mask", batch_first)
    packed = mt.pack(model, sequences(4), program="packed")
    assert not [row for row in packed.fallbacks if "scaled_dot_product_attention" in row or "Multihead" in row]
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    assert ".repeat([1, 4, 1, 1])" in str(packed.code)
    for batch in (5, 8):
        x = sequences(batch, seed=batch)
        assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5
    for k in (0, N - 1):
        member = mt.extract_member(model, k, sequences(4))
        x = sequences(5, seed=1)
        assert relative_error(member(x), mt.predict(model, x, N)[k]) <= 1e-5


@pytest.mark.parametrize("call", ["weights", "bias_kv"])
def test_multihead_attention_module_with_weights_or_key_bias_falls_back_exactly(call: str) -> None:
    """A call that reads the attention weights or adds key/value biases is kept as one call: a fallback on the
    member-stacked batch, equal to predict."""
    model = multihead(call)
    packed = mt.pack(model, sequences(4), program="packed")
    assert "attention (MultiheadAttention)" in packed.fallbacks
    for batch in (5, 8):
        x = sequences(batch, seed=batch)
        assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5


def test_a_torchvision_vit_folds_its_attention_and_shares_the_first_block() -> None:
    """torchvision's EncoderBlock: the first block's attention reads no mask, so it runs once on the batch for every
    member (listed as fallbacks, its attention counted once); the second one folds."""
    model = mt.insert(zoo.build("vit_torch"), N, 2.0, seed=0).eval()
    packed = mt.pack(model, zoo.images(2), program="packed")
    assert not any("MultiheadAttention" in name or "blocks.1" in name for name in packed.fallbacks)
    assert any(name.startswith("blocks.0.self_attention: scaled_dot_product_attention") for name in packed.fallbacks)
    tokens, width = 17, 16
    assert packed.macs["fallback"] == 2 * tokens * tokens * width, "the first block's attention products, once"
    x = zoo.images(5)
    assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5


class AcrossTheBatch(nn.Module):
    """``nn.MultiheadAttention`` on an unbatched (B, 16) tensor: attention across the samples of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pre = nn.Linear(6, 16), nn.Linear(16, 16)
        self.attention, self.out = nn.MultiheadAttention(16, 2), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(torch.relu(self.embed(x)))
        return self.out(self.attention(h, h, h, need_weights=False)[0])


def test_multihead_attention_across_the_batch_stays_one_call_per_member() -> None:
    """Unbatched inputs ((L, E), the batch as the tokens) are not written out: the call runs per member, as the
    dense model's batch holds every member's copy."""
    torch.manual_seed(0)
    model = mt.insert(AcrossTheBatch(), N, 2.0, seed=0).eval()
    packed = mt.pack(model, torch.randn(4, 6), program="packed")
    assert "attention (MultiheadAttention)" in packed.fallbacks
    for batch in (4, 8):
        x = torch.randn(batch, 6)
        assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5


class EagerAttention(TokenAttention):
    """Hugging Face's eager attention function on a token model: q, k, v Linear layers, ``matmul(q, k^T) *
    scaling``, a causal + padding mask sliced to the keys and added, ``softmax(dim=-1, dtype=float32).to(q.dtype)``,
    dropout by ``training``, ``matmul(weights, v)``. ``variant`` writes it so that a fused call would differ or
    could not stand in: the weights also read by the output, the mask added before the scale, a softmax over the
    queries."""

    def __init__(self, variant: str = "", dim: int = 16, heads: int = 2, length: int = 8) -> None:
        super().__init__(dim, heads)
        self.variant = variant
        causal = torch.full((length, length), -1e4).triu(1)
        self.register_buffer("causal", causal[None, None])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.words(tokens)
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        mask = self.causal + (tokens == 0)[:, None, None, :].float() * -1e4
        mask = mask[:, :, :, : k.shape[-2]]
        if self.variant == "mask_before_scale":
            weights = (torch.matmul(q, k.transpose(2, 3)) + mask) * self.scaling
        else:
            weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling + mask
        weights = F.softmax(weights, dim=-2 if self.variant == "softmax_over_queries" else -1, dtype=torch.float32)
        weights = F.dropout(weights.to(q.dtype), p=0.1, training=self.training)
        context = torch.matmul(weights, v).transpose(1, 2).flatten(2)
        out = self.out(context)
        if self.variant == "weights_read":
            out = out + weights.mean((1, 3))[..., None]
        return self.head(out.mean(1))


def fused_calls(packed: nn.Module) -> int:
    return str(packed.code).count("scaled_dot_product_attention(")


@pytest.mark.parametrize("name", ["bert", "timm_vit", "eager"])
def test_attention_written_out_runs_as_one_fused_call_equal_to_predict(name: str) -> None:
    """BERT's ``q @ k^T / sqrt(d) + mask``, timm's ``(q * scale) @ k^T`` and Hugging Face's eager function (casts,
    a sliced causal mask, functional dropout) each become one ``F.scaled_dot_product_attention`` call in the packed
    program and in a member's: no softmax is left, and the results equal predict. BERT's and timm's attention are
    folded into the heads; the eager one runs on the member-stacked batch (its mask is sliced by ``k.shape``)."""
    torch.manual_seed(0)
    if name == "timm_vit":
        model, example = mt.insert(zoo.build("vit"), N, 2.0, seed=0).eval(), zoo.images
        layers = sum(isinstance(m, zoo.Attention) for m in model.modules())
    else:
        model = bert() if name == "bert" else mt.insert(EagerAttention(), N, 2.0, seed=0).eval()
        example, layers = zoo.tokens, 2 if name == "bert" else 1
    packed = mt.pack(model, example(4), program="packed")
    member = mt.extract_member(model, 2, example(4))
    for program in (packed, member):
        assert fused_calls(program) == layers and "softmax" not in str(program.code)
    assert attention_fallbacks(packed) == []
    for batch in (5, 8):
        x = example(batch, seed=batch)
        expected = mt.predict(model, x, N)
        assert relative_error(packed(x), expected) <= 1e-5
        assert relative_error(member(x), expected[2]) <= 1e-5


@pytest.mark.parametrize("variant", ["weights_read", "mask_before_scale", "softmax_over_queries"])
def test_attention_a_fused_call_would_change_stays_written_out(variant: str) -> None:
    torch.manual_seed(0)
    model = mt.insert(EagerAttention(variant), N, 2.0, seed=0).eval()
    packed = mt.pack(model, zoo.tokens(4), program="packed")
    assert fused_calls(packed) == 0 and "softmax" in str(packed.code)
    for batch in (5, 8):
        x = zoo.tokens(batch, seed=batch)
        assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5


class QueryScaledBySize(nn.Module):
    """Single-head attention whose query is scaled before the product, the factor first:
    ``(q.shape[-1] ** -0.5 * q) @ k^T``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(channels, 3 * channels), nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(((q.shape[-1] ** -0.5 * q) @ k.transpose(-2, -1)).softmax(-1) @ v)


class TwoWrittenAttentions(nn.Module):
    """Two single-head attentions scaled by ``q.shape[-1] ** -0.5`` (a size read at run time), the scores in the
    first, the query in the second; a mean over the tokens and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.head = Attention(16), QueryScaledBySize(16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)).mean(1))


def test_a_scale_read_from_the_sizes_is_computed_as_the_model_computes_it() -> None:
    """The fused call's ``scale`` is the size expression itself, not the number it had on the example: other sequence
    lengths and a dynamic batch under ``torch.export`` give predict's values."""
    torch.manual_seed(0)
    model = mt.insert(TwoWrittenAttentions(), N, 2.0, seed=0).eval()
    packed = mt.pack(model, torch.randn(5, 7, 16), program="packed")
    assert fused_calls(packed) == 2 and "softmax" not in str(packed.code) and "** -0.5" in str(packed.code)
    for batch, length in ((3, 9), (8, 7)):
        x = torch.randn(batch, length, 16, generator=torch.Generator().manual_seed(batch))
        assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5
    exported = torch.export.export(packed, (torch.randn(8, 7, 16),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    x = torch.randn(6, 7, 16)
    assert relative_error(exported.module()(x), mt.predict(model, x, N)) <= 1e-5


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryAttention(nn.Module):
    """Llama's attention written by hand: q/k/v Linear layers, heads by view + transpose, rotary position embeddings
    (cos/sin of the positions, (L, d), shared by every head and sample; ``rotate_half`` slices, negates and
    concatenates the head dimension), keys and values with fewer heads repeated for the query heads (grouped-query
    attention) as ``repeat_kv`` (``k[:, :, None].expand(...).reshape(...)``), ``repeat_interleave`` or SDPA's
    ``enable_gqa``, a causal + padding mask. ``"rotary_on_some_heads"``: the rotation only on the first query heads
    (a slice of the heads axis, as models that mix heads with and without positions do), which must not fold."""

    def __init__(self, grouping: str = "repeat_kv", dim: int = 16, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.grouping, self.heads, self.kv_heads, self.head_dim = grouping, heads, kv_heads, dim // heads
        self.words = nn.Embedding(50, dim)
        self.query, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.key, self.value = (nn.Linear(dim, kv_heads * self.head_dim) for _ in range(2))
        self.head = nn.Linear(dim, 2)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2) / self.head_dim))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, -1, self.head_dim).transpose(1, 2)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.heads // self.kv_heads
        if self.grouping == "repeat_interleave":
            return x.repeat_interleave(groups, dim=1)
        batch, heads, length, size = x.shape
        return x[:, :, None, :, :].expand(batch, heads, groups, length, size).reshape(batch, -1, length, size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.words(tokens)
        positions = torch.arange(tokens.shape[1])
        angles = positions[:, None].float() * self.inv_freq
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        if self.grouping == "rotary_on_some_heads":
            rotated = q[:, : self.heads // 2]
            q = torch.cat((rotated * cos + rotate_half(rotated) * sin, q[:, self.heads // 2 :]), dim=1)
        else:
            q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        mask = (positions[None, :] <= positions[:, None]) & (tokens != 0)[:, None, None, :]
        if self.grouping == "enable_gqa":
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            context = F.scaled_dot_product_attention(q, self.grouped(k), self.grouped(v), attn_mask=mask)
        return self.head(self.out(context.transpose(1, 2).flatten(2)).mean(1))


def check_attention_folds_and_equals_predict(model: nn.Module, folds: bool) -> None:
    """Packed, the attention runs folded (nothing of it on the member-stacked batch) or not, as ``folds`` says;
    other batches and paddings, and a member alone, equal predict."""
    packed = mt.pack(model, zoo.tokens(4), program="packed")
    attention = [row for row in packed.fallbacks if row.startswith("scaled_dot_product_attention ")]
    assert (packed.macs["fallback"] == 0) is folds and (attention == []) is folds, packed.fallbacks
    assert packed.macs["packed"] < packed.macs["dense"]
    check_equal_to_predict(model, packed)
    member = mt.extract_member(model, 1, zoo.tokens(4))
    x = zoo.tokens(5, seed=5)
    assert relative_error(member(x), mt.predict(model, x, N)[1]) <= 1e-5


@pytest.mark.parametrize("grouping", ["repeat_kv", "repeat_interleave", "enable_gqa"])
def test_rotary_grouped_query_attention_folds_into_the_heads(grouping: str) -> None:
    """The cos/sin (L, d) broadcast over every member's heads; ``rotate_half``'s slices and concatenation of the head
    dimension, the keys' heads repeated for their query heads (within each member's block) and SDPA's
    ``enable_gqa`` (query head i*Hq + h reads key head i*Hkv + h // (Hq / Hkv)) keep the members apart: the attention
    folds (before, it ran at full width on the member-stacked batch)."""
    torch.manual_seed(0)
    model = mt.insert(RotaryAttention(grouping), N, 2.0, seed=0).eval()
    check_attention_folds_and_equals_predict(model, folds=True)


def test_rotary_on_a_slice_of_the_heads_does_not_fold() -> None:
    """``q[:, :2]`` takes the first two of a member's four heads (folded: of every member's block), but the
    rotated heads concatenated with the others along the heads axis would interleave the members' blocks: the region
    stays on the member-stacked batch, and equals predict."""
    torch.manual_seed(0)
    model = mt.insert(RotaryAttention("rotary_on_some_heads"), N, 2.0, seed=0).eval()
    check_attention_folds_and_equals_predict(model, folds=False)


class BiasedAttention(TokenAttention):
    """T5's and BEiT's relative position bias: a table of one bias per head and bucket (an ``nn.Embedding``), read
    at each (query, key) pair's clipped relative distance and moved to (1, heads, L, L), plus the padding mask, given
    to SDPA as its additive mask (``"sdpa"``) or added to the scores written out (``"eager"``: fused into one SDPA
    call). ``"per_sample"``: the bias also scaled by each sample's position in the batch (``arange(B)``), which
    differs between the member-stacked batch and the batch, so it must not be shared by the members' heads."""

    def __init__(self, variant: str = "sdpa", dim: int = 16, heads: int = 2, length: int = 8) -> None:
        super().__init__(dim, heads)
        self.variant = variant
        self.table = nn.Embedding(9, heads)
        positions = torch.arange(length)
        self.register_buffer("buckets", (positions[None, :] - positions[:, None]).clamp(-4, 4) + 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.words(tokens)
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        bias = self.table(self.buckets).permute(2, 0, 1)[None] + (tokens == 0)[:, None, None, :].float() * -1e4
        if self.variant == "per_sample":
            bias = bias * (1 + torch.arange(tokens.shape[0]) % 2)[:, None, None, None]
        if self.variant == "eager":
            weights = (torch.matmul(q, k.transpose(-1, -2)) * self.scaling + bias).softmax(-1)
            context = torch.matmul(weights, v)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scaling)
        return self.head(self.out(context.transpose(1, 2).flatten(2)).mean(1))


@pytest.mark.parametrize("variant", ["sdpa", "eager"])
def test_a_per_head_position_bias_is_repeated_for_every_members_heads(variant: str) -> None:
    """The (B, heads, L, L) bias, the same for every member (computed from the tokens and the table alone), is
    repeated once per member along the heads, members outermost as the fold lays them: the attention folds."""
    torch.manual_seed(0)
    model = mt.insert(BiasedAttention(variant), N, 2.0, seed=0).eval()
    check_attention_folds_and_equals_predict(model, folds=True)
    assert ".repeat([1, 4, 1, 1])" in str(mt.pack(model, zoo.tokens(4), program="packed").code)


def test_a_per_head_bias_that_differs_between_the_members_does_not_fold() -> None:
    """A bias that reads each sample's place in the batch runs per member on the member-stacked batch: no one bias
    serves every member's heads, so the attention runs there too, and equals predict."""
    torch.manual_seed(0)
    model = mt.insert(BiasedAttention("per_sample"), N, 2.0, seed=0).eval()
    check_attention_folds_and_equals_predict(model, folds=False)


class WhereMaskedAttention(TokenAttention):
    """GPT-Neo's attention: q/k/v Linear layers, scores written out, ``torch.where(causal, scores, min)`` with a
    (1, 1, L, L) boolean buffer, then the padding mask, softmax and the product with v.
    ``"per_sample"``: the condition also reads each sample's place in the batch (``arange(B)``), so it differs
    between the member-stacked batch and the batch and must not be shared by the members' heads."""

    def __init__(self, variant: str = "causal", dim: int = 16, heads: int = 2, length: int = 8) -> None:
        super().__init__(dim, heads)
        self.variant = variant
        self.register_buffer("causal", torch.ones(length, length, dtype=torch.bool).tril()[None, None])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.words(tokens)
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2))
        keep = self.causal
        if self.variant == "per_sample":
            keep = keep | (torch.arange(tokens.shape[0]) % 2 == 0)[:, None, None, None]
        scores = torch.where(keep, scores, torch.finfo(torch.float32).min)
        weights = (scores + (tokens == 0)[:, None, None, :].float() * -1e4).softmax(-1)
        return self.head(self.out(torch.matmul(weights, v).transpose(1, 2).flatten(2)).mean(1))


@pytest.mark.parametrize(("variant", "folds"), [("causal", True), ("per_sample", False)])
def test_a_where_with_a_mask_shared_by_the_members_folds(variant: str, folds: bool) -> None:
    """``torch.where`` takes each element from its own place: with a condition (and fill value) 1 on the heads and
    the same for every member, it folds like an additive mask (before, it ran at full width on the member-stacked
    batch); a condition that differs between the members keeps the attention there. Both equal predict."""
    torch.manual_seed(0)
    model = mt.insert(WhereMaskedAttention(variant), N, 2.0, seed=0).eval()
    packed = mt.pack(model, zoo.tokens(4), program="packed")
    assert (packed.macs["fallback"] == 0) is folds, packed.fallbacks
    assert any(row.startswith("where ") for row in packed.fallbacks) is not folds
    check_equal_to_predict(model, packed)
    member = mt.extract_member(model, 1, zoo.tokens(4))
    x = zoo.tokens(5, seed=5)
    assert relative_error(member(x), mt.predict(model, x, N)[1]) <= 1e-5
