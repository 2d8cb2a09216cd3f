"""Model surgery: ``insert`` (the paper's recipe) and ``convert_dropout``, on Sequential and functional models.

Both run the same two steps. ``_survey`` lists every layer and operation of the model in graph order, with the
shape of the tensor each call reads; the rule of ``masksembles_core.insertion`` (``plan_insertion`` for ``insert``,
``plan_conversion`` for ``convert_dropout``) decides where masks go; ``_Rebuilder`` builds a new model with a
Masksembles layer in front of (``insert``) or in place of (``convert_dropout``) the chosen layers and copies every
other layer and operation with its weights, so the input model is never modified. ``_read_raw`` follows the raw
input from the model's inputs through the graph to the layers that read it alone: the network's first layers (for
``convert_dropout``, the dropouts it reaches through no layer that mixes channels).

Paths: a layer of the model is its name (``"conv2"``); a layer of a nested Sequential/functional model is
``"<nested model name>/<layer name>"`` (nesting repeats), as in Keras' variable paths. A layer inside a custom layer
or a subclassed model (Python ``call()`` code, which cannot be rebuilt) is ``"<custom layer path>/<layer name>"`` and
is reported as left alone; so is a layer the graph calls that a custom layer also holds (a tied projection reading
an embedding's matrix, say): masks before its call would not reach the custom layer's use of its weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import keras

from masksembles_core.insertion import (
    CONVERTED,
    ZERO_RATE,
    Candidate,
    check_insert_arguments,
    plan_conversion,
    plan_insertion,
    used_outside_its_call,
)

from ._layers import Masksembles, Masksembles1D, Masksembles2D, Masksembles3D

Shape = tuple[int | None, ...]
Predicate = Callable[[str, Any], bool]

DEFAULT_BEFORE = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D, keras.layers.Dense)
INPUT_LAYERS = (  # the kinds of layer that read a network's raw input: those that do are its first layers
    *DEFAULT_BEFORE,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
    keras.layers.EinsumDense,
    keras.layers.Embedding,
)
MIXING = (*INPUT_LAYERS, keras.layers.RNN)  # what mixes the raw input's channels (attention holds EinsumDense layers)
DEPTHWISE = "depthwise convolution: each output channel reads one input channel (before=... includes it)"
_MASKS_BY_RANK: dict[int, type[Masksembles]] = {2: Masksembles1D, 3: Masksembles1D, 4: Masksembles2D, 5: Masksembles3D}


@dataclass
class _Site:
    """One layer or operation of the model, as the survey found it.

    Attributes:
        path: its path (module docstring).
        op: the layer or raw operation (``x + 1``, ``x[:, 0]``, a ``keras.ops`` call).
        inputs: per call in the graph, the shape of the one tensor it reads (None: it reads several tensors).
        holder: for a layer a custom layer holds, that layer's site (a layer also called in the graph is still held).
    """

    path: str
    op: Any
    inputs: list[Shape | None] = field(default_factory=list)
    holder: _Site | None = None


def _is_graph_model(op: object) -> bool:
    """A Sequential or functional model (a ``keras.Function`` graph): the models the surgery can rebuild."""
    return isinstance(op, keras.Sequential) or (isinstance(op, keras.Model) and isinstance(op, keras.Function))


def _check_model(model: object, operation: str) -> None:
    if not _is_graph_model(model):
        kind = "a subclassed keras.Model" if isinstance(model, keras.Model) else "not a keras.Model"
        raise TypeError(
            f"{operation} rebuilds Sequential and functional Keras models; {type(model).__name__} is {kind}, whose "
            "call() Keras cannot rebuild: put masksembles_keras.Masksembles layers in its code, or build it as a "
            "functional model"
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


def _survey(model: Any, prefix: str = "", sites: dict[int, _Site] | None = None) -> list[_Site]:
    """Every layer and operation of ``model`` and of its nested models, once each, in ``model.layers`` order."""
    found: dict[int, _Site] = {} if sites is None else sites
    for op, inputs in _graph_calls(model):
        site = found.get(id(op))
        if site is not None and site.holder is not None and not site.inputs:  # held, and called in the graph too
            site.path = f"{prefix}{op.name}"
        if site is None:
            site = found[id(op)] = _Site(f"{prefix}{op.name}", op)
            if _is_graph_model(op):
                _survey(op, f"{site.path}/", found)
            elif isinstance(op, keras.layers.Layer):
                for inner in op._flatten_layers(include_self=False, recursive=True):  # its tracked sublayers
                    held = found.setdefault(id(inner), _Site(f"{site.path}/{inner.name}", inner))
                    held.holder = held.holder or site
        site.inputs.extend(inputs)
    return list(found.values())


def _read_raw(model: Any, raw: Sequence[bool], stops: set[int], found: set[int]) -> list[bool]:
    """Follow the raw input through ``model``'s graph, whose input ``i`` carries it when ``raw[i]``.

    Every layer in ``stops`` (or custom layer holding one) whose tensors all carry the raw input is added to
    ``found`` and its outputs do not carry it; other layers and operations whose tensors all carry it pass it on.
    One that also reads a stop's result (an attention output a mask input joins at the scores, a residual, a
    concatenation with learned features) reads no raw input. Nested models are followed, input by input.
    Returns, per output of ``model``, whether it carries the raw input.
    """

    def through(op: Any, reads: list[bool], outputs: int) -> list[bool]:
        if _is_graph_model(op):
            inner_raw = reads if len(reads) == len(op.inputs) else [all(reads)] * len(op.inputs)
            return _read_raw(op, inner_raw, stops, found)
        if not all(reads):
            return [False] * outputs
        inner = op._flatten_layers(include_self=False, recursive=True) if isinstance(op, keras.layers.Layer) else []
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


def _channels(site: _Site, axis: int) -> tuple[int, str]:
    """The channel count of the site's input on ``axis``, or (0, why there is no single one or masks cannot go)."""
    if site.holder is not None and not site.inputs:
        kind = type(site.holder.op).__name__
        return 0, f"inside {kind} {site.holder.path!r}: only a Sequential/functional graph can be rebuilt"
    if site.holder is not None:
        return 0, used_outside_its_call(f"custom layer {site.holder.path!r} ({type(site.holder.op).__name__})")
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


def _candidate(site: _Site, default: bool) -> Candidate:
    """The insertion candidate of a matching layer, with the reason it must be left alone, if any.

    With the default ``before``, a convolution with one group per input channel (``Conv2D(groups=C)``, depthwise)
    is left alone; a user who names depthwise layers in ``before`` gets masks there.
    """
    axis = _channel_axis(site.op)
    channels, reason = _channels(site, axis)
    if not reason and default and 1 < getattr(site.op, "groups", 1) == channels:
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
    from ``stage3`` on (ImageNet ResNet-50). Widths stay as they are and every weight is copied, so ``scale=1``
    (all-ones masks) reproduces the model exactly. Sequential and functional models work, with nested models and
    raw operations (``x * 2.0``, ``x[:, 0]``, ``keras.ops`` calls); a subclassed model is a TypeError.

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
    (``Conv2D(groups=C)``) when ``before`` is the default, layers with a single input channel, layers reading several
    tensors or inputs of different channel counts, and layers inside custom layers or subclassed models (their
    ``call()`` cannot be rebuilt).

    Args:
        model: a built Sequential or functional model (left unchanged).
        n, scale, seed: as for ``Masksembles``; ``seed`` makes every layer's masks reproducible.
        before: a layer type, a tuple or list of them (default Conv1D/2D/3D and Dense, subclasses included; not
            DepthwiseConv2D, SeparableConv2D or transposed convolutions), or a predicate
            ``(path, layer) -> bool`` on every layer (paths as in the module docstring: ``"block3/conv"``).
        start: the path of the layer insertion starts from, e.g. ``"conv4_block1_1_conv"``: ResNet50's third
            residual stage (torchvision's ``layer3``), whose shortcut ``conv4_block1_0_conv`` comes later in
            ``model.layers`` and is included.
        include_first: also put masks on the input of the network's first layers (the raw input).

    Returns:
        the new model, of the input model's class (compiled with its compile configuration when it was compiled);
        its ``masksembles_report`` attribute (a ``LayerReport``, printed as a Markdown table) lists every matching
        layer, what was done and why. The report is not saved with the model; the masks are.

    Raises:
        TypeError: ``model`` is not a Sequential/functional model, or ``before`` is neither types nor a callable.
        ValueError: invalid ``n``/``scale``/``seed``, an unbuilt model, a ``start`` that names no layer, or no
            layer to put masks before (the message holds the report).
    """
    n, scale, seed = check_insert_arguments(n, scale, seed, start)
    matches = _selector(before)
    default = isinstance(before, tuple | list) and set(before) == set(DEFAULT_BEFORE)
    _check_model(model, "insert")
    sites = _survey(model)
    chosen = [
        site
        for site in sites
        if isinstance(site.op, keras.layers.Layer) and not _is_graph_model(site.op) and matches(site.path, site.op)
    ]
    found: set[int] = set()  # the network's first layers: they read the raw input
    stops = {id(site.op) for site in sites if isinstance(site.op, INPUT_LAYERS)} | {id(site.op) for site in chosen}
    _read_raw(model, [True] * len(model.inputs), stops, found)
    first = [site.path for site in sites if id(site.op) in found]
    report = plan_insertion(
        [_candidate(site, default) for site in chosen],
        [site.path for site in sites],
        n,
        scale,
        seed=seed,
        start=start,
        include_first=include_first,
        first_layers=first,
    )
    by_path = {site.path: site for site in sites}
    taken = {site.op.name for site in sites}
    edits: dict[int, _Edit] = {}
    for row in report.changed:
        site = by_path[row.path]
        name = _unique_name(f"{site.op.name}_masksembles", taken)
        masks = _masks_layer(site, n, scale, row.seed, _channel_axis(site.op), name)
        edits[id(site.op)] = _Edit(masks, keep=True)
    result = _Rebuilder(edits)(model)
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
    that is not a single tensor or has different channel counts at different calls; and dropouts inside custom
    layers (e.g. ``MultiHeadAttention``'s), which cannot be reached. The ``i``-th converted dropout gets masks from
    ``derive_seed(seed, i)``.

    Returns:
        the new model, of the input model's class (compiled with its compile configuration when it was compiled),
        with a ``masksembles_report`` attribute: a ``LayerReport`` (operation ``"convert_dropout"``) with one row per
        dropout layer, ``"converted"`` or ``"left as is"`` with the reason.

    Raises:
        TypeError: ``model`` is not a Sequential/functional model.
        ValueError: invalid ``n``/``scale``/``seed``, an unbuilt model, or no dropout to convert (the message holds
            the report).
    """
    n, scale, seed = check_insert_arguments(n, scale, seed, None)
    _check_model(model, "convert_dropout")
    sites = _survey(model)
    dropouts = [site for site in sites if isinstance(site.op, keras.layers.Dropout)]
    candidates = []
    for site in dropouts:
        axis = _channel_axis(site.op)  # SpatialDropout2D/3D's data_format; Dropout and SpatialDropout1D: -1
        channels, unusable = _channels(site, axis)
        reason = unusable or _dropout_reason(site.op, axis)
        candidates.append(Candidate(site.path, type(site.op).__name__, channels, axis, reason))
    found: set[int] = set()  # the dropouts that read the raw input
    stops = {id(site.op) for site in sites if isinstance(site.op, MIXING)} | {id(site.op) for site in dropouts}
    _read_raw(model, [True] * len(model.inputs), stops, found)
    report = plan_conversion(
        candidates,
        n,
        scale,
        seed=seed,
        first_layers=[site.path for site in dropouts if id(site.op) in found],
        include_first=include_first,
        converts="Dropout/SpatialDropout1D/SpatialDropout2D/SpatialDropout3D layers",
    )
    edits: dict[int, _Edit] = {}
    for site, row in zip(dropouts, report.rows, strict=True):
        if row.action == CONVERTED:
            assert row.channel_axis is not None
            masks = _masks_layer(site, n, scale, row.seed, row.channel_axis, site.op.name)
            edits[id(site.op)] = _Edit(masks, keep=False)
    result = _Rebuilder(edits)(model)
    result.masksembles_report = report
    return result
