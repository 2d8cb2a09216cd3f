"""The export form of a packed program whose members' blocks sit on the last axis: held member-first between the
operations that can read them so.

A compacted tensor (…, m*C) (``masksembles_core.packing``) holds member ``k``'s block of the last axis at
``k*C…(k+1)*C``. Exported to ONNX, every members' Linear reads its blocks apart (a ``Split`` of the last axis, a
strided copy) and joins its results again (a ``Concat`` of the last axis), once per layer. Held member-first instead,
(m, …, C), each block is one contiguous part of the tensor, and a transformer block's LayerNorm, channel gathers,
residual sums and activations read it as they are: a run of them costs no move of the blocks at all.

``member_first_plan`` runs the program node by node on the example input with every value that can be held
member-first held so (``_Blocks``), every other one as the program holds it, and keeps the result where it equals
the program's own within rounding: the names of the channel gathers it found reading within each member's block,
which is all the run under ``torch.export`` cannot check on its weights (they are not data there). ``run_member_first``
is that run, what a ``PackedMasksembles`` with a plan computes when exported.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from masksembles_core.packing import output_mismatch

from . import _packed_ops as ops
from ._pack_capture import ELEMENTWISE_FUNCTIONS, ELEMENTWISE_MODULES


class _Blocks:
    """A compacted tensor (…, m*C) held member-first, ``value`` (m, …, C); ``compacted()`` gives it back."""

    __slots__ = ("_compacted", "value")

    def __init__(self, value: Tensor) -> None:
        self.value = value
        self._compacted: Tensor | None = None

    def compacted(self) -> Tensor:
        """(m, …, C) -> (…, m*C), made once."""
        if self._compacted is None:
            self._compacted = self.value.movedim(0, -2).flatten(-2)
        return self._compacted

    def reaches_last_axis(self, axis: int) -> bool:
        """Whether ``axis`` of the compacted tensor is its last (the members' blocks)."""
        rank = self.value.dim() - 1
        return axis % rank == rank - 1


def _compacted(value: Any) -> Any:
    """``value`` (a structure of arguments) with every ``_Blocks`` as the program holds it."""
    return fx.node.map_aggregate(value, lambda v: v.compacted() if isinstance(v, _Blocks) else v)


class _MemberFirst(fx.Interpreter):
    """``module``'s graph, run with the values it can hold member-first held so. ``local_gathers``: the channel
    gathers known to read within each member's block (None: find them, checking the index, in ``found``)."""

    def __init__(self, module: fx.GraphModule, local_gathers: frozenset[str] | None) -> None:
        super().__init__(module, garbage_collect_values=True, graph=module._graph)  # the program's own graph
        self.local_gathers = local_gathers
        self.found: set[str] = set()

    def run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if (n.op != "output" and any(isinstance(a, _Blocks) for a in (*args, *kwargs.values()))) or self._reads(n):
            result = self._member_first(n, args, kwargs)
            if result is not NotImplemented:
                return result
        return getattr(self, n.op)(n.target, _compacted(args), _compacted(kwargs))

    def _reads(self, n: fx.Node) -> bool:
        """A members' Linear or MLP, which gives member-first results from any input."""
        return n.op == "call_module" and isinstance(self.module.get_submodule(str(n.target)), MEMBER_LAYERS)

    def _member_first(self, n: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``n`` on member-first values, or ``NotImplemented`` where it needs the program's layout."""
        if n.op == "call_module":
            module = self.module.get_submodule(str(n.target))
            if isinstance(module, ops.MemberLinear) and not kwargs:
                return _linear(module, args[0])
            if isinstance(module, ops.MemberMLP) and not kwargs:
                return _mlp(module, args[0])
            if _parameterless_activation(module) and _alone(args, kwargs):
                return _Blocks(module(args[0].value))
            return NotImplemented
        if n.op == "call_method":
            if n.target in ("add", "add_") and len(args) == 2 and not kwargs:
                return _sum(args[0], args[1])
            return NotImplemented
        if n.op != "call_function":
            return NotImplemented
        target, x = n.target, args[0]
        if not isinstance(x, _Blocks):
            return (
                _sum(*args) if target in (operator.add, torch.add) and len(args) == 2 and not kwargs else NotImplemented
            )
        if target is ops.layer_norm_members and x.value.shape[0] == args[1]:
            _, _, weight, bias, eps = args
            return _Blocks(F.layer_norm(x.value, x.value.shape[-1:], weight, bias, eps))
        if target is ops.gather_channels and not kwargs and x.reaches_last_axis(args[1]):
            return self._gather(n, x, args[2])
        if target in (ops.add_shared, ops.add_shared_) and not kwargs and x.value.shape[0] == args[2]:
            shared = args[1]
            if isinstance(shared, Tensor) and x.reaches_last_axis(args[3]):
                return _Blocks(x.value + shared)
            return NotImplemented
        if target in (operator.add, torch.add) and len(args) == 2 and not kwargs:
            return _sum(x, args[1])
        if target is operator.getitem and _leading_index(args[1], x.value.dim() - 1):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return _Blocks(x.value[(slice(None), *index)])
        if target is ops.members_first and not kwargs and x.value.shape[0] == args[1] and x.reaches_last_axis(args[2]):
            return x.value
        if target in ELEMENTWISE_FUNCTIONS | IN_PLACE_ACTIVATIONS and _alone(args, kwargs):
            return _Blocks(cast(Callable[..., Tensor], target)(x.value, *args[1:], **kwargs))
        return NotImplemented

    def _gather(self, n: fx.Node, x: _Blocks, index: Tensor) -> Any:
        """A channel gather of the members' blocks that reads within each member's block, member-first."""
        members, width = x.value.shape[0], x.value.shape[-1]
        if index.numel() % members:
            return NotImplemented
        local = index.view(members, -1) - torch.arange(members, device=index.device).view(-1, 1) * width
        if self.local_gathers is None:
            if bool(((local < 0) | (local >= width)).any()):
                return NotImplemented
            self.found.add(n.name)
        elif n.name not in self.local_gathers:
            return NotImplemented
        picked = local.view(members, *([1] * (x.value.dim() - 2)), -1)
        return _Blocks(torch.gather(x.value, -1, picked.expand(*x.value.shape[:-1], picked.shape[-1])))


MEMBER_LAYERS = (ops.MemberLinear, ops.MemberMLP)
# members' Linear layers whose input has at least this many rows per sample (tokens) run as one batched matmul
BATCHED_ROWS = 8
IN_PLACE_ACTIVATIONS = {torch.relu_, torch.sigmoid_, torch.tanh_, torch.ops.aten.gelu_}


def _alone(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The first argument is member-first and no other one is a tensor (an elementwise map of it alone)."""
    others = [*args[1:], *kwargs.values()]
    return isinstance(args[0], _Blocks) and not any(isinstance(o, Tensor | _Blocks) for o in others)


def _parameterless_activation(module: nn.Module) -> bool:
    return isinstance(module, ELEMENTWISE_MODULES) and not any(True for _ in module.parameters())


def _sum(a: Any, b: Any) -> Any:
    """``a + b`` of two member-first values of one shape, or of one and a number."""
    if isinstance(a, _Blocks) and isinstance(b, _Blocks) and a.value.shape == b.value.shape:
        return _Blocks(a.value + b.value)
    if isinstance(a, _Blocks) and isinstance(b, int | float):
        return _Blocks(a.value + b)
    if isinstance(b, _Blocks) and isinstance(a, int | float):
        return _Blocks(a + b.value)
    return NotImplemented


def _leading_index(index: Any, rank: int) -> bool:
    """An index of slices and integers that leaves the last of ``rank`` axes whole (a selection of rows)."""
    items = index if isinstance(index, tuple) else (index,)
    return len(items) < rank and all(isinstance(i, int | slice) and not isinstance(i, bool) for i in items)


def _batched(layer: ops.MemberLinear, x: Tensor) -> Tensor:
    """``layer`` on a member-first input as one batched matmul: (m, …, I) -> (m, …, O)."""
    members, inputs, outputs = layer.weight.shape
    y = torch.matmul(x.reshape(members, -1, inputs), layer.weight)
    y = y if layer.bias is None else y + layer.bias
    return y.reshape(members, *x.shape[1:-1], outputs)


def _member_first_input(layer: ops.MemberLinear, x: Any) -> Tensor | None:
    """``layer``'s input member-first, (m, …, I), where one batched matmul runs it: the rows of a sample are many
    (tokens), so that its weights, which onnxruntime packs on every call of a batched matmul (only a 2-D constant
    weight once, at load), cost little beside them. None where it reads its blocks apart."""
    lead = x.value.shape[2:-1] if isinstance(x, _Blocks) else x.shape[1:-1]
    rows = math.prod(size for size in lead if isinstance(size, int))  # a symbolic size (the batch) puts no guard
    if layer.member_major_in or rows < BATCHED_ROWS:
        return None
    if isinstance(x, _Blocks):
        return x.value
    blocks: Tensor = x.unflatten(-1, (layer.weight.shape[0], -1))
    return blocks.movedim(-2, 0)


def _output(layer: ops.MemberLinear, y: Tensor) -> Any:
    """The members' outputs of ``layer`` stacked member-first, (m, …, O), in the layout it gives (member-first
    where that is the members' blocks of the last axis)."""
    if layer.member_major_out:
        return y
    if layer.output_split > 1 or layer.split_heads:
        return layer.split_layout(y.movedim(0, -2))
    return _Blocks(y)


def _apart(layer: ops.MemberLinear, x: Any) -> list[Tensor]:
    """The members' input blocks of ``layer``, each (…, I), from a member-first or a program-held input."""
    if isinstance(x, _Blocks) and not layer.member_major_in:
        return list(x.value.unbind(0))
    return layer.member_blocks(_compacted(x))


def _linear(layer: ops.MemberLinear, x: Any) -> Any:
    stacked = _member_first_input(layer, x)
    if stacked is not None:
        return _output(layer, _batched(layer, stacked))
    return _output(layer, torch.stack([layer.member_output(k, block) for k, block in enumerate(_apart(layer, x))]))


def _mlp(mlp: ops.MemberMLP, x: Any) -> Any:
    stacked = _member_first_input(mlp.first, x)
    if stacked is not None:
        return _output(mlp.second, _batched(mlp.second, mlp.activation(_batched(mlp.first, stacked))))
    hidden = [mlp.activation(mlp.first.member_output(k, block)) for k, block in enumerate(_apart(mlp.first, x))]
    return _output(mlp.second, torch.stack([mlp.second.member_output(k, h) for k, h in enumerate(hidden)]))


def run_member_first(module: fx.GraphModule, local_gathers: frozenset[str], *args: Any) -> Any:
    """``module``'s output, computed with its values held member-first where they can be (``local_gathers``: the
    channel gathers that ``member_first_plan`` found reading within each member's block)."""
    return _MemberFirst(module, local_gathers).run(*args)


def member_first_plan(module: fx.GraphModule, example: Tensor) -> frozenset[str] | None:
    """The channel gathers of ``module`` that read within each member's block, where running it member-first on
    ``example`` gives its own output within rounding (``masksembles_core.packing.output_mismatch``); None where it
    differs or raises, or where the program holds no members' Linear (it is then exported as it runs)."""
    if not any(isinstance(m, MEMBER_LAYERS) for m in module.modules()):
        return None
    interpreter = _MemberFirst(module, None)
    try:
        with torch.no_grad():
            actual = _arrays(interpreter.run(example))
    except Exception:  # an export form, not the program: where it cannot run, the program's own is exported
        return None
    with torch.no_grad():
        expected = _arrays(module(example))
    eps = [float(np.finfo(a.dtype).eps) if np.issubdtype(a.dtype, np.inexact) else 0.0 for a in expected]
    return None if output_mismatch(expected, actual, eps) else frozenset(interpreter.found)


def _arrays(output: Any) -> list[np.ndarray]:
    """The tensor leaves of a program's output, as NumPy arrays."""
    return [leaf.detach().cpu().numpy() for leaf in ops.leaves(output) if isinstance(leaf, Tensor)]
