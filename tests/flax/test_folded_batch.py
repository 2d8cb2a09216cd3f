"""NNX and linen: a sample meets one member in every layer, whatever the batch size, also where the model folds
windows or tokens into the batch (Swin, Mixer); ``predict`` reads and checks ``n`` and never changes the model's
state."""

from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import masksembles_core as mc
import masksembles_flax as mf
from masksembles_flax import linen as ml
from masksembles_flax import nnx as mn
from tests.conformance import assert_bit_identical

N = 4


class SwinLike(nnx.Module):
    """Swin-style: attention on windows folded into the batch (B * windows, tokens, C) after a roll, then an MLP."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Conv(3, 8, (2, 2), strides=(2, 2), rngs=rngs)  # the first layer: left alone by insert
        self.qkv, self.proj = nnx.Linear(8, 24, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:  # (B, 16, 16, 3) -> (B, 3)
        x = self.embed(images)  # (B, 8, 8, 8)
        batch, height, width, channels = x.shape
        shifted = jnp.roll(x, (-2, -2), axis=(1, 2))
        windows = shifted.reshape(batch, 2, 4, 2, 4, channels).transpose(0, 1, 3, 2, 4, 5).reshape(-1, 16, channels)
        q, k, v = jnp.split(self.qkv(windows), 3, axis=-1)
        attended = self.proj(jax.nn.softmax(q @ k.transpose(0, 2, 1) / channels**0.5, axis=-1) @ v)
        merged = attended.reshape(batch, 2, 2, 4, 4, channels).transpose(0, 1, 3, 2, 4, 5)
        x = x + jnp.roll(merged.reshape(batch, height, width, channels), (2, 2), axis=(1, 2))
        x = x + self.fc2(nnx.relu(self.fc1(x)))
        return self.head(x.mean(axis=(1, 2)))


class MixerLike(nnx.Module):
    """Mixer-style: the token-mixing MLP runs on (B * C, tokens) rows, the channel-mixing MLP on (B, tokens, C)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Linear(12, 8, rngs=rngs)
        self.token1, self.token2 = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)
        self.channel1, self.channel2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, patches: jax.Array) -> jax.Array:  # (B, 16 tokens, 12) -> (B, 3)
        x = self.embed(patches)
        batch, tokens, channels = x.shape
        rows = x.transpose(0, 2, 1).reshape(batch * channels, tokens)  # (B * C, tokens), sample-major
        x = x + self.token2(nnx.relu(self.token1(rows))).reshape(batch, channels, tokens).transpose(0, 2, 1)
        x = x + self.channel2(nnx.relu(self.channel1(x)))
        return self.head(x.mean(axis=1))


MODELS = {"swin": (SwinLike, (16, 16, 3)), "mixer": (MixerLike, (16, 12))}


class Recorded(mn.Masksembles):
    """A Masksembles layer that reports, through a debug callback (under jit and grad too), which masks each row's
    output is consistent with: (rows, n) bool (rows with zero inputs may match several)."""

    records: ClassVar[list[np.ndarray]] = []

    def __call__(self, x: jax.Array, **kwargs: Any) -> jax.Array:
        y = super().__call__(x, **kwargs)
        shape = [1] * x.ndim
        shape[-1] = self.channels
        matches = jnp.stack(
            [(y == x * self.masks[...][k].reshape(shape)).reshape(x.shape[0], -1).all(axis=1) for k in range(self.n)],
            axis=1,
        )
        jax.debug.callback(lambda m: Recorded.records.append(np.asarray(m)), matches)
        return y


def recorded(model: nnx.Module) -> list[np.ndarray]:
    for _, layer in nnx.iter_graph(model):
        if type(layer) is mn.Masksembles:
            layer.__class__ = Recorded
    Recorded.records = []
    return Recorded.records


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("batch", [7, 5])
def test_a_sample_meets_one_member_in_every_layer_in_training(name: str, batch: int) -> None:
    build, shape = MODELS[name]
    model = mn.insert(build(nnx.Rngs(0)), N, 2.0, seed=0)
    records = recorded(model)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(batch), (batch, *shape))

    @nnx.jit
    def train_step(model: nnx.Module, optimizer: nnx.Optimizer, x: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda model: jnp.square(model(x)).mean())(model)
        optimizer.update(model, grads)
        return loss

    train_step(model, optimizer, x)
    jax.effects_barrier()
    assert len(records) == 5 and any(len(matches) > batch for matches in records), "the replica folds the batch"
    expected = mc.group_index(batch, N)
    for matches in records:
        assert matches.reshape(batch, -1, N)[np.arange(batch), :, expected].all()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_and_extracted_members_of_a_folding_model_equal_predict(name: str) -> None:
    build, shape = MODELS[name]
    model = mn.insert(build(nnx.Rngs(0)), N, 2.0, seed=0)
    x = jax.random.normal(jax.random.key(0), (7, *shape))
    members = mf.predict(model, x)
    np.testing.assert_allclose(mn.pack(model, x, program="packed")(x), members, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mn.extract_member(model, 2, x)(x), members[2], rtol=1e-4, atol=1e-5)


def test_folded_rows_without_the_record_straddle_members() -> None:
    layer = mn.Masksembles(8, N, 2.0, seed=0)
    x = jax.random.normal(jax.random.key(0), (7 * 4, 16, 8))  # no zeros: each row matches exactly one mask
    masks = np.asarray(layer.masks[...], np.float32)

    def members(y: jax.Array) -> np.ndarray:
        return np.stack([np.all(np.asarray(y) == np.asarray(x) * masks[k], axis=(1, 2)) for k in range(N)], axis=1)

    plain = members(layer(x)).argmax(axis=1).reshape(7, 4)
    assert sorted(tuple(sorted(set(row))) for row in plain if len(set(row)) > 1) == [(0, 1), (1, 2), (2, 3)]
    with mf.batch_size(7):
        folded = members(layer(x))
    assert (folded.sum(axis=1) == 1).all()
    assert (folded.argmax(axis=1).reshape(7, 4) == mc.group_index(7, N)[:, None]).all()


@pytest.mark.parametrize("rows, samples", [(28, 7), (20, 5), (24, 6), (7, 7), (9, 4), (16, 8)])
def test_linen_and_nnx_match_the_reference_with_samples(rows: int, samples: int) -> None:
    masks = mc.generate_masks(8, N, 2.0, seed=0)
    x = np.random.default_rng(rows).normal(size=(rows, 3, 8)).astype(np.float32)
    expected = mc.apply_masks(x, masks, channel_axis=-1, samples=samples)
    layer = ml.Masksembles(n=N, scale=2.0, masks=masks)
    variables = layer.init(jax.random.key(0), x)
    with mf.batch_size(samples):
        assert_bit_identical(np.asarray(mn.Masksembles(8, N, 2.0, masks=masks)(jnp.asarray(x))), expected)
        assert_bit_identical(np.asarray(layer.apply(variables, jnp.asarray(x))), expected)


def test_record_batch_size_survives_split_merge_and_clone() -> None:
    model = mn.insert(SwinLike(nnx.Rngs(0)), N, 2.0, seed=0)
    assert isinstance(model, SwinLike) and type(model).__name__ == "SwinLike" and type(model).records_batch_size
    assert type(mn.record_batch_size(model)) is type(model), "a second call changes nothing"
    graphdef, state = nnx.split(model)
    for copy in (nnx.merge(graphdef, state), nnx.clone(model)):
        assert type(copy) is type(model)


def nnx_model() -> nnx.Module:
    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.hidden, self.norm = nnx.Linear(5, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs)
            self.masks, self.drop = mn.Masksembles(8, N, 2.0, seed=0), nnx.Dropout(0.5, rngs=rngs)
            self.out = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.out(self.drop(self.masks(self.norm(self.hidden(x)))))

    return Net(nnx.Rngs(0))


def test_predict_reads_and_checks_n() -> None:
    model = nnx_model()
    x = jax.random.normal(jax.random.key(0), (6, 5))
    np.testing.assert_array_equal(mf.predict(model, x), mf.predict(model, x, N))
    with pytest.raises(ValueError, match=r"^n=2 does not match the model's Masksembles layers, which have n=4$"):
        mf.predict(model, x, 2)
    with pytest.raises(ValueError, match="no Masksembles layer to read it from; pass n"):
        mf.predict(nnx.Linear(5, 3, rngs=nnx.Rngs(0)), x)
    model.extra = mn.Masksembles(3, 3, 2.0, seed=0)
    with pytest.raises(ValueError, match=r"have different n: \[3, 4\]"):
        mf.predict(model, x)


def test_predict_reads_and_checks_n_of_a_linen_function() -> None:
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(3)(ml.Masksembles(n=N, scale=2.0, seed=0)(nn.Dense(8)(x)))

    x = jnp.ones((6, 5))
    variables = Net().init(jax.random.key(0), x)
    members = mf.predict(lambda batch: Net().apply(variables, batch), x)
    assert members.shape == (N, 6, 3)
    with pytest.raises(ValueError, match=r"^n=3 does not match the model's Masksembles layers, which have n=4$"):
        mf.predict(lambda batch: Net().apply(variables, batch), x, 3)
    with pytest.raises(ValueError, match="no Masksembles layer to read it from; pass n"):
        mf.predict(lambda batch: batch * 2.0, x)
    np.testing.assert_array_equal(mf.predict(lambda batch: batch * 2.0, x, 2), np.stack([x * 2.0] * 2))


def snapshot(leaf: jax.Array) -> np.ndarray:
    """A copy of a state leaf (a random key's data for a key: the Dropout stream's state)."""
    return np.asarray(jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf)


def test_predict_never_changes_the_model_state() -> None:
    model = nnx_model()  # a new NNX module is in train mode: BatchNorm on batch statistics, Dropout on
    state = jax.tree.map(snapshot, nnx.state(model))
    x = jax.random.normal(jax.random.key(0), (6, 5))
    members = mf.predict(model, x)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(snapshot, nnx.state(model)), state)
    assert model.norm.use_running_average is False and model.drop.deterministic is False, "its mode is kept"
    model.eval()
    np.testing.assert_array_equal(mf.predict(model, x), members)
    np.testing.assert_allclose(mn.pack(model, x, program="packed")(x), members, rtol=1e-5, atol=1e-6)
