"""Packed inference for Flax NNX: all N members at about the cost of one model.

    python benchmarks/bench_flax_packing.py [--rounds 15] [--models MLP,ResNet,...] [--no-write]

Fixed capacity N=4, S=2 (M·S = C), float32 on the default JAX device. Models: an MLP 784→1024→1024→1024→10 with
Masksembles before each Linear after the first, and a small ResNet on 32×32×3 (the same networks as
bench_packing.py), both ``nnx.Sequential``; a CNN written as a user's ``nnx.Module`` (the Flax tutorial's
conv-BatchNorm-relu-avg_pool twice, a reshape, two Linear layers) on 32×32×3; and Flax-examples-style modules: the
Flax examples' ResNet-18 on 128×128×3 (7×7/2 stem and 3×3/2 max pool, so that its last stage is 4×4: XLA:CPU runs a
3×3 convolution on a 2×2 map at a few hundred MFLOP/s), and channels-last versions of bench_packing.py's
MobileNetV3-like and ConvNeXt-like on 64×64×3 and ViT-like (``nnx.MultiHeadAttention``) on 32×32×3; all but the first
two with masks placed by ``masksembles_flax.nnx.insert``'s defaults. For batch sizes 1, 32, 256 (1 and 32 for the
Flax-examples-style modules but the ViT-like; medians of interleaved rounds, every ratio from the same run), each
function jitted with its variables as arguments:
(a) ``pack(model, program="packed")`` on the batch ÷ one forward of the same network without Masksembles;
(b) tiled dense ``predict(model, x, 4)`` ÷ the same;
(c) one ``extract_member`` model ÷ the same (latency and parameters);
and the program ``pack``'s default ``program="auto"`` chose on the batch, with the medians it chose by.
Next to each, the multiply-accumulate (MAC) ratio of its dot and convolution operations, counted on the jitted
program (padding included): the floor of the time ratio when both run at the same speed per MAC."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import flax
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from _report import interleaved_medians, machine, publish
from flax import nnx

import masksembles_flax as mf
import masksembles_flax._packing as packing_module
from masksembles_flax.nnx import Flatten, Masksembles, Residual, extract_member, insert, pack

N, SCALE = 4, 2.0
Layer = Callable[..., Any]


def mlp(masks: bool) -> nnx.Sequential:
    rngs = nnx.Rngs(0)
    layers: list[Layer] = [nnx.Linear(784, 1024, rngs=rngs), nnx.relu]
    for i in range(3):
        layers += [Masksembles(1024, N, SCALE, seed=i)] if masks else []
        layers += [nnx.Linear(1024, 1024, rngs=rngs), nnx.relu] if i < 2 else [nnx.Linear(1024, 10, rngs=rngs)]
    return nnx.Sequential(*layers)


def resnet(masks: bool) -> nnx.Sequential:
    rngs = nnx.Rngs(0)

    def conv_bn(inputs: int, outputs: int, strides: int = 1) -> list[Layer]:
        conv = nnx.Conv(inputs, outputs, (3, 3), strides=strides, use_bias=False, rngs=rngs)
        return [conv, nnx.BatchNorm(outputs, rngs=rngs)]

    def block(channels: int, seed: int) -> list[Layer]:
        middle = [Masksembles(channels, N, SCALE, seed=seed)] if masks else []
        return [Residual(*conv_bn(channels, channels), nnx.relu, *middle, *conv_bn(channels, channels)), nnx.relu]

    head = [Masksembles(128, N, SCALE, seed=2)] if masks else []
    return nnx.Sequential(
        *conv_bn(3, 64), nnx.relu, *block(64, 0), *conv_bn(64, 128, strides=2), nnx.relu, *block(128, 1),
        functools.partial(nnx.avg_pool, window_shape=(16, 16)), Flatten(), *head, nnx.Linear(128, 10, rngs=rngs),
    )  # fmt: skip


class TutorialCNN(nnx.Module):
    """A CNN as the Flax tutorial writes one: conv-BatchNorm-relu-avg_pool twice, a reshape, two Linear layers."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv1, self.bn1 = nnx.Conv(3, 64, (3, 3), rngs=rngs), nnx.BatchNorm(64, rngs=rngs)
        self.conv2, self.bn2 = nnx.Conv(64, 128, (3, 3), rngs=rngs), nnx.BatchNorm(128, rngs=rngs)
        self.linear1, self.linear2 = nnx.Linear(8 * 8 * 128, 256, rngs=rngs), nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.avg_pool(nnx.relu(self.bn1(self.conv1(x))), (2, 2), strides=(2, 2))
        x = nnx.avg_pool(nnx.relu(self.bn2(self.conv2(x))), (2, 2), strides=(2, 2))
        return self.linear2(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))


def cnn(masks: bool) -> nnx.Module:
    """Masks before conv2, linear1 and linear2 (insert leaves the first layer alone)."""
    model = TutorialCNN(nnx.Rngs(0))
    return insert(model, N, SCALE, seed=0) if masks else model


# --- Flax-examples-style models, masks placed by insert's defaults (widths unchanged) --------------------------


def conv_bn(
    inputs: int, outputs: int, kernel: int, rngs: nnx.Rngs, strides: int = 1, groups: int = 1
) -> nnx.Sequential:
    padding = [(kernel // 2, (kernel - 1) // 2)] * 2
    conv = nnx.Conv(inputs, outputs, (kernel, kernel), strides=strides, padding=padding,
                    feature_group_count=groups, use_bias=False, rngs=rngs)  # fmt: skip
    return nnx.Sequential(conv, nnx.BatchNorm(outputs, rngs=rngs))


class ResNetBlock(nnx.Module):
    """The Flax examples' ResNetBlock: conv-norm-relu-conv-norm, a 1x1 projection where the shape changes."""

    def __init__(self, inputs: int, filters: int, strides: int, rngs: nnx.Rngs) -> None:
        self.conv1, self.conv2 = conv_bn(inputs, filters, 3, rngs, strides), conv_bn(filters, filters, 3, rngs)
        changes = strides != 1 or inputs != filters
        self.projection = conv_bn(inputs, filters, 1, rngs, strides) if changes else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.conv2(nnx.relu(self.conv1(x)))
        return nnx.relu(y + (x if self.projection is None else self.projection(x)))


class ResNet18(nnx.Module):
    """The Flax examples' ResNet18 (imagenet/models.py): 7x7/2 stem, 3x3/2 max pool, stages of 2 blocks, mean pool."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.stem = conv_bn(3, 64, 7, rngs, strides=2)
        blocks, inputs = [], 64
        for stage, filters in enumerate((64, 128, 256, 512)):
            for i in range(2):
                blocks.append(ResNetBlock(inputs, filters, 2 if i == 0 and stage else 1, rngs))
                inputs = filters
        self.blocks, self.head = nnx.List(blocks), nnx.Linear(inputs, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.max_pool(nnx.relu(self.stem(x)), (3, 3), strides=(2, 2), padding="SAME")
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


class InvertedResidual(nnx.Module):
    """MobileNetV3 block: expand 1x1, depthwise kxk, squeeze-excite with a hard-sigmoid gate, project 1x1."""

    def __init__(self, inputs: int, expanded: int, outputs: int, kernel: int, strides: int, rngs: nnx.Rngs) -> None:
        self.expand = conv_bn(inputs, expanded, 1, rngs)
        self.depthwise = conv_bn(expanded, expanded, kernel, rngs, strides, groups=expanded)
        self.reduce = nnx.Conv(expanded, expanded // 4, (1, 1), rngs=rngs)
        self.gate = nnx.Conv(expanded // 4, expanded, (1, 1), rngs=rngs)
        self.project = conv_bn(expanded, outputs, 1, rngs)
        self.residual = strides == 1 and inputs == outputs

    def __call__(self, x: jax.Array) -> jax.Array:
        y = nnx.hard_swish(self.depthwise(nnx.hard_swish(self.expand(x))))
        y = y * nnx.hard_sigmoid(self.gate(nnx.relu(self.reduce(y.mean(axis=(1, 2), keepdims=True)))))
        y = self.project(y)
        return y + x if self.residual else y


class MobileNet(nnx.Module):
    """MobileNetV3-like (bench_packing.py's replica, channels-last)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        settings = [  # inputs, expanded, outputs, kernel, strides
            (16, 64, 24, 3, 2), (24, 72, 24, 3, 1), (24, 96, 40, 5, 2), (40, 240, 40, 5, 1), (40, 240, 48, 5, 1),
        ]  # fmt: skip
        self.stem = conv_bn(3, 16, 3, rngs, 2)
        self.blocks = nnx.List([InvertedResidual(*s, rngs=rngs) for s in settings])
        self.last = conv_bn(48, 288, 1, rngs)
        self.fc1, self.fc2 = nnx.Linear(288, 256, rngs=rngs), nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.hard_swish(self.stem(x))
        for block in self.blocks:
            x = block(x)
        x = nnx.hard_swish(self.last(x)).mean(axis=(1, 2))
        return self.fc2(nnx.hard_swish(self.fc1(x)))


class ConvNeXtBlock(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs) -> None:
        self.dwconv = nnx.Conv(dim, dim, (7, 7), padding=3, feature_group_count=dim, rngs=rngs)
        self.norm = nnx.LayerNorm(dim, epsilon=1e-6, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(dim, 4 * dim, rngs=rngs), nnx.Linear(4 * dim, dim, rngs=rngs)
        self.gamma = nnx.Param(jnp.full((dim,), 0.5))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.fc2(nnx.gelu(self.fc1(self.norm(self.dwconv(x))))) * self.gamma[...]


class ConvNeXt(nnx.Module):
    """ConvNeXt-like (bench_packing.py's replica, channels-last): 4x4/4 stem, stages of 2 blocks, 2x2/2 downsampling."""

    def __init__(self, rngs: nnx.Rngs, dims: tuple[int, ...] = (40, 80, 160)) -> None:
        self.stem = nnx.Conv(3, dims[0], (4, 4), strides=4, rngs=rngs)
        self.stem_norm = nnx.LayerNorm(dims[0], epsilon=1e-6, rngs=rngs)
        layers: list[Layer] = []
        for i, dim in enumerate(dims):
            if i:
                layers += [nnx.LayerNorm(dims[i - 1], epsilon=1e-6, rngs=rngs)]
                layers += [nnx.Conv(dims[i - 1], dim, (2, 2), strides=2, rngs=rngs)]
            layers += [ConvNeXtBlock(dim, rngs), ConvNeXtBlock(dim, rngs)]
        self.stages = nnx.Sequential(*layers)
        self.norm, self.head = nnx.LayerNorm(dims[-1], epsilon=1e-6, rngs=rngs), nnx.Linear(dims[-1], 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.stages(self.stem_norm(self.stem(x)))
        return self.head(self.norm(x.mean(axis=(1, 2))))


class ViTBlock(nnx.Module):
    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs) -> None:
        self.norm1, self.norm2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(dim, 4 * dim, rngs=rngs), nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x))
        return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))


class ViT(nnx.Module):
    """ViT-like (bench_packing.py's replica): 4x4 patches, dim 96, a class token, 4 blocks of nnx.MultiHeadAttention."""

    def __init__(self, rngs: nnx.Rngs, dim: int = 96, depth: int = 4, heads: int = 3) -> None:
        self.patch = nnx.Conv(3, dim, (4, 4), strides=4, rngs=rngs)
        self.cls = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, 1, dim)))
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, 65, dim)))
        self.blocks = nnx.List([ViTBlock(dim, heads, rngs) for _ in range(depth)])
        self.norm, self.head = nnx.LayerNorm(dim, rngs=rngs), nnx.Linear(dim, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.patch(x)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        cls = jnp.broadcast_to(self.cls[...], (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.pos[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def inserted(factory: Callable[[nnx.Rngs], nnx.Module]) -> Callable[[bool], nnx.Module]:
    """The model, with masks placed by ``insert``'s defaults when asked (the unmasked one has the same weights)."""

    def build(masks: bool) -> nnx.Module:
        model = factory(nnx.Rngs(0))
        return insert(model, N, SCALE, seed=0) if masks else model

    return build


def jitted(module: nnx.Module, call: Callable[[nnx.Module, jax.Array], Any]) -> Callable[[jax.Array], Any]:
    """``call(module, x)`` jitted with the module's variables as arguments."""
    graphdef, state = nnx.split(module)
    fn = jax.jit(lambda s, x: call(nnx.merge(graphdef, s), x))
    return lambda x: fn(state, x)


def macs(module: nnx.Module, call: Callable[[nnx.Module, jax.Array], Any], x: jax.Array) -> int:
    """Multiply-accumulates of the dot_general and conv_general_dilated operations of ``call(module, x)``, traced
    afresh (not from a jit cache) with the packed program's depthwise convolutions as convolutions (a scan's body,
    the chunks of a chunked program, counted once per iteration)."""

    def shape(var: Any) -> tuple[int, ...]:
        return tuple(var.aval.shape)

    def count(jaxpr: jex.Jaxpr) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            out = int(np.prod(shape(eqn.outvars[0])))
            if eqn.primitive.name == "dot_general":
                (contracting, _), _ = eqn.params["dimension_numbers"]
                lhs = shape(eqn.invars[0])
                total += out * int(np.prod([lhs[d] for d in contracting]))
            elif eqn.primitive.name == "conv_general_dilated":
                rhs = shape(eqn.invars[1])
                total += out * int(np.prod(rhs)) // rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
            repeats = int(eqn.params["length"]) if eqn.primitive.name == "scan" else 1  # a chunked program's loop
            total += repeats * sum(count(sub) for sub in jex.jaxprs_in_params(eqn.params))
        return total

    with mock.patch.object(packing_module, "_depthwise_as_sums", lambda: False):
        return count(jax.make_jaxpr(lambda v: call(module, v))(x).jaxpr)


def forward(module: nnx.Module, x: jax.Array) -> Any:
    return module(x)


def timed(fn: Callable[[jax.Array], Any], x: jax.Array) -> Callable[[], object]:
    return lambda: jax.block_until_ready(fn(x))


def parameters(module: nnx.Module) -> int:
    return sum(int(leaf.size) for leaf in jax.tree.leaves(nnx.state(module, nnx.Param)))


MODELS: dict[str, tuple[Callable[[bool], nnx.Module], tuple[int, ...], tuple[int, ...]]] = {
    "MLP": (mlp, (784,), (1, 32, 256)),
    "ResNet": (resnet, (32, 32, 3), (1, 32, 256)),
    "CNN module (insert)": (cnn, (32, 32, 3), (1, 32, 256)),
    "Flax examples ResNet-18 (insert)": (inserted(ResNet18), (128, 128, 3), (1, 32)),
    "MobileNetV3-like (insert)": (inserted(MobileNet), (64, 64, 3), (1, 32)),
    "ConvNeXt-like (insert)": (inserted(ConvNeXt), (64, 64, 3), (1, 32)),
    "ViT-like (insert)": (inserted(ViT), (32, 32, 3), (1, 32, 256)),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--models",
        type=lambda text: [name.strip() for name in text.split(",")],
        default=list(MODELS),
        help=f"comma-separated, from: {', '.join(MODELS)}",
    )
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    device = jax.devices()[0]
    lines = [
        f"## Packed inference, Flax NNX ({'CPU' if device.platform == 'cpu' else device.device_kind})",
        "",
        f"jax {jax.__version__}, flax {flax.__version__}, float32, N={N}, S={SCALE} at "
        f"fixed capacity (M·S = C); jitted functions with the variables as arguments, medians of {args.rounds} "
        f"interleaved rounds on {machine()}. Every ratio is ÷ one jitted forward of the same network without "
        "Masksembles on the same batch; in brackets, the MAC ratio of its dot/convolution operations: the bound on "
        "its time ratio when both run at the same speed per MAC (a small matmul or convolution runs slower per MAC, "
        "so a ratio can fall below it). The brackets count every dot, the one-hot products that move channels "
        "between layouts on feature maps included, and count the depthwise convolutions that the packed program "
        "runs as sums of shifted slices on CPU as the convolutions they compute. The MLP and the ResNet are "
        "`nnx.Sequential` stacks; the CNN module is a user's `nnx.Module` (the Flax tutorial's layout) with masks "
        "placed by `insert`; the last four are Flax-examples-style modules with masks placed by `insert`'s defaults "
        '(widths unchanged). `pack (s)`: the build of `pack(model, x, program="packed")`, verification included. '
        '`auto`: the program `pack(model, x)` (`program="auto"`) returned, and the medians of the packed and dense '
        "programs it timed on x in its interleaved rounds. On CPU a packed program proven to compute each sample "
        f"from that sample alone runs on chunks of the batch (`jax.lax.map`; {packing_module.CHUNK_SAMPLES} samples, "
        "more where their largest tensor, the members' together, is under "
        f"{packing_module.CHUNK_BYTES // 2**20} MiB); `chunk` gives the chunk's samples "
        "and packed ÷ the single model run on the same chunks, the like-for-like ratio (— where packed runs in one "
        "call). "
        "Targets: packed within 1.3× of its MAC ratio and ≤ 1.5× for the MLP; tiled predict ≈ N×.",
        "",
        "| model | batch | single (ms) | (a) packed ÷ single [MACs] | chunk: packed ÷ single in those chunks "
        "| (b) tiled predict ÷ single [MACs] | (c) one member ÷ single [MACs] | member params ÷ full | pack (s) "
        "| auto: program (packed / dense ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in args.models:
        factory, shape, batches = MODELS[name]
        masked, single = factory(True), factory(False)
        masked.eval()
        single.eval()
        for batch in batches:
            x = jax.random.normal(jax.random.key(batch), (batch, *shape))
            member = extract_member(masked, 0, x)
            start = time.perf_counter()
            packed = pack(masked, x, program="packed")
            build = time.perf_counter() - start
            auto = pack(masked, x)
            timed_ms = " / ".join(
                f"{auto.seconds[key] * 1e3:.3g}" for key in ("packed", "dense") if key in auto.seconds
            )
            calls: dict[str, tuple[nnx.Module, Callable[[nnx.Module, jax.Array], Any]]] = {
                "single": (single, forward),
                "packed": (packed, forward),
                "tiled": (masked, lambda m, v: mf.predict(m, v, N)),
                "member": (member, forward),
            }
            chunk = packed.chunk(batch)
            if chunk:  # the single model on the same chunks of the batch as the packed program
                calls["chunked"] = (single, lambda m, v, c=chunk: packing_module.in_chunks(m, v, c, 0))
            fns = {key: timed(jitted(module, call), x) for key, (module, call) in calls.items()}
            medians = interleaved_medians(fns, rounds=args.rounds)
            ratio = {key: medians[key] / medians["single"] for key in medians}
            mac = {key: macs(module, call, x) for key, (module, call) in calls.items() if key != "chunked"}
            mac_ratio = {key: mac[key] / mac["single"] for key in mac}
            chunked = f"{chunk}: {medians['packed'] / medians['chunked']:.2f}×" if chunk else "—"
            row = (
                f"| {name} | {batch} | {medians['single'] * 1e3:.3f} "
                f"| {ratio['packed']:.2f}× [{mac_ratio['packed']:.2f}×] "
                f"| {chunked} "
                f"| {ratio['tiled']:.2f}× [{mac_ratio['tiled']:.2f}×] "
                f"| {ratio['member']:.2f}× [{mac_ratio['member']:.2f}×] "
                f"| {parameters(member) / parameters(single):.2f}× | {build:.1f} "
                f"| {auto.program} ({timed_ms or 'not timed'}) |"
            )
            lines.append(row)
            print(row, flush=True)
    text = "\n".join(lines)
    publish("packing-flax", text, write=not args.no_write)


if __name__ == "__main__":
    main()
