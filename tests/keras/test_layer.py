"""The Keras layer: masks, forward against the NumPy oracle, any batch, errors, dtypes, random mode, config."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import keras
import numpy as np
import pytest
from keras import ops

import masksembles_core as mc
import masksembles_core.adapter as mca
import masksembles_keras as mk
from tests.keras.common import (
    BACKEND,
    JIT_COMPILE,
    assert_same_bits,
    core_error,
    dtype_scope,
    masks_of,
    oracle,
    special_values,
    to_numpy,
)

# (layer class, input shape without the batch, channel_axis)
LAYOUTS = {
    "dense-bc": (mk.Masksembles1D, (6,), -1),
    "seq-blc": (mk.Masksembles1D, (5, 6), -1),
    "image-bhwc": (mk.Masksembles2D, (3, 4, 6), -1),
    "image-bchw": (mk.Masksembles2D, (6, 3, 4), 1),
    "volume-bdhwc": (mk.Masksembles3D, (2, 3, 2, 6), -1),
    "any-bcl": (mk.Masksembles, (6, 5), 1),
}


def test_masks_are_the_cores_in_a_non_trainable_weight() -> None:
    layer = mk.Masksembles(4, 2.0, seed=3)
    layer.build((None, 7, 16))
    assert np.array_equal(masks_of(layer), mc.generate_masks(16, 4, 2.0, seed=3))
    assert (layer.n, layer.channels) == (4, 16)
    assert [w.path for w in layer.non_trainable_weights] == [layer.masks.path]
    assert layer.masks.path.endswith("masks") and tuple(layer.masks.shape) == (4, 16)
    assert layer.trainable_weights == []


def test_given_masks_are_used_and_checked_against_the_input() -> None:
    masks = mc.generate_masks(5, 3, 2.0, seed=0)
    layer = mk.Masksembles(masks=masks.astype(np.float32))
    layer.build((None, 5))
    assert np.array_equal(masks_of(layer), masks) and layer.n == 3
    expected = core_error(lambda: mca.check_input_shape((None, 4), channels=5, channel_axis=-1))
    with pytest.raises(expected[0], match=expected[1]):
        mk.Masksembles(masks=masks).build((None, 4))


@pytest.mark.parametrize("batch", [1, 3, 4, 8, 13], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_is_the_oracle_for_any_batch(layout: str, batch: int) -> None:
    cls, shape, axis = LAYOUTS[layout]
    layer = cls(4, 2.0, seed=1, channel_axis=axis)
    x = special_values((batch, *shape), seed=batch)
    y = to_numpy(layer(x))
    assert_same_bits(y, oracle(x, masks_of(layer), axis))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_compute_dtype_is_kept_and_masks_cast_to_it(dtype: str) -> None:
    with dtype_scope(dtype):
        layer = mk.Masksembles2D(4, 2.0, seed=0, dtype=dtype)
        x = special_values((6, 2, 2, 8), seed=0)
        y = layer(ops.cast(x, dtype))
        assert keras.backend.standardize_dtype(y.dtype) == dtype
        assert_same_bits(to_numpy(y), oracle(x, masks_of(layer), -1))


@pytest.fixture
def restore_policy() -> Iterator[None]:
    previous = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_output_keeps_the_compute_dtype(policy: str, restore_policy: None) -> None:
    keras.config.set_dtype_policy(policy)
    inputs = keras.Input((4, 4, 3))
    features = keras.layers.Conv2D(8, 1)(inputs)
    masked = mk.Masksembles2D(4, 2.0, seed=0)(features)
    model = keras.Model(inputs, keras.layers.Dense(2, dtype="float32")(keras.layers.Flatten()(masked)))
    compute = policy.removeprefix("mixed_")
    assert masked.dtype == compute
    layer = model.layers[2]
    assert keras.backend.standardize_dtype(layer.masks.dtype) == "float32"
    x = np.random.default_rng(0).normal(size=(6, 4, 4, 3)).astype(np.float32)
    assert keras.backend.standardize_dtype(layer(ops.convert_to_tensor(x[..., :1].repeat(8, -1))).dtype) == compute
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, np.zeros((6, 2), np.float32), batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])


@pytest.mark.parametrize("jit_compile", JIT_COMPILE, ids=lambda j: f"jit{j}")
def test_dynamic_batch_and_partial_last_batch_in_predict_and_fit(jit_compile: bool) -> None:
    """The original's issues #7 and #17: a None batch in a functional model, a partial last batch."""
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(12, kernel_initializer="ones")(inputs)
    assert hidden.shape[0] is None
    layer = mk.Masksembles1D(4, 2.0, seed=0)
    model = keras.Model(inputs, layer(hidden))
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    x = np.random.default_rng(0).normal(size=(10, 5)).astype(np.float32)
    predicted = model.predict(x, batch_size=4, verbose=0)  # batches of 4, 4 and 2
    features = to_numpy(model.layers[1](x))
    expected = np.concatenate([oracle(features[i : i + 4], masks_of(layer), -1) for i in range(0, 10, 4)])
    np.testing.assert_allclose(predicted, expected, rtol=1e-6, atol=1e-6)
    assert np.array_equal(predicted == 0, expected == 0)
    masks_before = masks_of(layer)
    history = model.fit(x, np.ones((10, 12), np.float32), batch_size=4, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert np.array_equal(masks_of(layer), masks_before), "masks are fixed state, never trained"


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a symbolic (None) batch inside a traced graph is TensorFlow's")
@pytest.mark.parametrize("jit_compile", [False, True], ids=lambda j: f"jit{j}")
def test_tensorflow_graph_with_unknown_batch(jit_compile: bool) -> None:
    import tensorflow as tf

    layer = mk.Masksembles(3, 2.0, seed=0)
    layer.build((None, 2, 6))
    traced = tf.function(layer, input_signature=[tf.TensorSpec([None, 2, 6])], jit_compile=jit_compile)
    for batch in (1, 5, 6, 7):
        x = special_values((batch, 2, 6), seed=batch)
        assert_same_bits(traced(x).numpy(), oracle(x, masks_of(layer), -1))


@pytest.mark.parametrize(
    ("layer_cls", "shape", "axis", "check"),
    [
        pytest.param(
            mk.Masksembles2D,
            (None, 4, 6),
            -1,
            lambda: mca.check_input_shape((None, 4, 6), channels=6, channel_axis=-1, ranks=(4,), layer="Masksembles2D"),
            id="2d-wrong-rank",
        ),
        pytest.param(
            mk.Masksembles,
            (None, 5),
            2,
            lambda: mca.check_input_shape((None, 5), channels=5, channel_axis=2),
            id="axis-out-of-range",
        ),
        pytest.param(mk.Masksembles, (None, 3, None), -1, lambda: mca.check_channels(None), id="unknown-channels"),
        pytest.param(
            mk.Masksembles,
            (None,),
            -1,
            lambda: mca.check_input_shape((None,), channels=1, channel_axis=-1),
            id="rank-1",
        ),
    ],
)
def test_bad_input_shapes_raise_the_cores_errors_at_build(
    layer_cls: type[mk.Masksembles], shape: tuple[int | None, ...], axis: int, check: Callable[[], object]
) -> None:
    error, message = core_error(check)
    with pytest.raises(error, match=message):
        layer_cls(4, 2.0, channel_axis=axis).build(shape)


def test_a_built_layer_rejects_other_channel_counts_with_the_cores_error() -> None:
    layer = mk.Masksembles2D(4, 2.0, seed=0)
    layer(np.zeros((2, 3, 3, 8), np.float32))
    error, message = core_error(
        lambda: mca.check_input_shape((2, 3, 3, 5), channels=8, channel_axis=-1, ranks=(4,), layer="Masksembles2D")
    )
    with pytest.raises(error, match=message):
        layer(np.zeros((2, 3, 3, 5), np.float32))
    inputs = keras.Input((3, 3, 5))
    with pytest.raises(error, match=message.replace("\\(2,", "\\(None,")):
        layer(inputs)


@pytest.mark.parametrize(
    ("kwargs", "check"),
    [
        pytest.param({"n": 0, "scale": 2.0}, lambda: mca.check_n(0), id="n-zero"),
        pytest.param({"n": 2.0, "scale": 2.0}, lambda: mca.check_n(2.0), id="n-float"),
        pytest.param(
            {"n": None, "scale": 2.0},
            lambda: mca.layer_arguments(None, None, 2.0, channel_axis=-1),
            id="n-missing",
        ),
        pytest.param({"n": 4, "scale": 0.5}, lambda: mca.check_scale(0.5), id="scale-below-1"),
        pytest.param({"n": 4, "scale": float("nan")}, lambda: mca.check_scale(float("nan")), id="scale-nan"),
        pytest.param({"n": 4, "scale": 2.0, "mode": "mc"}, lambda: mca.check_mode("mc"), id="mode"),
        pytest.param({"n": 4, "scale": 2.0, "channel_axis": 0}, lambda: mca.check_channel_axis(0), id="axis-0"),
        pytest.param({"n": 4, "scale": 2.0, "seed": -1}, lambda: mca.check_seed(-1), id="seed"),
        pytest.param({"masks": [[0, 0], [1, 1]]}, lambda: mc.validate_masks([[0, 0], [1, 1]]), id="empty-mask"),
        pytest.param(
            {"n": 3, "masks": [[1, 0], [0, 1]]},
            lambda: mca.layer_arguments(None, 3, None, masks=[[1, 0], [0, 1]], channel_axis=-1),
            id="n-disagrees-with-masks",
        ),
    ],
)
def test_bad_arguments_raise_the_cores_errors(kwargs: dict[str, object], check: Callable[[], object]) -> None:
    error, message = core_error(check)
    with pytest.raises(error, match=message):
        mk.Masksembles(**kwargs)  # type: ignore[arg-type]


def test_random_mode_draws_a_mask_per_sample_in_training_and_groups_in_inference() -> None:
    masks = mc.generate_masks(16, 4, 3.0, seed=0)
    x = np.random.default_rng(0).uniform(1.0, 2.0, size=(64, 16)).astype(np.float32)
    layer = mk.Masksembles(masks=masks, mode="random", seed=7)
    assert_same_bits(to_numpy(layer(x, training=False)), oracle(x, masks, -1))
    assert_same_bits(to_numpy(layer(x)), oracle(x, masks, -1))
    drawn = [to_numpy(layer(x, training=True)) != 0 for _ in range(2)]
    rows = [[int(np.flatnonzero((masks == row).all(axis=1))[0]) for row in draw] for draw in drawn]
    assert set(rows[0]) == {0, 1, 2, 3}, "every sample gets one of the n masks, all of them are used"
    assert rows[0] != rows[1], "the seed generator advances between calls"
    assert rows[0] != mc.group_index(64, 4).tolist()
    twin = mk.Masksembles(masks=masks, mode="random", seed=7)
    assert np.array_equal(to_numpy(twin(x, training=True)) != 0, drawn[0]), "same seed, same draws"


@pytest.mark.parametrize("jit_compile", JIT_COMPILE, ids=lambda j: f"jit{j}")
def test_random_mode_trains_in_fit(jit_compile: bool) -> None:
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(1)(mk.Masksembles1D(3, 2.0, seed=0, mode="random")(keras.layers.Dense(9)(inputs)))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    x = np.random.default_rng(1).normal(size=(14, 6)).astype(np.float32)
    history = model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert len(model.layers[2].non_trainable_weights) == 1, "only the masks are weights; the seed state is a variable"


def test_only_random_mode_owns_a_seed_generator() -> None:
    assert not hasattr(mk.Masksembles(2, 2.0), "seed_generator")
    assert isinstance(mk.Masksembles(2, 2.0, mode="random").seed_generator, keras.random.SeedGenerator)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"n": 4, "scale": 2.0, "seed": 5}, id="seed"),
        pytest.param({"n": 3, "scale": 1.5, "channel_axis": 1, "mode": "random", "name": "ens"}, id="random-axis1"),
        pytest.param({"n": 2, "scale": 4.0, "dtype": "float16", "trainable": False}, id="dtype-trainable"),
        pytest.param({"masks": [[1, 0, 1], [0, 1, 1]], "scale": 2.0}, id="given-masks"),
    ],
)
@pytest.mark.parametrize("cls", [mk.Masksembles, mk.Masksembles2D], ids=lambda c: c.__name__)
def test_get_config_from_config_round_trip(cls: type[mk.Masksembles], kwargs: dict[str, object]) -> None:
    layer = cls(**kwargs)  # type: ignore[arg-type]
    config = layer.get_config()
    assert {"n", "scale", "seed", "channel_axis", "mode", "name", "dtype", "trainable"} <= set(config)
    clone = cls.from_config(config)
    assert type(clone) is cls and clone.get_config() == config
    shape = (None, 3, 2, 2) if layer.channel_axis == 1 else (None, 2, 2, 3)
    layer.build(shape)
    clone.build(shape)
    if layer.seed is not None or layer.given_masks is not None:
        assert np.array_equal(masks_of(clone), masks_of(layer))


@pytest.mark.parametrize("cls", [mk.Masksembles, mk.Masksembles1D, mk.Masksembles2D, mk.Masksembles3D])
def test_registered_for_serialization(cls: type[mk.Masksembles]) -> None:
    assert keras.saving.get_registered_name(cls) == f"masksembles>{cls.__name__}"
    assert keras.saving.get_registered_object(f"masksembles>{cls.__name__}") is cls
    layer = cls(4, 2.0, seed=1)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(restored) is cls and restored.get_config() == layer.get_config()
