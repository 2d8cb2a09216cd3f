"""``predict`` against the tiled call a user would write by hand, on every framework and Keras backend.

    python benchmarks/bench_predict.py [--rounds 5] [--runs 3] [--frameworks keras-jax,flax-nnx,...]
        [--models "README CNN,ResNet-like"] [--batches 1,64,256] [--json runs.json] [--no-write]
    python benchmarks/bench_predict.py --from-json keras.json,flax.json  # publish runs saved apart, joined

For each framework (Keras on TensorFlow, JAX and PyTorch, Flax NNX and linen, PyTorch; each in its own process:
Keras reads KERAS_BACKEND once), the README's small CNN (the linen one written like the NNX one) and a ResNet-like
(bench_keras_packing.py's, bench_flax_packing.py's and bench_packing.py's; for linen the NNX one written in linen),
n=4, S=2, float32, at batch 1, 64 and 256: ``predict(model, x, n=4)`` ÷ the best hand-written tiled call that
returns the same (n, B, ...) members, timed in turn within every round (``timed_rounds``), after one warm-up round:

- Keras: ``model.predict(np.tile(x, ...), batch_size=n*B)`` reshaped (the call the issue compared against);
- NNX: ``nnx.jit(lambda m, v: untile(m(tile(v, n)), n))`` on the model in eval mode, made once;
- linen: ``jax.jit(lambda variables, v: untile(apply(variables, tile(v, n)), n))``, made once, against
  ``predict(functools.partial(module.apply, variables), x)``;
- PyTorch: ``model(x.repeat(n, 1, 1, 1)).unflatten(0, (n, B))`` under ``torch.no_grad()``, the model in eval mode.

Each row: the two medians, the ratio of the medians and the range of the per-round ratios; the two results are
checked equal (float32 rounding tolerance) before timing. The two calls swap places every round (neither always runs
first, after the other's allocations), and a call of under ``ROUND_SECONDS`` is timed as the mean of as many calls in
a row as make one round of that length (the same count for both), so a batch-1 row's round is not one 10 ms call.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from _report import machine, publish

N, SCALE = 4, 2.0
BATCHES = (1, 64, 256)
MODELS = ("README CNN", "ResNet-like")
FRAMEWORKS = ("keras-tensorflow", "keras-jax", "keras-torch", "flax-nnx", "flax-linen", "torch")
HERE = Path(__file__).resolve().parent
ROUND_SECONDS = 0.25  # a faster call is repeated within a round until the round lasts about this long

# model name -> (predict(x), the hand-written tiled call(x), the input shape without the batch)
Cases = dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any], tuple[int, ...]]]


def keras_cases() -> Cases:
    import keras
    from bench_keras_packing import build, resnet

    import masksembles_keras as mk

    def readme_cnn(enabled: bool) -> keras.Model:
        inputs = keras.Input((32, 32, 3))
        x = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
        x = keras.layers.Conv2D(64, 3, activation="relu")(x)
        outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x))
        return mk.insert(keras.Model(inputs, outputs), n=N, scale=SCALE, seed=0)

    def by_hand(model: keras.Model, x: np.ndarray) -> np.ndarray:
        tiled = np.tile(x, (N,) + (1,) * (x.ndim - 1))
        return model.predict(tiled, batch_size=len(tiled), verbose=0).reshape(N, len(x), -1)

    cases: Cases = {}
    for name, builder in (("README CNN", readme_cnn), ("ResNet-like", resnet)):
        model = build(builder, True)
        cases[name] = (functools.partial(mk.predict, model, n=N), functools.partial(by_hand, model), (32, 32, 3))
    return cases


def nnx_cases() -> Cases:
    import jax
    import jax.numpy as jnp
    from bench_flax_packing import resnet
    from flax import nnx

    import masksembles_flax as mf
    from masksembles_flax import nnx as mn

    class CNN(nnx.Module):  # the README's
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.conv1 = nnx.Conv(3, 32, (3, 3), rngs=rngs)
            self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
            self.head = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            x = nnx.relu(self.conv2(nnx.relu(self.conv1(x))))
            return self.head(x.mean((1, 2)))

    by_hand = nnx.jit(lambda model, v: mf.untile(model(mf.tile(v, N)), N))
    cases: Cases = {}
    for name, model in (("README CNN", mn.insert(CNN(nnx.Rngs(0)), N, SCALE, seed=0)), ("ResNet-like", resnet(True))):
        evaluated = nnx.merge(*nnx.split(model))
        evaluated.eval()
        cases[name] = (
            lambda x, m=model: jax.block_until_ready(mf.predict(m, jnp.asarray(x), n=N)),
            lambda x, m=evaluated: jax.block_until_ready(by_hand(m, jnp.asarray(x))),
            (32, 32, 3),
        )
    return cases


def linen_cases() -> Cases:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import masksembles_flax as mf
    from masksembles_flax import linen as ml

    class CNN(nn.Module):  # the README's NNX CNN in linen, masks where insert puts them
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = nn.relu(nn.Conv(64, (3, 3))(ml.Masksembles(n=N, scale=SCALE, seed=0)(x, deterministic=True)))
            return nn.Dense(10)(ml.Masksembles(n=N, scale=SCALE, seed=1)(x.mean((1, 2)), deterministic=True))

    class ResNet(nn.Module):  # bench_flax_packing.resnet in linen (BatchNorm with running statistics)
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            def conv_bn(y: jax.Array, channels: int, strides: int = 1) -> jax.Array:
                y = nn.Conv(channels, (3, 3), strides=strides, use_bias=False)(y)
                return nn.BatchNorm(use_running_average=True)(y)

            def block(y: jax.Array, channels: int, seed: int) -> jax.Array:
                z = ml.Masksembles(n=N, scale=SCALE, seed=seed)(nn.relu(conv_bn(y, channels)), deterministic=True)
                return nn.relu(y + conv_bn(z, channels))

            x = block(nn.relu(conv_bn(x, 64)), 64, 0)
            x = block(nn.relu(conv_bn(x, 128, strides=2)), 128, 1)
            x = ml.Masksembles(n=N, scale=SCALE, seed=2)(x.mean((1, 2)), deterministic=True)
            return nn.Dense(10)(x)

    cases: Cases = {}
    for name, module in (("README CNN", CNN()), ("ResNet-like", ResNet())):
        variables = module.init(jax.random.key(0), jnp.ones((N, 32, 32, 3)))
        by_hand = jax.jit(lambda v, x, apply=module.apply: mf.untile(apply(v, mf.tile(x, N)), N))
        model = functools.partial(module.apply, variables)
        cases[name] = (
            lambda x, m=model: jax.block_until_ready(mf.predict(m, jnp.asarray(x), n=N)),
            lambda x, v=variables, f=by_hand: jax.block_until_ready(f(v, jnp.asarray(x))),
            (32, 32, 3),
        )
    return cases


def torch_cases() -> Cases:
    import torch
    from bench_packing import ResNet
    from torch import nn

    import masksembles_torch as mt

    torch.manual_seed(0)
    readme_cnn = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip

    def by_hand(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x.repeat(N, 1, 1, 1)).unflatten(0, (N, len(x)))

    cases: Cases = {}
    for name, model in (("README CNN", mt.insert(readme_cnn, n=N, scale=SCALE, seed=0)), ("ResNet-like", ResNet(True))):
        model.eval()
        cases[name] = (
            lambda x, m=model: mt.predict(m, torch.from_numpy(x), n=N),
            lambda x, m=model: by_hand(m, torch.from_numpy(x)),
            (3, 32, 32),
        )
    return cases


def alternating_rounds(calls: Mapping[str, Callable[[], object]], rounds: int) -> tuple[dict[str, list[float]], int]:
    """Seconds per call of each of ``calls`` in each of ``rounds`` rounds, after one warm-up round, and the calls per
    timing: within a round the calls run in turn, in the other order every other round; each timing is the mean of
    as many calls in a row as make it last about ``ROUND_SECONDS`` (from the warm-up round's slower call)."""

    def timed(call: Callable[[], object], repeats: int) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        return (time.perf_counter() - start) / repeats

    warm = max(timed(call, 1) for call in calls.values())
    repeats = max(1, math.ceil(ROUND_SECONDS / warm))
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            times[name].append(timed(calls[name], repeats))
    return times, repeats


def measure(framework: str, rounds: int, models: list[str], batches: list[int]) -> list[dict[str, Any]]:
    """The rows of one framework for ``models`` and ``batches``, in this process."""
    cases = {
        "keras-tensorflow": keras_cases, "keras-jax": keras_cases, "keras-torch": keras_cases,
        "flax-nnx": nnx_cases, "flax-linen": linen_cases, "torch": torch_cases,
    }[framework]()  # fmt: skip
    rows = []
    for name, (predict, by_hand, shape) in cases.items():
        for batch in batches if name in models else []:
            x = np.random.default_rng(batch).standard_normal((batch, *shape)).astype(np.float32)
            expected, actual = np.asarray(by_hand(x)), np.asarray(predict(x))
            np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(expected).max())))
            calls = {"predict": functools.partial(predict, x), "by hand": functools.partial(by_hand, x)}
            times, repeats = alternating_rounds(calls, rounds)
            ratios = [p / h for p, h in zip(times["predict"], times["by hand"], strict=True)]
            rows.append({
                "framework": framework, "model": name, "batch": batch, "repeats": repeats,
                "predict": statistics.median(times["predict"]), "by_hand": statistics.median(times["by hand"]),
                "low": min(ratios), "high": max(ratios),
            })  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def worker_environment(framework: str, threads: int) -> dict[str, str]:
    """The subprocess' environment: its Keras backend and thread counts."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TF_NUM_INTRAOP_THREADS": str(threads)}
    if framework.startswith("keras-"):
        env["KERAS_BACKEND"] = framework.removeprefix("keras-")
    return env


def section(runs: list[list[dict[str, Any]]], rounds: int, threads: int) -> str:
    """The BENCHMARKS.md section of ``runs`` (each run: ``measure``'s rows, every framework's): per row, the medians
    over the runs."""
    by_row: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for rows in runs:
        for row in rows:
            by_row.setdefault((row["framework"], row["model"], row["batch"]), []).append(row)
    lines = [
        "## `predict` ÷ the tiled call by hand",
        "",
        f"n={N}, S={SCALE}, float32, CPU ({threads} intra-op threads), {len(runs)} runs of the script, each framework "
        f"in its own process, {rounds} interleaved rounds a run after one warm-up round (the two calls swap places "
        f"every round; a call under {ROUND_SECONDS} s timed as the mean of as many in a row as make a round of that "
        f"length: the column calls, the most of the runs), on {machine()} (shared with other jobs). By hand: Keras "
        "`model.predict` on the tiled batch (one batch), the jitted NNX/linen call on the tiled batch, torch "
        "`model(tiled)` under `no_grad`; both return the (n, B, ...) members. Times: the median over the runs of each "
        "run's median. Ratio: the median over the runs of each run's ratio of medians (listed), with the range of "
        "every per-round ratio. Target ≤ 1.1.",
        "",
        "| framework | model | batch | calls | `predict` (ms) | by hand (ms) | ratio | runs' ratios | round range |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for (framework, model, batch), rows in by_row.items():
        ratios = [row["predict"] / row["by_hand"] for row in rows]
        predict, by_hand = (statistics.median(row[key] for row in rows) * 1e3 for key in ("predict", "by_hand"))
        lines.append(
            f"| {framework} | {model} | {batch} | {max(row['repeats'] for row in rows)} | {predict:.2f} "
            f"| {by_hand:.2f} | {statistics.median(ratios):.2f} | {', '.join(f'{r:.2f}' for r in ratios)} "
            f"| {min(row['low'] for row in rows):.2f}–{max(row['high'] for row in rows):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds a run (at least 3)")
    parser.add_argument("--runs", type=int, default=3, help="runs of every framework's process (at least 3)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    parser.add_argument("--frameworks", type=lambda text: text.split(","), default=list(FRAMEWORKS))
    parser.add_argument("--models", type=lambda text: text.split(","), default=list(MODELS))
    parser.add_argument("--batches", type=lambda text: [int(b) for b in text.split(",")], default=list(BATCHES))
    parser.add_argument("--json", help="also write every run's rows to this JSON file")
    parser.add_argument(
        "--from-json",
        type=lambda text: text.split(","),
        help="measure nothing: publish the runs that --json saved in these files (run i of each joined)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one framework, rows to the --out JSON file
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker == "torch" or args.worker == "keras-torch":
            import torch

            torch.set_num_threads(args.threads)
        rows = measure(args.worker, args.rounds, args.models, args.batches)
        Path(args.out).write_text(json.dumps(rows))
        return
    if args.from_json:
        saved = [json.loads(Path(name).read_text()) for name in args.from_json]
        settings = {(part["rounds"], part["threads"]) for part in saved}
        if len(settings) != 1:
            raise SystemExit(f"--from-json: the files were measured with other --rounds/--threads: {sorted(settings)}")
        ((rounds, threads),) = settings
        joined = [list(itertools.chain(*parts)) for parts in zip(*(part["runs"] for part in saved), strict=True)]
        publish("predict-speed", section(joined, rounds, threads), write=not args.no_write)
        return
    runs: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as folder:
        for run in range(args.runs):
            runs.append([])
            for framework in args.frameworks:
                out = Path(folder) / f"{framework}-{run}.json"
                choice = ["--models", ",".join(args.models), "--batches", ",".join(map(str, args.batches))]
                command = [sys.executable, __file__, "--worker", framework, "--out", str(out),
                           "--rounds", str(args.rounds), "--threads", str(args.threads), *choice]  # fmt: skip
                subprocess.run(command, check=True, env=worker_environment(framework, args.threads))
                runs[-1] += json.loads(out.read_text())
            if args.json:  # after every run: what a stopped benchmark measured is kept
                saved_runs = {"rounds": args.rounds, "threads": args.threads, "runs": runs}
                Path(args.json).write_text(json.dumps(saved_runs, indent=1))
    publish("predict-speed", section(runs, args.rounds, args.threads), write=not args.no_write)


if __name__ == "__main__":
    main()
