"""tile/untile/predict, and the shared forward against the oracle on random shapes (hypothesis)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import masksembles_core as mc
import masksembles_core.adapter as mca
from masksembles_flax import linen, predict, tile, untile
from masksembles_flax import nnx as masksembles_nnx
from masksembles_flax._ops import apply_masks
from tests.flax.common import DTYPES, assert_same_bits, oracle, raises_like, special_values

KEY = jax.random.key(0)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_tile_and_untile_follow_the_core(n: int) -> None:
    x = np.arange(5 * 2 * 3, dtype=np.float32).reshape(5, 2, 3)
    tiled = tile(jnp.asarray(x), n)
    assert np.array_equal(np.asarray(tiled), mc.tile(x, n))
    assert np.array_equal(np.asarray(untile(tiled, n)), mc.untile(mc.tile(x, n), n))


def test_tile_and_untile_raise_the_core_errors() -> None:
    with raises_like(lambda: mca.check_n(0)):
        tile(jnp.ones((2, 3)), 0)
    with raises_like(lambda: mca.check_tiled_batch(10, 4)):
        untile(jnp.ones((10, 3)), 4)


def member_outputs(x: np.ndarray, masks: np.ndarray, channel_axis: int) -> np.ndarray:
    """(n, B, ...): every sample through every single mask, by the oracle."""
    return np.stack([oracle(x, np.repeat(mask[None], len(x), axis=0), channel_axis) for mask in masks])


def test_predict_with_a_linen_model_gives_every_member() -> None:
    layer = linen.Masksembles(n=4, scale=2.0, seed=0, channel_axis=1)
    x = special_values((3, 8, 2), seed=0)
    variables = layer.init(KEY, jnp.asarray(x))
    outputs = jax.jit(lambda x: predict(lambda batch: layer.apply(variables, batch), x, 4))(jnp.asarray(x))
    assert outputs.shape == (4, 3, 8, 2)
    assert_same_bits(outputs, member_outputs(x, np.asarray(variables["masksembles"]["masks"]), 1))


def test_predict_with_an_nnx_model_and_pytree_outputs() -> None:
    layer = masksembles_nnx.Masksembles(8, 3, 2.0, seed=1)
    x = special_values((5, 8), seed=1)

    def model(batch: jax.Array) -> dict[str, Any]:
        y = layer(batch)
        return {"y": y, "total": y.sum(axis=1)}

    outputs = predict(model, jnp.asarray(x), 3)
    expected = member_outputs(x, np.asarray(layer.masks[...]), -1)
    assert_same_bits(outputs["y"], expected)
    assert outputs["total"].shape == (3, 5)


def test_predict_runs_under_nnx_jit() -> None:
    layer = masksembles_nnx.Masksembles(6, 4, 2.0, seed=2)
    x = special_values((2, 6), seed=2)
    outputs = nnx.jit(lambda layer, x: predict(layer, x, 4))(layer, jnp.asarray(x))
    assert_same_bits(outputs, member_outputs(x, np.asarray(layer.masks[...]), -1))


@st.composite
def forward_cases(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, str]:
    rank = draw(st.integers(2, 5))
    channel_axis = draw(st.sampled_from([a for a in range(-rank, rank) if a % rank != 0]))
    shape = [draw(st.integers(1, 12))] + [draw(st.integers(1, 4)) for _ in range(rank - 1)]
    n = draw(st.integers(1, 6))
    masks = mc.generate_masks(shape[channel_axis], n, draw(st.floats(1.0, 4.0)), seed=draw(st.integers(0, 2**16)))
    x = special_values(tuple(shape), seed=draw(st.integers(0, 2**16)))
    return x, masks, channel_axis, draw(st.sampled_from(DTYPES))


@settings(max_examples=40, deadline=None)
@given(forward_cases())
def test_forward_matches_the_oracle_on_random_shapes(case: tuple[np.ndarray, np.ndarray, int, str]) -> None:
    x, masks, channel_axis, dtype = case
    forward = jax.jit(lambda x, masks: apply_masks(x, masks, channel_axis=channel_axis))
    y = forward(jnp.asarray(x, dtype), jnp.asarray(masks))
    assert y.dtype == jnp.dtype(dtype)
    assert_same_bits(y, oracle(x, masks, channel_axis))
