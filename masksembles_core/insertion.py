"""Where a model gets Masksembles layers: the rule shared by every framework's ``insert`` and ``convert_dropout``.

An adapter lists the layers of a model in order (their paths) and the candidates among them (the layers whose input
may get masks, with their input channel count; for ``convert_dropout``, the dropouts that masks may replace), and
``plan_insertion`` (``insert``) or ``plan_conversion`` (``convert_dropout``) decides, the same way in every framework:

- the network's first layers (``first_layers``, as the adapter finds them, whatever ``before`` selects: the
  convolution, linear or embedding layers that read the raw input, image or feature channels; one per input of a
  model with an image and a tabular input, say) are skipped when they are candidates, unless ``include_first`` is
  set;
- with ``start`` (a layer path, e.g. ``"layer3"``), candidates before that layer in the model's order are skipped;
  a ``start`` that names no layer is an error that lists the model's top-level layers;
- a candidate the adapter marked with a reason (e.g. a depthwise convolution, a dropout with ``p=0``, a layer whose
  weights other code uses, worded by ``used_outside_its_call``) is skipped with that reason, and so is one with a
  single input channel (every mask would keep it) or too few for n distinct masks (members would share masks);
- the ``i``-th layer given masks gets them from ``derive_seed(seed, i)``.

``plan_conversion`` applies the same rules without ``start`` (a dropout that reads the raw input is a first layer).
The result is a ``LayerReport``: one row per candidate, what was done and why, printable as a Markdown table.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from ._generation import derive_seed, ones_per_mask
from ._validation import check_int, check_n, check_scale

INSERTED = "inserted"
CONVERTED = "converted"
LEFT = "left as is"

# Why convert_dropout leaves a dropout as is, in every framework's words.
ZERO_RATE = "rate=0: it drops nothing"
PER_SAMPLE = "per-sample dropout (stochastic depth): it drops whole samples, not channels"


def attention_dropout_reason(source: str) -> str:
    """The reason for an attention-weight dropout; ``source`` says how it was found (``"named 'attn_drop'"``)."""
    return f"attention-weight dropout ({source}): its input is attention weights, not channels"


@dataclass(frozen=True)
class LayerChange:
    """One layer that ``insert`` or ``convert_dropout`` looked at.

    Attributes:
        path: the layer's path in the model (``"layer3.0.conv1"``, a Keras layer name, ``"blocks[2].conv"``).
        layer: the layer's type name.
        action: ``"inserted"`` (masks placed on the layer's input), ``"converted"`` (a dropout replaced by masks)
            or ``"left as is"``.
        channels: number of channels the masks cover (None when nothing was placed).
        channel_axis: axis of those channels in the layer's input (None when nothing was placed).
        seed: seed the masks were generated from (None when nothing was placed).
        reason: why a layer was left as is; for a layer given masks, a note from the adapter (how it chose the
            channel axis, say) or empty.
    """

    path: str
    layer: str
    action: str
    channels: int | None = None
    channel_axis: int | None = None
    seed: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class LayerReport:
    """What ``insert``/``convert_dropout`` did to a model, one row per layer it looked at; prints as a table."""

    operation: str
    n: int
    scale: float
    rows: tuple[LayerChange, ...]

    @property
    def changed(self) -> tuple[LayerChange, ...]:
        """The rows where masks were placed."""
        return tuple(row for row in self.rows if row.action != LEFT)

    @property
    def unchanged(self) -> tuple[LayerChange, ...]:
        """The rows left as is, each with its reason."""
        return tuple(row for row in self.rows if row.action == LEFT)

    def __str__(self) -> str:
        header = (
            f"{self.operation}: Masksembles n={self.n}, scale={self.scale:g} on {len(self.changed)} of "
            f"{len(self.rows)} layers"
        )
        lines = [
            header,
            "",
            "| layer | type | action | channels | axis | seed | reason |",
            "|---|---|---|---:|---:|---:|---|",
        ]
        for row in self.rows:
            cells = (row.channels, row.channel_axis, row.seed)
            numbers = " | ".join("" if value is None else str(value) for value in cells)
            lines.append(f"| {row.path} | {row.layer} | {row.action} | {numbers} | {row.reason} |")
        return "\n".join(lines)


@dataclass(frozen=True)
class Candidate:
    """A layer whose input may get masks, as an adapter found it.

    Attributes:
        path: the layer's path in the model, one of the paths given to ``plan_insertion`` as ``order``.
        layer: the layer's type name.
        channels: channels of its input (``in_channels``/``in_features``, or the last axis of a Keras input).
        channel_axis: axis of those channels in its input.
        reason: set by the adapter when masks cannot or should not go there (the layer is then left as is).
        note: kept in the report when masks do go there (e.g. "axis -1 from the input's rank").
    """

    path: str
    layer: str
    channels: int
    channel_axis: int
    reason: str = ""
    note: str = ""


def used_outside_its_call(user: str, weights: Iterable[str] = ()) -> str:
    """The reason a layer is left alone when other code uses its weights without calling the layer.

    Masks go on a layer's input where the layer is called; code that takes its weights itself (torchvision's
    shifted-window attention runs ``F.linear(x, self.qkv.weight, ...)``, a tied output projection reads an
    embedding's matrix) computes with them on an input no mask reaches.

    Args:
        user: who uses the weights, as the adapter names it (``"'features.1.0.attn' (ShiftedWindowAttention)"``).
        weights: the names of the weights used, when known (``("weight", "bias")``).
    """
    names = ", ".join(weights)
    listed = f" ({names})" if names else ""
    return f"its weights{listed} are used by {user} outside its own call: a mask on its input would not apply there"


def read_through_wrapper(user: str, names: Iterable[str]) -> str:
    """The reason a layer is left alone when the model reads attributes of it that are not weights (``out_features``)
    through the wrapper ``insert`` puts in its place."""
    return f"its attributes ({', '.join(names)}) are read by {user}, and Masked does not forward them"


def wrapper_attribute_error(layer: str, name: str) -> str:
    """The error for code that reads attribute ``name`` of a wrapped ``layer`` (a type name) through its wrapper."""
    return (
        f"Masked does not forward attributes to its {layer}: read .layer.{name} (code that uses a wrapped layer's "
        "weights without calling it would skip the masks; insert(..., example_input=...) leaves such layers alone)"
    )


def check_insert_arguments(n: object, scale: object, seed: object, start: object) -> tuple[int, float, int | None]:
    """Validate ``insert``'s common arguments, in one order for every framework; return (n, scale, seed)."""
    n = check_n(n)
    scale = check_scale(scale)
    checked_seed = None if seed is None else check_int("seed", seed, minimum=0)
    if start is not None and not isinstance(start, str):
        raise TypeError(f"start must be a layer path (str) or None; received {start!r} ({type(start).__name__})")
    return n, scale, checked_seed


def plan_insertion(
    candidates: Sequence[Candidate],
    order: Sequence[str],
    n: int,
    scale: float,
    *,
    seed: int | None,
    first_layers: Collection[str] = (),
    start: str | None = None,
    include_first: bool = False,
) -> LayerReport:
    """Decide which candidates get masks on their input (rules in the module docstring).

    Args:
        candidates: the layers matching the user's choice of types, in the model's order.
        order: the paths of all layers of the model, in order (``start`` is looked up here).
        n, scale, seed: as given to ``insert`` (validated by ``check_insert_arguments``).
        start: the path of the layer insertion starts from, or None for the whole model.
        first_layers: the paths of the layers that read the raw input (the network's first layer, or several: one
            per input of a multi-input model); empty when the model has none, every candidate is then a later layer.
        include_first: also mask the input of the network's first layers (the raw input).

    Raises:
        ValueError: ``start`` names no layer of the model, or no candidate gets masks (the message holds the report).
    """
    position = {path: i for i, path in enumerate(order)}
    first_allowed = 0
    if start is not None:
        if start not in position:
            top = sorted({name for name in (re.split(r"[/.\[]", path, maxsplit=1)[0] for path in order) if name})
            shown = ", ".join(repr(name) for name in top[:20]) + (", ..." if len(top) > 20 else "")
            raise ValueError(f"start={start!r} names no layer of the model; its top-level layers are {shown}")
        first_allowed = position[start]
    before_start = {candidate.path for candidate in candidates if position[candidate.path] < first_allowed}
    rows = _plan_rows(candidates, n, scale, seed, first_layers, include_first, INSERTED, before_start, start)
    report = LayerReport("insert", n, scale, rows)
    if not report.changed:
        raise ValueError(f"insert found no layer to put masks before ({len(candidates)} candidates)\n{report}")
    return report


def plan_conversion(
    candidates: Sequence[Candidate],
    n: int,
    scale: float,
    *,
    seed: int | None,
    first_layers: Collection[str] = (),
    include_first: bool = False,
    converts: str = "dropout layers",
) -> LayerReport:
    """Decide which dropouts ``convert_dropout`` replaces by masks: ``plan_insertion``'s rules, without ``start``.

    Args:
        candidates: every dropout the adapter looked at, in the model's order; ``channels``/``channel_axis`` describe
            the dropout's input, ``reason`` says why it cannot be converted (``p=0``, a per-sample dropout, ...).
        n, scale, seed: as given to ``convert_dropout`` (validated by ``check_insert_arguments``).
        first_layers: the paths of the dropouts that read the raw input (an input dropout), skipped unless
            ``include_first``.
        include_first: also convert the dropouts that read the raw input.
        converts: what the adapter converts, named in the error when nothing is converted.

    Raises:
        ValueError: no dropout converted (the message holds the report).
    """
    rows = _plan_rows(candidates, n, scale, seed, first_layers, include_first, CONVERTED, frozenset(), None)
    return _some_converted(LayerReport("convert_dropout", n, scale, rows), converts)


def leave_converted(report: LayerReport, paths: Collection[str], reason: str, converts: str) -> LayerReport:
    """``report`` with the converted rows at ``paths`` left as is for ``reason`` (the adapter put the dropouts back:
    found not to be called as the model runs at inference, say); raises as ``plan_conversion`` does when none is
    converted any more."""
    rows = tuple(
        LayerChange(row.path, row.layer, LEFT, reason=reason) if row.path in paths and row.action == CONVERTED else row
        for row in report.rows
    )
    return _some_converted(dataclasses.replace(report, rows=rows), converts)


def _some_converted(report: LayerReport, converts: str) -> LayerReport:
    if not report.changed:
        raise ValueError(
            f"convert_dropout converted no dropout ({len(report.rows)} looked at; it converts {converts})\n{report}"
        )
    return report


def _channels_reason(channels: int, n: int, scale: float) -> str:
    """Why ``channels`` input channels cannot get n distinct masks ("" when they can)."""
    if channels < 2:
        return "a single input channel: every mask would keep it"
    if n > 1 and scale > 1:
        ones = ones_per_mask(channels, n, scale)
        distinct = math.comb(channels, ones)
        if distinct < n:
            return (
                f"{channels} input channels: only {distinct} distinct masks of {ones} ones exist, fewer than n={n} "
                "(members would share masks)"
            )
    return ""


def _plan_rows(
    candidates: Sequence[Candidate],
    n: int,
    scale: float,
    seed: int | None,
    first_layers: Collection[str],
    include_first: bool,
    action: str,
    before_start: Collection[str],
    start: str | None,
) -> tuple[LayerChange, ...]:
    """One row per candidate: ``action`` with the ``i``-th seed, or left as is with the first reason that applies."""
    if isinstance(first_layers, str):
        raise TypeError(f"first_layers must be a collection of layer paths, not one str; received {first_layers!r}")
    first = frozenset(first_layers)
    rows: list[LayerChange] = []
    placed = 0
    for candidate in candidates:
        reason = candidate.reason
        if not reason and candidate.path in first and not include_first:
            reason = "the network's first layer: it reads the raw input (include_first=True masks it)"
        if not reason and candidate.path in before_start:
            reason = f"before start={start!r}"
        reason = reason or _channels_reason(candidate.channels, n, scale)
        if reason:
            rows.append(LayerChange(candidate.path, candidate.layer, LEFT, reason=reason))
            continue
        layer_seed = derive_seed(seed, placed)
        placed += 1
        rows.append(
            LayerChange(
                candidate.path,
                candidate.layer,
                action,
                candidate.channels,
                candidate.channel_axis,
                layer_seed,
                candidate.note,
            )
        )
    return tuple(rows)
