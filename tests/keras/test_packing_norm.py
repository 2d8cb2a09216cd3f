"""Keras ``pack`` of LayerNormalization: over the last axis it runs per member on the compacted program
(``MemberLayerNormalization``, every channel of each member's block), equal to ``predict``; over other axes it stays a
fallback at full width, still equal to ``predict``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from keras import layers

import masksembles_keras as mk
from masksembles_keras import _packed_layers
from tests.keras.test_packing import N, assert_close, call, check_round_trip, example, masks, members_first


def layer_norm(name: str, **options: Any) -> layers.LayerNormalization:
    """A LayerNormalization with gamma and beta away from their initial ones and zeros."""
    return layers.LayerNormalization(
        name=name, gamma_initializer=keras.initializers.RandomUniform(0.5, 1.5),
        beta_initializer=keras.initializers.RandomUniform(-0.5, 0.5), **options,
    )  # fmt: skip


def transformer_block() -> keras.Model:
    """A pre-norm transformer block on a (5, 6) sequence: Dense embedding, Masksembles, LayerNormalization, multi-head
    self-attention and a Dense MLP with masks, residual sums, a final LayerNormalization without center and scale."""
    inputs = keras.Input((5, 6))
    x = masks("m1", 0)(layers.Dense(16, name="embed")(inputs))
    attended = layers.MultiHeadAttention(2, 8, name="attention")(*[layer_norm("norm_attention")(x)] * 2)
    x = layers.Add()([x, attended])
    y = layers.Dense(32, activation="gelu", name="mlp_in")(layer_norm("norm_mlp")(x))
    y = layers.Dense(16, name="mlp_out")(masks("m2", 1)(y))
    x = layers.LayerNormalization(center=False, scale=False, name="norm_out")(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(3, name="head")(x), name="transformer_block")


def other_axes() -> keras.Model:
    """A LayerNormalization over the sequence and the channels of (B, 5, 12) (not over the channels alone: it runs
    at full width; Keras' torch backend cannot run one over the sequence axis alone)."""
    inputs = keras.Input((5, 6))
    x = masks("m1", 0)(layers.Dense(12, activation="relu")(inputs))
    x = layer_norm("norm_both", axis=[1, 2])(x)
    x = masks("m2", 1)(layers.Dense(8, activation="relu")(x))
    return keras.Model(inputs, layers.Dense(3)(layers.Flatten()(x)), name="other_axes")


def rms_scaled() -> keras.Model:
    """``rms_scaling=True`` (deprecated in Keras, still a setting): gamma only, the input scaled by its variance."""
    inputs = keras.Input((4, 6))
    x = masks("m1", 0)(layers.Dense(12, activation="relu")(inputs))
    x = layer_norm("norm_rms", axis=2, rms_scaling=True)(x)
    x = masks("m2", 1)(layers.Dense(8)(x))
    return keras.Model(inputs, layers.Dense(3)(layers.Flatten()(x)), name="rms_scaled")


def build(make: Any) -> keras.Model:
    keras.utils.set_random_seed(0)
    model: keras.Model = make()
    return model


def assert_packs_equal_to_predict(model: keras.Model) -> mk.PackedMasksembles:
    """Pack ``model`` (the packed program) and extract its first member; both equal ``predict`` at batch 5 and 2."""
    packed = mk.pack(model, example(model, 5), program="packed")
    assert packed.program == "packed"
    member = mk.extract_member(model, 0, example(model, 5))
    for batch in (5, 2):
        x = example(model, batch, seed=batch)
        expected = mk.predict(model, x, N)
        assert_close(members_first(packed, x), expected)
        assert_close(call(member, x), expected[0])
    return packed


def member_layer_norms(packed: keras.Model) -> list[Any]:
    steps = [step for layer in packed.layers for step in getattr(layer, "steps", [layer])]  # a Chain's too
    return [layer for layer in steps if isinstance(layer, _packed_layers.MemberLayerNormalization)]


def test_layer_normalizations_of_a_transformer_block_compact() -> None:
    packed = assert_packs_equal_to_predict(build(transformer_block))
    assert not [name for name in packed.fallbacks if "LayerNormalization" in name]
    assert len(member_layer_norms(packed)) == 3
    assert not [layer for layer in packed.layers if isinstance(layer, layers.LayerNormalization)]


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`:UserWarning")  # the model's layer, at every call
def test_rms_scaling_compacts() -> None:
    packed = assert_packs_equal_to_predict(build(rms_scaled))
    assert packed.fallbacks == ()
    assert [layer.rms_scaling for layer in member_layer_norms(packed)] == [True]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "You passed `rms_scaling=True`")  # the packed layer does not give it
        call(packed, example(packed, 2))


def test_a_layer_normalization_over_other_axes_stays_a_fallback() -> None:
    packed = assert_packs_equal_to_predict(build(other_axes))
    assert packed.fallbacks == ("norm_both (LayerNormalization)",)
    assert member_layer_norms(packed) == []


def test_member_layer_normalization_is_each_members_layer_normalization() -> None:
    """Each member's block through the Keras layer alone, with and without gamma and beta."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 3 * 8)).astype("float32")
    for center, scale in ((True, True), (False, True), (True, False), (False, False)):
        layer = layer_norm("reference", center=center, scale=scale, epsilon=1e-2)
        blocks = [np.asarray(keras.ops.convert_to_numpy(layer(x[..., k * 8 : (k + 1) * 8]))) for k in range(3)]
        packed = _packed_layers.MemberLayerNormalization(3, 1e-2, center, scale)
        packed.build(x.shape)
        for name in ("gamma", "beta"):
            if getattr(layer, name) is not None:
                getattr(packed, name).assign(getattr(layer, name))
        assert_close(np.asarray(keras.ops.convert_to_numpy(packed(x))), np.concatenate(blocks, axis=-1))


def test_packed_transformer_block_saves_and_loads(tmp_path: Path) -> None:
    check_round_trip(build(transformer_block), tmp_path)
