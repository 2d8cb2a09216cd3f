"""Argument and shape validation shared by every adapter.

Every framework adapter calls these functions, so a bad argument produces the same
exception type and the same message whatever the framework. Messages name the
parameter, the allowed range and the value received.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

MODES = ("grouped", "random")


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_int(name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` as a Python int if it is an integer >= ``minimum``.

    Raises:
        TypeError: ``value`` is a bool or not an integer (``4.0`` is rejected too).
        ValueError: ``value`` is below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}; received {_describe(value)}")
    result = int(value)
    if result < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; received {result}")
    return result


def check_n(n: object) -> int:
    """Validate the number of masks ``n`` (an integer >= 1)."""
    return check_int("n", n, minimum=1)


def check_channels(channels: object) -> int:
    """Validate a channel count (an integer >= 1)."""
    return check_int("channels", channels, minimum=1)


def check_scale(scale: object) -> float:
    """Validate the overlap scale ``scale`` (a finite real number >= 1)."""
    allowed = "a finite real number >= 1"
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be {allowed}; received {_describe(scale)}")
    result = float(scale)
    if not math.isfinite(result) or result < 1.0:
        raise ValueError(f"scale must be {allowed}; received {result!r}")
    return result


def check_mode(mode: object) -> str:
    """Validate the batch-assignment ``mode`` (``"grouped"`` or ``"random"``)."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; received {mode!r}")
    return mode


def check_channel_axis(channel_axis: object) -> int:
    """Validate ``channel_axis`` (an integer that is not the batch axis 0)."""
    if isinstance(channel_axis, bool) or not isinstance(channel_axis, numbers.Integral):
        raise TypeError(
            f"channel_axis must be a non-zero integer (axis 0 is the batch); received {_describe(channel_axis)}"
        )
    if int(channel_axis) == 0:
        raise ValueError("channel_axis must be a non-zero integer (axis 0 is the batch); received 0")
    return int(channel_axis)


def _layout(rank: int, axis: int) -> str:
    names = ["B"] + [f"D{i}" for i in range(1, rank)]
    names[axis] = "C"
    return "(" + ", ".join(names) + ")"


def check_input_shape(
    shape: Sequence[Any],
    *,
    channels: int,
    channel_axis: int,
    ranks: Sequence[int] | None = None,
    layer: str = "Masksembles",
) -> int:
    """Check an input shape against a layer's channel count; return the non-negative channel axis.

    Args:
        shape: input shape; axis 0 is the batch and may be ``None`` (unknown).
        channels: number of channels the layer's masks have.
        channel_axis: axis holding the channels (negative counts from the end).
        ranks: allowed input ranks, or None for any rank >= 2.
        layer: layer name used in the message.

    Raises:
        ValueError: wrong rank, or a channel count other than ``channels``.
    """
    rank = len(shape)
    allowed = sorted(ranks) if ranks is not None else None
    if allowed is not None and rank not in allowed:
        expected = " or ".join(str(r) for r in allowed)
        raise ValueError(f"{layer} expects an input of rank {expected}; received shape {tuple(shape)} (rank {rank})")
    if rank < 2:
        raise ValueError(f"{layer} expects an input of rank >= 2 (batch and channels); received shape {tuple(shape)}")
    if not -rank <= channel_axis < rank or channel_axis % rank == 0:
        raise ValueError(
            f"{layer}: channel_axis={channel_axis} is not a non-batch axis of an input of shape {tuple(shape)}"
        )
    axis = channel_axis % rank
    received = shape[axis]
    if received is not None and int(received) != channels:
        raise ValueError(
            f"{layer} expects {channels} channels on axis {channel_axis}, layout {_layout(rank, axis)}; "
            f"received shape {tuple(shape)} with {received} channels there"
        )
    return axis
