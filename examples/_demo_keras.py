"""Keras 3 path of the demo (any backend, chosen by KERAS_BACKEND): the models of ``_demo_common.ModelSpec``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
from _demo_common import ModelSpec, TrainConfig
from keras import layers
from numpy.typing import NDArray
from tqdm.auto import tqdm

import masksembles_keras as mk

PREDICT_BATCH = 1024

if keras.backend.backend() == "torch":
    import torch

    # The demo's models are tiny: one intra-op thread is much faster than two on a busy machine (as in _demo_torch).
    torch.set_num_threads(1)


def regularizer(spec: ModelSpec, block: int, *, conv: bool) -> layers.Layer:
    """What follows hidden block ``block``: Masksembles with its masks, channel dropout, or nothing."""
    if spec.method == "masksembles":
        return (mk.Masksembles2D if conv else mk.Masksembles1D)(scale=spec.scale, masks=spec.masks[block])
    if spec.method == "dropout":
        return layers.SpatialDropout2D(spec.rate) if conv else layers.Dropout(spec.rate)
    return layers.Identity()


def channels_last(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """Images (B, C, H, W) -> (B, H, W, C), Keras' default layout; feature vectors unchanged."""
    return np.ascontiguousarray(np.moveaxis(x, 1, -1)) if x.ndim == 4 else x


def build(spec: ModelSpec) -> keras.Sequential:
    """The network of ``spec`` (see ``ModelSpec``), channels-last, initialized from the global Keras seed."""
    widths = spec.widths
    if spec.arch == "mlp":
        return keras.Sequential(
            [
                keras.Input(spec.in_shape),
                layers.Dense(widths[0], activation="relu"),
                regularizer(spec, 0, conv=False),
                layers.Dense(widths[1], activation="relu"),
                regularizer(spec, 1, conv=False),
                layers.Dense(spec.outputs),
            ]
        )
    channels, height, width = spec.in_shape
    return keras.Sequential(
        [
            keras.Input((height, width, channels)),
            layers.Conv2D(widths[0], 3, padding="same", activation="relu"),
            layers.MaxPooling2D(2),
            regularizer(spec, 0, conv=True),
            layers.Conv2D(widths[1], 3, padding="same", activation="relu"),
            regularizer(spec, 1, conv=True),
            layers.Flatten(),
            layers.Dense(widths[2], activation="relu"),
            regularizer(spec, 2, conv=False),
            layers.Dense(spec.outputs),
        ]
    )


class EpochBar(keras.callbacks.Callback):
    """A tqdm bar over the epochs of ``fit``."""

    def __init__(self, epochs: int, desc: str) -> None:
        super().__init__()
        self.bar = tqdm(total=epochs, desc=desc, leave=False, disable=None, unit="epoch")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.bar.update()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.bar.close()


@dataclass
class KerasModel:
    """A trained Keras model and how to get its members' predictions."""

    model: keras.Sequential
    spec: ModelSpec
    parameters: int
    seconds: float

    def predict(self, x: NDArray[np.float32]) -> NDArray[np.float64]:
        """Member outputs (logits, or mean and log-variance), (B, ...) -> (members, B, K)."""
        inputs = channels_last(x)
        if self.spec.method == "masksembles":
            logits = mk.predict(self.model, inputs, self.spec.samples, batch_size=PREDICT_BATCH)
        elif self.spec.method == "dropout":  # MC-Dropout: training=True only switches the dropout layers on
            logits = np.stack(
                [keras.ops.convert_to_numpy(self.model(inputs, training=True)) for _ in range(self.spec.samples)]
            )
        else:
            logits = keras.ops.convert_to_numpy(self.model(inputs, training=False))[None]
        return np.asarray(logits, dtype=np.float64)


def train(
    spec: ModelSpec,
    x: NDArray[np.float32],
    y: NDArray[np.int64] | NDArray[np.float32],
    config: TrainConfig,
    *,
    seed: int,
    desc: str,
) -> KerasModel:
    """Build ``spec`` from ``seed`` and train it with Adam (``fit``) on shuffled mini-batches of (x, y).

    Classifiers minimize the cross-entropy, regressors the Gaussian NLL of ``mk.GaussianNLL``.
    """
    keras.utils.set_random_seed(seed)
    model = build(spec)
    loss = (
        keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if spec.task == "classification"
        else mk.GaussianNLL()
    )
    model.compile(optimizer=keras.optimizers.Adam(config.learning_rate), loss=loss)
    start = time.perf_counter()
    model.fit(
        channels_last(x),
        y,
        batch_size=config.batch_size,
        epochs=config.epochs,
        shuffle=True,
        verbose=0,
        callbacks=[EpochBar(config.epochs, desc)],
    )
    seconds = time.perf_counter() - start
    parameters = sum(int(np.prod(weight.shape)) for weight in model.trainable_weights)  # not the masks
    return KerasModel(model, spec, parameters, seconds)
