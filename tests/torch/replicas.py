"""Small replicas of blocks from timm and torchvision models that pack must handle as users build them: written here
from how those libraries build each block (their code is not imported: torchvision's C ops do not load on the CPU
build of torch these tests run on), at widths and sizes that keep a test fast.

Each model takes (B, 3, 16, 16) images and gets its masks from ``insert`` with the defaults, as a user would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IMAGE = (3, 16, 16)


# --- Swin (timm's swin_tiny layout): windows folded into the batch, a cyclic shift, relative position bias


def window_partition(x: Tensor, window: int) -> Tensor:
    """(B, H, W, C) -> (B * H/window * W/window, window*window, C): the windows join the batch axis."""
    b, h, w, c = x.shape
    x = x.view(b, h // window, window, w // window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, c)


def window_reverse(windows: Tensor, window: int, h: int, w: int) -> Tensor:
    c = windows.shape[-1]
    x = windows.view(-1, h // window, w // window, window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, h, w, c)


class WindowAttention(nn.Module):
    def __init__(self, dim: int, window: int, heads: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("bias_index", relative[..., 0] * (2 * window - 1) + relative[..., 1], persistent=False)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.bias_table[self.bias_index.view(-1)].view(n, n, -1).permute(2, 0, 1)
        attn = attn + bias.unsqueeze(0)
        if mask is not None:
            windows = mask.shape[0]
            attn = attn.view(-1, windows, self.heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, n, n)
        x = (attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(x)


class SwinBlock(nn.Module):
    def __init__(self, dim: int, size: int, window: int, shift: int, heads: int) -> None:
        super().__init__()
        self.size, self.window, self.shift = size, window, shift
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, window, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        if shift:
            regions = torch.zeros(1, size, size, 1)
            cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
            for label, (h, w) in enumerate((h, w) for h in cuts for w in cuts):
                regions[:, h, w, :] = label
            ids = window_partition(regions, window).squeeze(-1)
            mask = (ids.unsqueeze(1) - ids.unsqueeze(2)).ne(0).float() * -100.0
            self.register_buffer("attn_mask", mask, persistent=False)
        else:
            self.attn_mask = None

    def forward(self, x: Tensor) -> Tensor:  # (B, H, W, C)
        h, w = x.shape[1:3]
        shortcut = x
        x = self.norm1(x)
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        windows = self.attn(window_partition(x, self.window), mask=self.attn_mask)
        x = window_reverse(windows, self.window, h, w)
        if self.shift:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        x = shortcut + x
        return x + self.mlp(self.norm2(x))


class Swin(nn.Module):
    def __init__(self, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.blocks = nn.Sequential(SwinBlock(dim, 8, 4, 0, 2), SwinBlock(dim, 8, 4, 2, 2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks(self.patch(x).permute(0, 2, 3, 1))
        return self.head(self.norm(x).mean((1, 2)))


# --- LeViT: attention on (B, N, C) tokens with BatchNorm over the token features


class LinearNorm(nn.Sequential):
    """timm's LeViT ``LinearNorm``: Linear then BatchNorm1d on the flattened tokens."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.add_module("linear", nn.Linear(inputs, outputs, bias=False))
        self.add_module("bn", nn.BatchNorm1d(outputs))

    def forward(self, x: Tensor) -> Tensor:
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class LeViTAttention(nn.Module):
    def __init__(self, dim: int, key_dim: int, heads: int, tokens: int) -> None:
        super().__init__()
        self.heads, self.key_dim, self.scale = heads, key_dim, key_dim**-0.5
        self.qkv = LinearNorm(dim, heads * key_dim * 3)
        self.proj = nn.Sequential(nn.Hardswish(), LinearNorm(heads * key_dim, dim))
        self.attention_biases = nn.Parameter(torch.randn(heads, tokens) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, self.heads, -1).split([self.key_dim] * 3, dim=3)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3)
        attn = (q @ k) * self.scale + self.attention_biases.mean(-1)[None, :, None, None]
        x = (attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)
        return self.proj(x)


class LeViT(nn.Module):
    def __init__(self, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dim, 3, stride=2, padding=1), nn.BatchNorm2d(dim), nn.Hardswish())
        self.attn = LeViTAttention(dim, 4, 2, 64)
        self.mlp = nn.Sequential(LinearNorm(dim, 2 * dim), nn.Hardswish(), LinearNorm(2 * dim, dim))
        self.head = nn.Sequential(nn.BatchNorm1d(dim), nn.Linear(dim, classes))

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        x = x + self.attn(x)
        x = x + self.mlp(x)
        return self.head(x.mean(1))


# --- DenseNet: every layer reads the concatenation of all earlier feature maps


class DenseLayer(nn.Module):
    def __init__(self, inputs: int, growth: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(inputs), nn.Conv2d(inputs, 2 * growth, 1, bias=False)
        self.norm2, self.conv2 = nn.BatchNorm2d(2 * growth), nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[Tensor]) -> Tensor:
        x = self.conv1(F.relu(self.norm1(torch.cat(features, 1))))
        return self.conv2(F.relu(self.norm2(x)))


class DenseNet(nn.Module):
    def __init__(self, growth: int = 6, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layers = nn.ModuleList(DenseLayer(8 + i * growth, growth) for i in range(3))
        width = 8 + 3 * growth
        self.transition = nn.Sequential(nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, 12, 1), nn.AvgPool2d(2))
        self.head = nn.Linear(12, classes)

    def forward(self, x: Tensor) -> Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(features))
        x = self.transition(torch.cat(features, 1))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


# --- ShuffleNetV2: a channel split, two branches, concatenation and a shuffle by view/transpose


def channel_shuffle(x: Tensor, groups: int) -> Tensor:
    b, c, h, w = x.size()
    x = x.view(b, groups, c // groups, h, w).transpose(1, 2).contiguous()
    return x.view(b, -1, h, w)


class ShuffleUnit(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        half = channels // 2
        self.branch = nn.Sequential(
            nn.Conv2d(half, half, 1, bias=False), nn.BatchNorm2d(half), nn.ReLU(inplace=True),
            nn.Conv2d(half, half, 3, padding=1, groups=half, bias=False), nn.BatchNorm2d(half),
            nn.Conv2d(half, half, 1, bias=False), nn.BatchNorm2d(half), nn.ReLU(inplace=True),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=1)
        return channel_shuffle(torch.cat((x1, self.branch(x2)), dim=1), 2)


class ShuffleNet(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.units = nn.Sequential(ShuffleUnit(16), ShuffleUnit(16))
        self.head = nn.Linear(16, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.units(self.stem(x)).mean([2, 3]))


# --- DeiT distilled: class and distillation tokens, a tuple from forward_head, optional arguments


class DeiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class DeiTDistilled(nn.Module):
    def __init__(self, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.dist_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 18, dim) * 0.02)
        self.blocks = nn.Sequential(DeiTBlock(dim, 2), DeiTBlock(dim, 2))
        self.norm = nn.LayerNorm(dim)
        self.head, self.head_dist = nn.Linear(dim, classes), nn.Linear(dim, classes)
        self.distilled_training = False

    def forward_features(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        tokens = (self.cls_token.expand(x.shape[0], -1, -1), self.dist_token.expand(x.shape[0], -1, -1), x)
        return self.norm(self.blocks(torch.cat(tokens, dim=1) + self.pos_embed))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        if pre_logits:
            return (x[:, 0] + x[:, 1]) / 2
        logits, distilled = self.head(x[:, 0]), self.head_dist(x[:, 1])
        if self.distilled_training and self.training:
            return logits, distilled
        return (logits + distilled) / 2

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, return_tokens: bool = False) -> Tensor:
        features = self.forward_features(x, attn_mask)
        if return_tokens:
            return features
        return self.forward_head(features)  # type: ignore[return-value]


class DeiTTuple(DeiTDistilled):
    """The distilled head's training output, both heads as a tuple, in eval too."""

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, return_tokens: bool = False) -> Tensor:
        features = self.forward_features(x, attn_mask)
        return self.head(features[:, 0]), self.head_dist(features[:, 1])  # type: ignore[return-value]


# --- MLP-Mixer: token mixing by transposes


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.tokens = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channels = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, stride=4)
        self.blocks = nn.Sequential(MixerBlock(16, dim), MixerBlock(16, dim))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks(self.stem(x).flatten(2).transpose(1, 2))
        return self.head(self.norm(x).mean(1))


# --- RegNet: the X block (1x1, grouped 3x3, 1x1) with a projection shortcut


class RegNetBlock(nn.Module):
    def __init__(self, inputs: int, width: int, group_width: int, stride: int) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.b = nn.Sequential(
            nn.Conv2d(width, width, 3, stride, 1, groups=width // group_width, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        self.c = nn.Sequential(nn.Conv2d(width, width, 1, bias=False), nn.BatchNorm2d(width))
        self.shortcut = nn.Sequential(nn.Conv2d(inputs, width, 1, stride, bias=False), nn.BatchNorm2d(width))

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.shortcut(x) + self.c(self.b(self.a(x))))


class RegNet(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(RegNetBlock(8, 16, 4, 1), RegNetBlock(16, 24, 8, 2))
        self.head = nn.Linear(24, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


# --- SqueezeNet: the fire module (squeeze 1x1, then 1x1 and 3x3 expansions concatenated)


class Fire(nn.Module):
    def __init__(self, inputs: int, squeeze: int, expand: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(inputs, squeeze, 1)
        self.expand1x1 = nn.Conv2d(squeeze, expand, 1)
        self.expand3x3 = nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.squeeze(x), inplace=True)
        return torch.cat([F.relu(self.expand1x1(x), inplace=True), F.relu(self.expand3x3(x), inplace=True)], 1)


class SqueezeNet(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
            Fire(16, 4, 8), Fire(16, 4, 8),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Conv2d(16, classes, 1), nn.ReLU(inplace=True))

    def forward(self, x: Tensor) -> Tensor:
        return torch.flatten(F.adaptive_avg_pool2d(self.classifier(self.features(x)), 1), 1)


REPLICAS: dict[str, Callable[[], nn.Module]] = {
    "swin": Swin,
    "levit": LeViT,
    "densenet": DenseNet,
    "shufflenet_v2": ShuffleNet,
    "deit_distilled": DeiTDistilled,
    "deit_tuple": DeiTTuple,
    "mixer": Mixer,
    "regnet": RegNet,
    "squeezenet": SqueezeNet,
}


def build(name: str, seed: int = 0) -> nn.Module:
    """Replica ``name`` with seeded weights and random BatchNorm statistics, in eval mode."""
    torch.manual_seed(seed)
    model = REPLICAS[name]()
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            c = module.num_features
            module.running_mean.copy_(torch.randn(c, generator=generator) * 0.1)
            module.running_var.copy_(torch.rand(c, generator=generator) + 0.5)
    return model.eval()


def images(batch: int, seed: int = 0) -> Tensor:
    return torch.randn(batch, *IMAGE, generator=torch.Generator().manual_seed(seed))
