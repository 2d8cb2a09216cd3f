"""Masksembles for Flax linen.

    layer = Masksembles(n=4, scale=2.0, seed=0)
    variables = layer.init(jax.random.key(0), x)      # {"masksembles": {"masks": bool (4, C)}}
    y = layer.apply(variables, x)

The masks live in their own variable collection, ``MASKS_COLLECTION``: they are made once at ``init``, saved and
restored with the variables, and never seen by an optimizer over ``params``. Every later ``apply`` must be given
them, like ``batch_stats``: ``model.apply({"params": params, "masksembles": variables["masksembles"]}, x)``; a call
without them is an error, never new masks. ``with_uncertainty(module)`` is a module whose ``apply`` on the same
variables answers with the uncertainty (a dict computed in the graph).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

import masksembles_core.adapter as mca

from ._linen_head import UncertaintyHead, with_uncertainty
from ._linen_surgery import Converted, Inserted, convert_dropout, insert
from ._ops import MASKS_COLLECTION, input_channels, masked

__all__ = [
    "MASKS_COLLECTION",
    "Converted",
    "Inserted",
    "Masksembles",
    "UncertaintyHead",
    "convert_dropout",
    "insert",
    "with_uncertainty",
]


class Masksembles(nn.Module):
    """Multiply each sample by one of ``n`` fixed binary channel masks (Durasov et al., CVPR 2021).

    Input (B, ..., C, ...) with C channels on ``channel_axis``; output of the same shape and dtype. Sample ``i`` of a
    batch of B gets mask ``(i*n)//B`` (``masksembles_core.group_index``): the batch is n contiguous groups when n
    divides B, and any B works. With ``mode="random"`` and ``deterministic=False`` each sample instead draws its mask
    uniformly from the ``rng_collection`` stream (the paper's training rule); deterministic calls stay grouped.

    Attributes:
        n: number of masks (ensemble members).
        scale: overlap control, >= 1 (mean IoU of the masks about ``1/(2*scale-1)``).
        seed: seed of the NumPy mask generator; None draws fresh entropy at each ``init``.
        masks: fixed (n, C) 0/1 masks to use instead of generated ones; converted to a tuple of tuples of bools at
            construction, so the module stays hashable.
        channel_axis: axis of the input holding the channels (not 0).
        mode: "grouped" or "random".
        deterministic: the ``mode="random"`` switch, merged with the call argument as ``nn.Dropout`` does.
        rng_collection: RNG stream of the random mask draws.
        batch_axis: the axis of the samples in the input: 0 (B, ...), 1 for a sequence-first (L, B, ..., C) input
            (after ``nn.RNN(time_major=True)``), or None (the default): decided in each call from its shape and the
            model's batch size where one is known (``masksembles_flax.batch_size``; ``sample_axis`` of
            ``masksembles_core.adapter``), else axis 0. A call with a known batch size refuses a declared axis that
            does not hold it.
    """

    n: int
    scale: float
    seed: int | np.random.Generator | None = None
    masks: ArrayLike | None = None
    channel_axis: int = -1
    mode: str = "grouped"
    deterministic: bool | None = None
    rng_collection: str = "dropout"
    batch_axis: int | None = None

    def __post_init__(self) -> None:
        arguments = self._arguments()  # checked at construction rather than at init
        mca.check_batch_axis(self.batch_axis)
        if arguments.masks is not None:
            object.__setattr__(self, "masks", tuple(tuple(bool(v) for v in row) for row in arguments.masks))
        super().__post_init__()

    @nn.nowrap  # not a module method: called on the unbound module in __post_init__, also under nn.tabulate
    def _arguments(self) -> mca.LayerArguments:
        return mca.layer_arguments(
            None, self.n, self.scale, seed=self.seed, masks=self.masks, channel_axis=self.channel_axis, mode=self.mode
        )

    @nn.nowrap
    def _initial_masks(self, input_shape: Sequence[int]) -> jax.Array:
        """The (n, C) bool masks made at ``init``: the given ``masks``, or generated for the input's channels."""
        channels = None if self.masks is not None else input_channels(input_shape, self.channel_axis)
        return jnp.asarray(self._arguments().masks_for(channels))

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool | None = None, rng: jax.Array | None = None) -> jax.Array:
        """Apply the masks to ``x`` of shape (B, ..., C, ...), or (L, B, ..., C) along the samples' axis 1.

        Args:
            x: input with the channels on ``channel_axis``.
            deterministic: with ``mode="random"``, False draws a random mask per sample; ignored in grouped mode.
            rng: key of the random draws, instead of ``make_rng(rng_collection)``.

        Raises:
            ValueError: outside ``init``, the variables hold no masks for this layer (masks are only made by
                ``init``, even with ``mutable=["masksembles"]``).
        """
        if not self.is_initializing() and not self.has_variable(MASKS_COLLECTION, "masks"):
            raise ValueError(_missing_masks_message(self.path))
        masks = self.variable(MASKS_COLLECTION, "masks", self._initial_masks, x.shape).value
        key = None
        if self.mode == "random" and not nn.merge_param("deterministic", self.deterministic, deterministic):
            key = self.make_rng(self.rng_collection) if rng is None else rng
        name = f"Masksembles[{'/'.join(self.path)}]" if self.path else "Masksembles"
        return masked(x, masks, channel_axis=self.channel_axis, batch_axis=self.batch_axis, layer=name, key=key)


def _missing_masks_message(path: Sequence[str]) -> str:
    where = f"Masksembles layer {'/'.join(path)!r}" if path else "The Masksembles layer"
    return (
        f"{where} has no masks: the variables given to apply hold no {MASKS_COLLECTION!r} collection for it. "
        f"The masks are made once, by init, and are part of the model: pass them to every apply like batch_stats, "
        f"e.g. apply_fn({{'params': params, {MASKS_COLLECTION!r}: variables[{MASKS_COLLECTION!r}]}}, x); "
        f"mutable=[{MASKS_COLLECTION!r}] does not make new ones."
    )
