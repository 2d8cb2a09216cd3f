"""pack on a torch.export capture compacts what it compacts on a torch.fx capture: each ATen operation export gives
(BatchNorm, Hardswish and the other elementwise operations, pooling, resizing, reductions) is read as its torch-level
twin, which ``_pack_capture`` classifies once, whatever captured it. Models called with a tuple go through
torch.export, the same model called with its tensor through torch.fx; both equal ``predict`` up to float32 rounding."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import masksembles_torch as mt
from tests.rounding import assert_rounding_close

N = 4


def randomized(model: nn.Module) -> nn.Module:
    """``model`` in eval mode with BatchNorm statistics that are not the identity's."""
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
            assert module.running_var is not None
            module.running_mean.copy_(torch.rand(module.num_features, generator=generator) - 0.5)
            module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
            if module.affine:
                nn.init.uniform_(module.weight, 0.5, 1.5)
                nn.init.uniform_(module.bias, -0.5, 0.5)
    return model.eval()


class SqueezeExcite(nn.Module):
    """timm's/torchvision's squeeze-excite: a spatial mean, two 1x1 convolutions, a Hardsigmoid gate."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, channels // 2, 1), nn.Conv2d(channels // 2, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.expand(F.relu(self.reduce(x.mean((2, 3), keepdim=True))))
        return x * F.hardsigmoid(scale)


class SmallCNN(nn.Module):
    """A MobileNet-like CNN: BatchNorm, Hardswish and other activations, a clamp, pooling, squeeze-excite, an
    adaptive average pool and a spatial mean. With ``branch`` the pooling after the first block runs under
    ``if x.shape[-1] > 4`` (torch.fx cannot trace that, so ``pack`` captures it with torch.export); without, always
    (torch.fx traces it): the same function at the example's size."""

    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.branch = branch
        self.conv1, self.bn1, self.act1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Hardswish()
        self.masks1 = mt.Masksembles2D(16, N, 2.0, seed=0)
        self.gate = nn.Hardsigmoid()
        self.conv2, self.bn2, self.se = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), SqueezeExcite(16)
        self.masks2 = mt.Masksembles2D(16, N, 2.0, seed=1)
        self.conv3, self.pool3 = nn.Conv2d(16, 16, 3, padding=1), nn.AdaptiveAvgPool2d(2)
        self.masks3, self.fc = mt.Masksembles1D(16, N, 2.0, seed=2), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.masks1(self.act1(self.bn1(self.conv1(x))))
        x = F.leaky_relu(F.gelu(F.silu(x), approximate="tanh"), 0.1)
        x = F.relu6(F.elu(x)).clamp(-1.0, 2.0)
        x = self.gate(x) * x
        if not self.branch or x.shape[-1] > 4:
            x = F.avg_pool2d(x, 2)
        x = self.masks2(self.se(self.bn2(self.conv2(x))))
        x = self.pool3(self.conv3(F.max_pool2d(x, 2)))
        return self.fc(self.masks3(x.mean((2, 3))))


def test_a_model_torch_fx_cannot_trace_compacts_as_the_one_it_traces() -> None:
    """The issue's small CNN with one ``if`` on a size: 11 fallbacks on the export path, none on the fx path."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16)
    traced, exported = randomized(SmallCNN(branch=False)), randomized(SmallCNN(branch=True))
    exported.load_state_dict(traced.state_dict())
    with pytest.raises(Exception, match="symbolically traced variables cannot be used as inputs to control flow"):
        torch.fx.symbolic_trace(exported)
    by_fx, by_export = mt.pack(traced, x, program="packed"), mt.pack(exported, x, program="packed")
    assert by_fx.fallbacks == ()
    assert by_export.fallbacks == ()
    assert by_export.macs == by_fx.macs
    for batch in (x, x[:5]):
        expected = mt.predict(traced, batch, N)
        assert_rounding_close(by_export(batch), expected)
        assert_rounding_close(by_fx(batch), expected)


class Between(nn.Module):
    """``operation`` on a compacted (B, 8, 6, 6) tensor, between two Masksembles layers, the result pooled to 8
    features."""

    def __init__(self, operation: nn.Module | Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.conv, self.masks1 = nn.Conv2d(3, 8, 3, padding=1), mt.Masksembles2D(8, N, 2.0, seed=0)
        self.operation = operation
        self.masks2, self.fc = mt.Masksembles1D(8, N, 2.0, seed=1), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.operation(self.masks1(self.conv(x)))
        return self.fc(self.masks2(y.flatten(2).amax(-1)))


OPERATIONS: dict[str, Callable[[], nn.Module | Callable[[torch.Tensor], torch.Tensor]]] = {
    "batchnorm": lambda: nn.BatchNorm2d(8),
    "batchnorm-no-affine": lambda: nn.BatchNorm2d(8, affine=False),
    "hardswish": nn.Hardswish,
    "hardsigmoid": nn.Hardsigmoid,
    "relu6": nn.ReLU6,
    "relu6-function": lambda: F.relu6,
    "hardtanh": lambda: nn.Hardtanh(-0.5, 0.5),
    "leaky-relu": lambda: nn.LeakyReLU(0.2),
    "elu": lambda: nn.ELU(0.5),
    "celu": lambda: nn.CELU(0.7),
    "selu": nn.SELU,
    "mish": nn.Mish,
    "softplus": lambda: nn.Softplus(2.0, 10.0),
    "logsigmoid": nn.LogSigmoid,
    "hardshrink": nn.Hardshrink,
    "softshrink": nn.Softshrink,
    "threshold": lambda: nn.Threshold(0.1, 2.0),
    "prelu": nn.PReLU,
    "clamp": lambda: lambda x: x.clamp(-0.5, 1.0),
    "clamp-min": lambda: lambda x: x.clamp(min=0.1),
    "clamp-max": lambda: lambda x: x.clamp(max=0.1),
    "one-minus": lambda: lambda x: 1 - x,
    "square": lambda: torch.square,
    "avg-pool": lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False),
    "max-pool": lambda: nn.MaxPool2d(3, 2, 1),
    "adaptive-avg-pool": lambda: nn.AdaptiveAvgPool2d((2, 3)),
    "upsample": lambda: nn.Upsample(scale_factor=2),
    "upsample-bilinear": lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
    "pad-one": lambda: lambda x: F.pad(x, (1, 1, 1, 1), value=1.0),
    "spatial-mean": lambda: lambda x: x.mean((2, 3), keepdim=True),
    "spatial-sum": lambda: lambda x: x.sum(-1, keepdim=True),
    "spatial-amin": lambda: lambda x: x.amin((2, 3), keepdim=True),
    "float64-and-back": lambda: lambda x: x.to(torch.float64).sqrt().to(torch.float32),
}


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_each_operation_compacts_on_the_export_path_as_on_the_fx_path(name: str) -> None:
    torch.manual_seed(0)
    model = randomized(Between(OPERATIONS[name]()))
    x = torch.randn(8, 3, 6, 6).abs() if name == "float64-and-back" else torch.randn(8, 3, 6, 6)
    by_fx, by_export = mt.pack(model, x, program="packed"), mt.pack(model, (x,), program="packed")
    assert by_export.fallbacks == by_fx.fallbacks == ()
    assert by_export.macs == by_fx.macs
    expected = mt.predict(model, x, N)
    assert_rounding_close(by_export(x), expected)
    assert_rounding_close(by_fx(x), expected)
