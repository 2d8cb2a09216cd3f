"""insert: masks on the input of every Conv/Dense layer of small MobileNetV3-, EfficientNet-, ResNet-like graphs."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import masksembles_core as mc
import masksembles_core.adapter as mca
import masksembles_keras as mk
from masksembles_core.insertion import INSERTED, LEFT
from masksembles_keras._surgery import DEPTHWISE
from tests.keras.architectures import BUILDERS, CLASSES, mobilenet_v3_like, resnet_like
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

# architecture -> (its first layer, left alone by default; {path: (channels, channel axis)} of the inserted masks)
# (the squeeze-excitation expansions of the EfficientNet-like graph read 2 channels: too few for 4 distinct masks)
EXPECTED: dict[str, tuple[str, dict[str, tuple[int, int]]]] = {
    "mobilenet_v3": (
        "conv",
        {
            "expanded_conv_expand": (8, -1),
            "expanded_conv_squeeze_excite_conv": (16, -1),
            "expanded_conv_squeeze_excite_conv_1": (4, -1),
            "expanded_conv_project": (16, -1),
            "conv_1": (8, -1),
            "logits": (24, -1),
        },
    ),
    "efficientnet": (
        "stem_conv",
        {
            **{f"{block}_expand_conv": (8, -1) for block in ("block2a", "block2b")},
            **{f"{block}_se_reduce": (16, -1) for block in ("block2a", "block2b")},
            **{f"{block}_project_conv": (16, -1) for block in ("block2a", "block2b")},
            "top_conv": (8, -1),
            "predictions": (32, -1),
        },
    ),
    "resnet": (
        "conv1_conv",
        {
            "conv2_block1_1_conv": (8, -1),
            "conv2_block1_2_conv": (8, -1),
            "conv3_block1_1_conv": (8, -1),
            "conv3_block1_2_conv": (16, -1),
            "conv3_block1_0_conv": (8, -1),
            "predictions": (16, -1),
        },
    ),
    "raw_ops": ("embed", {"head": (8, -1)}),
    "nested": ("stem", {"block/inner": (8, -1), "block/inner_out": (12, -1), "head": (8, -1)}),
    "channels_first": ("conv_a", {"conv_b": (4, 1), "head": (6, -1)}),
}


def masks_path(path: str) -> str:
    return f"{path}_masksembles"


@pytest.mark.parametrize("name", list(BUILDERS))
def test_insert_puts_masks_on_the_input_of_every_conv_and_dense_layer(name: str) -> None:
    model = BUILDERS[name]()
    first, expected = EXPECTED[name]
    result = mk.insert(model, 4, 2.0, seed=0)
    report = result.masksembles_report
    assert (report.operation, report.n, report.scale) == ("insert", 4, 2.0)
    assert {row.path: (row.channels, row.channel_axis) for row in report.changed} == expected
    assert [(row.path, row.action) for row in report.unchanged][:1] == [(first, LEFT)]
    assert "first layer" in report.unchanged[0].reason
    assert all(
        "distinct masks" in row.reason or (row.layer.startswith("DepthwiseConv") and row.reason == DEPTHWISE)
        for row in report.unchanged[1:]
    )  # depthwise convolutions are listed, left alone
    assert set(masksembles_layers(result)) == {masks_path(path) for path in expected}
    for row in report.changed:
        masks = layer_at(result, masks_path(row.path))
        assert (masks.channels, masks.channel_axis, masks.seed) == (row.channels, row.channel_axis, row.seed)
        assert masks.dtype_policy.name == layer_at(model, row.path).dtype_policy.name
        assert layer_at(result, row.path).input is masks.output, "the layer reads the masks' output"
    assert not masksembles_layers(model), "the input model is left alone"
    x = data(model)
    members = mk.predict(result, x, 4)
    assert members.shape == (4, 5, CLASSES)
    assert not np.allclose(members[0], members[1])


@pytest.mark.parametrize("name", list(BUILDERS))
def test_all_ones_masks_keep_every_weight_output_and_masked_tensor(name: str) -> None:
    """scale=1 gives all-ones masks: the copy must compute exactly what the model computes, tensor for tensor."""
    model = BUILDERS[name]()
    result = mk.insert(model, 2, 1.0, include_first=True)
    for path, layer in layer_paths(model):
        copy = layer_at(result, path)
        assert type(copy) is type(layer) and copy is not layer
        if isinstance(layer, keras.Model):
            continue  # its weights now include masks; its layers are compared one by one
        for before, after in zip(layer.get_weights(), copy.get_weights(), strict=True):
            assert np.array_equal(before, after), path
    x = data(model)
    np.testing.assert_array_equal(run(result, x), run(model, x))
    by_model = collections.defaultdict(list)  # the masked layers of each (nested) model
    for row in result.masksembles_report.changed:
        by_model[row.path.rpartition("/")[0]].append(row.path)
    for holder, paths in by_model.items():
        new, old = (layer_at(result, holder), layer_at(model, holder)) if holder else (result, model)
        read_now = keras.Model(new.inputs, [layer_at(result, masks_path(path)).input for path in paths])
        read_before = keras.Model(old.inputs, [layer_at(model, path).input for path in paths])
        x = data(old)
        for path, now, before in zip(paths, run(read_now, [x]), run(read_before, [x]), strict=True):
            np.testing.assert_array_equal(now, before, err_msg=f"what the masks before {path} read")


def test_masks_follow_the_seed() -> None:
    model = BUILDERS["efficientnet"]()
    first, again = mk.insert(model, 4, 2.0, seed=5), mk.insert(model, 4, 2.0, seed=5)
    rows = first.masksembles_report.changed
    assert [row.seed for row in rows] == [mc.derive_seed(5, index) for index in range(len(rows))]
    for row in rows:
        masks = masks_of(layer_at(first, masks_path(row.path)))
        assert np.array_equal(masks, mc.generate_masks(row.channels, 4, 2.0, seed=row.seed))
        assert np.array_equal(masks, masks_of(layer_at(again, masks_path(row.path))))
    fresh = [mk.insert(model, 4, 2.0).masksembles_report.changed for _ in range(2)]
    assert [row.seed for row in fresh[0]] != [row.seed for row in fresh[1]]


@pytest.mark.parametrize("name", ["mobilenet_v3", "nested", "channels_first"])
def test_keras_file_round_trip_keeps_the_inserted_masks(name: str, tmp_path: Path) -> None:
    assert_file_round_trip_keeps_masks(mk.insert(BUILDERS[name](), 4, 2.0), tmp_path / "inserted.keras")


def test_inserted_model_trains_and_the_original_keeps_its_weights() -> None:
    model = mobilenet_v3_like()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    before = [weights.copy() for weights in model.get_weights()]
    result = mk.insert(model, 4, 2.0, seed=0)
    assert result.compiled, "compiled like the original"
    x, y = data(model, batch=10), np.arange(10) % CLASSES
    history = result.fit(x, y, batch_size=6, epochs=1, verbose=0)  # 6 and a partial batch of 4, n=4
    assert np.isfinite(history.history["loss"][-1])
    assert not np.array_equal(result.get_layer("logits").get_weights()[0], model.get_layer("logits").get_weights()[0])
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before, strict=True))


def test_start_skips_the_layers_before_it_in_model_layers_order() -> None:
    """The paper's ImageNet recipe: masks before every convolution from a chosen stage on."""
    result = mk.insert(resnet_like(), 4, 2.0, seed=0, start="conv3_block1_1_conv")
    report = result.masksembles_report
    stage3 = ["conv3_block1_1_conv", "conv3_block1_2_conv", "conv3_block1_0_conv", "predictions"]
    assert {row.path for row in report.changed} == set(stage3)
    assert {row.path: row.reason for row in report.unchanged} == {
        "conv1_conv": report.unchanged[0].reason,
        "conv2_block1_1_conv": "before start='conv3_block1_1_conv'",
        "conv2_block1_2_conv": "before start='conv3_block1_1_conv'",
    }
    nested = mk.insert(BUILDERS["nested"](), 4, 2.0, start="block/inner_out").masksembles_report
    assert [row.path for row in nested.changed] == ["block/inner_out", "head"]
    with pytest.raises(ValueError, match="start='conv9' names no layer of the model"):
        mk.insert(resnet_like(), 4, 2.0, start="conv9")


def test_before_takes_layer_types_or_a_predicate_on_path_and_layer() -> None:
    model = mobilenet_v3_like()
    convolutions = mk.insert(model, 3, 2.0, before=[keras.layers.Conv2D], include_first=True).masksembles_report
    assert len(convolutions.changed) == 7 and not convolutions.unchanged
    by_name = mk.insert(model, 4, 2.0, before=lambda path, layer: "squeeze_excite_conv" in path).masksembles_report
    assert [(row.path, row.action) for row in by_name.rows] == [  # neither is the network's first layer
        ("expanded_conv_squeeze_excite_conv", INSERTED),
        ("expanded_conv_squeeze_excite_conv_1", INSERTED),
    ]
    asked = mk.insert(model, 4, 2.0, before=keras.layers.DepthwiseConv2D).masksembles_report
    assert [(row.path, row.action, row.channels) for row in asked.rows] == [("expanded_conv_depthwise", INSERTED, 16)]
    with pytest.raises(TypeError, match="before must be a layer type, a non-empty tuple or list of layer types"):
        mk.insert(model, 4, 2.0, before=("Conv2D",))


def test_the_first_layer_is_the_networks_whatever_before_selects() -> None:
    dense_only = mk.insert(resnet_like(), 4, 2.0, before=keras.layers.Dense).masksembles_report
    assert [(row.path, row.action) for row in dense_only.rows] == [("predictions", INSERTED)]
    stem = keras.layers.Rescaling(1 / 255, name="rescale")
    preprocessed = mk.insert(
        keras.Sequential([keras.Input((4, 4, 3)), stem, keras.layers.Conv2D(4, 1, name="conv")]),
        3,
        2.0,
        before=lambda path, layer: True,
    ).masksembles_report
    assert [(row.path, row.action) for row in preprocessed.rows] == [("rescale", LEFT), ("conv", INSERTED)]


def test_every_layer_that_reads_a_raw_input_is_a_first_layer() -> None:
    """An image and a tabular input (through a raw operation and a nested model): the first layer of each, found by
    data flow, is left alone; ``model.layers`` puts the image branch's second convolution before the tabular one."""
    image, features = keras.Input((8, 8, 3), name="image"), keras.Input((5,), name="features")
    x = keras.layers.Conv2D(6, 3, activation="relu", name="image_conv")(image)
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(8, 3, name="image_conv_2")(x))
    tabular = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(6, name="dense"), keras.layers.Dense(4, name="dense_2")], name="tabular"
    )
    joined = keras.layers.Concatenate(name="join")([x, tabular(features * 2.0)])
    model = keras.Model([image, features], keras.layers.Dense(3, name="head")(joined))
    result = mk.insert(model, 2, 2.0, seed=0)
    report = result.masksembles_report
    first = "the network's first layer: it reads the raw input (include_first=True masks it)"
    assert [(row.path, row.action, row.reason) for row in report.rows] == [
        ("image_conv", LEFT, first),
        ("image_conv_2", INSERTED, ""),
        ("tabular/dense", LEFT, first),
        ("tabular/dense_2", INSERTED, ""),
        ("head", INSERTED, ""),
    ]
    included = mk.insert(model, 2, 2.0, seed=0, include_first=True)
    assert [(row.path, row.channels) for row in included.masksembles_report.changed] == [
        ("image_conv", 3),
        ("image_conv_2", 6),
        ("tabular/dense", 5),
        ("tabular/dense_2", 6),
        ("head", 12),
    ]
    rng = np.random.default_rng(0)
    batch = [rng.normal(size=(4, 8, 8, 3)).astype(np.float32), rng.normal(size=(4, 5)).astype(np.float32)]
    for inserted in (result, included):
        members = mk.predict(inserted, batch, 2)
        assert members.shape == (2, 4, 3) and np.isfinite(members).all()
        assert not np.allclose(members[0], members[1]), "the two members differ"


def test_two_branches_reading_one_input_both_read_the_raw_input() -> None:
    """One input feeding a 1x1 and a 3x3 convolution (an Inception-style split): both are first layers."""
    image = keras.Input((8, 8, 3))
    wide = keras.layers.Conv2D(4, 1, name="branch_1x1")(image)
    deep = keras.layers.Conv2D(4, 3, padding="same", name="branch_3x3")(image)
    joined = keras.layers.Concatenate(name="join")([wide, deep])
    model = keras.Model(image, keras.layers.Conv2D(6, 1, name="mix")(joined))
    report = mk.insert(model, 2, 2.0, seed=0).masksembles_report
    assert [(row.path, row.action) for row in report.rows] == [
        ("branch_1x1", LEFT),
        ("branch_3x3", LEFT),
        ("mix", INSERTED),
    ]


def test_layers_a_mask_input_reaches_with_other_layers_results_are_not_first_layers() -> None:
    """Tokens and a mask input: the mask joins the value layer's result before ``out`` and the pooling before
    ``head``; only the layers reading inputs alone (``embed`` on the tokens, ``gate`` on the mask) are first."""
    tokens, mask = keras.Input((5, 8), name="tokens"), keras.Input((5, 1), name="mask")
    h = keras.layers.Dense(8, name="embed")(tokens)
    h = h + keras.layers.Dense(8, name="gate")(keras.ops.concatenate([mask, 1.0 - mask], axis=-1))
    attended = keras.layers.Dense(8, name="out")(keras.layers.Dense(8, name="value")(h) * mask)
    pooled = keras.ops.sum((h + attended) * mask, axis=1) / keras.ops.sum(mask, axis=1)
    model = keras.Model([tokens, mask], keras.layers.Dense(3, name="head")(pooled))
    report = mk.insert(model, 2, 2.0, seed=0).masksembles_report
    first = "the network's first layer: it reads the raw input (include_first=True masks it)"
    assert [(row.path, row.reason) for row in report.unchanged] == [("embed", first), ("gate", first)]
    assert [row.path for row in report.changed] == ["value", "out", "head"]


def test_depthwise_convolutions_are_left_alone_by_the_default_before() -> None:
    model = keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            keras.layers.Conv2D(4, 1, name="pointwise"),
            keras.layers.Conv2D(4, 3, groups=4, name="depthwise"),
            keras.layers.Conv2D(8, 1, groups=2, name="grouped"),
        ]
    )
    report = mk.insert(model, 2, 2.0).masksembles_report
    assert [(row.path, row.action, row.reason) for row in report.rows] == [
        ("pointwise", LEFT, report.rows[0].reason),
        (
            "depthwise",
            LEFT,
            "depthwise convolution: each output channel reads one input channel (before=... includes it)",
        ),
        ("grouped", INSERTED, ""),
    ]


def test_an_einsum_dense_gets_masks_on_the_one_axis_its_equation_contracts_the_last() -> None:
    """An EinsumDense is a fully connected layer over its input's last axis when its equation contracts that axis
    alone (keras-hub's MLPs, attention's query/key/value projections): masks on that axis. One that contracts several
    axes (an attention output projection) or another axis is left alone, whatever its name; pack runs each EinsumDense
    at full width, equal to predict."""
    layers = keras.layers
    inputs = keras.Input((5, 8))
    x = layers.Dense(8, name="stem")(inputs)
    x = layers.EinsumDense("btd,df->btf", output_shape=(5, 12), bias_axes="f", activation="relu", name="up")(x)
    x = layers.EinsumDense("...f,fd->...d", output_shape=8, name="down")(x)
    x = layers.EinsumDense("btd,dnh->btnh", output_shape=(5, 2, 4), name="heads")(x)
    x = layers.EinsumDense("btnh,nhd->btd", output_shape=(5, 8), name="merge")(x)
    x = layers.EinsumDense("btd,tf->bdf", output_shape=(8, 6), name="over_tokens")(x)
    model = keras.Model(inputs, layers.EinsumDense("bd...,df->bf...", output_shape=(3, 6), name="elided_last")(x))
    result = mk.insert(model, 4, 2.0, seed=0)
    assert [(row.path, row.action, row.channels, row.reason) for row in result.masksembles_report.rows[1:]] == [
        ("up", INSERTED, 8, ""),
        ("down", INSERTED, 12, ""),
        ("heads", INSERTED, 8, ""),
        ("merge", LEFT, None, "einsum 'btnh,nhd->btd' contracts 2 axes of its input (n, h), not one channel axis"),
        (
            "over_tokens",
            LEFT,
            None,
            "einsum 'btd,tf->bdf' contracts axis 't', not the last axis of its input (the channels)",
        ),
        (
            "elided_last",
            LEFT,
            None,
            "einsum 'bd...,df->bf...' contracts axis 'd', not the last axis of its input (the channels)",
        ),
    ]
    assert all(result.get_layer(masks_path(name)).channel_axis == -1 for name in ("up", "down", "heads"))
    x = data(model, batch=6)
    np.testing.assert_allclose(run(mk.insert(model, 4, 1.0), x), run(model, x), rtol=1e-6, atol=1e-6)
    members = mk.predict(result, x)
    assert not np.allclose(members[0], members[1]), "the members differ"
    packed = mk.pack(result, x, program="packed")
    np.testing.assert_allclose(np.moveaxis(packed.predict(x, verbose=0), 1, 0), members, rtol=1e-5, atol=1e-6)
    assert [f for f in packed.fallbacks if f.endswith("(EinsumDense)")] == [
        f"{name} (EinsumDense)" for name in ("up", "down", "heads", "merge", "over_tokens", "elided_last")
    ]
    # per sample: up 5*12*8, down 5*8*12, heads 5*8*8, merge 5*8*8, over_tokens 8*6*5, elided_last 3*6*8; 4 members
    assert packed.macs["fallback"] == 4 * (480 + 480 + 320 + 320 + 240 + 144)


def test_sequential_models_stay_sequential() -> None:
    model = keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.Conv2D(5, 1, name="pointwise"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dense(2, name="head"),
        ],
        name="plain",
    )
    result = mk.insert(model, 2, 2.0, seed=0)
    assert isinstance(result, keras.Sequential) and result.name == "plain"
    assert [layer.name for layer in result.layers] == [
        "conv",
        "pointwise_masksembles",
        "pointwise",
        "flatten",
        "head_masksembles",
        "head",
    ]
    assert [type(layer) for layer in result.layers if isinstance(layer, mk.Masksembles)] == [
        mk.Masksembles2D,
        mk.Masksembles1D,
    ]
    assert mk.predict(result, np.ones((3, 6, 6, 3), np.float32), 2).shape == (2, 3, 2)


def test_a_shared_layer_gets_one_masks_layer_called_at_each_place() -> None:
    left, right = keras.Input((4,)), keras.Input((4,))
    stem, shared = keras.layers.Dense(6, name="stem"), keras.layers.Dense(3, name="shared")
    outputs = keras.layers.Concatenate()([shared(stem(left)), shared(stem(right))])
    result = mk.insert(keras.Model([left, right], outputs), 2, 2.0, seed=0)
    assert [row.path for row in result.masksembles_report.changed] == ["shared"]
    masks = result.get_layer("shared_masksembles")
    x = [np.ones((2, 4), np.float32), np.full((2, 4), 2.0, np.float32)]
    members = mk.predict(result, x, 2)
    assert members.shape == (2, 2, 6)
    stem_kernel, stem_bias = result.get_layer("stem").get_weights()
    kernel, bias = result.get_layer("shared").get_weights()
    for k in range(2):
        expected = [((side @ stem_kernel + stem_bias) * masks_of(masks)[k]) @ kernel + bias for side in x]
        np.testing.assert_allclose(members[k], np.concatenate(expected, axis=1), rtol=1e-5, atol=1e-5)


def test_a_frozen_functional_backbone_stays_frozen() -> None:
    features = keras.Input((6,))
    hidden = keras.layers.BatchNormalization(name="norm")(keras.layers.Dense(8, name="dense")(features))
    backbone = keras.Model(features, keras.layers.Dense(8, name="out")(hidden), name="backbone")
    backbone.trainable = False
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(backbone(inputs, training=False)))
    result = mk.insert(model, 2, 2.0, seed=0, include_first=True)
    assert [row.path for row in result.masksembles_report.changed] == ["backbone/dense", "backbone/out", "head"]
    assert not result.get_layer("backbone").trainable
    assert [weight.path for weight in result.trainable_weights] == ["head/kernel", "head/bias"]


def test_layers_that_read_several_tensors_or_different_widths_are_left_alone() -> None:
    inputs = keras.Input((4,))
    wide, narrow = keras.layers.Dense(6, name="wide")(inputs), keras.layers.Dense(3, name="narrow")(inputs)
    activation = keras.layers.Activation("relu", name="relu")
    joined = keras.layers.Concatenate(name="join")([activation(wide), activation(narrow)])
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(joined))
    chosen = ("relu", "join", "head")
    report = mk.insert(model, 2, 2.0, before=lambda path, layer: path in chosen, include_first=True).masksembles_report
    assert [(row.path, row.action, row.reason) for row in report.rows] == [
        ("relu", LEFT, "called on inputs with different channel counts (3, 6)"),
        ("join", LEFT, "its input is not a single tensor"),
        ("head", INSERTED, ""),
    ]


def test_masks_compute_in_the_float_policy_of_their_layer() -> None:
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, name="stem")(inputs)
    x = keras.layers.Dense(8, name="half", dtype="mixed_float16")(x)
    model = keras.Model(inputs, keras.layers.Dense(3, name="quantized")(x))
    model.get_layer("quantized").quantize("int8")
    result = mk.insert(model, 2, 1.0, seed=0)
    policies = {name: result.get_layer(f"{name}_masksembles").dtype_policy.name for name in ("half", "quantized")}
    assert policies == {"half": "mixed_float16", "quantized": "float32"}
    x = data(model)
    assert np.array_equal(run(result, x), run(model, x))


class Block(keras.layers.Layer):  # type: ignore[misc]
    """A custom layer holding its own Dense and Dropout as attributes, called in its own call()."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(6, name="block_dense")
        self.dropout = keras.layers.Dropout(0.2, name="block_dropout")

    def call(self, x: object, training: bool | None = None) -> object:
        return self.dropout(self.dense(x), training=training)


def test_layers_inside_custom_layers_get_masks_and_the_custom_layer_is_copied() -> None:
    inputs = keras.Input((4,))
    x = Block(name="custom")(keras.layers.Dense(5, name="stem")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))
    result = mk.insert(model, 2, 2.0, seed=0)
    report = result.masksembles_report
    assert [(row.path, row.action, row.channels) for row in report.rows] == [
        ("stem", LEFT, None),
        ("custom/block_dense", INSERTED, 5),
        ("head", INSERTED, 6),
    ]
    custom = result.get_layer("custom")
    assert type(custom) is Block and custom is not model.get_layer("custom")
    assert isinstance(custom.dense, mk.Masked) and custom.dense.layer.name == "block_dense"
    pairs = [(model.get_layer(name), result.get_layer(name)) for name in ("stem", "head")]
    for before, after in [*pairs, (model.get_layer("custom").dense, custom.dense.layer)]:
        weights = zip(before.get_weights(), after.get_weights(), strict=True)
        assert all(np.array_equal(a, b) for a, b in weights), before.name
    x = data(model)
    np.testing.assert_array_equal(run(mk.insert(model, 2, 1.0), x), run(model, x))
    custom_first = keras.Model(inputs, keras.layers.Dense(2, name="head")(Block(name="custom")(inputs)))
    rows = mk.insert(custom_first, 2, 2.0, seed=0).masksembles_report.rows
    assert [(row.path, row.action) for row in rows] == [("custom/block_dense", LEFT), ("head", INSERTED)]
    assert rows[0].reason == "the network's first layer: it reads the raw input (include_first=True masks it)", (
        "the custom layer's Dense reads the raw input"
    )


@keras.saving.register_keras_serializable(package="masksembles_tests")
class NamelessBlock(Block):  # type: ignore[misc]
    """A ``Block`` whose config leaves out its name: its copy, and the layer a saved model loads, get a name Keras
    makes up."""

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.dense.build(input_shape)

    def get_config(self) -> dict[str, Any]:
        return {}


def test_a_custom_layer_whose_config_drops_its_name_gets_masks_inside_and_round_trips(tmp_path: Path) -> None:
    inputs = keras.Input((4,))
    x = NamelessBlock(name="custom")(keras.layers.Dense(5, name="stem")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))
    result = mk.insert(model, 2, 2.0, seed=0)
    assert [(row.path, row.action) for row in result.masksembles_report.rows] == [
        ("stem", LEFT),
        ("custom/block_dense", INSERTED),
        ("head", INSERTED),
    ]
    (custom,) = [layer for layer in result.layers if isinstance(layer, NamelessBlock)]
    assert custom.name != "custom" and isinstance(custom.dense, mk.Masked)
    x = data(model)
    members = mk.predict(result, x)
    result.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    (custom,) = [layer for layer in loaded.layers if isinstance(layer, NamelessBlock)]
    assert isinstance(custom.dense, mk.Masked)
    np.testing.assert_array_equal(mk.predict(loaded, x), members)


def test_insert_errors() -> None:
    class Subclassed(keras.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x: object) -> object:
            return self.dense(x)

    subclassed = Subclassed()
    subclassed(np.ones((1, 3), np.float32))
    with pytest.raises(TypeError, match=r"Subclassed is a subclassed keras\.Model, whose call"):
        mk.insert(subclassed, 4, 2.0)
    with pytest.raises(ValueError, match="needs a built model"):
        mk.insert(keras.Sequential([keras.layers.Dense(2), keras.layers.Dense(2)]), 4, 2.0)
    with pytest.raises(ValueError, match=r"(?s)insert found no layer to put masks before \(1 candidates\).*first"):
        mk.insert(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), 4, 2.0)
    error, message = core_error(lambda: mca.check_scale(0.5))
    with pytest.raises(error, match=message):
        mk.insert(resnet_like(), 4, 0.5)


class TiedProjection(keras.layers.Layer):
    """A tied output projection: multiplies by the transposed kernel of a Dense the graph also calls."""

    def __init__(self, dense: keras.layers.Dense, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, x: Any) -> Any:
        return keras.ops.matmul(x, keras.ops.transpose(self.dense.kernel))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "dense": keras.saving.serialize_keras_object(self.dense)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TiedProjection:
        return cls(keras.saving.deserialize_keras_object(config.pop("dense")), **config)


@pytest.mark.parametrize("held_first", [False, True], ids=["called-first", "held-first"])
def test_a_layer_whose_weights_a_custom_layer_uses_is_left_alone(held_first: bool) -> None:
    """As in PyTorch: masks before the Dense's call would not reach the custom layer's use of its kernel."""
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(6, name="stem")(inputs)
    encoder = keras.layers.Dense(8, name="encoder")
    tied = TiedProjection(encoder, name="tied")
    if held_first:  # the survey meets the custom layer, holding the Dense, before the Dense's own call
        encoder.build((None, 6))
        outputs = keras.layers.Add()([tied(keras.layers.Dense(8, name="side")(hidden)), hidden])
        outputs = keras.layers.Dense(3, name="head")(encoder(outputs))
    else:
        outputs = keras.layers.Dense(3, name="head")(tied(encoder(hidden)))
    report = mk.insert(keras.Model(inputs, outputs), 2, 2.0, seed=0).masksembles_report
    reason = (
        "its weights are used by custom layer 'tied' (TiedProjection) outside its own call: a mask on its input "
        "would not apply there"
    )
    first = "the network's first layer: it reads the raw input (include_first=True masks it)"
    assert {row.path: row.reason for row in report.unchanged} == {"stem": first, "encoder": reason}
    assert "head" in {row.path for row in report.changed}
