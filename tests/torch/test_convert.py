"""convert_dropout: the MC-Dropout drop-in, keeping all trained weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import masksembles_core as mc
import masksembles_torch as mt


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Dropout2d(0.2), nn.Identity())
        self.sequence = nn.Sequential(nn.Conv1d(4, 6, 1), nn.Dropout1d(0.1))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 32), nn.Dropout(0.5), nn.Linear(32, 3))
        self.block3d = nn.Sequential(nn.Conv3d(1, 5, 1), nn.Dropout3d(0.3))

    def forward(self, x: torch.Tensor, seq: torch.Tensor, vol: torch.Tensor) -> torch.Tensor:
        y = self.head(self.features(x))
        return y + self.sequence(seq).mean() + self.block3d(vol).mean()


def example() -> tuple[torch.Tensor, ...]:
    return torch.randn(4, 3, 6, 6), torch.randn(4, 4, 7), torch.randn(4, 1, 2, 2, 2)


def test_replaces_every_dropout_with_right_channels_and_keeps_weights() -> None:
    torch.manual_seed(0)
    model = Net()
    converted = mt.convert_dropout(model, example(), n=4, scale=2.0, seed=11)
    assert any(isinstance(m, nn.Dropout2d) for m in model.modules()), "the original is untouched by default"
    layers = {name: m for name, m in converted.named_modules() if isinstance(m, mt.Masksembles)}
    assert {name: (m.channels, m.channel_axis) for name, m in layers.items()} == {
        "features.2": (8, 1),
        "sequence.1": (6, 1),
        "head.2": (32, -1),
        "block3d.1": (5, 1),
    }
    assert not any(isinstance(m, nn.modules.dropout._DropoutNd) for m in converted.modules())
    original_state = model.state_dict()
    for key, value in converted.state_dict().items():
        if not key.endswith("masks"):
            assert torch.equal(value, original_state[key]), key
    for index, layer in enumerate(layers.values()):
        expected = mc.generate_masks(layer.channels, 4, 2.0, seed=mc.derive_seed(11, index))
        assert torch.equal(layer.masks, torch.as_tensor(expected, dtype=torch.float32))
    again = mt.convert_dropout(model, example(), n=4, scale=2.0, seed=11)
    for a, b in zip(layers.values(), (m for m in again.modules() if isinstance(m, mt.Masksembles)), strict=True):
        assert torch.equal(a.masks, b.masks), "deterministic seeds per layer"
    assert converted(*example()).shape == (4, 3)


def test_plain_dropout_on_convolution_features_uses_axis_1() -> None:
    model = nn.Sequential(nn.Conv2d(3, 10, 1), nn.Dropout(0.2), nn.Conv2d(10, 2, 1))
    converted = mt.convert_dropout(model, torch.randn(2, 3, 7, 5), 2, 2.0, seed=0)
    assert (converted[1].channels, converted[1].channel_axis) == (10, 1)


def test_inplace_and_sequence_features() -> None:
    model = nn.Sequential(nn.Linear(5, 12), nn.Dropout(0.1), nn.Linear(12, 2))
    x = torch.randn(3, 9, 5)  # (B, L, C) sequence: channels last for nn.Dropout
    result = mt.convert_dropout(model, x, 2, 3.0, inplace=True)
    assert result is model and isinstance(model[1], mt.Masksembles) and model[1].channels == 12
    assert model(x).shape == (3, 9, 2)


def test_errors_name_the_module() -> None:
    with pytest.raises(ValueError, match=r"found no nn\.Dropout"):
        mt.convert_dropout(nn.Linear(2, 2), torch.randn(1, 2), 2, 2.0)

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.spare = nn.Linear(3, 3), nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    with pytest.raises(ValueError, match="does not reach dropout module 'spare'"):
        mt.convert_dropout(Unused(), torch.randn(2, 3), 2, 2.0)

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(x).sum() + self.drop(x[:, :2]).sum()

    holder = Shared()
    with pytest.raises(ValueError, match="'drop' is called on inputs of shapes"):
        mt.convert_dropout(holder, torch.randn(2, 4), 2, 2.0)
    with pytest.raises(ValueError, match="scale must be a finite real number >= 1"):
        mt.convert_dropout(holder, torch.randn(2, 4), 2, 0.0)
