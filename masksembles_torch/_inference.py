"""Inference helpers: run every member on every sample."""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

import masksembles_core.adapter as mca

from ._layers import Masksembles


def tile(x: Tensor, n: int) -> Tensor:
    """Repeat the batch ``n`` times: (B, ...) -> (n*B, ...); copy ``k`` goes through member ``k``."""
    return x.repeat(mca.check_n(n), *([1] * (x.ndim - 1)))


def untile(y: Tensor, n: int) -> Tensor:
    """(n*B, ...) -> (n, B, ...): ``y[k]`` is member ``k``'s output."""
    batch = mca.check_tiled_batch(y.shape[0], n)
    return cast(Tensor, y.unflatten(0, (n, batch)))  # type: ignore[no-untyped-call]


def predict(model: nn.Module, x: Tensor, n: int | None = None, *, batch_size: int | None = None) -> Tensor:
    """Every member's output for every sample of ``x``: (B, ...) -> (n, B, ...).

    Runs ``model`` on the tiled input under ``torch.no_grad()`` with every module in eval mode
    (BatchNorm running statistics, dropout off; each module's own mode is restored afterwards, so
    the model's state is never changed), ``batch_size`` samples of ``x`` at a time (all at once
    when None).

    Args:
        n: the number of members; None reads it from the model's Masksembles layers.

    Raises:
        ValueError: ``n`` differs from the n of the model's Masksembles layers, the layers have
            different n, or ``n`` is None and the model has no Masksembles layer.
    """
    n = mca.check_members([layer.n for layer in model.modules() if isinstance(layer, Masksembles)], n)
    step = x.shape[0] if batch_size is None else mca.check_int("batch_size", batch_size, minimum=1)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            chunks = [untile(model(tile(chunk, n)), n) for chunk in x.split(max(step, 1))]  # type: ignore[no-untyped-call]
    finally:
        for module, training in modes:
            module.training = training
    return torch.cat(chunks, dim=1)
