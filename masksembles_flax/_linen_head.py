"""linen ``with_uncertainty``: a linen module whose ``apply`` answers with the uncertainty, computed in the graph."""

from __future__ import annotations

from typing import Any

import flax.errors
import flax.linen as nn
import jax

import masksembles_core.adapter as mca
from masksembles_core.heads import HeadSpec, check_head

from ._heads import check_members_first, uncertainty_outputs
from ._ops import MASKS_COLLECTION, members, tile


class UncertaintyHead(nn.Module):
    """``wrapped`` on the batch tiled n times, then the uncertainty head: (B, ...) -> a dict of arrays.

    Its variables are ``wrapped``'s, at the same paths (``nn.share_scope``): ``head.apply(variables, x, ...)`` takes
    the variables ``wrapped.init`` made (and trained), and ``head.init`` makes the same ones. Made by
    ``with_uncertainty`` (its docstring).

    Attributes:
        wrapped: the linen module (with Masksembles layers: its own, or ``insert``'s/``convert_dropout``'s).
        spec: the validated head (``masksembles_core.heads.HeadSpec``); ``spec.outputs`` lists the dict's keys.
        n: the number of members; None reads it from the masks in the variables.
    """

    wrapped: nn.Module
    spec: HeadSpec
    n: int | None = None

    def setup(self) -> None:
        nn.share_scope(self, self.wrapped)

    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> dict[str, jax.Array]:
        """(B, ...) -> ``{name: array}`` in ``spec.outputs`` order; ``args``/``kwargs`` go to ``wrapped`` (e.g.
        ``train=False``) after the input."""
        if self.is_initializing():
            self.wrapped(x, *args, **kwargs)  # makes the variables, the masks with them, from x's shapes
        else:
            self._check_inference_call()
        counts = mask_counts(self.variables.get(MASKS_COLLECTION, {}))
        if not counts:
            raise ValueError(
                f"the variables hold no {MASKS_COLLECTION!r} masks: {type(self.wrapped).__name__} has no Masksembles "
                f"layer, so no members to take the uncertainty of (insert or convert_dropout puts them in a module)"
            )
        n = mca.check_members(counts, self.n)
        try:
            outputs = self.wrapped(tile(x, n), *args, **kwargs)
        except (flax.errors.InvalidRngError, flax.errors.ModifyScopeVariableError) as error:
            raise ValueError(
                f"with_uncertainty runs the module in inference mode, and it asked for {_wanted(error)}: pass the "
                f"call arguments that put it in inference mode (e.g. train=False, deterministic=True) after x"
            ) from error
        if not isinstance(outputs, jax.Array):
            raise TypeError(
                f"with_uncertainty needs a module that returns one array; it returned {type(outputs).__name__}"
            )
        return uncertainty_outputs(check_members_first(members(outputs, n, x.shape[0]), n, x.shape[0]), self.spec)

    def _check_inference_call(self) -> None:
        """Refuse ``apply`` with RNG streams or mutable collections: a draw or a batch statistic is training."""
        assert self.scope is not None  # a bound module
        if self.scope.rngs:
            raise ValueError(
                f"with_uncertainty answers in inference mode: apply it without rngs (received {sorted(self.scope.rngs)}"
                f"; a Dropout or random-mode Masksembles layer that draws makes the answer random)"
            )
        if self.scope.mutable:  # apply's mutable: False (the default) or an empty list when nothing is
            raise ValueError(
                f"with_uncertainty answers in inference mode: apply it with nothing mutable (received mutable="
                f"{self.scope.mutable!r}; BatchNorm in training mode would use the tiled batch's statistics)"
            )


def _wanted(error: Exception) -> str:
    if isinstance(error, flax.errors.InvalidRngError):
        return "a random stream (a Dropout or random-mode Masksembles layer not deterministic)"
    return "a variable update (a BatchNorm with use_running_average=False)"


def mask_counts(masks: Any) -> list[int]:
    """The n of every Masksembles layer whose (..., n, C) masks a ``"masksembles"`` collection holds."""
    return [int(leaf.shape[-2]) for leaf in jax.tree.leaves(masks)]


def with_uncertainty(
    module: nn.Module,
    *,
    task: str = "classification",
    logits: bool = True,
    head: str | None = None,
    min_variance: float = 1e-6,
    n: int | None = None,
) -> UncertaintyHead:
    """``module`` answering with its uncertainty: a linen module whose ``apply(variables, x, *args, **kwargs)``
    returns a dict, the head computed with jax.numpy in the same graph (``jax.jit(head.apply)`` and ``jax.export``
    take it whole).

    It runs ``module`` as ``masksembles_flax.predict`` does (the batch tiled n times, then untiled; the members on axis
    0) with the same variables (``module``'s, at the same paths) and the call arguments given after ``x``; the dict is
    ``masksembles_core.heads.uncertainty_head``'s (see ``masksembles_flax.nnx.with_uncertainty``), in float32 at
    least. Inference only: ``apply`` with ``rngs`` or ``mutable`` is refused, and a module that then asks for a
    random stream (Dropout in training mode) or a variable update (BatchNorm's batch statistics) is a ``ValueError``
    saying so. Concrete members are checked as the core checks them; traced (``jit``, exported) ones are not.

    Args:
        task, logits, head, min_variance: as ``masksembles_core.heads.check_head`` takes them.
        n: the number of members; None reads it from the masks in the variables (``"masksembles"`` collection).

    Raises:
        ValueError: bad head arguments (``check_head``); at ``apply``: variables with no masks (a module without
            Masksembles layers: no members), masks of different n or an ``n`` that differs from them, a call in
            training mode.
        TypeError: ``module`` is not a linen module, or ``logits``/``min_variance`` of the wrong type.
    """
    spec = check_head(task, logits=logits, head=head, min_variance=min_variance)
    if not isinstance(module, nn.Module):
        raise TypeError(f"with_uncertainty takes a linen nn.Module; received {type(module).__name__}")
    return UncertaintyHead(module.clone(parent=None), spec, None if n is None else mca.check_n(n))
