"""gaussian_nll_loss: the core metric's value under jit and grad; Masksembles members (NNX) train on it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import masksembles_flax as mf
from masksembles_core import metrics
from masksembles_flax import nnx as masksembles_nnx
from tests.rounding import assert_rounding_close


def head_output(batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, 2)).astype(np.float32), rng.normal(size=batch).astype(np.float32)


@pytest.mark.parametrize("head", ["log_variance", "variance"])
def test_matches_the_core_metric_under_jit(head: str) -> None:
    output, target = head_output(64, seed=0)
    if head == "variance":
        output[:, 1] = np.logaddexp(0.0, output[:, 1])
    variance = np.exp(output[:, 1].astype(np.float64)) if head == "log_variance" else output[:, 1]
    expected = metrics.gaussian_nll(output[:, 0], variance, target)
    losses = jax.jit(lambda o, t: mf.gaussian_nll_loss(o, t, head=head))(jnp.asarray(output), jnp.asarray(target))
    assert losses.shape == (64,)
    assert float(losses.mean()) == pytest.approx(expected, rel=1e-5)
    trailing = mf.gaussian_nll_loss(jnp.asarray(output), jnp.asarray(target)[:, None], head=head)
    assert_rounding_close(trailing, losses)  # eager vs jit


def test_gradient_matches_the_formula_and_the_floor() -> None:
    output = jnp.array([[0.3, 0.5], [0.0, -80.0]])
    target = jnp.array([1.0, 0.5])
    gradient = jax.grad(lambda o: mf.gaussian_nll_loss(o, target, min_variance=1e-3).sum())(output)
    # d/dμ = -(y - μ) / σ², d/ds = 0.5 (1 - (y - μ)² / σ²) for s = log σ² above the floor
    expected_row = [-(1.0 - 0.3) / math.exp(0.5), 0.5 * (1.0 - 0.49 / math.exp(0.5))]
    np.testing.assert_allclose(np.asarray(gradient[0]), expected_row, rtol=1e-5)
    assert float(gradient[1, 1]) == 0.0  # below the floor the variance channel gets no gradient
    floor_loss = float(mf.gaussian_nll_loss(output, target, min_variance=1e-3)[1])
    assert floor_loss == pytest.approx(0.5 * (math.log(2 * math.pi * 1e-3) + 0.25 / 1e-3), rel=1e-5)


class Regressor(nnx.Module):
    """Linear -> ReLU -> Masksembles -> Linear with a (mean, log-variance) head, (B, 1) -> (B, 2)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(1, 32, rngs=rngs)
        self.ensemble = masksembles_nnx.Masksembles(32, 4, 2.0, seed=0)
        self.out = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.ensemble(nnx.relu(self.hidden(x))))


def test_masksembles_members_train_on_it_and_predict_returns_their_gaussians() -> None:
    rng = np.random.default_rng(0)
    x = np.linspace(-2.0, 2.0, 128, dtype=np.float32)[:, None]
    y = (2.0 * x[:, 0] + (0.1 + 0.3 * np.abs(x[:, 0])) * rng.normal(size=128)).astype(np.float32)
    model = Regressor(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model: Regressor, optimizer: nnx.Optimizer[Regressor]) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: mf.gaussian_nll_loss(m(x), y).mean())(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(150)]
    assert losses[-1] < losses[0] - 1.0
    members = np.asarray(mf.predict(model, jnp.asarray(x), 4))
    assert members.shape == (4, 128, 2)
    means, variances = members[..., 0], np.exp(members[..., 1].astype(np.float64))
    for k in range(4):  # the loss on member k's outputs is the core NLL of member k's Gaussian
        member_loss = float(mf.gaussian_nll_loss(jnp.asarray(members[k]), jnp.asarray(y)).mean())
        assert member_loss == pytest.approx(metrics.gaussian_nll(means[k], variances[k], y), rel=1e-4)
    assert metrics.uncertainty_split(means, variances)[1].mean() > 0.0  # the members differ


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"head must be one of \('log_variance', 'variance'\)"):
        mf.gaussian_nll_loss(jnp.zeros((4, 2)), jnp.zeros(4), head="std")
    with pytest.raises(TypeError, match=r"min_variance must be a finite number > 0"):
        mf.gaussian_nll_loss(jnp.zeros((4, 2)), jnp.zeros(4), min_variance=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expects outputs of shape \(B, \.\.\., 2\)"):
        mf.gaussian_nll_loss(jnp.zeros((4, 3)), jnp.zeros(4))
    with pytest.raises(ValueError, match=r"target of a Gaussian NLL loss must have shape \(4,\)"):
        mf.gaussian_nll_loss(jnp.zeros((4, 2)), jnp.zeros(3))
