"""ConvNeXt-V2's Global Response Normalization compacted by ``pack``: GRN's ratio ``g / (g.mean(channels) + eps)``
is read as one ``"mean_ratio"`` of the core (its mean counts the zeros a mask leaves, as the dense model's does, by
dividing each member's sum by the full width), the spatial L2 norm as a per-channel reduction and ``addcmul`` as an
elementwise operation; on the torch.fx path and on the torch.export path alike. A ratio whose statistic does not count
zeros that way (a maximum over the channels) or that reads the batch stays a fallback, and every program equals
``predict``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, fx, nn

import masksembles_torch as mt
from masksembles_torch import _packed_ops
from tests.torch.packing_checks import check_equal_to_predict, check_member_equal_to_predict, program_code

N = 4


def transformers_grn(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``transformers``' ``ConvNextV2GRN`` (channels last, (1, 1, 1, C) parameters)."""
    global_features = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True)
    norm_features = global_features / (global_features.mean(dim=-1, keepdim=True) + 1e-6)
    return weight * (x * norm_features) + bias + x


def timm_grn(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """timm's ``GlobalResponseNorm`` (channels last, (C,) parameters viewed, a fused ``addcmul``)."""
    x_g = x.norm(p=2, dim=(1, 2), keepdim=True)
    x_n = x_g / (x_g.mean(dim=-1, keepdim=True) + 1e-6)
    return x + torch.addcmul(bias.view(1, 1, 1, -1), weight.view(1, 1, 1, -1), x * x_n)


def paper_grn(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """The paper's GRN written channels first ((B, C, H, W), ``torch.norm``)."""
    gx = torch.norm(x, p=2, dim=(2, 3), keepdim=True)
    nx = gx / (gx.mean(dim=1, keepdim=True) + 1e-6)
    return weight.view(1, -1, 1, 1) * (x * nx) + bias.view(1, -1, 1, 1) + x


def max_ratio_grn(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """Not GRN: the norms over their maximum over the channels, which a zero channel can change (the maximum of
    negative values and a zero), so no member's block can compute it from its own channels."""
    g = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True) - 1.0
    return weight * (x * (g / (g.amax(dim=-1, keepdim=True) + 1e-6))) + bias + x


def batch_ratio_grn(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """Not GRN: the norms over their mean over the batch, which reads every sample (and member)."""
    g = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True)
    return weight * (x * (g / (g.mean(dim=0, keepdim=True) + 1e-6))) + bias + x


GRN = Callable[[Tensor, Tensor, Tensor], Tensor]


class Block(nn.Module):
    """ConvNeXt-V2's block as ``transformers`` writes it: a depthwise 7x7 convolution, channels last, LayerNorm,
    Linear to 4x, GELU, GRN, Linear back, channels first, the residual sum (``channels_first``: the paper's GRN on
    (B, C, H, W), between permutes)."""

    def __init__(self, dim: int, grn: GRN, channels_first: bool = False) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm, self.pwconv1, self.pwconv2 = (
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim),
            nn.Linear(4 * dim, dim),
        )
        self.grn, self.channels_first = grn, channels_first
        generator = torch.Generator().manual_seed(dim)  # GRN starts as the identity (zeros): trained-like values
        shape = (1, 1, 1, 4 * dim) if grn is transformers_grn else (4 * dim,)  # as each library stores them
        self.weight = nn.Parameter(torch.randn(shape, generator=generator) * 0.5)
        self.bias = nn.Parameter(torch.randn(shape, generator=generator) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        y = self.pwconv1(self.norm(self.dwconv(x).permute(0, 2, 3, 1)))
        y = nn.functional.gelu(y)
        if self.channels_first:
            y = self.grn(y.permute(0, 3, 1, 2), self.weight, self.bias).permute(0, 2, 3, 1)
        else:
            y = self.grn(y, self.weight, self.bias)
        return x + self.pwconv2(y).permute(0, 3, 1, 2)


class ConvNeXtV2(nn.Module):
    """A tiny ConvNeXt-V2: a patchify stem, two blocks, a pooled LayerNorm and a classifier."""

    def __init__(self, grn: GRN, dim: int = 8, channels_first: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 2, stride=2)
        self.blocks = nn.Sequential(Block(dim, grn, channels_first), Block(dim, grn, channels_first))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.stem(x)).mean((2, 3))))


class MaskedGRN(nn.Module):
    """A mask right before GRN (channels last), zero bias on a share of the channels: GRN reads each member's live
    channels only, its mean over them divided by the full width, and a zero channel with a zero bias stays zero for
    the next Linear layer."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.stem, self.fc = nn.Conv2d(3, dim, 2, stride=2), nn.Linear(dim, dim)
        self.masks = mt.Masksembles2D(dim, N, 2.0, seed=3, channel_axis=-1)
        generator = torch.Generator().manual_seed(4)
        self.weight = nn.Parameter(torch.randn(1, 1, 1, dim, generator=generator))
        self.bias = nn.Parameter(torch.zeros(1, 1, 1, dim))
        self.head = nn.Linear(dim, 5)

    def forward(self, x: Tensor) -> Tensor:
        y = self.masks(self.fc(self.stem(x).permute(0, 2, 3, 1)))
        return self.head(transformers_grn(y, self.weight, self.bias).mean((1, 2)))


NEGATIVE: dict[str, GRN] = {"max-over-channels": max_ratio_grn, "mean-over-batch": batch_ratio_grn}


def built(grn: GRN, channels_first: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return mt.insert(ConvNeXtV2(grn, channels_first=channels_first), N, 2.0, seed=0).eval()


def grn_fallbacks(packed: mt.PackedMasksembles) -> list[str]:
    return [row for row in packed.fallbacks if "blocks" in row]


SLOW = pytest.mark.slow  # the other forms on the export path: the same operations as on the fx path, once rewritten


def images(batch: int) -> Tensor:
    """A batch of ``batch`` 3x8x8 images, seeded by its size."""
    return torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(batch))


@pytest.mark.parametrize(
    ("grn", "channels_first", "capture"),
    [
        (transformers_grn, False, "fx"), (transformers_grn, False, "export"), (timm_grn, False, "fx"),
        pytest.param(timm_grn, False, "export", marks=SLOW), (paper_grn, True, "fx"),
        pytest.param(paper_grn, True, "export", marks=SLOW),
    ],
    ids=["transformers-fx", "transformers-export", "timm-fx", "timm-export", "paper-fx", "paper-export"],
)  # fmt: skip
def test_convnext_v2_blocks_compact_their_grn(grn: GRN, channels_first: bool, capture: str) -> None:
    """No operation of the blocks falls back (GRN's norm, ratio, ``addcmul`` and sums are compacted per member: no
    move to the member-stacked batch), and the program equals predict; a tuple input goes through torch.export."""
    model = built(grn, channels_first)
    x = torch.randn(4, 3, 8, 8)
    packed = mt.pack(model, x if capture == "fx" else (x,), program="packed")
    assert packed.program == "packed" and grn_fallbacks(packed) == [], packed.fallbacks
    code = program_code(packed)
    assert "mean_ratio_members" in code and "to_batch" not in code
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    check_equal_to_predict(model, packed, images, N)
    if capture == "fx":
        check_member_equal_to_predict(model, x, N)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_mask_before_grn_leaves_each_member_its_live_channels(capture: str) -> None:
    """GRN right after a mask computes each member's live channels only (its mean: their sum over the full width),
    and with a zero bias the dropped channels stay zero into the head: no channel is written back."""
    torch.manual_seed(0)
    model = MaskedGRN().eval()
    x = torch.randn(4, 3, 8, 8)
    packed = mt.pack(model, x if capture == "fx" else (x,), program="packed")
    assert packed.fallbacks == () and "mean_ratio_members" in program_code(packed)
    live = int(model.masks.masks.sum(1).max())
    (program, ratio) = next(
        (module, node) for module in packed.modules() if isinstance(module, fx.GraphModule)
        for node in module.graph.nodes if node.target is _packed_ops.mean_ratio_members
    )  # fmt: skip
    held = getattr(program, str(ratio.args[3].target))
    assert held.numel() == N * live, "each member's block holds its live channels, padded to the widest member"
    check_equal_to_predict(model, packed, images, N)


@pytest.mark.parametrize("name", list(NEGATIVE))
def test_ratios_that_do_not_count_zeros_as_a_mean_does_stay_fallbacks(name: str) -> None:
    """A maximum over the channels (a dropped channel's zero can be the maximum) and a mean over the batch are not
    GRN's mean: they run as the model runs them, and the program still equals predict."""
    model = built(NEGATIVE[name])
    x = torch.randn(4, 3, 8, 8)
    for packed in (mt.pack(model, x, program="packed"), mt.pack(model, (x,), program="packed")):
        assert grn_fallbacks(packed) and "mean_ratio_members" not in program_code(packed), packed.fallbacks
        check_equal_to_predict(model, packed, images, N)
