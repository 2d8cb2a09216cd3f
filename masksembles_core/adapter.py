"""What framework adapters build on (not needed to use the package): argument checks and layout helpers.

Every adapter (``masksembles_torch``, ``masksembles_keras``, ``masksembles_flax``) validates a layer's arguments with
``layer_arguments``, checks inputs with ``check_input_shape``, the Gaussian losses' arguments with
``check_gaussian_head``/``check_gaussian_target`` and ``pack``'s ``program`` with ``check_program``, so a bad call
raises the same exception with the same message in every framework. Messages name the parameter, the allowed values
and the value received.
"""

from ._compiling import compiled_or_eager
from ._generation import LayerArguments, check_seed, layer_arguments, make_rng
from ._grouping import check_batch_axis, check_tiled_batch, grown_axis, rows_per_sample, sample_axis
from ._reference import mask_shape
from ._validation import (
    GAUSSIAN_HEADS,
    MODES,
    PROGRAMS,
    check_batch_sizes,
    check_channel_axis,
    check_channels,
    check_gaussian_head,
    check_gaussian_target,
    check_input_shape,
    check_int,
    check_members,
    check_mode,
    check_n,
    check_program,
    check_scale,
)

__all__ = [
    "GAUSSIAN_HEADS",
    "MODES",
    "PROGRAMS",
    "LayerArguments",
    "check_batch_axis",
    "check_batch_sizes",
    "check_channel_axis",
    "check_channels",
    "check_gaussian_head",
    "check_gaussian_target",
    "check_input_shape",
    "check_int",
    "check_members",
    "check_mode",
    "check_n",
    "check_program",
    "check_scale",
    "check_seed",
    "check_tiled_batch",
    "compiled_or_eager",
    "grown_axis",
    "layer_arguments",
    "make_rng",
    "mask_shape",
    "rows_per_sample",
    "sample_axis",
]
