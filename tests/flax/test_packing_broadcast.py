"""Flax pack/extract_member on a product with an operand broadcast along the channels: a padding mask from the token
ids (shared by every member) is read as it is by the members' compacted copies; one computed from a masked value runs
at full width. NNX here; linen packs through the same capture."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from masksembles_flax import predict
from masksembles_flax.nnx import Masksembles, extract_member, pack
from tests.flax.test_packing import kernels, linear, relative_error

N = 4
VOCAB, WIDTH, CLASSES, LENGTH = 11, 16, 3, 7


class PaddedMean(nnx.Module):
    """Token ids -> embedding -> Linear -> ReLU -> masks, multiplied by a (B, L, 1) mask, a Linear, a masked mean over
    the sequence, a Linear head. ``mask``: "padding" ((tokens != 0) as float) or "norm" (the masked hidden state's
    norm over the channels: a value per member)."""

    def __init__(self, mask: str, rngs: nnx.Rngs) -> None:
        self.mask = mask
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.fc, self.proj, self.head = linear(WIDTH, WIDTH, rngs), linear(WIDTH, WIDTH, rngs), linear(WIDTH, 3, rngs)
        self.masks = Masksembles(WIDTH, N, 2.0, seed=0)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        hidden = self.masks(nnx.relu(self.fc(self.embed(tokens))))
        if self.mask == "padding":
            mask = (tokens != 0).astype(jnp.float32)[..., None]
        else:
            mask = jnp.linalg.norm(hidden, axis=-1, keepdims=True)
        hidden = self.proj(hidden * mask)
        return self.head(hidden.sum(1) / jnp.maximum(mask.sum(1), 1.0))


def tokens(batch: int, seed: int) -> jax.Array:
    ids = np.random.default_rng(seed).integers(1, VOCAB, size=(batch, LENGTH))
    ids[:, LENGTH - 2 :] = 0  # padding at the end of every sequence
    ids[0, 2:] = 0
    return jnp.asarray(ids, jnp.int32)


def assert_equals_predict(model: PaddedMean, x: jax.Array) -> None:
    """pack (from an example of another batch size) equals predict; extract_member(k) equals member k."""
    expected = predict(model, x, N)
    assert relative_error(pack(model, x[:3], program="packed")(x), expected) <= 1e-5
    for k in range(N):
        assert relative_error(extract_member(model, k, x)(x), expected[k]) <= 1e-5


def primitives(fallbacks: tuple[str, ...]) -> list[str]:
    return [where.split(" ")[0] for where in fallbacks]


def test_a_padding_mask_broadcast_along_the_channels_is_read_as_it_is_by_the_members_copies() -> None:
    model = PaddedMean("padding", nnx.Rngs(0))
    x = tokens(5, 1)
    assert_equals_predict(model, x)
    packed = pack(model, x, program="packed")
    assert packed.program == "packed"
    # the mask, computed once from the token ids (ne, convert and broadcast_in_dim on one line: one place), its sum
    assert primitives(packed.fallbacks) == ["gather", "broadcast_in_dim", "reduce_sum", "max"]
    live = {int(row.sum()) for row in np.asarray(model.masks.masks[...])}
    assert live == {9}
    assert kernels(packed, "dot_general") == [(N, WIDTH, 9), (N, 9, WIDTH), (N, WIDTH, CLASSES)], (
        "proj reads each member's 9 live channels (the head every channel: a division is never known zero)"
    )


@pytest.mark.parametrize("batch", [1, 5])
def test_a_broadcast_operand_computed_per_member_runs_at_full_width(batch: int) -> None:
    model = PaddedMean("norm", nnx.Rngs(0))
    x = tokens(batch, 2)
    assert_equals_predict(model, x)
    packed = pack(model, x, program="packed")
    assert {"mul", "div"} <= set(primitives(packed.fallbacks))
    assert kernels(packed, "dot_general")[1] == (N, WIDTH, WIDTH), "proj reads the member-stacked product"
