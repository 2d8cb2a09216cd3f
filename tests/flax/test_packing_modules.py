"""pack/extract_member on NNX modules written the usual way and on single code patterns: compacted or run at full
width, the result equals ``predict``'s; "zero stays zero" is evaluated per operation and operand; what falls back is
reported; only a model JAX cannot trace is refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import masksembles_flax as mf
import masksembles_flax._packing as packing_module
from masksembles_core.packing import VERIFICATION
from masksembles_flax._capture import Capture
from masksembles_flax.nnx import Masksembles, extract_member, insert, pack
from tests.batch_clock import BatchClock
from tests.flax.test_packing import conv, linear, mlp, numpy_init, random_input, relative_error

N = 4


def randomized(model: nnx.Module, seed: int = 0) -> nnx.Module:
    """Random running statistics, scales and biases in every norm (not the 1/0 they start at), then eval mode."""
    rng = np.random.default_rng(seed)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            module.mean.set_value(jnp.asarray(rng.normal(size=module.mean.shape), jnp.float32))
            module.var.set_value(jnp.asarray(rng.uniform(0.5, 1.5, size=module.var.shape), jnp.float32))
        if isinstance(module, nnx.BatchNorm | nnx.LayerNorm | nnx.GroupNorm):
            for variable in (module.scale, module.bias):
                if variable is not None:
                    variable.set_value(jnp.asarray(rng.normal(size=variable.shape), jnp.float32))
    model.eval()
    return model


@nnx.jit
def outputs(model: nnx.Module, packed: nnx.Module, members: list[nnx.Module], x: jax.Array) -> tuple[Any, Any, Any]:
    """One compilation for pack(x), predict(model, x, N) and every extracted member on x."""
    return packed(x), mf.predict(model, x, N), [member(x) for member in members]


def assert_packs(model: nnx.Module, x: jax.Array, *, members: bool = True) -> None:
    """pack (from an example of another batch size) equals predict on x; extract_member(k) equals member k."""
    packed = pack(model, x[:3], program="packed")
    extracted = [extract_member(model, k, x) for k in range(N)] if members else []
    assert packed.program == "packed" and packed.seconds == {}
    assert all(single.program == "packed" for single in extracted)
    actual, expected, singles = outputs(model, packed, extracted, x)
    for got, wanted in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert got.shape == wanted.shape and relative_error(got, wanted) <= 1e-5
    for k, single in enumerate(singles):
        for got, wanted in zip(jax.tree.leaves(single), jax.tree.leaves(expected), strict=True):
            assert relative_error(got, wanted[k]) <= 1e-5


# --- modules written the usual NNX way -------------------------------------------------------------------------


class CNN(nnx.Module):
    """The Flax tutorial's CNN shape: conv-BatchNorm-relu-avg_pool twice, reshape, an MLP."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv1, self.bn1 = conv(3, 8, (3, 3), rngs), nnx.BatchNorm(8, rngs=rngs)
        self.conv2, self.bn2 = conv(8, 12, (3, 3), rngs), nnx.BatchNorm(12, rngs=rngs)
        self.linear1, self.linear2 = linear(12 * 2 * 2, 16, rngs), linear(16, 3, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.avg_pool(nnx.relu(self.bn1(self.conv1(x))), (2, 2), strides=(2, 2))
        x = nnx.avg_pool(nnx.relu(self.bn2(self.conv2(x))), (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


class MaskedByHand(nnx.Module):
    """Masksembles layers called in __call__, a Dropout and a masked flattened feature map."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv, self.masks1 = conv(3, 8, (3, 3), rngs, padding="VALID"), Masksembles(8, N, 2.0, seed=1)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.masks2, self.linear = Masksembles(8 * 4 * 4, N, 2.0, seed=2), linear(8 * 4 * 4, 3, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.dropout(self.masks1(nnx.silu(self.conv(x))))
        return self.linear(self.masks2(x.reshape(x.shape[0], -1)))


class Block(nnx.Module):
    """A ResNet basic block, with a strided 1x1 projection on the shortcut when the shape changes."""

    def __init__(self, features_in: int, features: int, strides: int, rngs: nnx.Rngs) -> None:
        self.conv1 = conv(features_in, features, (3, 3), rngs, strides=strides)
        self.bn1 = nnx.BatchNorm(features, rngs=rngs)
        self.conv2, self.bn2 = conv(features, features, (3, 3), rngs), nnx.BatchNorm(features, rngs=rngs)
        changes = strides != 1 or features_in != features
        self.projection = conv(features_in, features, (1, 1), rngs, strides=strides) if changes else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.bn2(self.conv2(nnx.relu(self.bn1(self.conv1(x)))))
        return nnx.relu(y + (x if self.projection is None else self.projection(x)))


class ResNet(nnx.Module):
    """A stem, a list of blocks, a global mean pool and a head."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.stem = conv(3, 8, (3, 3), rngs)
        self.blocks = nnx.List([Block(8, 8, 1, rngs), Block(8, 12, 2, rngs)])
        self.head = linear(12, 5, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


class Lambdas(nnx.Module):
    """A lambda attribute as the activation, scalar arithmetic and a reshape that merges two axes."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.fc1, self.masks = linear(6, 16, rngs), Masksembles(16, N, 2.0, seed=0)
        self.act = lambda x: jnp.maximum(x, 0.1 * x)
        self.fc2 = linear(16 * 2, 4, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.act(self.masks(self.fc1(x)))
        return self.fc2((y * 0.5 + 1.0).reshape(x.shape[0], -1))


class Mixer(nnx.Module):
    """An MLP-Mixer: patches, token mixing on the transposed tokens, channel mixing, LayerNorms, a mean-pooled head."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.patch = conv(3, 8, (2, 2), rngs, strides=2)
        self.norm1, self.token1, self.token2 = nnx.LayerNorm(8, rngs=rngs), linear(16, 16, rngs), linear(16, 16, rngs)
        self.norm2, self.channel1, self.channel2 = nnx.LayerNorm(8, rngs=rngs), linear(8, 16, rngs), linear(16, 8, rngs)
        self.norm, self.head = nnx.LayerNorm(8, rngs=rngs), linear(8, 3, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.patch(x)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        y = jnp.swapaxes(self.norm1(x), 1, 2)
        x = x + jnp.swapaxes(self.token2(nnx.gelu(self.token1(y))), 1, 2)
        x = x + self.channel2(nnx.gelu(self.channel1(self.norm2(x))))
        return self.head(self.norm(x).mean(axis=1))


class Attention(nnx.Module):
    """Attention written out: one qkv projection split by reshape, einsum scores, softmax, an output projection."""

    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs) -> None:
        self.heads, self.qkv, self.proj = heads, linear(dim, 3 * dim, rngs), linear(dim, dim, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, length, c = x.shape
        qkv = self.qkv(x).reshape(b, length, 3, self.heads, c // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(c // self.heads), axis=-1)
        return self.proj(jnp.einsum("bhqk,bkhd->bqhd", scores, v).reshape(b, length, c))


class ViT(nnx.Module):
    """Patch embedding, a class token broadcast to the batch, position embeddings, one pre-norm block (attention and
    a GELU MLP), the class token's head."""

    def __init__(self, rngs: nnx.Rngs, *, written_out: bool = False) -> None:
        dim = 16
        self.patch = conv(3, dim, (2, 2), rngs, strides=2)
        self.cls = nnx.Param(numpy_init(rngs.params(), (1, 1, dim)))
        self.pos = nnx.Param(numpy_init(rngs.params(), (1, 17, dim)))
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attention = (
            Attention(dim, 4, rngs)
            if written_out
            else nnx.MultiHeadAttention(num_heads=4, in_features=dim, decode=False, rngs=rngs)
        )
        self.norm2, self.fc1, self.fc2 = nnx.LayerNorm(dim, rngs=rngs), linear(dim, 32, rngs), linear(32, dim, rngs)
        self.norm, self.head = nnx.LayerNorm(dim, rngs=rngs), linear(dim, 3, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.patch(x)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        cls = jnp.broadcast_to(self.cls[...], (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.pos[...]
        x = x + self.attention(self.norm1(x))
        x = x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))
        return self.head(self.norm(x)[:, 0])


def inserted(factory: Callable[[nnx.Rngs], nnx.Module]) -> Callable[[], nnx.Module]:
    return lambda: insert(factory(nnx.Rngs(0)), N, 2.0, seed=0)


MODULES: dict[str, tuple[Callable[[], nnx.Module], tuple[int, ...]]] = {
    "cnn": (inserted(CNN), (8, 8, 3)),
    "masked-by-hand": (lambda: MaskedByHand(nnx.Rngs(0)), (6, 6, 3)),
    "resnet-list-of-blocks": (inserted(ResNet), (6, 6, 3)),
    "lambda-and-reshape": (lambda: Lambdas(nnx.Rngs(0)), (2, 6)),
    "mlp-mixer": (inserted(Mixer), (8, 8, 3)),
    "vit-multi-head-attention": (inserted(ViT), (8, 8, 3)),
    "vit-attention-written-out": (inserted(lambda rngs: ViT(rngs, written_out=True)), (8, 8, 3)),
}


# a batch that n divides and one it does not: the same programs for pack (predict tiles any batch), so the first is a
# near-duplicate, slow (the ViTs take 15-20 s each)
@pytest.mark.parametrize("batch", [pytest.param(4, marks=pytest.mark.slow), 5], ids=["batch4", "batch5"])
@pytest.mark.parametrize("name", list(MODULES))
def test_modules_pack_equal_to_predict(name: str, batch: int) -> None:
    factory, shape = MODULES[name]
    assert_packs(randomized(factory()), random_input((batch, *shape), batch))


def test_an_example_of_batch_one_packs_a_model_that_jax_simplifies_there() -> None:
    """At batch 1 JAX drops the ViT's broadcast of its class token to the batch, so its program differs from batch
    2's: the capture traces it from batch 2, and the program, verified at the example's batch of 1, runs any batch."""
    model = randomized(inserted(ViT)())
    x = random_input((3, 8, 8, 3), 3)
    assert Capture(model, x[:1]).program.batch == 2 and Capture(model, x[:2]).program.batch == 2
    assert Capture(randomized(inserted(CNN)()), x[:1]).program.batch == 1  # one program from batch 1: traced there
    packed = pack(model, x[:1], program="packed")
    assert packed.program == "packed" and not any(f.startswith(VERIFICATION) for f in packed.fallbacks)
    for batch in (1, 3):
        actual, expected, _ = outputs(model, packed, [], x[:batch])
        assert actual.shape == expected.shape and relative_error(actual, expected) <= 1e-5


DENSE_MODELS = {
    "cnn": MODULES["cnn"],
    "resnet-list-of-blocks": MODULES["resnet-list-of-blocks"],
    "mlp": (lambda: mlp(2.0, 0, nnx.Rngs(0)), (12,)),
}


@pytest.mark.parametrize("batch", [4, 5], ids=["batch4", "batch5"])
@pytest.mark.parametrize("name", list(DENSE_MODELS))
def test_dense_program_is_the_tiled_model(name: str, batch: int) -> None:
    """program="dense": every operation at full width on the member-stacked batch, no compacted weight."""
    factory, shape = DENSE_MODELS[name]
    model = randomized(factory())
    x = random_input((batch, *shape), batch)
    dense = pack(model, x[:3], program="dense")
    assert dense.program == "dense" and dense.seconds == {} and len(dense.weights) == 0
    assert "program=dense" in repr(dense) and "program=dense (" not in repr(dense), "no reason given"
    actual, expected, _ = outputs(model, dense, [], x)
    assert actual.shape == expected.shape and relative_error(actual, expected) <= 1e-5


def test_auto_times_on_eight_samples_where_rounds_on_the_example_do_not_fit_in_twice_the_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A clock that moves only while a timed call runs (a build of no time, so no time is left for timing): both
    programs run on 8 of the 32 samples, a warm-up round that compiles them and one counted round (a compiling call
    never decides), and the program kept equals predict on all 32."""
    clock = BatchClock(packing_module._timed, len)
    monkeypatch.setattr(packing_module, "clock", clock)
    monkeypatch.setattr(packing_module, "_timed", clock.timed)
    model = randomized(inserted(CNN)())
    x = random_input((32, 8, 8, 3), 0)
    packed = pack(model, x)
    assert clock.sizes == [8] * 4 and "median times over 1 interleaved rounds" in packed.choice
    assert packed.choice.endswith("; timed on 8 of the example's 32 samples to build in time")
    actual, expected, _ = outputs(model, packed, [], x)
    assert relative_error(actual, expected) <= 1e-5


def test_auto_reports_the_program_it_chose() -> None:
    """``auto`` times both programs and keeps the packed one unless the dense one is clearly faster
    (``masksembles_core.packing.timed_choice``, tested on its own in the core); ``choice`` says which and why."""
    model = randomized(inserted(CNN)())
    x = random_input((2, 8, 8, 3), 0)
    for example in (x, jax.ShapeDtypeStruct(x.shape, x.dtype)):  # a ShapeDtypeStruct is timed on normal values
        packed = pack(model, example)
        assert set(packed.seconds) == {"packed", "dense"} and all(t > 0 for t in packed.seconds.values())
        assert packed.choice.startswith(packed.program)
        figures = ", ".join(f"{name} {packed.seconds[name] * 1e3:.3g} ms" for name in ("packed", "dense"))
        assert f"program={packed.program} ({packed.choice}; measured {figures})" in repr(packed)
        actual, expected, _ = outputs(model, packed, [], x)
        assert relative_error(actual, expected) <= 1e-5
    with pytest.raises(ValueError, match=r"program must be one of \('auto', 'packed', 'dense'\); received 'fast'"):
        pack(model, x, program="fast")


# --- single patterns between two Masksembles layers ---------------------------------------------------------------


class Between(nnx.Module):
    """conv -> masks -> pattern(x) -> masks -> conv head: the pattern sits between two masked layers."""

    def __init__(self, pattern: Callable[..., Any]) -> None:
        rngs = nnx.Rngs(0)
        self.stem, self.masks1 = conv(3, 12, (3, 3), rngs), Masksembles(12, N, 2.0, seed=1)
        self.pattern = pattern
        self.masks2, self.head = Masksembles(12, N, 2.0, seed=2), conv(12, 5, (1, 1), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.masks2(self.pattern(self.masks1(self.stem(x)))))


class SqueezeExcite(nnx.Module):
    def __init__(self, channels: int) -> None:
        rngs = nnx.Rngs(1)
        self.reduce, self.expand = conv(channels, 4, (1, 1), rngs), conv(4, channels, (1, 1), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        s = x.mean(axis=(1, 2), keepdims=True)
        return x * nnx.sigmoid(self.expand(nnx.relu(self.reduce(s))))


class ChannelConcat(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(2)
        self.a, self.b = conv(12, 6, (1, 1), rngs), conv(12, 6, (3, 3), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.concatenate([nnx.relu(self.a(x)), self.b(x)], axis=-1)


def depthwise(bias: bool, groups: int = 12, features: int = 12) -> nnx.Conv:
    return conv(12, features, (3, 3), nnx.Rngs(3), feature_group_count=groups, use_bias=bias)


def strided_depthwise() -> nnx.Conv:
    """A depthwise convolution with strides, kernel dilation and uneven padding, one axis of each size."""
    options: dict[str, Any] = {"strides": (2, 1), "kernel_dilation": (2, 3), "padding": ((2, 1), (0, 2))}
    return conv(12, 12, (3, 2), nnx.Rngs(3), feature_group_count=12, **options)


PATTERNS: dict[str, Callable[[], Callable[..., Any]]] = {
    "depthwise-conv": lambda: depthwise(False),
    "depthwise-conv-bias": lambda: depthwise(True),
    "grouped-conv": lambda: depthwise(True, groups=3),
    "depthwise-multiplier": lambda: nnx.Sequential(depthwise(True, features=24), conv(24, 12, (1, 1), nnx.Rngs(4))),
    "depthwise-strided-dilated": lambda: strided_depthwise(),
    "squeeze-excite": lambda: SqueezeExcite(12),
    "channel-concat": ChannelConcat,
    "layernorm": lambda: nnx.LayerNorm(12, rngs=nnx.Rngs(0)),
    "groupnorm": lambda: nnx.GroupNorm(12, num_groups=3, rngs=nnx.Rngs(0)),
    "clip-away-from-zero": lambda: lambda x: jnp.clip(x, 0.1, 1.0),
    "leaky-relu-select": lambda: nnx.leaky_relu,
    "elu": lambda: nnx.elu,
    "hard-tanh": lambda: jax.nn.hard_tanh,
    "scalar-add": lambda: lambda x: x + 3.0,
    "per-channel-constant": lambda: lambda x: x * jnp.arange(12.0) - jnp.arange(12.0) % 3,
    "max-pool-same": lambda: lambda x: nnx.max_pool(x, (3, 3), padding="SAME"),
    "channels-first-roundtrip": lambda: lambda x: jnp.transpose(nnx.relu(jnp.transpose(x, (0, 3, 1, 2))), (0, 2, 3, 1)),
    "cumulative-over-width": lambda: lambda x: jnp.cumsum(x, axis=2),
    "cumulative-over-channels": lambda: lambda x: jnp.cumsum(x, axis=-1),
    "sort-channels": lambda: lambda x: jnp.sort(x, axis=-1),
    "masks-on-another-axis": lambda: Masksembles(6, N, 2.0, seed=5, channel_axis=1),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_packs_equal_to_predict(name: str) -> None:
    model = randomized(Between(PATTERNS[name]()))
    assert_packs(model, random_input((5, 6, 6, 3), 1))


def test_channel_moves_are_one_hot_products_on_feature_maps_and_gathers_on_token_sequences() -> None:
    """(B, H, W, C) feature maps: a matmul with a one-hot constant; (B, L, C) tokens: a gather XLA fuses."""
    x = random_input((3, 8, 8, 3), 2)
    cnn, vit = (pack(randomized(factory()), x, program="packed") for factory in (inserted(CNN), inserted(ViT)))
    assert any(key.startswith("move_") for key in cnn.constants)  # the masks before conv2
    assert not any(key.startswith("move_") for key in vit.constants)  # the masks before fc1 and fc2
    assert " gather[" in str(jax.make_jaxpr(vit)(x))


def test_depthwise_convolutions_run_as_sums_of_shifted_slices_on_cpu() -> None:
    model = randomized(Between(PATTERNS["depthwise-strided-dilated"]()))
    x = random_input((5, 6, 6, 3), 1)
    packed = pack(model, x, program="packed")
    groups = [
        e.params["feature_group_count"] for e in jax.make_jaxpr(packed)(x).jaxpr.eqns if "conv" in e.primitive.name
    ]
    assert groups == [1] * (1 + N), "the stem once and the head per member; the depthwise convolutions as sums"


# --- randomly built modules -----------------------------------------------------------------------------------------


class Residual2(nnx.Module):
    """x + conv(masks(act(conv(x))))."""

    def __init__(self, channels: int, act: Callable[..., Any], seed: int, rngs: nnx.Rngs) -> None:
        self.conv1, self.conv2 = conv(channels, channels, (3, 3), rngs), conv(channels, channels, (1, 1), rngs)
        self.act, self.masks = act, Masksembles(channels, N, 2.0, seed=seed)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.conv2(self.masks(self.act(self.conv1(x))))


class Concat2(nnx.Module):
    """Two branches concatenated on the channels."""

    def __init__(self, channels: int, act: Callable[..., Any], rngs: nnx.Rngs) -> None:
        self.a, self.b, self.act = conv(channels, 3, (1, 1), rngs), conv(channels, 5, (3, 3), rngs), act

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.concatenate([self.act(self.a(x)), self.b(x)], axis=-1)


ACTIVATIONS: list[Callable[..., Any]] = [
    nnx.relu,
    nnx.gelu,
    jnp.tanh,
    nnx.sigmoid,
    nnx.leaky_relu,
    nnx.elu,
    nnx.silu,
    lambda x: jnp.clip(x, -0.5, 2.0),
]


class RandomNet(nnx.Module):
    """Random blocks (conv-BatchNorm-activation-masks in random order, residual and concatenating blocks, depthwise
    convolutions, squeeze-excitation, LayerNorm, pools, transposes, per-channel arithmetic), a mean pool, a head."""

    def __init__(self, seed: int) -> None:
        rng, rngs = np.random.default_rng(seed), nnx.Rngs(seed)
        seeds = iter(range(100 * seed, 100 * seed + 100))

        def act() -> Callable[..., Any]:
            return ACTIVATIONS[int(rng.integers(len(ACTIVATIONS)))]

        channels, layers = 3, []
        for _ in range(int(rng.integers(3, 6))):
            choice = int(rng.integers(9))
            if choice <= 1 or channels == 3:
                out = int(rng.integers(6, 13))
                after = [nnx.BatchNorm(out, rngs=rngs), act(), Masksembles(out, N, 2.0, seed=next(seeds))]
                layers += [conv(channels, out, (3, 3), rngs), *(after[i] for i in rng.permutation(3))]
                channels = out
            elif choice == 2:
                layers.append(Residual2(channels, act(), next(seeds), rngs))
            elif choice == 3:
                layers += [Concat2(channels, act(), rngs), Masksembles(8, N, 2.0, seed=next(seeds))]
                channels = 8
            elif choice == 4:
                layers += [conv(channels, channels, (3, 3), rngs, feature_group_count=channels), act()]
            elif choice == 5:
                layers.append(SqueezeExcite(channels))
            elif choice == 6:
                layers.append(nnx.LayerNorm(channels, rngs=rngs))
            elif choice == 7:
                layers.append(
                    lambda x: jnp.transpose(
                        nnx.max_pool(jnp.transpose(x, (0, 2, 1, 3)), (2, 2), padding="SAME"), (0, 2, 1, 3)
                    )
                )
            else:
                scale = jnp.asarray(rng.normal(size=channels) * (rng.random(channels) < 0.5), jnp.float32)
                layers.append(lambda x, scale=scale: x * scale + scale)
        self.layers = nnx.List(layers)
        self.masks, self.head = Masksembles(channels, N, 2.0, seed=next(seeds)), linear(channels, 3, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.masks(x.mean(axis=(1, 2))))


@pytest.mark.parametrize("seed", range(6), ids=lambda seed: f"seed{seed}")
def test_randomly_built_modules(seed: int) -> None:
    assert_packs(randomized(RandomNet(seed), seed), random_input((5, 6, 6, 3), seed))


class BatchMixing(nnx.Module):
    """Operations that read the batch: a sum over it, and an index over it (both differ on the tiled batch)."""

    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.stem, self.fc = linear(4, 8, rngs), linear(8, 8, rngs)
        self.masks1, self.masks2 = Masksembles(8, N, 2.0, seed=1), Masksembles(8, N, 2.0, seed=2)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.stem(x)
        h = h - h.sum(axis=0) / 8.0  # shared input: the tiled batch sums every sample n times
        h = self.fc(self.masks1(h)) + jnp.arange(x.shape[0], dtype=jnp.float32)[:, None]
        return self.masks2(h - h.mean(axis=0))


def test_operations_that_read_the_batch_run_on_the_member_stacked_batch() -> None:
    """pack reproduces predict's tiled batch. A member alone would see one member's copy of it, so extract_member
    computes every member, as predict does, and returns member k's output."""
    model = BatchMixing()
    for batch in (4, 5):
        x = random_input((batch, 4), batch)
        assert_packs(model, x, members=False)
        expected = mf.predict(model, x, N)
        for k in range(N):
            member = extract_member(model, k, x)
            assert member.program == "packed" and member.members == (k,)
            assert relative_error(member(x), expected[k]) <= 1e-5


@pytest.mark.parametrize("name", ["cnn", "vit-multi-head-attention"])
def test_per_sample_programs_run_on_chunks_of_the_batch(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """On CPU a program proven to compute each sample from that sample alone runs on chunks of the batch
    (``jax.lax.map``, then the rest in one call): packed, dense and extracted ones equal predict at any batch (the
    ViT's class token broadcast to each chunk's size)."""
    monkeypatch.setattr(packing_module, "samples_per_chunk", lambda batch, size, limit: 2)  # the size: in the core
    factory, shape = MODULES[name]
    model = randomized(factory())
    x = random_input((5, *shape), 5)
    packed, dense = pack(model, x[:3], program="packed"), pack(model, x[:3], program="dense")
    member = extract_member(model, 1, x[:3])
    assert packed.chunk(5) == dense.chunk(5) == member.chunk(5) == 2
    assert "per-sample: in chunks of the batch" in repr(packed) and "in chunks of the batch)" in repr(dense)
    for batch in (4, 5):  # two chunks; two chunks and a rest
        actual, expected, singles = outputs(model, packed, [dense, member], x[:batch])
        assert actual.shape == expected.shape and relative_error(actual, expected) <= 1e-5
        assert relative_error(singles[0], expected) <= 1e-5 and relative_error(singles[1], expected[1]) <= 1e-5
    scan = [e for e in jax.make_jaxpr(packed)(x).jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scan] == [2], "two chunks of 2 in one loop, the fifth sample after it"


def test_chunks_hold_chunk_samples_or_more_where_samples_are_small() -> None:
    """Chunks of ``CHUNK_SAMPLES`` samples where that many samples' largest tensor is over ``CHUNK_BYTES``, of about
    ``CHUNK_BYTES`` where it is under (an MLP's rows); one call for a batch within one chunk."""
    factory, shape = MODULES["cnn"]
    packed = pack(randomized(factory()), random_input((2, *shape), 2), program="packed")
    samples, limit = packing_module.CHUNK_SAMPLES, packing_module.CHUNK_BYTES
    assert (samples, limit) == (16, 4 * 2**20)  # the figures below

    def chunk(sample_bytes: int, batch: int) -> int:
        packed.plan = dataclasses.replace(packed.plan, sample_bytes=sample_bytes)
        return packed.chunk(batch)

    large = limit // 2  # CHUNK_SAMPLES samples: 8x CHUNK_BYTES
    assert chunk(large, 1) == chunk(large, samples) == 0
    assert chunk(large, 2 * samples) == chunk(large, 256) == samples
    assert chunk(large, 34) == 12  # 68 MiB in chunks of up to 32: three of 12 (two in the loop, 10 after)
    small = limit // (4 * samples)  # CHUNK_SAMPLES samples: a quarter of CHUNK_BYTES
    assert chunk(small, 4 * samples) == 0 and chunk(small, 16 * samples) == 4 * samples
    assert chunk(0, 256) == 0  # not proven per-sample, or not on CPU


def test_programs_that_read_the_batch_run_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention (``nnx.MultiHeadAttention``) keeps samples apart (the ViTs' class token broadcast to
    the batch included); a sum over the batch, an index over it do not: their program never runs on chunks."""
    monkeypatch.setattr(packing_module, "samples_per_chunk", lambda batch, size, limit: 2)
    x = random_input((3, 8, 8, 3), 0)
    assert Capture(randomized(inserted(ViT)()), x).per_sample()
    mixing = random_input((5, 4), 5)
    assert not Capture(BatchMixing(), mixing).per_sample()
    assert pack(BatchMixing(), mixing, program="packed").chunk(5) == 0


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear, self.masks = nnx.Linear(8, 8, rngs=rngs), Masksembles(8, N, 2.0, seed=4)  # under nnx.vmap

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + nnx.relu(self.linear(self.masks(x)))


class Loops(nnx.Module):
    """Layers stacked by nnx.vmap and run by nnx.scan (Masksembles inside the scanned body), a fori_loop and a
    cond on the masked activations: sub-programs whose shapes follow the batch."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs: nnx.Rngs) -> Layer:
            return Layer(rngs)

        self.layers, self.stem, self.head = stack(rngs), linear(4, 8, rngs), linear(8, 3, rngs)
        self.masks, self.flag = Masksembles(8, N, 2.0, seed=5), nnx.Param(jnp.ones(()))

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h: jax.Array, layer: Layer) -> jax.Array:
            return layer(h)

        h = self.masks(body(self.stem(x), self.layers))
        h = jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h) + 0.1 * h, h)
        h = jax.lax.cond(self.flag[...] > 0, jnp.sin, lambda h: 2.0 * h, h)
        return self.head(h)


def test_loops_and_branches_run_on_the_member_stacked_batch() -> None:
    """Their bodies are rebuilt for each batch size; Masksembles layers inside use the extracted member's masks."""
    model = Loops(nnx.Rngs(0))
    packed = pack(model, random_input((2, 4), 0), program="packed")
    assert {where.split(" ")[0] for where in packed.fallbacks} == {"scan", "cond"}
    assert_packs(model, random_input((5, 4), 1))


class TwoOutputs(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.linear, self.masks, self.out = linear(4, 8, rngs), Masksembles(8, N, 2.0, seed=3), linear(8, 2, rngs)

    def __call__(self, x: jax.Array) -> dict[str, jax.Array]:
        h = self.masks(jnp.tanh(self.linear(x)))
        return {"logits": self.out(h), "features": h, "norm": (h * h).sum(-1)}


def test_every_output_leaf_is_per_member() -> None:
    assert_packs(TwoOutputs(), random_input((5, 4), 0))


class Tokens(nnx.Module):
    """Token ids through an embedding (a gather: it runs at full width), a token-wise MLP, the ids passed through."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed, self.fc1, self.fc2 = nnx.Embed(20, 8, rngs=rngs), linear(8, 16, rngs), linear(16, 3, rngs)

    def __call__(self, ids: jax.Array) -> dict[str, jax.Array]:
        h = nnx.relu(self.fc1(self.embed(ids))).mean(axis=1)
        return {"logits": self.fc2(h), "ids": ids}


def test_token_ids_and_an_input_passed_through() -> None:
    model = insert(Tokens(nnx.Rngs(0)), N, 2.0, seed=0, include_first=True)
    assert_packs(model, jnp.asarray(np.random.default_rng(0).integers(0, 20, size=(5, 7))))
    assert [where.split(" ")[0] for where in pack(model, jnp.zeros((2, 7), jnp.int32), program="packed").fallbacks] == [
        "gather"
    ]


# --- what is compacted, and what is reported ----------------------------------------------------------------------


def head_kernel(model: nnx.Module, x: jax.Array, outputs: int, k: int = 0) -> tuple[int, ...]:
    """The kernel shape of member k's last Linear (the one with ``outputs`` outputs)."""
    (shape,) = [
        p.shape for p in jax.tree.leaves(nnx.state(extract_member(model, k, x), nnx.Param)) if p.shape[-1] == outputs
    ]
    return tuple(shape)


@pytest.mark.parametrize(
    "activation,compacted",
    [
        (lambda x: jnp.clip(x, 0.1, 1.0), False),
        (lambda x: jnp.clip(x, -1.0, 1.0), True),
        (lambda x: x + jnp.where(jnp.arange(16) < 8, 0.0, 1.0), None),
        (nnx.leaky_relu, True),
    ],
    ids=["clip-0.1-maps-zero-away", "clip-minus-one-keeps-zero", "constant-zero-on-half", "leaky-relu-select"],
)
def test_zero_preservation_is_evaluated_with_the_operands(
    activation: Callable[..., Any], compacted: bool | None
) -> None:
    """clip(x, 0.1, 1) maps 0 to 0.1: the next layer reads every channel; clip(-1, 1) and leaky_relu (a select whose
    predicate is True at 0) keep zeros: it reads the member's channels; adding a constant that is 0 on channels 0-7
    keeps those."""
    rngs = nnx.Rngs(0)
    masks = Masksembles(16, N, 2.0, seed=0)
    model = nnx.Sequential(linear(6, 16, rngs), masks, activation, linear(16, 3, rngs))
    x = random_input((5, 6), 0)
    live = np.asarray(masks.masks[...])[0]
    expected = {True: int(live.sum()), False: 16, None: int((live | (np.arange(16) >= 8)).sum())}[compacted]
    assert head_kernel(model, x, 3) == (expected, 3)
    assert relative_error(extract_member(model, 0, x)(x), mf.predict(model, x, N)[0]) <= 1e-6


def test_fallbacks_are_reported_and_plain_models_have_none() -> None:
    vit = randomized(inserted(ViT)())
    packed = pack(vit, random_input((2, 8, 8, 3), 0), program="packed")
    assert any("normalization.py" in where and where.startswith("reduce_sum at") for where in packed.fallbacks)
    assert len(set(packed.fallbacks)) == len(packed.fallbacks), "each place once"
    assert pack(randomized(inserted(CNN)()), random_input((2, 8, 8, 3), 0), program="packed").fallbacks == ()


def test_an_untraceable_model_is_the_only_refusal() -> None:
    class Branchy(nnx.Module):
        def __init__(self) -> None:
            self.linear, self.masks = linear(4, 8, nnx.Rngs(0)), Masksembles(8, N, 2.0, seed=0)

        def __call__(self, x: jax.Array) -> jax.Array:
            y = self.masks(self.linear(x))
            return y if y.sum() > 0 else -y

    with pytest.raises(ValueError, match=r"need a model JAX can trace in eval mode \(no Python control flow"):
        pack(Branchy(), jnp.ones((2, 4)))


def test_the_packed_module_jits_and_traces_once_per_batch_size() -> None:
    model = randomized(inserted(ResNet)())
    packed = pack(model, random_input((2, 6, 6, 3), 0), program="packed")
    graphdef, state = nnx.split(packed)
    forward = jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))
    for batch in (1, 3, 4):
        x = random_input((batch, 6, 6, 3), batch)
        assert relative_error(forward(state, x), mf.predict(model, x, N)) <= 1e-5
    assert forward._cache_size() == 3


class SigmoidBetweenMasks(nnx.Module):
    """linear -> masks -> sigmoid (1/2 at zero: a dropped channel is live again) -> masks -> linear."""

    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.stem, self.head = linear(4, 8, rngs), linear(8, 3, rngs)
        self.masks1, self.masks2 = Masksembles(8, N, 2.0, seed=1), Masksembles(8, N, 2.0, seed=2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.masks2(jax.nn.sigmoid(self.masks1(self.stem(x)))))


@pytest.mark.verification_fallback
def test_a_program_built_on_a_wrong_proof_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The safety net: with a broken zero proof (every channel 'stays zero' through sigmoid) the packed program
    differs from predict, so every operation runs at full width instead and the first fallback says why."""
    from masksembles_flax import _capture

    model = SigmoidBetweenMasks()
    x = random_input((5, 4), 0)
    expected = mf.predict(model, x, N)
    monkeypatch.setattr(
        _capture.Answers, "zero_map", lambda self, op: np.ones(self.capture.values[op.var].shape[op.axis], bool)
    )
    assert relative_error(pack(model, x, program="packed", verify=False)(x), expected) > 1e-2  # the bug is real
    packed = pack(model, x, program="packed")
    assert packed.program == "dense"
    assert packed.fallbacks[0].startswith("verification: the packed program differed from predict")
    assert "verification" in repr(packed)
    assert relative_error(packed(x), expected) <= 1e-5
    member = extract_member(model, 1, x)
    assert member.fallbacks[0].startswith("verification: ") and relative_error(member(x), expected[1]) <= 1e-5


@pytest.mark.verification_fallback
def test_a_wrong_member_of_a_model_that_reads_the_batch_is_replaced_by_its_full_width_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the compacted member is wrong, the full-width program replaces it: for a model that reads the batch it
    computes every member and returns member k (the first replacement, not the last resort)."""
    from masksembles_flax import _capture

    class SigmoidThenBatchMean(SigmoidBetweenMasks):
        def __call__(self, x: jax.Array) -> jax.Array:
            h = jax.nn.sigmoid(self.masks1(self.stem(x)))
            return self.head(self.masks2(h - h.mean(axis=0)))

    model = SigmoidThenBatchMean()
    x = random_input((5, 4), 1)
    expected = mf.predict(model, x, N)
    monkeypatch.setattr(
        _capture.Answers, "zero_map", lambda self, op: np.ones(self.capture.values[op.var].shape[op.axis], bool)
    )
    assert relative_error(extract_member(model, 2, x, verify=False)(x), expected[2]) > 1e-2  # the bug is real
    member = extract_member(model, 2, x)
    assert member.program == "dense" and member.members == (2,)
    assert member.fallbacks[0].endswith("every operation at full width")
    assert relative_error(member(x), expected[2]) <= 1e-5
