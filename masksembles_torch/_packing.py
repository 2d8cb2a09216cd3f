"""Packed inference: every member at about the cost of one model, from the structure of the masks.

Member ``k`` of a Masksembles model only ever uses its live channels, so the layers next to a Masksembles layer can be
shrunk physically. ``pack`` runs all members in one call: grouped convolutions and batched matmuls over every member's
compacted weights instead of full-width layers on a tiled batch. ``extract_member`` builds member ``k`` alone, as a
smaller dense model. Both have eval semantics (BatchNorm running statistics, Dropout off, grouped masks) and return an
ordinary ``torch.fx.GraphModule``: printable, ``torch.compile``-able and exportable.

How: the model is traced with torch.fx in eval mode and run on the example input at two batch sizes, which tells every
tensor's shape and batch axis. In-place operations are rewritten out of place (later readers read the result). Each
operation is then mapped to a ``masksembles_core.packing`` kind: those this module knows how to compact (Linear and
convolutions of any ``groups``, BatchNorm, LayerNorm/GroupNorm over the channels, elementwise operations with scalar
or per-channel arguments, pooling and reductions over other axes, moves of the channel axis, sums/products,
concatenations, flattening, Masksembles); anything else is a *fallback* that runs exactly as the dense model runs it,
at full width on the member-stacked batch (``PackedMasksembles.fallbacks`` lists them). The core decides which
channels each member computes; this module emits the graph.

"Zero stays zero" is never assumed from an operation's name: an elementwise operation counts as zero-preserving on a
channel only when evaluating it, with its own arguments, on +0 and -0 inputs gives 0 there.

Exactness: results equal the dense model's for finite activations, up to float rounding. Channels that Masksembles
zeroes are left out instead of multiplied by 0 (a masked inf or NaN gives NaN in the dense model and is absent here),
and known zeros written back for a fallback are +0 where the dense model may hold -0.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import operator
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from masksembles_core.adapter import check_program
from masksembles_core.packing import (
    OUTPUT,
    VERIFY_SAMPLES,
    AxisConflict,
    AxisRule,
    GraphNode,
    Move,
    Program,
    Step,
    block_indices,
    channel_axes,
    channel_indices,
    choose_program,
    norm_affine,
    output_mismatch,
    plan_program,
    timed_rounds,
)

from . import _packed_ops as ops
from ._layers import Masksembles

PREFIX = "pack/extract_member"
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_FUNCTIONS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
POOL_TYPES = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.LPPool1d, nn.LPPool2d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Upsample,
)  # fmt: skip
POOL_FUNCTIONS = {
    F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.lp_pool1d, F.lp_pool2d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
    F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d, F.interpolate,
}  # fmt: skip
DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
DROPOUT_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
# Elementwise (value by value) operations. Whether one maps zero to zero is evaluated, never read from this table.
ELEMENTWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.ELU, nn.CELU, nn.SELU, nn.Hardswish, nn.Hardtanh,
    nn.Hardsigmoid, nn.Hardshrink, nn.Softshrink, nn.Tanhshrink, nn.Mish, nn.Sigmoid, nn.LogSigmoid, nn.Softplus,
    nn.Softsign, nn.Threshold, nn.Identity, nn.RReLU, nn.PReLU,
)  # fmt: skip
ELEMENTWISE_FUNCTIONS = {
    F.relu, F.relu6, F.leaky_relu, F.gelu, F.silu, F.elu, F.celu, F.selu, F.hardswish, F.hardtanh, F.hardsigmoid,
    F.hardshrink, F.softshrink, F.tanhshrink, F.mish, F.sigmoid, F.logsigmoid, F.softplus, F.softsign, F.threshold,
    F.rrelu, torch.relu, torch.sigmoid, torch.tanh, torch.exp, torch.abs, torch.neg, torch.sqrt, torch.rsqrt,
    torch.square, torch.clamp, torch.clip, torch.erf, torch.sin, torch.cos, torch.log, torch.pow, torch.nan_to_num,
    torch.sign, operator.neg, operator.abs, operator.pos,
}  # fmt: skip
ELEMENTWISE_METHODS = {
    "relu", "sigmoid", "tanh", "exp", "abs", "neg", "sqrt", "rsqrt", "square", "clamp", "clip", "erf", "sin", "cos",
    "log", "pow", "float", "half", "bfloat16", "double", "to", "contiguous", "clone", "detach", "nan_to_num", "sign",
    "add", "sub", "mul", "div", "true_divide", "__add__", "__sub__", "__mul__", "__truediv__", "__radd__", "__rsub__",
    "__rmul__", "__rtruediv__", "type_as", "maximum", "minimum",
}  # fmt: skip
# binary operations on two model tensors of the same channels -> when their output is zero
COMBINE_FUNCTIONS: dict[Any, str] = {
    operator.add: "all", operator.sub: "all", operator.mul: "any", operator.truediv: "never", torch.add: "all",
    torch.sub: "all", torch.mul: "any", torch.div: "never", torch.maximum: "all", torch.minimum: "all",
}  # fmt: skip
COMBINE_METHODS = {"add": "all", "sub": "all", "mul": "any", "div": "never", "maximum": "all", "minimum": "all"}
IN_PLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
}  # fmt: skip
PER_SAMPLE_DROPOUTS = {"stochastic_depth", "drop_path"}  # functions of (x, p, ..., training): the identity in eval
REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std"}
MOVES = {"permute", "transpose", "flatten", "unsqueeze", "squeeze", "movedim", "swapaxes", "swapdims", "unflatten"}
MOVE_FUNCTIONS = {
    torch.permute, torch.transpose, torch.flatten, torch.unsqueeze, torch.squeeze, torch.movedim, torch.swapaxes,
    operator.getitem,
}  # fmt: skip
VIEWS = {
    "view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "squeeze", "unsqueeze", "expand",
    "expand_as", "narrow", "select", "unbind", "split", "chunk", "view_as", "movedim", "swapaxes", "swapdims",
    "detach", "contiguous", "as_strided", "diagonal", "T", "mT",
}  # fmt: skip
VIEW_FUNCTIONS = {
    torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze, torch.narrow,
    torch.select, torch.chunk, torch.split, torch.unbind, torch.movedim, torch.swapaxes, operator.getitem,
}  # fmt: skip
METADATA = {"dim", "ndimension", "ndim", "dtype", "device", "is_contiguous", "requires_grad", "layout", "is_cuda"}
SIZES = {"size", "shape", "numel", "nelement"}
# layers that compute each sample from that sample alone (in eval)
PER_SAMPLE_MODULES = (
    nn.Linear, *CONV_TYPES, *BATCHNORM_TYPES, nn.LayerNorm, nn.GroupNorm, *POOL_TYPES, *ELEMENTWISE_MODULES,
    *DROPOUT_TYPES, nn.Embedding, nn.MultiheadAttention,
)  # fmt: skip


class _Tracer(fx.Tracer):
    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, Masksembles) or super().is_leaf_module(module, qualified_name)


def _target_name(node: fx.Node) -> str:
    return str(node.target) if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))


def _describe(node: fx.Node, root: nn.Module) -> str:
    """A node as a user recognizes it: a module by its path and type, a call by its function and enclosing module."""
    if node.op == "call_module":
        return f"{node.target} ({type(root.get_submodule(str(node.target))).__name__})"
    stack = node.meta.get("nn_module_stack") or {}
    where = f"{next(reversed(stack))}: " if stack else ""
    return f"{where}{_target_name(node)} (node {node.name!r})"


# ---------------------------------------------------------------------------------------------------- capture


def _trace(model: nn.Module) -> fx.GraphModule:
    """The model's graph, traced in eval mode (so ``self.training`` branches take their eval path), with the
    arguments of ``forward`` that have defaults fixed at them: the graph takes the input tensor alone."""
    parameters = list(inspect.signature(model.forward).parameters.values())
    defaults = {p.name: p.default for p in parameters[1:] if p.default is not inspect.Parameter.empty}
    try:
        graph = _Tracer().trace(model, concrete_args=defaults or None)
    except Exception as error:  # torch.fx raises many types for untraceable Python
        raise ValueError(
            f"{PREFIX} need a model torch.fx can trace in eval mode (no Python control flow on tensor values); "
            f"tracing {type(model).__name__} failed: {type(error).__name__}: {error}"
        ) from error
    _drop_defaults(graph)
    return fx.GraphModule(model, graph)


def _drop_defaults(graph: fx.Graph) -> None:
    """Remove the placeholders of arguments traced at their defaults and torch.fx's checks of their values (the graph
    uses the defaults themselves): the packed program takes one input."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    for node in placeholders[1:]:
        if not node.args:  # no default: a required input, refused by the capture
            continue
        compared = [user for user in node.users if user.target is operator.eq]
        checks = [user for user in node.users if _target_name(user) == "_assert_is_none"]
        checks += [check for user in compared for check in user.users if check.target is torch._assert]
        for check in checks:
            graph.erase_node(check)
        for user in compared:
            if not user.users:
                graph.erase_node(user)
        for user in list(node.users):  # none left when torch.fx folded the default in everywhere
            user.args = fx.node.map_arg(user.args, functools.partial(_default_of, node))
            user.kwargs = fx.node.map_arg(user.kwargs, functools.partial(_default_of, node))
        graph.erase_node(node)


def _default_of(placeholder: fx.Node, argument: fx.Node) -> Any:
    """``argument``, or the default value of ``placeholder`` where it is that placeholder."""
    return placeholder.args[0] if argument is placeholder else argument


def _bound(node: fx.Node) -> inspect.BoundArguments | None:
    """A call's arguments bound to its signature, defaults applied (None for builtins without a signature)."""
    try:
        signature = inspect.signature(cast(Callable[..., Any], node.target))
        bound = signature.bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return bound


def _in_place(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` overwrites its first argument (``relu_``, ``+=``, ``inplace=True``)."""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        if node.target in IN_PLACE_OPERATORS:
            return True
        bound = _bound(node)
        inplace = node.kwargs.get("inplace") if bound is None else bound.arguments.get("inplace")
        return inplace is True
    if node.op == "call_module":
        return getattr(root.get_submodule(str(node.target)), "inplace", False) is True
    return False


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target) in VIEWS
    return node.op == "call_function" and node.target in VIEW_FUNCTIONS


class _SharedInPlace(ValueError):
    """An in-place operation on a tensor that shares memory with another one read after it."""


def _functionalize(gm: fx.GraphModule) -> None:
    """Make in-place operations out of place: readers after ``y = x.relu_()`` read ``y`` instead of ``x``.

    An in-place operation on a tensor that shares memory with another one read after it (a view) cannot be rewritten
    this way: ``_SharedInPlace`` (``pack`` then runs the whole model tiled).
    """
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    alias: dict[fx.Node, fx.Node] = {}

    def base(node: fx.Node) -> fx.Node:
        while node in alias:
            node = alias[node]
        return node

    for node in gm.graph.nodes:
        if _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
            alias[node] = node.args[0]
    for node in list(gm.graph.nodes):
        if not _in_place(node, gm) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        target = node.args[0]
        family = [n for n in gm.graph.nodes if n is not target and n is not node and base(n) is base(target)]
        late = [n.name for n in family if any(order[user] > order[node] for user in n.users)]
        if late:
            raise _SharedInPlace(
                f"{_describe(node, gm)} works in place on {target.name!r}, which shares memory with {late} read "
                "after it"
            )
        for user in list(target.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(target, node)


@dataclass
class _Seen:
    """What the probe saw at a node at the two batch sizes: tensor shapes, the parts of a tuple, or values."""

    tensor: bool
    shapes: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    values: tuple[Any, Any] = (None, None)
    dtype: torch.dtype | None = None
    parts: tuple[_Seen, ...] = ()

    @property
    def rank(self) -> int:
        return len(self.shapes[0])

    @property
    def batch_axes(self) -> tuple[int, ...]:
        """Axes whose size follows the batch."""
        return tuple(i for i, (a, b) in enumerate(zip(*self.shapes, strict=True)) if a != b)

    @property
    def per_sample(self) -> int:
        """Elements per sample of a tensor with one batch-proportional axis."""
        return math.prod(self.shapes[0]) // self.shapes[0][self.batch_axes[0]]

    @property
    def batch_axis(self) -> int:
        """The one axis that follows the batch, if it is exactly the batch (else -1)."""
        axes = self.batch_axes
        if len(axes) == 1 and self.shapes[1][axes[0]] == self.shapes[0][axes[0]] + 1:
            return axes[0]
        return -1

    @property
    def batch_dependent(self) -> bool:
        if self.tensor:
            return bool(self.batch_axes)
        if self.parts:
            return any(part.batch_dependent for part in self.parts)
        try:
            return bool(self.values[0] != self.values[1])
        except Exception:  # values that do not compare as a bool (tensors inside): assume they do
            return True


def _summary(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)) and any(isinstance(v, Tensor) for v in value):
        return ("parts", tuple(_summary(v) for v in value))
    return ("value", value)


def _merge(first: Any, second: Any) -> _Seen:
    if first[0] == "parts" and second[0] == "parts" and len(first[1]) == len(second[1]):
        return _Seen(False, parts=tuple(_merge(a, b) for a, b in zip(first[1], second[1], strict=True)))
    if first[0] == "tensor" and second[0] == "tensor" and len(first[1]) == len(second[1]):
        return _Seen(True, (first[1], second[1]), dtype=first[2])
    return _Seen(False, values=(first[-1], second[-1]))


class _Probe(fx.Interpreter):
    """Runs the graph and keeps, per node, its summary (and the values of the nodes in ``keep``)."""

    def __init__(self, gm: fx.GraphModule, keep: set[fx.Node]) -> None:
        super().__init__(gm)
        self.seen: dict[fx.Node, Any] = {}
        self.keep, self.kept = keep, cast(dict[fx.Node, Any], {})

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        self.seen[n] = _summary(result)
        if n in self.keep:
            self.kept[n] = result.detach() if isinstance(result, Tensor) else result
        return result


def _probe(
    gm: fx.GraphModule, example: Tensor, constants: set[fx.Node]
) -> tuple[dict[fx.Node, _Seen], dict[fx.Node, Any]]:
    """Run the graph at the example's batch size and at one more; return what was seen and the constants' values."""
    runs = []
    with torch.no_grad():
        for index, batch in enumerate((example, torch.cat([example, example[:1]]))):
            probe = _Probe(gm, constants if index == 0 else set())
            try:
                probe.run(batch.clone())
            except Exception as error:
                raise ValueError(
                    f"{PREFIX}: the traced model fails on the example input at batch {batch.shape[0]}: "
                    f"{type(error).__name__}: {error}"
                ) from error
            runs.append(probe)
    seen = {node: _merge(runs[0].seen[node], runs[1].seen[node]) for node in runs[0].seen}
    return seen, runs[0].kept


# ------------------------------------------------------------------------------------------------ classification


@dataclass
class _Op:
    """A model node as the core sees it: its kind, the model values it reads, and what emitting it needs."""

    node: fx.Node
    kind: str
    tensors: list[fx.Node]
    rule: str = "same"  # how the channel axis goes through: same, fixed, map, concat, flatten, none
    fixed_in: int = -1
    fixed_out: int = -1
    module: nn.Module | None = None
    how: str = "call"  # call (the model's own operation), identity, affine, prelu, linear, conv, norm, flatten
    zero_rule: str = "all"
    groups: int = 1
    weight: Tensor | None = None
    bias: Tensor | None = None
    conv: dict[str, Any] = field(default_factory=dict)
    batch_dependent: bool = False
    axis: int = -1


def _members_of(layers: Sequence[Masksembles]) -> int:
    """The n of a model's Masksembles layers (all the same)."""
    if not layers:
        raise ValueError(f"{PREFIX}: the model has no Masksembles layer")
    counts = sorted({layer.n for layer in layers})
    if len(counts) != 1:
        raise ValueError(f"{PREFIX}: every Masksembles layer needs the same n; found {counts}")
    return int(counts[0])


class _Capture:
    """The traced model, what the probe saw, and every node's classification."""

    def __init__(self, model: nn.Module, example: Tensor) -> None:
        if not isinstance(example, Tensor) or example.dim() < 1 or example.shape[0] < 1:
            raise ValueError(f"{PREFIX} need an example input tensor with a batch of at least 1 on axis 0")
        self.gm = _trace(model)
        _functionalize(self.gm)
        self.gm.graph.eliminate_dead_code()
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            names = [str(node.target) for node in placeholders]
            raise ValueError(
                f"{PREFIX} support models called with one input tensor (other arguments of forward need defaults); "
                f"this one requires {len(placeholders)}: {names}"
            )
        self.input = placeholders[0]
        self.device = example.device
        self.dynamic: set[fx.Node] = set()
        for node in self.gm.graph.nodes:
            if node.op == "placeholder" or any(a in self.dynamic for a in node.all_input_nodes):
                self.dynamic.add(node)
        constants = {n for n in self.gm.graph.nodes if n not in self.dynamic and n.op != "output"}
        self.seen, self.constants = _probe(self.gm, example, constants)
        self.values: set[fx.Node] = {self.input}  # the model values: tensors, tuples and what is read from them
        for node in self.gm.graph.nodes:
            if node in self.dynamic and node.op not in ("placeholder", "output") and self._is_value(node):
                self.values.add(node)
        self.ops: dict[fx.Node, _Op] = {}
        self.mixing: dict[fx.Node, bool] = {}  # mixes_samples, evaluated once per node
        for node in self.gm.graph.nodes:
            if node in self.values and node is not self.input:
                self.ops[node] = self._classify(node)
        self.n = _members_of([cast(Masksembles, op.module) for op in self.ops.values() if op.kind == "masks"])
        self.classified = self.ops

    def reset(self, dense: bool) -> None:
        """Fresh operations for one build (the passes mark fallbacks and axes on them): as classified, or every one
        as the dense model runs it (the tiled model as one graph)."""
        self.ops = {node: self.fallback(node) if dense else copy.copy(op) for node, op in self.classified.items()}

    def _is_value(self, node: fx.Node) -> bool:
        seen = self.seen[node]
        if seen.tensor or seen.parts:
            return True
        return not self.is_query(node) and any(a in self.values for a in node.all_input_nodes)

    def is_query(self, node: fx.Node) -> bool:
        """A size or metadata query on a tensor: its value in the dense model is computed, not run."""
        if node.op == "call_method":
            return str(node.target) in SIZES | METADATA
        if node.op == "call_function" and node.target is getattr:
            return node.args[1] in SIZES | METADATA
        return node.op == "call_function" and node.target is torch.numel

    def inputs(self, node: fx.Node) -> list[fx.Node]:
        """The model values ``node`` reads, in order, each once."""
        return [a for a in dict.fromkeys(node.all_input_nodes) if a in self.values]

    def constant(self, value: Any) -> Any:
        """An argument's value when it does not depend on the input (folded once here); None for a model value."""
        if isinstance(value, fx.Node):
            if value in self.dynamic:
                return None
            return self.constants.get(value)
        if isinstance(value, (tuple, list)):
            items = [self.constant(v) for v in value]
            return (
                None
                if any(i is None and v is not None for i, v in zip(items, value, strict=True))
                else type(value)(items)
            )
        return value

    def argument(self, node: fx.Node, name: str, position: int, default: Any = None) -> Any:
        """A call argument by keyword or position, its constant value (defaults from the signature when it has one)."""
        bound = _bound(node)
        if bound is not None and name in bound.arguments:
            return self.constant(bound.arguments[name])
        if name in node.kwargs:
            return self.constant(node.kwargs[name])
        return self.constant(node.args[position]) if position < len(node.args) else default

    def batch_args(self, node: fx.Node) -> bool:
        """Whether a non-tensor argument follows the batch size: then only the dense frame gives it its meaning."""
        return any(
            a in self.dynamic and not self.seen[a].tensor and not self.seen[a].parts and self.seen[a].batch_dependent
            for a in node.all_input_nodes
        )

    def fallback(self, node: fx.Node) -> _Op:
        """``node`` as the dense model runs it; per member when it uses the batch size, mixes the samples or is a
        Masksembles layer."""
        per_member = self.is_masksembles(node) or self.batch_args(node) or self.mixes_samples(node)
        return _Op(node, "fallback", self.inputs(node), rule="none", batch_dependent=per_member)

    def is_masksembles(self, node: fx.Node) -> bool:
        """Whether ``node`` calls a Masksembles layer."""
        return node.op == "call_module" and isinstance(self.gm.get_submodule(str(node.target)), Masksembles)

    def mixes_samples(self, node: fx.Node) -> bool:
        """Whether one sample's result depends on the other samples (a mean over the batch, ``flip(0)``, a cumsum
        along it): evaluated at the probe's larger batch on random inputs, then again with the last sample changed;
        the other samples' rows must stay the same. Layers known to work per sample are not evaluated."""
        if node not in self.mixing:
            self.mixing[node] = self._mixes_samples(node)
        return self.mixing[node]

    def _mixes_samples(self, node: fx.Node) -> bool:
        if node.op == "call_module" and isinstance(self.gm.get_submodule(str(node.target)), PER_SAMPLE_MODULES):
            return False
        seen, tensors = self.seen[node], self.inputs(node)
        batch = self.seen[self.input].shapes[1][0]
        if not seen.tensor or len(seen.batch_axes) != 1 or not tensors:
            return False  # no batch axis to compare along (a reduction over it makes one per member: batch_args)
        if any(not self.seen[t].tensor or len(self.seen[t].batch_axes) != 1 for t in (node, *tensors)):
            return True
        sizes = {t: self.seen[t].shapes[1][self.seen[t].batch_axes[0]] for t in (node, *tensors)}
        if any(size % batch for size in sizes.values()):
            return True
        generator = torch.Generator(device=self.device).manual_seed(0)
        given = {t: _random_like(self.seen[t], self.device, generator) for t in tensors}
        try:
            before = _evaluate(self, node, given, run=1)
            for sample in (0, batch - 1):  # the first and the last sample drawn again: the others' rows must stay
                changed = {}
                for t in tensors:
                    axis, rows = self.seen[t].batch_axes[0], sizes[t] // batch
                    redrawn = _random_like(self.seen[t], self.device, generator).narrow(axis, sample * rows, rows)
                    changed[t] = given[t].index_copy(
                        axis, torch.arange(sample * rows, (sample + 1) * rows, device=self.device), redrawn
                    )
                after = _evaluate(self, node, changed, run=1)
                axis, rows = seen.batch_axes[0], sizes[node] // batch
                for start, stop in ((0, sample * rows), ((sample + 1) * rows, sizes[node])):  # the other samples
                    first, second = before.narrow(axis, start, stop - start), after.narrow(axis, start, stop - start)
                    if not bool(((first == second) | (first.isnan() & second.isnan())).all()):
                        return True
        except Exception:  # it does not apply to random inputs (indices out of range): not shown to keep samples apart
            return True
        return False

    def _classify(self, node: fx.Node) -> _Op:
        tensors = self.inputs(node)
        if not self.seen[node].tensor or not tensors or any(not self.seen[t].tensor for t in tensors):
            return self.fallback(node)
        if self._flatten_call(node, tensors[0]):
            return _Op(node, "flatten", tensors, rule="flatten", how="flatten")
        if self.batch_args(node) or node.op == "get_attr":
            return self.fallback(node)
        op = self._module(node, tensors) if node.op == "call_module" else self._function(node, tensors)
        return op if op is not None else self.fallback(node)

    def _function(self, node: fx.Node, tensors: list[fx.Node]) -> _Op | None:
        target = node.target
        method = node.op == "call_method"
        name = str(target) if method else getattr(target, "__name__", "")
        if method and name.endswith("_") and not name.endswith("__"):
            name = name[:-1]  # in place: emitted out of place
        if len(tensors) == 2:
            rule = (
                COMBINE_METHODS.get(name)
                if method
                else COMBINE_FUNCTIONS.get(IN_PLACE_OPERATORS.get(cast(Any, target), target))
            )
            return None if rule is None else _Op(node, "combine", tensors, zero_rule=rule)
        if target in (torch.cat, torch.concat):
            return _Op(node, "concat", tensors, rule="concat")
        if len(tensors) != 1:
            return None
        if target is F.linear:
            return self._linear(node, tensors, self.argument(node, "weight", 1), self.argument(node, "bias", 2))
        if target in CONV_FUNCTIONS:
            return self._conv_function(node, tensors)
        if target in DROPOUT_FUNCTIONS:
            return (
                None if self.argument(node, "training", 2, True) else _Op(node, "channelwise", tensors, how="identity")
            )
        if name in PER_SAMPLE_DROPOUTS and _bound(node) is not None and self.argument(node, "training", 3) is False:
            return _Op(node, "channelwise", tensors, how="identity")  # torchvision's stochastic_depth is fx.wrap'ed
        if target is F.batch_norm:
            if self.argument(node, "training", 5, False):
                return None
            mean, var = self.argument(node, "running_mean", 1), self.argument(node, "running_var", 2)
            weight, bias = self.argument(node, "weight", 3), self.argument(node, "bias", 4)
            return self._affine(node, tensors, mean, var, weight, bias, self.argument(node, "eps", 7, 1e-5))
        if target is F.layer_norm:
            return self._layer_norm(node, tensors, self.argument(node, "normalized_shape", 1))
        if target is F.group_norm:
            return _Op(node, "norm", tensors, rule="fixed", fixed_in=1, fixed_out=1, how="norm")
        if target in POOL_FUNCTIONS or target is F.pad:
            return self._spatial(node, tensors)
        if target in MOVE_FUNCTIONS or (method and name in MOVES):
            return _Op(node, "channelwise", tensors, rule="map")
        if name in REDUCTIONS:
            return _Op(node, "channelwise", tensors, rule="map")
        if target in IN_PLACE_OPERATORS or target in ELEMENTWISE_FUNCTIONS or target in COMBINE_FUNCTIONS:
            return _Op(node, "channelwise", tensors)
        if method and name in ELEMENTWISE_METHODS:
            return _Op(node, "channelwise", tensors)
        return None

    def _module(self, node: fx.Node, tensors: list[fx.Node]) -> _Op | None:
        module = self.gm.get_submodule(str(node.target))
        if len(tensors) != 1:
            return None
        rank = self.seen[tensors[0]].rank
        if isinstance(module, Masksembles):
            axis = module.channel_axis % rank
            return _Op(
                node, "masks", tensors, rule="fixed", fixed_in=axis, fixed_out=axis, module=module, how="identity"
            )
        if isinstance(module, nn.Linear):
            return self._linear(node, tensors, module.weight, module.bias)
        if isinstance(module, CONV_TYPES) and not module.transposed:
            settings = {"stride": module.stride, "padding": module.padding, "dilation": module.dilation,
                        "padding_mode": module.padding_mode, "dims": len(module.kernel_size)}  # fmt: skip
            return self._conv(node, tensors, module.weight, module.bias, module.groups, settings, module)
        if isinstance(module, BATCHNORM_TYPES):
            if module.running_mean is None or module.running_var is None:
                return None  # batch statistics even in eval: the dense frame reproduces them
            return self._affine(node, tensors, module.running_mean, module.running_var,
                                module.weight if module.affine else None, module.bias if module.affine else None,
                                module.eps)  # fmt: skip
        if isinstance(module, nn.LayerNorm):
            return self._layer_norm(node, tensors, module.normalized_shape, module)
        if isinstance(module, nn.GroupNorm):
            return _Op(node, "norm", tensors, rule="fixed", fixed_in=1, fixed_out=1, module=module, how="norm")
        if isinstance(module, DROPOUT_TYPES):
            return _Op(node, "channelwise", tensors, how="identity")
        if isinstance(module, nn.Flatten):
            return _Op(node, "channelwise", tensors, rule="map", module=module)
        if isinstance(module, POOL_TYPES):
            return self._spatial(node, tensors, module)
        if isinstance(module, nn.PReLU) and module.num_parameters > 1:
            return _Op(node, "channelwise", tensors, rule="fixed", fixed_in=1, fixed_out=1, module=module, how="prelu")
        if isinstance(module, ELEMENTWISE_MODULES):
            return _Op(node, "channelwise", tensors, module=module)
        return None

    def _flatten_call(self, node: fx.Node, source: fx.Node) -> bool:
        """``flatten(x, 1)``, ``x.flatten(1)``, ``nn.Flatten()``, or ``x.view(B, -1)``/``x.reshape(B, -1)`` with B
        the batch size: (B, ...) -> (B, features)."""
        seen = self.seen[source]
        if not seen.tensor or seen.batch_axes != (0,) or seen.batch_axis != 0:
            return False
        rank = seen.rank
        if node.op == "call_module":
            module = self.gm.get_submodule(str(node.target))
            return isinstance(module, nn.Flatten) and module.start_dim == 1 and module.end_dim in (-1, rank - 1)
        flatten = (node.op == "call_function" and node.target is torch.flatten) or (
            node.op == "call_method" and node.target == "flatten"
        )
        if flatten:
            start = self.constant(node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0))
            end = self.constant(node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1))
            return start == 1 and end in (-1, rank - 1)
        reshape = (node.op == "call_method" and node.target in ("view", "reshape")) or (
            node.op == "call_function" and node.target is torch.reshape
        )
        if not reshape or node.kwargs:
            return False
        shape = node.args[1:]
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if len(shape) != 2 or shape[1] != -1:
            return False
        first = shape[0]
        values = self.seen[first].values if isinstance(first, fx.Node) and first in self.seen else (first, first)
        return tuple(values) == (seen.shapes[0][0], seen.shapes[1][0])

    def _linear(self, node: fx.Node, tensors: list[fx.Node], weight: Any, bias: Any) -> _Op | None:
        if not isinstance(weight, Tensor) or (bias is not None and not isinstance(bias, Tensor)):
            return None
        rank = self.seen[tensors[0]].rank
        return _Op(node, "mixing", tensors, rule="fixed", fixed_in=rank - 1, fixed_out=rank - 1, how="linear",
                   weight=weight.detach(), bias=None if bias is None else bias.detach())  # fmt: skip

    def _conv_function(self, node: fx.Node, tensors: list[fx.Node]) -> _Op | None:
        weight, bias = self.argument(node, "weight", 1), self.argument(node, "bias", 2)
        settings = {"stride": self.argument(node, "stride", 3, 1), "padding": self.argument(node, "padding", 4, 0),
                    "dilation": self.argument(node, "dilation", 5, 1), "padding_mode": "zeros",
                    "dims": CONV_FUNCTIONS[cast(Any, node.target)]}  # fmt: skip
        groups = self.argument(node, "groups", 6, 1)
        if not isinstance(weight, Tensor) or any(v is None for v in settings.values()) or not isinstance(groups, int):
            return None
        return self._conv(node, tensors, weight, bias, groups, settings)

    def _conv(
        self, node: fx.Node, tensors: list[fx.Node], weight: Tensor, bias: Tensor | None, groups: int,
        settings: dict[str, Any], module: nn.Module | None = None,
    ) -> _Op | None:  # fmt: skip
        if bias is not None and not isinstance(bias, Tensor):
            return None
        return _Op(node, "mixing" if groups == 1 else "grouped", tensors, rule="fixed", fixed_in=1, fixed_out=1,
                   how="conv", groups=groups, weight=weight.detach(), bias=None if bias is None else bias.detach(),
                   conv=settings, module=module)  # fmt: skip

    def _affine(
        self, node: fx.Node, tensors: list[fx.Node], mean: Any, var: Any, weight: Any, bias: Any, eps: Any
    ) -> _Op | None:
        if not all(isinstance(v, Tensor) for v in (mean, var)) or not isinstance(eps, (int, float)):
            return None

        def numpy(tensor: Any) -> np.ndarray | None:
            return None if tensor is None else tensor.detach().cpu().double().numpy()

        scale, shift = norm_affine(mean.detach().cpu().double().numpy(), var.detach().cpu().double().numpy(),
                                   numpy(weight), numpy(bias), float(eps))  # fmt: skip
        return _Op(node, "channelwise", tensors, rule="fixed", fixed_in=1, fixed_out=1, how="affine",
                   weight=torch.as_tensor(scale).to(mean), bias=torch.as_tensor(shift).to(mean))  # fmt: skip

    def _layer_norm(
        self, node: fx.Node, tensors: list[fx.Node], shape: Any, module: nn.Module | None = None
    ) -> _Op | None:
        if shape is None or len(tuple(shape)) != 1:
            return None
        rank = self.seen[tensors[0]].rank
        return _Op(
            node, "norm", tensors, rule="fixed", fixed_in=rank - 1, fixed_out=rank - 1, module=module, how="norm"
        )

    def _spatial(self, node: fx.Node, tensors: list[fx.Node], module: nn.Module | None = None) -> _Op | None:
        """Pooling, resizing and padding over the axes after the channels: channel ``c`` from channel ``c``."""
        if module is not None and getattr(module, "return_indices", False):
            return None
        if module is None and node.target is not F.pad and _bound(node) is not None:
            bound = cast(inspect.BoundArguments, _bound(node))
            if bound.arguments.get("return_indices") is True:
                return None
        if node.target is F.pad:
            pad, mode = self.argument(node, "pad", 1), self.argument(node, "mode", 2, "constant")
            if (
                not isinstance(pad, (tuple, list))
                or mode != "constant"
                or len(pad) // 2 > self.seen[tensors[0]].rank - 2
            ):
                return None
        return _Op(node, "channelwise", tensors, rule="fixed", fixed_in=1, fixed_out=1, module=module)


# ------------------------------------------------------------------------------------------------ channel axes


def _solve_axes(capture: _Capture) -> dict[fx.Node, int]:
    """The channel axis of every compacted node and of what it reads; nodes that cannot agree fall back."""
    maps: dict[tuple[fx.Node, int], int | None] = {}
    while True:
        try:
            return _checked_axes(capture, maps)
        except AxisConflict as conflict:
            node = cast(fx.Node, conflict.node)
            capture.ops[node] = capture.fallback(node)


def _checked_axes(capture: _Capture, maps: dict[tuple[fx.Node, int], int | None]) -> dict[fx.Node, int]:
    """The core's axes for the compacted nodes' rules, then the layouts each node needs (its batch exactly on one axis,
    not the channels'; convolutions, BatchNorm and pooling with the batch first)."""
    compact = [op for op in capture.ops.values() if op.kind != "fallback"]
    rules = []
    for op in compact:
        if any(capture.seen[node].rank == 0 for node in (op.node, *op.tensors)):
            raise AxisConflict(op.node)  # a 0-d tensor (a sum of everything) has neither batch nor channel axis
        dim = capture.argument(op.node, "dim", 1, 0) if op.rule == "concat" else 0
        if not isinstance(dim, int):
            raise AxisConflict(op.node)
        mapped = None
        if op.rule == "map":
            mapped = functools.partial(_mapped_axis, capture, op, maps=maps)
        rules.append(
            AxisRule(op.node, tuple(op.tensors), op.rule, op.fixed_in, op.fixed_out,
                     dim % capture.seen[op.node].rank, mapped)
        )  # fmt: skip
    axis = cast(dict[fx.Node, int], channel_axes(rules, lambda node: capture.seen[cast(fx.Node, node)].rank))
    for op in compact:  # a flattened tensor that no other rule reads (the input): channels first, as nn.Flatten
        if op.kind == "flatten" and op.tensors[0] not in axis:
            if capture.seen[op.tensors[0]].rank < 2:
                raise AxisConflict(op.node)
            axis[op.tensors[0]] = 1
    for op in compact:
        for node in [op.node, *op.tensors]:
            seen = capture.seen[node]
            if seen.batch_axis < 0 or seen.batch_axis == axis[node] or (op.fixed_in == 1 and seen.batch_axis != 0):
                raise AxisConflict(op.node)
        if op.kind == "flatten" and axis[op.tensors[0]] not in (1, capture.seen[op.tensors[0]].rank - 1):
            raise AxisConflict(op.node)
    for op, rule in zip(compact, rules, strict=True):
        if op.rule == "concat":  # along the channels, or along another axis (then channel c of every part)
            op.kind = "concat" if axis[op.node] == rule.concat_dim else "combine"
        width = capture.seen[op.node].shapes[0][axis[op.node]]
        if op.kind == "combine" and any(capture.seen[t].shapes[0][axis[t]] != width for t in op.tensors):
            raise AxisConflict(op.node)  # one broadcasts along the channels (a (B, 1, 1, 1) tensor): full width
    for op in capture.ops.values():
        op.axis = axis.get(op.node, -1)
    return axis


def _mapped_axis(
    capture: _Capture, op: _Op, source_axis: int, maps: dict[tuple[fx.Node, int], int | None]
) -> int | None:
    key = (op.node, source_axis)
    if key not in maps:
        maps[key] = _evaluate_map(capture, op, source_axis)
    return maps[key]


def _evaluate_map(capture: _Capture, op: _Op, source_axis: int) -> int | None:
    """Where a move or reduction puts the channels that its input holds on ``source_axis`` (None: it mixes them).

    Evaluated, not read from the operation's name: the operation runs on a tensor holding each position's channel
    index, and the result must hold those indices whole, in order, on one axis (and likewise the batch indices).
    """
    node, source = op.node, op.tensors[0]
    seen = capture.seen[source]
    shape = seen.shapes[0]
    if source_axis == seen.batch_axis:
        return None
    if _target_name(node) == "getitem" and not _takes_whole(node.args[1], seen.rank, [source_axis, seen.batch_axis]):
        return None
    found = []
    for tracked in (source_axis, seen.batch_axis):
        ids = torch.arange(shape[tracked], dtype=torch.float64)
        view = [1] * len(shape)
        view[tracked] = shape[tracked]
        try:
            out = _evaluate(capture, node, {source: ids.view(view).expand(shape).contiguous()})
        except Exception:  # the operation does not apply to this tensor as given
            return None
        found.append(_whole_axis(out, ids))
    channel, batch = found
    if channel is None or batch is None or batch != capture.seen[node].batch_axis:
        return None
    return channel


def _random_like(seen: _Seen, device: torch.device, generator: torch.Generator) -> Tensor:
    """Random values of the shape and dtype the probe saw at its larger batch (0s and 1s for integers and bools)."""
    shape, dtype = seen.shapes[1], seen.dtype or torch.float32
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device, generator=generator)
    return torch.randint(0, 2, shape, device=device, generator=generator).to(dtype)


def _takes_whole(index: Any, rank: int, axes: Sequence[int]) -> bool:
    """A ``getitem`` index made of slices, ints, None and one Ellipsis that takes all of ``axes``."""
    entries = index if isinstance(index, tuple) else (index,)
    if any(not isinstance(e, (slice, int, type(None), type(Ellipsis))) for e in entries):
        return False
    consumed = [e for e in entries if e is not None and e is not Ellipsis]
    if sum(e is Ellipsis for e in entries) > 1 or len(consumed) > rank:
        return False
    positions: list[Any] = []
    for e in entries:
        if e is Ellipsis:
            positions.extend([slice(None)] * (rank - len(consumed)))
        elif e is not None:
            positions.append(e)
    positions.extend([slice(None)] * (rank - len(positions)))
    return all(positions[a] == slice(None) for a in axes)


def _whole_axis(out: Any, ids: Tensor) -> int | None:
    """The axis of ``out`` that holds ``ids`` in order, constant along every other axis; None if none does."""
    if not isinstance(out, Tensor):
        return None
    for a in range(out.dim()):
        if out.shape[a] != len(ids):
            continue
        view = [1] * out.dim()
        view[a] = len(ids)
        if torch.equal(out.double(), ids.view(view).expand(out.shape)):
            return a
    return None


def _evaluate(capture: _Capture, node: fx.Node, values: dict[fx.Node, Any], run: int = 0) -> Any:
    """Run one node of the traced graph on given values for its model inputs (other arguments as the probe saw them
    in ``run``: 0 at the example's batch size, 1 at one more)."""

    def value(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        if a in values:
            return values[a]
        if a in capture.dynamic:
            return capture.seen[a].values[run]
        return capture.constants.get(a)

    args = fx.node.map_aggregate(node.args, value)
    kwargs = fx.node.map_aggregate(node.kwargs, value)
    with torch.no_grad():
        if node.op == "call_module":
            return capture.gm.get_submodule(str(node.target))(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        return cast(Callable[..., Any], node.target)(*args, **kwargs)


def _zero_map(capture: _Capture, op: _Op) -> np.ndarray:
    """Per output channel, whether the operation maps zero inputs to zero: evaluated on +0 and on -0, with the
    operation's own arguments (a per-sample zero input, the batch of one)."""
    source = op.tensors[0]
    seen = capture.seen[source]
    shape = list(seen.shapes[0])
    shape[seen.batch_axis] = 1
    zero = np.ones(capture.seen[op.node].shapes[0][op.axis], dtype=bool)
    for sign in (0.0, -0.0):
        out = _evaluate(capture, op.node, {source: torch.full(shape, sign, dtype=seen.dtype, device=capture.device)})
        others = [a for a in range(out.dim()) if a != op.axis]
        zero &= (out == 0).all(dim=others).cpu().numpy() if others else (out == 0).cpu().numpy()
    return zero


# ------------------------------------------------------------------------------------------------ the core graph


def _graph_nodes(capture: _Capture, axis: dict[fx.Node, int]) -> tuple[list[GraphNode], str]:
    """The core's view of the model, and the name of the node whose value is the output."""

    def channels(node: fx.Node) -> int:
        seen = capture.seen[node]
        return seen.shapes[0][axis[node]] if seen.tensor and node in axis else 1

    _member_frames(capture)
    nodes = [GraphNode(capture.input.name, "input", (), channels(capture.input))]
    for node, op in capture.ops.items():
        names = tuple(t.name for t in op.tensors)
        size = channels(node)
        if op.kind == "masks":
            masks = (cast(Masksembles, op.module).masks != 0).cpu().numpy()
            nodes.append(GraphNode(node.name, "masks", names, size, masks=masks))
        elif op.kind == "channelwise":
            zero = True if op.how == "identity" else _zero_map(capture, op)
            nodes.append(GraphNode(node.name, "channelwise", names, size, zero_preserving=zero))
        elif op.kind == "grouped":
            nodes.append(
                GraphNode(node.name, "grouped", names, size, zero_preserving=_zero_map(capture, op), groups=op.groups)
            )
        elif op.kind == "combine":
            nodes.append(GraphNode(node.name, "combine", names, size, zero_rule=op.zero_rule))
        elif op.kind == "concat":
            nodes.append(GraphNode(node.name, "concat", names, size, parts=tuple(channels(t) for t in op.tensors)))
        elif op.kind == "flatten":
            source = op.tensors[0]
            seen = capture.seen[source]
            spatial = math.prod(s for a, s in enumerate(seen.shapes[0]) if a not in (0, axis[source]))
            last = axis[source] == seen.rank - 1 and seen.rank > 2
            nodes.append(GraphNode(node.name, "flatten", names, size, spatial=spatial, channels_last=last))
        elif op.kind == "fallback":
            nodes.append(GraphNode(node.name, "fallback", names, size, batch_dependent=op.batch_dependent))
        else:
            nodes.append(GraphNode(node.name, op.kind, names, size))
    output = next(n for n in capture.gm.graph.nodes if n.op == "output").args[0]
    if isinstance(output, fx.Node) and output in capture.values and capture.seen[output].tensor:
        return nodes, output.name
    leaves = [leaf for leaf in _leaves(output) if leaf in capture.values]
    nodes.append(GraphNode(OUTPUT, "fallback", tuple(leaf.name for leaf in leaves), 1, batch_dependent=True))
    return nodes, OUTPUT


def _leaves(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _member_frames(capture: _Capture) -> None:
    """Mark the fallbacks that must run per member: those whose shared result could not be repeated per member
    (no exact batch axis) while a per-member node reads it."""
    while True:
        member: set[fx.Node] = set()
        for node, op in capture.ops.items():
            if op.kind == "masks" or op.batch_dependent or any(t in member for t in op.tensors):
                member.add(node)
        changed = False
        for node, op in capture.ops.items():
            if node in member:
                continue
            readers = [user for user in node.users if user in member]
            if readers and not _repeatable(capture.seen[node]) and op.kind == "fallback":
                op.batch_dependent, changed = True, True
        if not changed:
            return


def _repeatable(seen: _Seen) -> bool:
    """Whether a shared value can be repeated for every member along its batch axis (or needs no repeat)."""
    if seen.parts:
        return all(_repeatable(part) for part in seen.parts)
    if not seen.tensor:
        return not seen.batch_dependent
    return not seen.batch_axes or seen.batch_axis >= 0


VERIFICATION = "verification"  # how the fallback entry that verification writes starts
AUTO_ROUNDS = 7  # interleaved timing rounds of program="auto"


# ------------------------------------------------------------------------------------------------ emission


class _Emitter:
    """Writes the program as an fx graph over a root module that holds the compacted layers and the moves' indices."""

    def __init__(
        self, capture: _Capture, axis: dict[fx.Node, int], program: Program, squeeze: bool, samples: int,
        chosen: Sequence[int],
    ) -> None:  # fmt: skip
        self.capture, self.axis, self.program, self.samples = capture, axis, program, samples
        self.m = len(program.members)
        # the members returned, as positions in the program's (None: all of them, in order)
        self.returned = None if list(chosen) == list(program.members) else [program.members.index(k) for k in chosen]
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.by_name = {node.name: node for node in capture.gm.graph.nodes}
        self.values: dict[str, fx.Node] = {}
        self.scalars: dict[fx.Node, Any] = {}
        self.moved: dict[tuple[Any, ...], fx.Node] = {}
        self.copies: dict[str, str] = {}
        self.macs = {"dense": 0, "packed": 0, "fallback": 0}
        self.same_shape: dict[fx.Node, tuple[int, ...]] = {}  # combines: the arguments shaped like the result
        self.last_axis_frames: dict[fx.Node, int] = {}  # to_batch/to_channels of (B, ..., m*C): C
        self.mlps: list[tuple[fx.Node, list[fx.Node], fx.Node]] = []  # members' Linear, activations, members' Linear
        for step in program.steps:
            self.values[step.name] = self._step(step)
        self._output(squeeze)
        self._in_place()
        self._member_major()
        self._fuse_mlps()
        self._direct_outputs()

    # ---- attributes of the root

    def _attribute(self, prefix: str, value: Tensor) -> fx.Node:
        """A tensor held by the root as a buffer, read in the graph."""
        name = f"{prefix}_{len(self.root._buffers)}"
        self.root.register_buffer(name, value)
        return self.graph.get_attr(name)

    def _call(self, prefix: str, module: nn.Module, *args: Any) -> fx.Node:
        """A module held by the root, called in the graph."""
        name = f"{prefix}_{len(self.root._modules)}"
        self.root.add_module(name, module)
        return self.graph.call_module(name, args)

    def _module(self, target: str) -> str:
        """The model's own module, copied once into the root (for the operations run as the model runs them)."""
        if target not in self.copies:
            module = copy.deepcopy(self.capture.gm.get_submodule(target))
            module.eval().requires_grad_(False)
            if getattr(module, "inplace", False) is True:
                module.inplace = False  # type: ignore[assignment]
            if isinstance(module, Masksembles):  # block j of the member-stacked batch is member members[j]
                module.masks = module.masks[list(self.program.members)]
                module.n = len(self.program.members)
            name = f"model_{target}".replace(".", "_")
            self.root.add_module(name, module)
            self.copies[target] = name
        return self.copies[target]

    # ---- values that are not model tensors: constants, sizes as the dense model sees them

    def _argument(self, value: Any) -> Any:
        """An argument for an emitted node: model values as emitted, constants folded, sizes in the dense frame."""
        return fx.node.map_arg(value, self._scalar)

    def _scalar(self, node: fx.Node) -> Any:
        if node.name in self.values:
            return self.values[node.name]
        if node in self.scalars:
            return self.scalars[node]
        capture = self.capture
        if node not in capture.dynamic:
            constant = capture.constants.get(node)
            if isinstance(constant, Tensor):
                result: Any = self._attribute("constant", constant)
            elif isinstance(constant, nn.Module):
                result = self.graph.get_attr(self._module(str(node.target)))
            else:
                result = constant
        elif capture.is_query(node):
            result = self._query(node)
        else:
            args, kwargs = self._argument(node.args), self._argument(node.kwargs)
            result = self.graph.create_node(node.op, node.target, args, kwargs)
        self.scalars[node] = result
        return result

    def _query(self, node: fx.Node) -> fx.Node:
        """A size or metadata query, answered as the dense model (member-stacked batch, every channel) would."""
        tensor = cast(fx.Node, node.args[0])
        value = self.values[tensor.name]
        name = str(node.args[1]) if node.target is getattr else _target_name(node)
        if name in METADATA:
            return self.graph.create_node(node.op, node.target, (value, *node.args[1:]), dict(node.kwargs))
        step = self.program.step(tensor.name)
        seen = self.capture.seen[tensor]
        dense = step.placement.dense
        factor = 1 if dense and not step.placement.shared else self.m
        channel_axis = -1 if dense or tensor is self.capture.input else self.axis[tensor]  # the input: every channel
        channels = seen.shapes[0][channel_axis] if channel_axis >= 0 else 0
        size = self.graph.call_function(ops.frame_size, (value, seen.batch_axes, factor, channel_axis, channels))
        if name in ("numel", "nelement") or node.target is torch.numel:
            return self.graph.call_function(math.prod, (size,))
        if name == "size" and len(node.args) + len(node.kwargs) > 1:
            dim = self._argument(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None))
            return self.graph.call_function(operator.getitem, (size, dim))
        return size

    # ---- moves

    def _edge(self, step: Step, index: int) -> fx.Node:
        edge = step.edges[index]
        value = self.values[edge.source]
        source = self.by_name.get(edge.source)
        key: tuple[Any, ...] = (edge.source,)
        for move in edge.moves:
            key = (*key, move.kind, _bytes(move.index), _bytes(move.scale))
            if key in self.moved:
                value = self.moved[key]
                continue
            value = self._move(move, value, cast(fx.Node, source))
            self.moved[key] = value
        return value

    def _move(self, move: Move, value: fx.Node, source: fx.Node) -> fx.Node:
        seen = self.capture.seen[source]
        if move.kind == "tile":
            if seen.parts:
                axes = tuple(part.batch_axis if part.batch_axes else -1 for part in seen.parts)
                return self.graph.call_function(ops.tile_parts, (value, self.m, axes))
            if not seen.tensor or not seen.batch_axes:
                return value  # the same for every member
            return self.graph.call_function(ops.tile, (value, self.m, seen.batch_axis))
        axis = self.axis[source] if source in self.axis else self._input_axis()
        if move.kind in ("to_batch", "to_channels"):
            function = ops.to_batch if move.kind == "to_batch" else ops.to_channels
            frame = self.graph.call_function(function, (value, self.m, seen.batch_axis, axis))
            if seen.batch_axis == 0 and axis == seen.rank - 1:  # batch first, channels last: see _member_major
                self.last_axis_frames[frame] = seen.shapes[0][axis]
            return frame
        assert move.index is not None and move.scale is not None
        rank = seen.rank
        if np.array_equal(move.index, np.arange(len(move.index))):
            value = self.graph.call_method("narrow", (value, axis, 0, len(move.index)))
        else:
            index = self._attribute("index", torch.as_tensor(move.index, dtype=torch.long, device=self.capture.device))
            value = self.graph.call_function(ops.gather_channels, (value, axis, index))
        if not (move.scale == 1).all():
            shape = [1] * rank
            shape[axis] = len(move.scale)
            scale = torch.as_tensor(move.scale, dtype=seen.dtype, device=self.capture.device).view(shape)
            value = self.graph.call_function(operator.mul, (value, self._attribute("scale", scale)))
        return value

    def _input_axis(self) -> int:
        return self.axis.get(self.capture.input, self.capture.seen[self.capture.input].rank - 1)

    # ---- steps

    def _step(self, step: Step) -> fx.Node:
        if step.node.kind == "input":
            return self.graph.placeholder(step.name)
        shared_sum = self._shared_sum(step)
        if shared_sum is not None:
            return shared_sum
        inputs = [self._edge(step, i) for i in range(len(step.edges))]
        if step.name == OUTPUT:
            return self.graph.call_function(tuple, (inputs,))
        node = self.by_name[step.name]
        op = self.capture.ops[node]
        self._count(step, op)
        if step.placement.dense and op.kind == "flatten":  # (B, ...) -> (B, features) on the frame's batch, which
            return self.graph.call_function(torch.flatten, (inputs[0], 1))  # the model's view(B, -1) does not know
        if step.placement.dense:
            return self._as_model(op, inputs)
        return self._compact(step, op, inputs)

    def _shared_sum(self, step: Step) -> fx.Node | None:
        """``member + shared`` where the shared tensor is repeated for every member: added by broadcasting its one
        block instead of copying it m times (a residual connection around the first masked block)."""
        node = self.by_name.get(step.name)
        op = self.capture.ops.get(node) if node is not None else None
        if op is None or step.node.kind != "combine" or step.placement.dense or step.placement.shared or self.m < 2:
            return None
        if node is None or node.target not in (operator.add, torch.add, operator.iadd) or node.kwargs:
            return None
        for shared, other in ((0, 1), (1, 0)):
            (move, *rest) = step.edges[shared].moves or (None,)
            if move is None or rest or move.repeats != self.m or move.index is None:
                continue
            source = self.values[step.edges[shared].source]
            block = move.index[: len(move.index) // self.m]
            if not np.array_equal(block, np.arange(self.program.step(step.edges[shared].source).placement.width)):
                index = torch.as_tensor(block, dtype=torch.long, device=self.capture.device)
                axis = self.axis[cast(fx.Node, self.by_name[step.edges[shared].source])]
                source = self.graph.call_function(ops.gather_channels, (source, axis, self._attribute("index", index)))
            value = self._edge(step, other)
            self._count(step, op)
            result = self.graph.call_function(ops.add_shared, (value, source, self.m, op.axis))
            seen, member = self.capture.seen, op.tensors[other]
            if (seen[member].shapes[0], seen[member].dtype) == (seen[node].shapes[0], seen[node].dtype):
                self.same_shape[result] = (0,)  # it may be computed in place on the members' tensor
            return result
        return None

    def _as_model(self, op: _Op, inputs: list[fx.Node], constants: Callable[[Tensor], Any] | None = None) -> fx.Node:
        """The model's own operation on the given values of its model inputs (dense, or compacted elementwise)."""
        node = op.node
        given = dict(zip(op.tensors, inputs, strict=True))
        if _in_place(node, self.capture.gm) and node.args and node.args[0] in given:
            mutated = cast(fx.Node, node.args[0])
            given[mutated] = self.graph.call_method("clone", (given[mutated],))

        def argument(a: fx.Node) -> Any:
            if a in given:
                return given[a]
            if (
                constants is not None
                and a not in self.capture.dynamic
                and isinstance(self.capture.constants.get(a), Tensor)
            ):
                return constants(self.capture.constants[a])
            return self._scalar(a)

        args = fx.node.map_arg(node.args, argument)
        kwargs = fx.node.map_arg(node.kwargs, argument)
        target: Any = node.target
        if node.op == "call_module":
            target = self._module(str(node.target))
        elif node.op == "call_method" and target in RESHAPING_VIEWS and not _dtype_view(node):
            target = RESHAPING_VIEWS[target]  # the values a view gives, on tensors laid out unlike the dense model's
        elif node.op == "call_function" and target in IN_PLACE_OPERATORS and constants is not None:
            target = IN_PLACE_OPERATORS[target]
        elif (
            node.op == "call_method"
            and constants is not None
            and str(target).endswith("_")
            and not str(target).endswith("__")
        ):
            target = str(target)[:-1]
        return self.graph.create_node(node.op, target, args, kwargs)

    def _compact(self, step: Step, op: _Op, inputs: list[fx.Node]) -> fx.Node:
        kind, placement = step.node.kind, step.placement
        member = not placement.shared and self.m > 1
        if kind == "masks" or op.how == "identity":
            return inputs[0]
        if kind in ("mixing", "grouped"):
            return self._mixing(step, op, inputs[0])
        if op.how == "affine":
            assert op.weight is not None and op.bias is not None
            scale = _per_channel(op.weight, placement.layouts, 1.0)
            shift = _per_channel(op.bias, placement.layouts, 0.0)
            affine = ops.Affine(scale, shift, op.axis, self.capture.seen[op.node].rank)
            return self._call("affine", affine, inputs[0])
        if op.how == "prelu":
            weight = _per_channel(cast(nn.PReLU, op.module).weight.detach(), placement.layouts, 0.0)
            return self.graph.call_function(F.prelu, (inputs[0], self._attribute("prelu", weight)))
        if kind == "concat":
            parts = [value for value, edge in zip(inputs, step.edges, strict=True) if edge.placement.width > 0]
            if member:
                return self.graph.call_function(ops.concat_members, (parts, self.m, op.axis))
            return self.graph.call_function(torch.cat, (parts, op.axis))
        if kind == "norm":
            return self._norm(op, inputs[0], member) if member else self._as_model(op, inputs)
        if kind == "flatten":
            last = step.node.channels_last
            if last and member:
                return self.graph.call_function(ops.flatten_members_last, (inputs[0], self.m))
            return self.graph.call_function(torch.flatten, (inputs[0], 1))
        if kind == "combine" and len(inputs) == 2:
            return self._note_same_shape(op, inputs, self._as_model(op, inputs, constants=lambda t: t))
        result = self._as_model(op, inputs, constants=lambda t: self._laid_out(t, step, op))
        return self._note_same_shape(op, inputs, result)

    def _note_same_shape(self, op: _Op, inputs: list[fx.Node], result: fx.Node) -> fx.Node:
        """Record which arguments of a sum or product ``result`` have its shape and dtype (it may be computed in
        place on one of them)."""
        if result.op != "call_function" or result.target not in (operator.add, operator.mul) or result.kwargs:
            return result
        seen = self.capture.seen
        like_result = {
            value for value, tensor in zip(inputs, op.tensors, strict=True)
            if (seen[tensor].shapes[0], seen[tensor].dtype) == (seen[op.node].shapes[0], seen[op.node].dtype)
        }  # fmt: skip
        self.same_shape[result] = tuple(i for i, argument in enumerate(result.args) if argument in like_result)
        return result

    def _laid_out(self, constant: Tensor, step: Step, op: _Op) -> fx.Node:
        """A constant operand of an elementwise operation, with its channels laid out like the compacted tensor."""
        rank = self.capture.seen[op.node].rank
        at = op.axis - (rank - constant.dim())
        if 0 <= at < constant.dim() and constant.shape[at] > 1:
            index, _ = channel_indices(step.placement.layouts)
            constant = constant.index_select(at, torch.as_tensor(index, device=constant.device))
        return self._attribute("operand", constant)

    def _mixing(self, step: Step, op: _Op, value: fx.Node) -> fx.Node:
        assert op.weight is not None
        rows = step.placement.layouts
        member = not step.placement.shared and self.m > 1
        bias = None if op.bias is None else _per_channel(op.bias, rows, 0.0)
        if step.node.kind == "grouped":
            index, valid = channel_indices(rows)
            weight = op.weight[torch.as_tensor(index, device=op.weight.device)]
            keep = torch.as_tensor(valid, device=weight.device).view(-1, *([1] * (weight.dim() - 1)))
            weight = torch.where(keep, weight, torch.zeros((), dtype=weight.dtype, device=weight.device))
            groups = step.groups * (len(rows) if not step.placement.shared else 1)
        else:
            cols = step.edges[0].placement.member_layouts(len(rows))
            r, c, valid = block_indices(rows, cols)
            picked = op.weight[torch.as_tensor(r), torch.as_tensor(c)]
            keep = torch.as_tensor(valid, device=picked.device).view(*valid.shape, *([1] * (op.weight.dim() - 2)))
            blocks = torch.where(keep, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
            if op.how == "linear" and member:
                shape = self.capture.seen[op.node].shapes[0]  # rows per call: at the example's batch, or chunk
                count = math.prod(shape[:-1]) * self.samples // self.capture.seen[self.capture.input].shapes[0][0]
                return self._call("linear", ops.MemberLinear(blocks, bias, per_member=count >= PER_MEMBER_ROWS), value)
            weight = blocks.flatten(0, 1)
            groups = len(rows) if member else 1
        if op.how == "linear":
            linear = nn.Linear(
                weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
            )
            _load(linear, weight, bias)
            return self._call("linear", linear, value)
        settings = op.conv
        conv_type = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[settings["dims"]]
        conv = conv_type(
            weight.shape[1] * groups, weight.shape[0], cast(Any, tuple(weight.shape[2:])), stride=settings["stride"],
            padding=settings["padding"], dilation=settings["dilation"], groups=groups, bias=bias is not None,
            padding_mode=settings["padding_mode"], device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        _load(conv, weight, bias)
        memory_format = {4: torch.channels_last, 5: torch.channels_last_3d}.get(weight.dim())
        if memory_format is not None:
            conv = conv.to(memory_format=memory_format)  # type: ignore[call-overload]
            value = self.graph.call_method("contiguous", (value,), {"memory_format": memory_format})
        return self._call("conv", conv, value)

    def _norm(self, op: _Op, value: fx.Node, member: bool) -> fx.Node:
        node, module = op.node, op.module
        if isinstance(module, nn.LayerNorm) or node.target is F.layer_norm:
            if isinstance(module, nn.LayerNorm):
                weight, bias, eps = module.weight, module.bias, module.eps
            else:
                c = self.capture
                weight, bias, eps = (
                    c.argument(node, "weight", 2),
                    c.argument(node, "bias", 3),
                    c.argument(node, "eps", 4, 1e-5),
                )
            args = (value, self.m, self._optional(weight), self._optional(bias), eps)
            return self.graph.call_function(ops.layer_norm_members, args)
        if isinstance(module, nn.GroupNorm):
            groups, weight, bias, eps = module.num_groups, module.weight, module.bias, module.eps
        else:
            c = self.capture
            groups, weight, bias = (
                c.argument(node, "num_groups", 1),
                c.argument(node, "weight", 2),
                c.argument(node, "bias", 3),
            )
            eps = c.argument(node, "eps", 4, 1e-5)
        return self.graph.call_function(
            ops.group_norm_members, (value, self.m, groups, self._optional(weight), self._optional(bias), eps)
        )

    def _optional(self, tensor: Any) -> fx.Node | None:
        return None if tensor is None else self._attribute("norm", tensor.detach())

    def _count(self, step: Step, op: _Op) -> None:
        """Multiply-adds of Linear, convolution and attention nodes: as m dense models, as emitted."""
        seen = self.capture.seen[op.node]
        seen = seen.parts[0] if seen.parts else seen  # nn.MultiheadAttention: (output, weights or None)
        if not seen.tensor or len(seen.batch_axes) != 1:
            return
        per_sample = seen.per_sample
        if step.node.kind == "fallback":
            dense = _fallback_macs(op, self.capture, per_sample) * self.m
            self.macs["dense"] += dense
            self.macs["packed"] += dense
            self.macs["fallback"] += dense
            return
        if op.weight is None or op.how not in ("linear", "conv"):
            return
        per_output = math.prod(op.weight.shape[1:])
        dense = per_sample * per_output * self.m
        self.macs["dense"] += dense
        outputs = per_sample
        positions = outputs // seen.shapes[0][op.axis]
        copies = 1 if step.placement.shared else self.m
        width = step.placement.width
        if step.node.kind == "grouped":
            self.macs["packed"] += positions * copies * width * math.prod(op.weight.shape[1:])
        else:
            inputs = step.edges[0].placement.width
            self.macs["packed"] += positions * copies * width * inputs * math.prod(op.weight.shape[2:])

    # ---- in place where nothing else reads

    def _in_place(self) -> None:
        """Run elementwise operations, BatchNorm maps and sums in place on tensors that this graph made and that
        nothing else reads (fresh allocations of large activations cost more than the operations themselves)."""
        for node in list(self.graph.nodes):
            module = self.root.get_submodule(str(node.target)) if node.op == "call_module" else None
            if not node.args or (not self._owned(node.args[0]) and node not in self.same_shape):
                continue
            if isinstance(module, ops.Affine):
                module.inplace = True
            elif isinstance(module, nn.GELU) or (node.op == "call_function" and node.target is F.gelu):
                approximate = module.approximate if isinstance(module, nn.GELU) else node.kwargs.get("approximate")
                if len(node.args) == 1 and set(node.kwargs) <= {"approximate"}:
                    with self.graph.inserting_before(node):
                        gelu = self.graph.call_function(
                            torch.ops.aten.gelu_, node.args, {"approximate": approximate or "none"}
                        )
                    node.replace_all_uses_with(gelu)
                    self.graph.erase_node(node)
            elif _activation(module):
                twin = copy.copy(module)
                twin.inplace = True  # type: ignore[union-attr]
                name = f"{node.target}_inplace"
                self.root.add_module(name, twin)
                node.target = name
            elif node.op == "call_function" and node.target in IN_PLACE_FUNCTIONS:
                if len(node.args) == 1 and not node.kwargs:
                    node.target = IN_PLACE_FUNCTIONS[node.target]
            elif node.op == "call_function" and node.target in INPLACE_KEYWORD:
                if ("inplace" not in node.kwargs and len(node.args) == 1) or node.kwargs.get("inplace") is False:
                    node.kwargs = {**node.kwargs, "inplace": True}
            elif node.target is ops.add_shared:
                if node in self.same_shape and self._owned(node.args[0]):
                    node.target = ops.add_shared_
            elif node in self.same_shape:
                for i in self.same_shape[node]:
                    if self._owned(node.args[i]):
                        name = "add_" if node.target is operator.add else "mul_"
                        with self.graph.inserting_before(node):
                            replacement = self.graph.call_method(name, (node.args[i], node.args[1 - i]))
                        node.replace_all_uses_with(replacement)
                        self.graph.erase_node(node)
                        break

    def _member_major(self) -> None:
        """Hold each member's rows as one block, (m, ..., C), where a members' Linear layer reads or writes it
        without a copy: between two of them joined only by elementwise activations, from one into the
        member-stacked batch (``to_batch`` is then a view) and from the member-stacked batch through a channel
        gather into one (the gather picks each member's channels in its block)."""
        for node in list(self.graph.nodes):
            if self._member_linear(node):
                self._member_major_after(node)
            elif node in self.last_axis_frames and node.target is ops.to_channels:
                self._member_major_gather(node)

    def _member_major_after(self, node: fx.Node) -> None:
        current, chain = node, list[fx.Node]()
        while len(current.users) == 1:
            (user,) = current.users
            if self._member_linear(user) and user.args[0] is current:
                self._linear(node).member_major_out = self._linear(user).member_major_in = True
                self.mlps.append((node, chain, user))
                return
            if user in self.last_axis_frames and user.target is ops.to_batch and current is node:
                self._linear(node).member_major_out = True
                with self.graph.inserting_before(user):
                    user.replace_all_uses_with(self.graph.call_method("flatten", (node, 0, 1)))
                self.graph.erase_node(user)
                return
            if not self._activation_of(user, current):
                return
            current = user
            chain.append(user)

    def _fuse_mlps(self) -> None:
        """Each members' Linear -> elementwise activations -> members' Linear becomes one ``MemberMLP`` (which runs
        them on tiles of rows on CPU)."""
        fused: set[fx.Node] = set()
        for first, chain, second in self.mlps:
            if first in fused:  # the second layer of the previous pair: that pair holds it
                continue
            graph = fx.Graph()
            copied = {first: graph.placeholder("hidden")}
            for node in chain:
                copied[node] = graph.node_copy(node, copied.__getitem__)
            graph.output(copied[chain[-1] if chain else first])
            modules = {str(n.target): self.root.get_submodule(str(n.target)) for n in chain if n.op == "call_module"}
            layers = self._linear(first), self._linear(second)
            for layer in layers:
                layer.per_member = False  # each tile runs one batched matmul
            activation = fx.GraphModule(modules, graph, class_name="Activation")
            name = f"mlp_{len(fused)}"
            self.root.add_module(name, ops.MemberMLP(layers[0], activation, layers[1]))
            with self.graph.inserting_before(second):
                second.replace_all_uses_with(self.graph.call_module(name, (first.args[0],)))
            for node in (second, *reversed(chain), first):
                self.graph.erase_node(node)
            fused.add(second)

    def _direct_outputs(self) -> None:
        """An output leaf read from the members' blocks by a view of them, without the member-stacked batch in
        between: ``members_first(to_batch(x))`` becomes ``members_first`` of ``x``'s channel axis, and
        ``members_first`` of a member-major members' Linear's flattened output that output itself. Fewer copies,
        and no reshape whose size guards stop ``torch.export`` with a dynamic batch."""
        unread: list[fx.Node] = []  # what the outputs read before, erased once nothing reads it
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target is not ops.members_first:
                continue
            source, members, axis = node.args
            held = source
            if source.op == "call_function" and source.target is operator.getitem:
                parts, i = source.args
                if parts.op == "call_function" and parts.target is tuple:
                    held = parts.args[0][i]
                    unread.append(parts)
            if held.op == "call_function" and held.target is ops.to_batch and held.args[1:3] == (members, axis):
                with self.graph.inserting_before(node):
                    direct = self.graph.call_function(ops.members_first, (held.args[0], members, held.args[3]))
            elif (
                held.op == "call_method" and held.target == "flatten" and held.args[1:] == (0, 1) and axis == 0
                and self._member_linear(held.args[0]) and self._linear(held.args[0]).member_major_out
            ):  # fmt: skip
                direct = held.args[0]
            else:
                continue
            node.replace_all_uses_with(direct)
            unread += [held, source, node]
        unread = list(dict.fromkeys(unread))
        while dead := [node for node in unread if not node.users]:
            for node in dead:
                self.graph.erase_node(node)
                unread.remove(node)

    def _member_major_gather(self, frame: fx.Node) -> None:
        """``to_channels`` -> (``gather_channels`` on the channel axis ->) a members' Linear: each member's block of
        the member-stacked batch read as it is (a view), or its channels gathered from there."""
        if len(frame.users) != 1:
            return
        (user,) = frame.users
        if self._member_linear(user) and user.args[0] is frame:
            with self.graph.inserting_before(frame):
                frame.replace_all_uses_with(self.graph.call_method("unflatten", (frame.args[0], 0, (self.m, -1))))
            self.graph.erase_node(frame)
            self._linear(user).member_major_in = True
            return
        gather = user
        if gather.target is not ops.gather_channels or len(gather.users) != 1 or gather.args[1] != frame.args[3]:
            return
        (linear,) = gather.users
        if not self._member_linear(linear) or linear.args[0] is not gather:
            return
        index = self.root.get_buffer(str(cast(fx.Node, gather.args[2]).target))
        channels, width = self.last_axis_frames[frame], index.numel() // self.m
        local = index.view(self.m, width) - torch.arange(self.m, device=index.device).view(-1, 1) * channels
        if index.numel() != self.m * width or bool(((local < 0) | (local >= channels)).any()):
            return
        with self.graph.inserting_before(gather):
            picked = self.graph.call_function(
                ops.gather_member_blocks, (frame.args[0], self.m, self._attribute("index", local))
            )
        gather.replace_all_uses_with(picked)
        self.graph.erase_node(gather)
        self.graph.erase_node(frame)
        self._linear(linear).member_major_in = True

    def _linear(self, node: fx.Node) -> ops.MemberLinear:
        return cast(ops.MemberLinear, self.root.get_submodule(str(node.target)))

    def _member_linear(self, node: fx.Node) -> bool:
        return node.op == "call_module" and isinstance(self.root.get_submodule(str(node.target)), ops.MemberLinear)

    def _activation_of(self, node: fx.Node, value: fx.Node) -> bool:
        """``node`` is an elementwise activation of ``value`` alone (its other arguments constants), whatever the
        layout of ``value``."""
        if not node.args or node.args[0] is not value:
            return False
        others = [*node.args[1:], *node.kwargs.values()]
        if any(isinstance(other, fx.Node) for other in others):
            return False
        if node.op == "call_module":
            module = self.root.get_submodule(str(node.target))
            return _activation(module) and not any(True for _ in module.parameters())
        if node.op == "call_function":
            return node.target in IN_PLACE_RESULTS or (
                node.target in ELEMENTWISE_FUNCTIONS and node.target is not F.rrelu
            )
        return False

    def _owned(self, value: Any) -> bool:
        """A tensor only one node reads that this graph allocated (not the caller's input or a buffer), or a view of
        one or an in-place result on one, each read by one node only."""
        if not isinstance(value, fx.Node) or len(value.users) != 1:
            return False
        if value.op == "call_module":
            module = self.root.get_submodule(str(value.target))
            if getattr(module, "inplace", False) is True:
                return self._owned(value.args[0])
            return isinstance(module, FRESH_MODULES) or _activation(module)
        if value.op == "call_function":
            written = value.target in IN_PLACE_RESULTS or value.target is ops.add_shared_
            if written or value.kwargs.get("inplace") is True:
                return self._owned(value.args[0])
            return value.target in FRESH_FUNCTIONS or (
                value.target in (operator.add, operator.mul) and value in self.same_shape
            )
        if value.op == "call_method" and str(value.target) in ("add_", "mul_", *VIEW_METHODS):
            return self._owned(value.args[0])
        return False

    # ---- the result

    def _output(self, squeeze: bool) -> None:
        program, capture = self.program, self.capture
        final = program.step(program.output)
        value = self.values[program.output]
        if program.output == OUTPUT:
            structure = next(n for n in capture.gm.graph.nodes if n.op == "output").args[0]
            leaves = [leaf for leaf in _leaves(structure) if leaf in capture.values]
            results = {}
            for i, leaf in enumerate(leaves):
                part = self.graph.call_function(operator.getitem, (value, i))
                results[leaf] = self._members_first(part, capture.seen[leaf].batch_axis, squeeze)
            self.graph.output(fx.node.map_arg(structure, lambda n: results[n] if n in results else self._scalar(n)))
            return
        if final.placement.shared:
            if not squeeze:
                members = self.m if self.returned is None else len(self.returned)
                value = self.graph.call_function(ops.repeat_members, (value, members))
        else:
            node = self.by_name[program.output]
            axis = capture.seen[node].batch_axis if final.placement.dense else self.axis[node]
            value = self._members_first(value, axis, squeeze)
        self.graph.output(value)

    def _members_first(self, value: fx.Node, axis: int, squeeze: bool) -> fx.Node:
        if self.returned is not None:  # computed for every member, some returned
            first = self.graph.call_function(ops.members_first, (value, self.m, axis))
            picked = self.graph.call_function(operator.getitem, (first, self.returned))
            return self.graph.call_function(operator.getitem, (picked, 0)) if squeeze else picked
        if squeeze:
            return value
        return self.graph.call_function(ops.members_first, (value, self.m, axis))


def _fallback_macs(op: _Op, capture: _Capture, per_sample: int) -> int:
    """Multiply-adds per sample of one dense model's fallback node, where it is a Linear, a convolution, an
    nn.MultiheadAttention (projections and attention products), ``F.scaled_dot_product_attention`` or a matmul."""
    node = op.node
    if node.op == "call_module":
        module = capture.gm.get_submodule(str(node.target))
        if isinstance(module, (nn.Linear, *CONV_TYPES)):
            weight = module.weight
            return per_sample // weight.shape[0] * weight.numel()
        if isinstance(module, nn.MultiheadAttention):
            query, key = (_argument(node, i, name) for i, name in enumerate(("query", "key")))
            width = module.embed_dim
            tokens, keys = (capture.seen[value].per_sample // width for value in (query, key))
            return int(tokens * 4 * width * width + 2 * tokens * keys * width)
        return 0
    output = capture.seen[node].shapes[0]
    if node.target is F.scaled_dot_product_attention:
        q, k, v = (capture.seen[_argument(node, i, n)].shapes[0] for i, n in enumerate(("query", "key", "value")))
        return math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1]) * per_sample // math.prod(output)
    if node.target in MATMULS or (node.op == "call_method" and node.target in ("matmul", "bmm")):
        left = capture.seen[_argument(node, 0, "input")].shapes[0]
        return per_sample * left[-1]
    return 0


def _argument(node: fx.Node, position: int, name: str) -> fx.Node:
    value = node.args[position] if len(node.args) > position else node.kwargs[name]
    return cast(fx.Node, value)


MATMULS = {torch.matmul, operator.matmul, torch.bmm}
# members' Linear layers on at least this many rows (at the example's batch size) run one matmul per member, reading
# and writing each member's block in place; fewer run one batched matmul (measured faster on CPU below ~1000 rows)
PER_MEMBER_ROWS = 1024
# a CPU program proven per-sample whose largest tensor exceeds twice this size runs on chunks of the batch where it is
# about this size: glibc hands blocks over 32 MiB straight back to the system, and every call page-faults on them
CHUNK_BYTES = 16 * 2**20


# producers whose result is a new tensor, and elementwise functions with an in-place form
FRESH_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, ops.MemberLinear, ops.Affine)
FRESH_FUNCTIONS = {
    ops.gather_channels, ops.add_shared, ops.concat_members, ops.layer_norm_members, ops.group_norm_members,
    torch.relu, torch.sigmoid, torch.tanh, F.relu, F.gelu, F.silu, F.hardswish, F.hardsigmoid, F.prelu,
}  # fmt: skip
IN_PLACE_FUNCTIONS = {torch.relu: torch.relu_, torch.sigmoid: torch.sigmoid_, torch.tanh: torch.tanh_}
IN_PLACE_RESULTS = {*IN_PLACE_FUNCTIONS.values(), torch.ops.aten.gelu_}  # return their first argument, written
VIEW_METHODS = ("permute", "transpose", "view", "reshape", "flatten", "unflatten", "movedim", "contiguous")
INPLACE_KEYWORD = {F.relu, F.relu6, F.silu, F.hardswish, F.hardsigmoid, F.leaky_relu, F.elu, F.selu, F.celu, F.mish}


# views whose strides the packed program does not keep as the dense model has them (channels-last convolutions, the
# member-stacked batch): reshapes give the same values, copying where a view cannot
RESHAPING_VIEWS = {"view": "reshape", "view_as": "reshape_as"}


def _dtype_view(node: fx.Node) -> bool:
    """``x.view(torch.float16)``: a reinterpretation of the bits, not a reshape."""
    return any(isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values()))


def _activation(module: nn.Module | None) -> bool:
    """An elementwise activation module with an ``inplace`` switch."""
    return isinstance(module, ELEMENTWISE_MODULES) and isinstance(getattr(module, "inplace", None), bool)


def _bytes(array: np.ndarray | None) -> bytes | None:
    return None if array is None else array.tobytes()


def _per_channel(vector: Tensor, layouts: Sequence[np.ndarray], padding: float) -> Tensor:
    """A per-channel vector laid out like ``layouts`` (member blocks side by side), ``padding`` at padded positions."""
    index, valid = channel_indices(layouts)
    picked = vector.detach()[torch.as_tensor(index, device=vector.device)]
    return torch.where(torch.as_tensor(valid, device=vector.device), picked, torch.full_like(picked, padding))


def _load(module: nn.Module, weight: Tensor, bias: Tensor | None) -> None:
    with torch.no_grad():
        cast(Tensor, module.weight).copy_(weight)
        if bias is not None:
            cast(Tensor, module.bias).copy_(bias)
    for parameter in module.parameters():
        parameter.requires_grad_(False)


# ------------------------------------------------------------------------------------------------ the public API


class PackedMasksembles(fx.GraphModule):
    """Members of a Masksembles model on compacted weights, made by ``pack`` or ``extract_member``.

    A ``torch.fx.GraphModule``: ``print(packed.code)`` shows the program, and it compiles and exports like any
    module. ``forward``: (B, ...) -> (m, B, ...) for the m members it was built for, or (B, ...) for an extracted
    member. Inference only (eval semantics).
    """

    @property
    def members(self) -> tuple[int, ...]:
        """The members it computes (indices into the masks)."""
        return cast(tuple[int, ...], self.meta["masksembles"]["members"])

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The model's operations that run at full width on the member-stacked batch (nothing here compacts them)."""
        return cast(tuple[str, ...], self.meta["masksembles"]["fallbacks"])

    @property
    def program(self) -> str:
        """``"packed"`` (compacted where it can), or ``"dense"`` (the tiled model, measured faster by ``pack``)."""
        return cast(str, self.meta["masksembles"]["program"])

    @property
    def seconds(self) -> dict[str, float]:
        """What ``pack`` measured on the example input (median seconds per call of each program), or empty."""
        return cast(dict[str, float], self.meta["masksembles"]["seconds"])

    @property
    def choice(self) -> str:
        """Why ``pack(program="auto")`` returned this program, from its interleaved timings; empty otherwise."""
        return cast(str, self.meta["masksembles"]["choice"])

    @property
    def macs(self) -> dict[str, int]:
        """Multiply-adds per sample of the Linear and convolution layers and of attention (its products, which
        run at full width): ``dense`` (m dense models), ``packed`` (as emitted) and ``fallback`` (the part of
        ``packed`` that runs at full width); empty when the whole model runs tiled (see ``fallbacks``)."""
        return cast(dict[str, int], self.meta["masksembles"]["macs"])

    def extra_repr(self) -> str:
        if self.program == "dense":
            why = f"measured faster than packed: {self.seconds}" if self.seconds else "; ".join(self.fallbacks)
            return f"members={list(self.members)}, program=dense" + (f" ({why})" if why else "")
        shown = ", ".join(self.fallbacks[:8]) + (", ..." if len(self.fallbacks) > 8 else "")
        chunk = self.meta["masksembles"].get("chunk")
        return (
            f"members={list(self.members)}"
            + (f", in chunks of up to {chunk} samples" if chunk else "")
            + f", fallbacks={len(self.fallbacks)}"
            + (f": {shown}" if shown else "")
        )


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode while packing (BatchNorm statistics untouched); each one's mode restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _build(
    capture: _Capture,
    example: Tensor,
    chosen: Sequence[int],
    squeeze: bool,
    *,
    dense: bool = False,
    chunks: bool = True,
) -> PackedMasksembles:
    """One program from the capture: compacted where it can, or (``dense``) every node at full width."""
    capture.reset(dense)
    axis = _solve_axes(capture)
    nodes, output = _graph_nodes(capture, axis)
    program = plan_program(nodes, output, _planned(capture, chosen))
    samples = _samples_per_chunk(capture, program, example) if chunks else 0
    emitter = _Emitter(capture, axis, program, squeeze, samples or example.shape[0], chosen)
    packed = PackedMasksembles(emitter.root, emitter.graph, class_name="PackedMasksembles")
    if samples:
        packed = _in_chunks(packed, example, samples)
    fallbacks = tuple(
        _describe(capture.ops[emitter.by_name[name]].node, capture.gm) for name in program.fallbacks if name != OUTPUT
    )
    packed.meta["masksembles"] = {
        "members": tuple(chosen), "fallbacks": fallbacks, "macs": dict(emitter.macs),
        "program": "dense" if dense else "packed", "seconds": {}, "chunk": samples, "choice": "", "squeeze": squeeze,
    }  # fmt: skip
    return packed.eval()


def _planned(capture: _Capture, chosen: Sequence[int]) -> list[int]:
    """The members to compute for ``chosen``: every member where a node runs per member on the member-stacked batch
    because it reads the batch (its size, as ``x.shape[0]`` or ``arange(B)``, or other samples, as a mean over the
    batch): in the dense model that batch holds every member's copy. A Masksembles layer that falls back needs no
    other member (the program's copy of it holds the computed members' masks, ``_Emitter._module``)."""
    per_member = any(
        op.kind == "fallback" and op.batch_dependent and not capture.is_masksembles(op.node)
        for op in capture.ops.values()
    )
    return list(range(capture.n)) if per_member else list(chosen)


def _samples_per_chunk(capture: _Capture, program: Program, example: Tensor) -> int:
    """How many samples a CPU program runs at a time, so that no tensor it makes is much over ``CHUNK_BYTES`` (large
    fresh buffers page-fault on every call); 0 for one call on the whole batch, as when its largest tensor is at most
    twice that at the example's batch size. Only a program proven to compute each sample's outputs from that sample
    alone is split: what falls back is an operation known to keep samples apart (``_keeps_samples``), every tensor
    the input reaches has one axis of exactly the batch size or none, no tensor without one is made from one with one
    (a reduction over the batch), none with one from none unless it broadcasts a tensor along it (a tensor built from
    the batch size), and every output has one."""
    by_name = {node.name: node for node in capture.gm.graph.nodes}
    fallbacks = [by_name[name] for name in program.fallbacks if name != OUTPUT]
    if example.device.type != "cpu" or not all(_keeps_samples(capture, node) for node in fallbacks):
        return 0
    batch, largest = example.shape[0], 1

    def follows(seen: _Seen) -> bool | None:  # True: the batch is its one axis; False: no batch axis; None: neither
        if seen.parts:
            kinds = {follows(part) for part in seen.parts}
            return None if None in kinds or len(kinds) > 1 else kinds.pop()
        if not seen.tensor:
            return False
        axes = seen.batch_axes
        if not axes:
            return False
        if len(axes) != 1 or seen.shapes[0][axes[0]] != batch or seen.shapes[1][axes[0]] != batch + 1:
            return None
        nonlocal largest
        largest = max(largest, seen.per_sample * (seen.dtype.itemsize if seen.dtype else 4))
        return True

    for node in capture.dynamic:
        if node.op == "output":
            leaves = [leaf for leaf in _leaves(node.args[0]) if isinstance(leaf, fx.Node)]
            if not leaves or not all(follows(capture.seen[leaf]) for leaf in leaves):
                return 0
            continue
        seen = capture.seen[node]
        kind = follows(seen)
        if kind is None:
            return 0
        if node.op != "placeholder" and (seen.tensor or seen.parts):  # sizes and other values: each chunk its own
            inputs = [follows(capture.seen[n]) for n in node.all_input_nodes if n in capture.dynamic]
            if None in inputs or (kind != any(inputs) and not (kind and _broadcast(capture, node))):
                return 0
    total = largest * len(program.members) * batch  # at most: every member's tensor as wide as the dense one
    if total <= 2 * CHUNK_BYTES:
        return 0
    return -(-batch // -(-total // CHUNK_BYTES))  # the batch in ceil(total / CHUNK_BYTES) chunks of equal size


def _batch_axis(capture: _Capture, node: fx.Node) -> int | None:
    seen = capture.seen[node]
    return seen.batch_axis if node in capture.dynamic and seen.tensor and seen.batch_axis >= 0 else None


def _called(node: fx.Node) -> str:
    """The name of the function or method a node calls ("" for a module, whose name says nothing of what it does)."""
    return "" if node.op == "call_module" else _target_name(node)


def _broadcast(capture: _Capture, node: fx.Node) -> bool:
    """``expand``/``broadcast_to`` whose batch axis is a broadcast of its input (a new axis or one of size 1): every
    sample gets the same values, whatever its place in the batch (a class token expanded to the batch)."""
    if _called(node) not in ("expand", "broadcast_to") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    axis, source = _batch_axis(capture, node), capture.seen[node.args[0]]
    if axis is None or not source.tensor:
        return False
    position = axis - (capture.seen[node].rank - source.rank)  # shapes align on the right
    return position < 0 or source.shapes[0][position] == 1


def _keeps_samples(capture: _Capture, node: fx.Node) -> bool:
    """An operation that falls back yet computes each sample from that sample alone, given that its tensors have
    one batch axis each (``_samples_per_chunk`` checks that): a tuple's element, ``unbind`` of another axis, a
    ``reshape``/``view`` with the batch first before and after (row-major order keeps each sample's block), a
    broadcast along the batch, a concatenation along another axis, a softmax over another axis, and attention or a
    matmul of two activations of one rank whose batch axes are the same leading one (they mix the last two axes
    only). Anything else is not proven and keeps the whole batch in one call."""
    name = _called(node)
    tensors = [n for n in node.all_input_nodes if n in capture.dynamic and capture.seen[n].tensor]
    axes = [_batch_axis(capture, n) for n in tensors]
    out = _batch_axis(capture, node)
    if node.op == "call_function" and node.target is operator.getitem:
        return bool(node.args) and isinstance(node.args[0], fx.Node) and bool(capture.seen[node.args[0]].parts)
    if name == "unbind" and len(tensors) == 1 and axes[0] is not None:
        dim = capture.argument(node, "dim", 1, 0)
        return isinstance(dim, int) and dim % capture.seen[tensors[0]].rank != axes[0]
    if name in ("reshape", "view") and len(tensors) == 1:
        return axes == [0] and out == 0
    if name in ("expand", "broadcast_to"):
        return _broadcast(capture, node) or (
            len(tensors) == 1
            and axes[0] is not None
            and out is not None
            and capture.seen[node].rank - out == capture.seen[tensors[0]].rank - axes[0]  # the same axis, aligned right
        )
    if node.target in (torch.cat, torch.concat):
        dim = capture.argument(node, "dim", 1, 0)
        rank = capture.seen[node].rank
        return out is not None and isinstance(dim, int) and dim % rank != out and all(a == out for a in axes)
    if node.target is F.scaled_dot_product_attention or (node.target in MATMULS and len(tensors) == 2):
        rank = capture.seen[tensors[0]].rank if tensors else 0
        return bool(axes) and all(
            a is not None and a == axes[0] and a < rank - 2 and capture.seen[t].rank == rank
            for a, t in zip(axes, tensors, strict=True)
        )
    if name in ("softmax", "log_softmax") and len(tensors) == 1 and axes[0] is not None:
        dim = capture.argument(node, "dim", 1)
        return isinstance(dim, int) and dim % capture.seen[tensors[0]].rank != axes[0]
    return False


def _in_chunks(packed: PackedMasksembles, example: Tensor, samples: int) -> PackedMasksembles:
    """``packed`` run on chunks of at most ``samples`` samples by a module that holds it as ``per_chunk``."""
    with torch.no_grad():
        axes = ops.leaf_batch_axes(packed(example[:1]), packed(example[:2]), 1)
    root = nn.Module()
    root.per_chunk = fx.GraphModule(packed, packed.graph, class_name="PerChunk")
    graph = fx.Graph()
    result = graph.call_function(ops.in_chunks, (graph.get_attr("per_chunk"), graph.placeholder("x"), samples, axes))
    graph.output(result)
    return PackedMasksembles(root, graph, class_name="PackedMasksembles")


def _chosen(members: Sequence[int] | None, n: int) -> list[int]:
    chosen = list(range(n)) if members is None else list(members)
    for k in chosen:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
            raise ValueError(f"member must be an integer in [0, {n}); received {k!r}")
    return chosen


def _member_outputs(model: nn.Module, x: Tensor, n: int) -> tuple[Any, tuple[int, ...]]:
    """The model's output on ``x`` tiled ``n`` times (what ``predict`` runs) and each output leaf's batch axis (-1 for
    a leaf without one), found from a second run on one more sample."""
    with torch.no_grad():
        small = model(ops.tile(x, n, 0))
        large = model(ops.tile(torch.cat([x, x[:1]]), n, 0))
    return small, ops.leaf_batch_axes(small, large, n * x.shape[0])


def _whole_model(model: nn.Module, example: Tensor, chosen: Sequence[int], squeeze: bool, n: int) -> PackedMasksembles:
    """The model itself (a copy, in eval mode) on the member-stacked batch: what ``predict`` computes, with every
    output leaf's batch axis found by running two batch sizes. The caller says why in ``fallbacks``."""
    whole = copy.deepcopy(model).eval().requires_grad_(False)
    _, axes = _member_outputs(whole, example, n)
    root = nn.Module()
    root.model = whole
    graph = fx.Graph()
    tiled = graph.call_function(ops.tile, (graph.placeholder("x"), n, 0))
    result = graph.call_function(ops.select_members, (graph.call_module("model", (tiled,)), n, axes, chosen, squeeze))
    graph.output(result)
    packed = PackedMasksembles(root, graph, class_name="PackedMasksembles")
    packed.meta["masksembles"] = {
        "members": tuple(chosen), "fallbacks": (), "macs": {}, "program": "dense", "seconds": {}, "choice": "",
        "squeeze": squeeze,
    }  # fmt: skip
    return packed.eval()


def _leaf_arrays(tree: Any) -> tuple[list[np.ndarray], list[float]]:
    """An output's leaves as NumPy arrays (floats as float64), and each one's machine epsilon (0: compared exactly)."""
    arrays, eps = [], []
    for leaf in ops.leaves(tree):
        if isinstance(leaf, Tensor):
            floating = leaf.is_floating_point() or leaf.is_complex()
            arrays.append(leaf.detach().cpu().to(torch.float64 if floating else leaf.dtype).numpy())
            eps.append(torch.finfo(leaf.dtype).eps if floating else 0.0)
        else:
            arrays.append(np.asarray(leaf, dtype=object))
            eps.append(0.0)
    return arrays, eps


class _Verifier:
    """Checks built programs against ``predict`` on the first ``VERIFY_SAMPLES`` samples of the example input."""

    def __init__(self, model: nn.Module, example: Tensor, n: int, chosen: Sequence[int], squeeze: bool) -> None:
        self.x = example[:VERIFY_SAMPLES]
        output, axes = _member_outputs(model, self.x, n)
        self.expected = _leaf_arrays(ops.select_members(output, n, axes, chosen, squeeze))

    def mismatch(self, packed: nn.Module) -> str | None:
        """Why ``packed`` differs from ``predict`` on the sample, or None."""
        try:
            with torch.no_grad():
                actual = _leaf_arrays(packed(self.x))
        except Exception as error:  # a program that fails where the model runs differs from it
            return f"it raised {type(error).__name__}: {error}"
        return output_mismatch(self.expected[0], actual[0], self.expected[1])


def _verified(
    packed: PackedMasksembles,
    verifier: _Verifier | None,
    full_width: Callable[[], PackedMasksembles],
    model: nn.Module,
    capture: _Capture,
) -> PackedMasksembles:
    """``packed`` if it equals ``predict``; otherwise every node at full width (``full_width()``), or the whole model
    tiled when that differs too, with the reason first in ``fallbacks``."""
    if verifier is None or (why := verifier.mismatch(packed)) is None:
        return packed
    reason = f"{VERIFICATION}: the {packed.program} program differed from predict on the example input ({why})"
    if packed.program == "packed":
        dense = full_width()
        if (also := verifier.mismatch(dense)) is None:
            dense.meta["masksembles"]["fallbacks"] = (f"{reason}; every node runs at full width", *dense.fallbacks)
            return dense
        reason += f"; so did every node at full width ({also})"
    whole = _whole_model(model, verifier.x, packed.members, packed.meta["masksembles"]["squeeze"], capture.n)
    whole.meta["masksembles"]["fallbacks"] = (f"{reason}: the whole model runs tiled",)
    return whole


def _seconds(modules: Mapping[str, nn.Module], x: Tensor, rounds: int = AUTO_ROUNDS) -> dict[str, list[float]]:
    """Wall time of each module on ``x`` in interleaved rounds (``masksembles_core.packing.timed_rounds``)."""

    def call(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                module(x)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)

        return run

    return timed_rounds({name: call(module) for name, module in modules.items()}, rounds=rounds)


def _packed(
    model: nn.Module, example_input: Tensor, members: Sequence[int] | None, squeeze: bool, program: str, verify: bool
) -> PackedMasksembles:
    """``pack``/``extract_member``: capture once, build the program(s), verify, and choose."""
    check_program(program)
    with _eval_mode(model):
        try:
            capture = _Capture(model, example_input)
        except _SharedInPlace as error:
            n = _members_of([layer for layer in model.modules() if isinstance(layer, Masksembles)])
            whole = _whole_model(model, example_input, _chosen(members, n), squeeze, n)
            whole.meta["masksembles"]["fallbacks"] = (f"the whole model, tiled: {error}",)
            return whole
        chosen = _chosen(members, capture.n)
        verifier = _Verifier(model, example_input, capture.n, chosen, squeeze) if verify else None

        def candidate(*, dense: bool = False, chunks: bool = True) -> PackedMasksembles:
            def build(dense: bool) -> PackedMasksembles:
                return _build(capture, example_input, chosen, squeeze, dense=dense, chunks=chunks)

            return _verified(build(dense), verifier, functools.partial(build, True), model, capture)

        if program != "auto":
            return candidate(dense=program == "dense")
        packed = candidate()
        if packed.program == "dense":  # verification or the graph left nothing packed: nothing to choose
            return packed
        candidates = {"packed": packed, "dense": candidate(dense=True)}
        if packed.meta["masksembles"]["chunk"]:  # in one call too: faster where freed memory is kept for reuse
            candidates["packed, one call"] = candidate(chunks=False)
        times = _seconds(candidates, example_input)
        name, why = choose_program(times, "packed")
        result = candidates[name]
        result.meta["masksembles"]["seconds"] = {key: statistics.median(value) for key, value in times.items()}
        result.meta["masksembles"]["choice"] = why
        return result


def pack(model: nn.Module, example_input: Tensor, *, program: str = "auto", verify: bool = True) -> PackedMasksembles:
    """All members of ``model`` in one call on compacted weights: (B, ...) -> (n, B, ...).

    Equals ``predict(model, x, n)`` (eval semantics) for finite activations, at about the cost the masks' overlap
    allows instead of n dense forward passes. ``example_input`` is run through the traced model to record shapes; any
    batch size works afterwards. ``forward`` is called with the input tensor alone: its other arguments keep their
    defaults (a required one is refused). Any model torch.fx can trace in eval mode packs: what this module cannot
    compact runs at full width (listed in ``fallbacks``); a model whose graph cannot be rewritten out of place (an
    in-place operation on a view read after it) runs whole on the member-stacked batch (``program == "dense"``).

    Args:
        program: ``"packed"`` (compacted where it can; on CPU, on chunks of the batch where its tensors are large
            and it is proven per-sample), ``"dense"`` (the tiled dense model as one graph: every node as the model
            runs it, on the member-stacked batch), or ``"auto"`` (the default: both, and the packed program in one
            call where it would run in chunks, are timed in interleaved rounds on ``example_input``; the packed
            program is kept unless another was clearly faster (``masksembles_core.packing.choose_program``);
            ``seconds`` holds the medians and ``choice`` the reason; give an example of the batch size you will run).
        verify: compare the program with ``predict`` on the first few samples of ``example_input`` before returning
            it (the default). One that differs beyond float rounding is never returned: every node then runs at full
            width, or the whole model tiled, and the first entry of ``fallbacks`` says why. ``False`` skips it.

    Raises:
        ValueError: the model cannot be traced, needs more than one input, has no Masksembles layer, or holds
            Masksembles layers of different n.
    """
    return _packed(model, example_input, None, False, program, verify)


def extract_member(model: nn.Module, k: int, example_input: Tensor, *, verify: bool = True) -> PackedMasksembles:
    """Member ``k`` of ``model`` as a standalone dense model: (B, ...) -> (B, ...).

    Every layer next to a Masksembles layer is physically shrunk to member ``k``'s live channels; the output equals
    group ``k``'s output of the masked model (eval semantics, finite values), verified as in ``pack``. Same support and
    errors as ``pack``.
    """
    return _packed(model, example_input, [k], True, "packed", verify)
