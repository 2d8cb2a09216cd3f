"""Packed inference: every member at about the cost of one model, from the structure of the masks.

Member ``k`` of a Masksembles model only ever uses its live channels, so the layers next to a
Masksembles layer can be shrunk physically. ``extract_member`` builds member ``k`` as a
standalone dense model; ``pack`` runs all members in one call, with grouped convolutions and
batched matmuls over every member's compacted weights instead of full-width layers on a tiled
batch. Both have eval semantics (BatchNorm running statistics, Dropout off, grouped masks).

This module traces the model with torch.fx and maps it to ``masksembles_core`` graph nodes; the
core decides, per member, which channels every node computes (the liveness rules are in
``masksembles_core.packing``). Channels that Masksembles zeroes are left out instead of
multiplied by 0, so results equal the dense model's for finite activations (a masked inf or NaN
gives NaN in the dense model and is absent here).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from masksembles_core.packing import GraphNode, block_indices, channel_indices, gather_plan, plan_members

from ._layers import Masksembles

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
POOL_TYPES = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)  # fmt: skip
# elementwise modules and functions -> whether they map 0 to 0
ACTIVATION_MODULES: dict[type[nn.Module], bool] = {
    nn.ReLU: True, nn.ReLU6: True, nn.LeakyReLU: True, nn.GELU: True, nn.SiLU: True, nn.Tanh: True,
    nn.ELU: True, nn.Hardswish: True, nn.Hardtanh: True, nn.Mish: True, nn.Identity: True,
    nn.Dropout: True, nn.Dropout1d: True, nn.Dropout2d: True, nn.Dropout3d: True,
    nn.Sigmoid: False, nn.Softplus: False, nn.Hardsigmoid: False,
}  # fmt: skip
ACTIVATION_FUNCTIONS: dict[Any, bool] = {
    F.relu: True, torch.relu: True, F.gelu: True, F.silu: True, torch.tanh: True, F.leaky_relu: True,
    F.dropout: True, torch.sigmoid: False, F.sigmoid: False,
}  # fmt: skip
ACTIVATION_METHODS: dict[str, tuple[Callable[..., Tensor], bool]] = {
    "relu": (torch.relu, True),
    "tanh": (torch.tanh, True),
    "sigmoid": (torch.sigmoid, False),
}
ADD_FUNCTIONS = (operator.add, torch.add, operator.iadd)
MIXING = ("linear", "conv")
CHANNELS_FIRST = ("conv", "norm", "pool", "flatten")


class _Tracer(fx.Tracer):
    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, Masksembles) or super().is_leaf_module(module, qualified_name)


class _Function(nn.Module):
    """An elementwise function from the traced graph, with its extra arguments."""

    def __init__(self, fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x, *self.args, **self.kwargs)


@dataclass
class _Node:
    """A node of the traced graph: what it computes, its layout, and its liveness per member."""

    name: str
    kind: str  # input, linear, conv, norm, pool, act, masks, add, flatten
    inputs: list[str]
    module: nn.Module | None
    shape: tuple[int, ...]
    zero_preserving: bool = True
    axis: int = -1
    spatial: int = 1  # flatten: positions per input channel
    masks: np.ndarray | None = None  # masks: (n, C) bool

    @property
    def channels(self) -> int:
        return self.shape[self.axis]

    @property
    def rank(self) -> int:
        return len(self.shape)

    def graph_node(self) -> GraphNode:
        kind = {
            "linear": "mixing",
            "conv": "mixing",
            "norm": "channelwise",
            "pool": "channelwise",
            "act": "channelwise",
        }
        return GraphNode(
            self.name, kind.get(self.kind, self.kind), tuple(self.inputs), self.channels, self.zero_preserving,
            self.spatial, self.masks,
        )  # fmt: skip


def _where(node: fx.Node, model: nn.Module) -> str:
    if node.op == "call_module":
        return f"module {node.target!r} ({type(model.get_submodule(str(node.target))).__name__})"
    return f"{node.op} {getattr(node.target, '__name__', node.target)!r} (node {node.name!r})"


def _classify(node: fx.Node, model: nn.Module) -> tuple[str, nn.Module | None, bool]:
    """(kind, module to run, maps 0 to 0) for a graph node; raises for anything unsupported."""
    unsupported = ValueError(f"pack/extract_member: unsupported {_where(node, model)}")
    data = [a for a in node.args if isinstance(a, fx.Node)]
    if node.op == "call_module":
        sub = model.get_submodule(str(node.target))
        if isinstance(sub, nn.Linear):
            return "linear", sub, False
        if isinstance(sub, CONV_TYPES):
            if sub.groups != 1:
                raise ValueError(
                    f"pack/extract_member: {_where(node, model)} has groups={sub.groups}; only 1 is supported"
                )
            return "conv", sub, False
        if isinstance(sub, NORM_TYPES):
            if sub.running_mean is None or sub.running_var is None:
                raise ValueError(f"pack/extract_member: {_where(node, model)} needs running statistics")
            return "norm", sub, False
        if isinstance(sub, POOL_TYPES):
            return "pool", sub, True
        if type(sub) in ACTIVATION_MODULES:
            return "act", sub, ACTIVATION_MODULES[type(sub)]
        if isinstance(sub, Masksembles):
            return "masks", sub, True
        if isinstance(sub, nn.Flatten):
            if sub.start_dim != 1 or sub.end_dim != -1:
                raise ValueError(f"pack/extract_member: {_where(node, model)} must flatten from dim 1 to -1")
            return "flatten", None, True
        raise unsupported
    if (
        node.op == "call_function"
        and node.target in ACTIVATION_FUNCTIONS
        and len(data) == 1
        and node.args[0] is data[0]
    ):
        fn = node.target
        if fn is F.dropout:
            return "act", None, True  # dropout has eval semantics here: the identity
        return "act", _Function(fn, tuple(node.args[1:]), dict(node.kwargs)), ACTIVATION_FUNCTIONS[fn]
    if node.op == "call_method" and node.target in ACTIVATION_METHODS and len(node.args) == 1:
        fn, zero = ACTIVATION_METHODS[str(node.target)]
        return "act", _Function(fn, (), {}), zero
    if node.op == "call_function" and node.target in ADD_FUNCTIONS and len(data) == 2 and len(node.args) == 2:
        if node.kwargs:
            raise unsupported
        return "add", None, True
    flatten_call = (node.op == "call_function" and node.target is torch.flatten) or (
        node.op == "call_method" and node.target == "flatten"
    )
    if flatten_call:
        if tuple(node.args[1:]) not in ((1,), (1, -1)) or node.kwargs:
            raise ValueError(f"pack/extract_member: {_where(node, model)} must flatten from dim 1 to -1")
        return "flatten", None, True
    raise unsupported


def _trace(model: nn.Module, example_input: Tensor) -> tuple[list[_Node], str]:
    """Trace ``model`` on ``example_input`` and classify every node; return (nodes, output name)."""
    graph = _Tracer().trace(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ShapeProp(fx.GraphModule(model, graph)).propagate(example_input)
    finally:
        model.train(was_training)
    nodes: dict[str, _Node] = {}
    output = ""
    for node in graph.nodes:
        if node.op == "output":
            if not isinstance(node.args[0], fx.Node):
                raise ValueError("pack/extract_member support models that return one tensor")
            output = node.args[0].name
            continue
        meta = node.meta.get("tensor_meta")
        if not hasattr(meta, "shape"):
            raise ValueError(f"pack/extract_member: unsupported {_where(node, model)}: it does not give a tensor")
        if node.op == "placeholder":
            if nodes:
                raise ValueError("pack/extract_member support models with a single tensor input")
            kind, sub, zero = "input", None, False
        else:
            kind, sub, zero = _classify(node, model)
        inputs = [a.name for a in node.args if isinstance(a, fx.Node)]
        entry = _Node(node.name, kind, inputs, sub, tuple(meta.shape), zero)
        if kind == "masks":
            entry.masks = sub.masks.detach().cpu().numpy() != 0  # type: ignore[union-attr]
        nodes[node.name] = entry
    result = list(nodes.values())
    _assign_axes(result, model)
    for entry in result:
        if entry.kind == "flatten":
            source = nodes[entry.inputs[0]]
            entry.spatial = int(np.prod(source.shape[2:], dtype=np.int64)) if source.rank > 2 else 1
    masks = [node for node in result if node.kind == "masks"]
    if not masks:
        raise ValueError("pack/extract_member: the model has no Masksembles layer")
    counts = sorted({node.masks.shape[0] for node in masks})  # type: ignore[union-attr]
    if len(counts) != 1:
        raise ValueError(f"pack/extract_member: every Masksembles layer needs the same n; found {counts}")
    return result, output


def _assign_axes(nodes: list[_Node], model: nn.Module) -> None:
    """Channel axis of every node; Linear acts on the last axis, Conv/BatchNorm/pooling on axis 1."""
    by_name = {node.name: node for node in nodes}

    def required(node: _Node, rank: int) -> int | None:
        if node.kind == "linear":
            return rank - 1
        if node.kind in CHANNELS_FIRST:
            return 1
        if node.kind == "masks":
            return node.module.channel_axis % rank  # type: ignore[union-attr]
        return None

    for node in nodes:  # outputs with a definite axis
        if node.kind in ("linear", "masks"):
            node.axis = required(node, node.rank)  # type: ignore[assignment]
        elif node.kind in CHANNELS_FIRST:
            node.axis = 1
    changed = True
    while changed:  # propagate through activations and additions, and from consumers to inputs
        changed = False
        for node in nodes:
            for name in node.inputs:
                source = by_name[name]
                want = required(node, source.rank) if node.kind not in ("act", "add") else node.axis
                if want is None or want < 0:
                    continue
                if source.axis < 0:
                    source.axis, changed = want, True
                elif source.axis != want:
                    raise ValueError(
                        f"pack/extract_member: {node.kind} node {node.name!r} reads axis {want} of {name!r} as "
                        f"channels, but {name!r} has its channels on axis {source.axis}"
                    )
            if node.kind in ("act", "add") and node.axis < 0:
                known = [by_name[name].axis for name in node.inputs if by_name[name].axis >= 0]
                if known:
                    node.axis, changed = known[0], True
    for node in nodes:
        if node.axis < 0:
            raise ValueError(f"pack/extract_member: cannot tell the channel axis of node {node.name!r}")


class _Select(nn.Module):
    """Gather positions along ``axis`` with one global index (member blocks included), then scale."""

    index: Tensor
    scale: Tensor

    def __init__(self, index: np.ndarray, scale: np.ndarray, axis: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.axis = axis
        self.gather = not np.array_equal(index, np.arange(len(index)))
        self.multiply = not bool((scale == 1).all())
        shape = [1] * rank
        shape[axis] = len(scale)
        self.register_buffer("index", torch.as_tensor(index, dtype=torch.long))
        self.register_buffer("scale", torch.as_tensor(scale, dtype=dtype).view(shape))

    def forward(self, x: Tensor) -> Tensor:
        if self.gather:
            x = x.index_select(self.axis, self.index)
        return x * self.scale if self.multiply else x


class _GroupedLinear(nn.Module):
    """One Linear per member on the member blocks of the last axis: (..., m*I) -> (..., m*O)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        members, outputs, _ = weight.shape
        self.weight = nn.Parameter(weight.transpose(1, 2).contiguous())  # (m, I, O)
        self.bias = nn.Parameter(bias.view(members, 1, outputs)) if bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        members, inputs, _ = self.weight.shape
        rows = x.reshape(-1, members, inputs).transpose(0, 1)  # (m, B, I)
        y = torch.bmm(rows, self.weight) if self.bias is None else torch.baddbmm(self.bias, rows, self.weight)
        return y.transpose(0, 1).reshape(*x.shape[:-1], -1)


def _blocks(weight: Tensor, rows: Sequence[np.ndarray], cols: Sequence[np.ndarray]) -> Tensor:
    """Member blocks ``weight[rows[k]][:, cols[k]]``, zero at padding: (m, P_out, P_in, *kernel)."""
    r, c, valid = block_indices(rows, cols)
    picked = weight[torch.as_tensor(r), torch.as_tensor(c)]
    keep = torch.as_tensor(valid, device=weight.device).view(*valid.shape, *([1] * (weight.dim() - 2)))
    return torch.where(keep, picked, torch.zeros((), dtype=weight.dtype, device=weight.device))


def _per_channel(vector: Tensor, layouts: Sequence[np.ndarray], padding: float) -> Tensor:
    """A per-channel vector laid out like ``layouts`` (member blocks side by side)."""
    index, valid = channel_indices(layouts)
    picked = vector[torch.as_tensor(index, device=vector.device)]
    return torch.where(torch.as_tensor(valid, device=vector.device), picked, torch.full_like(picked, padding))


class PackedMasksembles(nn.Module):
    """Members of a Masksembles model on compacted weights, made by ``pack`` or ``extract_member``.

    ``forward``: (B, ...) -> (m, B, ...) for the m members it was built for, or (B, ...) for an
    extracted member. Inference only (eval semantics).
    """

    def __init__(self, model: nn.Module, example_input: Tensor, members: Sequence[int], *, squeeze: bool) -> None:
        super().__init__()
        nodes, output = _trace(model, example_input)
        n = next(node.masks.shape[0] for node in nodes if node.masks is not None)
        for k in members:
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
                raise ValueError(f"member must be an integer in [0, {n}); received {k!r}")
        self.placements = plan_members([node.graph_node() for node in nodes], output, members)
        self.member_masks = {node.name: [node.masks[k] for k in members] for node in nodes if node.masks is not None}
        self.members = len(members)
        self.squeeze = squeeze
        self.dtype = next(node.module.masks.dtype for node in nodes if node.kind == "masks")  # type: ignore[union-attr]
        self.input_name = nodes[0].name
        self.ops = nn.ModuleDict()
        self.steps: list[tuple[str, str, tuple[str, ...]]] = []  # (node, how, inputs)
        for node in nodes[1:]:
            self.steps.append(self._compile(node))
        final = next(node for node in nodes if node.name == output)
        self.output_name, self.output_axis = output, final.axis
        self.output_shared = self.placements[output].shared

    def _select(self, source: str, target: _Node, scales: Sequence[np.ndarray] | None = None) -> _Select | None:
        plan = gather_plan(self.placements[source], self.placements[target.name], scales)
        return None if plan is None else _Select(*plan, target.axis, target.rank, self.dtype)

    def _compile(self, node: _Node) -> tuple[str, str, tuple[str, ...]]:
        names = tuple(node.inputs)
        if node.kind in MIXING:
            self.ops[node.name] = self._mixing(node)
            return node.name, "module", names
        if node.kind == "flatten":
            return node.name, "flatten", names
        if node.kind == "masks":
            select = self._select(names[0], node, [m.astype(np.float64) for m in self.member_masks[node.name]])
            if select is None:
                return node.name, "identity", names
            self.ops[node.name] = select
            return node.name, "module", names
        for i, name in enumerate(names):
            select = self._select(name, node)
            if select is not None:
                self.ops[f"{node.name}__in{i}"] = select
        if node.kind == "add":
            return node.name, "add", names
        if node.kind == "norm":
            self.ops[node.name] = self._norm(node)
        elif node.module is not None:
            self.ops[node.name] = node.module
        else:
            return node.name, "identity", names
        return node.name, "module", names

    def _mixing(self, node: _Node) -> nn.Module:
        module = node.module
        weight = module.weight.detach()  # type: ignore[union-attr]
        bias = None if module.bias is None else module.bias.detach()  # type: ignore[union-attr]
        target, source = self.placements[node.name], self.placements[node.inputs[0]]
        grouped = not target.shared and not source.shared and self.members > 1
        blocks = _blocks(
            weight, target.layouts, source.member_layouts(len(target.layouts))
        )  # (m or 1, P_out, P_in, ...)
        new_bias = None if bias is None else _per_channel(bias, target.layouts, 0.0)
        if isinstance(module, nn.Linear):
            if grouped:
                return _GroupedLinear(blocks, new_bias)
            flat = blocks.flatten(0, 1)  # members stacked on the outputs of one Linear
            linear = nn.Linear(
                flat.shape[1], flat.shape[0], bias=new_bias is not None, device=flat.device, dtype=flat.dtype
            )
            return self._load(linear, flat, new_bias)
        conv_weight = blocks.flatten(0, 1)
        groups = self.members if grouped else 1
        conv = type(module)(
            conv_weight.shape[1] * groups, conv_weight.shape[0], module.kernel_size, stride=module.stride,
            padding=module.padding, dilation=module.dilation, groups=groups, bias=new_bias is not None,
            padding_mode=module.padding_mode, device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        return self._load(conv, conv_weight, new_bias)

    @staticmethod
    def _load(module: nn.Module, weight: Tensor, bias: Tensor | None) -> nn.Module:
        with torch.no_grad():
            module.weight.copy_(weight)
            if bias is not None:
                module.bias.copy_(bias)
        return module

    def _norm(self, node: _Node) -> nn.Module:
        module = node.module
        layouts = self.placements[node.name].layouts
        mean, var = module.running_mean, module.running_var  # type: ignore[union-attr]
        weight = module.weight if module.affine else torch.ones_like(mean)  # type: ignore[union-attr]
        bias = module.bias if module.affine else torch.zeros_like(mean)  # type: ignore[union-attr]
        norm = type(module)(
            sum(len(layout) for layout in layouts), eps=module.eps, device=mean.device, dtype=mean.dtype
        )  # type: ignore[union-attr, arg-type]
        with torch.no_grad():
            norm.running_mean.copy_(_per_channel(mean, layouts, 0.0))
            norm.running_var.copy_(_per_channel(var, layouts, 1.0))
            norm.weight.copy_(_per_channel(weight.detach(), layouts, 1.0))
            norm.bias.copy_(_per_channel(bias.detach(), layouts, 0.0))
        return norm.eval()

    def forward(self, x: Tensor) -> Tensor:
        values = {self.input_name: x}
        for name, how, inputs in self.steps:
            args = [values[source] for source in inputs]
            for i in range(len(args)):
                select = f"{name}__in{i}"
                if select in self.ops:
                    args[i] = self.ops[select](args[i])
            if how == "module":
                values[name] = self.ops[name](args[0])
            elif how == "add":
                values[name] = args[0] + args[1]
            elif how == "flatten":
                values[name] = args[0].flatten(1)
            else:
                values[name] = args[0]
        y = values[self.output_name]
        if self.output_shared:
            return y if self.squeeze else y.unsqueeze(0).expand(self.members, *y.shape)
        y = y.unflatten(self.output_axis, (self.members, y.shape[self.output_axis] // self.members))
        y = y.movedim(self.output_axis, 0)
        return y[0] if self.squeeze else y


def pack(model: nn.Module, example_input: Tensor) -> PackedMasksembles:
    """All members of ``model`` in one call on compacted weights: (B, ...) -> (n, B, ...).

    Equals ``predict(model, x, n)`` (eval semantics) for finite activations, at about the cost
    the masks' overlap allows instead of n dense forward passes. ``example_input`` (any batch
    size) is run once through ``model`` to record shapes. Supported: Linear, Conv1d/2d/3d
    (groups=1), BatchNorm (running statistics), elementwise activations, pooling, Flatten,
    Dropout (off) and Masksembles layers with the same n, connected in a Sequential or any
    graph torch.fx can trace, residual additions included. Anything else raises a ValueError
    that names the module or operation.
    """
    n = next(m.n for m in model.modules() if isinstance(m, Masksembles)) if _has_masks(model) else 0
    return PackedMasksembles(model, example_input, range(n), squeeze=False)


def extract_member(model: nn.Module, k: int, example_input: Tensor) -> PackedMasksembles:
    """Member ``k`` of ``model`` as a standalone dense model: (B, ...) -> (B, ...).

    Every layer next to a Masksembles layer is physically shrunk to member ``k``'s live channels;
    the output equals group ``k``'s output of the masked model (eval semantics, finite values).
    Same support and errors as ``pack``.
    """
    if not _has_masks(model):
        raise ValueError("pack/extract_member: the model has no Masksembles layer")
    return PackedMasksembles(model, example_input, [k], squeeze=True)


def _has_masks(model: nn.Module) -> bool:
    return any(isinstance(m, Masksembles) for m in model.modules())
