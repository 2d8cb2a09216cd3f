"""Flax layer cost: jitted Masksembles forward and forward+backward vs a jitted ``x * 1.0`` in the same run.

    python benchmarks/bench_flax.py [--repeats 40] [--no-write]

Input (64, 32, 32, 256) float32, n=4, scale=2 on the default JAX device. Forward+backward is one jitted function that
returns the output and the input gradient for a given output gradient (``jax.vjp``); the baseline does the same for
``x * 1.0``. The layers' variables enter the jitted functions as arguments, as in a training step. The functions are
timed in interleaved rounds (one call of each per round), so slow phases of a shared machine hit every row alike;
each cell is the median over the rounds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
from _report import interleaved_medians, machine, publish
from flax import nnx

from masksembles_flax import linen as masksembles_linen
from masksembles_flax import nnx as masksembles_nnx

SHAPE = (64, 32, 32, 256)
N, SCALE = 4, 2.0
BASELINE = "`x * 1.0` (baseline)"

Forward = Callable[[Any, jax.Array], Any]


def forwards(x: jax.Array, key: jax.Array) -> dict[str, tuple[Forward, Any]]:
    """Row name -> (forward(state, x), state)."""
    linen_layer = masksembles_linen.Masksembles(n=N, scale=SCALE, seed=0)
    random_layer = masksembles_linen.Masksembles(n=N, scale=SCALE, seed=0, mode="random")
    graphdef, nnx_state = nnx.split(masksembles_nnx.Masksembles(SHAPE[-1], N, SCALE, seed=0))
    return {
        BASELINE: (lambda state, x: x * 1.0, None),
        "linen `Masksembles`": (linen_layer.apply, linen_layer.init(key, x)),
        "NNX `Masksembles`": (lambda state, x: nnx.merge(graphdef, state)(x), nnx_state),
        "linen `Masksembles`, mode=random, training": (
            lambda state, x: random_layer.apply(state["variables"], x, deterministic=False, rng=state["key"]),
            {"variables": random_layer.init(key, x, deterministic=True), "key": key},
        ),
    }


def with_backward(forward: Forward) -> Callable[[Any, jax.Array, jax.Array], tuple[Any, Any]]:
    def forward_backward(state: Any, x: jax.Array, grad_output: jax.Array) -> tuple[Any, Any]:
        y, pullback = jax.vjp(lambda x: forward(state, x), x)
        return y, pullback(grad_output)[0]

    return forward_backward


def run_to_completion(fn: Callable[..., Any], *args: Any) -> None:
    jax.block_until_ready(fn(*args))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=40, help="timed rounds")
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = parser.parse_args()

    key = jax.random.key(0)
    x = jax.random.normal(key, SHAPE)
    grad_output = jax.random.normal(jax.random.key(1), SHAPE)
    calls: dict[tuple[str, str], Callable[[], object]] = {}
    for name, (forward, state) in forwards(x, key).items():
        jitted_forward, jitted_backward = jax.jit(forward), jax.jit(with_backward(forward))
        calls[name, "forward"] = partial(run_to_completion, jitted_forward, state, x)
        calls[name, "backward"] = partial(run_to_completion, jitted_backward, state, x, grad_output)
    seconds = interleaved_medians(calls, rounds=args.repeats, warmup=3)

    rows = [
        "| jitted function | forward (ms) | ÷ baseline | forward+backward (ms) | ÷ baseline |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in dict.fromkeys(name for name, _ in calls):
        forward_s, backward_s = seconds[name, "forward"], seconds[name, "backward"]
        rows.append(
            f"| {name} | {forward_s * 1e3:.2f} | {forward_s / seconds[BASELINE, 'forward']:.2f}× "
            f"| {backward_s * 1e3:.2f} | {backward_s / seconds[BASELINE, 'backward']:.2f}× |"
        )
    device = jax.devices()[0]
    text = "\n".join(
        [
            "## Flax layer (linen and NNX)",
            "",
            f"Jitted forward and forward+backward (output and input gradient via `jax.vjp`) on {SHAPE} float32, "
            f"n={N}, scale={SCALE}, ÷ the same for a jitted `x * 1.0` (XLA compiles its forward to a copy of `x`). "
            f"Medians of {args.repeats} interleaved rounds, one run on {device.platform} ({device.device_kind}), "
            f"{machine()}, jax {jax.__version__}. Target: ≤ 1.10× for the grouped layers.",
            "",
            *rows,
        ]
    )
    publish("flax", text, write=not args.no_write)


if __name__ == "__main__":
    main()
