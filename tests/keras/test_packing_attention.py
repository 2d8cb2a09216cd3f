"""Keras ``pack`` of ``MultiHeadAttention`` folded into the heads: each member's query, key and value computed from
its own kept channels (``insert``'s default masks sit inside the attention, one per projection), one attention over
the members' heads side by side, masks broadcast over them, the output projection compacted like any Dense; equal
to ``predict``, compiled, after a ``.keras`` round trip, counted in ``macs``. Replicas: a ViT-like encoder with
``insert``'s default masks, a BERT-like encoder with a padding mask, a causal decoder (with and without attention
dropout, which Keras computes by two paths). Each call that does not fold runs whole, with its reason."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from keras import layers, ops

import masksembles_keras as mk
from masksembles_keras._pack_attention import fold_reason
from masksembles_keras._rewire import Masked
from tests.keras.common import JIT_COMPILE
from tests.rounding import assert_rounding_close

N = 4
HIDDEN, HEADS, SIZE, MLP = 16, 2, 8, 24
TOKENS = 6  # the sequence length of every replica
BLOCKS = 1
BATCH = 5


def encoder_block(x: Any, block: int, attention: Callable[[Any], Any]) -> Any:
    """A pre-norm block: LayerNormalization, ``attention``, a residual sum, then a GELU MLP and a residual sum."""
    x = layers.Add()([x, attention(layers.LayerNormalization(name=f"norm{block}a")(x))])
    y = layers.Dense(MLP, activation="gelu", name=f"mlp{block}a")(layers.LayerNormalization(name=f"norm{block}b")(x))
    return layers.Add()([x, layers.Dense(HIDDEN, name=f"mlp{block}b")(y)])


def self_attention(block: int, scores: bool = False, **call: Any) -> Callable[[Any], Any]:
    """Self-attention (with ``scores``, returning its attention scores too, which the block leaves unused)."""
    attention = layers.MultiHeadAttention(HEADS, SIZE, name=f"attention{block}")
    if scores:
        return lambda x: attention(x, x, return_attention_scores=True, **call)[0]
    return lambda x: attention(x, x, **call)


def vit_like(scores: bool = False) -> keras.Model:
    """Patch features (B, 6, 12) embedded by a Dense, an encoder block, mean pooling and a head."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TOKENS, 12), name="patches")
    x = layers.Dense(HIDDEN, name="embed")(inputs)
    for block in range(BLOCKS):
        x = encoder_block(x, block, self_attention(block, scores))
    x = layers.GlobalAveragePooling1D()(layers.LayerNormalization(name="norm")(x))
    return keras.Model(inputs, layers.Dense(5, name="head")(x), name="vit_like")


def bert_like() -> keras.Model:
    """Token features (B, 6, 10) and a padding mask (B, 6), the mask as the attention mask (B, 1, 6) of an encoder
    block, the first token's state through a pooler and a classifier."""
    keras.utils.set_random_seed(1)
    tokens = keras.Input((TOKENS, 10), name="tokens")
    padding = keras.Input((TOKENS,), dtype="int32", name="padding")
    attention_mask = ops.expand_dims(padding, 1)
    x = layers.LayerNormalization(name="embed_norm")(layers.Dense(HIDDEN, name="embed")(tokens))
    for block in range(BLOCKS):
        x = encoder_block(x, block, self_attention(block, attention_mask=attention_mask))
    pooled = layers.Dense(HIDDEN, activation="tanh", name="pooler")(x[:, 0])
    return keras.Model([tokens, padding], layers.Dense(3, name="classifier")(pooled), name="bert_like")


def decoder(dropout: float = 0.0) -> keras.Model:
    """Token features (B, 6, 10), a block of causal self-attention (with ``dropout`` Keras computes the scores
    itself, without it through ``dot_product_attention(is_causal=True)``), per-token logits (B, 6, 11)."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((TOKENS, 10), name="tokens")
    x = layers.Dense(HIDDEN, name="embed")(inputs)
    for block in range(BLOCKS):
        attention = layers.MultiHeadAttention(HEADS, SIZE, dropout=dropout, name=f"attention{block}")
        x = encoder_block(x, block, lambda y, attention=attention: attention(y, y, use_causal_mask=True))
    return keras.Model(inputs, layers.Dense(11, name="logits")(layers.LayerNormalization(name="norm")(x)))


REPLICAS: dict[str, Callable[[], keras.Model]] = {
    "vit_like": vit_like, "bert_like": bert_like, "decoder": decoder, "decoder_dropout": lambda: decoder(0.1),
}  # fmt: skip


def example(model: keras.Model, batch: int = BATCH, seed: int = 0) -> Any:
    """Normal features for every float input; a padding mask with the last tokens of some samples padded."""
    rng = np.random.default_rng(seed)
    leaves = []
    for tensor in model.inputs:
        if tensor.dtype == "int32":
            padding = np.ones((batch, TOKENS), "int32")
            for sample in range(0, batch, 2):
                padding[sample, TOKENS - 1 - sample % TOKENS :] = 0  # the first token always kept
            leaves.append(padding)
        else:
            leaves.append(rng.standard_normal((batch, *tensor.shape[1:])).astype("float32"))
    return leaves[0] if len(leaves) == 1 else leaves


@functools.cache
def inserted(name: str) -> keras.Model:
    """The replica with ``insert``'s default masks (built once: ``pack`` reads a model, never changes it)."""
    return mk.insert(REPLICAS[name](), N, 2.0, seed=0)


@functools.cache
def packed_replica(name: str) -> mk.PackedMasksembles:
    """The replica's packed program, unverified: the tests compare it with ``predict`` themselves."""
    model = inserted(name)
    return mk.pack(model, example(model), program="packed", verify=False)


def members_first(packed: keras.Model, x: Any, **options: Any) -> np.ndarray:
    return np.moveaxis(np.asarray(packed.predict(x, verbose=0, **options)), 1, 0)


def assert_packed(packed: mk.PackedMasksembles) -> None:
    """Built as the packed program, not replaced by verification."""
    assert packed.program == "packed"
    assert not [entry for entry in packed.fallbacks if entry.startswith("verification")]


def test_insert_puts_a_mask_inside_the_attention_before_each_projection() -> None:
    attention = inserted("vit_like").get_layer("attention0")
    projections = [attention._query_dense, attention._key_dense, attention._value_dense]
    assert all(isinstance(projection, Masked) for projection in projections)
    masks = [np.asarray(ops.convert_to_numpy(projection.masksembles.masks)) for projection in projections]
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    assert not isinstance(attention._output_dense, Masked)


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[pytest.mark.slow] if name == "decoder_dropout" else []) for name in REPLICAS]
)  # the decoder with dropout: the same fold, Keras' other attention path (scores computed, not fused)
def test_attention_folds_into_the_heads_and_equals_predict(name: str) -> None:
    model, packed = inserted(name), packed_replica(name)
    assert_packed(packed)
    assert not [entry for entry in packed.fallbacks if "Attention" in entry or "heads" in entry]
    assert packed.macs["fallback"] == 0 and 0 < packed.macs["packed"] < packed.macs["dense"]
    for batch, seed in ((BATCH, 1), (2, 2)):
        x = example(model, batch, seed)
        expected = mk.predict(model, x, N)
        assert_rounding_close(members_first(packed, x), expected)


def test_an_extracted_member_folds_its_heads_and_is_smaller() -> None:
    model = inserted("vit_like")
    member = mk.extract_member(model, 2, example(model), verify=False)
    assert member.fallbacks == () and member.count_params() < model.count_params()
    x = example(model, 3, seed=3)
    assert_rounding_close(np.asarray(member.predict(x, verbose=0)), mk.predict(model, x, N)[2])


def kept(masks: Any) -> int:
    """The widest member's kept channels of a Masksembles layer: the input width of the members' next layer."""
    return int(np.asarray(ops.convert_to_numpy(masks.masks)).sum(axis=1).max())


def test_macs_count_each_projection_on_its_own_kept_channels_and_the_folded_heads() -> None:
    """Per sample, by hand: the embedding once (before any mask); per block each of the query, key and value
    projections on the widest member's kept channels of its own masks, the heads (scores and weighted sums, every
    member's), the output projection on every head's features (it writes the residual stream, read whole), the MLP
    (its first layer writes only what the second's masks keep); the head on its kept channels."""
    model, packed = inserted("vit_like"), packed_replica("vit_like")
    tokens, heads = TOKENS, TOKENS * TOKENS * 2 * HEADS * SIZE
    dense = tokens * 12 * HIDDEN + HIDDEN * 5
    expected = tokens * 12 * HIDDEN + N * kept(model.get_layer("head_masksembles")) * 5
    for block in range(BLOCKS):
        attention = model.get_layer(f"attention{block}")
        for projection in (attention._query_dense, attention._key_dense, attention._value_dense):
            expected += tokens * N * kept(projection.masksembles) * HEADS * SIZE
        mlp_in, mlp_out = (kept(model.get_layer(f"mlp{block}{part}_masksembles")) for part in "ab")
        expected += N * (heads + tokens * HEADS * SIZE * HIDDEN + tokens * mlp_in * mlp_out + tokens * mlp_out * HIDDEN)
        dense += 3 * tokens * HIDDEN * HEADS * SIZE + heads + tokens * HEADS * SIZE * HIDDEN + 2 * tokens * HIDDEN * MLP
    assert packed.macs["packed"] == expected
    assert packed.macs["dense"] == N * dense
    tiled = mk.pack(model, example(model), program="dense")  # the embedding runs once there too
    assert tiled.macs["dense"] == N * dense
    assert tiled.macs["fallback"] == tiled.macs["packed"] == N * dense - (N - 1) * tokens * 12 * HIDDEN


def test_the_attention_mask_is_applied() -> None:
    """Padding other tokens changes the packed model's output as it changes predict's."""
    model, packed = inserted("bert_like"), packed_replica("bert_like")
    tokens, padding = example(model, 4, seed=4)
    unpadded = [tokens, np.ones_like(padding)]
    assert not np.allclose(members_first(packed, [tokens, padding]), members_first(packed, unpadded))
    assert_rounding_close(members_first(packed, unpadded), mk.predict(model, unpadded, N))


# the decoder's save, load and compile is the BERT-like's with a causal mask: a near-duplicate, slow
@pytest.mark.parametrize("name", ["bert_like", pytest.param("decoder", marks=pytest.mark.slow)])
def test_saved_and_compiled_packed_attention_equals_predict(name: str, tmp_path: Path) -> None:
    model, packed = inserted(name), packed_replica(name)
    packed.save(tmp_path / "packed.keras")
    loaded = keras.models.load_model(tmp_path / "packed.keras")
    assert isinstance(loaded, mk.PackedMasksembles) and loaded.fallbacks == packed.fallbacks
    x = example(model, 7, seed=5)
    expected = mk.predict(model, x, N)
    for jit_compile in JIT_COMPILE:
        loaded.compile(jit_compile=jit_compile)
        assert_rounding_close(members_first(loaded, x, batch_size=3), expected)


class OwnAttention(layers.MultiHeadAttention):  # type: ignore[misc]
    """A subclass that computes its own attention (here Keras', which this module cannot know)."""

    def _compute_attention(self, *args: Any, **kwargs: Any) -> Any:
        return super()._compute_attention(*args, **kwargs)


def scores_returned() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((TOKENS, 10))
    x = layers.Dense(HIDDEN, name="embed")(inputs)
    attention = layers.MultiHeadAttention(HEADS, SIZE, name="attention")
    y, _ = attention(x, x, return_attention_scores=True)
    x = layers.GlobalAveragePooling1D()(layers.Add()([x, y]))
    return keras.Model(inputs, layers.Dense(3, name="head")(x))


def over_two_axes() -> keras.Model:
    """Attention over both spatial axes of (B, 3, 2, C)."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((3, 2, 10))
    x = layers.Dense(HIDDEN, name="embed")(inputs)
    x = layers.MultiHeadAttention(HEADS, SIZE, attention_axes=(1, 2), name="attention")(x, x)
    return keras.Model(inputs, layers.Dense(3, name="head")(layers.GlobalAveragePooling2D()(x)))


def keras_masked() -> keras.Model:
    """Embeddings with ``mask_zero``: the attention reads the Keras mask its inputs carry (``pack`` itself does not
    carry Keras masks through its channel moves: the rule is checked on the graph)."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((TOKENS,), dtype="int32")
    x = layers.Embedding(9, HIDDEN, mask_zero=True, name="embed")(inputs)
    x = layers.Dense(HIDDEN, name="project")(x)
    x = layers.MultiHeadAttention(HEADS, SIZE, name="attention")(x, x)
    return keras.Model(inputs, layers.Dense(3, name="head")(ops.mean(x, axis=1)))


def gated() -> keras.Model:
    keras.utils.set_random_seed(6)
    inputs = keras.Input((TOKENS, 10))
    x = layers.Dense(HIDDEN, name="embed")(inputs)
    x = layers.MultiHeadAttention(HEADS, SIZE, use_gate=True, name="attention")(x, x)
    return keras.Model(inputs, layers.Dense(3, name="head")(layers.GlobalAveragePooling1D()(x)))


def subclassed() -> keras.Model:
    keras.utils.set_random_seed(7)
    inputs = keras.Input((TOKENS, 10))
    x = layers.Dense(HIDDEN, name="embed")(inputs)
    x = OwnAttention(HEADS, SIZE, name="attention")(x, x)
    return keras.Model(inputs, layers.Dense(3, name="head")(layers.GlobalAveragePooling1D()(x)))


WHOLE = {
    "scores_returned": (scores_returned, "it returns its attention scores"),
    "over_two_axes": (over_two_axes, "attention over axes (1, 2)"),
    "gated": (gated, "its output is gated"),
    "subclassed": (subclassed, "a subclass that computes its own attention"),
}


def tokens_example(model: keras.Model, batch: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (batch, *model.inputs[0].shape[1:])
    if model.inputs[0].dtype == "int32":
        return rng.integers(0, 9, size=shape).astype("int32")
    return rng.standard_normal(shape).astype("float32")


@pytest.mark.parametrize("name", list(WHOLE))
def test_attention_that_does_not_fold_runs_whole_with_its_reason(name: str) -> None:
    make, reason = WHOLE[name]
    model = mk.insert(make(), N, 2.0, seed=0)
    packed = mk.pack(model, tokens_example(model, BATCH, 0), program="packed", verify=False)
    assert_packed(packed)
    (entry,) = [entry for entry in packed.fallbacks if "attention (" in entry]
    assert entry.startswith(f"attention ({type(model.get_layer('attention')).__name__}): runs whole: {reason}")
    assert packed.macs["fallback"] > 0  # the attention, counted
    x = tokens_example(model, 3, 1)
    assert_rounding_close(members_first(packed, x), mk.predict(model, x, N))


def test_attention_reading_keras_masks_does_not_fold() -> None:
    layer = keras_masked().get_layer("attention")
    (node,) = layer._inbound_nodes
    assert fold_reason(layer, node.arguments.args, node.arguments.kwargs) == "its inputs carry Keras masks"


def test_the_fallback_share_drops_where_the_attention_folds() -> None:
    """The same encoder, its attention layers returning their scores (unused: they run whole) or not (they fold):
    a third and more of the multiply-adds at full width, then none."""
    shares = {}
    for scores in (True, False):
        packed = packed_replica("vit_like")
        if scores:
            model = mk.insert(vit_like(scores), N, 2.0, seed=0)
            packed = mk.pack(model, example(model), program="packed", verify=False)
        shares[scores] = packed.macs["fallback"] / packed.macs["packed"]
    assert shares[True] > 0.3 and shares[False] == 0


def test_a_mask_computed_per_member_runs_the_heads_unfolded() -> None:
    """An attention mask read from a value after Masksembles differs by member: the heads run as a plain fallback on
    the member-stacked batch, the projections still compacted, equal to predict."""
    keras.utils.set_random_seed(8)
    inputs = keras.Input((TOKENS, 10))
    x = mk.Masksembles(N, 2.0, seed=0, name="masks")(layers.Dense(HIDDEN, name="embed")(inputs))
    attention_mask = ops.expand_dims(ops.not_equal(x[:, :, 0], 1e9), 1)
    x = layers.MultiHeadAttention(HEADS, SIZE, name="attention")(x, x, attention_mask=attention_mask)
    model = keras.Model(inputs, layers.Dense(3, name="head")(layers.GlobalAveragePooling1D()(x)))
    x = tokens_example(model, BATCH, 0)
    packed = mk.pack(model, x, program="packed", verify=False)
    assert_packed(packed)
    assert "attention/heads (AttentionHeads): not folded into the heads: a mask it reads is computed per member" in (
        packed.fallbacks
    )
    assert packed.macs["fallback"] == N * TOKENS * TOKENS * 2 * HEADS * SIZE
    x = tokens_example(model, 3, 1)
    assert_rounding_close(members_first(packed, x), mk.predict(model, x, N))


def test_dropout_in_training_is_refused_as_random() -> None:
    keras.utils.set_random_seed(9)
    inputs = keras.Input((TOKENS, 10))
    x = mk.Masksembles(N, 2.0, seed=0, name="masks")(layers.Dense(HIDDEN, name="embed")(inputs))
    x = layers.MultiHeadAttention(HEADS, SIZE, dropout=0.5, name="attention")(x, x, training=True)
    model = keras.Model(inputs, layers.Dense(3, name="head")(layers.GlobalAveragePooling1D()(x)))
    with pytest.raises(ValueError, match="random"):
        mk.pack(model, tokens_example(model, BATCH, 0), program="packed")
