"""A packed model, with and without the uncertainty head, through Keras' export formats and back, against ``predict``
and ``masksembles_core.heads.uncertainty_head``: a TensorFlow SavedModel served with ``tf.saved_model.load(path).serve``
(TensorFlow and JAX backends) at two batch sizes, one of them 1; ONNX in onnxruntime (TensorFlow, JAX and torch
backends, the same sizes); LiteRT in its interpreter (TensorFlow backend). Each test runs in the session of the
backends it names; docs/keras.md's "Deploy" blocks run on TensorFlow."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from keras import layers

import masksembles_keras as mk
from tests.keras.common import BACKEND
from tests.keras.heads import N, assert_matches_oracle, converted, data, tolerance

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "keras.md"
BATCHES = (1, 3)  # n = 4: neither is a multiple of it


def small_cnn() -> keras.Model:
    """Convolutions, BatchNormalization, pooling and Dense with Masksembles (``convert_dropout``, n = 4): the packed
    program's grouped convolutions and channel selects."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6, 6, 2))
    x = layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.Dropout(0.2)(layers.Conv2D(8, 3, padding="same", activation="relu")(layers.Dropout(0.2)(x)))
    x = layers.Dropout(0.2)(layers.GlobalAveragePooling2D()(x))
    return mk.convert_dropout(keras.Model(inputs, layers.Dense(3)(x)), N, 2.0, seed=0)


def images(batch: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, 6, 6, 2)).astype("float32")


@pytest.fixture(scope="module")
def models() -> dict[str, tuple[keras.Model, keras.Model, Callable[..., np.ndarray]]]:
    """What is exported -> (that model, the Masksembles model whose ``predict`` it must equal, its inputs)."""
    mlp, cnn = converted("logits"), small_cnn()
    packed = mk.pack(mlp, data(8), program="packed", verify=False)  # the tests compare it with predict
    packed_cnn = mk.pack(cnn, images(8), program="packed", verify=False)
    return {
        "packed": (packed, mlp, data),
        "packed-head": (mk.with_uncertainty(packed), mlp, data),
        "packed-cnn-head": (mk.with_uncertainty(packed_cnn), cnn, images),
    }


def assert_same_as_predict(answer: Any, wrapped: str, source: keras.Model, x: np.ndarray) -> None:
    """A packed model's (B, n, K) (a tensor, or a dict of one), or the head's dict (by name, in any order), against
    ``predict``'s members."""
    members = mk.predict(source, x)
    if wrapped == "packed":
        (value,) = answer.values() if isinstance(answer, dict) else (answer,)
        np.testing.assert_allclose(np.asarray(value), np.moveaxis(members, 0, 1), rtol=0, atol=tolerance(members))
    else:
        assert_matches_oracle({key: np.asarray(value) for key, value in answer.items()}, members, ordered=False)


def export(model: keras.Model, path: Path, export_format: str) -> None:
    if BACKEND == "torch":  # Keras 3.15 sets these filters in a block it leaves before it exports: they never apply
        import torch

        with warnings.catch_warnings():
            for message in ("Converting a tensor to a Python", "torch.as_tensor results are registered as constants"):
                warnings.filterwarnings("ignore", message, torch.jit.TracerWarning)
            model.export(str(path), format=export_format, verbose=False)
    else:
        model.export(str(path), format=export_format, verbose=False)


def export_and_load(model: keras.Model, path: Path, export_format: str) -> Callable[[np.ndarray], Any]:
    """``model.export(path, format=export_format)``, then the artifact loaded by its runtime, as a function of x."""
    export(model, path, export_format)
    if export_format == "tf_saved_model":
        import tensorflow as tf

        loaded = tf.saved_model.load(str(path))  # kept alive by the closure: TensorFlow frees its variables with it
        return lambda x: loaded.serve(x)
    if export_format == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        (feed,) = session.get_inputs()
        names = [output.name for output in session.get_outputs()]
        if isinstance(model, mk.UncertaintyModel) and BACKEND != "tensorflow":  # the exporter names graph nodes:
            names = list(model.get_layer("uncertainty").spec.outputs)  # torch's outputs are in the call's order,
            if BACKEND == "jax":  # jax2onnx's in the flattened dict's (JAX's pytrees sort a dict's keys)
                names = sorted(names)
        return lambda x: dict(zip(names, session.run(None, {feed.name: x}), strict=True))
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_path=str(path)).get_signature_runner()
    (feed,) = runner.get_input_details()
    return lambda x: runner(**{feed: x})


# format -> (the backends whose Keras exports it, the file name, the batch sizes it runs)
FORMATS = {
    "tf_saved_model": (("tensorflow", "jax"), "served", BATCHES),
    "onnx": (("tensorflow", "jax", "torch"), "model.onnx", BATCHES),
    "litert": (("tensorflow",), "model.tflite", (3,)),  # a fixed batch (the one it was converted for)
}


@pytest.mark.parametrize("wrapped", ["packed", "packed-head", "packed-cnn-head"])
@pytest.mark.parametrize("export_format", list(FORMATS))
def test_the_exported_model_answers_as_predict(
    models: dict[str, tuple[keras.Model, keras.Model, Callable[..., np.ndarray]]],
    export_format: str,
    wrapped: str,
    tmp_path: Path,
) -> None:
    backends, name, batches = FORMATS[export_format]
    if BACKEND not in backends:
        pytest.skip(f"{export_format} is tested on {backends} (docs/keras.md's Deploy table says why not here)")
    model, source, inputs = models[wrapped]
    model(inputs(2))  # Keras' ONNX export refuses a model never called ("The model provided has never called")
    run = export_and_load(model, tmp_path / name, export_format)
    for batch in batches:
        x = inputs(batch, seed=batch)
        assert_same_as_predict(run(x), wrapped, source, x)


def guide_blocks() -> list[str]:
    """The Python blocks of docs/keras.md's "Deploy" section."""
    section = GUIDE.read_text().split("\n## Deploy", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the guide's recipe imports tensorflow: the TensorFlow session")
def test_the_guide_deploy_section_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the recipe writes its artifacts to the working directory
    blocks = guide_blocks()
    assert blocks
    namespace: dict[str, Any] = {"__name__": "guide_deploy"}
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/keras.md Deploy block {index}", "exec"), namespace)
    model, x = namespace["model"], namespace["x"]
    assert_matches_oracle(namespace["answer"], mk.predict(model, x))
    assert_matches_oracle(namespace["served_answer"], mk.predict(model, x[:1]), ordered=False)
