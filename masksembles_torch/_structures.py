"""A model's natural call and output: one tensor, a tuple of inputs, or a dict of keyword inputs (``transformers``
models: ``model(**{"input_ids": ..., "attention_mask": ...})``), and outputs of any structure (a tensor, a tuple, a
dict, a ``transformers`` ``ModelOutput``).

Inputs are batch-first: every tensor of them with at least one axis (nested in tuples, lists and dicts too) has the
batch on axis 0; other values (flags, 0-d tensors, None) are passed as they are.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

import masksembles_core.adapter as mca

# A model's inputs: one tensor (``model(x)``), a tuple (``model(*inputs)``) or a dict (``model(**inputs)``).
Inputs = Tensor | tuple[Any, ...] | Mapping[str, Any]


def call(model: nn.Module, inputs: Inputs) -> Any:
    """``model`` called on ``inputs`` as the model is called: ``model(**inputs)``, ``model(*inputs)`` or
    ``model(inputs)``."""
    args, kwargs = call_arguments(inputs)
    return model(*args, **kwargs)


def call_arguments(inputs: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments of ``call(model, inputs)``."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def map_batched(inputs: Any, function: Callable[[Tensor], Tensor]) -> Any:
    """``inputs`` with ``function`` applied to every batch-first tensor (at least one axis) in tuples, lists and
    dicts; other values kept. A top-level mapping becomes a plain dict (the model's keyword arguments)."""
    if isinstance(inputs, Tensor):
        return function(inputs) if inputs.ndim else inputs
    if isinstance(inputs, Mapping):
        return {key: map_batched(value, function) for key, value in inputs.items()}
    if isinstance(inputs, tuple) and hasattr(inputs, "_fields"):  # a namedtuple
        return type(inputs)(*(map_batched(value, function) for value in inputs))
    if isinstance(inputs, tuple | list):
        return type(inputs)(map_batched(value, function) for value in inputs)
    return inputs


def batched_tensors(inputs: Any, name: str = "inputs") -> list[tuple[str, Tensor]]:
    """Every batch-first tensor of ``inputs`` with its name (``"inputs['attention_mask']"``, ``"inputs[1]"``)."""
    if isinstance(inputs, Tensor):
        return [(name, inputs)] if inputs.ndim else []
    if isinstance(inputs, Mapping):
        return [found for key, value in inputs.items() for found in batched_tensors(value, f"{name}[{key!r}]")]
    if isinstance(inputs, tuple | list):
        return [found for i, value in enumerate(inputs) for found in batched_tensors(value, f"{name}[{i}]")]
    return []


def batch_size(inputs: Inputs) -> int:
    """The batch size of ``inputs``: the length of axis 0 of every batch-first tensor in them.

    Raises:
        ValueError: ``inputs`` hold no tensor, or tensors whose axis 0 differs.
    """
    return mca.check_batch_sizes([(name, tensor.shape[0]) for name, tensor in batched_tensors(inputs)])


def stack_members(outputs: list[Any], n: int, batches: list[int], *, sequence_first: bool = False) -> Any:
    """The outputs of a model on the tiled chunks of a batch, joined with the members on a new leading axis.

    ``outputs[i]`` is the model's output on chunk ``i`` of ``batches[i]`` samples, tiled ``n`` times. Its structure
    is kept (tensors, tuples, namedtuples, lists, dicts, dataclasses such as ``transformers``' ``ModelOutput``);
    every tensor whose axis 0 holds the tiled batch (``n * batches[i]`` rows) becomes (n, B, ...), member ``k`` at
    index ``k``, the chunks joined on axis 1. A tensor whose axis 1 holds it instead (sequence-first, (L, n*B, ...))
    keeps the members' blocks there, the chunks joined block by block. Any other value (a loss over the tiled batch,
    a key-value cache object) is returned as the model computed it on the whole tiled batch when there is one chunk,
    and is None when there are several (it cannot be joined).

    Args:
        sequence_first: the model ran a Masksembles layer on a sequence-first input: a tensor whose axes 0 and 1
            both hold the tiled batch is refused (which one is the batch cannot be told).

    Raises:
        ValueError: that ambiguous tensor.
    """
    first = outputs[0]
    if isinstance(first, Tensor):
        tensors = [out for out in outputs if isinstance(out, Tensor) and out.ndim]
        if len(tensors) != len(outputs):
            return first if len(outputs) == 1 else None
        on_first = all(out.shape[0] == n * rows for out, rows in zip(tensors, batches, strict=True))
        on_second = all(out.ndim > 1 and out.shape[1] == n * rows for out, rows in zip(tensors, batches, strict=True))
        if on_first and on_second and sequence_first:
            raise ValueError(
                f"predict: an output of shape {tuple(first.shape)} holds the tiled batch of {n}x{batches[0]} on axes "
                "0 and 1, and the model runs sequence-first blocks: whether it is batch-first or sequence-first "
                "cannot be told. Pass a batch_size (or a batch) whose n*B is not its sequence length"
            )
        if on_first:
            members = [out.unflatten(0, (n, rows)) for out, rows in zip(tensors, batches, strict=True)]  # type: ignore[no-untyped-call]
            return members[0] if len(members) == 1 else torch.cat(members, dim=1)  # one chunk: a view, no copy
        if on_second:  # member k's block of every chunk, in order
            blocks = [out.unflatten(1, (n, rows)) for out, rows in zip(tensors, batches, strict=True)]  # type: ignore[no-untyped-call]
            return first if len(outputs) == 1 else torch.cat(blocks, dim=2).flatten(1, 2)
        return first if len(outputs) == 1 else None

    def part(values: list[Any]) -> Any:
        return stack_members(values, n, batches, sequence_first=sequence_first)

    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = [field.name for field in dataclasses.fields(first) if field.init]
        return dataclasses.replace(first, **{name: part([getattr(out, name) for out in outputs]) for name in fields})
    if isinstance(first, Mapping):
        joined = copy.copy(first)
        for key in first:
            joined[key] = part([out[key] for out in outputs])  # type: ignore[index]
        return joined
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(part([out[i] for out in outputs]) for i in range(len(first))))
    if isinstance(first, tuple | list):
        return type(first)(part([out[i] for out in outputs]) for i in range(len(first)))
    return first if len(outputs) == 1 else None
