"""``predict``: every member on every sample, with ``n`` read from (or checked against) the model's layers, compiled
(``jax.jit``) and cached per model structure where the model allows it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx

import masksembles_core.adapter as mca

from ._capture import masking_counts
from ._nnx_layers import Masksembles
from ._ops import predict as predict_members

T = TypeVar("T")

_DYNAMIC = object()  # the place of an array among a functools.partial's bound arguments
_EAGER: set[Hashable] = set()  # the models (graph definitions, partial keys) whose compiled call failed


def predict(model: Callable[[jax.Array], T], x: jax.Array, n: int | None = None) -> T:
    """Every member's output on every sample: ``model(tile(x, n))`` with each output leaf untiled to (n, B, ...).

    ``model`` maps a batch to outputs (an array or a pytree of arrays with the batch on axis 0) and runs its
    Masksembles layers by the grouping rule (mode "grouped", or deterministic). An ``nnx.Module`` runs in inference
    mode (``eval()``: BatchNorm running statistics, Dropout off) on a copy of its graph, whatever mode it was left
    in, so its state is never changed; a linen ``apply`` in a function runs as the function calls it (linen
    variables change only where ``mutable`` returns them).

    Compiled and cached: an ``nnx.Module`` runs as one ``jax.jit`` program per graph structure and input shape (its
    arrays are arguments: a second call, or another model of the same structure, does not trace again), and so does
    a ``functools.partial`` of a function (``functools.partial(module.apply, variables)``, its bound arrays the
    arguments). Any other function is traced once per call to read ``n`` and runs as it is (call ``predict`` inside
    your own ``jax.jit`` to compile it). A model that cannot be compiled (a data-dependent shape) runs eagerly, from
    then on, silently.

    Args:
        n: the number of members; None reads it from the model's Masksembles layers: an ``nnx.Module``'s own layers,
            or, in any other function, the grouped layers (linen and NNX) that one abstract trace of ``model(x)``
            (``jax.make_jaxpr``: nothing is computed) finds.

    Raises:
        ValueError: ``n`` differs from the n of the model's Masksembles layers, the layers have different n, or
            ``n`` is None and no Masksembles layer is found.
    """
    if isinstance(model, nnx.Module):
        members = mca.check_members(
            [layer.n for _, layer in nnx.iter_graph(model) if isinstance(layer, Masksembles)], n
        )
        graphdef, state = nnx.split(model)
        compiled: T = _cached(graphdef, lambda: _nnx_compiled(graphdef, state, x, members),
                       lambda: _nnx_eager(graphdef, state, x, members))  # fmt: skip
        return compiled
    bound = _bound_arrays(model)
    if bound is None:
        result: T = predict_members(
            model, x, mca.check_members(sorted(masking_counts(jax.make_jaxpr(model)(x).jaxpr)), n)
        )
        return result
    key, arrays = bound
    members = mca.check_members(_partial_counts(key, tuple((a.shape, a.dtype) for a in arrays), x.shape, x.dtype), n)
    result = _cached(key, lambda: _partial_compiled(key, arrays, x, members),
                     lambda: predict_members(model, x, members))  # fmt: skip
    return result


def _cached(key: Hashable, compiled: Callable[[], T], eager: Callable[[], T]) -> T:
    """``compiled()``, or ``eager()`` where the model of ``key`` does not compile (remembered) or ``key`` cannot be
    hashed (a static attribute that is not hashable: nothing can be cached for it)."""
    try:
        known_eager = key in _EAGER
    except TypeError:
        return eager()
    if known_eager:
        return eager()
    return mca.compiled_or_eager(compiled, eager, lambda: _EAGER.add(key))


def _nnx_eager(graphdef: nnx.GraphDef[Any], state: Any, x: jax.Array, n: int) -> Any:
    """``predict_members`` on a copy of the module in eval mode (a new graph on the same arrays: ``eval()`` leaves the
    model's mode alone)."""
    model = nnx.merge(graphdef, state)
    model.eval()
    return predict_members(model, x, n)


@functools.partial(jax.jit, static_argnames=("graphdef", "n"))
def _nnx_compiled(graphdef: nnx.GraphDef[Any], state: Any, x: jax.Array, n: int) -> Any:
    """``_nnx_eager`` as one program, traced once per graph definition, ``n`` and argument shapes."""
    return _nnx_eager(graphdef, state, x, n)


def _bound_arrays(model: Callable[..., Any]) -> tuple[Hashable, list[Any]] | None:
    """A ``functools.partial`` as (a hashable key: its function, the structure and non-array values of its bound
    arguments; the arrays among them), or None for any other callable or for unhashable bound values."""
    if not isinstance(model, functools.partial):
        return None
    leaves, treedef = jax.tree.flatten((model.args, model.keywords))
    arrays = [leaf for leaf in leaves if isinstance(leaf, jax.Array | np.ndarray)]
    static = tuple(_DYNAMIC if isinstance(leaf, jax.Array | np.ndarray) else leaf for leaf in leaves)
    key = (model.func, treedef, static)
    try:
        hash(key)
    except TypeError:
        return None
    return key, arrays


def _rebuilt(key: Any, arrays: list[Any]) -> Callable[[jax.Array], Any]:
    """The partial of ``key`` with ``arrays`` in the places of its bound arrays."""
    func, treedef, static = key
    values = iter(arrays)
    args, keywords = jax.tree.unflatten(treedef, [next(values) if leaf is _DYNAMIC else leaf for leaf in static])
    return functools.partial(func, *args, **keywords)


@functools.lru_cache(maxsize=256)
def _partial_counts(key: Any, shapes: tuple[tuple[Any, Any], ...], x_shape: Any, x_dtype: Any) -> tuple[int, ...]:
    """The n of every Masksembles layer the partial of ``key`` calls, from one abstract trace per argument shapes."""
    arrays = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]  # type: ignore[no-untyped-call]
    traced = jax.make_jaxpr(lambda values, batch: _rebuilt(key, values)(batch))(
        arrays,
        jax.ShapeDtypeStruct(x_shape, x_dtype),  # type: ignore[no-untyped-call]
    )
    return tuple(sorted(masking_counts(traced.jaxpr)))


@functools.partial(jax.jit, static_argnames=("key", "n"))
def _partial_compiled(key: Any, arrays: list[Any], x: jax.Array, n: int) -> Any:
    """``predict_members`` of the partial of ``key`` as one program, traced once per key, ``n`` and shapes."""
    return predict_members(_rebuilt(key, arrays), x, n)
