"""Keras ``pack`` of ``MultiHeadAttention``: its projections compacted, its attention folded into the heads.

A ``keras.layers.MultiHeadAttention`` call on (B, T, C) queries and (B, S, C') keys and values is read as the calls it
makes (``AttentionParts``, which ``_pack_capture``'s graph calls in its place): the query, key and value projections,
each an ``EinsumDense`` ``"abc,cde->abde"`` that is a Dense layer over the hidden size, (B, L, C) -> (B, L,
heads*size) with its kernel (C, heads, size) read as (C, heads*size), each after its own Masksembles layer where
``insert`` put one inside the attention (``Masked``: each projection reads the channels its own masks keep); then
``AttentionHeads``, the attention between them with the call's masks; then the output projection ``"abcd,cde->abe"``
as a Dense, (B, T, heads*value_size) -> (B, T, E). The planner compacts the projections like any Dense (the output
projection computes only the channels the layers after it read). ``AttentionHeads`` computes every head apart and
applies its masks (attention, value and key masks, the causal mask) the same way to every head, so it is a *folded*
fallback (``masksembles_core.packing``): the members' heads side by side, (B, T, m*heads*size), are one attention with
m times the heads, run once on (B, T, m*heads, size), the masks broadcast over the heads; its output, in member
blocks, goes to the members' output projections without a move. Where a mask it reads is computed per member (after
Masksembles) it runs as a plain fallback, on the member-stacked batch.

What does not fold runs whole, at full width on the member-stacked batch, listed in ``fallbacks`` with the reason
(``fold_reason``): a subclass with its own ``call`` or attention, attention scores returned, a call in training with
dropout, a gate (``use_gate``), inputs of another rank than 3 or other attention axes, an ``output_shape`` of several
axes, Keras masks on its inputs (``mask_zero``) or a ``query_mask``, projections that are not plain ``EinsumDense``
layers (LoRA, quantized) or masks on another axis than the hidden size.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from ._layers import SERIALIZATION_PACKAGE, Masksembles
from ._packed_layers import _merge_axes, _split_axis
from ._rewire import Masked

MHA = keras.layers.MultiHeadAttention
PROJECTION = "abc,cde->abde"  # (B, L, C) x (C, heads, size): MultiHeadAttention's query, key and value on rank 3
OUTPUT_PROJECTION = "abcd,cde->abe"  # (B, T, heads, size) x (heads, size, E)
MASKS = ("attention_mask", "value_mask", "key_mask")  # what AttentionHeads reads besides the projections
_SIGNATURE = inspect.signature(MHA.call)


def call_arguments(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a ``MultiHeadAttention`` call by name, defaults filled in (TypeError where they do not fit)."""
    bound = _SIGNATURE.bind(None, *args, **kwargs)
    bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items() if name != "self"}


def _projection_reason(layer: Any, equation: str) -> str:
    """Why a projection of the attention (an ``EinsumDense``, or ``insert``'s ``Masked`` wrapper of one with masks
    over the hidden size) is not one this module reads, "" when it is."""
    if isinstance(layer, Masked):
        masks = layer.masksembles
        if type(layer).call is not Masked.call or not isinstance(masks, Masksembles):
            return f"its projection {layer.name!r} is not insert's masks and EinsumDense"
        if masks.channel_axis not in (-1, 2):
            return f"the masks of its projection {layer.name!r} are not on the hidden size"
        layer = layer.layer
    if not isinstance(layer, keras.layers.EinsumDense) or type(layer).call is not keras.layers.EinsumDense.call:
        return f"its projection {layer.name!r} is not an EinsumDense"
    if layer.equation != equation or getattr(layer, "lora_enabled", False):
        return f"its projection {layer.name!r} computes {layer.equation!r}, not {equation!r}"
    if layer.dtype_policy.quantization_mode is not None:
        return f"its projection {layer.name!r} is quantized"
    if keras.activations.serialize(layer.activation) != "linear":
        return f"its projection {layer.name!r} has an activation"
    return ""


def fold_reason(layer: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """Why a ``MultiHeadAttention`` call (its arguments as Keras tensors) does not fold into the heads, "" when it
    does."""
    if type(layer).call is not MHA.call or any(
        getattr(type(layer), name) is not getattr(MHA, name)
        for name in ("_compute_attention", "_compute_attention_mask", "_masked_softmax", "_compute_causal_mask")
    ):
        return "a subclass that computes its own attention"
    try:
        given = call_arguments(args, kwargs)
    except TypeError:
        return "its arguments are not MultiHeadAttention.call's"
    inputs = [given[name] for name in ("query", "value", "key") if given[name] is not None]
    if not all(isinstance(t, keras.KerasTensor) for t in inputs):
        return "its query, value or key is not a tensor of the graph"
    if given["return_attention_scores"] is not False:
        return "it returns its attention scores"
    if given["training"] not in (None, False) and layer.dropout > 0:
        return "its dropout runs in training"
    if given["query_mask"] is not None or any(getattr(t, "_keras_mask", None) is not None for t in inputs):
        return "its inputs carry Keras masks"
    if not isinstance(given["use_causal_mask"], bool):
        return "use_causal_mask is not a Python bool"
    if layer._use_gate:
        return "its output is gated (use_gate)"
    ranks = {len(t.shape) for t in inputs}
    if ranks != {3} or tuple(layer.attention_axes) != (1,):
        return f"attention over axes {tuple(layer.attention_axes)} of inputs of rank {sorted(ranks)}, not (B, L, C)"
    if layer._output_shape is not None and len(layer._output_shape) != 1:
        return f"its output_shape {layer._output_shape} has several axes"
    if isinstance(layer._output_dense, Masked):
        return "masks before its output projection (heads and head size together)"
    for projection, equation in (
        (layer._query_dense, PROJECTION), (layer._key_dense, PROJECTION), (layer._value_dense, PROJECTION),
        (layer._output_dense, OUTPUT_PROJECTION),
    ):  # fmt: skip
        reason = _projection_reason(projection, equation)
        if reason:
            return reason
    return ""


def as_dense(layer: Any, inputs: int) -> keras.layers.Dense:
    """An ``EinsumDense`` projection as the Dense layer it is on its input flattened to ``inputs`` features and its
    output flattened: its kernel read as (``inputs``, outputs), its bias flattened."""
    kernel = np.asarray(keras.ops.convert_to_numpy(layer.kernel)).reshape(inputs, -1)
    dense = keras.layers.Dense(kernel.shape[1], use_bias=layer.bias is not None, dtype=layer.dtype_policy)
    dense.build((None, inputs))
    dense.kernel.assign(kernel)
    if layer.bias is not None:
        dense.bias.assign(np.asarray(keras.ops.convert_to_numpy(layer.bias)).reshape(-1))
    return dense


@dataclass(frozen=True)
class AttentionParts:
    """The calls a folding ``MultiHeadAttention`` makes: per projection (``query``, ``key``, ``value``) its masks (or
    None) and its Dense, then ``heads`` and the ``output`` projection's Dense."""

    projections: dict[str, tuple[Masksembles | None, keras.layers.Dense]]
    heads: AttentionHeads
    output: keras.layers.Dense

    @classmethod
    def of(cls, layer: Any, causal: bool) -> AttentionParts:
        projections: dict[str, tuple[Masksembles | None, keras.layers.Dense]] = {}
        for name, wrapped in (("query", layer._query_dense), ("key", layer._key_dense), ("value", layer._value_dense)):
            masks, projection = (wrapped.masksembles, wrapped.layer) if isinstance(wrapped, Masked) else (None, wrapped)
            projections[name] = (masks, as_dense(projection, int(projection.kernel.shape[0])))
        output = layer._output_dense
        heads = AttentionHeads(
            layer.num_heads, layer.key_dim, layer.value_dim, dropout=layer.dropout, causal=causal,
            sliding_window=layer._sliding_window, flash_attention=layer._flash_attention, dtype=layer.dtype_policy,
        )  # fmt: skip
        return cls(projections, heads, as_dense(output, layer.num_heads * layer.value_dim))


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class AttentionHeads(keras.layers.Layer):  # type: ignore[misc]  # keras is untyped: Layer is Any to mypy
    """A ``MultiHeadAttention``'s attention between its projections, the heads side by side on the last axis:
    queries (B, T, heads*key_size), keys (B, S, heads*key_size), values (B, S, heads*value_size) ->
    (B, T, heads*value_size), with the call's masks (``attention_mask``, ``value_mask``, ``key_mask``; ``causal``:
    ``use_causal_mask``), computed by Keras' own ``MultiHeadAttention`` code (``_compute_attention_mask``,
    ``_compute_attention``) on (B, L, heads, size), in inference. Each head is computed apart and the masks apply to
    every head alike, so the heads of m members side by side are one such layer with m times the heads."""

    def __init__(
        self, heads: int, key_size: int, value_size: int, *, dropout: float = 0.0, causal: bool = False,
        sliding_window: int | None = None, flash_attention: bool | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self.heads, self.key_size, self.value_size, self.causal = heads, key_size, value_size, causal
        self.dropout, self.sliding_window, self.flash_attention = dropout, sliding_window, flash_attention
        self.attention = MHA(
            heads, key_size, value_size, dropout=dropout, sliding_window=sliding_window,
            flash_attention=flash_attention, dtype=self.dtype_policy,
        )  # fmt: skip
        self.attention._build_attention(4)  # its softmax, dropout and einsum equations for (B, L, heads, size)
        self.attention.built = self.built = True  # no weights: the projections are not this layer's (an unbuilt
        # layer makes JAX's predict build the model symbolically first, tracing it twice)

    def call(
        self, query: Any, key: Any, value: Any, attention_mask: Any = None, value_mask: Any = None,
        key_mask: Any = None, training: Any = None,
    ) -> Any:  # fmt: skip
        query, key, value = (_split_axis(t, 2, self.heads) for t in (query, key, value))
        attention = self.attention
        # as MultiHeadAttention.call: causal alone goes to the backend's causal kernel
        causal_only = (
            self.causal
            and self.sliding_window is None
            and all(mask is None for mask in (attention_mask, value_mask, key_mask))
        )
        if not causal_only:
            attention_mask = attention._compute_attention_mask(
                query, value, value_mask=value_mask, key_mask=key_mask, attention_mask=attention_mask,
                use_causal_mask=self.causal,
            )  # fmt: skip
        extra = {"use_causal_mask": True} if causal_only else {}
        output, _ = attention._compute_attention(query, key, value, attention_mask, False, False, **extra)
        return _merge_axes(output, 2)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(), "heads": self.heads, "key_size": self.key_size, "value_size": self.value_size,
            "dropout": self.dropout, "causal": self.causal, "sliding_window": self.sliding_window,
            "flash_attention": self.flash_attention,
        }  # fmt: skip


def heads_macs(query: Sequence[int], key: Sequence[int], value: Sequence[int]) -> int:
    """Multiply-adds per sample of ``AttentionHeads`` on queries, keys and values of these shapes (batch first):
    the scores (T x S per key feature) and their sum over the values (T x S per value feature)."""
    return int(query[1]) * int(key[1]) * (int(query[-1]) + int(value[-1]))


def attention_macs(layer: Any, query: Sequence[int], value: Sequence[int], key: Sequence[int]) -> int:
    """Multiply-adds per sample of a ``MultiHeadAttention`` (built) on inputs of these shapes (batch first): its
    projections (the gate's too), the scores and weighted sums over its attention axes, per head."""
    heads, key_size, value_size = layer.num_heads, layer.key_dim, layer.value_dim
    queries, values = math.prod(query[1:-1]), math.prod(value[1:-1])
    outputs = math.prod(layer._output_shape or (query[-1],))
    attended = math.prod(int(value[axis]) for axis in layer.attention_axes)  # keys each query position reads
    macs = queries * query[-1] * heads * key_size + values * (key[-1] * key_size + value[-1] * value_size) * heads
    macs += queries * query[-1] * heads * value_size if layer._use_gate else 0
    return int(macs + queries * attended * heads * (key_size + value_size) + queries * heads * value_size * outputs)


__all__ = ["MASKS", "AttentionHeads", "AttentionParts", "attention_macs", "call_arguments", "fold_reason", "heads_macs"]
