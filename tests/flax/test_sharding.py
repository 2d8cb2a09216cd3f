"""A batch sharded over 4 devices with NamedSharding under jit gives the outputs of the unsharded batch.

Needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4 (the flax nox session and tests/flax/conftest.py
set it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import masksembles_core.adapter as mca
from masksembles_flax import linen as masksembles_linen
from masksembles_flax import nnx as masksembles_nnx
from tests.flax.common import LinenMLP, NnxMLP, assert_same_bits, train_linen_mlp

KEY = jax.random.key(0)


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    devices = jax.devices("cpu")
    assert len(devices) >= 4, (
        f"{len(devices)} CPU device(s); set XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax loads"
    )
    return Mesh(np.array(devices[:4]), ("batch",))


def batch_sharded(mesh: Mesh, tree: Any) -> Any:
    return jax.device_put(tree, NamedSharding(mesh, P("batch")))


def replicated(mesh: Mesh, tree: Any) -> Any:
    return jax.device_put(tree, NamedSharding(mesh, P()))


Forward = Callable[[Any, jax.Array, jax.Array], jax.Array]
ForwardFactory = Callable[[int, str], tuple[Any, Forward]]


def linen_forward(n: int, mode: str) -> tuple[Any, Forward]:
    layer = masksembles_linen.Masksembles(n=n, scale=2.0, seed=0, mode=mode)
    variables = layer.init(KEY, jnp.zeros((4, 6, 6, 12)), deterministic=True)
    return variables, lambda variables, x, key: layer.apply(variables, x, deterministic=False, rng=key)


def nnx_forward(n: int, mode: str) -> tuple[Any, Forward]:
    graphdef, state = nnx.split(masksembles_nnx.Masksembles(12, n, 2.0, seed=0, mode=mode))
    return state, lambda state, x, key: nnx.merge(graphdef, state)(x, deterministic=False, rngs=key)


@pytest.mark.parametrize("mode", mca.MODES)
@pytest.mark.parametrize("n", [4, 3], ids=["n4-divides", "n3-gather"])
@pytest.mark.parametrize("api", [linen_forward, nnx_forward], ids=["linen", "nnx"])
def test_sharded_forward_equals_unsharded(mesh: Mesh, api: ForwardFactory, n: int, mode: str) -> None:
    state, forward = api(n, mode)
    x = jax.random.normal(KEY, (16, 6, 6, 12))
    key = jax.random.key(3)
    expected = jax.jit(forward)(state, x, key)
    x_sharded = batch_sharded(mesh, x)
    y = jax.jit(forward)(replicated(mesh, state), x_sharded, key)
    assert len(x_sharded.sharding.device_set) == 4
    assert len(y.sharding.device_set) == 4
    assert_same_bits(y, np.asarray(expected))


def regression_data() -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(KEY, (32, 3))
    return x, jnp.sin(x.sum(axis=1, keepdims=True))


def assert_trees_close(actual: Any, expected: Any) -> None:
    """Sharded reductions sum in another order, so trained values agree to float32 rounding, not bit for bit."""
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-6), actual, expected)


def train_linen(mesh: Mesh | None, mode: str) -> tuple[list[float], Any]:
    model = LinenMLP(mode=mode)
    x, target = regression_data()
    variables = model.init(KEY, x)
    if mesh is not None:
        variables, x, target = replicated(mesh, variables), batch_sharded(mesh, x), batch_sharded(mesh, target)
    return train_linen_mlp(model, variables, x, target, jax.random.split(KEY, 3))


def train_nnx(mesh: Mesh | None, mode: str) -> tuple[list[float], Any]:
    model = NnxMLP(mode=mode, rngs=nnx.Rngs(params=0, dropout=1))
    x, target = regression_data()
    if mesh is not None:
        nnx.update(model, replicated(mesh, nnx.state(model)))
        x, target = batch_sharded(mesh, x), batch_sharded(mesh, target)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model: NnxMLP, optimizer: nnx.Optimizer[NnxMLP], x: jax.Array, target: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda model: jnp.mean((model(x) - target) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    model.train()
    losses = [float(step(model, optimizer, x, target)) for _ in range(3)]
    return losses, nnx.state(model, nnx.Param, masksembles_nnx.Masks)


@pytest.mark.parametrize("mode", mca.MODES)
@pytest.mark.parametrize("train", [train_linen, train_nnx], ids=["linen", "nnx"])
def test_sharded_optax_training_equals_unsharded(
    mesh: Mesh, train: Callable[[Mesh | None, str], tuple[list[float], Any]], mode: str
) -> None:
    losses, state = train(None, mode)
    sharded_losses, sharded_state = train(mesh, mode)
    np.testing.assert_allclose(sharded_losses, losses, rtol=2e-5)
    masks, sharded_masks = (
        [leaf for leaf in jax.tree.leaves(tree) if leaf.dtype == jnp.bool_] for tree in (state, sharded_state)
    )
    assert len(masks) == 1
    assert np.array_equal(sharded_masks[0], masks[0])
    assert_trees_close(sharded_state, state)
