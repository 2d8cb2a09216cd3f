"""Distributed: JAX DataParallel over 4 virtual CPU devices, TF MirroredStrategy over 2 logical CPU devices.

How grouping relates to per-replica batches:

- JAX ``keras.distribution.DataParallel`` compiles one program over the global batch (the
  batch is sharded, the computation is global), so the layer groups the global batch exactly
  as on one device: inference and a ``fit`` step equal the single-device ones.
- ``tf.distribute.MirroredStrategy`` calls the model once per replica on its per-replica batch,
  so each replica applies the grouping rule to its own batch (all ``n`` members train on every
  replica whose batch has at least ``n`` samples): results equal one device running each
  replica's batch. ``masksembles_keras.predict`` calls the model outside the replicas, so its
  member outputs equal the single-device ones.

Each run needs its devices configured before the framework starts, so it runs in a subprocess
(tests/keras/distributed_worker.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.keras.common import BACKEND
from tests.rounding import assert_rounding_close

ROOT = Path(__file__).resolve().parents[2]


def run_worker(backend: str, tmp_path: Path) -> dict[str, np.ndarray]:
    out = tmp_path / f"{backend}.npz"
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "tests.keras.distributed_worker", backend, str(out)]
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-4000:]
    with np.load(out) as data:
        return {key: data[key] for key in data.files}


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution.DataParallel runs in the keras(jax) session")
def test_jax_data_parallel_equals_one_device(tmp_path: Path) -> None:
    results = run_worker("jax", tmp_path)
    assert int(results["devices"]) == 4, "the distributed model's weights live on the 4 devices"
    assert np.array_equal(results["distributed/masks"], results["single/masks"])
    for key in ("predict", "members"):  # each device multiplies its shard's rows: a matmul may round them differently
        assert_rounding_close(results[f"distributed/{key}"], results[f"single/{key}"], err_msg=key)
    weights = sorted(key.removeprefix("single/") for key in results if key.startswith("single/weight"))
    assert weights
    for key in weights:  # one fit step: equal up to the order of the gradient all-reduce
        assert_rounding_close(results[f"distributed/{key}"], results[f"single/{key}"], err_msg=key)


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.distribute.MirroredStrategy runs in the keras(tensorflow) session"
)
def test_tensorflow_mirrored_strategy_equals_one_device_on_the_same_layout(tmp_path: Path) -> None:
    results = run_worker("tensorflow", tmp_path)
    assert int(results["replicas"]) == 2
    # each replica's batch against the same batches on one device: other devices, other threads, so up to rounding
    assert_rounding_close(results["distributed/predict"], results["single/predict"], err_msg="per-replica grouping")
    assert not np.allclose(results["distributed/predict"], results["single/global_predict"]), (
        "each replica groups its own batch, not the global one"
    )
    assert_rounding_close(results["distributed/members"], results["single/members"])
    trainable = sorted(key.removeprefix("single/") for key in results if key.startswith("single/trainable"))
    assert len(trainable) == 4
    for key in trainable:  # one fit step against the same layout on one device
        assert_rounding_close(results[f"distributed/{key}"], results[f"single/{key}"], err_msg=key)
