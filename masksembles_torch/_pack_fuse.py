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
  K positions at c*K..c*K+K-1, ``F.fold`` sums them back), each sample from itself;
- MobileViT's patches (``transformers``' ``MobileViTLayer.unfolding``/``folding``): a chain of views and transposes
  from (B, C, H, W) to (B*ph*pw, patches, C), or back, that the intermediate values cannot be compacted along (the
  channels merged into the batch axis), proven by evaluating the chain on each element's index at both probed batch
  sizes to equal ``patches_to_rows``/``rows_to_patches``: one call, channel ``c`` from channel ``c``, each sample's
  ph*pw rows together, in sample order.
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
CHAIN_VIEWS = {
    torch.reshape, torch.transpose, torch.permute, torch.flatten, torch.movedim, "reshape", "view", "transpose",
    "permute", "contiguous", "flatten", "unflatten", "movedim",
}  # fmt: skip
CHAIN_LENGTH = 8  # views and transposes in a patch chain, at most
Evaluate = Callable[[fx.Node, dict[fx.Node, Any], int], Any]  # a node on given values of its inputs, at probe run r
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


def fuse_patch_rows(gm: fx.GraphModule, shapes: Callable[[fx.Node], tuple[tuple[int, ...], ...] | None],
                    evaluate: Evaluate) -> dict[fx.Node, fx.Node]:  # fmt: skip
    """MobileViT's unfolding and folding chains (``shapes``: a value's shapes at both probed batch sizes) as one call
    each; the replaced end of each chain -> its call."""
    fused: dict[fx.Node, fx.Node] = {}
    erased: set[fx.Node] = set()
    for source in list(gm.graph.nodes):
        if source in erased:
            continue
        found = _patch_chain(source, shapes, evaluate)
        if found is None:
            continue
        function, arguments, chain = found
        with gm.graph.inserting_before(chain[-1]):
            call = gm.graph.call_function(function, (source, *arguments))
        call.meta = dict(chain[-1].meta)
        chain[-1].replace_all_uses_with(call)
        for node in reversed(chain):
            gm.graph.erase_node(node)
        erased.update(chain)
        fused[chain[-1]] = call
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def _patch_chain(
    source: fx.Node, shapes: Callable[[fx.Node], tuple[tuple[int, ...], ...] | None], evaluate: Evaluate
) -> tuple[Callable[..., Any], tuple[int, ...], list[fx.Node]] | None:
    """The function, its arguments after the tensor, and the chain of views from ``source`` it replaces, where one
    of ``source``'s readers starts a chain that ends at MobileViT's patch rows (or back at the feature map): the
    longest such chain (a shorter one can be patch rows of another patch size, which the rest of the chain undoes)."""
    first = shapes(source)
    if first is None or len(first[0]) not in (3, 4):
        return None
    for start in source.users:
        chain: list[fx.Node] = []
        node, found = start, None
        while _target(node) in CHAIN_VIEWS and node.args and len(chain) < CHAIN_LENGTH:
            chain.append(node)
            for function, arguments in _patch_candidates(first, shapes(node)):
                if all(_same_chain(chain, source, first[r], function, arguments, evaluate, r) for r in (0, 1)):
                    found = function, arguments, list(chain)
                    break
            if len(node.users) != 1:
                break
            (node,) = node.users
        if found is not None:
            return found
    return None


def _patch_candidates(
    source: tuple[tuple[int, ...], ...], result: tuple[tuple[int, ...], ...] | None
) -> list[tuple[Callable[..., Any], tuple[int, ...]]]:
    """The patch sizes that would make ``result`` (shapes at both probes) the patch rows of ``source``, or the feature
    map of its patch rows."""
    if result is None:
        return []
    (before, _), (after, _) = source, result
    if len(before) == 4 and len(after) == 3 and after[2] == before[1] and after[0] % before[0] == 0:
        batch, _, height, width = before
        area, patches = after[0] // batch, after[1]
        return [
            (ops.patches_to_rows, (ph, area // ph)) for ph in _divisors(height)
            if area % ph == 0 and width % (area // ph) == 0 and (height // ph) * (width * ph // area) == patches
        ]  # fmt: skip
    if len(before) == 3 and len(after) == 4 and after[1] == before[2] and before[0] % after[0] == 0:
        batch, _, height, width = after
        area, patches = before[0] // batch, before[1]
        return [
            (ops.rows_to_patches, (ph, area // ph, height // ph, width * ph // area)) for ph in _divisors(height)
            if area % ph == 0 and width % (area // ph) == 0 and (height // ph) * (width * ph // area) == patches
        ]  # fmt: skip
    return []


def _divisors(size: int) -> list[int]:
    return [d for d in range(1, size + 1) if size % d == 0]


def _same_chain(
    chain: list[fx.Node], source: fx.Node, shape: tuple[int, ...], function: Callable[..., Any],
    arguments: tuple[int, ...], evaluate: Evaluate, run: int,
) -> bool:  # fmt: skip
    """Whether the chain, run on each element's index (at probe ``run``'s shape), gives what ``function`` gives."""
    index = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    value: Any = index
    try:
        for node, before in zip(chain, [source, *chain[:-1]], strict=True):
            value = evaluate(node, {before: value}, run)
    except Exception:  # the chain does not apply to this tensor as given
        return False
    expected = function(index, *arguments)
    return isinstance(value, torch.Tensor) and value.shape == expected.shape and bool(torch.equal(value, expected))
