"""Patterns of several operations that ``pack``'s capture reads as one, rewritten into one call before it classifies
them (on a torch.fx trace and on a ``torch.export`` capture alike, after ``_pack_export``'s rewrite to torch-level
calls): the call computes what the model's operations compute, with the same operations in the same order, so the
dense and fallback programs are unchanged; only the core sees one node it can compact.

- GRN's ratio ``g / (g.mean(dim, keepdim=True) + eps)`` (ConvNeXt-V2, timm's ``GlobalResponseNorm`` and
  ``transformers``' ``ConvNextV2GRN``): ``_packed_ops.mean_ratio(g, dim, eps)``, a ``"mean_ratio"`` of the core, where
  the mean and the sum have no other reader and ``eps`` is a number.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from . import _packed_ops as ops

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
