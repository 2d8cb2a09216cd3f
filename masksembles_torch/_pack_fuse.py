"""Patterns of several operations that ``pack``'s capture reads as one, rewritten into one call before it classifies
them (on a torch.fx trace and on a ``torch.export`` capture alike, after ``_pack_export``'s rewrite to torch-level
calls): the call computes what the model's operations compute, with the same operations in the same order, so the
dense and fallback programs are unchanged; only the core sees one node it can compact.

- GRN's ratio ``g / (g.mean(dim, keepdim=True) + eps)`` (ConvNeXt-V2, timm's ``GlobalResponseNorm`` and
  ``transformers``' ``ConvNextV2GRN``): ``_packed_ops.mean_ratio(g, dim, eps)``, a ``"mean_ratio"`` of the core, where
  the mean and the sum have no other reader and ``eps`` is a number;
- MobileViT-v2's patches: ``F.unfold(x, ...)`` viewed (B, C, K, L) and (B, C, K, L) viewed (B, C*K, L) for
  ``F.fold``, where the probe saw those shapes (K the kernel's positions, C the channels of ``x``): one
  ``unfold_patches``/``fold_patches`` call, channel ``c`` from channel ``c`` alone (``F.unfold`` writes channel ``c``'s
  K positions at c*K..c*K+K-1, ``F.fold`` sums them back), each sample from itself.
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from . import _packed_ops as ops

RESHAPES = {torch.reshape, "reshape", "view"}
Shapes = Callable[[fx.Node], tuple[int, ...] | None]  # a value's shape at the example's batch (None: not a tensor)
DIVISIONS = {operator.truediv, torch.div, torch.true_divide, "div", "true_divide", "__truediv__"}
SUMS = {operator.add, torch.add, "add", "__add__", "__radd__"}


def fuse_mean_ratios(gm: fx.GraphModule) -> None:
    """Every ``g / (g.mean(dim, keepdim=True) + eps)`` in ``gm`` as one ``mean_ratio(g, dim, eps)`` call."""
    changed = False
    for node in list(gm.graph.nodes):
        found = _mean_ratio(node)
        if found is None:
            continue
        g, dim, eps, (total, mean) = found
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(ops.mean_ratio, (g, dim, eps))
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        for dead in (node, total, mean):
            gm.graph.erase_node(dead)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _mean_ratio(node: fx.Node) -> tuple[fx.Node, int, float, tuple[fx.Node, fx.Node]] | None:
    """``(g, dim, eps, (the sum, the mean))`` where ``node`` is ``g / (g.mean(dim, keepdim=True) + eps)``; else None."""
    if _target(node) not in DIVISIONS or len(node.args) != 2 or node.kwargs:
        return None
    g, total = node.args
    if not isinstance(g, fx.Node) or not isinstance(total, fx.Node) or len(total.users) != 1:
        return None
    if _target(total) not in SUMS or len(total.args) != 2 or total.kwargs:
        return None
    mean, eps = total.args if isinstance(total.args[0], fx.Node) else total.args[::-1]
    if not isinstance(mean, fx.Node) or isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    if len(mean.users) != 1 or _target(mean) not in (torch.mean, "mean") or not mean.args or mean.args[0] is not g:
        return None
    dim = _mean_dim(mean)
    return None if dim is None else (g, dim, float(eps), (total, mean))


def _mean_dim(mean: fx.Node) -> int | None:
    """The one axis of ``x.mean(dim, keepdim=True)`` / ``torch.mean(x, dim, True)`` (dtype unset), else None."""
    names = ("dim", "keepdim", "dtype")
    given: dict[str, Any] = dict(zip(names, mean.args[1:], strict=False))
    if set(mean.kwargs) - set(names) or len(mean.args) > 1 + len(names):
        return None
    given.update(mean.kwargs)
    dim = given.get("dim")
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or isinstance(dim, bool) or given.get("keepdim") is not True:
        return None
    return dim if given.get("dtype") is None else None


def _target(node: fx.Node) -> Any:
    """A call's function, or its method's name."""
    if node.op == "call_method":
        return str(node.target)
    return node.target if node.op == "call_function" else None


def fuse_patches(gm: fx.GraphModule, shape: Shapes) -> dict[fx.Node, fx.Node]:
    """Every ``F.unfold`` viewed (B, C, K, L) and every (B, C, K, L) viewed (B, C*K, L) for ``F.fold`` as one call
    (``unfold_patches``/``fold_patches``), where ``shape`` gives those shapes; the replaced node -> its call."""
    fused: dict[fx.Node, fx.Node] = {}
    for node in list(gm.graph.nodes):
        found = _unfolded(node, shape) or _folded(node, shape)
        if found is None:
            continue
        function, source, arguments, inner = found
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(function, (source, *arguments))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        gm.graph.erase_node(inner)
        fused[node] = call
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def _unfolded(node: fx.Node, shape: Shapes) -> tuple[Callable[..., Any], fx.Node, tuple[Any, ...], fx.Node] | None:
    """``F.unfold(x, ...).view(B, C, K, L)``: (unfold_patches, x, its arguments, the unfold), else None."""
    if _target(node) not in RESHAPES or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    unfold = node.args[0]
    arguments = _arguments(unfold, F.unfold, ("kernel_size", "dilation", "padding", "stride"))
    if arguments is None or len(unfold.users) != 1 or not isinstance(unfold.args[0], fx.Node):
        return None
    x = unfold.args[0]
    before, middle, after = shape(x), shape(unfold), shape(node)
    positions = math.prod(_pair(arguments[0]))
    if before is None or middle is None or after is None or len(before) != 4:
        return None
    if after != (before[0], before[1], positions, middle[-1]) or middle[1] != before[1] * positions:
        return None
    return ops.unfold_patches, x, arguments, unfold


def _folded(node: fx.Node, shape: Shapes) -> tuple[Callable[..., Any], fx.Node, tuple[Any, ...], fx.Node] | None:
    """``F.fold(p.view(B, C*K, L), ...)`` of a (B, C, K, L) ``p``: (fold_patches, p, its arguments, the view)."""
    names = ("output_size", "kernel_size", "dilation", "padding", "stride")
    arguments = _arguments(node, F.fold, names)
    view = node.args[0] if node.args else None
    if arguments is None or not isinstance(view, fx.Node) or _target(view) not in RESHAPES or len(view.users) != 1:
        return None
    patches = view.args[0] if view.args else None
    if not isinstance(patches, fx.Node):
        return None
    before, middle = shape(patches), shape(view)
    if before is None or middle is None or len(before) != 4 or before[2] != math.prod(_pair(arguments[1])):
        return None
    if middle != (before[0], before[1] * before[2], before[3]):
        return None
    return ops.fold_patches, patches, arguments, view


def _arguments(node: fx.Node, function: Callable[..., Any], names: tuple[str, ...]) -> tuple[Any, ...] | None:
    """The arguments ``names`` of a call of ``function`` (its defaults applied), else None."""
    if node.op != "call_function" or node.target is not function:
        return None
    try:
        bound = inspect.signature(function).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return tuple(bound.arguments[name] for name in names)


def _pair(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)
