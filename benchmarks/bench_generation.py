"""Mask generation time: masksembles_core.generate_masks vs the official masksembles 1.1.1.

    python benchmarks/bench_generation.py [--repeats 50] [--budget 10]

n=4, channels x scale grid, medians. The official ``generation_wrapper`` retries without bound
and can hang, so each of its cells runs in a child process that is killed after ``--budget``
seconds; a cell reports "hang" or the error it raised instead of a time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection

import numpy as np
from _report import machine, median_seconds, publish

import masksembles_core as mc

CHANNELS = (64, 256, 1024, 2048)
SCALES = (1.5, 2.0, 3.0, 5.0)
N = 4


def _official_child(conn: Connection, channels: int, scale: float, repeats: int, budget: float) -> None:
    from masksembles.common import generation_wrapper

    np.random.seed(0)
    times: list[float] = []
    deadline = time.perf_counter() + budget / 2
    try:
        while len(times) < repeats and (not times or time.perf_counter() < deadline):
            start = time.perf_counter()
            generation_wrapper(channels, N, scale)
            times.append(time.perf_counter() - start)
    except Exception as error:  # report what the official package raises
        conn.send(("error", f"{type(error).__name__}"))
        return
    conn.send(("ok", float(np.median(times))))


def time_official(channels: int, scale: float, repeats: int, budget: float) -> tuple[str, float]:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_official_child, args=(child, channels, scale, repeats, budget))
    process.start()
    ready = parent.poll(budget)
    if not ready:
        process.kill()
        process.join()
        return "hang", float("nan")
    status, value = parent.recv()
    process.join()
    return (status, value) if status == "ok" else (str(value), float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--budget", type=float, default=10.0, help="seconds before an official cell counts as a hang")
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = parser.parse_args()

    try:
        import masksembles

        official_version = masksembles.__version__ if hasattr(masksembles, "__version__") else "1.1.1"
    except ImportError:
        sys.exit("the official package is needed: pip install masksembles==1.1.1 (the bench nox session does)")

    rows = [
        "| channels | scale | ours (ms) | official (ms) | official ÷ ours |",
        "|---:|---:|---:|---:|---:|",
    ]
    for channels in CHANNELS:
        for scale in SCALES:
            ours = median_seconds(lambda c=channels, s=scale: mc.generate_masks(c, N, s, seed=0), repeats=args.repeats)
            status, official = time_official(channels, scale, args.repeats, args.budget)
            if status == "ok":
                cells = f"{official * 1e3:.2f} | {official / ours:.1f}×"
            elif status == "hang":
                cells = f"hang (> {args.budget:.0f} s) | —"
            else:
                cells = f"fails ({status}) | —"
            row = f"| {channels} | {scale} | {ours * 1e3:.3f} | {cells} |"
            rows.append(row)
            print(row, flush=True)
    text = "\n".join(
        [
            "## Mask generation (n=4)",
            "",
            f"`masksembles_core.generate_masks` vs the official `masksembles` {official_version} `generation_wrapper`, "
            f"medians of up to {args.repeats} calls each, measured in the same run on {machine()}. "
            f"The official cells run in a child process killed after {args.budget:.0f} s.",
            "",
            *rows,
        ]
    )
    publish("generation", text, write=not args.no_write)


if __name__ == "__main__":
    main()
