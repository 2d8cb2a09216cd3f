"""Mask statistics and the paper's closed-form formulas (appendix)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from ._generation import validate_masks
from ._validation import check_int, check_n, check_scale


def expected_iou(scale: float) -> float:
    """The paper's approximation of the mean pairwise IoU of masks: ``1 / (2*scale - 1)``."""
    scale = check_scale(scale)
    return 1.0 / (2.0 * scale - 1.0)


def expected_width(m: int, n: int, scale: float) -> float:
    """Expected width of ``sample_masks(m, n, scale)``: ``m*scale*(1 - (1 - 1/scale)**n)``."""
    m = check_int("m", m, minimum=1)
    n = check_n(n)
    scale = check_scale(scale)
    return m * scale * (1.0 - (1.0 - 1.0 / scale) ** n)


@dataclass(frozen=True)
class MaskStats:
    """Summary of a set of masks (see ``mask_stats``)."""

    n: int
    channels: int
    ones_per_mask: tuple[int, ...]
    mean_iou: float
    min_iou: float
    max_iou: float
    coverage: float
    effective_scale: float
    dropout_rate: float

    def __repr__(self) -> str:
        ones = sorted(set(self.ones_per_mask))
        ones_text = str(ones[0]) if len(ones) == 1 else f"{ones[0]}..{ones[-1]}"
        return (
            f"MaskStats(n={self.n}, channels={self.channels}, ones_per_mask={ones_text}, "
            f"iou mean/min/max={self.mean_iou:.3f}/{self.min_iou:.3f}/{self.max_iou:.3f}, "
            f"coverage={self.coverage:.1%}, effective_scale={self.effective_scale:.3f}, "
            f"dropout_rate={self.dropout_rate:.3f})"
        )


def mask_stats(masks: ArrayLike) -> MaskStats:
    """Statistics of masks of shape (n, channels).

    - ``ones_per_mask``: ones in each mask.
    - ``mean_iou``/``min_iou``/``max_iou``: over the n*(n-1)/2 pairs of masks (NaN when n=1).
    - ``coverage``: fraction of channels used by at least one mask.
    - ``effective_scale``: the scale whose expected IoU ``1/(2S-1)`` equals ``mean_iou``,
      i.e. ``(1 + 1/mean_iou)/2`` (inf for disjoint masks, NaN when n=1).
    - ``dropout_rate``: mean fraction of channels a mask zeroes, the MC-Dropout rate with the
      same per-member capacity (the paper's ``1 - 1/S`` in the limit of many masks).
    """
    array = validate_masks(masks)
    n, channels = array.shape
    as_int = array.astype(np.int64)
    ones = as_int.sum(axis=1)
    intersection = as_int @ as_int.T
    union = ones[:, None] + ones[None, :] - intersection
    pairs = np.triu_indices(n, k=1)
    ious = intersection[pairs] / union[pairs]
    if ious.size:
        mean_iou, min_iou, max_iou = float(ious.mean()), float(ious.min()), float(ious.max())
        effective_scale = math.inf if mean_iou == 0.0 else (1.0 + 1.0 / mean_iou) / 2.0
    else:
        mean_iou = min_iou = max_iou = effective_scale = math.nan
    return MaskStats(
        n=n,
        channels=channels,
        ones_per_mask=tuple(int(v) for v in ones),
        mean_iou=mean_iou,
        min_iou=min_iou,
        max_iou=max_iou,
        coverage=float(array.any(axis=0).mean()),
        effective_scale=effective_scale,
        dropout_rate=float(1.0 - ones.mean() / channels),
    )
