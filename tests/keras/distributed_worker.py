"""Distributed runs for tests/keras/test_distributed.py, each in a fresh process (devices are set before start-up).

    export XLA_FLAGS=--xla_force_host_platform_device_count=4
    KERAS_BACKEND=jax python -m tests.keras.distributed_worker jax OUT
    KERAS_BACKEND=tensorflow python -m tests.keras.distributed_worker tensorflow OUT

Both build the same model twice (same initial weights, same masks), once on one device and once
distributed, run inference and one ``fit`` step on the same data, and save everything to the
``.npz`` file OUT for the test to compare.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

N = 3
GLOBAL_BATCH = 12  # 4 JAX devices: shards of 3; 2 TF replicas: per-replica batches of 6 (not multiples of N)
LEARNING_RATE = 0.1


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(GLOBAL_BATCH, 6)).astype(np.float32), rng.normal(size=(GLOBAL_BATCH, 2)).astype(np.float32)


def build(initial: list[np.ndarray] | None = None) -> Any:
    import keras

    import masksembles_keras as mk

    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(12, name="hidden")(inputs)
    masked = mk.Masksembles1D(N, 2.0, seed=0, name="masks")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(masked))
    if initial is not None:
        model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
    return model


def run(model: Any, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Inference, members, then one fit step on the whole batch."""
    import masksembles_keras as mk

    results = {
        "predict": model.predict(x, batch_size=GLOBAL_BATCH, verbose=0),
        "members": mk.predict(model, x, N),
        "masks": model.get_layer("masks").masks.numpy(),
    }
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    results |= {f"weight{i}": w for i, w in enumerate(model.get_weights())}
    return results


def prefixed(prefix: str, results: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {f"{prefix}/{key}": value for key, value in results.items()}


def jax_data_parallel(out: str) -> None:
    import jax
    import keras

    devices = jax.devices()
    assert len(devices) == 4, f"expected 4 virtual CPU devices, got {devices}; set XLA_FLAGS before jax starts"
    x, y = data()
    single = build()
    initial = single.get_weights()
    single_results = run(single, x, y)
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    distributed = build(initial)
    kernel_devices = len(distributed.get_layer("hidden").kernel.value.sharding.device_set)
    distributed_results = run(distributed, x, y)
    np.savez(
        out,
        devices=kernel_devices,
        **prefixed("single", single_results),
        **prefixed("distributed", distributed_results),
    )


def tensorflow_mirrored(out: str) -> None:
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import masksembles_keras as mk

    x, y = data()
    replica_batch = GLOBAL_BATCH // 2
    single = build()
    initial = single.get_weights()
    # The same layout on one device: each replica's batch through the model, the loss averaged over the global batch.
    with tf.GradientTape() as tape:
        parts = [single(x[i : i + replica_batch]) for i in (0, replica_batch)]
        loss = tf.reduce_mean(tf.square(tf.concat(parts, axis=0) - y))
    gradients = tape.gradient(loss, single.trainable_weights)
    stepped = [w.numpy() - LEARNING_RATE * g.numpy() for w, g in zip(single.trainable_weights, gradients, strict=True)]
    single_results = {
        "predict": tf.concat(parts, axis=0).numpy(),
        "members": mk.predict(single, x, N),
        "global_predict": single.predict_on_batch(x),
        **{f"trainable{i}": w for i, w in enumerate(stepped)},
    }
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        distributed = build(initial)
    distributed_results = run(distributed, x, y)
    distributed_results |= {f"trainable{i}": w.numpy() for i, w in enumerate(distributed.trainable_weights)}
    np.savez(
        out,
        replicas=strategy.num_replicas_in_sync,
        **prefixed("single", single_results),
        **prefixed("distributed", distributed_results),
    )


if __name__ == "__main__":
    backend, out_path = sys.argv[1], sys.argv[2]
    {"jax": jax_data_parallel, "tensorflow": tensorflow_mirrored}[backend](out_path)
