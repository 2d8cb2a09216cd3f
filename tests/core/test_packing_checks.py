"""The checks every adapter's pack runs: a built program against predict, and auto's choice of program."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from masksembles_core.packing import (
    AUTO_MARGIN,
    AUTO_ROUNDS,
    Cost,
    GraphNode,
    choose_program,
    output_mismatch,
    per_member_fallbacks,
    plan_program,
    program_macs,
    samples_per_chunk,
    timed_choice,
    timed_rounds,
    verified,
)

F32 = float(np.finfo(np.float32).eps)


def test_outputs_that_agree_to_rounding_pass_and_nonfinite_expectations_are_not_compared() -> None:
    expected = [np.array([[1.0, np.nan], [np.inf, 2.0]]), np.array([3, 4])]
    actual = [np.array([[1.0 + 1e-6, 5.0], [0.0, 2.0]]), np.array([3, 4])]
    assert output_mismatch(expected, actual, [F32, 0.0]) is None


@pytest.mark.parametrize(
    ("actual", "message"),
    [
        ([np.array([[1.1, 0.0], [0.0, 2.0]]), np.array([3, 4])], "output 0 differs from predict by up to 0.1"),
        ([np.array([[1.0, 0.0], [0.0, 2.0]]), np.array([3, 5])], "output 1 differs from predict in 1 of 2 values"),
        ([np.array([[1.0, 0.0], [0.0, np.nan]]), np.array([3, 4])], "output 0 is not finite where predict is"),
        ([np.zeros(4), np.array([3, 4])], "output 0 has shape (4,) where predict gives (2, 2)"),
        ([np.zeros(4)], "the program returns 1 outputs where predict returns 2"),
    ],
)
def test_outputs_that_differ_are_named(actual: list[np.ndarray], message: str) -> None:
    expected = [np.array([[1.0, np.nan], [np.inf, 2.0]]), np.array([3, 4])]
    assert message in str(output_mismatch(expected, actual, [F32, 0.0]))


def test_the_tolerance_follows_the_dtype_and_the_outputs_scale() -> None:
    expected = [np.array([1000.0, -2000.0])]
    assert output_mismatch(expected, [np.array([1000.5, -2000.0])], [F32]) is None  # 2.5e-4 of the scale
    assert output_mismatch(expected, [np.array([1002.0, -2000.0])], [F32]) is not None
    bfloat16 = 2.0**-7
    assert output_mismatch(expected, [np.array([1100.0, -2000.0])], [bfloat16]) is None


@pytest.mark.parametrize(
    ("dense", "chosen"),
    [
        ([0.95] * 7, "packed"),  # faster in every round, by less than the margin
        ([0.5] * 3 + [2.0] * 4, "packed"),  # much faster in 3 of 7 rounds: noise
        ([0.5] * 5 + [2.0] * 2, "packed"),  # faster in 5 of 7 rounds: below AUTO_WINS
        ([0.5] * 6 + [2.0], "dense"),  # twice as fast in 6 of 7 rounds
    ],
)
def test_auto_keeps_the_preferred_program_unless_another_is_clearly_faster(dense: list[float], chosen: str) -> None:
    name, why = choose_program({"packed": [1.0] * 7, "dense": dense}, "packed")
    assert name == chosen and why.startswith(chosen)


def test_auto_takes_the_fastest_of_several_clearly_faster_programs() -> None:
    times = {"packed": [1.0] * 5, "dense": [0.8] * 5, "packed, one call": [0.5] * 5}
    name, why = choose_program(times, "packed")
    assert name == "packed, one call" and "0.50x the time of packed" in why
    assert AUTO_MARGIN < 1


def test_timed_rounds_interleave_the_calls_after_the_warmup() -> None:
    order: list[str] = []
    times = timed_rounds({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=3, warmup=1)
    assert order == ["a", "b"] * 4
    assert {name: len(values) for name, values in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for values in times.values() for t in values)


def fake_clock(monkeypatch: pytest.MonkeyPatch, durations: dict[str, list[float]]) -> dict[str, Callable[[], None]]:
    """Calls whose wall times, as ``timed_rounds`` reads them, are ``durations`` (the warm-up round first)."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])  # the clock timed_rounds reads
    remaining = {name: iter(values) for name, values in durations.items()}

    def call(name: str) -> Callable[[], None]:
        def run() -> None:
            now[0] += next(remaining[name])

        return run

    return {name: call(name) for name in durations}


def test_timed_choice_stops_once_no_other_program_can_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 7 rounds another program needs 6 wins: after the packed one wins the first two rounds, none can."""
    calls = fake_clock(monkeypatch, {"packed": [9.0] + [1.0] * 7, "dense": [9.0] + [2.0] * 7})
    name, why, times = timed_choice(calls, "packed")
    assert name == "packed" and {key: len(values) for key, values in times.items()} == {"packed": 2, "dense": 2}
    assert why == "packed: after 2 of 7 rounds no other program could still win 6"


def test_timed_choice_runs_every_round_while_another_program_may_still_win(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_clock(monkeypatch, {"packed": [9.0] + [1.0] * 7, "dense": [9.0] + [0.5] * 6 + [2.0]})
    name, why, times = timed_choice(calls, "packed")
    assert name == "dense" and len(times["dense"]) == AUTO_ROUNDS
    assert why.startswith("dense: 0.50x the time of packed")


def test_a_shared_fallback_without_an_exact_batch_axis_runs_per_member_where_a_member_reads_it() -> None:
    """input -> fold (a fallback whose rows are batch x windows: not repeatable) -> masks, and -> free -> masks;
    a fallback that reads fold becomes per member too once fold is, to a fixed point."""
    nodes = [
        ("input", "input", (), False),
        ("fold", "fallback", ("input",), False),
        ("free", "fallback", ("input",), False),
        ("masks", "masks", ("fold", "free"), False),
        ("after", "fallback", ("fold",), False),
        ("reads_after", "fallback", ("after",), False),
        ("head", "mixing", ("masks", "reads_after"), False),
    ]
    not_repeatable = {"fold", "after"}
    assert per_member_fallbacks(nodes, lambda name: name not in not_repeatable) == {"fold"}
    nodes[5] = ("reads_after", "fallback", ("after",), True)  # reads the batch: per member, so 'after' must be too
    assert per_member_fallbacks(nodes, lambda name: name not in not_repeatable) == {"fold", "after"}
    assert per_member_fallbacks(nodes, lambda name: True) == set()


def test_program_macs_count_what_each_member_reads_and_fallbacks_as_the_dense_models_run_them() -> None:
    """A fallback on the members' values runs per member, one before the masks (shared) once for every member."""
    masks = np.array([[1, 1, 0, 0, 1, 0], [0, 1, 1, 0, 0, 1]], dtype=bool)  # 3 live channels of 6 each
    nodes = [
        GraphNode("x", "input", (), 6),
        GraphNode("pre", "fallback", ("x",), 6),
        GraphNode("m", "masks", ("pre",), 6, masks=masks),
        GraphNode("conv", "mixing", ("m",), 4),  # a 3x3 convolution over 5x5 positions
        GraphNode("dw", "grouped", ("conv",), 4, groups=4, zero_preserving=False),  # depthwise 3x3
        GraphNode("attn", "fallback", ("dw",), 4),
        GraphNode("fc", "mixing", ("attn",), 2),
    ]
    program = plan_program(nodes, "fc", [0, 1])
    costs = {"pre": Cost(fallback=50), "conv": Cost(25, 9), "dw": Cost(25, 9), "attn": Cost(fallback=1000)}
    macs = program_macs(program, {**costs, "fc": Cost(1)})
    assert program.step("pre").placement.shared and not program.step("attn").placement.shared
    dense = 50 + 25 * 4 * 6 * 9 + 25 * 4 * 1 * 9 + 1000 + 1 * 2 * 4
    assert macs["dense"] == 2 * dense
    assert macs["fallback"] == 50 + 2 * 1000
    conv_inputs = program.step("conv").edges[0].placement.width
    assert conv_inputs == 3  # each member reads only its 3 live channels
    assert macs["packed"] == 50 + 2 * (25 * 4 * 3 * 9 + 25 * 4 * 1 * 9 + 1000 + 2 * 4)
    assert program_macs(program, {}) == {"dense": 0, "packed": 0, "fallback": 0}


def test_verified_keeps_an_agreeing_program_and_otherwise_the_first_replacement_that_agrees() -> None:
    def mismatch(program: str) -> str | None:
        return None if program.startswith("good") else f"{program} is off by 1"

    built: list[str] = []

    def build(name: str) -> Callable[[], str]:
        def made() -> str:
            built.append(name)
            return name

        return made

    kept = verified("good", "packed", mismatch, [("every node at full width", build("good wide"))])
    assert kept == ("good", "") and built == []  # nothing else is built when the program agrees
    replaced = verified("bad", "packed", mismatch, [("x", build("bad x")), ("y", build("good y"))])
    assert replaced[0] == "good y" and built == ["bad x", "good y"]
    assert replaced[1] == (
        "verification: the packed program differed from predict on the example input (bad is off by 1); "
        "so did x (bad x is off by 1); y"
    )
    none = verified("bad", "dense", mismatch, [])
    assert none == (
        None,
        "verification: the dense program differed from predict on the example input (bad is off by 1)",
    )


@pytest.mark.parametrize(
    "batch,per_sample,chunk",
    [(32, 32, 0), (32, 33, 16), (32, 65, 11), (32, 100, 8), (256, 64, 16), (256, 1 << 20, 1), (7, 400, 3)],
)
def test_chunks_hold_about_the_chunk_size_and_split_the_batch_evenly(batch: int, per_sample: int, chunk: int) -> None:
    """A batch whose largest tensor is at most the chunk size runs in one call (0); a larger one in
    ceil(total / chunk size) chunks of equal size, at least one sample each."""
    assert samples_per_chunk(batch, per_sample, 1024) == chunk
