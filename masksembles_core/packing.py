"""Packed inference planning, shared by every framework: which channels each member computes, and how.

A model is described as a graph of ``GraphNode`` (kinds below), in topological order. ``plan_program`` decides, for
the members asked for, which channels of every node each member computes, where they sit, and which tensors run at
full width; adapters capture their framework's graph into nodes, then emit one kernel per step and one per move.

Kinds (what output channel ``c`` reads; ``channels`` is the size of the node's channel axis):

- ``"input"``: the model input (all channels, the same for every member);
- ``"mixing"``: every input channel (Linear, a convolution with one group);
- ``"grouped"``: the input channels of its group (a convolution with ``groups`` groups; depthwise included);
  ``zero_preserving[c]``: the bias of ``c`` is zero, so zero inputs give a zero output;
- ``"channelwise"``: input channel ``c`` only (activations, BatchNorm, pooling, a scalar factor, Dropout, a move of
  the channel axis); ``zero_preserving[c]``: the operation maps a zero channel ``c`` to zero, as the adapter proved
  by evaluating it on zeros with its own arguments (a bool for every channel, or one per channel);
- ``"combine"``: channel ``c`` of every input, all of ``channels`` channels (a sum, a product, a concatenation
  along another axis); ``zero_rule``: ``"all"`` (zero when every input is zero: sums, concatenations), ``"any"``
  (zero when one input is zero: products of finite values) or ``"never"``; ``"add"`` is a combine with rule "all";
  ``zero_inputs``: the positions of the inputs the rule reads (default: all of them), e.g. the two values of a
  ``select(predicate, a, b)``, which is zero where both are, whatever the predicate. The inputs at ``broadcast``
  positions have size 1 on the channel axis (a padding mask broadcast along the channels, ``x * mask[..., None]``):
  every channel reads their one value, so they are read as they are, every channel of their own, by every member's
  block. That is exact only for a *shared* one (below); a combine whose broadcast input is not shared runs as a
  fallback. The rule reads the other inputs: a product is zero where one of them is (the broadcast value, finite,
  cannot make a zero nonzero), a sum never known zero where its rule would read a broadcast input;
- ``"concat"``: the inputs' channels one after the other (``parts``: channels of each input);
- ``"norm"``: every input channel, zeros counted (LayerNorm, GroupNorm over the channels): after it every channel is
  live again;
- ``"mean_ratio"``: input channel ``c`` divided by a function of the mean over every input channel, zeros counted
  (GRN's ``g / (g.mean(channels) + eps)``): a zero channel adds nothing to the mean's sum, whose divisor is the full
  width ``channels``, so each member's block computes it from the channels it holds (its padding left out) and the
  full width; ``zero_preserving[c]`` as for channelwise (evaluated: 0 / (0 + eps) is 0 where eps is not 0);
- ``"masks"``: a Masksembles layer (``masks`` (n, C) bool);
- ``"flatten"``: (B, C, *spatial) -> (B, C*spatial), feature ``c*spatial + s`` from channel ``c``; with
  ``channels_last``, (B, *spatial, C) -> (B, spatial*C), feature ``s*C + c`` from channel ``c``;
- ``"fallback"``: anything else. It runs as the dense model would run it, at full width on the member-stacked batch
  (member ``k``'s copy of the batch in block ``k``), so its result is exact whatever it computes; it needs every
  channel of every input, and its output is never known to be zero. With ``batch_dependent`` it runs per member even
  when its inputs are shared (it uses the batch size, which is the member-stacked batch's in the dense model).
  With ``folded`` it runs on the members' channel blocks side by side instead, the members folded into an axis it
  keeps apart (attention heads, the adapter having checked that every operation of the region treats that axis
  independently): it reads every channel of each input in member blocks, except the inputs at ``broadcast`` positions,
  which it reads as they are (they must be shared: a mask broadcast over the heads), and holds every channel of every
  member, in order, in member blocks (not on the member-stacked batch). A broadcast input that is not shared raises
  ``FoldConflict`` (the adapter then runs the region as plain fallbacks).

Rules, per member:

- *needed*: the output needs every channel; mixing, norm, mean_ratio and fallback nodes need every input channel, and
  so does a combine of its broadcast inputs; a ``batch_dependent`` node needs them even where the member needs none
  of its output (it reads every member's rows of the member-stacked batch, so another member's output can depend on
  them);
  grouped nodes the input channels of the groups they keep; channelwise, combine, concat and flatten nodes the input
  channels of their needed outputs; Masksembles only the needed channels its mask keeps.
- *zero*: a channel is known to be zero after Masksembles drops it and stays zero through zero-preserving channelwise,
  mean_ratio and grouped nodes, flatten, concatenation and combines by their rule; nothing else is assumed zero.
- *kept*: needed, and not (zero and dropped by every consumer). Mixing, grouped, norm, mean_ratio and fallback
  consumers, and combines reading it at a broadcast position, drop zero inputs (they contribute nothing, or the move
  that feeds them writes the zero); any other consumer drops what it does not keep itself.

Placement: a node computed only from the input (before any Masksembles) is *shared*: every member computes the same
values, so the union of the members' kept channels is computed once. Every other node holds, per member, its kept
channels (in increasing order, padded with -1 to the widest member; grouped nodes in whole groups; concatenations
part by part; a mean_ratio node also every channel its input holds, which it reads in its own layout), the members'
blocks side by side on the channel axis. A *dense* node (fallback, or an elementwise node whose inputs are all dense)
holds every channel on the member-stacked batch instead: (m*B, C, ...) as the tiled dense model holds it, or
(B, C, ...) when shared; a folded fallback holds every channel in member blocks when not shared.
``Move``s bring a tensor from its producer's placement to the one its consumer reads.

Around the plan, what every adapter's ``pack`` does the same way: ``per_member_fallbacks`` (the shared fallbacks that
must run per member), ``program_macs`` (multiply-adds of a program and of the members' dense models),
``chosen_members``, ``samples_per_chunk`` (the chunks of the batch a program proven per-sample runs on, on CPU),
``output_mismatch`` and ``verified`` (a built program checked against ``predict`` before it is
returned, and what replaces it when it differs) and
``timed_choice`` (which program ``program="auto"`` keeps, from interleaved timings). ``masksembles_core.captured``
turns an adapter's captured operations into the graph ``plan_program`` reads.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

KINDS = (
    "input", "mixing", "grouped", "channelwise", "combine", "add", "concat", "norm", "mean_ratio", "masks", "flatten",
    "fallback",
)  # fmt: skip
ZERO_RULES = ("all", "any", "never")
OUTPUT = "__output__"  # the name adapters give the fallback node that gathers a model's output leaves
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]
FloatArray = NDArray[np.float64]
ZERO_FILLING = ("mixing", "grouped", "norm", "mean_ratio", "fallback")  # consumers whose input move writes known zeros
# dense when every input is dense
ELEMENTWISE = ("channelwise", "combine", "add", "concat", "norm", "mean_ratio", "flatten")


@dataclass(frozen=True, eq=False)
class GraphNode:
    """One node of a model graph, as the planner sees it (kinds and fields in the module docstring)."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    channels: int
    zero_preserving: bool | BoolArray = True
    spatial: int = 1
    masks: BoolArray | None = None
    channels_last: bool = False
    groups: int = 1
    zero_rule: str = "all"
    parts: tuple[int, ...] = ()
    batch_dependent: bool = False
    zero_inputs: tuple[int, ...] = ()
    folded: bool = False
    broadcast: tuple[int, ...] = ()

    def zero_map(self) -> BoolArray:
        """``zero_preserving`` as one bool per channel."""
        return np.broadcast_to(np.asarray(self.zero_preserving, dtype=bool), (self.channels,)).copy()

    def features(self, per_channel: BoolArray) -> BoolArray:
        """Flatten: expand a per-input-channel vector to the output features."""
        return np.tile(per_channel, self.spatial) if self.channels_last else np.repeat(per_channel, self.spatial)

    def any_feature(self, per_feature: BoolArray) -> BoolArray:
        """Flatten: for each input channel, whether any of its output features is set."""
        grid = per_feature.reshape(self.spatial, -1).T if self.channels_last else per_feature.reshape(-1, self.spatial)
        result: BoolArray = np.any(grid, axis=1)
        return result

    def offsets(self) -> IntArray:
        """Concat: the first output channel of each part."""
        return np.concatenate([[0], np.cumsum(self.parts)[:-1]]).astype(np.int64)


@dataclass(frozen=True, eq=False)
class Placement:
    """Where a node's channels sit: one layout when ``shared``, else one per member.

    A layout holds the original channel at each position of the compacted tensor, -1 for padding. A ``dense``
    placement holds every channel in order on the member-stacked batch (or on the batch when shared).
    """

    shared: bool
    layouts: tuple[IntArray, ...]
    dense: bool = False

    def member_layouts(self, members: int) -> tuple[IntArray, ...]:
        """One layout per member (a shared layout repeated)."""
        return self.layouts * members if self.shared else self.layouts

    @property
    def width(self) -> int:
        return len(self.layouts[0])

    @property
    def full(self) -> bool:
        """Every channel, in order, in every layout."""
        return all(np.array_equal(layout, np.arange(len(layout))) for layout in self.layouts)


@dataclass(frozen=True, eq=False)
class Move:
    """One step of bringing a tensor to the placement its consumer reads.

    Kinds: ``"select"`` (gather ``index`` on the channel axis, member blocks side by side, then multiply by
    ``scale``), ``"to_batch"`` (member blocks on the channel axis of a full placement -> member-stacked batch),
    ``"to_channels"`` (the reverse) and ``"tile"`` (a shared dense tensor -> member-stacked batch).
    """

    kind: str
    index: IntArray | None = None
    scale: FloatArray | None = None

    @property
    def repeats(self) -> int:
        """Select: the number of identical blocks (a shared tensor laid out once per member, scale 1), else 1."""
        if self.kind != "select" or self.index is None or self.scale is None or not (self.scale == 1).all():
            return 1
        for members in range(len(self.index), 1, -1):
            if len(self.index) % members == 0:
                blocks = self.index.reshape(members, -1)
                if (blocks == blocks[0]).all():
                    return members
        return 1


@dataclass(frozen=True, eq=False)
class Edge:
    """One input of a step: its producer, the placement the step reads, and the moves from one to the other."""

    source: str
    placement: Placement
    moves: tuple[Move, ...]


@dataclass(frozen=True, eq=False)
class Step:
    """One node of the program: its output placement and how each input reaches it.

    ``groups``: a grouped node's groups per copy after packing (the groups it keeps, padded to the widest member).
    """

    node: GraphNode
    placement: Placement
    edges: tuple[Edge, ...]
    groups: int = 1

    @property
    def name(self) -> str:
        return self.node.name


@dataclass(frozen=True, eq=False)
class Program:
    """The packed computation of ``members``: steps in graph order (the input first), the output's name."""

    steps: tuple[Step, ...]
    output: str
    members: tuple[int, ...]
    kept: tuple[dict[str, BoolArray], ...] = field(repr=False)

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The nodes that run at full width on the member-stacked batch because nothing here knows how to compact
        them (folded ones are in ``folded``)."""
        return tuple(step.name for step in self.steps if step.node.kind == "fallback" and not self._folded(step))

    @property
    def folded(self) -> tuple[str, ...]:
        """The folded fallbacks that run on the members' channel blocks (not shared: a shared one runs once, as the
        model does)."""
        return tuple(step.name for step in self.steps if self._folded(step))

    @staticmethod
    def _folded(step: Step) -> bool:
        return step.node.folded and not step.placement.shared

    def step(self, name: str) -> Step:
        return next(step for step in self.steps if step.name == name)


def _check(nodes: Sequence[GraphNode], output: str) -> dict[str, GraphNode]:
    by_name: dict[str, GraphNode] = {}
    for node in nodes:
        if node.kind not in KINDS:
            raise ValueError(f"node {node.name!r}: kind must be one of {KINDS}; received {node.kind!r}")
        missing = [name for name in node.inputs if name not in by_name]
        if missing:
            raise ValueError(f"node {node.name!r} reads {missing} before they are defined")
        sources = [by_name[name] for i, name in enumerate(node.inputs) if i not in node.broadcast]
        if node.kind in ("combine", "add", "channelwise", "mean_ratio", "masks") and any(
            s.channels != node.channels for s in sources
        ):
            raise ValueError(f"{node.kind} node {node.name!r} has {node.channels} channels; its inputs must too")
        if node.kind == "combine" and node.zero_rule not in ZERO_RULES:
            raise ValueError(f"node {node.name!r}: zero_rule must be one of {ZERO_RULES}; received {node.zero_rule!r}")
        if node.folded and node.kind != "fallback":
            raise ValueError(f"node {node.name!r}: only a fallback folds")
        if node.broadcast and (
            node.kind not in ("fallback", "combine", "add")
            or not all(0 <= i < len(node.inputs) for i in node.broadcast)
            or (node.kind != "fallback" and not sources)
        ):
            raise ValueError(
                f"node {node.name!r}: broadcast {node.broadcast} must be inputs of a fallback, or of a combine that "
                "has an input of its channels"
            )
        if node.zero_inputs and (
            node.kind != "combine" or not all(0 <= i < len(node.inputs) for i in node.zero_inputs)
        ):
            raise ValueError(
                f"node {node.name!r}: zero_inputs {node.zero_inputs} must be positions of a combine's inputs"
            )
        if node.kind == "concat" and (
            sum(node.parts) != node.channels or [s.channels for s in sources] != list(node.parts)
        ):
            raise ValueError(f"concat node {node.name!r}: parts {node.parts} must be its inputs' channels")
        if node.kind == "grouped" and (node.channels % node.groups or sources[0].channels % node.groups):
            raise ValueError(f"grouped node {node.name!r}: {node.groups} groups must divide its channels")
        by_name[node.name] = node
    if output not in by_name:
        raise ValueError(f"output {output!r} is not a node")
    return by_name


def _zeros(nodes: Sequence[GraphNode], member: int) -> dict[str, BoolArray]:
    """For each node, the channels known to be zero for ``member`` (the forward rule)."""
    zero: dict[str, BoolArray] = {}
    for node in nodes:
        sources = [zero[name] for name in node.inputs]
        if node.kind == "masks":
            assert node.masks is not None
            zero[node.name] = sources[0] | ~node.masks[member]
        elif node.kind in ("channelwise", "mean_ratio"):
            zero[node.name] = sources[0] & node.zero_map()
        elif node.kind in ("combine", "add"):
            rule = "all" if node.kind == "add" else node.zero_rule
            positions = node.zero_inputs or tuple(range(len(sources)))
            deciding = [sources[i] for i in positions if i not in node.broadcast]
            if rule == "never" or not deciding or (rule == "all" and len(deciding) < len(positions)):
                zero[node.name] = np.zeros(node.channels, dtype=bool)  # a broadcast summand need not be zero
            else:
                zero[node.name] = (np.logical_and if rule == "all" else np.logical_or).reduce(deciding)
        elif node.kind == "concat":
            zero[node.name] = np.concatenate(sources)
        elif node.kind == "flatten":
            zero[node.name] = node.features(sources[0])
        elif node.kind == "grouped":
            group_zero = sources[0].reshape(node.groups, -1).all(axis=1)
            zero[node.name] = np.repeat(group_zero, node.channels // node.groups) & node.zero_map()
        else:
            zero[node.name] = np.zeros(node.channels, dtype=bool)
    return zero


def kept_channels(nodes: Sequence[GraphNode], output: str, member: int) -> dict[str, BoolArray]:
    """The channels of every node that member ``member`` computes (rules in the module docstring)."""
    by_name = _check(nodes, output)
    consumers: dict[str, list[tuple[GraphNode, int]]] = {node.name: [] for node in nodes}
    for node in nodes:
        for position, name in enumerate(node.inputs):
            consumers[name].append((node, position))
    zero = _zeros(nodes, member)
    needed = {node.name: np.zeros(node.channels, dtype=bool) for node in nodes}
    needed[output][:] = True
    kept: dict[str, BoolArray] = {}
    required: dict[str, BoolArray] = {}  # flatten: the features its consumers must find
    for node in reversed(nodes):  # backward: needed, then kept
        demand = needed[node.name]
        tolerant = np.full(node.channels, node.name != output)
        for user, position in consumers[node.name]:
            if user.kind == "flatten":
                tolerant &= ~user.any_feature(required[user.name])
            elif user.kind == "concat":
                start = int(user.offsets()[position])
                tolerant &= ~kept[user.name][start : start + node.channels]
            elif user.kind not in ZERO_FILLING and position not in user.broadcast:
                tolerant &= ~kept[user.name]
        if node.kind == "flatten":
            required[node.name] = ~tolerant
        kept[node.name] = demand & ~(zero[node.name] & tolerant)
        for position, name in enumerate(node.inputs):
            source = needed[name]
            if node.batch_dependent:  # it mixes the members' rows (predict's batch): others may need this member's
                source[:] = True
            elif node.kind in ("mixing", "norm", "mean_ratio", "fallback") or position in node.broadcast:
                source |= bool(demand.any())
            elif node.kind == "grouped":
                used = kept[node.name].reshape(node.groups, -1).any(axis=1)
                source |= np.repeat(used, by_name[name].channels // node.groups)
            elif node.kind == "flatten":
                source |= node.any_feature(demand)
            elif node.kind == "masks":
                assert node.masks is not None
                source |= demand & node.masks[member]
            elif node.kind == "concat":
                start = int(node.offsets()[position])
                source |= demand[start : start + by_name[name].channels]
            else:
                source |= demand
    return kept


class FoldConflict(Exception):
    """A folded node whose broadcast input is not shared (the adapter runs its region as plain fallbacks, then plans
    again)."""

    def __init__(self, node: str) -> None:
        super().__init__(node)
        self.node = node


class AxisConflict(Exception):
    """A node whose channel axis cannot agree with its neighbours' (the adapter runs it as a fallback, then again)."""

    def __init__(self, node: Hashable) -> None:
        super().__init__(node)
        self.node = node


@dataclass(frozen=True, eq=False)
class AxisRule:
    """How a compacted node's output channel axis relates to its inputs' (adapters find a node's rule).

    Rules: ``"fixed"`` (its inputs have their channels on ``fixed_in``, its output on ``fixed_out``: Linear, a
    convolution), ``"same"`` (inputs and output on one axis: elementwise operations), ``"concat"`` (the same; with no
    axis known yet, ``concat_dim``), ``"flatten"`` (the output's channels are on axis 1) and ``"map"`` (a move or a
    reduction: ``mapped(a)`` is the output axis of input channels on axis ``a``, None where they do not come out
    whole).
    """

    node: Hashable
    inputs: tuple[Hashable, ...]
    rule: str
    fixed_in: int = -1
    fixed_out: int = -1
    concat_dim: int = 0
    mapped: Callable[[int], int | None] | None = None


def channel_axes(rules: Sequence[AxisRule], rank: Callable[[Hashable], int]) -> dict[Hashable, int]:
    """The channel axis of every node the rules mention, propagated through the rules until nothing changes; a node
    no rule decides gets its last axis. ``rank(node)`` is the rank of its value.

    Raises:
        AxisConflict: for the node whose rule disagrees with an axis already set (or names no axis of its value).
    """
    axis: dict[Hashable, int] = {}

    def put(node: Hashable, value: int, by: AxisRule) -> bool:
        if node in axis:
            if axis[node] != value:
                raise AxisConflict(by.node)
            return False
        if not 0 <= value < rank(node):
            raise AxisConflict(by.node)
        axis[node] = value
        return True

    def apply(rule: AxisRule) -> bool:
        changed = False
        if rule.rule == "fixed":
            for source in rule.inputs:
                changed |= put(source, rule.fixed_in, rule)
            return put(rule.node, rule.fixed_out, rule) or changed
        if rule.rule in ("same", "concat"):
            known = [axis[n] for n in (rule.node, *rule.inputs) if n in axis]
            if rule.rule == "concat" and not known:
                known = [rule.concat_dim]
            for n in (rule.node, *rule.inputs) if known else ():
                changed |= put(n, known[0], rule)
            return changed
        if rule.rule == "flatten":
            return put(rule.node, 1, rule)
        assert rule.rule == "map" and rule.mapped is not None
        source = rule.inputs[0]
        if source in axis:
            mapped = rule.mapped(axis[source])
            if mapped is None:
                raise AxisConflict(rule.node)
            return put(rule.node, mapped, rule)
        if rule.node in axis:
            candidates = [a for a in range(rank(source)) if rule.mapped(a) == axis[rule.node]]
            if len(candidates) != 1:
                raise AxisConflict(rule.node)
            return put(source, candidates[0], rule)
        return False

    while True:
        changed = True
        while changed:
            changed = False
            for rule in rules:
                changed |= apply(rule)
        unknown = [rule for rule in rules if rule.node not in axis]
        if not unknown:
            return axis
        put(unknown[0].node, rank(unknown[0].node) - 1, unknown[0])


def per_member_fallbacks(
    nodes: Sequence[tuple[Hashable, str, Sequence[Hashable], bool]], repeatable: Callable[[Hashable], bool]
) -> set[Hashable]:
    """The fallbacks that must also run per member on the member-stacked batch: those whose shared result cannot be
    repeated for every member (``repeatable`` says no: it has no exact batch axis) while a per-member node reads it.

    ``nodes`` are ``(name, kind, inputs, batch_dependent)`` in topological order. A node is per member when it is a
    Masksembles layer, already runs per member (``batch_dependent``: it reads the batch), was marked here, or reads a
    per-member node; marking a fallback can make its readers per member, so this runs to a fixed point.
    """
    marked: set[Hashable] = set()
    while True:
        member: set[Hashable] = set()
        for name, kind, inputs, dependent in nodes:
            if kind == "masks" or dependent or name in marked or any(i in member for i in inputs):
                member.add(name)
        read = {i for name, _, inputs, _ in nodes if name in member for i in inputs}
        new = {
            name for name, kind, _, _ in nodes if kind == "fallback" and name not in member and name in read
            and not repeatable(name)
        }  # fmt: skip
        if not new:
            return marked
        marked |= new


def flatten_layout(layout: IntArray, spatial: int, *, channels: int = 0, channels_last: bool = False) -> IntArray:
    """Layout after flattening a compacted tensor whose channels follow ``layout``.

    Channels first, (P, *spatial): position ``j*spatial + s`` holds feature ``layout[j]*spatial + s``.
    Channels last, (*spatial, P): position ``s*P + j`` holds feature ``s*channels + layout[j]``, where
    ``channels`` is the uncompacted channel count.
    """
    positions = np.arange(spatial)
    if channels_last:
        features = positions[:, None] * channels + layout[None, :]
        live = np.broadcast_to(layout[None, :] >= 0, features.shape)
    else:
        features = layout[:, None] * spatial + positions[None, :]
        live = np.broadcast_to(layout[:, None] >= 0, features.shape)
    result: IntArray = np.where(live, features, -1).reshape(-1)
    return result


def _padded(kept: BoolArray, width: int, minimum: int = 1) -> IntArray:
    """The kept channels in increasing order, padded with -1 to ``width`` (at least ``minimum`` positions)."""
    channels = np.flatnonzero(kept)
    size = max(width, len(channels), minimum)
    result: IntArray = np.concatenate([channels, np.full(size - len(channels), -1)]).astype(np.int64)
    return result


def _grouped_layouts(kept: Sequence[BoolArray], size: int) -> tuple[tuple[IntArray, ...], int]:
    """Whole groups of ``size`` channels holding the kept ones, padded with -1 groups; and the groups per copy."""
    used = [np.flatnonzero(k.reshape(-1, size).any(axis=1)) for k in kept]
    groups = max(1, *(len(u) for u in used))
    layouts = []
    for u in used:
        channels = (u[:, None] * size + np.arange(size)[None, :]).reshape(-1)
        layouts.append(np.concatenate([channels, np.full((groups - len(u)) * size, -1)]).astype(np.int64))
    return tuple(layouts), groups


def _full(channels: int, shared: bool, members: int) -> Placement:
    """Every channel in order: a shared layout, or one per member."""
    return Placement(shared, (np.arange(channels, dtype=np.int64),) * (1 if shared else members))


def gather_plan(
    source: Placement, target: Placement, scales: Sequence[NDArray[np.float64]] | None = None
) -> tuple[IntArray, NDArray[np.float64]] | None:
    """Index and scale that move ``source``'s positions into ``target``'s layout, or None if nothing moves.

    The index addresses the source's channel axis with the members' blocks side by side; the
    scale is ``scales[k][c]`` (default 1) for a channel the source holds, 0 for a channel the
    target keeps that the source dropped (a known zero) and 1 for padding.
    """
    same = source.shared == target.shared and scales is None
    if same and all(np.array_equal(a, b) for a, b in zip(source.layouts, target.layouts, strict=True)):
        return None
    index: list[int] = []
    scale: list[float] = []
    for k, layout in enumerate(target.layouts):  # a shared target has one layout: its source is shared too
        own = source.layouts[0 if source.shared else k]
        position = {int(c): p for p, c in enumerate(own) if c >= 0}
        offset = 0 if source.shared else k * len(own)
        for c in layout.tolist():
            index.append(offset + position.get(c, 0))
            if c < 0:
                scale.append(1.0)
            elif c in position:
                scale.append(1.0 if scales is None else float(scales[k][c]))
            else:
                scale.append(0.0)
    index_array = np.asarray(index, dtype=np.int64)
    scale_array = np.asarray(scale, dtype=np.float64)
    source_length = source.width * (1 if source.shared else len(source.layouts))
    moves = len(index) != source_length or not np.array_equal(index_array, np.arange(len(index)))
    moves = moves or not (scale_array == 1).all()
    return (index_array, scale_array) if moves or source.shared != target.shared else None


def _select(source: Placement, target: Placement, scales: Sequence[FloatArray] | None = None) -> tuple[Move, ...]:
    plan = gather_plan(source, target, scales)
    return () if plan is None else (Move("select", *plan),)


def moves_between(
    source: Placement, target: Placement, members: int, scales: Sequence[FloatArray] | None = None
) -> tuple[Move, ...]:
    """The moves that bring a tensor placed as ``source`` to ``target`` (``scales``: per-member channel factors).

    A shared dense tensor is also a shared compacted one with every channel; a member dense tensor becomes one with
    ``to_channels``. A dense target is reached through a full compacted layout (known zeros written by the select).
    """
    channels = len(source.layouts[0]) if source.dense else 0
    if source.dense and not source.shared:
        start: tuple[Move, ...] = (Move("to_channels"),)
        compact = _full(channels, False, members)
    else:
        start, compact = (), Placement(source.shared, source.layouts)
    if not target.dense:
        return (*start, *_select(compact, target, scales))
    if target.shared:
        return (*start, *_select(compact, Placement(True, target.layouts)))
    if source.dense:
        return () if not source.shared else (Move("tile"),)
    if compact.shared:
        return (*_select(compact, Placement(True, target.layouts[:1])), Move("tile"))
    return (*_select(compact, Placement(False, target.layouts)), Move("to_batch"))


def plan_program(nodes: Sequence[GraphNode], output: str, members: Sequence[int]) -> Program:
    """The packed program of ``members`` (indices into the masks): placements, moves and fallbacks of every node
    (a combine whose broadcast input is not shared among them)."""
    _check(nodes, output)
    nodes = _unshared_broadcasts_as_fallbacks(nodes)
    by_name = {node.name: node for node in nodes}
    chosen = tuple(int(k) for k in members)
    m = len(chosen)
    kept = tuple(kept_channels(nodes, output, k) for k in chosen)
    placements: dict[str, Placement] = {}
    steps: list[Step] = []
    for node in nodes:
        sources = [placements[name] for name in node.inputs]
        shared = node.kind != "masks" and not node.batch_dependent and all(source.shared for source in sources)
        member_kept = [member[node.name] for member in kept]
        reads: list[Placement] = list(sources)  # what the node reads, before the moves are planned
        groups = 1
        if node.kind == "input":
            placement = _full(node.channels, True, m)
        elif node.folded and not shared:
            placement = _full(node.channels, False, m)
            reads = [_folded_read(node, position, by_name[name], sources[position], m)
                     for position, name in enumerate(node.inputs)]  # fmt: skip
        elif node.kind == "fallback" or (
            node.kind in ELEMENTWISE and sources and all(source.dense for source in sources)
        ):
            placement = Placement(shared, _full(node.channels, shared, m).layouts, dense=True)
            reads = [Placement(shared, _full(by_name[n].channels, shared, m).layouts, dense=True) for n in node.inputs]
        elif node.kind == "flatten":
            channels = node.channels // node.spatial
            layouts = tuple(
                flatten_layout(layout, node.spatial, channels=channels, channels_last=node.channels_last)
                for layout in sources[0].layouts
            )
            placement = Placement(sources[0].shared, layouts)
        elif node.kind == "norm":
            placement = _full(node.channels, shared, m)
            reads = [_full(by_name[node.inputs[0]].channels, shared, m)]
        elif node.kind == "mean_ratio":  # the channels it keeps and every one its input holds (the mean's terms)
            held = [k | member[node.inputs[0]] for k, member in zip(member_kept, kept, strict=True)]
            width = max(int(h.sum()) for h in held)
            layouts = (_padded(np.logical_or.reduce(held), 1),) if shared else tuple(_padded(h, width) for h in held)
            placement = Placement(shared, layouts)
            reads = [placement]
        elif node.kind == "grouped":
            size = node.channels // node.groups
            layouts, groups = _grouped_layouts([np.logical_or.reduce(member_kept)] if shared else member_kept, size)
            placement = Placement(shared, layouts)
            in_size = by_name[node.inputs[0]].channels // node.groups
            reads = [Placement(shared, tuple(_group_inputs(layout, size, in_size) for layout in layouts))]
        elif node.kind == "concat":
            placement, reads = _concat(node, [np.logical_or.reduce(member_kept)] if shared else member_kept, shared)
        elif shared:
            placement = Placement(True, (_padded(np.logical_or.reduce(member_kept), 1),))
        else:
            width = max(int(k.sum()) for k in member_kept)
            placement = Placement(False, tuple(_padded(k, width) for k in member_kept))
        if node.kind in ("channelwise", "combine", "add", "masks") and not placement.dense:
            reads = [_broadcast_read(by_name[name], sources[i], m) if i in node.broadcast else placement
                     for i, name in enumerate(node.inputs)]  # fmt: skip
        elif node.kind == "mixing":  # reads its input as it is, a dense one with its channels side by side
            reads = [Placement(source.shared, source.layouts) for source in sources]
        edges = []
        for name, read in zip(node.inputs, reads, strict=True):
            scales = None
            if node.kind == "masks":
                assert node.masks is not None
                scales = [node.masks[k].astype(np.float64) for k in chosen]
            moves = () if node.kind == "flatten" else moves_between(placements[name], read, m, scales)
            edges.append(Edge(name, read, moves))
        placements[node.name] = placement
        steps.append(Step(node, placement, tuple(edges), groups))
    return Program(tuple(steps), output, chosen, kept)


def _unshared_broadcasts_as_fallbacks(nodes: Sequence[GraphNode]) -> list[GraphNode]:
    """``nodes`` with every combine whose broadcast input is not shared (computed per member: each member's block
    would need its own value) turned into a fallback, which runs it on the member-stacked batch."""
    shared: dict[str, bool] = {}
    result = []
    for node in nodes:
        if node.kind in ("combine", "add") and not all(shared[node.inputs[i]] for i in node.broadcast):
            node = GraphNode(node.name, "fallback", node.inputs, node.channels)
        shared[node.name] = node.kind != "masks" and not node.batch_dependent and all(shared[n] for n in node.inputs)
        result.append(node)
    return result


def _broadcast_read(source: GraphNode, placed: Placement, members: int) -> Placement:
    """How a node reads a broadcast input (a shared one): once, with every channel, as it is placed."""
    return Placement(True, _full(source.channels, True, members).layouts, dense=placed.dense)


def _folded_read(node: GraphNode, position: int, source: GraphNode, placed: Placement, members: int) -> Placement:
    """How a folded node reads its input at ``position``: a broadcast one once, with every channel, as it is placed
    (it must be shared), any other one with every channel in member blocks."""
    if position not in node.broadcast:
        return _full(source.channels, False, members)
    if not placed.shared:
        raise FoldConflict(node.name)
    return _broadcast_read(source, placed, members)


def _group_inputs(layout: IntArray, out_size: int, in_size: int) -> IntArray:
    """The input channels of the groups in a grouped node's output ``layout`` (whole groups), -1 for padding."""
    first = layout.reshape(-1, out_size)[:, :1]
    channels = first // out_size * in_size + np.arange(in_size)[None, :]
    result: IntArray = np.where(first >= 0, channels, -1).reshape(-1).astype(np.int64)
    return result


def _concat(node: GraphNode, kept: Sequence[BoolArray], shared: bool) -> tuple[Placement, list[Placement]]:
    """A concatenation's placement (its parts' layouts one after the other) and the placement each part is read in."""
    offsets = node.offsets().tolist()
    parts = []
    for offset, size in zip(offsets, node.parts, strict=True):
        part_kept = [member[offset : offset + size] for member in kept]
        width = max(int(member.sum()) for member in part_kept)
        parts.append(Placement(shared, tuple(_padded(member, width, minimum=0) for member in part_kept)))
    if all(part.width == 0 for part in parts):  # nothing kept: one padding position, read from the first part
        parts[0] = Placement(shared, tuple(np.array([-1], dtype=np.int64) for _ in kept))
    layouts = tuple(
        np.concatenate(
            [np.where(part.layouts[k] >= 0, part.layouts[k] + o, -1) for part, o in zip(parts, offsets, strict=True)]
        )
        for k in range(len(kept))
    )
    return Placement(shared, layouts), parts


def norm_affine(
    mean: ArrayLike, var: ArrayLike, weight: ArrayLike | None, bias: ArrayLike | None, eps: float
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """BatchNorm with running statistics as ``x * scale + shift``: (scale, shift), computed in float64.

    ``weight``/``bias`` None: a BatchNorm without learned scale/offset (1 and 0).
    """
    mean64, var64 = np.asarray(mean, np.float64), np.asarray(var, np.float64)
    scale = (1.0 if weight is None else np.asarray(weight, np.float64)) / np.sqrt(var64 + eps)
    shift = (0.0 if bias is None else np.asarray(bias, np.float64)) - mean64 * scale
    return np.broadcast_to(scale, mean64.shape).copy(), shift


def block_indices(rows: Sequence[IntArray], cols: Sequence[IntArray]) -> tuple[IntArray, IntArray, BoolArray]:
    """Indices that cut member blocks out of a (C_out, C_in, ...) weight: ``w[r, c] * valid``.

    Returns (r, c, valid) of shape (m, P_out, P_in): block ``k`` is ``weight[rows[k]][:, cols[k]]``
    with zeros where a row or a column is padding.
    """
    r = np.stack([np.asarray(row) for row in rows])[:, :, None]
    c = np.stack([np.asarray(col) for col in cols])[:, None, :]
    valid = (r >= 0) & (c >= 0)
    shape = np.broadcast_shapes(r.shape, c.shape)
    return np.broadcast_to(np.maximum(r, 0), shape).copy(), np.broadcast_to(np.maximum(c, 0), shape).copy(), valid


def channel_indices(layouts: Sequence[IntArray]) -> tuple[IntArray, BoolArray]:
    """Index and validity that lay a per-channel vector out like ``layouts`` (blocks side by side)."""
    stacked = np.concatenate(list(layouts))
    return np.maximum(stacked, 0), stacked >= 0


# ------------------------------------------------------------------------------------------------ checks at pack time


@dataclass(frozen=True)
class Cost:
    """What multiply-adds a node costs, per sample, as its adapter measured it: a Linear/convolution's ``positions``
    (output positions per channel) and ``kernel`` (inputs read per input channel: 1 for Linear, the kernel's size
    for a convolution), or a fallback's own multiply-adds in one dense model (attention products, a layer that
    falls back)."""

    positions: int = 0
    kernel: int = 1
    fallback: int = 0


def program_macs(program: Program, costs: Mapping[str, Cost]) -> dict[str, int]:
    """Multiply-adds per sample of the nodes ``costs`` names: ``"dense"`` in the members' dense models (one each),
    ``"packed"`` in the program, ``"fallback"`` in its fallbacks (counted as the dense models run them, once for a
    shared one, which runs once on the batch for every member; a folded fallback costs as much, in ``"dense"`` and
    ``"packed"`` only: it runs on the members' channel blocks)."""
    channels = {step.name: step.node.channels for step in program.steps}
    members = len(program.members)
    macs = {"dense": 0, "packed": 0, "fallback": 0}
    for step in program.steps:
        cost = costs.get(step.name)
        if cost is None:
            continue
        kind = step.node.kind
        if kind == "fallback":
            folded = Program._folded(step)
            copies = 1 if step.placement.shared and not folded else members
            macs["dense"] += cost.fallback * members
            macs["packed"] += cost.fallback * copies
            if not folded:
                macs["fallback"] += cost.fallback * copies
        elif kind in ("mixing", "grouped"):
            source = channels[step.edges[0].source]
            grouped = source // step.node.groups if kind == "grouped" else 0
            macs["dense"] += cost.positions * step.node.channels * (grouped or source) * cost.kernel * members
            copies = 1 if step.placement.shared else members
            inputs = grouped or step.edges[0].placement.width
            macs["packed"] += cost.positions * copies * step.placement.width * inputs * cost.kernel
    return macs


K = TypeVar("K", bound=Hashable)
VERIFY_SAMPLES = 4  # samples of the example input a built program is checked on
VERIFICATION = "verification"  # how the fallback entry starts that adapters write when verification replaced a program
AUTO_ROUNDS = 7  # interleaved timing rounds of pack(program="auto"), at most
AUTO_SLOWER = 1.1  # ``auto`` never keeps a program whose median time is more than this times another's
AUTO_BUILD = 2.0  # ``auto`` stops timing once it has taken this times the preferred program's build time
AUTO_SAMPLES = 8  # ``auto`` times on at least this many samples of the example (all of a smaller one)
AUTO_PLANNED_ROUNDS = 5  # a warm-up and the 4 rounds after which the median of ``AUTO_ROUNDS`` can be settled


def samples_per_chunk(batch: int, bytes_per_sample: int, chunk_bytes: int) -> int:
    """How many samples a program proven per-sample runs at a time so that its largest tensor, ``bytes_per_sample``
    per sample, is about ``chunk_bytes`` in each call: the batch in ceil(total / ``chunk_bytes``) chunks of equal
    size; 0 (the whole batch in one call) where the total is at most ``chunk_bytes``."""
    total = bytes_per_sample * batch
    if total <= chunk_bytes:
        return 0
    return -(-batch // -(-total // chunk_bytes))


def chosen_members(members: Sequence[int] | None, n: int) -> list[int]:
    """The members a program computes: all n when ``members`` is None, else those given, each checked."""
    chosen = list(range(n)) if members is None else list(members)
    for k in chosen:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
            raise ValueError(f"member must be an integer in [0, {n}); received {k!r}")
    return chosen


def program_raised(error: BaseException) -> str:
    """Why a built program that raised on the example differs from the dense model: the error's type and the first
    line of its message (a fallback reason, not a traceback: torch's C++ errors carry a whole stack in theirs)."""
    lines = str(error).strip().splitlines()
    first = f": {lines[0]}" + (" [...]" if len(lines) > 1 else "") if lines else ""
    return f"it raised {type(error).__name__}{first}"


def output_mismatch(expected: Sequence[ArrayLike], actual: Sequence[ArrayLike], eps: Sequence[float]) -> str | None:
    """Why a built program's outputs differ from the dense model's (``predict``), or None when they agree.

    ``expected`` and ``actual`` are the outputs' leaves in the same order (tensors converted to NumPy), ``eps`` the
    machine epsilon of each leaf's dtype (0 for exact dtypes). A float leaf agrees where ``|actual - expected|`` is at
    most ``sqrt(eps)`` times its largest finite ``|expected|``: far above the rounding of a reordered sum, far below
    what a wrong channel or member gives. Where ``expected`` is not finite anything is accepted (a masked inf or NaN
    is NaN in the dense model and absent from a packed one); where only ``actual`` is not, the leaf differs.
    """
    if len(expected) != len(actual):
        return f"the program returns {len(actual)} outputs where predict returns {len(expected)}"
    for index, (want, got, epsilon) in enumerate(zip(expected, actual, eps, strict=True)):
        want, got = np.asarray(want), np.asarray(got)
        if want.shape != got.shape:
            return f"output {index} has shape {got.shape} where predict gives {want.shape}"
        if epsilon == 0:
            if not np.array_equal(want, got):
                return f"output {index} differs from predict in {int(np.sum(want != got))} of {want.size} values"
            continue
        want, got = want.astype(np.float64), got.astype(np.float64)
        finite = np.isfinite(want)
        if not np.isfinite(got[finite]).all():
            return f"output {index} is not finite where predict is"
        error = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
        scale = float(np.max(np.abs(want[finite]), initial=0.0))
        allowed = float(np.sqrt(epsilon)) * (scale if scale > 0 else 1.0)
        if error > allowed:
            return f"output {index} differs from predict by up to {error:.3g} (largest |value| {scale:.3g})"
    return None


P = TypeVar("P")


def verified(
    program: P, kind: str, mismatch: Callable[[P], str | None], replacements: Sequence[tuple[str, Callable[[], P]]]
) -> tuple[P | None, str]:
    """What an adapter's ``pack`` returns after checking a built program against ``predict`` (``mismatch``: the
    difference, None when there is none): ``(program, "")`` when it agrees; else the first of ``replacements``
    (``(what it runs, how to build it)``, e.g. ``("every node at full width", ...)``) that agrees, with the reason the
    adapter puts first in its ``fallbacks``; else ``(None, reason)``, the reason naming every difference found (the
    adapter then runs the whole model tiled, or raises). ``kind``: the program's name (``"packed"``, ``"dense"``)."""
    why = mismatch(program)
    if why is None:
        return program, ""
    reason = f"{VERIFICATION}: the {kind} program differed from predict on the example input ({why})"
    for what, build in replacements:
        candidate = build()
        also = mismatch(candidate)
        if also is None:
            return candidate, f"{reason}; {what}"
        reason += f"; so did {what} ({also})"
    return None, reason


def timed_rounds(
    calls: Mapping[K, Callable[[], object]],
    *,
    rounds: int,
    warmup: int = 1,
    until: Callable[[Mapping[K, Sequence[float]]], bool] | None = None,
    deadline: float = math.inf,
    clock: Callable[[], float] = time.perf_counter,
    warm: Mapping[K, Sequence[float]] | None = None,
    compiled: bool = False,
) -> dict[K, list[float]]:
    """Wall time (``clock``, seconds) of each call in every round, the calls timed in turn within a round (noise hits
    all alike), after ``warmup`` rounds that do not count; fewer rounds where ``until(times)`` says, after a round,
    that the rest cannot matter, or where another round, as long as the last one, would end after ``deadline`` (a
    ``clock`` value; where that leaves no counted round, the warm-up rounds count, unless ``compiled``: the calls'
    first run compiles them, its time says nothing of a call's, and one counted round runs whatever the deadline).
    ``warm``: the times of a warm-up round already run on these calls (then ``warmup`` is usually 0). Each call must
    wait for its own result (synchronize an accelerator)."""
    times: dict[K, list[float]] = {name: [] for name in calls}
    warmed: dict[K, list[float]] = {name: list(warm[name]) if warm else [] for name in calls}
    last = sum(values[-1] for values in warmed.values()) if warm else None  # the last round's duration
    for index in range(warmup + rounds):
        may_stop = not compiled or any(times.values())
        if last is not None and may_stop and clock() + last > deadline:
            break
        counted = index >= warmup
        started = clock()
        for name, call in calls.items():
            start = clock()
            call()
            (times if counted else warmed)[name].append(clock() - start)
        last = clock() - started
        if counted and until is not None and until(times):
            break
    return times if all(times.values()) else warmed


def median_bounds(values: Sequence[float], rounds: int) -> tuple[float, float]:
    """The least and greatest median of ``rounds`` times of which ``values`` are the first, whatever the rest are."""
    ordered, missing = sorted(values), rounds - len(values)
    middle = (rounds - 1) // 2, rounds // 2  # the two middle ranks (one for an odd count)
    low = [ordered[rank - missing] if rank >= missing else 0.0 for rank in middle]
    high = [ordered[rank] if rank < len(ordered) else math.inf for rank in middle]
    return sum(low) / 2, sum(high) / 2


def timed_choice(
    calls: Mapping[str, Callable[[], object]],
    preferred: str,
    *,
    rounds: int = AUTO_ROUNDS,
    deadline: float = math.inf,
    clock: Callable[[], float] = time.perf_counter,
    warm: Mapping[str, Sequence[float]] | None = None,
    compiled: bool = False,
) -> tuple[str, str, dict[str, list[float]]]:
    """``choose_program`` on up to ``rounds`` interleaved rounds of ``calls`` (one warm-up round first, unless
    ``warm`` holds one already run): the program, why, and the times. It stops as soon as no outcome of the remaining
    rounds could change the choice (each program's median bounded by ``median_bounds``), or where the next round
    would end after ``deadline`` (``clock`` seconds; ``pack`` passes its start plus ``AUTO_BUILD`` times the preferred
    program's build time; ``compiled``: the first call compiles, ``timed_rounds``)."""

    def settled(times: Mapping[str, Sequence[float]]) -> bool:
        bounds = {name: median_bounds(values, rounds) for name, values in times.items()}
        fastest_low = min((low for name, (low, _) in bounds.items() if name != preferred), default=math.inf)
        if bounds[preferred][1] <= AUTO_SLOWER * fastest_low:
            return True  # the preferred program stays within the margin of every other
        for name, (_, high) in bounds.items():
            others = [low for other, (low, _) in bounds.items() if other != name]
            if name != preferred and high < min(others) and AUTO_SLOWER * high < bounds[preferred][0]:
                return True  # this one stays the fastest, and the preferred one more than the margin slower
        return False

    warmup = 0 if warm else 1
    times = timed_rounds(
        calls, rounds=rounds, warmup=warmup, until=settled, deadline=deadline, clock=clock, warm=warm, compiled=compiled
    )
    name, why = choose_program(times, preferred)
    done = len(times[preferred])
    if done < rounds:
        stop = "the rest could not change the choice" if settled(times) else "the time to build ran out"
        why += f"; stopped after {done} of {rounds} rounds: {stop}"
    return name, why, times


def timing_samples(batch: int, seconds_per_sample: float, seconds_left: float) -> int:
    """How many of the example's ``batch`` samples ``auto`` times its candidates on: all of them where
    ``AUTO_PLANNED_ROUNDS`` rounds, each ``seconds_per_sample`` per sample, end within ``seconds_left``; else as many
    as do, but never fewer than ``AUTO_SAMPLES`` (the whole batch where it is smaller): on a handful of samples the
    programs' fixed cost per call, not their work, would decide."""
    budget = AUTO_PLANNED_ROUNDS * seconds_per_sample
    fits = int(seconds_left / budget) if budget > 0 else batch
    return min(batch, max(AUTO_SAMPLES, fits))


def timed_choice_on_samples(
    calls_on: Callable[[int], Mapping[str, Callable[[], object]]],
    batch: int,
    preferred: str,
    *,
    deadline: float = math.inf,
    clock: Callable[[], float] = time.perf_counter,
    compiled: bool = False,
) -> tuple[str, str, dict[str, list[float]]]:
    """``timed_choice`` on the first samples of an example of ``batch`` samples (``calls_on(k)``: the candidates, each
    called on the first ``k``), so that ``auto`` builds by ``deadline`` also where one call of the candidates on the
    whole example costs as much as building the preferred one: the warm-up round runs on ``AUTO_SAMPLES`` samples
    and its time per sample sets how many the counted rounds run on (``timing_samples``); all of them without a
    deadline. The reason says on how many samples where that is not all. ``compiled``: a program's first call on a
    batch size compiles it (jit), so that round never decides (``timed_rounds``)."""
    if math.isinf(deadline) or batch <= AUTO_SAMPLES:
        return timed_choice(calls_on(batch), preferred, deadline=deadline, clock=clock, compiled=compiled)
    calls = calls_on(AUTO_SAMPLES)
    started = clock()
    warm = timed_rounds(calls, rounds=1, warmup=0, clock=clock)
    samples = timing_samples(batch, (clock() - started) / AUTO_SAMPLES, deadline - clock())
    if samples == AUTO_SAMPLES:
        name, why, times = timed_choice(calls, preferred, deadline=deadline, clock=clock, warm=warm, compiled=compiled)
    else:
        name, why, times = timed_choice(calls_on(samples), preferred, deadline=deadline, clock=clock, compiled=compiled)
    if samples < batch:
        why += f"; timed on {samples} of the example's {batch} samples to build in time"
    return name, why, times


def choose_program(times: Mapping[str, Sequence[float]], preferred: str) -> tuple[str, str]:
    """The program ``auto`` returns, and why (naming every program's median time), from interleaved timings
    (``timed_rounds``).

    ``preferred`` (the compacted program: fewest multiply-adds) is kept while its median time is at most
    ``AUTO_SLOWER`` times every other program's, so that noise never trades it for a program that does several times
    the work; otherwise the program with the least median time. No program whose median is more than ``AUTO_SLOWER``
    times another's is ever returned.
    """
    medians = {name: statistics.median(values) for name, values in times.items()}
    fastest = min(medians, key=medians.__getitem__)
    chosen = preferred if medians[preferred] <= AUTO_SLOWER * medians[fastest] else fastest
    named = ", ".join(f"{name} {median * 1e3:.3g} ms" for name, median in medians.items())
    rule = (
        f"within {AUTO_SLOWER - 1:.0%} of the fastest"
        if chosen == preferred
        else f"the fastest; {preferred} is {medians[preferred] / medians[chosen]:.2f}x its time"
    )
    return chosen, f"{chosen} ({rule}): median times over {len(times[preferred])} interleaved rounds: {named}"
