"""NumPy reference of the Masksembles layer: the conformance oracle for every adapter.

Forward: ``y = x * masks[group_index(B, n, samples=samples)]`` broadcast along ``channel_axis``, with the masks
cast to ``x.dtype``. Every adapter computes a masked position as this IEEE-754 product
``x * 0``: ``0.0`` for finite ``x`` (``-0.0`` for negative ``x``) and ``NaN`` for ``inf``/``NaN``.
A non-finite activation is therefore never hidden by a mask, and since multiplying by 0 or 1
is exact, the adapters match this reference bit for bit in every float dtype. Framework
dropouts differ: PyTorch's dropout multiplies too (``NaN`` where an inf/NaN is dropped), while
Flax's ``Dropout`` (linen and NNX), Keras' ``Dropout`` (TensorFlow, JAX and PyTorch backends)
and ``tf.nn.dropout`` select ``0.0`` there, hiding the inf/NaN (and turning ``-0.0`` into ``0.0``).

Input gradient: the layer is a diagonal linear map, so ``dL/dx = dL/dy * mask`` (the same
product applied to the output gradient).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._generation import validate_masks
from ._grouping import group_index
from ._validation import check_channel_axis, check_input_shape

T = TypeVar("T", bound=np.generic)


def mask_shape(rank: int, channel_axis: int, channels: int, leading: int) -> tuple[int, ...]:
    """Shape that broadcasts a (leading, channels) mask array over an input of ``rank``.

    ``channel_axis`` must be non-negative. Example: rank 4, axis 1 -> (leading, C, 1, 1).
    """
    shape = [1] * rank
    shape[0] = leading
    shape[channel_axis] = channels
    return tuple(shape)


def apply_masks(x: NDArray[T], masks: ArrayLike, *, channel_axis: int, samples: int | None = None) -> NDArray[T]:
    """Reference forward: multiply row ``i`` of ``x`` by mask ``group_index(B, n, samples=samples)[i]``.

    Args:
        x: float array of shape (B, ...) with the channels on ``channel_axis``.
        masks: (n, C) binary masks.
        channel_axis: axis of ``x`` holding the C channels (not 0).
        samples: the model's batch size where the B rows of ``x`` are its samples folded with other axes
            (``samples * f`` rows, sample-major); None when the rows are the samples.

    Returns:
        array of the shape and dtype of ``x``.
    """
    mask_array = validate_masks(masks)
    n, channels = mask_array.shape
    axis = check_input_shape(x.shape, channels=channels, channel_axis=check_channel_axis(channel_axis))
    per_sample = mask_array[group_index(x.shape[0], n, samples=samples)].astype(x.dtype)
    result: NDArray[T] = x * per_sample.reshape(mask_shape(x.ndim, axis, channels, x.shape[0]))
    return result


def apply_masks_grad(
    grad_output: NDArray[T], masks: ArrayLike, *, channel_axis: int, samples: int | None = None
) -> NDArray[T]:
    """Reference input gradient of ``apply_masks`` for an output gradient ``grad_output``."""
    return apply_masks(grad_output, masks, channel_axis=channel_axis, samples=samples)
