"""Packed inference for Flax NNX: every member at about the cost of one model, from the structure of the masks.

Member ``k`` of a Masksembles model only ever uses its live channels, so the layers next to a Masksembles layer can
be shrunk physically. ``pack`` runs all members in one call on compacted weights (or, ``program="dense"``, as the
tiled dense model: every operation run at full width; ``"auto"`` times both and keeps the faster); ``extract_member``
builds member ``k`` alone, as a smaller model. Both have eval semantics (BatchNorm running statistics, Dropout off,
grouped masks) and return a ``PackedMasksembles``, an NNX module that ``nnx.jit`` (or ``nnx.split`` + ``jax.jit``)
compiles.

Any ``nnx.Module`` that JAX can trace packs: ``_capture`` traces the model into a flat program of JAX primitives and
maps each one that reads the input to a ``masksembles_core.packing`` kind (its module docstring lists them);
``masksembles_core.packing.plan_program`` decides which channels each member computes and where tensors move; this
module emits the program. What the capture cannot compact runs exactly as the dense model runs it, at full width on
the member-stacked batch (``PackedMasksembles.fallbacks`` names those operations), so the result is the dense one.

Kernels: tensors a member computes are held one array per member, a shared one (before the first Masksembles layer)
once. The members' Linear layers (``dot_general`` with a weight) run as one batched matmul over their stacked
compacted weights; their convolutions one per member (XLA:CPU runs the grouped convolution that batching them makes
several times slower than the separate ones), a depthwise one on CPU as a sum of shifted slices times per-channel
weights (``_depthwise``: XLA:CPU's own depthwise convolution is 15-60x slower); elementwise operations, moves and
reductions run on each member's compacted array with their constant operands laid out like it. A channel move on a
channels-last spatial feature map (B, H, W, C) is one product with a one-hot matrix (XLA:CPU's gather copies value by
value: gathers made the packed ResNet of ``benchmarks/`` 10-20% slower, and were no faster on the Flax-examples-style
ones there); elsewhere, a token sequence (B, L, C) included, a gather, which XLA fuses into the operation that
produces it (one-hot products before the MLPs made the packed ViT-like of ``benchmarks/`` 15-20% slower at batch 32).
Operations that run at full width bind the model's primitive with the parameters it has at the member-stacked batch
size. On CPU a program proven to compute each sample from that sample alone (``Capture.per_sample``) runs on chunks of
the batch (``in_chunks``: ``jax.lax.map``) of ``CHUNK_SAMPLES`` samples (more where their tensors are small): XLA:CPU
ran the attention of the ViT-like of ``benchmarks/`` on a member-stacked batch of 4 x 32 samples (4x the work) in
4.5-7x the time of one batch of 32, and in 3.3x on chunks of 8 samples.

Exactness: results equal the dense model's for finite activations, up to float rounding. Channels that Masksembles
zeroes are left out instead of multiplied by 0 (a masked inf or NaN gives NaN in the dense model and is absent here),
and a non-finite activation moved by a one-hot product spreads NaN to the channels moved at its position.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter as clock  # the wall clock auto's build time and timings read
from typing import Any, cast

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
from flax import nnx

from masksembles_core.adapter import check_program
from masksembles_core.packing import (
    AUTO_BUILD,
    OUTPUT,
    VERIFICATION,
    VERIFY_SAMPLES,
    Move,
    Placement,
    Program,
    Step,
    block_indices,
    channel_indices,
    chosen_members,
    output_mismatch,
    plan_program,
    program_raised,
    samples_per_chunk,
    timed_choice_on_samples,
    verified,
)

from . import _capture as capture_module
from ._capture import PREFIX, SHAPE_PARAMS, Capture, Eqn, Literal, NotAffine, Op, node_name
from ._inference import refuse_sequence_first_inputs
from ._ops import apply_masks, predict, untile

# on CPU a program proven per-sample runs on chunks of CHUNK_SAMPLES samples, or more where that many samples' largest
# tensor (the members' together) is under CHUNK_BYTES (an MLP's: its matmuls keep their rows). XLA:CPU runs the
# attention, LayerNorms and MLPs of a ViT slower per multiply-add on tensors far over the CPU's cache, and convolutions
# far below their speed on a batch in loops of a few samples. On the quiet machine, chunks of 1 MiB (one sample of the
# benchmark's ResNet and CNN) made it 1.3-2.6x slower than one call at batch 32, and chunks of 4 samples of the
# Flax-examples ResNet-18 2.34x the single model at batch 32 against 1.93x with 16 samples and 2.02x in one call; the
# small ResNet at batch 256 read 2.03x (16 samples), 2.27x (64) and 2.50x (one call). Interleaved on the loaded
# machine, chunks of 16 samples instead of about 64 MiB (one call at batch 32, 128 samples at 256) ran the packed
# ViT-like 6-9% faster at batch 32 and 25% at 256, and the other rows as fast or up to 10% faster (docs/flax.md).
CHUNK_SAMPLES = 16
CHUNK_BYTES = 4 * 2**20


class Constant(nnx.Variable[jax.Array]):
    """An array of a packed program that is not a compacted weight: a per-channel operand laid out like the compacted
    channels, a one-hot move matrix, an operand (a weight too) of an operation run at full width, the masks of a
    Masksembles layer run at full width."""


Values = tuple[jax.Array, ...]  # one array per member, one for a shared tensor or one on the member-stacked batch
Arrays = dict[str, list[np.ndarray]]  # a packed module's arrays: one per copy


def _host(value: Any) -> np.ndarray:
    """A constant operand as NumPy; a PRNG key array (an RNG stream a loop carries, e.g. a stacked nnx.Dropout's)
    stays a JAX array, which NumPy cannot hold."""
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        return cast(np.ndarray, value)
    return np.asarray(value)


# ------------------------------------------------------------------------------------------------ the static program


@dataclass(frozen=True, eq=False)
class _Select:
    """Gather each target copy's channels from its source copy (``index``), then scale them (0/1: the masks, or a
    known zero written); or multiply by a one-hot ``matrix`` (a constant) that does both."""

    index: tuple[np.ndarray, ...]
    scale: tuple[np.ndarray | None, ...]
    source: tuple[int, ...]
    axis: int
    matrix: str = ""


@dataclass(frozen=True, eq=False)
class _Frame:
    """``to_batch`` (member arrays -> one on the member-stacked batch), ``to_channels`` (the reverse) or ``tile``
    (a shared array repeated for every member; ``axis`` -1: no batch axis, the same for all)."""

    kind: str
    axis: int
    members: int


@dataclass(frozen=True, eq=False)
class _Operand:
    """One operand of an equation: ``edge`` (the i-th run-time input, moved), ``constant`` (a key of the
    constants, its shape rebuilt per call by ``shape``) or ``literal`` (a value, or a template of the batch). An
    output ``edge`` holds the member-stacked batch on ``batch_axis`` (> 0: a sequence-first output, (L, m*B, ...))."""

    kind: str
    index: int = 0
    key: str = ""
    value: Any = None
    shape: Any = None
    batch_axis: int = 0


@dataclass(frozen=True, eq=False)
class _Step:
    """One node of the program, run ``copies`` times (once shared, once per member) on its moved ``edges``. ``how``:

    - ``input``; ``identity`` (a Masksembles layer: the move into it applied the masks);
    - ``dot``/``conv``: the model's ``eqn`` with its ``params`` on the compacted weight ``key`` (``side``: the input's
      operand position);
    - ``bind``: an elementwise operation, reduction or move on compacted arrays, with ``operands``; its output
      (``out_shape`` at the first probe batch size) has the batch on ``batch_axis`` and the channels on ``axis``, its
      input ``wide`` (laid out like it; an operand broadcast along the channels is shared, one copy read by every
      copy) on ``in_axes``;
    - ``concat`` (on ``axis``), ``flatten``;
    - ``dense``: output ``output`` of ``eqn`` at full width, ``params`` and ``operands`` templates of the batch size,
      on the member-stacked batch when ``member_frame``; ``masks``: a Masksembles layer at full width (masks ``key``);
    - ``output``: every output leaf on the member-stacked batch.
    """

    name: str
    how: str
    edges: tuple[tuple[str, tuple[int, ...]], ...] = ()
    copies: int = 1
    eqn: Eqn | None = None
    output: int = 0
    operands: tuple[_Operand, ...] = ()
    params: Any = None
    key: str = ""
    side: int = 0
    axis: int = -1
    batch_axis: int = -1
    out_shape: tuple[int, ...] = ()
    in_axes: tuple[int, int] = (-1, -1)  # a compacted move's input batch and channel axes
    wide: int = 0  # bind: the edge laid out like the output
    member_frame: bool = False
    depthwise: bool = False  # a conv with one input and one output channel per group (``_depthwise`` on CPU)


@dataclass(frozen=True, eq=False)
class _Plan:
    """Everything static about a packed model: its steps and moves, its output, the members it computes, which
    program it is and what ``pack`` measured (pairs, so that the plan stays immutable)."""

    steps: tuple[_Step, ...]
    moves: tuple[_Select | _Frame, ...]
    output: tuple[_Operand, ...]
    out_tree: Any
    members: tuple[int, ...]
    fallbacks: tuple[str, ...]
    squeeze: bool
    program: str = "packed"
    seconds: tuple[tuple[str, float], ...] = ()
    choice: str = ""
    pick: int = -1  # >= 0: the one member returned from a program of every member (squeezed)
    sample_bytes: int = 0  # > 0: proven per-sample, its largest tensor's bytes per sample (runs on chunks on CPU)

    def __repr__(self) -> str:
        """One line for the module's repr (the steps are not listed); after ``auto``, what it measured."""
        members = list(self.members)
        timed = ", ".join(f"{name} {seconds * 1e3:.3g} ms" for name, seconds in self.seconds)
        measured = f"; measured {timed}" if timed else ""
        if self.program == "dense":
            why = (
                f"{self.choice}" if self.choice else "; ".join(f for f in self.fallbacks if f.startswith(VERIFICATION))
            )
            chunks = ", per-sample: in chunks of the batch" if self.sample_bytes else ""
            return f"_Plan(members={members}, program=dense" + (f" ({why}{measured})" if why else "") + f"{chunks})"
        shown = ", ".join(self.fallbacks[:8]) + (", ..." if len(self.fallbacks) > 8 else "")
        chosen = f"program=packed ({self.choice}{measured}), " if self.choice else ""
        chunks = "per-sample: in chunks of the batch, " if self.sample_bytes else ""
        return f"_Plan(members={members}, {chosen}{chunks}fallbacks={len(self.fallbacks)}" + (
            f": {shown})" if shown else ")"
        )


# ------------------------------------------------------------------------------------------------ the module


class PackedMasksembles(nnx.Module):
    """Members of a Masksembles model on compacted weights, made by ``pack`` or ``extract_member``.

    ``__call__``: (B, ...) -> (m, B, ...) for the m members it was built for (each output leaf of the model), or
    (B, ...) for an extracted member. Inference only (eval semantics). Jit it like any NNX module (``nnx.jit``, or
    ``nnx.split`` + ``jax.jit``). ``weights`` holds the compacted kernels (``nnx.Param``), ``constants`` the other
    arrays; each entry is a list with one array per copy (one for a shared layer or an extracted member, one per
    member otherwise; the members' Linear kernels stacked in one array).
    """

    def __init__(self, plan: _Plan, weights: Arrays, constants: Arrays) -> None:
        self.plan = plan
        self.weights = nnx.Dict({k: nnx.List([nnx.Param(jnp.asarray(a)) for a in v]) for k, v in weights.items()})
        self.constants = nnx.Dict({k: nnx.List([Constant(jnp.asarray(a)) for a in v]) for k, v in constants.items()})

    @property
    def members(self) -> tuple[int, ...]:
        """The members it returns (indices into the masks)."""
        return self.plan.members if self.plan.pick < 0 else (self.plan.pick,)

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The model's operations that run at full width on the member-stacked batch (nothing here compacts them,
        or the program is ``"dense"``), as ``primitive at file:line (function)``."""
        return self.plan.fallbacks

    @property
    def program(self) -> str:
        """``"packed"`` (compacted where it can), or ``"dense"`` (the tiled model, as ``predict`` runs it)."""
        return self.plan.program

    @property
    def seconds(self) -> dict[str, float]:
        """What ``pack`` measured on the example input (median seconds per call of each program), or empty."""
        return dict(self.plan.seconds)

    @property
    def choice(self) -> str:
        """Why ``pack(program="auto")`` returned this program, from its interleaved timings; empty otherwise."""
        return self.plan.choice

    def chunk(self, batch: int) -> int:
        """The samples it runs at a time on a batch of ``batch`` (``jax.lax.map`` over chunks of the batch); 0: the
        whole batch in one call. On CPU a program proven to compute each sample from that sample alone runs on
        chunks of about ``CHUNK_SAMPLES`` samples, or more where that many samples' largest tensor (the members'
        together) is under ``CHUNK_BYTES``: chunks of equal size whose largest tensor is at most the larger of the
        two. A symbolic batch (``jax.export``) runs in one call: the chunks need the batch's size."""
        sample_bytes = self.plan.sample_bytes
        if not sample_bytes or jax.export.is_symbolic_dim(batch):
            return 0
        return samples_per_chunk(batch, sample_bytes, max(CHUNK_BYTES, CHUNK_SAMPLES * sample_bytes))

    def __call__(self, x: jax.Array) -> Any:
        """(B, ...) -> every output leaf as (m, B, ...), or (B, ...) for an extracted member."""
        axis = 0 if self.plan.squeeze or self.plan.pick >= 0 else 1
        return in_chunks(self._whole, x, self.chunk(x.shape[0]), axis)

    def _whole(self, x: jax.Array) -> Any:
        """The program on the whole of ``x`` in one call."""
        run = _Run(self, x.shape[0])
        for step in self.plan.steps:
            run.values[step.name] = run.step(step, x)
        return run.result()


def in_chunks(function: Callable[[jax.Array], Any], x: jax.Array, chunk: int, axis: int) -> Any:
    """``function(x)`` computed ``chunk`` samples at a time (``jax.lax.map`` over the batch's whole chunks, then one
    call on what is left), each output leaf joined on its batch axis ``axis``; in one call when ``chunk`` is 0 or
    not smaller than the batch. Only for a ``function`` that computes each sample from that sample alone."""
    count = x.shape[0] // chunk if chunk > 0 else 0
    if count == 0 or x.shape[0] <= chunk:
        return function(x)
    mapped = jax.lax.map(function, x[: count * chunk].reshape((count, chunk, *x.shape[1:])))

    def joined(y: jax.Array) -> jax.Array:  # (count, ..., chunk, ...) -> (..., count * chunk, ...)
        y = jnp.moveaxis(y, 0, axis)
        return y.reshape((*y.shape[:axis], count * chunk, *y.shape[axis + 2 :]))

    result = jax.tree.map(joined, mapped)
    if count * chunk == x.shape[0]:
        return result
    rest = function(x[count * chunk :])
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=axis), result, rest)


def _is_depthwise(params: dict[str, Any], kernel: tuple[int, ...]) -> bool:
    """Whether a convolution with ``params`` and a kernel of shape ``kernel`` has one input and one output channel per
    group, no input dilation, and its output laid out like its input (what ``_depthwise`` computes)."""
    numbers = params["dimension_numbers"]
    return (
        kernel[numbers.rhs_spec[1]] == 1
        and kernel[numbers.rhs_spec[0]] == params["feature_group_count"]
        and params["batch_group_count"] == 1
        and all(d == 1 for d in params["lhs_dilation"])
        and tuple(numbers.lhs_spec) == tuple(numbers.out_spec)
    )


def _depthwise_as_sums() -> bool:
    """Whether depthwise convolutions run as ``_depthwise``'s sums: on CPU (elsewhere as the model's convolution)."""
    return jax.default_backend() == "cpu"


def _depthwise(x: jax.Array, kernel: jax.Array, params: dict[str, Any]) -> jax.Array:
    """A depthwise convolution (``_is_depthwise``) as a sum over the window of strided slices of the padded input
    times each channel's weight: XLA fuses it into one loop, where XLA:CPU runs its own grouped convolution 15-60x
    slower (a 5x5 on (32, 8, 8, 240) took 75 ms, the sum 4 ms; jax 0.10.2)."""
    numbers = params["dimension_numbers"]
    channel_axis, spatial = numbers.lhs_spec[1], numbers.lhs_spec[2:]
    window = [kernel.shape[a] for a in numbers.rhs_spec[2:]]
    weights = jnp.transpose(kernel, (*numbers.rhs_spec[2:], numbers.rhs_spec[1], numbers.rhs_spec[0]))
    weights = weights.reshape((*window, kernel.shape[numbers.rhs_spec[0]]))  # (*window, C)
    pads = [(0, 0, 0)] * x.ndim
    for axis, (low, high) in zip(spatial, params["padding"], strict=True):
        pads[axis] = (low, high, 0)
    padded = jax.lax.pad(x, jnp.zeros((), x.dtype), pads)
    strides, dilation = params["window_strides"], params["rhs_dilation"]
    sizes = [
        (padded.shape[a] - (k - 1) * d - 1) // s + 1
        for a, k, d, s in zip(spatial, window, dilation, strides, strict=True)
    ]
    factor_shape = [1] * x.ndim
    factor_shape[channel_axis] = weights.shape[-1]
    total: jax.Array | None = None
    for tap in np.ndindex(*window):
        start, limit, step = [0] * x.ndim, list(padded.shape), [1] * x.ndim
        for axis, t, d, s, size in zip(spatial, tap, dilation, strides, sizes, strict=True):
            start[axis], limit[axis], step[axis] = t * d, t * d + s * (size - 1) + 1, s
        term = jax.lax.slice(padded, start, limit, step) * weights[tap].reshape(factor_shape)
        total = term if total is None else total + term
    assert total is not None
    dtype = params.get("preferred_element_type") or x.dtype
    return total.astype(dtype)


class _Run:
    """One call of a packed module: the values computed so far, the moves already made."""

    def __init__(self, module: PackedMasksembles, batch: int) -> None:
        self.module, self.plan, self.batch = module, module.plan, batch
        self.m = len(module.plan.members)
        self.values: dict[str, Values] = {}
        self.moved: dict[tuple[str, tuple[int, ...]], Values] = {}
        self.results: dict[int, list[jax.Array]] = {}  # full-width equations: all their outputs, once

    def constant(self, key: str, copy: int = 0) -> jax.Array:
        """A constant's array for one copy (the first, if the constant is the same for every copy)."""
        copies = self.module.constants[key]
        value: jax.Array = copies[copy if len(copies) > 1 else 0][...]
        return value

    def weight(self, key: str, copy: int = 0) -> jax.Array:
        value: jax.Array = self.module.weights[key][copy][...]
        return value

    def edge(self, edge: tuple[str, tuple[int, ...]]) -> Values:
        source, moves = edge
        value = self.values[source]
        for i in range(len(moves)):
            key = (source, moves[: i + 1])
            if key not in self.moved:
                self.moved[key] = self.move(self.plan.moves[moves[i]], value)
            value = self.moved[key]
        return value

    def move(self, move: _Select | _Frame, value: Values) -> Values:
        if isinstance(move, _Frame):
            if move.kind == "to_batch":
                return (jnp.concatenate(value, axis=move.axis),)
            if move.kind == "to_channels":
                return tuple(jnp.split(value[0], move.members, axis=move.axis))
            return value if move.axis < 0 else (jnp.concatenate([value[0]] * move.members, axis=move.axis),)
        outputs = []
        for k, (index, scale) in enumerate(zip(move.index, move.scale, strict=True)):
            x = value[move.source[k]]
            if move.matrix:
                matrix = self.constant(move.matrix, k).astype(x.dtype)
                outputs.append(jnp.dot(x, matrix, precision=jax.lax.Precision.HIGHEST))
                continue
            if len(index) != x.shape[move.axis] or not np.array_equal(index, np.arange(len(index))):
                x = jnp.take(x, index, axis=move.axis, mode="clip")
            if scale is not None:
                shape = [1] * x.ndim
                shape[move.axis] = len(scale)
                factor = jnp.asarray(scale.reshape(shape))
                x = x & factor.astype(bool) if x.dtype == jnp.bool_ else x * factor.astype(x.dtype)
            outputs.append(x)
        return tuple(outputs)

    def step(self, step: _Step, x: jax.Array) -> Values:
        if step.how == "input":
            return (x,)
        inputs = [self.edge(edge) for edge in step.edges]
        if step.how == "identity":
            return inputs[0]
        if step.how == "dot":
            return self.dot(step, inputs[0])
        if step.how == "conv":
            eqn = cast(Eqn, step.eqn)
            params = cast(dict[str, Any], step.params)
            if step.depthwise and _depthwise_as_sums():
                return tuple(_depthwise(xk, self.weight(step.key, k), params) for k, xk in enumerate(inputs[0]))
            return tuple(
                capture_module.bind(eqn, [xk, self.weight(step.key, k)], params)[0] for k, xk in enumerate(inputs[0])
            )
        if step.how == "bind":
            per_copy = [
                [value[k] if len(value) == step.copies else value[0] for value in inputs] for k in range(step.copies)
            ]
            return tuple(self.bind(step, tensors, k) for k, tensors in enumerate(per_copy))
        if step.how == "concat":
            parts = [value for value in inputs if value[0].shape[step.axis] > 0]
            return tuple(jnp.concatenate([part[k] for part in parts], axis=step.axis) for k in range(step.copies))
        if step.how == "flatten":
            return tuple(v.reshape((v.shape[0], -1)) for v in inputs[0])
        if step.how == "masks":
            return (apply_masks(inputs[0][0], self.constant(step.key), channel_axis=step.axis),)
        if step.how == "dense":
            return (self.dense(step, [value[0] for value in inputs]),)
        return tuple(value[0] for value in inputs)  # output: every leaf on the member-stacked batch

    def dot(self, step: _Step, value: Values) -> Values:
        """The members' Linear layers as one batched matmul: (m, ..., P_in) x (m, weight) -> (m, ...)."""
        weight = self.weight(step.key)
        eqn, params = cast(Eqn, step.eqn), dict(cast(dict[str, Any], step.params))
        if step.copies == 1:
            operands = [value[0], weight] if step.side == 0 else [weight, value[0]]
            return (capture_module.bind(eqn, operands, params)[0],)
        (contracting, _) = params["dimension_numbers"]
        params["dimension_numbers"] = (tuple(tuple(int(d) + 1 for d in dims) for dims in contracting), ((0,), (0,)))
        stacked = jnp.stack(value)
        operands = [stacked, weight] if step.side == 0 else [weight, stacked]
        (result,) = capture_module.bind(eqn, operands, params)
        return tuple(result[k] for k in range(step.copies))

    def bind(self, step: _Step, tensors: list[jax.Array], copy: int) -> jax.Array:
        """A compacted elementwise operation or move on one copy: constants laid out, shapes for this batch."""
        eqn = cast(Eqn, step.eqn)
        params = dict(cast(dict[str, Any], step.params))
        batch_in, channel_in = step.in_axes
        source = tensors[step.wide]
        width = source.shape[channel_in] if channel_in >= 0 else 0
        shape = list(step.out_shape)
        shape[step.batch_axis] = source.shape[batch_in]
        if step.axis >= 0:
            shape[step.axis] = width
        for key in SHAPE_PARAMS.get(eqn.name, ()):
            if key == "limit_indices":
                limits = list(params[key])
                for a in (batch_in, channel_in):
                    limits[a] = source.shape[a]
                params[key] = tuple(limits)
            else:
                params[key] = tuple(shape)
        args = []
        for operand in step.operands:
            if operand.kind == "edge":
                args.append(tensors[operand.index])
            elif operand.kind == "literal":
                args.append(operand.value)
            else:
                value = self.constant(operand.key, copy)
                target = [shape[a] if dim is None else dim for a, dim in enumerate(operand.shape)]
                args.append(jnp.broadcast_to(value, target))
        (result,) = capture_module.bind(eqn, args, params)
        return cast(jax.Array, result)

    def dense(self, step: _Step, tensors: list[jax.Array]) -> jax.Array:
        """The model's equation at full width, with the parameters it has at this frame's batch size."""
        eqn = cast(Eqn, step.eqn)
        frame = self.batch * self.m if step.member_frame else self.batch
        if eqn.index not in self.results:
            members = self.plan.members
            params = {key: capture_module.instantiate(value, frame, members) for key, value in step.params.items()}
            args: list[Any] = []
            for operand in step.operands:
                if operand.kind == "edge":
                    args.append(tensors[operand.index])
                elif operand.kind == "literal":
                    # a value that follows a symbolic batch (jax.export: a mean's count) is traced: kept as it is
                    value = capture_module.instantiate(operand.value, frame, members)
                    args.append(value if isinstance(value, jax.Array) else np.asarray(value))
                else:
                    target = tuple(capture_module.instantiate(operand.shape, frame, members))
                    args.append(jnp.broadcast_to(self.constant(operand.key), target))
            self.results[eqn.index] = capture_module.bind(eqn, args, params)
        return self.results[eqn.index][step.output]

    def result(self) -> Any:
        leaves = []
        for operand in self.plan.output:
            if operand.kind == "edge":
                leaf = self.values[OUTPUT][operand.index]
            elif operand.kind == "literal":
                leaf = jnp.asarray(operand.value)
            else:
                leaf = self.constant(operand.key)
            axis = operand.batch_axis
            if self.plan.pick >= 0:
                leaf = jnp.moveaxis(untile(jnp.moveaxis(leaf, axis, 0), self.m)[self.plan.pick], 0, axis)
            elif not self.plan.squeeze and axis == 0:
                leaf = untile(leaf, self.m)
            leaves.append(leaf)  # a sequence-first leaf keeps predict's layout: member k's block on its batch axis
        return jax.tree.unflatten(self.plan.out_tree, leaves)


# ------------------------------------------------------------------------------------------------ emission


class _Emitter:
    """Builds the static plan and the arrays of a packed module from the core program."""

    def __init__(self, capture: Capture, axis: dict[int, int], program: Program, squeeze: bool, dense: bool) -> None:
        self.capture, self.axis, self.program = capture, axis, program
        self.m = len(program.members)
        self.ops = {node_name(var): op for var, op in capture.ops.items()}
        self.weights: Arrays = {}
        self.constants: Arrays = {}
        self.moves: list[_Select | _Frame] = []
        self.move_ids: dict[tuple[Any, ...], int] = {}
        steps = [self._step(step) for step in program.steps]
        fallbacks = capture_module.fallbacks(capture, program.fallbacks)
        self.plan = _Plan(tuple(steps), tuple(self.moves), self._output(), capture.program.out_tree,
                          program.members, fallbacks, squeeze, "dense" if dense else "packed")  # fmt: skip

    def var(self, name: str) -> int:
        return int(name[1:])

    # ---- moves

    def _edges(self, step: Step) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Each input's producer and its moves (ids into the plan's moves; equal moves of a producer are shared)."""
        edges = []
        for edge in step.edges:
            produced = self.program.step(edge.source).placement
            shared, width = produced.shared, produced.width  # where the tensor is, as the moves go
            ids: list[int] = []
            key: tuple[Any, ...] = (edge.source,)
            target = edge.placement.width
            for move in edge.moves:
                # a select's copies: its index covers them side by side (a part of a concatenation may be empty)
                blocks = len(move.index) // target if move.index is not None and target else len(edge.placement.layouts)
                key = (*key, move.kind, _bytes(move.index), _bytes(move.scale))
                if key not in self.move_ids:
                    self.move_ids[key] = len(self.moves)
                    self.moves.append(self._make_move(edge.source, move, shared, width, target, blocks))
                ids.append(self.move_ids[key])
                if move.kind == "to_channels":
                    shared = False
                elif move.kind == "select":
                    shared, width = blocks == 1, target
            edges.append((edge.source, tuple(ids)))
        return tuple(edges)

    def _make_move(
        self, source: str, move: Move, shared: bool, source_width: int, width: int, blocks: int
    ) -> _Select | _Frame:
        """A core move as a kernel. A select's index addresses the members' blocks side by side: each target copy's
        block is cut out of its own source copy (or the one shared copy)."""
        var = self.var(source)
        seen = self.capture.values[var]
        if move.kind != "select":
            axis = seen.batch_axis if move.kind != "tile" or seen.batch_axes else -1
            return _Frame(move.kind, axis, self.m)
        assert move.index is not None and move.scale is not None
        channel_axis = self.axis[var]
        index = move.index.reshape(blocks, width)
        scale = move.scale.reshape(blocks, width)
        if not shared:
            index = index - (np.arange(blocks) * source_width)[:, None]
        sources = tuple(0 if shared else k for k in range(blocks))
        scales = tuple(None if (s == 1).all() else s.astype(np.float32) for s in scale)
        gathers = source_width != width or any(not np.array_equal(i, np.arange(width)) for i in index)
        feature_map = seen.rank > 3 and channel_axis == seen.rank - 1 and np.issubdtype(seen.dtype, np.floating)
        matrix = ""
        if feature_map and gathers:
            matrix = f"move_{len(self.moves)}"
            selection = np.zeros((blocks, source_width, width), dtype=np.float32)
            for k in range(blocks):
                selection[k, index[k], np.arange(width)] = scale[k]
            self.constants[matrix] = list(selection)
        return _Select(tuple(index), scales, sources, channel_axis, matrix)

    # ---- steps

    def _step(self, step: Step) -> _Step:
        name = step.name
        if step.node.kind == "input":
            return _Step(name, "input")
        edges = self._edges(step)
        if name == OUTPUT:
            return _Step(name, "output", edges)
        op = self.ops[name]
        copies = 1 if step.placement.shared else self.m
        if step.placement.dense:
            if capture_module.is_masking(op.eqn.name, op.eqn.params[0]):
                masks = np.asarray(self.capture.analysis.constants[cast(int, op.eqn.inputs[1])])
                key = f"{name}_masks"
                self.constants[key] = [masks[list(self.program.members)]]
                axis = capture_module.masking_axis(op.eqn.params[0])
                return _Step(name, "masks", edges, key=key, axis=axis)
            return self._dense(step, op, edges)
        kind = step.node.kind
        if kind == "masks":
            return _Step(name, "identity", edges)
        if kind == "mixing" and op.eqn.name == "dot_general":
            return self._dot(step, op, edges, copies)
        if kind in ("mixing", "grouped"):
            return self._conv(step, op, edges, copies)
        if kind == "concat":
            return _Step(name, "concat", edges, copies, axis=op.axis)
        if kind == "flatten":
            return _Step(name, "flatten", edges, copies)
        return self._bind(step, op, edges, copies)

    def _dot(self, step: Step, op: Op, edges: Any, copies: int) -> _Step:
        params = dict(op.eqn.params[0])
        (contracting, _) = params["dimension_numbers"]
        side = op.eqn.inputs.index(op.tensors[0])
        weight = np.asarray(self.capture.analysis.constants[op.weight])
        into = int(contracting[1 - side][0])  # the weight's contracted axis; its other one is the output's
        rows = step.placement.layouts
        cols = step.edges[0].placement.member_layouts(len(rows))
        r, c, valid = block_indices(rows, cols)  # (L, P_out, P_in)
        oriented = weight if into == 1 else weight.T  # (C_out, C_in)
        blocks = np.where(valid, oriented[r, c], np.zeros((), weight.dtype))
        blocks = blocks if into == 1 else blocks.transpose(0, 2, 1)
        key = self._weight_key(op)
        self.weights[key] = [blocks if copies > 1 else blocks[0]]  # the members' blocks stacked: one matmul
        return _Step(step.name, "dot", edges, copies, op.eqn, params=params, key=key, side=side)

    def _conv(self, step: Step, op: Op, edges: Any, copies: int) -> _Step:
        params = dict(op.eqn.params[0])
        kernel = np.asarray(self.capture.analysis.constants[op.weight])
        numbers = params["dimension_numbers"]
        out_dim, in_dim = numbers.rhs_spec[0], numbers.rhs_spec[1]
        oriented = np.moveaxis(kernel, (out_dim, in_dim), (0, 1))  # (C_out, C_in / groups, *window)
        rows = step.placement.layouts
        if step.node.kind == "grouped":
            blocks = []
            for layout in rows:
                index, valid = channel_indices([layout])
                keep = valid.reshape(-1, *([1] * (oriented.ndim - 1)))
                blocks.append(np.where(keep, oriented[index], np.zeros((), kernel.dtype)))
            stacked = np.stack(blocks)
            params["feature_group_count"] = step.groups
        else:
            cols = step.edges[0].placement.member_layouts(len(rows))
            r, c, valid = block_indices(rows, cols)
            keep = valid.reshape(*valid.shape, *([1] * (oriented.ndim - 2)))
            stacked = np.where(keep, oriented[r, c], np.zeros((), kernel.dtype))
        restored = np.moveaxis(stacked, (1, 2), (out_dim + 1, in_dim + 1))
        key = self._weight_key(op)
        self.weights[key] = list(restored)
        return _Step(step.name, "conv", edges, copies, op.eqn, params=params, key=key,
                     depthwise=_is_depthwise(params, restored.shape[1:]))  # fmt: skip

    def _weight_key(self, op: Op) -> str:
        """``dot_general_000``, ``conv_general_dilated_001``, ...: the i-th kernel of that primitive in program order
        (state keys sort in that order)."""
        count = sum(key.startswith(op.eqn.name) for key in self.weights)
        return f"{op.eqn.name}_{count:03d}"

    def _bind(self, step: Step, op: Op, edges: Any, copies: int) -> _Step:
        """A compacted elementwise operation, reduction or move, with its constant operands laid out per copy."""
        capture = self.capture
        out = capture.values[op.var]
        operands = []
        for position, atom in enumerate(op.eqn.inputs):
            if isinstance(atom, Literal):
                operands.append(_Operand("literal", value=atom.values[0]))
            elif atom in capture.runtime:
                operands.append(_Operand("edge", index=op.tensors.index(atom)))
            else:
                key = f"{step.name}_operand{position}"
                value = np.asarray(capture.analysis.reduced[atom])
                self.constants[key] = self._lay_out(value, op.axis, out.shape[op.axis], step.placement, copies)
                seen = capture.values[atom]  # None: the batch's size, or the compacted channels'
                shape = tuple(
                    None
                    if (a == out.batch_axis and a in seen.batch_axes) or (a == op.axis and size == out.shape[a])
                    else size
                    for a, size in enumerate(seen.shape)
                )
                operands.append(_Operand("constant", key=key, shape=shape))
        wide = op.channel_operands[0]
        in_axes = (capture.values[wide].batch_axis, self.axis.get(wide, -1))
        return _Step(step.name, "bind", edges, copies, op.eqn, operands=tuple(operands), params=dict(op.eqn.params[0]),
                     axis=op.axis, batch_axis=out.batch_axis, out_shape=out.shape, in_axes=in_axes,
                     wide=op.tensors.index(wide))  # fmt: skip

    def _lay_out(
        self, value: np.ndarray, axis: int, channels: int, placement: Placement, copies: int
    ) -> list[np.ndarray]:
        """A constant operand per copy: its channel axis laid out like the copy's channels (a constant with one
        channel, or a scalar, is the same for every copy: one array)."""
        if value.ndim == 0 or value.shape[axis] != channels or channels == 1:
            return [value]
        laid = []
        for layout in placement.layouts[:copies]:
            index, _ = channel_indices([layout])  # padding reads channel 0: finite, and never read back
            laid.append(np.take(value, index, axis=axis))
        return laid

    def _dense(self, step: Step, op: Op, edges: Any) -> _Step:
        """The model's equation as the dense model runs it, its batch-sized parameters rebuilt per call."""
        capture, eqn = self.capture, op.eqn
        start = capture.program.batch
        try:
            params = {key: capture_module.template([p[key] for p in eqn.params], start) for key in eqn.params[0]}
            operands = []
            for position, atom in enumerate(eqn.inputs):
                if isinstance(atom, Literal):
                    operands.append(_Operand("literal", value=capture_module.template(atom.values, start)))
                elif atom in capture.runtime:
                    operands.append(_Operand("edge", index=op.tensors.index(atom)))
                else:
                    key = f"{step.name}_operand{position}"
                    self.constants[key] = [_host(capture.analysis.reduced[atom])]
                    shape = capture_module.template(capture.values[atom].shapes, start)
                    operands.append(_Operand("constant", key=key, shape=shape))
        except NotAffine as error:
            raise ValueError(
                f"{PREFIX}: {eqn.describe()} has parameters that follow the batch size in a way that cannot be "
                f"rebuilt for other batch sizes ({error}); it cannot run on the member-stacked batch"
            ) from error
        member_frame = not step.placement.shared
        return _Step(step.name, "dense", edges, eqn=eqn, output=eqn.outputs.index(op.var), operands=tuple(operands),
                     params=params, member_frame=member_frame)  # fmt: skip

    def _output(self) -> tuple[_Operand, ...]:
        capture = self.capture
        names = [edge.source for edge in self.program.step(OUTPUT).edges]
        operands = []
        for position, atom in enumerate(capture.program.outputs):
            if isinstance(atom, Literal):
                operands.append(_Operand("literal", value=atom.values[0]))
            elif atom in capture.runtime:
                batch_axis = max(capture.values[atom].batch_axis, 0)
                operands.append(_Operand("edge", index=names.index(node_name(atom)), batch_axis=batch_axis))
            else:
                key = f"output_{position}"
                self.constants[key] = [_host(capture.analysis.constants[atom])]
                operands.append(_Operand("constant", key=key))
        return tuple(operands)


def _bytes(array: np.ndarray | None) -> bytes | None:
    return None if array is None else array.tobytes()


# ------------------------------------------------------------------------------------------------ the public API


def _build(capture: Capture, chosen: Sequence[int], squeeze: bool, *, dense: bool = False) -> PackedMasksembles:
    if dense:  # the tiled dense model itself: every operation as the model runs it, on the member-stacked batch
        capture = copy.copy(capture)  # its own ops: the traced program can still be packed
        capture.ops = {var: capture.fallback(var) for var in capture.ops}
    axis = capture_module.solve_axes(capture)
    nodes = capture_module.graph_nodes(capture, axis)
    pick = chosen[0] if squeeze and _reads_the_batch(capture) else -1
    if pick >= 0:  # one member, where an operation reads the batch: predict's batch holds every member's copy
        chosen, squeeze = list(range(capture.n)), False
    program = plan_program(nodes, OUTPUT, chosen)
    emitter = _Emitter(capture, axis, program, squeeze, dense)
    packed = PackedMasksembles(emitter.plan, emitter.weights, emitter.constants)
    sample_bytes = _sample_bytes(capture, len(program.members))
    packed.plan = dataclasses.replace(packed.plan, pick=pick, sample_bytes=sample_bytes)
    return packed


def _sample_bytes(capture: Capture, members: int) -> int:
    """On CPU, for a program proven to compute each sample from that sample alone (``Capture.per_sample``): the bytes
    per sample of its largest tensor, every member's as wide as the model's (at most); else 0 (never on chunks)."""
    if jax.default_backend() != "cpu" or not capture.per_sample():
        return 0
    batch = capture.program.batch
    largest = max(
        math.prod(value.shape) // batch * value.dtype.itemsize
        for value in (capture.values[var] for var in capture.runtime)
        if value.batch_axis >= 0
    )
    return largest * members


def _reads_the_batch(capture: Capture) -> bool:
    """Whether an operation that runs at full width may read the batch (its size, or other samples) and so runs on
    the member-stacked batch per member: one member's program must then compute every member, as ``predict`` does
    (a Masksembles layer that runs at full width needs no other member: it applies the computed members' masks)."""
    return any(
        op.kind == "fallback" and op.batch_dependent and not capture_module.is_masking(op.eqn.name, op.eqn.params[0])
        for op in capture.ops.values()
    )


def _example_values(example_input: jax.Array | jax.ShapeDtypeStruct) -> jax.Array:
    """The example as an array: itself, or for a ``jax.ShapeDtypeStruct`` seeded normal values (zeros if integer)."""
    if not isinstance(example_input, jax.ShapeDtypeStruct):
        return jnp.asarray(example_input)
    if jnp.issubdtype(example_input.dtype, jnp.floating):
        return jax.random.normal(jax.random.key(0), example_input.shape, example_input.dtype)
    return jnp.zeros(example_input.shape, example_input.dtype)


class _Verifier:
    """Checks built programs against ``predict`` (eval semantics) on the first ``VERIFY_SAMPLES`` samples."""

    def __init__(
        self, model: nnx.Module, x: jax.Array, n: int, chosen: Sequence[int], squeeze: bool, batch_axes: Sequence[int]
    ) -> None:
        """``batch_axes``: the batch axis of each output leaf of the model (> 0: sequence-first, predict's members'
        blocks on that axis)."""
        graphdef, state = nnx.split(model)
        dense = nnx.merge(graphdef, state)  # a new module graph on the same arrays: eval mode leaves the model alone
        dense.eval()  # type: ignore[no-untyped-call]
        self.x = x[:VERIFY_SAMPLES]
        leaves, tree = jax.tree.flatten(predict(_jitted(dense), self.x, n))
        members = [_chosen(y, n, axis, chosen, squeeze) for y, axis in zip(leaves, batch_axes, strict=True)]
        self.expected = _leaf_arrays(jax.tree.unflatten(tree, members))

    def mismatch(self, packed: PackedMasksembles) -> str | None:
        """Why ``packed`` differs from ``predict`` on the sample, or None."""
        try:
            actual = _leaf_arrays(_jitted(packed)(self.x))
        except Exception as error:  # a program that fails where the model runs differs from it
            return program_raised(error)
        return output_mismatch(self.expected[0], actual[0], self.expected[1])


def _chosen(y: jax.Array, n: int, batch_axis: int, chosen: Sequence[int], squeeze: bool) -> jax.Array:
    """The ``chosen`` members of one ``predict`` output leaf: (n, B, ...) -> (len(chosen), B, ...), or (B, ...) for
    ``squeeze``; a sequence-first leaf (its members' blocks on ``batch_axis``) keeps that layout."""
    if batch_axis <= 0:
        return y[jnp.asarray(chosen)][0] if squeeze else y[jnp.asarray(chosen)]
    picked = untile(jnp.moveaxis(y, batch_axis, 0), n)[jnp.asarray(chosen)]
    stacked = picked[0] if squeeze else picked.reshape((-1, *picked.shape[2:]))
    return jnp.moveaxis(stacked, 0, batch_axis)


def _leaf_arrays(tree: Any) -> tuple[list[np.ndarray], list[float]]:
    """An output's leaves as NumPy arrays (floats as float64), and each one's machine epsilon (0: compared exactly)."""
    arrays, eps = [], []
    for leaf in jax.tree.leaves(tree):
        value = np.asarray(leaf)
        floating = jnp.issubdtype(value.dtype, jnp.inexact)
        arrays.append(value.astype(np.float64) if floating and not np.iscomplexobj(value) else value)
        eps.append(float(jnp.finfo(value.dtype).eps) if floating else 0.0)  # type: ignore[no-untyped-call]
    return arrays, eps


def _verified(
    capture: Capture, verifier: _Verifier | None, chosen: Sequence[int], squeeze: bool, dense: bool
) -> PackedMasksembles:
    """The program built from ``capture`` if it equals ``predict``; otherwise every operation at full width, or, for
    one extracted member, every member at full width and that member's output, with the reason first in
    ``fallbacks``. Raises if none of them equals ``predict``."""
    packed = _build(capture, chosen, squeeze, dense=dense)
    if verifier is None:
        return packed

    def full_width(members: Sequence[int], squeezed: bool, pick: int) -> PackedMasksembles:
        candidate = _build(capture, members, squeezed, dense=True)
        if pick >= 0:  # otherwise keep the member _build picks where the batch is read
            candidate.plan = dataclasses.replace(candidate.plan, pick=pick)
        return candidate

    replacements = [] if dense else [("every operation at full width", lambda: full_width(chosen, squeeze, -1))]
    if squeeze:  # an operation that reads the batch sees every member's copy of it in predict
        every = list(range(capture.n))
        replacements.append(("every member at full width", lambda: full_width(every, False, chosen[0])))
    checked = verified(packed, packed.program, verifier.mismatch, replacements)
    result, reason = checked
    if result is None:
        raise RuntimeError(f"{PREFIX} could not build a program equal to predict: {reason}")
    if reason:
        result.plan = dataclasses.replace(result.plan, fallbacks=(reason, *result.plan.fallbacks))
    return result


def _timed(module: PackedMasksembles, x: jax.Array) -> Callable[[], object]:
    """One jitted call of ``module`` on ``x``, waiting for its result (the first call compiles)."""
    run = _jitted(module)
    return lambda: jax.block_until_ready(run(x))  # type: ignore[no-untyped-call]


def _jitted(module: nnx.Module) -> Callable[[jax.Array], Any]:
    """``module`` as one jitted function of its input (compiled once per input shape, not operation by operation)."""
    graphdef, state = nnx.split(module)
    jitted = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    return lambda x: jitted(state, x)


def _packed(
    model: nnx.Module,
    example_input: jax.Array | jax.ShapeDtypeStruct,
    members: Sequence[int] | None,
    squeeze: bool,
    program: str,
    verify: bool,
) -> PackedMasksembles:
    """``pack``/``extract_member``: capture once, build the program(s), verify, and choose."""
    check_program(program)
    started = clock()
    refuse_sequence_first_inputs(model, PREFIX)
    capture = Capture(model, example_input)
    chosen = chosen_members(members, capture.n)
    x = _example_values(example_input)
    axes = [capture.values[a].batch_axis if isinstance(a, int) else 0 for a in capture.program.outputs]
    verifier = _Verifier(model, x, capture.n, chosen, squeeze, axes) if verify else None
    if program != "auto":
        return _verified(capture, verifier, chosen, squeeze, program == "dense")
    packed = _verified(capture, verifier, chosen, squeeze, False)
    if packed.program == "dense":  # verification left nothing packed: nothing to choose
        return packed
    deadline = started + AUTO_BUILD * (clock() - started)  # AUTO_BUILD times what program="packed" takes
    candidates = {"packed": packed, "dense": _verified(capture, verifier, chosen, squeeze, True)}

    def calls_on(samples: int) -> dict[str, Callable[[], object]]:
        return {name: _timed(module, x[:samples]) for name, module in candidates.items()}

    name, why, times = timed_choice_on_samples(
        calls_on, len(x), "packed", deadline=deadline, clock=clock, compiled=True
    )  # the first call at a batch size compiles
    chosen_program = candidates[name]
    seconds = tuple((key, statistics.median(value)) for key, value in times.items())
    chosen_program.plan = dataclasses.replace(chosen_program.plan, seconds=seconds, choice=why)
    return chosen_program


def pack(
    model: nnx.Module,
    example_input: jax.Array | jax.ShapeDtypeStruct,
    *,
    program: str = "auto",
    verify: bool = True,
) -> PackedMasksembles:
    """All members of ``model`` in one call on compacted weights: (B, ...) -> (n, B, ...).

    Equals ``masksembles_flax.predict(model, x, n)`` with eval semantics (BatchNorm running statistics, Dropout off)
    for finite activations, at about the cost the masks' overlap allows instead of n dense forward passes.
    ``example_input`` (an array or a ``jax.ShapeDtypeStruct``, batch on axis 0, any batch size; a small one traces
    faster) gives the shapes; the model is traced, not modified. Any ``nnx.Module`` JAX can trace in eval mode packs:
    what this module cannot compact runs at full width (listed in ``fallbacks``).

    Args:
        program: ``"packed"`` (compacted where it can), ``"dense"`` (the tiled dense model: every operation as the
            model runs it, on the member-stacked batch, as ``predict`` does), or ``"auto"`` (the default: both are
            jitted and timed in interleaved rounds on ``example_input``, seeded normal values for a
            ``jax.ShapeDtypeStruct``; the packed program is kept unless the dense one was clearly faster
            (``masksembles_core.packing.choose_program``); ``seconds`` holds the medians, ``choice`` the reason;
            give an example of the batch size you will run).
        verify: compare the program with ``predict`` on the first few samples of the example (seeded normal values
            for a ``jax.ShapeDtypeStruct``) before returning it (the default). One that differs beyond float
            rounding is never returned: every operation then runs at full width, and the first entry of
            ``fallbacks`` says why. ``False`` skips it.

    Raises:
        ValueError: ``program`` is not one of the three; the model cannot be traced (Python control flow on array
            values), has no Masksembles layer, or holds Masksembles layers of different n.
        RuntimeError: verification found no program equal to ``predict`` (a bug: please report it).
    """
    return _packed(model, example_input, None, False, program, verify)


def extract_member(
    model: nnx.Module, k: int, example_input: jax.Array | jax.ShapeDtypeStruct, *, verify: bool = True
) -> PackedMasksembles:
    """Member ``k`` of ``model`` as a standalone model: (B, ...) -> (B, ...).

    Every layer next to a Masksembles layer is physically shrunk to member ``k``'s live channels; the output equals
    member ``k``'s output of the masked model (eval semantics, finite values), verified as in ``pack``. Same support
    and errors as ``pack``. An operation that reads the batch (a sum over it, its size) sees every member's copy of
    the batch in ``predict``: where the compacted member differs for that reason, verification finds it and the
    returned module runs every member at full width and returns member ``k``'s output (``fallbacks`` says so).
    """
    return _packed(model, example_input, [k], True, "packed", verify)
