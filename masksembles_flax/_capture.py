"""The first half of Flax NNX packing: a model's computation, traced by JAX, as a graph of ``masksembles_core`` kinds.

The model (a copy in eval mode) is traced as a pure function of its state leaves and the input with
``jax.make_jaxpr``, at the example's batch size B and at B+1 and B+2 (at 2, 3 and 4 for an example of batch 1 whose
program differs from batch 2's: JAX simplifies some operations away at batch 1, e.g. a broadcast of a class token to
the batch; verification then checks the program at the example's batch). Nested calls (``jit``, ``custom_jvp``/
``custom_vjp`` functions, ``remat``) are inlined, so the program is a flat list of JAX primitives (loops and branches,
``scan``/``while``/``cond``, stay whole); a variable's axes whose size follows the batch are its batch axes, and the
parameters and literals that follow it (a ``reshape`` to (B*L, C), a mean over the batch, a loop body) are affine in
the batch size (checked at the third size), so they can be rebuilt for any batch. Everything computed from the state
alone is folded to a constant, once; the rest reads the input.

Each equation that reads the input becomes a core node (``masksembles_core.packing``, whose module docstring defines
the kinds): ``dot_general`` with a constant operand contracted over one axis and one free axis of its own is
*mixing* (``nnx.Linear``, an einsum projection); ``conv_general_dilated`` is *mixing*, or *grouped* with
``feature_group_count > 1``; elementwise primitives are *channelwise* with one operand that reads the input (the
others constants, laid out per channel) or *combine* with several; reductions, pools (``reduce_window_*``) and
cumulative operations over other axes, transposes, reshapes, broadcasts, squeezes, slices, pads and concatenations
that keep the channel axis whole are *channelwise* moves; a concatenation of model values along the channel axis is
*concat*; ``reshape`` (B, ..., C) -> (B, features) is *flatten*; the NNX Masksembles layer is *masks* (its grouped
masking runs as a ``jit`` named ``masksembles_grouped_channel_axis_<axis>``, with the input and the masks as
operands). Anything else, and any node whose channel axis cannot agree with its neighbours', is a *fallback*.

Which axis of a move or reduction holds the channels is evaluated, not read from its name where the primitive moves
data: the equation runs on a tensor holding each position's index along one axis, and the result must hold those
indices whole and in order on one axis, constant along the others (likewise for the batch). Reductions, pools and
cumulative operations map axes by their ``axes``/window parameters. "Zero stays zero" is evaluated per equation and
operand: an equation is zero-preserving on a channel only when running it, with its own constant operands, on +0 and
on -0 inputs gives 0 there; a combine is zero when all its value operands are, if running it on zero values gives 0
for every value of its boolean operands (a ``select``'s predicate); products (``mul``, ``and``) are zero when one
operand is (finite values).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import source_info_util

from masksembles_core import captured
from masksembles_core.captured import CapturedOp, Probed, array_repeatable
from masksembles_core.packing import OUTPUT, GraphNode

from ._ops import GROUPED_MASKING, apply_masks, batch_size

PREFIX = "pack/extract_member"
PROBES = 3  # batch sizes B, B+1, B+2: the first two find the batch axes, the third checks affine parameters
INLINED = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat2", "checkpoint"}
ELEMENTWISE = {
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "clz", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma", "div", "eq", "erf",
    "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "igamma", "igammac", "imag", "integer_pow",
    "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter",
    "not", "or", "polygamma", "population_count", "pow", "real", "reduce_precision", "rem", "round", "rsqrt",
    "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh", "sqrt",
    "square", "stop_gradient", "sub", "tan", "tanh", "xor", "zeta",
}  # fmt: skip
PRODUCTS = {"mul", "and"}  # zero when one operand is zero (finite values)
REDUCTIONS = {
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax",
    "argmin",
}  # fmt: skip
WINDOWS = {"reduce_window_sum", "reduce_window_max", "reduce_window_min"}
CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
MOVES = {"transpose", "reshape", "broadcast_in_dim", "squeeze", "slice", "pad", "rev", "concatenate"}
# parameters of a compacted move that are shapes: recomputed from the arrays it runs on
SHAPE_PARAMS = {"reshape": ("new_sizes",), "broadcast_in_dim": ("shape",), "slice": ("limit_indices",)}


# ------------------------------------------------------------------------------------------------ the traced program


@dataclass(frozen=True, eq=False)
class Literal:
    """A literal operand: its value at each probe batch size (equal unless it follows the batch)."""

    values: tuple[np.ndarray, ...]


Atom = int | Literal  # a variable (its index), or a literal


@dataclass(frozen=True, eq=False)
class Value(Probed):
    """A variable of the program: its shape at each probe batch size (``batch``, ``batch + 1``, ...), its dtype."""

    dtype: np.dtype = field(kw_only=True)


@dataclass(eq=False)
class Eqn:
    """One primitive of the flat program: its operands, its outputs and its parameters at each probe batch size."""

    index: int
    primitive: jex.Primitive
    inputs: tuple[Atom, ...]
    outputs: tuple[int, ...]
    params: tuple[dict[str, Any], ...]
    source: Any  # the first probe's source_info

    @property
    def name(self) -> str:
        return str(self.primitive.name)

    @property
    def varying(self) -> set[str]:
        """The parameters that change with the batch size."""
        return {key for key in self.params[0] if not all(_same(self.params[0][key], p[key]) for p in self.params[1:])}

    def describe(self) -> str:
        """The primitive and where the model calls it, e.g. ``reduce_sum at normalization.py:57 (_compute_stats)``."""
        summary = re.sub(r"^[^ ]*/", "", source_info_util.summarize(self.source))
        return f"{self.name} at {summary}" if summary else self.name


def _same(a: Any, b: Any) -> bool:
    """Whether a parameter or literal has the same value at two probes (programs compare as text, NaN equals NaN)."""
    if isinstance(a, jex.ClosedJaxpr | jex.Jaxpr) or isinstance(b, jex.ClosedJaxpr | jex.Jaxpr):
        return str(a) == str(b)
    if isinstance(a, float | np.floating | np.ndarray) and isinstance(b, float | np.floating | np.ndarray):
        return np.shape(a) == np.shape(b) and bool(np.array_equal(a, b, equal_nan=True))
    try:
        return bool(a == b)
    except Exception:  # values without a bool comparison
        return a is b


class _Flat:
    """One probe's program, with nested calls inlined: variables, constants and equations in order."""

    def __init__(self) -> None:
        self.avals: list[Any] = []
        self.constants: dict[int, Any] = {}
        self.eqns: list[tuple[jex.Primitive, list[Atom | Any], list[int], dict[str, Any], Any]] = []

    def variable(self, aval: Any) -> int:
        self.avals.append(aval)
        return len(self.avals) - 1

    def inline(self, jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = self.variable(var.aval)
            self.constants[env[var]] = value
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(var: Any) -> Any:
            return var if isinstance(var, jex.Literal) else env[var]

        for eqn in jaxpr.eqns:
            inputs = [read(var) for var in eqn.invars]
            body = _body(eqn)
            if body is not None:
                outputs = self.inline(body[0], body[1], inputs)
            else:
                outputs = [self.variable(var.aval) for var in eqn.outvars]
                self.eqns.append((eqn.primitive, inputs, outputs, dict(eqn.params), eqn.source_info))
            for var, output in zip(eqn.outvars, outputs, strict=True):
                if not isinstance(var, jex.DropVar):
                    env[var] = output
        return [read(var) for var in jaxpr.outvars]


def _body(eqn: Any) -> tuple[jex.Jaxpr, Sequence[Any]] | None:
    """The called program of a nested call that is inlined (not the Masksembles layer's named jit)."""
    if eqn.primitive.name not in INLINED or is_masking(eqn.primitive.name, eqn.params):
        return None
    for key in ("jaxpr", "call_jaxpr"):
        body = eqn.params.get(key)
        if isinstance(body, jex.ClosedJaxpr):
            return body.jaxpr, body.consts
        if isinstance(body, jex.Jaxpr):
            return body, ()
    return None


def is_masking(primitive: str, params: dict[str, Any]) -> bool:
    """Whether an equation is the NNX Masksembles layer's grouped masking (a jit named by ``grouped_masking``)."""
    return primitive in ("jit", "pjit") and str(params.get("name", "")).startswith(GROUPED_MASKING)


def masking_axis(params: dict[str, Any]) -> int:
    return int(str(params["name"])[len(GROUPED_MASKING) :])


@dataclass(eq=False)
class Program:
    """The model's flat program over its state leaves and input, as traced at the three probe batch sizes."""

    values: list[Value]
    eqns: list[Eqn]
    input: int
    outputs: list[Atom]
    out_tree: Any
    constants: dict[int, Any]  # state leaves and closed-over constants: their value
    batch: int  # the first probe batch size


class DifferentPrograms(ValueError):
    """The model runs different operations at two probe batch sizes."""


def trace(model: nnx.Module, example: Any) -> Program:
    """The flat program of ``model`` in eval mode on inputs shaped like ``example`` (batch on axis 0), traced from
    the example's batch size (from 2 where a batch of 1 runs other operations than a batch of 2)."""
    shape, dtype = tuple(example.shape), example.dtype
    if len(shape) < 1 or shape[0] < 1:
        raise ValueError(f"{PREFIX} need an example input with a batch of at least 1 on axis 0; received {shape}")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"{PREFIX} need an nnx.Module; received {type(model).__name__}")
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)  # a new module graph on the same arrays: eval mode leaves the model alone
    copy.eval()  # type: ignore[no-untyped-call]
    graphdef, state = nnx.split(copy)
    leaves, treedef = jax.tree.flatten(state)
    streams = {id(leaf) for leaf in jax.tree.leaves(nnx.state(copy, nnx.RngState))}
    random = [position for position, leaf in enumerate(leaves) if id(leaf) in streams]  # its RNG keys and counts

    def call(leaves: list[Any], x: jax.Array) -> Any:
        with batch_size(x.shape[0]):  # as predict runs it: the layers decide and check their samples' axis
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(x)

    def probed(start: int) -> Program:
        flats, out_trees = [], []
        for extra in range(PROBES):
            batch = jax.ShapeDtypeStruct((start + extra, *shape[1:]), dtype)  # type: ignore[no-untyped-call]
            try:
                closed, out_shape = jax.make_jaxpr(call, return_shape=True)(leaves, batch)
            except Exception as error:  # JAX raises many types for Python that cannot be traced
                raise ValueError(
                    f"{PREFIX} need a model JAX can trace in eval mode (no Python control flow on array values, e.g. "
                    f"`if x.sum() > 0`); tracing {type(model).__name__} failed: {type(error).__name__}: {error}"
                ) from error
            _check_draws_nothing(closed.jaxpr, random, type(model).__name__)
            flat = _Flat()
            args = [flat.variable(var.aval) for var in closed.jaxpr.invars]
            for position, leaf in enumerate(leaves):
                flat.constants[args[position]] = leaf
            outputs = flat.inline(closed.jaxpr, closed.consts, args)
            flats.append((flat, outputs))
            out_trees.append(jax.tree.structure(out_shape))
        return _merge(flats, out_trees, len(leaves), start, type(model).__name__)

    try:
        return probed(shape[0])
    except DifferentPrograms:
        if shape[0] != 1:
            raise
        # JAX simplifies some operations away at batch 1 (a broadcast of a class token to the batch is then a
        # no-op): the program is traced from batch 2, and verification checks it at the example's batch of 1
        return probed(2)


RANDOM_DRAWS = frozenset({"random_bits", "threefry2x32"})  # the primitives that turn a key into random numbers


def _draws_random_bits(jaxpr: jex.Jaxpr) -> bool:
    """Whether ``jaxpr`` or any program inside it (a scan's body, a jit's, a cond's branches) draws random bits."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in RANDOM_DRAWS:
            return True
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                inner = item.jaxpr if isinstance(item, jex.ClosedJaxpr) else item
                if isinstance(inner, jex.Jaxpr) and _draws_random_bits(inner):
                    return True
    return False


def _check_draws_nothing(jaxpr: jex.Jaxpr, streams: Sequence[int], name: str) -> None:
    """The program of a model in eval mode draws no random bits from its RNG streams (the invariables at
    ``streams``): one that does draws other random numbers at every call, and no program equals ``predict``. A
    stream only carried through (``nnx.scan`` over layers passes every layer's state, its RNG streams included,
    through the scan) draws nothing."""
    read = {var for eqn in jaxpr.eqns for var in eqn.invars if isinstance(var, jex.Var)}
    if any(jaxpr.invars[position] in read for position in streams) and _draws_random_bits(jaxpr):
        raise ValueError(
            f"{PREFIX} need a model that computes the same outputs for the same input in eval mode; {name} reads an "
            "RNG stream (nnx.Rngs) in eval mode: it draws random numbers at every call (noise outside training). "
            "Pass that randomness in as an input of the model, or make it fixed in eval mode, then pack"
        )


def _merge(flats: list[tuple[_Flat, list[Any]]], out_trees: list[Any], leaves: int, batch: int, name: str) -> Program:
    """One program from the probes' (the same equations, shapes and parameters per probe)."""
    first, outputs = flats[0]

    def signature(flat: _Flat, outputs: list[Any]) -> Any:
        def atom(a: Any) -> Any:
            return ("literal", str(cast(Any, a.aval).dtype)) if isinstance(a, jex.Literal) else a

        eqns = [(p.name, tuple(map(atom, i)), tuple(o), tuple(sorted(params))) for p, i, o, params, _ in flat.eqns]
        return len(flat.avals), sorted(flat.constants), eqns, [atom(o) for o in outputs]

    reference = signature(first, outputs)
    for probe, ((flat, outs), tree) in enumerate(zip(flats[1:], out_trees[1:], strict=True), start=1):
        if signature(flat, outs) != reference or tree != out_trees[0]:
            raise DifferentPrograms(
                f"{PREFIX}: {name} runs different operations at batch sizes {batch} and {batch + probe}; packing "
                "needs one program for every batch size (e.g. a Masksembles layer on a sequence-first (L, B, C) "
                "input that declares no batch_axis reads axis 0 at a batch B that divides L: declare it, as insert "
                "and convert_dropout do from an example input)"
            )
    avals: list[list[Any]] = [flat.avals for flat, _ in flats]
    values = [
        Value(tuple(tuple(int(d) for d in probe[i].shape) for probe in avals), batch, dtype=avals[0][i].dtype)
        for i in range(len(first.avals))
    ]

    def literal(atoms: Sequence[Any]) -> Atom:
        if isinstance(atoms[0], jex.Literal):
            return Literal(tuple(np.asarray(a.val, dtype=a.aval.dtype) for a in atoms))
        return cast(int, atoms[0])

    eqns = []
    for index, probes in enumerate(zip(*(flat.eqns for flat, _ in flats), strict=True)):
        primitive, _, outs, _, source = probes[0]
        inputs = tuple(literal(atoms) for atoms in zip(*(p[1] for p in probes), strict=True))
        eqns.append(Eqn(index, primitive, inputs, tuple(outs), tuple(p[3] for p in probes), source))
    for var in first.constants:
        if var >= leaves and values[var].batch_axes:
            raise ValueError(
                f"{PREFIX}: {name} holds a constant of shape {values[var].shape} that follows the batch size, computed "
                "outside JAX (e.g. with NumPy from x.shape); compute it with jax.numpy so that it can be rebuilt for "
                "any batch"
            )
    program_outputs = [literal(atoms) for atoms in zip(*(outs for _, outs in flats), strict=True)]
    return Program(values, eqns, leaves, program_outputs, out_trees[0], dict(first.constants), batch)


# ------------------------------------------------------------------------------------------------ what reads the input


@dataclass(eq=False)
class Analysis:
    """The program's equations that run on every call (those that read the input, or that follow the batch size),
    and the constants they read, evaluated once at the first probe batch size."""

    program: Program
    runtime: set[int]  # variables computed at run time
    eqns: list[Eqn]  # the run-time equations, in order, dead ones removed
    constants: dict[int, jax.Array]  # constant operands of the run-time equations: their value at batch B
    reduced: dict[int, jax.Array]  # the same, with the axes that follow the batch cut to size 1 (they are uniform)


def analyse(program: Program) -> Analysis:
    """Fold what only reads the state; keep what reads the input or the batch size (a constant that follows the batch
    and is not the same for every sample, e.g. an ``iota`` over the batch, is recomputed at run time)."""
    used = _live(program)
    eqns = [eqn for eqn in program.eqns if eqn.index in used]
    reads_input = _forward({program.input}, eqns)
    sized = {v for eqn in eqns for v in eqn.outputs if program.values[v].batch_axes} - reads_input
    candidates = _forward(reads_input | sized, eqns)
    wanted = sorted({a for eqn in eqns if set(_vars(eqn)) & candidates for a in _vars(eqn)} - reads_input | sized)
    folded = _evaluate_constants(program, [e for e in eqns if not set(e.outputs) & reads_input], wanted)
    runtime = set(reads_input)
    for var in sorted(sized):
        axis = program.values[var].batch_axis
        if axis < 0 or not _uniform(folded[var], axis):
            runtime.add(var)
    runtime = _forward(runtime, eqns)
    live = [eqn for eqn in eqns if set(eqn.outputs) & runtime]
    needed = {a for eqn in live for a in _vars(eqn) if a not in runtime}
    constants = {var: folded[var] if var in folded else program.constants[var] for var in needed}
    reduced = {}
    for var, array in constants.items():
        axis = program.values[var].batch_axis
        reduced[var] = array[(slice(None),) * axis + (slice(0, 1),)] if axis >= 0 else array
    return Analysis(program, runtime, live, constants, reduced)


def _vars(eqn: Eqn) -> list[int]:
    return [a for a in eqn.inputs if isinstance(a, int)]


def _live(program: Program) -> set[int]:
    """The equations the outputs depend on."""
    needed = {a for a in program.outputs if isinstance(a, int)}
    live: set[int] = set()
    for eqn in reversed(program.eqns):
        if set(eqn.outputs) & needed:
            live.add(eqn.index)
            needed.update(_vars(eqn))
    return live


def _forward(start: set[int], eqns: Sequence[Eqn]) -> set[int]:
    """``start`` and every variable computed from it."""
    reached = set(start)
    for eqn in eqns:
        if set(_vars(eqn)) & reached:
            reached.update(eqn.outputs)
    return reached


def _uniform(value: jax.Array, axis: int) -> bool:
    array = np.asarray(value)
    return bool((array == array.take([0], axis=axis)).all())


def _evaluate_constants(program: Program, eqns: Sequence[Eqn], wanted: Sequence[int]) -> dict[int, jax.Array]:
    """The values of ``wanted`` (state leaves, closed-over constants, equations of them), at batch B, in one jit."""
    sources = sorted(program.constants)

    def run(values: list[Any]) -> list[Any]:
        env = dict(zip(sources, values, strict=True))
        for eqn in eqns:
            env.update(zip(eqn.outputs, bind(eqn, [read(env, a) for a in eqn.inputs]), strict=True))
        return [env[var] for var in wanted]

    results = evaluate_once(run, [program.constants[var] for var in sources])
    return dict(zip(wanted, results, strict=True))


def evaluate_once(function: Callable[[list[Any]], list[Any]], args: list[Any]) -> list[Any]:
    """``function(args)`` compiled by XLA without its backend optimizations: it runs once, at pack time, and compiles
    in about half the time."""
    compiled = jax.jit(function).lower(args).compile({"xla_backend_optimization_level": "0"})
    return cast(list[Any], compiled(args))


def read(env: dict[int, Any], atom: Atom) -> Any:
    return atom.values[0] if isinstance(atom, Literal) else env[atom]


def bind(eqn: Eqn, args: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """Run one equation (first probe's parameters unless given); always a list of outputs."""
    result = eqn.primitive.bind(*args, **(eqn.params[0] if params is None else params))  # type: ignore[no-untyped-call]
    return list(result) if eqn.primitive.multiple_results else [result]


# ------------------------------------------------------------------------------------------------ classification


@dataclass(eq=False)
class Op(CapturedOp[int]):
    """A run-time variable as the core sees it (``key``: the variable), with the equation that computes it."""

    eqn: Eqn = field(kw_only=True)
    mapping: str = ""  # map rule: "evaluate" (index tensors) or "params" (reductions, windows, cumulative)
    weight: int = -1  # mixing/grouped: the constant operand

    @property
    def var(self) -> int:
        return self.key


class Capture:
    """The program, which of its variables run per call, and the core kind of each."""

    def __init__(self, model: nnx.Module, example: Any) -> None:
        self.program = trace(model, example)
        self.analysis = analyse(self.program)
        self.values = self.program.values
        self.input = self.program.input
        self.runtime = self.analysis.runtime
        self.ops: dict[int, Op] = {}
        for eqn in self.analysis.eqns:
            for var in eqn.outputs:
                self.ops[var] = self._classify(eqn, var)
        counts = sorted(self._mask_counts())
        if not counts:
            raise ValueError(f"{PREFIX}: the model has no Masksembles layer (none is called on the input)")
        if len(counts) != 1:
            raise ValueError(f"{PREFIX}: every Masksembles layer needs the same n; found {counts}")
        self.n = counts[0]
        self.answers = Answers(self)

    def _mask_counts(self) -> set[int]:
        """The n of every Masksembles layer the model calls, in sub-programs (a scanned layer stack) too."""
        counts = set()
        for op in self.ops.values():
            if is_masking(op.eqn.name, op.eqn.params[0]):
                counts.add(self.values[cast(int, op.eqn.inputs[1])].shape[0])
            for sub in jex.jaxprs_in_params(op.eqn.params[0]):
                counts |= masking_counts(sub)
        return counts

    def tensors(self, eqn: Eqn) -> list[int]:
        return list(dict.fromkeys(a for a in _vars(eqn) if a in self.runtime))

    def _fallback(self, eqn: Eqn, var: int) -> Op:
        """Run as the dense model runs it (whether per member is decided once the axes are: ``batch_dependent``)."""
        return Op(var, "fallback", self.tensors(eqn), rule="none", eqn=eqn)

    # what the core's pipeline asks (``masksembles_core.captured.CapturedGraph``)

    @property
    def output(self) -> None:
        return None  # the program's outputs are always gathered by the core's OUTPUT node

    @property
    def output_leaves(self) -> list[int]:
        return [a for a in self.program.outputs if a in self.runtime]

    def probed(self, key: int) -> Value:
        return self.values[key]

    def name(self, key: int) -> str:
        return node_name(key)

    def fallback(self, key: int) -> Op:
        return self._fallback(self.ops[key].eqn, key)

    def axis_map(self, op: Op, source_axis: int) -> int | None:
        return self.answers.mapped_axis(op, source_axis) if op.mapping == "evaluate" else _param_map(op)(source_axis)

    def zero_map(self, op: Op) -> np.ndarray:
        return self.answers.zero_map(op)

    def zero_rule(self, op: Op) -> tuple[str, tuple[int, ...]]:
        """Zero when one operand is (products), or when its value operands are, if evaluating it on zero values
        (every value of its boolean operands) gave 0 everywhere; else never known zero."""
        booleans = [i for i, t in enumerate(op.tensors) if self.values[t].dtype == np.bool_]
        numbers = [i for i in range(len(op.tensors)) if i not in booleans]
        constants = any(not (isinstance(a, int) and a in self.runtime) for a in op.eqn.inputs)
        if op.eqn.name in PRODUCTS and not constants:
            return "any", ()
        if self.answers.all_zero(op):
            return "all", tuple(numbers) if numbers and booleans else ()
        return "never", ()

    def repeatable(self, key: int) -> bool:
        return array_repeatable(self.values[key])

    def batch_dependent(self, op: Op) -> bool:
        """Whether a fallback must run on the member-stacked batch even when what it reads is shared: unless it
        provably treats every sample on its own (the dense model's result is then the shared one repeated), it
        may mix samples or read the batch size, which the member-stacked batch has m times."""
        eqn, out = op.eqn, self.values[op.var]
        name, params = eqn.name, eqn.params[0]
        batch = [self.values[t].batch_axis for t in op.tensors]
        literals = all(all(_same(a.values[0], v) for v in a.values[1:]) for a in eqn.inputs if isinstance(a, Literal))
        if not op.tensors or is_masking(name, params) or out.batch_axis < 0 or min(batch) < 0 or not literals:
            return True
        if eqn.varying - set(SHAPE_PARAMS.get(name, ())):
            return True
        if name in ELEMENTWISE or (name == "concatenate" and int(params["dimension"]) not in batch):
            return set(batch) != {out.batch_axis}
        if name in REDUCTIONS | WINDOWS | CUMULATIVE:
            return _param_map(op)(batch[0]) != out.batch_axis
        if name in MOVES and len(op.tensors) == 1:
            return self.answers.mapped_axis(op, batch[0]) != out.batch_axis
        if name == "conv_general_dilated":
            numbers = params["dimension_numbers"]
            return op.tensors != [eqn.inputs[0]] or (batch[0], out.batch_axis) != (
                numbers.lhs_spec[0],
                numbers.out_spec[0],
            )
        if name == "dot_general":
            ranks = [self.values[a].rank if isinstance(a, int) else 0 for a in eqn.inputs]
            return _dot_batch_axis(eqn, dict(zip(op.tensors, batch, strict=True)), ranks) != out.batch_axis
        return True

    def per_sample(self) -> bool:
        """Whether every output sample is computed from that sample alone, whatever else the batch holds: every
        run-time value has one axis of exactly the batch size or none; no value without one is made from one with one
        (a reduction over the batch), none with one from none (an ``iota`` over the batch); every operation but a
        Masksembles layer (which masks each sample by its member) keeps samples apart (``batch_dependent``); and every
        output leaf has the batch on axis 0."""
        if any(self.values[var].batch_axes and self.values[var].batch_axis < 0 for var in self.runtime):
            return False
        for op in self.ops.values():
            if is_masking(op.eqn.name, op.eqn.params[0]):
                continue
            reads = [self.values[t].batch_axis >= 0 for t in op.tensors]
            if self.values[op.var].batch_axis < 0:
                if any(reads):
                    return False
            elif not any(reads) or self.batch_dependent(op):
                return False
        outputs = self.program.outputs
        return all(isinstance(a, int) and a in self.runtime and self.values[a].batch_axis == 0 for a in outputs)

    def _classify(self, eqn: Eqn, var: int) -> Op:
        tensors = self.tensors(eqn)
        name, params = eqn.name, eqn.params[0]
        if not tensors or len(eqn.outputs) != 1:
            return self._fallback(eqn, var)
        if is_masking(name, params):
            op = self._masks(eqn, var, tensors)
        elif name == "dot_general":
            op = self._dot(eqn, var, tensors)
        elif name == "conv_general_dilated":
            op = self._conv(eqn, var, tensors)
        elif not self._batch_free(eqn, name):
            op = None
        elif name in ELEMENTWISE:
            op = Op(var, "channelwise" if len(tensors) == 1 else "combine", tensors, eqn=eqn)
        elif name in REDUCTIONS | WINDOWS | CUMULATIVE and len(tensors) == 1:
            op = Op(var, "channelwise", tensors, rule="map", mapping="params", eqn=eqn)
        elif name == "reshape" and self._flatten(eqn, tensors[0], var):
            op = Op(var, "flatten", tensors, rule="flatten", eqn=eqn)
        elif name in MOVES and len(tensors) == 1:
            op = Op(var, "channelwise", tensors, rule="map", mapping="evaluate", eqn=eqn)
        elif name == "concatenate" and len(tensors) == len(eqn.inputs):
            op = Op(var, "concat", tensors, rule="concat", concat_dim=int(params["dimension"]), eqn=eqn)
        else:
            op = None
        if op is not None and op.kind in ("channelwise", "combine") and not self._operands_align(eqn, var):
            op = None
        return op if op is not None else self._fallback(eqn, var)

    def _batch_free(self, eqn: Eqn, name: str) -> bool:
        """Whether only the shape parameters a compacted move recomputes follow the batch size (and no literal)."""
        if eqn.varying - set(SHAPE_PARAMS.get(name, ())):
            return False
        return all(all(_same(a.values[0], v) for v in a.values[1:]) for a in eqn.inputs if isinstance(a, Literal))

    def _operands_align(self, eqn: Eqn, var: int) -> bool:
        """Constant operands of an elementwise operation or a move: scalars, or of the output's rank (their axes are
        the output's, so their channels can be laid out like it)."""
        rank = self.values[var].rank
        return all(isinstance(a, Literal) or a in self.runtime or self.values[a].rank in (0, rank) for a in eqn.inputs)

    def _constant(self, atom: Atom) -> bool:
        """An operand computed from the state alone (a weight), not a literal."""
        return isinstance(atom, int) and atom not in self.runtime

    def _masks(self, eqn: Eqn, var: int, tensors: list[int]) -> Op | None:
        x, masks = eqn.inputs
        if not self._constant(masks) or tensors != [x]:
            return None
        axis = masking_axis(eqn.params[0])
        values = np.asarray(self.analysis.constants[cast(int, masks)]).astype(bool)
        return Op(var, "masks", tensors, rule="fixed", fixed_in=axis, fixed_out=axis, masks=values, eqn=eqn)

    def _dot(self, eqn: Eqn, var: int, tensors: list[int]) -> Op | None:
        """A product of a model value and a constant over one axis of each, the constant with one other axis."""
        (contracting, batch_dims) = eqn.params[0]["dimension_numbers"]
        if len(tensors) != 1 or any(batch_dims):
            return None
        side = eqn.inputs.index(tensors[0])
        weight = eqn.inputs[1 - side]
        if not self._constant(weight) or self.values[cast(int, weight)].rank != 2 or len(contracting[side]) != 1:
            return None
        fixed_in = int(contracting[side][0])
        # output axes: the left operand's free axes, then the right one's; the weight has one free axis
        fixed_out = self.values[tensors[0]].rank - 1 if side == 0 else 0
        return Op(var, "mixing", tensors, rule="fixed", fixed_in=fixed_in, fixed_out=fixed_out,
                  weight=cast(int, weight), eqn=eqn)  # fmt: skip

    def _conv(self, eqn: Eqn, var: int, tensors: list[int]) -> Op | None:
        params = eqn.params[0]
        weight = eqn.inputs[1]
        if tensors != [eqn.inputs[0]] or not self._constant(weight) or params["batch_group_count"] != 1:
            return None
        numbers = params["dimension_numbers"]
        groups = int(params["feature_group_count"])
        kind = "mixing" if groups == 1 else "grouped"
        return Op(var, kind, tensors, rule="fixed", fixed_in=numbers.lhs_spec[1], fixed_out=numbers.out_spec[1],
                  batch_in=numbers.lhs_spec[0], batch_out=numbers.out_spec[0], weight=cast(int, weight), groups=groups,
                  eqn=eqn)  # fmt: skip

    def _flatten(self, eqn: Eqn, source: int, var: int) -> bool:
        """(B, ..., C) or (B, C, ...) -> (B, features), row-major."""
        seen, out = self.values[source], self.values[var]
        return (
            eqn.params[0].get("dimensions") is None
            and seen.rank > 2
            and seen.batch_axis == 0
            and out.rank == 2
            and out.batch_axis == 0
        )


# ------------------------------------------------------------------------------------------------ evaluations


class Answers:
    """The evaluations the classification asks for, run in one jit at batch B: each run-time elementwise operation,
    move and grouped convolution on zero inputs (+0 and -0; every value of its boolean operands for a combine), and
    each move on index tensors."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        questions: list[tuple[Eqn, dict[int, Callable[[], jax.Array]], bool]] = []  # (equation, inputs, indices)
        self.zero_questions: dict[int, list[int]] = {}  # var -> its questions (all must be zero)
        self.index_questions: dict[tuple[int, int], int] = {}  # (var, source axis) -> question
        for var, op in capture.ops.items():
            if op.kind in ("channelwise", "grouped", "combine", "concat"):  # a concatenation may become a combine
                self.zero_questions[var] = []
                for assignment in self._zero_inputs(op):
                    self.zero_questions[var].append(len(questions))
                    questions.append((op.eqn, assignment, False))
            if op.eqn.name in MOVES and len(op.tensors) == 1:  # also asked when it falls back: does it keep samples
                source = capture.values[op.tensors[0]]
                for axis in range(source.rank):
                    self.index_questions[(var, axis)] = len(questions)
                    questions.append((op.eqn, {op.tensors[0]: _ids(source.shape, axis)}, True))
        self.results = self._run(questions) if questions else []

    def _zero_inputs(self, op: Op) -> Iterator[dict[int, Callable[[], jax.Array]]]:
        """Zero (+0, then -0) for the value operands; both values of the boolean ones (at most two of them)."""
        values = self.capture.values
        booleans = [t for t in op.tensors if values[t].dtype == np.bool_]
        numbers = [t for t in op.tensors if t not in booleans] or booleans
        selectors = [t for t in booleans if t not in numbers][:2]
        signs = (0.0, -0.0) if any(np.issubdtype(values[t].dtype, np.floating) for t in numbers) else (0.0,)
        for sign in signs:
            for choice in range(2 ** len(selectors)):
                assignment = {t: _full(values[t], sign) for t in numbers}
                for bit, t in enumerate(selectors):
                    assignment[t] = _full(values[t], bool(choice >> bit & 1))
                yield assignment

    def _run(self, questions: list[tuple[Eqn, dict[int, Callable[[], jax.Array]], bool]]) -> list[np.ndarray]:
        analysis = self.capture.analysis
        sources = sorted(analysis.constants)
        runtime = self.capture.runtime

        def operand(atom: Atom, given: dict[int, Callable[[], jax.Array]], index: bool, env: dict[int, Any]) -> Any:
            if isinstance(atom, int) and atom in given:
                return given[atom]()
            if index:  # a move on index tensors: every other array operand is a NaN sentinel
                shape = () if isinstance(atom, Literal) else self.capture.values[atom].shape
                return jnp.full(shape, np.nan, jnp.float32)
            if isinstance(atom, Literal):
                return atom.values[0]
            assert atom not in runtime, "a run-time operand that is not given"
            return env[atom]

        def run(constants: list[Any]) -> list[Any]:
            env = dict(zip(sources, constants, strict=True))
            results = []
            for eqn, given, index in questions:
                (output,) = bind(eqn, [operand(a, given, index, env) for a in eqn.inputs])
                results.append(output if index else output == 0)
            return results

        return [np.asarray(r) for r in evaluate_once(run, [analysis.constants[var] for var in sources])]

    def zero_map(self, op: Op) -> np.ndarray:
        """Per output channel (``op.axis``), whether every evaluation on zero inputs gave 0 there."""
        zero = np.ones(self.capture.values[op.var].shape[op.axis], dtype=bool)
        for question in self.zero_questions[op.var]:
            zero &= captured.zero_channels(self.results[question], op.axis)
        return zero

    def all_zero(self, op: Op) -> bool:
        return all(bool(self.results[q].all()) for q in self.zero_questions[op.var])

    def mapped_axis(self, op: Op, axis: int) -> int | None:
        """The output axis that holds, whole and in order, the indices the input held on ``axis``."""
        return _whole_axis(self.results[self.index_questions[(op.var, axis)]], self.capture.values[op.tensors[0]], axis)


def _full(value: Value, fill: float | bool) -> Callable[[], jax.Array]:
    return lambda: _opaque(jnp.full(value.shape, fill, value.dtype))


def _ids(shape: tuple[int, ...], axis: int) -> Callable[[], jax.Array]:
    """Each position's index along ``axis``, as float32 (exact for any realistic size)."""
    return lambda: _opaque(jax.lax.broadcasted_iota(jnp.float32, shape, axis))


def _opaque(value: jax.Array) -> jax.Array:
    """``value`` behind an optimization barrier: XLA would otherwise fold the question's equation on it at compile
    time (a pool over a constant feature map took seconds and printed "Constant folding ... taking > 1s")."""
    return cast(jax.Array, jax.lax.optimization_barrier(value))  # type: ignore[no-untyped-call]


def _whole_axis(out: np.ndarray, source: Value, axis: int) -> int | None:
    """The axis of ``out`` holding 0..n-1 in order (n the source's size on ``axis``), the same along every other
    axis wherever ``out`` is not a NaN sentinel (a constant operand's position)."""
    size = source.shape[axis]
    found = [a for a in range(out.ndim) if out.shape[a] == size]
    for a in found:
        view = [1] * out.ndim
        view[a] = size
        expected = np.broadcast_to(np.arange(size, dtype=np.float32).reshape(view), out.shape)
        model = ~np.isnan(out)
        if model.any() and np.array_equal(out[model], expected[model]):
            holds = model.any(axis=tuple(b for b in range(out.ndim) if b != a))
            if holds.all():  # every index reaches the output
                return a
    return None


# ------------------------------------------------------------------------------------------------ channel axes


def _dot_batch_axis(eqn: Eqn, batch: dict[int, int], ranks: list[int]) -> int | None:
    """Where a ``dot_general`` puts the batch of its run-time operands (``batch``: each one's batch axis), if every
    output sample reads only its own samples: a batch axis is a batch dimension of both operands at the same
    position, or a free axis of one operand while the other is a constant. None otherwise."""
    (contracting, batch_dims) = eqn.params[0]["dimension_numbers"]
    found = set()
    for side, atom in enumerate(eqn.inputs):
        if not isinstance(atom, int) or atom not in batch:
            continue
        axis = batch[atom]
        dims = [int(d) for d in batch_dims[side]]
        if axis in [int(d) for d in contracting[side]]:
            return None
        if axis in dims:
            other = eqn.inputs[1 - side]
            if not isinstance(other, int) or batch.get(other) != int(batch_dims[1 - side][dims.index(axis)]):
                return None
            found.add(dims.index(axis))
            continue
        if len(batch) > 1:
            return None  # a free batch axis on both sides: every sample meets every other
        free = [a for a in range(ranks[side]) if a not in dims and a not in [int(d) for d in contracting[side]]]
        before = 0 if side == 0 else ranks[0] - len(contracting[0]) - len(batch_dims[0])
        found.add(len(dims) + before + free.index(axis))
    return found.pop() if len(found) == 1 else None


def _param_map(op: Op) -> Callable[[int], int | None]:
    """Axis maps of reductions (``axes``), pools (a window of 1 on the axis) and cumulative operations (``axis``)."""
    params = op.eqn.params[0]
    if op.eqn.name in REDUCTIONS:
        axes = [int(a) for a in params["axes"]]
        return lambda a: None if a in axes else a - sum(b < a for b in axes)
    if op.eqn.name in WINDOWS:
        keys = ("window_dimensions", "window_strides", "base_dilation", "window_dilation")

        def window(a: int) -> int | None:
            untouched = all(int(params[key][a]) == 1 for key in keys) and tuple(params["padding"][a]) == (0, 0)
            return a if untouched else None

        return window
    along = int(params["axis"])
    return lambda a: None if a == along else a


# ------------------------------------------------------------------------------------------------ the core graph


def node_name(var: int) -> str:
    return f"v{var}"


def solve_axes(capture: Capture) -> dict[int, int]:
    """The core's channel axes (``masksembles_core.captured.solve_axes``), then which fallbacks read the batch."""
    axis = captured.solve_axes(capture)
    for op in capture.ops.values():
        op.batch_dependent = op.kind == "fallback" and capture.batch_dependent(op)
    return axis


def graph_nodes(capture: Capture, axis: dict[int, int]) -> list[GraphNode]:
    """The core's view of the program; the last node, ``OUTPUT``, reads every output on the member-stacked batch."""
    nodes, _ = captured.graph_nodes(capture, axis)
    return nodes


def fallbacks(capture: Capture, names: Sequence[str]) -> tuple[str, ...]:
    """The fallback nodes, described by primitive and where the model calls it (each place once)."""
    by_name = {node_name(var): op for var, op in capture.ops.items()}
    return tuple(dict.fromkeys(by_name[name].eqn.describe() for name in names if name != OUTPUT))


@dataclass(frozen=True)
class Affine:
    """A parameter or literal that follows the batch size: ``value + slope * (batch - start)``."""

    value: Any
    slope: Any
    start: int

    def at(self, batch: int) -> Any:
        return self.value + self.slope * (batch - self.start)


class NotAffine(Exception):
    """A parameter that changes with the batch size in a way packing cannot rebuild."""


def template(values: Sequence[Any], start: int) -> Any:
    """``values`` at the probe batch sizes start, start+1, ... as a function of the batch: a constant, an ``Affine``,
    or a tuple/list/named tuple of them (``instantiate`` evaluates it)."""
    first = values[0]
    masking = isinstance(first, jex.ClosedJaxpr) and has_masking(first.jaxpr)
    if all(_same(first, v) for v in values[1:]) and not masking:
        return _Constant(first)
    if isinstance(first, tuple | list) and all(type(v) is type(first) and len(v) == len(first) for v in values):
        items = [template([v[i] for v in values], start) for i in range(len(first))]
        return _Sequence(type(first), tuple(items))
    if all(isinstance(v, jex.ClosedJaxpr) for v in values):
        return _JaxprTemplate([(v.jaxpr, v.consts) for v in values], start)
    if all(isinstance(v, int | float | np.number | np.ndarray) and np.ndim(v) == 0 for v in values):
        numbers = [np.asarray(v) for v in values]
        slope = numbers[1] - numbers[0]
        predicted = [numbers[0] + slope * i for i in range(len(numbers))]
        if all(np.array_equal(p, n) for p, n in zip(predicted, numbers, strict=True)):
            if isinstance(first, int | np.integer):
                return Affine(int(first), int(slope), start)
            return Affine(numbers[0], slope, start)
        raise NotAffine(f"{[n.item() for n in numbers]} at batch sizes {start}, {start + 1}, ...")
    raise NotAffine(f"{type(first).__name__} values that differ")


def has_masking(jaxpr: jex.Jaxpr) -> bool:
    """Whether a (sub-)program calls a Masksembles layer, at any depth."""
    return bool(masking_counts(jaxpr))


def masking_counts(jaxpr: jex.Jaxpr) -> set[int]:
    """The n of every Masksembles layer a (sub-)program calls, at any depth."""
    counts = set()
    for eqn in jaxpr.eqns:
        if is_masking(eqn.primitive.name, eqn.params):
            counts.add(int(cast(Any, eqn.invars[1].aval).shape[0]))
        for sub in jex.jaxprs_in_params(eqn.params):
            counts |= masking_counts(sub)
    return counts


class _JaxprTemplate:
    """A sub-program parameter (the body of a ``scan``, ``while_loop`` or ``cond``) whose shapes follow the batch, or
    that calls a Masksembles layer: rebuilt for a batch size and members by tracing the first probe's equations with
    their parameters at that size, nested calls inlined, each Masksembles layer on the members' masks (the members'
    copies of the batch one after the other, as the member-stacked batch holds them)."""

    def __init__(self, probes: Sequence[tuple[jex.Jaxpr, Sequence[Any]]], start: int) -> None:
        first, consts = probes[0]
        if any(len(j.eqns) != len(first.eqns) or len(j.invars) != len(first.invars) for j, _ in probes):
            raise NotAffine("sub-programs with different operations")
        if any(not all(_same(a, b) for a, b in zip(consts, c, strict=True)) for _, c in probes):
            raise NotAffine("sub-programs with different constants")
        self.jaxpr, self.consts = first, consts
        shapes = [[tuple(cast(Any, var.aval).shape) for var in j.invars] for j, _ in probes]
        self.inputs = [template([probe[i] for probe in shapes], start) for i in range(len(first.invars))]
        self.eqns: list[tuple[Any, Any, dict[int, Any]]] = []  # (equation, how: template or params, literals)
        for i, eqn in enumerate(first.eqns):
            eqns = [j.eqns[i] for j, _ in probes]
            literals = {
                position: template([cast(jex.Literal, e.invars[position]).val for e in eqns], start)
                for position, var in enumerate(eqn.invars)
                if isinstance(var, jex.Literal)
            }
            if is_masking(eqn.primitive.name, eqn.params):
                self.eqns.append((eqn, None, literals))
            elif _body(eqn) is not None:
                self.eqns.append((eqn, _JaxprTemplate([cast(Any, _body(e)) for e in eqns], start), literals))
            else:
                self.eqns.append((eqn, {key: template([e.params[key] for e in eqns], start) for key in eqn.params},
                                  literals))  # fmt: skip
        self.built: dict[tuple[int, tuple[int, ...]], jex.ClosedJaxpr] = {}

    def at(self, batch: int, members: tuple[int, ...]) -> jex.ClosedJaxpr:
        if (batch, members) not in self.built:
            avals = [
                jax.ShapeDtypeStruct(instantiate(shape, batch, members), cast(Any, var.aval).dtype)  # type: ignore[no-untyped-call]
                for shape, var in zip(self.inputs, self.jaxpr.invars, strict=True)
            ]
            traced = jax.make_jaxpr(lambda *args: self.evaluate(batch, members, args))(*avals)
            self.built[(batch, members)] = traced
        return self.built[(batch, members)]

    def evaluate(self, batch: int, members: tuple[int, ...], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
        env.update(zip(self.jaxpr.invars, args, strict=True))
        for eqn, how, literals in self.eqns:
            inputs = [
                instantiate(literals[i], batch, members) if isinstance(var, jex.Literal) else env[var]
                for i, var in enumerate(eqn.invars)
            ]
            if how is None:  # a Masksembles layer: on the members' masks, in the members' order
                x, masks = inputs
                outputs = [apply_masks(x, masks[np.asarray(members)], channel_axis=masking_axis(eqn.params))]
            elif isinstance(how, _JaxprTemplate):
                outputs = how.evaluate(batch, members, inputs)
            else:
                bound = {key: instantiate(value, batch, members) for key, value in how.items()}
                result = eqn.primitive.bind(*inputs, **bound)
                outputs = result if eqn.primitive.multiple_results else [result]
            env.update(
                (var, out) for var, out in zip(eqn.outvars, outputs, strict=True) if not isinstance(var, jex.DropVar)
            )
        return [var.val if isinstance(var, jex.Literal) else env[var] for var in self.jaxpr.outvars]


@dataclass(frozen=True)
class _Constant:
    value: Any


@dataclass(frozen=True)
class _Sequence:
    kind: type
    items: tuple[Any, ...]


def instantiate(value: Any, batch: int, members: tuple[int, ...]) -> Any:
    """A ``template`` at ``batch`` (the members: those of the Masksembles layers inside a sub-program)."""
    if isinstance(value, _Constant):
        return value.value
    if isinstance(value, Affine):
        return value.at(batch)
    if isinstance(value, _JaxprTemplate):
        return value.at(batch, members)
    if isinstance(value, _Sequence):
        items = [instantiate(item, batch, members) for item in value.items]
        if value.kind in (tuple, list):
            return value.kind(items)
        return value.kind(*items)
    raise TypeError(f"not a template: {value!r}")
