"""Conv1d layers in the packed program run as Conv2d on one row of positions in channels-last memory (oneDNN's
grouped Conv1d is slower per multiply-add than a dense one; issue #39), with every setting a Conv1d takes: the
program equals predict and its multiply-adds are the Conv1d's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import masksembles_torch as mt

N = 4


def one_d_cnn(**conv: Any) -> nn.Module:
    """Issue #39's 1-D CNN: three Conv1d layers and a Linear, masks before the last three; ``conv``: the second
    convolution's settings."""
    torch.manual_seed(0)
    settings = {"kernel_size": 5, "padding": 2, **conv}
    return nn.Sequential(
        nn.Conv1d(2, 16, 7, padding=3), nn.ReLU(), mt.Masksembles1D(16, N, 2.0, seed=0),
        nn.Conv1d(16, 24, **settings), nn.ReLU(), mt.Masksembles1D(24, N, 2.0, seed=1),
        nn.Conv1d(24, 24, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
        mt.Masksembles1D(24, N, 2.0, seed=2), nn.Linear(24, 5),
    ).eval()  # fmt: skip


class FunctionalConv(nn.Module):
    """``F.conv1d`` with a stride and a dilation between two masks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.masks1 = nn.Conv1d(2, 12, 3), mt.Masksembles1D(12, N, 2.0, seed=3)
        self.weight = nn.Parameter(torch.randn(8, 12, 3) * 0.3)
        self.masks2, self.head = mt.Masksembles1D(8, N, 2.0, seed=4), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv1d(F.gelu(self.masks1(self.stem(x))), self.weight, stride=2, dilation=2)
        return self.head(self.masks2(y).amax(-1))


@pytest.mark.parametrize(
    "model",
    [
        one_d_cnn(),
        one_d_cnn(stride=2, dilation=2, bias=False),
        one_d_cnn(padding="same", padding_mode="reflect"),
        one_d_cnn(padding=2, padding_mode="circular", groups=2),
        FunctionalConv().eval(),
    ],
    ids=["issue", "strided-dilated", "same-reflect", "circular-grouped", "functional"],
)
def test_conv1d_runs_as_a_channels_last_conv2d_and_equals_predict(model: nn.Module) -> None:
    x = torch.randn(7, 2, 29, generator=torch.Generator().manual_seed(0))
    packed = mt.pack(model, x[:3], program="packed")
    assert packed.fallbacks == ()
    modules = list(packed.modules())
    assert not any(isinstance(module, nn.Conv1d) for module in modules)
    assert any(isinstance(module, nn.Conv2d) and module.groups == N for module in modules), "the members, grouped"
    torch.testing.assert_close(packed(x), mt.predict(model, x, N), rtol=1e-5, atol=1e-5)
    member = mt.extract_member(model, 2, x[:3])
    torch.testing.assert_close(member(x), mt.predict(model, x, N)[2], rtol=1e-5, atol=1e-5)


def test_the_issue_cnn_counts_its_conv1d_multiply_adds_and_exports() -> None:
    model = one_d_cnn()
    x = torch.randn(5, 2, 29, generator=torch.Generator().manual_seed(1))
    packed = mt.pack(model, x, program="packed")
    single = 29 * (2 * 16 * 7 + 16 * 24 * 5 + 24 * 24 * 3) + 24 * 5
    assert packed.macs["dense"] == N * single
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        packed(x)
    assert packed.macs["packed"] * 5 == counter.get_total_flops() // 2
    exported = mt.pack(model, (x,), program="packed")  # through torch.export
    assert exported.macs["dense"] == packed.macs["dense"]
    torch.testing.assert_close(exported(x), packed(x), rtol=1e-5, atol=1e-6)
