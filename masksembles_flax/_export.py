"""``export``: an NNX model's forward as a ``jax.export.Exported`` with a symbolic batch, its state inside."""

from __future__ import annotations

import jax
import jax.export
from flax import nnx


def export(
    model: nnx.Module, example: jax.Array | jax.ShapeDtypeStruct, *, batch: str | None = "b"
) -> jax.export.Exported:
    """``x -> model(x)`` exported with ``jax.export``: a serializable program that runs without the model's code.

    The model's state (``nnx.split``) is closed over, so its arrays are constants of the program: the artifact is
    self-contained (``exported.serialize()`` -> bytes; ``jax.export.deserialize(bytes).call(x)``). Axis 0 of the
    input is the symbolic dimension ``batch`` (``jax.export.symbolic_shape``: any size >= 1 at call time), the other
    axes and the dtype those of ``example``; ``batch=None`` fixes the batch to the example's. The outputs are
    ``model(x)``'s (a pytree of arrays: a ``with_uncertainty`` head's dict, a packed model's (n, B, ...) members).

    A packed model runs the whole batch in one call here (its chunks of the batch, ``PackedMasksembles.chunk``,
    need a known batch size).

    Raises:
        ValueError: the model cannot be traced at a symbolic batch (an operation whose shapes or values depend on
            the batch size in a way ``jax.export`` cannot express): the message names what JAX refused; export at a
            fixed batch with ``batch=None`` instead.
    """
    graphdef, state = nnx.split(model)

    def forward(x: jax.Array) -> object:
        return nnx.merge(graphdef, state)(x)

    shape = tuple(example.shape)
    if batch is not None:
        shape = (*jax.export.symbolic_shape(batch), *shape[1:])
    spec = jax.ShapeDtypeStruct(shape, example.dtype)  # type: ignore[no-untyped-call]
    try:
        return jax.export.export(jax.jit(forward))(spec)
    except jax.errors.InconclusiveDimensionOperation as error:
        if batch is None:
            raise
        reason = str(error).splitlines()[0]
        raise ValueError(
            f"{type(model).__name__} cannot be exported with a symbolic batch {batch!r}: tracing it at a batch of "
            f"unknown size failed ({type(error).__name__}: {reason}). Export at the example's fixed batch instead "
            f"(batch=None), or export the packed model (pack replays its operations for any batch size)"
        ) from error
