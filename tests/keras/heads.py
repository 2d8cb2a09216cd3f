"""Small Masksembles models for the uncertainty head's tests, and the comparison with the core's NumPy head."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
from keras import layers

import masksembles_keras as mk
from masksembles_core.heads import uncertainty_head
from tests.keras.common import to_numpy

N = 4
EPS32 = float(np.finfo(np.float32).eps)

# name -> (outputs of the last Dense, its activation, with_uncertainty's arguments)
HEADS: dict[str, tuple[int, str | None, dict[str, Any]]] = {
    "logits": (3, None, {}),
    "sigmoid-logit": (1, None, {}),
    "probabilities": (3, "softmax", {"logits": False}),
    "point-regression": (2, None, {"task": "regression"}),
    "gaussian-regression": (2, None, {"task": "regression", "head": "log_variance"}),
}


def dropout_model(name: str, seed: int = 0) -> keras.Model:
    """An MC-Dropout MLP with BatchNormalization, the last Dense as ``HEADS[name]`` says; seeded weights."""
    outputs, activation, _ = HEADS[name]
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    hidden = layers.Dense(12, activation="relu")(inputs)
    hidden = layers.BatchNormalization()(hidden)
    hidden = layers.Dropout(0.5)(hidden)
    hidden = layers.Dense(8, activation="tanh")(hidden)
    hidden = layers.Dropout(0.5)(hidden)
    model = keras.Model(inputs, layers.Dense(outputs, activation=activation)(hidden), name=name.replace("-", "_"))
    batch_norm = model.layers[2]
    batch_norm.moving_mean.assign(np.linspace(-0.5, 0.5, 12).astype("float32"))
    batch_norm.moving_variance.assign(np.linspace(0.5, 2.0, 12).astype("float32"))
    return model


def converted(name: str) -> keras.Model:
    """``dropout_model(name)`` with its dropouts replaced by Masksembles (n = 4)."""
    return mk.convert_dropout(dropout_model(name), N, 2.0, seed=0)


def data(batch: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, 5)).astype("float32")


def tolerance(members: np.ndarray) -> float:
    """Float32 rounding of the members (packed and tiled programs differ in summation order) and of the head's own
    log-softmax, sums and means: a few dozen units of float32 roundoff of the members' scale."""
    return 64 * EPS32 * max(1.0, float(np.abs(members).max()))


def assert_matches_oracle(
    answer: Mapping[str, Any], members: np.ndarray, *, ordered: bool = True, **arguments: Any
) -> None:
    """Each value of ``answer`` equals ``uncertainty_head(members, **arguments)`` within ``tolerance``; ``ordered``:
    its keys in ``HeadSpec.outputs``' order (exported formats sort them)."""
    expected = uncertainty_head(members, **arguments)
    assert (list(answer) if ordered else sorted(answer)) == (list(expected) if ordered else sorted(expected))
    tol = tolerance(members)
    for key, value in expected.items():
        np.testing.assert_allclose(to_numpy(answer[key]), value, rtol=tol, atol=tol, err_msg=key)
