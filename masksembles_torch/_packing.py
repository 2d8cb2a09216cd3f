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

import copy
import inspect
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from masksembles_core.packing import (
    GraphNode,
    block_indices,
    channel_indices,
    gather_plan,
    norm_affine,
    plan_members,
)

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
IN_PLACE_FUNCTIONS: dict[Any, Callable[[Tensor], Tensor]] = {
    F.relu: torch.relu_, torch.relu: torch.relu_, torch.tanh: torch.tanh_, torch.sigmoid: torch.sigmoid_,
    F.sigmoid: torch.sigmoid_,
}  # fmt: skip
DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)  # identities in eval, even in place
ADD_FUNCTIONS = (operator.add, torch.add, operator.iadd)
MIXING = ("linear", "conv")
CHANNELS_FIRST = ("conv", "norm", "pool", "flatten")
_ConvModule = nn.Conv1d | nn.Conv2d | nn.Conv3d
_MixingModule = nn.Linear | _ConvModule  # the module of a "linear" or "conv" node
_NormModule = nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d  # the module of a "norm" node
_M = TypeVar("_M", bound=_MixingModule)


class _Tracer(fx.Tracer):
    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, Masksembles) or super().is_leaf_module(module, qualified_name)


class _Function(nn.Module):
    """An elementwise function from the traced graph, with its extra arguments (``inplace`` split off)."""

    def __init__(self, fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        kwargs = dict(kwargs)
        self.inplace = bool(kwargs.pop("inplace", False))
        try:
            parameters = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):  # a builtin: no inplace argument
            parameters = []
        position = parameters.index("inplace") - 1 if "inplace" in parameters else len(args)
        if position < len(args):
            self.inplace = bool(args[position])
            args = args[:position] + args[position + 1 :]
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
    mutates: bool = False  # an in-place activation or +=: overwrites its (first) input
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
        if isinstance(sub, DROPOUT_TYPES):
            return "act", None, True  # eval semantics: the identity
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
        function = cast(Callable[..., Tensor], fn)  # a call_function target: a callable, not a name
        return "act", _Function(function, tuple(node.args[1:]), dict(node.kwargs)), ACTIVATION_FUNCTIONS[fn]
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
            ShapeProp(fx.GraphModule(model, graph)).propagate(example_input.clone())  # the model may work in place
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
        mutates = node.target is operator.iadd or (kind == "act" and bool(getattr(sub, "inplace", False)))
        entry = _Node(node.name, kind, inputs, sub, tuple(meta.shape), zero, mutates)
        if kind == "masks":
            entry.masks = (cast(Masksembles, sub).masks != 0).cpu().numpy()
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
            return cast(Masksembles, node.module).channel_axis % rank
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


def _gather(x: Tensor, axis: int, index: Tensor) -> Tensor:
    """``x.index_select(axis, index)``, along the contiguous axis when ``x`` is channels-last."""
    if axis == 1 and x.dim() > 2 and not x.is_contiguous() and x.movedim(1, -1).is_contiguous():
        rows = x.movedim(1, -1)
        flat = rows.reshape(-1, rows.shape[-1])
        picked = torch.gather(flat, 1, index.expand(flat.shape[0], -1))  # faster than index_select here
        return picked.view(*rows.shape[:-1], -1).movedim(-1, 1)
    return x.index_select(axis, index)


class _Select(nn.Module):
    """Gather positions along ``axis`` with one global index (member blocks included), then scale.

    When the index repeats one block for every member with scale 1 (a shared tensor read by every
    member), ``tile`` holds that block, so an addition can broadcast it instead of copying it.
    """

    index: Tensor
    scale: Tensor
    tile: Tensor

    def __init__(
        self, index: np.ndarray, scale: np.ndarray, axis: int, rank: int, dtype: torch.dtype, members: int, source: int
    ) -> None:
        super().__init__()
        self.axis = axis
        self.gather = len(index) != source or not np.array_equal(index, np.arange(len(index)))
        self.multiply = not bool((scale == 1).all())
        blocks = index.reshape(members, -1)
        self.repeats = members if members > 1 and not self.multiply and bool((blocks == blocks[0]).all()) else 1
        self.tile_gather = not np.array_equal(blocks[0], np.arange(blocks.shape[1]))
        shape = [1] * rank
        shape[axis] = len(scale)
        self.register_buffer("index", torch.as_tensor(index, dtype=torch.long))
        self.register_buffer("scale", torch.as_tensor(scale, dtype=dtype).view(shape))
        self.register_buffer("tile", torch.as_tensor(blocks[0], dtype=torch.long))

    @property
    def fresh(self) -> bool:
        """Whether ``forward`` returns a new tensor (else its input, unchanged)."""
        return self.gather or self.multiply

    def forward(self, x: Tensor) -> Tensor:
        if self.gather:
            x = _gather(x, self.axis, self.index)
            return x.mul_(self.scale) if self.multiply else x
        return x * self.scale if self.multiply else x

    def add_tiled(self, x: Tensor, other: Tensor, inplace: bool) -> Tensor:
        """``forward(x) + other`` without materializing the repeated blocks (``repeats > 1``)."""
        block = _gather(x, self.axis, self.tile) if self.tile_gather else x
        grouped: Tensor = other.unflatten(self.axis, (self.repeats, -1))  # type: ignore[no-untyped-call]
        if inplace:
            grouped.add_(block.unsqueeze(self.axis))
            return other
        return (grouped + block.unsqueeze(self.axis)).flatten(self.axis, self.axis + 1)


class _Elementwise(nn.Module):
    """An elementwise activation, run in place on a tensor that nothing else reads."""

    def __init__(self, out_of_place: Callable[[Tensor], Tensor], in_place: Callable[[Tensor], Tensor] | None) -> None:
        super().__init__()
        self.out_of_place, self.in_place = out_of_place, in_place

    def forward(self, x: Tensor, inplace: bool = False) -> Tensor:
        return self.in_place(x) if inplace and self.in_place is not None else self.out_of_place(x)


class _Affine(nn.Module):
    """BatchNorm with running statistics as the per-channel map ``x * scale + shift``."""

    scale: Tensor
    shift: Tensor

    def __init__(self, scale: Tensor, shift: Tensor, axis: int, rank: int) -> None:
        super().__init__()
        shape = [1] * rank
        shape[axis] = len(scale)
        self.register_buffer("scale", scale.view(shape))
        self.register_buffer("shift", shift.view(shape))

    def forward(self, x: Tensor, inplace: bool = False) -> Tensor:
        return x.mul_(self.scale).add_(self.shift) if inplace else torch.addcmul(self.shift, x, self.scale)


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
        self.dtype = next(cast(Masksembles, node.module).masks.dtype for node in nodes if node.kind == "masks")
        self.input_name = nodes[0].name
        self.ops = nn.ModuleDict()
        by_name = {node.name: node for node in nodes}
        self.steps = [self._compile(node, by_name) for node in nodes[1:]]
        self._mark_writable(output)
        final = next(node for node in nodes if node.name == output)
        self.output_name, self.output_axis = output, final.axis
        self.output_shared = self.placements[output].shared

    def _select(self, source: str, target: _Node, scales: Sequence[np.ndarray] | None = None) -> _Select | None:
        placement = self.placements[source]
        plan = gather_plan(placement, self.placements[target.name], scales)
        length = placement.width * len(placement.layouts)  # positions on the source's channel axis
        return None if plan is None else _Select(*plan, target.axis, target.rank, self.dtype, self.members, length)

    def _compile(self, node: _Node, nodes: dict[str, _Node]) -> _Step:
        names = tuple(node.inputs)
        if node.kind in MIXING:
            self.ops[node.name] = self._mixing(node)
            return _Step(node.name, "conv" if node.kind == "conv" else "op", names, _memory_format(node.rank))
        if node.kind == "flatten":
            return _Step(node.name, "flatten", names)
        if node.kind == "masks":
            select = self._select(names[0], node, [m.astype(np.float64) for m in self.member_masks[node.name]])
            if select is None or not select.fresh:
                return _Step(node.name, "identity", names)
            self.ops[node.name] = select
            return _Step(node.name, "op", names)
        selects = []
        for i, name in enumerate(names):
            select = self._select(name, node)
            if select is not None and select.fresh:
                self.ops[f"{node.name}__in{i}"] = select
            selects.append(select is not None and select.fresh)
        same_shape = all(nodes[name].shape[1:] == node.shape[1:] for name in names)
        if node.kind == "add":
            return _Step(node.name, "add", names, selects=tuple(selects), same_shape=same_shape, mutates=node.mutates)
        if node.kind == "norm":
            self.ops[node.name] = self._norm(node)
            how = "elementwise"
        elif node.kind == "act" and node.module is not None:
            self.ops[node.name] = _elementwise(copy.deepcopy(node.module))
            how = "elementwise"
        elif node.module is not None:
            self.ops[node.name] = copy.deepcopy(node.module)  # pooling: its own copy, whatever the model's mode
            how = "op"
        else:
            how = "identity"
        return _Step(node.name, how, names, selects=tuple(selects), same_shape=same_shape, mutates=node.mutates)

    def _mark_writable(self, output: str) -> None:
        """Which inputs each step may overwrite: fresh copies, and tensors it is the only one to read.

        A step of the model that itself works in place (``ReLU(inplace=True)``, ``+=``) on a tensor
        that other steps also read would change what they see; that is refused, not imitated.
        """
        root = {self.input_name: self.input_name}
        readers: dict[str, int] = {}
        for step in self.steps:
            if step.how in ("identity", "flatten"):  # the same tensor, or a view of it
                root[step.name] = root[step.inputs[0]]
                continue
            root[step.name] = step.name
            for source in step.inputs:
                readers[root[source]] = readers.get(root[source], 0) + 1
        readers[root[output]] = readers.get(root[output], 0) + 1
        for step in self.steps:
            if step.mutates and readers[root[step.inputs[0]]] > 1:
                raise ValueError(
                    f"pack/extract_member: node {step.name!r} overwrites {step.inputs[0]!r} in place while other "
                    "layers read it too; make that operation out of place"
                )
        readers[self.input_name] = 2  # never overwrite the caller's input
        self.steps = [
            step._replace(
                writable=tuple(
                    step.same_shape and (fresh or readers[root[source]] == 1)
                    for source, fresh in zip(step.inputs, step.selects or (False,) * len(step.inputs), strict=True)
                )
            )
            for step in self.steps
        ]

    def _mixing(self, node: _Node) -> nn.Module:
        module = cast(_MixingModule, node.module)
        weight = module.weight.detach()
        bias = None if module.bias is None else module.bias.detach()
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
        # the attributes are tuple[int, ...], the constructors' stubs want a tuple of the convolution's rank
        conv = cast(Callable[..., _ConvModule], type(module))(
            conv_weight.shape[1] * groups, conv_weight.shape[0], module.kernel_size, stride=module.stride,
            padding=module.padding, dilation=module.dilation, groups=groups, bias=new_bias is not None,
            padding_mode=module.padding_mode, device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        memory_format = _memory_format(node.rank)
        loaded = self._load(conv, conv_weight, new_bias)
        # Module.to takes memory_format at runtime, but its stubs leave it out
        return loaded.to(memory_format=memory_format or torch.contiguous_format)  # type: ignore[call-overload,no-any-return]

    @staticmethod
    def _load(module: _M, weight: Tensor, bias: Tensor | None) -> _M:
        with torch.no_grad():
            module.weight.copy_(weight)
            if bias is not None:
                cast(Tensor, module.bias).copy_(bias)  # built with a bias when there is one
        return module

    def _norm(self, node: _Node) -> _Affine:
        module = cast(_NormModule, node.module)
        # _classify refused BatchNorm without running statistics
        running_mean, running_var = cast(Tensor, module.running_mean), cast(Tensor, module.running_var)

        def numpy(tensor: Tensor) -> np.ndarray:
            return tensor.detach().cpu().double().numpy()

        weight, bias = (numpy(module.weight), numpy(module.bias)) if module.affine else (None, None)
        scale, shift = norm_affine(numpy(running_mean), numpy(running_var), weight, bias, module.eps)
        layouts = self.placements[node.name].layouts
        return _Affine(
            _per_channel(torch.as_tensor(scale), layouts, 1.0).to(running_mean),
            _per_channel(torch.as_tensor(shift), layouts, 0.0).to(running_mean),
            node.axis,
            node.rank,
        )

    def forward(self, x: Tensor) -> Tensor:
        values = {self.input_name: x}
        for step in self.steps:
            args = [values[source] for source in step.inputs]
            if step.how == "add":
                values[step.name] = self._add(step, args)
                continue
            if step.selects and step.selects[0]:
                args[0] = self.ops[f"{step.name}__in0"](args[0])
            if step.how == "op":
                values[step.name] = self.ops[step.name](args[0])
            elif step.how == "conv":
                if step.memory_format is not None:
                    args[0] = args[0].contiguous(memory_format=step.memory_format)
                values[step.name] = self.ops[step.name](args[0])
            elif step.how == "elementwise":
                values[step.name] = self.ops[step.name](args[0], inplace=step.writable[0])
            elif step.how == "flatten":
                values[step.name] = args[0].flatten(1)
            else:
                values[step.name] = args[0]
        y = values[self.output_name]
        if self.output_shared:
            return y if self.squeeze else y.unsqueeze(0).expand(self.members, *y.shape)
        size = (self.members, y.shape[self.output_axis] // self.members)
        y = cast(Tensor, y.unflatten(self.output_axis, size))  # type: ignore[no-untyped-call]
        y = y.movedim(self.output_axis, 0)
        return y[0] if self.squeeze else y

    def _add(self, step: _Step, args: list[Tensor]) -> Tensor:
        """A residual addition, in place where it may, broadcasting a shared tensor read by every member."""
        selects = [cast(_Select, self.ops[f"{step.name}__in{i}"]) if step.selects[i] else None for i in (0, 1)]
        for i, j in ((0, 1), (1, 0)):
            tiled, other = selects[i], selects[j]
            if tiled is not None and tiled.repeats > 1 and (other is None or other.repeats == 1):
                partner = args[j] if other is None else other(args[j])
                return tiled.add_tiled(args[i], partner, inplace=step.writable[j])
        for i, select in enumerate(selects):
            if select is not None:
                args[i] = select(args[i])
        if step.writable[0]:
            return args[0].add_(args[1])
        if step.writable[1]:
            return args[1].add_(args[0])
        return args[0] + args[1]


class _Step(NamedTuple):
    """One node of the packed forward: how it runs, what it reads, which inputs it may overwrite."""

    name: str
    how: str  # op, conv, elementwise, add, flatten, identity
    inputs: tuple[str, ...]
    memory_format: torch.memory_format | None = None
    selects: tuple[bool, ...] = ()  # whether input i goes through ops[f"{name}__in{i}"]
    same_shape: bool = False
    mutates: bool = False
    writable: tuple[bool, ...] = ()


def _memory_format(rank: int) -> torch.memory_format | None:
    """Channels-last for 2-D and 3-D convolutions: grouped kernels run at the dense speed per MAC there."""
    return {4: torch.channels_last, 5: torch.channels_last_3d}.get(rank)


def _elementwise(module: nn.Module) -> _Elementwise:
    """An activation, out of place, with its in-place form where torch has one (used on tensors it owns)."""
    if isinstance(module, _Function):
        in_place = IN_PLACE_FUNCTIONS.get(module.fn) if not module.args and not module.kwargs else None
        return _Elementwise(module, in_place)
    if hasattr(module, "inplace"):
        in_place = copy.copy(module)
        # torch's stubs type Module.__setattr__ for tensors and modules only; a bool flag is fine at runtime
        module.inplace, in_place.inplace = False, True  # type: ignore[assignment]
        return _Elementwise(module, in_place)
    return _Elementwise(module, None)


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
