"""Packed inference: every member at about the cost of one model, from the structure of the masks.

Member ``k`` of a Masksembles model only ever uses its live channels, so the layers next to a Masksembles layer can be
shrunk physically. ``pack`` runs all members in one call: grouped convolutions and batched matmuls over every member's
compacted weights instead of full-width layers on a tiled batch. ``extract_member`` builds member ``k`` alone, as a
smaller dense model. Both have eval semantics (BatchNorm running statistics, Dropout off, grouped masks) and return an
ordinary ``torch.fx.GraphModule``: printable, ``torch.compile``-able and exportable.

How, one file a step: ``_pack_capture`` traces the model with torch.fx in eval mode, runs it on the example input at
two batch sizes (every tensor's shape and batch axis) and classifies each operation as a ``masksembles_core.packing``
kind: what can be compacted (Linear and convolutions of any ``groups``, BatchNorm, LayerNorm/GroupNorm over the
channels, elementwise operations with scalar or per-channel arguments, pooling and reductions over other axes, moves
of the channel axis, sums/products, concatenations, flattening, Masksembles) or a *fallback* that runs exactly as the
dense model runs it, at full width on the member-stacked batch (``PackedMasksembles.fallbacks`` lists them);
``_pack_graph`` answers the core's questions about it (``masksembles_core.captured`` solves the channel axes and builds
the core's graph, from which the core decides which channels each member computes); ``_pack_emit`` writes the program
as an fx graph over the kernels of ``_packed_ops``; ``_pack_chunks`` proves a CPU program per-sample and runs it on
chunks of the batch. This module builds, verifies against ``predict``
and chooses (``pack``, ``extract_member``).

"Zero stays zero" is never assumed from an operation's name: an elementwise operation counts as zero-preserving on a
channel only when evaluating it, with its own arguments, on +0 and -0 inputs gives 0 there.

Exactness: results equal the dense model's for finite activations, up to float rounding. Channels that Masksembles
zeroes are left out instead of multiplied by 0 (a masked inf or NaN gives NaN in the dense model and is absent here),
and known zeros written back for a fallback are +0 where the dense model may hold -0.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, fx, nn

from masksembles_core import captured
from masksembles_core.adapter import check_program
from masksembles_core.packing import (
    OUTPUT,
    VERIFICATION,
    VERIFY_SAMPLES,
    FoldConflict,
    Program,
    chosen_members,
    output_mismatch,
    plan_program,
    timed_choice,
)

from . import _packed_ops as ops
from ._layers import Masksembles
from ._pack_attention import Region, fold_regions, unfold
from ._pack_capture import _Capture, _describe, _members_of, _SharedInPlace
from ._pack_chunks import _in_chunks, _samples_per_chunk
from ._pack_emit import _Emitter
from ._pack_graph import _Graph, _planned, _solve_axes


class PackedMasksembles(fx.GraphModule):
    """Members of a Masksembles model on compacted weights, made by ``pack`` or ``extract_member``.

    A ``torch.fx.GraphModule``: ``print(packed.code)`` shows the program, and it compiles and exports like any
    module. ``forward``: (B, ...) -> (m, B, ...) for the m members it was built for, or (B, ...) for an extracted
    member. Inference only (eval semantics).
    """

    @property
    def members(self) -> tuple[int, ...]:
        """The members it computes (indices into the masks)."""
        return cast(tuple[int, ...], self.meta["masksembles"]["members"])

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The model's operations that run at full width on the member-stacked batch (nothing here compacts them)."""
        return cast(tuple[str, ...], self.meta["masksembles"]["fallbacks"])

    @property
    def program(self) -> str:
        """``"packed"`` (compacted where it can), or ``"dense"`` (the tiled model, measured faster by ``pack``)."""
        return cast(str, self.meta["masksembles"]["program"])

    @property
    def seconds(self) -> dict[str, float]:
        """What ``pack`` measured on the example input (median seconds per call of each program), or empty."""
        return cast(dict[str, float], self.meta["masksembles"]["seconds"])

    @property
    def choice(self) -> str:
        """Why ``pack(program="auto")`` returned this program, from its interleaved timings; empty otherwise."""
        return cast(str, self.meta["masksembles"]["choice"])

    @property
    def macs(self) -> dict[str, int]:
        """Multiply-adds per sample of the Linear and convolution layers and of attention (its products, which
        run at full width): ``dense`` (m dense models), ``packed`` (as emitted) and ``fallback`` (the part of
        ``packed`` that runs at full width); empty when the whole model runs tiled (see ``fallbacks``)."""
        return cast(dict[str, int], self.meta["masksembles"]["macs"])

    def extra_repr(self) -> str:
        if self.program == "dense":
            why = f"measured faster than packed: {self.seconds}" if self.seconds else "; ".join(self.fallbacks)
            return f"members={list(self.members)}, program=dense" + (f" ({why})" if why else "")
        shown = ", ".join(self.fallbacks[:8]) + (", ..." if len(self.fallbacks) > 8 else "")
        chunk = self.meta["masksembles"].get("chunk")
        return (
            f"members={list(self.members)}"
            + (f", in chunks of up to {chunk} samples" if chunk else "")
            + f", fallbacks={len(self.fallbacks)}"
            + (f": {shown}" if shown else "")
        )


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode while packing (BatchNorm statistics untouched); each one's mode restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _build(
    capture: _Capture,
    example: Tensor,
    chosen: Sequence[int],
    squeeze: bool,
    *,
    dense: bool = False,
    chunks: bool = True,
) -> PackedMasksembles:
    """One program from the capture: compacted where it can, or (``dense``) every node at full width."""
    capture.reset(dense)
    graph, axis = _solve_axes(capture)
    regions = [] if dense else fold_regions(graph, axis)
    while True:
        nodes, output = captured.graph_nodes(graph, axis)
        try:
            program = plan_program(nodes, output, _planned(capture, chosen))
            _check_folds(program, regions, graph)
        except FoldConflict as conflict:  # a region that cannot run folded runs as plain fallbacks
            region = next(r for r in regions if any(node.name == conflict.node for node in r.ops))
            unfold(graph, region)
            regions.remove(region)
            continue
        break
    samples = _samples_per_chunk(capture, program, example) if chunks else 0
    emitter = _Emitter(capture, axis, program, squeeze, samples or example.shape[0], chosen, regions)
    packed = PackedMasksembles(emitter.root, emitter.graph, class_name="PackedMasksembles")
    if samples:
        packed = PackedMasksembles(*_in_chunks(packed, example, samples), class_name="PackedMasksembles")
    fallbacks = tuple(
        _describe(capture.ops[emitter.by_name[name]].node, capture.gm) for name in program.fallbacks if name != OUTPUT
    )
    packed.meta["masksembles"] = {
        "members": tuple(chosen), "fallbacks": fallbacks, "macs": dict(emitter.macs),
        "program": "dense" if dense else "packed", "seconds": {}, "chunk": samples, "choice": "", "squeeze": squeeze,
    }  # fmt: skip
    return packed.eval()


def _check_folds(program: Program, regions: Sequence[Region], graph: _Graph) -> None:
    """Each region runs folded throughout or not at all: a folded step whose region value or Linear layer is shared
    (read by the members as one block) raises ``FoldConflict``."""
    for region in regions:
        steps = [program.step(node.name) for node in region.ops]
        if any(step.placement.shared for step in steps) and not all(step.placement.shared for step in steps):
            raise FoldConflict(region.ops[0].name)
        if not steps[0].placement.shared and any(program.step(e.name).placement.shared for e in region.entries):
            raise FoldConflict(region.ops[0].name)


def _member_outputs(model: nn.Module, x: Tensor, n: int) -> tuple[Any, tuple[int, ...]]:
    """The model's output on ``x`` tiled ``n`` times (what ``predict`` runs) and each output leaf's batch axis (-1 for
    a leaf without one), found from a second run on one more sample."""
    with torch.no_grad():
        small = model(ops.tile(x, n, 0))
        large = model(ops.tile(torch.cat([x, x[:1]]), n, 0))
    return small, ops.leaf_batch_axes(small, large, n * x.shape[0])


def _whole_model(
    model: nn.Module, axes: Sequence[int], chosen: Sequence[int], squeeze: bool, n: int
) -> PackedMasksembles:
    """The model itself (a copy, in eval mode) on the member-stacked batch: what ``predict`` computes, each output
    leaf's batch axis given by ``axes`` (``_member_outputs``). The caller says why in ``fallbacks``."""
    whole = copy.deepcopy(model).eval().requires_grad_(False)
    root = nn.Module()
    root.model = whole
    graph = fx.Graph()
    tiled = graph.call_function(ops.tile, (graph.placeholder("x"), n, 0))
    result = graph.call_function(ops.select_members, (graph.call_module("model", (tiled,)), n, axes, chosen, squeeze))
    graph.output(result)
    packed = PackedMasksembles(root, graph, class_name="PackedMasksembles")
    packed.meta["masksembles"] = {
        "members": tuple(chosen), "fallbacks": (), "macs": {}, "program": "dense", "seconds": {}, "choice": "",
        "squeeze": squeeze,
    }  # fmt: skip
    return packed.eval()


def _leaf_arrays(tree: Any) -> tuple[list[np.ndarray], list[float]]:
    """An output's leaves as NumPy arrays (floats as float64), and each one's machine epsilon (0: compared exactly)."""
    arrays, eps = [], []
    for leaf in ops.leaves(tree):
        if isinstance(leaf, Tensor):
            floating = leaf.is_floating_point() or leaf.is_complex()
            arrays.append(leaf.detach().cpu().to(torch.float64 if floating else leaf.dtype).numpy())
            eps.append(torch.finfo(leaf.dtype).eps if floating else 0.0)
        else:
            arrays.append(np.asarray(leaf, dtype=object))
            eps.append(0.0)
    return arrays, eps


class _Verifier:
    """Checks built programs against ``predict`` on the first ``VERIFY_SAMPLES`` samples of the example input."""

    def __init__(self, model: nn.Module, example: Tensor, n: int, chosen: Sequence[int], squeeze: bool) -> None:
        self.x = example[:VERIFY_SAMPLES]
        output, self.axes = _member_outputs(model, self.x, n)
        self.expected = _leaf_arrays(ops.select_members(output, n, self.axes, chosen, squeeze))

    def mismatch(self, packed: nn.Module) -> str | None:
        """Why ``packed`` differs from ``predict`` on the sample, or None."""
        try:
            with torch.no_grad():
                actual = _leaf_arrays(packed(self.x))
        except Exception as error:  # a program that fails where the model runs differs from it
            return f"it raised {type(error).__name__}: {error}"
        return output_mismatch(self.expected[0], actual[0], self.expected[1])


def _verified(
    packed: PackedMasksembles,
    verifier: _Verifier | None,
    full_width: Callable[[], PackedMasksembles],
    model: nn.Module,
    capture: _Capture,
) -> PackedMasksembles:
    """``packed`` if it equals ``predict``; otherwise every node at full width (``full_width()``), or the whole model
    tiled when that differs too, with the reason first in ``fallbacks``."""
    if verifier is None or (why := verifier.mismatch(packed)) is None:
        return packed
    reason = f"{VERIFICATION}: the {packed.program} program differed from predict on the example input ({why})"
    if packed.program == "packed":
        dense = full_width()
        if (also := verifier.mismatch(dense)) is None:
            dense.meta["masksembles"]["fallbacks"] = (f"{reason}; every node runs at full width", *dense.fallbacks)
            return dense
        reason += f"; so did every node at full width ({also})"
    whole = _whole_model(model, verifier.axes, packed.members, packed.meta["masksembles"]["squeeze"], capture.n)
    whole.meta["masksembles"]["fallbacks"] = (f"{reason}: the whole model runs tiled",)
    return whole


def _timed(module: nn.Module, x: Tensor) -> Callable[[], None]:
    """One call of ``module`` on ``x``, waiting for its result."""

    def run() -> None:
        with torch.no_grad():
            module(x)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    return run


def _packed(
    model: nn.Module, example_input: Tensor, members: Sequence[int] | None, squeeze: bool, program: str, verify: bool
) -> PackedMasksembles:
    """``pack``/``extract_member``: capture once, build the program(s), verify, and choose."""
    check_program(program)
    with _eval_mode(model):
        try:
            capture = _Capture(model, example_input)
        except _SharedInPlace as error:
            n = _members_of([layer for layer in model.modules() if isinstance(layer, Masksembles)])
            axes = _member_outputs(model, example_input, n)[1]
            whole = _whole_model(model, axes, chosen_members(members, n), squeeze, n)
            whole.meta["masksembles"]["fallbacks"] = (f"the whole model, tiled: {error}",)
            return whole
        chosen = chosen_members(members, capture.n)
        verifier = _Verifier(model, example_input, capture.n, chosen, squeeze) if verify else None

        def candidate(*, dense: bool = False, chunks: bool = True) -> PackedMasksembles:
            def build(dense: bool) -> PackedMasksembles:
                return _build(capture, example_input, chosen, squeeze, dense=dense, chunks=chunks)

            return _verified(build(dense), verifier, functools.partial(build, True), model, capture)

        if program != "auto":
            return candidate(dense=program == "dense")
        packed = candidate()
        if packed.program == "dense":  # verification or the graph left nothing packed: nothing to choose
            return packed
        candidates = {"packed": packed, "dense": candidate(dense=True)}
        if packed.meta["masksembles"]["chunk"]:  # in one call too: faster where freed memory is kept for reuse
            candidates["packed, one call"] = candidate(chunks=False)
        calls = {name: _timed(module, example_input) for name, module in candidates.items()}
        name, why, times = timed_choice(calls, "packed")
        result = candidates[name]
        result.meta["masksembles"]["seconds"] = {key: statistics.median(value) for key, value in times.items()}
        result.meta["masksembles"]["choice"] = why
        return result


def pack(model: nn.Module, example_input: Tensor, *, program: str = "auto", verify: bool = True) -> PackedMasksembles:
    """All members of ``model`` in one call on compacted weights: (B, ...) -> (n, B, ...).

    Equals ``predict(model, x, n)`` (eval semantics) for finite activations, at about the cost the masks' overlap
    allows instead of n dense forward passes. ``example_input`` is run through the traced model to record shapes; any
    batch size works afterwards. ``forward`` is called with the input tensor alone: its other arguments keep their
    defaults (a required one is refused). Any model torch.fx can trace in eval mode packs: what this module cannot
    compact runs at full width (listed in ``fallbacks``); a model whose graph cannot be rewritten out of place (an
    in-place operation on a view read after it) runs whole on the member-stacked batch (``program == "dense"``).

    Args:
        program: ``"packed"`` (compacted where it can; on CPU, on chunks of the batch where its tensors are large
            and it is proven per-sample), ``"dense"`` (the tiled dense model as one graph: every node as the model
            runs it, on the member-stacked batch), or ``"auto"`` (the default: both, and the packed program in one
            call where it would run in chunks, are timed in interleaved rounds on ``example_input``; the packed
            program is kept unless another was clearly faster (``masksembles_core.packing.choose_program``);
            ``seconds`` holds the medians and ``choice`` the reason; give an example of the batch size you will run).
        verify: compare the program with ``predict`` on the first few samples of ``example_input`` before returning
            it (the default). One that differs beyond float rounding is never returned: every node then runs at full
            width, or the whole model tiled, and the first entry of ``fallbacks`` says why. ``False`` skips it.

    Raises:
        ValueError: the model cannot be traced, needs more than one input, has no Masksembles layer, or holds
            Masksembles layers of different n.
    """
    return _packed(model, example_input, None, False, program, verify)


def extract_member(model: nn.Module, k: int, example_input: Tensor, *, verify: bool = True) -> PackedMasksembles:
    """Member ``k`` of ``model`` as a standalone dense model: (B, ...) -> (B, ...).

    Every layer next to a Masksembles layer is physically shrunk to member ``k``'s live channels; the output equals
    group ``k``'s output of the masked model (eval semantics, finite values), verified as in ``pack``. Same support and
    errors as ``pack``.
    """
    return _packed(model, example_input, [k], True, "packed", verify)
