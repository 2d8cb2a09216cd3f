"""Keras pack/extract_member on a product with an operand broadcast along the channels (a ``Multiply`` layer or
``keras.ops.multiply``): a padding mask from the token ids (shared by every member) is read as it is by the members'
compacted blocks; one computed from a masked value runs at full width."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import layers, ops

import masksembles_keras as mk
from tests.keras.test_packing import assert_close, call, masks, members_first

N = 4
VOCAB, WIDTH, CLASSES, LENGTH = 11, 16, 3, 7


def padded_mean(mask: str, product: str) -> keras.Model:
    """Token ids -> embedding -> Dense (ReLU) -> masks, multiplied (``product``: "layer" or "op") by a (B, L, 1) mask,
    a Dense, a masked mean over the sequence, a Dense head. ``mask``: "padding" ((tokens != 0) as float) or "norm"
    (the masked hidden state's norm over the channels: a value per member)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((LENGTH,), dtype="int32")
    hidden = masks("m", 0)(layers.Dense(WIDTH, activation="relu")(layers.Embedding(VOCAB, WIDTH)(tokens)))
    if mask == "padding":
        weight = ops.expand_dims(ops.cast(ops.not_equal(tokens, 0), "float32"), -1)
    else:
        weight = ops.sqrt(ops.sum(ops.square(hidden), axis=-1, keepdims=True))
    masked = layers.Multiply()([hidden, weight]) if product == "layer" else ops.multiply(hidden, weight)
    hidden = layers.Dense(WIDTH, name="proj")(masked)
    pooled = ops.sum(hidden, axis=1) / ops.maximum(ops.sum(weight, axis=1), 1.0)
    return keras.Model(tokens, layers.Dense(CLASSES)(pooled), name=f"padded_mean_{mask}_{product}")


def tokens(batch: int, seed: int) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(1, VOCAB, size=(batch, LENGTH)).astype("int32")
    ids[:, LENGTH - 2 :] = 0  # padding at the end of every sequence
    ids[0, 2:] = 0
    return ids


def assert_equals_predict(model: keras.Model, x: np.ndarray) -> keras.Model:
    """pack equals predict and extract_member(k) member k; the packed model."""
    packed = mk.pack(model, x, program="packed")
    expected = mk.predict(model, x, N)
    assert packed.program == "packed"
    assert_close(members_first(packed, x), expected)
    for k in range(N):
        assert_close(call(mk.extract_member(model, k, x), x), expected[k])
    return packed


def kinds(packed: keras.Model) -> list[str]:
    """The operation or layer class of each of ``packed.fallbacks`` ("sum_1 (Sum)" -> "Sum")."""
    return [name.rsplit("(", 1)[1].rstrip(")") for name in packed.fallbacks]


def expected_macs(read: int) -> dict[str, int]:
    """Multiply-adds per sample: the first Dense once (before the masks, shared), proj reading ``read`` channels per
    member, the head every channel (a division is never known zero)."""
    fc, proj, head = LENGTH * WIDTH * WIDTH, LENGTH * WIDTH * read, WIDTH * CLASSES
    return {"dense": N * (2 * fc + head), "packed": fc + N * (proj + head), "fallback": 0}


@pytest.mark.parametrize("product", ["layer", "op"])
def test_a_padding_mask_broadcast_along_the_channels_is_read_as_it_is_by_the_members_blocks(product: str) -> None:
    model = padded_mean("padding", product)
    packed = assert_equals_predict(model, tokens(5, 1))
    assert kinds(packed) == ["NotEqual", "Embedding", "Cast", "ExpandDims", "Sum", "Maximum"], (
        "the mask and its sum, computed once from the token ids; the product, the sum over the sequence and the "
        "division run on the members' blocks"
    )
    live = {int(row.sum()) for row in np.asarray(ops.convert_to_numpy(model.get_layer("m").masks)) != 0}
    assert live == {9}
    assert {key: packed.macs[key] for key in ("dense", "packed", "fallback")} == expected_macs(9)


@pytest.mark.parametrize("batch", [1, 5])
def test_a_broadcast_operand_computed_per_member_runs_at_full_width(batch: int) -> None:
    model = padded_mean("norm", "op")
    packed = assert_equals_predict(model, tokens(batch, 2))
    assert {"Multiply", "TrueDivide"} <= set(kinds(packed))
    assert {key: packed.macs[key] for key in ("dense", "packed", "fallback")} == expected_macs(WIDTH)
