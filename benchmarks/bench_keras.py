"""Keras layer forward speed on each backend, against that backend's own ``x * 1.0``.

    python benchmarks/bench_keras.py [--rounds 15] [--backends tensorflow jax torch] [--no-write]

Masksembles2D(n=4, scale=2) forward on (64, 32, 32, 256) float32, channels-last, compiled
(``jit_compile``: XLA through ``tf.function(jit_compile=True)`` on TensorFlow and ``jax.jit`` of
``stateless_call`` on JAX; ``torch.compile`` on PyTorch) and eager. The baseline ``x * 1.0`` is
compiled the same way in the same process (XLA rewrites it to a copy, the same memory traffic as
a multiply). Each backend runs in its own subprocess (KERAS_BACKEND is read once); layer and
baseline are timed in turn within every round; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _report import interleaved_medians, machine, publish

SHAPE = (64, 32, 32, 256)
N, SCALE = 4, 2.0
BACKENDS = ("tensorflow", "jax", "torch")
ROOT = Path(__file__).resolve().parent.parent
COMPILER = {"tensorflow": "XLA (tf.function jit_compile)", "jax": "XLA (jax.jit)", "torch": "torch.compile"}


def functions(backend: str, compiled: bool) -> dict[str, Callable[[], object]]:
    """The layer and the baseline as zero-argument callables that finish their work before returning."""
    import keras

    import masksembles_keras as mk

    x_host = np.random.default_rng(0).normal(size=SHAPE).astype(np.float32)
    layer = mk.Masksembles2D(N, SCALE, seed=0)
    layer.build(SHAPE)
    x = keras.ops.convert_to_tensor(x_host)
    layer_fn: Callable[[], Any]
    base_fn: Callable[[], Any]
    if backend == "tensorflow":
        import tensorflow as tf

        forward = tf.function(layer, jit_compile=True) if compiled else layer
        multiply = tf.function(lambda v: v * 1.0, jit_compile=True) if compiled else (lambda v: v * 1.0)
        layer_fn, base_fn = (lambda: forward(x)), (lambda: multiply(x))
    elif backend == "jax":
        import jax

        masks = layer.masks.value
        if compiled:
            forward = jax.jit(lambda m, v: layer.stateless_call([], [m], v)[0])
            multiply = jax.jit(lambda v: v * 1.0)
            layer_fn, base_fn = (
                (lambda: forward(masks, x).block_until_ready()),
                (lambda: multiply(x).block_until_ready()),
            )
        else:
            layer_fn, base_fn = (lambda: layer(x).block_until_ready()), (lambda: (x * 1.0).block_until_ready())
    else:
        import torch

        torch.set_grad_enabled(False)
        forward = torch.compile(layer) if compiled else layer
        multiply = torch.compile(lambda v: v * 1.0) if compiled else (lambda v: v * 1.0)
        layer_fn, base_fn = (lambda: forward(x)), (lambda: multiply(x))
    return {"x * 1.0": base_fn, "Masksembles2D": layer_fn}


def child(backend: str, rounds: int) -> None:
    """Run in a subprocess with KERAS_BACKEND=backend; print one JSON line of medians."""
    results = {}
    for compiled in (True, False):
        medians = interleaved_medians(functions(backend, compiled), rounds=rounds, warmup=3)
        results["compiled" if compiled else "eager"] = medians
    print(json.dumps(results))


def run_backend(backend: str, rounds: int) -> dict[str, dict[str, float]]:
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, __file__, "--child", backend, "--rounds", str(rounds)]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise SystemExit(f"{backend} failed:\n{completed.stderr[-3000:]}")
    result: dict[str, dict[str, float]] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    parser.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rounds)
        return

    import keras

    rows = [
        "| backend | mode | `x * 1.0` (ms) | Masksembles2D (ms) | layer ÷ `x * 1.0` |",
        "|---|---|---:|---:|---:|",
    ]
    for backend in args.backends:
        results = run_backend(backend, args.rounds)
        for mode in ("compiled", "eager"):
            base, layer = results[mode]["x * 1.0"], results[mode]["Masksembles2D"]
            label = f"jit_compile: {COMPILER[backend]}" if mode == "compiled" else "eager"
            row = f"| {backend} | {label} | {base * 1e3:.2f} | {layer * 1e3:.2f} | {layer / base:.2f}× |"
            rows.append(row)
            print(row, flush=True)
    text = "\n".join(
        [
            "## Keras 3 layer forward (per backend)",
            "",
            f"`masksembles_keras.Masksembles2D(n={N}, scale={SCALE})` forward on {SHAPE} float32 (channels-last), "
            f"divided by the same backend's `x * 1.0` compiled the same way, timed in turn in the same process; "
            f"medians of {args.rounds} rounds, Keras {keras.__version__}, CPU, on {machine()}. "
            "Target: compiled ≤ 1.15×. Both are memory-bound (read and write 64 MiB); XLA rewrites `x * 1.0` "
            "to a copy, which moves the same bytes.",
            "",
            *rows,
        ]
    )
    publish("keras", text, write=not args.no_write)


if __name__ == "__main__":
    main()
