"""NNX ``extract_member`` holds one member's share of the model where a per-channel scale follows a mask: ConvNeXt's
block (a depthwise convolution, LayerNorm, two Linear layers, its layer scale ``y * gamma`` with gamma (C,)) with
``insert``'s default masks, replicated small. The scale is compacted on the channels (its constant laid out per
channel; LayerNorm's statistics run at full width), so the member holds less than the model and equals ``predict``
(as Keras' test_packing_member_share.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import masksembles_flax as mf
from masksembles_flax.nnx import extract_member, insert, pack

N = 4
DIM = 8


class ConvNeXtBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.depthwise = nnx.Conv(DIM, DIM, (3, 3), feature_group_count=DIM, rngs=rngs)
        self.norm = nnx.LayerNorm(DIM, epsilon=1e-6, rngs=rngs)
        self.pointwise_1 = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.pointwise_2 = nnx.Linear(4 * DIM, DIM, rngs=rngs)
        self.gamma = nnx.Param(jax.random.uniform(rngs.params(), (DIM,), minval=0.5, maxval=1.5))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.pointwise_2(nnx.gelu(self.pointwise_1(self.norm(self.depthwise(x)))))
        return x + y * self.gamma[...]


class ConvNeXt(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.stem = nnx.Conv(3, DIM, (2, 2), strides=2, rngs=rngs)
        self.blocks = nnx.List([ConvNeXtBlock(rngs), ConvNeXtBlock(rngs)])
        self.head = nnx.Linear(DIM, 5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


def parameters(module: nnx.Module) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nnx.state(module, nnx.Param)))


def test_a_member_of_convnext_holds_less_than_the_model_and_equals_predict() -> None:
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 8, 8, 3)), jnp.float32)
    model = insert(ConvNeXt(nnx.Rngs(0)), N, 2.0, seed=0, example_input=x)
    expected = np.asarray(mf.predict(model, x, N))
    member = extract_member(model, 2, x)
    assert member.members == (2,)
    assert not [f for f in member.fallbacks if __name__.rsplit(".")[-1] in f]  # the scale and the sum compacted
    assert parameters(member) <= parameters(model)
    np.testing.assert_allclose(np.asarray(member(x)), expected[2], rtol=0, atol=1e-5 * np.abs(expected).max())
    packed = pack(model, x, program="packed")
    np.testing.assert_allclose(np.asarray(packed(x)), expected, rtol=0, atol=1e-5 * np.abs(expected).max())
