"""Model surgery: Masksembles on the input of chosen layers (``insert``) or in place of dropouts (``convert_dropout``).

Both keep every trained weight and every layer's width, return the changed model (a deep copy unless ``inplace``) and
attach a ``masksembles_core.insertion.LayerReport`` to it as ``masksembles_report``: one row per layer looked at, what
was done and why; ``print(model.masksembles_report)`` shows it as a Markdown table.

``insert`` decides with the rule every framework's ``insert`` shares (``masksembles_core.insertion``) and replaces
each chosen layer by ``Masked(masksembles, layer)``, except where torch.fx sees the model use a layer's weights
without calling it; given an example input, it runs the new model once and leaves alone the layers that would make
it fail. ``convert_dropout`` reads the model with torch.fx (with torch.export in training mode where torch.fx cannot
trace it: Hugging Face ``transformers`` models) and decides with the same rule (``plan_conversion``): a dropout's
channel axis comes from the layer that produced its input, ``F.dropout`` calls are found, and dropouts of attention
weights are recognized. Both take the example input as the model is called (``masksembles_torch._structures``).
Dropout modules are replaced in place, so the model keeps its classes and methods; only a module whose own
``forward`` calls ``F.dropout`` is replaced by a ``torch.fx.GraphModule`` of that ``forward``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import operator
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.fx.experimental.symbolic_shapes import has_guarding_hint
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

import masksembles_core.adapter as mca
from masksembles_core.insertion import (
    CONVERTED,
    PER_SAMPLE,
    Candidate,
    LayerChange,
    LayerReport,
    attention_dropout_reason,
    check_insert_arguments,
    leave_converted,
    plan_conversion,
    plan_insertion,
    read_through_wrapper,
    used_outside_its_call,
    wrapper_attribute_error,
)

from ._layers import Masksembles, record_batch_size, sequence_first
from ._structures import Inputs, batched_tensors, call, map_batched

DEFAULT_BEFORE: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
DEPTHWISE = "depthwise convolution: each output channel reads one input channel (before=... includes it)"
INPUT_LAYERS = (nn.modules.conv._ConvNd, nn.Linear, nn.Embedding, nn.EmbeddingBag)  # what reads a network's input
REPORT = "masksembles_report"
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_NOTE_READS = "_masksembles_note_read"  # set on a Masked only while insert runs its example input


class Masked(nn.Module):
    """A layer whose input gets Masksembles masks: ``layer(masksembles(x), *args, **kwargs)``. Made by ``insert``.

    Args:
        masksembles: the Masksembles layer applied to the first input.
        layer: the wrapped layer (a Conv2d, a Linear, ...), called on the masked input.

    Shape:
        input: what ``layer`` takes, with ``masksembles.channels`` channels on ``masksembles.channel_axis``;
        output: what ``layer`` returns.

    Attributes are not forwarded to the layer: read ``masked.layer.weight``, ``masked.layer.in_features``. Code that
    takes a wrapped layer's weights to compute without calling it would silently skip the masks; it gets an
    AttributeError that says so instead (``insert`` leaves such layers alone when torch.fx or its example input
    shows them). ``state_dict`` keys: ``<path>.layer.<name>`` for the layer's parameters and buffers,
    ``<path>.masksembles.masks`` for the masks.
    """

    def __init__(self, masksembles: Masksembles, layer: nn.Module) -> None:
        super().__init__()
        self.masksembles = masksembles
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``layer`` on its masked first input, passed by position or by the name of ``layer.forward``'s first
        parameter (``input=x`` for ``nn.Linear``): (B, ...) -> ``layer``'s output."""
        if args:
            return self.layer(self.masksembles(args[0]), *args[1:], **kwargs)
        name = next(iter(inspect.signature(self.layer.forward).parameters), None)
        if name not in kwargs:
            raise TypeError(f"Masked.forward() needs the input of its {type(self.layer).__name__} (x or {name}=)")
        return self.layer(**{**kwargs, name: self.masksembles(kwargs[name])})

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError as error:
            layer = self.__dict__.get("_modules", {}).get("layer")
            if layer is None or not hasattr(layer, name):
                raise
            note_read = self.__dict__.get(_NOTE_READS)
            if note_read is not None:  # insert's example run: note who reads what, and let the model go on
                note_read(name)
                return getattr(layer, name)
            raise AttributeError(f"{error}; {wrapper_attribute_error(type(layer).__name__, name)}") from None


# --- shared by insert and convert_dropout ---------------------------------------------------------------------------


def _factory(module: nn.Module) -> dict[str, Any]:
    """Device and dtype of ``module``'s first floating parameter (the defaults when it has none)."""
    parameter = next((p for p in module.parameters() if p.is_floating_point()), None)
    return {} if parameter is None else {"device": parameter.device, "dtype": parameter.dtype}


def _masksembles(row: LayerChange, n: int, scale: float, like: nn.Module, training: bool) -> Masksembles:
    """The Masksembles layer a report row describes, stored like ``like``'s weights."""
    assert row.channels is not None and row.channel_axis is not None, f"row {row.path!r} places no masks"
    layer = Masksembles(row.channels, n, scale, seed=row.seed, channel_axis=row.channel_axis, **_factory(like))
    return layer.train(training)


def _declare_batch_axes(model: nn.Module, example: Inputs | None, holders: Mapping[Masksembles, nn.Module]) -> None:
    """Set the ``batch_axis`` of each new Masksembles layer (a key of ``holders``, the module that calls it): 1 in
    one of torch's sequence-first transformer layers, 0 in a batch-first one; elsewhere the axis of its input that
    grows when the example input grows by one sample (the model run on ``example`` and on ``example`` with its first
    sample repeated once more: eval mode, no gradients, modes restored), 0 or 1 for a 3-D channels-last input; None
    (decided in each call) where no example is given, the model fails on the larger one, or no single axis grows."""
    probed = {}
    for layer, holder in holders.items():
        if isinstance(holder, FEED_FORWARD_LAYERS):  # its unbatched (L, E) calls are refused by the layer
            layer.batch_axis = 1 if sequence_first(holder) else 0
        else:
            layer.batch_axis = None
            probed[id(layer)] = layer
    if not probed or example is None:
        return
    runs: list[dict[int, list[tuple[int, ...]]]] = []
    for inputs in (example, map_batched(example, lambda tensor: torch.cat([tensor, tensor[:1]]))):
        seen: dict[int, list[tuple[int, ...]]] = {key: [] for key in probed}

        def note(module: nn.Module, args: tuple[Any, ...], seen: dict[int, list[tuple[int, ...]]] = seen) -> None:
            if id(module) in seen and args and isinstance(args[0], Tensor):
                seen[id(module)].append(tuple(args[0].shape))

        handle = torch.nn.modules.module.register_module_forward_pre_hook(note)
        try:
            with _evaluating(model):
                call(model, inputs)
        except Exception:  # a model that takes no other batch size: each call decides
            return
        finally:
            handle.remove()
        runs.append(seen)
    for key, layer in probed.items():
        layer.batch_axis = mca.grown_axis(runs[0][key], runs[1][key], layer.channel_axis)


def _paths(model: nn.Module) -> dict[int, list[str]]:
    """Every path each module instance is registered at (``id`` -> paths, in ``named_modules`` order)."""
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    return paths


def _replace(model: nn.Module, paths: Sequence[str], module: nn.Module) -> None:
    """Register ``module`` at each of ``paths`` (not the root) in place of what is there."""
    for path in paths:
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, module)


def _attach(model: nn.Module, report: LayerReport) -> nn.Module:
    setattr(model, REPORT, report)  # a plain attribute: deepcopy and pickling keep it, state_dict does not
    return record_batch_size(model)  # a sample meets one member in every layer, also where the model folds the batch


# --- insert ----------------------------------------------------------------------------------------------------------


def _selector(before: object) -> Callable[[str, nn.Module], object]:
    if isinstance(before, type):
        before = (before,)
    if isinstance(before, tuple | list):
        types = tuple(before)
        if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
            raise TypeError(f"before must be module types or a predicate (path, module) -> bool; received {before!r}")
        return lambda _path, module: isinstance(module, types)
    if callable(before):
        return cast(Callable[[str, nn.Module], object], before)
    raise TypeError(f"before must be module types or a predicate (path, module) -> bool; received {before!r}")


def _default_selection(select: Callable[[str, nn.Module], object], path: str, module: nn.Module) -> object:
    return select(path, module) or _transposed_linear(module)


def _transposed_linear(module: nn.Module) -> bool:
    """Hugging Face ``transformers``' ``Conv1D`` (GPT-2's layers): a Linear whose weight is stored (in, out)."""
    weight = getattr(module, "weight", None)
    named = type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")
    return named and isinstance(weight, Tensor) and weight.ndim == 2


def _candidate(model: nn.Module, path: str, module: nn.Module, paths: list[str], default: bool) -> Candidate:
    """``module`` as a candidate for masks on its input, with the reason to leave it alone if there is one."""
    kind = type(module).__name__
    parent = model.get_submodule(path.rpartition(".")[0])
    if isinstance(parent, Masked):
        return Candidate(path, kind, 0, 1, reason="already masked: the layer of a Masked wrapper")
    if len(paths) > 1:
        return Candidate(path, kind, 0, 1, reason=f"one module registered at {len(paths)} paths ({', '.join(paths)})")
    called = isinstance(parent, FEED_FORWARD_LAYERS) and path.rpartition(".")[2] in ("linear1", "linear2")
    if type(parent).__module__.startswith("torch.nn") and not isinstance(parent, CONTAINERS) and not called:
        reason = f"part of {type(parent).__name__}, which may use its weights without calling it"
        return Candidate(path, kind, 0, 1, reason=reason)
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        return Candidate(path, kind, 0, 1, reason="lazy module not initialized: run one forward pass first")
    if isinstance(module, nn.modules.conv._ConvNd):
        depthwise = default and module.groups > 1 and module.groups == module.in_channels
        return Candidate(path, kind, module.in_channels, 1, reason=DEPTHWISE if depthwise else "")
    if _transposed_linear(module):
        return Candidate(path, kind, cast(Tensor, module.weight).shape[0], -1)
    channels = getattr(module, "in_features", None)
    if isinstance(channels, int):
        return Candidate(path, kind, channels, -1)
    return Candidate(path, kind, 0, 1, reason="no in_channels or in_features to read its input channels from")


def _trace_model(model: nn.Module, leaves: set[str]) -> fx.Graph | str:
    """``model`` traced by torch.fx with ``leaves`` kept as calls and the defaults of its ``forward`` as constants,
    or why it could not be traced."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
        defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
        return _Tracer(leaves).trace(model, concrete_args=defaults or None)
    except Exception as error:  # no Python signature (a scripted module), or anything torch.fx cannot follow
        return f"torch.fx could not trace the model ({_first_line(error)})"


def _reading_raw(
    graph: fx.Graph, stops: Callable[[fx.Node], bool], inputs: Collection[str] | None = None
) -> list[fx.Node]:
    """The nodes among ``stops`` that read the raw input: whose arguments are computed from the inputs of ``graph``
    alone (with constants, parameters and sizes), through no other stop. A value that also reads a stop's result
    is not the raw input: an attention output the ``attention_mask`` joins at the scores, a residual sum, a
    concatenation with learned features. ``inputs``: the names of the placeholders that are inputs (None: all;
    torch.export lifts weights into placeholders too)."""
    raw: set[fx.Node] = set()  # computed from the inputs alone
    learned: set[fx.Node] = set()  # computed from a stop's result
    found: list[fx.Node] = []
    for node in graph.nodes:
        sources = node.all_input_nodes
        if node.op == "placeholder":
            if inputs is None or node.name in inputs:
                raw.add(node)
        elif _metadata(node):  # a size, dtype or device: no data of the tensor it describes
            continue
        elif any(source in learned for source in sources):
            learned.add(node)
        elif any(source in raw for source in sources):
            if stops(node):
                found.append(node)
                learned.add(node)
            else:
                raw.add(node)
    return found


TENSOR_METADATA = frozenset({"size", "shape", "numel", "nelement", "dim", "ndimension", "ndim", "dtype", "device"})


def _metadata(node: fx.Node) -> bool:
    """A query of a tensor's metadata (``x.size(0)``, ``x.shape``, ``x.dtype``, ``x.dim()``, ATen's ``sym_size``)."""
    if node.op == "call_method":
        return node.target in TENSOR_METADATA
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in TENSOR_METADATA
    return _aten(node.target) in ("sym_size", "sym_numel", "sym_stride")


def _first_layers(model: nn.Module, layers: list[str], graph: fx.Graph | str) -> Collection[str]:
    """The network's first layers among ``layers`` (paths in ``named_modules`` order): those that read the raw input.

    A ``forward`` with one required input: the first of ``layers``. With several (``forward(self, image, features)``,
    ``forward(self, input_ids, attention_mask)``): the layers torch.fx finds reading inputs alone, through none of
    ``layers`` (``_reading_raw``: not an attention projection the mask reaches through the scores), or the first of
    ``layers`` when torch.fx cannot trace the model (``graph`` is then why). Arguments with a default keep it.
    """
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no Python signature (a scripted module): the order rule
        return layers[:1]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if isinstance(graph, str) or sum(p.default is p.empty and p.kind in positional for p in parameters) < 2:
        return layers[:1]
    leaves = set(layers)
    reading = _reading_raw(graph, lambda node: node.op == "call_module" and node.target in leaves)
    return {cast(str, node.target) for node in reading}


def _user(path: str, modules: dict[str, nn.Module]) -> str:
    """A module of the model as a report names it: ``'blocks.0.attn' (Attention)``, or the model's ``forward``."""
    return f"{path!r} ({type(modules[path]).__name__})" if path else "the model's forward"


def _used_outside(model: nn.Module, graph: fx.Graph, paths: Sequence[str]) -> dict[str, str]:
    """{path: reason} for the layers at ``paths`` whose parameters or buffers ``graph`` reads itself (a ``get_attr``
    node: ``F.linear(x, self.qkv.weight)``) instead of only calling the layer."""
    owners: dict[int, list[tuple[str, str]]] = {}  # id of a tensor -> (layer path, its name there)
    for path in paths:
        layer = model.get_submodule(path)
        for name, owned in itertools.chain(layer.named_parameters(), layer.named_buffers()):
            owners.setdefault(id(owned), []).append((path, name))
    modules = dict(model.named_modules())
    found: dict[str, tuple[dict[str, None], dict[str, None]]] = {}  # path -> (names used, users), in order
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            tensor: object = functools.reduce(getattr, cast(str, node.target).split("."), model)
        except AttributeError:  # a constant torch.fx made, not an attribute of the model
            continue
        for path, name in owners.get(id(tensor), []):
            names, users = found.setdefault(path, ({}, {}))
            names[name] = None
            users[_user(_owner(node)[0], modules)] = None
    return {path: used_outside_its_call(" and ".join(users), names) for path, (names, users) in found.items()}


def _wrap(model: nn.Module, report: LayerReport) -> dict[str, Masked]:
    """Each layer the report gives masks, replaced by its ``Masked`` wrapper; {path: wrapper}."""
    wrappers: dict[str, Masked] = {}
    for row in report.changed:
        layer = model.get_submodule(row.path)
        wrappers[row.path] = Masked(_masksembles(row, report.n, report.scale, layer, layer.training), layer)
        _replace(model, [row.path], wrappers[row.path])
    return wrappers


def _unwrap(model: nn.Module, wrappers: dict[str, Masked]) -> None:
    for path, wrapper in wrappers.items():
        _replace(model, [path], wrapper.layer)


def _read_reason(layer: nn.Module, names: Collection[str], users: Collection[str]) -> str:
    """Why a layer whose attributes ``names`` the model read through its wrapper is left alone."""
    weights = [name for name in names if isinstance(getattr(layer, name), Tensor)]
    if weights:
        return used_outside_its_call(" and ".join(users), weights)
    return read_through_wrapper(" and ".join(users), names)


def _run_once(model: nn.Module, inputs: Inputs, wrappers: dict[str, Masked]) -> dict[str, str]:
    """Run ``model`` on ``inputs`` (eval mode, no gradients, modes restored); {path of a wrapper: why it must go}.

    A wrapper goes when the model reads its layer's attributes through it (``self.qkv.weight``: noted, and read from
    the layer so that the run goes on), when the model fails inside it, or when its parent, a torch.nn module, runs
    without calling it (a fused inference path that skips the layer). The calls are seen through global module hooks,
    which turn no fused path off. A failure outside every wrapper restores the model (the wrappers removed) and is
    raised, saying whether the model fails without masks too.
    """
    modules = dict(model.named_modules())
    path_of = {id(module): path for path, module in modules.items()}
    stack: list[str] = []  # paths of the modules running, innermost last
    used: dict[str, tuple[dict[str, None], dict[str, None]]] = {}  # as in _used_outside
    called: set[str] = set()

    def note(path: str, name: str) -> None:
        names, users = used.setdefault(path, ({}, {}))
        names[name] = None
        users[_user(stack[-1] if stack else "", modules)] = None

    def enter(module: nn.Module, args: object) -> None:
        if id(module) in path_of:
            stack.append(path_of[id(module)])
            called.add(stack[-1])

    def leave(module: nn.Module, args: object, output: object) -> None:
        if id(module) in path_of:
            stack.pop()

    def skipped(path: str) -> bool:
        """Not called while its parent, a torch.nn module with a fused inference path, was."""
        parent = path.rpartition(".")[0]
        owner = modules[parent]
        fused = type(owner).__module__.startswith("torch.nn") and not isinstance(owner, CONTAINERS)
        return fused and parent in called and path not in called

    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(enter),
        torch.nn.modules.module.register_module_forward_hook(leave),
    ]
    for path, wrapper in wrappers.items():
        wrapper.__dict__[_NOTE_READS] = functools.partial(note, path)
    failure: Exception | None = None
    try:
        with _evaluating(model):
            call(model, inputs)
    except Exception as error:
        failure = error
    finally:
        for hook in hooks:
            hook.remove()
        for wrapper in wrappers.values():
            del wrapper.__dict__[_NOTE_READS]
    found = {path: _read_reason(wrappers[path].layer, names, users) for path, (names, users) in used.items()}
    if failure is None:
        return found | {path: SKIPPED_AT_INFERENCE for path in wrappers if path not in found and skipped(path)}
    failing = next((path for path in reversed(stack) if path in wrappers), None)
    if failing is not None:
        found.setdefault(failing, f"the model fails with masks on its input ({_first_line(failure)})")
    if found:
        return found
    _unwrap(model, wrappers)
    try:
        with _evaluating(model):
            call(model, inputs)
    except Exception as plain:
        raise ValueError(f"insert: the model fails on example_input without masks ({_first_line(plain)})") from plain
    raise ValueError(
        f"insert: the model fails on example_input with masks, outside every masked layer ({_first_line(failure)})"
    ) from failure


def insert(
    model: nn.Module,
    n: int,
    scale: float,
    *,
    seed: int | None = None,
    before: Sequence[type[nn.Module]] | type[nn.Module] | Callable[[str, nn.Module], object] = DEFAULT_BEFORE,
    start: str | None = None,
    include_first: bool = False,
    inplace: bool = False,
    example_input: Inputs | None = None,
) -> nn.Module:
    """Put a Masksembles layer on the input of every matching layer, as in the paper's experiments.

    Every trained weight and every layer's width is kept. Each chosen layer at path ``p`` is replaced by
    ``Masked(masksembles, layer)``; its masks cover the layer's ``in_channels`` (channels on axis 1, convolutions of
    any ``groups``) or ``in_features`` (last axis) and are stored on the device and in the dtype of its weights. The
    default ``before`` also selects Hugging Face ``transformers``' ``Conv1D`` (GPT-2's linear layers, their weight
    stored (in, out)): on a ``transformers`` model it masks the input of every attention projection, MLP layer,
    pooler and classifier or LM head, not the embeddings.
    Layers are looked at in ``named_modules`` order and decided by ``masksembles_core.insertion.plan_insertion``:
    the network's first layer (its first convolution, linear or embedding layer, or an earlier one ``before``
    selects) reads the raw input and is skipped unless ``include_first``. A ``forward`` with several required
    inputs (``forward(self, image, features)``) has one per input: the layers of these kinds that torch.fx finds
    reading inputs alone, through no other such layer (the first in order when torch.fx cannot trace the model); a
    layer whose input also holds another layer's result is not one (the attention output projection that
    ``forward(self, input_ids, attention_mask)``'s mask reaches through the scores). With ``start`` (a
    module path such as ``"layer3"``, the paper's ImageNet recipe) the layers before it are skipped; the ``i``-th
    inserted layer gets masks from ``masksembles_core.derive_seed(seed, i)``. Also left alone, with the reason in
    the report: depthwise convolutions when ``before`` is the default, a module registered at several paths, the
    layers inside a torch.nn module such as ``nn.MultiheadAttention`` (it may use their weights without calling
    them), lazy modules not yet initialized, and layers with a single input channel or too few input channels for
    ``n`` distinct masks.

    A layer whose weights the model uses without calling it (torchvision's Swin attention runs
    ``F.linear(x, self.qkv.weight, self.qkv.bias)``) is left alone too: a mask on its input would not apply there,
    and the wrapper would make that code fail. torch.fx finds these uses by tracing the model (a warning says when it
    cannot and no ``example_input`` is given). With ``example_input``, the new model is also run once on it (in eval
    mode, without gradients, every module's mode restored): a layer it reads through its wrapper, or whose wrapper
    it fails in, is left alone with the reason and the decision is made again without it, so that the returned
    model runs where the original does.

    Args:
        model: the network; not modified unless ``inplace``.
        n: number of masks (ensemble members).
        scale: overlap control, >= 1.
        seed: seed of the per-layer seeds (None: fresh entropy; the report lists the seeds used).
        before: module types, or a predicate ``(path, module) -> bool`` that chooses the layers by name or type.
        start: path of the module from which insertion begins (None: the whole model).
        include_first: also mask the input of the network's first layers (the raw input).
        inplace: change ``model`` itself instead of a deep copy.
        example_input: a batch for ``model`` to run the new model on once, as the model is called: a tensor, a tuple
            of its inputs (``model(*inputs)``) or a dict of keyword inputs (``model(**inputs)``).

    Returns:
        the model with Masked layers and a ``masksembles_report`` attribute (a ``LayerReport``).

    Raises:
        ValueError: invalid ``n``/``scale``/``seed``, a ``start`` that names no module, no layer to mask, or a model
            that fails on ``example_input`` outside every masked layer (or without masks).
        TypeError: ``before`` is neither module types nor a callable.
    """
    n, scale, seed = check_insert_arguments(n, scale, seed, start)
    select = _selector(before)
    default = isinstance(before, tuple | list) and set(before) == set(DEFAULT_BEFORE)
    if default:  # also the linear layers of transformers that are not nn.Linear (GPT-2's Conv1D)
        select = functools.partial(_default_selection, select)
    if not inplace:
        model = copy.deepcopy(model)
    paths = _paths(model)
    order = [path for path, _ in model.named_modules(remove_duplicate=False) if path]
    selected = [(path, module) for path, module in model.named_modules() if path and select(path, module)]
    candidates = [
        _candidate(model, path, module, paths[id(module)], default)
        for path, module in selected
        if not isinstance(module, Masked | Masksembles)
    ]
    chosen = {path for path, _ in selected}
    layers = [
        path for path, module in model.named_modules() if path and (isinstance(module, INPUT_LAYERS) or path in chosen)
    ]
    graph = _trace_model(model, set(layers))
    first = _first_layers(model, layers, graph)  # the network's first layers: they read the raw input
    if isinstance(graph, str):
        reasons: dict[str, str] = {}
        if example_input is None:
            warnings.warn(
                f"insert: {graph}; layers whose weights the model uses without calling them cannot be found: pass "
                "example_input= to check the new model",
                stacklevel=2,
            )
    else:
        reasons = _used_outside(model, graph, [candidate.path for candidate in candidates if not candidate.reason])
    while True:  # each round leaves at least one more layer alone, until the model runs (or nothing is left)
        report = plan_insertion(
            [dataclasses.replace(c, reason=c.reason or reasons.get(c.path, "")) for c in candidates],
            order,
            n,
            scale,
            seed=seed,
            start=start,
            include_first=include_first,
            first_layers=first,
        )
        wrappers = _wrap(model, report)
        keep_masks_off_fused_paths(model)
        failed = {} if example_input is None else _run_once(model, example_input, wrappers)
        if not failed:
            holders = {
                wrapper.masksembles: model.get_submodule(path.rpartition(".")[0]) for path, wrapper in wrappers.items()
            }
            _declare_batch_axes(model, example_input, holders)
            return _attach(model, report)
        _unwrap(model, wrappers)
        reasons.update(failed)


# --- convert_dropout: reading the model with torch.fx -----------------------------------------------------------------

DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
# functional dropouts -> (name in the report, channels on axis 1 by definition)
DROPOUT_FUNCTIONS: dict[Callable[..., Any], tuple[str, bool]] = {
    F.dropout: ("F.dropout", False),
    F.dropout1d: ("F.dropout1d", True),
    F.dropout2d: ("F.dropout2d", True),
    F.dropout3d: ("F.dropout3d", True),
    torch.dropout: ("torch.dropout", False),
}
ATTENTION_NAMES = frozenset({"attn_drop", "attn_dropout", "attention_drop", "attention_dropout"})
SOFTMAX = "softmax"
# What produced a tensor -> the axis of its channels (1: channels first, -1: channels last).
CHANNELS_FIRST_MODULES = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.modules.pooling._LPPoolNd,
    nn.Upsample,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
)
SEQUENCE_MODULES = (  # attention, recurrent and transformer modules: channels last, and they mix the channels
    nn.MultiheadAttention,
    nn.RNNBase,
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)
FEED_FORWARD_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)  # their linear1, linear2 are called
CHANNELS_LAST_MODULES = (
    nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.RMSNorm, *SEQUENCE_MODULES,
)  # fmt: skip
CHANNELS_FIRST_FUNCTIONS = frozenset(
    {
        F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
        F.batch_norm, F.instance_norm, F.group_norm, F.interpolate,
        F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
        F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
        F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
        F.dropout1d, F.dropout2d, F.dropout3d,
    }
)  # fmt: skip
CHANNELS_LAST_FUNCTIONS = frozenset(
    {F.linear, F.bilinear, F.embedding, F.layer_norm, F.rms_norm, F.scaled_dot_product_attention,
     torch.matmul, torch.bmm, operator.matmul}
)  # fmt: skip
CHANNELS_LAST_METHODS = frozenset({"matmul", "bmm"})
SOFTMAX_FUNCTIONS = frozenset({F.softmax, torch.softmax})
# What mixes the channels of the raw input: a dropout after one of these does not read the raw input.
MIXING_MODULES = (*INPUT_LAYERS, nn.Bilinear, *SEQUENCE_MODULES)
MIXING_FUNCTIONS = (CHANNELS_LAST_FUNCTIONS - {F.layer_norm, F.rms_norm}) | {
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
}
# Ops that may keep a shape but move the channels: the search for the producer stops there.
PERMUTING = frozenset({"permute", "transpose", "t", "movedim", "moveaxis", "swapaxes", "swapdims"})
# Reshapes: where one keeps the last axis, channels-last producers before it still give the axis (-1).
RESHAPING = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten"})
RESHAPED = "reshaped"
# The same for the ATen operations of a torch.export graph (the model read with torch.export when torch.fx cannot
# trace it), by operation name.
ATEN_CHANNELS_FIRST = frozenset(
    {"convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
     "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
     "instance_norm", "group_norm", "native_group_norm", "max_pool1d", "max_pool2d", "max_pool3d",
     "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d", "avg_pool3d",
     "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
     "adaptive_max_pool2d", "adaptive_max_pool3d", "upsample_nearest2d", "upsample_bilinear2d", "feature_dropout"}
)  # fmt: skip
ATEN_CHANNELS_LAST = frozenset(
    {"linear", "addmm", "mm", "matmul", "bmm", "baddbmm", "embedding", "layer_norm", "native_layer_norm", "rms_norm",
     "scaled_dot_product_attention"}
)  # fmt: skip
ATEN_SOFTMAX = frozenset({"softmax", "_softmax", "_safe_softmax"})
ATEN_MIXING = (ATEN_CHANNELS_LAST - {"layer_norm", "native_layer_norm", "rms_norm"}) | {
    "convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"
}  # fmt: skip
ATEN_DROPOUT = "dropout"
ATEN_ATTENTION = "scaled_dot_product_attention"
WRAPPED = "model"  # the model's attribute in the module torch.export reads it through


def _per_sample(module: nn.Module) -> bool:
    """Stochastic depth (torchvision ``StochasticDepth``, timm ``DropPath``, look-alikes), recognized by class name."""
    name = type(module).__name__.lower().replace("_", "")
    return "droppath" in name or "stochasticdepth" in name


class _Tracer(fx.Tracer):
    """Keeps dropouts, Masksembles and per-sample dropouts as calls; records how traced-through modules are called."""

    def __init__(self, leaves: set[str] | None = None) -> None:
        super().__init__()
        self.calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
        self.leaves = leaves or set()  # more modules kept as calls, by path

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        special = isinstance(m, (*DROPOUT_TYPES, Masksembles)) or _per_sample(m) or module_qualified_name in self.leaves
        return special or super().is_leaf_module(m, module_qualified_name)

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        path = self.path_of_module(m)
        if not self.is_leaf_module(m, path):
            self.calls.setdefault(path, []).append((args, kwargs))
        return super().call_module(m, forward, args, kwargs)


class _OwnTracer(fx.Tracer):
    """Traces a module's own ``forward`` only: every submodule stays a call."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


@dataclass
class _Traced:
    """The model as torch.fx sees it, with shapes from the example input (``graph`` None when it failed), or, where
    torch.fx cannot trace it, as torch.export sees it in training mode (``exported``: a graph of ATen operations,
    every dropout a call, ``inputs`` the names of its placeholders that are the model's inputs)."""

    graph: fx.Graph | None
    modules: dict[str, nn.Module]
    calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = field(default_factory=dict)
    failure: str = ""
    exported: bool = False
    inputs: frozenset[str] | None = None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _positional(model: nn.Module, inputs: Inputs) -> tuple[Any, ...]:
    """``inputs`` as the positional arguments of ``model.forward`` (a dict bound to its parameters, defaults filled)."""
    if not isinstance(inputs, Mapping):
        return inputs if isinstance(inputs, tuple) else (inputs,)
    bound = inspect.signature(model.forward).bind(**inputs)
    bound.apply_defaults()
    if bound.kwargs:
        raise TypeError(f"inputs {sorted(bound.kwargs)} are not parameters of forward that torch.fx can pass")
    return bound.args


def _output_tensors(output: object) -> list[Tensor]:
    """The tensors of a model's output (in tuples, lists, dicts and dataclasses such as ``ModelOutput``)."""
    if isinstance(output, Tensor):
        return [output]
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        output = [getattr(output, item.name) for item in dataclasses.fields(output)]
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, tuple | list):
        return [tensor for item in output for tensor in _output_tensors(item)]
    return []  # an object torch.export cannot return (a key-value cache): its tensors are not needed here


class _TensorOutputs(nn.Module):
    """``model`` returning only the tensors of its output, which torch.export can return whatever their holder."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        setattr(self, WRAPPED, model)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
        return tuple(_output_tensors(getattr(self, WRAPPED)(*args, **kwargs)))


def _export(model: nn.Module, inputs: Inputs) -> tuple[fx.Graph, frozenset[str]] | str:
    """``model`` read by torch.export in training mode (every dropout a call, scaled_dot_product_attention with its
    ``dropout_p``) on ``inputs``, with the names of the placeholders that are inputs; or why it could not be."""
    args, kwargs = ((), dict(inputs)) if isinstance(inputs, Mapping) else (_positional(model, inputs), {})
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        program = torch.export.export(_TensorOutputs(model), args, kwargs, strict=False)
    except Exception as error:
        return f"nor could torch.export ({_first_line(error)})"
    finally:
        for module, mode in modes:
            module.training = mode
    return program.graph, frozenset(program.graph_signature.user_inputs)


def _trace(model: nn.Module, inputs: Inputs) -> _Traced:
    """``model`` read with torch.fx (shapes from ``inputs``), or with torch.export where torch.fx cannot trace it."""
    modules = dict(model.named_modules())
    tracer = _Tracer()
    try:
        graph = tracer.trace(model)
        ShapeProp(fx.GraphModule(model, graph)).propagate(*_positional(model, inputs))
    except Exception as error:  # anything torch.fx cannot follow: torch.export, else the rank rule takes over
        failure = f"torch.fx could not trace the model ({_first_line(error)})"
        exported = _export(model, inputs)
        if isinstance(exported, str):
            return _Traced(None, modules, failure=f"{failure}; {exported}")
        return _Traced(exported[0], modules, exported=True, inputs=exported[1])
    return _Traced(graph, modules, tracer.calls)


def _aten(target: object) -> str | None:
    """The name of an ATen operation (``"linear"`` for ``aten.linear.default``), None for anything else."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target._opname
    return None


def _exported_path(node: fx.Node) -> str:
    """The path in the model of the module whose own ``forward`` made this call of a torch.export graph."""
    path = _owner(node)[0]
    return "" if path == WRAPPED else path.removeprefix(f"{WRAPPED}.")


def _shape(node: object) -> tuple[int | None, ...] | None:
    """The shape of a tensor node (None for anything else), a size only the data decides (the tokens a boolean mask
    picks, in a torch.export graph) None."""
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta.get("tensor_meta")
    value = node.meta.get("val")  # torch.export's fake tensor
    sizes = meta.shape if isinstance(meta, TensorMetadata) else value.shape if isinstance(value, Tensor) else None
    return None if sizes is None else tuple(int(size) if has_guarding_hint(size) else None for size in sizes)


def _known(shape: tuple[int | None, ...] | None) -> bool:
    return shape is not None and None not in shape


def _sort_key(shape: Sequence[int | None]) -> tuple[int, ...]:
    return tuple(-1 if size is None else size for size in shape)


def _kind(node: fx.Node, modules: dict[str, nn.Module]) -> int | str | None:
    """What ``node`` says about the channel axis of its output: 1, -1, ``SOFTMAX``, ``"through"`` (the same shape
    as an input, with channels where they were: look further back), ``RESHAPED`` (a reshape of its first argument)
    or None (unknown)."""
    if node.op == "call_module":
        module = modules[cast(str, node.target)]
        if isinstance(module, CHANNELS_FIRST_MODULES):
            return 1
        if isinstance(module, CHANNELS_LAST_MODULES):
            return -1
        return SOFTMAX if isinstance(module, nn.Softmax) else "through"
    if node.op == "call_function":
        target = node.target
        name = _aten(target)
        if name is not None:
            if name in ATEN_CHANNELS_FIRST:
                return 1
            if name in ATEN_CHANNELS_LAST:
                return -1
            if name in ATEN_SOFTMAX:
                return SOFTMAX
            if name in RESHAPING:
                return RESHAPED
            return None if name in PERMUTING else "through"
        if target is operator.getitem and isinstance(node.args[0], fx.Node) and _shape(node.args[0]) is None:
            source = _kind(node.args[0], modules)  # an item of a tuple output (nn.MultiheadAttention, LSTM)
            return None if source == "through" else source
        if target in CHANNELS_FIRST_FUNCTIONS:
            return 1
        if target in CHANNELS_LAST_FUNCTIONS:
            return -1
        if target in SOFTMAX_FUNCTIONS:
            return SOFTMAX
        name = getattr(target, "__name__", "")
        return RESHAPED if name in RESHAPING else None if name in PERMUTING else "through"
    if node.op == "call_method":
        if node.target in CHANNELS_LAST_METHODS:
            return -1
        if node.target == SOFTMAX:
            return SOFTMAX
        return RESHAPED if node.target in RESHAPING else None if node.target in PERMUTING else "through"
    return None


def _producers(node: object, modules: dict[str, nn.Module]) -> set[int | str]:
    """Channel axes (and ``SOFTMAX``) found walking back from ``node`` through shape-preserving elementwise ops, and
    through reshapes that keep the last axis (only a last-axis producer, -1, or a softmax counts behind those: a
    Linear's (B*L, C) output viewed as (B, L, C))."""
    found: set[int | str] = set()
    stack: list[tuple[fx.Node, bool]] = [(node, False)] if isinstance(node, fx.Node) else []
    seen: set[tuple[fx.Node, bool]] = set()
    while stack:
        current, last_only = stack.pop()
        if (current, last_only) in seen:
            continue
        seen.add((current, last_only))
        kind = _kind(current, modules)
        shape = _shape(current)
        if kind == "through":
            stack += [(arg, last_only) for arg in current.all_input_nodes if _known(shape) and _shape(arg) == shape]
        elif kind == RESHAPED:
            source = current.args[0] if current.args else None
            before = _shape(source)
            if isinstance(source, fx.Node) and shape is not None and before is not None:
                if _known(shape) and before == shape:
                    stack.append((source, last_only))
                elif len(before) >= 2 and len(shape) >= 2 and before[-1] is not None and before[-1] == shape[-1]:
                    stack.append((source, True))
        elif kind is not None and (not last_only or kind in (-1, SOFTMAX)):
            found.add(kind)
    return found


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode without gradients; every module's own mode is restored afterwards."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, mode in modes:
            module.training = mode


def _input_shapes(
    model: nn.Module, inputs: Inputs, modules: Sequence[nn.Module]
) -> tuple[dict[int, list[Any]], set[int]]:
    """Input shape of every call of each of ``modules`` on ``inputs`` (one forward pass), and the ids of the modules
    called on one of ``inputs`` itself."""
    seen: dict[int, list[Any]] = {id(module): [] for module in modules}
    on_inputs: set[int] = set()

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0] if args else next(iter(kwargs.values()))
        seen[id(module)].append(tuple(x.shape))
        if any(x is tensor for _, tensor in batched_tensors(inputs)):
            on_inputs.add(id(module))

    hooks = [module.register_forward_pre_hook(record, with_kwargs=True) for module in modules]
    try:
        call(model, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen, on_inputs


# --- convert_dropout: deciding and replacing ------------------------------------------------------------------------


@dataclass
class _Site:
    """A dropout: a module (all its calls) or a functional call of one module's ``forward`` (its call in each call
    of that module)."""

    path: str
    layer: str
    p: float
    channels_first: bool  # Dropout1d/2d/3d: channels on axis 1 by definition
    nodes: list[fx.Node]  # its calls in the traced graph (empty when torch.fx did not see them)
    shapes: list[Any]  # its input shapes, one per call (empty when the example input does not reach it)
    failure: str = ""  # why it cannot be replaced


def _calls(node: fx.Node, path: str, traced: _Traced) -> bool:
    """Whether ``node`` is a call of the dropout module at ``path``."""
    if traced.exported:
        return _aten(node.target) == ATEN_DROPOUT and _exported_path(node) == path
    return node.op == "call_module" and node.target == path


def _module_site(path: str, module: nn.Module, traced: _Traced, shapes: list[Any]) -> _Site:
    """A dropout module as a site: its calls in the traced graph, its input shapes from there or else from the run."""
    nodes = [node for node in (traced.graph.nodes if traced.graph is not None else ()) if _calls(node, path, traced)]
    return _Site(
        path,
        type(module).__name__,
        cast(float, module.p),
        isinstance(module, nn.Dropout1d | nn.Dropout2d | nn.Dropout3d),
        nodes,
        [_shape(node.args[0]) for node in nodes] if nodes else shapes,
    )


def _decide(site: _Site, traced: _Traced, channel_axis: int | None) -> Candidate:
    """``site`` as a candidate for ``plan_conversion``: its channels and axis, or the reason to leave it (module
    docstring of ``convert_dropout``)."""

    def left(reason: str) -> Candidate:
        return Candidate(site.path, site.layer, 0, 1, reason=reason)

    name = site.path.rpartition(".")[2]
    if site.p == 0:
        return left("p=0: it does nothing")
    if name.lower() in ATTENTION_NAMES:
        return left(f"attention-weight dropout (named {name!r}): its input is attention weights, not channels")
    if site.failure:
        return left(site.failure)
    if not site.shapes:
        return left("not reached by the example input")
    producers = [_producers(node.args[0], traced.modules) for node in site.nodes]
    if any(SOFTMAX in found for found in producers):
        return left("attention-weight dropout: its input is a softmax output, not channels")
    if any(not node.users for node in site.nodes):
        return left("its result is not used (an in-place call): masks would change nothing")
    why = traced.failure or (
        "torch.export did not see this call (in training mode)"
        if traced.exported
        else "torch.fx did not see this call (inside a module it does not trace into)"
    )
    choices: set[tuple[int, int]] = set()
    notes: set[str] = set()
    for index, shape in enumerate(site.shapes):
        rank = len(shape)
        if rank < 2:
            return left(f"a {rank}-D input has no channel axis")
        axes = producers[index] - {SOFTMAX} if site.nodes else set()
        if channel_axis is not None:
            axis = channel_axis
        elif site.channels_first:
            axis = 1
        elif len(axes) == 1:
            axis = cast(int, axes.pop())
        else:
            axis = 1 if rank in (4, 5) else -1
            if rank > 2:
                source = "the producer of its input is not recognized" if site.nodes else why
                notes.add(f"axis {axis} from the input's rank ({rank}-D): {source}")
        if not (-rank <= axis < rank) or axis % rank == 0:
            return left(f"channel_axis={axis} is not a channel axis of its {rank}-D input")
        if shape[axis] is None:
            return left(f"its channel axis {axis} has a size only the data decides")
        choices.add((shape[axis], axis))
    if len(choices) > 1:
        return left(f"called on inputs with different channels: {sorted(set(site.shapes), key=_sort_key)}")
    ((channels, axis),) = choices
    return Candidate(site.path, site.layer, channels, axis, note="; ".join(sorted(notes)))


def _argument(node: fx.Node, name: str, position: int, default: object) -> object:
    return node.kwargs.get(name, node.args[position] if len(node.args) > position else default)


def _is_dropout_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in DROPOUT_FUNCTIONS


def _owner(node: fx.Node) -> tuple[str, str]:
    """(path of the module whose own ``forward`` made this call, key of that module call)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "", ""
    key, (path, _) = next(reversed(stack.items()))
    return cast(str, path), cast(str, key)


def _concrete_arguments(module: nn.Module, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> dict[str, Any]:
    """The non-tensor arguments ``module`` was called with (defaults included), the same in every call."""

    def has_proxy(value: object) -> bool:
        if isinstance(value, tuple | list):
            return any(has_proxy(item) for item in value)
        if isinstance(value, dict):
            return any(has_proxy(item) for item in value.values())
        return isinstance(value, fx.Proxy)

    signature = inspect.signature(module.forward)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    found: list[dict[str, Any]] = []
    for args, kwargs in calls:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        found.append(
            {
                name: value
                for name, value in bound.arguments.items()
                if signature.parameters[name].kind in kinds and not has_proxy(value)
            }
        )
    if any(arguments != found[0] for arguments in found[1:]):
        raise ValueError(f"it is called with different arguments: {found}")
    return found[0] if found else {}


@dataclass
class _Owner:
    """A module whose own ``forward`` calls a functional dropout, traced on its own."""

    path: str
    module: nn.Module
    graph: fx.Graph
    calls: list[fx.Node]  # its functional dropout calls, in order
    names: list[str]  # the attribute each call's Masksembles layer gets (the call's name, unless taken)
    layers: dict[int, Masksembles] = field(default_factory=dict)  # index in calls -> its layer


def _functional_sites(model: nn.Module, traced: _Traced) -> list[tuple[_Site, _Owner | None, int]]:
    """Every functional dropout call of the traced model as (site, its owner traced alone, its index there)."""
    by_owner: dict[str, dict[str, list[fx.Node]]] = {}
    for node in traced.graph.nodes if traced.graph is not None else ():
        if _is_dropout_call(node):
            path, key = _owner(node)
            by_owner.setdefault(path, {}).setdefault(key, []).append(node)
    sites: list[tuple[_Site, _Owner | None, int]] = []
    for path, per_call in by_owner.items():
        module = model.get_submodule(path)
        owner, failure = None, ""
        counts = {len(nodes) for nodes in per_call.values()}
        try:
            with _evaluating(model):
                concrete = _concrete_arguments(module, traced.calls[path]) if path else {}
                graph = _OwnTracer().trace(module, concrete_args=concrete or None)
            calls = [node for node in graph.nodes if _is_dropout_call(node)]
            if {len(calls)} != counts:
                raise ValueError(f"its trace has {len(calls)} dropout calls, not {counts}")
            names: list[str] = []
            for call in calls:
                names.append(call.name)
                while hasattr(module, names[-1]) or names[-1] in names[:-1]:
                    names[-1] += "_masks"
            owner = _Owner(path, module, graph, calls, names)
        except Exception as error:  # the calls stay, reported with the reason
            failure = f"torch.fx could not trace {path or 'the model'!r} on its own ({_first_line(error)})"
        for index in range(max(counts)):
            nodes = [call[index] for call in per_call.values() if index < len(call)]
            label, channels_first = DROPOUT_FUNCTIONS[cast(Callable[..., Any], nodes[0].target)]
            local = owner.names[index] if owner is not None else nodes[0].name
            p = _argument(nodes[0], "p", 1, 0.5)
            site = _Site(
                f"{path}.{local}" if path else local,
                label,
                float(p) if isinstance(p, int | float) else float("nan"),
                channels_first,
                nodes,
                [_shape(node.args[0]) for node in nodes],
                failure,
            )
            sites.append((site, owner, index))
    return sites


def _attention_rates(traced: _Traced) -> list[tuple[str, float, fx.Node]]:
    """(path of the calling module, rate, call) of every dropout of attention weights in a torch.export graph (read
    in training mode, where models pass their rates): scaled_dot_product_attention calls with a ``dropout_p``, and
    functional dropouts of a softmax output (``transformers``' eager attention)."""
    found: list[tuple[str, float, fx.Node]] = []
    for node in traced.graph.nodes if traced.exported and traced.graph is not None else ():
        owner, name = _exported_path(node), _aten(node.target)
        if name == ATEN_ATTENTION:
            p = _argument(node, "dropout_p", 4, 0.0)
        elif name == ATEN_DROPOUT and _functional(node, traced) and SOFTMAX in _producers(node.args[0], traced.modules):
            p = _argument(node, "p", 1, 0.5)
        else:
            continue
        if isinstance(p, int | float) and p > 0:
            found.append((owner, float(p), node))
    return found


def _functional(node: fx.Node, traced: _Traced) -> bool:
    """Whether a dropout call of a torch.export graph is a functional one (not a dropout module's)."""
    return not isinstance(traced.modules.get(_exported_path(node)), DROPOUT_TYPES)


def _rate_reason(path: str, p: float, rates: list[tuple[str, float, fx.Node]], modules: dict[str, nn.Module]) -> str:
    """Why a dropout module the model never calls is an attention-weight dropout: its parent module uses its ``p``
    for an attention-weight dropout in ``rates`` (Hugging Face ``transformers``' attention keeps the module for its
    rate); "" if none. The entry found is removed from ``rates``."""
    parent = path.rpartition(".")[0]
    for index, (owner, rate, node) in enumerate(rates):
        if owner == parent and rate == p:
            del rates[index]
            attention = _aten(node.target) == ATEN_ATTENTION
            use = "the dropout_p of scaled_dot_product_attention" if attention else "the rate of F.dropout on a softmax"
            return attention_dropout_reason(f"never called: its p is {use} in {_user(owner, modules)}")
    return ""


def _exported_sites(traced: _Traced, rates: list[tuple[str, float, fx.Node]]) -> list[_Site]:
    """What a torch.export graph shows besides dropout modules, reported and left as is: functional dropout calls
    (only a model torch.fx traces has its calls converted) and the attention-weight dropouts of ``rates`` (those no
    module row reports). Each is named ``<path of the calling module>.<operation>[_<i>]``."""
    sites: list[_Site] = []
    taken = set(traced.modules)
    left = {node: p for _, p, node in rates}

    def named(owner: str, operation: str) -> str:
        base = f"{owner}.{operation}" if owner else operation
        name, count = base, 0
        while name in taken:
            count += 1
            name = f"{base}_{count}"
        taken.add(name)
        return name

    for node in traced.graph.nodes if traced.exported and traced.graph is not None else ():
        owner, operation = _exported_path(node), _aten(node.target)
        shapes = [_shape(node.args[0])] if node.args else []
        if operation == ATEN_ATTENTION and node in left:
            reason = attention_dropout_reason(f"dropout_p={left[node]:g} of scaled_dot_product_attention")
            name = named(owner, "scaled_dot_product_attention")
            sites.append(_Site(name, "F.scaled_dot_product_attention", left[node], False, [node], shapes, reason))
        elif operation == ATEN_DROPOUT and _functional(node, traced):
            p = float(cast(float, _argument(node, "p", 1, 0.5)))
            if SOFTMAX in _producers(node.args[0], traced.modules):
                if node not in left and p > 0:
                    continue  # a dropout module's rate, reported on its row
                reason = "attention-weight dropout: its input is a softmax output, not channels"
            else:
                reason = (
                    "a functional dropout seen by torch.export: only a model torch.fx traces has its calls converted"
                )
            sites.append(_Site(named(owner, "dropout"), "F.dropout", p, False, [node], shapes, reason))
    return sites


def _rewrite(owner: _Owner) -> fx.GraphModule:
    """``owner``'s traced ``forward`` with each converted dropout call replaced by its Masksembles submodule."""
    rewritten = fx.GraphModule(owner.module, owner.graph, class_name=type(owner.module).__name__)
    for index, layer in owner.layers.items():
        node, name = owner.calls[index], owner.names[index]
        rewritten.add_submodule(name, layer)
        with rewritten.graph.inserting_after(node):
            call = rewritten.graph.call_module(name, (node.args[0],))
        node.replace_all_uses_with(call)
        rewritten.graph.erase_node(node)
    rewritten.recompile()
    return rewritten.train(owner.module.training)


def _input_dropouts(sites: Sequence[_Site], traced: _Traced, on_inputs: set[int]) -> set[str]:
    """The paths of the dropouts among ``sites`` that read the raw input: computed from the inputs alone, through
    nothing that mixes channels (``MIXING_MODULES``, ``MIXING_FUNCTIONS``, ``matmul``/``bmm`` methods,
    ``ATEN_MIXING``) and no other dropout in the traced or exported graph; without a graph, the dropout modules
    called on an input itself."""
    if traced.graph is None:
        return {site.path for site in sites if id(traced.modules.get(site.path)) in on_inputs}

    def stop(node: fx.Node) -> bool:
        if node.op == "call_module":
            return isinstance(traced.modules[cast(str, node.target)], (*MIXING_MODULES, *DROPOUT_TYPES))
        if node.op == "call_method":
            return node.target in CHANNELS_LAST_METHODS
        name = _aten(node.target)
        if name is not None:
            return name in ATEN_MIXING or name == ATEN_DROPOUT
        return node.target in MIXING_FUNCTIONS or _is_dropout_call(node)

    reading = set(_reading_raw(traced.graph, stop, traced.inputs))
    return {site.path for site in sites if any(node in reading for node in site.nodes)}


def convert_dropout(
    model: nn.Module,
    example_input: Inputs,
    n: int,
    scale: float,
    *,
    seed: int | None = None,
    channel_axis: int | None = None,
    include_first: bool = False,
    inplace: bool = False,
) -> nn.Module:
    """Replace the channel dropouts of ``model`` by Masksembles layers: the paper's drop-in for MC-Dropout.

    Converted: ``nn.Dropout``/``Dropout1d/2d/3d`` modules and ``F.dropout``/``F.dropout1d/2d/3d``/``torch.dropout``
    calls. The channel count and axis come from the input each one receives on ``example_input`` (in eval mode,
    without gradients): axis 1 for ``Dropout1d/2d/3d``; for ``nn.Dropout`` and ``F.dropout`` the axis of the layer
    that produced the tensor, found with torch.fx through elementwise ops (Conv1d/2d/3d, BatchNorm, pooling: 1, so a
    Conv1d's (B, C, L) gets masks over C; Linear, LayerNorm, attention, RNNs: -1), unless ``channel_axis`` is given.
    A model torch.fx cannot trace (Hugging Face ``transformers`` models) is read with torch.export in training mode
    instead (neither the model nor the example changed): producers are its ATen operations, and reshapes that keep
    the last axis are followed for a channels-last producer (GPT-2's ``Conv1D``). Where neither can tell (a model
    neither reads, an unrecognized producer) the input's rank decides, 1 for 4-D and 5-D inputs and -1 otherwise,
    and the report says so. Left as is, each with its reason in the report: ``p=0`` dropouts (they do nothing),
    attention-weight dropouts (input from a softmax, or named ``attn_drop``, ``attention_dropout``, ...; a dropout
    module that is never called while its parent passes its ``p`` to ``F.scaled_dot_product_attention`` as
    ``dropout_p`` or to an ``F.dropout`` of a softmax, as ``transformers``' attention does), the
    ``scaled_dot_product_attention`` calls of a torch.export graph with a ``dropout_p`` of their own and its other
    functional dropout calls (converted only where torch.fx traces the model), dropouts the example input does not
    reach, calls whose result is unused, and per-sample dropouts (modules named like ``DropPath`` or
    ``StochasticDepth``, which are not channel dropout). ``example_input`` is a tensor, a tuple of the model's inputs
    or a dict of its keyword inputs.

    The rest is decided by ``masksembles_core.insertion.plan_conversion``, with ``insert``'s rules: a dropout with a
    single input channel or too few for ``n`` distinct masks is left as is, and so is one that reads the raw input
    (computed from the inputs alone, through no convolution, linear or embedding layer; without a graph, a dropout
    module called on an input itself) unless ``include_first``. The ``i``-th converted dropout (modules in
    ``named_modules`` order, then calls) gets masks from ``masksembles_core.derive_seed(seed, i)``.

    Dropout modules are replaced in place (at every path they are registered at); the other modules, their classes
    and every trained weight are kept. A module whose own ``forward`` calls a functional dropout (timm's heads call
    ``F.dropout``) is replaced by a ``torch.fx.GraphModule`` of that ``forward`` traced in eval mode (its submodules
    kept, the converted call now a Masksembles submodule): the model itself when the call is in its ``forward``.

    Returns:
        the converted model, with a ``masksembles_report`` attribute (a ``LayerReport``): a deep copy unless
        ``inplace``, and a GraphModule when the model's own ``forward`` calls a converted functional dropout.

    Raises:
        ValueError: invalid ``n``/``scale``/``seed``/``channel_axis``, or no dropout converted (the message holds the
            report).
    """
    n, scale, seed = check_insert_arguments(n, scale, seed, None)
    if channel_axis is not None:
        mca.check_channel_axis(channel_axis)
    if not inplace:
        model = copy.deepcopy(model)
    inputs = example_input
    dropouts = [(path, module) for path, module in model.named_modules() if isinstance(module, DROPOUT_TYPES)]
    with _evaluating(model), _without_nested_tensors(model):
        shapes, on_inputs = _input_shapes(model, inputs, [module for _, module in dropouts])
        traced = _trace(model, inputs)
    if traced.failure:
        axes = "channel axes follow the input's rank and " if channel_axis is None else ""
        warnings.warn(f"convert_dropout: {traced.failure}; {axes}F.dropout calls are not converted", stacklevel=2)
    paths = _paths(model)
    rates = _attention_rates(traced)
    candidates: list[Candidate] = []
    sites: list[_Site] = []
    targets: list[nn.Module | tuple[_Owner | None, int] | None] = []  # what each candidate's masks replace
    for path, module in model.named_modules():
        if _per_sample(module):
            candidates.append(Candidate(path, type(module).__name__, 0, 1, reason=PER_SAMPLE))
            targets.append(None)
        elif isinstance(module, DROPOUT_TYPES):
            sites.append(_module_site(path, module, traced, shapes[id(module)]))
            if not sites[-1].shapes:
                sites[-1].failure = _rate_reason(path, sites[-1].p, rates, traced.modules)
            candidates.append(_decide(sites[-1], traced, channel_axis))
            targets.append(module)
    for site, owner, index in _functional_sites(model, traced):
        sites.append(site)
        candidates.append(_decide(site, traced, channel_axis))
        targets.append((owner, index))
    for site in _exported_sites(traced, rates):
        sites.append(site)
        candidates.append(_decide(site, traced, channel_axis))
        targets.append(None)
    kinds = "nn.Dropout/Dropout1d/Dropout2d/Dropout3d modules or F.dropout calls"
    first = _input_dropouts(sites, traced, on_inputs)
    report = plan_conversion(
        candidates, n, scale, seed=seed, first_layers=first, include_first=include_first, converts=kinds
    )
    owners: dict[str, _Owner] = {}
    placed: dict[str, tuple[nn.Module, Masksembles]] = {}  # converted modules: path -> (the dropout, its masks)
    holders: dict[Masksembles, nn.Module] = {}
    for row, target in zip(report.rows, targets, strict=True):
        if row.action != CONVERTED or target is None:
            continue
        if isinstance(target, nn.Module):
            holder = model.get_submodule(paths[id(target)][0].rpartition(".")[0])
            layer = _masksembles(row, n, scale, model, target.training)
            placed[row.path] = (target, layer)
            _replace(model, paths[id(target)], layer)
        else:
            owner, index = target
            assert owner is not None, "a call is converted only where its owner was traced"
            holder = owner.module
            layer = owner.layers[index] = _masksembles(row, n, scale, model, owner.module.training)
            owners[owner.path] = owner
        holders[layer] = holder
    for path in sorted(owners, key=lambda p: -1 if not p else p.count("."), reverse=True):
        rewritten = _rewrite(owners[path])
        if path:
            _replace(model, paths[id(owners[path].module)], rewritten)
        else:
            model = rewritten
    keep_masks_off_fused_paths(model)
    _declare_batch_axes(model, inputs, holders)
    skipped = _skipped_at_inference(model, inputs, {path: layer for path, (_, layer) in placed.items()})
    for path in skipped:
        _replace(model, paths[id(placed[path][0])], placed[path][0])
    if skipped:
        report = leave_converted(report, skipped, SKIPPED_AT_INFERENCE, kinds)
    return _attach(model, report)


SKIPPED_AT_INFERENCE = (
    "not called when the model runs in eval without gradients, as predict runs it (a module's fused inference path "
    "skips it)"
)


def keep_masks_off_fused_paths(model: nn.Module) -> None:
    """torch's ``TransformerEncoder`` may turn a padded batch into a nested tensor for its layers' fused inference
    path (eval, no gradients, a padding mask). Every Masksembles layer keeps the layer holding it off that fused path
    (its hook, ``_layers._off_fused_paths``), and an encoder whose layers hold Masksembles layers (placed by
    ``insert``, ``convert_dropout`` or by hand: ``predict`` and ``pack`` call this too) keeps its batch padded
    (``use_nested_tensor = False``). Inference then applies the masks as training does, on the same path."""
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder) and any(isinstance(m, Masksembles) for m in module.modules()):
            module.use_nested_tensor = False


@contextlib.contextmanager
def _without_nested_tensors(model: nn.Module) -> Iterator[None]:
    """Every ``nn.TransformerEncoder`` of ``model`` keeps a padded batch padded (no nested tensor, which its layers'
    dropouts would then see), as it will once its layers hold masks; restored afterwards."""
    encoders = [(m, m.use_nested_tensor) for m in model.modules() if isinstance(m, nn.TransformerEncoder)]
    for encoder, _ in encoders:
        encoder.use_nested_tensor = False
    try:
        yield
    finally:
        for encoder, nested in encoders:
            encoder.use_nested_tensor = nested


def _skipped_at_inference(model: nn.Module, inputs: Inputs, layers: Mapping[str, Masksembles]) -> list[str]:
    """The paths of ``layers`` not called when ``model`` runs on ``inputs`` as ``predict`` runs it (eval, no
    gradients), which reached them with their dropouts' hooks on. Seen through a global hook, which turns no fused
    path off."""
    wanted = {id(layer) for layer in layers.values()}
    called: set[int] = set()

    def seen(module: nn.Module, args: tuple[Any, ...]) -> None:
        if id(module) in wanted:
            called.add(id(module))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(seen)
    try:
        with _evaluating(model):
            call(model, inputs)
    finally:
        handle.remove()
    return [path for path, layer in layers.items() if id(layer) not in called]
