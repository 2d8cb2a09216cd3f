"""Keras ``pack``/``extract_member`` on this backend: every program and every member equal ``predict``, at batch sizes
that do and do not divide n; the result jit-compiles, saves and loads; fallbacks are reported; verification replaces
a program that differs (with a wrong zero proof forced on purpose)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from keras import layers, ops

import masksembles_keras as mk
from masksembles_keras import _pack_capture, _packed_layers, _packing
from tests.batch_clock import BatchClock
from tests.keras import architectures
from tests.keras.common import JIT_COMPILE

N = 4
BATCHES = (5, 8)


def masks(name: str, seed: int, scale: float = 2.0, **options: Any) -> mk.Masksembles:
    return mk.Masksembles(N, scale, seed=seed, name=name, **options)


def mlp() -> keras.Model:
    """A Sequential MLP: Dense, activations, Masksembles."""
    return keras.Sequential(
        [
            keras.Input((6,)),
            layers.Dense(16, activation="relu"),
            masks("m1", 0),
            layers.Dense(16),
            layers.Activation("tanh"),
            masks("m2", 1),
            layers.Dense(3),
        ],
        name="mlp",
    )


def cnn() -> keras.Model:
    """Convolutions with BatchNorm, a residual Add, pooling, a Dense head."""
    inputs = keras.Input((8, 8, 3))
    x = layers.Conv2D(8, 3, padding="same")(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    x = masks("m1", 0)(x)
    y = layers.Conv2D(8, 3, padding="same")(x)
    y = layers.BatchNormalization()(y)
    x = layers.Activation("relu")(layers.Add()([x, y]))
    x = layers.MaxPooling2D()(x)
    x = masks("m2", 1)(x)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(3)(x), name="cnn")


def mobilenet() -> keras.Model:
    """An inverted residual: expand, depthwise, grouped projection, residual."""
    inputs = keras.Input((8, 8, 4))
    x = layers.Conv2D(8, 1)(inputs)
    x = masks("m1", 0)(x)
    shortcut = x
    x = layers.Conv2D(16, 1, use_bias=False)(x)
    x = layers.ReLU(6.0)(layers.BatchNormalization()(x))
    x = masks("m2", 1)(x)
    x = layers.DepthwiseConv2D(3, padding="same", depth_multiplier=1)(x)
    x = layers.ReLU(6.0)(layers.BatchNormalization()(x))
    x = layers.Conv2D(8, 1, groups=2)(x)
    x = layers.Add()([shortcut, layers.BatchNormalization()(x)])
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(3)(x), name="mobilenet")


def concat() -> keras.Model:
    inputs = keras.Input((10,))
    x = masks("m1", 0)(layers.Dense(12, activation="relu")(inputs))
    a = layers.Dense(8, activation="relu")(x)
    b = layers.Dense(6, activation="gelu")(x)
    x = masks("m2", 1)(layers.Concatenate()([a, b]))
    return keras.Model(inputs, layers.Dense(3)(x), name="concat")


def flatten_head() -> keras.Model:
    inputs = keras.Input((6, 6, 2))
    x = layers.Conv2D(6, 3, activation="relu")(inputs)
    x = masks("m1", 0)(x)
    x = layers.Conv2D(8, 3)(x)
    x = masks("m2", 1)(x)
    x = layers.Flatten()(x)
    return keras.Model(inputs, layers.Dense(3)(x), name="flatten_head")


def raw_ops() -> keras.Model:
    """Raw operations between layers: ``x * 2.0 + 1.0`` and a sigmoid, neither of which keeps zeros."""
    inputs = keras.Input((6,))
    x = masks("m1", 0)(layers.Dense(12)(inputs))
    x = ops.sigmoid(x * 2.0 + 1.0)
    x = masks("m2", 1)(layers.Dense(12)(x))
    x = ops.relu(x) - 0.5
    return keras.Model(inputs, layers.Dense(3)(x), name="raw_ops")


def token_head() -> keras.Model:
    """A sequence model's head: the first token (``x[:, 0]``, a GetItem whose key is its argument) and a Dropout
    (whose node Keras writes with training=False) between masked layers."""
    inputs = keras.Input((5, 6))
    x = masks("m1", 0)(layers.Dense(12)(inputs))[:, 0]
    x = layers.Dropout(0.2)(layers.Dense(12, activation="relu")(x))
    return keras.Model(inputs, layers.Dense(3)(masks("m2", 1)(x)), name="token_head")


@keras.saving.register_keras_serializable(package="masksembles_tests")
class Scaled(layers.Layer):  # type: ignore[misc]
    """A custom layer: nothing in pack knows it."""

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.gain = self.add_weight(shape=(int(input_shape[-1]),), initializer="random_normal", name="gain")

    def call(self, x: Any) -> Any:
        return x * self.gain + 0.1


def custom_layer() -> keras.Model:
    inputs = keras.Input((6,))
    x = masks("m1", 0)(layers.Dense(12)(inputs))
    x = Scaled(name="scaled")(x)
    x = masks("m2", 1)(layers.Dense(12, activation="relu")(x))
    return keras.Model(inputs, layers.Dense(3)(x), name="custom_layer")


def batch_reader() -> keras.Model:
    """A Lambda that subtracts the mean over the batch: it reads other samples."""
    inputs = keras.Input((6,))
    x = masks("m1", 0)(layers.Dense(12)(inputs))
    x = layers.Lambda(lambda v: v - ops.mean(v, axis=0, keepdims=True), name="center")(x)
    return keras.Model(inputs, layers.Dense(3)(x), name="batch_reader")


def batch_reader_of_a_dead_member() -> keras.Model:
    """A mean over the batch between masks, and the masks after it keep none of member 0's channels: member 0 needs
    nothing of its own rows, but in predict's member-stacked batch the mean reads them for every other member."""
    first = np.array([[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 1, 0, 1, 1, 0, 1], [1, 1, 0, 1, 0, 0, 0, 1],
                      [1, 0, 0, 1, 0, 1, 0, 1]])  # fmt: skip
    second = np.array([[0, 1, 0, 0, 1, 0, 1, 1], [1, 0, 1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 1, 1, 0, 1],
                       [0, 0, 1, 0, 1, 0, 1, 1]])  # fmt: skip
    third = np.concatenate([1 - second[:1], np.ones((3, 8), int)])
    inputs = keras.Input((6,))
    x = mk.Masksembles(masks=first, name="m1")(layers.Dense(8)(inputs))
    x = layers.Lambda(lambda v: v - ops.mean(v, axis=0, keepdims=True), name="center")(x)
    x = mk.Masksembles(masks=third, name="m3")(mk.Masksembles(masks=second, name="m2")(x))
    return keras.Model(inputs, layers.Dense(3)(x), name="batch_reader_of_a_dead_member")


def inserted() -> keras.Model:
    """``insert`` with its defaults on a model not written for these tests (keras.applications' MobileNetV3 style)."""
    model = architectures.mobilenet_v3_like()
    randomize_batchnorm(model)
    return mk.insert(model, N, 2.0, seed=0)


def randomize_batchnorm(model: keras.Model) -> None:
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if isinstance(layer, layers.BatchNormalization):
            layer.moving_mean.assign(rng.normal(size=layer.moving_mean.shape))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, size=layer.moving_variance.shape))


MODELS: dict[str, Callable[[], keras.Model]] = {
    "mlp": mlp,
    "cnn": cnn,
    "mobilenet": mobilenet,
    "concat": concat,
    "flatten_head": flatten_head,
    "raw_ops": raw_ops,
    "token_head": token_head,
    "custom_layer": custom_layer,
    "batch_reader": batch_reader,
    "batch_reader_of_a_dead_member": batch_reader_of_a_dead_member,
    "inserted": inserted,
}


def build(name: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = MODELS[name]()
    randomize_batchnorm(model)
    return model


def example(model: keras.Model, batch: int, seed: int = 0) -> np.ndarray:
    shape = (batch, *model.inputs[0].shape[1:])
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def call(model: keras.Model, x: np.ndarray) -> np.ndarray:
    """One inference call (compiled on JAX, eager elsewhere: the fastest way to check many small models)."""
    return np.asarray(ops.convert_to_numpy(_packing._run(model, x)))


def members_first(packed: keras.Model, x: np.ndarray) -> np.ndarray:
    """The packed model's (B, m, ...) output as predict's (m, B, ...)."""
    return np.moveaxis(call(packed, x), 1, 0)


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    scale = float(np.max(np.abs(expected)))
    assert actual.shape == expected.shape
    assert float(np.max(np.abs(actual - expected))) <= 1e-5 * scale


@pytest.mark.parametrize("name", list(MODELS))
def test_every_program_and_member_equal_predict(name: str) -> None:
    model = build(name)
    x = example(model, BATCHES[0])
    programs = {program: mk.pack(model, x, program=program) for program in ("packed", "dense")}
    assert programs["packed"].program == "packed" and programs["dense"].program == "dense"
    extracted = {k: mk.extract_member(model, k, x) for k in (0, N - 1)}  # the first and the last member
    for batch in (*BATCHES, 1):
        inputs = example(model, batch, seed=batch)
        expected = mk.predict(model, inputs, N)
        for packed in programs.values():
            assert packed.members == tuple(range(N))
            assert_close(members_first(packed, inputs), expected)
        for k, member in extracted.items() if batch in BATCHES else ():
            assert member.members == (k,)
            assert_close(call(member, inputs), expected[k])


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_auto_times_both_programs_and_says_why(name: str) -> None:
    model = build(name)
    x = example(model, 8)
    chosen = mk.pack(model, x)  # program="auto"
    assert chosen.program in ("packed", "dense") and set(chosen.seconds) == {"packed", "dense"}
    assert chosen.choice.startswith(chosen.program)
    assert_close(members_first(chosen, x), mk.predict(model, x, N))


def test_auto_times_on_eight_samples_where_rounds_on_the_example_do_not_fit_in_twice_the_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A clock that moves only while a timed call runs (a build of no time, so no time is left for timing): both
    programs run on 8 of the 32 samples, a warm-up round that compiles them and one counted round (a compiling call
    never decides), and the program kept equals predict on all 32."""
    clock = BatchClock(_packing._timed, lambda x: len(keras.tree.flatten(x)[0]))
    monkeypatch.setattr(_packing, "clock", clock)
    monkeypatch.setattr(_packing, "_timed", clock.timed)
    model = build("mlp")
    x = example(model, 32)
    chosen = mk.pack(model, x)
    assert clock.sizes == [8] * 4 and "median times over 1 interleaved rounds" in chosen.choice
    assert chosen.choice.endswith("; timed on 8 of the example's 32 samples to build in time")
    assert_close(members_first(chosen, x), mk.predict(model, x, N))


def test_fallbacks_name_what_runs_at_full_width() -> None:
    assert mk.pack(build("mlp"), example(build("mlp"), 5), program="packed").fallbacks == ()
    custom = mk.pack(build("custom_layer"), example(build("custom_layer"), 5), program="packed")
    assert custom.fallbacks == ("scaled (Scaled)",)
    assert "scaled (Scaled)" in repr(custom)
    reader = build("batch_reader")
    assert mk.pack(reader, example(reader, 5), program="packed").fallbacks == ("center (Lambda)",)


@pytest.mark.parametrize("name", ["mlp", "cnn", "mobilenet", "raw_ops", "flatten_head", "token_head"])
def test_packed_model_is_smaller_where_nothing_falls_back(name: str) -> None:
    model = build(name)
    packed = mk.pack(model, example(model, 5), program="packed")
    assert packed.fallbacks == ()
    assert 0 < packed.macs["packed"] < packed.macs["dense"] and packed.macs["fallback"] == 0
    member = mk.extract_member(model, 0, example(model, 5))
    assert member.count_params() < model.count_params()


def batchnorm_after_convolutions() -> keras.Model:
    """Every BatchNormalization alone after a convolution: grouped, depthwise with multiplier 2, without bias,
    without scale and center."""
    inputs = keras.Input((6, 6, 4))
    x = layers.BatchNormalization()(layers.Conv2D(8, 3, padding="same", groups=2)(inputs))
    x = masks("m1", 0)(layers.ReLU()(x))
    x = layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, use_bias=False)(x)
    x = layers.ReLU()(layers.BatchNormalization(scale=False, center=False)(x))
    x = layers.BatchNormalization()(layers.Conv1D(6, 2)(layers.Reshape((36, 16))(x)))
    return keras.Model(inputs, layers.Dense(3)(layers.GlobalAveragePooling1D()(x)), name="batchnorm_after")


def test_batchnorm_after_a_convolution_is_folded_into_it() -> None:
    keras.utils.set_random_seed(0)
    model = batchnorm_after_convolutions()
    randomize_batchnorm(model)
    x = example(model, 5)
    packed = mk.pack(model, x, program="packed")
    assert (packed.program, packed.fallbacks) == ("packed", ())
    steps = [step for layer in packed.layers for step in getattr(layer, "steps", [layer])]  # a Chain's too
    assert not [layer for layer in steps if isinstance(layer, layers.BatchNormalization)]
    assert_close(members_first(packed, x), mk.predict(model, x, N))


@pytest.mark.parametrize(
    ("window", "strides", "dilation", "padding", "multiplier"),
    [((3, 3), 1, 1, "same", 1), ((3, 2), 2, 1, "same", 2), ((3, 3), 1, 2, "valid", 1), ((4,), 3, 1, "same", 2)],
)
def test_depthwise_as_sums_is_the_depthwise_convolution(
    window: tuple[int, ...], strides: int, dilation: int, padding: str, multiplier: int
) -> None:
    shape = (2, *([9] * len(window)), 3)
    layer = (layers.DepthwiseConv2D if len(window) == 2 else layers.DepthwiseConv1D)(
        window, strides, padding, depth_multiplier=multiplier, dilation_rate=dilation, use_bias=False
    )
    x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    expected = ops.convert_to_numpy(layer(x))
    actual = ops.convert_to_numpy(_packed_layers.depthwise_as_sums(x, layer.kernel, layer))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("form", ["gather", "slices", "onehot"])
def test_channel_select_forms_agree(form: str) -> None:
    """Each member's channels from its own block of 3 members x 4 channels (a known zero written at 0 and 5)."""
    index = [1, 3, 0, 2, 4, 4, 7, 5, 11, 8, 9, 10]
    scale = [0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    x = np.random.default_rng(0).standard_normal((2, 5, 12)).astype("float32")
    expected = x[..., index] * np.asarray(scale, dtype="float32")
    for blocks in (1, 3) if form == "onehot" else (1,):
        select = _packed_layers.ChannelSelect(index, scale, 2, form, blocks)
        np.testing.assert_allclose(ops.convert_to_numpy(select(x)), expected, rtol=0, atol=1e-6)
    assert _packed_layers.blocked(index, scale, 12, 3) and not _packed_layers.blocked(index[::-1], None, 12, 3)


CONVOLUTIONS = [
    (layers.Conv2D, {"filters": 6, "kernel_size": 3, "strides": 2, "padding": "same", "groups": 2}, (2, 8, 8, 4)),
    (layers.Conv2D, {"filters": 4, "kernel_size": (3, 2), "dilation_rate": 2, "padding": "same"}, (2, 9, 7, 3)),
    (layers.Conv2D, {"filters": 4, "kernel_size": 3, "data_format": "channels_first", "padding": "same"}, (2, 3, 6, 6)),
    (layers.Conv1D, {"filters": 4, "kernel_size": 3, "strides": 2, "padding": "valid"}, (2, 9, 4)),
    (layers.Conv1D, {"filters": 4, "kernel_size": 3, "padding": "causal", "groups": 2}, (2, 9, 4)),
    (layers.Conv3D, {"filters": 4, "kernel_size": 2, "strides": 2, "padding": "same", "groups": 2}, (1, 5, 5, 5, 4)),
    (layers.DepthwiseConv2D, {"kernel_size": 3, "strides": 2, "padding": "same", "depth_multiplier": 2}, (2, 8, 8, 3)),
    (layers.DepthwiseConv1D, {"kernel_size": 4, "padding": "valid", "activation": "relu"}, (2, 9, 3)),
]


@pytest.mark.parametrize(("layer_type", "options", "shape"), CONVOLUTIONS)
def test_member_convolutions_are_the_keras_convolution(
    layer_type: type, options: dict[str, Any], shape: tuple[int, ...]
) -> None:
    """The packed convolutions in each backend's form (on torch without Keras' copies, the bias in the convolution)
    compute the Keras layer they replace: strides with Keras' uneven "same" padding, dilation, groups, depthwise
    multipliers, channels-first and causal padding."""
    keras.utils.set_random_seed(0)
    layer = layer_type(**options, bias_initializer="random_normal")
    x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    expected = ops.convert_to_numpy(layer(x))
    member_type = (_packed_layers.MEMBER_CONVOLUTIONS | _packed_layers.MEMBER_DEPTHWISE)[layer_type]
    extra = {"members": options.get("groups", 1)} if layer_type in _packed_layers.MEMBER_CONVOLUTIONS else {}
    packed = member_type.from_config({**layer.get_config(), **extra})
    packed.build(shape)
    packed.set_weights(layer.get_weights())
    np.testing.assert_allclose(ops.convert_to_numpy(packed(x)), expected, rtol=0, atol=1e-5)


def test_member_dense_is_each_members_matmul() -> None:
    """(B, m*P_in) -> (B, m*P_out) in each backend's form (on torch one baddbmm), then the bias and activation."""
    rng = np.random.default_rng(0)
    kernel, bias = rng.standard_normal((3, 5, 4)).astype("float32"), rng.standard_normal(12).astype("float32")
    x = rng.standard_normal((7, 15)).astype("float32")
    dense = _packed_layers.MemberDense(3, 4, activation="relu")
    dense.build(x.shape)
    dense.set_weights([kernel, bias])
    expected = np.concatenate([x[:, 5 * k : 5 * (k + 1)] @ kernel[k] for k in range(3)], axis=1) + bias
    np.testing.assert_allclose(ops.convert_to_numpy(dense(x)), np.maximum(expected, 0), rtol=0, atol=1e-5)


def test_chain_runs_its_layers_in_inference_and_saves(tmp_path: Path) -> None:
    """A Chain is its layers one after the other (a layer whose call defaults to training=True runs in inference);
    on torch, pack runs each run of layers that read only each other as one Chain: the packed MLP is one layer."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 6, 2))
    steps = [layers.RandomFlip("horizontal"), layers.Conv2D(3, 2), layers.ReLU(), layers.Flatten(), layers.Dense(2)]
    x = np.random.default_rng(0).standard_normal((5, 4, 6, 2)).astype("float32")
    expected = x
    for step in steps:
        expected = step(expected, training=False)
    model = keras.Model(inputs, _packed_layers.Chain(steps)(inputs))
    np.testing.assert_allclose(model.predict_on_batch(x), ops.convert_to_numpy(expected), rtol=0, atol=1e-6)
    model.save(tmp_path / "chain.keras")
    loaded = keras.models.load_model(tmp_path / "chain.keras")
    np.testing.assert_allclose(loaded.predict_on_batch(x), ops.convert_to_numpy(expected), rtol=0, atol=1e-6)
    packed = mk.pack(build("mlp"), example(build("mlp"), 5), program="packed")
    chained = [type(layer).__name__ for layer in packed.layers] == ["InputLayer", "Chain"]
    assert chained == (keras.backend.backend() == "torch")


def test_a_chain_of_member_dense_layers_is_each_layer_in_turn() -> None:
    """Three members' Dense layers (3 members, bias, relu) on tokens (B, L, 3*4) as one Chain equal the layers one
    after the other; on TensorFlow and JAX the Chain runs them laid out members first, and pack makes the packed
    MLP's run of them one Chain."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 2, 12)).astype("float32")
    steps = []
    for units in (6, 6, 2):
        layer = _packed_layers.MemberDense(3, units, activation="relu")
        layer.build((5, 2, 3 * (4 if not steps else 6)))
        layer.set_weights([w + rng.standard_normal(w.shape).astype("float32") for w in layer.get_weights()])
        steps.append(layer)
    expected = x
    for layer in steps:
        expected = ops.convert_to_numpy(layer(expected))
    major = _packed_layers.runs_member_dense_members_major()
    assert major == (keras.backend.backend() in ("tensorflow", "jax"))
    assert _packed_layers.member_dense_spans(steps) == ([(0, 3)] if major else [(0, 1), (1, 2), (2, 3)])
    np.testing.assert_allclose(ops.convert_to_numpy(_packed_layers.Chain(steps)(x)), expected, rtol=0, atol=1e-5)
    keras.utils.set_random_seed(0)
    stack = [layers.Dense(16, activation="relu"), masks("m1", 0), layers.Dense(16, activation="relu"), masks("m2", 1)]
    model = keras.Sequential([keras.Input((6,)), *stack, layers.Dense(3)])
    packed = mk.pack(model, example(model, 5), program="packed")
    chains = [layer for layer in packed.layers if isinstance(layer, _packed_layers.Chain)]
    if major:
        assert len(chains) == 1 and all(isinstance(step, _packed_layers.MemberDense) for step in chains[0].steps)


@pytest.mark.parametrize("apart", [True, False], ids=["members-apart", "batched"])
def test_member_dense_agrees_one_matmul_per_member_or_batched(apart: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """3 members of 4 -> 5 channels on 12 rows, one matmul per member (TensorFlow's form) or one batched matmul
    (JAX's; torch has its own): each member's block through its own kernel."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 12)).astype("float32")
    kernel, bias = rng.standard_normal((3, 4, 5)).astype("float32"), rng.standard_normal(15).astype("float32")
    expected = np.concatenate([x[..., 4 * k : 4 * k + 4] @ kernel[k] for k in range(3)], axis=-1) + bias
    monkeypatch.setattr(_packed_layers, "runs_members_apart", lambda: apart)
    layer = _packed_layers.MemberDense(3, 5)
    layer.build(x.shape)
    layer.kernel.assign(kernel)
    layer.bias.assign(bias)
    np.testing.assert_allclose(ops.convert_to_numpy(layer(x)), expected, rtol=0, atol=1e-5)


def no_pieces(groups: int, members: int, window: int) -> int:
    raise AssertionError("a grouped 2D channels-last convolution on TensorFlow runs as one tf.nn.convolution")


@pytest.mark.parametrize(("strides", "groups"), [(1, 1), (2, 1), (1, 2)])
def test_member_convolution_equals_each_groups_convolution(
    strides: int, groups: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 members of 5 * groups -> 4 * groups channels, 3x3, in ``groups`` groups each (on JAX one convolution per
    member, a member of one group with its 5 channels padded to 8; on TensorFlow one grouped convolution)."""
    if keras.backend.backend() == "tensorflow":
        monkeypatch.setattr(_packed_layers, "convolution_pieces", no_pieces)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 7, 15 * groups)).astype("float32")
    kernel = rng.standard_normal((3, 3, 5, 12 * groups)).astype("float32")
    layer = _packed_layers.MemberConv2D(
        12 * groups, 3, strides, padding="same", groups=3 * groups, members=3, use_bias=False
    )
    layer.build(x.shape)
    layer.kernel.assign(kernel)
    parts = [
        ops.conv(x[..., 5 * k : 5 * k + 5], kernel[..., 4 * k : 4 * k + 4], strides, padding="same")
        for k in range(3 * groups)
    ]
    expected = ops.convert_to_numpy(ops.concatenate(parts, axis=-1))
    np.testing.assert_allclose(ops.convert_to_numpy(layer(x)), expected, rtol=0, atol=1e-5)


def test_in_chunks_pads_the_batch_to_equal_chunks() -> None:
    x = np.arange(5 * 3, dtype="float32").reshape(5, 3)
    y = _packed_layers.in_chunks(lambda chunk: ops.exp(-chunk) * 2.0, ops.convert_to_tensor(x), 2)
    np.testing.assert_allclose(ops.convert_to_numpy(y), np.exp(-x) * 2.0, rtol=1e-6)


def test_a_program_that_keeps_samples_apart_runs_on_chunks_of_the_batch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On JAX and TensorFlow (torch runs no chunks), with chunks of one sample: equal to predict, kept by a .keras
    file; a model that reads the batch (a mean over it) gets no chunks."""
    monkeypatch.setattr(_packed_layers, "CHUNK_BYTES", 1)
    model, reader = build("cnn"), build("batch_reader")
    packed = mk.pack(model, example(model, 5), program="packed")
    sample_bytes = packed.get_config()["masksembles"].get("sample_bytes")
    assert (sample_bytes is not None and sample_bytes > 0) == (keras.backend.backend() in ("jax", "tensorflow"))
    assert "sample_bytes" not in mk.pack(reader, example(reader, 5), program="packed").get_config()["masksembles"]
    x = example(model, 7, seed=1)
    packed.save(tmp_path / "packed.keras")
    loaded = keras.models.load_model(tmp_path / "packed.keras")
    for built in (packed, loaded):
        assert_close(np.moveaxis(built.predict_on_batch(x), 1, 0), mk.predict(model, x, N))


@pytest.mark.parametrize("jit_compile", JIT_COMPILE)
@pytest.mark.parametrize("name", ["cnn", "mobilenet", "raw_ops"])
def test_compiled_predict_and_evaluate(name: str, jit_compile: bool) -> None:
    model = build(name)
    x = example(model, 8)
    packed = mk.pack(model, x, program="packed")
    packed.compile(loss="mse", jit_compile=jit_compile)
    expected = mk.predict(model, x, N)
    assert_close(np.moveaxis(packed.predict(x, batch_size=3, verbose=0), 1, 0), expected)
    loss = packed.evaluate(x, np.moveaxis(expected, 0, 1), batch_size=3, verbose=0)
    assert loss < 1e-8


@pytest.mark.parametrize("name", ["cnn", "mobilenet", "concat", "flatten_head", "raw_ops", "custom_layer"])
def test_keras_file_round_trip(name: str, tmp_path: Path) -> None:
    check_round_trip(build(name), tmp_path)


def check_round_trip(model: keras.Model, tmp_path: Path) -> None:
    """The packed model and one member saved to ``.keras`` and loaded: the same class, settings and outputs."""
    x = example(model, 5)
    packed = mk.pack(model, x, program="packed")
    path = tmp_path / "packed.keras"
    packed.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, mk.PackedMasksembles)
    assert (loaded.members, loaded.program, loaded.fallbacks, loaded.macs) == (
        packed.members, packed.program, packed.fallbacks, packed.macs,
    )  # fmt: skip
    assert_close(np.moveaxis(loaded.predict(x, verbose=0), 1, 0), mk.predict(model, x, N))
    member = mk.extract_member(model, 2, x)
    member.save(path)
    assert_close(np.asarray(keras.models.load_model(path).predict(x, verbose=0)), mk.predict(model, x, N)[2])


@pytest.mark.verification_fallback
def test_verification_replaces_a_program_built_on_a_wrong_zero_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    """If every channel were proven to stay zero, sigmoid(x * 2 + 1) would drop channels it makes live: the packed
    program differs from predict, and verification returns the dense one instead, saying why."""
    model = build("raw_ops")
    x = example(model, 5)
    monkeypatch.setattr(
        _pack_capture.Capture, "zero_map", lambda self, op: np.ones(self.seen[op.key].shape[op.axis], dtype=bool)
    )
    packed = mk.pack(model, x, program="packed")
    assert packed.program == "dense"
    assert packed.fallbacks[0].startswith("verification: the packed program differed from predict")
    assert "program=dense (verification:" in repr(packed)
    assert_close(members_first(packed, x), mk.predict(model, x, N))
    member = mk.extract_member(model, 1, x)
    assert member.fallbacks[0].startswith("verification:")
    assert_close(np.asarray(member.predict(x, verbose=0)), mk.predict(model, x, N)[1])
    unchecked = mk.pack(model, x, program="packed", verify=False)
    assert unchecked.program == "packed"
    assert not np.allclose(members_first(unchecked, x), mk.predict(model, x, N), atol=1e-3)


def test_pack_leaves_the_model_untouched() -> None:
    model = build("cnn")
    before = [np.copy(w) for w in model.get_weights()]
    mk.pack(model, example(model, 5), program="packed")
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


class Subclassed(keras.Model):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.dense = layers.Dense(8)
        self.masks = mk.Masksembles(N, 2.0, seed=0)

    def call(self, x: Any) -> Any:
        return self.masks(self.dense(x))


def test_a_subclassed_model_is_refused_with_what_to_do() -> None:
    model = Subclassed()
    x = example(build("mlp"), 4)
    model(x)
    with pytest.raises(TypeError, match=r"Subclassed is a subclassed keras\.Model.*build it as a functional model"):
        mk.pack(model, x)
    with pytest.raises(TypeError, match="subclassed"):
        mk.extract_member(model, 0, x)


def test_n_must_match_the_masks() -> None:
    model = build("mlp")
    with pytest.raises(ValueError, match="n=3 does not match"):
        mk.pack(model, example(model, 4), 3)


class Noisy(layers.Layer):  # type: ignore[misc]
    """Noise added in inference too: another draw at every call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(0)

    def call(self, x: Any) -> Any:
        return x + keras.random.normal(ops.shape(x), seed=self.seed_generator)


def test_a_model_random_at_every_call_is_refused_with_what_to_do() -> None:
    """No program equals predict for such a model: pack says so instead of returning the whole model tiled."""
    inputs = keras.Input((6,))
    x = masks("m1", 0)(layers.Dense(12)(inputs))
    model = keras.Model(inputs, layers.Dense(3)(Noisy(name="noisy")(x)))
    random_per_call = r"noisy \(Noisy\) writes its state in an inference call: it draws random numbers at every call"
    for packing in (lambda: mk.pack(model, example(model, 4)), lambda: mk.extract_member(model, 0, example(model, 4))):
        with pytest.raises(ValueError, match=random_per_call):
            packing()
