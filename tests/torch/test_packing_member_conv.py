"""On CPU the members' convolutions that read many channels on few positions run one member at a time
(``MemberConv``: oneDNN's grouped convolution is several times slower there); the packed program equals predict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import masksembles_torch as mt
from masksembles_torch import _packed_ops

N = 4


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(8 * N, 6 * N, 3, padding=1, groups=N),
        nn.Conv2d(8 * N, 6 * N, 3, stride=2, padding=1, padding_mode="reflect", groups=N, bias=False),
        nn.Conv1d(4 * N, 2 * N, 1, groups=N),
    ],
    ids=["3x3", "strided-reflect-no-bias", "1d"],
)
def test_member_convolution_equals_the_grouped_one(conv: nn.Module) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, conv.in_channels, *([5] * (conv.weight.dim() - 2)))
    member = _packed_ops.MemberConv(conv, N)
    with torch.no_grad():
        torch.testing.assert_close(member(x), conv(x), rtol=1e-5, atol=1e-6)


def wide(size: int) -> nn.Module:
    """1024 channels (512 per member at S=2) on ``size``×``size`` positions into a 3×3 and a 1×1 convolution."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 1024, 3, padding=1), nn.ReLU(), mt.Masksembles2D(1024, N, 2.0, seed=0),
        nn.Conv2d(1024, 16, 3, padding=1), nn.ReLU(), mt.Masksembles2D(16, N, 2.0, seed=1),
        nn.Conv2d(16, 1024, 1), nn.ReLU(), mt.Masksembles2D(1024, N, 2.0, seed=2),
        nn.Conv2d(1024, 8, 1), nn.Flatten(), nn.Linear(8 * size * size, 5),
    ).eval()  # fmt: skip


@pytest.mark.parametrize(("size", "batch", "apart"), [(4, 1, 2), (4, 2, 1), (2, 2, 2), (8, 1, 0)])
def test_wide_convolutions_on_few_positions_run_one_member_at_a_time(size: int, batch: int, apart: int) -> None:
    """The 3×3 convolution runs apart on at most 16 positions per sample, the 1×1 one on at most 16 in all (the
    example's batch): ``apart`` of them; the program equals predict at the example's batch and another."""
    model = wide(size)
    x = torch.randn(batch, 3, size, size)
    packed = mt.pack(model, x, program="packed")
    assert sum(isinstance(module, _packed_ops.MemberConv) for module in packed.modules()) == apart
    for given in (x, torch.randn(5, 3, size, size)):
        torch.testing.assert_close(packed(given), mt.predict(model, given, N), rtol=1e-5, atol=1e-5)
