"""``sample_axis``: which axis of a layer's input holds the model's samples (batch-first or sequence-first), and the
axis 0 where its shape cannot tell (the batch-first convention), refusals where it contradicts the layer's declared
axis."""

from __future__ import annotations

import pytest

import masksembles_core.adapter as mca


@pytest.mark.parametrize(
    ("shape", "channel_axis", "samples", "declared", "axis"),
    [
        ((4, 7, 16), -1, 4, None, 0),  # batch-first (B, L, C)
        ((28, 7, 16), -1, 4, None, 0),  # B * f rows folded sample-major
        ((7, 4, 16), -1, 4, None, 1),  # sequence-first (L, B, C)
        ((7, 4, 16), -1, None, None, 0),  # no batch size known: axis 0
        ((7, 4, 16), -1, None, 1, 1),  # ... or the declared axis
        ((4, 4, 6, 6), 1, 4, None, 0),  # channels on axis 1: axis 1 is no candidate
        ((4, 6, 6, 4), -1, 4, None, 0),  # 4-D channels last: no sequence-first candidate
        ((8, 4, 16), -1, 4, 1, 1),  # declared sequence-first with L a multiple of B
        ((4, 4, 16), -1, 4, 0, 0),  # declared batch-first with L == B
        ((5, 3, 16), -1, 4, 0, 0),  # neither axis holds the batch: rows that are not samples, the plain rule
    ],
)
def test_the_axis_that_holds_the_samples(
    shape: tuple[int, ...], channel_axis: int, samples: int | None, declared: int | None, axis: int
) -> None:
    assert mca.sample_axis(shape, channel_axis, samples, declared) == axis


def test_a_shape_both_layouts_fit_reads_axis_0_unless_declared() -> None:
    """(L, B, C) with L a multiple of B, or (B, B, C), fits both layouts: undeclared, the batch-first convention."""
    assert mca.sample_axis((8, 4, 16), -1, 4) == 0
    assert mca.sample_axis((4, 4, 16), -1, 4) == 0
    assert mca.sample_axis((8, 4, 16), -1, 4, 1) == 1


def test_a_declared_axis_the_batch_is_not_on_is_refused() -> None:
    with pytest.raises(ValueError, match=r"batch_axis=0\) received shape \(7, 4, 16\), whose axis 1, not axis 0"):
        mca.sample_axis((7, 4, 16), -1, 4, 0)
    with pytest.raises(ValueError, match=r"batch_axis=1\) expects a sequence-first input.*\(4, 7, 16\)"):
        mca.sample_axis((4, 7, 16), -1, 4, 1)
    with pytest.raises(ValueError, match=r"unbatched sequence"):
        mca.sample_axis((7, 16), -1, None, 1)


@pytest.mark.parametrize("value", [2, -1, True, "1"])
def test_batch_axis_is_0_1_or_none(value: object) -> None:
    with pytest.raises(ValueError, match="batch_axis must be 0"):
        mca.check_batch_axis(value)
    assert [mca.check_batch_axis(axis) for axis in (0, 1, None)] == [0, 1, None]


@pytest.mark.parametrize(
    ("small", "large", "channel_axis", "axis"),
    [
        ([(4, 7, 16)], [(5, 7, 16)], -1, 0),  # batch-first: axis 0 grows
        ([(28, 7, 16)], [(35, 7, 16)], -1, 0),  # B * f rows folded sample-major
        ([(7, 4, 16)], [(7, 5, 16)], -1, 1),  # sequence-first (L, B, C)
        ([(7, 4, 16), (7, 4, 16)], [(7, 5, 16), (7, 5, 16)], 2, 1),  # every call
        ([(7, 4, 16)], [(7, 5, 16)], 1, None),  # channels on axis 1: no sequence-first candidate
        ([(7, 4, 6, 16)], [(7, 5, 6, 16)], -1, None),  # 4-D: no sequence-first candidate
        ([(4, 7, 16), (7, 4, 16)], [(5, 7, 16), (7, 5, 16)], -1, None),  # the calls disagree
        ([(4, 4, 16)], [(5, 5, 16)], -1, None),  # two axes grow
        ([(4, 16)], [(4, 16)], -1, None),  # nothing grows
        ([(4, 16)], [], -1, None),  # called once in one run only
        ([], [], -1, None),  # never called
    ],
)
def test_the_axis_that_grows_with_one_more_sample(
    small: list[tuple[int, ...]], large: list[tuple[int, ...]], channel_axis: int, axis: int | None
) -> None:
    assert mca.grown_axis(small, large, channel_axis) == axis
