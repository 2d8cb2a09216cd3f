"""Random functional Keras models for differential tests of pack/extract_member: stacks and DAGs drawn from a grammar
of operations, with Masksembles layers at random places (the Keras counterpart of tests/torch/generated_models.py).

A model is a chain of blocks over a channels-last tensor in one of two layouts (``Shape``): an image (B, S, S, C) or
features (B, C). Each block is one operation of ``OPERATIONS`` (those that apply to the current shape), or a branch:
two chains of shape-keeping operations joined by ``Add`` or ``Concatenate``. A Masksembles layer (``Masksembles2D``
on images, ``Masksembles1D`` on features, n=4) goes before a block with some probability, and at least one is in
every model. The operations are Keras layers and raw ``keras.ops`` calls as real networks write them: activations
that do and do not keep zeros, reorderings of the channels, reductions and norms over them, BatchNormalization with
random moving statistics, pooling and reshapes of the batch. A draw that Keras refuses to build is redrawn.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import keras
import numpy as np
from keras import layers, ops

import masksembles_keras as mk
from tests.generated_shapes import Shape, always, even, image

N = 4
WIDTHS = (8, 12, 16)
MAX_FEATURES = 256  # the widest flattened image the grammar makes
MIN_MASKED = 6  # the fewest channels a Masksembles layer goes on


Build = Callable[[Any, Shape, random.Random], tuple[Any, Shape]]  # (KerasTensor, its shape, rng) -> the same


@dataclass(frozen=True)
class Operation:
    """One production: where it applies, what it builds, and whether it keeps the shape (usable in branches)."""

    name: str
    applies: Callable[[Shape], bool]
    build: Build
    keeps_shape: bool = True


def _same(function: Callable[[Any], Any]) -> Build:
    """An operation that keeps the shape: a layer instance or a raw-op function of the tensor."""
    return lambda x, shape, _: (function(x), shape)


def _layer(make: Callable[[Shape], Callable[[Any], Any]]) -> Build:
    """A shape-keeping layer made for the input's shape."""
    return lambda x, shape, _: (make(shape)(x), shape)


def _bias() -> keras.initializers.Initializer:
    """Biases away from zero: a zero bias would make every mixing layer keep zeros."""
    return keras.initializers.RandomUniform(-0.5, 0.5)


def _batch_norm(shape: Shape) -> layers.BatchNormalization:
    return layers.BatchNormalization(
        moving_mean_initializer=keras.initializers.RandomUniform(-1.0, 1.0),
        moving_variance_initializer=keras.initializers.RandomUniform(0.5, 2.0),
        gamma_initializer=keras.initializers.RandomUniform(0.5, 1.5),
        beta_initializer=keras.initializers.RandomUniform(-0.5, 0.5),
    )


def _layer_norm(shape: Shape) -> layers.LayerNormalization:
    return layers.LayerNormalization(
        gamma_initializer=keras.initializers.RandomUniform(0.5, 1.5),
        beta_initializer=keras.initializers.RandomUniform(-0.5, 0.5),
    )


def _mixing(kind: str) -> Build:
    """Dense (features, or an image's last axis) or a 2-D convolution to a width from ``WIDTHS``."""

    def build(x: Any, shape: Shape, rng: random.Random) -> tuple[Any, Shape]:
        if kind == "depthwise":
            return layers.DepthwiseConv2D(3, padding="same", bias_initializer=_bias())(x), shape
        width = rng.choice(WIDTHS)
        if kind == "dense":
            return layers.Dense(width, bias_initializer=_bias())(x), replace(shape, channels=width)
        groups, kernel = {"conv": (1, 3), "pointwise": (1, 1), "grouped": (2, 3)}[kind]
        conv = layers.Conv2D(width, kernel, padding="same", groups=groups, bias_initializer=_bias())
        return conv(x), replace(shape, channels=width)

    return build


def _shuffle(x: Any, shape: Shape, _: random.Random) -> tuple[Any, Shape]:
    """ShuffleNet's channel shuffle in two groups, by reshape and transpose."""
    c = shape.channels
    if shape.layout == "flat":
        return ops.reshape(ops.transpose(ops.reshape(x, (-1, 2, c // 2)), (0, 2, 1)), (-1, c)), shape
    s = shape.size
    grouped = ops.transpose(ops.reshape(x, (-1, s, s, 2, c // 2)), (0, 1, 2, 4, 3))
    return ops.reshape(grouped, (-1, s, s, c)), shape


def _reversed_halves(x: Any, shape: Shape, _: random.Random) -> tuple[Any, Shape]:
    first, second = ops.split(x, 2, axis=-1)
    return layers.Concatenate()([second, first]), shape


def _strided(x: Any, shape: Shape, _: random.Random) -> tuple[Any, Shape]:
    return x[..., ::2], replace(shape, channels=shape.channels // 2)


def _pool(pooling: type[layers.Layer]) -> Build:
    return lambda x, shape, _: (pooling(2)(x), replace(shape, size=shape.size // 2))


def _global_pool(x: Any, shape: Shape, _: random.Random) -> tuple[Any, Shape]:
    return layers.GlobalAveragePooling2D()(x), Shape("flat", shape.channels)


def _flatten(how: str) -> Build:
    """An image to (B, S*S*C): ``Flatten``, ``Reshape((-1,))`` or ``ops.reshape(x, (-1, F))`` (the batch inferred)."""

    def build(x: Any, shape: Shape, _: random.Random) -> tuple[Any, Shape]:
        if how == "Flatten":
            flat = layers.Flatten()(x)
        elif how == "Reshape":
            flat = layers.Reshape((-1,))(x)
        else:
            flat = ops.reshape(x, (-1, shape.features))
        return flat, Shape("flat", shape.features)

    return build


def _small_image(shape: Shape) -> bool:
    return image(shape) and shape.features <= MAX_FEATURES


OPERATIONS: tuple[Operation, ...] = (
    # activations that keep zeros
    Operation("relu", always, _same(lambda x: layers.ReLU()(x))),
    Operation("gelu", always, _same(lambda x: layers.Activation("gelu")(x))),
    Operation("elu", always, _same(lambda x: layers.ELU()(x))),
    Operation("tanh", always, _same(ops.tanh)),
    Operation("x * 0.5", always, _same(lambda x: x * 0.5)),
    # and those that do not
    Operation("sigmoid", always, _same(lambda x: layers.Activation("sigmoid")(x))),
    Operation("softplus", always, _same(ops.softplus)),
    Operation("hard_sigmoid", always, _same(lambda x: layers.Activation("hard_sigmoid")(x))),
    Operation("x + 1.0", always, _same(lambda x: x + 1.0)),
    Operation("maximum(x, 0.1)", always, _same(lambda x: ops.maximum(x, 0.1))),
    Operation("exp", always, _same(lambda x: ops.exp(ops.minimum(x, 4.0)))),
    Operation("where(x > 0, x, 1.0)", always, _same(lambda x: ops.where(x > 0, x, 1.0))),
    # reorderings of the channels
    Operation("flip", always, _same(lambda x: ops.flip(x, axis=-1))),
    Operation("roll", always, _same(lambda x: ops.roll(x, 1, axis=-1))),
    Operation("shuffle", even, _shuffle),
    Operation("reversed halves", even, _reversed_halves),
    Operation("x[..., ::2]", lambda s: s.channels >= 12 and even(s), _strided, keeps_shape=False),
    # reductions and norms over the channels
    Operation("x - max", always, _same(lambda x: x - ops.max(x, axis=-1, keepdims=True))),
    # axis=(-1,): an int axis of ops.norm in a functional model fails on JAX ("Non-hashable static arguments")
    Operation("x / (norm + 1)", always, _same(lambda x: x / (ops.norm(x, axis=(-1,), keepdims=True) + 1.0))),
    Operation("softmax", always, _same(lambda x: layers.Softmax()(x))),
    Operation("cumsum", always, _same(lambda x: ops.cumsum(x, axis=-1))),
    Operation("l2-normalize", always, _same(lambda x: ops.normalize(x, axis=-1))),
    Operation("LayerNormalization", always, _layer(_layer_norm)),
    Operation("BatchNormalization", always, _layer(_batch_norm)),
    # mixing layers
    Operation("Dense", always, _mixing("dense"), keeps_shape=False),
    Operation("Conv2D", image, _mixing("conv"), keeps_shape=False),
    Operation("Conv2D 1x1", image, _mixing("pointwise"), keeps_shape=False),
    Operation("Conv2D groups=2", lambda s: image(s) and even(s), _mixing("grouped"), keeps_shape=False),
    Operation("DepthwiseConv2D", image, _mixing("depthwise")),
    # pooling and reshapes of the batch
    Operation("MaxPooling2D", lambda s: image(s) and s.size >= 4, _pool(layers.MaxPooling2D), keeps_shape=False),
    Operation(
        "AveragePooling2D", lambda s: image(s) and s.size >= 4, _pool(layers.AveragePooling2D), keeps_shape=False
    ),
    Operation("GlobalAveragePooling2D", image, _global_pool, keeps_shape=False),
    Operation("Flatten", _small_image, _flatten("Flatten"), keeps_shape=False),
    Operation("Reshape((-1,))", _small_image, _flatten("Reshape"), keeps_shape=False),
    Operation("reshape(x, (-1, F))", _small_image, _flatten("ops.reshape"), keeps_shape=False),
)
BRANCH_JOINS = ("Add", "Concatenate")
INPUTS = (Shape("image", 3, 4), Shape("image", 8, 4), Shape("flat", 12))


class _Draw:
    """One attempt at a model: the rng, the Masksembles seeds used so far, and a description of the blocks."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.masks = rng.uniform(0.2, 0.6)  # the probability of a Masksembles layer before a block
        self.description: list[str] = []
        self.seeds = 0

    def masksembles(self, x: Any, shape: Shape) -> Any:
        self.seeds += 1
        layer = mk.Masksembles2D if shape.layout == "image" else mk.Masksembles1D
        return layer(N, 2.0, seed=self.seeds)(x)

    def operation(self, x: Any, shape: Shape, keeps_shape: bool) -> tuple[Any, Shape, str]:
        choices = [op for op in OPERATIONS if op.applies(shape) and (op.keeps_shape or not keeps_shape)]
        operation = self.rng.choice(choices)
        y, shape = operation.build(x, shape, self.rng)
        return y, shape, operation.name

    def chain(self, x: Any, shape: Shape, length: int) -> tuple[Any, list[str]]:
        """``length`` shape-keeping operations, Masksembles before each with probability ``masks``."""
        names: list[str] = []
        for _ in range(length):
            if shape.channels >= MIN_MASKED and self.rng.random() < self.masks:
                x = self.masksembles(x, shape)
                names.append("masks")
            x, shape, name = self.operation(x, shape, keeps_shape=True)
            names.append(name)
        return x, names

    def model(self, blocks: int) -> keras.Model:
        shape = self.rng.choice(INPUTS)
        inputs = keras.Input(shape.batched(1)[1:])
        x = inputs
        for _ in range(self.rng.randint(2, blocks)):
            if shape.channels >= MIN_MASKED and self.rng.random() < self.masks:
                x = self.masksembles(x, shape)
                self.description.append("masks")
            if self.rng.random() < 0.25:
                join = self.rng.choice(BRANCH_JOINS)
                left, left_names = self.chain(x, shape, self.rng.randint(1, 2))
                right, right_names = self.chain(x, shape, self.rng.randint(0, 2))
                x = layers.Add()([left, right]) if join == "Add" else layers.Concatenate()([left, right])
                shape = replace(shape, channels=2 * shape.channels) if join == "Concatenate" else shape
                self.description.append(f"{join}: [{', '.join(left_names)}] [{', '.join(right_names)}]")
                continue
            x, shape, name = self.operation(x, shape, keeps_shape=False)
            self.description.append(name)
        if not self.seeds:
            if shape.channels < MIN_MASKED:
                raise ValueError("no Masksembles layer fits: redraw")
            x = self.masksembles(x, shape)
            self.description.append("masks")
        if self.rng.random() < 0.7:
            x = layers.GlobalAveragePooling2D()(x) if shape.layout == "image" else x
            x = layers.Dense(3, bias_initializer=_bias())(x)
            self.description.append("head")
        return keras.Model(inputs, x, name="generated")


def generate(seed: int, blocks: int = 6) -> tuple[keras.Model, list[str]]:
    """A random model and a description of its blocks; the same ``seed`` gives the same model and weights.

    A draw that Keras refuses to build, or whose output is not finite on a standard normal input, is redrawn from
    the next attempt's rng (the same for the same seed), so every returned model is valid.
    """
    for attempt in range(100):
        keras.utils.set_random_seed(seed * 100 + attempt)
        draw = _Draw(random.Random(seed * 100 + attempt))
        try:
            model = draw.model(blocks)
        except ValueError:
            continue
        probe = np.random.default_rng(seed).standard_normal((2, *model.inputs[0].shape[1:])).astype("float32")
        if np.all(np.isfinite(ops.convert_to_numpy(model(probe, training=False)))):
            return model, draw.description
    raise AssertionError(f"no valid model in 100 draws for seed {seed}")
