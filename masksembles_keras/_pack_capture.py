"""The first step of Keras ``pack``: the model's graph as a list of calls, probed, and what each call is.

A Sequential or functional model is read call by call (``model._nodes_by_depth``, as ``_surgery`` reads it; nested
Sequential and functional models are inlined), every layer and raw operation (``x * 2.0``, ``keras.ops.sigmoid(x)``,
``x[:, 0]``) with its arguments. The calls are run one by one, eagerly and in inference (``training=False``), on the
example input and on it with one more sample: every value's shape at both batch sizes (its batch axes). Each call is
then classified as a ``masksembles_core.packing`` kind (``_Op``) and answers the core's questions
(``masksembles_core.captured.CapturedGraph``) by running the call alone: on zeros (+0 and -0) for which channels
stay zero, on index tensors for where an axis lands, on a batch with one sample redrawn for whether it keeps samples
apart. Nothing is assumed from a name but the channel axis of a layer with a ``data_format`` or ``axis``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
from keras import ops

import masksembles_core.adapter as mca
from masksembles_core import captured
from masksembles_core.captured import CapturedOp, Probed, array_repeatable, whole_axis

from ._inference import _no_autograd
from ._layers import Masksembles
from ._pack_attention import MASKS, AttentionHeads, AttentionParts, call_arguments, fold_reason
from ._rewire import Masked
from ._surgery import _check_model, _is_graph_model

PREFIX = "pack/extract_member"
INPUT = "input"
ELEMENTWISE_ACTIVATIONS = {
    "relu", "relu6", "sigmoid", "tanh", "gelu", "silu", "swish", "elu", "selu", "softplus", "softsign", "exponential",
    "hard_sigmoid", "hard_silu", "hard_swish", "linear", "leaky_relu", "mish", "log_sigmoid", "celu", "hard_tanh",
    "tanh_shrink", "soft_shrink", "hard_shrink", "squareplus", "sparse_plus", "sparse_sigmoid", "threshold",
}  # fmt: skip
UNARY_OPS = {
    "Relu", "Relu6", "Sigmoid", "Softplus", "Softsign", "Silu", "LogSigmoid", "LeakyRelu", "HardSigmoid", "HardSilu",
    "Elu", "Selu", "Gelu", "Celu", "TanhShrink", "HardTanh", "HardShrink", "SoftShrink", "Squareplus", "SparsePlus",
    "SparseSigmoid", "Threshold", "Absolute", "Abs", "Exp", "Exp2", "Expm1", "Log", "Log1p", "Log2", "Log10", "Sqrt",
    "Square", "Negative", "Sin", "Cos", "Tan", "Tanh", "Sinh", "Cosh", "Arctan", "Sign", "Floor", "Ceil", "Round",
    "Reciprocal", "Clip", "Cbrt", "Trunc", "Copy", "Erf", "Cast",
}  # fmt: skip
BINARY_OPS = {
    "Add",
    "Subtract",
    "Multiply",
    "Divide",
    "TrueDivide",
    "Maximum",
    "Minimum",
    "Power",
    "Mod",
    "FloorDivide",
}
MOVE_OPS = {
    "GetItem", "Reshape", "Transpose", "ExpandDims", "Squeeze", "Moveaxis", "Swapaxes", "Mean", "Sum", "Max", "Min",
    "Amax", "Amin", "Flip",
}  # fmt: skip
REDUCTION_OPS = {"Mean", "Sum", "Max", "Min", "Amax", "Amin"}  # whether they keep zeros is evaluated
CONV_TYPES = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
DEPTHWISE_TYPES = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
SEPARABLE_TYPES = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
IDENTITY_TYPES = (  # at inference
    keras.layers.Dropout, keras.layers.GaussianNoise, keras.layers.GaussianDropout, keras.layers.AlphaDropout,
    keras.layers.ActivityRegularization, keras.layers.Identity,
)  # fmt: skip
ACTIVATION_TYPES = (keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.ELU)
COMBINE_TYPES = (
    keras.layers.Add, keras.layers.Subtract, keras.layers.Multiply, keras.layers.Average, keras.layers.Maximum,
    keras.layers.Minimum,
)  # fmt: skip
SPATIAL_TYPES = (  # layers over the spatial axes of a data_format: the channel axis stays where it is
    keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D, keras.layers.AveragePooling1D,
    keras.layers.AveragePooling2D, keras.layers.AveragePooling3D, keras.layers.ZeroPadding1D,
    keras.layers.ZeroPadding2D, keras.layers.ZeroPadding3D, keras.layers.Cropping1D, keras.layers.Cropping2D,
    keras.layers.Cropping3D, keras.layers.UpSampling1D, keras.layers.UpSampling2D, keras.layers.UpSampling3D,
)  # fmt: skip
GLOBAL_POOLING_TYPES = (
    keras.layers.GlobalAveragePooling1D, keras.layers.GlobalAveragePooling2D, keras.layers.GlobalAveragePooling3D,
    keras.layers.GlobalMaxPooling1D, keras.layers.GlobalMaxPooling2D, keras.layers.GlobalMaxPooling3D,
)  # fmt: skip


@dataclass(frozen=True)
class _Ref:
    """A run-time value in a call's arguments."""

    key: str


def _substitute(value: Any, replace: Callable[[Any], Any | None]) -> Any:
    """``value`` (nested lists, tuples and dicts) with each leaf ``replace`` returns something for replaced."""
    replaced = replace(value)
    if replaced is not None:
        return replaced
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_substitute(item, replace) for item in value)
    if isinstance(value, dict):
        return {key: _substitute(item, replace) for key, item in value.items()}
    return value


def _without(value: Any, keys: set[str]) -> Any:
    """``value`` (nested lists, tuples and dicts) with each run-time value of ``keys`` replaced by None."""
    if isinstance(value, _Ref):
        return None if value.key in keys else value
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_without(item, keys) for item in value)
    if isinstance(value, dict):
        return {key: _without(item, keys) for key, item in value.items()}
    return value


def _refs(value: Any) -> list[str]:
    found: list[str] = []
    _substitute(value, lambda leaf: found.append(leaf.key) if isinstance(leaf, _Ref) else None)
    return list(dict.fromkeys(found))


@dataclass(eq=False)
class Call:
    """One call of a layer or raw operation in the model's graph: its arguments (run-time values as ``_Ref``) and
    the keys of its outputs."""

    operation: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[str, ...]
    path: str
    note: str = ""  # why it runs at full width, where the call alone does not say (a MultiHeadAttention not folded)

    @property
    def inputs(self) -> list[str]:
        return _refs((self.args, self.kwargs))

    @property
    def layer(self) -> bool:
        return isinstance(self.operation, keras.layers.Layer)

    @property
    def kind(self) -> str:
        """The operation's class name (``Dense``, ``Multiply``, ...)."""
        return type(self.operation).__name__

    def arguments(self, values: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments with each run-time value taken from ``values``."""
        args, kwargs = _substitute(
            (self.args, self.kwargs), lambda leaf: values[leaf.key] if isinstance(leaf, _Ref) else None
        )
        return args, kwargs

    def run(self, values: Mapping[str, Any], operation: Any = None) -> list[Any]:
        """The call on ``values`` (eagerly, or on Keras tensors to build a model), with ``operation`` (a copy) instead
        of the model's; a list of outputs."""
        args, kwargs = self.arguments(values)
        op = self.operation if operation is None else operation
        if isinstance(op, keras.layers.Layer) and "training" not in kwargs:
            kwargs = {**kwargs, "training": False}
        return list(keras.tree.flatten(op(*args, **kwargs)))  # a structure's leaves in the order of its node's outputs

    def describe(self) -> str:
        return f"{self.path} ({self.kind})" + (f": {self.note}" if self.note else "")


def check_model(model: object) -> None:
    """A built Sequential or functional model."""
    _check_model(
        model, PREFIX, "read the graph of",
        "build it as a functional model (keras.Model(inputs, outputs)) with the same layers, or run every member "
        "with masksembles_keras.predict",
    )  # fmt: skip


def input_keys(model: Any) -> list[str]:
    """The keys of the model's inputs (``model.inputs``' order): ``INPUT`` for the first, the core's input."""
    return [INPUT] + [f"{INPUT}{i}" for i in range(1, len(model.inputs))]


def by_name(model: Any) -> bool:
    """Whether the model takes a dict of inputs by name (one input too: keras-hub's ``{"token_ids": ...}``)."""
    return not isinstance(model, keras.Sequential) and isinstance(model.input, dict)  # a Sequential's input: a tensor


def model_input(model: Any, leaves: Sequence[Any]) -> Any:
    """One value per input of ``model`` (``model.inputs``' order) in the structure the model takes: the value of a
    model with one input (not by name); else the structure of ``model.input``."""
    return leaves[0] if len(leaves) == 1 and not by_name(model) else keras.tree.pack_sequence_as(model.input, leaves)


def example_leaves(model: Any, example: Any) -> list[np.ndarray]:
    """``example`` as one array per input of ``model`` (``model.inputs``' order): an array for a model with one
    input (or a dict of it by name, where the model takes one); the structure of ``model.input`` (a list, or a dict
    by input name) for one with several."""
    if by_name(model) and (isinstance(example, Mapping) or len(model.inputs) > 1):
        if not isinstance(example, Mapping) or set(example) != set(model.input):
            raise ValueError(f"{PREFIX} need an example input with the model's inputs {sorted(model.input)}")
        given = [example[name] for name in sorted(model.input)]  # keras.tree's order of a dict: its sorted keys
    elif len(model.inputs) == 1:
        given = [example]
    else:
        given = list(example) if isinstance(example, list | tuple) else [example]
        if len(given) != len(model.inputs):
            raise ValueError(
                f"{PREFIX} need an example input with one array per input of the model ({len(model.inputs)}); "
                f"received {len(given)}"
            )
    leaves = [np.asarray(ops.convert_to_numpy(leaf)) for leaf in given]
    for leaf in leaves:
        if leaf.ndim < 1 or leaf.shape[0] < 1:
            raise ValueError(
                f"{PREFIX} need an example input with a batch of at least 1 on axis 0; received {leaf.shape}"
            )
    mca.check_batch_sizes(
        [(tensor.name, int(leaf.shape[0])) for tensor, leaf in zip(model.inputs, leaves, strict=True)]
    )
    return leaves


class _Graph:
    """The calls of a model in order, nested Sequential/functional models inlined; the keys of its outputs
    (``model.outputs``' order)."""

    def __init__(self, model: Any) -> None:
        self.calls: list[Call] = []
        self.count = 0
        self.parts: dict[int, tuple[Any, Any]] = {}  # a separable convolution's two layers, by the layer's id
        self.attention: dict[tuple[int, bool], AttentionParts] = {}  # by the layer's id and use_causal_mask
        self.outputs = self._walk(model, input_keys(model), "")

    def _walk(self, model: Any, inputs: list[str], prefix: str) -> list[str]:
        if isinstance(model, keras.Sequential):
            (key,) = inputs
            for layer in model.layers:
                key = self._call(layer, (_Ref(key),), {}, 1, prefix)[0]
            return [key]
        keys = {id(tensor): key for tensor, key in zip(model.inputs, inputs, strict=True)}
        for depth in sorted(model._nodes_by_depth, reverse=True):  # inputs first
            for node in model._nodes_by_depth[depth]:
                if node.is_input:
                    continue
                args, kwargs = _substitute(
                    (node.arguments.args, node.arguments.kwargs),
                    lambda leaf: _Ref(keys[id(leaf)]) if isinstance(leaf, keras.KerasTensor) else None,
                )
                given = (node.arguments.args, node.arguments.kwargs)
                outputs = self._call(node.operation, args, kwargs, len(node.outputs), prefix, given)
                keys.update((id(tensor), key) for tensor, key in zip(node.outputs, outputs, strict=True))
        return [keys[id(tensor)] for tensor in model.outputs]

    def _call(
        self, operation: Any, args: Any, kwargs: dict[str, Any], outputs: int, prefix: str, given: Any = None,
        name: str | None = None,
    ) -> list[str]:  # fmt: skip
        """The call's output keys, after recording it (``given``: its arguments as Keras tensors, in a functional
        graph), or the calls it makes (a nested model, a separable convolution, ``insert``'s ``Masked`` wrapper, a
        ``MultiHeadAttention`` that folds)."""
        note = ""
        if isinstance(operation, keras.layers.MultiHeadAttention):
            reason = fold_reason(operation, *(given or (args, kwargs)))
            if not reason and outputs == 1:
                return self._attention(operation, args, kwargs, prefix)
            note = f"runs whole: {reason or 'several outputs'}"
        unmasked = all(leaf is None for leaf in keras.tree.flatten(kwargs.get("mask")))
        if _is_graph_model(operation) and len(args) == 1 and set(kwargs) <= {"training", "mask"} and unmasked:
            # its inputs in the order of its ``inputs`` (``keras.tree``'s: a dict's by sorted key), whatever the
            # order of the structure it is called with
            given = keras.tree.flatten(args[0])
            reads = [leaf.key for leaf in given if isinstance(leaf, _Ref)]
            if len(reads) == len(given) == len(operation.inputs) and len(operation.outputs) == outputs:
                return self._walk(operation, reads, f"{prefix}{operation.name}/")
        if separable(operation) and len(args) == 1 and set(kwargs) <= {"training"} and outputs == 1:
            # the depthwise convolution and the 1x1 convolution it computes, two calls the planner compacts
            if id(operation) not in self.parts:
                self.parts[id(operation)] = separable_parts(operation)
            depthwise, pointwise = self.parts[id(operation)]
            (spread,) = self._call(depthwise, args, {}, 1, prefix)
            return self._call(pointwise, (_Ref(spread),), {}, 1, prefix)
        if isinstance(operation, Masked) and len(args) == 1 and set(kwargs) <= {"training"} and outputs == 1:
            # insert's wrapper (inside custom layers, in a model whose class builds its graph): its two calls
            (masked,) = self._call(operation.masksembles, args, {}, 1, prefix)
            return self._call(operation.layer, (_Ref(masked),), {}, 1, prefix)
        training = kwargs.get("training", True) if isinstance(operation, keras.layers.Layer) else True
        if training is False or training is None:
            # the inference ``training`` Keras writes into a node (a Dropout's default False): not an argument of
            # the computation (``Call.run`` passes training=False), so a dropout reads as the identity it is there
            kwargs = {key: value for key, value in kwargs.items() if key != "training"}
        keys = [f"v{self.count + i}" for i in range(outputs)]
        self.count += outputs
        path = f"{prefix}{name or operation.name}"
        self.calls.append(Call(operation, tuple(args), dict(kwargs), tuple(keys), path, note))
        return keys

    def _attention(self, layer: Any, args: Any, kwargs: dict[str, Any], prefix: str) -> list[str]:
        """A ``MultiHeadAttention`` as the calls it makes (``_pack_attention``): each projection after its own masks,
        the heads reading the projections and the call's masks, the output projection."""
        given = call_arguments(args, kwargs)
        causal = bool(given["use_causal_mask"])
        if (id(layer), causal) not in self.attention:
            self.attention[(id(layer), causal)] = AttentionParts.of(layer, causal)
        parts = self.attention[(id(layer), causal)]
        inner = f"{prefix}{layer.name}/"
        reads = {"query": given["query"], "key": given["value"] if given["key"] is None else given["key"]}
        reads["value"] = given["value"]
        projected = []
        for name, (masks, dense) in parts.projections.items():
            value = reads[name]
            if masks is not None:
                value = _Ref(self._call(masks, (value,), {}, 1, inner)[0])
            projected.append(_Ref(self._call(dense, (value,), {}, 1, inner, name=name)[0]))
        extra = {name: given[name] for name in MASKS if given[name] is not None}
        (heads,) = self._call(parts.heads, tuple(projected), extra, 1, inner, name="heads")
        return self._call(parts.output, (_Ref(heads),), {}, 1, inner, name="output")


def separable(operation: Any) -> bool:
    """A ``SeparableConv1D/2D`` that computes what Keras' own does (its class's ``call`` is Keras')."""
    return isinstance(operation, SEPARABLE_TYPES) and any(type(operation).call is t.call for t in SEPARABLE_TYPES)


def separable_parts(layer: Any) -> tuple[Any, Any]:
    """What a ``SeparableConv1D/2D`` computes (``keras.ops.separable_conv``, then its bias and activation) as two
    layers holding its weights: a ``DepthwiseConv1D/2D`` with its depthwise kernel, strides, padding and dilation (no
    bias, no activation), then a 1x1 ``Conv1D/2D`` with its pointwise kernel, bias and activation. Each output channel
    ``c * depth_multiplier + j`` of the first reads input channel ``c`` alone; the second mixes them."""
    rank = len(layer.kernel_size)
    depthwise_type, conv_type = DEPTHWISE_TYPES[rank - 1], CONV_TYPES[rank - 1]
    depthwise = depthwise_type(
        kernel_size=layer.kernel_size, strides=layer.strides, padding=layer.padding,
        depth_multiplier=layer.depth_multiplier, data_format=layer.data_format, dilation_rate=layer.dilation_rate,
        use_bias=False, dtype=layer.dtype_policy, name=f"{layer.name}_depthwise",
    )  # fmt: skip
    pointwise = conv_type(
        filters=layer.filters, kernel_size=1, data_format=layer.data_format, activation=layer.activation,
        use_bias=layer.use_bias, dtype=layer.dtype_policy, name=f"{layer.name}_pointwise",
    )  # fmt: skip
    channels, multiplier = (int(size) for size in layer.depthwise_kernel.shape[-2:])
    axis = 1 if layer.data_format == "channels_first" else rank + 1
    for part, width in ((depthwise, channels), (pointwise, channels * multiplier)):
        shape: list[int | None] = [None] * (rank + 2)
        shape[axis] = width
        part.build(tuple(shape))
    depthwise.kernel.assign(layer.depthwise_kernel)
    pointwise.kernel.assign(layer.pointwise_kernel)
    if layer.use_bias:
        pointwise.bias.assign(layer.bias)
    return depthwise, pointwise


@dataclass(eq=False)
class _Op(CapturedOp[str]):
    """A run-time value as the core sees it, with the call that computes it (``output``: which of its outputs) and
    how the emitter writes it (``role``): ``dense``, ``conv``, ``depthwise``, ``batchnorm``, ``layernorm``, ``masks``,
    ``identity``, ``flatten``, ``reshape`` (a move whose shape is rebuilt), ``per_channel`` (an elementwise operation
    with a per-channel constant, laid out like the compacted channels), ``call`` (the operation again, on the
    compacted tensor) or ``fallback``."""

    call: Call = field(kw_only=True)
    output: int = 0
    role: str = "call"


def _scalar(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, bool | int | float | str)
        or (np.ndim(value) == 0 and not isinstance(value, keras.Variable))
    )


def _static_index(value: Any) -> bool:
    """A constant of a static index (``x[:, 0]``'s key: GetItem's argument): an int, a slice of ints, None, ``...``."""
    if isinstance(value, slice):
        return all(part is None or isinstance(part, int) for part in (value.start, value.stop, value.step))
    return value is None or value is Ellipsis or isinstance(value, int)


def _activation(function: Any) -> bool:
    """Whether a layer's activation is elementwise (by its registered name)."""
    name = keras.activations.serialize(function)
    return isinstance(name, str) and name in ELEMENTWISE_ACTIVATIONS


def _masks_layers(operation: Any) -> list[Masksembles]:
    if not isinstance(operation, keras.layers.Layer):
        return []
    return [layer for layer in operation._flatten_layers(include_self=True, recursive=True)
            if isinstance(layer, Masksembles)]  # fmt: skip


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` as one compiled program on the JAX backend, whose eager operations each compile on first use
    (a pack-time evaluation of every call would compile every operation twice); as it is on the others."""
    if keras.backend.backend() != "jax":
        return function
    import jax

    return jax.jit(function)


@dataclass(frozen=True)
class _Question:
    """One evaluation of a call: ``"zero"`` (its inputs all +0, or -0 with ``sign``), ``"index"`` (its input holding
    each position's index along ``axis``), ``"redrawn"`` (at the second probe, sample 0 of every input changed) or
    ``"first"`` (the first B samples of the second probe's inputs: the same samples at the first probe's batch size)."""

    key: str
    kind: str
    axis: int = 0
    sign: float = 0.0


class Capture:
    """The model's calls, probed at the example's batch size B and B+1, and the core kind of each value
    (``masksembles_core.captured.CapturedGraph``)."""

    def __init__(self, model: Any, example: Any, n: int | None) -> None:
        check_model(model)
        self.model = model
        self.input = INPUT
        layers = model._flatten_layers(include_self=True, recursive=True)
        self.n = mca.check_members([layer.n for layer in layers if isinstance(layer, Masksembles)], n)
        self.inputs = input_keys(model)  # the first is the core's input; the others are read where the model reads them
        self.leaves = example_leaves(model, example)
        self.batch = int(self.leaves[0].shape[0])
        self.example = model_input(model, self.leaves)
        self.input_shapes = [_input_shape(t, x) for t, x in zip(model.inputs, self.leaves, strict=True)]
        graph = _Graph(model)
        self.calls = graph.calls
        self.outputs = graph.outputs
        compiled_run = compiled(self._run)
        written: set[int] = set()  # the ids of the variables a call writes (a seed generator's state)

        def run(leaves: Sequence[Any]) -> dict[str, Any]:
            with _no_autograd(), keras.StatelessScope() as scope:  # what is written stays in the scope of one run
                values: dict[str, Any] = compiled_run(leaves)
            written.update(scope.state_mapping)
            return values

        probes = [run(self.leaves), run([np.concatenate([x, x[:1]]) for x in self.leaves])]
        again = run(self.leaves)
        # an output a layer returns as None (XLNet's encoder: its memory, when none is asked for) is no value: the
        # calls that read it are given None
        absent = {key for key, value in probes[0].items() if value is None}
        for call in self.calls:
            call.args, call.kwargs = _without((call.args, call.kwargs), absent)
        self.values = [
            {key: np.asarray(ops.convert_to_numpy(v)) for key, v in probe.items() if key not in absent}
            for probe in probes
        ]
        self._check_repeatable(again, written)
        self.seen = {
            key: Probed(tuple(tuple(int(d) for d in v[key].shape) for v in self.values), self.batch)
            for key in self.values[0]
        }
        self.by_key = {
            key: (call, position)
            for call in self.calls
            for position, key in enumerate(call.outputs)
            if key not in absent
        }
        self.dependent: dict[str, bool] = {}
        self.folding = True  # AttentionHeads calls fold into the heads (not in the dense program)
        classified = {key: self._classify(call, key, position) for key, (call, position) in self.by_key.items()}
        self.answers = self._answers(classified)
        self.ops: dict[str, _Op] = {}
        self.reset(dense=False)

    def _check_repeatable(self, again: Mapping[str, Any], written: set[int]) -> None:
        """The model's calls give the same values in a second inference call on the example (``again``) and write no
        variable (``written``: their ids; a seed generator's state, which draws other random numbers next call): a
        model random at every call has no one program that equals ``predict``."""
        need = f"{PREFIX} need a model that computes the same outputs for the same input in inference"
        why = (
            "it draws random numbers at every call (noise outside training). Pass that randomness in as an input of "
            "the model, or make it fixed in inference, then pack"
        )
        for call in self.calls:
            variables = getattr(call.operation, "variables", []) if call.layer else []
            if any(id(variable) in written for variable in variables):
                raise ValueError(f"{need}; {call.describe()} writes its state in an inference call: {why}")
            for key in call.outputs:
                if key in self.values[0] and not _close(self.values[0][key], _numpy(again[key])):
                    raise ValueError(
                        f"{need}; {call.describe()} gave other values in two inference calls on the example input: "
                        f"{why}"
                    )
        if written:
            raise ValueError(f"{need}; it writes a variable in an inference call (keras.random's global seed): {why}")

    def _run(self, leaves: Sequence[Any]) -> dict[str, Any]:
        """Every call in inference on the inputs' values: each value."""
        values = dict(zip(self.inputs, leaves, strict=True))
        for call in self.calls:
            values.update(zip(call.outputs, call.run(values), strict=True))
        return values

    def reset(self, dense: bool) -> None:
        """Classify every value again (the axis solver turns some into fallbacks); ``dense``: all of them fallbacks,
        none folded."""
        self.folding = not dense
        self.ops = {key: self.fallback(key) for key in self.inputs[1:]}
        for key, (call, position) in self.by_key.items():
            op = None if dense else self._classify(call, key, position)
            self.ops[key] = op if op is not None else self.fallback(key)

    def _answers(self, classified: Mapping[str, _Op | None]) -> dict[_Question, np.ndarray]:
        """Every evaluation the core may ask for, run in one call (one compiled program on JAX): zeros through each
        elementwise call, index tensors through each move, a redrawn sample through every call."""
        questions = [_Question(key, "first") for key in classified if self._inputs_differ(key)]
        for key, op in classified.items():
            if op is None:
                questions.append(_Question(key, "redrawn"))
                continue
            if op.kind in ("channelwise", "grouped", "combine", "concat"):
                questions += [_Question(key, "zero", sign=0.0), _Question(key, "zero", sign=-0.0)]
            if op.rule == "map":
                questions += [_Question(key, "index", axis=a) for a in range(self.seen[op.tensors[0]].rank)]
            questions.append(_Question(key, "redrawn"))
        dtypes = {key: str(value.dtype) for key, value in self.values[0].items()}

        def ask(large: dict[str, Any]) -> list[Any]:
            results = []
            for question in questions:
                call, position = self.by_key[question.key]
                given: dict[str, Any] = {}
                for t in call.inputs:
                    shape = self.seen[t].shape
                    if question.kind == "zero":
                        given[t] = ops.full(shape, question.sign, dtype=dtypes[t])
                    elif question.kind == "first":
                        given[t] = large[t][: self.batch]
                    elif question.kind == "index":
                        view = [1] * len(shape)
                        view[question.axis] = shape[question.axis]
                        steps = ops.reshape(ops.arange(shape[question.axis], dtype="float32"), view)
                        given[t] = ops.broadcast_to(steps, shape)
                    else:
                        first = large[t][:1]
                        if dtypes[t].startswith(("float", "bfloat")):
                            changed = first * -2.0 + 1.0
                        elif dtypes[t] == "bool":  # a where's condition: TensorFlow adds no numbers to bools
                            changed = ops.logical_not(first)
                        else:
                            changed = first + 1
                        given[t] = ops.concatenate([ops.cast(changed, dtypes[t]), large[t][1:]], axis=0)
                output = call.run(given)[position]
                results.append(ops.equal(output, 0) if question.kind == "zero" else output)
            return results

        with _no_autograd():
            answers = compiled(ask)({key: ops.convert_to_tensor(value) for key, value in self.values[1].items()})
        return {q: np.asarray(ops.convert_to_numpy(a)) for q, a in zip(questions, answers, strict=True)}

    # ---- what the core's pipeline asks (``masksembles_core.captured.CapturedGraph``)

    @property
    def output(self) -> str | None:
        return self.outputs[0] if len(self.outputs) == 1 else None

    @property
    def output_leaves(self) -> list[str]:
        return self.outputs

    def probed(self, key: str) -> Probed:
        return self.seen[key]

    def name(self, key: str) -> str:
        return key

    def fallback(self, key: str) -> _Op:
        if key in self.inputs:  # an input but the first: the model's input as it is, shared by the members
            call = Call(None, (), {}, (key,), self.model.inputs[self.inputs.index(key)].name)
            return _Op(key, "fallback", [], rule="none", call=call, role="input")
        call, position = self.by_key[key]
        folded = self.folding and isinstance(call.operation, AttentionHeads) and not call.note
        return _Op(key, "fallback", call.inputs, rule="none", call=call, output=position, role="fallback",
                   batch_dependent=self._reads_the_batch(call, key), folded=folded,
                   broadcast=tuple(range(3, len(call.inputs))) if folded else ())  # fmt: skip

    def unfold(self, key: str) -> None:
        """Run the ``AttentionHeads`` call of ``key`` as a plain fallback (a mask it reads is computed per member:
        ``masksembles_core.packing.FoldConflict``)."""
        self.by_key[key][0].note = "not folded into the heads: a mask it reads is computed per member"

    def axis_map(self, op: _Op, source_axis: int) -> int | None:
        result = self.answers[_Question(op.key, "index", axis=source_axis)]
        return whole_axis(result, self.seen[op.tensors[0]].shape[source_axis])

    def zero_map(self, op: _Op) -> np.ndarray:
        zero = np.ones(self.seen[op.key].shape[op.axis], dtype=bool)
        for sign in (0.0, -0.0):
            zero &= captured.zero_channels(self.answers[_Question(op.key, "zero", sign=sign)], op.axis)
        return zero

    def zero_rule(self, op: _Op) -> tuple[str, tuple[int, ...]]:
        """Products of two values are zero when one is; anything else when evaluating it on zeros gave zeros."""
        product = op.call.kind == "Multiply" and len(op.call.inputs) == len(_leaves(op.call))
        if product:
            return "any", ()
        return ("all", ()) if self.zero_map(op).all() else ("never", ())

    def repeatable(self, key: str) -> bool:
        return array_repeatable(self.seen[key])

    def _reads_the_batch(self, call: Call, key: str) -> bool:
        """Whether a call may read the batch (its size, or other samples), so that it runs per member: a Masksembles
        layer, a value without an exact batch axis, or a result that changes for other samples when one sample is
        redrawn, or with the batch size: the same samples at the two probe batch sizes give other results (the call
        run on the first B samples of its inputs at B+1, where those differ from its inputs at B, as after a
        Masksembles layer, which gives a sample another member at another batch size)."""
        if key not in self.dependent:
            first = _Question(key, "first")
            alone = self.answers[first] if first in self.answers else self.values[0][key]
            self.dependent[key] = (
                bool(_masks_layers(call.operation))
                or self.mixes_samples(call, key)
                or not _close(alone, self.values[1][key][: self.batch])
            )
        return self.dependent[key]

    def _inputs_differ(self, key: str) -> bool:
        """Whether the call of ``key`` and its inputs hold the batch on axis 0 and some input's first B samples at the
        second probe differ from its value at the first (``_reads_the_batch`` then runs the call on them)."""
        call, _ = self.by_key[key]
        if not call.inputs or any(self.seen[k].batch_axis != 0 for k in (*call.inputs, key)):
            return False
        return not all(_close(self.values[0][t], self.values[1][t][: self.batch]) for t in call.inputs)

    def mixes_samples(self, call: Call, key: str) -> bool:
        """Whether a call may compute a sample's result from other samples: a call without inputs, a value without
        its batch on axis 0, or a result that changes for other samples when one sample of its inputs is redrawn."""
        return (
            not call.inputs
            or any(self.seen[k].batch_axis != 0 for k in (*call.inputs, key))
            or not _close(self.answers[_Question(key, "redrawn")][1:], self.values[1][key][1:])
        )

    # ---- classification

    def _classify(self, call: Call, key: str, position: int) -> _Op | None:
        """The call's compacted kind, or None: a fallback."""
        tensors = call.inputs
        if len(call.outputs) != 1 or not tensors:
            return None
        rank = self.seen[key].rank
        return self._layer(call, key, tensors, rank) if call.layer else self._raw(call, key, tensors, rank)

    def _channel_constant(self, constant: Any, tensor: str, key: str) -> int | None:
        """The axis along which a constant operand of an elementwise operation varies, where it varies along that
        one alone (right-aligned, size 1 or absent on every other axis of the result; ``x * gamma`` with gamma (C,),
        a per-channel scale) and the other operand has the result's shape: channel ``c`` of the result then reads
        channel ``c`` of the operand and one number of the constant (None otherwise)."""
        shape, out = constant_shape(constant), self.seen[key].shape
        if self.seen[tensor].shape != out or len(shape) > len(out):
            return None
        varying = [len(out) - len(shape) + a for a, size in enumerate(shape) if size != 1]
        if len(varying) != 1 or out[varying[0]] != shape[varying[0] - len(out) + len(shape)]:
            return None
        return varying[0]

    def _layer(self, call: Call, key: str, tensors: list[str], rank: int) -> _Op | None:
        layer = call.operation
        channels_first = getattr(layer, "data_format", "channels_last") == "channels_first"
        axis = 1 if channels_first else self.seen[tensors[0]].rank - 1  # of the (first) input
        single = len(tensors) == 1 and len([leaf for leaf in _leaves(call) if leaf is not None]) == 1
        if isinstance(layer, Masksembles):
            if not single or call.kwargs.get("samples") is not None:
                return None
            masks = np.asarray(ops.convert_to_numpy(layer.masks)) != 0
            channel = layer.channel_axis % rank
            return _Op(key, "masks", tensors, rule="fixed", fixed_in=channel, fixed_out=channel, batch_in=0,
                       batch_out=0, masks=masks, call=call, role="masks")  # fmt: skip
        if getattr(layer, "dtype_policy", None) is not None and layer.dtype_policy.quantization_mode is not None:
            return None
        if not single:
            if isinstance(layer, COMBINE_TYPES):
                return _Op(key, "combine", tensors, call=call)
            if isinstance(layer, keras.layers.Concatenate) and len(tensors) == len(_leaves(call)):
                return _Op(key, "concat", tensors, rule="concat", concat_dim=layer.axis % rank, call=call)
            return None
        if isinstance(layer, keras.layers.Dense) and not getattr(layer, "lora_enabled", False):
            if not _activation(layer.activation):
                return None
            return _Op(key, "mixing", tensors, rule="fixed", fixed_in=rank - 1, fixed_out=rank - 1, call=call,
                       role="dense")  # fmt: skip
        if isinstance(layer, CONV_TYPES) and not getattr(layer, "lora_enabled", False):
            if not _activation(layer.activation):
                return None
            kind = "mixing" if layer.groups == 1 else "grouped"
            return _Op(key, kind, tensors, rule="fixed", fixed_in=axis, fixed_out=axis, batch_in=0, batch_out=0,
                       groups=layer.groups, call=call, role="conv")  # fmt: skip
        if isinstance(layer, DEPTHWISE_TYPES):
            if not _activation(layer.activation):
                return None
            groups = self.seen[tensors[0]].shape[axis]
            return _Op(key, "grouped", tensors, rule="fixed", fixed_in=axis, fixed_out=axis, batch_in=0, batch_out=0,
                       groups=groups, call=call, role="depthwise")  # fmt: skip
        if isinstance(layer, keras.layers.BatchNormalization):
            channel = layer.axis % rank
            return _Op(key, "channelwise", tensors, rule="fixed", fixed_in=channel, fixed_out=channel, call=call,
                       role="batchnorm")  # fmt: skip
        if isinstance(layer, keras.layers.LayerNormalization):
            if not _over_last_axis(layer, self.seen[tensors[0]].rank):
                return None
            return _Op(key, "norm", tensors, rule="fixed", fixed_in=rank - 1, fixed_out=rank - 1, call=call,
                       role="layernorm")  # fmt: skip
        if isinstance(layer, IDENTITY_TYPES):
            return _Op(key, "channelwise", tensors, keeps_zeros=True, call=call, role="identity")
        if isinstance(layer, ACTIVATION_TYPES) or (
            isinstance(layer, keras.layers.Activation) and _activation(layer.activation)
        ):
            return _Op(key, "channelwise", tensors, call=call)
        if isinstance(layer, SPATIAL_TYPES):
            return _Op(key, "channelwise", tensors, rule="fixed", fixed_in=axis, fixed_out=axis, batch_in=0,
                       batch_out=0, call=call)  # fmt: skip
        if isinstance(layer, GLOBAL_POOLING_TYPES):
            out = axis if layer.keepdims else 1
            return _Op(key, "channelwise", tensors, rule="fixed", fixed_in=axis, fixed_out=out, batch_in=0,
                       batch_out=0, call=call)  # fmt: skip
        if isinstance(layer, keras.layers.Flatten) and not channels_first:
            return _Op(key, "flatten", tensors, rule="flatten", batch_in=0, batch_out=0, call=call, role="flatten")
        if isinstance(layer, keras.layers.Reshape):
            return _Op(key, "channelwise", tensors, rule="map", keeps_zeros=True, batch_in=0, batch_out=0, call=call,
                       role="reshape")  # fmt: skip
        if isinstance(layer, keras.layers.Permute):
            return _Op(key, "channelwise", tensors, rule="map", keeps_zeros=True, call=call)
        return None

    def _raw(self, call: Call, key: str, tensors: list[str], rank: int) -> _Op | None:
        """A raw operation (``keras.ops``), its constants in its config and arguments."""
        name = call.kind
        if not type(call.operation).__module__.startswith("keras."):
            return None
        config = call.operation.get_config()
        constants = [leaf for leaf in _leaves(call) if not isinstance(leaf, _Ref)]
        scalars = all(_scalar(value) for value in (*constants, *config.values()))
        if name in UNARY_OPS | BINARY_OPS and scalars:
            if len(tensors) == 1:
                return _Op(key, "channelwise", tensors, call=call)
            if name in BINARY_OPS and len(tensors) == 2 and not constants:
                return _Op(key, "combine", tensors, call=call)
            return None
        if name in BINARY_OPS and len(tensors) == 1 and len(constants) == 1 and len(_leaves(call)) == 2:
            axis = self._channel_constant(constants[0], tensors[0], key)
            if axis is not None and all(_scalar(value) for value in config.values()):
                return _Op(key, "channelwise", tensors, rule="fixed", fixed_in=axis, fixed_out=axis, call=call,
                           role="per_channel")  # fmt: skip
            return None
        if (
            name in MOVE_OPS
            and len(tensors) == 1
            and len(_leaves(call)) == len(constants) + 1
            and all(_static_index(leaf) for leaf in constants)
        ):
            role = "reshape" if name == "Reshape" else "call"
            batch = 0 if role == "reshape" else -1
            return _Op(key, "channelwise", tensors, rule="map", keeps_zeros=name not in REDUCTION_OPS, batch_in=batch,
                       batch_out=batch, call=call, role=role)  # fmt: skip
        if name == "Concatenate" and len(tensors) == len(_leaves(call)):
            return _Op(key, "concat", tensors, rule="concat", concat_dim=config["axis"] % rank, call=call)
        return None


def constant_shape(value: Any) -> tuple[int, ...]:
    """The shape of a constant argument (an array, a ``keras.Variable``, a backend tensor)."""
    return tuple(int(size) for size in getattr(value, "shape", np.shape(value)))


def _input_shape(tensor: Any, x: np.ndarray) -> tuple[int | None, ...]:
    """The shape (batch left out) a packed model's input declares: the model's input's (``tensor``), whose sizes
    declared None (a sequence length) any call may change, where ``x`` fits it; ``x``'s otherwise."""
    declared = tuple(tensor.shape[1:])
    fits = len(declared) == x.ndim - 1
    if fits and all(d is None or int(d) == s for d, s in zip(declared, x.shape[1:], strict=True)):
        return tuple(None if d is None else int(d) for d in declared)
    return tuple(int(s) for s in x.shape[1:])


def _over_last_axis(layer: Any, rank: int) -> bool:
    """Whether a ``LayerNormalization`` layer normalizes over the last axis of its rank-``rank`` input alone, with
    Keras' own ``call`` (``MemberLayerNormalization`` computes that one per member)."""
    axes = layer.axis if isinstance(layer.axis, list | tuple) else [layer.axis]
    own = type(layer).call is keras.layers.LayerNormalization.call
    return own and rank >= 2 and [int(a) % rank for a in axes] == [rank - 1]


def _leaves(call: Call) -> list[Any]:
    """The leaves of a call's arguments (run-time values as ``_Ref``)."""
    found: list[Any] = []

    def visit(leaf: Any) -> None:
        if isinstance(leaf, list | tuple | dict) and not isinstance(leaf, _Ref):
            return None
        found.append(leaf)
        return None

    _substitute((call.args, call.kwargs), lambda leaf: visit(leaf))
    return found


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(value))


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to float rounding of a reordered computation."""
    if a.shape != b.shape:
        return False
    if a.dtype.kind not in "fc":
        return bool(np.array_equal(a, b))
    scale = float(np.max(np.abs(b), initial=0.0)) or 1.0
    return bool(np.allclose(a, b, rtol=0.0, atol=1e-5 * scale, equal_nan=True))


def spatial_size(shape: Sequence[int], batch_axis: int, channel_axis: int) -> int:
    """The positions a channel has in a value: every axis but the batch's and the channels'."""
    return math.prod(s for a, s in enumerate(shape) if a not in (batch_axis, channel_axis))
