"""Masksembles for Flax NNX.

    layer = Masksembles(channels=64, n=4, scale=2.0, seed=0)
    y = layer(x)                                       # x: (B, ..., 64)

The masks are a ``Masks`` variable: ``nnx.state``/``nnx.split`` carry them and ``nnx.Optimizer(model, tx,
wrt=nnx.Param)`` leaves them alone. ``insert`` puts Masksembles layers into an existing model (the paper's recipe);
``pack``/``extract_member`` run its members on compacted weights. ``with_uncertainty`` wraps a packed or inserted
model so that it answers with its uncertainty (a dict computed in the graph); ``export`` makes a ``jax.export``
program of a model with a symbolic batch.
"""

from ._dropout import convert_dropout
from ._export import export
from ._insertion import Masked, insert
from ._nnx_head import UncertaintyHead, with_uncertainty
from ._nnx_layers import Flatten, Masks, Masksembles, Residual, record_batch_size
from ._packing import PackedMasksembles, extract_member, pack

__all__ = [
    "Flatten",
    "Masked",
    "Masks",
    "Masksembles",
    "PackedMasksembles",
    "Residual",
    "UncertaintyHead",
    "convert_dropout",
    "export",
    "extract_member",
    "insert",
    "pack",
    "record_batch_size",
    "with_uncertainty",
]
