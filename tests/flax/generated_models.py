"""Random Masksembles NNX models for differential tests of pack/extract_member: stacks and DAGs drawn from a grammar
of operations, with Masksembles layers at random places (the Flax twin of ``tests/torch/generated_models.py``).

A model is a chain of blocks over a channels-last tensor in one of three layouts (``Shape``): an image (B, S, S, C),
tokens (B, S, C) or features (B, C). Each block is one operation of ``OPERATIONS`` (those that apply to the current
shape), or a branch: two chains of shape-keeping operations joined by a sum, a sigmoid gate or a concatenation. A
Masksembles layer (n=4, on the last axis) goes before a block with some probability, and at least one is in every
model. The operations are what real networks are written with: activations that do and do not keep zeros, moves and
reorderings of the channels, reductions and norms over them, BatchNorm with running statistics, reshapes that fold
the features into the batch, operations that read the batch size, and a ``jax.custom_vjp`` function.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from masksembles_flax.nnx import Masksembles
from tests.flax.test_packing import conv, linear
from tests.generated_shapes import Shape, always, even, image

N = 4
WIDTHS = (8, 12, 16)

Array = jax.Array


@jax.custom_vjp
def cube(x: Array) -> Array:
    """x * |x|, with a hand-written gradient."""
    return x * jnp.abs(x)


def _cube_forward(x: Array) -> tuple[Array, Array]:
    return cube(x), x


def _cube_backward(x: Array, grad: Array) -> tuple[Array]:
    return (2 * grad * jnp.abs(x),)


cube.defvjp(_cube_forward, _cube_backward)


class LayerScale(nnx.Module):
    """A per-channel affine map with its own parameters (timm's layer scale, with a shift)."""

    def __init__(self, channels: int, rng: np.random.Generator) -> None:
        self.scale = nnx.Param(jnp.asarray(rng.normal(size=channels), jnp.float32))
        self.shift = nnx.Param(jnp.asarray(rng.normal(size=channels), jnp.float32))

    def __call__(self, x: Array) -> Array:
        return x * self.scale[...] + self.shift[...]


class Attention(nnx.Module):
    """Single-head self-attention over tokens: a qkv Linear split in three, softmax(q k^T) v, a projection."""

    def __init__(self, channels: int, rngs: nnx.Rngs) -> None:
        self.qkv, self.proj = linear(channels, 3 * channels, rngs), linear(channels, channels, rngs)

    def __call__(self, x: Array) -> Array:
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        weights = jax.nn.softmax(jnp.einsum("bqc,bkc->bqk", q, k) * q.shape[-1] ** -0.5, axis=-1)
        return self.proj(jnp.einsum("bqk,bkc->bqc", weights, v))


class Chain(nnx.Module):
    """Layers (modules and functions) applied in order; no layers is the identity."""

    def __init__(self, layers: list[Callable[[Array], Array]]) -> None:
        self.layers = nnx.List(layers)

    def __call__(self, x: Array) -> Array:
        for layer in self.layers:
            x = layer(x)
        return x


class Branch(nnx.Module):
    """Two chains on one input, joined: ``"add"``, ``"gate"`` (a * sigmoid(b)), ``"cat"`` on the channels."""

    def __init__(self, left: Chain, right: Chain, join: str) -> None:
        self.left, self.right, self.join = left, right, join

    def __call__(self, x: Array) -> Array:
        a, b = self.left(x), self.right(x)
        if self.join == "add":
            return a + b
        if self.join == "gate":
            return a * jax.nn.sigmoid(b)
        return jnp.concatenate([a, b], axis=-1)


# ---------------------------------------------------------------------------------------------------- the grammar


@dataclass
class Context:
    """What a production draws from: the Python RNG (structure), a NumPy one (values), the NNX keys (weights)."""

    rng: random.Random
    values: np.random.Generator
    rngs: nnx.Rngs


Build = Callable[[Shape, Context], tuple[Callable[[Array], Array], Shape]]


@dataclass(frozen=True)
class Operation:
    """One production: where it applies, what it builds, and whether it keeps the shape (usable in branches)."""

    name: str
    applies: Callable[[Shape], bool]
    build: Build
    keeps_shape: bool = True
    weight: int = 1  # how often it is drawn, relative to the others that apply


def _function(function: Callable[[Array], Array]) -> Build:
    return lambda shape, _: (function, shape)


def _affine(module: nnx.BatchNorm | nnx.LayerNorm | nnx.GroupNorm, values: np.random.Generator) -> None:
    """Scale in [0.5, 1.5] and bias in [-0.5, 0.5], not the 1 and 0 they start at."""
    assert module.scale is not None and module.bias is not None
    module.scale.set_value(jnp.asarray(values.uniform(0.5, 1.5, size=module.scale.shape), jnp.float32))
    module.bias.set_value(jnp.asarray(values.uniform(-0.5, 0.5, size=module.bias.shape), jnp.float32))


def _batch_norm(shape: Shape, context: Context) -> tuple[Callable[[Array], Array], Shape]:
    norm = nnx.BatchNorm(shape.channels, use_running_average=True, rngs=context.rngs)
    norm.mean.set_value(jnp.asarray(context.values.uniform(-1.0, 1.0, size=shape.channels), jnp.float32))
    norm.var.set_value(jnp.asarray(context.values.uniform(0.5, 2.0, size=shape.channels), jnp.float32))
    _affine(norm, context.values)
    return norm, shape


def _layer_norm(shape: Shape, context: Context) -> tuple[Callable[[Array], Array], Shape]:
    norm = nnx.LayerNorm(shape.channels, rngs=context.rngs)
    _affine(norm, context.values)
    return norm, shape


def _group_norm(shape: Shape, context: Context) -> tuple[Callable[[Array], Array], Shape]:
    norm = nnx.GroupNorm(shape.channels, num_groups=2, rngs=context.rngs)
    _affine(norm, context.values)
    return norm, shape


def _mixing(kind: str) -> Build:
    """Linear (tokens, features) or a convolution (images) to a width from ``WIDTHS``; a depthwise one keeps it."""

    def build(shape: Shape, context: Context) -> tuple[Callable[[Array], Array], Shape]:
        c, rngs = shape.channels, context.rngs
        if kind == "depthwise":
            return conv(c, c, (3, 3), rngs, feature_group_count=c), shape
        width = context.rng.choice(WIDTHS)
        if shape.layout != "image":
            return linear(c, width, rngs), replace(shape, channels=width)
        if kind == "grouped":
            return conv(c, width, (3, 3), rngs, feature_group_count=2), replace(shape, channels=width)
        kernel = (1, 1) if kind == "pointwise" else (3, 3)
        return conv(c, width, kernel, rngs), replace(shape, channels=width)

    return build


def _shuffle(x: Array) -> Array:
    """ShuffleNet's channel shuffle in two groups, by reshape and transpose."""
    c = x.shape[-1]
    return jnp.swapaxes(x.reshape(*x.shape[:-1], 2, c // 2), -1, -2).reshape(x.shape)


def _reversed_halves(x: Array) -> Array:
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([second, first], axis=-1)


def _batch_position(x: Array) -> Array:
    """Each sample scaled by its place in the batch: reads the batch size."""
    position = jnp.arange(x.shape[0], dtype=x.dtype) / x.shape[0]
    return x * (1 + position.reshape(-1, *([1] * (x.ndim - 1))))


def _to_tokens(shape: Shape, _: Context) -> tuple[Callable[[Array], Array], Shape]:
    return lambda x: x.reshape(x.shape[0], -1, x.shape[-1]), Shape("tokens", shape.channels, shape.size**2)


def _to_image(shape: Shape, _: Context) -> tuple[Callable[[Array], Array], Shape]:
    side = round(shape.size**0.5)
    return lambda x: x.reshape(x.shape[0], side, side, x.shape[-1]), Shape("image", shape.channels, side)


def _flatten(shape: Shape, _: Context) -> tuple[Callable[[Array], Array], Shape]:
    return lambda x: x.reshape(x.shape[0], -1), Shape("flat", shape.features)


def _features_to_batch(shape: Shape, _: Context) -> tuple[Callable[[Array], Array], Shape]:
    """reshape(-1, F): the batch size comes out of the total size."""
    features = shape.features
    return lambda x: x.reshape(-1, features), Shape("flat", features)


def _pool(shape: Shape, _: Context) -> tuple[Callable[[Array], Array], Shape]:
    pool: Callable[[Array], Array] = lambda x: nnx.avg_pool(x, (2, 2), strides=(2, 2))  # type: ignore[no-untyped-call] # noqa: E731
    return pool, replace(shape, size=shape.size // 2)


def _strided(shape: Shape, _: Context) -> tuple[Callable[[Array], Array], Shape]:
    return lambda x: x[..., ::2], replace(shape, channels=shape.channels // 2)


OPERATIONS: tuple[Operation, ...] = (
    # activations that keep zeros, and those that do not
    Operation("relu", always, _function(nnx.relu)),
    Operation("gelu", always, _function(nnx.gelu)),
    Operation("tanh", always, _function(jnp.tanh)),
    Operation("x * 0.5", always, _function(lambda x: x * 0.5)),
    Operation("clip(x, 0.1, 1)", always, _function(lambda x: jnp.clip(x, 0.1, 1.0))),
    Operation("sigmoid", always, _function(jax.nn.sigmoid)),
    Operation("softplus", always, _function(jax.nn.softplus)),
    Operation("x + 1", always, _function(lambda x: x + 1.0)),
    Operation("maximum(x, 0.1)", always, _function(lambda x: jnp.maximum(x, 0.1))),
    Operation("exp", always, _function(lambda x: jnp.exp(jnp.minimum(x, 4.0)))),
    Operation("where(x > 0, x, 1)", always, _function(lambda x: jnp.where(x > 0, x, 1.0))),
    Operation("custom_vjp", always, _function(cube)),
    Operation("layer scale", always, lambda s, c: (LayerScale(s.channels, c.values), s)),
    # reorderings of the channels
    Operation("flip", always, _function(lambda x: jnp.flip(x, -1))),
    Operation("roll", always, _function(lambda x: jnp.roll(x, 1, axis=-1))),
    Operation("shuffle", even, _function(_shuffle)),
    Operation("reversed halves", even, _function(_reversed_halves)),
    Operation("strided slice", lambda s: s.channels >= 8 and even(s), _strided, keeps_shape=False),
    # reductions and norms over the channels
    Operation("x - max", always, _function(lambda x: x - jnp.max(x, axis=-1, keepdims=True))),
    Operation("x / (norm + 1)", always, _function(lambda x: x / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1))),
    Operation("softmax", always, _function(lambda x: jax.nn.softmax(x, axis=-1))),
    Operation("cumsum", always, _function(lambda x: jnp.cumsum(x, axis=-1))),
    Operation("l2 normalize", always, _function(lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6))),
    Operation("LayerNorm", always, _layer_norm),
    Operation("GroupNorm", lambda s: image(s) and even(s), _group_norm),
    Operation("BatchNorm", always, _batch_norm),
    # mixing layers
    Operation("conv or linear", always, _mixing("full"), keeps_shape=False, weight=6),
    Operation("pointwise conv", image, _mixing("pointwise"), keeps_shape=False, weight=2),
    Operation("grouped conv", lambda s: image(s) and even(s), _mixing("grouped"), keeps_shape=False, weight=2),
    Operation("depthwise conv", image, _mixing("depthwise"), weight=2),
    Operation("attention", lambda s: s.layout == "tokens", lambda s, c: (Attention(s.channels, c.rngs), s), weight=2),
    Operation("avg_pool", lambda s: image(s) and s.size >= 4, _pool, keeps_shape=False),
    # layouts and reshapes of the batch
    Operation("to tokens", image, _to_tokens, keeps_shape=False),
    Operation("to image", lambda s: s.layout == "tokens" and round(s.size**0.5) ** 2 == s.size, _to_image, False),
    Operation("reshape(B, -1)", lambda s: s.layout != "flat" and s.features <= 256, _flatten, keeps_shape=False),
    Operation("reshape(-1, F)", lambda s: s.layout != "flat" and s.features <= 256, _features_to_batch, False),
    # operations that read the batch
    Operation("x - batch mean", always, _function(lambda x: x - x.mean(0, keepdims=True))),
    Operation("x * (1 + arange(B) / B)", always, _function(_batch_position)),
)
BRANCH_JOINS = ("add", "gate", "cat")


class Generated(nnx.Module):
    """A generated model: ``blocks`` in order, then ``head``; ``description`` names the blocks, ``operations`` the
    productions of ``OPERATIONS`` it was built from."""

    def __init__(self, blocks: Chain, head: Chain, description: tuple[str, ...], operations: frozenset[str]) -> None:
        self.blocks, self.head, self.description, self.operations = blocks, head, description, operations

    def __call__(self, x: Array) -> Array:
        return self.head(self.blocks(x))


def _masks(shape: Shape, seeds: list[int]) -> Masksembles:
    seeds.append(len(seeds))
    return Masksembles(shape.channels, N, 2.0, seed=seeds[-1])


def _choose(rng: random.Random, operations: list[Operation]) -> Operation:
    return rng.choices(operations, weights=[op.weight for op in operations])[0]


def _chain(
    shape: Shape, context: Context, length: int, masks: float, seeds: list[int], names: list[str]
) -> tuple[Chain, Shape]:
    """``length`` shape-keeping operations, masks before each with probability ``masks``; and the output's shape."""
    layers: list[Callable[[Array], Array]] = []
    for _ in range(length):
        if shape.channels >= 4 and context.rng.random() < masks:
            layers.append(_masks(shape, seeds))
            names.append("masks")
        operation = _choose(context.rng, [op for op in OPERATIONS if op.keeps_shape and op.applies(shape)])
        layer, shape = operation.build(shape, context)
        layers.append(layer)
        names.append(operation.name)
    return Chain(layers), shape


INPUTS = (Shape("image", 3, 4), Shape("image", 8, 4), Shape("tokens", 8, 4), Shape("flat", 12))


def _draw(seed: int, blocks: int) -> tuple[Generated, Shape]:
    rng = random.Random(seed)
    context = Context(rng, np.random.default_rng(seed), nnx.Rngs(seed))
    shape = rng.choice(INPUTS)
    first = shape
    layers: list[Callable[[Array], Array]] = []
    description: list[str] = []
    seeds: list[int] = []
    operations: set[str] = set()
    masks = rng.uniform(0.2, 0.6)
    for _ in range(rng.randint(2, blocks)):
        if shape.channels >= 4 and rng.random() < masks:
            layers.append(_masks(shape, seeds))
            description.append("masks")
        if rng.random() < 0.25:
            join = rng.choice(BRANCH_JOINS if shape.channels <= 16 else BRANCH_JOINS[:2])
            left_names: list[str] = []
            right_names: list[str] = []
            left, _ = _chain(shape, context, rng.randint(1, 2), masks, seeds, left_names)
            right, _ = _chain(shape, context, rng.randint(0, 2), masks, seeds, right_names)
            layers.append(Branch(left, right, join))
            description.append(f"branch {join}: [{', '.join(left_names)}] [{', '.join(right_names)}]")
            operations.update(left_names + right_names)
            if join == "cat":
                shape = replace(shape, channels=2 * shape.channels)
            continue
        operation = _choose(rng, [op for op in OPERATIONS if op.applies(shape)])
        layer, shape = operation.build(shape, context)
        layers.append(layer)
        description.append(operation.name)
        operations.add(operation.name)
    if not seeds:
        layers.append(_masks(shape, seeds))
        description.append("masks")
    head: list[Callable[[Array], Array]] = []
    if rng.random() < 0.7:
        if shape.layout != "flat":
            axes = (1, 2) if shape.layout == "image" else (1,)
            head.append(lambda x: x.mean(axis=axes))
        head.append(linear(shape.channels, 3, context.rngs))
        description.append("head")
    model = Generated(Chain(layers), Chain(head), tuple(description), frozenset(operations - {"masks"}))
    return model, first


def generate(seed: int, blocks: int = 6) -> tuple[Generated, Shape]:
    """A random model (in eval mode) and its input's per-sample shape; the same ``seed`` gives the same model.

    Every production is drawn only where it applies, and the model is traced once on its input's shape: one that
    does not trace (a grammar bug) raises here, in the generator, not in the test that packs it.
    """
    model, shape = _draw(seed, blocks)
    model.eval()  # type: ignore[no-untyped-call]
    jax.eval_shape(model, jnp.zeros(shape.batched(6), jnp.float32))
    return model, shape
