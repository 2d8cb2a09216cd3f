"""``convert_dropout`` for NNX, and the dropout rule linen's ``convert_dropout`` shares with it.

A dropout is converted to a Masksembles layer over the channels of its input (the last axis: Flax is channels-last)
unless ``dropout_reason`` says why not, in the words every framework uses (``masksembles_core.insertion``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

from flax import nnx

from masksembles_core.insertion import (
    PER_SAMPLE,
    ZERO_RATE,
    Candidate,
    attention_dropout_reason,
    check_insert_arguments,
    plan_conversion,
)

from ._insertion import (
    STACKED,
    _dotted,
    _keep_attribute_order,
    _masksembles,
    _node_at,
    _replace,
    _walk,
    declare_batch_axes,
    input_shapes,
)

ModuleT = TypeVar("ModuleT", bound=nnx.Module)
Shape = tuple[int, ...]

ATTENTION_NAMES = frozenset({"attn_drop", "attn_dropout", "attention_drop", "attention_dropout"})
NOT_REACHED = "not reached by the example input"


def dropout_reason(rate: float, broadcast_dims: Sequence[int], name: str, shapes: set[Shape | None]) -> tuple[str, int]:
    """Why a dropout is left as is ("" when it is converted), and the channel count of its input's last axis.

    Args:
        rate: its drop probability.
        broadcast_dims: the axes that share one draw.
        name: its attribute name (``"attn_drop"`` and the like mark an attention-weight dropout).
        shapes: the shapes of its input at its calls (None: a call on something other than an array).
    """
    if rate == 0:
        return ZERO_RATE, 0
    if name.lower() in ATTENTION_NAMES:
        return attention_dropout_reason(f"named {name!r}"), 0
    if not shapes:
        return NOT_REACHED, 0
    if None in shapes:
        return "its input is not an array", 0
    if len(shapes) > 1:
        return f"called on inputs with different shapes: {sorted(shape for shape in shapes if shape is not None)}", 0
    (shape,) = shapes
    assert shape is not None
    rank = len(shape)
    if rank < 2:
        return f"a {rank}-D input has no channel axis", 0
    shared = {axis % rank for axis in broadcast_dims}
    if shared >= set(range(1, rank)):
        return PER_SAMPLE, 0
    if rank - 1 in shared:
        return (
            f"broadcast_dims={tuple(broadcast_dims)}: one draw for all channels at a position, not channel dropout",
            0,
        )
    if shape[-1] < 2:
        return "a single channel: every mask would keep it", 0
    return "", shape[-1]


def _call_on(model: nnx.Module, example: Any) -> Any:
    """``convert_dropout``'s call: the example is the model's one argument."""
    return model(example)


def _stack_shape(dropout: nnx.Dropout) -> tuple[int, ...]:
    """The axes ``nnx.vmap`` stacked the dropout on (its RNG key's shape), () for one made once or without rngs."""
    stream = dropout.rngs
    return tuple(stream.key[...].shape) if isinstance(stream, nnx.RngStream) else ()


def convert_dropout(model: ModuleT, example: Any, n: int, scale: float, *, seed: int | None = None) -> ModuleT:
    """A copy of ``model`` with its channel dropouts (``nnx.Dropout``) replaced by Masksembles layers.

    Each converted dropout becomes ``Masksembles(C, n, scale, seed=...)`` over the last axis of its input (C read from
    the input it gets when the copy runs on ``example``, abstractly and in eval mode), at every path it sits at; every
    other module and weight is kept and ``model`` is not modified. A dropout of a stack of layers made with
    ``nnx.vmap`` (it holds a stacked RNG stream) gets one set of masks per layer, as ``insert`` gives a stacked
    layer. The i-th converted dropout, in the model's order (``insert``'s), gets masks from
    ``masksembles_core.derive_seed(seed, i)``.

    Left as is, with the reason in the report: ``rate=0``; per-sample dropouts (``broadcast_dims`` over every axis
    but the batch: stochastic depth) and dropouts sharing one draw across the channels (``broadcast_dims`` with the
    last axis); attention-weight dropouts (named like ``attn_drop``/``attention_dropout``, and
    ``nnx.MultiHeadAttention``'s ``dropout_rate``, reported on the attention layer); dropouts the example does not
    reach or reaches with different shapes.

    Args:
        model: any ``nnx.Module``.
        example: an input of ``model`` (an array or what ``model.__call__`` takes as its one argument).
        n, scale, seed: as for ``insert``.

    Returns:
        the copy, with the decisions as ``masksembles_report`` (operation ``"convert_dropout"``).

    Raises:
        TypeError: ``model`` is not an ``nnx.Module``.
        ValueError: bad ``n``/``scale``/``seed``, or no dropout converted (the message holds the report).
    """
    n, scale, seed = check_insert_arguments(n, scale, seed, None)
    if not isinstance(model, nnx.Module):
        raise TypeError(f"convert_dropout needs an nnx.Module; received {type(model).__name__}")
    nodes = list(_walk(model))
    dropouts: dict[int, list[tuple[Any, ...]]] = {}
    for path, node, _ in nodes:
        if isinstance(node, nnx.Dropout):
            dropouts.setdefault(id(node), []).append(path)
    shapes = {key: set(seen) for key, seen in input_shapes(model, example, dropouts, _call_on).items()}
    candidates: list[Candidate] = []
    stacks: dict[str, tuple[int, ...]] = {}
    for path, node, _ in nodes:
        dotted = _dotted(path)
        kind = type(node).__name__
        if isinstance(node, nnx.MultiHeadAttention) and node.dropout_rate > 0:
            source = f"{kind}'s dropout_rate={node.dropout_rate:g}"
            candidates.append(Candidate(dotted, kind, 0, -1, reason=attention_dropout_reason(source)))
        elif isinstance(node, nnx.Dropout) and dropouts[id(node)][0] == path:
            reason, channels = dropout_reason(node.rate, node.broadcast_dims, str(path[-1]), shapes[id(node)])
            stacks[dotted] = _stack_shape(node)
            note = STACKED.format(layers=math.prod(stacks[dotted])) if stacks[dotted] else ""
            candidates.append(Candidate(dotted, kind, channels, -1, reason=reason, note=note))
    report = plan_conversion(candidates, n, scale, seed=seed, converts="nnx.Dropout layers")
    copy = nnx.clone(model, arrays=True)
    _keep_attribute_order(model, copy)
    for path, node, _ in nodes:
        if isinstance(node, nnx.Module):
            _keep_attribute_order(node, _node_at(copy, path))
    by_path = {_dotted(paths[0]): paths for paths in dropouts.values()}
    placed: dict[int, list[tuple[Any, ...]]] = {}
    for row in report.changed:
        layer = _masksembles(row, n, scale, stacks[row.path])
        for path in by_path[row.path]:
            _replace(copy, path, layer)
        placed[id(layer)] = by_path[row.path]
    declare_batch_axes(copy, example, placed, _call_on)
    copy.masksembles_report = report  # type: ignore[attr-defined]  # a static attribute: LayerReport is hashable
    return copy
