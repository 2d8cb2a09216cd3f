"""``insert``: Masksembles layers on the input of chosen layers of any NNX model, by the paper's recipe (Section 5).

The model's layers are found by walking its graph in the model's order: a module's attributes in the order they were
assigned (for a model built by its ``__init__``, the order of the constructor), list and ``nnx.List`` items by
index, dict and ``nnx.Dict`` items in insertion order, parents before their children. A layer's path is the
``nnx.iter_graph`` path joined with dots: ``"conv1"``, ``"blocks.2.conv"``, ``"layers.3"`` in an ``nnx.Sequential``.
Which of the chosen layers get masks is decided by the rule every framework shares,
``masksembles_core.insertion.plan_insertion``; ``insert`` only finds the layers and rewires the copy.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import masksembles_core as mc
import masksembles_core.adapter as mca
from masksembles_core.insertion import (
    Candidate,
    LayerChange,
    LayerReport,
    check_insert_arguments,
    plan_insertion,
    read_through_wrapper,
    used_outside_its_call,
    wrapper_attribute_error,
)

from ._nnx_layers import Masks, Masksembles, record_batch_size

ModuleT = TypeVar("ModuleT", bound=nnx.Module)
Key = str | int
Path = tuple[Key, ...]
Shape = tuple[int, ...]
LayerFilter = type | tuple[type, ...] | list[type] | Callable[[str, Any], bool]

DEPTHWISE = "depthwise convolution: each output channel reads one input channel (before=... includes it)"
ALREADY_MASKED = "already has Masksembles on its input (the layer of a Masked)"
NO_CHANNELS = "no integer in_features: the channel count of its input is unknown"
STACKED = "a stack of {layers} layers (nnx.vmap): layer j's masks from derive_seed(seed, j)"


INPUT_LAYERS = (
    nnx.Conv,
    nnx.ConvTranspose,
    nnx.Linear,
    nnx.Embed,
    nnx.LinearGeneral,
    nnx.Einsum,
)  # what reads raw input


class Masked(nnx.Module):
    """A layer with a Masksembles layer on its input, as ``insert`` places it: ``layer(masksembles(x), ...)``.

    Input (B, ..., C) with C = ``masksembles.channels`` on ``masksembles.channel_axis``; output: the layer's.
    Arguments after ``x`` go to the layer.
    """

    def __init__(self, masksembles: Masksembles, layer: Callable[..., Any]) -> None:
        self.masksembles = masksembles
        self.layer = layer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``layer`` on its masked first input, passed by position or by the name of the layer's first parameter
        (``inputs=x`` for ``nnx.Linear``)."""
        if args:
            return self.layer(self.masksembles(args[0]), *args[1:], **kwargs)
        name = next(iter(inspect.signature(self.layer).parameters), None)
        if name not in kwargs:
            raise TypeError(f"Masked() needs the input of its {type(self.layer).__name__} (x or {name}=)")
        return self.layer(**{**kwargs, name: self.masksembles(kwargs[name])})

    def __getattr__(self, name: str) -> Any:
        """Only for names ``Masked`` lacks: one of the layer's (``kernel``), read by code that uses the layer's
        weights without calling it, is an error that says what to do (a mask on the input would not apply there)."""
        layer = self.__dict__.get("layer")
        if not name.startswith("__") and layer is not None and hasattr(layer, name):
            raise ReadOutsideCall(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class ReadOutsideCall(AttributeError):
    """The model read an attribute of a layer ``insert`` wrapped, outside the layer's call."""

    def __init__(self, masked: Masked, name: str) -> None:
        super().__init__(
            f"{type(masked).__name__!r} object has no attribute {name!r}; "
            f"{wrapper_attribute_error(type(masked.layer).__name__, name)}"
        )
        self.masked, self.attribute = masked, name


def insert(
    model: ModuleT,
    n: int,
    scale: float,
    *,
    seed: int | None = None,
    before: LayerFilter = (nnx.Conv, nnx.Linear),
    start: str | None = None,
    include_first: bool = False,
    example_input: Any = None,
) -> ModuleT:
    """A copy of ``model`` with a Masksembles layer on the input of every chosen layer (the paper's recipe).

    Each chosen layer of the copy is replaced, where it sits (an attribute, a list or dict item), by
    ``Masked(Masksembles(in_features, n, scale, seed=...), layer)``: its weights are kept and no width changes, so
    any NNX model works, whatever its ``__call__`` does. The masks cover the layer's ``in_features`` channels on the
    last axis (NNX layers are channels-last). ``model`` itself is not modified; the copy holds its own arrays and
    keeps the model's attribute order.

    Decided by ``masksembles_core.insertion.plan_insertion``, as in every framework: the network's first layer (its
    first Conv, Linear or Embed in the model's order) reads the raw input and is left alone unless
    ``include_first``; layers before ``start`` are left alone; so are depthwise convolutions
    (``feature_group_count == in_features``), layers with one input channel, layers whose instance also sits at
    another path (masks at one place would miss the calls from the other) and the layer of an existing ``Masked``.
    The i-th layer given masks gets ``masksembles_core.derive_seed(seed, i)``. A Linear or convolution stacked by
    ``nnx.vmap`` (scan-over-layers: its kernel has leading layer axes) gets masks (*layers, n, C), layer j's from
    ``derive_seed(that seed, j)``, so that ``nnx.scan`` hands each layer its own; the report notes the stack.

    Args:
        model: any ``nnx.Module`` (a user's module, ``nnx.Sequential``, nested modules, lists of blocks).
        n: number of masks (ensemble members).
        scale: overlap control, >= 1.
        seed: seed of all the masks (reproducible per layer); None draws fresh entropy.
        before: the layers to put masks before: a type or a tuple (or list) of types (``isinstance``), or a predicate
            ``(path, layer) -> bool`` called on every module below the root. A chosen layer needs an integer
            ``in_features``.
        start: path of the layer (or block) insertion starts from, e.g. ``"blocks.2"``; None for the whole model.
        include_first: also mask the network's first layer's input (the raw input).
        example_input: a batch to run the new model on once (on a clone, so nothing in the copy changes), as the
            model is called: an array (``model(x)``), a tuple (``model(*x)``) or a dict (``model(**x)``). A layer
            whose attributes the model reads outside the layer's call (``x @ self.fc.kernel``) is then left alone
            with the reason (``masksembles_core.insertion.used_outside_its_call``); without it, such a read of a
            wrapped layer raises an error that says so.

    Returns:
        the copy, with the decisions as ``masksembles_report`` (a ``masksembles_core.insertion.LayerReport``; print
        it for a table of every chosen layer: inserted, or left as is and why).

    Raises:
        TypeError: ``model`` is not an ``nnx.Module``, or ``before`` is neither types nor a callable.
        ValueError: bad ``n``/``scale``/``seed``, ``start`` names no layer, no layer gets masks, or the model fails
            on ``example_input`` (with masks, outside every masked layer's attributes, or without them).
    """
    n, scale, seed = check_insert_arguments(n, scale, seed, start)
    if not isinstance(model, nnx.Module):
        raise TypeError(f"insert needs an nnx.Module; received {type(model).__name__}")
    chosen = _layer_filter(before)
    nodes = list(_walk(model))
    paths_of: dict[int, list[str]] = {}
    for path, node, _ in nodes:
        paths_of.setdefault(id(node), []).append(_dotted(path))
    candidates: list[Candidate] = []
    path_parts: dict[str, Path] = {}
    for path, node, parent in nodes:
        dotted = _dotted(path)
        if isinstance(node, nnx.Module) and paths_of[id(node)][0] == dotted and chosen(dotted, node):
            others = paths_of[id(node)][1:]
            candidates.append(_candidate(dotted, node, others, isinstance(parent, Masked) and path[-1] == "layer"))
            path_parts[dotted] = path
    order = [_dotted(path) for path, _, _ in nodes]
    first = [  # the network's first layer: it reads the raw input
        dotted for dotted, (_, node, _) in zip(order, nodes, strict=True)
        if isinstance(node, INPUT_LAYERS) or dotted in path_parts
    ][:1]  # fmt: skip
    reasons: dict[str, str] = {}
    while True:  # each round leaves at least one more layer alone, until the model runs on example_input
        report = plan_insertion(
            [dataclasses.replace(c, reason=c.reason or reasons.get(c.path, "")) for c in candidates],
            order, n, scale, seed=seed, start=start, include_first=include_first, first_layers=first,
        )  # fmt: skip
        stacks = {row.path: _stack_shape(_node_at(model, path_parts[row.path])) for row in report.changed}
        report = _stacked_report(report, stacks)
        copy = nnx.clone(model, arrays=True)
        _keep_attribute_order(model, copy)
        for path, node, _ in nodes:
            if isinstance(node, nnx.Module):
                _keep_attribute_order(node, _node_at(copy, path))
        for row in report.changed:
            path = path_parts[row.path]
            _replace(copy, path, Masked(_masksembles(row, n, scale, stacks[row.path]), _node_at(copy, path)))
        failed = {} if example_input is None else _read_outside_calls(model, copy, example_input)
        if not failed:
            copy.masksembles_report = report  # type: ignore[attr-defined]  # static: LayerReport is hashable
            copy = record_batch_size(copy)  # a sample meets one member in every layer, also where it folds the batch
            masks = {(*path_parts[row.path], "masksembles") for row in report.changed}
            placed = {id(_node_at(copy, path)): [path] for path in masks}
            if example_input is not None:
                declare_batch_axes(copy, example_input, placed, _call)
            return copy
        reasons.update(failed)


def _call(model: nnx.Module, inputs: Any) -> Any:
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def _read_outside_calls(model: nnx.Module, copy: nnx.Module, inputs: Any) -> dict[str, str]:
    """Run a clone of ``copy`` on ``inputs``: the path of a layer whose attribute the model read outside the layer's
    call, with the reason (empty when it runs)."""
    trial = nnx.clone(copy)  # the run must not change the copy (BatchNorm statistics, RNG counts)
    paths = {id(node): _dotted(path) for path, node, _ in _walk(trial) if isinstance(node, Masked)}
    try:
        _call(trial, inputs)
    except ReadOutsideCall as read:
        user = "the model's own code"
        if isinstance(getattr(read.masked.layer, read.attribute), nnx.Variable | jax.Array):
            return {paths[id(read.masked)]: used_outside_its_call(user, (read.attribute,))}
        return {paths[id(read.masked)]: read_through_wrapper(user, (read.attribute,))}
    except Exception as failure:
        try:
            _call(nnx.clone(model), inputs)
        except Exception as plain:
            raise ValueError(f"insert: the model fails on example_input without masks ({plain})") from plain
        raise ValueError(f"insert: the model fails on example_input with masks ({failure})") from failure
    return {}


def _stacked_report(report: LayerReport, stacks: dict[str, tuple[int, ...]]) -> LayerReport:
    """``report`` with a note on each inserted row of a stacked layer (its masks are one set per layer)."""
    rows = [
        dataclasses.replace(row, reason=STACKED.format(layers=math.prod(stacks[row.path])))
        if stacks.get(row.path)
        else row
        for row in report.rows
    ]
    return dataclasses.replace(report, rows=tuple(rows))


def _stack_shape(layer: nnx.Module) -> tuple[int, ...]:
    """The leading axes ``nnx.vmap`` stacked ``layer``'s kernel on, () for a layer made once.

    A Linear's kernel is (in, out) and a convolution's (*window, in/groups, out): any axis in front of those is a
    stack of layers, each of which ``nnx.scan`` (or ``nnx.vmap``) runs on its own slice.
    """
    if isinstance(layer, nnx.Conv | nnx.ConvTranspose):
        expected = len(layer.kernel_size) + 2
    elif isinstance(layer, nnx.Linear):
        expected = 2
    else:
        return ()
    shape = tuple(layer.kernel[...].shape)
    return shape[: len(shape) - expected]


def _masksembles(row: LayerChange, n: int, scale: float, stack: tuple[int, ...]) -> Masksembles:
    """The Masksembles layer of an inserted row: masks (n, C), or (*stack, n, C) for a stacked layer, layer ``j`` of
    the stack (row-major) with masks from ``derive_seed(row.seed, j)``."""
    assert row.channels is not None and row.channel_axis is not None  # set on every inserted row
    layer = Masksembles(row.channels, n, scale, seed=row.seed, channel_axis=row.channel_axis)
    if stack:
        seeds = [mc.derive_seed(row.seed, j) for j in range(math.prod(stack))]
        masks = np.stack([mc.generate_masks(row.channels, n, scale, seed=seed) for seed in seeds])
        layer.masks = Masks(jnp.asarray(masks.reshape((*stack, n, row.channels))))
    return layer


def _layer_filter(before: LayerFilter) -> Callable[[str, Any], bool]:
    if isinstance(before, type):
        return lambda _, layer: isinstance(layer, before)
    if isinstance(before, tuple | list):
        if before and all(isinstance(kind, type) for kind in before):
            kinds = tuple(before)
            return lambda _, layer: isinstance(layer, kinds)
    elif callable(before):
        return before
    raise TypeError(
        f"before must be a layer type, a non-empty tuple or list of layer types or a predicate (path, layer) -> bool; "
        f"received {before!r}"
    )


def _candidate(path: str, layer: nnx.Module, others: list[str], masked: bool) -> Candidate:
    name = type(layer).__name__
    channels = getattr(layer, "in_features", None)
    reason = ""
    if masked:
        reason = ALREADY_MASKED
    elif others:
        reason = f"shared: the same {name} also sits at {', '.join(others)}; masks at one place would miss the others"
    elif not isinstance(channels, int):
        reason = NO_CHANNELS
    elif isinstance(layer, nnx.Conv) and channels > 1 and layer.feature_group_count == channels:
        reason = DEPTHWISE
    return Candidate(path, name, channels if isinstance(channels, int) else 0, -1, reason)


def _keep_attribute_order(original: nnx.Module, copy: nnx.Module) -> None:
    """Give ``copy`` the attribute order of ``original`` (``nnx.clone`` sorts attributes by name): the copy keeps the
    model's order, for its repr and for a later ``insert``."""
    attributes = vars(copy)
    rank = {name: i for i, name in enumerate(vars(original))}
    ordered = sorted(attributes.items(), key=lambda item: rank.get(item[0], len(rank)))
    attributes.clear()
    attributes.update(ordered)


def _dotted(path: Path) -> str:
    return ".".join(str(key) for key in path)


def _children(node: Any) -> Iterator[tuple[Key, Any]]:
    """The direct children of ``node`` that may hold layers, in the model's order."""
    if isinstance(node, nnx.List) or type(node) in (list, tuple):
        items: Iterator[tuple[Key, Any]] = iter(enumerate(node))
    elif isinstance(node, nnx.Dict) or type(node) is dict:
        items = iter(node.items())
    else:
        items = ((key, value) for key, value in vars(node).items() if not key.startswith("_pytree__"))
    for key, value in items:
        if isinstance(value, nnx.Module) or type(value) in (list, tuple, dict):
            yield key, value


def _walk(root: nnx.Module) -> Iterator[tuple[Path, Any, Any]]:
    """(path, node, parent) of every module and container below ``root``, parents first; a node reached by several
    paths is yielded at each of them (cycles are cut)."""
    stack: list[tuple[Path, Any, Any]] = [((), root, None)]
    ancestors: list[int] = []
    while stack:
        path, node, parent = stack.pop()
        del ancestors[len(path) :]
        if id(node) in ancestors:
            continue
        if path:
            yield path, node, parent
        ancestors.append(id(node))
        stack.extend(reversed([((*path, key), value, node) for key, value in _children(node)]))


def _child(node: Any, key: Key) -> Any:
    if isinstance(node, nnx.List | nnx.Dict) or type(node) in (list, tuple, dict):
        return node[key]
    return getattr(node, str(key))


def _node_at(root: Any, path: Path) -> Any:
    for key in path:
        root = _child(root, key)
    return root


def _replace(root: nnx.Module, path: Path, value: Any) -> None:
    """Put ``value`` at ``path`` in ``root``: set the attribute or item (a tuple is rebuilt in its own parent)."""
    *head, key = path
    parent = _node_at(root, tuple(head))
    if type(parent) is tuple:
        assert isinstance(key, int)
        _replace(root, tuple(head), (*parent[:key], value, *parent[key + 1 :]))
    elif isinstance(parent, nnx.List | nnx.Dict) or type(parent) in (list, dict):
        parent[key] = value
    else:
        setattr(parent, str(key), value)


# ------------------------------------------------------------------------------------------------ the samples' axis


class _Probe(nnx.Module):
    """A module's stand-in while an example runs: records the shape of each input it gets."""

    def __init__(self, module: nnx.Module, seen: list[Shape | None]) -> None:
        self.module = module
        self.seen = seen

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(tuple(x.shape) if isinstance(x, jax.Array) else None)
        return self.module(x, *args, **kwargs)


def input_shapes(
    model: nnx.Module, example: Any, modules: Mapping[int, Sequence[Path]], call: Callable[[nnx.Module, Any], Any]
) -> dict[int, list[Shape | None]]:
    """The input shape of each call of each of ``modules`` (by ``id``, at its paths), in call order, in one abstract
    eval-mode ``call(model, example)`` on a clone (``model`` is not changed)."""
    probe = nnx.clone(model)
    seen: dict[int, list[Shape | None]] = {key: [] for key in modules}
    for key, paths in modules.items():
        stand_in = _Probe(_node_at(probe, paths[0]), seen[key])
        for path in paths:
            _replace(probe, path, stand_in)
    probe.eval()  # type: ignore[no-untyped-call]  # BatchNorm on running statistics, dropout off
    graphdef, state = nnx.split(probe)
    jax.eval_shape(lambda state: call(nnx.merge(graphdef, state, copy=True), example), state)
    return seen


def one_more_sample(example: Any) -> Any:
    """``example`` with its first sample repeated once more at the end of every array's axis 0."""

    def grown(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array | np.ndarray) and leaf.ndim:
            return jnp.concatenate([leaf, leaf[:1]])
        return leaf

    return jax.tree.map(grown, example)


def declare_batch_axes(
    model: nnx.Module, example: Any, layers: Mapping[int, Sequence[Path]], call: Callable[[nnx.Module, Any], Any]
) -> None:
    """Set the ``batch_axis`` of each Masksembles layer of ``layers`` (by ``id``, at its paths in ``model``): the axis
    of its input that grows when ``example`` grows by one sample (``masksembles_core.adapter.grown_axis``: 0, or 1 for
    a sequence-first (L, B, C)), from two abstract eval-mode calls; None (decided in each call) where the model fails
    on the larger example or no single axis grows."""
    try:
        runs = [input_shapes(model, inputs, layers, call) for inputs in (example, one_more_sample(example))]
    except Exception:  # a model that takes no other batch size: each call decides
        runs = []
    for key, paths in layers.items():
        layer = _node_at(model, paths[0])
        if runs and None not in runs[0][key] + runs[1][key]:
            small, large = (cast(list[Shape], run[key]) for run in runs)
            layer.batch_axis = mca.grown_axis(small, large, layer.channel_axis)
