"""masksembles_flax.linen.Masksembles: masks in their own collection, forward, random mode, transforms, saving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import errors, serialization

import masksembles_core as mc
import masksembles_core.adapter as mca
from masksembles_flax.linen import MASKS_COLLECTION, Masksembles
from tests.flax.common import (
    DTYPES,
    LinenMLP,
    assert_same_bits,
    oracle,
    raises_like,
    special_values,
    train_linen_mlp,
)

KEY = jax.random.key(0)


def masks_of(variables: Any) -> np.ndarray:
    return np.asarray(variables[MASKS_COLLECTION]["masks"])


def test_masks_are_made_at_init_in_their_own_collection() -> None:
    variables = Masksembles(n=4, scale=2.0, seed=7).init(KEY, jnp.zeros((8, 5, 16)))
    assert set(variables) == {MASKS_COLLECTION}
    masks = masks_of(variables)
    assert masks.dtype == np.bool_
    assert np.array_equal(masks, mc.generate_masks(16, 4, 2.0, seed=7))


def test_masks_follow_the_channel_axis() -> None:
    variables = Masksembles(n=3, scale=1.5, seed=1, channel_axis=1).init(KEY, jnp.zeros((6, 10, 4, 4)))
    assert np.array_equal(masks_of(variables), mc.generate_masks(10, 3, 1.5, seed=1))


def test_seed_none_draws_fresh_masks_at_each_init() -> None:
    layer = Masksembles(n=4, scale=2.0)
    first, second = (masks_of(layer.init(KEY, jnp.zeros((4, 64)))) for _ in range(2))
    assert not np.array_equal(first, second)


def test_given_masks_are_stored_as_a_hashable_field() -> None:
    masks = mc.generate_masks(6, 3, 2.0, seed=0)
    layer = Masksembles(n=3, scale=2.0, masks=masks.astype(np.float32))
    assert layer.masks == tuple(tuple(bool(v) for v in row) for row in masks)
    assert hash(layer) == hash(Masksembles(n=3, scale=2.0, masks=masks))
    assert np.array_equal(masks_of(layer.init(KEY, jnp.zeros((3, 6)))), masks)


BAD_ARGUMENTS = {
    "n-zero": ({"n": 0, "scale": 2.0}, lambda: mca.check_n(0)),
    "n-float": ({"n": 4.0, "scale": 2.0}, lambda: mca.check_n(4.0)),
    "scale-below-one": ({"n": 4, "scale": 0.5}, lambda: mca.check_scale(0.5)),
    "scale-nan": ({"n": 4, "scale": float("nan")}, lambda: mca.check_scale(float("nan"))),
    "channel-axis-batch": ({"n": 4, "scale": 2.0, "channel_axis": 0}, lambda: mca.check_channel_axis(0)),
    "seed-negative": ({"n": 4, "scale": 2.0, "seed": -1}, lambda: mca.check_seed(-1)),
    "mode": ({"n": 4, "scale": 2.0, "mode": "mixed"}, lambda: mca.check_mode("mixed")),
    "masks-n-mismatch": (
        {"n": 3, "scale": 2.0, "masks": np.ones((4, 6))},
        lambda: mca.layer_arguments(None, 3, 2.0, masks=np.ones((4, 6)), channel_axis=-1),
    ),
    "masks-not-binary": (
        {"n": 2, "scale": 2.0, "masks": np.full((2, 6), 0.5)},
        lambda: mc.validate_masks(np.full((2, 6), 0.5)),
    ),
}


@pytest.mark.parametrize(("kwargs", "core_call"), BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_bad_arguments_raise_the_core_error(kwargs: dict[str, Any], core_call: Any) -> None:
    with raises_like(core_call):
        Masksembles(**kwargs)


def test_wrong_input_raises_the_core_error() -> None:
    layer = Masksembles(n=4, scale=2.0, seed=0)
    with raises_like(lambda: mca.check_input_shape((8,), channels=8, channel_axis=-1)):
        layer.init(KEY, jnp.zeros((8,)))
    with raises_like(lambda: mca.check_input_shape((8, 6), channels=1, channel_axis=3)):
        Masksembles(n=4, scale=2.0, channel_axis=3).init(KEY, jnp.zeros((8, 6)))
    variables = layer.init(KEY, jnp.zeros((8, 6)))
    with raises_like(lambda: mca.check_input_shape((8, 5), channels=6, channel_axis=-1)):
        layer.apply(variables, jnp.zeros((8, 5)))
    given = Masksembles(n=4, scale=2.0, masks=masks_of(variables))
    with raises_like(lambda: mca.check_input_shape((8, 7), channels=6, channel_axis=-1)):
        given.init(KEY, jnp.zeros((8, 7)))


MISSING_MASKS = r"Masksembles layer 'Masksembles_0' has no masks: .* pass them to every apply like batch_stats"
APPLY_WITHOUT_MASKS = {"plain": {}, "mutable-masks": {"mutable": [MASKS_COLLECTION]}, "mutable-all": {"mutable": True}}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("apply_kwargs", APPLY_WITHOUT_MASKS.values(), ids=APPLY_WITHOUT_MASKS.keys())
def test_apply_without_the_masks_is_an_error_never_new_masks(apply_kwargs: dict[str, Any], jit: bool) -> None:
    model = LinenMLP()
    x = jnp.ones((8, 3))
    params = model.init(KEY, x)["params"]

    def apply(params: Any, x: jax.Array) -> Any:
        return model.apply({"params": params}, x, **apply_kwargs)

    with pytest.raises(ValueError, match=MISSING_MASKS):
        (jax.jit(apply) if jit else apply)(params, x)
    with pytest.raises(ValueError, match=r"^The Masksembles layer has no masks"):
        Masksembles(n=4, scale=2.0, seed=0).apply({}, jnp.zeros((4, 6)), **apply_kwargs)


def test_masks_from_init_stay_fixed_across_calls_and_retraces_with_seed_none() -> None:
    layer = Masksembles(n=4, scale=2.0)
    variables = layer.init(KEY, jnp.zeros((8, 64)))
    initial = masks_of(variables)
    apply = jax.jit(lambda variables, x: layer.apply(variables, x, mutable=[MASKS_COLLECTION]))
    for batch in (8, 8, 5, 3):  # 5 and 3: partial last batches, each a retrace
        x = jax.random.normal(jax.random.key(batch), (batch, 64))
        y, returned = apply(variables, x)
        assert np.array_equal(masks_of(returned), initial)
        assert_same_bits(y, oracle(np.asarray(x), initial, -1))


LAYOUTS = {"bhwc": ((5, 3, 12), -1), "bchw": ((12, 3, 5), 1), "bc": ((12,), -1)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [8, 6, 4, 3, 1], ids=lambda b: f"b{b}")
@pytest.mark.parametrize(("feature_shape", "channel_axis"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_jitted_forward_and_input_gradient_match_the_oracle(
    feature_shape: tuple[int, ...], channel_axis: int, batch: int, dtype: str
) -> None:
    layer = Masksembles(n=4, scale=2.0, seed=3, channel_axis=channel_axis)
    x = special_values((batch, *feature_shape), seed=batch)
    grad_output = special_values(x.shape, seed=batch + 100)
    variables = layer.init(KEY, jnp.zeros(x.shape))

    @jax.jit
    def forward_backward(variables: Any, x: jax.Array, grad_output: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, pullback = jax.vjp(lambda x_in: layer.apply(variables, x_in), x)
        return y, pullback(grad_output)[0]

    y, grad_input = forward_backward(variables, jnp.asarray(x, dtype), jnp.asarray(grad_output, dtype))
    assert y.dtype == grad_input.dtype == jnp.dtype(dtype)
    assert_same_bits(y, oracle(x, masks_of(variables), channel_axis))
    assert_same_bits(grad_input, oracle(grad_output, masks_of(variables), channel_axis))


def test_vmap_over_stacked_batches() -> None:
    layer = Masksembles(n=4, scale=2.0, seed=0)
    xs = jax.random.normal(KEY, (3, 6, 10))
    variables = layer.init(KEY, xs[0])
    stacked = jax.jit(jax.vmap(lambda x: layer.apply(variables, x)))(xs)
    for x, y in zip(xs, stacked, strict=True):
        assert_same_bits(y, oracle(np.asarray(x), masks_of(variables), -1))


def random_layer(**kwargs: Any) -> tuple[Masksembles, Any]:
    layer = Masksembles(n=4, scale=2.0, seed=5, mode="random", **kwargs)
    call_kwargs = {} if layer.deterministic is not None else {"deterministic": True}
    return layer, layer.init(KEY, jnp.zeros((4, 16)), **call_kwargs)


def mask_rows(y: jax.Array, masks: np.ndarray) -> np.ndarray:
    """Index of the mask each row of ``y = ones * mask`` used (the masks must be distinct)."""
    matches = np.asarray(y, dtype=bool)[:, None, :] == masks[None, :, :]
    found = matches.all(axis=2)
    assert (found.sum(axis=1) == 1).all(), "every row is exactly one mask"
    return found.argmax(axis=1)


def test_random_mode_draws_a_uniform_mask_per_sample() -> None:
    layer, variables = random_layer()
    masks = masks_of(variables)
    assert len({row.tobytes() for row in masks}) == 4
    ones = jnp.ones((4000, 16))
    y = jax.jit(lambda x, key: layer.apply(variables, x, deterministic=False, rngs={"dropout": key}))(ones, KEY)
    counts = np.bincount(mask_rows(y, masks), minlength=4)
    assert (np.abs(counts - 1000) < 150).all(), counts  # binomial sd ~27


def test_random_mode_draws_from_the_given_key() -> None:
    layer, variables = random_layer()
    ones, key = jnp.ones((32, 16)), jax.random.key(11)
    y = layer.apply(variables, ones, deterministic=False, rng=key)
    expected = np.asarray(jax.random.randint(key, (32,), 0, 4))
    assert np.array_equal(mask_rows(y, masks_of(variables)), expected)


def test_random_mode_is_reproducible_per_key() -> None:
    layer, variables = random_layer()
    ones = jnp.ones((32, 16))

    def draw(seed: int) -> np.ndarray:
        y = layer.apply(variables, ones, deterministic=False, rngs={"dropout": jax.random.key(seed)})
        return mask_rows(y, masks_of(variables))

    assert np.array_equal(draw(1), draw(1))
    assert not np.array_equal(draw(1), draw(2))


def test_random_mode_is_grouped_when_deterministic() -> None:
    layer, variables = random_layer(deterministic=True)
    x = jax.random.normal(KEY, (6, 16))
    assert_same_bits(layer.apply(variables, x), oracle(np.asarray(x), masks_of(variables), -1))


def test_random_mode_follows_merge_param() -> None:
    layer, variables = random_layer()
    with pytest.raises(ValueError, match="must be passed to the constructor or at call time"):
        layer.apply(variables, jnp.ones((4, 16)))
    fixed, _ = random_layer(deterministic=False)
    with pytest.raises(ValueError, match="passed to the constructor and at call time"):
        fixed.apply(variables, jnp.ones((4, 16)), deterministic=True)
    with pytest.raises(errors.InvalidRngError):
        fixed.apply(variables, jnp.ones((4, 16)))


def test_grouped_mode_ignores_deterministic_and_needs_no_rng() -> None:
    layer = Masksembles(n=4, scale=2.0, seed=0)
    x = jax.random.normal(KEY, (8, 16))
    variables = layer.init(KEY, x)
    expected = oracle(np.asarray(x), masks_of(variables), -1)
    for deterministic in (None, False, True):
        assert_same_bits(layer.apply(variables, x, deterministic=deterministic), expected)


def test_flax_serialization_round_trip_keeps_the_masks(tmp_path: Path) -> None:
    layer = Masksembles(n=4, scale=3.0, seed=2)
    x = jax.random.normal(KEY, (8, 32))
    variables = layer.init(KEY, x)
    path = tmp_path / "variables.msgpack"
    path.write_bytes(serialization.to_bytes(variables))
    blank = Masksembles(n=4, scale=3.0, seed=99).init(KEY, x)
    restored = serialization.from_bytes(blank, path.read_bytes())
    assert masks_of(restored).dtype == np.bool_
    assert np.array_equal(masks_of(restored), masks_of(variables))
    assert np.array_equal(masks_of(serialization.msgpack_restore(path.read_bytes())), masks_of(variables))
    assert_same_bits(layer.apply(restored, x), np.asarray(layer.apply(variables, x)))


def mlp_masks(variables: Any) -> np.ndarray:
    return np.asarray(variables[MASKS_COLLECTION]["Masksembles_0"]["masks"])


def test_orbax_round_trip_keeps_the_masks(tmp_path: Path) -> None:
    model = LinenMLP()
    x = jax.random.normal(KEY, (8, 3))
    variables = model.init(KEY, x)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", variables)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "ckpt", jax.eval_shape(model.init, KEY, x))
    assert np.array_equal(mlp_masks(restored), mlp_masks(variables))
    assert_same_bits(model.apply(restored, x), np.asarray(model.apply(variables, x)))


@pytest.mark.parametrize("mode", mca.MODES)
def test_optax_training_leaves_the_masks_unchanged(mode: str) -> None:
    model = LinenMLP(mode=mode)
    x = jax.random.normal(KEY, (64, 3))
    target = jnp.sin(x.sum(axis=1, keepdims=True))
    variables = model.init(KEY, x)
    losses, trained = train_linen_mlp(model, variables, x, target, jax.random.split(KEY, 30))
    params, masks = trained["params"], trained[MASKS_COLLECTION]
    assert losses[-1] < 0.5 * losses[0]
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params)), "no mask among the trained params"
    assert np.array_equal(mlp_masks({MASKS_COLLECTION: masks}), mlp_masks(variables))
    assert np.array_equal(mlp_masks(variables), mc.generate_masks(32, 4, 2.0, seed=0))
