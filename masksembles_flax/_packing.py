"""Packed inference for Flax NNX: every member at about the cost of one model, from the structure of the masks.

Member ``k`` of a Masksembles model only ever uses its live channels, so the layers next to a Masksembles layer can
be shrunk physically. ``extract_member`` builds member ``k`` as a standalone dense model of shrunk NNX layers.
``pack`` runs all members in one call: the shared prefix before the first Masksembles layer runs once on the batch
(on the union of the channels the members use); after it, every member runs on its own compacted weights, padded to
the widest member: the members' Linear layers as one batched matmul (``jax.vmap`` over their stacked kernels), their
convolutions and per-channel layers one per member (XLA:CPU runs the grouped convolution that ``jax.vmap`` makes of
a convolution several times slower than the separate ones). Both have eval semantics: BatchNorm uses its running
statistics, Dropout is off, Masksembles is grouped.

Supported models: ``nnx.Sequential`` (nested ones included) of ``nnx.Linear``, ``nnx.Conv`` (feature_group_count=1,
no kernel mask), ``nnx.BatchNorm`` on the last axis, ``nnx.Dropout``, elementwise activation functions (``nnx.relu``,
``jax.nn.gelu``, ``jnp.tanh``, ... or a ``functools.partial`` of one with keyword arguments), pooling given as a
``functools.partial`` of ``nnx.max_pool``/``avg_pool``/``min_pool`` over the spatial axes, ``Flatten``, ``Residual``
and Masksembles layers on the last axis with the same n. Anything else raises a ValueError that names the layer by
its path in the model (``model.layers[2]``). Which channels each member computes is decided across the graph,
residual additions included, by ``masksembles_core.packing`` (its module docstring states the rules): a residual
addition keeps what either side needs, and a channel is skipped only where it is known to be zero. Channels that
Masksembles zeroes are left out instead of multiplied by 0, so results equal the dense model's for finite
activations (a masked inf or NaN gives NaN in the dense model and is absent here).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import masksembles_core.adapter as mca
from masksembles_core.packing import (
    GraphNode,
    Placement,
    block_indices,
    channel_indices,
    gather_plan,
    norm_affine,
    plan_members,
)

from . import nnx as masksembles_nnx

# elementwise activation functions -> whether they map 0 to 0
ACTIVATIONS: dict[Callable[..., Any], bool] = {
    jax.nn.relu: True, jax.nn.relu6: True, jax.nn.gelu: True, jax.nn.silu: True, jnp.tanh: True, jax.nn.elu: True,
    jax.nn.celu: True, jax.nn.selu: True, jax.nn.leaky_relu: True, jax.nn.hard_tanh: True, jax.nn.hard_silu: True,
    jax.nn.soft_sign: True, jax.nn.mish: True, jax.nn.identity: True,
    jax.nn.sigmoid: False, jax.nn.softplus: False, jax.nn.hard_sigmoid: False, jax.nn.log_sigmoid: False,
}  # fmt: skip
POOLS = (nnx.max_pool, nnx.avg_pool, nnx.min_pool)
MIXING = ("linear", "conv")
CHANNELWISE = ("norm", "dropout", "function")


class Flatten(nnx.Module):
    """(B, *rest) -> (B, prod(rest)) in row-major order: for channels-last input, feature ``s*C + c``."""

    def __call__(self, x: jax.Array) -> jax.Array:
        flat: jax.Array = x.reshape((x.shape[0], -1))
        return flat


class Residual(nnx.Module):
    """A residual block ``y = x + f(x)`` with ``f = nnx.Sequential(*layers)``; f must keep the shape of x."""

    def __init__(self, *layers: Callable[..., Any]) -> None:
        self.branch = nnx.Sequential(*layers)

    def __call__(self, x: jax.Array) -> jax.Array:
        y: jax.Array = x + self.branch(x)
        return y


@dataclass
class _Node:
    """A node of the model graph: what it computes, its output shape and, for Masksembles, its masks."""

    name: str  # the layer's path in the model, or "input"
    kind: str  # input, linear, conv, norm, dropout, function, masks, add, flatten
    inputs: tuple[str, ...]
    output: jax.ShapeDtypeStruct
    layer: Any = None
    zero_preserving: bool = True
    spatial: int = 1  # flatten: positions per input channel
    masks: np.ndarray | None = None  # masks: (n, C) bool

    def graph_node(self) -> GraphNode:
        kind = "mixing" if self.kind in MIXING else "channelwise" if self.kind in CHANNELWISE else self.kind
        return GraphNode(
            self.name, kind, self.inputs, self.output.shape[-1], self.zero_preserving,
            self.spatial, self.masks, channels_last=True,
        )  # fmt: skip


def _describe(layer: Any) -> str:
    if isinstance(layer, functools.partial):
        return f"functools.partial of {_describe(layer.func)}"
    if isinstance(layer, nnx.Module):
        return type(layer).__name__
    return f"function {getattr(layer, '__name__', repr(layer))!r}"


def _is_activation(layer: Any) -> bool:
    if isinstance(layer, functools.partial):
        return not layer.args and _is_activation(layer.func)
    try:
        return layer in ACTIVATIONS
    except TypeError:  # unhashable callable
        return False


def _zero_preserving(layer: Any) -> bool:
    return _zero_preserving(layer.func) if isinstance(layer, functools.partial) else ACTIVATIONS[layer]


def _output_struct(layer: Any, source: jax.ShapeDtypeStruct, where: str) -> jax.ShapeDtypeStruct:
    """Shape and dtype of ``layer``'s output on ``source``, evaluated abstractly on a copy (the model is untouched)."""
    try:
        if isinstance(layer, nnx.Module):
            graphdef, state = nnx.split(layer)
            result = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, source)
        else:
            result = jax.eval_shape(layer, source)
    except Exception as error:
        raise ValueError(f"pack/extract_member: {where} fails on an input of shape {source.shape}: {error}") from error
    if not isinstance(result, jax.ShapeDtypeStruct):
        raise ValueError(f"pack/extract_member: {where} must return one array")
    return result


def _classify(layer: Any, path: str, source: _Node) -> _Node:
    """The graph node of one layer reading ``source``; raises for anything outside the supported set."""
    where = f"{path} ({_describe(layer)})"
    shape = source.output.shape
    kind, zero, masks = "", True, None
    if type(layer) is nnx.Linear:
        kind, zero = "linear", False
    elif type(layer) is nnx.Conv:
        if layer.feature_group_count != 1:
            raise ValueError(
                f"pack/extract_member: {where} has feature_group_count={layer.feature_group_count}; only 1 is supported"
            )
        if layer.mask is not None:
            raise ValueError(f"pack/extract_member: {where} has a kernel mask; only unmasked kernels are supported")
        kind, zero = "conv", False
    elif type(layer) is nnx.BatchNorm:
        axes = layer.axis if isinstance(layer.axis, tuple) else (layer.axis,)
        if tuple(a % len(shape) for a in axes) != (len(shape) - 1,):
            raise ValueError(f"pack/extract_member: {where} normalizes axis {layer.axis}; only the last is supported")
        kind, zero = "norm", False
    elif type(layer) is nnx.Dropout:
        kind = "dropout"
    elif isinstance(layer, masksembles_nnx.Masksembles):
        mca.check_input_shape(shape, channels=layer.channels, channel_axis=layer.channel_axis)
        if layer.channel_axis % len(shape) != len(shape) - 1:
            raise ValueError(
                f"pack/extract_member: {where} has channel_axis={layer.channel_axis} on a rank-{len(shape)} input; "
                "only the last axis is supported (NNX layers are channels-last)"
            )
        kind, masks = "masks", np.asarray(layer.masks[...]).astype(bool)
    elif type(layer) is Flatten:
        kind = "flatten"
    elif _is_activation(layer):
        kind, zero = "function", _zero_preserving(layer)
    elif isinstance(layer, functools.partial) and layer.func in POOLS:
        window = layer.keywords.get("window_shape", layer.args[0] if layer.args else None)
        if not isinstance(window, Sequence) or len(window) != len(shape) - 2:
            raise ValueError(
                f"pack/extract_member: {where} has window_shape={window} on a rank-{len(shape)} input; a pool must "
                "cover exactly the spatial axes (all but the first and the last)"
            )
        kind = "function"
    else:
        raise ValueError(f"pack/extract_member: unsupported layer {where}")
    output = source.output if kind in ("norm", "dropout", "masks") else _output_struct(layer, source.output, where)
    node = _Node(path, kind, (source.name,), output, layer, zero, masks=masks)
    if kind == "flatten":
        node.spatial = int(np.prod(shape[1:-1], dtype=np.int64))
    return node


def _walk(layer: Any, path: str, source: _Node, nodes: list[_Node]) -> _Node:
    """Append the graph nodes of ``layer`` (reading ``source``) to ``nodes``; return its output node."""
    if type(layer) is nnx.Sequential:
        for i, sub in enumerate(layer.layers):
            source = _walk(sub, f"{path}.layers[{i}]", source, nodes)
        return source
    if type(layer) is Residual:
        branch = _walk(layer.branch, f"{path}.branch", source, nodes)
        if branch.output.shape != source.output.shape:
            raise ValueError(
                f"pack/extract_member: {path} (Residual) maps shape {source.output.shape} to {branch.output.shape} "
                "in its branch; it must keep the shape"
            )
        node = _Node(path, "add", (source.name, branch.name), source.output)
    else:
        node = _classify(layer, path, source)
    nodes.append(node)
    return node


def _trace(model: Any, example_input: jax.Array | jax.ShapeDtypeStruct) -> tuple[list[_Node], str]:
    """The graph nodes of ``model`` on ``example_input``'s shape and dtype, and the output node's name."""
    example = jax.ShapeDtypeStruct(tuple(example_input.shape), example_input.dtype)  # type: ignore[no-untyped-call]
    if len(example.shape) < 2:
        raise ValueError(
            f"pack/extract_member need an example input of shape (B, ..., C); received shape {example.shape}"
        )
    nodes = [_Node("input", "input", (), example)]
    output = _walk(model, "model", nodes[0], nodes).name
    counts = sorted({node.masks.shape[0] for node in nodes if node.masks is not None})
    if not counts:
        raise ValueError("pack/extract_member: the model has no Masksembles layer")
    if len(counts) != 1:
        raise ValueError(f"pack/extract_member: every Masksembles layer needs the same n; found {counts}")
    return nodes, output


class _Select(nnx.Module):
    """Move the channels (last axis) of one copy's input into its layout (``index``, (P,)), then scale them.

    On feature maps (``matmul``) the move is one product with a (C, P) one-hot matrix that carries the scale: XLA:CPU
    then fuses it with the convolutions around it, while a gather splits the program into kernels run one by one
    (the packed ResNet of benchmarks/ ran 10-20% slower with gathers). The product is exact for finite values; a
    non-finite activation spreads NaN to every channel moved at its position. On vectors, where that product would
    cost as much as the Linear layer it feeds, it stays a gather.
    """

    def __init__(self, index: np.ndarray, scale: np.ndarray, *, gather: bool, channels: int, matmul: bool) -> None:
        self.gather, self.multiply = gather, not bool((scale == 1).all())
        self.matmul = gather and matmul
        if self.matmul:  # only the arrays the call uses: they are the module's state
            selection = np.zeros((channels, len(index)), dtype=np.float32)
            selection[np.clip(index, 0, channels - 1), np.arange(len(index))] = scale
            self.selection = jnp.asarray(selection)
            return
        if self.gather:
            self.index = jnp.asarray(index, dtype=jnp.int32)
        if self.multiply:
            self.scale = jnp.asarray(scale, dtype=jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.matmul:
            moved: jax.Array = jnp.dot(x, self.selection.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)
            return moved
        if self.gather:
            x = jnp.take(x, self.index, axis=-1, mode="clip")
        return x * self.scale.astype(x.dtype) if self.multiply else x


def _selects(
    source: Placement, target: Placement, copies: int, scales: Sequence[np.ndarray] | None, *, feature_map: bool
) -> list[_Select | None]:
    """For each of the target's copies, the module that moves its source copy into its layout (None: nothing moves).

    ``copies``: 1 for a shared node or an extracted member, else the member count; a source with one copy feeds
    them all. ``feature_map``: the arrays have spatial axes (the move is then a one-hot product, see ``_Select``).
    """
    plan = gather_plan(source, target, scales)
    if plan is None:
        return [None] * copies
    width, blocks = target.width, len(target.layouts)  # one block for a shared target, else one per member
    index, scale = plan[0].reshape(blocks, width), plan[1].reshape(blocks, width)
    if not source.shared:  # gather_plan addresses the members' blocks side by side
        index = index - (np.arange(blocks) * source.width)[:, None]
    selects: list[_Select | None] = []
    for k in range(copies):
        gather = source.width != width or not (index[k] == np.arange(width)).all()
        moves = gather or not (scale[k] == 1).all()
        select = _Select(index[k], scale[k], gather=gather, channels=source.width, matmul=feature_map)
        selects.append(select if moves else None)
    return selects


def _blocks(kernel: np.ndarray, rows: Sequence[np.ndarray], cols: Sequence[np.ndarray]) -> np.ndarray:
    """Member blocks of a (*kernel_size, C_in, C_out) kernel: (L, *kernel_size, P_in, P_out), zero at padding."""
    r, c, valid = block_indices(rows, cols)  # (L, P_out, P_in)
    picked = np.where(valid, kernel[..., c, r], np.zeros((), kernel.dtype))  # (*kernel_size, L, P_out, P_in)
    spatial = kernel.ndim - 2
    return np.transpose(picked, (spatial, *range(spatial), spatial + 2, spatial + 1))


def _per_channel(vector: np.ndarray, layout: np.ndarray, padding: float) -> np.ndarray:
    """A per-channel vector laid out like ``layout``, ``padding`` at padded positions."""
    index, valid = channel_indices([layout])
    result: np.ndarray = np.where(valid, vector[index], np.asarray(padding, vector.dtype))
    return result


def _shrink_mixing(layer: nnx.Linear | nnx.Conv, rows: Sequence[np.ndarray], cols: Sequence[np.ndarray]) -> Any:
    """A copy of a Linear/Conv cut to output channels ``rows[k]`` and input channels ``cols[k]`` (-1: zero padding).

    One layout pair gives a plain shrunk layer; several give kernels stacked on a leading member axis (``jax.vmap``).
    """
    kernel = _blocks(np.asarray(layer.kernel[...]), rows, cols)
    shrunk = nnx.clone(layer)
    shrunk.kernel = nnx.Param(jnp.asarray(kernel if len(rows) > 1 else kernel[0]))
    if layer.bias is not None:
        bias = np.stack([_per_channel(np.asarray(layer.bias[...]), row, 0.0) for row in rows])
        shrunk.bias = nnx.Param(jnp.asarray(bias if len(rows) > 1 else bias[0]))
    shrunk.in_features, shrunk.out_features = kernel.shape[-2:]
    if isinstance(shrunk, nnx.Conv):
        shrunk.kernel_shape = kernel.shape[1:]
    return shrunk


class _Affine(nnx.Module):
    """BatchNorm with running statistics as its per-channel map ``x * scale + shift`` on the last axis."""

    def __init__(self, scale: np.ndarray, shift: np.ndarray, dtype: Any) -> None:
        self.scale, self.shift, self.dtype = jnp.asarray(scale), jnp.asarray(shift), dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or jnp.result_type(x.dtype, self.scale.dtype)  # as BatchNorm promotes
        y: jax.Array = x.astype(dtype) * self.scale.astype(dtype) + self.shift.astype(dtype)
        return y


def _shrink_norm(layer: nnx.BatchNorm, layout: np.ndarray) -> _Affine:
    """A BatchNorm in eval mode as its affine map, laid out like ``layout`` (computed once, in float64)."""
    mean, var = np.asarray(layer.mean[...]), np.asarray(layer.var[...])
    weight = None if layer.scale is None else np.asarray(layer.scale[...])
    bias = None if layer.bias is None else np.asarray(layer.bias[...])
    scale, shift = norm_affine(mean, var, weight, bias, layer.epsilon)
    dtype = np.result_type(mean.dtype, var.dtype)
    return _Affine(
        _per_channel(scale, layout, 1.0).astype(dtype), _per_channel(shift, layout, 0.0).astype(dtype), layer.dtype
    )


class _Copy(nnx.Module):
    """One copy of a node (shared, or one member's): the selects of its inputs and its compacted operation."""

    def __init__(self, selects: Sequence[_Select | None], operation: Any) -> None:
        self.selects = nnx.List(selects)
        self.operation = operation


class _Step(nnx.Module):
    """One node, as one copy (shared, or an extracted member) or one per member; ``how``: apply, add, flatten, identity.

    Values are tuples of arrays, one per copy; a one-copy input feeds every copy.
    """

    def __init__(self, name: str, inputs: tuple[str, ...], how: str, copies: Sequence[_Copy]) -> None:
        self.name, self.inputs, self.how = name, inputs, how
        self.copies = nnx.List(copies)

    def __call__(self, *sources: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        outputs = []
        for k, copy in enumerate(self.copies):
            args = [source[k] if len(source) > 1 else source[0] for source in sources]
            args = [x if select is None else select(x) for x, select in zip(args, copy.selects, strict=True)]
            if self.how == "add":
                outputs.append(args[0] + args[1])
            elif self.how == "flatten":
                outputs.append(args[0].reshape((args[0].shape[0], -1)))
            else:
                outputs.append(args[0] if self.how == "identity" else copy.operation(args[0]))
        return tuple(outputs)


class _BatchedLinear(nnx.Module):
    """A Linear node for every member at once: one batched matmul over the members' stacked compacted kernels."""

    def __init__(self, name: str, inputs: tuple[str, ...], layer: nnx.Linear) -> None:
        self.name, self.inputs, self.layer = name, inputs, layer

    def __call__(self, source: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        graphdef, state = nnx.split(self.layer)
        outputs = jax.vmap(lambda member, x: nnx.merge(graphdef, member)(x))(state, jnp.stack(source))
        return tuple(outputs)


class PackedMasksembles(nnx.Module):
    """Members of a Masksembles model on compacted weights, made by ``pack`` or ``extract_member``.

    ``__call__``: (B, ...) -> (m, B, ...) for the m members it was built for, or (B, ...) for an extracted member.
    Inference only (eval semantics). Jit it like any NNX module (``nnx.jit``, or ``nnx.split`` + ``jax.jit``).
    """

    def __init__(
        self,
        model: Any,
        example_input: jax.Array | jax.ShapeDtypeStruct,
        members: Sequence[int] | None,
        *,
        squeeze: bool,
    ) -> None:
        nodes, output = _trace(model, example_input)
        masks = {node.name: node.masks for node in nodes if node.masks is not None}
        n = next(iter(masks.values())).shape[0]
        chosen = list(range(n)) if members is None else list(members)
        for k in chosen:
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
                raise ValueError(f"member must be an integer in [0, {n}); received {k!r}")
        placements = plan_members([node.graph_node() for node in nodes], output, chosen)
        steps: list[_Step | _BatchedLinear] = []
        for node in nodes[1:]:
            target = placements[node.name]
            copies = 1 if squeeze or target.shared else len(chosen)
            if node.kind in MIXING:
                rows, cols = target.layouts, placements[node.inputs[0]].member_layouts(len(target.layouts))
                if node.kind == "linear" and copies > 1:
                    steps.append(_BatchedLinear(node.name, node.inputs, _shrink_mixing(node.layer, rows, cols)))
                else:
                    operations = [_shrink_mixing(node.layer, [rows[k]], [cols[k]]) for k in range(copies)]
                    steps.append(_Step(node.name, node.inputs, "apply", [_Copy([None], op) for op in operations]))
                continue
            if node.kind == "flatten":
                steps.append(_Step(node.name, node.inputs, "flatten", [_Copy([None], None) for _ in range(copies)]))
                continue
            scales = [masks[node.name][k].astype(np.float64) for k in chosen] if node.kind == "masks" else None
            feature_map = len(node.output.shape) > 2
            selects = [
                _selects(placements[name], target, copies, scales, feature_map=feature_map) for name in node.inputs
            ]
            how = {"add": "add", "function": "apply", "norm": "apply"}.get(node.kind, "identity")
            operations = [
                _shrink_norm(node.layer, target.layouts[k]) if node.kind == "norm" else node.layer
                for k in range(copies)
            ]
            step_copies = [_Copy([per_input[k] for per_input in selects], operations[k]) for k in range(copies)]
            steps.append(_Step(node.name, node.inputs, how, step_copies))
        self.steps = nnx.List(steps)
        self.input_name, self.output_name = nodes[0].name, output
        self.squeeze = squeeze

    def __call__(self, x: jax.Array) -> jax.Array:
        """(B, ...) -> (m, B, ...) every member's output, or (B, ...) for an extracted member."""
        values: dict[str, tuple[jax.Array, ...]] = {self.input_name: (x,)}
        for step in self.steps:
            values[step.name] = step(*(values[name] for name in step.inputs))
        outputs = values[self.output_name]
        return outputs[0] if self.squeeze else jnp.stack(outputs)


def pack(model: Any, example_input: jax.Array | jax.ShapeDtypeStruct) -> PackedMasksembles:
    """All members of ``model`` in one call on compacted weights: (B, ...) -> (n, B, ...).

    Equals ``masksembles_flax.predict(model, x, n)`` with eval semantics (BatchNorm running statistics, Dropout off)
    for finite activations, at about the cost the masks' overlap allows instead of n dense forward passes.
    ``example_input`` (an array or a ``jax.ShapeDtypeStruct``, any batch size) gives the shapes; the model is not
    run and not modified. The supported layers are listed in this module's docstring; anything else raises a
    ValueError that names the layer.
    """
    return PackedMasksembles(model, example_input, None, squeeze=False)


def extract_member(model: Any, k: int, example_input: jax.Array | jax.ShapeDtypeStruct) -> PackedMasksembles:
    """Member ``k`` of ``model`` as a standalone dense model: (B, ...) -> (B, ...).

    Every layer next to a Masksembles layer is physically shrunk to member ``k``'s live channels; the output equals
    member ``k``'s output of the masked model (eval semantics, finite values). Same support and errors as ``pack``.
    """
    return PackedMasksembles(model, example_input, [k], squeeze=True)
