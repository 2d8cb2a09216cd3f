"""Keras ``extract_member`` holds one member's share of the model: a call after a Masksembles layer reads the batch
only where the same samples give other results at another batch size (not because the masks gave its inputs other
members at the other probe), and an elementwise operation with a per-channel constant (``x * gamma``) is compacted
on the axis its constant varies along. ConvNeXt's block (keras.applications: a depthwise ``Conv2D(groups=C)``,
``LayerNormalization``, two ``Dense`` layers, its ``LayerScale`` layer ``x * gamma``) replicated small."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
from keras import layers, ops

import masksembles_keras as mk
from masksembles_keras import _pack_capture, _packing

N = 4
BATCH = 6


class LayerScale(layers.Layer):  # type: ignore[misc]
    """keras.applications' ConvNeXt ``LayerScale``: its input times a weight of one value per channel."""

    def __init__(self, init_values: float, projection_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.init_values, self.projection_dim = init_values, projection_dim

    def build(self, _: Any) -> None:
        self.gamma = self.add_weight(
            shape=(self.projection_dim,), initializer=keras.initializers.RandomUniform(0.5, 1.5), name="gamma"
        )

    def call(self, x: Any) -> Any:
        return x * self.gamma


class BatchSized(layers.Layer):  # type: ignore[misc]
    """Its input divided by the batch size: each sample alone, but not the same at another batch size."""

    def call(self, x: Any) -> Any:
        return x / ops.cast(ops.shape(x)[0], x.dtype)


def convnext_block(x: Any, dim: int, name: str, scale: Any) -> Any:
    """keras.applications' ConvNeXt block (no stochastic depth), its layer scale ``scale(y)``."""
    y = layers.Conv2D(dim, 3, padding="same", groups=dim, name=f"{name}_depthwise_conv")(x)
    y = layers.LayerNormalization(epsilon=1e-6, name=f"{name}_layernorm")(y)
    y = layers.Dense(4 * dim, name=f"{name}_pointwise_conv_1")(y)
    y = layers.Activation("gelu", name=f"{name}_gelu")(y)
    y = layers.Dense(dim, name=f"{name}_pointwise_conv_2")(y)
    return layers.Add(name=f"{name}_add")([x, scale(y)])


def convnext(scale: Any) -> keras.Model:
    """A stem, two ConvNeXt blocks and a head, with ``insert``'s default masks."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    x = layers.Conv2D(16, 2, strides=2, name="stem")(inputs)
    for block in range(2):
        x = convnext_block(x, 16, f"block{block}", scale(block))
    x = layers.Dense(5, name="head")(layers.GlobalAveragePooling2D()(x))
    return mk.insert(keras.Model(inputs, x, name="convnext"), N, 2.0, seed=0)


def custom_scale(block: int) -> Any:
    return LayerScale(1e-6, 16, name=f"block{block}_layer_scale")


def raw_scale(block: int) -> Any:
    """``y * gamma`` written in the graph: a raw multiply by a (C,) constant."""
    gamma = np.random.default_rng(block).uniform(0.5, 1.5, 16).astype("float32")
    return lambda y: y * gamma


def images(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(BATCH, 8, 8, 3)).astype("float32")


def assert_close(actual: Any, expected: np.ndarray) -> None:
    actual = np.asarray(actual)
    assert actual.shape == expected.shape
    assert float(np.max(np.abs(actual - expected))) <= 1e-5 * float(np.max(np.abs(expected)))


@pytest.mark.parametrize("scale", [custom_scale, raw_scale], ids=["LayerScale", "raw_multiply"])
def test_a_member_of_convnext_holds_less_than_the_model_and_equals_predict(scale: Any) -> None:
    model = convnext(scale)
    x = images()
    expected = mk.predict(model, images(1), N)
    member = mk.extract_member(model, 2, x)
    assert member.members == (2,)
    assert member.count_params() <= model.count_params()
    assert_close(member.predict(images(1), verbose=0), expected[2])
    packed = mk.pack(model, x, program="packed")
    assert_close(np.moveaxis(packed.predict(images(1), verbose=0), 1, 0), expected)
    if scale is raw_scale:  # compacted: nothing at full width
        assert packed.fallbacks == () and member.fallbacks == ()
    else:  # the custom layer runs at full width (pack does not read inside it), each sample alone
        assert packed.fallbacks == ("block0_layer_scale (LayerScale)", "block1_layer_scale (LayerScale)")


def computes_every_member(model: keras.Model) -> bool:
    """Whether ``extract_member`` of ``model`` computes every member (a call at full width reads the batch)."""
    x = np.random.default_rng(0).normal(size=(BATCH, 6)).astype("float32")
    capture = _pack_capture.Capture(model, x, None)
    capture.reset(dense=False)
    return _packing._reads_the_batch(capture)


def test_a_call_after_masks_reads_the_batch_only_where_the_batch_size_changes_its_result() -> None:
    """A custom per-channel scale after masks keeps samples apart at any batch size; a division by the batch size
    after masks does not, and runs per member (``extract_member`` computes every member, as ``predict``)."""
    inputs = keras.Input((6,))
    masked = mk.Masksembles(N, 2.0, seed=0, name="masks")(layers.Dense(12)(inputs))
    scaled = keras.Model(inputs, layers.Dense(3)(LayerScale(1.0, 12, name="scale")(masked)))
    sized = keras.Model(inputs, layers.Dense(3)(BatchSized(name="sized")(masked)))
    assert not computes_every_member(scaled)
    assert computes_every_member(sized)
    x = np.random.default_rng(1).normal(size=(BATCH, 6)).astype("float32")
    for model in (scaled, sized):
        assert_close(mk.extract_member(model, 1, x).predict(x, verbose=0), mk.predict(model, x, N)[1])


def test_a_constant_of_several_axes_or_of_other_channels_is_not_per_channel() -> None:
    """``x * c`` with c varying along two axes, or along the batch, runs at full width and equals predict."""
    inputs = keras.Input((4, 6))
    masked = mk.Masksembles(N, 2.0, seed=0, name="masks")(layers.Dense(6)(inputs))
    grid = np.random.default_rng(0).uniform(0.5, 1.5, (4, 6)).astype("float32")
    model = keras.Model(inputs, layers.Dense(3)(masked * grid))
    x = np.random.default_rng(1).normal(size=(BATCH, 4, 6)).astype("float32")
    packed = mk.pack(model, x, program="packed")
    assert len(packed.fallbacks) == 1 and packed.fallbacks[0].endswith("(Multiply)")
    assert_close(np.moveaxis(packed.predict(x, verbose=0), 1, 0), mk.predict(model, x, N))
