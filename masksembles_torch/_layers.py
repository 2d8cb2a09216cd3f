"""Masksembles layers for PyTorch: masks in a persistent buffer, forward in ``_functional``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

import masksembles_core as mc
import masksembles_core.adapter as mca

from ._functional import masksembles

# symbolic tracing records the functional call as one node (its shape checks need concrete shapes)
torch.fx.wrap("masksembles")

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class Masksembles(nn.Module):
    """Masksembles over the channels of any layout (Durasov et al., CVPR 2021).

    Holds ``n`` fixed binary masks of ``channels`` channels. Sample ``i`` of a batch of ``B``
    is multiplied by mask ``(i * n) // B``: the batch is ``n`` contiguous groups, group ``k``
    goes through member ``k``. Any batch size works. At inference, ``predict`` (or ``tile`` and
    ``untile``) runs every member on every sample.

    Args:
        channels: number of channels C (may be None when ``masks`` is given).
        n: number of masks (may be None when ``masks`` is given).
        scale: overlap control, >= 1: 1 is a single model, large values disjoint masks.
        seed: int for reproducible masks, a ``numpy.random.Generator``, or None (fresh).
        masks: optional (n, C) binary masks to use instead of generated ones.
        channel_axis: axis of the channels in the input (1 for (B, C, ...), -1 for (B, ..., C)).
        mode: ``"grouped"`` (the batch-grouping rule, always) or ``"random"`` (in training each
            sample draws a mask uniformly at random from ``generator``; grouped in eval).
        generator: ``torch.Generator`` used by random mode (on the input's device).
        batch_axis: the axis of the samples in the input: 0 (B, ...), 1 for a sequence-first (L, B, ..., C) input
            (inside ``nn.TransformerEncoderLayer(batch_first=False)``, XLNet's blocks), or None (the default):
            decided in each call from its shape and the model's batch size (``masksembles_core.adapter.sample_axis``:
            axis 1 where a 3-D channels-last input holds the batch there and not on axis 0; axis 0 where both fit,
            the batch-first convention), axis 0 where no batch size is known. ``insert`` and ``convert_dropout`` set
            it (declare a sequence-first layer you place by hand).
        device, dtype: where and in which floating dtype the mask buffer is stored.

    Shape:
        input (B, ...) with C channels on ``channel_axis``; output the same shape, dtype and
        memory format.

    Every call with a known batch size (in training within a call of the recording model; in eval within one, which
    ``predict`` makes: ``n * B``) checks that the axis it groups along holds that many samples, and refuses a
    sequence-first input it would otherwise group by token position.

    The masks are a persistent buffer: ``state_dict``, ``torch.save``/``torch.load``, ``deepcopy``
    and pickling keep them bit for bit, and loading never regenerates them.

    Inside a model that folds other axes into the batch (windows, tokens: ``B * f`` rows in the
    sample-major order of ``reshape``), ``record_batch_size(model)`` (which ``insert`` and
    ``convert_dropout`` call) lets every layer in training give row ``r`` the member of sample
    ``r // f``, so a sample meets one member in every layer at any batch size (in eval the plain
    rule: ``predict``'s tiled batch lines up with it). Such a layer refuses, in training, a call that is not part of a
    call of the recording model (``model.forward_features(x)``, a submodule called directly): ``recorded_call``.
    """

    ranks: ClassVar[Sequence[int] | None] = None
    masks: Tensor
    # Set by ``record_batch_size``: whether a recording model holds the layer, and how many of the calls that record
    # for it are under way (class defaults: also for a layer pickled whole before they existed).
    recorded: bool = False
    open_calls: int = 0
    batch_axis: int | None = None  # also for a layer pickled whole before it existed
    grouped_axis: int | None = None  # the axis its last eager call grouped along (predict reads it)

    def __init__(
        self,
        channels: int | None = None,
        n: int | None = None,
        scale: float | None = None,
        *,
        seed: int | np.random.Generator | None = None,
        masks: ArrayLike | Tensor | None = None,
        channel_axis: int = 1,
        mode: str = "grouped",
        generator: torch.Generator | None = None,
        batch_axis: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(masks, Tensor):
            masks = masks.detach().cpu().float().numpy()  # NumPy has no bfloat16; 0/1 stay exact
        arguments = mca.layer_arguments(
            channels, n, scale, seed=seed, masks=masks, channel_axis=channel_axis, mode=mode
        )
        resolved = arguments.masks_for(channels)
        self.n, self.channels = resolved.shape
        self.scale, self.channel_axis, self.mode = arguments.scale, arguments.channel_axis, arguments.mode
        self.generator = generator
        self.batch_axis = mca.check_batch_axis(batch_axis)
        factory_kwargs: dict[str, Any] = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        if not factory_kwargs["dtype"].is_floating_point:
            raise TypeError(f"dtype must be a floating dtype; received {dtype}")
        self.register_buffer("masks", torch.as_tensor(resolved, **factory_kwargs))
        # The batch size of the recording model's last call, kept after it: torch.utils.checkpoint recomputes a
        # block in backward, after the call, and groups its rows as the call did.
        self.samples: int | None = None
        self.register_forward_pre_hook(_off_fused_paths)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the masks: (B, ...) -> (B, ...), or (L, B, ...) -> (L, B, ...) along the samples' axis 1."""
        samples = self._training_samples() if self.training else None  # eval: predict's tiled batch lines up already
        known = samples if self.training else self.samples if self.open_calls else None
        axis = self._sample_axis(x, known)
        if not torch.compiler.is_compiling() and not isinstance(x, torch.fx.Proxy):
            self.grouped_axis = axis
        index = None
        if self.mode == "random" and self.training:
            rows = x.shape[axis]
            per_sample = mca.rows_per_sample(rows, samples)  # random mode draws in training only
            index = torch.randint(self.n, (rows // per_sample,), device=x.device, generator=self.generator)
            if per_sample != 1:  # one draw per sample, shared by its rows
                index = index.repeat_interleave(per_sample)
        return masksembles(
            x,
            self.masks,
            channel_axis=self.channel_axis,
            index=index,
            samples=samples,
            ranks=self.ranks,
            layer=type(self).__name__,
            batch_axis=axis,
        )

    def _sample_axis(self, x: Tensor, samples: int | None) -> int:
        """The axis of ``x`` that holds the samples (``masksembles_core.adapter.sample_axis``). Under torch.compile
        or torch.export a declared axis is used as it is (the eager calls check it), and an undeclared one is the
        axis that provably holds the batch for every value of the symbolic sizes, axis 0 where axis 1 has a fixed size
        (no guard pinning the batch size to it, which torch.export refuses: DeBERTa's relative attention), and is
        decided with guards only where neither holds."""
        if isinstance(x, torch.fx.Proxy) or x.is_nested or x.ndim < 2:
            # torch.fx's symbolic trace records the declared axis (no sizes to check), the functional refuses the rest
            return 0 if self.batch_axis is None else self.batch_axis
        layer = f"{type(self).__name__}({self.channels}, n={self.n})"
        if torch.compiler.is_compiling() and samples is not None:
            if self.batch_axis is not None:
                return self.batch_axis
            proven = mca.sample_axis(x.shape, self.channel_axis, samples, layer=layer, known=statically_known_true)
            if proven == 1 or statically_known_true(x.shape[0] % samples == 0):
                return int(proven)
            if isinstance(samples, torch.SymInt) and x.ndim == 3 and not isinstance(x.shape[1], torch.SymInt):
                return 0  # a fixed size on axis 1 holds no batch of every size: no guard pinning the batch to it
        return int(mca.sample_axis(x.shape, self.channel_axis, samples, self.batch_axis, layer=layer))

    def _training_samples(self) -> int | None:
        """The model's batch size for this training call: the recording model's (``record_batch_size``) within its
        call, and after it in autograd's backward (``torch.utils.checkpoint``'s recomputation of this call);
        ``samples`` as it is set for a layer no model records for.

        Raises:
            RuntimeError: a recording model holds the layer and the call is not part of one of its calls
                (``model.forward_features(x)``, a submodule called directly), or that call had no batch-first tensor:
                which rows belong to which sample is not known, and a model that folds windows or tokens into the
                batch would send a sample through two members.
        """
        if not self.recorded:
            return self.samples
        if self.samples is not None and (self.open_calls or torch._C._current_graph_task_id() != -1):
            return self.samples
        raise RuntimeError(
            f"{type(self).__name__}({self.channels}, n={self.n}) ran in training outside a call of the model that "
            "records its batch size (record_batch_size, which insert and convert_dropout call), as "
            "model.forward_features(x) or a submodule called directly does, or in a call with no batch-first tensor: "
            "its rows cannot be grouped by sample (where the model folds windows or tokens into the batch, a sample "
            "would go through two members). Call the model itself, or make the call inside "
            "`with masksembles_torch.recorded_call(model, x):` (x: the call's input, samples on axis 0), or record "
            "the batch size on the module you call (masksembles_torch.record_batch_size(module))"
        )

    def extra_repr(self) -> str:
        axis = "" if self.batch_axis is None else f", batch_axis={self.batch_axis}"
        return (
            f"{self.channels}, n={self.n}, scale={self.scale}, mode={self.mode!r}, channel_axis={self.channel_axis}"
            f"{axis}"
        )

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + "masks"
        if key in state_dict:
            loaded = state_dict[key]
            if tuple(loaded.shape) != (self.n, self.channels):
                error_msgs.append(
                    f"{key}: the checkpoint holds masks of shape {tuple(loaded.shape)}, but this "
                    f"{type(self).__name__} has n={self.n}, channels={self.channels}; build the layer with "
                    f"n={loaded.shape[0] if loaded.ndim == 2 else '?'} and "
                    f"channels={loaded.shape[-1] if loaded.ndim == 2 else '?'}"
                )
                return
            try:
                mc.validate_masks(loaded.detach().cpu().float().numpy())
            except ValueError as error:
                error_msgs.append(f"{key}: invalid masks in the checkpoint: {error}")
                return
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


class Masksembles1D(Masksembles):
    """Masksembles for (B, C) or (B, C, L) inputs (like ``nn.Dropout`` / ``nn.Dropout1d``)."""

    ranks = (2, 3)


class Masksembles2D(Masksembles):
    """Masksembles for (B, C, H, W) inputs (like ``nn.Dropout2d``)."""

    ranks = (4,)


class Masksembles3D(Masksembles):
    """Masksembles for (B, C, D, H, W) inputs (like ``nn.Dropout3d``)."""

    ranks = (5,)


def _off_fused_paths(module: nn.Module, args: tuple[Any, ...]) -> None:
    """A forward pre-hook that does nothing, on every Masksembles layer: torch's ``nn.TransformerEncoderLayer`` runs
    one fused kernel in eval without gradients that calls none of its submodules (its dropouts, its Linear layers),
    unless one of them has a hook. A layer holding Masksembles layers (placed by ``insert``, ``convert_dropout`` or by
    hand) therefore always takes its unfused path, and inference applies the masks as training does."""


def _batch_size(inputs: Any) -> int | None:
    """Axis 0 of the first tensor (of rank >= 1) in ``inputs``, nested tuples, lists and dicts searched in order."""
    if isinstance(inputs, Tensor):
        return inputs.shape[0] if inputs.dim() > 0 else None
    items = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, tuple | list) else ()
    for item in items:
        batch = _batch_size(item)
        if batch is not None:
            return batch
    return None


def _layers(model: nn.Module) -> list[Masksembles]:
    return [layer for layer in model.modules() if isinstance(layer, Masksembles)]


def _record(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: a call of ``model`` begins; give its Masksembles layers the batch size of its first tensor
    input (a model inside it that records too sets its own layers again at its call: each layer follows the innermost
    one)."""
    batch = _batch_size((args, kwargs))
    for layer in _layers(model):
        layer.recorded, layer.open_calls, layer.samples = True, layer.open_calls + 1, batch


def _close(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    """Forward hook, also run when the call raises: the call of ``model`` is over (its batch size is kept)."""
    for layer in _layers(model):
        layer.open_calls = max(layer.open_calls - 1, 0)  # a layer added to the model during the call was never opened


def record_batch_size(model: ModuleT) -> ModuleT:
    """Let every Masksembles layer of ``model`` group its rows by the model's samples; returns ``model``.

    Registers forward hooks on ``model``: at each call the batch size B of its first tensor input (axis 0) is given to
    its Masksembles layers (their ``samples``, kept after the call for ``torch.utils.checkpoint``'s recomputation in
    backward), which then, in training, send row ``r`` of a batch of ``B * f`` rows through the member of sample
    ``r // f`` (``masksembles_core.group_index(rows, n, samples=B)``); a layer whose rows B does not divide uses the
    plain rule over its rows. In training the layers refuse a call that is not part of a call of ``model`` (its other
    entry points, ``model.forward_features(x)``, or a submodule called directly): make such a call inside
    ``recorded_call(model, x)``. ``insert`` and ``convert_dropout`` call it; call it on a model with hand-placed
    layers. Calling it again does nothing. The hooks keep working under ``deepcopy``, pickling,
    ``torch.compile(fullgraph=True)`` and ``torch.export`` (B is symbolic there).
    """
    if _record not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_record, with_kwargs=True)
    if _close not in model._forward_hooks.values():
        model.register_forward_hook(_close, with_kwargs=True, always_call=True)
    for layer in _layers(model):
        layer.recorded = True
    return model


SEQUENCE_FIRST_MODULES = (
    nn.MultiheadAttention,
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.RNNBase,
)


def sequence_first(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's attention, transformer or recurrent modules set to sequence-first tensors,
    (L, B, ...) (``batch_first=False``, the default of every one of them)."""
    if isinstance(module, nn.TransformerEncoder | nn.TransformerDecoder):
        return bool(module.layers) and sequence_first(module.layers[0])
    if isinstance(module, nn.Transformer):
        return sequence_first(module.encoder)
    if isinstance(module, nn.TransformerEncoderLayer | nn.TransformerDecoderLayer):
        return not module.self_attn.batch_first
    return isinstance(module, SEQUENCE_FIRST_MODULES) and not getattr(module, "batch_first", True)


@contextlib.contextmanager
def samples_known(model: nn.Module, samples: int) -> Iterator[list[Masksembles]]:
    """Calls of ``model`` inside with ``samples`` rows of samples (``predict``'s tiled batch, ``n * B``): its
    Masksembles layers check the axis they group along against it, also those no model records for; yields the
    layers, whose ``grouped_axis`` then says along which axis each grouped (None: not called). Their state is restored
    afterwards."""
    layers = _layers(model)
    saved = [(layer.open_calls, layer.samples, layer.grouped_axis) for layer in layers]
    for layer in layers:
        layer.open_calls, layer.samples, layer.grouped_axis = layer.open_calls + 1, samples, None
    try:
        yield layers
    finally:
        for layer, (calls, known, _) in zip(layers, saved, strict=True):
            layer.open_calls, layer.samples = calls, known


@contextlib.contextmanager
def recorded_call(model: nn.Module, inputs: Any) -> Iterator[None]:
    """A call of ``model`` through another entry point, recorded as ``model(inputs)`` records it.

    ``with recorded_call(model, x): features = model.forward_features(x)`` (timm) gives ``model``'s Masksembles layers
    the batch size of ``inputs`` (axis 0 of its first tensor, nested tuples, lists and dicts searched: the samples) for
    the calls inside, so that in training each sample goes through one member, also where the model folds windows or
    tokens into the batch. ``model`` is the module whose layers ``record_batch_size`` records for (the one ``insert``
    or ``convert_dropout`` returned).

    Raises:
        ValueError: ``inputs`` hold no tensor with a batch axis.
    """
    if _batch_size(inputs) is None:
        raise ValueError(f"recorded_call needs the call's input, a tensor with a batch axis; received {inputs!r}")
    _record(model, (inputs,), {})
    try:
        yield
    finally:
        _close(model, (inputs,), {}, None)
