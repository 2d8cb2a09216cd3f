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
    x = torch.randn(8, 3, 8, 8)
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


def chain(*operations: nn.Module | Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """The operations one after the other (a failure names the operation's node in ``fallbacks``)."""
    return nn.Sequential(*(op if isinstance(op, nn.Module) else Call(op) for op in operations))


class Call(nn.Module):
    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


# what the fx path compacts, by kind; each twin's arguments in the positions ATen gives them (non-default ones)
OPERATIONS: dict[str, Callable[[], nn.Module]] = {
    "batchnorm": lambda: chain(nn.BatchNorm2d(8), nn.BatchNorm2d(8, affine=False)),
    "activations": lambda: chain(
        nn.Hardswish(),
        nn.Hardsigmoid(),
        nn.ReLU6(),
        F.relu6,
        nn.Hardtanh(-0.5, 0.5),
        nn.LeakyReLU(0.2),
        nn.ELU(0.5),
        nn.CELU(0.7),
        nn.SELU(),
        nn.Mish(),
        nn.Softplus(2.0, 10.0),
        nn.LogSigmoid(),
        nn.Hardshrink(0.1),
        nn.Softshrink(0.1),
        nn.Threshold(0.1, 2.0),
        nn.PReLU(),
        torch.square,
        lambda x: 1 - x,
    ),
    "clamps": lambda: chain(lambda x: x.clamp(-0.5, 1.0), lambda x: x.clamp(min=-0.2), lambda x: x.clamp(max=0.8)),
    "prelu-per-channel": lambda: nn.PReLU(8, init=0.1),
    "pooling": lambda: chain(
        nn.AvgPool2d(3, 1, 1, count_include_pad=False),
        nn.MaxPool2d(3, 2, 1),
        nn.AdaptiveAvgPool2d((2, 3)),
        nn.Upsample(scale_factor=2),
        nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.Upsample(scale_factor=1.5, mode="bicubic"),
        lambda x: F.pad(x, (1, 1, 1, 1), value=1.0),
    ),
    "reductions": lambda: chain(
        lambda x: x.mean((2, 3), keepdim=True) + x.sum(-1, keepdim=True),
        lambda x: x.amin((2, 3), keepdim=True) * x.amax(-2, keepdim=True),
    ),
    # export records these as aten.conv2d.padding (transformers' EfficientNet writes its convolutions so)
    "string-padded-convolutions": lambda: chain(
        nn.Conv2d(8, 8, 3, padding="same"), nn.Conv2d(8, 8, 3, padding="valid")
    ),
    "float64-and-back": lambda: chain(lambda x: x.to(torch.float64).abs().sqrt().to(torch.float32)),
}


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_operations_compact_on_the_export_path_as_on_the_fx_path(name: str) -> None:
    torch.manual_seed(0)
    model = randomized(Between(OPERATIONS[name]()))
    x = torch.randn(8, 3, 6, 6)
    by_fx, by_export = mt.pack(model, x, program="packed"), mt.pack(model, (x,), program="packed")
    assert by_fx.fallbacks == (), by_fx.fallbacks
    assert by_export.fallbacks == (), by_export.fallbacks
    assert by_export.macs == by_fx.macs
    expected = mt.predict(model, x, N)
    assert_rounding_close(by_export(x), expected)
    assert_rounding_close(by_fx(x), expected)


class ScaledELU(nn.Module):
    """``aten.elu`` with ``scale`` 2 (``F.elu`` has no such argument): no twin, so it stays an ATen call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.elu(x, 1.0, 2.0)


# operations that are not per channel or have no twin: they run as the model runs them on both paths
FALLBACKS: dict[str, Callable[[], nn.Module]] = {
    "batchnorm-batch-statistics": lambda: nn.BatchNorm2d(8, track_running_stats=False),
    "elu-with-scale": ScaledELU,
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_what_falls_back_on_the_fx_path_falls_back_on_the_export_path(name: str) -> None:
    torch.manual_seed(0)
    model = randomized(Between(FALLBACKS[name]()))
    x = torch.randn(8, 3, 6, 6)
    by_fx, by_export = mt.pack(model, x, program="packed"), mt.pack(model, (x,), program="packed")
    assert by_fx.fallbacks and len(by_export.fallbacks) == len(by_fx.fallbacks), (by_fx.fallbacks, by_export.fallbacks)
    assert by_export.macs == by_fx.macs
    for batch in (x, x[:5]):
        expected = mt.predict(model, batch, N)
        assert_rounding_close(by_export(batch), expected)
        assert_rounding_close(by_fx(batch), expected)


class InPlace(nn.Module):
    """In-place activations, ``+=``, ``mul_``, ``clamp_`` (export keeps them in place: ``aten.relu_``, ...). With
    ``view``, two of them write a view of the tensor read after them, which torch.fx's capture refuses (the whole
    model runs tiled) and the export capture leaves in place (they fall back)."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.view = view
        self.conv, self.masks1 = nn.Conv2d(3, 8, 3, padding=1), mt.Masksembles2D(8, N, 2.0, seed=0)
        self.bn, self.hardswish, self.relu = nn.BatchNorm2d(8), nn.Hardswish(inplace=True), nn.ReLU(inplace=True)
        self.silu, self.leaky = nn.SiLU(inplace=True), nn.LeakyReLU(0.1, inplace=True)
        self.masks2, self.fc = mt.Masksembles1D(8, N, 2.0, seed=1), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.masks1(self.conv(x))
        y = self.leaky(self.silu(self.relu(self.hardswish(self.bn(x)))))
        y += x
        y.mul_(2.0).clamp_(-1.0, 1.0)
        y = F.elu(y, inplace=True)
        if self.view:
            y[:, :4].relu_().mul_(3.0)
            y = y + x
        return self.fc(self.masks2(y.mean((2, 3))))


@pytest.mark.parametrize("view", [False, True], ids=["in-place", "in-place-on-a-view"])
def test_in_place_operations_compact_on_the_export_path_where_proven(view: bool) -> None:
    torch.manual_seed(0)
    model = randomized(InPlace(view))
    x = torch.randn(8, 3, 6, 6)
    by_fx, by_export = mt.pack(model, x, program="packed"), mt.pack(model, (x,), program="packed")
    if view:
        assert by_fx.fallbacks[0].startswith("the whole model, tiled: relu_"), by_fx.fallbacks
        assert any("relu_" in reason for reason in by_export.fallbacks), by_export.fallbacks
    else:
        assert by_fx.fallbacks == by_export.fallbacks == ()
        assert by_export.macs == by_fx.macs
    expected = mt.predict(model, x, N)
    assert_rounding_close(by_export(x), expected)
    assert_rounding_close(by_fx(x), expected)
