"""masksembles_keras: Masksembles layers for Keras 3, on the TensorFlow, JAX and PyTorch backends.

Layers are written in ``keras.ops`` only and registered for serialization under the package
``"masksembles"``, so a ``.keras`` file loads once this package is imported. The masks come from
``masksembles_core`` and are saved with the model. ``insert`` and ``convert_dropout`` put Masksembles
layers into an existing Sequential or functional model, inside its custom layers too (keras-hub's transformers);
``pack`` and ``extract_member`` build all members, or one, on compacted weights as an ordinary Keras model;
``with_uncertainty`` wraps a model so that it answers with the members' uncertainty, computed in its graph.
"""

from ._heads import UncertaintyHead, UncertaintyModel, with_uncertainty
from ._inference import predict, tile, untile
from ._layers import Masksembles, Masksembles1D, Masksembles2D, Masksembles3D
from ._losses import GaussianNLL
from ._packing import PackedMasksembles, extract_member, pack
from ._rewire import Masked
from ._surgery import convert_dropout, insert

__all__ = [
    "GaussianNLL",
    "Masked",
    "Masksembles",
    "Masksembles1D",
    "Masksembles2D",
    "Masksembles3D",
    "PackedMasksembles",
    "UncertaintyHead",
    "UncertaintyModel",
    "convert_dropout",
    "extract_member",
    "insert",
    "pack",
    "predict",
    "tile",
    "untile",
    "with_uncertainty",
]
