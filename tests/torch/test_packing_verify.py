"""pack/extract_member verify what they built against predict before returning it, take forward's optional
arguments at their defaults, and in ``auto`` never keep a program over 10 % slower than another, timed in the
build time of the packed program."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import masksembles_torch as mt
from masksembles_torch import _pack_graph
from masksembles_torch import _packing as packing

N = 4


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


class SigmoidBetweenMasks(nn.Module):
    """conv -> masks -> sigmoid (1/2 at zero: a dropped channel is live again) -> masks -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 12, 3, padding=1)
        self.masks1 = mt.Masksembles2D(12, N, 2.0, seed=1)
        self.masks2 = mt.Masksembles2D(12, N, 2.0, seed=2)
        self.head = nn.Conv2d(12, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.masks2(torch.sigmoid(self.masks1(self.stem(x)))))


def wrong_zero_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken proof: every elementwise operation 'maps zero to zero' (sigmoid does not)."""
    monkeypatch.setattr(
        _pack_graph._Graph, "zero_map", lambda graph, op: np.ones(graph.capture.seen[op.node].shapes[0][op.axis], bool)
    )


@pytest.mark.verification_fallback
@pytest.mark.parametrize("program", ["packed", "auto"])
def test_a_wrong_program_is_never_returned(program: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The safety net: a program built on a wrong proof differs from predict, so every node runs at full width
    instead, and the first fallback says why."""
    torch.manual_seed(0)
    model = SigmoidBetweenMasks().eval()
    x = torch.randn(6, 3, 5, 5)
    expected = mt.predict(model, x, N)
    wrong_zero_proof(monkeypatch)
    assert relative_error(mt.pack(model, x, program="packed", verify=False)(x), expected) > 1e-2  # the bug is real
    packed = mt.pack(model, x, program=program)
    assert packed.program == "dense"
    assert packed.fallbacks[0].startswith("verification: the packed program differed from predict on the example")
    assert packed.fallbacks[0].endswith("every node at full width")
    assert "verification" in repr(packed)
    assert relative_error(packed(x), expected) <= 1e-6
    member = mt.extract_member(model, 2, x)
    assert member.fallbacks[0].startswith("verification: ")
    assert relative_error(member(x), expected[2]) <= 1e-6


@pytest.mark.verification_fallback
def test_when_the_full_width_graph_differs_too_the_whole_model_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = SigmoidBetweenMasks().eval()
    x = torch.randn(5, 3, 5, 5)
    expected = mt.predict(model, x, N)
    wrong_zero_proof(monkeypatch)
    original = packing._build

    def broken_dense(*args: object, dense: bool, chunks: bool) -> packing.PackedMasksembles:
        packed = original(*args, dense=dense, chunks=chunks)  # type: ignore[arg-type]
        if dense:  # a broken full-width program too
            forward = packed.forward
            packed.forward = lambda x: forward(x) * 0.0  # type: ignore[method-assign]
        return packed

    monkeypatch.setattr(packing, "_build", broken_dense)
    packed = mt.pack(model, x, program="packed")
    assert packed.program == "dense" and packed.fallbacks[0].endswith("the whole model runs tiled")
    assert "so did every node at full width" in packed.fallbacks[0]
    assert relative_error(packed(x), expected) <= 1e-6


def test_verify_false_skips_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    model = SigmoidBetweenMasks().eval()
    x = torch.randn(3, 3, 5, 5)
    calls: list[int] = []
    monkeypatch.setattr(packing._Verifier, "mismatch", lambda self, packed: calls.append(1))
    mt.pack(model, x, program="packed", verify=False)
    mt.extract_member(model, 0, x, verify=False)
    assert calls == []
    mt.pack(model, x, program="packed")
    assert calls == [1]


class OptionalArguments(nn.Module):
    """A timm-style forward: optional arguments that change nothing at their defaults."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.masks = mt.Masksembles1D(16, N, 2.0, seed=0)
        self.fc2 = nn.Linear(16, 3)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, pre_logits: bool = False, *, scale: float = 1.0
    ) -> torch.Tensor:
        if mask is not None:
            x = x * mask
        hidden = self.masks(F.relu(self.fc1(x)))
        return hidden if pre_logits else self.fc2(hidden) * scale


def test_a_forward_with_optional_arguments_packs_at_their_defaults() -> None:
    torch.manual_seed(0)
    model = OptionalArguments().eval()
    x = torch.randn(5, 8)
    expected = mt.predict(model, x, N)
    for program in ("packed", "dense", "auto"):
        packed = mt.pack(model, x, program=program)
        assert relative_error(packed(x), expected) <= 1e-6
        assert packed.program == "dense" or not packed.fallbacks
    assert relative_error(mt.extract_member(model, 1, x)(x), expected[1]) <= 1e-6


class TwoRequired(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.masks = mt.Masksembles1D(8, N, 2.0, seed=0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.masks(x + y)


def test_a_second_required_input_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"other arguments of forward need defaults\); this one requires 2: \['x', 'y'\]"
    ):
        mt.pack(TwoRequired(), torch.randn(2, 8))


def test_auto_reports_its_choice() -> None:
    torch.manual_seed(0)
    model = SigmoidBetweenMasks().eval()
    x = torch.randn(4, 3, 5, 5)
    packed = mt.pack(model, x)
    assert set(packed.seconds) == {"packed", "dense"} and all(t > 0 for t in packed.seconds.values())
    assert packed.choice.startswith(f"{'packed' if packed.program == 'packed' else 'dense'}")
    assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-6
    assert mt.pack(model, x, program="packed").choice == ""


class FakeClock:
    """The clock ``pack`` reads (``_packing.clock``), moved only by fake costs: building the packed program takes
    ``build`` seconds (a dense one a fifth of it) and one timed call of a program ``seconds[program]`` per 4 samples."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, build: float, seconds: dict[str, float]) -> None:
        self.now = 0.0
        real_build = packing._build

        def build_program(*args: Any, dense: bool = False, **kwargs: Any) -> packing.PackedMasksembles:
            self.now += build / 5 if dense else build
            return real_build(*args, dense=dense, **kwargs)

        def timed(module: packing.PackedMasksembles, x: torch.Tensor) -> Callable[[], None]:
            def run() -> None:
                self.now += seconds[module.program] * len(x) / 4

            return run

        monkeypatch.setattr(packing, "clock", lambda: self.now)
        monkeypatch.setattr(packing, "_build", build_program)
        monkeypatch.setattr(packing, "_timed", timed)


@pytest.mark.parametrize(
    ("seconds", "chosen", "rounds"),
    [
        ({"packed": 3.0, "dense": 1.0}, "dense", 1),  # warm-up 12-16, a round 16-20: another would end after 20
        ({"packed": 1.05, "dense": 1.0}, "packed", 2),  # within 10 % of the dense program: the packed one stays
        ({"packed": 0.5, "dense": 1.0}, "packed", 4),  # the median bounds settle it after 4 of 7 rounds
    ],
)
def test_auto_keeps_no_program_over_10_percent_slower_and_times_within_the_packed_build_time(
    monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float], chosen: str, rounds: int
) -> None:
    """Building the packed program takes 10 (fake) seconds, so auto must be done by 20: the dense program's build
    (2 s) and the timing rounds fit in the 10 s left, and whatever it keeps equals predict."""
    torch.manual_seed(0)
    model = SigmoidBetweenMasks().eval()
    x = torch.randn(4, 3, 5, 5)
    clock = FakeClock(monkeypatch, 10.0, seconds)
    packed = mt.pack(model, x)
    assert clock.now <= 20.0
    assert packed.program == chosen and packed.seconds == pytest.approx(seconds)
    named = ", ".join(f"{name} {value * 1e3:.3g} ms" for name, value in seconds.items())
    assert (
        packed.choice.startswith(f"{chosen} (")
        and f"median times over {rounds} interleaved rounds: {named}" in packed.choice
    )
    assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-6


def test_auto_times_on_the_first_samples_where_rounds_on_the_whole_example_would_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """32 samples, a call 0.125 s (packed) and 0.25 s (dense) per sample, 10 s to build the packed program: after the
    dense build (12 s) and a warm-up round on 8 samples (15 s), 5 rounds on more than 8 would end after 20, so one
    round on 8 samples runs (18 s) and decides; whatever it keeps equals predict on all 32."""
    torch.manual_seed(0)
    model = SigmoidBetweenMasks().eval()
    x = torch.randn(32, 3, 5, 5)
    clock = FakeClock(monkeypatch, 10.0, {"packed": 0.5, "dense": 1.0})
    packed = mt.pack(model, x)
    assert clock.now == pytest.approx(18.0) and packed.program == "packed"
    assert packed.seconds == pytest.approx({"packed": 1.0, "dense": 2.0})
    assert packed.choice.endswith("; timed on 8 of the example's 32 samples to build in time")
    assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-6
