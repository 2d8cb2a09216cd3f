"""Model surgery: ``insert`` (the paper's recipe) and ``convert_dropout``, on Sequential and functional models and
inside their custom layers.

Both run the same two steps. ``_survey`` lists every layer and operation of the model in graph order, with the
shape of the tensor each call reads, and the layers custom layers hold as attributes (their calls read by running
the model once, ``_trace``); the rule of ``masksembles_core.insertion`` (``plan_insertion`` for ``insert``,
``plan_conversion`` for ``convert_dropout``) decides where masks go; ``_Rebuilder`` builds a new model with a
Masksembles layer in front of (``insert``) or in place of (``convert_dropout``) the chosen layers and copies every
other layer and operation with its weights, so the input model is never modified. What a rebuilt graph cannot hold
(a layer inside a custom layer, a layer of a functional model whose class builds its own graph) is changed in place
in that copy (``_rewire``). ``_read_raw`` follows the raw input from the model's inputs through the graph to the
layers that read it alone: the network's first layers (for ``convert_dropout``, the dropouts it reaches through no
layer that mixes channels).

Paths: a layer of the model is its name (``"conv2"``); a layer of a nested Sequential/functional model is
``"<nested model name>/<layer name>"`` (nesting repeats), as in Keras' variable paths. A layer a custom layer holds
is ``"<custom layer path>/<layer name>"``. A layer held twice (by two custom layers, or called by the graph and held
by a custom layer: a tied projection reading an embedding's matrix, say) is left alone: masks before one call would
not reach the other use of its weights.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import keras
from keras import ops

from masksembles_core.insertion import (
    CONVERTED,
    ZERO_RATE,
    Candidate,
    attention_dropout_reason,
    check_insert_arguments,
    plan_conversion,
    plan_insertion,
    used_outside_its_call,
)

from ._inference import _no_autograd
from ._layers import Masksembles, Masksembles1D, Masksembles2D, Masksembles3D
from ._rewire import (
    Locator,
    Rewired,
    Step,
    apply_change,
    held_layers,
    holder_of,
    mark_rewired,
    record,
    replace,
    resolve,
)

Shape = tuple[int | None, ...]
Predicate = Callable[[str, Any], bool]

# the convolutions and fully connected layers: an EinsumDense is one when its equation says so (_contraction_reason);
# a separable convolution's channels meet in its pointwise part, its depthwise part reads each one alone
DEFAULT_BEFORE = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)
DEPTHWISE_TYPES = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)  # listed by the default, left alone
INPUT_LAYERS = (  # the kinds of layer that read a network's raw input: those that do are its first layers
    *DEFAULT_BEFORE,
    *DEPTHWISE_TYPES,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.Embedding,
)
MIXING = (*INPUT_LAYERS, keras.layers.RNN)  # what mixes the raw input's channels (attention holds EinsumDense layers)
DEPTHWISE = "depthwise convolution: each output channel reads one input channel (before=... includes it)"
_MASKS_BY_RANK: dict[int, type[Masksembles]] = {2: Masksembles1D, 3: Masksembles1D, 4: Masksembles2D, 5: Masksembles3D}

REBUILD_ADVICE = "put masksembles_keras.Masksembles layers in its code, or build it as a functional model"


@dataclass
class _Site:
    """One layer or operation of the model, as the survey found it.

    Attributes:
        path: its path (module docstring).
        op: the layer or raw operation (``x + 1``, ``x[:, 0]``, a ``keras.ops`` call).
        locator: the steps from the model to it (``_rewire.resolve``; a graph's layers by name: ``_in_copy`` gives
            the steps to its copy).
        inputs: per call, the shape of the one tensor it reads (None: it reads several tensors); a graph's calls
            come from its nodes, a held layer's from running the model once (``_trace``).
        holder: for a layer a custom layer holds, that layer's site (a layer also called in the graph is still held).
        users: the other custom layers that hold it too (the weights of a layer held twice are shared).
        in_graph: a graph calls it.
        replaced: masks go there by ``_rewire.replace`` in a copy of the model (held by a custom layer, or in a
            functional model whose class builds its own graph), not by rebuilding a graph.
        aliases: the other locators of the same layer object (a shared layer).
        attention: the path of the Softmax whose output it reads (an attention-weight dropout), or "".
        order: the index of its first call when the model ran once (held layers), to list them in call order.
    """

    path: str
    op: Any
    locator: Locator = ()
    inputs: list[Shape | None] = field(default_factory=list)
    holder: _Site | None = None
    users: list[_Site] = field(default_factory=list)
    in_graph: bool = False
    replaced: bool = False
    aliases: list[Locator] = field(default_factory=list)
    attention: str = ""
    order: int = -1


def _is_graph_model(op: object) -> bool:
    """A Sequential or functional model (a ``keras.Function`` graph)."""
    return isinstance(op, keras.Sequential) or (isinstance(op, keras.Model) and isinstance(op, keras.Function))


def _rebuildable(op: object) -> bool:
    """A graph model that a rebuilt graph gives back with its class: a Sequential, or a functional model whose
    class takes ``(inputs, outputs, name)`` (as ``keras.models.clone_model`` decides). Other functional models
    (keras-hub's backbones and tasks build their graph in ``__init__``) are copied through their config."""
    if isinstance(op, Rewired) or not _is_graph_model(op):
        return False
    if isinstance(op, keras.Sequential):
        return type(op) is keras.Sequential
    spec = inspect.getfullargspec(type(op).__init__)
    return spec.args[1:] == ["inputs", "outputs", "name"] or (spec.varargs is not None and spec.varkw is not None)


def _check_model(model: object, operation: str, does: str = "rebuilds", advice: str = REBUILD_ADVICE) -> None:
    """A built Sequential or functional model: ``operation`` (``does`` what to its graph) refuses anything else with
    what to do instead (``advice``)."""
    if not _is_graph_model(model):
        kind = "a subclassed keras.Model" if isinstance(model, keras.Model) else "not a keras.Model"
        raise TypeError(
            f"{operation} {does} Sequential and functional Keras models; {type(model).__name__} is {kind}, whose "
            f"call() cannot be read: {advice}"
        )
    if not model.built:  # type: ignore[attr-defined]  # a keras.Model (Any to mypy)
        raise ValueError(f"{operation} needs a built model (give it an Input, or call it once on data)")


def _shape(tensors: list[Any]) -> Shape | None:
    return tuple(tensors[0].shape) if len(tensors) == 1 else None


def _graph_calls(model: Any) -> list[tuple[Any, list[Shape | None]]]:
    """The layers and operations ``model`` calls, in the order of ``model.layers``, with the input of each call."""
    if isinstance(model, keras.Sequential):
        calls: list[tuple[Any, list[Shape | None]]] = []
        tensor = model.inputs[0]
        for layer in model.layers:
            calls.append((layer, [tuple(tensor.shape)]))
            tensor = layer.compute_output_spec(tensor)
        return calls
    # A functional model is a keras.Function: one node per call, read from its graph (Keras has no public accessor).
    inputs: dict[int, list[Shape | None]] = {}
    for nodes in model._nodes_by_depth.values():
        for node in nodes:
            if not node.is_input:
                inputs.setdefault(id(node.operation), []).append(_shape(node.input_tensors))
    return [(op, inputs[id(op)]) for op in model.operations if id(op) in inputs]


class _Survey:
    """Every layer and operation of a model, once each: the graphs' calls in ``model.layers`` order (nested models
    followed), and the layers each custom layer holds, after it."""

    def __init__(self, model: Any) -> None:
        self.found: dict[int, _Site] = {}
        self.paths: set[str] = set()
        self.graph(model, "", (), replaced=False)

    def path(self, wanted: str, fallback: str) -> str:
        path = wanted if wanted not in self.paths else fallback
        self.paths.add(path)
        return path

    def graph(self, model: Any, prefix: str, locator: Locator, replaced: bool) -> None:
        replaced = replaced or not _rebuildable(model)
        for op, inputs in _graph_calls(model):
            site = self.found.get(id(op))
            if site is not None and not site.in_graph:  # held first, called by a graph too: the graph's path
                site.path, site.locator = f"{prefix}{op.name}", (*locator, ("layer", op.name))
                self.paths.add(site.path)
            if site is None:
                path = self.path(f"{prefix}{op.name}", f"{prefix}{op.name}#{len(self.found)}")
                site = self.found[id(op)] = _Site(path, op, (*locator, ("layer", op.name)), replaced=replaced)
                if _is_graph_model(op):
                    self.graph(op, f"{site.path}/", site.locator, replaced)
                elif isinstance(op, keras.layers.Layer):
                    self.held(site)
            site.in_graph = True
            site.inputs.extend(inputs)

    def held(self, holder: _Site) -> None:
        for steps, layer in held_layers(holder.op):
            site = self.found.get(id(layer))
            if site is not None:  # also held or called elsewhere: a shared layer
                site.users.append(holder)
                site.aliases.append(holder.locator + steps)
                continue
            name = steps[0][1] + "".join(f"[{key}]" for _, key in steps[1:])
            path = self.path(f"{holder.path}/{layer.name}", f"{holder.path}/{name}")
            site = self.found[id(layer)] = _Site(path, layer, holder.locator + steps, holder=holder, replaced=True)
            if _is_graph_model(layer):
                self.graph(layer, f"{site.path}/", site.locator, replaced=True)
            else:
                self.held(site)

    def sites(self) -> list[_Site]:
        """The sites in model order; the layers a custom layer holds follow it in the order of their first call."""
        children: dict[int, list[_Site]] = {}
        for site in self.found.values():
            if site.holder is not None and not site.in_graph:
                children.setdefault(id(site.holder), []).append(site)
        ordered: list[_Site] = []

        def add(site: _Site) -> None:
            ordered.append(site)
            held = children.get(id(site), [])
            for child in sorted(held, key=lambda child: (child.order < 0, child.order)):
                add(child)

        for site in self.found.values():
            if site.holder is None or site.in_graph:
                add(site)
        return ordered


@dataclass
class _Call:
    """One call of a layer while the model ran once (``_trace``)."""

    layer: int
    parent: int | None
    tensors: list[Any]
    output: Any = None


def _run_traced(model: Any, layers: Sequence[Any], size: int) -> list[_Call]:
    """Run ``model`` once on ones (batch 2, every other unknown axis ``size``), noting each call of ``layers``."""
    calls: list[_Call] = []
    stack: list[int] = []

    def traced(layer: Any, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            tensors = [value for value in keras.tree.flatten((args, kwargs)) if ops.is_tensor(value)]
            calls.append(_Call(id(layer), stack[-1] if stack else None, tensors))
            stack.append(len(calls) - 1)
            index = stack[-1]
            try:
                calls[index].output = call(*args, **kwargs)
            finally:
                stack.pop()
            return calls[index].output

        return run

    def ones(tensor: Any) -> Any:
        shape = (2, *(size if dim is None else dim for dim in tensor.shape[1:]))
        return ops.ones(shape, dtype=tensor.dtype)

    for layer in layers:  # the instance's call, for this run only (Keras calls ``self.call``)
        object.__setattr__(layer, "call", traced(layer, layer.call))
    try:
        with _no_autograd():
            model(keras.tree.map_structure(ones, model.input), training=False)
    finally:
        for layer in layers:
            object.__delattr__(layer, "call")
    return calls


def _trace(model: Any, sites: Sequence[_Site]) -> tuple[list[_Call], str]:
    """Run the model twice (unknown axes 8, then 9) to read how its custom layers call the layers they hold: each
    held layer's input shapes (an axis that differs is unknown), the order of first calls, and the dropouts that
    read a Softmax's output. Returns the first run's calls, and the error if the model could not run."""
    layers = [site.op for site in sites if isinstance(site.op, keras.layers.Layer) and not _is_graph_model(site.op)]
    try:
        runs = [_run_traced(model, layers, size) for size in (8, 9)]
    except Exception as error:  # any error of the user's model: reported on the layers it hides
        return [], f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    by_layer = {id(site.op): site for site in sites}
    shapes: dict[int, list[list[Shape | None]]] = {}
    for run in runs:
        per_layer: dict[int, list[Shape | None]] = {}
        for call in run:
            per_layer.setdefault(call.layer, []).append(_shape(call.tensors))
        for layer, found in per_layer.items():
            shapes.setdefault(layer, []).append(found)
    softmax = {
        id(call.output): by_layer[call.layer]
        for call in runs[0]
        if isinstance(by_layer[call.layer].op, keras.layers.Softmax)
    }
    for index, call in enumerate(runs[0]):
        site = by_layer[call.layer]
        if site.order < 0:
            site.order = index
        if len(call.tensors) == 1 and id(call.tensors[0]) in softmax:
            site.attention = softmax[id(call.tensors[0])].path
    for site in sites:
        if site.holder is None or site.in_graph:
            continue  # a graph's nodes give its inputs
        first, second = shapes.get(id(site.op), [[], []])
        site.inputs = [_merged(a, b) for a, b in zip(first, second, strict=False)]
    return runs[0], ""


def _merged(first: Shape | None, second: Shape | None) -> Shape | None:
    """One call's input shape from the two runs: an axis that differs follows the unknown axes (None); batch None."""
    if first is None or second is None or len(first) != len(second):
        return None
    return (None, *(a if a == b else None for a, b in zip(first[1:], second[1:], strict=True)))


def _raw_held(
    calls: Sequence[_Call], sites: Sequence[_Site], reads: Mapping[int, list[bool]], stops: set[int]
) -> set[int]:
    """The held layers in ``stops`` that read the raw input inside the custom layers that read it.

    ``reads`` gives, for each custom layer a graph calls on the raw input, which of its input tensors carry it (in
    the order of ``keras.tree.flatten((args, kwargs))``). Inside custom layers there is no graph: the raw input is
    followed from layer to layer by the tensors the run passed (a layer not in ``stops`` passes it on), so a raw
    operation between two held layers (``x * 2`` in ``call``) ends it there.
    """
    by_layer = {id(site.op): site for site in sites}
    carrying: set[int] = set()
    found: set[int] = set()
    for call in calls:
        if call.parent is None:
            flags = reads.get(call.layer, [])
            carrying.update(id(tensor) for tensor, flag in zip(call.tensors, flags, strict=False) if flag)
        elif any(id(tensor) in carrying for tensor in call.tensors):
            if call.layer in stops:
                found.add(call.layer)
            elif not any(True for _ in held_layers(by_layer[call.layer].op)):  # a custom layer: its own calls follow
                carrying.update(id(tensor) for tensor in keras.tree.flatten(call.output) if ops.is_tensor(tensor))
    return found


def _read_raw(
    model: Any,
    raw: Sequence[bool],
    stops: set[int],
    found: set[int],
    held_reads: dict[int, list[bool]] | None = None,
) -> list[bool]:
    """Follow the raw input through ``model``'s graph, whose input ``i`` carries it when ``raw[i]``.

    Every layer in ``stops`` (or custom layer holding one) whose tensors all carry the raw input is added to
    ``found`` and its outputs do not carry it; other layers and operations whose tensors all carry it pass it on.
    One that also reads a stop's result (an attention output a mask input joins at the scores, a residual, a
    concatenation with learned features) reads no raw input. Nested models are followed, input by input.
    ``held_reads`` collects, for each custom layer that reads it, which of its input tensors carry it.
    Returns, per output of ``model``, whether it carries the raw input.
    """

    def through(op: Any, reads: list[bool], outputs: int) -> list[bool]:
        if _is_graph_model(op):
            inner_raw = reads if len(reads) == len(op.inputs) else [all(reads)] * len(op.inputs)
            return _read_raw(op, inner_raw, stops, found, held_reads)
        inner = op._flatten_layers(include_self=False, recursive=True) if isinstance(op, keras.layers.Layer) else []
        if inner and held_reads is not None:
            held_reads.setdefault(id(op), reads)
        if not all(reads):
            return [False] * outputs
        if id(op) in stops or any(id(layer) in stops for layer in inner):
            found.add(id(op))
            return [False] * outputs
        return [True] * outputs

    if isinstance(model, keras.Sequential):
        carries = raw[0]
        for layer in model.layers:
            carries = carries and any(through(layer, [True], 1))
        return [carries]
    carrying = {id(tensor) for tensor, flag in zip(model.inputs, raw, strict=True) if flag}
    for depth in sorted(model._nodes_by_depth, reverse=True):  # inputs first (see _graph_calls)
        for node in model._nodes_by_depth[depth]:
            reads = [id(tensor) in carrying for tensor in node.input_tensors]
            if node.is_input or not any(reads):
                continue
            flags = through(node.operation, reads, len(node.outputs))
            carrying.update(id(tensor) for tensor, flag in zip(node.outputs, flags, strict=True) if flag)
    return [id(tensor) in carrying for tensor in model.outputs]


def _channel_axis(layer: Any) -> int:
    """Axis of the channels in the layer's input: 1 for ``data_format="channels_first"``, else -1."""
    return 1 if getattr(layer, "data_format", None) == "channels_first" else -1


def _user(site: _Site) -> str:
    return f"custom layer {site.path!r} ({type(site.op).__name__})"


def _channels(site: _Site, axis: int, traced: str) -> tuple[int, str]:
    """The channel count of the site's input on ``axis``, or (0, why there is no single one or masks cannot go).

    ``traced`` is the error of the run that reads custom layers (``_trace``), "" when it ran.
    """
    if site.holder is not None and site.in_graph:  # a layer a graph calls whose weights a custom layer holds
        return 0, used_outside_its_call(_user(site.holder))
    if site.users:  # held by a second custom layer (or called by a graph and held)
        return 0, used_outside_its_call(_user(site.users[-1]))
    if site.holder is not None and traced:
        return 0, f"inside {type(site.holder.op).__name__} {site.holder.path!r}: the model could not run ({traced})"
    if site.holder is not None and not site.inputs:
        return 0, f"never called when the model runs (inside {type(site.holder.op).__name__} {site.holder.path!r})"
    if any(shape is None for shape in site.inputs):
        return 0, "its input is not a single tensor"
    counts = {shape[axis] for shape in site.inputs if shape is not None}
    if len(counts) > 1:
        shown = ", ".join(str(count) for count in sorted(counts, key=lambda count: -1 if count is None else count))
        return 0, f"called on inputs with different channel counts ({shown})"
    (channels,) = counts
    if channels is None:
        return 0, f"unknown channel count (None) on axis {axis} of its input"
    return channels, ""


def _masks_layer(site: _Site, n: int, scale: float, seed: int | None, axis: int, name: str) -> Masksembles:
    """A Masksembles layer for the site's input, in the site's dtype policy (1D/2D/3D by the input's rank)."""
    ranks = {len(shape) for shape in site.inputs if shape is not None}
    masks_class = _MASKS_BY_RANK.get(ranks.pop(), Masksembles) if len(ranks) == 1 else Masksembles
    policy = site.op.dtype_policy  # a quantized layer's masks use the float policy it was quantized from
    dtype = policy if policy.quantization_mode is None else policy.get_config()["source_name"]
    return masks_class(n, scale, seed=seed, channel_axis=axis, name=name, dtype=dtype)


def _copy(op: Any) -> Any:
    """A new layer or operation with ``op``'s configuration (weights are copied once the new model is built)."""
    if isinstance(op, keras.layers.Lambda):
        # A Lambda's config holds its function as bytecode, which Keras only reloads in unsafe mode and without the
        # function's globals: the copy takes the function object itself.
        return keras.layers.Lambda(
            op.function,
            output_shape=op._output_shape,
            mask=op.mask,
            arguments=op.arguments,
            name=op.name,
            dtype=op.dtype_policy,
            trainable=op.trainable,
        )
    return type(op).from_config(op.get_config())


def _config_copy(model: Any) -> Any:
    """A model of ``model``'s class built from its config (compiled as it was, unless its class compiles it; weights
    copied later).

    A keras-hub task's preprocessor holds no weights and may hold what its config does not (a tokenizer's
    vocabulary, loaded from a preset's assets): the copy shares it.
    """
    config = model.get_config()
    preprocessor = getattr(model, "preprocessor", None)
    if isinstance(preprocessor, keras.layers.Layer) and "preprocessor" in config and not preprocessor.weights:
        config = {**config, "preprocessor": preprocessor}
    result = type(model).from_config(config)
    if model.compiled and not result.compiled:  # a keras-hub task compiles itself (its compile() is its own)
        result.compile_from_config(model.get_compile_config())
    return result


def _new_input(tensor: Any) -> Any:
    """A new ``keras.Input`` like the model input ``tensor``, named after its InputLayer (as the model's layers are)."""
    name = tensor._keras_history.operation.name  # the InputLayer that made the tensor (no public accessor)
    return keras.Input(batch_shape=tensor.shape, dtype=tensor.dtype, sparse=tensor.sparse, name=name)


@dataclass(frozen=True)
class _Edit:
    """Masks for one layer: in front of a copy of it (``keep``, insert) or in its place (convert_dropout)."""

    masks: Masksembles
    keep: bool


class _Rebuilder:
    """Builds a new model from a Sequential/functional model, applying ``edits`` (keyed by the original layer's id).

    Every other layer and operation is copied once (shared layers stay shared), nested Sequential/functional models
    are rebuilt the same way, and the copies get the original layers' weights.
    """

    def __init__(self, edits: Mapping[int, _Edit]) -> None:
        self.edits = edits
        self.clones: dict[int, Any] = {}
        self.masks_before: dict[int, Masksembles] = {}  # id of a kept layer's copy -> masks called on its input
        self.copies: list[tuple[Any, Any]] = []

    def __call__(self, model: Any) -> Any:
        result = self.model(model)
        for original, copy in self.copies:
            copy.set_weights(original.get_weights())
        return result

    def model(self, model: Any) -> Any:
        if not _rebuildable(model):  # a functional model that builds its own graph: a copy through its config
            result = _config_copy(model)
            self.copies.append((model, result))
            return result
        if isinstance(model, keras.Sequential):
            layers = [_new_input(model.inputs[0])]
            for layer in model.layers:
                edit = self.edits.get(id(layer))
                if edit is not None:
                    layers.append(edit.masks)
                if edit is None or edit.keep:
                    layers.append(self.clone(layer))
            result = keras.Sequential(layers, name=model.name)
            if model.compiled:
                result.compile_from_config(model.get_compile_config())
        else:
            # clone_model replays the functional graph (inputs, raw operations, the model's class and compile config)
            inputs = keras.tree.map_structure(_new_input, model.input)
            result = keras.models.clone_model(
                model, input_tensors=inputs, clone_function=self.clone, call_function=self.call
            )
        if not model.trainable:
            result.trainable = False
        return result

    def clone(self, op: Any) -> Any:
        if id(op) not in self.clones:
            edit = self.edits.get(id(op))
            if edit is not None and not edit.keep:
                clone = edit.masks
            elif _is_graph_model(op):
                clone = self.model(op)
            else:
                clone = _copy(op)
                if isinstance(op, keras.layers.Layer):
                    self.copies.append((op, clone))
                if edit is not None:
                    self.masks_before[id(clone)] = edit.masks
            self.clones[id(op)] = clone
        return self.clones[id(op)]

    def call(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        masks = self.masks_before.get(id(op))
        if masks is not None:  # the layer reads one tensor (checked by the survey): it reads it through the masks
            args, kwargs = keras.tree.map_structure(
                lambda value: masks(value) if isinstance(value, keras.KerasTensor) else value, (args, kwargs)
            )
        return op(*args, **kwargs)


def _survey(model: Any) -> tuple[list[_Site], list[_Call], str]:
    """The sites of ``model`` in order; with layers held by custom layers, the model's traced run (``_trace``)."""
    survey = _Survey(model)
    found = list(survey.found.values())
    calls, traced = _trace(model, found) if any(site.holder is not None for site in found) else ([], "")
    return survey.sites(), calls, traced


def _first_layers(model: Any, sites: Sequence[_Site], calls: Sequence[_Call], stops: set[int]) -> list[str]:
    """The paths of the layers in ``stops`` that read the raw input: through the graphs, and inside the custom
    layers that read it (``_raw_held``)."""
    found: set[int] = set()
    reads: dict[int, list[bool]] = {}
    _read_raw(model, [True] * len(model.inputs), stops, found, reads)
    found |= _raw_held(calls, sites, reads, stops)
    return [site.path for site in sites if id(site.op) in found]


def _position(layers: Sequence[Any], layer: Any) -> int:
    return next(index for index, item in enumerate(layers) if item is layer)


def _in_copy(locator: Locator, model: Any, result: Any, clones: Mapping[int, Any]) -> Locator:
    """``locator`` (steps in ``model``) as the steps to the same layer's copy in ``result``, a graph's layers by their
    index in its ``layers`` (``_rewire``: a copy through a config, or a model loaded from the copy's config, may name
    them anew). A rebuilt graph's copy of a layer is in ``clones`` (masks layers inserted: another index); a graph
    copied through its config has the same layers in the same order."""
    steps: list[Step] = []
    original, copy = model, result
    for step in locator:
        child = resolve(original, (step,))
        if step[0] == "layer":
            copied = clones.get(id(child))
            if copied is None:
                copied = copy.layers[_position(original.layers, child)]
            step = ("layer", _position(copy.layers, copied))
        else:
            copied = resolve(copy, (step,))
        steps.append(step)
        original, copy = child, copied
    return tuple(steps)


def _retie(result: Any, sites: Sequence[_Site], in_copy: Callable[[Locator], Locator]) -> None:
    """Give back to the copy the layers the model shares between places (a layer two custom layers hold, a tied
    projection): copied through each holder's config, they came out as separate layers."""
    for site in sites:
        if not site.aliases:
            continue
        shared = resolve(result, in_copy(site.locator))
        for alias in map(in_copy, site.aliases):
            copy = resolve(result, alias)
            if copy is not shared:
                replace(holder_of(result, alias), copy, shared)


@dataclass(frozen=True)
class _Change:
    """Masks for a layer ``_rewire`` changes in place in the copy: wrapped with it (``wrap``, insert) or in its place
    (convert_dropout)."""

    site: _Site
    masks: Masksembles
    wrap: bool


def _build(model: Any, sites: Sequence[_Site], edits: Mapping[int, _Edit], changes: Sequence[_Change]) -> Any:
    """The new model: graphs rebuilt with ``edits``, shared layers tied again, then ``changes`` made in place (a
    model with changes saves them: ``_rewire.Rewired``)."""
    rebuilder = _Rebuilder(edits)
    result = rebuilder(model)

    def in_copy(locator: Locator) -> Locator:
        return _in_copy(locator, model, result, rebuilder.clones)

    _retie(result, sites, in_copy)
    recorded = [
        record(in_copy(change.site.locator), change.masks, _input_shape(change.site), change.wrap) for change in changes
    ]
    for change in recorded:
        apply_change(result, change)
    if recorded:
        mark_rewired(result, [*getattr(result, "masksembles_changes", []), *recorded])
    return result


def _input_shape(site: _Site) -> Shape:
    return next(shape for shape in site.inputs if shape is not None)


def _unique_name(name: str, taken: set[str]) -> str:
    candidate, suffix = name, 0
    while candidate in taken:
        suffix += 1
        candidate = f"{name}_{suffix}"
    taken.add(candidate)
    return candidate


def _selector(before: object) -> Predicate:
    """``before`` (a layer type, a tuple or list of them, or a predicate) as a predicate (path, layer) -> bool."""
    if isinstance(before, type):
        before = (before,)
    if isinstance(before, tuple | list):
        kinds = tuple(before)
        if kinds and all(isinstance(kind, type) for kind in kinds):
            return lambda path, layer: isinstance(layer, kinds)
    elif callable(before):
        return lambda path, layer: bool(before(path, layer))
    raise TypeError(
        "before must be a layer type, a non-empty tuple or list of layer types or a predicate (path, layer) -> bool; "
        f"received {before!r}"
    )


def _contraction_reason(equation: str) -> str:
    """Why an ``EinsumDense`` with this equation is not a fully connected layer over its input's last axis, "" when
    it is one: it contracts (sums over) exactly one axis of its input, the last, and every other input axis goes on to
    its output (the batch, the tokens), as a ``Dense`` on (B, L, C) does. That axis is then the channel axis of the
    masks. Read from the equation (Keras' forms ``"abc,cd->abd"``, ``"...c,cd->...d"``, ``"ab...,bc->ac..."``), never
    from the layer's name: keras-hub's MLP layers (``"btd,df->btf"``) and attention's query, key and value projections
    (``"btd,ndh->btnh"``) are fully connected layers over the hidden size; an attention output projection
    (``"btnh,nhd->btd"``: heads and head size contracted together) is not, and one mask axis cannot cover its input.
    """
    inputs, output = equation.split(",")[0], equation.split("->")[1]
    contracted = [label for label in inputs.replace("...", "") if label not in output]
    if len(contracted) != 1:
        axes = f"{len(contracted)} axes of its input ({', '.join(contracted)})" if contracted else "no axis"
        return f"einsum {equation!r} contracts {axes}, not one channel axis"
    if not inputs.endswith(contracted[0]):
        return f"einsum {equation!r} contracts axis {contracted[0]!r}, not the last axis of its input (the channels)"
    return ""


def _candidate(site: _Site, default: bool, traced: str) -> Candidate:
    """The insertion candidate of a matching layer, with the reason it must be left alone, if any.

    With the default ``before``, a convolution with one group per input channel (``Conv2D(groups=C)``, depthwise)
    is left alone; a user who names depthwise layers in ``before`` gets masks there. An ``EinsumDense`` that is not a
    fully connected layer over its input's last axis (``_contraction_reason``) is left alone whatever ``before`` is.
    """
    axis = _channel_axis(site.op)
    channels, reason = _channels(site, axis, traced)
    if isinstance(site.op, keras.layers.EinsumDense):
        reason = _contraction_reason(site.op.equation) or reason
    depthwise = isinstance(site.op, DEPTHWISE_TYPES) or 1 < getattr(site.op, "groups", 1) == channels
    if not reason and default and depthwise:
        reason = DEPTHWISE
    return Candidate(site.path, type(site.op).__name__, channels, axis, reason)


def insert(
    model: keras.Model,
    n: int,
    scale: float,
    *,
    seed: int | None = None,
    before: type | Sequence[type] | Predicate = DEFAULT_BEFORE,
    start: str | None = None,
    include_first: bool = False,
) -> keras.Model:
    """A copy of ``model`` with a Masksembles layer on the input of every matching layer (the paper's recipe).

    The paper puts Masksembles before every convolutional and dense layer (CIFAR-10), or before every convolution
    from ``stage3`` on (ImageNet ResNet-50); PyTorch's ``insert`` before every ``nn.Linear``, on a ``transformers``
    decoder (Llama) its attention's query, key, value and output projections and its MLP. Here an ``EinsumDense`` is
    a dense layer when its equation contracts its input's last axis alone, every other axis going on to its output
    (``_contraction_reason``), with the masks on that axis: keras-hub's decoders (Gemma, whose MLP is EinsumDense
    too, Llama, Mistral, Qwen, Phi-3) and ``MultiHeadAttention`` get masks before the query, key and value
    projections and the MLP. Their attention output projection (``"btnh,nhd->btd"``) contracts the heads and the
    head size together, which a mask on one axis cannot cover: it is left alone with that reason, whatever ``before``
    says (PyTorch masks ``o_proj``, a Linear on the heads' outputs laid side by side).

    Widths stay as they are and every weight is copied, so ``scale=1`` (all-ones masks) reproduces the model exactly.
    Sequential and functional models work, with nested models and raw operations (``x * 2.0``, ``x[:, 0]``,
    ``keras.ops`` calls); a subclassed model is a TypeError.

    The masks layer before layer ``"conv"`` is named ``"conv_masksembles"``; its class follows the input's rank
    (``Masksembles1D`` for (B, C) and (B, L, C), ``Masksembles2D`` for (B, H, W, C), ``Masksembles3D``), its
    ``channel_axis`` is 1 when the layer has ``data_format="channels_first"`` and -1 otherwise, its dtype policy
    is the layer's (its float policy, for a quantized layer). A layer called at several places gets one masks layer,
    called at each of them.

    Which layers get masks is decided by ``masksembles_core.insertion.plan_insertion``, the rule shared with
    PyTorch and Flax: the network's first layers read the raw input and are skipped unless ``include_first``. They
    are found by data flow from every model input: each convolution, dense, einsum-dense or embedding layer (or layer
    ``before`` selects) that reads model inputs alone, through no other such layer, so each input of a multi-input
    model (an image and a tabular branch) has its own; a layer whose input also holds another layer's result (a mask
    input multiplied into an attention output) does not read the raw input. Layers before ``start`` in
    ``model.layers`` order (a nested model's layers follow it) are skipped; the ``i``-th layer given masks gets
    ``derive_seed(seed, i)``. Left alone, with the reason in the report: depthwise convolutions
    (``DepthwiseConv1D/2D``, ``Conv2D(groups=C)``) when ``before`` is the default (a ``SeparableConv1D/2D``, a
    depthwise convolution then a 1x1 one that mixes the channels, gets masks), an EinsumDense that contracts several
    axes of its input or another than the last, layers with a single input channel, layers reading several tensors
    or inputs of different channel counts, layers held twice, and layers inside custom layers the model never calls.
    A layer a custom layer holds (keras-hub's ``TransformerEncoder`` holds its feedforward ``Dense`` layers) is
    replaced there by ``Masked(masks, layer)``; so is a layer of a functional model whose class builds its own graph
    (keras-hub's backbones and tasks), copied through its config so that it keeps its class (docs/keras.md, "What the
    surgery can and cannot reach").

    Args:
        model: a built Sequential or functional model (left unchanged).
        n, scale, seed: as for ``Masksembles``; ``seed`` makes every layer's masks reproducible.
        before: a layer type, a tuple or list of them (default Conv1D/2D/3D, Dense, EinsumDense and
            SeparableConv1D/2D, subclasses included; not transposed convolutions; DepthwiseConv1D/2D are listed in
            the report, left alone), or a predicate
            ``(path, layer) -> bool`` on every layer (paths as in the module docstring: ``"block3/conv"``).
        start: the path of the layer insertion starts from, e.g. ``"conv4_block1_1_conv"``: ResNet50's third
            residual stage (torchvision's ``layer3``), whose shortcut ``conv4_block1_0_conv`` comes later in
            ``model.layers`` and is included.
        include_first: also put masks on the input of the network's first layers (the raw input).

    Returns:
        the new model, of the input model's class (compiled with its compile configuration when it was compiled;
        a subclass of the same name that saves its changes when masks went inside custom layers or a graph its
        class builds); its ``masksembles_report`` attribute (a ``LayerReport``, printed as a Markdown table) lists
        every matching layer, what was done and why. The report is not saved with the model; the masks are.

    Raises:
        TypeError: ``model`` is not a Sequential/functional model, or ``before`` is neither types nor a callable.
        ValueError: invalid ``n``/``scale``/``seed``, an unbuilt model, a ``start`` that names no layer, or no
            layer to put masks before (the message holds the report).
    """
    n, scale, seed = check_insert_arguments(n, scale, seed, start)
    matches = _selector(before)
    default = isinstance(before, tuple | list) and set(before) == set(DEFAULT_BEFORE)
    _check_model(model, "insert")
    sites, calls, traced = _survey(model)
    listed = (lambda path, layer: isinstance(layer, DEPTHWISE_TYPES) or matches(path, layer)) if default else matches
    chosen = [
        site
        for site in sites
        if isinstance(site.op, keras.layers.Layer) and not _is_graph_model(site.op) and listed(site.path, site.op)
    ]
    stops = {id(site.op) for site in sites if isinstance(site.op, INPUT_LAYERS)} | {id(site.op) for site in chosen}
    report = plan_insertion(
        [_candidate(site, default, traced) for site in chosen],
        [site.path for site in sites],
        n,
        scale,
        seed=seed,
        start=start,
        include_first=include_first,
        first_layers=_first_layers(model, sites, calls, stops),
    )
    by_path = {site.path: site for site in sites}
    taken = {site.op.name for site in sites}
    edits: dict[int, _Edit] = {}
    changes: list[_Change] = []
    for row in report.changed:
        site = by_path[row.path]
        name = _unique_name(f"{site.op.name}_masksembles", taken)
        masks = _masks_layer(site, n, scale, row.seed, _channel_axis(site.op), name)
        if site.replaced:  # in a custom layer or a graph its class builds: wrapped in place
            changes.append(_Change(site, masks, wrap=True))
        else:
            edits[id(site.op)] = _Edit(masks, keep=True)
    result = _build(model, sites, edits, changes)
    result.masksembles_report = report
    return result


def _dropout_reason(layer: Any, axis: int) -> str:
    """Why a dropout layer is not channel dropout ("" when it is)."""
    if layer.rate == 0:
        return ZERO_RATE
    noise_shape = getattr(layer, "noise_shape", None)
    if noise_shape is not None and noise_shape[axis] == 1:
        return (
            f"noise_shape={tuple(noise_shape)}: one draw for all channels (per-sample dropout, e.g. stochastic "
            "depth), not channel dropout"
        )
    return ""


def convert_dropout(
    model: keras.Model, n: int, scale: float, *, seed: int | None = None, include_first: bool = False
) -> keras.Model:
    """A copy of ``model`` with its channel dropouts replaced by Masksembles (the paper's MC-Dropout drop-in).

    Each ``Dropout``/``SpatialDropout1D/2D/3D`` becomes a Masksembles layer over the channels of its input: the last
    axis for ``Dropout`` and ``SpatialDropout1D`` (also after a channels-first convolution: a plain ``Dropout``
    carries no layout), the ``data_format``'s channel axis for ``SpatialDropout2D/3D``. The class follows the
    input's rank as in ``insert`` (``Masksembles1D`` for (B, C) and (B, L, C), ``Masksembles2D``, ``Masksembles3D``,
    else ``Masksembles``); the masks layer keeps the dropout's name (``model.get_layer("top_dropout")`` finds it)
    and dtype policy and reads its channel count from its input. Every other layer and raw operation is copied with
    its weights (the input model is left unchanged); Sequential and functional models work, nested ones included,
    and a subclassed model is a TypeError.

    Decided by ``masksembles_core.insertion.plan_conversion``, with ``insert``'s rules: left as is, with the reason
    in the report, a dropout with a single input channel or too few for ``n`` distinct masks, and one that reads the
    raw input (model inputs alone, through no convolution, dense, einsum-dense, embedding or recurrent layer) unless
    ``include_first``. Also left as is: ``rate=0``; a ``noise_shape`` that shares one draw across the
    channels (per-sample dropout such as EfficientNet's stochastic depth, ``noise_shape=(None, 1, 1, 1)``); an input
    that is not a single tensor or has different channel counts at different calls; an attention-weight dropout
    (one that reads a ``Softmax`` layer's output, ``MultiHeadAttention``'s), with
    ``masksembles_core.insertion.attention_dropout_reason``; and a dropout inside a custom layer the model never
    calls. Dropouts inside custom layers (keras-hub's ``TransformerEncoder``) are replaced where the custom layer
    holds them. The ``i``-th converted dropout gets masks from ``derive_seed(seed, i)``.

    Returns:
        the new model, of the input model's class (compiled with its compile configuration when it was compiled;
        a subclass of the same name that saves its changes when masks went inside custom layers or a graph its
        class builds), with a ``masksembles_report`` attribute: a ``LayerReport`` (operation
        ``"convert_dropout"``) with one row per dropout layer, ``"converted"`` or ``"left as is"`` with the reason.

    Raises:
        TypeError: ``model`` is not a Sequential/functional model.
        ValueError: invalid ``n``/``scale``/``seed``, an unbuilt model, or no dropout to convert (the message holds
            the report).
    """
    n, scale, seed = check_insert_arguments(n, scale, seed, None)
    _check_model(model, "convert_dropout")
    sites, calls, traced = _survey(model)
    dropouts = [site for site in sites if isinstance(site.op, keras.layers.Dropout)]
    candidates = []
    for site in dropouts:
        axis = _channel_axis(site.op)  # SpatialDropout2D/3D's data_format; Dropout and SpatialDropout1D: -1
        channels, unusable = _channels(site, axis, traced)
        reason = _dropout_reason(site.op, axis)
        if site.attention and not reason:
            reason = attention_dropout_reason(f"applied to the output of Softmax {site.attention!r}")
        reason = reason or unusable
        candidates.append(Candidate(site.path, type(site.op).__name__, channels, axis, reason))
    stops = {id(site.op) for site in sites if isinstance(site.op, MIXING)} | {id(site.op) for site in dropouts}
    report = plan_conversion(
        candidates,
        n,
        scale,
        seed=seed,
        first_layers=_first_layers(model, sites, calls, stops),
        include_first=include_first,
        converts="Dropout/SpatialDropout1D/SpatialDropout2D/SpatialDropout3D layers",
    )
    edits: dict[int, _Edit] = {}
    changes: list[_Change] = []
    for site, row in zip(dropouts, report.rows, strict=True):
        if row.action == CONVERTED:
            assert row.channel_axis is not None
            masks = _masks_layer(site, n, scale, row.seed, row.channel_axis, site.op.name)
            if site.replaced:  # in a custom layer or a graph its class builds: replaced in place
                changes.append(_Change(site, masks, wrap=False))
            else:
                edits[id(site.op)] = _Edit(masks, keep=False)
    result = _build(model, sites, edits, changes)
    result.masksembles_report = report
    return result
