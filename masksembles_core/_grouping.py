"""The batch-grouping rule and the tile/untile convention for inference.

Every adapter follows these definitions:

- ``group_index(B, n)[i] == (i * n) // B``: sample ``i`` of a batch of ``B`` is multiplied by
  mask ``(i * n) // B``. When ``n`` divides ``B`` this is the classic split of the batch into
  ``n`` contiguous groups of ``B // n``; any ``B >= 1`` is legal (group sizes then differ by
  at most one, and when ``B < n`` some masks are unused).
- A layer may see more rows than the model has samples: a model that folds other axes into the
  batch (Swin's windows, tokens flattened into rows) calls it on ``R = B * f`` rows in the
  sample-major order ``reshape`` produces, row ``r`` from sample ``r // f``. Given the model's
  batch size ``samples=B``, ``group_index(R, n, samples=B)[r] == ((r // f) * n) // B``: every row
  goes through its sample's member, so a sample meets one member in every layer. Where ``B``
  does not divide ``R`` the rows are not folded samples and each row is its own sample (the
  plain rule). When ``n`` divides ``B`` both rules give the same groups.
- ``tile(x, n)`` repeats the batch ``n`` times along axis 0 (``n*B`` samples, copy ``k``
  first in block ``k``). ``group_index(n*B, n)`` then gives block ``k`` mask ``k``, so the
  forward pass of the tiled batch computes every member on every sample.
- ``untile(y, n)`` reshapes an output of ``n*B`` samples to ``(n, B, ...)``: ``y[k]`` is
  member ``k``'s output.
- The samples are on axis 0 of a layer's input, except in a sequence-first block ((L, B, C): torch's
  ``nn.TransformerEncoderLayer(batch_first=False)``, XLNet's hidden states, after a Flax RNN with
  ``time_major=True``), where they are on axis 1 and the rule
  above runs along axis 1 (``sample_axis`` decides which, from the layer's declared ``batch_axis`` and the model's
  batch size, and refuses where the shape cannot tell).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from ._validation import check_int, check_n

T = TypeVar("T", bound=np.generic)


def rows_per_sample(rows: Any, samples: Any) -> Any:
    """How many of a layer's ``rows`` come from one of the model's ``samples``: ``rows // samples`` where
    ``samples`` divides ``rows``, else 1 (each row is its own sample), and 1 for ``samples`` None.

    Plain arithmetic, so the adapters call it on their frameworks' symbolic sizes too (torch ``SymInt``).
    """
    if samples is None or rows == 0 or rows % samples:
        return 1
    return rows // samples


BATCH_AXES = (0, 1)
DECLARE_AXIS = (
    "give the layer its layout: batch_axis=1 for a sequence-first (L, B, C) input (inside torch's "
    "nn.TransformerEncoderLayer(batch_first=False), XLNet's blocks, after a Flax RNN with time_major=True), 0 for a "
    "batch-first one (`layer.batch_axis = ...`; insert and convert_dropout set it from the module's batch_first, or "
    "from the axis that grows with the batch of example_input)"
)


def check_batch_axis(batch_axis: object) -> int | None:
    """Validate a layer's ``batch_axis``: 0 (batch-first), 1 (sequence-first (L, B, ...)) or None (decided per call)."""
    if batch_axis is not None and (isinstance(batch_axis, bool) or batch_axis not in BATCH_AXES):
        raise ValueError(
            f"batch_axis must be 0 (samples first, (B, ...)), 1 (sequence-first, (L, B, ...)) or None (decided from "
            f"each call's shape and the model's batch size); received {batch_axis!r}"
        )
    return None if batch_axis is None else int(batch_axis)


def sample_axis(
    shape: Sequence[Any],
    channel_axis: int,
    samples: Any,
    batch_axis: int | None = None,
    *,
    layer: str = "Masksembles",
    known: Callable[[Any], bool] = bool,
) -> int:
    """The axis of a layer's input that holds the model's samples, along which the grouping rule runs: 0 (``(B,
    ...)``, or ``B * f`` rows folded sample-major) or 1 (a sequence-first ``(L, B, ...)``).

    Args:
        shape: the layer's input shape (sizes may be symbolic).
        channel_axis: the layer's channel axis.
        samples: the model's batch size in this call (``record_batch_size``; ``predict``'s ``n * B``), or None
            where it is not known: the declared axis is used (0 when undeclared).
        batch_axis: the layer's declared axis (0 or 1), or None: decided from ``shape`` and ``samples``. Axis 1 is
            a candidate only for a 3-D input with its channels last (``(L, B, C)``); it holds the samples when its
            size is ``samples``, and axis 0 does when ``samples`` divides its size.
        layer: layer name used in the messages.
        known: how a condition on sizes is decided (``bool``; a symbolic tracer passes one that answers True only
            where the condition holds for every value of its symbols).

    Raises:
        ValueError: the declared axis does not hold ``samples`` while the other one does (or, for a declared 1, at
            all). Undeclared, a shape both axes fit (``(B, B, C)``: a batch-first sequence of B tokens, or a
            sequence-first one of a batch of B) reads axis 0, the batch-first convention: declare a sequence-first
            layer.
    """
    rank = len(shape)
    channels = channel_axis % rank if rank else 0
    if batch_axis == 1 and (rank < 3 or channels in (0, 1)):
        raise ValueError(
            f"{layer}(batch_axis=1) groups the samples along axis 1 of a sequence-first input (L, B, ..., C); "
            f"received shape {tuple(shape)} with the channels on axis {channel_axis} (an unbatched sequence (L, C) "
            "holds no batch axis)"
        )
    if samples is None:
        return 0 if batch_axis is None else batch_axis
    fits_first = known(shape[0] % samples == 0)
    fits_second = rank == 3 and channels == 2 and known(shape[1] == samples)
    if batch_axis == 1:
        if not known(shape[1] == samples):
            raise ValueError(
                f"{layer}(batch_axis=1) expects a sequence-first input (L, B, ...) whose axis 1 holds the model's "
                f"batch of {samples}; received shape {tuple(shape)}. The batch size is read on axis 0 of the model's "
                "first input (predict and tile put the samples there too): call a model whose inputs are "
                "sequence-first (torch's nn.TransformerEncoder(batch_first=False) on (L, B, E), a Flax RNN with "
                "time_major=True) through a wrapper that takes batch-first inputs and transposes them"
            )
        return 1
    if batch_axis == 0:
        if not fits_first and fits_second:
            raise ValueError(
                f"{layer}(batch_axis=0) received shape {tuple(shape)}, whose axis 1, not axis 0, holds the model's "
                f"batch of {samples}: a sequence-first input would be grouped by token position instead of by "
                f"sample; {DECLARE_AXIS}"
            )
        return 0
    # Undeclared and both fit ((B, B, C), or (L, B, C) with L a multiple of B): axis 0, the package's batch-first
    # convention, which every batch-first model needs (a refusal here stopped batch-first transformers whose token
    # count equals the batch, e.g. 128 tokens at predict's n*B = 128). A sequence-first layer in that case must be
    # declared: insert/convert_dropout declare it from torch's batch_first or from example_input.
    return 1 if fits_second and not fits_first else 0


def grown_axis(small: Sequence[Sequence[int]], large: Sequence[Sequence[int]], channel_axis: int) -> int | None:
    """A layer's samples' axis, from its input shapes in two runs of the model: ``small`` on an example input,
    ``large`` on that example with one more sample (one shape per call of the layer, in call order).

    Returns:
        0 where axis 0 alone grows in every call; 1 where axis 1 alone grows in every call of a 3-D input with its
        channels last (sequence-first, (L, B, C)); None (left to each call, ``sample_axis``) where nothing was seen,
        the runs called the layer a different number of times, or no single axis grows.
    """
    if not small or len(small) != len(large):
        return None
    grown = {
        tuple(axis for axis, (a, b) in enumerate(zip(before, after, strict=True)) if a != b)
        for before, after in zip(small, large, strict=True)
        if len(before) == len(after)
    }
    if grown == {(0,)}:
        return 0
    if grown == {(1,)} and all(len(shape) == 3 for shape in small) and channel_axis % 3 == 2:
        return 1
    return None


def group_index(batch_size: int, n: int, *, samples: int | None = None) -> NDArray[np.int64]:
    """Mask index of each row of a batch: ``(i * n) // batch_size`` for ``i < batch_size``.

    With ``samples`` (the model's batch size B) and ``f = rows_per_sample(batch_size, B)``, row ``i``
    belongs to sample ``i // f`` and gets that sample's mask, ``((i // f) * n) // B``.
    """
    batch_size = check_int("batch_size", batch_size, minimum=0)
    n = check_n(n)
    if samples is not None:
        samples = check_int("samples", samples, minimum=1)
    if batch_size == 0:
        return np.zeros(0, dtype=np.int64)
    per_sample: int = rows_per_sample(batch_size, samples)
    sample = np.arange(batch_size, dtype=np.int64) // per_sample
    index: NDArray[np.int64] = (sample * n) // (batch_size // per_sample)
    return index


def tile(x: NDArray[T], n: int) -> NDArray[T]:
    """Repeat ``x`` of shape (B, ...) ``n`` times along the batch: shape (n*B, ...)."""
    n = check_n(n)
    return np.concatenate([x] * n, axis=0)


def check_tiled_batch(batch_size: int, n: int) -> int:
    """Return the untiled batch size, or raise if ``batch_size`` is not a multiple of ``n``."""
    n = check_n(n)
    if batch_size % n:
        raise ValueError(
            f"untile expects a batch that is a multiple of n={n} (the output of a tiled input); "
            f"received a batch of {batch_size}"
        )
    return batch_size // n


def untile(y: NDArray[T], n: int) -> NDArray[T]:
    """Reshape ``y`` of shape (n*B, ...) to (n, B, ...); ``y[k]`` is member ``k``'s output."""
    batch = check_tiled_batch(y.shape[0], n)
    return y.reshape((n, batch, *y.shape[1:]))
