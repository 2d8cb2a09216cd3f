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
"""

from __future__ import annotations

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
