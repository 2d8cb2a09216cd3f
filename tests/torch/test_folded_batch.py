"""A sample meets one member in every layer, whatever the batch size, also where the model folds windows or tokens
into the batch (Swin, Mixer); ``predict`` reads and checks ``n`` and never changes the model's state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import masksembles_core as mc
import masksembles_core.adapter as mca
import masksembles_torch as mt
from tests.conformance import assert_bit_identical

N = 4


class SwinBlock(nn.Module):
    """Swin-style: windows folded into the batch for attention (B * windows, tokens, C), a cyclic shift (roll), then
    an MLP on the (B, H, W, C) map."""

    def __init__(self, channels: int, window: int, shift: int) -> None:
        super().__init__()
        self.window, self.shift = window, shift
        self.norm = nn.LayerNorm(channels)
        self.qkv, self.proj = nn.Linear(channels, 3 * channels), nn.Linear(channels, channels)
        self.fc1, self.fc2 = nn.Linear(channels, 2 * channels), nn.Linear(2 * channels, channels)

    def forward(self, x: Tensor) -> Tensor:  # (B, H, W, C)
        batch, height, width, channels = x.shape
        w = self.window
        shifted = torch.roll(self.norm(x), (-self.shift, -self.shift), dims=(1, 2))
        windows = shifted.view(batch, height // w, w, width // w, w, channels).permute(0, 1, 3, 2, 4, 5)
        windows = windows.reshape(-1, w * w, channels)  # (B * windows, tokens, C), sample-major
        q, k, v = self.qkv(windows).chunk(3, dim=-1)
        attended = self.proj(torch.softmax(q @ k.transpose(1, 2) / channels**0.5, dim=-1) @ v)
        merged = attended.view(batch, height // w, width // w, w, w, channels).permute(0, 1, 3, 2, 4, 5)
        x = x + torch.roll(merged.reshape(batch, height, width, channels), (self.shift, self.shift), dims=(1, 2))
        return x + self.fc2(torch.relu(self.fc1(x)))


class SwinLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Conv2d(3, 8, 2, stride=2)  # the first layer: left alone by insert
        self.blocks = nn.Sequential(SwinBlock(8, 4, 0), SwinBlock(8, 4, 2))
        self.head = nn.Linear(8, 3)

    def forward(self, images: Tensor) -> Tensor:  # (B, 3, 16, 16) -> (B, 3)
        return self.head(self.blocks(self.embed(images).permute(0, 2, 3, 1)).mean(dim=(1, 2)))


class MixerLike(nn.Module):
    """Mixer-style: the token-mixing MLP runs on (B * C, tokens) rows, the channel-mixing MLP on (B, tokens, C)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(12, 8)
        self.token1, self.token2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.channel1, self.channel2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, patches: Tensor) -> Tensor:  # (B, 16 tokens, 12) -> (B, 3)
        x = self.embed(patches)
        batch, tokens, channels = x.shape
        rows = x.transpose(1, 2).reshape(batch * channels, tokens)  # (B * C, tokens), sample-major
        mixed = self.token2(torch.relu(self.token1(rows))).view(batch, channels, tokens).transpose(1, 2)
        x = x + mixed
        x = x + self.channel2(torch.relu(self.channel1(x)))
        return self.head(x.mean(dim=1))


MODELS = {"swin": (SwinLike, (3, 16, 16)), "mixer": (MixerLike, (16, 12))}


def consistent_members(x: Tensor, y: Tensor, masks: Tensor, channel_axis: int) -> np.ndarray:
    """(rows, n) bool: whether row r of a Masksembles layer's output is its input times mask k (rows with zero inputs
    may match several masks)."""
    shape = mca.mask_shape(x.ndim, channel_axis % x.ndim, masks.shape[1], 1)
    return np.stack(
        [(y == x * masks[k].view(shape)).flatten(1).all(dim=1).numpy() for k in range(masks.shape[0])], axis=1
    )


def record_members(model: nn.Module) -> list[tuple[str, np.ndarray]]:
    """Hooks that record, for every Masksembles call, the members each row's output is consistent with."""
    records: list[tuple[str, np.ndarray]] = []
    for name, layer in model.named_modules():
        if isinstance(layer, mt.Masksembles):

            def hook(module: mt.Masksembles, args: tuple[Tensor], output: Tensor, name: str = name) -> None:
                records.append((name, consistent_members(args[0], output, module.masks, module.channel_axis)))

            layer.register_forward_hook(hook)
    return records


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("batch", [7, 5])
def test_a_sample_meets_one_member_in_every_layer_in_training(name: str, batch: int) -> None:
    build, shape = MODELS[name]
    # the example tells the layers' rows are batch-first: undeclared, a call whose tokens equal the batch is refused
    model = mt.insert(build(), N, 2.0, seed=0, example_input=torch.randn(2, *shape))
    records = record_members(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(batch))
    model.train()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    assert any(len(members) > batch for _, members in records), "the replica folds the batch"
    expected = mc.group_index(batch, N)
    for layer, members in records:
        per_sample = members.reshape(batch, -1, N)  # sample-major rows
        assert per_sample[np.arange(batch), :, expected].all(), layer
    assert {layer.samples for layer in model.modules() if isinstance(layer, mt.Masksembles)} == {batch}

    model.eval()
    torch.testing.assert_close(mt.pack(model, x, program="packed")(x), mt.predict(model, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_extracted_member_of_a_folding_model_equals_predict(name: str) -> None:
    build, shape = MODELS[name]
    model = mt.insert(build(), N, 2.0, seed=0, example_input=torch.randn(2, *shape)).eval()
    x = torch.randn(7, *shape, generator=torch.Generator().manual_seed(0))
    member = mt.extract_member(model, 2, x)
    assert not any(entry.startswith("verification") for entry in member.fallbacks)  # right without the safety net
    torch.testing.assert_close(member(x), mt.predict(model, x)[2], rtol=1e-4, atol=1e-5)


def test_folded_rows_without_the_record_straddle_members() -> None:
    # The failure the record fixes: at batch 7 the plain rule over the 28 attention rows mixes members in a sample.
    layer = mt.Masksembles(8, N, 2.0, seed=0, channel_axis=-1).train()
    x = torch.randn(7 * 4, 16, 8)  # no zeros: each row matches exactly one mask
    plain = consistent_members(x, layer(x), layer.masks, -1).argmax(axis=1).reshape(7, 4)
    assert sorted(tuple(sorted(set(row))) for row in plain if len(set(row)) > 1) == [(0, 1), (1, 2), (2, 3)]
    layer.samples = 7
    folded = consistent_members(x, layer(x), layer.masks, -1)
    assert (folded.sum(axis=1) == 1).all()
    assert (folded.argmax(axis=1).reshape(7, 4) == mc.group_index(7, N)[:, None]).all()


@pytest.mark.parametrize("rows, samples", [(28, 7), (20, 5), (24, 6), (7, 7), (9, 4), (16, 8)])
def test_functional_matches_the_reference_with_samples(rows: int, samples: int) -> None:
    masks = mc.generate_masks(8, N, 2.0, seed=0)
    x = np.random.default_rng(rows).normal(size=(rows, 3, 8)).astype(np.float32)
    result = mt.masksembles(torch.from_numpy(x), torch.from_numpy(masks), channel_axis=-1, samples=samples)
    assert_bit_identical(result.numpy(), mc.apply_masks(x, masks, channel_axis=-1, samples=samples))


def test_record_batch_size_works_compiled_and_exported() -> None:
    torch.manual_seed(0)
    model = mt.record_batch_size(mt.insert(nn.Sequential(SwinBlock(8, 4, 2)), N, 2.0, seed=0, include_first=True))
    assert len(model._forward_pre_hooks) == 1, "a second call adds nothing"
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    exported = torch.export.export(
        model, (torch.randn(6, 8, 8, 8),), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},)
    ).module()
    for batch in (7, 5, 8):
        x = torch.randn(batch, 8, 8, 8)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(exported(x), model(x), rtol=1e-5, atol=1e-5)
    assert {layer.open_calls for layer in model.modules() if isinstance(layer, mt.Masksembles)} == {0}, "calls closed"
    with pytest.raises(RuntimeError, match="outside a call of the model that records its batch size"):
        model[0](x)  # a submodule called directly, in training


def test_predict_reads_and_checks_n() -> None:
    model = nn.Sequential(nn.Linear(5, 8), mt.Masksembles1D(8, N, 2.0, seed=0), nn.Linear(8, 3))
    x = torch.randn(6, 5)
    assert torch.equal(mt.predict(model, x), mt.predict(model, x, N))
    with pytest.raises(ValueError, match=r"^n=2 does not match the model's Masksembles layers, which have n=4$"):
        mt.predict(model, x, 2)
    with pytest.raises(ValueError, match=r"have different n: \[3, 4\]"):
        mt.predict(nn.Sequential(model, mt.Masksembles1D(3, 3, 2.0, seed=0)), x)
    with pytest.raises(ValueError, match="no Masksembles layer to read it from; pass n"):
        mt.predict(nn.Linear(5, 3), x)


def test_predict_never_changes_the_model_state() -> None:
    model = nn.Sequential(
        nn.Linear(5, 8), nn.BatchNorm1d(8), mt.Masksembles1D(8, N, 2.0, seed=0), nn.Dropout(0.5), nn.Linear(8, 3)
    )
    model.train()
    model[1].eval()  # a frozen BatchNorm inside a model in train mode
    state = {key: value.clone() for key, value in model.state_dict().items()}
    x = torch.randn(6, 5)
    members = mt.predict(model, x)
    assert [module.training for module in model.modules()] == [True, True, False, True, True, True]
    assert all(torch.equal(state[key], value) for key, value in model.state_dict().items())
    model.eval()
    assert torch.equal(mt.predict(model, x), members)
