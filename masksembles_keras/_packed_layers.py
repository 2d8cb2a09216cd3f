"""The layers a packed Keras model is built from, besides copies of the model's own: channel moves between the core's
placements, the members' Linear layers, and the output in Keras' batch-first layout.

A packed model holds every tensor in one of three ways (``masksembles_core.packing.Placement``): *shared* (B, ...),
computed once; *per member*, the members' compacted channels side by side on the channel axis, (B, ..., m*P, ...);
*on the member-stacked batch* (m*B, ...), member ``k``'s copy of the batch in block ``k``, as the tiled dense model
holds it. The layers here move tensors between these; all are written in ``keras.ops`` and registered for
serialization, so a packed model saves to ``.keras`` and loads once ``masksembles_keras`` is imported.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from ._layers import SERIALIZATION_PACKAGE, _apply_masks, _constant_initializer


def sizes(x: Any) -> list[Any]:
    """``x``'s shape for a reshape: each size known when traced as an int, the others (a sequence length declared
    None) as the run-time size ``keras.ops.shape`` gives; a symbolic size (``jax.export``'s shape polymorphism, as
    ``model.export`` traces a None batch on JAX) stays symbolic: it is no int, and ``jnp.reshape`` takes it."""
    static = tuple(x.shape)
    if None not in static:
        return [int(d) if isinstance(d, int | np.integer) else d for d in static]
    dynamic = ops.shape(x)
    return [dynamic[a] if d is None else int(d) if isinstance(d, int | np.integer) else d for a, d in enumerate(static)]


def _split_axis(x: Any, axis: int, members: int) -> Any:
    """(..., m*P on ``axis``, ...) -> (..., m, P, ...): the members' blocks on their own axis (``axis``)."""
    shape = sizes(x)
    shape[0] = -1  # the batch, known or not
    shape[axis : axis + 1] = [members, int(x.shape[axis]) // members]
    return ops.reshape(x, shape)


def _merge_axes(x: Any, axis: int) -> Any:
    """(..., a, b on ``axis``, ``axis + 1``, ...) -> (..., a*b, ...)."""
    shape = sizes(x)
    shape[0] = -1
    shape[axis : axis + 2] = [int(x.shape[axis]) * int(x.shape[axis + 1])]
    return ops.reshape(x, shape)


def _batch_to_front(x: Any, batch_axis: int) -> Any:
    """Move the batch axis to 0 (a no-op when it is there)."""
    return x if batch_axis == 0 else ops.moveaxis(x, batch_axis, 0)


def contiguous_runs(index: Sequence[int]) -> list[tuple[int, int]]:
    """``index`` as (start, stop) runs of consecutive channels, in order."""
    runs: list[tuple[int, int]] = []
    for i in index:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _axis_slice(x: Any, axis: int, start: int, stop: int) -> Any:
    """``x[..., start:stop, ...]`` on ``axis`` (>= 0)."""
    return x[(slice(None),) * axis + (slice(start, stop),)]


def onehot_blocks(index: Sequence[int], scale: Sequence[float] | None, width: int, blocks: int) -> np.ndarray:
    """(blocks, width / blocks, len(index) / blocks): the select of ``index`` (times ``scale``) from ``width``
    channels as one-hot matrices, output block ``k`` read from input block ``k`` only (``blocked``)."""
    rows, cols = width // blocks, len(index) // blocks
    matrix = np.zeros((blocks, rows, cols), dtype=np.float32)
    values = np.ones(len(index)) if scale is None else np.asarray(scale)
    for position, (source, value) in enumerate(zip(index, values, strict=True)):
        if value != 0:
            matrix[position // cols, source - (position // cols) * rows, position % cols] = value
    return matrix


def blocked(index: Sequence[int], scale: Sequence[float] | None, width: int, blocks: int) -> bool:
    """Whether the select of ``index`` from ``width`` channels reads output block ``k`` of ``blocks`` only from
    input block ``k`` (or writes a known zero: ``scale`` 0)."""
    if blocks < 2 or width % blocks or len(index) % blocks:
        return False
    rows, cols = width // blocks, len(index) // blocks
    values = np.ones(len(index)) if scale is None else np.asarray(scale)
    block = np.arange(len(index)) // cols
    return bool(((np.asarray(index) // rows == block) | (values == 0)).all())


def on_torch() -> bool:
    return str(keras.backend.backend()) == "torch"


def _torch_gather_last(x: Any, index: Sequence[int], scale: Sequence[float] | None) -> Any:
    """``x[..., index] * scale`` on torch as one ``torch.gather`` over the rows of x, then scaled in place: torch's
    ``index_select`` on the last axis of a channels-last tensor (``ops.take``) is 5-8x slower (32 -> 68 channels of
    a (32, 32, 32) map: 15 against 2 ms); compiled, the product is a new tensor (Dynamo does not trace ``mul_``)."""
    import torch

    rows = x.reshape(-1, x.shape[-1])
    indices = torch.as_tensor(index, dtype=torch.int64, device=x.device).expand(rows.shape[0], len(index))
    y = torch.gather(rows, 1, indices).reshape(*x.shape[:-1], len(index))
    if scale is None:
        return y
    factor = torch.as_tensor(scale, dtype=y.dtype, device=y.device)
    return y * factor if torch.compiler.is_compiling() else y.mul_(factor)  # in place where torch.compile allows


# on JAX and TensorFlow, a packed program proven to keep samples apart whose largest tensor at the batch it is called on
# exceeds this size runs on chunks of the batch where it is about this size (``masksembles_core.packing.
# samples_per_chunk``; fresh large buffers and tensors far over the CPU's cache made a packed ResNet-like 2.5x slower
# per sample at batch 256 than at batch 32 on JAX)
CHUNK_BYTES = 16 * 2**20


def in_chunks(run: Callable[[Any], Any], x: Any, samples: int) -> Any:
    """``run(x)`` on equal chunks of at most ``samples`` samples of ``x`` (batch on axis 0, of static size), in one
    loop (``keras.ops.map``), the batch padded with zeros to a whole number of chunks and the padding's outputs
    dropped: equal to ``run(x)`` for a ``run`` that computes each sample from that sample alone."""
    batch = int(x.shape[0])
    chunks = -(-batch // samples)
    size = -(-batch // chunks)
    if chunks * size > batch:
        x = ops.pad(x, [(0, chunks * size - batch)] + [(0, 0)] * (len(x.shape) - 1))
    y = ops.map(run, ops.reshape(x, (chunks, size, *sizes(x)[1:])))
    return keras.tree.map_structure(lambda part: ops.reshape(part, (chunks * size, *sizes(part)[2:]))[:batch], y)


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class ChannelSelect(keras.layers.Layer):  # type: ignore[misc]  # keras is untyped: Layer is Any to mypy
    """A core ``select`` move: gather ``index`` on ``axis`` (the source's copies side by side), then multiply by
    ``scale`` (the masks, 0 for a known zero written, 1 elsewhere; None: all ones).

    ``form`` is the kernel: ``"gather"`` (``ops.take``; on torch ``_torch_gather_last`` on the last axis),
    ``"slices"`` (static slices of the index's runs of consecutive channels, concatenated) or ``"onehot"``:
    products with one-hot matrices (``onehot_blocks``, the scale folded in), one per block of ``blocks`` (a
    ``blocked`` select), on the last axis (a non-finite value spreads NaN to the channels moved at its position).
    """

    def __init__(
        self, index: Sequence[int], scale: Sequence[float] | None, axis: int, form: str = "gather", blocks: int = 1,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self.index, self.scale, self.axis = [int(i) for i in index], None if scale is None else list(scale), axis
        self.form, self.blocks = form, blocks

    def call(self, x: Any) -> Any:
        axis = self.axis % len(x.shape)
        if self.form == "onehot":
            width = int(x.shape[axis])
            matrices = onehot_blocks(self.index, self.scale, width, self.blocks)
            rows = width // self.blocks
            parts = [
                ops.matmul(x[..., k * rows : (k + 1) * rows] if self.blocks > 1 else x, ops.cast(matrix, x.dtype))
                for k, matrix in enumerate(matrices)
            ]
            return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=-1)
        if self.form == "slices":
            parts = [_axis_slice(x, axis, start, stop) for start, stop in contiguous_runs(self.index)]
            y = parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=axis)
        elif on_torch() and axis == len(x.shape) - 1 and len(x.shape) > 2:
            return _torch_gather_last(ops.convert_to_tensor(x), self.index, self.scale)
        elif on_torch():  # the index_select that ops.take calls, without its ravel and squeeze (ONNX export lacks the
            import torch  # first's aten::ravel, and writes the second, a no-op here, as a Squeeze onnxruntime refuses)

            index = torch.as_tensor(self.index, dtype=torch.int64, device=x.device)
            y = torch.index_select(ops.convert_to_tensor(x), axis, index)
        else:
            y = ops.take(x, ops.convert_to_tensor(np.asarray(self.index, dtype="int32")), axis=axis)
        if self.scale is None:
            return y
        shape = [1] * len(x.shape)
        shape[axis] = len(self.scale)
        return y * ops.cast(ops.convert_to_tensor(np.asarray(self.scale).reshape(shape)), y.dtype)

    def compute_output_shape(self, input_shape: Sequence[int | None]) -> tuple[int | None, ...]:
        shape = list(input_shape)
        shape[self.axis] = len(self.index)
        return tuple(shape)

    def get_config(self) -> dict[str, Any]:
        config = {"index": self.index, "scale": self.scale, "axis": self.axis, "form": self.form}
        return {**super().get_config(), **config, "blocks": self.blocks}


def runs_members_apart() -> bool:
    """Whether this backend runs the members' Dense layers one per member, on static slices of their side-by-side
    channels, concatenated: TensorFlow runs that faster than one batched matmul over the members (3.6 against 5.8 ms
    at batch 256); JAX and torch run the batched matmul as fast or faster (JAX, the Keras packing benchmark's
    Transformer at batch 32 and 256: 2.7x and 1.8x the single model batched against 4.1x and 2.5x apart, its MLP, CNNs
    alike either way)."""
    return str(keras.backend.backend()) == "tensorflow"


def convolution_pieces(groups: int, members: int, window: int) -> int:
    """How many convolutions a grouped convolution of ``groups`` groups over ``members`` members runs as on this
    backend, its input and kernel sliced (``window``: the kernel's positions): TensorFlow one per group where
    ``tensorflow_convolution`` does not run it (Keras runs a grouped convolution there as an XLA cluster on CPU, 2-10x
    slower than its groups apart); JAX one per member where the window is wider than a point (XLA:CPU's grouped 3x3
    convolution is 2.5-4x slower than its members apart, its grouped 1x1 convolution faster); torch one grouped
    convolution (``torch_convolution``)."""
    backend = str(keras.backend.backend())
    if backend == "tensorflow":
        return groups
    if backend == "jax" and window > 1:
        return members
    return 1


def tensorflow_convolution(layer: Any, inputs: Any, kernel: Any) -> Any | None:
    """``layer``'s grouped 2D channels-last convolution (``"valid"`` or ``"same"``) as one ``tf.nn.convolution``,
    outside the XLA cluster Keras wraps a grouped convolution in; None where it is not one. TensorFlow's own grouped
    convolution on CPU ran the packed ResNet-like's members' 3x3 convolutions from 17 channels at batch 32 in 10.0 ms,
    their slices apart in 14.7 ms (and 9.8 ms on four inputs already apart: slicing and joining cost the rest)."""
    if len(inputs.shape) != 4 or layer.data_format != "channels_last" or layer.padding not in ("valid", "same"):
        return None
    import tensorflow as tf

    return tf.nn.convolution(
        inputs, kernel, strides=list(layer.strides), padding=layer.padding.upper(),
        dilations=list(layer.dilation_rate), data_format="NHWC",
    )  # fmt: skip


def _same_padding(size: int, window: int, stride: int, dilation: int) -> tuple[int, int]:
    """(before, after) of Keras' ``"same"`` padding on torch: the extra position after."""
    extent = (window - 1) * dilation + 1
    total = max((-(-size // stride) - 1) * stride + extent - size, 0)
    return total // 2, total - total // 2


def torch_convolution(layer: Any, inputs: Any, kernel: Any, bias: Any, depthwise: bool) -> Any:
    """``layer``'s convolution (``"valid"`` or ``"same"``; Keras' kernel layout, (*window, C_in / groups, C_out) or
    depthwise (*window, C, multiplier)) on torch with the bias added by the convolution and no copy of the input:
    channels-last inputs are read as a channels-first view of the same memory and the kernel is handed over in
    channels-last memory format, so torch's convolution writes a channels-last result, where Keras' own ``conv``
    copies the input to channels-first and back before every convolution and adds the bias in one more pass (in the
    packed ResNet-like at batch 32 the copies took 0.7x the time of the convolutions; a grouped 1x1 convolution of
    512 -> 128 channels in 8 groups took 71 ms through them, 7 ms without)."""
    import torch

    rank = inputs.ndim - 2
    last = layer.data_format == "channels_last"
    x = inputs.permute(0, rank + 1, *range(1, rank + 1)) if last else inputs
    if depthwise:  # (*window, C, multiplier) -> (C * multiplier, 1, *window): output c * multiplier + j
        weight = kernel.reshape(*kernel.shape[:-2], 1, -1).permute(rank + 1, rank, *range(rank))
    else:  # (*window, C_in / groups, C_out) -> (C_out, C_in / groups, *window)
        weight = kernel.permute(rank + 1, rank, *range(rank))
    if last and rank > 1:
        weight = weight.contiguous(memory_format=torch.channels_last if rank == 2 else torch.channels_last_3d)
    padding: Any = 0
    if layer.padding == "same":
        pads = [
            _same_padding(int(x.shape[2 + a]), int(weight.shape[2 + a]), layer.strides[a], layer.dilation_rate[a])
            for a in range(rank)
        ]
        if all(before == after for before, after in pads):
            padding = [before for before, _ in pads]
        else:
            x = torch.nn.functional.pad(x, [p for pad in reversed(pads) for p in pad])
    convolution = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[rank - 1]
    groups = int(x.shape[1]) // int(weight.shape[1])
    y = convolution(x, weight, bias, layer.strides, padding, layer.dilation_rate, groups)
    return y.permute(0, *range(2, rank + 2), 1) if last else y


def _torch_call(layer: Any, inputs: Any, depthwise: bool) -> Any:
    """A convolution layer's ``call`` through ``torch_convolution``, then its activation."""
    kernel = ops.convert_to_tensor(layer.kernel)
    bias = ops.convert_to_tensor(layer.bias) if layer.use_bias else None
    outputs = torch_convolution(layer, ops.convert_to_tensor(inputs), kernel, bias, depthwise)
    return outputs if layer.activation is None else layer.activation(outputs)


CHANNEL_ALIGNMENT = 4  # on JAX, each piece's input channels padded with zeros to a multiple of this


class _MemberConvolution:
    """A Keras convolution over ``members`` copies side by side on the channel axis, each with ``groups /
    members`` groups of its own, run as ``convolution_pieces`` convolutions on static slices, concatenated (on
    torch as one ``torch_convolution``, on TensorFlow a 2D channels-last one as one ``tensorflow_convolution``). On
    JAX each piece of one group has its input channels (and its kernel's) padded with zeros to a multiple of
    ``CHANNEL_ALIGNMENT``: XLA:CPU's 3x3 convolution from 17 channels took 2.2x as long as from 20 (and longer than
    from 32)."""

    members: int
    groups: int
    data_format: str
    padding: str

    def call(self, inputs: Any) -> Any:
        if on_torch() and self.padding in ("valid", "same"):
            return _torch_call(self, inputs, depthwise=False)
        return super().call(inputs)  # type: ignore[misc]

    def convolution_op(self, inputs: Any, kernel: Any) -> Any:
        run = super().convolution_op  # type: ignore[misc]
        if keras.backend.backend() == "tensorflow":
            outputs = tensorflow_convolution(self, inputs, kernel)
            if outputs is not None:
                return outputs
        pieces = convolution_pieces(self.groups, self.members, int(np.prod(kernel.shape[:-2])))
        if pieces == 1:
            return run(inputs, kernel)
        axis = len(inputs.shape) - 1 if self.data_format == "channels_last" else 1
        width, out = int(inputs.shape[axis]) // pieces, int(kernel.shape[-1]) // pieces
        one_group = int(kernel.shape[-2]) == width  # a piece of several groups keeps its width: they split it
        pad = -width % CHANNEL_ALIGNMENT if str(keras.backend.backend()) == "jax" and one_group else 0
        parts = []
        for k in range(pieces):
            piece, piece_kernel = (
                _axis_slice(inputs, axis, k * width, (k + 1) * width),
                kernel[..., k * out : (k + 1) * out],
            )
            if pad:
                widths = [(0, 0)] * len(inputs.shape)
                widths[axis] = (0, pad)
                piece = ops.pad(piece, widths)
                piece_kernel = ops.pad(piece_kernel, [(0, 0)] * (len(kernel.shape) - 2) + [(0, pad), (0, 0)])
            parts.append(run(piece, piece_kernel))
        return ops.concatenate(parts, axis=axis)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "members": self.members}  # type: ignore[misc]


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberConv1D(_MemberConvolution, keras.layers.Conv1D):  # type: ignore[misc]
    """``Conv1D`` run member by member (``_MemberConvolution``)."""

    def __init__(self, *args: Any, members: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.members = members


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberConv2D(_MemberConvolution, keras.layers.Conv2D):  # type: ignore[misc]
    """``Conv2D`` run member by member (``_MemberConvolution``)."""

    def __init__(self, *args: Any, members: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.members = members


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberConv3D(_MemberConvolution, keras.layers.Conv3D):  # type: ignore[misc]
    """``Conv3D`` run member by member (``_MemberConvolution``)."""

    def __init__(self, *args: Any, members: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.members = members


MEMBER_CONVOLUTIONS: dict[type, Any] = {
    keras.layers.Conv1D: MemberConv1D, keras.layers.Conv2D: MemberConv2D, keras.layers.Conv3D: MemberConv3D,
}  # fmt: skip


def depthwise_as_sums(x: Any, kernel: Any, layer: Any) -> Any:
    """A depthwise convolution of ``layer`` (its strides, ``"valid"`` or ``"same"`` padding, dilation and data format;
    ``kernel``: (*window, C, multiplier)) as a sum over the window of strided slices of the padded input times each
    channel's weights: XLA fuses it into one loop, where XLA:CPU runs its own depthwise convolution many times slower
    (the Flax packer's ``_depthwise`` measured 15-60x)."""
    x, rank = ops.convert_to_tensor(x), len(x.shape)
    channel_axis = rank - 1 if layer.data_format == "channels_last" else 1
    spatial = [a for a in range(1, rank) if a != channel_axis]
    window, multiplier = tuple(int(k) for k in kernel.shape[:-2]), int(kernel.shape[-1])
    if multiplier > 1:
        x = ops.repeat(x, multiplier, axis=channel_axis)
    pads, sizes = [(0, 0)] * rank, []
    for axis, k, d, s in zip(spatial, window, layer.dilation_rate, layer.strides, strict=True):
        n, extent = int(x.shape[axis]), (k - 1) * d + 1
        if layer.padding == "same":
            size = -(-n // s)
            total = max((size - 1) * s + extent - n, 0)
            pads[axis] = (total // 2, total - total // 2)
        else:
            size = (n - extent) // s + 1
        sizes.append(size)
    padded = ops.pad(x, pads) if any(pads[a] != (0, 0) for a in spatial) else x
    weights = ops.reshape(kernel, (*window, -1))  # (*window, C * multiplier): output channel c * multiplier + j
    shape = [1] * rank
    shape[channel_axis] = -1
    total_sum = None
    for tap in np.ndindex(*window):
        index = [slice(None)] * rank
        for axis, t, d, s, size in zip(spatial, tap, layer.dilation_rate, layer.strides, sizes, strict=True):
            index[axis] = slice(t * d, t * d + s * (size - 1) + 1, s)
        term = padded[tuple(index)] * ops.reshape(weights[tap], shape)
        total_sum = term if total_sum is None else total_sum + term
    return total_sum


class _SummedDepthwise:
    """A Keras depthwise convolution that runs as ``depthwise_as_sums`` on JAX, as ``torch_convolution`` on torch,
    as Keras runs it elsewhere."""

    def call(self, inputs: Any) -> Any:
        layer: Any = self
        if layer.padding not in ("valid", "same"):
            return super().call(inputs)  # type: ignore[misc]
        if on_torch():
            return _torch_call(layer, inputs, depthwise=True)
        if str(keras.backend.backend()) != "jax":
            return super().call(inputs)  # type: ignore[misc]
        outputs = depthwise_as_sums(inputs, layer.kernel, layer)
        if layer.use_bias:
            shape = [1] * len(outputs.shape)
            shape[-1 if layer.data_format == "channels_last" else 1] = -1
            outputs = outputs + ops.reshape(layer.bias, shape)
        return outputs if layer.activation is None else layer.activation(outputs)


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberDepthwiseConv1D(_SummedDepthwise, keras.layers.DepthwiseConv1D):  # type: ignore[misc]
    """``DepthwiseConv1D`` as sums on JAX (``_SummedDepthwise``)."""


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberDepthwiseConv2D(_SummedDepthwise, keras.layers.DepthwiseConv2D):  # type: ignore[misc]
    """``DepthwiseConv2D`` as sums on JAX (``_SummedDepthwise``)."""


MEMBER_DEPTHWISE: dict[type, Any] = {
    keras.layers.DepthwiseConv1D: MemberDepthwiseConv1D, keras.layers.DepthwiseConv2D: MemberDepthwiseConv2D,
}  # fmt: skip


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberFrame(keras.layers.Layer):  # type: ignore[misc]
    """A core frame move for ``members`` members: ``"to_batch"`` ((B, ..., m*C on ``channel_axis``) -> (m*B, ...)),
    ``"to_channels"`` (the reverse) or ``"tile"`` ((B, ...) -> (m*B, ...)); the batch on ``batch_axis``."""

    def __init__(self, kind: str, members: int, batch_axis: int, channel_axis: int = -1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kind, self.members, self.batch_axis, self.channel_axis = kind, members, batch_axis, channel_axis

    def call(self, x: Any) -> Any:
        m, batch, channel = self.members, self.batch_axis, self.channel_axis
        if self.kind == "tile":
            return ops.concatenate([x] * m, axis=batch)
        if self.kind == "to_batch":  # (.., B, .., m*C, ..) -> (m, .., B, .., C, ..) -> (.., m*B, .., C, ..)
            split = ops.moveaxis(
                _split_axis(_batch_to_front(x, batch), self._front(channel), m), self._front(channel), 0
            )
            merged = ops.reshape(split, (-1, *sizes(split)[2:]))
            return merged if batch == 0 else ops.moveaxis(merged, 0, batch)
        front = _batch_to_front(x, batch)  # to_channels: (m*B, .., C, ..) -> (B, .., m*C, ..)
        split = ops.reshape(front, (m, -1, *sizes(front)[1:]))
        moved = ops.moveaxis(split, 0, self._front(channel))
        merged = _merge_axes(moved, self._front(channel))
        return merged if batch == 0 else ops.moveaxis(merged, 0, batch)

    def _front(self, axis: int) -> int:
        """Where ``axis`` is once the batch is on axis 0."""
        return axis + 1 if axis < self.batch_axis else axis

    def compute_output_shape(self, input_shape: Sequence[int | None]) -> tuple[int | None, ...]:
        shape = list(input_shape)
        batch = shape[self.batch_axis]
        if self.kind == "to_channels":
            shape[self.batch_axis] = None if batch is None else batch // self.members
            shape[self.channel_axis] = int(shape[self.channel_axis]) * self.members  # type: ignore[arg-type]
        else:
            shape[self.batch_axis] = None if batch is None else batch * self.members
            if self.kind == "to_batch":
                shape[self.channel_axis] = int(shape[self.channel_axis]) // self.members  # type: ignore[arg-type]
        return tuple(shape)

    def get_config(self) -> dict[str, Any]:
        config = {"kind": self.kind, "members": self.members, "batch_axis": self.batch_axis}
        return {**super().get_config(), **config, "channel_axis": self.channel_axis}


def _torch_member_matmul(x: Any, kernel: Any, bias: Any) -> Any:
    """(..., m*P_in) -> (..., m*P_out): member ``k``'s block through ``kernel[k]`` ((m, P_in, P_out)), plus ``bias``
    (m*P_out, or None), on torch as one ``baddbmm`` over the members (the members first): 1.3-2x faster than the
    einsum at batch 32-256."""
    import torch

    kernel = ops.convert_to_tensor(kernel)
    members, width, units = (int(size) for size in kernel.shape)
    rows = x.reshape(-1, members, width).transpose(0, 1)  # (m, N, P_in)
    if bias is None:
        y = torch.bmm(rows, kernel)
    else:
        y = torch.baddbmm(ops.convert_to_tensor(bias).reshape(members, 1, units), rows, kernel)
    return y.transpose(0, 1).reshape(*x.shape[:-1], members * units)


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberDense(keras.layers.Layer):  # type: ignore[misc]
    """The members' Dense layers: (..., m*P_in) -> (..., m*P_out), member ``k``'s block of the input through its own
    (P_in, P_out) kernel (one matmul per member where ``runs_members_apart``, on torch one ``baddbmm``, else one
    batched matmul); then the bias and the Dense layer's activation."""

    def __init__(self, members: int, units: int, activation: Any = None, use_bias: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.members, self.units, self.use_bias = members, units, use_bias
        self.activation = keras.activations.get(activation)

    def build(self, input_shape: Sequence[int | None]) -> None:
        width = int(input_shape[-1]) // self.members  # type: ignore[arg-type]
        self.kernel = self.add_weight(name="kernel", shape=(self.members, width, self.units), initializer="zeros")
        self.bias = (
            self.add_weight(name="bias", shape=(self.members * self.units,), initializer="zeros")
            if self.use_bias
            else None
        )

    def call(self, x: Any) -> Any:
        if on_torch():
            return self.activation(_torch_member_matmul(ops.convert_to_tensor(x), self.kernel, self.bias))
        if runs_members_apart():
            width = int(x.shape[-1]) // self.members
            parts = [ops.matmul(x[..., k * width : (k + 1) * width], self.kernel[k]) for k in range(self.members)]
            y = ops.concatenate(parts, axis=-1)
        else:
            y = ops.einsum("...mi,mio->...mo", _split_axis(x, len(x.shape) - 1, self.members), self.kernel)
            y = ops.reshape(y, (-1, *sizes(x)[1:-1], self.members * self.units))
        if self.bias is not None:
            y = y + self.bias
        return self.activation(y)

    def members_major(self, x: Any) -> Any:
        """The layer on its input laid out members first, (m, rows, P_in) -> (m, rows, P_out): one batched matmul."""
        y = ops.matmul(x, self.kernel)
        if self.bias is not None:
            y = y + ops.reshape(self.bias, (self.members, 1, self.units))
        return self.activation(y)

    def compute_output_shape(self, input_shape: Sequence[int | None]) -> tuple[int | None, ...]:
        return (*input_shape[:-1], self.members * self.units)

    def get_config(self) -> dict[str, Any]:
        config = {"members": self.members, "units": self.units, "use_bias": self.use_bias}
        return {**super().get_config(), **config, "activation": keras.activations.serialize(self.activation)}


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberLayerNormalization(keras.layers.Layer):  # type: ignore[misc]
    """A ``LayerNormalization`` over the last axis, member by member: (..., m*C) -> (..., m*C), each member's block
    of C channels (every channel, zeros included) normalized as ``keras.ops.layer_normalization`` normalizes it, with
    the layer's ``gamma`` and ``beta`` ((C,), each optional), ``epsilon`` and ``rms_scaling`` (the input times the
    reciprocal square root of its variance, then gamma); computed in at least float32 and cast to the compute dtype,
    as the layer is."""

    def __init__(
        self, members: int, epsilon: float, center: bool = True, scale: bool = True, rms_scaling: bool = False,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self.members, self.epsilon, self.center, self.scale, self.rms_scaling = (
            members, epsilon, center, scale, rms_scaling
        )  # fmt: skip
        self.autocast = False

    def build(self, input_shape: Sequence[int | None]) -> None:
        shape = (int(input_shape[-1]) // self.members,)  # type: ignore[arg-type]
        self.gamma = (
            self.add_weight(name="gamma", shape=shape, initializer="ones", autocast=False)
            if self.scale or self.rms_scaling
            else None
        )
        self.beta = (
            self.add_weight(name="beta", shape=shape, initializer="zeros", autocast=False)
            if self.center and not self.rms_scaling
            else None
        )

    def call(self, x: Any) -> Any:
        shape = ops.shape(x)  # sizes unknown when traced (batch, sequence) as tensors
        split = ops.reshape(x, (*shape[:-1], self.members, int(shape[-1]) // self.members))
        if self.rms_scaling:  # Keras' arithmetic for it, without the deprecation warning it gives on every call
            split = ops.cast(split, keras.backend.result_type(split.dtype, "float32"))
            y = split * ops.rsqrt(ops.var(split, axis=-1, keepdims=True) + self.epsilon)
            y = y if self.gamma is None else y * ops.cast(self.gamma, y.dtype)
        else:
            y = ops.layer_normalization(split, self.gamma, self.beta, -1, self.epsilon)
        return ops.cast(ops.reshape(y, shape), self.compute_dtype)

    def compute_output_shape(self, input_shape: Sequence[int | None]) -> tuple[int | None, ...]:
        return tuple(input_shape)

    def get_config(self) -> dict[str, Any]:
        config = {"members": self.members, "epsilon": self.epsilon, "center": self.center, "scale": self.scale}
        return {**super().get_config(), **config, "rms_scaling": self.rms_scaling}


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberMasks(keras.layers.Layer):  # type: ignore[misc]
    """A Masksembles layer run at full width on the member-stacked batch: block ``k`` of the batch times the ``k``-th
    of the computed members' masks (``masks``: (m, C), in the members' order)."""

    def __init__(self, masks: Sequence[Sequence[int]], channel_axis: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.given = np.asarray(masks, dtype=bool)
        self.channel_axis = channel_axis

    def build(self, input_shape: Sequence[int | None]) -> None:
        self.masks = self.add_weight(
            name="masks", shape=self.given.shape, initializer=_constant_initializer(self.given), trainable=False,
            autocast=False,
        )  # fmt: skip

    def call(self, x: Any) -> Any:
        return _apply_masks(x, self.masks, channel_axis=self.channel_axis % len(x.shape))

    def get_config(self) -> dict[str, Any]:
        masks = self.given.astype(np.int8).tolist()
        return {**super().get_config(), "masks": masks, "channel_axis": self.channel_axis}


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberFlatten(keras.layers.Layer):  # type: ignore[misc]
    """Flatten a channels-last (B, *spatial, m*P) tensor member by member: (B, m*spatial*P), each member's features
    (``s*P + j``) one block after the other (a plain flatten would interleave the members)."""

    def __init__(self, members: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.members = members

    def call(self, x: Any) -> Any:
        split = _split_axis(x, len(x.shape) - 1, self.members)  # (B, *spatial, m, P)
        return ops.reshape(ops.moveaxis(split, -2, 1), (-1, int(np.prod(x.shape[1:]))))

    def compute_output_shape(self, input_shape: Sequence[int | None]) -> tuple[int | None, ...]:
        return (input_shape[0], int(np.prod(input_shape[1:])))  # type: ignore[arg-type]

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "members": self.members}


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberConcat(keras.layers.Layer):  # type: ignore[misc]
    """Concatenate per-member tensors on their channel ``axis``, member by member: part ``i`` of member ``k`` after
    part ``i - 1`` of member ``k`` (a plain concatenation would put every member of a part together)."""

    def __init__(self, members: int, axis: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.members, self.axis = members, axis

    def call(self, parts: Sequence[Any]) -> Any:
        split = [_split_axis(part, self.axis, self.members) for part in parts]
        return _merge_axes(ops.concatenate(split, axis=self.axis + 1), self.axis)

    def compute_output_shape(self, input_shape: Sequence[Sequence[int | None]]) -> tuple[int | None, ...]:
        shape = list(input_shape[0])
        shape[self.axis] = sum(int(part[self.axis] or 0) for part in input_shape)
        return tuple(shape)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "members": self.members, "axis": self.axis}


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class MemberOutput(keras.layers.Layer):  # type: ignore[misc]
    """The program's output in Keras' batch-first layout: (B, m, ...) from a tensor held ``placement`` ``"batch"``
    ((m*B, ...), the batch on axis 0), ``"channels"`` ((B, ..., m*C on ``axis``, ...)) or ``"shared"`` ((B, ...), the
    same for every member); with ``pick`` >= 0 only that position's member, (B, ...)."""

    def __init__(self, placement: str, members: int, axis: int = -1, pick: int = -1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.placement, self.members, self.axis, self.pick = placement, members, axis, pick

    def call(self, x: Any) -> Any:
        m = self.members
        if self.placement == "batch":
            y = ops.moveaxis(ops.reshape(x, (m, -1, *sizes(x)[1:])), 0, 1)
        elif self.placement == "channels":
            y = ops.moveaxis(_split_axis(x, self.axis, m), self.axis, 1)
        else:
            y = ops.stack([x] * m, axis=1)
        return y if self.pick < 0 else y[:, self.pick]

    def compute_output_shape(self, input_shape: Sequence[int | None]) -> tuple[int | None, ...]:
        shape = list(input_shape)
        if self.placement == "batch":
            shape[0] = None if shape[0] is None else shape[0] // self.members
        elif self.placement == "channels":
            shape[self.axis] = int(shape[self.axis]) // self.members  # type: ignore[arg-type]
        return tuple(shape) if self.pick >= 0 else (shape[0], self.members, *shape[1:])

    def get_config(self) -> dict[str, Any]:
        config = {"placement": self.placement, "members": self.members, "axis": self.axis, "pick": self.pick}
        return {**super().get_config(), **config}


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class TileBatch(keras.layers.Layer):  # type: ignore[misc]
    """``masksembles_keras.tile`` as a layer: (B, ...) -> (n*B, ...), copy ``k`` in block ``k`` (the whole model run
    tiled, where verification replaced every packed program)."""

    def __init__(self, n: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n = n

    def call(self, x: Any) -> Any:
        return ops.concatenate([x] * self.n, axis=0)

    def compute_output_shape(self, input_shape: Sequence[int | None]) -> tuple[int | None, ...]:
        return (None if input_shape[0] is None else input_shape[0] * self.n, *input_shape[1:])

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "n": self.n}


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class SelectMembers(keras.layers.Layer):  # type: ignore[misc]
    """(n*B, ...) from a tiled model -> (B, m, ...) for the ``members`` asked for ((B, ...) when ``squeeze``)."""

    def __init__(self, n: int, members: Sequence[int], squeeze: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n, self.members, self.squeeze = n, [int(k) for k in members], squeeze

    def call(self, x: Any) -> Any:
        y = ops.reshape(x, (self.n, -1, *sizes(x)[1:]))
        if self.members != list(range(self.n)):  # every member in order (with_uncertainty's) needs no gather
            y = ops.take(y, np.asarray(self.members, dtype="int32"), axis=0)
        return y[0] if self.squeeze else ops.moveaxis(y, 0, 1)

    def compute_output_shape(self, input_shape: Sequence[int | None]) -> tuple[int | None, ...]:
        batch = None if input_shape[0] is None else input_shape[0] // self.n
        rest = tuple(input_shape[1:])
        return (batch, *rest) if self.squeeze else (batch, len(self.members), *rest)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "n": self.n, "members": self.members, "squeeze": self.squeeze}


def runs_member_dense_members_major() -> bool:
    """Whether this backend runs a run of the members' Dense layers laid out members first (``_members_major``):
    TensorFlow, where three of the packed MLP's (4 members of 273 channels) took 0.97 ms at batch 32 and 4.8 ms at
    batch 256 that way, 1.25 and 6.6 ms one matmul per member on slices joined again; JAX, where XLA:CPU runs the
    batched matmul on (rows, m, P) with a transpose around each layer (the packed MLP: 1.28 -> 0.74 ms at batch 32,
    4.7 -> 3.3 ms at batch 256, alike at batch 1). Torch runs each layer as one ``baddbmm`` on the members' blocks."""
    return str(keras.backend.backend()) in ("tensorflow", "jax")


def member_dense_spans(steps: Sequence[Any]) -> list[tuple[int, int]]:
    """``steps`` cut into (start, stop) spans run together: on a backend that runs the members' Dense layers members
    first, each run of two or more ``MemberDense`` of one member count is one span; every other step its own."""
    spans: list[tuple[int, int]] = []
    start = 0
    while start < len(steps):
        stop = start + 1
        if runs_member_dense_members_major() and isinstance(steps[start], MemberDense):
            while (
                stop < len(steps) and isinstance(steps[stop], MemberDense)
                and steps[stop].members == steps[start].members
            ):  # fmt: skip
                stop += 1
        spans.append((start, stop))
        start = stop
    return spans


def _members_major(steps: Sequence[MemberDense], x: Any) -> Any:
    """Consecutive ``MemberDense`` layers on (B, ..., m*P): the input laid out as (m, rows, P) once, each layer one
    batched matmul (``MemberDense.members_major``), the output laid out back once."""
    members, inner = steps[0].members, tuple(int(size) for size in x.shape[1:-1])
    y = ops.transpose(ops.reshape(x, (-1, members, int(x.shape[-1]) // members)), (1, 0, 2))
    for step in steps:
        y = step.members_major(y)
    return ops.reshape(ops.transpose(y, (1, 0, 2)), (-1, *inner, members * steps[-1].units))


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class Chain(keras.layers.Layer):  # type: ignore[misc]
    """Layers that each read only the one before (``steps``, built), run in one Keras call: ``call`` runs each
    step's own ``call``, and on TensorFlow and JAX each run of two or more ``MemberDense`` steps laid out members first
    (``_members_major``). On torch Keras runs a model layer by layer in Python, and each layer call costs about 0.1 ms
    besides its arithmetic, more than a small model's matmuls at batch 1."""

    def __init__(self, steps: Sequence[Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps = list(steps)
        self.inference = tuple(  # the keyword arguments of each step's call: inference (``training=False``)
            "training" in inspect.signature(step.call).parameters for step in self.steps
        )
        self.spans = member_dense_spans(self.steps)

    def build(self, input_shape: Sequence[int | None]) -> None:
        x = keras.KerasTensor(tuple(input_shape), dtype=self.compute_dtype)
        for step in self.steps:  # builds those not yet built (a loaded model), as Sequential does
            x = step(x)

    def call(self, x: Any) -> Any:
        for start, stop in self.spans:
            if stop - start > 1 and None not in tuple(x.shape[1:]):  # members first needs the axes but the batch
                x = _members_major(self.steps[start:stop], x)
                continue
            for step, training in zip(self.steps[start:stop], self.inference[start:stop], strict=True):
                x = step.call(x, training=False) if training else step.call(x)
        return x

    def compute_output_spec(self, x: Any) -> Any:
        for step in self.steps:
            x = step.compute_output_spec(x)
        return x

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "steps": [keras.saving.serialize_keras_object(step) for step in self.steps]}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Chain:
        steps = [keras.saving.deserialize_keras_object(step) for step in config.pop("steps")]
        return cls(steps, **config)
