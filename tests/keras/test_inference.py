"""tile, untile and predict (every member on every sample)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import masksembles_core as mc
import masksembles_core.adapter as mca
import masksembles_keras as mk
from tests.conformance import assert_bit_identical
from tests.keras.common import core_error, masks_of, to_numpy
from tests.rounding import assert_rounding_close


@pytest.mark.parametrize("shape", [(3, 2), (5, 4, 3), (1, 2, 2, 3)], ids=lambda s: f"rank{len(s)}")
def test_tile_and_untile_follow_the_core(shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    tiled = to_numpy(mk.tile(x, 4))
    assert np.array_equal(tiled, mc.tile(x, 4))
    assert np.array_equal(to_numpy(mk.untile(tiled, 4)), mc.untile(tiled, 4))
    assert np.array_equal(to_numpy(mk.untile(tiled, 4))[2], x)


def test_untile_rejects_a_batch_that_is_not_a_multiple_of_n() -> None:
    error, message = core_error(lambda: mca.check_tiled_batch(7, 3))
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
        assert_rounding_close(members[k], single.predict_on_batch(x))  # 7 rows against predict's 21
    assert_rounding_close(mk.predict(model, x, 3, batch_size=3), members)  # chunks of 9 rows against 21


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


def test_predict_reads_and_checks_n() -> None:
    inputs = keras.Input((5,))
    hidden = mk.Masksembles(4, 2.0, seed=0)(keras.layers.Dense(8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    x = np.random.default_rng(0).normal(size=(6, 5)).astype("float32")
    np.testing.assert_array_equal(mk.predict(model, x), mk.predict(model, x, 4))
    with pytest.raises(ValueError, match=r"^n=2 does not match the model's Masksembles layers, which have n=4$"):
        mk.predict(model, x, 2)
    nested = keras.Sequential([model, mk.Masksembles(3, 2.0, seed=0)])
    with pytest.raises(ValueError, match=r"have different n: \[3, 4\]"):
        mk.predict(nested, x)
    with pytest.raises(ValueError, match="no Masksembles layer to read it from; pass n"):
        mk.predict(keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]), x)


def test_predict_never_changes_the_model_state() -> None:
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8), keras.layers.BatchNormalization(), mk.Masksembles(4, 2.0, seed=0),
         keras.layers.Dropout(0.5), keras.layers.Dense(3)]
    )  # fmt: skip
    weights = [np.array(w) for w in model.get_weights()]
    mk.predict(model, np.random.default_rng(0).normal(size=(6, 5)).astype("float32"))
    for before, after in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("rows, samples", [(28, 7), (20, 5), (7, 7), (9, 4)])
def test_layer_groups_folded_rows_by_sample(rows: int, samples: int) -> None:
    masks = mc.generate_masks(8, 4, 2.0, seed=0)
    x = np.random.default_rng(rows).normal(size=(rows, 3, 8)).astype("float32")
    layer = mk.Masksembles(masks=masks)
    result = keras.ops.convert_to_numpy(layer(x, samples=samples))
    assert_bit_identical(result, mc.apply_masks(x, masks, channel_axis=-1, samples=samples))
