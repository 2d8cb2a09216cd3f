"""What every framework path of the demo builds, trains and returns (framework-free)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

import masksembles_core as mc

N = 4  # masks, dropout samples and ensemble members
METHODS = ("single", "dropout", "masksembles")
TASKS = ("classification", "regression")


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """A classifier or a Gaussian regressor to build, with dropout or Masksembles after every hidden layer.

    ``arch="mlp"``, input (B, F): Linear(F, w0) ReLU · Linear(w0, w1) ReLU · Linear(w1, K).
    ``arch="cnn"``, input (B, C, H, W): Conv3x3(C, w0) ReLU MaxPool2 · Conv3x3(w0, w1) ReLU ·
    Linear(w1·H/2·W/2, w2) ReLU · Linear(w2, K). The regularizer (Masksembles with ``masks[i]``,
    channel dropout at ``rate``, or nothing) follows hidden block ``i``, on the channels.

    Attributes:
        arch: "mlp" or "cnn".
        in_shape: one sample's shape, (F,) or (C, H, W).
        outputs: output units K: the logits of K classes (classification), or 2 for
            (mean, log-variance) (regression).
        widths: channels of the hidden blocks (w0, w1[, w2]).
        method: "single", "dropout" (MC-Dropout) or "masksembles".
        rate: dropout rate (method "dropout").
        samples: members at inference: stochastic passes for "dropout", masks for "masksembles".
        masks: one (n, widths[i]) bool array per hidden block (method "masksembles").
        scale: the S the masks were made with (method "masksembles").
        task: "classification" (trained on the cross-entropy) or "regression" (on the Gaussian
            negative log-likelihood of the adapter's loss).
    """

    arch: str
    in_shape: tuple[int, ...]
    outputs: int
    widths: tuple[int, ...]
    method: str = "single"
    rate: float = 0.0
    samples: int = 1
    masks: tuple[NDArray[np.bool_], ...] = ()
    scale: float = 1.0
    task: str = "classification"

    def __post_init__(self) -> None:
        blocks = {"mlp": 2, "cnn": 3}[self.arch]
        if len(self.widths) != blocks or self.method not in METHODS or self.task not in TASKS:
            raise ValueError(
                f"bad ModelSpec: arch={self.arch!r} needs {blocks} widths; method={self.method!r}; task={self.task!r}"
            )
        if self.task == "regression" and self.outputs != 2:
            raise ValueError(f"a regression ModelSpec has 2 outputs (mean, log-variance); received {self.outputs}")
        if self.method == "masksembles" and [m.shape for m in self.masks] != [(self.samples, w) for w in self.widths]:
            raise ValueError(f"masks {[m.shape for m in self.masks]} do not fit n={self.samples}, widths={self.widths}")

    @property
    def parameters(self) -> int:
        """Trainable parameters of the network (weights and biases; masks are not parameters)."""
        if self.arch == "mlp":
            sizes = [self.in_shape[0], *self.widths, self.outputs]
            return sum((fan_in + 1) * fan_out for fan_in, fan_out in itertools.pairwise(sizes))
        channels, height, width = self.in_shape
        first, second, hidden = self.widths
        convolutions = (9 * channels + 1) * first + (9 * first + 1) * second
        return convolutions + (second * (height // 2) * (width // 2) + 1) * hidden + (hidden + 1) * self.outputs


@dataclass(frozen=True)
class TrainConfig:
    """Adam on the task's loss, ``epochs`` passes over shuffled mini-batches."""

    epochs: int
    batch_size: int
    learning_rate: float


class Trained(Protocol):
    """A trained model: its size, its training time and its members' predictions."""

    @property
    def parameters(self) -> int:
        """Number of trained parameters (masks are not parameters)."""
        ...

    @property
    def seconds(self) -> float:
        """Training wall time."""
        ...

    def predict(self, x: NDArray[np.float32]) -> NDArray[np.float64]:
        """Member outputs, (B, ...) -> (members, B, K): logits, or (mean, log-variance) for regression."""
        ...


class Framework(Protocol):
    """One framework's model code (a module such as ``_demo_torch``)."""

    def train(
        self,
        spec: ModelSpec,
        x: NDArray[np.float32],
        y: NDArray[np.int64] | NDArray[np.float32],
        config: TrainConfig,
        *,
        seed: int,
        desc: str,
    ) -> Trained:
        """Build ``spec`` with weights from ``seed``, train it on (x, y) (class labels, or float targets for
        regression), show a progress bar named ``desc``."""
        ...


@dataclass(frozen=True)
class Ensemble:
    """A deep ensemble: independently trained models, whose predictions are stacked as members."""

    models: tuple[Trained, ...]

    @property
    def parameters(self) -> int:
        return sum(model.parameters for model in self.models)

    @property
    def seconds(self) -> float:
        return sum(model.seconds for model in self.models)

    def predict(self, x: NDArray[np.float32]) -> NDArray[np.float64]:
        """(B, ...) -> (len(models), B, K): member k is model k."""
        return np.concatenate([model.predict(x) for model in self.models], axis=0)


def train_ensemble(
    framework: Framework,
    spec: ModelSpec,
    x: NDArray[np.float32],
    y: NDArray[np.int64] | NDArray[np.float32],
    config: TrainConfig,
    *,
    seed: int,
    desc: str,
) -> Ensemble:
    """``N`` independently initialized and shuffled copies of ``spec``."""
    return Ensemble(
        tuple(
            framework.train(spec, x, y, config, seed=mc.derive_seed(seed, 100 + k), desc=f"{desc} {k + 1}/{N}")
            for k in range(N)
        )
    )


def masksembles_spec(base: ModelSpec, masks: Sequence[NDArray[np.bool_]], scale: float) -> ModelSpec:
    """``base`` with Masksembles layers holding ``masks`` (made with ``scale``); the widths become the masks' widths."""
    return ModelSpec(
        base.arch,
        base.in_shape,
        base.outputs,
        tuple(m.shape[1] for m in masks),
        method="masksembles",
        samples=masks[0].shape[0],
        masks=tuple(masks),
        scale=scale,
        task=base.task,
    )
