"""Packed inference: every member at about the cost of one model, from the structure of the masks.

Member ``k`` of a Masksembles model only ever uses its live channels, so the layers next to a Masksembles layer can be
shrunk physically. ``pack`` runs all members in one call: grouped convolutions and batched matmuls over every member's
compacted weights instead of full-width layers on a tiled batch. ``extract_member`` builds member ``k`` alone, as a
smaller dense model. Both have eval semantics (BatchNorm running statistics, Dropout off, grouped masks) and return an
ordinary ``torch.fx.GraphModule``: printable, ``torch.compile``-able and exportable.

How, one file a step: ``_pack_capture`` traces the model with torch.fx in eval mode (or captures it with
``torch.export``, ``_pack_export``, for several inputs or a model torch.fx cannot trace), runs it on the example input
at two batch sizes (every tensor's shape and batch axis) and classifies each operation as a ``masksembles_core.packing``
kind: what can be compacted (Linear and convolutions of any ``groups``, BatchNorm, LayerNorm/GroupNorm over the
channels, GRN's ratio to the mean over the channels, elementwise operations with scalar or per-channel arguments,
pooling and reductions over other axes, moves of the channel axis, sums/products, concatenations, flattening,
MobileViT's patches, Masksembles; ``_pack_fuse`` first rewrites a few patterns of several operations into one call each)
or a *fallback* that runs exactly as the dense model runs it, at full width on the member-stacked batch
(``PackedMasksembles.fallbacks`` lists them); ``_pack_graph`` answers the core's questions about it
(``masksembles_core.captured`` solves the channel axes and builds the core's graph, from which the core decides which
channels each member computes); ``_pack_emit`` writes the program as an fx graph over the kernels of ``_packed_ops``;
``_pack_chunks`` proves a CPU program per-sample and runs it on chunks of the batch. This module builds, verifies
against ``predict`` and chooses (``pack``, ``extract_member``).

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
from time import perf_counter as clock  # the wall clock auto's build time and timings read
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, fx, nn
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

from masksembles_core import captured
from masksembles_core.adapter import check_program
from masksembles_core.packing import (
    AUTO_BUILD,
    OUTPUT,
    VERIFY_SAMPLES,
    FoldConflict,
    Program,
    chosen_members,
    output_mismatch,
    plan_program,
    program_raised,
    timed_choice_on_samples,
    verified,
)

from . import _packed_ops as ops
from ._layers import Masksembles
from ._pack_attention import Region, fold_regions, unfold
from ._pack_capture import PREFIX, _Capture, _describe, _members_of, _SharedInPlace, counted_macs
from ._pack_chunks import _in_chunks, _planned, _samples_per_chunk
from ._pack_emit import _Emitter
from ._pack_graph import _Graph, _solve_axes
from ._structures import Inputs, batch_size, batched_tensors, call, call_arguments, map_batched
from ._surgery import keep_masks_off_fused_paths


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
        """Multiply-adds per sample of every matmul, convolution and attention product (``FlopCounterMode``'s flops
        / 2, whatever module or function runs them): ``dense`` (the m members' dense models), ``packed`` (the
        program it runs) and ``fallback`` (the part of ``packed`` that runs at full width). Always these three keys:
        a dense program or the whole model tiled runs all of it at full width."""
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
    example: Inputs,
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
    # a torch.export capture (several inputs) runs in one call
    samples = _samples_per_chunk(capture, program, example) if chunks and isinstance(example, Tensor) else 0
    emitter = _Emitter(capture, axis, program, squeeze, samples or batch_size(example), chosen, regions)
    packed = PackedMasksembles(emitter.root, emitter.graph, class_name="PackedMasksembles")
    if samples:
        packed = PackedMasksembles(*_in_chunks(packed, cast(Tensor, example), samples), class_name="PackedMasksembles")
    if capture.entry is not None:
        packed = _entry(packed, capture)
    fallbacks = tuple(
        _describe(capture.ops[emitter.by_name[name]].node, capture.gm)
        for name in program.fallbacks
        if name != OUTPUT and emitter.by_name[name].op != "placeholder"  # an input read as it is
    )
    packed.meta["masksembles"] = {
        "members": tuple(chosen), "fallbacks": fallbacks, "macs": dict(emitter.macs),
        "program": "dense" if dense else "packed", "seconds": {}, "chunk": samples, "choice": "", "squeeze": squeeze,
    }  # fmt: skip
    return packed.eval()


def _entry(program: PackedMasksembles, capture: _Capture) -> PackedMasksembles:
    """The program of a torch.export capture called as the model is (``packed(**inputs)``, ``packed(*inputs)``),
    returning the model's output structure: it takes the batch-first tensors of the inputs and returns the output's
    leaves (``capture.entry`` says how they flatten and unflatten)."""
    assert capture.entry is not None
    root = nn.Module()
    root.flat = program
    graph = fx.Graph()
    placeholders = {node: graph.placeholder(node.name) for node in capture.gm.graph.nodes if node.op == "placeholder"}
    graph.output(graph.call_module("flat", tuple(placeholders[node] for node in capture.placeholders)))
    graph._codegen = _PyTreeCodeGen(capture.entry)
    packed = PackedMasksembles(root, graph, class_name="PackedMasksembles")
    packed.meta = program.meta
    return packed


def _check_folds(program: Program, regions: Sequence[Region], graph: _Graph) -> None:
    """Each region runs folded throughout or not at all: a folded step whose region value or Linear layer is shared
    (read by the members as one block) raises ``FoldConflict``."""
    for region in regions:
        steps = [program.step(node.name) for node in region.ops]
        if any(step.placement.shared for step in steps) and not all(step.placement.shared for step in steps):
            raise FoldConflict(region.ops[0].name)
        if not steps[0].placement.shared and any(program.step(e.name).placement.shared for e in region.entries):
            raise FoldConflict(region.ops[0].name)


def _member_outputs(model: nn.Module, x: Inputs, n: int) -> tuple[Any, tuple[int, ...], int]:
    """The model's output on ``x`` tiled ``n`` times (what ``predict`` runs), each output leaf's batch axis (-1 for
    a leaf without one), found from a second run on one more sample, and the multiply-adds per sample of one model
    (what that sample added, ÷ n)."""
    with torch.no_grad():
        tiled = _tiled(x, n)
        small, small_macs = counted_macs(lambda: call(model, tiled))
        larger = map_batched(x, lambda tensor: ops.tile(torch.cat([tensor, tensor[:1]]), n, 0))
        large, large_macs = counted_macs(lambda: call(model, larger))
    return small, ops.leaf_batch_axes(small, large, n * batch_size(x)), (large_macs - small_macs) // n


def _tiled(x: Inputs, n: int) -> Inputs:
    """``x``'s batch-first tensors tiled ``n`` times, (B, ...) -> (n·B, ...): the batch ``predict`` runs."""
    return cast(Inputs, map_batched(x, functools.partial(ops.tile, members=n, batch_axis=0)))


def _whole_model(
    model: nn.Module, example: Inputs, axes: Sequence[int], chosen: Sequence[int], squeeze: bool, n: int, macs: int
) -> PackedMasksembles:
    """The model itself (a copy, in eval mode) on the member-stacked batch: what ``predict`` computes, each output
    leaf's batch axis given by ``axes`` and one model's multiply-adds per sample by ``macs`` (``_member_outputs``),
    called as the model is called on ``example``. The caller says why in ``fallbacks``."""
    macs_of = {"dense": macs * len(chosen), "packed": macs * n, "fallback": macs * n}  # all n members, at full width
    whole = copy.deepcopy(model).eval().requires_grad_(False)
    root = nn.Module()
    root.model = whole
    graph = fx.Graph()
    if isinstance(example, Tensor):
        tiled = graph.call_function(ops.tile, (graph.placeholder("x"), n, 0))
        result = graph.call_function(
            ops.select_members, (graph.call_module("model", (tiled,)), n, axes, chosen, squeeze)
        )
        graph.output(result)
        return _dense_whole(root, graph, chosen, squeeze, macs_of)
    args, kwargs = call_arguments(example)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    given = [
        graph.call_function(ops.tile, (graph.placeholder(f"leaf_{i}"), n, 0))
        if isinstance(leaf, Tensor) and leaf.ndim
        else graph.placeholder(f"leaf_{i}")
        for i, leaf in enumerate(leaves)
    ]
    args, kwargs = pytree.tree_unflatten(given, spec)
    result = graph.call_module("model", tuple(args), dict(kwargs))
    graph.output(graph.call_function(ops.select_members, (result, n, axes, chosen, squeeze)))
    names = [f"input_{i}" for i in range(len(args))] + list(kwargs)  # forward's: the model's positions and keywords
    graph._codegen = _PyTreeCodeGen(_PyTreeInfo(names, spec, None))
    return _dense_whole(root, graph, chosen, squeeze, macs_of)


def _dense_whole(
    root: nn.Module, graph: fx.Graph, chosen: Sequence[int], squeeze: bool, macs: dict[str, int]
) -> PackedMasksembles:
    packed = PackedMasksembles(root, graph, class_name="PackedMasksembles")
    packed.meta["masksembles"] = {
        "members": tuple(chosen), "fallbacks": (), "macs": macs, "program": "dense", "seconds": {}, "choice": "",
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

    def __init__(self, model: nn.Module, example: Inputs, n: int, chosen: Sequence[int], squeeze: bool) -> None:
        self.model, self.n, self.chosen, self.squeeze = model, n, chosen, squeeze
        self.x = map_batched(example, lambda tensor: tensor[:VERIFY_SAMPLES])
        output, self.axes, self.macs = _member_outputs(model, self.x, n)
        self.expected = self._predicted(output)
        self.repeatable = False  # set once a second run of the model has given the same output

    def _predicted(self, output: Any) -> tuple[list[np.ndarray], list[float]]:
        return _leaf_arrays(ops.select_members(output, self.n, self.axes, self.chosen, self.squeeze))

    def mismatch(self, packed: nn.Module) -> str | None:
        """Why ``packed`` differs from ``predict`` on the sample, or None.

        Raises:
            ValueError: it differs because the model's own output changes from one call to the next on the same input
                (random per call), so no program can be verified against it.
        """
        try:
            with torch.no_grad():
                actual = _leaf_arrays(call(packed, self.x))
        except Exception as error:  # a program that fails where the model runs differs from it
            why: str | None = program_raised(error)
        else:
            why = output_mismatch(self.expected[0], actual[0], self.expected[1])
        if why is not None:
            self._refuse_random()
        return why

    def _refuse_random(self) -> None:
        """Run the model once more on the sample (only after a mismatch: a verified program costs nothing more) and
        raise where its output moved. It is compared with the tolerance the programs are held to, not bit for bit:
        the same call on the same input is the same arithmetic on a CPU, but not on a GPU whose kernels add with
        atomics in any order; what matters is whether the reference moves by more than a program may differ."""
        if self.repeatable:
            return
        with torch.no_grad():
            again = self._predicted(call(self.model, _tiled(self.x, self.n)))
        moved = output_mismatch(self.expected[0], again[0], self.expected[1])
        if moved is not None:
            raise ValueError(
                f"{PREFIX} need a model whose output is the same from one call to the next on the same input (eval "
                f"mode); {type(self.model).__name__}'s changed between two calls on the example input "
                f"({moved.replace('from predict', 'from the first call')}): it is random per call (it draws noise "
                "or a mask in forward). Pass its randomness in as an input, drawn once per call by you (transformers' "
                "ViTMAE: noise=torch.rand(batch, patches) in the example input and in each call), or make the model "
                "deterministic in eval mode"
            )
        self.repeatable = True


def _verified(
    packed: PackedMasksembles,
    verifier: _Verifier | None,
    full_width: Callable[[], PackedMasksembles],
    model: nn.Module,
    capture: _Capture,
) -> PackedMasksembles:
    """``packed`` if it equals ``predict``; otherwise every node at full width (``full_width()``), or the whole model
    tiled when that differs too, with the reason first in ``fallbacks`` (``masksembles_core.packing.verified``)."""
    if verifier is None:
        return packed
    replacements = [("every node at full width", full_width)] if packed.program == "packed" else []
    checked = verified(packed, packed.program, verifier.mismatch, replacements)
    result, reason = checked
    if result is not None:
        if reason:
            result.meta["masksembles"]["fallbacks"] = (reason, *result.fallbacks)
        return result
    squeeze = packed.meta["masksembles"]["squeeze"]
    whole = _whole_model(model, verifier.x, verifier.axes, packed.members, squeeze, capture.n, verifier.macs)
    whole.meta["masksembles"]["fallbacks"] = (f"{reason}: the whole model runs tiled",)
    return whole


def _timed(module: nn.Module, x: Inputs) -> Callable[[], None]:
    """One call of ``module`` on ``x``, waiting for its result."""
    device = batched_tensors(x)[0][1].device

    def run() -> None:
        with torch.no_grad():
            call(module, x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def _packed(
    model: nn.Module, example_input: Inputs, members: Sequence[int] | None, squeeze: bool, program: str, verify: bool
) -> PackedMasksembles:
    """``pack``/``extract_member``: capture once, build the program(s), verify, and choose."""
    check_program(program)
    started = clock()
    keep_masks_off_fused_paths(model)  # as predict runs the model
    with _eval_mode(model):
        try:
            capture = _Capture(model, example_input)
        except _SharedInPlace as error:
            n = _members_of([layer for layer in model.modules() if isinstance(layer, Masksembles)])
            _, axes, macs = _member_outputs(model, example_input, n)
            whole = _whole_model(model, example_input, axes, chosen_members(members, n), squeeze, n, macs)
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
        deadline = started + AUTO_BUILD * (clock() - started)  # AUTO_BUILD times what program="packed" takes
        candidates = {"packed": packed, "dense": candidate(dense=True)}
        if packed.meta["masksembles"]["chunk"]:  # in one call too: faster where freed memory is kept for reuse
            candidates["packed, one call"] = candidate(chunks=False)

        def calls_on(samples: int) -> dict[str, Callable[[], None]]:
            x = map_batched(example_input, lambda tensor: tensor[:samples])
            return {name: _timed(module, x) for name, module in candidates.items()}

        batch = batch_size(example_input)
        name, why, times = timed_choice_on_samples(calls_on, batch, "packed", deadline=deadline, clock=clock)
        result = candidates[name]
        result.meta["masksembles"]["seconds"] = {key: statistics.median(value) for key, value in times.items()}
        result.meta["masksembles"]["choice"] = why
        return result


def pack(model: nn.Module, example_input: Inputs, *, program: str = "auto", verify: bool = True) -> PackedMasksembles:
    """All members of ``model`` in one call on compacted weights: (B, ...) -> (n, B, ...).

    Equals ``predict(model, x, n)`` (eval semantics) for finite activations, at about the cost the masks' overlap
    allows instead of n dense forward passes. ``example_input`` is what the model is called with, as in ``predict``:
    a tensor (``model(x)``), a tuple (``model(*x)``) or a dict of keyword inputs (``model(**x)``, a ``transformers``
    model's ``input_ids``, ``attention_mask``, ...), every tensor in it batch-first. It is run through the captured
    model to record shapes; any batch size works afterwards, and the packed module is called the same way (the same
    keys and flags), returning the model's output structure with the members first (``out.logits`` (n, B, ...)), a
    tensor whose batch is on another axis as ``predict`` returns it (XLNet's ``mems``, (L, n·B, H)).

    Capture: a tensor input goes through torch.fx (``forward`` called with it alone: its other arguments keep their
    defaults, a required one is refused). A model torch.fx cannot trace (``transformers`` models), or a tuple or dict
    of inputs, is captured with ``torch.export`` (eval mode, the batch symbolic): each Masksembles layer is found again
    from export's module stacks, and the ATen operations with a torch-level twin are read as that twin; batch-first
    inputs other than the first (an attention mask) are read as the model reads them, tiled for the members where a
    full-width operation needs them. What this module cannot compact runs at full width (listed in ``fallbacks``:
    attention in a transformer); a model whose graph cannot be rewritten out of place (an in-place operation on a
    view read after it) runs whole on the member-stacked batch (``program == "dense"``).

    Args:
        program: ``"packed"`` (compacted where it can; on CPU, on chunks of the batch where its tensors are large and a
            torch.fx capture proves it per-sample), ``"dense"`` (the tiled dense model as one graph: every node as the
            model runs it, on the member-stacked batch), or ``"auto"`` (the default: both, and the packed program in one
            call where it would run in chunks, are timed in interleaved rounds on ``example_input``, for at most as
            long again as building the packed program took (on its first samples, at least 8, where rounds on all of
            it would take longer: ``choice`` then says on how many); the packed program is kept unless its median
            time is more than 10 % above another's, and then the fastest is
            (``masksembles_core.packing.choose_program``); ``seconds`` holds the medians and ``choice`` the reason,
            naming them; give an example of the batch size you will run).
        verify: compare the program with ``predict`` on the first few samples of ``example_input`` before returning
            it (the default). One that differs beyond float rounding is never returned: every node then runs at full
            width, or the whole model tiled, and the first entry of ``fallbacks`` says why. ``False`` skips it.

    Raises:
        ValueError: neither torch.fx nor torch.export can capture the model (an output holding an object such as a
            key-value cache: pass ``use_cache=False``), it needs more than one input tensor and was given one, has no
            Masksembles layer, or holds Masksembles layers of different n; the tensors of ``example_input`` have
            different batch sizes; or (``verify``) a program differs from ``predict`` because the model's own output
            changes from one call to the next on the same input (random per call: pass its randomness in as an
            input, ViTMAE's ``noise``).
    """
    return _packed(model, example_input, None, False, program, verify)


def extract_member(model: nn.Module, k: int, example_input: Inputs, *, verify: bool = True) -> PackedMasksembles:
    """Member ``k`` of ``model`` as a standalone dense model: (B, ...) -> (B, ...), called as the model is called on
    ``example_input`` (a tensor, tuple or dict, as in ``pack``) and returning the model's output structure.

    Every layer next to a Masksembles layer is physically shrunk to member ``k``'s live channels; the output equals
    group ``k``'s output of the masked model (eval semantics, finite values), verified as in ``pack``. Same support and
    errors as ``pack``.
    """
    return _packed(model, example_input, [k], True, "packed", verify)
