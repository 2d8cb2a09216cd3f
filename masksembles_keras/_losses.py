"""Gaussian negative log-likelihood for members with a (mean, variance) head, in ``keras.ops`` only."""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

import masksembles_core.adapter as mca

from ._layers import SERIALIZATION_PACKAGE


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class GaussianNLL(keras.losses.Loss):  # type: ignore[misc]  # keras is untyped: Loss is Any to mypy
    """Negative log-likelihood of the target under N(mean, σ²) predicted by a two-channel head.

    ``0.5 * (log(2π σ²) + (y - mean)² / σ²)`` per element, with ``σ²`` floored at
    ``min_variance``: the value ``masksembles_core.metrics.gaussian_nll`` reports. Use it in
    ``model.compile(loss=GaussianNLL())``; ``predict`` then returns the members' (n, B, ..., 2)
    outputs for ``metrics.gaussian_mixture``. Saved with the model (``.keras``).

    Args:
        head: what output channel 1 holds: ``"log_variance"`` (log σ², default) or
            ``"variance"`` (σ², e.g. after a softplus). Channel 0 is the mean.
        min_variance: the smallest variance used (> 0).
        reduction, name, dtype: as for any ``keras.losses.Loss``; the default reduction averages
            over every element. Targets are (B, ...) or (B, ..., 1) for outputs (B, ..., 2).
    """

    def __init__(
        self,
        head: str = "log_variance",
        min_variance: float = 1e-6,
        reduction: str = "sum_over_batch_size",
        name: str = "gaussian_nll",
        dtype: Any = None,
    ) -> None:
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.head, self.min_variance = mca.check_gaussian_head(head, min_variance)

    def call(self, y_true: Any, y_pred: Any) -> Any:
        if mca.check_gaussian_target(y_pred.shape, y_true.shape):
            y_true = ops.squeeze(y_true, axis=-1)
        mean, channel = y_pred[..., 0], y_pred[..., 1]
        if self.head == "log_variance":
            log_variance = ops.maximum(channel, math.log(self.min_variance))
            inverse_variance = ops.exp(-log_variance)
        else:
            variance = ops.maximum(channel, self.min_variance)
            log_variance, inverse_variance = ops.log(variance), ops.reciprocal(variance)
        return 0.5 * (log_variance + ops.square(y_true - mean) * inverse_variance + math.log(2.0 * math.pi))

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        return {**config, "head": self.head, "min_variance": self.min_variance}
