"""Functional core of the PyTorch adapter: one broadcast multiply by batch-grouped masks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

import masksembles_core.adapter as mca


def _grouped_index(batch: int, n: int, per_sample: int, device: torch.device) -> Tensor:
    """``masksembles_core.group_index`` on ``device``: ``((i // per_sample) * n) // (batch // per_sample)``."""
    sample = torch.arange(batch, device=device)
    if per_sample != 1:
        sample = torch.div(sample, per_sample, rounding_mode="floor")
    return torch.div(sample * n, batch // per_sample, rounding_mode="floor")


def masksembles(
    x: Tensor,
    masks: Tensor,
    *,
    channel_axis: int = 1,
    index: Tensor | None = None,
    samples: int | None = None,
    ranks: Sequence[int] | None = None,
    layer: str = "Masksembles",
    batch_axis: int = 0,
) -> Tensor:
    """Multiply sample ``i`` of ``x`` by mask ``(i * n) // B`` (or by mask ``index[i]``).

    Args:
        x: (B, ...) with C channels on ``channel_axis``; (L, B, ...) with ``batch_axis=1``.
        masks: (n, C) floating or bool masks; cast to ``x.dtype`` (0/1 is exact in every dtype).
        channel_axis: axis of the channels (not 0).
        index: optional (B,) mask index per sample (random mode); default the batch-grouping rule.
        samples: the model's batch size, where the B rows of ``x`` are its samples folded with other axes
            (``samples * f`` rows, sample-major): row ``r`` gets the mask of sample ``r // f``
            (``masksembles_core.group_index(B, n, samples=samples)``). None: the rows are the samples.
        ranks: allowed input ranks (None: any rank >= 2).
        layer: layer name for error messages.
        batch_axis: the axis of the samples: 0, or 1 for a sequence-first input (L, B, ...), the rule then run
            along axis 1 (the channels on another axis than 0 and 1).

    Returns:
        tensor of the shape, dtype and memory format of ``x``.
    """
    if x.is_nested:
        raise ValueError(
            f"{layer} received a nested tensor: an nn.TransformerEncoder given a src_key_padding_mask turns its batch "
            "into one in eval without gradients; set its use_nested_tensor = False (masksembles_torch's insert, "
            "convert_dropout, predict and pack do)"
        )
    if batch_axis == 1:  # the rule on the (B, L, ...) view; transposing back gives x's layout
        if x.ndim < 3 or channel_axis % x.ndim in (0, 1):
            raise ValueError(
                f"{layer}: batch_axis=1 needs an input (L, B, ..., C) with the channels on another axis than 0 and "
                f"1; received shape {tuple(x.shape)}, channel_axis={channel_axis}"
            )
        axis = channel_axis % x.ndim
        swapped = masksembles(x.transpose(0, 1), masks, channel_axis=axis, index=index, samples=samples,
                              ranks=ranks, layer=layer)  # fmt: skip
        return swapped.transpose(0, 1)
    n, channels = masks.shape
    axis = mca.check_input_shape(tuple(x.shape), channels=channels, channel_axis=channel_axis, ranks=ranks, layer=layer)
    masks = masks.to(dtype=x.dtype)
    batch = x.shape[0]
    per_sample = mca.rows_per_sample(batch, samples)
    if (
        index is None
        and isinstance(batch, int)
        and (batch // per_sample) % n == 0
        and not torch.compiler.is_compiling()
    ):
        # Eager, with samples that n divides: the batch viewed as (n, B/n, ...) times the masks
        # viewed as (n, 1, ..., C, ...) (each sample's rows lie in one group).
        grouped: Tensor = x.unflatten(0, (n, batch // n))  # type: ignore[no-untyped-call]
        shape = [1] * grouped.ndim
        shape[0], shape[axis + 1] = n, channels
        return (grouped * masks.view(shape)).flatten(0, 1)
    # Any batch size, and under torch.compile/torch.export (one graph for every batch size instead
    # of a guard on B % n; Inductor also fails on the view of a batch with symbolic spatial sizes):
    # gather the per-sample masks, (B, C), then one broadcast multiply.
    if index is None:
        index = _grouped_index(batch, n, per_sample, x.device)
    return x * masks.index_select(0, index).view(mca.mask_shape(x.ndim, axis, channels, batch))
