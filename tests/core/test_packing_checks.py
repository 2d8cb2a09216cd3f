"""The checks every adapter's pack runs: a built program against predict, and auto's choice of program."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from masksembles_core.packing import (
    AUTO_SAMPLES,
    AUTO_SLOWER,
    Cost,
    GraphNode,
    choose_program,
    median_bounds,
    output_mismatch,
    per_member_fallbacks,
    plan_program,
    program_macs,
    program_raised,
    samples_per_chunk,
    timed_choice,
    timed_choice_on_samples,
    timed_rounds,
    timing_samples,
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
        ([0.5] * 3 + [2.0] * 4, "packed"),  # much faster in 3 of 7 rounds: the median is packed's
        ([0.5] * 4 + [2.0] * 3, "dense"),  # faster in 4 of 7 rounds: its median is half of packed's
        ([0.9] * 7, "dense"),  # packed takes 1.11x its time
    ],
)
def test_auto_keeps_the_preferred_program_unless_its_median_is_over_the_margin(dense: list[float], chosen: str) -> None:
    name, why = choose_program({"packed": [1.0] * 7, "dense": dense}, "packed")
    assert name == chosen and why.startswith(chosen)


def test_auto_never_keeps_a_program_slower_than_another_by_more_than_the_margin() -> None:
    """Over many random timings, the median of what auto keeps is at most AUTO_SLOWER times every other median."""
    generator = np.random.default_rng(0)
    for _ in range(500):
        times = {name: list(generator.lognormal(0.0, 0.5, size=7)) for name in ("packed", "dense", "packed, one call")}
        name, _ = choose_program(times, "packed")
        medians = {key: float(np.median(values)) for key, values in times.items()}
        assert medians[name] <= AUTO_SLOWER * min(medians.values())
        if name != "packed":
            assert medians[name] == min(medians.values())


def test_auto_takes_the_fastest_of_several_faster_programs_and_names_every_median() -> None:
    times = {"packed": [1.0] * 5, "dense": [0.8] * 5, "packed, one call": [0.5] * 5}
    name, why = choose_program(times, "packed")
    assert name == "packed, one call"
    assert why == (
        "packed, one call (the fastest; packed is 2.00x its time): median times over 5 interleaved rounds: "
        "packed 1e+03 ms, dense 800 ms, packed, one call 500 ms"
    )


def test_timed_rounds_interleave_the_calls_after_the_warmup() -> None:
    order: list[str] = []
    times = timed_rounds({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=3, warmup=1)
    assert order == ["a", "b"] * 4
    assert {name: len(values) for name, values in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for values in times.values() for t in values)


class FakeClock:
    """A clock that only moves when a fake program runs: ``calls(durations)`` are programs whose wall times are
    ``durations`` (the warm-up round first)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def calls(self, durations: dict[str, list[float]]) -> dict[str, Callable[[], None]]:
        remaining = {name: iter(values) for name, values in durations.items()}

        def call(name: str) -> Callable[[], None]:
            def run() -> None:
                self.now += next(remaining[name])

            return run

        return {name: call(name) for name in durations}


@pytest.mark.parametrize(
    ("values", "rounds", "bounds"),
    [
        ([3.0, 1.0, 2.0, 4.0], 7, (1.0, 4.0)),  # three more values below 1 or above 4 move the median no further
        ([3.0, 1.0, 2.0], 7, (0.0, np.inf)),
        ([3.0, 1.0, 2.0, 4.0, 5.0, 6.0], 7, (3.0, 4.0)),
        ([3.0, 1.0, 2.0, 4.0], 4, (2.5, 2.5)),  # all known: the median
        ([1.0, 2.0, 3.0], 4, (1.5, 2.5)),  # an even count: the mean of the two middle values
    ],
)
def test_median_bounds_are_the_medians_of_the_extreme_completions(
    values: list[float], rounds: int, bounds: tuple[float, float]
) -> None:
    assert median_bounds(values, rounds) == bounds
    if np.isfinite(bounds).all():
        for fill in (0.0, 100.0):
            assert bounds[0] <= np.median(values + [fill] * (rounds - len(values))) <= bounds[1]


def test_timed_choice_stops_once_the_remaining_rounds_cannot_change_the_choice() -> None:
    """After 4 of 7 rounds packed's median is at most its 4th time (1) and dense's at least its least one (2)."""
    clock = FakeClock()
    calls = clock.calls({"packed": [9.0] + [1.0] * 7, "dense": [9.0] + [2.0] * 7})
    name, why, times = timed_choice(calls, "packed", clock=clock)
    assert name == "packed" and {key: len(values) for key, values in times.items()} == {"packed": 4, "dense": 4}
    assert why == (
        "packed (within 10% of the fastest): median times over 4 interleaved rounds: packed 1e+03 ms, dense 2e+03 ms; "
        "stopped after 4 of 7 rounds: the rest could not change the choice"
    )


def test_timed_choice_leaves_the_preferred_program_for_one_whose_median_is_clearly_less() -> None:
    """RoBERTa's case: the packed program ten times as slow as the dense one but faster in two noisy rounds."""
    clock = FakeClock()
    calls = clock.calls({"packed": [9.0] + [18.4] * 7, "dense": [9.0, 30.0, 30.0] + [1.9] * 5})
    name, why, times = timed_choice(calls, "packed", clock=clock)
    assert name == "dense" and len(times["dense"]) == 6  # after 6 rounds dense's median is at most 1.9
    assert why.startswith("dense (the fastest; packed is 9.68x its time): median times over 6 interleaved rounds")


def test_timed_choice_runs_no_round_that_would_end_after_the_deadline() -> None:
    """Rounds of 3 s from t = 3 (after the warm-up) with a deadline at 10: rounds end at 6 and 9, then one more
    would end at 12. Where not even one round fits, the warm-up round is the one that counts."""
    clock = FakeClock()
    calls = clock.calls({"packed": [2.0] + [2.0, 1.0] * 4, "dense": [1.0] + [1.0, 2.0] * 4})
    name, why, times = timed_choice(calls, "packed", deadline=10.0, clock=clock)
    assert times == {"packed": [2.0, 1.0], "dense": [1.0, 2.0]} and clock.now == 9.0
    assert name == "packed" and why.endswith("stopped after 2 of 7 rounds: the time to build ran out")
    clock = FakeClock()
    calls = clock.calls({"packed": [2.0] * 8, "dense": [1.0] * 8})
    name, why, times = timed_choice(calls, "packed", deadline=1.0, clock=clock)
    assert times == {"packed": [2.0], "dense": [1.0]} and name == "dense"


def per_sample_calls(
    clock: FakeClock, seconds: dict[str, float]
) -> tuple[Callable[[int], dict[str, Callable[[], None]]], list[int]]:
    """Fake programs that take ``seconds[name]`` per sample, as ``calls_on(k)`` (called on the first ``k`` samples),
    and the list of the sample counts asked for."""
    asked: list[int] = []

    def calls_on(samples: int) -> dict[str, Callable[[], None]]:
        asked.append(samples)

        def call(per_sample: float) -> Callable[[], None]:
            def run() -> None:
                clock.now += per_sample * samples

            return run

        return {name: call(per_sample) for name, per_sample in seconds.items()}

    return calls_on, asked


def test_timing_samples_are_all_where_the_planned_rounds_fit_else_those_that_fit_but_never_a_handful() -> None:
    assert timing_samples(32, 0.1, 100.0) == 32  # 5 rounds of 32 samples: 16 s
    assert timing_samples(32, 0.1, 10.0) == 20  # 5 rounds of 20 samples: 10 s
    assert timing_samples(32, 0.1, 1.0) == AUTO_SAMPLES  # 2 samples would fit: too few to time the work
    assert timing_samples(5, 0.1, 0.0) == 5  # an example smaller than that: all of it
    assert timing_samples(32, 0.0, 0.0) == 32  # calls that take no measurable time


def test_auto_times_on_the_first_samples_where_rounds_on_the_whole_example_would_end_after_the_deadline() -> None:
    """A round costs 0.4 s per sample (packed 0.1, dense 0.3). With 30 s left: the warm-up on 8 samples ends at 3.2,
    26.8 s are left for 5 rounds, so 13 samples; a warm-up round and 4 rounds on 13 end at 29.2, and then packed's
    median can no longer leave the margin."""
    clock = FakeClock()
    calls_on, asked = per_sample_calls(clock, {"packed": 0.1, "dense": 0.3})
    name, why, times = timed_choice_on_samples(calls_on, 32, "packed", deadline=30.0, clock=clock)
    assert asked == [AUTO_SAMPLES, 13] and name == "packed" and len(times["packed"]) == 4
    assert clock.now == pytest.approx(29.2)
    assert why.endswith("; timed on 13 of the example's 32 samples to build in time")
    # no time for a round after the warm-up on 8 samples: that round decides, on 8 samples
    clock = FakeClock()
    calls_on, asked = per_sample_calls(clock, {"packed": 0.1, "dense": 0.3})
    name, why, times = timed_choice_on_samples(calls_on, 32, "packed", deadline=5.0, clock=clock)
    assert asked == [AUTO_SAMPLES] and times == {"packed": [pytest.approx(0.8)], "dense": [pytest.approx(2.4)]}
    assert clock.now == pytest.approx(3.2) and "over 1 interleaved rounds" in why and "timed on 8 of the" in why
    # time enough for all 32 samples: no mention of a part
    clock = FakeClock()
    calls_on, asked = per_sample_calls(clock, {"packed": 0.3, "dense": 0.1})
    name, why, times = timed_choice_on_samples(calls_on, 32, "packed", deadline=1000.0, clock=clock)
    assert asked == [AUTO_SAMPLES, 32] and name == "dense" and "timed on" not in why
    # no deadline, or an example of at most 8 samples: all of it from the warm-up on, as timed_choice alone
    for batch, deadline in ((32, float("inf")), (AUTO_SAMPLES, 1.0)):
        clock = FakeClock()
        calls_on, asked = per_sample_calls(clock, {"packed": 0.1, "dense": 0.3})
        timed_choice_on_samples(calls_on, batch, "packed", deadline=deadline, clock=clock)
        assert asked == [batch]


def test_a_compiling_first_call_never_decides_one_counted_round_runs_whatever_the_deadline() -> None:
    """The warm-up round compiles packed (9 s against 1 s a call): past the deadline, it still does not decide."""
    clock = FakeClock()
    calls = clock.calls({"packed": [9.0, 1.0, 1.0], "dense": [1.0, 2.0, 2.0]})
    name, _, times = timed_choice(calls, "packed", deadline=0.0, clock=clock, compiled=True)
    assert times == {"packed": [1.0], "dense": [2.0]} and name == "packed"
    clock = FakeClock()
    calls = clock.calls({"packed": [9.0, 1.0, 1.0], "dense": [1.0, 2.0, 2.0]})
    name, _, times = timed_choice(calls, "packed", deadline=0.0, clock=clock)  # eager: the warm-up counts
    assert times == {"packed": [9.0], "dense": [1.0]} and name == "dense"


def test_timed_rounds_given_a_warm_up_already_run_starts_no_round_that_would_end_after_the_deadline() -> None:
    clock = FakeClock()
    calls = clock.calls({"packed": [2.0] * 3, "dense": [1.0] * 3})
    times = timed_rounds(calls, rounds=3, warmup=0, deadline=5.0, clock=clock, warm={"packed": [2.0], "dense": [1.0]})
    assert times == {"packed": [2.0], "dense": [1.0]} and clock.now == 3.0  # a second round would end at 6
    clock = FakeClock()
    calls = clock.calls({"packed": [2.0] * 3, "dense": [1.0] * 3})
    times = timed_rounds(calls, rounds=3, warmup=0, deadline=2.0, clock=clock, warm={"packed": [4.0], "dense": [1.0]})
    assert times == {"packed": [4.0], "dense": [1.0]} and clock.now == 0.0  # not one round fits: the warm-up counts


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


def test_a_program_that_raised_is_reported_by_the_first_line_of_its_error() -> None:
    """torch's C++ errors carry a whole stack trace in their message: the fallback reason keeps its first line."""
    stack = RuntimeError("shape mismatch in aten::mm\nException raised from check at /src/a.cpp:12\nframe #0: ...")
    assert program_raised(stack) == "it raised RuntimeError: shape mismatch in aten::mm [...]"
    assert program_raised(ValueError("one line")) == "it raised ValueError: one line"
    assert program_raised(KeyError()) == "it raised KeyError"
