"""masksembles_core: the framework-free core of Masksembles (NumPy only).

Masks (the paper's algorithm, ``sample_masks``, and the fixed-width form layers use, ``generate_masks``), their
statistics and the paper's formulas, the batch-grouping rule (``group_index``, ``tile``, ``untile``) and the NumPy
reference layer every framework adapter is tested against (``apply_masks``). Submodules: ``metrics`` (uncertainty
and evaluation from member outputs), ``conformal`` (prediction sets and intervals with a coverage guarantee),
``heads`` (the uncertainty a deployed model answers with), ``insertion`` (where ``insert`` puts masks), ``packing``
(the program behind packed inference) and ``adapter`` (what framework adapters build on). Importing this package
imports no deep learning framework.
"""

from . import adapter, conformal, heads, insertion, metrics, packing
from ._generation import (
    DuplicateMasksWarning,
    derive_seed,
    generate_masks,
    ones_per_mask,
    sample_masks,
    validate_masks,
)
from ._grouping import group_index, tile, untile
from ._reference import apply_masks, apply_masks_grad
from ._stats import MaskStats, expected_iou, expected_width, mask_stats

__version__ = "0.1.0"

__all__ = [
    "DuplicateMasksWarning",
    "MaskStats",
    "adapter",
    "apply_masks",
    "apply_masks_grad",
    "conformal",
    "derive_seed",
    "expected_iou",
    "expected_width",
    "generate_masks",
    "group_index",
    "heads",
    "insertion",
    "mask_stats",
    "metrics",
    "ones_per_mask",
    "packing",
    "sample_masks",
    "tile",
    "untile",
    "validate_masks",
]
