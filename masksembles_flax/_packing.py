"""Packed inference for Flax NNX: every member at about the cost of one model, from the structure of the masks.

Member ``k`` of a Masksembles model only ever uses its live channels, so the layers next to a Masksembles layer can
be shrunk physically. ``extract_member`` builds member ``k`` as a standalone dense model of shrunk NNX layers;
``pack`` runs all members in one call: the shared prefix before the first Masksembles layer runs once on the batch,
then every member holds its compacted weights stacked on a leading member axis (padded to the widest member) and
``jax.vmap`` runs the members together (a batched matmul for Linear, a grouped convolution for Conv). Both have eval
semantics: BatchNorm uses its running statistics, Dropout is off, Masksembles is grouped.

Supported models: ``nnx.Sequential`` (nested ones included) of ``nnx.Linear``, ``nnx.Conv`` (feature_group_count=1,
no kernel mask), ``nnx.BatchNorm`` on the last axis, ``nnx.Dropout``, elementwise activation functions (``nnx.relu``,
``jax.nn.gelu``, ``jnp.tanh``, ... or a ``functools.partial`` of one with keyword arguments), pooling given as a
``functools.partial`` of ``nnx.max_pool``/``avg_pool``/``min_pool``, ``Flatten``, ``Residual`` and Masksembles
layers on the last axis with the same n. Anything else raises a ValueError that names the layer by its path in the
model (``model.layers[2]``). Which channels each member computes is decided across the graph, residual additions
included, by ``masksembles_core.packing`` (its module docstring states the rules). Channels that Masksembles zeroes
are left out instead of multiplied by 0, so results equal the dense model's for finite activations.
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

import masksembles_core as mc
from masksembles_core.packing import (
    GraphNode,
    Placement,
    block_indices,
    channel_indices,
    gather_plan,
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
        return x.reshape((x.shape[0], -1))


class Residual(nnx.Module):
    """A residual block ``y = x + f(x)`` with ``f = nnx.Sequential(*layers)``; f must keep the shape of x."""

    def __init__(self, *layers: Callable[..., Any]) -> None:
        self.branch = nnx.Sequential(*layers)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.branch(x)


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
        mc.check_input_shape(shape, channels=layer.channels, channel_axis=layer.channel_axis)
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
    example = jax.ShapeDtypeStruct(tuple(example_input.shape), example_input.dtype)
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
    """Move the channels (last axis) of a node into its consumer's layout (``gather``), then scale them (``multiply``).

    ``index`` and ``scale``: (P,) for an unstacked target; (m, P) for a stacked one, whose output has the member axis
    in front, (m, B, ..., P), with ``index[k]`` addressing member k's source block (or the shared source).
    """

    def __init__(
        self, index: np.ndarray, scale: np.ndarray, *, source_stacked: bool, target_stacked: bool, gather: bool
    ) -> None:
        self.source_stacked, self.target_stacked, self.gather = source_stacked, target_stacked, gather
        self.multiply = not bool((scale == 1).all())
        self.index = jnp.asarray(index, dtype=jnp.int32)
        self.scale = jnp.asarray(scale, dtype=jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gather and self.target_stacked and not self.source_stacked:
            x = jnp.moveaxis(jnp.take(x, self.index, axis=-1), -2, 0)
        elif self.gather and self.target_stacked:
            x = jax.vmap(lambda member, index: jnp.take(member, index, axis=-1))(x, self.index)
        elif self.gather:
            x = jnp.take(x, self.index, axis=-1)
        if not self.multiply:
            return x
        scale = self.scale.astype(x.dtype)
        if self.target_stacked:
            scale = scale.reshape((scale.shape[0], *([1] * (x.ndim - 2)), scale.shape[1]))
        return x * scale


def _select(
    source: Placement,
    target: Placement,
    members: int,
    scales: Sequence[np.ndarray] | None,
    *,
    source_stacked: bool,
    target_stacked: bool,
) -> _Select | None:
    """The module that moves ``source``'s channels into ``target``'s layout, or None if nothing moves."""
    plan = gather_plan(source, target, members, scales)
    if plan is None:
        return None
    index, scale = plan
    width = target.width
    if target_stacked:
        index, scale = index.reshape(members, width), scale.reshape(members, width)
        if source_stacked:  # gather_plan addresses the members' blocks side by side
            index = index - (np.arange(members) * source.width)[:, None]
    else:  # a shared target repeats its one layout for every member; an extracted member is one block
        index, scale = index[:width], scale[:width]
    gather = source_stacked != target_stacked or source.width != width or not (index == np.arange(width)).all()
    if not gather and (scale == 1).all():
        return None
    return _Select(index, scale, source_stacked=source_stacked, target_stacked=target_stacked, gather=gather)


def _blocks(kernel: np.ndarray, rows: Sequence[np.ndarray], cols: Sequence[np.ndarray]) -> np.ndarray:
    """Member blocks of a (*kernel_size, C_in, C_out) kernel: (L, *kernel_size, P_in, P_out), zero at padding."""
    r, c, valid = block_indices(rows, cols)  # (L, P_out, P_in)
    picked = np.where(valid, kernel[..., c, r], np.zeros((), kernel.dtype))  # (*kernel_size, L, P_out, P_in)
    spatial = kernel.ndim - 2
    return np.transpose(picked, (spatial, *range(spatial), spatial + 2, spatial + 1))


def _per_channel(vector: np.ndarray, layouts: Sequence[np.ndarray], padding: float) -> np.ndarray:
    """A per-channel vector laid out like ``layouts``: (L, P), ``padding`` at padded positions."""
    index, valid = channel_indices(layouts)
    picked = np.where(valid, vector[index], np.asarray(padding, vector.dtype))
    return picked.reshape(len(layouts), -1)


def _shrink_mixing(layer: nnx.Linear | nnx.Conv, rows: Sequence[np.ndarray], cols: Sequence[np.ndarray]) -> nnx.Module:
    """A copy of a Linear/Conv holding the member blocks ``rows`` x ``cols``, stacked on a leading axis if several."""
    stacked = len(rows) > 1
    kernel = _blocks(np.asarray(layer.kernel[...]), rows, cols)
    shrunk = nnx.clone(layer)
    shrunk.kernel = nnx.Param(jnp.asarray(kernel if stacked else kernel[0]))
    if layer.bias is not None:
        bias = _per_channel(np.asarray(layer.bias[...]), rows, 0.0)
        shrunk.bias = nnx.Param(jnp.asarray(bias if stacked else bias[0]))
    shrunk.in_features, shrunk.out_features = kernel.shape[-2:]
    if isinstance(shrunk, nnx.Conv):
        shrunk.kernel_shape = kernel.shape[1:]
    return shrunk


def _shrink_norm(layer: nnx.BatchNorm, layouts: Sequence[np.ndarray]) -> nnx.BatchNorm:
    """A copy of a BatchNorm with running statistics laid out like ``layouts`` (stacked if several)."""
    stacked = len(layouts) > 1

    def lay_out(vector: jax.Array, padding: float) -> jax.Array:
        result = _per_channel(np.asarray(vector), layouts, padding)
        return jnp.asarray(result if stacked else result[0])

    shrunk = nnx.clone(layer)
    shrunk.mean = nnx.BatchStat(lay_out(layer.mean[...], 0.0))
    shrunk.var = nnx.BatchStat(lay_out(layer.var[...], 1.0))
    if layer.scale is not None:
        shrunk.scale = nnx.Param(lay_out(layer.scale[...], 1.0))
    if layer.bias is not None:
        shrunk.bias = nnx.Param(lay_out(layer.bias[...], 0.0))
    shrunk.num_features = len(layouts[0])
    shrunk.use_running_average = True
    return shrunk


class _Step(nnx.Module):
    """One node: bring its inputs into its layout, then compute it; ``stacked`` outputs have the member axis first.

    ``how``: "layer" (a compacted Linear, Conv or BatchNorm, vmapped over stacked weights), "function", "add",
    "flatten" or "identity".
    """

    def __init__(
        self,
        name: str,
        inputs: tuple[str, ...],
        selects: Sequence[_Select | None],
        how: str,
        operation: Any,
        *,
        stacked: bool,
    ) -> None:
        self.name, self.inputs, self.how, self.stacked = name, inputs, how, stacked
        self.selects = nnx.List(selects)
        self.operation = operation

    def __call__(self, *values: jax.Array) -> jax.Array:
        args = [x if select is None else select(x) for x, select in zip(values, self.selects, strict=True)]
        if self.how == "add":
            return args[0] + args[1]
        x = args[0]
        if self.how == "flatten":
            return x.reshape((*x.shape[: 2 if self.stacked else 1], -1))
        if self.how == "identity":
            return x
        if self.how == "function":
            result: jax.Array = jax.vmap(self.operation)(x) if self.stacked else self.operation(x)
            return result
        if not self.stacked:
            result = self.operation(x)
            return result
        graphdef, state = nnx.split(self.operation)
        result = jax.vmap(lambda member, v: nnx.merge(graphdef, member)(v))(state, x)
        return result


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
        stacked = {name: not squeeze and not placement.shared for name, placement in placements.items()}
        steps = []
        for node in nodes[1:]:
            target = placements[node.name]
            if node.kind in MIXING:
                source = placements[node.inputs[0]]
                operation = _shrink_mixing(node.layer, target.layouts, source.member_layouts(len(target.layouts)))
                steps.append(_Step(node.name, node.inputs, [None], "layer", operation, stacked=stacked[node.name]))
                continue
            if node.kind == "flatten":
                steps.append(_Step(node.name, node.inputs, [None], "flatten", None, stacked=stacked[node.name]))
                continue
            scales = [masks[node.name][k].astype(np.float64) for k in chosen] if node.kind == "masks" else None
            selects = [
                _select(
                    placements[name],
                    target,
                    len(chosen),
                    scales,
                    source_stacked=stacked[name],
                    target_stacked=stacked[node.name],
                )
                for name in node.inputs
            ]
            how, operation = {"add": ("add", None), "function": ("function", node.layer)}.get(
                node.kind, ("identity", None)
            )
            if node.kind == "norm":
                how, operation = "layer", _shrink_norm(node.layer, target.layouts)
            steps.append(_Step(node.name, node.inputs, selects, how, operation, stacked=stacked[node.name]))
        self.steps = nnx.List(steps)
        self.input_name, self.output_name = nodes[0].name, output
        self.members, self.squeeze = len(chosen), squeeze

    def __call__(self, x: jax.Array) -> jax.Array:
        """(B, ...) -> (m, B, ...) every member's output, or (B, ...) for an extracted member."""
        values = {self.input_name: x}
        for step in self.steps:
            values[step.name] = step(*(values[name] for name in step.inputs))
        return values[self.output_name]


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
