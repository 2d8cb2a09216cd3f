"""``F.pad`` on a channels-last grid, (B, H, W, C) padded on H and W (torchvision's Swin pads to whole windows):
channel ``c`` comes from channel ``c``, so it compacts. A pad that reaches the channels does not; a pad with a
constant other than 0 compacts with the channels it makes live at full width (zero does not stay zero: evaluated).
Every program equals ``predict``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import masksembles_torch as mt
from tests.torch.packing_checks import check_equal_to_predict

N = 4


class PaddedGrid(nn.Module):
    """(B, 3, 7, 7) -> (B, 5): a 1x1 convolution, channels last, a Linear, the pad, a Linear, the mean, a head."""

    def __init__(self, pad: tuple[int, ...], value: float) -> None:
        super().__init__()
        self.pad, self.value = pad, value
        self.embed, self.mix, self.head = nn.Conv2d(3, 8, 1), nn.Linear(8, 8), nn.Linear(8, 5)
        self.after = nn.Linear(8 + pad[0] + pad[1], 8)  # wider where the pad reaches the channels

    def forward(self, x: Tensor) -> Tensor:
        grid = self.mix(self.embed(x).permute(0, 2, 3, 1))
        padded = F.pad(grid, self.pad, value=self.value)
        return self.head(self.after(padded).mean((1, 2)))


def images(batch: int) -> Tensor:
    return torch.randn(batch, 3, 7, 7, generator=torch.Generator().manual_seed(batch))


@pytest.mark.parametrize(
    ("pad", "value", "compacts"),
    [((0, 0, 0, 1, 0, 1), 0.0, True), ((0, 0, 0, 1, 0, 1), 0.5, True), ((0, 1, 0, 1, 0, 1), 0.0, False)],
    ids=["on-H-and-W", "a-constant-other-than-0", "reaching-the-channels"],
)
def test_a_channels_last_pad(pad: tuple[int, ...], value: float, compacts: bool) -> None:
    torch.manual_seed(0)
    model = mt.insert(PaddedGrid(pad, value), N, 2.0, seed=0).eval()
    packed = mt.pack(model, images(4), program="packed")
    assert any("pad" in row for row in packed.fallbacks) != compacts, packed.fallbacks
    assert not [row for row in packed.fallbacks if row.startswith("verification")], packed.fallbacks
    check_equal_to_predict(model, packed, images, N)
