"""``with_uncertainty`` on this backend: each value of the head equals ``masksembles_core.heads.uncertainty_head`` on
``predict``'s members (float32 rounding), eager and compiled, on a packed and on a converted model, for each task; the
wrapper ignores ``training``, saves and loads, runs at any batch size, and refuses what it cannot answer for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from keras import layers

import masksembles_keras as mk
from masksembles_core import metrics
from masksembles_core.heads import CLASSIFICATION_OUTPUTS, check_head
from tests.keras.common import BACKEND, core_error, to_numpy
from tests.keras.heads import HEADS, N, assert_matches_oracle, converted, data, dropout_model


def eager(model: keras.Model, x: np.ndarray) -> dict[str, Any]:
    return dict(model(x))


def compiled(model: keras.Model, x: np.ndarray) -> dict[str, Any]:
    """The backend's compiled predict: XLA on TensorFlow and JAX (a ``tf.function``, a ``jax.jit``), ``torch.compile``
    on torch."""
    model.compile(jit_compile=True)
    return dict(model.predict_on_batch(x))


CALLS: dict[str, Callable[[keras.Model, np.ndarray], dict[str, Any]]] = {"eager": eager, "compiled": compiled}


@pytest.fixture(scope="module")
def models() -> dict[tuple[str, str], tuple[keras.Model, keras.Model]]:
    """(head name, "converted" or "packed") -> (the model to wrap, the model ``predict`` runs for the members)."""
    built: dict[tuple[str, str], tuple[keras.Model, keras.Model]] = {}
    for name in HEADS:
        model = converted(name)
        built[name, "converted"] = (model, model)
        built[name, "packed"] = (mk.pack(model, data(8), program="packed", verify=False), model)  # compared here
    return built


# every head on the packed model; the converted model (the tiled batch in the graph) for a classifier and a regressor
CASES = [(name, "packed", call) for name in HEADS for call in CALLS] + [
    (name, "converted", call) for name in ("logits", "gaussian-regression") for call in CALLS
]
# torch.compile takes long (the packed MLP's head: 3 minutes on the loaded 2-core machine): one case by default
SLOW_ON_TORCH = [case for case in CASES if case[2] == "compiled" and case[:2] != ("logits", "converted")]


@pytest.mark.parametrize(
    ("name", "wrapped", "call"),
    [
        pytest.param(*case, marks=[pytest.mark.slow] if BACKEND == "torch" and case in SLOW_ON_TORCH else [])
        for case in CASES
    ],
    ids=["-".join(case) for case in CASES],
)
def test_each_value_equals_the_core_on_predicts_members(
    models: dict[tuple[str, str], tuple[keras.Model, keras.Model]], name: str, wrapped: str, call: str
) -> None:
    model, source = models[name, wrapped]
    arguments = HEADS[name][2]
    head = mk.with_uncertainty(model, **arguments)
    x = data(5)
    # a call keeps HeadSpec.outputs' order; predict on JAX returns the dict sorted (its tree utilities sort keys)
    assert_matches_oracle(CALLS[call](head, x), mk.predict(source, x), ordered=call == "eager", **arguments)


@pytest.mark.parametrize("batch", [1, 3])
def test_any_batch_size_even_one(models: dict[tuple[str, str], tuple[keras.Model, keras.Model]], batch: int) -> None:
    model, _ = models["logits", "converted"]
    head = mk.with_uncertainty(model)
    x = data(batch, seed=batch)
    assert_matches_oracle(head.predict(x, verbose=0), mk.predict(model, x), ordered=False)


def test_the_output_spec_names_the_heads_outputs(
    models: dict[tuple[str, str], tuple[keras.Model, keras.Model]],
) -> None:
    for name, (_, _, arguments) in HEADS.items():
        head = mk.with_uncertainty(models[name, "packed"][0], **arguments)
        spec = check_head(**arguments)
        assert list(head.output) == list(spec.outputs)
        classes = max(HEADS[name][0], 2)
        shapes = {key: tuple(tensor.shape) for key, tensor in head.output.items()}
        if spec.task == "classification":
            assert shapes == {key: (None, classes) if key == "probabilities" else (None,) for key in spec.outputs}
        else:
            assert set(shapes.values()) == {(None, 2) if spec.head is None else (None,)}


def test_training_is_ignored_dropout_off_and_moving_statistics(
    models: dict[tuple[str, str], tuple[keras.Model, keras.Model]],
) -> None:
    """A model with Dropout and BatchNormalization: ``training=True`` answers as inference does (as ``predict``)."""
    keras.utils.set_random_seed(3)
    model = mk.insert(dropout_model("logits"), N, 2.0, seed=1)  # keeps the dropouts, adds Masksembles
    assert any(isinstance(layer, layers.Dropout) for layer in model.layers)
    head = mk.with_uncertainty(model)
    x = data(6)
    inference = {key: to_numpy(value) for key, value in head(x, training=False).items()}
    for answer in (head(x, training=True), head(x)):
        for key, value in answer.items():
            np.testing.assert_array_equal(to_numpy(value), inference[key], err_msg=key)
    assert_matches_oracle(inference, mk.predict(model, x))


def test_a_model_that_stacks_its_members_names_the_axis() -> None:
    keras.utils.set_random_seed(4)
    inputs = keras.Input((5,))
    stacked = layers.Reshape((N, 3))(layers.Dense(N * 3)(inputs))  # (B, n, K)
    model = keras.Model(inputs, stacked)
    head = mk.with_uncertainty(model, member_axis=1)
    x = data(4)
    assert_matches_oracle(eager(head, x), to_numpy(model(x)), member_axis=1)
    with pytest.raises(ValueError, match=r"n=3 differs from 4"):
        mk.with_uncertainty(model, member_axis=1, n=3)
    with pytest.raises(ValueError, match="out of range"):
        mk.with_uncertainty(model, member_axis=3)


def test_keras_file_round_trip(models: dict[tuple[str, str], tuple[keras.Model, keras.Model]], tmp_path: Path) -> None:
    for wrapped in ("packed", "converted"):
        head = mk.with_uncertainty(models["gaussian-regression", wrapped][0], **HEADS["gaussian-regression"][2])
        path = tmp_path / f"{wrapped}.keras"
        head.save(path)
        loaded = keras.models.load_model(path)
        assert isinstance(loaded, mk.UncertaintyModel)
        x = data(3)
        for key, value in head.predict_on_batch(x).items():
            np.testing.assert_array_equal(loaded.predict_on_batch(x)[key], value, err_msg=key)


# --- what it refuses --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    [{"task": "segmentation"}, {"logits": 1}, {"head": "variance"}, {"task": "regression", "head": "std"}],
    ids=["task", "logits", "classification-head", "gaussian-head"],
)
def test_bad_arguments_raise_the_cores_errors(
    models: dict[tuple[str, str], tuple[keras.Model, keras.Model]], arguments: dict[str, Any]
) -> None:
    error, message = core_error(lambda: check_head(**arguments))
    with pytest.raises(error, match=message):
        mk.with_uncertainty(models["logits", "packed"][0], **arguments)


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_a_model_without_members_is_refused(task: str) -> None:
    with pytest.raises(ValueError, match="has no members"):
        mk.with_uncertainty(dropout_model("point-regression"), task=task)


def test_an_extracted_member_is_refused(models: dict[tuple[str, str], tuple[keras.Model, keras.Model]]) -> None:
    member = mk.extract_member(models["point-regression", "converted"][0], 0, data(4), verify=False)
    with pytest.raises(ValueError, match="computes one"):
        mk.with_uncertainty(member, task="regression")


def test_member_axis_and_n_must_agree_with_the_model(
    models: dict[tuple[str, str], tuple[keras.Model, keras.Model]],
) -> None:
    packed, model = models["logits", "packed"][0], models["logits", "converted"][0]
    with pytest.raises(ValueError, match="member_axis=0 differs from 1"):
        mk.with_uncertainty(packed, member_axis=0)
    with pytest.raises(ValueError, match="n=3 differs from 4"):
        mk.with_uncertainty(packed, n=3)
    with pytest.raises(ValueError, match="leave member_axis None"):
        mk.with_uncertainty(model, member_axis=0)
    error, message = core_error(lambda: __import__("masksembles_core").adapter.check_members([N], 3))
    with pytest.raises(error, match=message):
        mk.with_uncertainty(model, n=3)


def test_shapes_the_head_cannot_read_are_refused(
    models: dict[tuple[str, str], tuple[keras.Model, keras.Model]],
) -> None:
    with pytest.raises(ValueError, match="need a last axis of 2"):
        mk.with_uncertainty(models["logits", "packed"][0], task="regression", head="variance")  # 3 outputs
    inputs = keras.Input((5,))
    with pytest.raises(ValueError, match="one output"):
        mk.with_uncertainty(keras.Model(inputs, [layers.Dense(2)(inputs), layers.Dense(3)(inputs)]), member_axis=1)
    sequence = keras.Model(inputs, layers.Reshape((N, 1, 3))(layers.Dense(N * 3)(inputs)))
    with pytest.raises(ValueError, match=r"classification members must be \(n, B, K\)"):
        mk.with_uncertainty(sequence, member_axis=1)


def test_a_subclassed_model_is_a_type_error() -> None:
    class Subclassed(keras.Model):  # type: ignore[misc]
        def call(self, x: Any) -> Any:
            return x

    with pytest.raises(TypeError, match="functional or Sequential"):
        mk.with_uncertainty(Subclassed())


def test_eager_calls_check_the_members_as_the_core_does(
    models: dict[tuple[str, str], tuple[keras.Model, keras.Model]],
) -> None:
    """Probabilities read as logits, logits read as probabilities: the core's errors, eagerly."""
    x = data(4)
    probabilities, source = models["probabilities", "converted"]
    error, message = core_error(lambda: metrics.member_probabilities(mk.predict(source, x), logits=True))
    with pytest.raises(error, match=message):
        mk.with_uncertainty(probabilities)(x)
    logits, source = models["logits", "packed"]
    with pytest.raises(ValueError, match=r"members must be probabilities in \[0, 1\]; received values from") as raised:
        mk.with_uncertainty(logits, logits=False)(x)
    with pytest.raises(ValueError) as expected:  # the same message but for the digits of the range it prints
        metrics.member_probabilities(mk.predict(source, x), logits=False)
    assert "which look like" + str(expected.value).split("which look like")[1] in str(raised.value)


def test_the_head_layer_reports_its_outputs_in_the_specs_order() -> None:
    layer = mk.UncertaintyHead(member_axis=1)
    members = np.random.default_rng(0).normal(size=(2, N, 3)).astype("float32")
    assert tuple(layer(members)) == CLASSIFICATION_OUTPUTS
    assert mk.UncertaintyHead.from_config(layer.get_config()).get_config() == layer.get_config()
