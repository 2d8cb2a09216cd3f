"""Packed inference planning, shared by every framework: which channels each member computes.

A model is described as a graph of ``GraphNode`` (kinds below), in topological order. For each
member, ``plan_members`` decides which channels of every node are computed and where they sit in
a compacted tensor; adapters then slice weights and gather activations by these layouts.

Kinds:

- ``"input"``: the model input (all channels, the same for every member);
- ``"mixing"``: Linear/Conv: every output channel reads every input channel;
- ``"channelwise"``: channel ``c`` of the output reads channel ``c`` of the input (activations,
  BatchNorm, pooling, Dropout); ``zero_preserving`` tells whether it maps 0 to 0;
- ``"masks"``: a Masksembles layer (``masks`` (n, C) bool);
- ``"add"``: the sum of two nodes with the same channels (a residual connection);
- ``"flatten"``: (B, C, *spatial) -> (B, C*spatial), feature ``c*spatial + s`` from channel ``c``; with
  ``channels_last``, (B, *spatial, C) -> (B, spatial*C), feature ``s*C + c`` from channel ``c``.

Rules, per member:

- *needed*: the output needs every channel; mixing nodes need every input channel; channelwise,
  add and flatten nodes need the input channels of their needed outputs; Masksembles needs only
  the needed channels its mask keeps.
- *zero*: a channel is known to be zero after Masksembles drops it and stays zero through
  zero-preserving channelwise nodes, flatten, and the sum of two zeros; mixing outputs and
  non-zero-preserving channelwise outputs are never assumed zero.
- *kept*: needed, and not (zero and dropped by every consumer). A mixing consumer drops zero
  inputs (they contribute nothing); any other consumer drops what it does not keep itself.

Placement: nodes computed only from the input (before any Masksembles) are *shared*: every member
computes the same values, so the union of the members' kept channels is computed once. Every
other node holds, per member, its kept channels in increasing order, padded with -1 to the widest
member, and the members' blocks are laid side by side on the channel axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

KINDS = ("input", "mixing", "channelwise", "masks", "add", "flatten")
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]


@dataclass(frozen=True)
class GraphNode:
    """One node of a model graph, as ``plan_members`` sees it."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    channels: int
    zero_preserving: bool = True
    spatial: int = 1
    masks: BoolArray | None = None
    channels_last: bool = False

    def features(self, per_channel: BoolArray) -> BoolArray:
        """Flatten: expand a per-input-channel vector to the output features."""
        return np.tile(per_channel, self.spatial) if self.channels_last else np.repeat(per_channel, self.spatial)

    def any_feature(self, per_feature: BoolArray) -> BoolArray:
        """Flatten: for each input channel, whether any of its output features is set."""
        grid = per_feature.reshape(self.spatial, -1).T if self.channels_last else per_feature.reshape(-1, self.spatial)
        result: BoolArray = np.any(grid, axis=1)
        return result


@dataclass(frozen=True)
class Placement:
    """Where a node's channels sit: one layout when ``shared``, else one per member.

    A layout holds the original channel at each position of the compacted tensor, -1 for padding.
    """

    shared: bool
    layouts: tuple[IntArray, ...]

    def member_layouts(self, members: int) -> tuple[IntArray, ...]:
        """One layout per member (a shared layout repeated)."""
        return self.layouts * members if self.shared else self.layouts

    @property
    def width(self) -> int:
        return len(self.layouts[0])


def _check(nodes: Sequence[GraphNode], output: str) -> None:
    names = set()
    for node in nodes:
        if node.kind not in KINDS:
            raise ValueError(f"node {node.name!r}: kind must be one of {KINDS}; received {node.kind!r}")
        missing = [name for name in node.inputs if name not in names]
        if missing:
            raise ValueError(f"node {node.name!r} reads {missing} before they are defined")
        names.add(node.name)
    if output not in names:
        raise ValueError(f"output {output!r} is not a node")


def kept_channels(nodes: Sequence[GraphNode], output: str, member: int) -> dict[str, BoolArray]:
    """The channels of every node that member ``member`` computes (rules in the module docstring)."""
    _check(nodes, output)
    consumers: dict[str, list[GraphNode]] = {node.name: [] for node in nodes}
    for node in nodes:
        for name in node.inputs:
            consumers[name].append(node)
    zero: dict[str, BoolArray] = {}
    for node in nodes:  # forward: channels known to be zero
        first = zero[node.inputs[0]] if node.inputs else np.zeros(node.channels, dtype=bool)
        if node.kind == "masks":
            assert node.masks is not None
            zero[node.name] = first | ~node.masks[member]
        elif node.kind == "add":
            zero[node.name] = zero[node.inputs[0]] & zero[node.inputs[1]]
        elif node.kind == "flatten":
            zero[node.name] = node.features(first)
        elif node.kind == "channelwise" and node.zero_preserving:
            zero[node.name] = first.copy()
        else:
            zero[node.name] = np.zeros(node.channels, dtype=bool)
    needed = {node.name: np.zeros(node.channels, dtype=bool) for node in nodes}
    needed[output][:] = True
    kept: dict[str, BoolArray] = {}
    required: dict[str, BoolArray] = {}  # flatten: the features its consumers must find
    for node in reversed(nodes):  # backward: needed, then kept
        demand = needed[node.name]
        tolerant = np.full(node.channels, node.name != output)
        for user in consumers[node.name]:
            if user.kind == "flatten":
                tolerant &= ~user.any_feature(required[user.name])
            elif user.kind != "mixing":
                tolerant &= ~kept[user.name]
        if node.kind == "flatten":
            required[node.name] = ~tolerant
        kept[node.name] = demand & ~(zero[node.name] & tolerant)
        for name in node.inputs:
            if node.kind == "mixing":
                needed[name][:] = True
            elif node.kind == "flatten":
                needed[name] |= node.any_feature(demand)
            elif node.kind == "masks":
                assert node.masks is not None
                needed[name] |= demand & node.masks[member]
            else:
                needed[name] |= demand
    return kept


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


def plan_members(nodes: Sequence[GraphNode], output: str, members: Sequence[int]) -> dict[str, Placement]:
    """Placement of every node when computing ``members`` (indices into the masks) together."""
    kept = [kept_channels(nodes, output, k) for k in members]
    placements: dict[str, Placement] = {}
    for node in nodes:
        sources = [placements[name] for name in node.inputs]
        if node.kind == "input":
            placements[node.name] = Placement(True, (np.arange(node.channels, dtype=np.int64),))
        elif node.kind == "flatten":
            source = sources[0]
            channels = node.channels // node.spatial
            layouts = tuple(
                flatten_layout(layout, node.spatial, channels=channels, channels_last=node.channels_last)
                for layout in source.layouts
            )
            placements[node.name] = Placement(source.shared, layouts)
        elif node.kind != "masks" and all(source.shared for source in sources):
            union = np.logical_or.reduce([member[node.name] for member in kept])
            placements[node.name] = Placement(True, (_padded(union, 1),))
        else:
            width = max(1, *(int(member[node.name].sum()) for member in kept))
            placements[node.name] = Placement(False, tuple(_padded(member[node.name], width) for member in kept))
    return placements


def _padded(kept: BoolArray, width: int) -> IntArray:
    """The kept channels in increasing order, padded with -1 to ``width`` (at least one position: kernels need one)."""
    channels = np.flatnonzero(kept)
    result: IntArray = np.concatenate([channels, np.full(max(width - len(channels), 0), -1)]).astype(np.int64)
    return result


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
