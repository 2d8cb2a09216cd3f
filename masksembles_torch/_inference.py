"""Inference helpers: run every member on every sample."""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import Tensor, nn

import masksembles_core.adapter as mca

from ._layers import Masksembles, samples_known, sequence_first
from ._structures import Inputs, call, map_batched, stack_members
from ._structures import batch_size as batch_size_of
from ._surgery import keep_masks_off_fused_paths


def tile(x: Tensor, n: int) -> Tensor:
    """Repeat the batch ``n`` times: (B, ...) -> (n*B, ...); copy ``k`` goes through member ``k``."""
    return x.repeat(mca.check_n(n), *([1] * (x.ndim - 1)))


def untile(y: Tensor, n: int) -> Tensor:
    """(n*B, ...) -> (n, B, ...): ``y[k]`` is member ``k``'s output."""
    batch = mca.check_tiled_batch(y.shape[0], n)
    return cast(Tensor, y.unflatten(0, (n, batch)))  # type: ignore[no-untyped-call]


def predict(model: nn.Module, x: Inputs, n: int | None = None, *, batch_size: int | None = None) -> Any:
    """Every member's output for every sample of ``x``: (B, ...) -> (n, B, ...).

    ``x`` is what the model is called with: a tensor (``model(x)``), a tuple (``model(*x)``) or a dict of keyword
    inputs (``model(**x)``, a ``transformers`` model's ``input_ids``, ``attention_mask``, ``pixel_values``, ...).
    Every tensor in it (also in nested tuples, lists and dicts) has the batch on axis 0, and all are tiled together:
    copy ``k`` of the batch goes through member ``k`` (a model called on sequence-first inputs, as torch's
    ``nn.TransformerEncoder(batch_first=False)`` is, is refused: wrap it to take batch-first ones; inside the model,
    sequence-first blocks are fine: each Masksembles layer groups along the axis of its input that holds the tiled
    batch, and refuses an input where that cannot be told). Other values (flags, 0-d tensors, None) are passed as they
    are. The model runs on the tiled input under ``torch.no_grad()`` with every module in eval mode (BatchNorm
    running statistics, dropout off; each module's own mode is restored afterwards, so the model's state is never
    changed), ``batch_size`` samples of ``x`` at a time (all at once when None; chunks equal the one call up to
    rounding, not bit for bit: a kernel may round a sum differently on fewer rows). An ``nn.TransformerEncoder`` whose
    layers hold Masksembles layers keeps a padded batch padded (no nested tensor), as ``insert`` and
    ``convert_dropout`` leave it (``keep_masks_off_fused_paths``).

    Returns:
        the model's output with the members on a new leading axis: a tensor (n*B, ...) becomes (n, B, ...), and an
        output of another structure (a tuple, a dict, a ``transformers`` ``ModelOutput``) keeps it, each tensor in it
        whose axis 0 holds the tiled batch becoming (n, B, ...) (``out.logits[k]`` is member ``k``'s). A tensor
        whose axis 1 holds it instead (a sequence-first (L, n*B, ...), XLNet's ``mems``) keeps the members' blocks
        there (member ``k``'s at ``[:, k*B:(k+1)*B]``). Where the model ran a Masksembles layer on a sequence-first
        input, a tensor whose axes 0 and 1 both hold n*B is refused (pass a ``batch_size`` that tells them apart).
        Any other value of it (a loss over the tiled batch, a key-value cache object) is the model's on the whole
        tiled batch when ``x`` runs in one call, and None when it runs in chunks of ``batch_size`` (it cannot be
        joined).

    Args:
        n: the number of members; None reads it from the model's Masksembles layers.

    Raises:
        ValueError: ``n`` differs from the n of the model's Masksembles layers, the layers have different n, ``n``
            is None and the model has no Masksembles layer, the tensors of ``x`` have different batch sizes, the
            model takes sequence-first inputs, or a Masksembles layer or an output cannot tell its samples' axis.
    """
    refuse_sequence_first_inputs(model, "predict")
    modules = list(model.modules())
    n = mca.check_members([layer.n for layer in modules if isinstance(layer, Masksembles)], n)
    keep_masks_off_fused_paths(model)
    batch = batch_size_of(x)
    step = max(batch if batch_size is None else mca.check_int("batch_size", batch_size, minimum=1), 1)
    starts = range(0, max(batch, 1), step)
    sizes = [min(step, batch - start) for start in starts]
    training = [module for module in modules if module.training]
    if training:  # a model already in eval mode (the usual one at inference) is left as it is
        model.eval()
    outputs: list[Any] = []
    axes: set[int | None] = set()
    try:
        with torch.no_grad():
            for start, rows in zip(starts, sizes, strict=True):
                with samples_known(model, n * rows) as layers:
                    tiled = map_batched(x, functools.partial(_tiled_rows, n=n, start=start, rows=rows))
                    outputs.append(call(model, tiled))
                    axes |= {layer.grouped_axis for layer in layers}
    finally:
        for module in training:
            module.training = True
    return stack_members(outputs, n, sizes, sequence_first=1 in axes)


def refuse_sequence_first_inputs(model: nn.Module, caller: str) -> None:
    """Raise where ``model`` itself is one of torch's sequence-first modules: its inputs hold the batch on axis 1,
    and ``caller`` tiles (and reads) the batch on axis 0."""
    if sequence_first(model):
        raise ValueError(
            f"{caller} takes inputs with the samples on axis 0, and {type(model).__name__} with batch_first=False "
            "takes sequence-first ones, (L, B, E): tiling them would repeat the sequence, not the batch. Call it "
            "through a module that takes batch-first inputs and transposes them (or build it with batch_first=True)"
        )


def _tiled_rows(tensor: Tensor, n: int, start: int, rows: int) -> Tensor:
    """Rows ``start`` to ``start + rows`` of ``tensor``, tiled ``n`` times."""
    return tile(tensor.narrow(0, start, rows), n)
