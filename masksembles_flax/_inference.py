"""``predict``: every member on every sample, with ``n`` read from (or checked against) the model's layers, compiled
(``jax.jit``) and cached per model structure where the model allows it."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import jax
import numpy as np
from flax import linen, nnx

import masksembles_core.adapter as mca

from ._capture import masking_counts
from ._nnx_layers import Masksembles
from ._ops import predict as predict_members

T = TypeVar("T")

_DYNAMIC = object()  # the place of an array among a functools.partial's bound arguments


def predict(model: Callable[[jax.Array], T], x: jax.Array, n: int | None = None) -> T:
    """Every member's output on every sample: ``model(tile(x, n))`` with each output leaf untiled to (n, B, ...).

    ``model`` maps a batch to outputs (an array or a pytree of arrays with the batch on axis 0) and runs its
    Masksembles layers by the grouping rule (mode "grouped", or deterministic). An ``nnx.Module`` runs in inference
    mode (``eval()``: BatchNorm running statistics, Dropout off) on a copy of its graph, whatever mode it was left
    in, so its state is never changed; a linen ``apply`` in a function runs as the function calls it (linen
    variables change only where ``mutable`` returns them).

    Compiled and cached: an ``nnx.Module`` runs as one ``jax.jit`` program per graph structure and input shape (its
    arrays are arguments: a second call, or another model of the same structure, does not trace again), and so does
    a ``functools.partial`` of a linen Module's method (``functools.partial(module.apply, variables)``, its bound
    arrays the arguments). The cache is keyed on the graph definition (or the partial's method and non-array bound
    values): a model changed since (a layer swapped, other shapes, another ``n``) gets its own program, and new values
    of the same structure run in the cached one. Any other function, or a partial of one, is traced once per call to
    read ``n`` and runs as it is, not cached (its closure, the globals it reads and the objects it calls can change
    while the function object stays the same: a program cached on it would run stale arrays); call ``predict`` inside
    your own ``jax.jit`` to compile it. A model that cannot be compiled (a data-dependent shape) runs eagerly, from
    then on, silently.

    Args:
        n: the number of members; None reads it from the model's Masksembles layers: an ``nnx.Module``'s own layers,
            or, in any other function, the grouped layers (linen and NNX) that one abstract trace of ``model(x)``
            (``jax.make_jaxpr``: nothing is computed) finds.

    Sequence-first layers: ``x`` holds the samples on axis 0, and a model that takes sequence-first inputs itself (an
    ``nnx.RNN``/``nn.RNN`` with ``time_major=True``) is refused (tiling would repeat the sequence): wrap it to take
    batch-first ones. Inside the model, a Masksembles layer on a sequence-first (L, B, C) value groups along its axis
    1 (its ``batch_axis``, or decided from the tiled batch of n*B), and an output leaf (L, n*B, ...) keeps member
    ``k``'s block at ``[:, k*B:(k+1)*B]``.

    Raises:
        ValueError: ``n`` differs from the n of the model's Masksembles layers, the layers have different n, ``n``
            is None and no Masksembles layer is found, the model takes sequence-first inputs, a layer's declared
            samples' axis does not hold the tiled batch, or an output leaf holds it on both axes 0 and 1 in a model
            that runs a sequence-first layer.
    """
    refuse_sequence_first_inputs(model, "predict")
    if isinstance(model, nnx.Module):
        graphdef, state = nnx.split(model)
        try:
            known = _PROGRAMS.get(graphdef)
        except TypeError:  # a static attribute that cannot be hashed: nothing can be cached for it
            return _nnx_eager(graphdef, state, x, mca.check_members(_nnx_counts(model), n))  # type: ignore[no-any-return]
        program = known or _PROGRAMS.put(graphdef, _nnx_program(model, graphdef))
        compiled: T = program(state, x, n)
        return compiled
    bound = _bound_arrays(model)
    if bound is None:
        return _traced_members(model, x, n)
    key, arrays = bound
    try:
        known = _PROGRAMS.get(key)
    except TypeError:  # a bound value that cannot be hashed: nothing can be cached for it
        return _traced_members(model, x, n)
    program = known or _PROGRAMS.put(key, _partial_program(key))
    result: T = program(arrays, x, n)
    return result


SEQUENCE_FIRST_MODULES = (nnx.RNN, nnx.Bidirectional, linen.RNN, linen.Bidirectional)


def refuse_sequence_first_inputs(model: Callable[..., Any], caller: str) -> None:
    """Raise where ``model`` (or the linen module whose method a ``functools.partial`` binds) is one of Flax's
    recurrent modules with ``time_major=True``: its inputs hold the batch on axis 1, and ``caller`` tiles (and reads)
    the batch on axis 0."""
    method = model.func if isinstance(model, functools.partial) else None
    module = method.__self__ if inspect.ismethod(method) else model
    if isinstance(module, SEQUENCE_FIRST_MODULES) and module.time_major:
        raise ValueError(
            f"{caller} takes inputs with the samples on axis 0, and {type(module).__name__} with time_major=True takes "
            "sequence-first ones, (L, B, ...): tiling them would repeat the sequence, not the batch. Call it through a "
            "module that takes batch-first inputs and transposes them (or build it with time_major=False)"
        )


def _traced_members(model: Callable[[jax.Array], T], x: jax.Array, n: int | None) -> T:
    """``predict_members`` run as it is, ``n`` checked against the layers one abstract trace of ``model(x)`` finds."""
    return predict_members(model, x, mca.check_members(sorted(masking_counts(jax.make_jaxpr(model)(x).jaxpr)), n))


class _Program:
    """One model structure's predict (an NNX graph definition, or a partial's function and static bound values):
    ``function(arrays, x, n)``, which checks ``n`` (None or an int, as the caller passed it) against the n of the
    Masksembles layers it runs and returns the members, called jitted (``n`` static: the check runs once per ``n``
    and argument shapes, while tracing, not on every call), or as it is where the jitted call failed once
    (remembered)."""

    def __init__(self, function: Callable[[Any, jax.Array, int | None], Any]) -> None:
        self.function, self.jitted, self.eager = function, jax.jit(function, static_argnums=2), False

    def __call__(self, arrays: Any, x: jax.Array, n: int | None) -> Any:
        """The members, compiled where the program compiles. A refused ``n`` raises in both calls, and the program
        stays compiled."""
        if self.eager:
            return self.function(arrays, x, n)
        return mca.compiled_or_eager(
            lambda: self.jitted(arrays, x, n), lambda: self.function(arrays, x, n), self._run_eagerly
        )

    def _run_eagerly(self) -> None:
        self.eager = True


class _Programs:
    """The ``_Program`` of each model structure, the ``limit`` last made kept: one lookup a call (the key's hash and
    equality)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.made: dict[Hashable, _Program] = {}

    def get(self, key: Hashable) -> _Program | None:
        return self.made.get(key)

    def put(self, key: Hashable, program: _Program) -> _Program:
        if len(self.made) >= self.limit:
            del self.made[next(iter(self.made))]
        self.made[key] = program
        return program


_PROGRAMS = _Programs(limit=256)


def _nnx_program(model: nnx.Module, graphdef: nnx.GraphDef[Any]) -> _Program:
    """The ``_Program`` of the graph definition of ``model``: ``_nnx_eager`` jitted with the graph definition fixed
    (traced once per ``n`` and argument shapes), ``n`` checked against the module's Masksembles layers, read once
    (``n`` is a static attribute, part of the graph definition: a model of an equal one has the same)."""
    counts = _nnx_counts(model)

    def program(state: Any, x: jax.Array, n: int | None) -> Any:
        return _nnx_eager(graphdef, state, x, mca.check_members(counts, n))

    return _Program(program)


def _nnx_counts(model: nnx.Module) -> tuple[int, ...]:
    """The n of every Masksembles layer of ``model``."""
    return tuple(layer.n for _, layer in nnx.iter_graph(model) if isinstance(layer, Masksembles))


def _nnx_eager(graphdef: nnx.GraphDef[Any], state: Any, x: jax.Array, n: int) -> Any:
    """``predict_members`` on a copy of the module in eval mode (a new graph on the same arrays: ``eval()`` leaves the
    model's mode alone)."""
    model = nnx.merge(graphdef, state)
    model.eval()
    return predict_members(model, x, n)


def _bound_arrays(model: Callable[..., Any]) -> tuple[Hashable, list[Any]] | None:
    """A ``functools.partial`` of a linen Module's method (``module.apply``) as (a key: the method, the structure and
    non-array values of its bound arguments, hashable unless a value is not; the arrays among them), or None for any
    other callable. The key holds the module (a frozen dataclass: another model is another key), as ``jax.jit`` of
    ``module.apply`` does; a partial of any other function is not cached: a function that reads its model from a
    closure or a global keeps its identity when that model is replaced, and a program cached on it would compute the
    old model, silently."""
    if not isinstance(model, functools.partial) or not _linen_method(model.func):
        return None
    leaves, treedef = jax.tree.flatten((model.args, model.keywords))
    arrays: list[Any] = []
    static: list[Any] = []
    for leaf in leaves:  # one pass: this runs on every call
        if isinstance(leaf, jax.Array | np.ndarray):
            arrays.append(leaf)
            static.append(_DYNAMIC)
        else:
            static.append(leaf)
    return (model.func, treedef, tuple(static)), arrays


def _linen_method(function: Callable[..., Any]) -> bool:
    """Whether ``function`` is a method bound to a linen Module."""
    return inspect.ismethod(function) and isinstance(function.__self__, linen.Module)


def _rebuilt(key: Any, arrays: list[Any]) -> Callable[[jax.Array], Any]:
    """The partial of ``key`` with ``arrays`` in the places of its bound arrays."""
    func, treedef, static = key
    values = iter(arrays)
    args, keywords = jax.tree.unflatten(treedef, [next(values) if leaf is _DYNAMIC else leaf for leaf in static])
    return functools.partial(func, *args, **keywords)


def _partial_program(key: Any) -> _Program:
    """The ``_Program`` of the partial of ``key``: ``predict_members`` of it jitted (traced once per ``n`` and argument
    shapes), ``n`` checked against the Masksembles layers that one abstract trace of the partial finds while tracing
    (the bound arrays' and the input's shapes and dtypes are the jitted program's: no per-call signature)."""

    def program(arrays: list[Any], x: jax.Array, n: int | None) -> Any:
        model = _rebuilt(key, arrays)
        abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]  # type: ignore[no-untyped-call]
        traced = jax.make_jaxpr(lambda values, batch: _rebuilt(key, values)(batch))(
            abstract,
            jax.ShapeDtypeStruct(x.shape, x.dtype),  # type: ignore[no-untyped-call]
        )
        return predict_members(model, x, mca.check_members(sorted(masking_counts(traced.jaxpr)), n))

    return _Program(program)
