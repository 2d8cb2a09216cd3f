"""Which operations of a captured graph compute each sample from that sample alone: proven from the operation, its
arguments and the batch axes the probe saw, never evaluated. ``_samples_per_chunk`` splits only such programs, and
``_Capture.mixes_samples`` evaluates only what this cannot prove.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from ._pack_capture import _called, _Capture
from ._pack_emit import MATMULS
from ._pack_graph import _axis_map


def _batch_axis(capture: _Capture, node: fx.Node) -> int | None:
    seen = capture.seen[node]
    return seen.batch_axis if node in capture.dynamic and seen.tensor and seen.batch_axis >= 0 else None


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


COMPARISONS = {operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, torch.eq, torch.ne}
COMPARISON_METHODS = {"eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"}


def _keeps_samples(capture: _Capture, node: fx.Node) -> bool:
    """An operation that falls back yet computes each sample from that sample alone, given that its tensors have
    one batch axis each (``_samples_per_chunk`` checks that): a tuple's element, ``unbind`` of another axis, a
    ``reshape``/``view`` with the batch first before and after (row-major order keeps each sample's block), a
    broadcast along the batch, a concatenation along another axis, a softmax over another axis, attention or a
    matmul of two activations of one rank whose batch axes are the same leading one (they mix the last two axes
    only), an elementwise operation or comparison whose tensors have their batch on the same axis, an index that only
    adds axes (``x[:, None, None, :]``), an embedding lookup on the batch's indices, a move or reduction whose
    evaluation on batch indices gives them whole on its output's batch axis, and a layer with constant weights or an
    operation that reads axes besides its channel axis, whose one input and output hold the batch on axis 0 and the
    channels on another (a Linear reads the last axis; a convolution, pooling, BatchNorm, GroupNorm and GRN take each
    item of axis 0 alone; LayerNorm normalises over the last axis). Anything else is not proven (a convolution or a
    norm over the batch: evaluated by ``_Capture.mixes_samples``) and keeps the whole batch in one call."""
    name = _called(node)
    tensors = [n for n in node.all_input_nodes if n in capture.dynamic and capture.seen[n].tensor]
    axes = [_batch_axis(capture, n) for n in tensors]
    out = _batch_axis(capture, node)
    if node.op == "call_function" and node.target is operator.getitem:
        if len(tensors) == 1 and axes[0] is not None and out is not None and _new_axes_only(node.args[1]):
            return True  # x[:, None, None, :]: a view with axes of size 1 added
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
    embedding = node.op == "call_module" and isinstance(capture.gm.get_submodule(str(node.target)), nn.Embedding)
    if (embedding or node.target is F.embedding) and len(tensors) == 1:  # a lookup per index
        return axes[0] is not None and axes[0] == out
    if node.target in COMPARISONS or name in COMPARISON_METHODS:  # elementwise: the batch on the same axis
        return bool(axes) and out is not None and all(a == out for a in axes)
    classified = capture.classified.get(node)  # an operation that would compact, at full width as it reads fallbacks
    if classified is None or out is None:
        return False
    if classified.kind in ("mixing", "grouped", "norm", "mean_ratio") or classified.rule == "fixed":
        return axes == [0] and out == 0 and classified.fixed_in != 0  # it reads axes other than its channel axis
    if classified.kind not in ("channelwise", "combine"):
        return False
    if classified.rule == "map":  # a move or a reduction: the batch indices must come out whole on the batch axis
        return len(axes) == 1 and axes[0] is not None and _axis_map(capture, classified, axes[0]) == out
    return all(a == out for a in axes)


def _new_axes_only(index: object) -> bool:
    """An index of whole axes and new ones (``None``): ``x[:, None, None, :]``."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(part is None or part == slice(None) for part in parts)
