"""masksembles_flax.nnx.Masksembles: Masks variable, forward, random mode, NNX transforms, optimizer, saving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import masksembles_core as mc
import masksembles_core.adapter as mca
from masksembles_flax.nnx import Masks, Masksembles
from tests.flax.common import DTYPES, NnxMLP, assert_same_bits, oracle, raises_like, special_values

KEY = jax.random.key(0)


@nnx.jit
def jit_call(layer: Masksembles, x: jax.Array) -> jax.Array:
    """``layer(x)`` under ``nnx.jit``, with the layer's RNG stream updated in place."""
    return layer(x)


def masks_of(layer: Masksembles) -> np.ndarray:
    return np.asarray(layer.masks[...])


def test_masks_are_a_masks_variable_with_static_attributes() -> None:
    layer = Masksembles(16, 4, 2.0, seed=7, channel_axis=1)
    assert isinstance(layer.masks, Masks)
    assert masks_of(layer).dtype == np.bool_
    assert np.array_equal(masks_of(layer), mc.generate_masks(16, 4, 2.0, seed=7))
    assert (layer.n, layer.channels, layer.scale, layer.channel_axis, layer.mode) == (4, 16, 2.0, 1, "grouped")


def test_given_masks_are_used() -> None:
    masks = mc.generate_masks(6, 3, 2.0, seed=0)
    assert np.array_equal(masks_of(Masksembles(6, 3, 2.0, masks=masks.astype(np.int8))), masks)


def test_seed_none_draws_fresh_masks() -> None:
    assert not np.array_equal(masks_of(Masksembles(64, 4, 2.0)), masks_of(Masksembles(64, 4, 2.0)))


BAD_ARGUMENTS = {
    "channels-zero": ((0, 4, 2.0), {}, lambda: mca.check_channels(0)),
    "n-zero": ((8, 0, 2.0), {}, lambda: mca.check_n(0)),
    "n-float": ((8, 4.0, 2.0), {}, lambda: mca.check_n(4.0)),
    "scale-below-one": ((8, 4, 0.5), {}, lambda: mca.check_scale(0.5)),
    "seed-negative": ((8, 4, 2.0), {"seed": -1}, lambda: mca.check_seed(-1)),
    "channel-axis-batch": ((8, 4, 2.0), {"channel_axis": 0}, lambda: mca.check_channel_axis(0)),
    "mode": ((8, 4, 2.0), {"mode": "mixed"}, lambda: mca.check_mode("mixed")),
    "masks-channels-mismatch": (
        (5, 4, 2.0),
        {"masks": np.ones((4, 6))},
        lambda: mca.layer_arguments(5, 4, 2.0, masks=np.ones((4, 6)), channel_axis=-1),
    ),
    "masks-all-zero-row": (
        (6, 2, 2.0),
        {"masks": np.zeros((2, 6))},
        lambda: mc.validate_masks(np.zeros((2, 6))),
    ),
}


@pytest.mark.parametrize(("args", "kwargs", "core_call"), BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_bad_arguments_raise_the_core_error(args: tuple[Any, ...], kwargs: dict[str, Any], core_call: Any) -> None:
    with raises_like(core_call):
        Masksembles(*args, **kwargs)


def test_rngs_of_the_wrong_type_are_rejected() -> None:
    with pytest.raises(TypeError, match="rngs must be"):
        Masksembles(8, 4, 2.0, rngs=0)  # type: ignore[arg-type]


def test_wrong_input_raises_the_core_error() -> None:
    layer = Masksembles(6, 4, 2.0, seed=0)
    with raises_like(lambda: mca.check_input_shape((8,), channels=6, channel_axis=-1)):
        layer(jnp.zeros((8,)))
    with raises_like(lambda: mca.check_input_shape((8, 5), channels=6, channel_axis=-1)):
        layer(jnp.zeros((8, 5)))
    with raises_like(lambda: mca.check_input_shape((8, 6, 3), channels=6, channel_axis=-1)):
        jit_call(layer, jnp.zeros((8, 6, 3)))


LAYOUTS = {"bhwc": ((5, 3, 12), -1), "bchw": ((12, 3, 5), 1), "bc": ((12,), -1)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [8, 6, 4, 3, 1], ids=lambda b: f"b{b}")
@pytest.mark.parametrize(("feature_shape", "channel_axis"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_nnx_jit_forward_and_input_gradient_match_the_oracle(
    feature_shape: tuple[int, ...], channel_axis: int, batch: int, dtype: str
) -> None:
    layer = Masksembles(12, 4, 2.0, seed=3, channel_axis=channel_axis)
    x = special_values((batch, *feature_shape), seed=batch)
    grad_output = special_values(x.shape, seed=batch + 100)

    @nnx.jit
    def forward_backward(layer: Masksembles, x: jax.Array, grad_output: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, pullback = jax.vjp(layer, x)
        return y, pullback(grad_output)[0]

    y, grad_input = forward_backward(layer, jnp.asarray(x, dtype), jnp.asarray(grad_output, dtype))
    assert y.dtype == grad_input.dtype == jnp.dtype(dtype)
    assert_same_bits(y, oracle(x, masks_of(layer), channel_axis))
    assert_same_bits(grad_input, oracle(grad_output, masks_of(layer), channel_axis))


def test_vmap_over_stacked_batches() -> None:
    layer = Masksembles(10, 4, 2.0, seed=0)
    xs = jax.random.normal(KEY, (3, 6, 10))
    stacked = nnx.vmap(lambda layer, x: layer(x), in_axes=(None, 0))(layer, xs)
    closed = jax.jit(jax.vmap(layer))(xs)
    for x, y, y_closed in zip(xs, stacked, closed, strict=True):
        expected = oracle(np.asarray(x), masks_of(layer), -1)
        assert_same_bits(y, expected)
        assert_same_bits(y_closed, expected)


def test_nnx_grad_and_optimizer_skip_the_masks() -> None:
    model = NnxMLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    grads = nnx.grad(lambda model: jnp.sum(model(jnp.ones((4, 3)))))(model)
    assert not jax.tree.leaves(nnx.state(grads, Masks))
    assert not jax.tree.leaves(nnx.state(optimizer.opt_state, Masks))
    assert len(jax.tree.leaves(nnx.state(model, Masks))) == 1


@pytest.mark.parametrize("mode", mca.MODES)
def test_optax_training_leaves_the_masks_unchanged(mode: str) -> None:
    model = NnxMLP(mode=mode, rngs=nnx.Rngs(params=0, dropout=1))
    masks_before = masks_of(model.ensemble)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(KEY, (64, 3))
    target = jnp.sin(x.sum(axis=1, keepdims=True))

    @nnx.jit
    def step(model: NnxMLP, optimizer: nnx.Optimizer[NnxMLP]) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda model: jnp.mean((model(x) - target) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    model.train()
    losses = [float(step(model, optimizer)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    assert np.array_equal(masks_of(model.ensemble), masks_before)
    assert np.array_equal(masks_before, mc.generate_masks(32, 4, 2.0, seed=0))


def test_split_merge_and_state_carry_the_masks() -> None:
    model = NnxMLP(rngs=nnx.Rngs(0))
    graphdef, params, masks = nnx.split(model, nnx.Param, Masks)
    assert len(jax.tree.leaves(masks)) == 1
    merged = nnx.merge(graphdef, params, masks)
    assert np.array_equal(masks_of(merged.ensemble), masks_of(model.ensemble))
    x = jax.random.normal(KEY, (8, 3))
    assert_same_bits(merged(x), np.asarray(model(x)))


def test_orbax_round_trip_keeps_the_masks(tmp_path: Path) -> None:
    model = NnxMLP(seed=1, rngs=nnx.Rngs(0))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", nnx.state(model))
        checkpointer.wait_until_finished()
        # The abstract target is built from another seed: the restored masks must be the saved ones.
        graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: NnxMLP(seed=2, rngs=nnx.Rngs(5))))
        restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "ckpt", abstract_state))
    assert masks_of(restored.ensemble).dtype == np.bool_
    assert np.array_equal(masks_of(restored.ensemble), masks_of(model.ensemble))
    x = jax.random.normal(KEY, (8, 3))
    assert_same_bits(restored(x), np.asarray(model(x)))


def mask_rows(y: jax.Array, masks: np.ndarray) -> np.ndarray:
    """Index of the mask each row of ``y = ones * mask`` used (the masks must be distinct)."""
    found = (np.asarray(y, dtype=bool)[:, None, :] == masks[None, :, :]).all(axis=2)
    assert (found.sum(axis=1) == 1).all(), "every row is exactly one mask"
    return found.argmax(axis=1)


def random_layer(**kwargs: Any) -> Masksembles:
    layer = Masksembles(16, 4, 2.0, seed=5, mode="random", **kwargs)
    assert len({row.tobytes() for row in masks_of(layer)}) == 4
    return layer


def test_random_mode_draws_a_uniform_mask_per_sample() -> None:
    layer = random_layer(rngs=nnx.Rngs(dropout=0))
    counts = np.bincount(mask_rows(jit_call(layer, jnp.ones((4000, 16))), masks_of(layer)), minlength=4)
    assert (np.abs(counts - 1000) < 150).all(), counts  # binomial sd ~27


def test_random_mode_draws_from_the_given_key() -> None:
    layer, key = random_layer(), jax.random.key(11)
    y = layer(jnp.ones((32, 16)), rngs=key)
    assert np.array_equal(mask_rows(y, masks_of(layer)), np.asarray(jax.random.randint(key, (32,), 0, 4)))


def test_random_mode_stream_is_reproducible_and_advances() -> None:
    ones = jnp.ones((32, 16))
    first, second = random_layer(rngs=nnx.Rngs(dropout=3)), random_layer(rngs=nnx.Rngs(dropout=3))
    draws = [mask_rows(jit_call(layer, ones), masks_of(layer)) for layer in (first, second, first)]
    assert np.array_equal(draws[0], draws[1])
    assert not np.array_equal(draws[0], draws[2])


def test_random_mode_is_grouped_in_eval_mode_and_views() -> None:
    layer = random_layer(rngs=nnx.Rngs(dropout=0))
    x = jax.random.normal(KEY, (6, 16))
    grouped = oracle(np.asarray(x), masks_of(layer), -1)
    assert_same_bits(layer(x, deterministic=True), grouped)
    assert_same_bits(nnx.view(layer, deterministic=True)(x), grouped)
    layer.eval()
    assert layer.deterministic is True
    assert_same_bits(layer(x), grouped)
    layer.train()
    assert layer.deterministic is False
    assert not np.array_equal(np.asarray(layer(x)), grouped)


def test_random_mode_needs_deterministic_and_keys() -> None:
    with pytest.raises(ValueError, match="needs `deterministic`"):
        random_layer(deterministic=None)(jnp.ones((4, 16)))
    with pytest.raises(ValueError, match="needs random keys"):
        random_layer()(jnp.ones((4, 16)))


def test_grouped_mode_ignores_deterministic_and_needs_no_rngs() -> None:
    layer = Masksembles(16, 4, 2.0, seed=0)
    x = jax.random.normal(KEY, (8, 16))
    expected = oracle(np.asarray(x), masks_of(layer), -1)
    for deterministic in (None, False, True):
        assert_same_bits(layer(x, deterministic=deterministic), expected)
