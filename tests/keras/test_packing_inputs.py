"""Keras ``pack`` of functional models with several inputs and outputs, as a list or a dict by name: the packed model
takes and returns the model's own structures (each output (B, m, ...), or (B, ...) for one member), equal to
``predict``; the first input is the one the program starts from, the others are read where the model reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from keras import layers, ops

import masksembles_keras as mk
from tests.keras.test_packing import N, assert_close, masks


def two_tower(structure: str) -> keras.Model:
    """Tokens (B, L, 6) with a padding mask (B, L), and features (B, 3): a masked mean over the tokens and a Dense
    tower, joined; two outputs, a class score from both towers and a per-token score."""
    tokens = keras.Input((None, 6), name="tokens")
    padding = keras.Input((None,), name="padding")
    features = keras.Input((3,), name="features")
    x = masks("m1", 0)(layers.Dense(16, activation="relu", name="embed")(tokens))
    x = layers.Dense(16, activation="relu", name="hidden")(x) * ops.expand_dims(padding, -1)
    x = masks("m2", 1)(x)
    pooled = ops.sum(x, axis=1) / ops.maximum(ops.sum(padding, axis=1, keepdims=True), 1.0)
    tower = masks("m3", 2)(layers.Dense(8, activation="relu", name="tower")(features))
    joined = masks("m4", 3)(layers.Dense(12, activation="relu", name="joined")(layers.Concatenate()([pooled, tower])))
    scores = layers.Dense(3, name="scores")(joined)
    per_token = layers.Dense(1, name="per_token")(masks("m5", 4)(x))
    if structure == "dict":
        inputs = {"tokens": tokens, "padding": padding, "features": features}
        return keras.Model(inputs, {"scores": scores, "per_token": per_token}, name="two_tower")
    return keras.Model([tokens, padding, features], [scores, per_token], name="two_tower")


def example(structure: str, batch: int, length: int, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    padding = np.ones((batch, length), "float32")
    padding[0, length // 2 :] = 0.0
    leaves = {
        "tokens": rng.standard_normal((batch, length, 6)).astype("float32"),
        "padding": padding,
        "features": rng.standard_normal((batch, 3)).astype("float32"),
    }
    return leaves if structure == "dict" else [leaves["tokens"], leaves["padding"], leaves["features"]]


def assert_members(actual: Any, expected: Any, member: int | None = None) -> None:
    """``actual`` (a packed model's batch-first output) equals ``predict``'s ``expected``, leaf by leaf and in the
    same structure; ``member``: an extracted member's."""
    keras.tree.assert_same_structure(actual, expected)
    for got, wanted in zip(keras.tree.flatten(actual), keras.tree.flatten(expected), strict=True):
        assert_close(np.asarray(got), wanted[member]) if member is not None else assert_close(
            np.moveaxis(np.asarray(got), 1, 0), wanted
        )


@pytest.mark.parametrize("structure", ["dict", "list"])
def test_every_program_and_a_member_equal_predict_in_the_models_structure(structure: str) -> None:
    model = two_tower(structure)
    x = example(structure, 5, 7)
    built = {program: mk.pack(model, x, program=program) for program in ("packed", "dense", "auto")}
    member = mk.extract_member(model, 2, x)
    assert built["packed"].program == "packed" and built["packed"].macs["packed"] < built["packed"].macs["dense"]
    assert not any("tokens" in f or "padding" in f or "features" in f for f in built["packed"].fallbacks)
    for batch, length in ((5, 7), (6, 3)):
        x = example(structure, batch, length, seed=batch)
        expected = mk.predict(model, x, N)
        scores = keras.tree.flatten(expected)[0 if structure == "list" else 1]
        assert float(np.std(scores, axis=0).max()) > 1e-3  # the members differ
        for packed in built.values():
            assert_members(packed.predict(x, verbose=0), expected)
        assert_members(member.predict(x, verbose=0), expected, member=2)


def test_round_trip_through_a_keras_file(tmp_path: Path) -> None:
    model = two_tower("dict")
    x = example("dict", 5, 7)
    packed = mk.pack(model, x, program="packed")
    packed.save(tmp_path / "packed.keras")
    loaded = keras.models.load_model(tmp_path / "packed.keras")
    assert isinstance(loaded, mk.PackedMasksembles) and loaded.fallbacks == packed.fallbacks
    assert_members(loaded.predict(x, verbose=0), mk.predict(model, x, N))


def test_an_example_that_does_not_fit_the_inputs_is_refused() -> None:
    model = two_tower("dict")
    x = example("dict", 5, 7)
    with pytest.raises(ValueError, match=r"the model's inputs \['features', 'padding', 'tokens'\]"):
        mk.pack(model, {"tokens": x["tokens"]})
    with pytest.raises(ValueError, match=r"one array per input of the model \(3\); received 2"):
        mk.pack(two_tower("list"), example("list", 5, 7)[:2])
    with pytest.raises(ValueError, match="padding: 4"):
        mk.pack(model, {**x, "padding": x["padding"][:4]})
