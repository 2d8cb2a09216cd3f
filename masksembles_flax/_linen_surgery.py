"""linen ``insert`` and ``convert_dropout``: Masksembles in any linen module, without a change to its code.

A linen module's layers exist only while it is called, so both functions return a wrapper module (``Inserted``,
``Converted``) that calls the user's module inside ``nn.intercept_methods``; ``nn.share_scope`` keeps the module's
variables where they were (a checkpoint of the original ``params`` loads as is). At ``init`` the wrapper first
surveys the call (``_survey``: an abstract ``init`` of the module that records every module call, in call order, with
the shape of its input), decides with the rule every framework shares (``masksembles_core.insertion``), then makes
each chosen layer's masks once, as a variable ``masks`` of the ``"masksembles"`` collection in that layer's own scope
(``{"masksembles": {"Block_0": {"Conv_1": {"masks": bool (n, C)}}}}``). Every later ``apply`` masks exactly the
layers whose masks the variables hold: the masks, saved with the variables, are the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import masksembles_core as mc
import masksembles_core.adapter as mca
from masksembles_core.insertion import (
    Candidate,
    LayerChange,
    LayerReport,
    attention_dropout_reason,
    check_insert_arguments,
    plan_conversion,
    plan_insertion,
)

from ._dropout import dropout_reason
from ._insertion import DEPTHWISE, one_more_sample
from ._ops import MASKS_COLLECTION, batch_size_of_call, masked

MASKS = "masks"
LayerFilter = type | tuple[type, ...] | Callable[[str, nn.Module], bool]

DEFAULT_BEFORE: tuple[type[nn.Module], ...] = (nn.Dense, nn.Conv)
INPUT_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose, nn.ConvLocal, nn.Embed, nn.Einsum)
LIFTED = (
    f"inside a lifted transform (nn.scan, nn.vmap, ...) that does not carry the {MASKS_COLLECTION!r} collection: "
    f"add it to the transform's variable_broadcast (masks shared by the stack) or variable_axes"
)


@dataclass(frozen=True)
class _Call:
    """One call of a module during the survey: its path, the module, its first argument's shape (None: not an array)
    and whether the masks collection can be written there."""

    path: str
    module: nn.Module
    shape: tuple[int, ...] | None
    writable: bool


def _dotted(path: Sequence[str]) -> str:
    return "/".join(path)


def _survey(module: nn.Module, rng_names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[_Call]:
    """Every ``__call__`` of a module below ``module`` in an abstract ``init`` on ``args``, in call order."""
    calls: list[_Call] = []

    def record(next_fun: Callable[..., Any], call_args: Any, call_kwargs: Any, context: Any) -> Any:
        called = context.module
        if context.method_name == "__call__" and called.scope is not None and called.path:
            first = call_args[0] if call_args else next(iter(call_kwargs.values()), None)
            shape = tuple(first.shape) if isinstance(first, jax.Array | np.ndarray) else None
            calls.append(_Call(_dotted(called.path), called, shape, called.is_mutable_collection(MASKS_COLLECTION)))
        return next_fun(*call_args, **call_kwargs)

    unbound = module.clone(parent=None, _deep_clone=True)
    rngs = {name: jax.random.key(0) for name in rng_names}
    with nn.intercept_methods(record):
        jax.eval_shape(lambda: unbound.init(rngs, *args, **kwargs))
    return calls


def _first_calls(calls: list[_Call]) -> list[_Call]:
    """Each path's first call, in call order."""
    seen: dict[str, _Call] = {}
    for call in calls:
        seen.setdefault(call.path, call)
    return list(seen.values())


def _generated_masks(channels: int, n: int, scale: float, seed: int | None) -> jax.Array:
    return jnp.asarray(mc.generate_masks(channels, n, scale, seed=seed))


def _masked_call(
    plan: dict[str, LayerChange], n: int, scale: float, replace: bool, batch_axes: dict[str, int]
) -> Callable[..., Any]:
    """The interceptor of ``apply``/``init``: masks the input of (or replaces, ``replace``) each layer holding masks,
    grouping the samples along the layer's axis in ``batch_axes`` (by path; absent: decided in each call).

    At ``init`` (``plan`` not empty) it first makes the masks of the layers ``plan`` names.
    """
    from .linen import Masksembles  # the layer of the user's own code is never a target

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if context.method_name != "__call__" or module.scope is None or isinstance(module, Masksembles):
            return next_fun(*args, **kwargs)
        row = plan.get(_dotted(module.path))
        if row is not None and row.channels is not None and module.is_mutable_collection(MASKS_COLLECTION):
            module.variable(MASKS_COLLECTION, MASKS, _generated_masks, row.channels, n, scale, row.seed)
        if not module.has_variable(MASKS_COLLECTION, MASKS):
            return next_fun(*args, **kwargs)
        masks = module.get_variable(MASKS_COLLECTION, MASKS)
        path = _dotted(module.path)
        # the named jit every Masksembles layer runs: predict(n=None) finds it in a traced program
        x = masked(args[0], masks, channel_axis=-1, batch_axis=batch_axes.get(path), layer=f"Masksembles[{path}]")
        return x if replace else next_fun(x, *args[1:], **kwargs)

    return interceptor


class _Rewired(nn.Module):
    """The user's module, called with Masksembles at the layers the wrapper's rule chose (module docstring)."""

    module: nn.Module
    n: int
    scale: float
    seed: int | None = None
    batch_axes: tuple[tuple[str, int], ...] = ()  # (path, samples' axis) of the layers declared by example_input

    def setup(self) -> None:
        nn.share_scope(self, self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)`` with the masks; at ``init`` the rule decides and the masks are made."""
        plan: dict[str, LayerChange] = {}
        if self.is_initializing():
            assert self.scope is not None  # a bound module
            report = self.masksembles_report(*args, rng_names=tuple(self.scope.rngs), **kwargs)
            plan = {row.path: row for row in report.changed}
        elif MASKS_COLLECTION not in self.variables:
            raise ValueError(_missing_masks_message())
        interceptor = _masked_call(plan, self.n, self.scale, replace=self._replaces, batch_axes=dict(self.batch_axes))
        with batch_size_of_call((args, kwargs)), nn.intercept_methods(interceptor):  # as NNX's record_batch_size
            return self.module(*args, **kwargs)

    _replaces = False

    @nn.nowrap
    def masksembles_report(self, *args: Any, rng_names: Sequence[str] = ("params",), **kwargs: Any) -> LayerReport:
        """What ``init`` on ``(*args, **kwargs)`` decides (printable as a Markdown table); runs the module abstractly.

        ``rng_names``: the RNG streams the module's ``init`` needs (e.g. ``("params", "dropout")``).
        """
        calls = _survey(self.module, rng_names, args, kwargs)
        return self._decide(calls)

    @nn.nowrap
    def _decide(self, calls: list[_Call]) -> LayerReport:
        raise NotImplementedError


def _missing_masks_message() -> str:
    return (
        f"the variables given to apply hold no {MASKS_COLLECTION!r} collection: the masks are made once, by init, "
        f"and are part of the model: pass them to every apply like batch_stats, e.g. "
        f"apply_fn({{'params': params, {MASKS_COLLECTION!r}: variables[{MASKS_COLLECTION!r}]}}, x)"
    )


class Inserted(_Rewired):
    """``insert``'s result: ``module`` with Masksembles on the input of the chosen layers (``insert``'s docstring).

    Attributes:
        module: the user's module (its variables keep their paths).
        n, scale, seed: as given to ``insert``.
        batch_axes: (path, samples' axis) of the layers ``example_input`` declared (1: sequence-first (L, B, C));
            the others decide in each call.
        before, start, include_first: ``insert``'s choice of layers.
    """

    before: LayerFilter = DEFAULT_BEFORE
    start: str | None = None
    include_first: bool = False

    @nn.nowrap
    def _decide(self, calls: list[_Call]) -> LayerReport:
        chosen = _layer_filter(self.before)
        called = _first_calls(calls)
        candidates = [_candidate(call) for call in called if chosen(call.path, call.module)]
        names = {candidate.path for candidate in candidates}
        first = [call.path for call in called if isinstance(call.module, INPUT_LAYERS) or call.path in names][:1]
        order = [call.path for call in called]
        return plan_insertion(
            candidates,
            order,
            self.n,
            self.scale,
            seed=self.seed,
            start=self.start,
            include_first=self.include_first,
            first_layers=first,
        )


def _layer_filter(before: LayerFilter) -> Callable[[str, nn.Module], bool]:
    if isinstance(before, type):
        return lambda _, layer: isinstance(layer, before)
    if isinstance(before, tuple) and before and all(isinstance(kind, type) for kind in before):
        return lambda _, layer: isinstance(layer, before)
    if callable(before) and not isinstance(before, tuple):
        return before
    raise TypeError(
        f"before must be a layer type, a non-empty tuple or list of layer types or a predicate (path, layer) -> bool; "
        f"received {before!r}"
    )


def _candidate(call: _Call) -> Candidate:
    """A layer whose input may get masks (channels on the last axis: linen is channels-last)."""
    name = type(call.module).__name__
    shape = call.shape
    reason = ""
    if not call.writable:
        reason = LIFTED
    elif shape is None or len(shape) < 2:
        reason = "its input is not a batch of arrays with channels (fewer than 2 axes, or not an array)"
    elif isinstance(call.module, nn.DenseGeneral) and call.module.axis not in (-1, len(shape) - 1):
        reason = f"axis={call.module.axis!r}: the masks cover the last axis, which this layer does not contract alone"
    elif isinstance(call.module, nn.Conv) and 1 < shape[-1] == call.module.feature_group_count:
        reason = DEPTHWISE
    channels = shape[-1] if shape is not None and len(shape) >= 2 else 0
    return Candidate(call.path, name, channels, -1, reason)


def insert(
    module: nn.Module,
    n: int,
    scale: float,
    *,
    seed: int | None = None,
    before: LayerFilter | list[type] = DEFAULT_BEFORE,
    start: str | None = None,
    include_first: bool = False,
    example_input: Any = None,
) -> Inserted:
    """``module`` with a Masksembles layer on the input of every chosen layer its call reaches (the paper's recipe).

    Returns an ``Inserted`` module: ``init`` and ``apply`` it like ``module`` (same arguments, same ``params`` tree,
    so trained ``params`` of ``module`` load as they are); ``init`` also makes the masks, once, in the
    ``"masksembles"`` collection, at the path of each chosen layer: ``variables["masksembles"]["Dense_1"]["masks"]``,
    bool (n, C). Pass that collection to every ``apply``, like ``batch_stats``; an optimizer over ``params`` never
    sees it. The module's code is not changed: its layers are found while it runs (``nn.intercept_methods``).

    Decided at ``init`` by ``masksembles_core.insertion.plan_insertion``, as in every framework, over the layers in
    the order the module calls them: the network's first layer (its first Dense, Conv, Embed, ... called) reads the
    raw input and is left alone unless ``include_first``; layers called before ``start`` are left alone; so are
    depthwise convolutions (``feature_group_count`` equal to the input channels), layers with one input channel or
    too few for n distinct masks, and layers inside a lifted transform that does not carry the collection
    (``nn.scan(..., variable_broadcast="masksembles")`` carries it: one set of masks for the whole stack). The i-th
    layer given masks gets ``masksembles_core.derive_seed(seed, i)``. ``Inserted.masksembles_report(*args,
    **kwargs)`` returns the decisions ``init`` makes on those arguments (a ``LayerReport``; print it for a table).

    Args:
        module: any linen module (unbound).
        n: number of masks (ensemble members).
        scale: overlap control, >= 1.
        seed: seed of all the masks (reproducible per layer); None draws fresh entropy at each ``init``.
        before: a layer type, a tuple or list of types (``isinstance``: ``nn.Dense``, ``nn.Conv``,
            ``nn.DenseGeneral``, ``nn.ConvTranspose``), or a predicate ``(path, layer) -> bool`` called on every
            module the call reaches, with linen paths such as ``"Block_0/Conv_1"``. Masks cover the last axis of
            the layer's first argument.
        start: path of the layer (or block) insertion starts from, e.g. ``"Block_2"``; None for the whole model.
        include_first: also mask the network's first layer's input (the raw input).
        example_input: an input of ``module`` (an array, a tuple of positional arguments or a dict of keyword ones):
            each layer's samples' axis is declared (``Inserted.batch_axes``) as the axis of its input that grows
            when the example grows by one sample (``_declared_axes``); without it (or where no single axis grows)
            each call decides (``masksembles_core.adapter.sample_axis``).

    Raises:
        TypeError: ``module`` is not a linen module, or ``before`` is neither types nor a callable.
        ValueError: bad ``n``/``scale``/``seed``; at ``init``, ``start`` names no layer or no layer gets masks.
    """
    n, scale, seed = check_insert_arguments(n, scale, seed, start)
    if not isinstance(module, nn.Module):
        raise TypeError(f"insert needs a flax.linen Module; received {type(module).__name__}")
    before = tuple(before) if isinstance(before, list) else before
    chosen = _layer_filter(before)  # checked now, not at init
    axes = _declared_axes(module, example_input, lambda call: bool(chosen(call.path, call.module)))
    return Inserted(module, n, scale, seed, batch_axes=axes, before=before, start=start, include_first=include_first)


class Converted(_Rewired):
    """``convert_dropout``'s result: ``module`` with the chosen ``nn.Dropout`` layers replaced by Masksembles."""

    _replaces = True

    @nn.nowrap
    def _decide(self, calls: list[_Call]) -> LayerReport:
        candidates: list[Candidate] = []
        shapes: dict[str, set[tuple[int, ...] | None]] = {}
        for call in calls:
            shapes.setdefault(call.path, set()).add(call.shape)
        for call in _first_calls(calls):
            if isinstance(call.module, nn.MultiHeadDotProductAttention) and call.module.dropout_rate > 0:
                source = f"{type(call.module).__name__}'s dropout_rate={call.module.dropout_rate:g}"
                reason = attention_dropout_reason(source)
                candidates.append(Candidate(call.path, type(call.module).__name__, 0, -1, reason=reason))
            elif isinstance(call.module, nn.Dropout):
                reason, channels = _dropout_reason(call, shapes[call.path])
                candidates.append(Candidate(call.path, "Dropout", channels, -1, reason=reason))
        return plan_conversion(candidates, self.n, self.scale, seed=self.seed, converts="nn.Dropout layers")


def _dropout_reason(call: _Call, shapes: set[tuple[int, ...] | None]) -> tuple[str, int]:
    dropout = call.module
    if dropout.rate != 0 and not call.writable:
        return LIFTED, 0
    return dropout_reason(dropout.rate, dropout.broadcast_dims, call.path.rpartition("/")[2], shapes)


def convert_dropout(
    module: nn.Module, n: int, scale: float, *, seed: int | None = None, example_input: Any = None
) -> Converted:
    """``module`` with its channel dropouts (``nn.Dropout``) replaced by Masksembles (the MC-Dropout drop-in).

    Returns a ``Converted`` module, used like ``insert``'s ``Inserted``: the same ``params`` tree, the masks made
    once at ``init`` in the ``"masksembles"`` collection at each converted dropout's path
    (``variables["masksembles"]["Dropout_0"]["masks"]``, bool (n, C) over the last axis of its input). A converted
    dropout applies its masks in every mode (``deterministic`` and the ``"dropout"`` RNG no longer matter to it).
    The i-th converted dropout, in call order, gets masks from ``masksembles_core.derive_seed(seed, i)``.

    Left as is, with the reason in the report (``Converted.masksembles_report(*args, **kwargs)``): ``rate=0``;
    per-sample dropouts (``broadcast_dims`` over every axis but the batch: stochastic depth) and dropouts that share
    one draw across the channels (``broadcast_dims`` with the last axis); attention-weight dropouts (a dropout named
    like ``attn_drop``/``attention_dropout``, and ``MultiHeadDotProductAttention``'s ``dropout_rate``, reported on
    the attention layer); a dropout called on inputs with different channel counts; and a dropout inside a lifted
    transform that does not carry the ``"masksembles"`` collection. ``example_input`` declares each dropout's
    samples' axis, as for ``insert``.

    Raises:
        TypeError: ``module`` is not a linen module.
        ValueError: bad ``n``/``scale``/``seed``; at ``init``, no dropout converted (the message holds the report).
    """
    n, scale, seed = check_insert_arguments(n, scale, seed, None)
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_dropout needs a flax.linen Module; received {type(module).__name__}")
    axes = _declared_axes(module, example_input, lambda call: isinstance(call.module, nn.Dropout))
    return Converted(module, n, scale, seed, batch_axes=axes)


def _declared_axes(module: nn.Module, example: Any, targets: Callable[[_Call], bool]) -> tuple[tuple[str, int], ...]:
    """(path, samples' axis) of each ``targets`` call of ``module`` on ``example`` (an array: ``module(x)``, a tuple:
    ``module(*x)``, a dict: ``module(**x)``): the axis of its input that grows when the example grows by one sample
    (``masksembles_core.adapter.grown_axis``, the masks on the last axis), from two abstract ``init`` surveys; none
    without an example, where the module fails on the larger one, or where no single axis grows."""
    if example is None:
        return ()
    runs: list[dict[str, list[tuple[int, ...] | None]]] = []
    for inputs in (example, one_more_sample(example)):
        args = inputs if isinstance(inputs, tuple) else () if isinstance(inputs, dict) else (inputs,)
        kwargs = inputs if isinstance(inputs, dict) else {}
        try:
            calls = _survey(module, ("params", "dropout"), args, kwargs)
        except Exception:  # a module that takes no other batch size: each call decides
            return ()
        shapes: dict[str, list[tuple[int, ...] | None]] = {}
        for call in calls:
            if targets(call):
                shapes.setdefault(call.path, []).append(call.shape)
        runs.append(shapes)
    declared = []
    for path, small in runs[0].items():
        large = runs[1].get(path, [])
        if None not in small + large:
            axis = mca.grown_axis(cast(list[tuple[int, ...]], small), cast(list[tuple[int, ...]], large), -1)
            if axis is not None:
                declared.append((path, axis))
    return tuple(declared)
