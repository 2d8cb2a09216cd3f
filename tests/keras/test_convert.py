"""convert_dropout: channel dropouts become Masksembles; raw operations, per-sample and rate-0 dropouts survive."""

from __future__ import annotations

import re
from pathlib import Path

import keras
import numpy as np
import pytest

import masksembles_core as mc
import masksembles_core.adapter as mca
import masksembles_keras as mk
from masksembles_core.insertion import CONVERTED, LEFT
from tests.keras.architectures import BUILDERS, CLASSES
from tests.keras.common import (
    assert_file_round_trip_keeps_masks,
    core_error,
    data,
    layer_at,
    layer_paths,
    masks_of,
    masksembles_layers,
    run,
)

# architecture -> {dropout path: (action, channels, channel axis)}
EXPECTED: dict[str, dict[str, tuple[str, int | None, int | None]]] = {
    "mobilenet_v3": {"dropout": (CONVERTED, 24, -1)},
    "efficientnet": {"block2b_drop": (LEFT, None, None), "top_dropout": (CONVERTED, 32, -1)},
    "raw_ops": {"drop": (CONVERTED, 8, -1)},
    "nested": {"block/inner_drop": (CONVERTED, 12, -1)},
    "channels_first": {"spatial_drop": (CONVERTED, 6, 1)},
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_convert_dropout_on_small_versions_of_real_architectures(name: str) -> None:
    model = BUILDERS[name]()
    converted = mk.convert_dropout(model, 4, 2.0, seed=0)
    report = converted.masksembles_report
    assert (report.operation, report.n, report.scale) == ("convert_dropout", 4, 2.0)
    assert {row.path: (row.action, row.channels, row.channel_axis) for row in report.rows} == EXPECTED[name]
    assert set(masksembles_layers(converted)) == {row.path for row in report.changed}, "masks keep the names"
    for row in report.changed:
        masks = layer_at(converted, row.path)
        assert (masks.channels, masks.channel_axis, masks.seed) == (row.channels, row.channel_axis, row.seed)
    for row in report.unchanged:
        assert type(layer_at(converted, row.path)) is type(layer_at(model, row.path))
    members = mk.predict(converted, data(model), 4)
    assert members.shape == (4, 5, CLASSES) and not np.allclose(members[0], members[1])
    assert not masksembles_layers(model), "the input model is left alone"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_all_ones_masks_reproduce_the_model_and_read_the_dropouts_input(name: str) -> None:
    model = BUILDERS[name]()
    converted = mk.convert_dropout(model, 2, 1.0)
    for path, layer in layer_paths(model):
        copy = layer_at(converted, path)
        assert copy is not layer
        if not isinstance(layer, keras.Model | keras.layers.Dropout):
            assert type(copy) is type(layer)
            weights = zip(layer.get_weights(), copy.get_weights(), strict=True)
            assert all(np.array_equal(before, after) for before, after in weights), path
    x = data(model)
    np.testing.assert_array_equal(run(converted, x), run(model, x))
    for row in converted.masksembles_report.changed:
        holder = row.path.rpartition("/")[0]
        new, old = (layer_at(converted, holder), layer_at(model, holder)) if holder else (converted, model)
        reads = [keras.Model(owner.inputs, layer_at(owner, row.path.rpartition("/")[2]).input) for owner in (new, old)]
        x = [data(old)]  # the models read ``inputs``, a list
        np.testing.assert_array_equal(run(reads[0], x), run(reads[1], x), err_msg=row.path)


def test_the_issue_repro_with_raw_operations_converts_on_every_backend() -> None:
    """inputs -> Dense -> x * 2.0 -> Dropout -> x[:, 0] -> Dense crashed with 'Multiply' has no 'set_weights'."""
    keras.utils.set_random_seed(0)
    model = BUILDERS["raw_ops"]()
    # from logits: on probabilities, a head whose outputs are all clipped (negative) gets no gradient at all
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    converted = mk.convert_dropout(model, 4, 2.0, seed=1)
    assert converted.compiled, "compiled like the original"
    drop = converted.get_layer("drop")
    assert type(drop) is mk.Masksembles1D and drop.seed == mc.derive_seed(1, 0)
    assert np.array_equal(masks_of(drop), mc.generate_masks(8, 4, 2.0, seed=drop.seed))
    x, y = data(model, batch=10), np.arange(10) % CLASSES
    history = converted.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert not np.array_equal(converted.get_layer("head").get_weights()[0], model.get_layer("head").get_weights()[0])


def test_stochastic_depth_keeps_its_dropout_and_the_head_dropout_becomes_masks() -> None:
    converted = mk.convert_dropout(BUILDERS["efficientnet"](), 4, 2.0, seed=0)
    (left,) = converted.masksembles_report.unchanged
    assert left.reason == (
        "noise_shape=(None, 1, 1, 1): one draw for all channels (per-sample dropout, e.g. stochastic depth), "
        "not channel dropout"
    )
    kept = converted.get_layer("block2b_drop")
    assert type(kept) is keras.layers.Dropout and kept.noise_shape == (None, 1, 1, 1)
    assert converted.get_layer("predictions").input is converted.get_layer("top_dropout").output


def test_zero_rate_single_channel_and_unreachable_dropouts_are_reported() -> None:
    inputs = keras.Input((4, 8))
    x = keras.layers.Dropout(0.0, name="no_op")(keras.layers.Dense(8, name="embed")(inputs))
    x = keras.layers.MultiHeadAttention(2, 4, dropout=0.1, name="attention")(x, x)
    x = keras.layers.Dropout(0.2, name="single")(keras.layers.Dense(1, name="narrow")(x))
    x = keras.layers.Dropout(0.2, name="mixed", dtype="mixed_float16")(keras.layers.Flatten()(x))
    converted = mk.convert_dropout(keras.Model(inputs, x), 2, 2.0, seed=0)
    rows = {row.path: (row.action, row.reason) for row in converted.masksembles_report.rows}
    # Keras numbers the names of the attention's dropout and softmax, each with its own count in the process
    (attention,) = [path for path in rows if path.startswith("attention/")]
    assert re.fullmatch(r"attention/dropout(_\d+)?", attention)
    action, reason = rows.pop(attention)
    assert action == LEFT and re.fullmatch(
        r"attention-weight dropout \(applied to the output of Softmax 'attention/softmax(_\d+)?'\): its input is "
        "attention weights, not channels",
        reason,
    ), reason
    assert rows == {
        "no_op": (LEFT, "rate=0: it drops nothing"),
        "single": (LEFT, "a single input channel: every mask would keep it"),
        "mixed": (CONVERTED, ""),
    }
    assert converted.get_layer("mixed").dtype_policy.name == "mixed_float16"
    with pytest.raises(ValueError, match=r"(?s)convert_dropout converted no dropout \(1 looked at; .*rate=0"):
        mk.convert_dropout(keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.0)]), 2, 2.0)


def test_lambda_layers_are_copied_with_their_function() -> None:
    scale = 3.0
    inputs = keras.Input((6,))
    x = keras.layers.Lambda(lambda t: t * scale, name="triple")(keras.layers.Dense(6, name="embed")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(keras.layers.Dropout(0.5)(x)))
    converted = mk.convert_dropout(model, 2, 1.0)
    x = data(model)
    np.testing.assert_array_equal(run(converted, x), run(model, x))


def dropout_sequential() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.SpatialDropout2D(0.3, name="spatial"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu", name="dense"),
            keras.layers.Dropout(0.5, name="drop"),
            keras.layers.Dense(2, name="head"),
        ]
    )


def test_convert_dropout_replaces_every_dropout_and_keeps_trained_weights() -> None:
    model = dropout_sequential()
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 6, 6, 3)).astype(np.float32)
    model.fit(x, np.ones((8, 2), np.float32), epochs=1, verbose=0)
    converted = mk.convert_dropout(model, 4, 2.0, seed=3)
    assert isinstance(converted, keras.Sequential)
    layers = [layer for layer in converted.layers if isinstance(layer, mk.Masksembles)]
    assert [(type(layer), layer.name, layer.channels, layer.channel_axis) for layer in layers] == [
        (mk.Masksembles2D, "spatial", 4, -1),
        (mk.Masksembles1D, "drop", 16, -1),
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
    converted.fit(x[:7], np.ones((7, 2), np.float32), batch_size=4, epochs=1, verbose=0)
    assert not np.array_equal(converted.get_layer("dense").get_weights()[0], kernel_before)
    assert np.array_equal(model.get_layer("dense").get_weights()[0], kernel_before), "weights are copied, not shared"


def test_convert_dropout_in_functional_and_nested_models() -> None:
    sequence, image, volume = keras.Input((7, 3)), keras.Input((5, 4, 4)), keras.Input((2, 2, 2, 6))
    block = keras.Sequential([keras.Input((7, 3)), keras.layers.Dense(8), keras.layers.SpatialDropout1D(0.2)])
    pooled = [
        keras.layers.GlobalAveragePooling1D()(block(sequence)),
        keras.layers.Flatten()(keras.layers.SpatialDropout2D(0.2, data_format="channels_first")(image)),
        keras.layers.Flatten()(keras.layers.SpatialDropout3D(0.2)(volume)),
    ]
    model = keras.Model([sequence, image, volume], keras.layers.Dense(1)(keras.layers.Concatenate()(pooled)))
    default = mk.convert_dropout(model, 2, 2.0, seed=0).masksembles_report
    first = "the network's first layer: it reads the raw input (include_first=True masks it)"
    assert [(row.layer, row.reason) for row in default.unchanged] == [
        ("SpatialDropout2D", first),
        ("SpatialDropout3D", first),
    ], "the image and volume dropouts read a model input"
    converted = mk.convert_dropout(model, 2, 2.0, seed=0, include_first=True)
    found = {
        (type(layer).__name__, layer.channels, layer.channel_axis) for layer in masksembles_layers(converted).values()
    }
    assert found == {("Masksembles1D", 8, -1), ("Masksembles2D", 5, 1), ("Masksembles3D", 6, -1)}
    inputs = [np.ones((3, 7, 3), np.float32), np.ones((3, 5, 4, 4), np.float32), np.ones((3, 2, 2, 2, 6), np.float32)]
    assert mk.predict(converted, inputs, 2).shape == (2, 3, 1)


@pytest.mark.parametrize("name", ["efficientnet", "nested"])
def test_keras_file_round_trip_keeps_the_converted_masks(name: str, tmp_path: Path) -> None:
    assert_file_round_trip_keeps_masks(mk.convert_dropout(BUILDERS[name](), 4, 2.0), tmp_path / "converted.keras")


def test_convert_dropout_errors() -> None:
    with pytest.raises(ValueError, match=r"convert_dropout converted no dropout \(0 looked at; it converts Dropout/"):
        mk.convert_dropout(BUILDERS["resnet"](), 4, 2.0)
    unbuilt = keras.Sequential([keras.layers.Dense(2), keras.layers.Dropout(0.1)])
    with pytest.raises(ValueError, match="needs a built model"):
        mk.convert_dropout(unbuilt, 4, 2.0)
    with pytest.raises(TypeError, match="convert_dropout rebuilds Sequential and functional Keras models"):
        mk.convert_dropout(keras.layers.Dropout(0.1), 4, 2.0)
    error, message = core_error(lambda: mca.check_scale(0.0))
    with pytest.raises(error, match=message):
        mk.convert_dropout(dropout_sequential(), 4, 0.0)


def test_insert_rules_apply_too_few_channels_and_the_input_dropout() -> None:
    """The rules of insert (masksembles_core.insertion.plan_conversion), in the same words as in PyTorch."""
    inputs = keras.Input((6,))
    x = keras.layers.Dropout(0.1, name="input_drop")(keras.layers.Rescaling(2.0)(inputs))
    x = keras.layers.Dropout(0.3, name="narrow_drop")(keras.layers.Dense(3, name="narrow")(x))
    x = keras.layers.Dropout(0.3, name="drop")(keras.layers.Dense(8, name="wide")(x))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))
    report = mk.convert_dropout(model, 4, 2.0, seed=0).masksembles_report
    assert {row.path: (row.action, row.reason) for row in report.rows} == {
        "input_drop": (LEFT, "the network's first layer: it reads the raw input (include_first=True masks it)"),
        "narrow_drop": (
            LEFT,
            "3 input channels: only 3 distinct masks of 2 ones exist, fewer than n=4 (members would share masks)",
        ),
        "drop": (CONVERTED, ""),
    }
    assert report.changed[0].seed == mc.derive_seed(0, 0)
    included = mk.convert_dropout(model, 3, 2.0, seed=0, include_first=True)
    assert [row.path for row in included.masksembles_report.changed] == ["input_drop", "narrow_drop", "drop"]
    assert included.get_layer("input_drop").channels == 6
