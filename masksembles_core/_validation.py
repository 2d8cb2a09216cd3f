"""Argument and shape validation shared by every adapter.

Every framework adapter calls these functions, so a bad argument produces the same
exception type and the same message whatever the framework. Messages name the
parameter, the allowed range and the value received.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

MODES = ("grouped", "random")
PROGRAMS = ("auto", "packed", "dense")


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


def check_members(layer_counts: Iterable[int], n: object = None) -> int:
    """The number of members of a model, from the n of its Masksembles layers and an optional requested ``n``.

    Args:
        layer_counts: the n of every Masksembles layer found in the model (may be empty when they cannot be found).
        n: the n asked for, or None to read it from the layers.

    Raises:
        ValueError: the layers have different n, ``n`` differs from theirs, or ``n`` is None and no layer was found.
    """
    counts = sorted({int(count) for count in layer_counts})
    if len(counts) > 1:
        raise ValueError(f"the model's Masksembles layers have different n: {counts}; every layer needs the same n")
    if n is None:
        if not counts:
            raise ValueError("n is None and the model has no Masksembles layer to read it from; pass n")
        return counts[0]
    requested = check_n(n)
    if counts and counts[0] != requested:
        raise ValueError(f"n={requested} does not match the model's Masksembles layers, which have n={counts[0]}")
    return requested


def check_batch_sizes(sizes: Sequence[tuple[str, int]]) -> int:
    """The batch size of a model's inputs: the one length of axis 0 that every input array has.

    Args:
        sizes: (name of an input array, e.g. ``"inputs['input_ids']"``, the length of its axis 0), for every array
            of the inputs (a dict or tuple of batch-first arrays, or one array).

    Raises:
        ValueError: no array at all, or arrays whose axis 0 (the batch) differs.
    """
    if not sizes:
        raise ValueError("the inputs hold no tensor or array to take the batch from")
    batches = {int(size) for _, size in sizes}
    if len(batches) > 1:
        listed = ", ".join(f"{name}: {size}" for name, size in sizes)
        raise ValueError(
            f"every tensor or array of the inputs needs the batch on axis 0, the same size in all; received {listed}"
        )
    return batches.pop()


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


def check_program(program: object) -> str:
    """Validate ``pack``'s ``program`` (``"auto"``, ``"packed"`` or ``"dense"``)."""
    if not isinstance(program, str) or program not in PROGRAMS:
        raise ValueError(f"program must be one of {PROGRAMS}; received {program!r}")
    return program


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


GAUSSIAN_HEADS = ("log_variance", "variance")


def check_gaussian_head(head: object, min_variance: object) -> tuple[str, float]:
    """Validate a Gaussian NLL loss's ``head`` (what output channel 1 holds) and its variance floor.

    ``head="log_variance"``: channel 1 is log σ²; ``head="variance"``: channel 1 is σ² itself
    (e.g. after a softplus). ``min_variance`` is a finite number > 0.
    """
    if not isinstance(head, str) or head not in GAUSSIAN_HEADS:
        raise ValueError(f"head must be one of {GAUSSIAN_HEADS}; received {head!r}")
    if isinstance(min_variance, bool) or not isinstance(min_variance, numbers.Real):
        raise TypeError(f"min_variance must be a finite number > 0; received {_describe(min_variance)}")
    floor = float(min_variance)
    if not (math.isfinite(floor) and floor > 0.0):
        raise ValueError(f"min_variance must be a finite number > 0; received {floor!r}")
    return head, floor


def check_gaussian_target(output_shape: Sequence[Any], target_shape: Sequence[Any]) -> bool:
    """Check a Gaussian head's output (..., 2) = (mean, variance channel) against its target.

    The target has the output's shape without the last axis, or with a last axis of 1 (as
    Keras often passes labels); ``None`` dimensions (unknown) match anything.

    Returns:
        True when the target has that trailing axis of 1, which the loss drops.
    """
    output, target = tuple(output_shape), tuple(target_shape)
    if len(output) < 2 or output[-1] not in (2, None):
        raise ValueError(
            f"a Gaussian NLL loss expects outputs of shape (B, ..., 2) holding (mean, variance channel); "
            f"received shape {output}"
        )

    def matches(expected: tuple[Any, ...], received: tuple[Any, ...]) -> bool:
        return len(expected) == len(received) and all(
            a is None or b is None or int(a) == int(b) for a, b in zip(expected, received, strict=True)
        )

    if matches(output[:-1], target):
        return False
    if matches((*output[:-1], 1), target):
        return True
    raise ValueError(
        f"the target of a Gaussian NLL loss must have shape {output[:-1]} (or {(*output[:-1], 1)}) to match "
        f"outputs {output}; received {target}"
    )
