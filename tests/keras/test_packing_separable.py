"""Keras separable and depthwise convolutions: ``insert``'s default masks the input of ``SeparableConv1D/2D`` (a
depthwise convolution, then a 1x1 one that mixes the channels) and lists ``DepthwiseConv1D/2D`` with the reason it
leaves them; ``pack`` compacts a separable convolution as its two parts (the depthwise part on each member's kept
channels, the 1x1 part as the members' convolutions), counts both in ``macs`` and equals ``predict``. An Xception-like
model (keras.applications' Xception middle and exit blocks) replicated small."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
from keras import layers

import masksembles_keras as mk
from masksembles_core.insertion import INSERTED, LEFT
from masksembles_keras._surgery import DEPTHWISE

N = 4
BATCH = 6


def randomize_batchnorm(model: keras.Model) -> None:
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if isinstance(layer, layers.BatchNormalization):
            layer.moving_mean.assign(rng.normal(size=layer.moving_mean.shape))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, size=layer.moving_variance.shape))


def xception_like() -> keras.Model:
    """A stem, an Xception entry block (two separable convolutions, max pooling, a strided 1x1 shortcut), a
    MobileNet-style depthwise convolution and a head."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    x = layers.Activation("relu")(layers.BatchNormalization()(layers.Conv2D(8, 3, strides=2, name="stem")(inputs)))
    residual = layers.BatchNormalization()(layers.Conv2D(16, 1, strides=2, padding="same", name="shortcut")(x))
    x = layers.SeparableConv2D(16, 3, padding="same", use_bias=False, name="sepconv1")(x)
    x = layers.Activation("relu")(layers.BatchNormalization()(x))
    x = layers.SeparableConv2D(16, 3, padding="same", use_bias=False, name="sepconv2")(x)
    x = layers.MaxPooling2D(3, strides=2, padding="same")(layers.BatchNormalization()(x))
    x = layers.Add()([x, residual])
    x = layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, name="depthwise")(x)
    x = layers.SeparableConv2D(24, 3, activation="relu", depth_multiplier=2, name="sepconv3")(x)
    x = layers.Dense(5, name="head")(layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, x, name="xception_like")
    randomize_batchnorm(model)
    return model


def sequence_model() -> keras.Model:
    """``SeparableConv1D`` with a stride, a dilation and a depth multiplier, channels first and last."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((12, 4))
    x = layers.Conv1D(8, 1, name="stem")(inputs)
    x = layers.SeparableConv1D(8, 3, strides=2, depth_multiplier=3, activation="relu", name="strided")(x)
    x = layers.SeparableConv1D(6, 2, dilation_rate=2, name="dilated")(x)
    x = layers.Permute((2, 1))(x)
    x = layers.SeparableConv1D(6, 3, padding="same", data_format="channels_first", name="first")(x)
    return keras.Model(inputs, layers.Dense(3, name="head")(layers.Flatten()(x)), name="sequence_model")


def example(model: keras.Model, seed: int = 0) -> np.ndarray:
    shape = (BATCH, *model.inputs[0].shape[1:])
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def assert_close(actual: Any, expected: np.ndarray) -> None:
    actual = np.asarray(actual)
    assert actual.shape == expected.shape
    assert float(np.max(np.abs(actual - expected))) <= 1e-5 * float(np.max(np.abs(expected)))


def test_insert_masks_separable_convolutions_and_lists_depthwise_ones() -> None:
    report = mk.insert(xception_like(), N, 2.0, seed=0).masksembles_report
    actions = {row.path: row.action for row in report.rows}
    assert actions == {
        "stem": LEFT, "shortcut": INSERTED, "sepconv1": INSERTED, "sepconv2": INSERTED, "depthwise": LEFT,
        "sepconv3": INSERTED, "head": INSERTED,
    }  # fmt: skip
    assert {row.path: row.reason for row in report.unchanged}["depthwise"] == DEPTHWISE
    named = mk.insert(xception_like(), N, 2.0, seed=0, before=layers.DepthwiseConv2D).masksembles_report
    assert [row.path for row in named.changed] == ["depthwise"]


@pytest.mark.parametrize("make", [xception_like, sequence_model])
def test_pack_compacts_separable_convolutions_and_equals_predict(make: Any) -> None:
    model = mk.insert(make(), N, 2.0, seed=0)
    x = example(model)
    packed = mk.pack(model, x, program="packed")
    assert packed.fallbacks == ()
    assert 0 < packed.macs["packed"] < packed.macs["dense"] and packed.macs["fallback"] == 0
    expected = mk.predict(model, example(model, 1), N)
    assert_close(np.moveaxis(packed.predict(example(model, 1), verbose=0), 1, 0), expected)
    member = mk.extract_member(model, 3, x)
    assert member.count_params() < model.count_params()
    assert_close(member.predict(example(model, 1), verbose=0), expected[3])


def test_the_dense_program_counts_separable_convolutions_as_full_width() -> None:
    """Every multiply-add of a separable convolution, per sample: its depthwise part (the window times each input
    channel's multiplier outputs) and its 1x1 part, at every output position; at full width in the dense program."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((8, 8, 3))
    x = mk.Masksembles(N, 2.0, seed=0)(layers.Conv2D(8, 1, name="stem")(inputs))
    x = layers.SeparableConv2D(6, 3, strides=2, depth_multiplier=2, name="separable")(x)  # 3x3 outputs
    model = keras.Model(inputs, layers.Dense(5, name="head")(layers.GlobalAveragePooling2D()(x)))
    stem, separable, head = 8 * 8 * 3 * 8, 3 * 3 * (3 * 3 * 8 * 2) + 3 * 3 * 6 * 8 * 2, 6 * 5
    dense = mk.pack(model, example(model), program="dense")
    assert dense.macs["dense"] == N * (stem + separable + head)
    assert dense.macs["fallback"] == dense.macs["packed"] == stem + N * (separable + head)  # the stem runs once
