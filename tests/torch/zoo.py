"""Small re-implementations of the torchvision and timm architectures that users convert, for the torch tests.

Each block follows how torchvision (``resnet``, ``mobilenetv3``, ``efficientnet``, ``ops.SqueezeExcitation``,
``ops.StochasticDepth``) and timm (``ConvNeXtBlock``, ``LayerNorm2d``, ``Mlp``, ``Attention``, ``DropPath``, heads
that call ``F.dropout``) build it: the same modules, attribute names, layouts and code patterns (in-place residual
additions, ``scale * x`` gating, permutes around channels-last LayerNorm and Linear, attention as ``softmax`` +
``attn_drop`` or fused ``F.scaled_dot_product_attention``). Widths, depths and images are tiny so the tests stay
fast: every model maps (B, 3, 32, 32) images to (B, 10) logits. ``ZOO`` builds each one with fixed weights and random
BatchNorm statistics (so eval outputs depend on every layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IMAGE = (3, 32, 32)
CLASSES = 10
SEQUENCE = 7  # tokens of the Multihead model's input


# --- per-sample dropouts (stochastic depth) -------------------------------------------------------------------


def drop_path(x: Tensor, drop_prob: float, training: bool) -> Tensor:
    """timm's per-sample drop: each sample's whole residual branch is kept (scaled) or zeroed."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    return x * x.new_empty(shape).bernoulli_(keep).div_(keep)


class DropPath(nn.Module):
    """timm-style DropPath: per-sample stochastic depth (not an nn.Dropout)."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: Tensor) -> Tensor:
        return drop_path(x, self.drop_prob, self.training)


def stochastic_depth(x: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    """torchvision's stochastic depth: ``"row"`` drops samples, ``"batch"`` the whole batch."""
    if not training or p == 0.0:
        return x
    size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p)
    return x * noise.div_(1.0 - p)


torch.fx.wrap("stochastic_depth")  # as torchvision does: one node in symbolic traces


class StochasticDepth(nn.Module):
    """torchvision-style ``ops.StochasticDepth(p, mode)``."""

    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, x: Tensor) -> Tensor:
        return stochastic_depth(x, self.p, self.mode, self.training)


# --- ResNet (torchvision) ---------------------------------------------------------------------------------------


def conv3x3(inputs: int, outputs: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, groups=groups, bias=False)


def conv1x1(inputs: int, outputs: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None, groups: int = 1
    ) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, optionally grouped as in ResNeXt), 1x1 expand by 4."""

    expansion = 4

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None, groups: int = 1
    ) -> None:
        super().__init__()
        width = planes * groups
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride, groups)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet layout: conv1/bn1/relu/maxpool, layer1..layer4, avgpool, fc."""

    def __init__(
        self, block: type[BasicBlock | Bottleneck], layers: list[int], width: int = 8, groups: int = 1
    ) -> None:
        super().__init__()
        self.inplanes, self.groups = width, groups
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, CLASSES)

    def _make_layer(
        self, block: type[BasicBlock | Bottleneck], planes: int, blocks: int, stride: int = 1
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride), nn.BatchNorm2d(planes * block.expansion)
            )
        layers = [block(self.inplanes, planes, stride, downsample, self.groups)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, groups=self.groups) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# --- MobileNetV3 and EfficientNet (torchvision) -------------------------------------------------------------------


class ConvNormActivation(nn.Sequential):
    def __init__(
        self,
        inputs: int,
        outputs: int,
        kernel_size: int = 3,
        stride: int = 1,
        groups: int = 1,
        activation: Callable[..., nn.Module] | None = nn.ReLU,
    ) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(inputs, outputs, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(outputs),
        ]
        if activation is not None:
            layers.append(activation())
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    """torchvision ``ops.SqueezeExcitation``: pooled 1x1 convs give a per-channel gate, ``scale * x``."""

    def __init__(
        self,
        channels: int,
        squeeze: int,
        activation: Callable[..., nn.Module] = nn.ReLU,
        scale_activation: Callable[..., nn.Module] = nn.Sigmoid,
    ) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def forward(self, x: Tensor) -> Tensor:
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class InvertedResidual(nn.Module):
    """MobileNetV3 block: 1x1 expand (if wider), depthwise conv, optional SE (hardsigmoid gate), 1x1 project."""

    def __init__(
        self, inputs: int, kernel: int, expanded: int, outputs: int, use_se: bool, hardswish: bool, stride: int
    ) -> None:
        super().__init__()
        self.use_res_connect = stride == 1 and inputs == outputs
        activation = nn.Hardswish if hardswish else nn.ReLU
        layers: list[nn.Module] = []
        if expanded != inputs:
            layers.append(ConvNormActivation(inputs, expanded, 1, activation=activation))
        layers.append(ConvNormActivation(expanded, expanded, kernel, stride, groups=expanded, activation=activation))
        if use_se:
            layers.append(SqueezeExcitation(expanded, max(expanded // 4, 2), scale_activation=nn.Hardsigmoid))
        layers.append(ConvNormActivation(expanded, outputs, 1, activation=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        result = self.block(x)
        if self.use_res_connect:
            result += x
        return result


class MobileNetV3(nn.Module):
    """torchvision layout: ``features`` (stem, blocks, last conv), ``avgpool``, ``classifier`` with in-place Dropout."""

    def __init__(self) -> None:
        super().__init__()
        settings = [  # inputs, kernel, expanded, outputs, SE, hardswish, stride
            (8, 3, 8, 8, True, False, 2),
            (8, 3, 24, 12, False, False, 2),
            (12, 3, 36, 12, False, False, 1),
            (12, 5, 48, 16, True, True, 2),
        ]
        layers: list[nn.Module] = [ConvNormActivation(3, 8, 3, 2, activation=nn.Hardswish)]
        layers += [InvertedResidual(*setting) for setting in settings]
        layers.append(ConvNormActivation(16, 96, 1, activation=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(96, 32), nn.Hardswish(inplace=True), nn.Dropout(p=0.2, inplace=True), nn.Linear(32, CLASSES)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class MBConv(nn.Module):
    """EfficientNet block: expand (SiLU), depthwise (SiLU), SE (SiLU, sigmoid gate), project; per-sample drop."""

    def __init__(self, inputs: int, outputs: int, expand_ratio: int, kernel: int, stride: int, drop: nn.Module) -> None:
        super().__init__()
        self.use_res_connect = stride == 1 and inputs == outputs
        expanded = inputs * expand_ratio
        layers: list[nn.Module] = []
        if expanded != inputs:
            layers.append(ConvNormActivation(inputs, expanded, 1, activation=nn.SiLU))
        layers.append(ConvNormActivation(expanded, expanded, kernel, stride, groups=expanded, activation=nn.SiLU))
        layers.append(SqueezeExcitation(expanded, max(inputs // 4, 2), activation=nn.SiLU))
        layers.append(ConvNormActivation(expanded, outputs, 1, activation=None))
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = drop

    def forward(self, x: Tensor) -> Tensor:
        result = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += x
        return result


class EfficientNet(nn.Module):
    """EfficientNet with a timm-style head: ``forward_head`` calls ``F.dropout`` (not a module).

    ``drop`` picks the per-sample dropout of the residual blocks: ``"stochastic_depth"`` (torchvision's
    ``StochasticDepth(p, "row")``) or ``"drop_path"`` (timm's ``DropPath``).
    """

    def __init__(self, drop: str = "stochastic_depth", drop_rate: float = 0.2) -> None:
        super().__init__()

        def per_sample(p: float) -> nn.Module:
            return StochasticDepth(p, "row") if drop == "stochastic_depth" else DropPath(p)

        self.features = nn.Sequential(
            ConvNormActivation(3, 8, 3, 2, activation=nn.SiLU),
            MBConv(8, 8, 1, 3, 1, per_sample(0.05)),
            MBConv(8, 12, 4, 3, 2, per_sample(0.1)),
            MBConv(12, 12, 4, 5, 1, per_sample(0.15)),
            ConvNormActivation(12, 48, 1, activation=nn.SiLU),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.drop_rate = drop_rate
        self.classifier = nn.Linear(48, CLASSES)

    def forward_head(self, x: Tensor) -> Tensor:
        x = self.avgpool(x).flatten(1)
        if self.drop_rate > 0.0:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return self.classifier(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.features(x))


# --- ConvNeXt (timm) ----------------------------------------------------------------------------------------------


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of (B, C, H, W): permute to channels-last, normalize, permute back."""

    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Mlp(nn.Module):
    """timm's Mlp: fc1, act, drop1, fc2, drop2 on channels-last features."""

    def __init__(self, features: int, hidden: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, channels-last LayerNorm and GELU MLP (Linear), layer scale ``gamma``, DropPath, residual."""

    def __init__(self, dim: int, drop_path: float = 0.0, ls_init_value: float = 0.5) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)
        self.gamma = nn.Parameter(ls_init_value * torch.ones(dim))
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x
        x = self.conv_dw(x).permute(0, 2, 3, 1)
        x = self.mlp(self.norm(x)).mul(self.gamma)
        return self.drop_path(x.permute(0, 3, 1, 2)) + shortcut


class ConvNeXt(nn.Module):
    """timm layout: stem (4x4 patchify + LayerNorm2d), stages (downsample + blocks), head (pool, norm, drop, fc).

    Every Mlp dropout is ``Dropout(p=0)`` as in timm's defaults; the head's has ``drop_rate``.
    """

    def __init__(self, dims: tuple[int, int] = (8, 16), drop_rate: float = 0.3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6))
        self.stages = nn.Sequential(
            nn.Sequential(ConvNeXtBlock(dims[0], 0.1)),
            nn.Sequential(
                nn.Sequential(LayerNorm2d(dims[0], eps=1e-6), nn.Conv2d(dims[0], dims[1], 2, stride=2)),
                ConvNeXtBlock(dims[1], 0.2),
            ),
        )
        self.head = nn.ModuleDict(
            {
                "norm": LayerNorm2d(dims[1], eps=1e-6),
                "flatten": nn.Flatten(1),
                "drop": nn.Dropout(drop_rate),
                "fc": nn.Linear(dims[1], CLASSES),
            }
        )

    def forward_features(self, x: Tensor) -> Tensor:
        return self.stages(self.stem(x))

    def forward(self, x: Tensor) -> Tensor:
        x = self.forward_features(x).mean((2, 3), keepdim=True)
        x = self.head["flatten"](self.head["norm"](x))
        return self.head["fc"](self.head["drop"](x))


# --- Vision Transformer (timm's Attention, torchvision's EncoderBlock) --------------------------------------------


class Attention(nn.Module):
    """timm's Attention: qkv Linear, fused ``F.scaled_dot_product_attention`` (reads ``attn_drop.p``) or explicit
    softmax + ``attn_drop`` on the (B, heads, L, L) weights; proj Linear and proj_drop."""

    def __init__(self, dim: int, num_heads: int, attn_drop: float, proj_drop: float, fused: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused
        self.qkv = nn.Linear(dim, dim * 3)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            attn = self.attn_drop(attn.softmax(dim=-1))
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class Block(nn.Module):
    """timm's ViT block: pre-norm attention and Mlp, each with DropPath and a residual."""

    def __init__(self, dim: int, num_heads: int, drop: float, drop_path: float, fused: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, drop, drop, fused)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 2 * dim, drop)
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class EncoderBlock(nn.Module):
    """torchvision's ViT EncoderBlock: ``nn.MultiheadAttention`` (batch first), Dropout, MLP."""

    def __init__(self, dim: int, num_heads: int, drop: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, num_heads, dropout=drop, batch_first=True)
        self.dropout = nn.Dropout(drop)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(drop), nn.Linear(2 * dim, dim), nn.Dropout(drop)
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + self.dropout(y)
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    """Patch embedding (Conv2d, 8x8 patches), class token, position embedding + pos_drop, blocks, norm, head.

    ``attention``: ``"timm"`` (Attention with explicit softmax), ``"fused"`` (timm's fused path) or ``"torch"``
    (``nn.MultiheadAttention``).
    """

    def __init__(self, attention: str = "timm", dim: int = 16, depth: int = 2, drop: float = 0.1) -> None:
        super().__init__()
        tokens = (IMAGE[1] // 8) * (IMAGE[2] // 8)
        self.patch_embed = nn.Conv2d(3, dim, 8, stride=8)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.pos_drop = nn.Dropout(drop)
        blocks: list[nn.Module] = [
            EncoderBlock(dim, 2, drop) if attention == "torch" else Block(dim, 2, drop, 0.1, attention == "fused")
            for _ in range(depth)
        ]
        self.blocks = nn.Sequential(*blocks)
        self.norm = nn.LayerNorm(dim)
        self.head_drop = nn.Dropout(drop)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.norm(self.blocks(self.pos_drop(x + self.pos_embed)))
        return self.head(self.head_drop(x[:, 0]))


# --- the registry -------------------------------------------------------------------------------------------------


class Multihead(nn.Module):
    """Tokens (B, SEQUENCE, 6) -> Linear, GELU, Linear -> ``nn.MultiheadAttention`` called as ``call`` says -> Linear
    -> mean over the tokens. ``insert`` masks the inputs of the Linear layers (not the attention's), so the attention
    reads member-dependent values.

    ``call``: ``"self"`` (query, key and value one tensor; the weights returned and unused), ``"cross"`` (key and value
    from another Linear), ``"kdim"`` (keys of 12 and values of 8 channels, so separate projection weights),
    ``"key_padding_mask"`` and ``"float_padding_mask"`` (from the tokens, boolean or additive), ``"attn_mask"``
    (causal, additive; the weights returned and unused), ``"bool_attn_mask"`` (causal, True where left out),
    ``"is_causal"`` (the hint with the boolean mask, ``need_weights=False``: torch runs SDPA's causal path),
    ``"is_causal_weights"`` (the hint with ``need_weights=True``: torch uses the mask), ``"attn_and_padding_mask"``
    and ``"float_attn_and_padding_mask"`` (both masks, with the hint: torch merges them), ``"per_sample_mask"`` (a
    (B * heads, L, S) boolean mask from the tokens), or one it computes differently: ``"weights"`` (the attention
    weights are read), ``"bias_kv"`` (``add_bias_kv``).
    """

    def __init__(self, call: str = "self", batch_first: bool = True, bias: bool = True) -> None:
        super().__init__()
        self.call, self.batch_first = call, batch_first
        self.embed, self.pre = nn.Linear(6, 16), nn.Linear(16, 16)
        dims = {"kdim": 12, "vdim": 8} if call == "kdim" else {}
        self.memory = nn.Linear(16, 12 if call == "kdim" else 16)
        self.values = nn.Linear(16, 8)
        self.attention = nn.MultiheadAttention(
            16, 4, bias=bias, batch_first=batch_first, add_bias_kv=call == "bias_kv", **dims
        )
        self.out = nn.Linear(16, CLASSES)
        self.register_buffer("causal", torch.triu(torch.full((SEQUENCE, SEQUENCE), float("-inf")), 1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.pre(F.gelu(self.embed(x)))
        key = value = h
        if self.call == "cross":
            key = value = self.memory(h)
        elif self.call == "kdim":
            key, value = self.memory(h), self.values(h)
        swap = (lambda t: t) if self.batch_first else (lambda t: t.transpose(0, 1))
        options: dict[str, Tensor | bool] = {}
        padding = (x[..., 0] > 1.0) & (torch.arange(x.shape[1]) > 0)  # True: left out; never the first key
        if self.call == "key_padding_mask":
            options["key_padding_mask"] = padding
        elif self.call == "float_padding_mask":
            options["key_padding_mask"] = padding.float() * -1e4
        elif self.call == "attn_mask":
            options["attn_mask"] = self.causal
        elif self.call in ("bool_attn_mask", "is_causal", "is_causal_weights"):
            options["attn_mask"] = self.causal.isinf()
        elif self.call in ("attn_and_padding_mask", "float_attn_and_padding_mask"):
            additive = self.call.startswith("float")
            options["attn_mask"] = self.causal if additive else self.causal.isinf()
            options["key_padding_mask"] = padding.float() * -1e4 if additive else padding
        elif self.call == "per_sample_mask":  # each sample's own keys left out, on top of the causal mask
            left_out = padding[:, None, :] | self.causal.isinf()
            options["attn_mask"] = left_out.repeat_interleave(self.attention.num_heads, 0)
        if self.call.startswith("is_causal") or self.call == "attn_and_padding_mask":
            options["is_causal"] = True
            options["need_weights"] = self.call == "is_causal_weights"
        y, weights = self.attention(swap(h), swap(key), swap(value), **options)
        y = swap(y)
        if self.call == "weights":
            y = y * weights.sum(-1, keepdim=True)  # (B, L, S) whichever axis holds the batch
        return self.out(y).mean(1)


def randomize_norms(model: nn.Module, generator: torch.Generator) -> nn.Module:
    """Random BatchNorm statistics and affine parameters, so that eval outputs depend on them."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            c = module.num_features
            module.running_mean.copy_(torch.randn(c, generator=generator) * 0.1)
            module.running_var.copy_(torch.rand(c, generator=generator) + 0.5)
            module.weight.data.copy_(torch.rand(c, generator=generator) + 0.5)
            module.bias.data.copy_(torch.randn(c, generator=generator) * 0.1)
    return model


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "resnet_basic": lambda: ResNet(BasicBlock, [2, 1, 1, 1]),
    "resnet_bottleneck": lambda: ResNet(Bottleneck, [1, 1, 1, 1], width=4),
    "resnext": lambda: ResNet(Bottleneck, [1, 1, 1, 1], width=4, groups=2),
    "mobilenet_v3": MobileNetV3,
    "efficientnet": EfficientNet,
    "efficientnet_drop_path": lambda: EfficientNet("drop_path"),
    "convnext": ConvNeXt,
    "vit": VisionTransformer,
    "vit_fused": lambda: VisionTransformer("fused"),
    "vit_torch": lambda: VisionTransformer("torch"),
}


def build(name: str, seed: int = 0) -> nn.Module:
    """Model ``name`` of ``BUILDERS`` with weights and BatchNorm statistics from ``seed``, in eval mode."""
    torch.manual_seed(seed)
    return randomize_norms(BUILDERS[name](), torch.Generator().manual_seed(seed)).eval()


def images(batch: int, seed: int = 0) -> Tensor:
    """(batch, 3, 32, 32) random images."""
    return torch.randn(batch, *IMAGE, generator=torch.Generator().manual_seed(seed))


# --- BERT (Hugging Face's BertSelfAttention layout), for the attention folding tests --------------------------------


class BertLayer(nn.Module):
    """query/key/value Linear layers, heads by view + transpose, scores + an additive (B, 1, 1, L) padding mask,
    softmax, dropout, context, output Linear + LayerNorm, GELU MLP + LayerNorm. ``kv_heads`` < ``heads``: keys and
    values with fewer heads, each shared by a group of query heads (grouped-query attention); ``talking``: a Linear
    over the heads of the attention weights (talking heads), which mixes heads."""

    def __init__(self, dim: int, heads: int, kv_heads: int | None = None, talking: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads or heads, dim // heads
        self.query, self.dense = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.key, self.value = (nn.Linear(dim, self.kv_heads * self.head_dim) for _ in range(2))
        self.talking = nn.Linear(heads, heads) if talking else None
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-12), nn.LayerNorm(dim, eps=1e-12)
        self.attention_dropout, self.dropout = nn.Dropout(0.1), nn.Dropout(0.1)
        self.intermediate, self.output = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def split(self, x: Tensor, heads: int) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        q = self.split(self.query(x), self.heads)
        k, v = self.split(self.key(x), self.kv_heads), self.split(self.value(x), self.kv_heads)
        if self.kv_heads != self.heads:
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5 + mask
        if self.talking is not None:
            scores = self.talking(scores.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        context = (self.attention_dropout(scores.softmax(-1)) @ v).transpose(1, 2)
        x = self.norm1(x + self.dropout(self.dense(context.flatten(2))))
        return self.norm2(x + self.dropout(self.output(F.gelu(self.intermediate(x)))))


class Bert(nn.Module):
    """Token ids (B, L) -> logits (B, 2): embeddings + LayerNorm, layers with a padding mask (id 0) built from the
    ids, tanh pooler on the first token, classifier."""

    def __init__(self, dim: int = 16, depth: int = 2, heads: int = 2, length: int = 8, **layer: int | bool) -> None:
        super().__init__()
        self.words, self.positions = nn.Embedding(50, dim), nn.Parameter(torch.randn(1, length, dim) * 0.02)
        self.norm = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(dim, heads, **layer) for _ in range(depth))  # type: ignore[arg-type]
        self.pooler, self.classifier = nn.Linear(dim, dim), nn.Linear(dim, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        mask = (tokens == 0)[:, None, None, :].float() * -10000.0
        x = self.norm(self.words(tokens) + self.positions)
        for layer in self.layers:
            x = layer(x, mask)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


def tokens(batch: int, length: int = 8, seed: int = 0) -> Tensor:
    """(batch, length) token ids in [1, 50), each sequence padded with id 0 after at least 3 tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (batch, length), generator=generator)
    lengths = torch.randint(3, length + 1, (batch, 1), generator=generator)
    return ids.masked_fill(torch.arange(length) >= lengths, 0)
