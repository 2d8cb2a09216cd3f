"""predict, insert and convert_dropout called as a model is called: a tensor, a tuple or a dict of batch-first
tensors, and outputs that keep the model's structure (a dict, a tuple, a dataclass) with the members in front."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import masksembles_torch as mt
from tests.rounding import assert_rounding_close

N = 4


@dataclasses.dataclass
class Output:  # shaped like a transformers ModelOutput: a dataclass of optional tensors
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    loss: torch.Tensor | None = None
    cache: object = None


class Pair(NamedTuple):
    scores: torch.Tensor
    count: int


class Tagger(nn.Module):
    """Keyword inputs (ids, a padding mask, optional labels and a flag) and a structured output."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 12)
        self.hidden = nn.Linear(12, 16)
        self.masks = mt.Masksembles(16, N, 2.0, seed=0, channel_axis=-1)
        self.head = nn.Linear(16, 3)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None = None,
        scale: float = 1.0,
        as_tuple: bool = False,
    ) -> Any:
        features = self.masks(torch.relu(self.hidden(self.embedding(input_ids)))) * scale
        pooled = (features * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)
        logits = self.head(pooled)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        if as_tuple:
            return logits, Pair(features, features.shape[0])
        return Output(logits, (pooled, features), loss, cache=object())


def text(batch: int = 5, length: int = 6) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, 3:] = 0  # padding
    return {"input_ids": ids, "attention_mask": mask}


def tiled(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: mt.tile(value, N) for key, value in inputs.items()}


def test_dict_inputs_keep_the_output_structure_and_equal_the_tiled_model() -> None:
    model = Tagger()
    inputs = text()  # 5 samples: not a multiple of N
    members = mt.predict(model, {**inputs, "scale": 2.0})
    with torch.no_grad():
        expected = model.eval()(**tiled(inputs), scale=2.0)
    assert type(members) is Output
    assert members.logits.shape == (N, 5, 3) and members.hidden[1].shape == (N, 5, 6, 16)
    # predict calls the model once on the tiled batch, as here: the same arithmetic, so the same bits
    assert torch.equal(members.logits, expected.logits.unflatten(0, (N, 5)))
    assert torch.equal(members.hidden[0], expected.hidden[0].unflatten(0, (N, 5)))
    assert members.loss is None and members.cache is not None, "an object without a batch: the model's own"
    chunked = mt.predict(model, {**inputs, "scale": 2.0}, batch_size=2)
    assert_rounding_close(chunked.logits, members.logits)
    assert chunked.cache is None, "an object of each chunk cannot be joined"


def test_a_loss_over_the_tiled_batch_is_kept_in_one_call_and_none_in_chunks() -> None:
    model = Tagger()
    inputs = {**text(), "labels": torch.tensor([0, 1, 2, 0, 1])}
    members = mt.predict(model, inputs)
    with torch.no_grad():
        expected = model.eval()(**tiled(inputs))
    assert members.loss is not None and expected.loss is not None
    assert members.loss.shape == () and torch.equal(members.loss, expected.loss)
    assert mt.predict(model, inputs, batch_size=3).loss is None


def test_tuple_inputs_and_tuple_outputs() -> None:
    model = Tagger()
    inputs = text()
    logits, pair = mt.predict(model, (inputs["input_ids"], inputs["attention_mask"], None, 1.0, True), batch_size=3)
    assert isinstance(pair, Pair) and pair.scores.shape == (N, 5, 6, 16) and pair.count is None
    assert_rounding_close(logits, mt.predict(model, inputs).logits)  # chunks of 3 samples against all 5 at once


def test_plain_dicts_and_nested_inputs() -> None:
    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Sequential(nn.Linear(3, 8), mt.Masksembles1D(8, N, 2.0, seed=0))

        def forward(self, parts: list[torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
            return OrderedDict(left=self.layer(parts[0]), right=self.layer(parts[1]))

    model = Branches()
    parts = [torch.randn(5, 3), torch.randn(5, 3)]
    members = mt.predict(model, {"parts": parts})
    assert type(members) is OrderedDict and list(members) == ["left", "right"]
    assert torch.equal(members["right"], mt.predict(model.layer, parts[1]))


def test_inputs_with_different_batches_are_an_error() -> None:
    inputs = text()
    with pytest.raises(ValueError, match=r"batch on axis 0.*inputs\['input_ids'\]: 5, inputs\['attention_mask'\]: 4"):
        mt.predict(Tagger(), {**inputs, "attention_mask": inputs["attention_mask"][:4]})
    with pytest.raises(ValueError, match="the inputs hold no tensor"):
        mt.predict(Tagger(), {"scale": 1.0})


def test_insert_and_convert_dropout_take_a_dict_example() -> None:
    class Keywords(nn.Module):  # torch.fx traces it: the dict is bound to forward's parameters
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(20, 12)
            self.hidden = nn.Linear(12, 16)
            self.drop = nn.Dropout(0.1)
            self.head = nn.Linear(16, 3)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            features = self.drop(torch.relu(self.hidden(self.embedding(input_ids * attention_mask))))
            return self.head(features.mean(1))

    inputs = text()
    converted = mt.convert_dropout(Keywords(), inputs, N, 2.0, seed=0)
    row = converted.masksembles_report.rows[0]
    assert (row.path, row.action, row.channels, row.channel_axis, row.reason) == ("drop", "converted", 16, -1, "")
    inserted = mt.insert(Keywords(), N, 2.0, seed=0, example_input=inputs)
    assert [row.path for row in inserted.masksembles_report.changed] == ["hidden", "head"]
    assert mt.predict(inserted, inputs).shape == (N, 5, 3)
