"""The uncertainty head: a Keras model that answers with the members' predictive distribution and its uncertainty.

``with_uncertainty`` wraps a packed model (``pack``), a model with Masksembles layers (``insert``,
``convert_dropout``: run on the tiled batch, as ``predict`` runs it) or a model that stacks members itself, in a
functional model whose output is ``masksembles_core.heads``' dict, computed with ``keras.ops`` in its graph, so that
``.keras`` files, ``model.export`` and ``jit_compile`` take it with the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

import masksembles_core.adapter as mca
from masksembles_core import metrics
from masksembles_core.heads import HeadSpec, check_head, gaussian_channels

from ._layers import SERIALIZATION_PACKAGE, Masksembles
from ._packed_layers import SelectMembers, TileBatch
from ._packing import PackedMasksembles

PACKED_MEMBER_AXIS = 1  # a PackedMasksembles answers (B, n, ...)


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class UncertaintyHead(keras.layers.Layer):  # type: ignore[misc]  # keras is untyped: Layer is Any to mypy
    """Members with the members on ``member_axis`` (``(n, B, ...)`` for 0) -> ``masksembles_core.heads``' dict.

    Computed in float32 (float64 members stay float64): a log-softmax over the classes (a single logit column is a
    sigmoid, the two logits ``(0, z)``), ``0 log 0 = 0``, the mutual information clamped at 0, probabilities (with
    ``logits=False``) renormalized to sum to 1 as the core renormalizes them. Called on concrete tensors (eagerly),
    it first checks the members as ``masksembles_core.metrics`` does and raises its errors (probabilities given as
    logits and the reverse, NaN or inf); inside a traced or exported graph nothing is checked.
    """

    def __init__(
        self,
        task: str = "classification",
        logits: bool = True,
        head: str | None = None,
        min_variance: float = 1e-6,
        member_axis: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.spec = check_head(task, logits=logits, head=head, min_variance=min_variance)
        self.member_axis = int(member_axis)

    def call(self, members: Any) -> dict[str, Any]:
        if _concrete(members):
            _check_members(ops.convert_to_numpy(members), self.spec, self.member_axis)
        dtype = "float64" if keras.backend.standardize_dtype(members.dtype) == "float64" else "float32"
        stacked = ops.moveaxis(ops.cast(members, dtype), self.member_axis, 0)
        if self.spec.task == "classification":
            return _classification(stacked, self.spec.logits)
        if self.spec.head is None:
            mean = ops.mean(stacked, axis=0)
            return {"mean": mean, "variance": ops.mean(ops.square(stacked - mean), axis=0)}
        return _gaussian_mixture(stacked, self.spec.head, self.spec.min_variance)

    def compute_output_spec(self, members: Any) -> dict[str, keras.KerasTensor]:
        shape = list(members.shape)
        del shape[self.member_axis]
        dtype = "float64" if keras.backend.standardize_dtype(members.dtype) == "float64" else "float32"
        if self.spec.task == "classification":
            classes = shape[-1] if shape[-1] is None else max(shape[-1], 2)  # one logit: a sigmoid's two classes
            probabilities = (*shape[:-1], classes)
            return {
                name: keras.KerasTensor(probabilities if name == "probabilities" else shape[:-1], dtype=dtype)
                for name in self.spec.outputs
            }
        value_shape = shape if self.spec.head is None else shape[:-1]
        return {name: keras.KerasTensor(value_shape, dtype=dtype) for name in self.spec.outputs}

    def get_config(self) -> dict[str, Any]:
        spec = self.spec
        return {
            **super().get_config(),
            "task": spec.task,
            "logits": spec.logits,
            "head": spec.head,
            "min_variance": spec.min_variance,
            "member_axis": self.member_axis,
        }


def _entropy(probabilities: Any, log_probabilities: Any) -> Any:
    """Entropy in nats over the last axis, with 0 log 0 = 0 (a −inf log next to a zero probability adds nothing)."""
    return -ops.sum(ops.where(probabilities > 0, probabilities * log_probabilities, 0.0), axis=-1)


def _classification(members: Any, logits: bool) -> dict[str, Any]:
    """(n, B, K) logits or probabilities -> the classification dict (K = 1 logits: two classes)."""
    if logits:
        if members.shape[-1] == 1:
            members = ops.concatenate([ops.zeros_like(members), members], axis=-1)
        log_probabilities = ops.log_softmax(members, axis=-1)
        probabilities = ops.exp(log_probabilities)
    else:
        probabilities = members / ops.sum(members, axis=-1, keepdims=True)
        log_probabilities = ops.log(ops.where(probabilities > 0, probabilities, 1.0))
    mean = ops.mean(probabilities, axis=0)
    predictive = _entropy(mean, ops.log(ops.where(mean > 0, mean, 1.0)))
    expected = ops.mean(_entropy(probabilities, log_probabilities), axis=0)
    return {
        "probabilities": mean,
        "predictive_entropy": predictive,
        "expected_entropy": expected,
        "mutual_information": ops.maximum(predictive - expected, 0.0),  # Jensen: >= 0 up to rounding
        "max_probability": ops.max(mean, axis=-1),
    }


def _gaussian_mixture(members: Any, head: str, min_variance: float) -> dict[str, Any]:
    """(n, B, ..., 2) Gaussian members -> the equal-weight mixture's mean and variance, and its split."""
    means, channel = members[..., 0], members[..., 1]
    if head == "log_variance":
        variances = ops.exp(ops.maximum(channel, math.log(min_variance)))
    else:
        variances = ops.maximum(channel, min_variance)
    mean = ops.mean(means, axis=0)
    aleatoric = ops.mean(variances, axis=0)
    epistemic = ops.mean(ops.square(means - mean), axis=0)
    return {"mean": mean, "variance": aleatoric + epistemic, "aleatoric": aleatoric, "epistemic": epistemic}


def _check_members(members: np.ndarray[Any, Any], spec: HeadSpec, member_axis: int) -> None:
    """The core's checks of concrete members (its errors and messages)."""
    if spec.task == "classification":
        metrics.member_probabilities(members, logits=spec.logits, member_axis=member_axis)
    elif spec.head is None:
        metrics.member_mean(members, member_axis=member_axis)
    else:
        gaussian_channels(np.moveaxis(members, member_axis, 0), spec.head, spec.min_variance)
        metrics.member_mean(members, member_axis=member_axis)


def _concrete(x: Any) -> bool:
    """Whether ``x`` holds values (an eager call), not a symbol being traced, compiled or exported."""
    backend = keras.backend.backend()
    if isinstance(x, keras.KerasTensor):
        return False
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.executing_eagerly())
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    if backend == "torch":
        import torch
        from torch._subclasses.fake_tensor import is_fake

        jit_tracing = torch._C._get_tracing_state() is not None  # torch.jit.trace (the TorchScript ONNX exporter)
        tracing = torch.compiler.is_compiling() or torch.compiler.is_exporting() or jit_tracing
        return not (tracing or is_fake(x) or x.device.type == "meta")
    return False


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class UncertaintyModel(keras.Model):  # type: ignore[misc]
    """What ``with_uncertainty`` returns: a functional model (B, ...) -> dict, always called in inference.

    ``training`` is ignored (always False): the wrapped model's Dropout stays off and BatchNormalization reads its
    moving statistics whatever the caller passes, as ``predict`` runs it. A call returns the dict in
    ``HeadSpec.outputs``' order (``model.predict`` on JAX and the exported formats sort it by name).
    """

    def call(self, inputs: Any, training: Any = None, mask: Any = None, **kwargs: Any) -> Any:
        outputs = super().call(inputs, training=False, mask=mask, **kwargs)
        (head,) = (layer for layer in self.layers if isinstance(layer, UncertaintyHead))
        return {name: outputs[name] for name in head.spec.outputs}  # the torch backend's tree utilities sort keys


def with_uncertainty(
    model: keras.Model,
    *,
    task: str = "classification",
    logits: bool = True,
    head: str | None = None,
    min_variance: float = 1e-6,
    member_axis: int | None = None,
    n: int | None = None,
) -> UncertaintyModel:
    """``model`` answering with its members' uncertainty: (B, ...) -> a dict of ``masksembles_core.heads``' names.

    Classification (``logits=True``: the members output logits, a single column a sigmoid's; ``False``:
    probabilities): ``probabilities`` (B, K), ``predictive_entropy``, ``expected_entropy``, ``mutual_information``,
    ``max_probability`` (B,). Regression (``task="regression"``): ``mean`` and ``variance`` (B, ...) of point
    members; with ``head="log_variance"`` or ``"variance"`` (members (…, 2) holding a mean and a variance channel, as
    ``GaussianNLL`` trains them; the variance floored at ``min_variance``) the mixture's ``mean`` and ``variance``
    and its ``aleatoric`` and ``epistemic`` parts. Each equals ``masksembles_core.heads.uncertainty_head`` on
    ``predict``'s members, up to float32 rounding.

    The members come from:

    - a ``PackedMasksembles`` (``pack``): its (B, n, ...) output;
    - a model with Masksembles layers (``insert``, ``convert_dropout``): the model called on the input tiled ``n``
      times and the output untiled, in the graph (what ``predict`` computes; ``n`` read from its layers);
    - any other model whose single output stacks members on ``member_axis`` (required then).

    The result is a functional Keras model of registered layers (``.keras`` files load after ``import
    masksembles_keras``; ``model.export`` and ``jit_compile`` take it); it calls the wrapped model with
    ``training=False`` whatever its caller passes. Called eagerly, it checks the members as
    ``masksembles_core.metrics`` does (probabilities given with ``logits=True`` or the reverse, NaN or inf); compiled
    or exported graphs do not check.

    Args:
        member_axis: for a model that stacks members itself, the axis of its output that holds them; a packed
            model's is 1 and a Masksembles model's members come from the tiled batch: another value raises.
        n: the number of members; None reads it from the model (its Masksembles layers, the packed members).

    Raises:
        ValueError: bad head arguments (``masksembles_core.heads.check_head``), a model with no members (no
            Masksembles layer, not packed, an extracted single member, no ``member_axis``), several outputs,
            ``n`` or ``member_axis`` that disagree with the model, members of the wrong rank for the task.
        TypeError: ``model`` is not a built Keras model with inputs (a functional or Sequential model).
    """
    spec = check_head(task, logits=logits, head=head, min_variance=min_variance)
    try:
        structure = model.input if isinstance(model, keras.Model) else None
    except (AttributeError, ValueError):  # a subclassed or unbuilt model has no symbolic input
        structure = None
    if structure is None:
        raise TypeError(
            f"with_uncertainty needs a built functional or Sequential Keras model (it reads the model's inputs); "
            f"received {type(model).__name__}"
        )
    if len(keras.tree.flatten(model.outputs)) != 1:
        raise ValueError(
            f"with_uncertainty needs a model with one output; {model.name!r} has {len(model.outputs)} (make a model "
            f"of the output the members answer with)"
        )
    inputs = keras.tree.map_structure(lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name), structure)
    members, axis = _members(model, inputs, member_axis, n)
    _check_member_shape(members.shape, axis, spec)
    head_layer = UncertaintyHead(
        spec.task, spec.logits, spec.head, spec.min_variance, member_axis=axis, name="uncertainty"
    )
    return UncertaintyModel(inputs, head_layer(members), name=f"{model.name}_uncertainty")


def _members(model: keras.Model, inputs: Any, member_axis: int | None, n: int | None) -> tuple[Any, int]:
    """The wrapped model's members as a symbolic tensor, and the axis that holds them."""
    if isinstance(model, PackedMasksembles):
        if len(model.members) == 1:
            raise ValueError(
                "with_uncertainty needs members, and this PackedMasksembles computes one (extract_member): wrap the "
                "model it was extracted from, or its pack()"
            )
        _same(member_axis, PACKED_MEMBER_AXIS, "member_axis", "a packed model's outputs are (B, n, ...)")
        _same(n, len(model.members), "n", "the packed model's member count")
        return model(inputs, training=False), PACKED_MEMBER_AXIS
    layers = model._flatten_layers(include_self=True, recursive=True)
    counts = [layer.n for layer in layers if isinstance(layer, Masksembles)]
    if counts:
        members = mca.check_members(counts, n)
        if member_axis is not None:
            raise ValueError(
                f"member_axis is for a model whose output stacks members; {model.name!r} has Masksembles layers, its "
                f"members come from the tiled batch (as predict computes them): leave member_axis None"
            )
        tiled = keras.tree.map_structure(TileBatch(members, name="tile"), inputs)
        untiled = SelectMembers(members, range(members), False, name="members")(model(tiled, training=False))
        return untiled, PACKED_MEMBER_AXIS
    if member_axis is None:
        raise ValueError(
            f"{model.name!r} has no members: it is not a pack()ed model and has no Masksembles layer (insert or "
            f"convert_dropout puts them in); for a model whose output already stacks members, pass member_axis"
        )
    outputs = model(inputs, training=False)
    rank = len(outputs.shape)
    axis = mca.check_int("member_axis", member_axis, minimum=-rank)
    if axis >= rank:
        raise ValueError(f"member_axis={axis} is out of range for the model's output of rank {rank}")
    axis %= rank
    if n is not None and outputs.shape[axis] is not None:
        _same(n, outputs.shape[axis], "n", f"the size of the output's member axis {axis}")
    return outputs, axis


def _same(given: int | None, expected: int, name: str, why: str) -> None:
    if given is not None and given != expected:
        raise ValueError(f"{name}={given} differs from {expected}: {why}")


def _check_member_shape(shape: Sequence[int | None], axis: int, spec: HeadSpec) -> None:
    """Members of a rank the head reads: classification (n, B, K) (any member axis), regression (n, B, ...)."""
    layout = "(n, B, K)" if spec.task == "classification" else "(n, B, ...)"
    if (spec.task == "classification" and len(shape) != 3) or len(shape) < 2:
        raise ValueError(f"{spec.task} members must be {layout} (member axis {axis}); received shape {tuple(shape)}")
    if spec.head is not None and shape[-1] != 2:
        raise ValueError(
            f"Gaussian members (head={spec.head!r}) need a last axis of 2 (mean, variance channel); received shape "
            f"{tuple(shape)}"
        )


__all__ = ["UncertaintyHead", "UncertaintyModel", "with_uncertainty"]
