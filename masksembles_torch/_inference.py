"""Inference helpers: run every member on every sample, and convert dropout models."""

from __future__ import annotations

import copy
from typing import cast

import torch
from torch import Tensor, nn

import masksembles_core as mc

from ._layers import Masksembles


def tile(x: Tensor, n: int) -> Tensor:
    """Repeat the batch ``n`` times: (B, ...) -> (n*B, ...); copy ``k`` goes through member ``k``."""
    return x.repeat(mc.check_n(n), *([1] * (x.ndim - 1)))


def untile(y: Tensor, n: int) -> Tensor:
    """(n*B, ...) -> (n, B, ...): ``y[k]`` is member ``k``'s output."""
    batch = mc.check_tiled_batch(y.shape[0], n)
    return cast(Tensor, y.unflatten(0, (n, batch)))  # type: ignore[no-untyped-call]


def predict(model: nn.Module, x: Tensor, n: int, *, batch_size: int | None = None) -> Tensor:
    """Every member's output for every sample of ``x``: (B, ...) -> (n, B, ...).

    Runs ``model`` on the tiled input under ``torch.no_grad()`` in eval mode (the previous
    train/eval mode is restored afterwards), ``batch_size`` samples of ``x`` at a time (all at
    once when None).
    """
    n = mc.check_n(n)
    step = x.shape[0] if batch_size is None else mc.check_int("batch_size", batch_size, minimum=1)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            chunks = [untile(model(tile(chunk, n)), n) for chunk in x.split(max(step, 1))]  # type: ignore[no-untyped-call]
    finally:
        model.train(was_training)
    return torch.cat(chunks, dim=1)


DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def _dropout_channel_axis(module: nn.Module, rank: int) -> int:
    """Channels of a dropout's input: axis 1 for Dropout1d/2d/3d and for nn.Dropout on 4-D/5-D
    (convolution) features, the last axis for nn.Dropout on (B, C) or (B, L, C) (Linear) features."""
    if type(module) is nn.Dropout and rank not in (4, 5):
        return -1
    return 1


def convert_dropout(
    model: nn.Module,
    example_input: Tensor | tuple[Tensor, ...],
    n: int,
    scale: float,
    *,
    seed: int | None = None,
    channel_axis: int | None = None,
    inplace: bool = False,
) -> nn.Module:
    """Replace every ``nn.Dropout``/``Dropout1d/2d/3d`` of ``model`` by a Masksembles layer.

    The MC-Dropout drop-in of the paper: the channel count of each layer is read from the input
    it receives on ``example_input`` (one forward pass, in eval mode, without gradients); all
    other modules and all trained weights are kept. Channels are on axis 1 for
    ``Dropout1d/2d/3d``; for ``nn.Dropout`` on axis 1 of 4-D/5-D (convolution) features and on
    the last axis otherwise (the features of a Linear), unless ``channel_axis`` is given. Layer
    ``i`` (in ``named_modules`` order) gets masks from ``masksembles_core.derive_seed(seed, i)``.
    Dropout applied through ``F.dropout`` inside a ``forward`` is not a module and is not converted.

    Returns:
        the converted model (a deep copy unless ``inplace``).

    Raises:
        ValueError: no dropout module found, one that the example input does not reach, or one
            called on inputs of different channel counts.
    """
    n = mc.check_n(n)
    scale = mc.check_scale(scale)
    if channel_axis is not None:
        mc.check_channel_axis(channel_axis)
    if not inplace:
        model = copy.deepcopy(model)
    targets = [(name, module) for name, module in model.named_modules() if type(module) in DROPOUT_TYPES]
    if not targets:
        raise ValueError("convert_dropout found no nn.Dropout/Dropout1d/Dropout2d/Dropout3d module in the model")
    seen: dict[str, list[tuple[int, ...]]] = {name: [] for name, _ in targets}
    hooks = [
        module.register_forward_pre_hook(lambda _m, args, name=name: seen[name].append(tuple(args[0].shape)))
        for name, module in targets
    ]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(*example_input) if isinstance(example_input, tuple) else model(example_input)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    for index, (name, module) in enumerate(targets):
        shapes = seen[name]
        if not shapes:
            raise ValueError(f"convert_dropout: the example input does not reach dropout module {name!r}")
        axis = _dropout_channel_axis(module, len(shapes[0])) if channel_axis is None else channel_axis
        counts = {shape[axis] for shape in shapes}
        if len(counts) != 1:
            raise ValueError(
                f"convert_dropout: module {name!r} is called on inputs of shapes {shapes} (channels differ)"
            )
        reference = next((p for p in model.parameters()), None)
        layer = Masksembles(
            counts.pop(),
            n,
            scale,
            seed=mc.derive_seed(seed, index),
            channel_axis=axis,
            device=None if reference is None else reference.device,
            dtype=None if reference is None or not reference.is_floating_point() else reference.dtype,
        )
        layer.train(module.training)
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attribute, layer)
    return model
