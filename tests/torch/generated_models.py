"""Random Masksembles models for differential tests of pack/extract_member: stacks and DAGs drawn from a grammar of
operations, each a small module, with Masksembles layers at random places.

A model is a chain of blocks over a tensor in one of three layouts (``Shape``): an image (B, C, S, S), tokens
(B, S, C) or features (B, C). Each block is one operation of ``OPERATIONS`` (those that apply to the current shape),
or a branch: two chains of shape-keeping operations joined by a sum, a product or a concatenation. A Masksembles layer
goes before a block with some probability (over the current channels), and at least one is in every model. The
operations are what real networks are written with: activations that do and do not keep zeros, moves and reorderings
of the channels, reductions and norms over them, BatchNorm with running statistics, attention (written out, or torch's
``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``), reshapes that fold windows or features into the batch,
operations that read the batch size, and custom ``autograd.Function``s.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

import masksembles_torch as mt
from tests import generated_shapes
from tests.generated_shapes import always, even, image

N = 4
WIDTHS = (8, 12, 16)


@dataclass(frozen=True)
class Shape(generated_shapes.Shape):
    """A per-sample shape: ``layout`` "image" (C, S, S), "tokens" (S, C) or "flat" (C,)."""

    contiguous: bool = True  # in the dense model (a view of it works)

    @property
    def axis(self) -> int:
        """The channel axis of the batched tensor."""
        return -1 if self.layout == "tokens" else 1

    def batched(self, batch: int) -> tuple[int, ...]:
        if self.layout == "image":
            return (batch, self.channels, self.size, self.size)
        return super().batched(batch)


class Cube(torch.autograd.Function):
    """x * |x|, with its gradient: torch.fx traces through ``apply``."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x.abs()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return 2 * grad * x.abs()


class ShiftedSoftsign(torch.autograd.Function):
    """x / (1 + |x|) + 0.1 (a zero maps to 0.1), called through a ``torch.fx.wrap``'ed function: one opaque node."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x / (1 + x.abs()) + 0.1

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad / (1 + x.abs()) ** 2


def shifted_softsign(x: torch.Tensor) -> torch.Tensor:
    return ShiftedSoftsign.apply(x)  # type: ignore[no-any-return]


torch.fx.wrap("shifted_softsign")


class Function(nn.Module):
    """``function(x, shape)``: an operation without parameters (``shape`` is the input's)."""

    def __init__(self, name: str, function: Callable[[torch.Tensor, Shape], torch.Tensor], shape: Shape) -> None:
        super().__init__()
        self.name, self.function, self.shape = name, function, shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x, self.shape)

    def extra_repr(self) -> str:
        return self.name


class ChannelsLast(nn.Module):
    """A module over the last axis run on an image's channels: permute, module, permute back (timm's LayerNorm2d)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class TokensFirst(nn.Module):
    """A module over axis 1 run on tokens' channels: (B, S, C) -> (B, C, S) -> module -> (B, S, C) (LeViT's
    BatchNorm on token features)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.transpose(1, 2)).transpose(1, 2)


class Windows(nn.Module):
    """An image's 2x2 windows folded into the batch, (B, C, S, S) -> (4B, C, S/2, S/2), a module on them, and back;
    or tokens in windows of two, (B, S, C) -> (B*S/2, 2, C), after a roll along the tokens (Swin)."""

    def __init__(self, module: nn.Module, shape: Shape) -> None:
        super().__init__()
        self.module, self.shape = module, shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, s = self.shape.channels, self.shape.size
        if self.shape.layout == "tokens":
            windows = torch.roll(x, 1, dims=1).view(-1, 2, c)
            return torch.roll(self.module(windows).view(-1, s, c), -1, dims=1)
        h = s // 2
        windows = x.view(-1, c, 2, h, 2, h).permute(0, 2, 4, 1, 3, 5).reshape(-1, c, h, h)
        y = self.module(windows)
        return y.view(-1, 2, 2, c, h, h).permute(0, 3, 1, 4, 2, 5).reshape(-1, c, s, s)


class Attention(nn.Module):
    """Single-head self-attention over tokens: qkv Linear, softmax(q k^T) v, projection."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(channels, 3 * channels), nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1)
        return self.proj(weights @ v)


class LayerScale(nn.Module):
    """A per-channel affine map with its own parameters (timm's layer scale, with a shift)."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.view = [1] * len(shape.batched(1))
        self.view[shape.axis] = shape.channels
        self.scale = nn.Parameter(torch.randn(shape.channels))
        self.shift = nn.Parameter(torch.randn(shape.channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.view(self.view) + self.shift.view(self.view)


class Branch(nn.Module):
    """Two chains on one input, joined: ``"add"``, ``"mul"`` (a sigmoid gate), ``"cat"`` on the channels."""

    def __init__(self, left: nn.Sequential, right: nn.Sequential, join: str, shape: Shape) -> None:
        super().__init__()
        self.left, self.right, self.join, self.shape = left, right, join, shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.left(x), self.right(x)
        if self.join == "add":
            return a + b
        if self.join == "mul":
            return a * torch.sigmoid(b)
        return torch.cat([a, b], dim=self.shape.axis)

    def extra_repr(self) -> str:
        return self.join


class Generated(nn.Module):
    """A generated model: ``blocks`` in order, then ``head``."""

    def __init__(self, blocks: list[nn.Module], head: nn.Module, description: list[str]) -> None:
        super().__init__()
        self.blocks, self.head, self.description = nn.ModuleList(blocks), head, description

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ---------------------------------------------------------------------------------------------------- the grammar

Build = Callable[[Shape, random.Random], tuple[nn.Module, Shape]]


@dataclass(frozen=True)
class Operation:
    """One production: where it applies, what it builds, and whether it keeps the shape (usable in branches)."""

    name: str
    applies: Callable[[Shape], bool]
    build: Build
    keeps_shape: bool = True


def _function(name: str, function: Callable[[torch.Tensor, Shape], torch.Tensor]) -> Build:
    return lambda shape, _: (Function(name, function, shape), shape)


def _module(make: Callable[[Shape], nn.Module], permuted: Callable[[Shape], bool] = lambda s: False) -> Build:
    """``make(shape)``, whose output is a permuted view (not contiguous) where ``permuted(shape)``."""
    return lambda shape, _: (make(shape), replace(shape, contiguous=shape.contiguous and not permuted(shape)))


def _channels(shape: Shape, channels: int, size: int | None = None) -> Shape:
    """The shape of a new tensor with ``channels`` channels (and sides or tokens ``size``)."""
    return replace(shape, channels=channels, size=shape.size if size is None else size, contiguous=True)


def _batch_norm(shape: Shape) -> nn.Module:
    norm = nn.BatchNorm2d(shape.channels) if shape.layout == "image" else nn.BatchNorm1d(shape.channels)
    with torch.no_grad():
        norm.running_mean.uniform_(-1.0, 1.0)  # type: ignore[union-attr]
        norm.running_var.uniform_(0.5, 2.0)  # type: ignore[union-attr]
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    return TokensFirst(norm) if shape.layout == "tokens" else norm


def _layer_norm(shape: Shape) -> nn.Module:
    norm = nn.LayerNorm(shape.channels)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    return ChannelsLast(norm) if shape.layout == "image" else norm


def _mixing(shape: Shape, rng: random.Random, kind: str) -> tuple[nn.Module, Shape]:
    """Linear (tokens, features) or a convolution (images) to a width from ``WIDTHS``."""
    if kind == "depthwise":
        return nn.Conv2d(shape.channels, shape.channels, 3, padding=1, groups=shape.channels), shape
    width = rng.choice(WIDTHS)
    if shape.layout != "image":
        return nn.Linear(shape.channels, width), _channels(shape, width)
    if kind == "grouped":
        return nn.Conv2d(shape.channels, width, 3, padding=1, groups=2), _channels(shape, width)
    kernel = 1 if kind == "pointwise" else 3
    return nn.Conv2d(shape.channels, width, kernel, padding=kernel // 2), _channels(shape, width)


def _shuffle(x: torch.Tensor, shape: Shape) -> torch.Tensor:
    """ShuffleNet's channel shuffle in two groups, by view and transpose."""
    c = shape.channels
    if shape.layout == "tokens":
        return x.view(x.size(0), shape.size, 2, c // 2).transpose(2, 3).reshape(x.size(0), shape.size, c)
    if shape.layout == "flat":
        return x.view(x.size(0), 2, c // 2).transpose(1, 2).reshape(x.size(0), c)
    s = shape.size
    return x.view(x.size(0), 2, c // 2, s, s).transpose(1, 2).reshape(x.size(0), c, s, s)


def _reversed_chunks(x: torch.Tensor, shape: Shape) -> torch.Tensor:
    first, second = x.chunk(2, dim=shape.axis)
    return torch.cat([second, first], dim=shape.axis)


def _strided(x: torch.Tensor, shape: Shape) -> torch.Tensor:
    return x[..., ::2] if shape.layout == "tokens" else x[:, ::2]


def _batch_scale(x: torch.Tensor, shape: Shape) -> torch.Tensor:
    """Each sample scaled by its place in the batch: reads the batch size."""
    position = torch.arange(x.shape[0], dtype=x.dtype, device=x.device) / x.shape[0]
    return x * (1 + position.view(-1, *([1] * (len(shape.batched(1)) - 1))))


def _to_tokens(shape: Shape, _: random.Random) -> tuple[nn.Module, Shape]:
    function = Function("to tokens", lambda x, s: x.flatten(2).transpose(1, 2), shape)
    return function, Shape("tokens", shape.channels, shape.size**2, contiguous=False)


def _to_image(shape: Shape, _: random.Random) -> tuple[nn.Module, Shape]:
    side = round(shape.size**0.5)

    def to_image(x: torch.Tensor, s: Shape) -> torch.Tensor:
        return x.transpose(1, 2).reshape(x.size(0), s.channels, side, side)

    # a view of the tokens where it can be (channels-last memory): not contiguous
    return Function("to image", to_image, shape), Shape("image", shape.channels, side, contiguous=False)


def _flatten(how: str) -> Build:
    def build(shape: Shape, _: random.Random) -> tuple[nn.Module, Shape]:
        features = shape.features
        if how == "batch" and shape.contiguous:
            function = Function("view(x.size(0), -1)", lambda x, s: x.view(x.size(0), -1), shape)
        elif how == "batch":
            function = Function("reshape(x.size(0), -1)", lambda x, s: x.reshape(x.size(0), -1), shape)
        elif shape.contiguous:
            function = Function(f"view(-1, {features})", lambda x, s: x.view(-1, s.features), shape)
        else:
            function = Function(f"reshape(-1, {features})", lambda x, s: x.reshape(-1, s.features), shape)
        return function, Shape("flat", features)

    return build


def _pixel_shuffle(shape: Shape, _: random.Random) -> tuple[nn.Module, Shape]:
    return Function("pixel_shuffle", lambda x, s: F.pixel_shuffle(x, 2), shape), _channels(
        shape, shape.channels // 4, shape.size * 2
    )


def _pool(shape: Shape, _: random.Random) -> tuple[nn.Module, Shape]:
    return nn.AvgPool2d(2), _channels(shape, shape.channels, shape.size // 2)


def _windows(shape: Shape, rng: random.Random) -> tuple[nn.Module, Shape]:
    if shape.layout == "tokens":
        inner: nn.Module = rng.choice([Attention(shape.channels), nn.Linear(shape.channels, shape.channels)])
    else:
        inner = nn.Sequential(nn.Conv2d(shape.channels, shape.channels, 1), nn.GELU())
    return Windows(inner, shape), replace(shape, contiguous=True)


class TorchAttention(nn.Module):
    """torch's own ``nn.MultiheadAttention`` (self-attention, batch first) or ``nn.TransformerEncoderLayer``."""

    def __init__(self, channels: int, layer: bool) -> None:
        super().__init__()
        heads = 2 if channels % 2 == 0 else 1
        self.layer = (
            nn.TransformerEncoderLayer(channels, heads, 2 * channels, dropout=0.0, batch_first=True) if layer else None
        )
        self.attention = None if layer else nn.MultiheadAttention(channels, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer is not None:
            return self.layer(x)
        assert self.attention is not None
        return self.attention(x, x, x, need_weights=False)[0]


def _attention(shape: Shape, rng: random.Random) -> tuple[nn.Module, Shape]:
    kind = rng.choice(["written", "multihead", "encoder layer"])
    if kind == "written":
        return Attention(shape.channels), shape
    layer = kind == "encoder layer"  # nn.MultiheadAttention returns a transposed (non-contiguous) view
    return TorchAttention(shape.channels, layer), shape if layer else replace(shape, contiguous=False)


OPERATIONS: tuple[Operation, ...] = (
    # activations that keep zeros, and those that do not
    Operation("relu", always, _module(lambda s: nn.ReLU())),
    Operation("gelu", always, _module(lambda s: nn.GELU())),
    Operation("tanh", always, _function("tanh", lambda x, s: torch.tanh(x))),
    Operation("scale", always, _function("x * 0.5", lambda x, s: x * 0.5)),
    Operation("hardtanh(0.1)", always, _module(lambda s: nn.Hardtanh(0.1))),
    Operation("sigmoid", always, _module(lambda s: nn.Sigmoid())),
    Operation("softplus", always, _module(lambda s: nn.Softplus())),
    Operation("x + 1", always, _function("x + 1", lambda x, s: x + 1)),
    Operation("clamp(min=0.1)", always, _function("clamp(min=0.1)", lambda x, s: x.clamp(min=0.1))),
    Operation("exp", always, _function("exp", lambda x, s: torch.exp(x.clamp(max=4.0)))),
    Operation("where", always, _function("where(x > 0, x, 1)", lambda x, s: torch.where(x > 0, x, 1.0))),
    Operation("autograd.Function", always, _function("Cube.apply", lambda x, s: Cube.apply(x))),
    Operation("wrapped autograd.Function", always, _function("shifted_softsign", lambda x, s: shifted_softsign(x))),
    Operation("layer scale", always, _module(LayerScale)),
    # reorderings of the channels
    Operation("flip", always, _function("flip", lambda x, s: x.flip(s.axis))),
    Operation("roll", always, _function("roll", lambda x, s: torch.roll(x, 1, s.axis))),
    Operation("shuffle", even, _function("shuffle", _shuffle)),
    Operation("reversed chunks", even, _function("reversed chunks", _reversed_chunks)),
    Operation(
        "strided slice",
        lambda s: s.channels >= 8 and even(s),
        lambda s, _: (Function("[::2]", _strided, s), replace(s, channels=s.channels // 2, contiguous=False)),
        keeps_shape=False,
    ),
    Operation(
        "pixel_shuffle",
        lambda s: image(s) and s.channels % 4 == 0 and s.channels >= 16 and s.size <= 4,
        _pixel_shuffle,
        keeps_shape=False,
    ),
    # reductions and norms over the channels
    Operation("minus max", always, _function("x - amax", lambda x, s: x - x.amax(s.axis, keepdim=True))),
    Operation(
        "over norm", always, _function("x / (norm + 1)", lambda x, s: x / (x.norm(dim=s.axis, keepdim=True) + 1))
    ),
    Operation("softmax", always, _function("softmax", lambda x, s: x.softmax(s.axis))),
    Operation("cumsum", always, _function("cumsum", lambda x, s: x.cumsum(s.axis))),
    Operation("F.normalize", always, _function("F.normalize", lambda x, s: F.normalize(x, dim=s.axis))),
    Operation("LayerNorm", always, _module(_layer_norm, image)),
    Operation("GroupNorm", lambda s: image(s) and even(s), _module(lambda s: nn.GroupNorm(2, s.channels))),
    Operation("BatchNorm", always, _module(_batch_norm, lambda s: s.layout == "tokens")),
    # mixing layers
    Operation("conv or linear", always, lambda s, rng: _mixing(s, rng, "full"), keeps_shape=False),
    Operation("pointwise", image, lambda s, rng: _mixing(s, rng, "pointwise"), keeps_shape=False),
    Operation(
        "grouped conv",
        lambda s: image(s) and even(s),
        lambda s, rng: _mixing(s, rng, "grouped"),
        keeps_shape=False,
    ),
    Operation("depthwise conv", image, lambda s, rng: _mixing(s, rng, "depthwise")),
    Operation("attention", lambda s: s.layout == "tokens", _attention),
    Operation("avg_pool", lambda s: image(s) and s.size >= 4, _pool, keeps_shape=False),
    # layouts and reshapes of the batch
    Operation("to tokens", lambda s: image(s) and s.size <= 4, _to_tokens, keeps_shape=False),
    Operation("to image", lambda s: s.layout == "tokens" and round(s.size**0.5) ** 2 == s.size, _to_image, False),
    Operation("view(x.size(0), -1)", lambda s: s.layout != "flat" and s.features <= 256, _flatten("batch"), False),
    Operation("view(-1, F)", lambda s: s.layout != "flat" and s.features <= 256, _flatten("features"), False),
    Operation("windows", lambda s: s.layout != "flat" and s.size % 2 == 0, _windows),
    # operations that read the batch
    Operation("minus batch mean", always, _function("x - x.mean(0)", lambda x, s: x - x.mean(0, keepdim=True))),
    Operation("batch position", always, _function("x * (1 + arange(B) / B)", _batch_scale)),
)
BRANCH_JOINS = ("add", "mul", "cat")


def _chain(
    shape: Shape, rng: random.Random, length: int, masks: float, seeds: list[int]
) -> tuple[nn.Sequential, Shape]:
    """``length`` shape-keeping operations, masks before each with probability ``masks``; and the output's shape."""
    modules: list[nn.Module] = []
    for _ in range(length):
        if rng.random() < masks:
            modules.append(_masks(shape, seeds))
        operation = rng.choice([op for op in OPERATIONS if op.keeps_shape and op.applies(shape)])
        module, shape = operation.build(shape, rng)
        modules.append(module)
    return nn.Sequential(*modules), shape


def _masks(shape: Shape, seeds: list[int]) -> mt.Masksembles:
    seeds.append(len(seeds))
    return mt.Masksembles(shape.channels, N, 2.0, seed=seeds[-1], channel_axis=shape.axis)


INPUTS = (Shape("image", 3, 4), Shape("image", 8, 4), Shape("tokens", 8, 4), Shape("flat", 12))


def generate(seed: int, blocks: int = 6) -> tuple[Generated, Shape]:
    """A random model and its input's per-sample shape; the same ``seed`` gives the same model and weights."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shape = rng.choice(INPUTS)
    first = shape
    modules: list[nn.Module] = []
    description: list[str] = []
    seeds: list[int] = []
    masks = rng.uniform(0.2, 0.6)
    for _ in range(rng.randint(2, blocks)):
        if shape.channels >= 4 and rng.random() < masks:
            modules.append(_masks(shape, seeds))
            description.append("masks")
        if rng.random() < 0.2:
            join = rng.choice(BRANCH_JOINS)
            left, left_shape = _chain(shape, rng, rng.randint(1, 2), masks, seeds)
            right, right_shape = _chain(shape, rng, rng.randint(0, 2), masks, seeds)
            modules.append(Branch(left, right, join, shape))
            description.append(f"branch {join}: [{_names(left)}] [{_names(right)}]")
            if join == "cat":
                shape = _channels(shape, 2 * shape.channels)
            else:
                shape = replace(shape, contiguous=left_shape.contiguous and right_shape.contiguous)
            continue
        operation = rng.choice([op for op in OPERATIONS if op.applies(shape)])
        module, shape = operation.build(shape, rng)
        modules.append(module)
        description.append(operation.name)
    if not seeds:
        modules.append(_masks(shape, seeds))
        description.append("masks")
    head: nn.Module = nn.Identity()
    if rng.random() < 0.7:
        pool: nn.Module = nn.Flatten() if shape.layout == "flat" else Function("mean", _mean, shape)
        head = nn.Sequential(pool, nn.Linear(shape.channels, 3))
    model = Generated(modules, head, description)
    for module in model.modules():  # no dead weights: every layer's bias matters
        if isinstance(module, (nn.Linear, nn.Conv2d)) and module.bias is not None:
            nn.init.uniform_(module.bias, -0.5, 0.5)
    return model.eval(), first


def _mean(x: torch.Tensor, shape: Shape) -> torch.Tensor:
    return x.mean((2, 3)) if shape.layout == "image" else x.mean(1)


def _names(chain: nn.Sequential) -> str:
    return ", ".join(
        module.name if isinstance(module, Function) else type(module).__name__ for module in chain.children()
    )
