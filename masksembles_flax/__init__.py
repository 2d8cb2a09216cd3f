"""masksembles_flax: Masksembles layers for Flax, linen (``masksembles_flax.linen``) and NNX (``masksembles_flax.nnx``).

``tile``, ``untile`` and ``predict`` run every ensemble member on every sample: the batch is repeated ``n`` times,
the grouping rule gives block ``k`` mask ``k``, and the outputs come back as (n, B, ...).
"""

from . import linen, nnx
from ._inference import predict
from ._losses import gaussian_nll_loss
from ._ops import batch_size, tile, untile

__all__ = ["batch_size", "gaussian_nll_loss", "linen", "nnx", "predict", "tile", "untile"]
