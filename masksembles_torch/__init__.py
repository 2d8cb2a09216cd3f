"""masksembles_torch: Masksembles layers and helpers for PyTorch, over masksembles_core."""

from ._functional import masksembles
from ._inference import convert_dropout, predict, tile, untile
from ._layers import Masksembles, Masksembles1D, Masksembles2D, Masksembles3D

__all__ = [
    "Masksembles",
    "Masksembles1D",
    "Masksembles2D",
    "Masksembles3D",
    "convert_dropout",
    "masksembles",
    "predict",
    "tile",
    "untile",
]
