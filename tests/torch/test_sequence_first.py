"""Masksembles layers in sequence-first blocks, (L, B, C) (torch's transformer modules with ``batch_first=False``,
XLNet's hidden states): each layer groups the samples along axis 1 there, so every sample meets one member, as in a
batch-first twin with the same weights and masks; ``predict`` and ``pack`` run the members per sample. A declared axis
the batch is not on, and a model called on sequence-first inputs, are refused with what to do."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import masksembles_torch as mt
from tests.backends import requested_backends

N, LENGTH, CHANNELS = 4, 7, 16


def encoder(batch_first: bool) -> nn.TransformerEncoder:
    """Two encoder layers with dropouts (converted to masks) and no attention-weight dropout (kept random)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(CHANNELS, 2, 32, dropout=0.1, batch_first=batch_first)
    layer.self_attn.dropout = 0.0
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class Encoder(nn.Module):
    """Batch-first inputs (B, L, C) through an encoder of either layout; returns (B, L, C), or the encoder's own
    layout with ``sequence_output`` ((L, B, C) for a sequence-first one)."""

    def __init__(self, batch_first: bool, sequence_output: bool = False) -> None:
        super().__init__()
        self.batch_first, self.sequence_output = batch_first, sequence_output
        self.encoder = encoder(batch_first)

    def forward(self, x: Tensor) -> Tensor:
        if self.batch_first:
            return self.encoder(x)
        y = self.encoder(x.transpose(0, 1))
        return y if self.sequence_output else y.transpose(0, 1)


def twins(surgery: str, x: Tensor, sequence_output: bool = False) -> tuple[nn.Module, nn.Module]:
    """A sequence-first model and its batch-first twin: the same weights, masks placed the same way."""
    made = []
    for batch_first in (False, True):
        model = Encoder(batch_first, sequence_output)
        if surgery == "insert":  # the dropouts stay: off, so that training is the masks alone
            for module in model.modules():
                if isinstance(module, nn.Dropout):
                    module.p = 0.0
            made.append(mt.insert(model, N, 2.0, seed=0, example_input=x))
        else:
            made.append(mt.convert_dropout(model, x, N, 2.0, seed=0))
    return made[0], made[1]


def layers(model: nn.Module) -> list[mt.Masksembles]:
    return [module for module in model.modules() if isinstance(module, mt.Masksembles)]


def member(model: nn.Module, k: int) -> nn.Module:
    """``model`` with every Masksembles layer's masks all mask ``k``: member ``k`` whatever the grouping (eval)."""
    single = copy.deepcopy(model).eval()
    for layer in layers(single):
        layer.masks.copy_(layer.masks[k].expand_as(layer.masks))
    return single


@pytest.mark.parametrize("surgery", ["convert_dropout", "insert"])
@pytest.mark.parametrize("batch", [4, 6], ids=["n-divides-B", "B=6"])
def test_training_groups_by_sample_as_the_batch_first_twin(surgery: str, batch: int) -> None:
    x = torch.randn(batch, LENGTH, CHANNELS)
    sequence, twin = twins(surgery, x)
    assert {layer.batch_axis for layer in layers(sequence)} == {1}
    assert {layer.batch_axis for layer in layers(twin)} == {0}
    torch.testing.assert_close(sequence.train()(x), twin.train()(x))
    expected = mt.predict(twin, x)
    torch.testing.assert_close(mt.predict(sequence, x), expected)
    for k in range(N):  # the members are the single-mask models, not a mix of masks over token positions
        torch.testing.assert_close(expected[k], member(sequence, k)(x))


def test_sequence_first_outputs_keep_the_members_blocks_and_pack_equals_predict() -> None:
    """An output (L, n·B, C) keeps member ``k``'s block at ``[:, k·B:(k+1)·B]``: the batch-first twin's predict
    rearranged, in one call and in chunks of the batch; ``pack`` returns the same."""
    batch = 3
    x = torch.randn(batch, LENGTH, CHANNELS)
    sequence, twin = twins("convert_dropout", x, sequence_output=True)
    expected = mt.predict(twin, x).permute(2, 0, 1, 3).flatten(1, 2)  # (n, B, L, C) -> (L, n·B, C)
    torch.testing.assert_close(mt.predict(sequence, x), expected)
    torch.testing.assert_close(mt.predict(sequence, x, batch_size=2), expected)
    packed = mt.pack(sequence, x, program="packed")
    torch.testing.assert_close(packed(x), expected)


def test_compiled_and_exported_sequence_first_models_group_by_sample() -> None:
    """torch.compile (dynamic shapes, training) and torch.export (a symbolic batch, eval) decide the axis without a
    guard on the batch size, also for layers that leave it to each call (``batch_axis=None``)."""
    x = torch.randn(4, LENGTH, CHANNELS)
    sequence, twin = twins("convert_dropout", x)
    for layer in layers(sequence):
        layer.batch_axis = None
    compiled = torch.compile(sequence.train(), backend="eager", fullgraph=True, dynamic=True)  # dynamo decides
    for batch in (4, 6):
        x = torch.randn(batch, LENGTH, CHANNELS)
        torch.testing.assert_close(compiled(x), twin.train()(x))
    tiled = mt.tile(x, N)
    exported = torch.export.export(sequence.eval(), (tiled,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.testing.assert_close(exported.module()(tiled), twin.eval()(tiled))


def test_a_layer_left_to_each_call_takes_axis_1_only_where_axis_0_cannot_hold_the_batch() -> None:
    """Undeclared (``batch_axis=None``), a layer takes axis 1 where only it holds the batch, and axis 0 on (B, B, C),
    which both layouts fit (the batch-first convention: a sequence-first layer must be declared, as ``insert`` and
    ``convert_dropout`` do)."""
    x = torch.randn(4, LENGTH, CHANNELS)
    sequence, twin = twins("convert_dropout", x)
    for layer in layers(sequence):
        layer.batch_axis = None
    torch.testing.assert_close(sequence.train()(x), twin.train()(x))
    sequence(torch.randn(LENGTH, LENGTH, CHANNELS))
    assert {layer.grouped_axis for layer in layers(sequence)} == {0}


class Transposing(nn.Module):
    """Batch-first inputs, Linear layers on the sequence-first (L, B, C) view: no torch layer to read it from."""

    def __init__(self) -> None:
        super().__init__()
        self.project, self.head = nn.Linear(CHANNELS, CHANNELS), nn.Linear(CHANNELS, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.project(x.transpose(0, 1))).transpose(0, 1)


@pytest.mark.parametrize("batch", [1, LENGTH], ids=["B=1", "B=L"])
def test_insert_finds_the_axis_that_grows_with_the_batch(batch: int) -> None:
    """The example alone cannot tell (L, B, C) from (B, L, C) where L is a multiple of B; one more sample can. Without
    an example the axis is left to each call (axis 1 where only it holds the batch)."""
    x = torch.randn(batch, LENGTH, CHANNELS)
    model = mt.insert(Transposing(), N, 2.0, seed=0, include_first=True, example_input=x)
    assert [layer.batch_axis for layer in layers(model)] == [1, 1]
    undeclared = mt.insert(Transposing(), N, 2.0, seed=0, include_first=True)
    assert [layer.batch_axis for layer in layers(undeclared)] == [None, None]
    undeclared.train()(torch.randn(3, LENGTH, CHANNELS))
    assert [layer.grouped_axis for layer in layers(undeclared)] == [1, 1]
    model.train()(torch.randn(LENGTH, LENGTH, CHANNELS))  # (L, B, C) with L == B: only the declared axis tells
    assert [layer.grouped_axis for layer in layers(model)] == [1, 1]


def test_a_declared_axis_that_does_not_hold_the_batch_is_refused() -> None:
    """Declared batch-first, a layer refuses an input whose axis 1, not axis 0, holds the batch; declared
    sequence-first, one whose axis 1 does not hold it."""
    x = torch.randn(4, LENGTH, CHANNELS)
    sequence, _ = twins("convert_dropout", x)
    for layer in layers(sequence):
        layer.batch_axis = 0
    with pytest.raises(ValueError, match=r"batch_axis=0\) received shape \(7, 4, 16\), whose axis 1, not axis 0"):
        sequence.train()(x)
    hand_placed = nn.Sequential(nn.Linear(CHANNELS, CHANNELS), mt.Masksembles(CHANNELS, N, 2.0, channel_axis=-1))
    hand_placed[1].batch_axis = 1
    mt.record_batch_size(hand_placed)
    with pytest.raises(ValueError, match=r"batch_axis=1\) expects a sequence-first input"):
        hand_placed.train()(torch.randn(LENGTH, 4, CHANNELS))  # the recorded batch is axis 0's 7, not axis 1's 4


def test_a_model_called_on_sequence_first_inputs_is_refused() -> None:
    """predict tiles axis 0: torch's encoder itself takes (L, B, E), and a model that hands such an input on is
    caught by its layers (the tiled axis 0 is not the batch their axis 1 holds)."""
    naked = mt.convert_dropout(encoder(batch_first=False), torch.randn(LENGTH, 4, CHANNELS), N, 2.0, seed=0)
    with pytest.raises(ValueError, match=r"predict takes inputs with the samples on axis 0.*batch_first=False"):
        mt.predict(naked, torch.randn(LENGTH, 4, CHANNELS))
    with pytest.raises(ValueError, match=r"with_uncertainty takes inputs with the samples on axis 0"):
        mt.with_uncertainty(naked.eval())
    wrapped = mt.record_batch_size(nn.Sequential(naked))
    with pytest.raises(ValueError, match=r"batch_axis=1\) expects a sequence-first input.*through a wrapper"):
        mt.predict(wrapped, torch.randn(LENGTH, 4, CHANNELS))


def test_an_output_whose_axes_0_and_1_both_hold_the_tiled_batch_is_refused() -> None:
    """A sequence-first model's output (L, n·B, C) with L = n·B: which axis is the batch cannot be told, unless
    chunks of another size tell it."""
    sequence, twin = twins("convert_dropout", torch.randn(3, LENGTH, CHANNELS), sequence_output=True)
    x = torch.randn(2, 2 * N, CHANNELS)  # L = 8 = n·B
    with pytest.raises(ValueError, match=r"\(8, 8, 16\) holds the tiled batch of 4x2 on axes 0 and 1"):
        mt.predict(sequence, x)
    expected = mt.predict(twin, x).permute(2, 0, 1, 3).flatten(1, 2)
    torch.testing.assert_close(mt.predict(sequence, x, batch_size=1), expected)


@pytest.mark.skipif("transformers" not in requested_backends(), reason="backend 'transformers' not requested")
def test_xlnet_blocks_group_by_sample() -> None:
    """XLNet's blocks run on (L, B, H): insert's feed-forward masks group the samples on axis 1, so each member is
    the single-mask model, and a training sample goes through its member."""
    import transformers

    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=50, d_model=16, n_layer=2, n_head=2, d_inner=32, dropout=0.0)
    batch = 4
    ids = {"input_ids": torch.randint(0, 50, (batch, LENGTH))}
    model = mt.insert(transformers.XLNetModel(config).eval(), N, 2.0, seed=0, example_input=ids)
    assert {path.rsplit(".", 2)[-2] for path, _ in model.named_modules() if path.endswith("masksembles")} == {
        "layer_1", "layer_2"
    }  # fmt: skip
    assert {layer.batch_axis for layer in layers(model)} == {1}
    members = mt.predict(model, ids).last_hidden_state
    for k in range(N):
        torch.testing.assert_close(members[k], member(model, k)(**ids).last_hidden_state)
    trained = model.train()(**ids).last_hidden_state
    for i in range(batch):
        torch.testing.assert_close(trained[i], members[(i * N) // batch, i])
