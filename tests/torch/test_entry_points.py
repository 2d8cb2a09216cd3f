"""Whole members in training through every entry point of a model: timm's ``forward_features``/``forward_head``, a
submodule called directly, ``torch.utils.checkpoint``'s recomputation in backward. A call that reaches the Masksembles
layers of a recording model (``insert``, ``convert_dropout``, ``record_batch_size``) outside one of its calls is
refused in training, and grouped by sample inside ``recorded_call``; the recomputation of a checkpointed block groups
its rows as the call did, so the gradients equal the model's without checkpoints."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import masksembles_core as mc
import masksembles_torch as mt
from tests.torch import replicas
from tests.torch.test_folded_batch import record_members

N, BATCH = 4, 7  # n does not divide the batch: the plain rule over folded rows would split samples between members
REFUSED = r"outside a call of the model that records its batch size.*recorded_call\(model, x\)"


class TimmSwin(replicas.Swin):
    """timm's layout: ``forward`` is ``forward_head(forward_features(x))``; the blocks fold windows into the batch,
    optionally each under ``torch.utils.checkpoint`` (timm's ``set_grad_checkpointing``)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.grad_checkpointing: bool | None = None  # None: off; else checkpoint's use_reentrant

    def forward_features(self, x: Tensor) -> Tensor:  # (B, 3, 16, 16) -> (B, 8, 8, C)
        x = self.patch(x).permute(0, 2, 3, 1)
        for block in self.blocks:
            if self.grad_checkpointing is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.grad_checkpointing)
        return self.norm(x)

    def forward_head(self, x: Tensor) -> Tensor:  # (B, 8, 8, C) -> (B, classes)
        return self.head(x.mean((1, 2)))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


class TokenRows(nn.Module):
    """Tokens folded into rows in ``forward_features`` itself: (B, L, C) -> (B*L, C) through an MLP whose hidden
    layer ``insert`` masks, then back."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 3)

    def forward_features(self, tokens: Tensor) -> Tensor:  # (B, L, 6) -> (B, L, 8)
        x = self.embed(tokens)
        return x + self.mlp(x.flatten(0, 1)).view_as(x)

    def forward_head(self, x: Tensor) -> Tensor:
        return self.head(x.mean(1))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(tokens))


MODELS = {"swin": (TimmSwin, replicas.IMAGE), "token-rows": (TokenRows, (5, 6))}


def trained(name: str) -> tuple[nn.Module, Tensor]:
    build, shape = MODELS[name]
    model = mt.insert(build(), N, 2.0, seed=0).train()
    return model, torch.randn(BATCH, *shape, generator=torch.Generator().manual_seed(1))


def assert_whole_members(records: list[tuple[str, np.ndarray]]) -> None:
    """Every Masksembles call's rows, sample-major, went through their sample's member alone."""
    assert records and any(len(members) > BATCH for _, members in records), "the model folds the batch"
    expected = mc.group_index(BATCH, N)
    for layer, members in records:
        per_sample = members.reshape(BATCH, -1, N)
        assert per_sample[np.arange(BATCH), :, expected].all(), layer
        assert (per_sample.sum(axis=2) == 1).all(), f"{layer}: a row consistent with two members proves nothing"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_features_in_training_is_refused_outside_the_models_call_and_whole_inside_recorded_call(
    name: str,
) -> None:
    model, x = trained(name)
    records = record_members(model)
    with pytest.raises(RuntimeError, match=REFUSED):
        model.forward_features(x)
    records.clear()
    with mt.recorded_call(model, x):
        features = model.forward_features(x)
        output = model.forward_head(features)
    assert_whole_members(records)
    records.clear()
    assert torch.equal(model(x), output), "the same arithmetic: the model's own call groups as recorded_call does"
    assert_whole_members(records)


def test_a_submodule_called_directly_is_refused_in_training_and_whole_once_it_records() -> None:
    model, x = trained("swin")
    h = model.patch(x).permute(0, 2, 3, 1)
    with pytest.raises(RuntimeError, match=REFUSED):
        model.blocks(h)
    records = record_members(model)
    mt.record_batch_size(model.blocks)
    model.blocks(h)
    assert_whole_members(records)


def test_eval_mode_and_unrecorded_layers_are_unchanged() -> None:
    model, x = trained("swin")
    model.eval()
    assert torch.equal(model.forward_head(model.forward_features(x)), model(x)), "eval: the plain rule, no refusal"
    layer = mt.Masksembles1D(8, N, 2.0, seed=0).train()  # no model records for it: the plain rule over its rows
    rows = torch.randn(BATCH, 8)
    assert torch.equal(layer(rows), mt.masksembles(rows, layer.masks))


def test_the_record_is_closed_after_a_call_that_raises_and_after_recorded_call() -> None:
    model, x = trained("swin")
    with pytest.raises(RuntimeError, match="shape"):
        model(x[:, :, :, :3])  # fails inside the model
    with pytest.raises(ValueError, match="recorded_call needs the call's input"), mt.recorded_call(model, {"flag": 1}):
        pass
    with mt.recorded_call(model, x):
        model.forward_features(x)
    assert {layer.open_calls for layer in model.modules() if isinstance(layer, mt.Masksembles)} == {0}
    with pytest.raises(RuntimeError, match=REFUSED):
        model.forward_features(x)


@pytest.mark.parametrize("entry", ["model", "forward_features"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_blocks_recompute_with_the_calls_batch_and_give_the_same_gradients(
    entry: str, use_reentrant: bool
) -> None:
    """The recomputation runs in backward, after the call: the layers keep the call's batch size for it (a record
    cleared after the call would regroup the recomputed rows by the plain rule, and the gradients would differ)."""
    model, x = trained("swin")
    checkpointed = copy.deepcopy(model)
    checkpointed.grad_checkpointing = use_reentrant
    probe = torch.randn(BATCH, 8, 8, 16, generator=torch.Generator().manual_seed(2))  # LayerNorm's output squared
    gradients = []  # would have a mean of about 1 whatever the blocks compute: a fixed random weighting instead
    for each in (model, checkpointed):
        if entry == "model":
            loss = each(x).square().mean()
        else:
            with mt.recorded_call(each, x):
                loss = (each.forward_features(x) * probe).mean()
        loss.backward()
        gradients.append({name: parameter.grad for name, parameter in each.named_parameters()})
    assert gradients[0].keys() == gradients[1].keys()
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, msg=name)  # float32 rounding tolerances
