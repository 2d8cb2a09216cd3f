"""Shared helpers for benchmarks: medians, machine description, BENCHMARKS.md sections."""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

from masksembles_core.packing import timed_rounds

K = TypeVar("K", bound=Hashable)

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
HEADER = (
    "# Benchmarks\n\n"
    "Measured by the scripts in `benchmarks/` (`python -m nox -s bench`); every ratio comes from one run.\n"
)


def median_seconds(fn: Callable[[], object], *, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(fns: dict[K, Callable[[], object]], *, rounds: int, warmup: int = 2) -> dict[K, float]:
    """Median wall time of each function, timed in turn within every round (noise hits all alike): the same helper
    as ``pack(program="auto")``'s, ``masksembles_core.packing.timed_rounds``."""
    times = timed_rounds(fns, rounds=rounds, warmup=warmup)
    return {name: statistics.median(values) for name, values in times.items()}


def arguments(rounds: int = 15, *, device: bool = False, models: list[str] | None = None) -> argparse.Namespace:
    """Command-line options shared by the benchmarks (``models``: the names ``--models`` may choose from)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    if device:
        parser.add_argument("--device", default="cpu", help="cpu or cuda")
    if models is not None:
        parser.add_argument(
            "--models",
            type=lambda text: [name.strip() for name in text.split(",")],
            default=models,
            help=f"comma-separated, from: {', '.join(models)}",
        )
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    return parser.parse_args()


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_section(name: str, markdown: str) -> None:
    """Replace (or append) the section between ``<!-- name:start -->`` and ``<!-- name:end -->``."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else HEADER
    block = f"<!-- {name}:start -->\n{markdown.rstrip()}\n<!-- {name}:end -->"
    pattern = re.compile(rf"<!-- {re.escape(name)}:start -->.*?<!-- {re.escape(name)}:end -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)


def publish(name: str, markdown: str, *, write: bool) -> None:
    """Print a benchmark's section and, when ``write``, put it into BENCHMARKS.md."""
    print(markdown)
    if write:
        write_section(name, markdown)
