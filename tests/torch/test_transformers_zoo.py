"""More Hugging Face ``transformers`` architectures than the four of ``test_transformers.py``, each from a tiny
config (nothing downloaded), called as it is called (keyword tensors, padding in ``attention_mask``, a batch of 6
that n does not divide): ``insert`` and ``convert_dropout``, then ``predict`` with the output structure kept, and
``pack`` and ``extract_member`` equal to it; a training step on the converted model. ``FOLDED`` lists the models
whose multiply-adds all run packed (attention folded into the heads, rotary embeddings, grouped-query attention,
T5's, BEiT's and MPNet's per-head position bias (MPNet's added in place) and GPT-Neo's ``torch.where`` causal mask
included; OPT's feed-forward on its tokens folded into the batch, (B*L, C) rows; Swin's window attention on its
windows folded into the batch); the others keep their attention at full width on the member-stacked batch, exactly
(DeBERTa's disentangled attention)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import masksembles_torch as mt
from tests.backends import requested_backends

if "transformers" not in requested_backends():
    pytest.skip(
        f"backend 'transformers' not requested (MASKSEMBLES_TEST_BACKENDS={requested_backends()})",
        allow_module_level=True,
    )

import transformers as T

N = 4
BATCH = 6  # not a multiple of N
LENGTH = 7
VOCAB = 100
HIDDEN = 32
ENCODER = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    max_position_embeddings=64, num_labels=3,
)  # fmt: skip
DECODER = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=64, num_key_value_heads=2,
)  # fmt: skip
BART = dict(
    vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, num_labels=3,
    pad_token_id=1, bos_token_id=0, eos_token_id=2, dropout=0.1, classifier_dropout=0.1,
)  # fmt: skip
VISION = dict(
    hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16, patch_size=4,
    hidden_dropout_prob=0.1,
)  # fmt: skip
WHISPER = dict(
    vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16,
    num_labels=3, dropout=0.1,
)  # fmt: skip

# name -> (input kind, output, model class, config class, config); kinds: text, bart (text with one <eos> per
# sample), image, audio; outputs: classes (labels), tokens (a causal LM), hidden (a base model)
ARCHITECTURES: dict[str, tuple[str, str, str, str, dict[str, Any]]] = {
    "roberta": ("text", "classes", "RobertaForSequenceClassification", "RobertaConfig",
                {**ENCODER, "pad_token_id": 1}),
    "albert": ("text", "classes", "AlbertForSequenceClassification", "AlbertConfig",
               {**ENCODER, "embedding_size": 16, "hidden_dropout_prob": 0.1}),
    "electra": ("text", "classes", "ElectraForSequenceClassification", "ElectraConfig",
                {**ENCODER, "embedding_size": 16}),
    "deberta-v2": ("text", "classes", "DebertaV2ForSequenceClassification", "DebertaV2Config", ENCODER),
    "xlm-roberta": ("text", "classes", "XLMRobertaForSequenceClassification", "XLMRobertaConfig",
                    {**ENCODER, "pad_token_id": 1}),
    "mpnet": ("text", "classes", "MPNetForSequenceClassification", "MPNetConfig", {**ENCODER, "pad_token_id": 1}),
    "bart": ("bart", "classes", "BartForSequenceClassification", "BartConfig", BART),
    "t5-encoder": ("text", "hidden", "T5EncoderModel", "T5Config",
                   {"vocab_size": VOCAB, "d_model": HIDDEN, "d_kv": 16, "d_ff": 64, "num_layers": 2, "num_heads": 2,
                    "dropout_rate": 0.1}),
    "gpt-neo": ("text", "tokens", "GPTNeoForCausalLM", "GPTNeoConfig",
                {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_layers": 2, "num_heads": 2, "window_size": 4,
                 "attention_types": [[["global", "local"], 1]], "max_position_embeddings": 64, "intermediate_size": 64,
                 "embed_dropout": 0.1, "resid_dropout": 0.1, "bos_token_id": 0, "eos_token_id": 0}),
    "opt": ("text", "tokens", "OPTForCausalLM", "OPTConfig",
            {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 2,
             "ffn_dim": 64, "max_position_embeddings": 64, "word_embed_proj_dim": HIDDEN, "pad_token_id": 1,
             "bos_token_id": 0, "eos_token_id": 2}),
    "llama": ("text", "tokens", "LlamaForCausalLM", "LlamaConfig", DECODER),
    "mistral": ("text", "tokens", "MistralForCausalLM", "MistralConfig", DECODER),
    "qwen2": ("text", "tokens", "Qwen2ForCausalLM", "Qwen2Config", DECODER),
    "gemma": ("text", "tokens", "GemmaForCausalLM", "GemmaConfig", {**DECODER, "head_dim": 8}),
    "phi": ("text", "tokens", "PhiForCausalLM", "PhiConfig",
            {**DECODER, "num_key_value_heads": 4, "resid_pdrop": 0.1, "embd_pdrop": 0.1}),
    "deit": ("image", "classes", "DeiTForImageClassification", "DeiTConfig", {**VISION, "num_labels": 3}),
    "beit": ("image", "classes", "BeitForImageClassification", "BeitConfig",
             {**VISION, "num_labels": 3, "use_relative_position_bias": True}),
    "swin": ("image", "classes", "SwinForImageClassification", "SwinConfig",
             {"image_size": 16, "patch_size": 2, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2],
              "window_size": 2, "num_labels": 3, "hidden_dropout_prob": 0.1}),
    "convnext": ("image", "classes", "ConvNextForImageClassification", "ConvNextConfig",
                 {"num_stages": 2, "hidden_sizes": [16, 32], "depths": [1, 1], "num_labels": 3}),
    "resnet": ("image", "classes", "ResNetForImageClassification", "ResNetConfig",
               {"embedding_size": 16, "hidden_sizes": [16, 32], "depths": [1, 1], "num_labels": 3,
                "layer_type": "basic"}),
    "clip-vision": ("image", "hidden", "CLIPVisionModel", "CLIPVisionConfig",
                    {"hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "image_size": 16, "patch_size": 4}),
    "dinov2": ("image", "hidden", "Dinov2Model", "Dinov2Config",
               {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 2, "mlp_ratio": 2,
                "image_size": 16, "patch_size": 4, "hidden_dropout_prob": 0.1}),
    "whisper": ("audio", "classes", "WhisperForAudioClassification", "WhisperConfig", WHISPER),
}  # fmt: skip
FOLDED = {"roberta", "albert", "electra", "xlm-roberta", "bart", "t5-encoder", "gpt-neo", "opt", "llama", "mistral",
          "qwen2", "gemma", "phi", "deit", "beit", "convnext", "resnet", "clip-vision", "dinov2",
          "whisper", "mpnet", "swin"}  # fmt: skip
# a dropout module on the hidden states (OPT's, Whisper's and BART's others are F.dropout calls, which a model read
# with torch.export keeps; Llama, Mistral, Qwen2, Gemma, CLIP, ResNet, ConvNeXt have none)
DROPOUTS = ["roberta", "albert", "electra", "deberta-v2", "xlm-roberta", "mpnet", "bart", "t5-encoder", "gpt-neo",
            "phi", "deit", "beit", "swin", "dinov2"]  # fmt: skip
SLOW = {"xlm-roberta", "mistral", "qwen2", "gemma", "beit", "swin", "deberta-v2", "mpnet", "electra"}
# convert_dropout's training step on a sibling of a default case's architecture (ALBERT: RoBERTa's encoder; Phi:
# GPT-Neo's decoder; DINOv2: DeiT's ViT); their insert cases stay in the default run
CONVERT_SLOW = SLOW | {"albert", "phi", "dinov2"}


def cases(names: list[str], slow: set[str] = SLOW) -> list[Any]:
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in names]


def build(name: str) -> nn.Module:
    *_, model_class, config_class, config = ARCHITECTURES[name]
    torch.manual_seed(0)
    model: nn.Module = getattr(T, model_class)(getattr(T, config_class)(**config))
    return model.eval()


def inputs(name: str, seed: int = 0, batch: int = BATCH) -> dict[str, Any]:
    """A batch as the model is called: keyword tensors, text with right padding in samples 1 and 3 (BART's <eos> at
    each sample's last token), BART and the causal LMs without their key-value cache."""
    kind, output, *_ = ARCHITECTURES[name]
    generator = torch.Generator().manual_seed(seed)
    if kind == "image":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=generator)}
    if kind == "audio":
        return {"input_features": torch.randn(batch, 16, 32, generator=generator)}
    mask = torch.ones(batch, LENGTH, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    ids = torch.randint(3, VOCAB, (batch, LENGTH), generator=generator)
    if kind == "bart":
        ids[torch.arange(batch), mask.sum(1) - 1] = 2
    return {
        "input_ids": ids,
        "attention_mask": mask,
        **({"use_cache": False} if kind == "bart" or output == "tokens" else {}),
    }


def fewer(batch: dict[str, Any], size: int) -> dict[str, Any]:
    return {key: value[:size] if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def assert_same_output(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected) and list(actual.keys()) == list(expected.keys())
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-6)


def member(output: Any, k: int) -> Any:
    return type(output)(**{key: value[k] for key, value in output.items()})


def check_predict(model: nn.Module, batch: dict[str, Any]) -> Any:
    """predict keeps the model's output structure, every member on a leading axis, member k on copy k of the batch."""
    members = mt.predict(model, batch)
    tiled = {key: mt.tile(value, N) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    with torch.no_grad():
        expected = model(**tiled)
    assert type(members) is type(expected) and list(members.keys()) == list(expected.keys())
    for key in expected:
        assert members[key].shape == (N, BATCH, *expected[key].shape[1:])
        assert torch.equal(members[key], expected[key].unflatten(0, (N, BATCH))), key
    first = next(iter(members.values()))
    assert not torch.allclose(first[0], first[1]), "the members differ"
    return members


def check_pack(model: nn.Module, batch: dict[str, Any], name: str, members: Any, folded: bool) -> None:
    packed = mt.pack(model, batch, program="packed")
    assert packed.program == "packed"
    assert_same_output(packed(**batch), members)
    other = fewer(inputs(name, seed=1), 3)
    assert_same_output(packed(**other), mt.predict(model, other))
    assert packed.macs["packed"] < packed.macs["dense"]
    assert (packed.macs["fallback"] == 0) is folded, packed.fallbacks
    assert_same_output(mt.extract_member(model, 2, batch)(**batch), member(members, 2))


@pytest.mark.parametrize("name", cases(list(ARCHITECTURES)))
def test_insert_then_predict_pack_and_a_member_equal_the_model_on_the_tiled_batch(name: str) -> None:
    batch = inputs(name)
    model = mt.insert(build(name), N, 2.0, seed=0, example_input=batch)
    assert model.masksembles_report.changed
    check_pack(model, batch, name, check_predict(model, batch), name in FOLDED)


def loss(model: nn.Module, name: str, batch: dict[str, Any]) -> torch.Tensor:
    output = ARCHITECTURES[name][1]
    if output == "hidden":
        return model(**batch).last_hidden_state.square().mean()
    labels = batch["input_ids"] if output == "tokens" else torch.arange(BATCH) % 3
    return model(**batch, labels=labels).loss


@pytest.mark.parametrize("name", cases(DROPOUTS, CONVERT_SLOW))
def test_convert_dropout_trains_then_predict_and_pack_equal_the_model_on_the_tiled_batch(name: str) -> None:
    batch = inputs(name)
    model = mt.convert_dropout(build(name), batch, N, 2.0, seed=0)
    assert model.masksembles_report.changed
    before = mt.predict(model, batch)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    value = loss(model, name, batch)
    value.backward()
    optimizer.step()
    assert torch.isfinite(value)
    members = check_predict(model.eval(), batch)
    assert not torch.equal(next(iter(members.values())), next(iter(before.values()))), "the step changed the members"
    # BART's block dropouts are F.dropout calls, left: only its head is masked, its blocks run once for every member
    check_pack(model, batch, name, members, name in FOLDED - {"bart"})


@pytest.mark.parametrize("name", ["roberta", "llama", "whisper"])
def test_eager_attention_packs_as_the_sdpa_one(name: str) -> None:
    """``attn_implementation="eager"``: the same members as with SDPA, packed the same way."""
    batch = inputs(name)
    sdpa, eager = build(name), build(name)
    eager.set_attn_implementation("eager")
    sdpa, eager = (mt.insert(model, N, 2.0, seed=0, example_input=batch) for model in (sdpa, eager))
    members = mt.predict(eager, batch)
    assert_same_output(members, mt.predict(sdpa, batch))
    check_pack(eager, batch, name, members, name in FOLDED)


@pytest.mark.slow
def test_swin_windows_compact_around_their_attention() -> None:
    """Swin's window partition (a zero pad where the windows fit, views and a transpose to (B*windows, tokens, C))
    keeps each sample's windows together: the query, key and value projections on the windows compact. The attention
    (a per-head position bias) and the output projection that reads it run on the member-stacked batch."""
    batch = inputs("swin")
    model = mt.insert(build("swin"), N, 2.0, seed=0, example_input=batch)
    packed = mt.pack(model, batch, program="packed")
    assert not any(reason.startswith("verification") for reason in packed.fallbacks), packed.fallbacks[:1]
    assert not [reason for reason in packed.fallbacks if any(p in reason for p in ("q_proj", "k_proj", "v_proj"))]
    assert packed.macs["fallback"] / packed.macs["packed"] < 0.25, packed.macs
    assert_same_output(packed(**batch), mt.predict(model, batch))


def test_the_packed_llama_exports_with_a_dynamic_batch() -> None:
    """The folded rotary and grouped-query attention read no batch size: the packed program exports with a dynamic
    batch and gives the packed values at other batch sizes."""
    batch = inputs("llama")
    model = mt.insert(build("llama"), N, 2.0, seed=0, example_input=batch)
    packed = mt.pack(model, batch, program="packed")
    assert packed.macs["fallback"] == 0
    dynamic = {key: {0: torch.export.Dim("batch", min=1)} if isinstance(value, torch.Tensor) else None
               for key, value in batch.items()}  # fmt: skip
    exported = torch.export.export(packed, (), batch, dynamic_shapes=dynamic, strict=False).module()
    assert_same_output(exported(**batch), packed(**batch))
    other = fewer(inputs("llama", seed=1), 3)
    assert_same_output(exported(**other), mt.predict(model, other))
