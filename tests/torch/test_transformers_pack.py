"""``pack`` and ``extract_member`` on Hugging Face ``transformers`` models built from tiny configs: captured with
``torch.export`` (torch.fx cannot trace them), called as the model is called (keyword tensors, padding in
``attention_mask``, a batch that n does not divide), returning the model's ``ModelOutput``, equal to ``predict``
with every Linear layer compacted and attention run with the members folded into its heads: the text models'
padding (and GPT-2's causal) mask, built from ``attention_mask`` alone, is computed once on the batch and broadcast
over every member's heads; a mask that reads where a sample sits in the batch stays per member, unfolded."""

from __future__ import annotations

import re
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import masksembles_torch as mt
from masksembles_torch import _packing
from tests.backends import requested_backends

if "transformers" not in requested_backends():
    pytest.skip(
        f"backend 'transformers' not requested (MASKSEMBLES_TEST_BACKENDS={requested_backends()})",
        allow_module_level=True,
    )

import transformers

from tests.torch.test_transformers import BATCH, HIDDEN, LENGTH, MODELS, VOCAB, N, inputs, surgery

CASES = [(name, "insert") for name in MODELS] + [("bert", "convert_dropout")]


def natural(name: str, seed: int = 0) -> dict[str, Any]:
    """The model's call: GPT-2 without its key-value cache (an object a packed program cannot return)."""
    return {**inputs(name, seed), "use_cache": False} if name == "gpt2" else inputs(name, seed)


def assert_same_output(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected) and list(actual.keys()) == list(expected.keys())
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "how"), CASES, ids=[f"{name}-{how}" for name, how in CASES])
def test_pack_equals_predict_with_the_linear_layers_compacted_and_attention_folded(name: str, how: str) -> None:
    model = surgery(name, how)
    batch = natural(name)
    packed = mt.pack(model, batch, program="packed")
    assert packed.program == "packed"
    assert_same_output(packed(**batch), mt.predict(model, batch))
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    assert not [row for row in packed.fallbacks if re.search(r"\.(layer|h)\.\d+\.", row)], "nothing in the blocks"
    other = natural(name, seed=1)
    for size in (3, N):  # other batch sizes, one that n divides; the padded samples 1 and 3 among them
        fewer = {key: value[:size] if isinstance(value, torch.Tensor) else value for key, value in other.items()}
        assert_same_output(packed(**fewer), mt.predict(model, fewer))


def programs_code(packed: nn.Module) -> str:
    return "".join(str(module.code) for module in packed.modules() if isinstance(module, torch.fx.GraphModule))


@pytest.mark.parametrize("name", list(MODELS))
def test_eager_attention_runs_as_one_fused_call_per_layer_equal_to_predict(name: str) -> None:
    """``attn_implementation="eager"`` (matmul, scale, mask, softmax in float32, cast, dropout, matmul, as
    ``torch.export`` captures them) folds into the heads like the SDPA call (nothing in the blocks falls back) and
    becomes one ``F.scaled_dot_product_attention`` call per layer."""
    torch.manual_seed(0)
    model = MODELS[name]()
    model.set_attn_implementation("eager")
    model = mt.insert(model, N, 2.0, seed=0, example_input=inputs(name))
    batch = natural(name)
    packed = mt.pack(model, batch, program="packed")
    code = programs_code(packed)
    assert code.count("scaled_dot_product_attention(") == 2 and "softmax" not in code
    assert packed.macs["fallback"] == 0
    assert not [row for row in packed.fallbacks if re.search(r"\.(layer|h)\.\d+\.", row)], "nothing in the blocks"
    assert_same_output(packed(**batch), mt.predict(model, batch))


@pytest.mark.parametrize("name", list(MODELS))
def test_pack_auto_keeps_a_program_equal_to_predict_and_says_why(name: str) -> None:
    model = surgery(name, "insert")
    batch = natural(name)
    packed = mt.pack(model, batch)
    assert packed.program in ("packed", "dense") and set(packed.seconds) >= {"packed", "dense"}
    assert packed.choice.startswith(f"{packed.program} (") and "median times" in packed.choice
    assert_same_output(packed(**batch), mt.predict(model, batch))


@pytest.mark.parametrize(("name", "how"), CASES, ids=[f"{name}-{how}" for name, how in CASES])
def test_extract_member_equals_its_member_of_predict(name: str, how: str) -> None:
    model = surgery(name, how)
    batch = natural(name)
    member = mt.extract_member(model, 2, batch)
    expected = mt.predict(model, batch)
    assert member.members == (2,)
    assert_same_output(member(**batch), type(expected)(**{key: value[2] for key, value in expected.items()}))


def test_pack_takes_a_tokenizers_batch_encoding_and_an_image_tensor() -> None:
    model = surgery("bert", "insert")
    encoding = transformers.BatchEncoding(inputs("bert"))
    assert_same_output(mt.pack(model, encoding, program="packed")(**encoding), mt.predict(model, encoding))
    vit = surgery("vit", "insert")
    images = inputs("vit")["pixel_values"]
    packed = mt.pack(vit, images, program="packed")  # torch.fx fails on it: captured by torch.export
    assert packed.program == "packed"
    assert_same_output(packed(images), mt.predict(vit, images))


class Scaled(nn.Module):
    """A model called with two batch-first tensors, the first not the one the layers read: ``head(mask(hidden(x)))``
    times a per-sample weight."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(6, 16)
        self.masks = mt.Masksembles(16, N, 2.0, seed=0, channel_axis=-1)
        self.head = nn.Linear(16, 3)

    def forward(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.masks(torch.relu(self.hidden(x)))) * weight


def test_a_second_input_is_tiled_where_it_is_read_not_taken_for_the_main_one() -> None:
    torch.manual_seed(0)
    model = Scaled()
    weight, x = torch.rand(BATCH, 1), torch.randn(BATCH, 6)
    for example in ((weight, x), {"x": x, "weight": weight}):
        packed = mt.pack(model, example, program="packed")
        expected = mt.predict(model, example)
        actual = packed(*example) if isinstance(example, tuple) else packed(**example)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        assert packed.macs["packed"] < packed.macs["dense"] and packed.macs["fallback"] == 0


class MaskedAttention(nn.Module):
    """One attention block called with ``x`` and ``attention_mask``, its (B, 1, 1, L) mask built as ``transformers``
    builds it (each sample's row picked by ``arange(B)``, expanded to (B, 1, L, L)); ``by_position``: the odd
    positions of the batch attend to every token as well, a mask that reads where a sample sits in the batch."""

    def __init__(self, by_position: bool) -> None:
        super().__init__()
        self.by_position = by_position
        self.masks = mt.Masksembles(8, N, 2.0, seed=0, channel_axis=-1)
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        rows = torch.arange(batch)[:, None, None, None]
        keep = attention_mask.bool()[rows, torch.arange(length)[None, None, None, :]]
        if self.by_position:
            keep = keep | (rows % 2 == 1)
        q, k, v = self.qkv(self.masks(x)).view(batch, length, 3, 2, 4).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep.expand(batch, -1, length, length))
        return self.proj(out.transpose(1, 2).reshape(batch, length, 8))


@pytest.mark.parametrize("by_position", [False, True])
def test_a_mask_from_the_inputs_alone_is_broadcast_over_the_folded_heads_one_that_reads_positions_is_not(
    by_position: bool,
) -> None:
    torch.manual_seed(0)
    model = MaskedAttention(by_position).eval()
    batch = {"x": torch.randn(BATCH, LENGTH, 8), "attention_mask": inputs("bert")["attention_mask"]}
    packed = mt.pack(model, batch, program="packed")
    assert any("scaled_dot_product_attention" in row for row in packed.fallbacks) is by_position
    for size in (BATCH, 3, N):  # an odd batch: positions differ between the member-stacked batch and the batch
        fewer = {key: value[:size] for key, value in batch.items()}
        torch.testing.assert_close(packed(**fewer), mt.predict(model, fewer), rtol=1e-5, atol=1e-6)


def test_a_causal_lm_called_with_its_cache_on_is_refused_saying_to_pass_use_cache_false() -> None:
    """GPT-2 called as it is by default (``use_cache=True``) returns a ``DynamicCache``: refused with what to do,
    not with torch.export's error about an unknown type; with ``use_cache=False`` it packs (the tests above)."""
    model = surgery("gpt2", "insert")
    refusal = (
        r"cannot return the DynamicCache object in GPT2LMHeadModel's output .* call the model with use_cache=False"
    )
    with pytest.raises(ValueError, match=refusal):
        mt.pack(model, inputs("gpt2"))
    with pytest.raises(ValueError, match=refusal):  # torch.fx fails first on a tensor input, then torch.export
        mt.extract_member(model, 0, inputs("gpt2")["input_ids"])


def test_vit_mae_random_per_call_is_refused_and_packs_with_its_noise_passed_in() -> None:
    """ViTMAE without ``noise`` masks patches at random on every call, in eval too: refused, saying so and naming
    ``noise=``, not packed as the whole model with figures that mean nothing. Given its noise, the packed program
    equals predict, its loss (no batch axis: over the member-stacked batch) included."""
    torch.manual_seed(0)
    config = transformers.ViTMAEConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16,
        patch_size=4, decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
        decoder_intermediate_size=64,
    )  # fmt: skip
    batch = {"pixel_values": torch.randn(BATCH, 3, 16, 16)}
    model = mt.insert(transformers.ViTMAEForPreTraining(config).eval(), N, 2.0, seed=0, example_input=batch)
    with pytest.raises(ValueError, match=r"random per call.*noise=torch\.rand\(batch, patches\)"):
        mt.pack(model, batch, program="packed")
    with_noise = {**batch, "noise": torch.rand(BATCH, (16 // 4) ** 2)}
    packed = mt.pack(model, with_noise, program="packed")
    assert packed.program == "packed"
    assert_same_output(packed(**with_noise), mt.predict(model, with_noise))


def test_xlnet_mems_come_back_in_predicts_layout() -> None:
    """XLNet returns its memory sequence-first, ``mems`` (L, B, H) per layer: packed as ``predict`` returns it, (L,
    n·B, H) with member k's block at k·B (not (n, L, B, H)). Masks on the summary
    and classifier only, whose inputs are batch-first (the blocks' states are sequence-first, (L, B, H), where a
    Masksembles layer would group its rows by token, not by sample)."""
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=VOCAB, d_model=HIDDEN, n_layer=2, n_head=2, d_inner=64, num_labels=3)
    batch = inputs("bert")
    model = mt.insert(
        transformers.XLNetForSequenceClassification(config).eval(), N, 2.0, seed=0, example_input=batch,
        before=lambda path, module: isinstance(module, nn.Linear) and not path.startswith("transformer."),
    )  # fmt: skip
    expected = mt.predict(model, batch)
    assert [tuple(memory.shape) for memory in expected.mems] == [(LENGTH, N * BATCH, HIDDEN)] * 2
    packed = mt.pack(model, batch, program="packed")
    assert packed.program == "packed"
    assert_same_output(packed(**batch), expected)  # extract_member's block: test_packing_output_layout.py


@pytest.mark.verification_fallback
def test_the_whole_model_fallback_is_called_as_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _packing._Verifier.mismatch

    def refuse_the_graphs(self: _packing._Verifier, packed: nn.Module) -> str | None:  # not the whole model's
        whole = any(node.target == "model" for node in cast(mt.PackedMasksembles, packed).graph.nodes)
        return check(self, packed) if whole else "refused for the test"

    monkeypatch.setattr(_packing._Verifier, "mismatch", refuse_the_graphs)
    model = surgery("bert", "insert")
    batch = inputs("bert")
    packed = mt.pack(model, batch, program="packed")
    assert packed.program == "dense" and packed.fallbacks[0].startswith("verification: the packed program differed")
    assert_same_output(packed(**batch), mt.predict(model, batch))
    member = mt.extract_member(model, 1, batch)
    expected = mt.predict(model, batch)
    assert_same_output(member(**batch), type(expected)(**{key: value[1] for key, value in expected.items()}))


def test_the_packed_bert_exports_with_a_dynamic_batch() -> None:
    model = surgery("bert", "insert")
    batch = inputs("bert")
    packed = mt.pack(model, batch, program="packed")
    dynamic = {key: {0: torch.export.Dim("batch", min=1)} for key in batch}
    exported = torch.export.export(packed, (), batch, dynamic_shapes=dynamic, strict=False).module()
    assert_same_output(exported(**batch), packed(**batch))
    fewer = {key: value[:3] for key, value in batch.items()}
    assert_same_output(exported(**fewer), packed(**fewer))


def test_the_packed_bert_compiles_as_one_graph() -> None:
    model = surgery("bert", "insert")
    batch = inputs("bert")
    packed = mt.pack(model, batch, program="packed")
    compiled = torch.compile(packed, fullgraph=True)
    assert_same_output(compiled(**batch), packed(**batch))
