"""A replica of torchvision's Swin Transformer (``torchvision.models.swin_t``'s layout, at a tiny size), written from
how torchvision builds it (torchvision is not imported: its C ops do not load on the CPU build of torch these tests
run on).

What matters for ``pack`` is kept as torchvision has it: the window attention is one module-level function,
``shifted_window_attention(input, qkv_weight, proj_weight, relative_position_bias, window_size, num_heads,
shift_size, ...)``, registered with ``torch.fx.wrap`` (so a symbolic trace records it as one call, its Python
branches on sizes never traced), as are the patch merging's pad and the gather of the relative position bias. Inside
the function: the (B, H, W, C) grid zero-padded to whole windows, rolled back by the shift, cut into windows folded
into the batch, (B*windows, ws*ws, C); one fused qkv projection from the weights, q scaled, q @ k^T plus the bias;
for a shifted window the mask of its regions (built from the padded grid's size: 0 within a region, -100 between)
added on a (B, windows, heads, L, L) view; softmax, attention dropout, @ v, the output projection, dropout; the
windows merged, rolled forward, the padding cut off. A window as large as the padded grid is not shifted (torchvision
writes 0 into the block's ``shift_size`` list then).

``build()``: 14x14 images, 2x2 patches, so the 7x7 grid of the first stage is padded to 8x8 (four 4x4 windows, shifted
by 2 in its second block); patch merging pads 7x7 to 8x8 and halves it to 4x4, where the window covers the grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.torch.zoo import StochasticDepth

IMAGE = (3, 14, 14)


def _patch_merging_pad(x: Tensor) -> Tensor:
    """(..., H, W, C) zero-padded at the bottom and right to even H and W."""
    height, width = x.shape[-3], x.shape[-2]
    return F.pad(x, (0, 0, 0, width % 2, 0, height % 2))


torch.fx.wrap("_patch_merging_pad")


def _get_relative_position_bias(table: Tensor, index: Tensor, window_size: list[int]) -> Tensor:
    """(1, heads, L, L) with L = window area: the table's row of each pair's relative position."""
    area = window_size[0] * window_size[1]
    gathered = table[index].view(area, area, -1)
    return gathered.permute(2, 0, 1).contiguous().unsqueeze(0)


torch.fx.wrap("_get_relative_position_bias")


def _region_mask(padded: tuple[int, int], window_size: list[int], shift_size: list[int], like: Tensor) -> Tensor:
    """(windows, L, L): 0 between two positions of one region of the rolled grid, -100 between regions."""
    regions = like.new_zeros(padded)
    cuts = [((0, -w), (-w, -s), (-s, None)) for w, s in zip(window_size, shift_size, strict=True)]
    label = 0
    for top, bottom in cuts[0]:
        for left, right in cuts[1]:
            regions[top:bottom, left:right] = label
            label += 1
    rows, cols = padded[0] // window_size[0], padded[1] // window_size[1]
    regions = regions.view(rows, window_size[0], cols, window_size[1]).permute(0, 2, 1, 3)
    ids = regions.reshape(rows * cols, window_size[0] * window_size[1])
    difference = ids.unsqueeze(1) - ids.unsqueeze(2)
    return difference.masked_fill(difference != 0, -100.0).masked_fill(difference == 0, 0.0)


def shifted_window_attention(
    input: Tensor,
    qkv_weight: Tensor,
    proj_weight: Tensor,
    relative_position_bias: Tensor,
    window_size: list[int],
    num_heads: int,
    shift_size: list[int],
    attention_dropout: float = 0.0,
    dropout: float = 0.0,
    qkv_bias: Tensor | None = None,
    proj_bias: Tensor | None = None,
) -> Tensor:
    """(B, H, W, C) -> (B, H, W, C): multi-head attention within each (shifted) window, as torchvision computes it."""
    batch, height, width, channels = input.shape
    pad_right = (window_size[1] - width % window_size[1]) % window_size[1]
    pad_bottom = (window_size[0] - height % window_size[0]) % window_size[0]
    x = F.pad(input, (0, 0, 0, pad_right, 0, pad_bottom))
    _, padded_height, padded_width, _ = x.shape
    if window_size[0] >= padded_height:
        shift_size[0] = 0
    if window_size[1] >= padded_width:
        shift_size[1] = 0
    shifted = sum(shift_size) > 0
    if shifted:
        x = torch.roll(x, shifts=(-shift_size[0], -shift_size[1]), dims=(1, 2))
    rows, cols = padded_height // window_size[0], padded_width // window_size[1]
    windows = rows * cols
    x = x.view(batch, rows, window_size[0], cols, window_size[1], channels)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(batch * windows, window_size[0] * window_size[1], channels)

    head_dim = channels // num_heads
    qkv = F.linear(x, qkv_weight, qkv_bias)
    qkv = qkv.reshape(x.size(0), x.size(1), 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    q = q * head_dim**-0.5
    attention = q.matmul(k.transpose(-2, -1)) + relative_position_bias
    if shifted:
        mask = _region_mask((padded_height, padded_width), window_size, shift_size, x)
        attention = attention.view(x.size(0) // windows, windows, num_heads, x.size(1), x.size(1))
        attention = attention + mask.unsqueeze(1).unsqueeze(0)
        attention = attention.view(-1, num_heads, x.size(1), x.size(1))
    attention = F.dropout(F.softmax(attention, dim=-1), p=attention_dropout)
    x = attention.matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), channels)
    x = F.dropout(F.linear(x, proj_weight, proj_bias), p=dropout)

    x = x.view(batch, rows, cols, window_size[0], window_size[1], channels)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(batch, padded_height, padded_width, channels)
    if shifted:
        x = torch.roll(x, shifts=(shift_size[0], shift_size[1]), dims=(1, 2))
    return x[:, :height, :width, :].contiguous()


torch.fx.wrap("shifted_window_attention")


class ShiftedWindowAttention(nn.Module):
    """The parameters of ``shifted_window_attention`` (a fused qkv and an output Linear, the bias table per relative
    position and head) and the call."""

    def __init__(self, dim: int, window_size: list[int], shift_size: list[int], num_heads: int) -> None:
        super().__init__()
        self.window_size, self.shift_size, self.num_heads = window_size, shift_size, num_heads
        self.attention_dropout = self.dropout = 0.0
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        spans = [2 * w - 1 for w in window_size]
        self.relative_position_bias_table = nn.Parameter(torch.zeros(spans[0] * spans[1], num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        grid = torch.meshgrid(torch.arange(window_size[0]), torch.arange(window_size[1]), indexing="ij")
        positions = torch.stack(grid).flatten(1)  # (2, L)
        offsets = (positions[:, :, None] - positions[:, None, :]).permute(1, 2, 0)  # (L, L, 2), from -(w-1)
        index = (offsets[..., 0] + window_size[0] - 1) * spans[1] + offsets[..., 1] + window_size[1] - 1
        self.register_buffer("relative_position_index", index.flatten())

    def forward(self, x: Tensor) -> Tensor:
        bias = _get_relative_position_bias(
            self.relative_position_bias_table, self.relative_position_index, self.window_size
        )
        return shifted_window_attention(
            x, self.qkv.weight, self.proj.weight, bias, self.window_size, self.num_heads, shift_size=self.shift_size,
            attention_dropout=self.attention_dropout, dropout=self.dropout, qkv_bias=self.qkv.bias,
            proj_bias=self.proj.bias,
        )  # fmt: skip


class MLP(nn.Sequential):
    """torchvision's ``ops.MLP(dim, [hidden, dim], activation_layer=nn.GELU)``: Linear, GELU, Dropout, Linear,
    Dropout."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(0.0), nn.Linear(hidden, dim), nn.Dropout(0.0))


class SwinTransformerBlock(nn.Module):
    """(B, H, W, C): x + attention(norm(x)), then x + MLP(norm(x)), each branch through stochastic depth."""

    def __init__(self, dim: int, heads: int, window_size: list[int], shift_size: list[int], depth_prob: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ShiftedWindowAttention(dim, window_size, shift_size, heads)
        self.stochastic_depth = StochasticDepth(depth_prob, "row")
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.stochastic_depth(self.attn(self.norm1(x)))
        return x + self.stochastic_depth(self.mlp(self.norm2(x)))


class PatchMerging(nn.Module):
    """(B, H, W, C) -> (B, ceil(H/2), ceil(W/2), 2C): each 2x2 neighbourhood's four positions side by side on the
    channels (after the pad to even sizes), LayerNorm, a Linear without bias."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.reduction = nn.LayerNorm(4 * dim), nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = _patch_merging_pad(x)
        parts = [x[..., 0::2, 0::2, :], x[..., 1::2, 0::2, :], x[..., 0::2, 1::2, :], x[..., 1::2, 1::2, :]]
        return self.reduction(self.norm(torch.cat(parts, -1)))


class Permute(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: Tensor) -> Tensor:
        return torch.permute(x, self.dims)


class SwinTransformer(nn.Module):
    """Patches embedded channels-last, stages of blocks (every second one shifted by half a window) with patch
    merging between them, LayerNorm, the mean over positions, a Linear head."""

    def __init__(
        self, patch: int = 2, embed_dim: int = 16, depths: tuple[int, ...] = (2, 2), heads: tuple[int, ...] = (2, 4),
        window_size: tuple[int, int] = (4, 4), depth_prob: float = 0.2, classes: int = 5,
    ) -> None:  # fmt: skip
        super().__init__()
        layers: list[nn.Module] = [
            nn.Sequential(nn.Conv2d(3, embed_dim, patch, stride=patch), Permute([0, 2, 3, 1]), nn.LayerNorm(embed_dim))
        ]
        blocks, done = sum(depths), 0
        for stage, (depth, stage_heads) in enumerate(zip(depths, heads, strict=True)):
            dim = embed_dim * 2**stage
            stage_blocks = []
            for i in range(depth):
                shift = [0 if i % 2 == 0 else w // 2 for w in window_size]
                probability = depth_prob * done / (blocks - 1)
                stage_blocks.append(SwinTransformerBlock(dim, stage_heads, list(window_size), shift, probability))
                done += 1
            layers.append(nn.Sequential(*stage_blocks))
            if stage < len(depths) - 1:
                layers.append(PatchMerging(dim))
        self.features = nn.Sequential(*layers)
        features = embed_dim * 2 ** (len(depths) - 1)
        self.norm, self.avgpool = nn.LayerNorm(features), nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(features, classes)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(self.features(x))
        return self.head(torch.flatten(self.avgpool(x.permute(0, 3, 1, 2)), 1))


def build(seed: int = 0, **config: object) -> SwinTransformer:
    torch.manual_seed(seed)
    return SwinTransformer(**config).eval()  # type: ignore[arg-type]


def images(batch: int, seed: int = 0) -> Tensor:
    return torch.randn(batch, *IMAGE, generator=torch.Generator().manual_seed(seed))
