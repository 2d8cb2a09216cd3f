"""The last step of Keras ``pack``: the core's program written as an ordinary functional Keras model.

Every step of ``masksembles_core.packing.Program`` becomes layers on the previous steps' outputs (placements and the
layers that move between them: ``_packed_layers``): the members' Dense layers as one Dense (a shared input) or
``MemberDense``, their convolutions as one grouped convolution (``groups`` = members x the groups each one keeps:
``MemberConv1D/2D/3D``, which run it in the pieces each backend runs fastest), depthwise convolutions as one depthwise
convolution over the members' kept channels, BatchNormalization as a BatchNormalization over the kept channels (its
statistics and affine gathered) or folded into the convolution before it, LayerNormalization over the last axis as
``MemberLayerNormalization`` (each member's block normalized alone), a Masksembles layer as the masking move into it,
Flatten and Concatenate member by member, and every other compacted layer or raw operation called again on the compacted
tensor (an activation, pooling, a sum). Channel selects take the kernel ``_select_form`` picks for this backend.
Fallbacks call a copy of the model's layer (its weights copied) or its raw operation at full width. On torch, where
Keras runs a model layer by layer in Python, each run of layers that read only each other then becomes one ``Chain``
layer (``chained``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import keras
import numpy as np

from masksembles_core.packing import OUTPUT, Move, Program, Step, block_indices, channel_indices

from ._layers import Masksembles
from ._pack_attention import AttentionHeads, attention_macs, call_arguments, heads_macs
from ._pack_capture import (
    INPUT,
    Call,
    Capture,
    _leaves,
    _Op,
    _Ref,
    _substitute,
    by_name,
    model_input,
    separable,
    spatial_size,
)
from ._packed_layers import (
    MEMBER_CONVOLUTIONS,
    MEMBER_DEPTHWISE,
    Chain,
    ChannelSelect,
    MemberConcat,
    MemberDense,
    MemberFlatten,
    MemberFrame,
    MemberLayerNormalization,
    MemberMasks,
    MemberOutput,
    blocked,
    contiguous_runs,
    on_torch,
    runs_member_dense_members_major,
)
from ._surgery import _copy

ZEROS = {"kernel_initializer": "zeros", "bias_initializer": "zeros"}  # weights assigned at once: nothing to draw


def _numpy(variable: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable))


def _laid_out(vector: np.ndarray, layouts: Sequence[np.ndarray]) -> np.ndarray:
    """A per-channel vector laid out like ``layouts`` side by side (0 for padding)."""
    index, valid = channel_indices(layouts)
    return np.where(valid, vector[index], np.zeros((), vector.dtype))


def _macs(call: Call, capture: Capture, key: str) -> int:
    """Multiply-adds per sample of a model's Dense, EinsumDense or convolution layer (separable ones too), attention
    (``MultiHeadAttention`` run whole, or the heads of one read as its calls) at full width (0 for anything else)."""
    layer = call.operation
    out = capture.seen[key].shape
    if isinstance(layer, AttentionHeads):
        return heads_macs(*(capture.seen[t].shape for t in call.inputs[:3]))
    if isinstance(layer, keras.layers.MultiHeadAttention):  # one that runs whole, on tensors of the graph
        given = call_arguments(call.args, call.kwargs)
        given["key"] = given["value"] if given["key"] is None else given["key"]
        reads = [given[name] for name in ("query", "value", "key")]
        if not all(isinstance(read, _Ref) for read in reads):
            return 0
        return attention_macs(layer, *(capture.seen[read.key].shape for read in reads))
    if separable(layer):  # per output position: the depthwise part's (*window, C_in, multiplier), then the 1x1's
        depthwise = tuple(int(size) for size in layer.depthwise_kernel.shape)
        positions = math.prod(out[1:]) // int(layer.filters)
        return positions * math.prod(depthwise) + math.prod(out[1:]) * math.prod(depthwise[-2:])
    if not isinstance(layer, keras.layers.Dense | keras.layers.EinsumDense | keras.layers.Conv1D | keras.layers.Conv2D
                      | keras.layers.Conv3D | keras.layers.DepthwiseConv1D | keras.layers.DepthwiseConv2D):  # fmt: skip
        return 0
    if isinstance(layer, keras.layers.Dense):
        return math.prod(out[1:]) * int(layer.kernel.shape[0])
    if isinstance(layer, keras.layers.EinsumDense):  # every output value sums over the kernel's contracted axes
        kernel_spec, output_spec = layer.equation.split(",")[1].split("->")
        sizes = zip(kernel_spec, layer.kernel.shape, strict=True)
        return math.prod(out[1:]) * math.prod(int(size) for label, size in sizes if label not in output_spec)
    kernel: tuple[int, ...] = tuple(layer.kernel.shape)
    # (*window, C_in / groups, C_out), depthwise (*window, C_in, multiplier)
    return (
        math.prod(out[1:])
        * math.prod(kernel[:-2])
        * (1 if isinstance(layer, keras.layers.DepthwiseConv1D | keras.layers.DepthwiseConv2D) else kernel[-2])
    )


def _reshaped(op: _Op, width: int) -> tuple[int, ...]:
    """The target shape (the batch's axis left out) of a ``Reshape`` layer or ``keras.ops.reshape`` (its batch on
    axis 0) whose channel axis, ``op.axis``, holds ``width`` channels now; a size it infers (-1) it still infers."""
    operation = op.call.operation
    target = list(operation.target_shape if isinstance(operation, keras.layers.Reshape) else operation.newshape[1:])
    if target[op.axis - 1] != -1:
        target[op.axis - 1] = width
    return tuple(int(size) for size in target)


class Emitter:
    """Builds the Keras model of a core program (``model``), with its multiply-adds (``macs``) and the model's
    layers that run at full width (``fallbacks``)."""

    def __init__(self, capture: Capture, axis: dict[str, int], program: Program, squeeze: bool, pick: int) -> None:
        self.capture, self.axis, self.program = capture, axis, program
        self.m = len(program.members)
        self.macs = {"dense": 0, "packed": 0, "fallback": 0, "moves": 0}
        self.copies: list[tuple[Any, Any]] = []
        self.copy_of: dict[int, Any] = {}  # a layer's copy by the layer's id (None: the model's own), for each call
        # a call with several outputs: run once on what its steps read (outputs placed apart, one shared and one
        # per member, read its inputs apart: run once each)
        self.results: dict[tuple[int, ...], list[Any]] = {}
        plain = len(capture.inputs) == 1 and not by_name(capture.model)
        self.inputs = {
            key: keras.Input(shape=shape, dtype=str(x.dtype), name="input" if plain else tensor.name)
            for key, shape, x, tensor in zip(
                capture.inputs, capture.input_shapes, capture.leaves, capture.model.inputs, strict=True
            )
        }  # fmt: skip
        self.input = model_input(capture.model, list(self.inputs.values()))
        self.tensors: dict[str, Any] = {}
        self.moved: dict[tuple[Any, ...], Any] = {}
        self.readers: dict[str, list[tuple[Step, int]]] = {}  # who reads each step, and through which edge
        for step in program.steps:
            for position, edge in enumerate(step.edges):
                self.readers.setdefault(edge.source, []).append((step, position))
        self.folded: set[str] = set()  # BatchNormalization steps folded into the convolution before them
        self.sample_bytes = 0  # the largest tensor between steps, in bytes per sample of the input
        for step in program.steps:
            self.tensors[step.name] = self._step(step)
            self._measure(self.tensors[step.name], step.placement.dense and not step.placement.shared)
        outputs = self._outputs(program.step(program.output), squeeze, pick)
        for original, copy in self.copies:
            copy.set_weights(original.get_weights())
        if on_torch():
            outputs = chained(outputs)
        elif runs_member_dense_members_major():
            outputs = chained(outputs, lambda layer: isinstance(layer, MemberDense))
        self.output = outputs[0] if len(outputs) == 1 else keras.tree.pack_sequence_as(capture.model.output, outputs)
        self.fallbacks = tuple(
            dict.fromkeys(
                capture.ops[name].call.describe()
                for name in program.fallbacks
                if name in capture.ops and capture.ops[name].role != "input"  # an input, read as it is
            )
        )

    # ---- moves

    def _edge(self, step: Step, position: int) -> Any:
        edge = step.edges[position]
        source = edge.source
        produced = self.program.step(source).placement
        value, key = self.tensors[source], cast(tuple[Any, ...], (source,))
        shared, stacked = produced.shared, produced.dense and not produced.shared
        for move in edge.moves:
            key = (*key, move.kind, _bytes(move.index), _bytes(move.scale))
            stacked = move.kind in ("tile", "to_batch") or (stacked and move.kind != "to_channels")
            if key not in self.moved:
                self.moved[key] = self._move(source, move, shared, value)(value)
                self._measure(self.moved[key], stacked)
            value = self.moved[key]
            if move.kind in ("to_channels", "tile", "to_batch"):
                shared = False
            elif move.kind == "select":
                shared = edge.placement.shared
        return value

    def _measure(self, value: Any, stacked: bool) -> None:
        """Count ``value`` (a symbolic tensor or a structure of them; ``stacked``: on the member-stacked batch, m
        copies per sample) in ``sample_bytes``, a size unknown until called (a sequence length) as 1."""
        for tensor in keras.tree.flatten(value):
            if isinstance(tensor, keras.KerasTensor):
                size = math.prod(int(d or 1) for d in tensor.shape[1:]) * np.dtype(tensor.dtype).itemsize
                self.sample_bytes = max(self.sample_bytes, size * (self.m if stacked else 1))

    def _move(self, source: str, move: Move, shared: bool, value: Any) -> Any:
        seen = self.capture.seen[source]
        if move.kind == "select":
            assert move.index is not None and move.scale is not None
            scale = None if (move.scale == 1).all() else move.scale.tolist()
            axis = self.axis[source] % len(value.shape)
            form, blocks = _select_form(move.index.tolist(), scale, self.m, value, axis)
            if form == "onehot":
                positions = spatial_size(seen.shape, seen.batch_axis, axis)
                self.macs["moves"] += positions * int(value.shape[axis]) * len(move.index) // blocks
            return ChannelSelect(move.index.tolist(), scale, self.axis[source], form, blocks)
        if move.kind == "tile":
            if not seen.batch_axes:
                return lambda value: value  # the same for every member
            return MemberFrame("tile", self.m, seen.batch_axis)
        return MemberFrame(move.kind, self.m, seen.batch_axis, self.axis[source])

    # ---- steps

    def _step(self, step: Step) -> Any:
        if step.node.kind == "input":
            return self.inputs[step.name]
        edges = [self._edge(step, position) for position in range(len(step.edges))]
        if step.name == OUTPUT:  # the model's outputs, gathered on the member-stacked batch
            return edges
        op = self.capture.ops[step.name]
        full = _macs(op.call, self.capture, step.name)
        self.macs["dense"] += full * self.m
        if step.name in self.program.folded:
            self.macs["packed"] += full * self.m
            return self._folded(op, edges)
        if step.placement.dense:
            frame = 1 if step.placement.shared else self.m
            self.macs["packed"] += full * frame
            self.macs["fallback"] += full * frame
            return self._dense(op, edges)
        copies = 1 if step.placement.shared else self.m
        role = op.role
        if role in ("masks", "identity"):
            return edges[0]
        if role == "dense":
            return self._dense_layer(step, op, edges[0], copies)
        if role == "conv":
            return self._conv(step, op, edges[0], copies)
        if role == "depthwise":
            return self._depthwise(step, op, edges[0], copies)
        if role == "batchnorm":
            return edges[0] if step.name in self.folded else self._batchnorm(step, op, edges[0])
        if role == "layernorm" and copies > 1:
            return self._layer_norm(op, edges[0], copies)
        if step.node.kind == "flatten":
            last = self.axis[op.tensors[0]] == self.capture.seen[op.tensors[0]].rank - 1
            return (MemberFlatten(copies) if last and copies > 1 else keras.layers.Flatten())(edges[0])
        if step.node.kind == "concat":
            parts = [edge for edge in edges if edge.shape[op.axis] > 0] or edges[:1]
            if len(parts) == 1:
                return parts[0]
            return (MemberConcat(copies, op.axis) if copies > 1 else keras.layers.Concatenate(op.axis))(parts)
        if role == "reshape":
            width = int(edges[0].shape[self.axis[op.tensors[0]]])
            return keras.layers.Reshape(_reshaped(op, width))(edges[0])
        if role == "per_channel":
            return self._per_channel(step, op, edges[0])
        return self._call(op, edges)

    def _folded(self, op: _Op, edges: list[Any]) -> Any:
        """A folded ``AttentionHeads`` call on the members' heads side by side: one with m times the heads, on the
        projections' member blocks, its masks read as they are (broadcast over the heads)."""
        config = op.call.operation.get_config()
        del config["name"]
        wide = AttentionHeads.from_config({**config, "heads": config["heads"] * self.m})
        return op.call.run(dict(zip(op.tensors, edges, strict=True)), wide)[0]

    def _per_channel(self, step: Step, op: _Op, x: Any) -> Any:
        """An elementwise operation with a per-channel constant (``x * gamma``) on the compacted tensor, its constant
        laid out like the step's channels (padding reads channel 0: finite, never read back)."""
        call = op.call
        (constant,) = (leaf for leaf in _leaves(call) if not isinstance(leaf, _Ref))
        values, rank = _numpy(constant), self.capture.seen[op.key].rank
        index, _ = channel_indices(step.placement.layouts)
        shape = [1] * values.ndim
        shape[op.axis - rank + values.ndim] = len(index)
        laid_out = values.reshape(-1)[index].reshape(shape)
        args, kwargs = _substitute((call.args, call.kwargs), lambda leaf: laid_out if leaf is constant else None)
        return Call(call.operation, args, kwargs, call.outputs, call.path).run({op.tensors[0]: x})[0]

    def _call(self, op: _Op, edges: list[Any]) -> Any:
        """The model's layer (a copy) or raw operation again, on the moved tensors."""
        call = op.call
        run = (id(call), *(id(edge) for edge in edges))
        if run not in self.results:
            values = dict(zip(op.tensors, edges, strict=True))
            self.results[run] = self._run_copy(call, values)
        return self.results[run][op.output]

    def _run_copy(self, call: Call, values: dict[str, Any]) -> list[Any]:
        """``call`` on a copy of its layer or operation rebuilt from its config; on the model's own where its config
        does not rebuild it (raises, or builds other weights: a custom layer whose inner layers ``insert`` or
        ``convert_dropout`` replaced, as in keras-hub's), which the packed model then shares with the model."""
        operation = call.operation
        if id(operation) in self.copy_of:  # a layer the model calls at several places (a tied embedding): one copy
            return call.run(values, self.copy_of[id(operation)])
        self.copy_of[id(operation)] = None
        try:
            copy = (
                _copy(operation)
                if isinstance(operation, keras.layers.Layer)
                else type(operation).from_config(operation.get_config())
            )
            outputs = call.run(values, copy)
        except Exception:  # a config that does not rebuild it
            return call.run(values)
        weights = getattr(operation, "weights", [])  # a raw operation has none
        if [tuple(w.shape) for w in getattr(copy, "weights", [])] != [tuple(w.shape) for w in weights]:
            return call.run(values)
        if weights:
            self.copies.append((operation, copy))
        self.copy_of[id(operation)] = copy
        return outputs

    def _dense(self, op: _Op, edges: list[Any]) -> Any:
        """A fallback at full width: the model's layer or operation on the member-stacked batch (or shared); a
        Masksembles layer with the computed members' masks."""
        operation = op.call.operation
        if op.role == "input":
            return self.inputs[op.key]
        if isinstance(operation, Masksembles):
            masks = _numpy(operation.masks) != 0
            rank = self.capture.seen[op.key].rank
            return MemberMasks(masks[list(self.program.members)].astype(int).tolist(), operation.channel_axis % rank)(
                edges[0]
            )
        return self._call(op, edges)

    def _kernel_blocks(self, step: Step, oriented: np.ndarray) -> np.ndarray:
        """(L, P_out, P_in, *window): each copy's block of a (C_out, C_in, *window) kernel, zero where padded."""
        rows = step.placement.layouts
        cols = step.edges[0].placement.member_layouts(len(rows))
        r, c, valid = block_indices(rows, cols)
        keep = valid.reshape(*valid.shape, *([1] * (oriented.ndim - 2)))
        blocks: np.ndarray = np.where(keep, oriented[r, c], np.zeros((), oriented.dtype))
        return blocks

    def _count(self, step: Step, op: _Op, per_position: int) -> None:
        seen = self.capture.seen[op.key]
        positions = spatial_size(seen.shape, seen.batch_axis, op.axis)
        self.macs["packed"] += positions * per_position

    def _dense_layer(self, step: Step, op: _Op, x: Any, copies: int) -> Any:
        layer = op.call.operation
        blocks = self._kernel_blocks(step, _numpy(layer.kernel).T)  # (L, P_out, P_in)
        units = blocks.shape[1]
        bias = _laid_out(_numpy(layer.bias), step.placement.layouts) if layer.use_bias else None
        self._count(step, op, blocks.size)
        dtype = layer.dtype_policy
        if copies > 1 and not step.edges[0].placement.shared:
            packed = MemberDense(copies, units, layer.activation, layer.use_bias, dtype=dtype)
            result = packed(x)
            packed.kernel.assign(blocks.transpose(0, 2, 1))
        else:
            packed = keras.layers.Dense(copies * units, activation=layer.activation, use_bias=layer.use_bias,
                                        dtype=dtype, kernel_initializer="zeros")  # fmt: skip
            result = packed(x)
            packed.kernel.assign(np.concatenate(list(blocks), axis=0).T)
        if bias is not None:
            cast(Any, packed.bias).assign(bias)
        return result

    def _conv(self, step: Step, op: _Op, x: Any, copies: int) -> Any:
        layer = op.call.operation
        kernel = _numpy(layer.kernel)  # (*window, C_in / groups, C_out)
        oriented = np.moveaxis(kernel, (-1, -2), (0, 1))  # (C_out, C_in / groups, *window)
        if step.node.kind == "grouped":
            blocks = [_laid_out_rows(oriented, layout) for layout in step.placement.layouts]
            stacked = np.concatenate(blocks)
            groups = copies * step.groups
        else:
            stacked = np.concatenate(list(self._kernel_blocks(step, oriented)))
            groups = 1 if step.edges[0].placement.shared else copies
        self._count(step, op, stacked.size)
        fold = self._batchnorm_after(step, layer)
        config = {**layer.get_config(), "filters": stacked.shape[0], "groups": groups, **ZEROS}
        config["use_bias"] = layer.use_bias or fold is not None
        del config["name"]
        member_convolution = MEMBER_CONVOLUTIONS.get(type(layer))
        if member_convolution is not None:
            packed = member_convolution.from_config({**config, "members": groups // (step.groups or 1)})
        else:
            packed = type(layer).from_config(config)
        result = packed(x)
        bias = _laid_out(_numpy(layer.bias), step.placement.layouts) if layer.use_bias else None
        if fold is not None:  # (C_out, ...) rows times the BatchNormalization's scale, its shift into the bias
            scale, shift = fold
            stacked = stacked * scale.reshape(-1, *([1] * (stacked.ndim - 1))).astype(stacked.dtype)
            bias = shift if bias is None else bias * scale + shift
        packed.kernel.assign(np.moveaxis(stacked, (0, 1), (-1, -2)))
        if bias is not None:
            packed.bias.assign(bias.astype(stacked.dtype))
        return result

    def _depthwise(self, step: Step, op: _Op, x: Any, copies: int) -> Any:
        layer = op.call.operation
        kernel = _numpy(layer.kernel)  # (*window, C_in, multiplier)
        multiplier = kernel.shape[-1]
        oriented = np.moveaxis(kernel, -2, 0)  # (C_in, *window, multiplier)
        groups = []
        for layout in step.placement.layouts:
            first = layout.reshape(-1, multiplier)[:, 0]
            valid = (first >= 0).reshape(-1, *([1] * (oriented.ndim - 1)))
            groups.append(np.where(valid, oriented[np.maximum(first, 0) // multiplier], np.zeros((), kernel.dtype)))
        stacked = np.concatenate(groups)  # (C_in, *window, multiplier)
        self._count(step, op, stacked.size)
        fold = self._batchnorm_after(step, layer)
        config = {**layer.get_config(), "depthwise_initializer": "zeros", "bias_initializer": "zeros"}
        config["use_bias"] = layer.use_bias or fold is not None
        del config["name"]
        packed = MEMBER_DEPTHWISE.get(type(layer), type(layer)).from_config(config)
        result = packed(x)
        bias = _laid_out(_numpy(layer.bias), step.placement.layouts) if layer.use_bias else None
        if fold is not None:  # output channel c * multiplier + j: the BatchNormalization's scale, its shift
            scale, shift = fold
            per_tap = scale.reshape(len(stacked), *([1] * (stacked.ndim - 2)), multiplier)
            stacked = stacked * per_tap
            bias = shift if bias is None else bias * scale + shift
        packed.kernel.assign(np.moveaxis(stacked, 0, -2).astype(kernel.dtype))
        if bias is not None:
            packed.bias.assign(bias.astype(kernel.dtype))
        return result

    def _batchnorm_after(self, step: Step, layer: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """The (scale, shift) per packed output channel of the BatchNormalization that alone reads ``step`` (a
        convolution without activation, its channels unmoved, float32 or float64 throughout), which is then folded
        into it: marked in ``folded``, it passes its input on. None where there is none."""
        readers = self.readers.get(step.name, [])
        if len(readers) != 1 or step.name == self.program.output:
            return None
        reader, position = readers[0]
        if reader.edges[position].moves or reader.name not in self.capture.ops:
            return None
        op = self.capture.ops[reader.name]
        norm = op.call.operation
        exact = ("float32", "float64")
        if op.role != "batchnorm" or reader.placement.dense or step.placement.dense:
            return None
        if keras.activations.serialize(layer.activation) != "linear":
            return None
        if layer.dtype_policy.name not in exact or norm.dtype_policy.name != layer.dtype_policy.name:
            return None
        if op.axis != self.capture.ops[step.name].axis:
            return None
        index, _ = channel_indices(step.placement.layouts)  # padding reads channel 0: finite, never read back
        mean, variance = _numpy(norm.moving_mean).astype(np.float64), _numpy(norm.moving_variance).astype(np.float64)
        gamma = _numpy(norm.gamma).astype(np.float64) if norm.scale else np.ones_like(mean)
        beta = _numpy(norm.beta).astype(np.float64) if norm.center else np.zeros_like(mean)
        scale = gamma / np.sqrt(variance + norm.epsilon)
        self.folded.add(reader.name)
        return scale[index], (beta - mean * scale)[index]

    def _batchnorm(self, step: Step, op: _Op, x: Any) -> Any:
        layer = op.call.operation
        config = layer.get_config()
        del config["name"]
        packed = type(layer).from_config(config)
        result = packed(x)
        layouts = step.placement.layouts
        for name in ("gamma", "beta", "moving_mean", "moving_variance"):
            variable = getattr(layer, name, None)
            if variable is not None:
                index, _ = channel_indices(layouts)  # padding reads channel 0: finite, and never read back
                getattr(packed, name).assign(_numpy(variable)[index])
        return result

    def _layer_norm(self, op: _Op, x: Any, copies: int) -> Any:
        """A LayerNormalization over the last axis on ``copies`` members' full blocks side by side: each block
        normalized alone, with the layer's own gamma and beta (the core lays every channel out in order)."""
        layer = op.call.operation
        packed = MemberLayerNormalization(
            copies, layer.epsilon, layer.center, layer.scale, layer.rms_scaling, dtype=layer.dtype_policy
        )
        result = packed(x)
        for name in ("gamma", "beta"):
            variable = getattr(layer, name)
            if variable is not None:
                getattr(packed, name).assign(_numpy(variable))
        return result

    def _outputs(self, step: Step, squeeze: bool, pick: int) -> list[Any]:
        """The model's outputs (``capture.outputs``' order) in Keras' batch-first layout, (B, m, ...) or, where
        ``squeeze``, member ``pick`` (the first computed where -1): (B, ...)."""
        if squeeze and pick < 0:
            pick = 0
        if step.name == OUTPUT:
            gathered = dict(zip(dict.fromkeys(self.capture.outputs), self.tensors[OUTPUT], strict=True))
            return [MemberOutput("batch", self.m, -1, pick)(gathered[key]) for key in self.capture.outputs]
        if step.placement.shared:
            placement, axis = "shared", -1
        elif step.placement.dense:
            placement, axis = "batch", -1
        else:
            placement, axis = "channels", self.axis[step.name]
        return [MemberOutput(placement, self.m, axis, pick)(self.tensors[step.name])]


def _laid_out_rows(oriented: np.ndarray, layout: np.ndarray) -> np.ndarray:
    """The rows of a (C_out, ...) kernel in ``layout`` (zero where padded)."""
    index, valid = channel_indices([layout])
    keep = valid.reshape(-1, *([1] * (oriented.ndim - 1)))
    rows: np.ndarray = np.where(keep, oriented[index], np.zeros((), oriented.dtype))
    return rows


ONEHOT_WIDTH = 128  # the widest input (per block) a one-hot select reads on TensorFlow


def _select_form(
    index: Sequence[int], scale: Sequence[float] | None, members: int, value: Any, axis: int
) -> tuple[str, int]:
    """``ChannelSelect``'s kernel for ``index`` on ``axis`` of ``value``, and its blocks: static slices where the
    index is at most ``members`` runs of consecutive channels (a tile, a member's block); on TensorFlow one-hot
    products (one per member where the select is ``blocked``) on the last axis of a float tensor at most
    ``ONEHOT_WIDTH`` channels wide per block (its gather on the channel axis is 1.5-4x slower than them); else a
    gather (XLA's on JAX is faster than one-hot products there)."""
    if len(contiguous_runs(index)) <= members:
        return "slices", 1
    width = int(value.shape[axis])
    blocks = members if blocked(index, scale, width, members) else 1
    last = axis == len(value.shape) - 1 and "float" in str(value.dtype)
    if last and width // blocks <= ONEHOT_WIDTH and keras.backend.backend() == "tensorflow":
        return "onehot", blocks
    return "gather", 1


def _nodes(outputs: Sequence[Any]) -> list[Any]:
    """The Keras graph's nodes that ``outputs`` are computed from, each after those it reads."""
    order: list[Any] = []
    seen: set[int] = set()
    stack = [
        (output._keras_history.operation._inbound_nodes[output._keras_history.node_index], False)
        for output in reversed(outputs)
    ]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
        elif id(node) not in seen:
            seen.add(id(node))
            stack.append((node, True))
            stack.extend((parent, False) for parent in node.parent_nodes if id(parent) not in seen)
    return order


def _chainable(node: Any) -> bool:
    """Whether ``Chain`` can run ``node``'s layer: a Keras or packed layer called on one tensor without a mask (and
    at most ``training=False``), writing one tensor and no mask, its dtype policy not mixed."""
    layer = node.operation
    arguments = node.arguments
    if not isinstance(layer, keras.layers.Layer) or isinstance(layer, keras.Model | keras.layers.InputLayer):
        return False
    if not type(layer).__module__.startswith(("keras.", "masksembles_keras.")):
        return False
    if arguments.kwargs not in ({}, {"training": False}):
        return False
    if len(arguments.args) != 1 or len(node.input_tensors) != 1 or len(node.outputs) != 1:
        return False
    if arguments.args[0] is not node.input_tensors[0] or getattr(arguments.args[0], "_keras_mask", None) is not None:
        return False
    policy = layer.dtype_policy
    return bool(
        type(layer).compute_mask is keras.layers.Layer.compute_mask and policy.compute_dtype == policy.variable_dtype
    )


def chained(outputs: Sequence[Any], select: Callable[[Any], bool] = lambda layer: True) -> list[Any]:
    """``outputs`` computed again with every run of two or more layers that ``Chain`` can run (``_chainable``, one
    dtype policy) and ``select`` takes, each reading only the one before it and read only by the one after it, as
    one ``Chain`` layer: torch's eager Keras pays each layer call (about 0.1 ms), the compiled backends do not; on
    TensorFlow and JAX a ``Chain`` runs the members' Dense layers laid out members first
    (``runs_member_dense_members_major``).
    """
    nodes = _nodes(outputs)
    reads: dict[int, int] = {}
    for output in outputs:
        reads[id(output)] = reads.get(id(output), 0) + 1
    for node in nodes:
        for tensor in node.input_tensors:
            reads[id(tensor)] = reads.get(id(tensor), 0) + 1
    chain_of: dict[int, list[Any]] = {}  # id(node) -> its chain (shared list), nodes in order
    producer = {id(tensor): node for node in nodes for tensor in node.outputs}
    for node in nodes:
        if not _chainable(node) or not select(node.operation):
            continue
        before = producer.get(id(node.input_tensors[0]))
        if (
            before is not None and id(before) in chain_of and reads[id(node.input_tensors[0])] == 1
            and before.operation.dtype_policy.name == node.operation.dtype_policy.name
        ):  # fmt: skip
            chain_of[id(node)] = chain_of[id(before)]
            chain_of[id(node)].append(node)
        else:
            chain_of[id(node)] = [node]
    new: dict[int, Any] = {}

    def moved(value: Any) -> Any:
        return new.get(id(value), value) if isinstance(value, keras.KerasTensor) else value

    for node in nodes:
        if node.is_input:
            continue
        chain = chain_of.get(id(node))
        if chain is not None and len(chain) > 1:
            if node is chain[-1]:
                head = chain[0].input_tensors[0]
                steps = [step.operation for step in chain]
                new[id(node.outputs[0])] = Chain(steps, dtype=steps[0].dtype_policy)(moved(head))
            continue
        args = keras.tree.map_structure(moved, list(node.arguments.args))
        kwargs = keras.tree.map_structure(moved, dict(node.arguments.kwargs))
        results = keras.tree.flatten(node.operation(*args, **kwargs))
        new.update((id(old), result) for old, result in zip(node.outputs, results, strict=True))
    return [new[id(output)] for output in outputs]


def _bytes(array: np.ndarray | None) -> bytes | None:
    return None if array is None else array.tobytes()


__all__ = ["INPUT", "Emitter"]
