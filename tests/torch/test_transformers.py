"""Hugging Face ``transformers`` models, built from tiny configs (nothing downloaded): ``convert_dropout`` and
``insert`` with their reports, a training step, and ``predict`` called as the model is called (a dict of keyword
tensors, padding in ``attention_mask``, a batch that n does not divide), its ``ModelOutput`` kept."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import masksembles_torch as mt
from masksembles_core.insertion import CONVERTED, INSERTED, LEFT
from tests.backends import requested_backends
from tests.rounding import assert_rounding_close
from tests.torch.guide import guide_section

if "transformers" not in requested_backends():
    pytest.skip(
        f"backend 'transformers' not requested (MASKSEMBLES_TEST_BACKENDS={requested_backends()})",
        allow_module_level=True,
    )

import transformers
from transformers.pytorch_utils import Conv1D

N = 4
BATCH = 5  # not a multiple of N
LENGTH = 7
VOCAB = 100
HIDDEN = 32


def bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def distilbert() -> nn.Module:
    config = transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=HIDDEN, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32, num_labels=3
    )
    return transformers.DistilBertForSequenceClassification(config)


def vit() -> nn.Module:
    config = transformers.ViTConfig(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16,
        patch_size=4, num_labels=3, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"bert": bert, "distilbert": distilbert, "vit": vit, "gpt2": gpt2}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def inputs(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch as the model is called: keyword tensors, the text ones with right padding in two samples."""
    generator = torch.Generator().manual_seed(seed)
    if name == "vit":
        return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=generator)}
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return {"input_ids": torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator), "attention_mask": mask}


def labels(name: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["input_ids"] if name == "gpt2" else torch.arange(BATCH) % 3


def tiled(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: mt.tile(value, N) for key, value in batch.items()}


def decisions(model: nn.Module) -> dict[str, tuple[str, int | None, int | None, str]]:
    report = model.masksembles_report
    return {row.path: (row.action, row.channels, row.channel_axis, row.reason) for row in report.rows}


def attention_rate(owner: str, kind: str) -> str:
    return (
        f"attention-weight dropout (never called: its p is the dropout_p of scaled_dot_product_attention in "
        f"'{owner}' ({kind})): its input is attention weights, not channels"
    )


def hidden_dropout(note: str = "") -> tuple[str, int, int, str]:
    return (CONVERTED, HIDDEN, -1, note)


def expected_conversion(name: str) -> dict[str, tuple[str, int | None, int | None, str]]:
    """Hidden-state and classifier dropouts converted over the hidden size, attention-weight dropouts left."""
    rows: dict[str, tuple[str, int | None, int | None, str]] = {}
    if name == "bert":
        rows["bert.embeddings.dropout"] = hidden_dropout()
        for i in (0, 1):
            layer = f"bert.encoder.layer.{i}"
            rows[f"{layer}.attention.self.dropout"] = (
                LEFT, None, None, attention_rate(f"{layer}.attention.self", "BertSelfAttention")
            )  # fmt: skip
            rows[f"{layer}.attention.output.dropout"] = hidden_dropout()
            rows[f"{layer}.output.dropout"] = hidden_dropout()
        rows["dropout"] = hidden_dropout()  # the classifier's, on the pooled (B, hidden) features
    elif name == "distilbert":
        rows["distilbert.embeddings.dropout"] = hidden_dropout()
        for i in (0, 1):
            layer = f"distilbert.transformer.layer.{i}"
            reason = attention_rate(f"{layer}.attention", "DistilBertSelfAttention")
            rows[f"{layer}.attention.dropout"] = (LEFT, None, None, reason)
            rows[f"{layer}.ffn.dropout"] = hidden_dropout()
        rows["dropout"] = hidden_dropout()
    elif name == "vit":  # the class token joined to the patches: no single producer, the rank decides (rightly)
        rank = "axis -1 from the input's rank (3-D): the producer of its input is not recognized"
        rows["vit.embeddings.dropout"] = hidden_dropout(rank)
        rows["vit.layers.0.dropout"] = hidden_dropout()  # one module after the attention and after the MLP
        rows["vit.layers.1.dropout"] = hidden_dropout()
        for i in (0, 1):  # ViT passes its attention dropout rate to the attention function, no module has it
            reason = (
                "attention-weight dropout (dropout_p=0.1 of scaled_dot_product_attention): its input is attention "
                "weights, not channels"
            )
            rows[f"vit.layers.{i}.attention.scaled_dot_product_attention"] = (LEFT, None, None, reason)
    else:
        rows["transformer.drop"] = hidden_dropout()
        for i in (0, 1):
            reason = "attention-weight dropout (named 'attn_dropout'): its input is attention weights, not channels"
            rows[f"transformer.h.{i}.attn.attn_dropout"] = (LEFT, None, None, reason)
            rows[f"transformer.h.{i}.attn.resid_dropout"] = hidden_dropout()
            rows[f"transformer.h.{i}.mlp.dropout"] = hidden_dropout()
    return rows


@pytest.mark.parametrize("name", list(MODELS))
def test_convert_dropout_converts_hidden_and_classifier_dropouts_and_reports_attention_ones(name: str) -> None:
    model = build(name)
    converted = mt.convert_dropout(model, inputs(name), N, 2.0, seed=0)  # no warning: torch.export reads it
    assert decisions(converted) == expected_conversion(name)
    assert type(converted) is type(model), "converted in place: the model keeps its class and methods"


def test_eager_attention_dropouts_are_reported_from_their_functional_call() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, attn_implementation="eager",
    )  # fmt: skip
    example = transformers.BatchEncoding(inputs("bert"))  # what a tokenizer returns
    converted = mt.convert_dropout(transformers.BertForSequenceClassification(config), example, N, 2.0, seed=0)
    owner = "'bert.encoder.layer.0.attention.self' (BertSelfAttention)"
    assert decisions(converted)["bert.encoder.layer.0.attention.self.dropout"] == (
        LEFT,
        None,
        None,
        f"attention-weight dropout (never called: its p is the rate of F.dropout on a softmax in {owner}): its input "
        "is attention weights, not channels",
    )
    assert len(converted.masksembles_report.changed) == 4


def linear_layers(model: nn.Module) -> dict[str, int]:
    """The linear layers of a transformers model (nn.Linear, GPT-2's Conv1D) -> their input features."""
    found = {path: m.in_features for path, m in model.named_modules() if isinstance(m, nn.Linear)}
    found |= {path: m.weight.shape[0] for path, m in model.named_modules() if isinstance(m, Conv1D)}
    return found


@pytest.mark.parametrize("name", list(MODELS))
def test_insert_masks_the_input_of_every_linear_layer_but_not_the_embeddings(name: str) -> None:
    model = build(name)
    inserted = mt.insert(model, N, 2.0, seed=0, example_input=inputs(name))
    rows = decisions(inserted)
    expected = {path: (INSERTED, features, -1, "") for path, features in linear_layers(model).items()}
    if name == "vit":
        first = "the network's first layer: it reads the raw input (include_first=True masks it)"
        expected["vit.embeddings.patch_embeddings.projection"] = (LEFT, None, None, first)
    assert rows == expected
    assert not any("embeddings" in path and row[0] == INSERTED for path, row in rows.items())


def test_insert_filter_chooses_the_layers() -> None:
    def mlp_and_head(path: str, module: nn.Module) -> bool:  # leave the attention projections alone
        return isinstance(module, nn.Linear) and ".attention." not in path

    inserted = mt.insert(build("bert"), N, 2.0, seed=0, before=mlp_and_head, example_input=inputs("bert"))
    assert [row.path for row in inserted.masksembles_report.changed] == [
        "bert.encoder.layer.0.intermediate.dense",
        "bert.encoder.layer.0.output.dense",
        "bert.encoder.layer.1.intermediate.dense",
        "bert.encoder.layer.1.output.dense",
        "bert.pooler.dense",
        "classifier",
    ]


def surgery(name: str, how: str) -> nn.Module:
    if how == "insert":
        return mt.insert(build(name), N, 2.0, seed=0, example_input=inputs(name))
    return mt.convert_dropout(build(name), inputs(name), N, 2.0, seed=0)


CASES = [(name, how) for name in MODELS for how in ("insert", "convert_dropout")]


@pytest.mark.parametrize(("name", "how"), CASES, ids=[f"{name}-{how}" for name, how in CASES])
def test_a_training_step_then_predict_equals_the_model_on_the_tiled_batch(name: str, how: str) -> None:
    model = surgery(name, how)
    batch = inputs(name)
    masks = {key: value.clone() for key, value in model.state_dict().items() if key.endswith("masks")}
    weights = {key: value.clone() for key, value in model.named_parameters()}
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(**batch, labels=labels(name, batch)).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    trained = [key for key, value in model.named_parameters() if value.grad is not None]
    assert trained and all(not torch.equal(weights[key], model.get_parameter(key)) for key in trained)
    assert all(torch.equal(masks[key], model.state_dict()[key]) for key in masks), "the masks never train"

    members = mt.predict(model, batch)
    assert model.training, "predict restores every module's mode"
    with torch.no_grad():
        expected = model.eval()(**tiled(batch))
    assert type(members) is type(expected) and list(members.keys()) == list(expected.keys())
    assert members.logits.shape == (N, BATCH, *expected.logits.shape[1:])
    assert torch.equal(members.logits, expected.logits.unflatten(0, (N, BATCH))), "member k: copy k of the batch"
    assert not torch.allclose(members.logits[0], members.logits[1]), "the members differ"
    chunked = mt.predict(model, batch, batch_size=2)
    assert_rounding_close(chunked.logits, members.logits)


@pytest.mark.parametrize("name", ["bert", "distilbert", "gpt2"])
def test_predict_honours_the_attention_mask(name: str) -> None:
    model = surgery(name, "insert")
    batch = inputs(name)
    other = dict(batch, input_ids=torch.where(batch["attention_mask"].bool(), batch["input_ids"], 1))
    members, changed = mt.predict(model, batch).logits, mt.predict(model, other).logits
    if name == "gpt2":  # token logits: those of the real tokens
        kept = batch["attention_mask"].bool()
        torch.testing.assert_close(changed[:, kept], members[:, kept], rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(changed, members, rtol=1e-5, atol=1e-6)
    assert not torch.equal(other["input_ids"], batch["input_ids"]), "padded tokens were changed"


def test_predict_keeps_the_output_structure_and_its_leaves_without_a_batch() -> None:
    model = surgery("bert", "insert")
    batch = {**inputs("bert"), "labels": labels("bert", inputs("bert")), "output_hidden_states": True}
    members = mt.predict(model, batch)
    with torch.no_grad():
        expected = model.eval()(**tiled({key: batch[key] for key in ("input_ids", "attention_mask", "labels")}))
    assert isinstance(members, transformers.modeling_outputs.SequenceClassifierOutput)
    assert len(members.hidden_states) == 3 and members.hidden_states[-1].shape == (N, BATCH, LENGTH, HIDDEN)
    assert members.loss.shape == () and torch.equal(members.loss, expected.loss), "the loss over the tiled batch"
    assert mt.predict(model, batch, batch_size=2).loss is None, "a loss per chunk cannot be joined"
    logits, *_ = mt.predict(model, {**inputs("bert"), "return_dict": False})
    assert torch.equal(logits, mt.predict(model, inputs("bert")).logits)

    lm = surgery("gpt2", "insert")
    assert mt.predict(lm, inputs("gpt2")).past_key_values is not None, "the cache of the tiled batch, one call"
    assert mt.predict(lm, inputs("gpt2"), batch_size=2).past_key_values is None


def test_the_guide_transformers_section_runs(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = guide_section("Transformers")
    assert blocks
    namespace: dict[str, Any] = {"__name__": "guide_transformers"}
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/torch.md Transformers block {index}", "exec"), namespace)
    assert "convert_dropout: Masksembles n=4" in capsys.readouterr().out
