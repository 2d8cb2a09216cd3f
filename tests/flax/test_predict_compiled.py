"""predict runs an nnx.Module, and a functools.partial of a linen apply, as one jitted program, traced once per model
structure and shape; eagerly where it cannot be traced; results equal the eager computation within float32 rounding."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import masksembles_flax as mf
from masksembles_flax import _inference
from masksembles_flax import linen as ml
from masksembles_flax import nnx as mn

N = 3
# jitted and eager programs may fuse and order float32 operations differently: a few hundred roundings of a value
TOLERANCE = 256 * float(np.finfo(np.float32).eps)


class Counting(nnx.Module):
    """Linear, BatchNorm, Masksembles, Linear; ``runs`` counts the Python runs of ``__call__`` (one per trace where
    jitted, one per call where eager). ``to_numpy``: the call reads its hidden values as NumPy, which no trace can."""

    runs = 0

    def __init__(self, seed: int, to_numpy: bool = False) -> None:
        rngs = nnx.Rngs(seed)
        self.hidden, self.norm = nnx.Linear(5, 12, rngs=rngs), nnx.BatchNorm(12, rngs=rngs)
        self.masks, self.head = mn.Masksembles(12, N, 2.0, seed=0), nnx.Linear(12, 2, rngs=rngs)
        self.norm.mean.set_value(jax.random.normal(jax.random.key(seed), (12,)))  # inference BatchNorm does something
        self.to_numpy = to_numpy

    def __call__(self, x: jax.Array) -> jax.Array:
        Counting.runs += 1
        hidden = self.masks(nnx.relu(self.norm(self.hidden(x))))
        if self.to_numpy:
            hidden = jnp.asarray(np.asarray(hidden) * 0.5)
        return self.head(hidden)


def samples(batch: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(batch).normal(size=(batch, 5)).astype(np.float32))


def eager_members(model: nnx.Module, x: jax.Array, n: int = N) -> np.ndarray:
    """The members computed operation by operation, the model in eval mode (a copy: the model keeps its mode)."""
    evaluated = nnx.merge(*nnx.split(model))
    evaluated.eval()
    with jax.disable_jit():
        return np.asarray(mf.untile(evaluated(mf.tile(x, n)), n))


def assert_close(actual: jax.Array, expected: np.ndarray) -> None:
    actual = np.asarray(actual)
    np.testing.assert_allclose(actual, expected, rtol=TOLERANCE, atol=TOLERANCE * float(np.abs(expected).max()))


def test_nnx_predict_traces_once_per_structure_and_shape_and_equals_the_eager_members() -> None:
    model, other = Counting(seed=0), Counting(seed=1)  # the same structure, other weights
    x = samples(7)
    expected, other_expected = eager_members(model, x), eager_members(other, x)
    Counting.runs = 0
    assert_close(mf.predict(model, x), expected)
    assert Counting.runs == 1
    assert_close(mf.predict(model, x), expected)
    assert_close(mf.predict(other, x), other_expected)
    assert Counting.runs == 1, "a second call, or a model of the same structure, traced again"
    model.train()  # predict runs in eval mode whatever mode the model is in, and leaves its mode alone
    assert_close(mf.predict(model, x), expected)
    assert model.norm.use_running_average is False


def test_an_nnx_model_that_cannot_be_traced_runs_eagerly_with_the_same_result() -> None:
    model = Counting(seed=0, to_numpy=True)
    x = samples(6)
    expected = eager_members(model, x)
    np.testing.assert_array_equal(np.asarray(mf.predict(model, x)), expected)  # eager both: the same operations
    Counting.runs = 0
    np.testing.assert_array_equal(np.asarray(mf.predict(model, x)), expected)
    assert Counting.runs == 1, "after the first failure predict runs it eagerly, without a new try to trace it"


class LinenNet(nn.Module):
    runs = 0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        type(self).runs += 1
        x = ml.Masksembles(n=N, scale=2.0, seed=0)(nn.relu(nn.Dense(12)(x)), deterministic=True)
        return nn.Dense(2)(x)


def test_a_partial_of_a_linen_apply_traces_once_and_equals_the_eager_members() -> None:
    x, net = samples(5), LinenNet()
    variables = net.init(jax.random.key(0), x)
    doubled = jax.tree.map(lambda v: v * 2 if v.dtype == jnp.float32 else v, variables)
    with jax.disable_jit():
        expected = [np.asarray(mf.untile(net.apply(v, mf.tile(x, N)), N)) for v in (variables, doubled)]
    LinenNet.runs = 0
    assert_close(mf.predict(functools.partial(net.apply, variables), x), expected[0])
    traced = LinenNet.runs  # n read by one abstract trace, then the jitted program's trace
    assert_close(mf.predict(functools.partial(net.apply, variables), x), expected[0])
    assert_close(mf.predict(functools.partial(net.apply, doubled), x), expected[1])  # other arrays, the same key
    assert LinenNet.runs == traced, "a new partial of the same apply and variable structure traced again"
    assert_close(mf.predict(lambda b: net.apply(variables, b), x), expected[0])  # any function: as it is


def test_nnx_predict_follows_every_change_of_the_model() -> None:
    """The cache is keyed on the graph definition: new values of the same structure run the cached program (no
    stale arrays), and a mutated structure (a layer swapped, other shapes, another n) gets its own program and n."""
    model, x = Counting(seed=0), samples(4)
    mf.predict(model, x)
    model.head.kernel.set_value(model.head.kernel.get_value() * 2)  # new values, the same structure
    expected = eager_members(model, x)
    Counting.runs = 0
    assert_close(mf.predict(model, x), expected)
    assert Counting.runs == 0, "new values of the same shapes traced again"
    model.head = nnx.Linear(12, 3, rngs=nnx.Rngs(5))  # other shapes
    assert_close(mf.predict(model, x), eager_members(model, x))
    assert np.asarray(mf.predict(model, x)).shape == (N, 4, 3)
    model.masks = mn.Masksembles(12, 2, 2.0, seed=1)  # another n: read again, checked again
    expected = eager_members(model, x, n=2)
    assert_close(mf.predict(model, x), expected)
    assert np.asarray(mf.predict(model, x)).shape == (2, 4, 3)
    with pytest.raises(ValueError, match="n=3 does not match"):
        mf.predict(model, x, n=3)
    model.masks = mn.Masksembles(12, N, 2.0, seed=0)  # back to a structure seen before: its cached program and n
    assert_close(mf.predict(model, x), eager_members(model, x))


def test_an_nnx_model_with_an_unhashable_static_attribute_runs_eagerly() -> None:
    model, x = Counting(seed=0), samples(3)
    model.table = nnx.static(bytearray(b"unhashable"))  # in the graph definition, which then cannot be hashed
    expected = eager_members(model, x)
    Counting.runs = 0
    np.testing.assert_array_equal(np.asarray(mf.predict(model, x)), expected)  # eager both: the same operations
    assert Counting.runs == 1
    with pytest.raises(ValueError, match="n=2 does not match"):
        mf.predict(model, x, n=2)


def test_a_partial_follows_other_variable_shapes_and_an_unhashable_bound_value_runs_as_it_is() -> None:
    net = LinenNet()
    for features in (5, 7):  # the same apply and structure, other kernel shapes: another signature
        x = jnp.asarray(np.random.default_rng(features).normal(size=(3, features)).astype(np.float32))
        variables = net.init(jax.random.key(features), x)
        with jax.disable_jit():
            expected = np.asarray(mf.untile(net.apply(variables, mf.tile(x, N)), N))
        assert_close(mf.predict(functools.partial(net.apply, variables), x), expected)

    def apply_with(variables: Any, options: bytearray, batch: jax.Array) -> jax.Array:
        return net.apply(variables, batch)

    x = samples(3)
    variables = net.init(jax.random.key(0), x)
    model = functools.partial(apply_with, variables, bytearray(b"unhashable"))
    with jax.disable_jit():
        expected = np.asarray(mf.untile(net.apply(variables, mf.tile(x, N)), N))
    assert_close(mf.predict(model, x), expected)
    LinenNet.runs = 0
    assert_close(mf.predict(model, x), expected)
    assert LinenNet.runs >= 1, "an unhashable bound value: run as it is (eagerly) on every call"


def test_a_refused_n_raises_on_every_call_and_leaves_the_compiled_program_in_place() -> None:
    """``n`` is checked while the program traces (once per ``n`` and shapes, not on every call): a wrong ``n`` raises
    the eager call's refusal every time, and the model still runs compiled afterwards, n given or read."""
    x, net = samples(4), LinenNet()
    variables = net.init(jax.random.key(0), x)
    linen_model = functools.partial(net.apply, variables)
    nnx_model = Counting(seed=0)
    expected = {"linen": np.asarray(mf.predict(linen_model, x)), "nnx": eager_members(nnx_model, x)}
    for name, model, count in (("linen", linen_model, LinenNet), ("nnx", nnx_model, Counting)):
        assert_close(mf.predict(model, x, n=N), expected[name])  # n given and n read: one result
        for _ in range(2):
            with pytest.raises(ValueError, match=f"n=2 does not match .* layers, which have n={N}"):
                mf.predict(model, x, n=2)
        count.runs = 0
        assert_close(mf.predict(model, x), expected[name])
        assert_close(mf.predict(model, x, n=N), expected[name])
        assert count.runs == 0, f"{name}: a refused n left the model running eagerly or traced again"


def test_the_program_cache_keeps_the_last_made() -> None:
    programs = _inference._Programs(limit=2)
    made = [_inference._Program(lambda arrays, x, n: None) for _ in range(3)]
    for key, program in enumerate(made):
        assert programs.put(key, program) is program
    assert programs.get(0) is None
    assert programs.get(1) is made[1] and programs.get(2) is made[2]


class Activated(nn.Module):
    """Dense, an activation, Masksembles, Dense: two values of ``activation`` are two models with the same variables."""

    activation: str = "relu"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = nn.Dense(12)(x)
        hidden = nn.relu(hidden) if self.activation == "relu" else jnp.tanh(hidden)
        return nn.Dense(2)(ml.Masksembles(n=N, scale=2.0, seed=0)(hidden, deterministic=True))


CURRENT = {"model": Activated("relu")}  # a model a function reads from outside itself, replaced below


def test_a_partial_of_a_function_that_reads_its_model_from_outside_follows_the_model_it_reads() -> None:
    """The function object stays the same while the model it reads changes: a program cached on it would compute the
    first model (as it did before only a linen method's partial was cached)."""

    def apply(variables: Any, batch: jax.Array) -> jax.Array:
        return CURRENT["model"].apply(variables, batch)

    x = samples(4)
    variables = Activated("relu").init(jax.random.key(0), x)
    for activation in ("relu", "tanh"):
        CURRENT["model"] = Activated(activation)
        with jax.disable_jit():
            expected = np.asarray(mf.untile(CURRENT["model"].apply(variables, mf.tile(x, N)), N))
        assert_close(mf.predict(functools.partial(apply, variables), x), expected)
    assert not np.allclose(expected, np.asarray(mf.untile(Activated("relu").apply(variables, mf.tile(x, N)), N)))
