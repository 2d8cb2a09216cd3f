"""Regenerate the cross-backend ``.keras`` fixtures: one model saved on each Keras backend.

    python tests/keras/make_fixtures.py                 # every backend, one subprocess each
    python tests/keras/make_fixtures.py --backend jax   # one backend (needs masksembles_keras importable)

Each ``fixtures/<backend>.keras`` holds a model with four Masksembles layers (masks from fresh
entropy, so a loader that regenerated them would fail) and Dense layers with small integer
weights, so that every backend computes its predictions exactly. ``fixtures/<backend>.npz``
holds the input, the saving backend's predictions and member outputs, and each layer's masks.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("tensorflow", "jax", "torch")
N = 4


def build_model() -> object:
    import keras
    import numpy as np

    import masksembles_keras as mk

    inputs = keras.Input((2, 3, 4))
    x = keras.layers.Dense(6)(inputs)
    x = mk.Masksembles2D(N, 2.0, name="bhwc")(x)
    x = keras.layers.Permute((3, 1, 2))(x)
    x = mk.Masksembles2D(N, 3.0, channel_axis=1, name="bchw")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(10)(x)
    x = mk.Masksembles1D(N, 1.5, mode="random", name="random")(x)
    x = keras.layers.Reshape((5, 2))(x)
    x = mk.Masksembles(N, 1.0, channel_axis=1, name="any")(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(x)))
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dense):
            layer.set_weights([rng.integers(-3, 4, size=w.shape).astype(np.float32) for w in layer.get_weights()])
    return model


def write(backend: str) -> None:
    os.environ["KERAS_BACKEND"] = backend  # before the first import of keras
    import keras
    import numpy as np

    import masksembles_keras as mk

    assert keras.backend.backend() == backend, keras.backend.backend()
    model = build_model()
    x = np.random.default_rng(1).integers(-3, 4, size=(6, 2, 3, 4)).astype(np.float32)
    masks = {f"masks/{layer.name}": layer.masks.numpy() != 0 for layer in model.layers if hasattr(layer, "masks")}
    FIXTURES.mkdir(exist_ok=True)
    model.save(FIXTURES / f"{backend}.keras")
    outputs = {"y": model.predict_on_batch(x), "members": mk.predict(model, x, N)}
    np.savez(FIXTURES / f"{backend}.npz", x=x, **outputs, **masks)
    print(f"wrote {backend}.keras and {backend}.npz in {FIXTURES}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=BACKENDS)
    args = parser.parse_args()
    if args.backend:
        write(args.backend)
        return
    for backend in BACKENDS:
        env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, __file__, "--backend", backend], check=True, env=env)


if __name__ == "__main__":
    main()
