"""Keras ``pack`` of a model whose input declares a size None (a sequence length): the packed model declares it None
too, so that it runs on any length as the model does, equal to ``predict`` at lengths other than the example's, in
chunks, compiled and after a ``.keras`` round trip."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
from keras import layers

import masksembles_keras as mk
from masksembles_keras import _packed_layers, _packing
from tests.keras.common import JIT_COMPILE
from tests.keras.test_packing import N, assert_close, masks, members_first

LENGTHS = (5, 2, 9)  # the example's first


def text_model() -> keras.Model:
    """A text-like model on (B, L, 6) for any L: Dense embedding, a convolution over the sequence, a LayerNormalization
    over the channels, multi-head self-attention (folded into the heads), a reshape that infers the length, masks
    before each Dense, pooling over the sequence."""
    inputs = keras.Input((None, 6))
    x = masks("m1", 0)(layers.Dense(16, activation="relu", name="embed")(inputs))
    x = layers.Conv1D(16, 3, padding="same", activation="relu", name="conv")(x)
    x = layers.LayerNormalization(name="norm")(x)
    x = layers.Add()([x, layers.MultiHeadAttention(2, 4, name="attention")(x, x)])
    x = layers.Reshape((-1, 16))(masks("m2", 1)(x))
    x = masks("m3", 2)(layers.Dense(12, activation="gelu", name="mlp")(x))
    x = layers.GlobalAveragePooling1D()(layers.Dense(8, name="out")(x))
    return keras.Model(inputs, layers.Dense(3, name="head")(x), name="text_model")


def sequences(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, length, 6)).astype("float32")


def test_packed_programs_declare_the_models_free_sizes_and_equal_predict_at_every_length() -> None:
    model = text_model()
    x = sequences(5, LENGTHS[0])
    built = {program: mk.pack(model, x, program=program) for program in ("packed", "dense", "auto")}
    member = mk.extract_member(model, 1, x)
    assert built["packed"].program == "packed"
    assert built["packed"].fallbacks == ()
    for packed in (*built.values(), member):
        assert tuple(packed.inputs[0].shape) == (None, None, 6)
    for length in LENGTHS:
        x = sequences(7, length, seed=length)
        expected = mk.predict(model, x, N)
        for packed in built.values():
            assert_close(members_first(packed, x), expected)
        assert_close(np.asarray(member.predict(x, verbose=0)), expected[1])


@pytest.mark.parametrize("jit_compile", JIT_COMPILE)
def test_compiled_predict_runs_each_length(jit_compile: bool) -> None:
    model = text_model()
    packed = mk.pack(model, sequences(5, LENGTHS[0]), program="packed")
    packed.compile(jit_compile=jit_compile)
    for length in LENGTHS:
        x = sequences(8, length, seed=length)
        assert_close(np.moveaxis(packed.predict(x, batch_size=3, verbose=0), 1, 0), mk.predict(model, x, N))


def test_chunks_count_the_length_they_are_called_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``sample_bytes`` counts a free size as 1 and a call multiplies it by the length it gets: with chunks of about
    one sample at length 5 (JAX and TensorFlow run chunks), a call at length 9 runs chunks of one sample too, equal to
    predict, before and after a ``.keras`` round trip."""
    model = text_model()
    packed = mk.pack(model, sequences(5, LENGTHS[0]), program="packed")
    sample_bytes = packed.get_config()["masksembles"].get("sample_bytes", 0)
    assert (sample_bytes > 0) == (keras.backend.backend() in ("jax", "tensorflow"))
    chunks: list[int] = []
    in_chunks = _packing.in_chunks

    def recorded(run, x, samples):  # type: ignore[no-untyped-def]
        chunks.append(samples)
        return in_chunks(run, x, samples)

    monkeypatch.setattr(_packing, "in_chunks", recorded)
    monkeypatch.setattr(_packed_layers, "CHUNK_BYTES", sample_bytes * 5)
    packed.save(tmp_path / "packed.keras")
    loaded = keras.models.load_model(tmp_path / "packed.keras")
    x = sequences(4, 9, seed=3)
    for built in (packed, loaded):
        assert_close(np.moveaxis(built.predict_on_batch(x), 1, 0), mk.predict(model, x, N))
    assert chunks == ([1, 1] if sample_bytes else [])
