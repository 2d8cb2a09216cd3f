"""predict runs the model compiled (tf.function on TensorFlow, jax.jit on JAX), once per model and shape, and eagerly
where it cannot be compiled; its results equal the eager call's within float32 rounding."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
from keras import ops

import masksembles_core as mc
import masksembles_keras as mk
from tests.keras.common import BACKEND

N = 3
# compiled and eager programs may fuse and order float32 operations differently: a few hundred roundings of a value
TOLERANCE = 256 * float(np.finfo(np.float32).eps)


class Counting(keras.Model):
    """Dense, Masksembles, Dense; counts the Python runs of ``call``: one per trace where compiled, per call where
    eager. ``to_numpy``: the call reads its hidden values as NumPy, which no trace can do."""

    def __init__(self, to_numpy: bool = False) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(12, activation="relu")
        self.norm = keras.layers.BatchNormalization()
        self.masks = mk.Masksembles(N, 2.0, seed=0)
        self.head = keras.layers.Dense(2)
        self.to_numpy = to_numpy
        self.runs = 0

    def call(self, x: Any, training: bool | None = None) -> Any:
        self.runs += 1
        hidden = self.masks(self.norm(self.hidden(x), training=training))
        if self.to_numpy:
            hidden = ops.convert_to_tensor(np.asarray(ops.convert_to_numpy(hidden)) * 0.5)
        return self.head(hidden)


def built(model: keras.Model) -> keras.Model:
    model(np.zeros((N, 5), np.float32))
    rng = np.random.default_rng(1)  # moving statistics other than 0 and 1, so inference BatchNorm does something
    model.norm.moving_mean.assign(rng.normal(size=12).astype(np.float32))
    model.norm.moving_variance.assign(rng.uniform(0.5, 2.0, size=12).astype(np.float32))
    model.runs = 0
    return model


def samples(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).normal(size=(batch, 5)).astype(np.float32)


def eager_members(model: keras.Model, x: np.ndarray) -> np.ndarray:
    """What predict computes, as the eager call on the whole tiled batch."""
    return mc.untile(ops.convert_to_numpy(model(mc.tile(x, N), training=False)), N)


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(actual, expected, rtol=TOLERANCE, atol=TOLERANCE * float(np.abs(expected).max()))


@pytest.mark.skipif(BACKEND == "torch", reason="Keras runs inference eagerly on torch: nothing is traced")
def test_a_second_call_and_a_smaller_last_chunk_do_not_trace_again() -> None:
    model = built(Counting())
    x = samples(8)
    mk.predict(model, x)
    traced = model.runs
    assert traced >= 1
    mk.predict(model, x)
    assert model.runs == traced, "the same shapes traced again"
    mk.predict(model, x, batch_size=4)  # chunks of 4: a new shape, traced once
    for batch in (10, 7, 4, 1):  # last chunks of 2, 3, 4 and 1 samples, padded to 4
        expected = eager_members(model, samples(batch))  # an eager run (counted) before predict's
        before = model.runs
        members = mk.predict(model, samples(batch), batch_size=4)
        assert model.runs == before, f"a batch of {batch} in chunks of 4 traced again"
        assert members.shape == (N, batch, 2)
        assert_close(members, expected)


def test_compiled_predict_equals_the_eager_call_within_float32_rounding() -> None:
    model = built(Counting())
    x = samples(11)
    expected = eager_members(model, x)
    assert_close(mk.predict(model, x), expected)
    assert_close(mk.predict(model, x), expected)
    chunked = np.concatenate([eager_members(model, x[start : start + 4]) for start in (0, 4, 8)], axis=1)
    assert_close(mk.predict(model, x, batch_size=4), chunked)


def test_a_model_that_cannot_be_compiled_runs_eagerly_with_the_same_result() -> None:
    model = built(Counting(to_numpy=True))
    x = samples(6)
    expected = eager_members(model, x)
    np.testing.assert_array_equal(mk.predict(model, x), expected)  # eager both: the same operations
    model.runs = 0
    chunked = mk.predict(model, x, batch_size=4)
    assert model.runs == 2, "after the first failure each chunk runs eagerly, without a new try to compile"
    np.testing.assert_array_equal(
        chunked, np.concatenate([eager_members(model, x[:4]), eager_members(model, x[4:])], 1)
    )
