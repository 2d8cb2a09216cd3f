"""The first step of ``pack``: the model as torch.fx sees it, and what each operation is.

The model is traced in eval mode (``forward``'s optional arguments at their defaults), in-place operations are
rewritten out of place, and the graph is run on the example input at two batch sizes: every tensor's shape and batch
axis (``_Seen``). Each operation that reads the input is then classified as a ``masksembles_core.packing`` kind
(``_Op``): what this module knows how to compact, or a fallback that runs as the dense model runs it. "Zero stays
zero" and the moves of the channel axis are evaluated on the operation itself, with its own arguments
(``_evaluate``), never read from a name.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.fx.graph import _PyTreeInfo
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from masksembles_core.captured import CapturedOp, Probed
from masksembles_core.packing import (
    norm_affine,
)

from . import _packed_ops as ops
from ._layers import Masksembles
from ._pack_export import exported, flat_inputs
from ._pack_fuse import fuse_mean_ratios, fuse_patch_rows, fuse_patches
from ._pack_modules import write_out_torch_modules
from ._structures import Inputs, batch_size, batched_tensors, call, map_batched

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
    torch.sign, operator.neg, operator.abs, operator.pos, torch.addcmul, torch.addcdiv,
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


REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "norm", "linalg_vector_norm"}


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


class _Tracer(fx.Tracer):
    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, Masksembles) or super().is_leaf_module(module, qualified_name)


def _target_name(node: fx.Node) -> str:
    return str(node.target) if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))


def _called(node: fx.Node) -> str:
    """The name of the function or method a node calls ("" for a module, whose name says nothing of what it does)."""
    return "" if node.op == "call_module" else _target_name(node)


def _describe(node: fx.Node, root: nn.Module) -> str:
    """A node as a user recognizes it: a module by its path and type, a call by its function and enclosing module."""
    if node.op == "call_module":
        return f"{node.target} ({type(root.get_submodule(str(node.target))).__name__})"
    stack = node.meta.get("nn_module_stack") or {}
    where = f"{next(reversed(stack))}: " if stack else ""
    return f"{where}{_target_name(node)} (node {node.name!r})"


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


def _wrapped_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The calls on the input's data to a plain Python function of the model's own code, which torch.fx records as
    one node only where it is registered with ``torch.fx.wrap`` (torchvision's ``shifted_window_attention``,
    ``_patch_merging_pad``): anything else it records is a torch function, method or operator. Such a call is opaque
    to the rules (one fallback at full width). torchvision wraps those functions because they branch in Python on
    sizes (``if window_size[0] >= pad_H``), which torch.fx cannot trace into with symbolic sizes, and tracing them at
    the example's sizes would fix the batch size. ``torch.export`` runs that Python with the batch symbolic and the
    other sizes as they are, so it records the operations of the branch taken (guarded on the shapes), each then
    classified by its own rule (``_Capture`` uses it for such a model). Not counted: the package's own functions
    and the per-sample dropouts (``PER_SAMPLE_DROPOUTS``, the identity in eval by their rule)."""
    reads_input = {node for node in gm.graph.nodes if node.op == "placeholder"}
    wrapped = []
    for node in gm.graph.nodes:
        if not any(a in reads_input for a in node.all_input_nodes):
            continue
        reads_input.add(node)
        target = node.target
        module = getattr(target, "__module__", None) or ""
        if (
            node.op == "call_function"
            and inspect.isfunction(target)
            and module.partition(".")[0] not in ("torch", "masksembles_torch")
            and _target_name(node) not in PER_SAMPLE_DROPOUTS
        ):
            wrapped.append(node)
    return wrapped


def _exported(model: nn.Module, example: Inputs, traced: ValueError | None) -> tuple[fx.GraphModule, _PyTreeInfo]:
    """The model captured by ``torch.export`` (``_pack_export``), for inputs other than one tensor or a model
    torch.fx could not trace (``traced``: why)."""
    try:
        return exported(model, example)
    except Exception as error:  # torch.export raises many types for what it cannot capture
        held = _object_in_output(model, example)
        if held is not None:
            raise ValueError(held) from error
        why = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
        if traced is not None:
            raise ValueError(f"{traced}; torch.export failed too: {why}") from error
        raise ValueError(
            f"{PREFIX} need a model torch.export can capture in eval mode; exporting {type(model).__name__} failed: "
            f"{why}"
        ) from error


def _object_in_output(model: nn.Module, example: Inputs) -> str | None:
    """Why the model cannot be packed where its output on ``example`` holds an object other than tensors, numbers
    and strings (``transformers``' key-value cache, returned by default): a packed program returns tensors. None
    where it holds none (or the model fails on ``example``: the capture's own error says more)."""
    try:
        with torch.no_grad():
            output = call(model, example)
    except Exception:  # whatever the model raises, the capture's error is reported instead
        return None
    held = [leaf for leaf in pytree.tree_leaves(output) if not isinstance(leaf, Tensor | int | float | str | None)]
    if not held:
        return None
    name = type(model).__name__
    cache = "use_cache" in inspect.signature(model.forward).parameters or hasattr(
        getattr(model, "config", None), "use_cache"
    )
    return (
        f"{PREFIX} cannot return the {type(held[0]).__name__} object in {name}'s output on the example input (a "
        "packed program returns tensors): "
        + (
            "call the model with use_cache=False (add use_cache=False to the example input and to the packed "
            "model's calls)"
            if cache
            else "call it so that its output holds tensors only"
        )
    )


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
    macs: int = 0  # the multiply-adds the node ran per sample (FlopCounterMode's count, its flops / 2)

    @property
    def rank(self) -> int:
        return len(self.shapes[0])

    @property
    def batch_axes(self) -> tuple[int, ...]:
        """Axes whose size follows the batch."""
        return tuple(i for i, (a, b) in enumerate(zip(*self.shapes, strict=True)) if a != b)

    @property
    def per_sample(self) -> int:
        """Elements per sample of a tensor with one batch-proportional axis: the second probe's one more sample adds
        its rows there (one on the batch axis, L where each sample's L tokens are rows, (B*L, C))."""
        axis = self.batch_axes[0]
        before, after = self.shapes[0][axis], self.shapes[1][axis]
        return math.prod(self.shapes[0]) // before * (after - before)

    @property
    def batch_axis(self) -> int:
        """The one axis that follows the batch, if it is exactly the batch (else -1)."""
        axes = self.batch_axes
        if len(axes) == 1 and self.shapes[1][axes[0]] == self.shapes[0][axes[0]] + 1:
            return axes[0]
        return -1

    @property
    def sole_batch_axis(self) -> int:
        """The one axis that follows the batch (its rows: the batch, or (B*L, C) where tokens fold into it; unlike the
        core's ``Probed.rows_axis``, whether they hold whole samples is not asked: ``Probed.rows_per_sample``), else
        -1."""
        axes = self.batch_axes
        return axes[0] if len(axes) == 1 else -1

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
    """Runs the graph and keeps, per node, its summary, the flops it ran (``counter``: matmuls, convolutions and
    attention, whatever function calls them) and the values of the nodes in ``keep``."""

    def __init__(self, gm: fx.GraphModule, keep: set[fx.Node], counter: FlopCounterMode) -> None:
        super().__init__(gm)
        self.seen: dict[fx.Node, Any] = {}
        self.flops: dict[fx.Node, int] = {}
        self.keep, self.kept = keep, cast(dict[fx.Node, Any], {})
        self.counter = counter

    def run_node(self, n: fx.Node) -> Any:
        before = self.counter.get_total_flops()
        result = super().run_node(n)
        self.flops[n] = self.counter.get_total_flops() - before
        self.seen[n] = _summary(result)
        if n in self.keep:
            self.kept[n] = result.detach() if isinstance(result, Tensor) else result
        return result


def _probe(
    gm: fx.GraphModule, runs: Sequence[list[Any]], constants: set[fx.Node]
) -> tuple[dict[fx.Node, _Seen], dict[fx.Node, Any]]:
    """Run the graph on the example's inputs and on one more sample (``runs``: the placeholders' values of each);
    return what was seen (each node's multiply-adds per sample: what the one more sample added) and the constants'
    values."""
    probes = []
    with torch.no_grad():
        for index, values in enumerate(runs):
            probe = _Probe(gm, constants if index == 0 else set(), flop_counter())
            try:
                with counting(probe.counter):
                    probe.run(*[value.clone() if isinstance(value, Tensor) else value for value in values])
            except Exception as error:
                batch = next(value.shape[0] for value in values if isinstance(value, Tensor) and value.ndim)
                raise ValueError(
                    f"{PREFIX}: the traced model fails on the example input at batch {batch}: "
                    f"{type(error).__name__}: {error}"
                ) from error
            probes.append(probe)
    seen = {node: _merge(probes[0].seen[node], probes[1].seen[node]) for node in probes[0].seen}
    for node, found in seen.items():
        found.macs = (probes[1].flops[node] - probes[0].flops[node]) // 2
    return seen, probes[0].kept


def flop_counter() -> FlopCounterMode:
    """``FlopCounterMode`` that also counts the CPU's fused attention kernel, which it leaves out (0 flops for
    ``F.scaled_dot_product_attention`` on CPU), by the formula it has for the other fused kernels. Enter it with
    ``counting`` (``nn.MultiheadAttention``'s fused fast path, which it does not count either, turned off). Only
    the total is kept: its tracker of the modules, which hooks the backward of every module input that requires grad,
    is left out (it raised AssertionError on a view of a parameter made without gradients, which requires grad but
    has no gradient function: DeBERTa's relative embeddings, ``weight[: 2 * span].unsqueeze(0)``, into a masked
    position projection)."""
    cpu_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    counter = FlopCounterMode(display=False, custom_mapping={cpu_attention: _attention_flops})
    counter.mod_tracker = cast(Any, _GlobalOnly())
    return counter


class _GlobalOnly(contextlib.nullcontext[None]):
    """What ``FlopCounterMode`` reads of its module tracker: entered and left, and the one module every count goes
    to (``"Global"``, whose sum is ``get_total_flops``)."""

    parents = ("Global",)


@contextlib.contextmanager
def counting(counter: FlopCounterMode) -> Iterator[FlopCounterMode]:
    """``counter`` active, with ``nn.MultiheadAttention`` on its unfused path (the same products, each counted)."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with counter:
            yield counter
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


def _attention_flops(query: Sequence[int], key: Sequence[int], value: Sequence[int], *_: Any, **__: Any) -> int:
    """Flops of fused attention on tensors of these shapes (FlopCounterMode's formula, its other arguments unread)."""
    return int(sdpa_flop_count(query, key, value))  # type: ignore[no-untyped-call]  # torch leaves it untyped


def counted_macs(function: Callable[[], Any]) -> tuple[Any, int]:
    """``function()`` and the multiply-adds it ran (``flop_counter``'s flops / 2)."""
    with counting(flop_counter()) as counter:
        result = function()
    return result, counter.get_total_flops() // 2


@dataclass(eq=False)
class _Op(CapturedOp[fx.Node]):
    """A model node as the core sees it (``key``: the node), with what emitting it needs. An operation with its
    channels on axis 1 (convolutions, BatchNorm, pooling) reads and writes the batch on axis 0; ``how="identity"``
    (a view, Dropout in eval) keeps zeros without being evaluated."""

    module: nn.Module | None = None
    how: str = "call"  # call (the model's own operation), identity, affine, prelu, linear, conv, norm, flatten, rows,
    # mean_ratio
    weight: Tensor | None = None
    bias: Tensor | None = None
    conv: dict[str, Any] = field(default_factory=dict)
    batch_size_read: fx.Node | None = None  # the batch size a fallback only broadcasts to (``batch_broadcast``)

    def __post_init__(self) -> None:
        if self.rule == "fixed" and self.fixed_in == 1:
            self.batch_in = self.batch_out = 0
        self.keeps_zeros = self.keeps_zeros or self.how == "identity"

    @property
    def node(self) -> fx.Node:
        return self.key


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

    def __init__(self, model: nn.Module, example: Inputs) -> None:
        tensors = batched_tensors(example, "example_input")
        if not tensors or min(tensor.shape[0] for _, tensor in tensors) < 1:
            raise ValueError(f"{PREFIX} need an example input with a batch of at least 1 on axis 0")
        batch_size(example)  # every tensor's the same
        self.entry: _PyTreeInfo | None = None  # a torch.export capture: how its placeholders take the model's inputs
        if isinstance(example, Tensor):
            try:
                self.gm = _trace(model)
            except ValueError as error:
                self.gm, self.entry = _exported(model, example, error)
            else:
                if _wrapped_calls(self.gm):  # their operations seen by torch.export; where it fails, one call each
                    with contextlib.suppress(ValueError):
                        self.gm, self.entry = _exported(model, example, None)
        else:
            self.gm, self.entry = _exported(model, example, None)
        if self.entry is None:
            _functionalize(self.gm)
            self.gm.graph.eliminate_dead_code()
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if self.entry is None and len(placeholders) != 1:
            names = [str(node.target) for node in placeholders]
            raise ValueError(
                f"{PREFIX} support models called with one input tensor (other arguments of forward need defaults); "
                f"this one requires {len(placeholders)}: {names}"
            )
        if self.entry is None:
            write_out_torch_modules(self.gm, cast(Tensor, example))
        fuse_mean_ratios(self.gm)
        given = dict(zip(placeholders, self.flat(example), strict=True))
        # the batch-first tensors among the inputs: the first is the input the core starts from, the others run as
        # the model runs them (fallbacks without inputs) wherever they are read
        self.placeholders = [node for node, value in given.items() if isinstance(value, Tensor) and value.ndim]
        self.input = self.placeholders[0]
        self.device = tensors[0][1].device
        self.dynamic: set[fx.Node] = set()
        for node in self.gm.graph.nodes:
            if node.op == "placeholder" or any(a in self.dynamic for a in node.all_input_nodes):
                self.dynamic.add(node)
        constants = {n for n in self.gm.graph.nodes if n not in self.dynamic and n.op != "output"}
        larger = map_batched(example, lambda tensor: torch.cat([tensor, tensor[:1]]))
        self.seen, self.constants = _probe(self.gm, [self.flat(example), self.flat(larger)], constants)
        rows = fuse_patch_rows(self.gm, self._shapes, functools.partial(_evaluate, self))
        for replaced, fused in {**fuse_patches(self.gm, self._shape), **rows}.items():  # the same value, one call
            self.seen[fused] = self.seen.pop(replaced)
            self.dynamic.add(fused)
        self.dynamic &= set(self.gm.graph.nodes)  # not the fused operations
        self.values: set[fx.Node] = set(self.placeholders)  # the model values: tensors, tuples and what they give
        for node in self.gm.graph.nodes:
            if node in self.dynamic and node.op not in ("placeholder", "output") and self._is_value(node):
                self.values.add(node)
        self.ops: dict[fx.Node, _Op] = {}
        self.classified = self.ops  # as the nodes are classified (``fallback`` reads the earlier ones); kept by reset
        self.mixing: dict[fx.Node, bool] = {}  # mixes_samples, evaluated once per node
        self.data_free: dict[fx.Node, bool] = {}  # _data_free, once per node
        self.sample_ordered: dict[fx.Node, bool] = {}  # sample_rows, once per node
        for node in self.gm.graph.nodes:
            if node in self.values and node is not self.input:
                self.ops[node] = self._classify(node)
        called = [self.gm.get_submodule(str(node.target)) for node in self.ops if node.op == "call_module"]
        held = [inner for module in called for inner in module.modules() if isinstance(inner, Masksembles)]
        self.n = _members_of(held)

    def _shape(self, node: fx.Node) -> tuple[int, ...] | None:
        """A value's shape at the example's batch size, None for anything but a tensor."""
        shapes = self._shapes(node)
        return None if shapes is None else shapes[0]

    def _shapes(self, node: fx.Node) -> tuple[tuple[int, ...], ...] | None:
        """A value's shapes at the probe's two batch sizes, None for anything but a tensor."""
        seen = self.seen.get(node)
        return seen.shapes if seen is not None and seen.tensor else None

    def flat(self, inputs: Inputs) -> list[Any]:
        """``inputs`` (of the example's structure) as the graph's placeholders take them."""
        return [inputs] if self.entry is None else flat_inputs(self.entry, inputs)

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
        """``node`` as the dense model runs it; per member when it uses the batch size (unless it only broadcasts to
        it: ``batch_broadcast``), mixes the samples or is a Masksembles layer."""
        reads_batch = self.batch_args(node)
        broadcast = self.batch_broadcast(node) if reads_batch else None
        per_member = self.calls_masks(node) or (reads_batch and broadcast is None) or self.mixes_samples(node)
        return _Op(
            node, "fallback", self.inputs(node), rule="none", batch_dependent=per_member, batch_size_read=broadcast,
            sample_rows=self.rows_per_sample(node) > 1 and self.sample_rows(node),
        )  # fmt: skip

    def rows_per_sample(self, node: fx.Node) -> int:
        """``Probed.rows_per_sample`` of a value (0 for anything but a tensor with one batch-proportional axis)."""
        seen = self.seen[node]
        return Probed(seen.shapes, self.seen[self.input].shapes[0][0]).rows_per_sample if seen.tensor else 0

    def sample_rows(self, node: fx.Node) -> bool:
        """Whether ``node``'s value holds each sample's rows together, in sample order, on its batch-proportional
        axis (Swin's windows folded into the batch, (B*windows, L, C)): by induction from the values whose axis is
        exactly the batch, each value on more rows per sample reads only such values and keeps each sample's rows
        apart from the others' (``mixes_samples``, evaluated: redrawing one sample's rows of every input changes
        only that sample's rows of the result). A Masksembles layer scales each row where it is (by its member's
        mask: the rows' place in the member-stacked batch, so it is not evaluated on random rows); a module that holds
        one is not proven to keep the rows in order."""
        pending, unknown = [node], set()
        while pending:  # the values not decided yet that it reads, decided below in graph order
            value = pending.pop()
            if value not in self.sample_ordered and value not in unknown:
                unknown.add(value)
                if self.rows_per_sample(value) > 1 and value not in self.placeholders:
                    pending += self._batched_inputs(value)
        for value in [v for v in self.gm.graph.nodes if v in unknown]:
            rows = self.rows_per_sample(value)
            self.sample_ordered[value] = rows == 1 or (
                rows > 1
                and value not in self.placeholders
                and (self._masks_layer(value) or not (self.calls_masks(value) or self.mixes_samples(value)))
                and all(self.sample_ordered[t] for t in self._batched_inputs(value))
            )
        return self.sample_ordered[node]

    def _masks_layer(self, node: fx.Node) -> bool:
        return node.op == "call_module" and isinstance(self.gm.get_submodule(str(node.target)), Masksembles)

    def _batched_inputs(self, node: fx.Node) -> list[fx.Node]:
        """The tensors with a batch axis among the model values ``node`` reads."""
        return [t for t in self.inputs(node) if self.seen[t].tensor and self.seen[t].batch_axes]

    def batch_broadcast(self, node: fx.Node) -> fx.Node | None:
        """The batch size read by ``node`` when it only repeats a tensor that does not follow the batch along the
        batch axis (``cls.expand(x.shape[0], -1, -1)`` of a (1, 1, D) parameter): an expand whose source has no batch
        axis and size 1 (or no axis) there, to a size read from a model value's exact batch axis, the other sizes
        fixed. Every sample's rows are then the same: computed once on the batch, it is the dense model's result
        repeated for every member. None for any other node."""
        method = node.op == "call_method" and node.target == "expand"
        if not (method or (node.op == "call_function" and node.target is Tensor.expand)) or node.kwargs:
            return None
        source, *sizes = node.args
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
            sizes = list(sizes[0])
        if not isinstance(source, fx.Node) or source not in self.seen:
            return None
        seen, before = self.seen[node], self.seen[source]
        if not seen.tensor or not before.tensor or before.batch_axes or len(sizes) != seen.rank:
            return None
        axis, added = seen.batch_axis, seen.rank - before.rank
        if axis < 0 or (axis >= added and before.shapes[0][axis - added] != 1):
            return None
        fixed = all(
            not (isinstance(size, fx.Node) and size in self.dynamic and self.seen[size].batch_dependent)
            for j, size in enumerate(sizes)
            if j != axis
        )
        read = sizes[axis]
        return read if fixed and isinstance(read, fx.Node) and self._batch_read(read) else None

    def _batch_read(self, node: fx.Node) -> bool:
        """Whether ``node`` is ``t.shape[a]``, ``t.size()[a]`` or ``t.size(a)`` of a model value ``t`` whose axis ``a``
        is exactly the batch (the input's batch size at the probe's two batches)."""
        if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
            query, axis = node.args
            if not isinstance(query, fx.Node) or not self.is_query(query) or query.kwargs:
                return False
            shape = query.args[1:] == ("shape",) if query.target is getattr else query.args[1:] == ()
            if not shape or query.target not in (getattr, "size"):
                return False
            tensor = query.args[0]
        elif node.op == "call_method" and node.target == "size" and len(node.args) == 2 and not node.kwargs:
            tensor, axis = node.args
        else:
            return False
        if not isinstance(tensor, fx.Node) or tensor not in self.values or not isinstance(axis, int):
            return False
        seen, batch = self.seen[tensor], self.seen[self.input].shapes[0][0]
        return (
            seen.tensor
            and -seen.rank <= axis < seen.rank
            and seen.batch_axis == axis % seen.rank
            and (seen.shapes[0][axis] == batch)
        )

    def calls_masks(self, node: fx.Node) -> bool:
        """Whether ``node`` calls a Masksembles layer, or a module that holds one (a module torch.fx does not trace
        into: the masks inside it group the batch it is given)."""
        if node.op != "call_module":
            return False
        return any(isinstance(module, Masksembles) for module in self.gm.get_submodule(str(node.target)).modules())

    def mixes_samples(self, node: fx.Node) -> bool:
        """Whether one sample's result depends on the other samples (a mean over the batch, ``flip(0)``, a cumsum
        along it): evaluated at the probe's larger batch on random inputs, then again with the last sample changed;
        the other samples' rows must stay the same. What ``_pack_samples`` proves per sample from the operation and
        its arguments is not evaluated."""
        if node not in self.mixing:
            self.mixing[node] = self._mixes_samples(node)
        return self.mixing[node]

    def _mixes_samples(self, node: fx.Node) -> bool:
        seen, tensors = self.seen[node], self.inputs(node)
        element = node.target is operator.getitem and isinstance(node.args[1], int)
        if element and tensors and self.seen[tensors[0]].parts:
            return False  # an element of a tuple (``q, k, v = qkv.unbind(0)``, a module's (output, weights))
        batch = self.seen[self.input].shapes[1][0]
        if not seen.tensor or len(seen.batch_axes) != 1 or not tensors:
            return False  # no batch axis to compare along (a reduction over it makes one per member: batch_args)
        if any(not self.seen[t].tensor for t in tensors):
            return True
        batched = [t for t in tensors if self.seen[t].batch_axes]
        if any(t not in batched and not self._data_free(t) for t in tensors):
            return True  # computed from the samples' data without a batch axis: a mean over the batch
        if any(len(self.seen[t].batch_axes) != 1 for t in (node, *batched)):
            return True
        sizes = {t: self.seen[t].shapes[1][self.seen[t].batch_axes[0]] for t in (node, *batched)}
        if any(size % batch for size in sizes.values()):
            return True
        from ._pack_samples import _keeps_samples  # it reads the classification this module makes

        if _keeps_samples(self, node):
            return False  # proven from the operation and its arguments: nothing to evaluate
        generator = torch.Generator(device=self.device).manual_seed(0)
        given = {t: _random_like(self.seen[t], self.device, generator) for t in tensors}
        try:
            before = _evaluate(self, node, given, run=1)
            for sample in (0, batch - 1):  # the first and the last sample drawn again: the others' rows must stay
                changed = dict(given)
                for t in batched:
                    axis, rows = self.seen[t].batch_axes[0], sizes[t] // batch
                    redrawn = _random_like(self.seen[t], self.device, generator, rows_on=(axis, rows))
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

    def identity_dropout(self, node: fx.Node) -> bool:
        """Whether a dropout function's call returns its input: in eval, or with ``p`` 0 in training mode too (ATen's
        dropouts return the input then; torchvision's Swin calls ``F.dropout(attn, p=attention_dropout)`` with
        ``training`` left True)."""
        return self.argument(node, "training", 2, True) is False or self.argument(node, "p", 1) == 0

    def _data_free(self, node: fx.Node) -> bool:
        """Whether ``node``'s value reads no data of a tensor with a batch axis: computed from constants, parameters
        and sizes alone (``arange(x.shape[1])``), so it is the same for every sample and every member."""
        if node not in self.data_free:
            self.data_free[node] = all(
                source not in self.dynamic
                or self.is_query(source)
                or (not self.seen[source].batch_dependent and self._data_free(source))
                for source in node.all_input_nodes
            )
        return self.data_free[node]

    def _classify(self, node: fx.Node) -> _Op:
        tensors = self.inputs(node)
        if not self.seen[node].tensor or not tensors or any(not self.seen[t].tensor for t in tensors):
            return self.fallback(node)
        if self._flatten_call(node, tensors[0]):
            return _Op(node, "flatten", tensors, rule="flatten", how="flatten")
        if self._regroups_rows(node, tensors):
            last = (self.seen[tensors[0]].rank - 1, self.seen[node].rank - 1)
            return _Op(node, "channelwise", tensors, rule="fixed", fixed_in=last[0], fixed_out=last[1], batch_in=0,
                       batch_out=0, keeps_zeros=True, regroups_rows=True, how="rows")  # fmt: skip
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
        if target in (ops.unfold_patches, ops.fold_patches) and len(tensors) == 1:  # channel c from channel c
            return _Op(node, "channelwise", tensors, rule="fixed", fixed_in=1, fixed_out=1)
        if target in (ops.patches_to_rows, ops.rows_to_patches) and len(tensors) == 1:  # each sample's rows together
            axes = (1, 2) if target is ops.patches_to_rows else (2, 1)
            return _Op(node, "channelwise", tensors, rule="fixed", fixed_in=axes[0], fixed_out=axes[1], batch_in=0,
                       batch_out=0, regroups_rows=True)  # fmt: skip
        if target is ops.mean_ratio and len(tensors) == 1:  # over the channels, or per channel (``mean_ratio_axis``)
            over_batch = self.argument(node, "dim", 1) % self.seen[node].rank in self.seen[tensors[0]].batch_axes
            return None if over_batch else _Op(node, "mean_ratio", tensors, how="mean_ratio")
        if target in (torch.cat, torch.concat):
            dim = self.argument(node, "dim", 1, 0)
            if not isinstance(dim, int):
                return None
            return _Op(node, "concat", tensors, rule="concat", concat_dim=dim % self.seen[node].rank)
        if len(tensors) == 2:
            rule = (
                COMBINE_METHODS.get(name)
                if method
                else COMBINE_FUNCTIONS.get(IN_PLACE_OPERATORS.get(cast(Any, target), target))
            )
            return None if rule is None else _Op(node, "combine", tensors, zero_rule=rule)
        if len(tensors) != 1:
            return None
        if target is F.linear:
            return self._linear(node, tensors, self.argument(node, "weight", 1), self.argument(node, "bias", 2))
        if target in (torch.matmul, operator.matmul) or (method and name in ("matmul", "__matmul__")):
            return self._constant_matmul(node, tensors)
        if target in CONV_FUNCTIONS:
            return self._conv_function(node, tensors)
        if target in DROPOUT_FUNCTIONS:
            return _Op(node, "channelwise", tensors, how="identity") if self.identity_dropout(node) else None
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
        if target is F.prelu:
            return self._prelu(node, tensors, self.argument(node, "weight", 1))
        if target in POOL_FUNCTIONS or target is F.pad:
            return self._spatial(node, tensors)
        if target in MOVE_FUNCTIONS or (method and name in MOVES):
            return _Op(node, "channelwise", tensors, rule="map")
        if target is torch.roll or (method and name == "roll"):
            return self._roll(node, tensors)
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
            masks = (module.masks != 0).cpu().numpy()
            return _Op(node, "masks", tensors, rule="fixed", fixed_in=axis, fixed_out=axis, masks=masks, module=module,
                       how="identity")  # fmt: skip
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
            return _Op(node, "channelwise", tensors, rule="fixed", fixed_in=1, fixed_out=1, module=module, how="prelu",
                       weight=module.weight.detach())  # fmt: skip
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

    def _regroups_rows(self, node: fx.Node, tensors: list[fx.Node]) -> bool:
        """``x.reshape(-1, C)``, ``x.view(B, L, C)``: a reshape that keeps the last axis and the batch's rows first,
        before and after (rows per sample may change: (B, L, C) -> (B*L, C) and back, Swin's windows). Row-major
        order then keeps each sample's rows together, in sample order, and channel ``c`` of every position in
        channel ``c``; with compacted channels it is the same reshape, the last axis as wide as the input's."""
        reshape = (node.op == "call_method" and node.target in ("view", "reshape")) or (
            node.op == "call_function" and node.target is torch.reshape
        )
        if not reshape or node.kwargs or len(tensors) != 1 or node.args[0] is not tensors[0] or _dtype_view(node):
            return False
        source, result = self.seen[tensors[0]], self.seen[node]
        batch = self.seen[self.input].shapes[0][0]
        rows = [Probed(seen.shapes, batch).rows_axis for seen in (source, result)]
        return rows == [0, 0] and min(source.rank, result.rank) >= 2 and source.shapes[0][-1] == result.shapes[0][-1]

    def _linear(self, node: fx.Node, tensors: list[fx.Node], weight: Any, bias: Any) -> _Op | None:
        if not isinstance(weight, Tensor) or (bias is not None and not isinstance(bias, Tensor)):
            return None
        rank = self.seen[tensors[0]].rank
        return _Op(node, "mixing", tensors, rule="fixed", fixed_in=rank - 1, fixed_out=rank - 1, how="linear",
                   weight=weight.detach(), bias=None if bias is None else bias.detach())  # fmt: skip

    def _roll(self, node: fx.Node, tensors: list[fx.Node]) -> _Op | None:
        """``torch.roll(x, shifts, dims)`` along axes other than the batch's (Swin's cyclic shift of (B, H, W, C)
        along H and W): each sample's elements move within the sample, every position keeps its value, so where the
        channel axis is not rolled channel ``c`` comes from channel ``c`` (``axis_map`` evaluates it: a rolled
        channel axis does not hold the channels in order). Rolled along the batch, or with ``dims`` not given (the
        flattened tensor), samples trade values: not a move."""
        dims, shifts = self.argument(node, "dims", 2, ()), self.argument(node, "shifts", 1)
        dims = (dims,) if isinstance(dims, int) else dims
        if (
            not isinstance(dims, (tuple, list))
            or not dims
            or not all(isinstance(d, int) for d in dims)
            or shifts is None
        ):
            return None
        seen = self.seen[tensors[0]]
        if any(d % seen.rank in seen.batch_axes for d in dims):
            return None
        return _Op(node, "channelwise", tensors, rule="map")

    def _constant_matmul(self, node: fx.Node, tensors: list[fx.Node]) -> _Op | None:
        """``x @ w`` with ``w`` a (K, N) matrix that does not depend on the input (``transformers``' FalconLinear,
        ``x @ self.weight.T``, which torch.export captures as ``matmul(x, numpy_T(weight))``) as ``F.linear(x, w.T)``:
        for ``x`` of rank 2 or more, ``matmul`` broadcasts a 2-D second operand over ``x``'s leading axes and
        contracts ``x``'s last axis with its rows, each row of ``x`` alone, as a Linear of weight ``w.T`` (N, K)
        does. Not a Linear: ``w`` first (``w @ x`` mixes another axis of ``x``), ``w`` of another rank (a vector drops
        the last axis, a batched ``w`` pairs batches), ``x`` a vector, or two model values (attention's products)."""
        if node.kwargs or len(node.args) != 2 or node.args[0] is not tensors[0] or self.seen[tensors[0]].rank < 2:
            return None
        second = node.args[1]
        matrix = self.constant(second)
        if not isinstance(matrix, Tensor) or matrix.dim() != 2:
            return None
        return self._linear(node, tensors, matrix.t(), None)

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

    def _prelu(self, node: fx.Node, tensors: list[fx.Node], weight: Any) -> _Op | None:
        """``F.prelu(x, weight)`` as ``nn.PReLU``: one slope per channel on axis 1, or one slope for all (then
        elementwise)."""
        if not isinstance(weight, Tensor) or weight.dim() != 1:
            return None
        if weight.numel() == 1:
            return _Op(node, "channelwise", tensors)
        return _Op(node, "channelwise", tensors, rule="fixed", fixed_in=1, fixed_out=1, how="prelu",
                   weight=weight.detach())  # fmt: skip

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
            return self._pad(node, tensors)
        return _Op(node, "channelwise", tensors, rule="fixed", fixed_in=1, fixed_out=1, module=module)

    def _pad(self, node: fx.Node, tensors: list[fx.Node]) -> _Op | None:
        """``F.pad(x, pad)`` with a constant: each position keeps its value and gains constant ones along the padded
        axes, so channel ``c`` comes from channel ``c`` on an axis it leaves whole (whether zero stays zero is
        evaluated: the constant may not be 0). The channels are on axis 1 where only the axes after it are padded (a
        convolution's input); otherwise on the last axis where it is not padded ((B, H, W, C) padded on H and W to
        whole windows: torchvision's Swin). Padded along a batch axis, samples are added: not a move."""
        pad, mode = self.argument(node, "pad", 1), self.argument(node, "mode", 2, "constant")
        if not isinstance(pad, (tuple, list)) or mode != "constant" or not all(isinstance(p, int) for p in pad):
            return None
        seen = self.seen[tensors[0]]
        padded = {seen.rank - 1 - i // 2 for i, amount in enumerate(pad) if amount}
        if len(pad) // 2 > seen.rank or padded & set(seen.batch_axes):
            return None
        axis = 1 if len(pad) // 2 <= seen.rank - 2 else seen.rank - 1
        if axis in padded:
            return None
        return _Op(node, "channelwise", tensors, rule="fixed", fixed_in=axis, fixed_out=axis)


def _dtype_view(node: fx.Node) -> bool:
    """``x.view(torch.float16)``: a reinterpretation of the bits, not a reshape."""
    return any(isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values()))


def _random_like(
    seen: _Seen, device: torch.device, generator: torch.Generator, rows_on: tuple[int, int] | None = None
) -> Tensor:
    """Random values of the shape and dtype the probe saw at its larger batch (0s and 1s for integers and bools);
    with ``rows_on`` (axis, rows), only that many rows on that axis (one sample's)."""
    shape, dtype = list(seen.shapes[1]), seen.dtype or torch.float32
    if rows_on is not None:
        shape[rows_on[0]] = rows_on[1]
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device, generator=generator)
    return torch.randint(0, 2, shape, device=device, generator=generator).to(dtype)


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
