"""torch's own ``nn.TransformerEncoder``: its fused inference path calls none of the dropouts that
``convert_dropout`` turns into Masksembles, so the conversion turns that path off and checks at run time that every
converted layer is called as ``predict`` runs the model; ``pack`` equals ``predict`` on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import masksembles_torch as mt
from masksembles_core.insertion import CONVERTED, LEFT
from masksembles_torch import _surgery

N = 4


class TextEncoder(nn.Module):
    """Token ids (B, L) -> embedding -> ``nn.TransformerEncoder`` (batch first, 2 layers; with ``padding``, id 0
    left out of the attention by ``src_key_padding_mask``) -> mean -> Linear."""

    def __init__(self, norm_first: bool = False, padding: bool = False) -> None:
        super().__init__()
        self.padding = padding
        self.embed = nn.Embedding(50, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True, norm_first=norm_first)
        # nested tensors on (the default) where torch allows them
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=not norm_first)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        padding = ids == 0 if self.padding else None  # id 0 left out of the attention
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=padding).mean(1))


def ids(batch: int, seed: int = 0) -> torch.Tensor:
    """(batch, 6) token ids in [0, 50); the first never 0, so that no sequence is all padding."""
    drawn = torch.randint(0, 50, (batch, 6), generator=torch.Generator().manual_seed(seed))
    return torch.cat([drawn[:, :1].clamp_min(1), drawn[:, 1:]], 1)


def fused_paths_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Masksembles layers made without their hook and encoders left nesting: torch's fused paths then skip them."""
    monkeypatch.setattr(_surgery, "keep_masks_off_fused_paths", lambda model: None)
    monkeypatch.setattr(mt.Masksembles, "register_forward_pre_hook", lambda self, hook: None)


def converted(norm_first: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return mt.convert_dropout(TextEncoder(norm_first), ids(4), N, 2.0, seed=0)


def members_differ_as_unfused(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``predict(model, x)``, asserting that the members differ (the masks are applied) and equal what torch's
    unfused path computes (its fused attention paths switched off for the call)."""
    members = mt.predict(model, x, N)
    assert members.std(0).max() > 1e-3, "masks applied: the members differ"
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        unfused = mt.predict(model, x, N)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    torch.testing.assert_close(members, unfused)
    return members


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_converted_transformer_encoder_applies_its_masks_at_inference(norm_first: bool) -> None:
    """The members differ under predict (eval, no gradients), and equal what the unfused path computes."""
    model = converted(norm_first)
    rows = {row.path: row.action for row in model.masksembles_report.rows}
    assert [path for path, action in rows.items() if action == CONVERTED] == [
        f"encoder.layers.{i}.{name}" for i in range(2) for name in ("dropout", "dropout1", "dropout2")
    ]
    x = ids(5, seed=1)
    members_differ_as_unfused(model, x)


@pytest.mark.parametrize("padding", [False, True], ids=["plain", "padding_mask"])
def test_pack_writes_a_converted_transformer_encoder_out_and_equals_predict(padding: bool) -> None:
    """The encoder and its layers are written out: the second layer's attention folds (the first one's reads no
    mask and runs once), its Linear layers compact, and the result equals predict."""
    torch.manual_seed(0)
    model = mt.convert_dropout(TextEncoder(padding=padding), ids(4), N, 2.0, seed=0)
    packed = mt.pack(model, ids(4), program="packed")
    second = [name for name in packed.fallbacks if "layers.1" in name]
    assert not [name for name in second if "scaled_dot_product_attention" in name or "permute" in name]
    assert len(second) == (2 if padding else 0), "the padding mask's operations (computed once) alone"
    assert packed.macs["packed"] < 0.8 * packed.macs["dense"]
    for batch in (5, 8):
        x = ids(batch, seed=batch)
        torch.testing.assert_close(packed(x), mt.predict(model, x, N), rtol=1e-5, atol=1e-6)


def test_a_converted_layer_that_inference_skips_is_put_back_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without turning the fused path off, the run-time check finds the converted layers uncalled: the dropouts are
    put back, each reported with the reason, and the head's dropout alone is converted."""
    fused_paths_on(monkeypatch)

    class WithHead(TextEncoder):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.drop(self.encoder(self.embed(ids)).mean(1)))

    torch.manual_seed(0)
    model = mt.convert_dropout(WithHead(), ids(4), N, 2.0, seed=0)
    rows = {row.path: row for row in model.masksembles_report.rows}
    assert rows["drop"].action == CONVERTED and isinstance(model.drop, mt.Masksembles)
    inner = rows["encoder.layers.0.dropout1"]
    assert (inner.action, inner.reason) == (LEFT, _surgery.SKIPPED_AT_INFERENCE)
    assert type(model.encoder.layers[0].dropout1) is nn.Dropout
    with pytest.raises(ValueError, match="converted no dropout"):
        mt.convert_dropout(TextEncoder(), ids(4), N, 2.0, seed=0)


def inserted(**options: object) -> nn.Module:
    torch.manual_seed(0)
    return mt.insert(TextEncoder(), N, 2.0, seed=0, **options)


def test_insert_masks_the_feed_forward_of_transformer_encoder_layers() -> None:
    """``linear1`` and ``linear2`` are called by the layer's unfused path, which it then takes: masked; the
    attention's ``out_proj`` (its weights read by ``nn.MultiheadAttention``) is left alone."""
    model = inserted(example_input=ids(4))
    rows = {row.path: row for row in model.masksembles_report.rows}
    assert [path for path, row in rows.items() if row.action != LEFT] == [
        "encoder.layers.0.linear1", "encoder.layers.0.linear2", "encoder.layers.1.linear1", "encoder.layers.1.linear2",
        "head",
    ]  # fmt: skip
    assert "part of MultiheadAttention" in rows["encoder.layers.0.self_attn.out_proj"].reason
    x = ids(5, seed=1)
    members = members_differ_as_unfused(model, x)
    packed = mt.pack(model, ids(4), program="packed")
    assert not [name for name in packed.fallbacks if "layers.1" in name], "the second layer compacts and folds"
    torch.testing.assert_close(packed(x), members, rtol=1e-5, atol=1e-6)


def test_insert_leaves_layers_that_inference_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without turning the fused path off, the run on ``example_input`` finds the fused path reading the
    feed-forward layers' weights through their wrappers (the first layer) and not calling them: each is left alone
    with its reason, and the head keeps its masks."""
    fused_paths_on(monkeypatch)
    model = inserted(example_input=ids(4))
    rows = {row.path: row for row in model.masksembles_report.rows}
    assert [path for path, row in rows.items() if row.action != LEFT] == ["head"]
    reasons = {rows[f"encoder.layers.{i}.{name}"].reason for i in range(2) for name in ("linear1", "linear2")}
    assert any("weight" in reason for reason in reasons), reasons


class ScaledFeedForwardLayer(nn.TransformerEncoderLayer):
    """A layer that changes a block of torch's: its call computes something other than torch's layer."""

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * super()._ff_block(x)


class ScaledTextEncoder(TextEncoder):
    def __init__(self) -> None:
        super().__init__()
        layer = ScaledFeedForwardLayer(16, 4, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_an_encoder_layer_kept_as_one_call_with_masks_inside_runs_per_member() -> None:
    """A subclass that changes a block of torch's layer is not written out (the encoder around it is): each layer
    stays one call. Its input is the same for every member, but the masks inside group the batch it is given: it
    runs on the member-stacked batch, as the dense model does, and equals predict with no verification fallback."""
    torch.manual_seed(0)
    model = mt.convert_dropout(ScaledTextEncoder(), ids(4), N, 2.0, seed=0)
    packed = mt.pack(model, ids(4), program="packed")
    layers = [f"encoder.layers.{i} (ScaledFeedForwardLayer)" for i in range(2)]
    assert [name for name in packed.fallbacks if "encoder" in name] == layers
    for batch in (5, 8):
        x = ids(batch, seed=batch)
        torch.testing.assert_close(packed(x), mt.predict(model, x, N), rtol=1e-5, atol=1e-6)


class GPT(nn.Module):
    """A "GPT from scratch": token ids (B, L) -> token embeddings plus the position table sliced to L (a parameter
    indexed with a size of the input) -> ``nn.TransformerEncoder`` (batch first, pre-norm, 2 layers) called with
    the causal mask -> LayerNorm -> next-token logits (B, L, 50).

    ``call``: ``"hint"`` (the additive mask of ``generate_square_subsequent_mask`` and ``is_causal=True``),
    ``"detected"`` (a boolean mask, True above the diagonal, and no hint: torch detects it), ``"padding"`` (the
    boolean mask with the hint, and id 0 left out of the attention by ``src_key_padding_mask``: torch merges the
    masks)."""

    def __init__(self, call: str) -> None:
        super().__init__()
        self.call = call
        self.embed, self.position = nn.Embedding(50, 16), nn.Parameter(torch.randn(1, 6, 16) * 0.1)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=False)
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        x = self.embed(ids) + self.position[:, : ids.shape[1]]
        if self.call == "hint":
            x = self.encoder(x, mask=causal, is_causal=True)
        elif self.call == "detected":
            x = self.encoder(x, mask=causal.isinf())
        else:
            x = self.encoder(x, mask=causal.isinf(), src_key_padding_mask=ids == 0, is_causal=True)
        return self.head(x)


def with_masks(model: nn.Module, placed: str) -> nn.Module:
    """Masksembles placed by ``insert`` (its defaults: before every Linear but the first) or by ``convert_dropout``."""
    if placed == "insert":
        return mt.insert(model, N, 2.0, seed=0).eval()
    return mt.convert_dropout(model, ids(4), N, 2.0, seed=0)


def attention_step(fallback: str) -> bool:
    """A fallback of an attention's own operations (not of its masks, which run once)."""
    return any(step in fallback for step in ("unflatten", "permute", "unbind", "scaled_dot_product", "flatten"))


def check_pack_and_members(model: nn.Module) -> mt.PackedMasksembles:
    """``pack`` (``"packed"`` and ``"auto"``) and ``extract_member`` equal predict at batches that do and do not
    divide n; the members differ. Returns the packed program."""
    packed = mt.pack(model, ids(4), program="packed")
    chosen = mt.pack(model, ids(4))
    for batch in (5, 8):
        x = ids(batch, seed=batch)
        members = mt.predict(model, x, N)
        assert members.std(0).max() > 1e-3, "masks applied: the members differ"
        torch.testing.assert_close(packed(x), members, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chosen(x), members, rtol=1e-5, atol=1e-5)
    x = ids(5, seed=1)
    for k in (0, N - 1):
        member = mt.extract_member(model, k, ids(4))
        torch.testing.assert_close(member(x), mt.predict(model, x, N)[k], rtol=1e-5, atol=1e-5)
    return packed


@pytest.mark.parametrize("call", ["hint", "detected", "padding"])
@pytest.mark.parametrize("placed", ["insert", "convert_dropout"])
def test_a_causal_transformer_encoder_is_written_out_and_its_attention_folds(placed: str, call: str) -> None:
    """GPT: the encoder called with a causal mask is written out, its attention with the mask (and padding mask) as
    ``F.multi_head_attention_forward`` merges them. The second layer's attention folds into the heads (the first
    one's reads no Masksembles layer: it runs once for every member, its attention products the only fallback
    multiply-adds; the masks' operations run once too), and the program equals predict."""
    torch.manual_seed(0)
    model = with_masks(GPT(call), placed)
    packed = check_pack_and_members(model)
    assert not [name for name in packed.fallbacks if "(Transformer" in name or "(Multihead" in name]
    assert not [name for name in packed.fallbacks if "layers.1" in name and attention_step(name)]
    tokens, width = 6, 16
    assert packed.macs["fallback"] == 2 * tokens * tokens * width, "the first layer's attention products, once"
    assert packed.macs["packed"] < 0.75 * packed.macs["dense"]


class Translator(nn.Module):
    """Token ids (B, L) -> embedding -> ``nn.TransformerEncoder`` (the memory, with a padding mask) and
    ``nn.TransformerDecoder`` (batch first, 2 layers, a final norm) on the reversed tokens with the causal
    ``tgt_mask`` (and hint) and the padding mask on the memory -> Linear."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        encoder = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(encoder, 2, enable_nested_tensor=False)
        decoder = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.1, batch_first=True, norm_first=norm_first)
        self.decoder = nn.TransformerDecoder(decoder, 2, norm=nn.LayerNorm(16))
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        padding = ids == 0
        memory = self.encoder(self.embed(ids), src_key_padding_mask=padding)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        target = self.embed(ids.flip(1))
        decoded = self.decoder(target, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=padding)
        return self.head(decoded)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("placed", ["insert", "convert_dropout"])
def test_a_transformer_decoder_is_written_out_and_its_attention_folds(placed: str, norm_first: bool) -> None:
    """The decoder and its layers are written out: self-attention with the causal mask, attention on the encoder's
    memory with its padding mask, the feed-forward; from the second layers on every attention folds, and the program
    equals predict. The first encoder and decoder layers' self-attention reads no Masksembles layer: it runs once for
    every member. With ``insert`` (the attention's ``out_proj`` left alone) the first decoder layer's attention on
    the memory has queries the same for every member and keys and values that differ: it runs per member."""
    torch.manual_seed(0)
    model = with_masks(Translator(norm_first), placed)
    if placed == "insert":
        rows = {row.path: row.action for row in model.masksembles_report.rows}
        assert all(rows[f"decoder.layers.{i}.{name}"] != LEFT for i in range(2) for name in ("linear1", "linear2"))
    packed = check_pack_and_members(model)
    assert not [name for name in packed.fallbacks if "(Transformer" in name or "(Multihead" in name]
    assert not [name for name in packed.fallbacks if "layers.1" in name and attention_step(name)]
    tokens, width = 6, 16
    products = 2 * tokens * tokens * width
    assert packed.macs["fallback"] == (2 + (N if placed == "insert" else 0)) * products
    assert packed.macs["packed"] < 0.75 * packed.macs["dense"]


def test_a_packed_transformer_encoder_exports_and_compiles_with_a_dynamic_batch() -> None:
    torch.manual_seed(0)
    model = mt.convert_dropout(TextEncoder(padding=True), ids(4), N, 2.0, seed=0)
    packed = mt.pack(model, ids(4), program="packed")
    batch = torch.export.Dim("batch", min=2)
    exported = torch.export.export(packed, (ids(4),), dynamic_shapes=({0: batch},)).module()
    compiled = torch.compile(packed, fullgraph=True, dynamic=True)
    for samples in (3, 5):
        x = ids(samples, seed=samples)
        expected = mt.predict(model, x, N)
        torch.testing.assert_close(exported(x), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-6)


def by_hand(padding: bool = False) -> nn.Module:
    """Masksembles layers set as each encoder layer's ``dropout1`` by hand (no insert/convert_dropout), in eval."""
    torch.manual_seed(0)
    model = TextEncoder(padding=padding).eval()
    for index, layer in enumerate(model.encoder.layers):
        layer.dropout1 = mt.Masksembles(16, N, 2.0, seed=index, channel_axis=-1)
    return model


def test_masks_placed_by_hand_in_an_encoder_layer_apply_however_the_model_is_called() -> None:
    """The layers' hooks keep torch's fused path off: the model called directly on a tiled batch in eval without
    gradients gives predict's members, which differ and equal torch's unfused path; pack equals predict."""
    model = by_hand()
    x = ids(5, seed=1)
    with torch.no_grad():
        direct = mt.untile(model(mt.tile(x, N)), N)
    members = members_differ_as_unfused(model, x)
    torch.testing.assert_close(direct, members)
    packed = mt.pack(model, ids(4), program="packed")
    torch.testing.assert_close(packed(x), members, rtol=1e-5, atol=1e-6)


def test_a_nested_batch_reaching_masks_placed_by_hand_is_refused_until_predict_keeps_it_padded() -> None:
    """An encoder given a padding mask nests its batch in eval without gradients: the Masksembles layers say what to
    do instead of masking a nested tensor; predict (and pack) keep the batch padded, and then the call works."""
    model = by_hand(padding=True)
    padded = ids(5, seed=1).clamp_min(1)
    padded[:, 4:] = 0  # padding after the tokens, as nested tensors require
    x = mt.tile(padded, N)
    with (
        torch.no_grad(),
        pytest.warns(UserWarning, match="nested tensors is in prototype stage"),  # torch's, as it nests the batch
        pytest.raises(ValueError, match="set its use_nested_tensor = False"),
    ):
        model(x)
    members = members_differ_as_unfused(model, padded)
    with torch.no_grad():
        torch.testing.assert_close(mt.untile(model(x), N), members)
