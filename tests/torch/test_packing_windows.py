"""Swin's window attention folded into the heads: the windows of each image join the batch, (B, H, W, C) ->
(B*windows, ws*ws, C), attention runs per window, and the windows go back. Those rows hold each sample's windows
together, in sample order (proven per operation by evaluation), so the members' blocks on the channel axis are the
dense model's members on the member-stacked batch, and the attention on (B*windows, m*heads, L, L) keeps the members
apart as on (B, m*heads, L, L). The cyclic shift (``torch.roll`` along H and W) is a move of positions; the shifted
windows' mask, from constants and the batch size, is computed once and broadcast over every member's heads.

A partition that puts the windows outermost (rows window by window: each sample's rows scattered) or a roll along the
batch does not keep the samples' rows in order: it runs as the dense model runs it. Every program equals
``predict``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import masksembles_torch as mt
from tests.backends import requested_backends
from tests.rounding import assert_rounding_close
from tests.torch import replicas
from tests.torch.packing_checks import check_equal_to_predict, check_member_equal_to_predict, program_code

N, DIM, HEADS, WINDOW, SIZE = 4, 16, 2, 4, 8  # tokens on an 8x8 grid, 4x4 windows: 4 windows per image


def partition(x: Tensor, window: int, windows_first: bool = False) -> Tensor:
    """(B, H, W, C) -> (B*windows, window*window, C), each image's windows together (``windows_first``: window by
    window, every image's copy of a window together)."""
    b, h, w, c = x.shape
    grid = x.view(b, h // window, window, w // window, window, c)
    if windows_first:
        return grid.permute(1, 3, 0, 2, 4, 5).reshape(-1, window * window, c)
    return grid.transpose(2, 3).contiguous().view(-1, window * window, c)


def merge(windows: Tensor, window: int, h: int, w: int, windows_first: bool = False) -> Tensor:
    """The inverse of ``partition``: (B*windows, window*window, C) -> (B, H, W, C)."""
    c = windows.shape[-1]
    if windows_first:
        grid = windows.view(h // window, w // window, -1, window, window, c)
        return grid.permute(2, 0, 3, 1, 4, 5).reshape(-1, h, w, c)
    grid = windows.view(-1, h // window, w // window, window, window, c)
    return grid.transpose(2, 3).contiguous().view(-1, h, w, c)


class WindowAttention(nn.Module):
    """Attention within each window as ``transformers``' ``SwinAttention`` computes it: separate q/k/v projections
    split into heads, a learned bias per head and relative position (a table gathered by a fixed index), the shifted
    windows' mask (windows, L, L) expanded over the images in the batch and added to it, one
    ``scaled_dot_product_attention``, an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM) for _ in range(4))
        generator = torch.Generator().manual_seed(3)
        self.table = nn.Parameter(torch.randn((2 * WINDOW - 1) ** 2, HEADS, generator=generator))
        position = torch.stack(torch.meshgrid(torch.arange(WINDOW), torch.arange(WINDOW), indexing="ij")).flatten(1)
        offset = (position[:, :, None] - position[:, None, :]) + (WINDOW - 1)  # (2, L, L), each in [0, 2*WINDOW-1)
        self.register_buffer("index", (offset[0] * (2 * WINDOW - 1) + offset[1]).flatten(), persistent=False)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        rows, length, _ = x.shape
        q, k, v = (proj(x).view(rows, length, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        bias = self.table[self.index].view(length, length, -1).permute(2, 0, 1).unsqueeze(0)
        if mask is not None:
            windows = mask.shape[0]
            per_image = mask.unsqueeze(1).unsqueeze(0).expand(rows // windows, -1, -1, -1, -1)
            bias = bias + per_image.reshape(-1, 1, length, length)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o_proj(context.transpose(1, 2).reshape(rows, length, -1))


def shifted_mask(shift: int) -> Tensor:
    """(windows, L, L): 0 between positions of one region of the rolled grid, -100 between regions."""
    region = torch.zeros(SIZE, SIZE)
    bounds = (0, SIZE - WINDOW, SIZE - shift, SIZE)
    for i in range(3):
        for j in range(3):
            region[bounds[i] : bounds[i + 1], bounds[j] : bounds[j + 1]] = 3 * i + j
    ids = partition(region.view(1, SIZE, SIZE, 1), WINDOW).squeeze(-1)
    return (ids.unsqueeze(1) - ids.unsqueeze(2)).ne(0).float() * -100.0


class SwinLayer(nn.Module):
    """``transformers``' ``SwinLayer`` on (B, H*W, C) tokens: LayerNorm, the grid rolled back by ``shift`` (along
    H and W; along the batch and H with ``roll_batch``), windows, attention, windows merged, rolled forward, the
    residual sum, LayerNorm, MLP, the residual sum."""

    def __init__(self, shift: int, windows_first: bool = False, roll_batch: bool = False) -> None:
        super().__init__()
        self.shift, self.windows_first, self.roll_dims = shift, windows_first, (0, 1) if roll_batch else (1, 2)
        self.before, self.after = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention = WindowAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.register_buffer("mask", shifted_mask(shift) if shift else None, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, _, channels = x.shape
        grid = self.before(x).view(batch, SIZE, SIZE, channels)
        if self.shift:
            grid = torch.roll(grid, shifts=(-self.shift, -self.shift), dims=self.roll_dims)
        windows = self.attention(partition(grid, WINDOW, self.windows_first), self.mask)
        grid = merge(windows, WINDOW, SIZE, SIZE, self.windows_first)
        if self.shift:
            grid = torch.roll(grid, shifts=(self.shift, self.shift), dims=self.roll_dims)
        x = x + grid.view(batch, SIZE * SIZE, channels)
        return x + self.mlp(self.after(x))


class Swin(nn.Module):
    """2x2 patches of a 16x16 image embedded to DIM channels, two Swin layers (windows, then shifted windows), the
    mean token classified into 5."""

    def __init__(self, windows_first: bool = False, roll_batch: bool = False) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, DIM, 2, stride=2)
        self.layers = nn.Sequential(SwinLayer(0, windows_first), SwinLayer(2, windows_first, roll_batch))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, 5)

    def forward(self, images: Tensor) -> Tensor:
        tokens = self.patches(images).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.layers(tokens)).mean(1))


def built(**variant: bool) -> nn.Module:
    torch.manual_seed(0)
    return mt.insert(Swin(**variant), N, 2.0, seed=0, example_input=replicas.images(4)).eval()  # torch.fx cannot
    # trace the expand over ``rows // windows`` images: insert checks the model on the example instead


def attention_fallbacks(packed: mt.PackedMasksembles) -> list[str]:
    """Fallbacks of the attention on the windows (not the shared mask's expand and sum, computed once)."""
    return [row for row in packed.fallbacks if any(s in row for s in ("scaled_dot_product", "transpose", "proj"))]


def test_window_attention_folds_into_the_heads_on_the_export_path() -> None:
    """Both layers' attention folded (before: every operation between the projections ran on the member-stacked
    batch, and the projections' masks with them); nothing that computes falls back; equal to predict."""
    model = built()
    packed = mt.pack(model, (replicas.images(4),), program="packed")
    assert attention_fallbacks(packed) == [], packed.fallbacks
    assert not [row for row in packed.fallbacks if "roll" in row or "proj" in row], packed.fallbacks
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    assert "to_batch" not in program_code(packed)
    check_equal_to_predict(model, packed, lambda batch: replicas.images(batch, seed=batch), N)


def test_timm_window_attention_folds_on_the_fx_path() -> None:
    """timm's layout (tests/torch/replicas.py: a fused qkv, written-out attention, the shifted mask added on a
    (B, windows, heads, L, L) view): folded, equal to predict, and one member equal to its part."""
    model = mt.insert(replicas.build("swin"), N, 2.0, seed=0).eval()
    packed = mt.pack(model, replicas.images(4), program="packed")
    assert not [row for row in packed.fallbacks if "matmul" in row or "softmax" in row or "roll" in row]
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    check_equal_to_predict(model, packed, lambda batch: replicas.images(batch, seed=batch), N)
    check_member_equal_to_predict(model, replicas.images(5, seed=5), N)


def test_windows_that_scatter_the_samples_rows_do_not_fold() -> None:
    """Windows outermost (image b's windows at rows w*B + b): the rows are not each sample's together, so the
    attention runs as the dense model runs it (counted in ``macs["fallback"]``), equal to predict."""
    model = built(windows_first=True)
    packed = mt.pack(model, (replicas.images(4),), program="packed")
    assert attention_fallbacks(packed) and packed.macs["fallback"] > 0, packed.fallbacks
    check_equal_to_predict(model, packed, lambda batch: replicas.images(batch, seed=batch), N)


def test_a_roll_along_the_batch_is_not_a_move() -> None:
    """The cyclic shift along the batch and H (it trades rows between samples): the roll runs as the dense model
    runs it, on the member-stacked batch, and the program equals predict."""
    model = built(roll_batch=True)
    packed = mt.pack(model, (replicas.images(4),), program="packed")
    assert [row for row in packed.fallbacks if "roll" in row], packed.fallbacks
    check_equal_to_predict(model, packed, lambda batch: replicas.images(batch, seed=batch), N)


@pytest.mark.skipif("transformers" not in requested_backends(), reason="backend 'transformers' not requested")
def test_the_real_swin_packs_with_its_window_attention_folded() -> None:
    """``transformers``' Swin at a tiny size (one stage of two layers, windows of 4 on an 8x8 grid, shifted in the
    second): before, both layers' attention fell back; now only the shared mask's expand and sum (no multiply-add)
    run at full width, and the program equals predict."""
    import transformers

    config = transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[2], num_heads=[2], window_size=4, num_labels=3
    )
    torch.manual_seed(0)
    single = transformers.SwinForImageClassification(config).eval()

    def batch_of(size: int, seed: int = 0) -> dict[str, Tensor]:
        return {"pixel_values": torch.randn(size, 3, 32, 32, generator=torch.Generator().manual_seed(seed))}

    model = mt.insert(single, N, 2.0, seed=0, example_input=batch_of(4)).eval()
    packed = mt.pack(model, batch_of(4), program="packed")
    computing = [row for row in packed.fallbacks if not any(s in row for s in ("expand", "reshape", "add"))]
    assert computing == [], packed.fallbacks
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    for size in (3, 6):
        batch = batch_of(size, seed=size)
        assert_rounding_close(packed(**batch).logits, mt.predict(model, batch).logits)
