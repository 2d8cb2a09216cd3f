"""MobileViT's patches compacted by ``pack``. MobileViT-v2: ``F.unfold`` viewed (B, C, K, L) and its inverse,
(B, C, K, L) viewed (B, C*K, L) for ``F.fold``, each read as one operation that takes channel ``c`` from channel ``c``
alone (unfold writes channel c's K kernel positions next to each other, fold sums them back), each sample from itself.
MobileViT (v1): the views and transposes from (B, C, H, W) to (B*ph*pw, patches, C) and back, proven on each
element's index to be one move that keeps each sample's rows together. The layers between them run on each member's
channels. A view that mixes the channels with the kernel positions stays a fallback; every program equals
``predict``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import masksembles_torch as mt
from tests.torch.packing_checks import check_equal_to_predict, check_member_equal_to_predict, program_code

N = 4


class MobileViTV2Layer(nn.Module):
    """``transformers``' ``MobileViTV2Layer`` without its attention: a 3x3 and a 1x1 convolution, the patches
    (``unfolding``: ``F.unfold`` with kernel = stride = patch, viewed (B, C, patch area, patches)), a GroupNorm and a
    1x1-convolution MLP with its residual sum on (B, C, K, L), a GroupNorm, ``folding`` and a 1x1 projection. With
    ``mixed`` the patches are viewed (B, K, C, L) and transposed instead: channels and kernel positions mixed."""

    def __init__(self, dim: int = 8, patch: int = 2, mixed: bool = False) -> None:
        super().__init__()
        self.patch, self.mixed = patch, mixed
        self.conv_kxk, self.conv_1x1 = nn.Conv2d(dim, dim, 3, padding=1), nn.Conv2d(dim, dim, 1, bias=False)
        self.norm_before, self.norm_after = nn.GroupNorm(1, dim), nn.GroupNorm(1, dim)
        self.ffn = nn.Sequential(nn.Conv2d(dim, 2 * dim, 1), nn.SiLU(), nn.Conv2d(2 * dim, dim, 1))
        self.projection = nn.Conv2d(dim, dim, 1)

    def unfolding(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        batch_size, in_channels, height, width = x.shape
        patches = F.unfold(x, kernel_size=(self.patch, self.patch), stride=(self.patch, self.patch))
        if self.mixed:  # (B, K, C, L) read back as (B, C, K, L): each new channel holds several channels' values
            mixed = patches.reshape(batch_size, self.patch * self.patch, in_channels, -1).transpose(1, 2)
            return mixed, (height, width)
        return patches.reshape(batch_size, in_channels, self.patch * self.patch, -1), (height, width)

    def folding(self, patches: Tensor, output_size: tuple[int, int]) -> Tensor:
        batch_size, in_dim, patch_size, n_patches = patches.shape
        patches = patches.reshape(batch_size, in_dim * patch_size, n_patches)
        return F.fold(patches, output_size=output_size, kernel_size=self.patch, stride=self.patch)

    def forward(self, x: Tensor) -> Tensor:
        patches, size = self.unfolding(self.conv_1x1(F.silu(self.conv_kxk(x))))
        patches = patches + self.ffn(self.norm_before(patches))
        return self.projection(self.folding(self.norm_after(patches), size))


class MobileViTV2(nn.Module):
    def __init__(self, mixed: bool = False, dim: int = 8) -> None:
        super().__init__()
        self.stem, self.layer, self.head = (
            nn.Conv2d(3, dim, 2, stride=2),
            MobileViTV2Layer(dim, mixed=mixed),
            nn.Linear(dim, 5),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(self.stem(x)).mean((2, 3)))


def built(mixed: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return mt.insert(MobileViTV2(mixed), N, 2.0, seed=0).eval()


def images(batch: int) -> Tensor:
    """A batch of ``batch`` 3x16x16 images, seeded by its size."""
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(batch))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_mobilevit_v2_patches_compact(capture: str) -> None:
    """Nothing of the layer falls back (before: the unfold, its view, and the GroupNorm reading them ran at full
    width, with moves to and from the member-stacked batch); the program equals predict."""
    model = built()
    x = torch.randn(4, 3, 16, 16)
    packed = mt.pack(model, x if capture == "fx" else (x,), program="packed")
    assert packed.fallbacks == (), packed.fallbacks
    code = program_code(packed)
    assert "unfold_patches" in code and "fold_patches" in code and "to_batch" not in code
    check_equal_to_predict(model, packed, images, N)
    if capture == "fx":
        check_member_equal_to_predict(model, x, N)


def test_patches_viewed_across_the_channels_stay_fallbacks() -> None:
    """Viewed (B, K, C, L), each new channel mixes kernel positions of several channels: it runs as the model runs
    it, and the program equals predict."""
    model = built(mixed=True)
    packed = mt.pack(model, torch.randn(4, 3, 16, 16), program="packed")
    assert packed.fallbacks and "unfold_patches" not in program_code(packed)
    check_equal_to_predict(model, packed, images, N)


class MobileViTLayer(nn.Module):
    """``transformers``' ``MobileViTLayer`` (v1) with one transformer layer: a 3x3 and a 1x1 convolution, its
    ``unfolding`` (views and transposes to (B*ph*pw, patches, C)), a pre-norm attention block and MLP on the rows,
    a LayerNorm, its ``folding`` back to (B, C, H, W), a 1x1 projection and the fusion convolution of the input and
    the result concatenated."""

    def __init__(self, channels: int = 8, dim: int = 16, heads: int = 2, patch: int = 2) -> None:
        super().__init__()
        self.patch, self.heads = patch, heads
        self.conv_kxk, self.conv_1x1 = nn.Conv2d(channels, channels, 3, padding=1), nn.Conv2d(channels, dim, 1)
        self.norm1, self.norm2, self.norm = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
        self.projection, self.fusion = nn.Conv2d(dim, channels, 1), nn.Conv2d(2 * channels, channels, 3, padding=1)

    def unfolding(self, features: Tensor) -> tuple[Tensor, dict[str, int]]:
        patch_area = self.patch * self.patch
        batch_size, channels, height, width = features.shape
        num_patch_height, num_patch_width = height // self.patch, width // self.patch
        num_patches = num_patch_height * num_patch_width
        patches = features.reshape(batch_size * channels * num_patch_height, self.patch, num_patch_width, self.patch)
        patches = patches.transpose(1, 2)
        patches = patches.reshape(batch_size, channels, num_patches, patch_area)
        patches = patches.transpose(1, 3)
        patches = patches.reshape(batch_size * patch_area, num_patches, -1)
        info = {"batch_size": batch_size, "channels": channels, "num_patches": num_patches,
                "num_patch_height": num_patch_height, "num_patch_width": num_patch_width}  # fmt: skip
        return patches, info

    def folding(self, patches: Tensor, info: dict[str, int]) -> Tensor:
        batch_size, channels, patch_area = info["batch_size"], info["channels"], self.patch * self.patch
        features = patches.contiguous().view(batch_size, patch_area, info["num_patches"], -1)
        features = features.transpose(1, 3)
        features = features.reshape(
            batch_size * channels * info["num_patch_height"], info["num_patch_width"], self.patch, self.patch
        )
        features = features.transpose(1, 2)
        return features.reshape(
            batch_size, channels, info["num_patch_height"] * self.patch, info["num_patch_width"] * self.patch
        )

    def attention(self, x: Tensor) -> Tensor:
        rows, length, dim = x.shape
        q, k, v = (
            layer(x).view(rows, length, self.heads, dim // self.heads).transpose(1, 2)
            for layer in (self.query, self.key, self.value)
        )
        context = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(rows, length, dim)
        return self.out(context)

    def forward(self, x: Tensor) -> Tensor:
        features = self.conv_1x1(F.silu(self.conv_kxk(x)))
        patches, info = self.unfolding(features)
        patches = patches + self.attention(self.norm1(patches))
        patches = self.norm(patches + self.mlp(self.norm2(patches)))
        features = self.projection(self.folding(patches, info))
        return self.fusion(torch.cat((x, features), 1))


class MobileViT(nn.Module):
    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.stem, self.layer, self.head = (
            nn.Conv2d(3, channels, 2, stride=2),
            MobileViTLayer(channels),
            nn.Linear(channels, 5),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(self.stem(x)).mean((2, 3)))


QKV = ("layer.query", "layer.key", "layer.value")  # their paths, in both captures' names


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_mobilevit_patch_rows_compact_and_the_transformer_with_them(capture: str) -> None:
    """The unfolding and folding chains become one move each that keeps each sample's rows together: the query, key
    and value Linear layers on the patch rows compact (before, every Linear layer of the transformer fell back,
    reading rows of a fallback). The attention on the rows (patches folded into the batch, as Swin's windows) runs
    with the members folded into its heads (before: on the member-stacked batch, with what reads its rows); the
    program equals predict."""
    torch.manual_seed(0)
    model = mt.insert(MobileViT(), N, 2.0, seed=0).eval()
    x = torch.randn(4, 3, 16, 16)
    packed = mt.pack(model, x if capture == "fx" else (x,), program="packed")
    code = program_code(packed)
    assert "patches_to_rows" in code and "rows_to_patches" in code
    assert not [row for row in packed.fallbacks if any(name in row for name in (*QKV, "patches_to_rows"))]
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"], packed.fallbacks
    check_equal_to_predict(model, packed, images, N)
    if capture == "fx":
        check_member_equal_to_predict(model, x, N)
