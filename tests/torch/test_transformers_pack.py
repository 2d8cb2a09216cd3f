"""``pack`` and ``extract_member`` on Hugging Face ``transformers`` models built from tiny configs: captured with
``torch.export`` (torch.fx cannot trace them), called as the model is called (keyword tensors, padding in
``attention_mask``, a batch that n does not divide), returning the model's ``ModelOutput``, equal to ``predict``
with every Linear layer compacted; attention runs with the members folded into its heads where its mask does not
follow the batch (the ViT, called without one) and alone at full width where it does (the text models' padding)."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
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

from tests.torch.test_transformers import BATCH, HIDDEN, LENGTH, MODELS, N, inputs, surgery

LAYERS = 2
FOLDED = {"vit"}  # attention folded into the heads; the others' padding masks are read per member
TOKENS = {"bert": LENGTH, "distilbert": LENGTH, "gpt2": LENGTH, "vit": (16 // 4) ** 2 + 1}  # ViT: patches and [CLS]
CASES = [(name, "insert") for name in MODELS] + [("bert", "convert_dropout")]


def natural(name: str, seed: int = 0) -> dict[str, Any]:
    """The model's call: GPT-2 without its key-value cache (an object a packed program cannot return)."""
    return {**inputs(name, seed), "use_cache": False} if name == "gpt2" else inputs(name, seed)


def assert_same_output(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected) and list(actual.keys()) == list(expected.keys())
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-6)


def attention_macs(name: str) -> int:
    """Multiply-adds per sample of the attention products of every member (q·k and the weights times v)."""
    return N * LAYERS * 2 * TOKENS[name] ** 2 * HIDDEN


@pytest.mark.parametrize(("name", "how"), CASES, ids=[f"{name}-{how}" for name, how in CASES])
def test_pack_equals_predict_with_the_linear_layers_compacted_and_attention_folded_or_at_full_width(
    name: str, how: str
) -> None:
    model = surgery(name, how)
    batch = natural(name)
    packed = mt.pack(model, batch, program="packed")
    assert packed.program == "packed"
    assert_same_output(packed(**batch), mt.predict(model, batch))
    full_width = 0 if name in FOLDED else attention_macs(name)
    assert packed.macs["fallback"] == full_width, "only the attention products of unfolded regions at full width"
    assert packed.macs["packed"] < packed.macs["dense"]
    assert not [row for row in packed.fallbacks if "linear" in row or "Masksembles" in row]
    assert any("scaled_dot_product_attention" in row for row in packed.fallbacks) is (name not in FOLDED)
    other = natural(name, seed=1)
    other = {key: value[:3] if isinstance(value, torch.Tensor) else value for key, value in other.items()}
    assert_same_output(packed(**other), mt.predict(model, other))  # another batch size


@pytest.mark.parametrize("name", list(MODELS))
def test_pack_auto_keeps_a_program_equal_to_predict_and_says_why(name: str) -> None:
    model = surgery(name, "insert")
    batch = natural(name)
    packed = mt.pack(model, batch)
    assert packed.program in ("packed", "dense") and set(packed.seconds) >= {"packed", "dense"}
    assert packed.choice.startswith(f"{packed.program}:")
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


def test_a_model_whose_output_holds_a_cache_object_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"torch\.export can capture .*DynamicCache"):
        mt.pack(surgery("gpt2", "insert"), inputs("gpt2"))


@pytest.mark.verification_fallback
def test_the_whole_model_fallback_is_called_as_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _packing._Verifier.mismatch

    def refuse_the_graphs(self: _packing._Verifier, packed: nn.Module) -> str | None:  # not the whole model's
        return "refused for the test" if cast(mt.PackedMasksembles, packed).macs else check(self, packed)

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
