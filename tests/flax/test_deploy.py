"""Deployment with jax.export: packed NNX models, with and without the uncertainty head, and linen heads, exported
with a symbolic batch, serialized, deserialized and called at two batch sizes (one of them 1), equal to predict and
masksembles_core.heads.uncertainty_head; what cannot take a symbolic batch is a named error."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import masksembles_flax as mf
from masksembles_core.heads import uncertainty_head
from masksembles_flax import _packing
from masksembles_flax import linen as ml
from masksembles_flax import nnx as mn
from tests.flax.common import assert_float32_close, assert_head_equals

N = 4
BATCHES = (1, 3)


class Conv(nnx.Module):
    """Conv -> BatchNorm -> relu -> mean over space -> Linear -> relu -> Linear: a tiny image classifier for insert."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv, self.norm = nnx.Conv(3, 8, (3, 3), rngs=rngs), nnx.BatchNorm(8, rngs=rngs)
        self.hidden, self.out = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = nnx.relu(self.norm(self.conv(x))).mean(axis=(1, 2))
        return self.out(nnx.relu(self.hidden(h)))


class BatchMean(nnx.Module):
    """Subtracts the batch mean after a Masksembles layer: the batch size is a value of the program (a mean's count)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden, self.out = nnx.Linear(5, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)
        self.masks = mn.Masksembles(8, N, 2.0, seed=0)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.masks(jnp.tanh(self.hidden(x)))
        return self.out(h - h.mean(axis=0))


def images(batch: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(batch).normal(size=(batch, 6, 6, 3)), jnp.float32)


def inserted_conv() -> nnx.Module:
    model = mn.insert(Conv(nnx.Rngs(0)), N, 2.0, seed=0)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def round_trip(exported: jax.export.Exported) -> jax.export.Exported:
    """Serialized to bytes and back: what a server loads."""
    blob = exported.serialize()
    assert isinstance(blob, bytearray | bytes)
    return jax.export.deserialize(blob)


def symbolic_batch(exported: jax.export.Exported) -> None:
    (aval,) = exported.in_avals
    assert jax.export.is_symbolic_dim(aval.shape[0]) and str(aval.shape[0]) == "b"


@pytest.mark.parametrize("head", [False, True], ids=["members", "head"])
def test_packed_model_exports_with_a_symbolic_batch(head: bool) -> None:
    model = inserted_conv()
    packed = mn.pack(model, images(2), program="packed")
    restored = round_trip(mn.export(mn.with_uncertainty(packed) if head else packed, images(2)))
    symbolic_batch(restored)
    for batch in BATCHES:
        x = images(batch)
        members = np.asarray(mf.predict(model, x), np.float64)
        if head:
            assert_head_equals(restored.call(x), uncertainty_head(members))
        else:
            assert_float32_close(restored.call(x), members)


def test_inserted_model_with_the_head_exports_with_a_symbolic_batch() -> None:
    """The head tiles the batch in the graph; insert's record of the batch size stays symbolic."""
    model = inserted_conv()
    restored = round_trip(mn.export(mn.with_uncertainty(model), images(2)))
    for batch in BATCHES:
        x = images(batch)
        assert_head_equals(restored.call(x), uncertainty_head(np.asarray(mf.predict(model, x))))


def test_regression_head_on_a_program_that_reads_the_batch_size() -> None:
    model = BatchMean(nnx.Rngs(0))
    packed = mn.pack(model, jnp.ones((3, 5)), program="packed")
    restored = round_trip(mn.export(mn.with_uncertainty(packed, task="regression"), jnp.ones((3, 5))))
    for batch in BATCHES:
        x = jnp.asarray(np.random.default_rng(batch).normal(size=(batch, 5)), jnp.float32)
        expected = uncertainty_head(np.asarray(mf.predict(model, x)), task="regression")
        assert_head_equals(restored.call(x), expected)


def test_a_program_run_in_chunks_runs_the_symbolic_batch_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks need the batch's size: exported, the whole batch runs in one call, with the same results."""
    monkeypatch.setattr(_packing, "CHUNK_BYTES", 1)
    monkeypatch.setattr(_packing, "CHUNK_SAMPLES", 2)
    model = inserted_conv()
    packed = mn.pack(model, images(2), program="packed")
    assert packed.chunk(3) == 2
    assert packed.chunk(jax.export.symbolic_shape("b")[0]) == 0
    restored = round_trip(mn.export(packed, images(2)))
    x = images(3)
    assert_float32_close(restored.call(x), np.asarray(packed(x), np.float64))


def test_a_model_that_needs_its_batch_size_is_a_named_error_and_exports_at_a_fixed_batch() -> None:
    class Branches(Conv):
        def __call__(self, x: jax.Array) -> jax.Array:
            y = super().__call__(x)
            return y if x.shape[0] > 6 else 2.0 * y  # Python control flow on the (tiled) batch size

    model = mn.insert(Branches(nnx.Rngs(0)), N, 2.0, seed=0)
    model.eval()  # type: ignore[no-untyped-call]
    head = mn.with_uncertainty(model)
    message = r"cannot be exported with a symbolic batch 'b'.*comparison '4\*b' > '6' is inconclusive.*batch=None"
    with pytest.raises(ValueError, match=message):
        mn.export(head, images(2))
    fixed = round_trip(mn.export(head, images(3), batch=None))
    assert fixed.in_avals[0].shape == (3, 6, 6, 3)
    assert_head_equals(fixed.call(images(3)), uncertainty_head(np.asarray(mf.predict(model, images(3)))))


class LinenNet(nn.Module):
    """Dense -> BatchNorm -> relu -> Masksembles -> Dense."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x)))
        return nn.Dense(3)(ml.Masksembles(n=N, scale=2.0, seed=0)(x))


@pytest.mark.parametrize("head", [False, True], ids=["members", "head"])
def test_linen_exports_with_a_symbolic_batch(head: bool) -> None:
    module = LinenNet()
    variables = module.init(jax.random.key(0), jnp.ones((2, 5)))
    wrapped = ml.with_uncertainty(module)

    def serve(x: jax.Array) -> Any:
        if head:
            return wrapped.apply(variables, x)
        return mf.predict(lambda b: module.apply(variables, b), x, n=N)

    spec = jax.ShapeDtypeStruct((*jax.export.symbolic_shape("b"), 5), jnp.float32)
    restored = round_trip(jax.export.export(jax.jit(serve))(spec))
    symbolic_batch(restored)
    for batch in BATCHES:
        x = jnp.asarray(np.random.default_rng(batch).normal(size=(batch, 5)), jnp.float32)
        members = np.asarray(mf.predict(lambda b: module.apply(variables, b), x, n=N), np.float64)
        if head:
            assert_head_equals(restored.call(x), uncertainty_head(members))
        else:
            assert_float32_close(restored.call(x), members)
