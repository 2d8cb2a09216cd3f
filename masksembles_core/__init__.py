"""masksembles_core: the framework-free core of Masksembles (NumPy only).

Mask generation (the paper's algorithm and the fixed-width form layers use), validation,
statistics and the paper's formulas, the batch-grouping rule, and the NumPy reference layer
that every framework adapter is tested against. Importing this package imports no deep
learning framework.
"""

from . import metrics
from ._generation import (
    derive_seed,
    generate_masks,
    make_rng,
    ones_per_mask,
    resolve_masks,
    sample_masks,
    validate_masks,
)
from ._grouping import check_tiled_batch, group_index, tile, untile
from ._reference import apply_masks, apply_masks_grad, mask_shape
from ._stats import MaskStats, expected_iou, expected_width, mask_stats
from ._validation import (
    GAUSSIAN_HEADS,
    MODES,
    check_channel_axis,
    check_channels,
    check_gaussian_head,
    check_gaussian_target,
    check_input_shape,
    check_int,
    check_mode,
    check_n,
    check_scale,
)

__version__ = "0.1.0"

__all__ = [
    "GAUSSIAN_HEADS",
    "MODES",
    "MaskStats",
    "apply_masks",
    "apply_masks_grad",
    "check_channel_axis",
    "check_channels",
    "check_gaussian_head",
    "check_gaussian_target",
    "check_input_shape",
    "check_int",
    "check_mode",
    "check_n",
    "check_scale",
    "check_tiled_batch",
    "derive_seed",
    "expected_iou",
    "expected_width",
    "generate_masks",
    "group_index",
    "make_rng",
    "mask_shape",
    "mask_stats",
    "metrics",
    "ones_per_mask",
    "resolve_masks",
    "sample_masks",
    "tile",
    "untile",
    "validate_masks",
]
