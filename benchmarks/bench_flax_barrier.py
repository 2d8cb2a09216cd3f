"""What the ``jax.lax.optimization_barrier`` in ``masksembles_flax._ops.apply_masks`` costs under ``jax.jit``.

    python benchmarks/bench_flax_barrier.py [--rounds 40] [--no-write]

The barrier keeps XLA from rewriting ``x * mask`` as a select, so that a masked inf/NaN gives NaN as in the NumPy
reference. Each workload is compiled twice from the package's own code: as shipped, and traced with
``jax.lax.optimization_barrier`` replaced by the identity (the same function without the barrier). Workloads, float32,
n=4, scale=2, the Masksembles variables passed as arguments as in training: the linen layer alone (forward, and
forward+backward via ``jax.vjp``) on a batch of exactly n samples (where XLA would rewrite the product), on an MLP
activation, on a batch that n does not divide (the gather path) and on an NHWC feature map; a small CNN's forward; the
same CNN's training step (loss, gradient and an SGD update). The two versions run in interleaved rounds (alternating
which goes first), and each cell is the median over rounds of the per-round ratio. The table also says whether XLA
compiled the two to the same program (source metadata aside).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
from _report import machine, publish

from masksembles_flax.linen import Masksembles

N, SCALE = 4, 2.0


class ConvNet(nn.Module):
    """Two 3×3 convolutions and a dense head, each hidden activation followed by Masksembles."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = Masksembles(n=N, scale=SCALE, seed=0)(nn.relu(nn.Conv(32, (3, 3))(x)))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = Masksembles(n=N, scale=SCALE, seed=1)(nn.relu(nn.Conv(64, (3, 3))(x)))
        x = jnp.mean(x, axis=(1, 2))
        x = Masksembles(n=N, scale=SCALE, seed=2)(nn.relu(nn.Dense(128)(x)))
        return nn.Dense(10)(x)


def layer_forward(shape: tuple[int, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    layer = Masksembles(n=N, scale=SCALE, seed=0)
    x = jax.random.normal(jax.random.key(0), shape)
    return layer.apply, (layer.init(jax.random.key(1), x), x)


def layer_forward_backward(shape: tuple[int, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    forward, (variables, x) = layer_forward(shape)

    def forward_backward(variables: Any, x: jax.Array, grad_output: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, pullback = jax.vjp(lambda x_in: forward(variables, x_in), x)
        return y, pullback(grad_output)[0]

    return forward_backward, (variables, x, jax.random.normal(jax.random.key(2), shape))


def cnn(batch: int) -> tuple[ConvNet, Any, jax.Array, jax.Array]:
    model = ConvNet()
    x = jax.random.normal(jax.random.key(0), (batch, 32, 32, 3))
    labels = jax.random.randint(jax.random.key(1), (batch,), 0, 10)
    return model, model.init(jax.random.key(2), x), x, labels


def cnn_forward(batch: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    model, variables, x, _ = cnn(batch)
    return model.apply, (variables, x)


def cnn_training_step(batch: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    model, variables, x, labels = cnn(batch)

    def step(variables: Any, x: jax.Array, labels: jax.Array) -> tuple[Any, jax.Array]:
        def loss(params: Any) -> jax.Array:
            logits = model.apply({**variables, "params": params}, x)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

        value, grads = jax.value_and_grad(loss)(variables["params"])
        params = jax.tree.map(lambda p, g: p - 0.01 * g, variables["params"], grads)
        return {**variables, "params": params}, value

    return step, (variables, x, labels)


WORKLOADS: dict[str, Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]] = {
    "layer forward+backward, (4, 1024), one sample per mask": lambda: layer_forward_backward((4, 1024)),
    "layer forward, (256, 1024)": lambda: layer_forward((256, 1024)),
    "layer forward+backward, (256, 1024)": lambda: layer_forward_backward((256, 1024)),
    "layer forward+backward, (250, 1024), gather path": lambda: layer_forward_backward((250, 1024)),
    "layer forward+backward, (32, 32, 32, 128)": lambda: layer_forward_backward((32, 32, 32, 128)),
    "CNN forward, (64, 32, 32, 3)": lambda: cnn_forward(64),
    "CNN training step, (64, 32, 32, 3)": lambda: cnn_training_step(64),
}


def compiled(fn: Callable[..., Any], args: tuple[Any, ...], *, barrier: bool) -> tuple[Callable[[], object], list[str]]:
    """``fn(*args)`` compiled ahead of time with or without the barrier: a call that runs to completion, and the
    compiled program's instructions without their source metadata."""
    fresh = jax.jit(lambda *a: fn(*a))  # a new function each time: no trace reused from the other version
    if barrier:
        lowered = fresh.lower(*args)
    else:
        with mock.patch.object(jax.lax, "optimization_barrier", lambda operand: operand):
            lowered = fresh.lower(*args)
    assert ("optimization_barrier" in lowered.as_text()) == barrier
    executable = lowered.compile()
    program = [
        re.sub(r", metadata=\{[^}]*\}", "", line)
        for line in executable.as_text().splitlines()
        if line.startswith(("%", "ENTRY", " ", "}"))
    ]
    return (lambda: jax.block_until_ready(executable(*args))), program


def median_ratio(with_barrier: Callable[[], object], without: Callable[[], object], rounds: int) -> tuple[float, ...]:
    """Medians of (with, without, with ÷ without) over rounds that run each once, in alternating order."""
    calls = {"with": with_barrier, "without": without}
    times: list[dict[str, float]] = []
    for round_index in range(rounds + 2):  # two warm-up rounds
        seconds = {}
        for name in sorted(calls, reverse=round_index % 2 == 1):
            start = time.perf_counter()
            calls[name]()
            seconds[name] = time.perf_counter() - start
        if round_index >= 2:
            times.append(seconds)
    return (
        statistics.median(t["with"] for t in times),
        statistics.median(t["without"] for t in times),
        statistics.median(t["with"] / t["without"] for t in times),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40, help="interleaved timing rounds")
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = parser.parse_args()

    rows = [
        "| jitted function | same compiled program | with barrier (ms) | without (ms) | with ÷ without |",
        "|---|---|---:|---:|---:|",
    ]
    for name, make in WORKLOADS.items():
        fn, fn_args = make()
        (with_barrier, program), (without, program_without) = (compiled(fn, fn_args, barrier=b) for b in (True, False))
        same = "yes" if program == program_without else "no"
        seconds_with, seconds_without, ratio = median_ratio(with_barrier, without, args.rounds)
        rows.append(f"| {name} | {same} | {seconds_with * 1e3:.3f} | {seconds_without * 1e3:.3f} | {ratio:.3f}× |")
        print(rows[-1], flush=True)
    device = jax.devices()[0]
    text = "\n".join(
        [
            "## Flax: the cost of the optimization barrier",
            "",
            "The jitted Masksembles code as shipped ÷ the same code traced without its `jax.lax.optimization_barrier` "
            f"(which keeps masked inf/NaN as NaN), float32, n={N}, scale={SCALE}; medians over {args.rounds} "
            "interleaved rounds (alternating order) of the per-round ratio, one run on "
            f'{device.platform} ({device.device_kind}), {machine()}, jax {jax.__version__}. "Same compiled program": '
            "XLA's optimized HLO of the two is identical apart from source metadata.",
            "",
            *rows,
        ]
    )
    publish("flax_barrier", text, write=not args.no_write)


if __name__ == "__main__":
    main()
