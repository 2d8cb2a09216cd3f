"""Packed inference: all N members in one call, timed ÷ one model and ÷ tiled ``predict``.

    python benchmarks/bench_packing.py [--rounds 15] [--device cpu|cuda] [--models MLP,ResNet,...]
    MALLOC_MMAP_THRESHOLD_=4000000000 MALLOC_TRIM_THRESHOLD_=4000000000 python benchmarks/bench_packing.py

N=4, S=2. Models (float32): an MLP 784→1024→1024→1024→10 with Masksembles before each Linear after the first; a
small ResNet on 3×32×32 (masks inside the blocks and before the head); and, with masks placed by ``insert`` (the
paper's recipe: before every Conv/Linear but the first), a MobileNetV3-like (depthwise convolutions, squeeze-excite,
hardswish) and a ConvNeXt-like (depthwise 7×7, channels-first LayerNorm, GELU MLP, layer scale) on 3×64×64 and a
ViT-like (dim 96, 4 blocks, 4×4 patches) on 3×32×32, the same ViT as Hugging Face `transformers` builds it
(``ViTForImageClassification`` from a config) and with torchvision's blocks (``nn.MultiheadAttention``), and a
BERT-tiny-like (hidden 128, 2 layers, 2 heads) on 128 token ids with a padding mask, its attention written out as
Hugging Face's BERT wrote it (which ``pack`` runs as one ``F.scaled_dot_product_attention`` call) and as that call
in the single model too (SDPA); with dropouts converted by
``convert_dropout``, the BERT-tiny shape built from torch's own ``nn.TransformerEncoder``, with a padding mask (its
single model skips the padded tokens with nested tensors; a second row runs it on every token, as the packed program
and the MAC ratio count them) and,
GPT-like, with a causal mask (pre-norm, the last token classified); and the issue's case, a
ResNet-50 (bottleneck blocks 3-4-6-3) on 3×32×32 with masks after every block; issue #39's 1-D CNN (Conv1d 1→32, kernel
7; 32→64, kernel 5; 64→64, kernel 3; average pool; Linear 64→10; masks before the last three) on 1×128. For each batch
size (medians of interleaved rounds, every ratio from the same run), ÷ one forward of the same network without
Masksembles on the same batch: ``pack(model, program="packed")``, the tiled dense ``predict(model, x, 4)``, and packed ÷
tiled (``pack``'s default ``program="auto"`` keeps the faster of the two). Next to the packed ratio: the
multiply-accumulate (MAC) ratio of its Linear/Conv layers and attention products, and the share of those MACs that run
at full width because they fell back; where the packed program runs on chunks of the batch (CPU, per-sample programs),
the single model run on the same chunks. The second command keeps glibc from returning freed memory to the system, so
that large allocations do not page-fault on every call (its table goes to its own section)."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _report import arguments, interleaved_medians, machine, publish
from _torch_setup import torch_device
from torch import Tensor, nn

import masksembles_torch as mt

N, SCALE = 4, 2.0
# glibc settings that keep freed memory for reuse: run with both set to a large value (e.g. 4000000000) to measure
# without the page faults that fresh large allocations cost (written to its own section of BENCHMARKS.md)
ALLOCATOR = " ".join(
    f"{name}={os.environ[name]}" for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if name in os.environ
)


def mlp(masks: bool) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(784, 1024), nn.ReLU()]
    for i in range(2):
        layers += [mt.Masksembles1D(1024, N, SCALE, seed=i) if masks else nn.Identity()]
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    layers += [mt.Masksembles1D(1024, N, SCALE, seed=2) if masks else nn.Identity()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


class Block(nn.Module):
    def __init__(self, channels: int, masks: bool, seed: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.masks = mt.Masksembles2D(channels, N, SCALE, seed=seed) if masks else nn.Identity()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn2(self.conv2(self.masks(F.relu(self.bn1(self.conv1(x)))))) + x)


class ResNet(nn.Module):
    def __init__(self, masks: bool) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.block1 = Block(64, masks, 0)
        self.down = nn.Sequential(
            nn.Conv2d(64, 128, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU()
        )
        self.block2 = Block(128, masks, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head_masks = mt.Masksembles1D(128, N, SCALE, seed=2) if masks else nn.Identity()
        self.fc = nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        y = self.pool(self.block2(self.down(self.block1(self.stem(x))))).flatten(1)
        return self.fc(self.head_masks(y))


class ConvBN(nn.Sequential):
    def __init__(self, inputs: int, outputs: int, kernel: int, stride: int = 1, groups: int = 1) -> None:
        conv = nn.Conv2d(inputs, outputs, kernel, stride, kernel // 2, groups=groups, bias=False)
        super().__init__(conv, nn.BatchNorm2d(outputs))


class InvertedResidual(nn.Module):
    """MobileNetV3 block: expand 1×1, depthwise k×k, squeeze-excite with hardsigmoid gate, project 1×1."""

    def __init__(self, inputs: int, expanded: int, outputs: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.expand, self.depthwise = ConvBN(inputs, expanded, 1), ConvBN(expanded, expanded, kernel, stride, expanded)
        self.reduce, self.gate = nn.Conv2d(expanded, expanded // 4, 1), nn.Conv2d(expanded // 4, expanded, 1)
        self.project = ConvBN(expanded, outputs, 1)
        self.residual = stride == 1 and inputs == outputs

    def forward(self, x: Tensor) -> Tensor:
        y = F.hardswish(self.depthwise(F.hardswish(self.expand(x))))
        y = y * F.hardsigmoid(self.gate(F.relu(self.reduce(y.mean((2, 3), keepdim=True)))))
        y = self.project(y)
        return y + x if self.residual else y


class MobileNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        settings = [  # inputs, expanded, outputs, kernel, stride
            (16, 64, 24, 3, 2), (24, 72, 24, 3, 1), (24, 96, 40, 5, 2), (40, 240, 40, 5, 1), (40, 240, 48, 5, 1),
        ]  # fmt: skip
        self.stem = ConvBN(3, 16, 3, 2)
        self.blocks = nn.Sequential(*(InvertedResidual(*s) for s in settings))
        self.last = ConvBN(48, 288, 1)
        self.head = nn.Sequential(nn.Linear(288, 256), nn.Hardswish(), nn.Linear(256, 10))

    def forward(self, x: Tensor) -> Tensor:
        x = F.hardswish(self.last(self.blocks(F.hardswish(self.stem(x)))))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv, self.norm = nn.Conv2d(dim, dim, 7, padding=3, groups=dim), nn.LayerNorm(dim, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.fc2(F.gelu(self.fc1(y))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (40, 80, 160)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6))
        stages: list[nn.Module] = []
        for i, dim in enumerate(dims):
            down = [] if i == 0 else [LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dim, 2, stride=2)]
            stages.append(nn.Sequential(*down, ConvNeXtBlock(dim), ConvNeXtBlock(dim)))
        self.stages = nn.Sequential(*stages)
        self.norm, self.fc = nn.LayerNorm(dims[-1], eps=1e-6), nn.Linear(dims[-1], 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.norm(self.stages(self.stem(x)).mean((2, 3))))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(dim), Attention(dim, heads), nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self, dim: int = 96, depth: int = 4, heads: int = 3) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 65, dim) * 0.02)
        self.blocks = nn.Sequential(*(ViTBlock(dim, heads) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


class BertLayer(nn.Module):
    """A BERT encoder layer as Hugging Face writes it: query/key/value Linear layers, heads by view + transpose, scores
    plus an additive padding mask, softmax, dropout, context, output Linear + LayerNorm, GELU MLP + LayerNorm."""

    def __init__(self, dim: int, heads: int, fused: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.fused = heads, dim // heads, fused
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.dense, self.norm1 = nn.Linear(dim, dim), nn.LayerNorm(dim, eps=1e-12)
        self.attention_dropout, self.dropout = nn.Dropout(0.1), nn.Dropout(0.1)
        self.intermediate, self.output = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-12)

    def split(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        if self.fused:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
        else:
            scores = q @ k.transpose(-1, -2) / self.head_dim**0.5 + mask
            context = (self.attention_dropout(scores.softmax(-1)) @ v).transpose(1, 2)
        x = self.norm1(x + self.dropout(self.dense(context.flatten(2))))
        return self.norm2(x + self.dropout(self.output(F.gelu(self.intermediate(x)))))


class BertTiny(nn.Module):
    """BERT-tiny's shape (hidden 128, 2 layers, 2 heads) on token ids (B, 128) with padding (id 0) masked out of the
    attention: embeddings + LayerNorm, encoder layers, tanh pooler on the first token, classifier."""

    def __init__(
        self, vocabulary: int = 1000, dim: int = 128, depth: int = 2, heads: int = 2, length: int = 128,
        fused: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.words, self.positions = nn.Embedding(vocabulary, dim), nn.Parameter(torch.randn(1, length, dim) * 0.02)
        self.norm = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(dim, heads, fused) for _ in range(depth))
        self.pooler, self.classifier = nn.Linear(dim, dim), nn.Linear(dim, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        mask = (tokens == 0)[:, None, None, :].float() * torch.finfo(torch.float32).min
        x = self.norm(self.words(tokens) + self.positions)
        for layer in self.layers:
            x = layer(x, mask)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


class EncoderBlock(nn.Module):
    """torchvision's ViT block: ``nn.MultiheadAttention`` (batch first, ``need_weights=False``), GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        y = self.norm1(x)
        x = x + self.attention(y, y, y, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def torchvision_vit() -> nn.Module:
    """ViT-like with torchvision's blocks (``nn.MultiheadAttention``)."""
    model = ViT()
    model.blocks = nn.Sequential(*(EncoderBlock(96, 3) for _ in range(4)))
    return model


class TextEncoder(nn.Module):
    """BERT-tiny's shape with torch's own ``nn.TransformerEncoder`` (hidden 128, 2 layers, 2 heads, feed-forward 512,
    GELU, dropout 0.1, batch first, defaults otherwise) on token ids (B, 128), padding (id 0) left out through
    ``src_key_padding_mask``, mean over the tokens, classifier. Without masks, torch runs it on its fused path (and
    nested tensors for the padding)."""

    def __init__(self, vocabulary: int = 1000, dim: int = 128, length: int = 128) -> None:
        super().__init__()
        self.words, self.positions = nn.Embedding(vocabulary, dim), nn.Parameter(torch.randn(1, length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 2, 4 * dim, 0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.classifier = nn.Linear(dim, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.encoder(self.words(tokens) + self.positions, src_key_padding_mask=tokens == 0)
        return self.classifier(x.mean(1))


class CausalTextEncoder(nn.Module):
    """GPT-like, BERT-tiny's shape: torch's own ``nn.TransformerEncoder`` (hidden 128, 2 layers, 2 heads, feed-forward
    512, GELU, dropout 0.1, batch first, pre-norm, a final LayerNorm) on token ids (B, 128) with the causal mask and
    ``is_causal=True``, the last token classified. Without masks, torch runs it on its fused path."""

    def __init__(self, vocabulary: int = 1000, dim: int = 128, length: int = 128) -> None:
        super().__init__()
        self.words, self.positions = nn.Embedding(vocabulary, dim), nn.Parameter(torch.randn(1, length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 2, 4 * dim, 0.1, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(dim), enable_nested_tensor=False)
        self.classifier = nn.Linear(dim, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        x = self.encoder(self.words(tokens) + self.positions, mask=causal, is_causal=True)
        return self.classifier(x[:, -1])


def converted(factory: Callable[[], nn.Module], example: Callable[[int], Tensor]) -> Callable[[bool], nn.Module]:
    """The model, its dropouts converted by ``convert_dropout`` when asked (the other one has the same weights)."""

    def build(masks: bool) -> nn.Module:
        torch.manual_seed(0)
        model = factory()
        return mt.convert_dropout(model, example(4), N, SCALE, seed=0) if masks else model

    return build


def every_token(factory: Callable[[bool], nn.Module]) -> Callable[[bool], nn.Module]:
    """The model, its single (unmasked) copy run on every token: its encoder's nested tensors off, so that it computes
    the padded positions as the packed program does (torch's fused path still runs it)."""

    def build(masks: bool) -> nn.Module:
        model = factory(masks)
        if not masks:
            model.encoder.use_nested_tensor = False  # type: ignore[union-attr]
        return model

    return build


def transformers_vit() -> nn.Module:
    """ViT-like's shape as Hugging Face ``transformers`` writes it (``ViTForImageClassification``, SDPA attention),
    built from a config: nothing is downloaded."""
    import transformers  # only this row needs it (the bench session installs it)

    config = transformers.ViTConfig(
        hidden_size=96, num_hidden_layers=4, num_attention_heads=3, intermediate_size=384, image_size=32,
        patch_size=4, num_labels=10,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def tokens(batch: int, length: int = 128) -> Tensor:
    """Token ids (batch, length) in [1, 1000), each sequence padded with 0 after a random length of at least 8."""
    ids = torch.randint(1, 1000, (batch, length))
    lengths = torch.randint(8, length + 1, (batch, 1))
    return ids.masked_fill(torch.arange(length) >= lengths, 0)


class Bottleneck(nn.Module):
    def __init__(self, inputs: int, width: int, stride: int, masks: bool, seed: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = ConvBN(inputs, width, 1), ConvBN(width, width, 3, stride)
        self.conv3 = ConvBN(width, 4 * width, 1)
        self.down = ConvBN(inputs, 4 * width, 1, stride) if stride != 1 or inputs != 4 * width else None
        self.masks = mt.Masksembles2D(4 * width, N, SCALE, seed=seed) if masks else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv3(F.relu(self.conv2(F.relu(self.conv1(x)))))
        return self.masks(F.relu(y + (x if self.down is None else self.down(x))))


class ResNet50(nn.Module):
    """ResNet-50's bottleneck stages (3, 4, 6, 3 blocks, widths 64-512) on 32×32 images, masks after every block."""

    def __init__(self, masks: bool) -> None:
        super().__init__()
        self.stem = ConvBN(3, 64, 3)
        blocks, inputs = [], 64
        for stage, (count, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
            for i in range(count):
                blocks.append(Bottleneck(inputs, width, 2 if i == 0 and stage else 1, masks, len(blocks)))
                inputs = 4 * width
        self.blocks, self.fc = nn.Sequential(*blocks), nn.Linear(inputs, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.blocks(F.relu(self.stem(x))), 1).flatten(1))


def conv1d_cnn(masks: bool) -> nn.Module:
    """Issue #39's 1-D CNN: three Conv1d layers and a Linear, Masksembles before the last three."""

    def masked(channels: int, seed: int) -> nn.Module:
        return mt.Masksembles1D(channels, N, SCALE, seed=seed) if masks else nn.Identity()

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(1, 32, 7, padding=3), nn.ReLU(), masked(32, 0),
        nn.Conv1d(32, 64, 5, padding=2), nn.ReLU(), masked(64, 1),
        nn.Conv1d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), masked(64, 2),
        nn.Linear(64, 10),
    )  # fmt: skip


def inserted(factory: Callable[[], nn.Module]) -> Callable[[bool], nn.Module]:
    """The model, with masks placed by ``insert`` when asked (the unmasked one has the same weights)."""

    def build(masks: bool) -> nn.Module:
        torch.manual_seed(0)
        model = factory()
        return mt.insert(model, N, SCALE, seed=0) if masks else model

    return build


MODELS: dict[str, tuple[Callable[[bool], nn.Module], tuple[int, ...], tuple[int, ...]]] = {
    "MLP": (mlp, (784,), (1, 32, 256)),
    "ResNet": (ResNet, (3, 32, 32), (1, 32, 256)),
    "1-D CNN": (conv1d_cnn, (1, 128), (1, 32, 256)),
    "MobileNetV3-like": (inserted(MobileNet), (3, 64, 64), (1, 32, 256)),
    "ConvNeXt-like": (inserted(ConvNeXt), (3, 64, 64), (1, 32, 256)),
    "ViT-like": (inserted(ViT), (3, 32, 32), (1, 32, 256)),
    "ViT (transformers)": (inserted(transformers_vit), (3, 32, 32), (1, 32, 256)),
    "ViT-like (nn.MultiheadAttention)": (inserted(torchvision_vit), (3, 32, 32), (1, 32, 256)),
    "BERT-tiny-like": (inserted(BertTiny), (128,), (1, 32, 256)),
    "BERT-tiny-like (SDPA)": (inserted(lambda: BertTiny(fused=True)), (128,), (1, 32, 256)),
    "nn.TransformerEncoder (convert_dropout)": (converted(TextEncoder, tokens), (128,), (1, 32, 256)),
    "nn.TransformerEncoder (convert_dropout), single on every token": (
        every_token(converted(TextEncoder, tokens)),
        (128,),
        (1, 32, 256),
    ),
    "GPT-like causal nn.TransformerEncoder (convert_dropout)": (
        converted(CausalTextEncoder, tokens),
        (128,),
        (1, 32, 256),
    ),
    "ResNet-50, masks after every block": (ResNet50, (3, 32, 32), (1, 8, 32)),
}


INPUTS: dict[str, Callable[[int], Tensor]] = {  # the others: random images
    "BERT-tiny-like": tokens,
    "BERT-tiny-like (SDPA)": tokens,
    "nn.TransformerEncoder (convert_dropout)": tokens,
    "nn.TransformerEncoder (convert_dropout), single on every token": tokens,
    "GPT-like causal nn.TransformerEncoder (convert_dropout)": tokens,
}


def example(name: str, batch: int, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """An input of model ``name`` with ``batch`` samples."""
    return (INPUTS[name](batch) if name in INPUTS else torch.randn(batch, *shape)).to(device)


def randomize_norms(model: nn.Module) -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.copy_(torch.randn(module.num_features, generator=generator) * 0.1)
            module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
    return model


def main() -> None:
    args = arguments(device=True, models=list(MODELS))
    device, sync, where = torch_device(args)
    lines = [
        f"## Packed inference, PyTorch ({where}{', ' + ALLOCATOR if ALLOCATOR else ''})",
        "",
        f"torch {torch.__version__}, float32, N={N}, S={SCALE}; medians of {args.rounds} interleaved rounds on "
        f"{machine()}. Every ratio is ÷ one forward of the same network without Masksembles on the same batch. In "
        "brackets after the packed ratio: the MAC ratio of its Linear/Conv layers and attention products (the "
        "bound on its time ratio if every kernel ran at the same speed per MAC) and the share of MACs that fell back "
        "to full width. On CPU a program proven per-sample runs on chunks of the batch (about 16 MiB for its largest "
        "tensor; fresh larger buffers page-fault on every call); the next column gives the chunk's samples and packed "
        "÷ the single model run on the same chunks, the like-for-like ratio (— where packed runs in one call). "
        "Targets: packed within 1.3× of its MAC ratio where nothing falls back; never slower than "
        'tiled predict (`pack`\'s default `program="auto"` times both on the example input and keeps the faster).',
        "",
        "| model | batch | single (ms) | packed ÷ single [MACs; fallback] | chunk: packed ÷ single in those chunks "
        "| tiled predict ÷ single | packed ÷ tiled | one member ÷ single | member params ÷ full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in args.models:
        factory, shape, batches = MODELS[name]
        masked = randomize_norms(factory(True)).to(device).eval()
        single = randomize_norms(factory(False)).to(device).eval()
        for batch in batches:
            x = example(name, batch, shape, device)
            packed = mt.pack(masked, x, program="packed")
            member = mt.extract_member(masked, 0, x)
            tiled = copy.deepcopy(masked)

            def run(fn: Callable[[Tensor], object], x: Tensor = x) -> Callable[[], None]:
                def call() -> None:
                    with torch.no_grad():
                        fn(x)
                    sync()

                return call

            chunk = packed.meta["masksembles"]["chunk"]
            contenders = {
                "single": run(single),
                "packed": run(packed),
                "tiled": run(lambda v, model=tiled: mt.predict(model, v, N)),
                "member": run(member),
            }
            if chunk:  # the single model on the same chunks of the batch as the packed program
                parts = -(-batch // chunk)
                contenders["chunked"] = run(lambda v, n=parts, m=single: [m(part) for part in v.tensor_split(n)])
            medians = interleaved_medians(contenders, rounds=args.rounds)
            ratio = {k: medians[k] / medians["single"] for k in medians}
            macs = packed.macs
            mac_ratio = macs["packed"] / (macs["dense"] / N)
            fallback = macs["fallback"] / macs["packed"]
            params = sum(p.numel() for p in member.parameters()) / sum(p.numel() for p in single.parameters())
            row = (
                f"| {name} | {batch} | {medians['single'] * 1e3:.2f} "
                f"| {ratio['packed']:.2f}× [{mac_ratio:.2f}×; {fallback:.0%}] "
                + (f"| {chunk}: {medians['packed'] / medians['chunked']:.2f}× " if chunk else "| — ")
                + f"| {ratio['tiled']:.2f}× "
                f"| {medians['packed'] / medians['tiled']:.2f}× | {ratio['member']:.2f}× | {params:.2f}× |"
            )
            lines.append(row)
            print(row, flush=True)
    publish(f"packing-{device.type}{'-malloc' if ALLOCATOR else ''}", "\n".join(lines), write=not args.no_write)
    if not ALLOCATOR:
        publish(f"packing-build-{device.type}", build_times(args.models, device), write=not args.no_write)


def build_times(models: list[str], device: torch.device) -> str:
    """How long ``pack`` itself takes: ``program="packed"`` (trace, probe, plan, emit, verify) and the default
    ``"auto"`` (the same capture, two or three programs built and verified, then timed in interleaved rounds)."""
    lines = [
        f"### Time to build (PyTorch, {device.type})",
        "",
        f"Seconds for one call of `pack` on the middle batch size of each model above, {machine()}; one measurement "
        "each (a build is not repeated), so read them as orders of magnitude. `auto` traces and probes the model "
        "once for all its candidates, builds and verifies each, and times them in up to 7 interleaved rounds "
        "(fewer once the rest could not change its choice, and none that would end after twice the packed build "
        "time); the last column is its choice.",
        "",
        '| model | batch | `pack(program="packed")` (s) | `pack()` (s) | auto ÷ packed | auto\'s choice |',
        "|---|---:|---:|---:|---:|---|",
    ]
    for name in models:
        factory, shape, batches = MODELS[name]
        masked = randomize_norms(factory(True)).to(device).eval()
        batch = batches[len(batches) // 2]
        x = example(name, batch, shape, device)
        seconds = {}
        for program in ("packed", "auto"):
            start = time.perf_counter()
            built = mt.pack(masked, x, program=program)
            seconds[program] = time.perf_counter() - start
        row = (
            f"| {name} | {batch} | {seconds['packed']:.1f} | {seconds['auto']:.1f} "
            f"| {seconds['auto'] / seconds['packed']:.2f}× | {built.choice} |"
        )
        lines.append(row)
        print(row, flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
