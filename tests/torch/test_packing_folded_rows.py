"""pack and extract_member on layers that run on tokens folded into the batch axis: OPT's feed-forward on
``hidden.reshape(-1, C)`` rows, viewed back to (B, L, C), and Swin's windows ``(B * windows, tokens, C)``. A reshape
that keeps the channels last and the batch's rows first keeps each sample's rows together, in sample order, so the
Masksembles layers and Linear layers on those rows compact like those on (B, L, C): nothing runs at full width, and
the results equal predict at batches that n does and does not divide. Rows folded in another order (tokens first) are
not whole samples: they run as the dense model runs them, still exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import masksembles_torch as mt

N = 4
TOKENS, WIDTH = 6, 16


class FeedForward(nn.Module):
    """OPT's decoder feed-forward: the tokens as rows, (B, L, C) -> (B*L, C), LayerNorm, Masksembles -> fc1 -> ReLU
    -> Masksembles -> fc2, the residual sum, viewed back to the input's shape; ``tokens_first`` folds them as
    (L*B, C) instead (``x.transpose(0, 1).reshape(-1, C)``)."""

    def __init__(self, seed: int, tokens_first: bool = False) -> None:
        super().__init__()
        self.tokens_first = tokens_first
        self.norm = nn.LayerNorm(WIDTH)
        self.masks1 = mt.Masksembles(WIDTH, N, 2.0, seed=seed, channel_axis=-1)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.masks2 = mt.Masksembles(4 * WIDTH, N, 2.0, seed=seed + 1, channel_axis=-1)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.transpose(0, 1) if self.tokens_first else x
        rows = rows.reshape(-1, x.size(-1))
        rows = rows + self.fc2(self.masks2(torch.relu(self.fc1(self.masks1(self.norm(rows))))))
        if self.tokens_first:
            return rows.view(shape[1], shape[0], shape[2]).transpose(0, 1)
        return rows.view(shape)


class Decoder(nn.Module):
    """Token embedding -> two feed-forward blocks -> head on every token."""

    def __init__(self, tokens_first: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(5, WIDTH)
        self.blocks = nn.Sequential(FeedForward(0, tokens_first), FeedForward(2, tokens_first))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


class Windows(nn.Module):
    """Swin's window partition: (B, H, W, C) -> (B * windows, window², C) as timm writes it (view, permute, reshape),
    Masksembles -> Linear -> GELU -> Masksembles -> Linear on each window's tokens, and back."""

    def __init__(self, window: int = 2) -> None:
        super().__init__()
        self.window = window
        # rows (B * windows, window², C): batch-first, declared (window² = 4 tokens equal a batch of 4 otherwise)
        self.masks1 = mt.Masksembles(WIDTH, N, 2.0, seed=0, channel_axis=-1, batch_axis=0)
        self.masks2 = mt.Masksembles(2 * WIDTH, N, 2.0, seed=1, channel_axis=-1, batch_axis=0)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        s = self.window
        windows = x.view(b, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)
        windows = self.fc2(self.masks2(nn.functional.gelu(self.fc1(self.masks1(windows)))))
        x = x + windows.view(b, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        return x.mean((1, 2))


class Image(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, WIDTH, 2, stride=2)
        self.windows = Windows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.windows(self.patch(x).permute(0, 2, 3, 1))


MODELS = {"feed-forward": (Decoder, (TOKENS, 5)), "windows": (Image, (3, 8, 8))}


def build(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    model_class, shape = MODELS[name]
    torch.manual_seed(0)
    return model_class().eval(), shape


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("name", list(MODELS))
def test_layers_on_rows_folded_into_the_batch_compact(name: str, capture: str) -> None:
    """torch.fx traces a tensor input; a tuple is captured with torch.export (the ATen graph ``transformers`` give)."""
    model, shape = build(name)
    example = torch.randn(6, *shape)
    packed = mt.pack(model, example if capture == "fx" else (example,), program="packed")
    assert not any(reason.startswith("verification") for reason in packed.fallbacks), packed.fallbacks[:1]
    assert packed.macs["fallback"] == 0, packed.fallbacks
    assert "to_batch" not in packed.code and "to_channels" not in packed.code
    assert packed.macs["packed"] < 0.55 * packed.macs["dense"]  # the MLP's padded hidden units included
    for batch in (8, 6, 5, 1):  # N divides the batch or not
        x = torch.randn(batch, *shape)
        expected = mt.predict(model, x, N)
        assert relative_error(packed(x), expected) <= 1e-5
        for k in (0, N - 1):
            member = mt.extract_member(model, k, example)
            assert member.macs["fallback"] == 0, member.fallbacks
            assert relative_error(member(x), expected[k]) <= 1e-5


@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_program_on_folded_rows_exports_with_a_dynamic_batch(name: str) -> None:
    model, shape = build(name)
    packed = mt.pack(model, torch.randn(6, *shape), program="packed")
    assert packed.macs["fallback"] == 0, packed.fallbacks
    batch = torch.export.Dim("batch", min=2, max=64)
    exported = torch.export.export(packed, (torch.randn(6, *shape),), dynamic_shapes=({0: batch},))
    for size in (9, 4):
        x = torch.randn(size, *shape)
        assert relative_error(exported.module()(x), mt.predict(model, x, N)) <= 1e-5


def test_rows_folded_tokens_first_are_not_whole_samples() -> None:
    """``x.transpose(0, 1).reshape(-1, C)`` puts token l of every sample together: a Masksembles layer's member
    blocks of the member-stacked batch are not the members' samples there, so those layers run as the dense model
    runs them (per member), and the result is still predict's."""
    torch.manual_seed(0)
    model = Decoder(tokens_first=True).eval()
    packed = mt.pack(model, torch.randn(6, TOKENS, 5), program="packed")
    assert not any(reason.startswith("verification") for reason in packed.fallbacks), packed.fallbacks[:1]
    assert packed.macs["fallback"] > 0
    for batch in (8, 5):
        x = torch.randn(batch, TOKENS, 5)
        assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5
