"""GaussianNLL: the core metric's value, Masksembles members train on it in ``fit``, and it is saved with the model."""

from __future__ import annotations

import math
from pathlib import Path

import keras
import numpy as np
import pytest
from keras import ops

import masksembles_keras as mk
from masksembles_core import metrics
from tests.keras.common import JIT_COMPILE, to_numpy


def head_output(batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, 2)).astype(np.float32), rng.normal(size=batch).astype(np.float32)


def softplus(x: np.ndarray) -> np.ndarray:
    result: np.ndarray = np.logaddexp(0.0, x.astype(np.float64))
    return result


@pytest.mark.parametrize("head", ["log_variance", "variance"])
def test_matches_the_core_metric(head: str) -> None:
    output, target = head_output(64, seed=0)
    if head == "variance":
        output[:, 1] = softplus(output[:, 1])
    variance = np.exp(output[:, 1].astype(np.float64)) if head == "log_variance" else output[:, 1]
    expected = metrics.gaussian_nll(output[:, 0], variance, target)
    loss = mk.GaussianNLL(head=head)
    assert float(to_numpy(loss(target, output))) == pytest.approx(expected, rel=1e-5)
    assert float(to_numpy(loss(target[:, None], output))) == pytest.approx(expected, rel=1e-5)
    weights = np.r_[np.ones(32), np.zeros(32)].astype(np.float32)
    first_half = metrics.gaussian_nll(output[:32, 0], variance[:32], target[:32])
    assert float(to_numpy(loss(target, output, sample_weight=weights))) == pytest.approx(first_half / 2, rel=1e-5)
    per_element = keras.losses.Loss.__call__(mk.GaussianNLL(head=head, reduction=None), target, output)
    assert to_numpy(per_element).shape == (64,)


def test_the_variance_floor() -> None:
    output = np.array([[0.0, -80.0]], dtype=np.float32)
    loss = float(to_numpy(mk.GaussianNLL(min_variance=1e-3)(np.array([0.5], dtype=np.float32), output)))
    assert loss == pytest.approx(0.5 * (math.log(2 * math.pi * 1e-3) + 0.25 / 1e-3), rel=1e-5)


@pytest.mark.parametrize("jit_compile", JIT_COMPILE)
def test_masksembles_members_train_on_it_and_predict_returns_their_gaussians(jit_compile: bool, tmp_path: Path) -> None:
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = np.linspace(-2.0, 2.0, 128, dtype=np.float32)[:, None]
    y = (2.0 * x[:, 0] + (0.1 + 0.3 * np.abs(x[:, 0])) * rng.normal(size=128)).astype(np.float32)
    model = keras.Sequential(
        [
            keras.Input((1,)),
            keras.layers.Dense(32, activation="relu"),
            mk.Masksembles(n=4, scale=2.0, seed=0),
            keras.layers.Dense(2),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), loss=mk.GaussianNLL(), jit_compile=jit_compile)
    history = model.fit(x, y, batch_size=32, epochs=40, shuffle=True, verbose=0).history["loss"]
    assert history[-1] < history[0] - 1.0
    members = mk.predict(model, x, n=4)
    assert members.shape == (4, 128, 2)
    means, variances = members[..., 0], np.exp(members[..., 1].astype(np.float64))
    for k in range(4):  # the loss on member k's outputs is the core NLL of member k's Gaussian
        member_loss = float(to_numpy(mk.GaussianNLL()(y, members[k])))
        assert member_loss == pytest.approx(metrics.gaussian_nll(means[k], variances[k], y), rel=1e-4)
    assert metrics.uncertainty_split(means, variances)[1].mean() > 0.0  # the members differ
    path = tmp_path / "regressor.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(mk.predict(loaded, x, n=4), members)
    assert loaded.evaluate(x, y, verbose=0) == pytest.approx(model.evaluate(x, y, verbose=0), rel=1e-6)


def test_config_round_trip() -> None:
    loss = mk.GaussianNLL(head="variance", min_variance=1e-4, name="nll")
    restored = keras.losses.deserialize(keras.losses.serialize(loss))
    assert isinstance(restored, mk.GaussianNLL)
    assert (restored.head, restored.min_variance, restored.name) == ("variance", 1e-4, "nll")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"head must be one of \('log_variance', 'variance'\)"):
        mk.GaussianNLL(head="std")
    with pytest.raises(ValueError, match=r"min_variance must be a finite number > 0"):
        mk.GaussianNLL(min_variance=-1.0)
    with pytest.raises(ValueError, match=r"expects outputs of shape \(B, \.\.\., 2\)"):
        mk.GaussianNLL()(ops.zeros((4,)), ops.zeros((4, 3)))
    with pytest.raises(ValueError, match=r"target of a Gaussian NLL loss must have shape \(4,\) \(or \(4, 1\)\)"):
        mk.GaussianNLL()(ops.zeros((4, 2)), ops.zeros((4, 2)))
