"""masksembles_torch: Masksembles layers and helpers for PyTorch, over masksembles_core."""

from ._functional import masksembles
from ._heads import UncertaintyHead, with_uncertainty
from ._inference import predict, tile, untile
from ._layers import Masksembles, Masksembles1D, Masksembles2D, Masksembles3D, record_batch_size, recorded_call
from ._losses import gaussian_nll_loss
from ._packing import PackedMasksembles, extract_member, pack
from ._surgery import Masked, convert_dropout, insert

__all__ = [
    "Masked",
    "Masksembles",
    "Masksembles1D",
    "Masksembles2D",
    "Masksembles3D",
    "PackedMasksembles",
    "UncertaintyHead",
    "convert_dropout",
    "extract_member",
    "gaussian_nll_loss",
    "insert",
    "masksembles",
    "pack",
    "predict",
    "record_batch_size",
    "recorded_call",
    "tile",
    "untile",
    "with_uncertainty",
]
