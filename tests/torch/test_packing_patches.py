"""MobileViT-v2's patches compacted by ``pack``: ``F.unfold`` viewed (B, C, K, L) and its inverse, (B, C, K, L)
viewed (B, C*K, L) for ``F.fold``, each read as one operation that takes channel ``c`` from channel ``c`` alone
(unfold writes channel c's K kernel positions next to each other, fold sums them back), each sample from itself: the
layers between them run on each member's channels. A view that mixes the channels with the kernel positions stays a
fallback; every program equals ``predict``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

import masksembles_torch as mt
from tests.rounding import assert_rounding_close

N = 4


class MobileViTV2Layer(nn.Module):
    """``transformers``' ``MobileViTV2Layer`` without its attention: a 3x3 and a 1x1 convolution, the patches
    (``unfolding``: ``F.unfold`` with kernel = stride = patch, viewed (B, C, patch area, patches)), a GroupNorm and a
    1x1-convolution MLP with its residual sum on (B, C, K, L), a GroupNorm, ``folding`` and a 1x1 projection. With
    ``mixed`` the patches are viewed (B, K, C, L) instead: channels and kernel positions exchanged."""

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
        if self.mixed:
            return patches.reshape(batch_size, self.patch * self.patch, in_channels, -1), (height, width)
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


def program_code(packed: nn.Module) -> str:
    return "\n".join(module.code for module in packed.modules() if isinstance(module, fx.GraphModule))


def check_equal_to_predict(model: nn.Module, packed: nn.Module) -> None:
    for batch in (3, 8):
        x = torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(batch))
        assert_rounding_close(packed(x), mt.predict(model, x, N))


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
    check_equal_to_predict(model, packed)


def test_patches_viewed_across_the_channels_stay_fallbacks() -> None:
    """Viewed (B, K, C, L), each new channel mixes kernel positions of several channels: it runs as the model runs
    it, and the program equals predict."""
    model = built(mixed=True)
    packed = mt.pack(model, torch.randn(4, 3, 16, 16), program="packed")
    assert packed.fallbacks and "unfold_patches" not in program_code(packed)
    check_equal_to_predict(model, packed)
