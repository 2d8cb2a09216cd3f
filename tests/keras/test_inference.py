"""tile, untile, predict (every member on every sample) and convert_dropout."""

from __future__ import annotations

from collections.abc import Iterator

import keras
import numpy as np
import pytest
from keras import ops

import masksembles_core as mc
import masksembles_keras as mk
from tests.keras.common import core_error, masks_of, to_numpy


@pytest.mark.parametrize("shape", [(3, 2), (5, 4, 3), (1, 2, 2, 3)], ids=lambda s: f"rank{len(s)}")
def test_tile_and_untile_follow_the_core(shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    tiled = to_numpy(mk.tile(x, 4))
    assert np.array_equal(tiled, mc.tile(x, 4))
    assert np.array_equal(to_numpy(mk.untile(tiled, 4)), mc.untile(tiled, 4))
    assert np.array_equal(to_numpy(mk.untile(tiled, 4))[2], x)


def test_untile_rejects_a_batch_that_is_not_a_multiple_of_n() -> None:
    error, message = core_error(lambda: mc.check_tiled_batch(7, 3))
    with pytest.raises(error, match=message):
        mk.untile(np.zeros((7, 2), np.float32), 3)


def test_untile_works_on_an_unknown_batch() -> None:
    assert mk.untile(keras.Input((3, 2)), 4).shape == (4, None, 3, 2)


def small_model(masks: np.ndarray) -> keras.Model:
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(masks.shape[1], activation="relu", name="hidden")(inputs)
    masked = mk.Masksembles(masks=masks, name="masks")(hidden)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(masked))


def test_predict_gives_each_members_output_for_every_sample() -> None:
    masks = mc.generate_masks(12, 3, 2.0, seed=0)
    model = small_model(masks)
    x = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    members = mk.predict(model, x, 3)
    assert isinstance(members, np.ndarray) and members.shape == (3, 7, 2)
    for k in range(3):
        single = small_model(masks[k : k + 1])
        for name in ("hidden", "head"):
            single.get_layer(name).set_weights(model.get_layer(name).get_weights())
        np.testing.assert_allclose(members[k], single.predict_on_batch(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mk.predict(model, x, 3, batch_size=3), members, rtol=1e-6, atol=1e-6)


def test_predict_handles_nested_inputs_and_outputs() -> None:
    left, right = keras.Input((4,), name="left"), keras.Input((4,), name="right")
    masked = mk.Masksembles(2, 2.0, seed=0)(keras.layers.Concatenate()([left, right]))
    model = keras.Model({"left": left, "right": right}, {"sum": ops.sum(masked, axis=1, keepdims=True), "all": masked})
    x = {"left": np.ones((3, 4), np.float32), "right": np.full((3, 4), 2.0, np.float32)}
    members = mk.predict(model, x, 2, batch_size=2)
    assert members["all"].shape == (2, 3, 8) and members["sum"].shape == (2, 3, 1)
    masks = masks_of(model.layers[3])
    for k in range(2):
        assert np.array_equal(members["all"][k], np.concatenate([x["left"], x["right"]], axis=1) * masks[k])


def dropout_sequential() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.SpatialDropout2D(0.3),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu", name="dense"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(2, name="head"),
        ]
    )


def test_convert_dropout_replaces_every_dropout_and_keeps_trained_weights() -> None:
    model = dropout_sequential()
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 6, 6, 3)).astype(np.float32)
    model.fit(x, np.ones((8, 2), np.float32), epochs=1, verbose=0)
    converted = mk.convert_dropout(model, 4, 2.0, seed=3)
    layers = [layer for layer in converted.layers if isinstance(layer, mk.Masksembles)]
    assert [(type(layer), layer.channels, layer.channel_axis) for layer in layers] == [
        (mk.Masksembles2D, 4, -1),
        (mk.Masksembles, 16, -1),
    ]
    for index, layer in enumerate(layers):
        assert layer.seed == mc.derive_seed(3, index)
        assert np.array_equal(masks_of(layer), mc.generate_masks(layer.channels, 4, 2.0, seed=layer.seed))
    assert sum(isinstance(layer, keras.layers.Dropout) for layer in model.layers) == 2, "the original is untouched"
    for name in ("conv", "norm", "dense", "head"):
        original, copy = model.get_layer(name), converted.get_layer(name)
        assert copy is not original
        for a, b in zip(original.get_weights(), copy.get_weights(), strict=True):
            assert np.array_equal(a, b)
    kernel_before = model.get_layer("dense").get_weights()[0]
    converted.compile(optimizer="adam", loss="mse")
    converted.fit(x[:7], np.ones((7, 2), np.float32), batch_size=4, epochs=1, verbose=0)
    assert not np.array_equal(converted.get_layer("dense").get_weights()[0], kernel_before)
    assert np.array_equal(model.get_layer("dense").get_weights()[0], kernel_before), "weights are copied, not shared"


def test_converted_model_with_all_ones_masks_predicts_like_the_original() -> None:
    """scale=1 gives all-ones masks: the converted model must reproduce the trained model's inference exactly."""
    model = dropout_sequential()
    x = np.random.default_rng(1).normal(size=(5, 6, 6, 3)).astype(np.float32)
    converted = mk.convert_dropout(model, 4, 1.0)
    assert np.array_equal(converted.predict_on_batch(x), model.predict_on_batch(x))


def all_layers(model: keras.Model) -> Iterator[keras.layers.Layer]:
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from all_layers(layer)


def test_convert_dropout_in_functional_and_nested_models() -> None:
    sequence, image, volume = keras.Input((7, 3)), keras.Input((5, 4, 4)), keras.Input((2, 2, 2, 6))
    block = keras.Sequential([keras.Input((7, 3)), keras.layers.Dense(8), keras.layers.SpatialDropout1D(0.2)])
    pooled = [
        keras.layers.GlobalAveragePooling1D()(block(sequence)),
        keras.layers.Flatten()(keras.layers.SpatialDropout2D(0.2, data_format="channels_first")(image)),
        keras.layers.Flatten()(keras.layers.SpatialDropout3D(0.2)(volume)),
    ]
    model = keras.Model([sequence, image, volume], keras.layers.Dense(1)(keras.layers.Concatenate()(pooled)))
    converted = mk.convert_dropout(model, 2, 2.0, seed=0)
    found = {
        (type(layer).__name__, layer.channels, layer.channel_axis)
        for layer in all_layers(converted)
        if isinstance(layer, mk.Masksembles)
    }
    assert found == {("Masksembles1D", 8, -1), ("Masksembles2D", 5, 1), ("Masksembles3D", 6, -1)}
    inputs = [np.ones((3, 7, 3), np.float32), np.ones((3, 5, 4, 4), np.float32), np.ones((3, 2, 2, 2, 6), np.float32)]
    assert mk.predict(converted, inputs, 2).shape == (2, 3, 1)


def test_convert_dropout_errors() -> None:
    without = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="found no Dropout"):
        mk.convert_dropout(without, 4, 2.0)
    unbuilt = keras.Sequential([keras.layers.Dense(2), keras.layers.Dropout(0.1)])
    with pytest.raises(ValueError, match="needs a built model"):
        mk.convert_dropout(unbuilt, 4, 2.0)
    error, message = core_error(lambda: mc.check_scale(0.0))
    with pytest.raises(error, match=message):
        mk.convert_dropout(dropout_sequential(), 4, 0.0)
