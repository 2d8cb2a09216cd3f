"""The NNX layers: ``Masksembles`` (its masks in a ``Masks`` variable), and ``Flatten`` and ``Residual`` for
``nnx.Sequential`` models. Public through ``masksembles_flax.nnx``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
from flax import nnx
from numpy.typing import ArrayLike

import masksembles_core.adapter as mca

from ._ops import batch_size_of_call, masked

RngSource = nnx.Rngs | nnx.RngStream | jax.Array
ModuleT = TypeVar("ModuleT", bound=nnx.Module)


class Masks(nnx.Variable[jax.Array]):
    """The fixed (n, channels) bool masks of a Masksembles layer: saved with the model, never trained."""


class Masksembles(nnx.Module):
    """Multiply each sample by one of ``n`` fixed binary channel masks (Durasov et al., CVPR 2021).

    Input (B, ..., C, ...) with C = ``channels`` on ``channel_axis``; output of the same shape and dtype. Sample
    ``i`` of a batch of B gets mask ``(i*n)//B`` (``masksembles_core.group_index``): the batch is n contiguous groups
    when n divides B, and any B works. With ``mode="random"`` and ``deterministic=False`` each sample instead draws
    its mask uniformly from ``rngs`` (the paper's training rule); ``model.eval()`` (``deterministic=True``) makes it
    grouped again. Grouped mode ignores ``deterministic`` and needs no ``rngs``.

    Args:
        channels: number of channels C.
        n: number of masks (ensemble members).
        scale: overlap control, >= 1 (mean IoU of the masks about ``1/(2*scale-1)``).
        seed: seed of the NumPy mask generator; None draws fresh entropy.
        masks: fixed (n, channels) 0/1 masks to use instead of generated ones.
        channel_axis: axis of the input holding the channels (not 0).
        mode: "grouped" or "random".
        deterministic: the ``mode="random"`` switch; a call argument wins, ``train()``/``eval()``/``nnx.view`` set it.
        rng_collection: stream of ``rngs`` forked for the random draws.
        rngs: ``nnx.Rngs`` or ``nnx.RngStream`` forked for ``mode="random"`` (unused in grouped mode).
        batch_axis: the axis of the samples in the input: 0 (B, ...), 1 for a sequence-first (L, B, ..., C) input
            (after ``nnx.RNN(time_major=True)``), or None (the default): decided in each call from its shape and the
            model's batch size (``masksembles_core.adapter.sample_axis``: axis 1 where a 3-D channels-last input
            holds the batch there and axis 0 cannot; axis 0 where both fit, the batch-first convention), axis 0
            where no batch size is known (``record_batch_size``, ``masksembles_flax.batch_size``). ``insert`` and
            ``convert_dropout`` set it from their example input. A call with a known batch size refuses a declared
            axis that does not hold it.
    """

    def __init__(
        self,
        channels: int,
        n: int,
        scale: float,
        *,
        seed: int | np.random.Generator | None = None,
        masks: ArrayLike | None = None,
        channel_axis: int = -1,
        mode: str = "grouped",
        deterministic: bool | None = False,
        rng_collection: str = "dropout",
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        batch_axis: int | None = None,
    ) -> None:
        arguments = mca.layer_arguments(
            channels, n, scale, seed=seed, masks=masks, channel_axis=channel_axis, mode=mode
        )
        resolved = arguments.masks_for(channels)
        self.n, self.channels = resolved.shape
        self.scale, self.channel_axis, self.mode = arguments.scale, arguments.channel_axis, arguments.mode
        self.masks = Masks(jnp.asarray(resolved))
        self.deterministic = deterministic
        self.batch_axis = mca.check_batch_axis(batch_axis)
        self.rng_collection = rng_collection
        if rngs is not None and not isinstance(rngs, nnx.Rngs | nnx.RngStream):
            raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream or None; received {type(rngs).__name__}")
        # Only random mode draws: a grouped layer holds no RNG state and leaves the caller's streams untouched.
        if self.mode == "random" and rngs is not None:
            self.rngs = (rngs[rng_collection] if isinstance(rngs, nnx.Rngs) else rngs).fork()
        else:
            self.rngs = nnx.data(None)

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None, rngs: RngSource | None = None) -> jax.Array:
        """Apply the masks to ``x`` of shape (B, ..., C, ...), or (L, B, ..., C) along the samples' axis 1.

        Args:
            x: input with the channels on ``channel_axis``.
            deterministic: with ``mode="random"``, False draws a random mask per sample; overrides the attribute.
            rngs: ``nnx.Rngs``, ``nnx.RngStream`` or key for the random draws, instead of the layer's own stream.
        """
        random = self.mode == "random" and not self._resolve_deterministic(deterministic)
        return masked(
            x,
            self.masks[...],
            channel_axis=self.channel_axis,
            batch_axis=self.batch_axis,
            layer=f"Masksembles({self.channels}, n={self.n})",
            key=self._random_key(rngs) if random else None,
        )

    def _resolve_deterministic(self, deterministic: bool | None) -> bool:
        resolved = self.deterministic if deterministic is None else deterministic
        if resolved is None:
            raise ValueError(
                "Masksembles(mode='random') needs `deterministic`: pass it to the constructor or the call, "
                "or set it with model.train()/model.eval() or nnx.view(model, deterministic=...)"
            )
        return resolved

    def _random_key(self, rngs: RngSource | None) -> jax.Array:
        source = self.rngs if rngs is None else rngs
        if isinstance(source, nnx.Rngs):
            source = source[self.rng_collection]
        if isinstance(source, nnx.RngStream):
            key: jax.Array = source()
            return key
        if isinstance(source, jax.Array):
            return source
        raise ValueError(
            "Masksembles(mode='random') with deterministic=False needs random keys: pass rngs to the constructor "
            "or the call"
        )

    def set_view(self, deterministic: bool | None = None) -> None:
        """Hook of ``nnx.view``: ``deterministic=True`` makes ``mode="random"`` grouped."""
        if deterministic is not None:
            self.deterministic = deterministic


@functools.cache
def _recording(cls: type[ModuleT]) -> type[ModuleT]:
    """``cls`` whose ``__call__`` runs in ``batch_size(B)``, B the batch of its first array input (same names)."""

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        with batch_size_of_call((args, kwargs)):
            return cls.__call__(self, *args, **kwargs)

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "records_batch_size": True,
    }
    metaclass: Any = type(cls)
    return cast(type[ModuleT], metaclass(cls.__name__, (cls,), namespace))


def record_batch_size(model: ModuleT) -> ModuleT:
    """Let every Masksembles layer of ``model`` group its rows by the model's samples; returns ``model``, changed.

    At each call of ``model`` the batch size B of its first array input (axis 0) is recorded (``batch_size``), so a
    layer called on ``B * f`` rows (windows or tokens folded into the batch in the sample-major order of ``reshape``)
    sends row ``r`` through the member of sample ``r // f``; a layer whose rows B does not divide uses the plain rule.
    The model's class becomes a subclass of the same name whose ``__call__`` records B (``isinstance`` holds, and
    ``nnx.split``/``nnx.merge``, ``nnx.jit`` and ``nnx.clone`` keep it). ``insert`` calls it. Calling it again does
    nothing.
    """
    if not getattr(type(model), "records_batch_size", False):
        model.__class__ = _recording(type(model))
    return model


class Flatten(nnx.Module):
    """(B, *rest) -> (B, prod(rest)) in row-major order: for channels-last input, feature ``s*C + c``."""

    def __call__(self, x: jax.Array) -> jax.Array:
        flat: jax.Array = x.reshape((x.shape[0], -1))
        return flat


class Residual(nnx.Module):
    """A residual block ``y = x + f(x)`` with ``f = nnx.Sequential(*layers)``; f must keep the shape of x."""

    def __init__(self, *layers: Callable[..., Any]) -> None:
        self.branch = nnx.Sequential(*layers)

    def __call__(self, x: jax.Array) -> jax.Array:
        y: jax.Array = x + self.branch(x)
        return y
