"""Saving: ``.keras`` and weights round trips on this backend, and models saved on every backend loaded here."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest

import masksembles_keras as mk
from tests.keras.common import BACKEND, masks_of
from tests.keras.make_fixtures import BACKENDS, FIXTURES, N


def make_model() -> keras.Model:
    """Masks from fresh entropy (seed=None): a loader that regenerated them could not match."""
    inputs = keras.Input((4, 4, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    x = mk.Masksembles2D(N, 2.0, name="conv_masks")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    x = mk.Masksembles(N, 3.0, mode="random", name="dense_masks")(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(10, 4, 4, 3)).astype(np.float32), rng.normal(size=(10, 2)).astype(np.float32)


def masksembles_layers(model: keras.Model) -> dict[str, mk.Masksembles]:
    return {layer.name: layer for layer in model.layers if isinstance(layer, mk.Masksembles)}


def test_keras_file_round_trip_restores_masks_config_and_predictions(tmp_path: Path) -> None:
    model = make_model()
    model.compile(optimizer="adam", loss="mse")
    x, y = data()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)  # no custom_objects: the layers are registered
    for name, layer in masksembles_layers(model).items():
        twin = masksembles_layers(loaded)[name]
        assert type(twin) is type(layer) and twin.get_config() == layer.get_config()
        assert np.array_equal(masks_of(twin), masks_of(layer)), f"{name}: masks must be loaded, not regenerated"
    assert np.array_equal(loaded.predict_on_batch(x), model.predict_on_batch(x))
    assert np.array_equal(mk.predict(loaded, x, N), mk.predict(model, x, N))
    history = loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)  # the compiled state comes back too
    assert np.isfinite(history.history["loss"][-1])


def test_weights_file_round_trip_replaces_the_masks_a_fresh_build_made(tmp_path: Path) -> None:
    model = make_model()
    path = tmp_path / "model.weights.h5"
    model.save_weights(path)
    fresh = make_model()
    assert not np.array_equal(masks_of(fresh.get_layer("conv_masks")), masks_of(model.get_layer("conv_masks")))
    fresh.load_weights(path)
    for name, layer in masksembles_layers(model).items():
        assert np.array_equal(masks_of(fresh.get_layer(name)), masks_of(layer))
    x, _ = data()
    assert np.array_equal(fresh.predict_on_batch(x), model.predict_on_batch(x))


@pytest.mark.parametrize("saved_on", BACKENDS)
def test_model_saved_on_any_backend_loads_here_with_identical_predictions(saved_on: str) -> None:
    expected = np.load(FIXTURES / f"{saved_on}.npz")
    model = keras.saving.load_model(FIXTURES / f"{saved_on}.keras")
    for key in (k for k in expected.files if k.startswith("masks/")):
        assert np.array_equal(masks_of(model.get_layer(key.removeprefix("masks/"))), expected[key]), key
    x = expected["x"]
    assert np.array_equal(model.predict_on_batch(x), expected["y"]), f"saved on {saved_on}, loaded on {BACKEND}"
    assert np.array_equal(mk.predict(model, x, N), expected["members"])
