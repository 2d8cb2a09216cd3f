"""Inference helpers: run every member on every sample."""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import Tensor, nn

import masksembles_core.adapter as mca

from ._layers import Masksembles
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
    copy ``k`` of the batch goes through member ``k``. Other values (flags, 0-d tensors, None) are passed as they
    are. The model runs on the tiled input under ``torch.no_grad()`` with every module in eval mode (BatchNorm
    running statistics, dropout off; each module's own mode is restored afterwards, so the model's state is never
    changed), ``batch_size`` samples of ``x`` at a time (all at once when None; chunks equal the one call up to
    rounding, not bit for bit: a kernel may round a sum differently on fewer rows). An ``nn.TransformerEncoder`` whose
    layers hold Masksembles layers keeps a padded batch padded (no nested tensor), as ``insert`` and
    ``convert_dropout`` leave it (``keep_masks_off_fused_paths``).

    Returns:
        the model's output with the members on a new leading axis: a tensor (n*B, ...) becomes (n, B, ...), and an
        output of another structure (a tuple, a dict, a ``transformers`` ``ModelOutput``) keeps it, each tensor in it
        whose axis 0 holds the tiled batch becoming (n, B, ...) (``out.logits[k]`` is member ``k``'s). Any other
        value of it (a loss over the tiled batch, a key-value cache object) is the model's on the whole tiled batch
        when ``x`` runs in one call, and None when it runs in chunks of ``batch_size`` (it cannot be joined).

    Args:
        n: the number of members; None reads it from the model's Masksembles layers.

    Raises:
        ValueError: ``n`` differs from the n of the model's Masksembles layers, the layers have different n, ``n``
            is None and the model has no Masksembles layer, or the tensors of ``x`` have different batch sizes.
    """
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
    try:
        with torch.no_grad():
            outputs = [
                call(model, map_batched(x, functools.partial(_tiled_rows, n=n, start=start, rows=rows)))
                for start, rows in zip(starts, sizes, strict=True)
            ]
    finally:
        for module in training:
            module.training = True
    if isinstance(outputs[0], Tensor):
        members = [untile(output, n) for output in outputs]
        return members[0] if len(members) == 1 else torch.cat(members, dim=1)  # one chunk: a view, no copy
    return stack_members(outputs, n, sizes)


def _tiled_rows(tensor: Tensor, n: int, start: int, rows: int) -> Tensor:
    """Rows ``start`` to ``start + rows`` of ``tensor``, tiled ``n`` times."""
    return tile(tensor.narrow(0, start, rows), n)
