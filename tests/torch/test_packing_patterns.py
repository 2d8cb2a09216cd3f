"""pack/extract_member on the code patterns real networks are written with, each on its own: compacted or run at full
width, the result equals the dense model's; and "zero stays zero" is proven per operation and per argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import masksembles_torch as mt

N = 4


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def masks(channels: int, seed: int, axis: int = 1) -> mt.Masksembles:
    return mt.Masksembles(channels, N, 2.0, seed=seed, channel_axis=axis)


class Block(nn.Module):
    """conv -> masks -> pattern(x) -> masks -> conv head: the pattern sits between two masked layers."""

    def __init__(self, pattern: Callable[[torch.Tensor], torch.Tensor], modules: nn.Module | None = None) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 12, 3, padding=1)
        self.masks1 = masks(12, 1)
        self.pattern = pattern
        self.inner = modules if modules is not None else nn.Identity()
        self.masks2 = masks(12, 2)
        self.head = nn.Conv2d(12, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.masks2(self.pattern(self.masks1(self.stem(x)))))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, 4, 1), nn.Conv2d(4, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.expand(F.relu(self.reduce(s))))


class LayerNorm2d(nn.LayerNorm):
    """Channels-first LayerNorm as timm/ConvNeXt write it: permute, layer_norm over the last axis, permute back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class BatchNormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d: F.batch_norm with the running statistics, then an activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return F.silu(x)


class DropPath(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.dim() - 1))).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class Attention(nn.Module):
    """timm-style attention on (B, L, C): qkv Linear, heads by reshape/permute, SDPA, projection."""

    def __init__(self, dim: int, heads: int, fused: bool) -> None:
        super().__init__()
        self.heads, self.fused = heads, fused
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            attn = self.attn_drop((q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5).softmax(-1))
            y = attn @ v
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class TokenModel(nn.Module):
    """Patch embedding, a class token expanded to the batch, position embedding, a block, the class token's head."""

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 2, stride=2)
        self.cls = nn.Parameter(torch.randn(1, 1, 16))
        self.pos = nn.Parameter(torch.randn(1, 5, 16))
        self.norm1, self.masks1, self.mixer = nn.LayerNorm(16), masks(16, 3, -1), mixer
        self.norm2, self.masks2 = nn.LayerNorm(16), masks(16, 4, -1)
        self.fc1, self.masks3, self.fc2 = nn.Linear(16, 32), masks(32, 5, -1), nn.Linear(32, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = x + self.mixer(self.masks1(self.norm1(x)))
        x = x + self.fc2(self.masks3(F.gelu(self.fc1(self.masks2(self.norm2(x))))))
        return self.head(x[:, 0])


class MultiheadBlock(nn.Module):
    """``nn.MultiheadAttention`` without masks (written out and folded), or one whose attention weights are read
    (``weights``: kept as one call, a fallback)."""

    def __init__(self, weights: bool = False) -> None:
        super().__init__()
        self.attention, self.weights = nn.MultiheadAttention(16, 4, batch_first=True), weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weights:
            y, weights = self.attention(x, x, x)
            return y * weights.sum(-1, keepdim=True)
        return self.attention(x, x, x, need_weights=False)[0]


class ChannelConcat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(12, 6, 1), nn.Conv2d(12, 6, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.relu(self.a(x)), self.b(x)], dim=1)


class Flattened(nn.Module):
    """Flatten by view with the batch read from the tensor, then a masked MLP head."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.conv, self.masks1 = nn.Conv2d(3, 6, 3), masks(6, 6)
        self.fc, self.masks2, self.out = nn.Linear(6 * 4, 10), masks(10, 7, -1), nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.masks1(F.relu(self.conv(x))), 2)
        x = x.view(x.shape[0], -1) if self.how == "shape" else x.reshape(x.size(0), -1)
        return self.out(self.masks2(F.relu(self.fc(x))))


class MeanPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.masks1 = nn.Conv2d(3, 8, 3), masks(8, 8)
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.masks1(F.relu(self.conv(x))).mean((2, 3)))


class InPlaceOnShared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.masks, self.out = nn.Linear(4, 8), masks(8, 9, -1), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.masks(self.linear(x))
        return self.out(F.relu(h, inplace=True) + h)  # the dense model sees relu(h) twice


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.masks, self.out = nn.Linear(4, 8), masks(8, 10, -1), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.masks(torch.tanh(self.linear(x)))
        return self.out(h), h.sum(-1)


class SequenceFirst(nn.Module):
    """nn.MultiheadAttention with the batch on axis 1 ((L, B, E)), between masked Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.masks1 = nn.Linear(6, 16), masks(16, 11, -1)
        self.attention = nn.MultiheadAttention(16, 2)
        self.masks2, self.out = masks(16, 12, -1), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.masks1(F.gelu(self.embed(x))).transpose(0, 1)
        y = self.attention(h, h, h, need_weights=False)[0].transpose(0, 1)
        return self.out(self.masks2(y)).mean(1)


class Tokens(nn.Module):
    """Token ids -> embedding -> masks -> a GLU (chunk on the channels) -> pooled head; returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.masks1 = nn.Embedding(20, 16), masks(16, 13, -1)
        self.up, self.masks2, self.out = nn.Linear(16, 32), masks(16, 14, -1), nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = F.glu(self.up(self.masks1(self.embed(ids))), dim=-1)
        a, b = self.up(h.new_zeros(1, 16)).chunk(2, dim=-1)
        logits = self.out(self.masks2(h + a * b).mean(1))
        return {"logits": logits, "probs": logits.softmax(-1)}


class Upsampled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.masks1 = nn.Conv2d(3, 8, 3, padding=1), masks(8, 15)
        self.up, self.conv2 = nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(8, 4, 3, padding=1)
        self.masks2 = masks(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(F.interpolate(self.up(self.masks1(F.relu(self.conv(x)))), scale_factor=0.5))
        z = torch.where(y > 0, y, 0.1 * y)
        b, c = z.shape[:2]
        return self.masks2(z).view(b, c, -1).mean(-1)


class Sequence1d(nn.Module):
    """Conv1d features (B, C, L) with Masksembles on axis 1, max-pooled, then a masked Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.masks1 = nn.Conv1d(4, 12, 3), masks(12, 17)
        self.pool, self.conv2 = nn.MaxPool1d(2), nn.Conv1d(12, 8, 1)
        self.masks2, self.fc = masks(8, 18, -1), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(self.pool(self.masks1(F.relu(self.conv(x)))))
        return self.fc(self.masks2(y.amax(-1)))


class TokenMLP(nn.Module):
    """Token-wise Linear layers on enough tokens (rows) for the members' separate matmuls, with a GELU whose input is
    read twice, a tanh-GELU module, a Linear without bias and a product that promotes to float64."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.masks1 = nn.Linear(8, 16), masks(16, 19, -1)
        self.fc1, self.act, self.masks2 = nn.Linear(16, 32), nn.GELU(approximate="tanh"), masks(32, 20, -1)
        self.fc2 = nn.Linear(32, 16, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16, dtype=torch.float64))
        self.masks3, self.out = masks(16, 21, -1), nn.Linear(16, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(self.masks2(self.act(self.fc1(self.masks1(self.embed(x))))))
        a = F.gelu(y) * self.scale  # float64: computed in place on the float32 GELU output it would be float32
        z = F.relu(y) + a  # float64, as above
        return self.out(self.masks3(z)).mean(1)


def image(pattern: Callable[[torch.Tensor], torch.Tensor], modules: nn.Module | None = None) -> nn.Module:
    return Block(pattern, modules)


def with_modules(module: nn.Module) -> nn.Module:
    return Block(module, None)


PATTERNS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "depthwise-conv": (lambda: with_modules(nn.Conv2d(12, 12, 3, padding=1, groups=12, bias=False)), (3, 6, 6)),
    "depthwise-conv-bias": (lambda: with_modules(nn.Conv2d(12, 12, 3, padding=1, groups=12)), (3, 6, 6)),
    "grouped-conv": (lambda: with_modules(nn.Conv2d(12, 12, 1, groups=3)), (3, 6, 6)),
    "depthwise-multiplier": (
        lambda: with_modules(nn.Sequential(nn.Conv2d(12, 24, 3, padding=1, groups=12), nn.Conv2d(24, 12, 1))),
        (3, 6, 6),
    ),
    "squeeze-excite": (lambda: with_modules(SqueezeExcite(12)), (3, 6, 6)),
    "groupnorm": (lambda: with_modules(nn.GroupNorm(3, 12)), (3, 6, 6)),
    "layernorm2d-permute": (lambda: with_modules(LayerNorm2d(12)), (3, 6, 6)),
    "batchnorm-act": (lambda: with_modules(BatchNormAct(12)), (3, 6, 6)),
    "adaptive-avg-pool-function": (lambda: image(lambda x: F.adaptive_avg_pool2d(x, 3)), (3, 6, 6)),
    "scalar-mul": (lambda: image(lambda x: x * 0.5), (3, 6, 6)),
    "scalar-add": (lambda: image(lambda x: x + 3.0), (3, 6, 6)),
    "hardtanh-away-from-zero": (lambda: with_modules(nn.Hardtanh(min_val=0.1, max_val=1.0)), (3, 6, 6)),
    "celu": (lambda: with_modules(nn.CELU()), (3, 6, 6)),
    "selu": (lambda: with_modules(nn.SELU()), (3, 6, 6)),
    "softsign": (lambda: with_modules(nn.Softsign()), (3, 6, 6)),
    "threshold": (lambda: with_modules(nn.Threshold(0.1, 20.0)), (3, 6, 6)),
    "threshold-to-zero": (lambda: with_modules(nn.Threshold(0.1, 0.0)), (3, 6, 6)),
    "prelu-per-channel": (lambda: with_modules(nn.PReLU(12)), (3, 6, 6)),
    "stochastic-depth": (lambda: with_modules(DropPath(0.3)), (3, 6, 6)),
    "channel-concat": (lambda: Block(ChannelConcat(), None), (3, 6, 6)),
    "flatten-view-shape": (lambda: Flattened("shape"), (3, 4, 4)),
    "flatten-reshape-size": (lambda: Flattened("size"), (3, 4, 4)),
    "mean-as-pool": (MeanPool, (3, 5, 5)),
    "in-place-on-a-shared-tensor": (InPlaceOnShared, (4,)),
    "vit-attention-sdpa": (lambda: TokenModel(Attention(16, 4, fused=True)), (3, 4, 4)),
    "vit-attention-explicit": (lambda: TokenModel(Attention(16, 4, fused=False)), (3, 4, 4)),
    "multihead-attention": (lambda: TokenModel(MultiheadBlock()), (3, 4, 4)),
    "multihead-attention-weights": (lambda: TokenModel(MultiheadBlock(weights=True)), (3, 4, 4)),
    "two-outputs": (TwoOutputs, (4,)),
    "sequence-first-attention": (SequenceFirst, (5, 6)),
    "sequence-conv1d": (Sequence1d, (4, 9)),
    "upsample-where-view": (Upsampled, (3, 6, 6)),
    "token-mlp-many-rows": (TokenMLP, (300, 8)),
}


def randomized(model: nn.Module) -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            c = module.num_features
            module.running_mean.copy_(torch.randn(c, generator=generator))
            module.running_var.copy_(torch.rand(c, generator=generator) + 0.5)
        for parameter in module.parameters(recurse=False):
            if parameter.dim() == 1:  # norm weights and biases: not the 1/0 they start at
                parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.5 + parameter.data)
    return model.eval()


def outputs(y: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return y if isinstance(y, tuple) else (y,)


@pytest.mark.parametrize("batch", [4, 6], ids=["batch4", "batch6"])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_packs_equal_to_the_dense_model(name: str, batch: int) -> None:
    factory, shape = PATTERNS[name]
    torch.manual_seed(0)
    model = randomized(factory())
    x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(1))
    tiled = model(mt.tile(x, N))
    expected = tuple(mt.untile(y, N) for y in outputs(tiled))
    for program in ("packed", "dense"):
        packed = mt.pack(model, x[:3], program=program)
        assert packed.program == program
        for actual, wanted in zip(outputs(packed(x)), expected, strict=True):
            assert relative_error(actual, wanted) <= 1e-5
    for k in range(N):
        member = mt.extract_member(model, k, x)
        for actual, wanted in zip(outputs(member(x)), expected, strict=True):
            assert relative_error(actual, wanted[k]) <= 1e-5


@pytest.mark.parametrize("example", [1, 4, 12], ids=["300-rows", "1200-rows", "3600-rows"])
def test_linear_layers_joined_by_activations_run_as_one_mlp_on_tiles_of_rows(example: int) -> None:
    """fc1 -> GELU -> fc2 become one MemberMLP: fc1 writes (m, rows, O) and fc2 reads it, one tile of about 2048
    rows at a time (1 to 3 tiles here). The Linear after it runs one batched matmul on an example of 300 rows and one
    matmul per member from 1024. Each equals the dense model at any batch (also on one row), also exported with a
    dynamic batch (one tile there)."""
    torch.manual_seed(0)
    model = randomized(TokenMLP())
    packed = mt.pack(model, torch.randn(example, 300, 8), program="packed")
    (mlp,) = [m for m in packed.modules() if type(m).__name__ == "MemberMLP"]
    assert "tile_rows=2048, activations=[gelu_]" in repr(mlp)
    assert (mlp.first.member_major_out, mlp.second.member_major_in) == (True, True)
    (last,) = [m for m in packed.modules() if hasattr(m, "member_major_in") and m not in (mlp.first, mlp.second)]
    assert (last.member_major_in, last.member_major_out, last.per_member) == (False, False, example > 1)
    exported = torch.export.export(
        packed, (torch.randn(2, 300, 8),), dynamic_shapes=({0: torch.export.Dim("batch", min=2)},)
    ).module()
    for batch, tokens in ((1, 300), (4, 300), (13, 300), (21, 300), (1, 1)):
        x = torch.randn(batch, tokens, 8, generator=torch.Generator().manual_seed(batch))
        expected = mt.untile(model(mt.tile(x, N)), N)
        assert relative_error(packed(x), expected) <= 1e-5
        if batch > 1:
            assert relative_error(exported(x), expected) <= 1e-5


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def test_a_member_mlp_pads_its_hidden_layer_where_the_activations_keep_zero_finite() -> None:
    """205 hidden units per member run as 208: the first layer writes zeros there and the second reads them with zero
    weights, the same result. After log, infinite at 0, nothing is padded."""
    from masksembles_torch._packed_ops import MemberLinear, MemberMLP

    generator = torch.Generator().manual_seed(0)
    w1, b1 = torch.randn(N, 205, 6, generator=generator), torch.randn(N, 205, generator=generator)
    w2, b2 = torch.randn(N, 3, 205, generator=generator), torch.randn(N, 3, generator=generator)
    x = torch.randn(2, 5, N * 6, generator=generator)
    blocks = x.unflatten(-1, (N, 6))
    expected = torch.einsum("...kh,koh->...ko", F.gelu(torch.einsum("...ki,khi->...kh", blocks, w1) + b1), w2) + b2

    def mlp(activation: nn.Module) -> MemberMLP:
        first, second = MemberLinear(w1, b1.flatten()), MemberLinear(w2, b2.flatten())
        first.member_major_out = second.member_major_in = True
        return MemberMLP(first, torch.fx.symbolic_trace(activation), second)

    padded = mlp(nn.GELU())
    assert (padded.padding, padded.first.weight.shape[2], padded.second.weight.shape[1]) == (3, 208, 208)
    assert "hidden_padding=3" in repr(padded)
    assert relative_error(padded(x), expected.flatten(-2)) <= 1e-5
    assert mlp(Log()).padding == 0


def test_zero_preservation_is_evaluated_with_the_arguments() -> None:
    """Hardtanh(0.1, 1) maps 0 to 0.1: the masked channels are live after it, so the next layer reads them all;
    Hardtanh(-1, 1) keeps zeros: the next layer reads the member's channels only."""
    for low, full in ((0.1, True), (-1.0, False)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), masks(16, 0, -1), nn.Hardtanh(low, 1.0), nn.Linear(16, 3)).eval()
        x = torch.randn(5, 6)
        member = mt.extract_member(model, 0, x)
        widths = [m.in_features for m in member.modules() if isinstance(m, nn.Linear)]
        assert widths[-1] == (16 if full else int(model[1].masks[0].sum()))
        assert relative_error(member(x), mt.predict(model, x, N)[0]) <= 1e-6


def test_fallbacks_are_reported() -> None:
    torch.manual_seed(0)
    model = randomized(TokenModel(MultiheadBlock(weights=True)))
    packed = mt.pack(model, torch.randn(2, 3, 4, 4), program="packed")
    assert any("MultiheadAttention" in name for name in packed.fallbacks)
    assert "fallbacks=" in repr(packed)
    assert 0 < packed.macs["fallback"] < packed.macs["packed"] <= packed.macs["dense"]
    plain = mt.pack(randomized(MeanPool()), torch.randn(2, 3, 5, 5), program="packed")
    assert plain.fallbacks == () and plain.macs["fallback"] == 0
    counted = []
    for fused in (True, False):  # the attention products, by SDPA or by two matmuls, count the same
        attention = mt.pack(randomized(TokenModel(Attention(16, 4, fused))), torch.randn(2, 3, 4, 4), program="packed")
        assert attention.macs["fallback"] == 0, "folded into the heads: nothing runs on the member-stacked batch"
        counted.append(attention.macs)
    assert counted[0] == counted[1] and counted[0]["dense"] - counted[0]["packed"] > 0


def test_the_packed_module_is_an_fx_graph_module() -> None:
    torch.manual_seed(0)
    model = randomized(with_modules(SqueezeExcite(12)))
    x = torch.randn(4, 3, 6, 6)
    packed = mt.pack(model, x, program="packed")
    assert isinstance(packed, torch.fx.GraphModule) and "def forward" in packed.code
    expected = mt.predict(model, x, N)
    exported = torch.export.export(packed, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=2)},))
    assert relative_error(exported.module()(torch.cat([x, x[:1]])), mt.predict(model, torch.cat([x, x[:1]]), N)) <= 1e-5
    assert relative_error(torch.compile(packed, fullgraph=True)(x), expected) <= 1e-5


def test_untraceable_model_is_the_only_refusal() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.masks = nn.Linear(4, 8), masks(8, 0, -1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.masks(self.linear(x))
            return y if y.sum() > 0 else -y

    with pytest.raises(ValueError, match=r"need a model torch\.fx can trace in eval mode"):
        mt.pack(Branchy(), torch.randn(2, 4))


class ViewInPlace(nn.Module):
    """An in-place operation on a view read after it: the graph cannot be rewritten out of place."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.masks, self.out = nn.Linear(4, 8), masks(8, 0, -1), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        y = self.masks(self.linear(x))
        view = y[:, :4]
        view.relu_()
        z = self.out(y * 2)
        return z, {"sequence_first": z.t(), "scale": self.out.weight.sum()}


def test_in_place_on_a_view_read_later_runs_the_whole_model_tiled() -> None:
    """Not a refusal: pack runs the model itself on the member-stacked batch, and says so."""
    torch.manual_seed(0)
    model = ViewInPlace().eval()
    x = torch.randn(5, 4)
    expected, tiled_extra = model(mt.tile(x, N))
    expected = mt.untile(expected, N)
    one_model = 4 * 8 + 8 * 3  # per sample: the two Linear layers
    for program in ("auto", "packed", "dense"):
        packed = mt.pack(model, x[:3], program=program)
        assert packed.program == "dense" and packed.seconds == {}
        assert packed.macs == {"dense": N * one_model, "packed": N * one_model, "fallback": N * one_model}
        assert packed.fallbacks[0].startswith("the whole model, tiled: ")
        assert "works in place on 'getitem', which shares memory with" in repr(packed)
        z, extra = packed(x)
        assert relative_error(z, expected) <= 1e-6
        # batch on axis 1: returned as predict returns it, (3, n·B) with member k's block at k·B
        assert relative_error(extra["sequence_first"], tiled_extra["sequence_first"]) <= 1e-6
        assert torch.equal(extra["scale"], model.out.weight.sum())
    for k in range(N):
        z, extra = mt.extract_member(model, k, x[:2])(x)
        assert relative_error(z, expected[k]) <= 1e-6 and extra["sequence_first"].shape == (3, 5)
    with pytest.raises(ValueError, match=r"member must be an integer in \[0, 4\)"):
        mt.extract_member(model, 4, x)


def test_auto_reports_the_program_it_chose() -> None:
    torch.manual_seed(0)
    model = randomized(with_modules(SqueezeExcite(12)))
    x = torch.randn(4, 3, 6, 6)
    packed = mt.pack(model, x)
    assert set(packed.seconds) == {"packed", "dense"} and all(t > 0 for t in packed.seconds.values())
    assert packed.choice.startswith(packed.program)
    assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5
    with pytest.raises(ValueError, match=r"program must be one of \('auto', 'packed', 'dense'\); received 'fast'"):
        mt.pack(model, x, program="fast")


def test_token_ids_and_a_dict_output() -> None:
    torch.manual_seed(0)
    model = randomized(Tokens())
    ids = torch.randint(0, 20, (6, 7), generator=torch.Generator().manual_seed(0))
    tiled = model(mt.tile(ids, N))
    for program in ("packed", "dense"):
        packed = mt.pack(model, ids[:2], program=program)(ids)
        assert set(packed) == {"logits", "probs"}
        for key in packed:
            assert relative_error(packed[key], mt.untile(tiled[key], N)) <= 1e-5


class MaskedOutputs(nn.Module):
    """Returns the logits of a member-major head, the masked features (in a tuple), or both."""

    def __init__(self, returns: str) -> None:
        super().__init__()
        self.returns = returns
        self.stem, self.masks1, self.head = nn.Conv2d(3, 12, 3, padding=1), masks(12, 1), nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> object:
        features = self.masks1(self.stem(x))
        logits = self.head(features.mean((2, 3)))
        return {"logits": logits, "features": (features,), "both": (logits, features)}[self.returns]


@pytest.mark.parametrize("returns", ["logits", "features", "both"])
def test_output_leaves_are_the_members_blocks_and_export_with_a_dynamic_batch(returns: str) -> None:
    """Each output leaf is read from the members' blocks directly (no member-stacked batch, no reshape whose size
    guards stopped torch.export with a dynamic batch on tuple outputs)."""
    torch.manual_seed(0)
    model = MaskedOutputs(returns).eval()
    packed = mt.pack(model, torch.randn(6, 3, 8, 8), program="packed")
    assert "to_batch" not in packed.code and "flatten" not in packed.code
    exported = torch.export.export(
        packed, (torch.randn(4, 3, 8, 8),), dynamic_shapes=({0: torch.export.Dim("batch", min=2)},)
    ).module()
    x = torch.randn(7, 3, 8, 8)
    with torch.no_grad():
        expected = model(mt.tile(x, N))
    for result in (packed(x), exported(x)):
        leaves = [result] if returns == "logits" else list(result)
        wanted = [expected] if returns == "logits" else list(expected)
        for actual, dense in zip(leaves, wanted, strict=True):
            assert relative_error(actual, mt.untile(dense, N)) <= 1e-5


class SharedResidual(nn.Module):
    """x + block(x) where x is shared by every member (before the first masks) and the block's output is the
    members': the sum is written into the block's output when nothing else reads it and it has the result's shape and
    dtype."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.stem, self.masks1 = nn.Conv2d(3, 8, 3, padding=1), masks(8, 1)
        self.conv, self.head = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.stem(x)
        branch = self.conv(self.masks1(shared))
        if self.variant == "read twice":
            return self.head(shared + branch) * branch.mean((1, 2, 3), keepdim=True)
        if self.variant == "float64 shared":
            return self.head((shared.double() + branch).float())
        if self.variant == "pooled branch":
            return self.head(shared + branch.mean((2, 3), keepdim=True))
        return self.head(shared + branch)


@pytest.mark.parametrize(
    ("variant", "in_place"),
    [("plain", True), ("read twice", False), ("float64 shared", False), ("pooled branch", False)],
)
def test_a_shared_input_is_added_into_the_members_tensor_only_when_that_is_safe(variant: str, in_place: bool) -> None:
    torch.manual_seed(0)
    model = SharedResidual(variant).eval()
    x = torch.randn(5, 3, 6, 6)
    packed = mt.pack(model, x, program="packed")
    assert ("add_shared_(" in packed.code) is in_place
    with torch.no_grad():
        expected = mt.untile(model(mt.tile(x, N)), N)
    assert relative_error(packed(x), expected) <= 1e-5
