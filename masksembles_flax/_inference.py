"""``predict``: every member on every sample, with ``n`` read from (or checked against) the model's layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
from flax import nnx

import masksembles_core.adapter as mca

from ._capture import masking_counts
from ._nnx_layers import Masksembles
from ._ops import predict as predict_members

T = TypeVar("T")


def predict(model: Callable[[jax.Array], T], x: jax.Array, n: int | None = None) -> T:
    """Every member's output on every sample: ``model(tile(x, n))`` with each output leaf untiled to (n, B, ...).

    ``model`` maps a batch to outputs (an array or a pytree of arrays with the batch on axis 0) and runs its
    Masksembles layers by the grouping rule (mode "grouped", or deterministic). An ``nnx.Module`` runs in inference
    mode (``eval()``: BatchNorm running statistics, Dropout off) on a copy of its graph, whatever mode it was left
    in, so its state is never changed; a linen ``apply`` in a function runs as the function calls it (linen
    variables change only where ``mutable`` returns them).

    Args:
        n: the number of members; None reads it from the model's Masksembles layers: an ``nnx.Module``'s own layers,
            or, in any other function, the grouped layers (linen and NNX) that one abstract trace of ``model(x)``
            (``jax.make_jaxpr``: nothing is computed) finds.

    Raises:
        ValueError: ``n`` differs from the n of the model's Masksembles layers, the layers have different n, or
            ``n`` is None and no Masksembles layer is found.
    """
    if isinstance(model, nnx.Module):
        counts = [layer.n for _, layer in nnx.iter_graph(model) if isinstance(layer, Masksembles)]
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, state)  # a new graph on the same arrays: eval() leaves the model's mode alone
        model.eval()  # type: ignore[no-untyped-call]
    else:
        counts = sorted(masking_counts(jax.make_jaxpr(model)(x).jaxpr))
    result: T = predict_members(model, x, mca.check_members(counts, n))
    return result
