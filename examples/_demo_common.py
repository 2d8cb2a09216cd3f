"""What every framework path of the demo builds, trains and returns (framework-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

METHODS = ("single", "dropout", "masksembles")


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """A classifier to build, with dropout or Masksembles after every hidden layer.

    ``arch="mlp"``, input (B, F): Linear(F, w0) ReLU · Linear(w0, w1) ReLU · Linear(w1, K).
    ``arch="cnn"``, input (B, C, H, W): Conv3x3(C, w0) ReLU MaxPool2 · Conv3x3(w0, w1) ReLU ·
    Linear(w1·H/2·W/2, w2) ReLU · Linear(w2, K). The regularizer (Masksembles with ``masks[i]``,
    channel dropout at ``rate``, or nothing) follows hidden block ``i``, on the channels.

    Attributes:
        arch: "mlp" or "cnn".
        in_shape: one sample's shape, (F,) or (C, H, W).
        classes: number of classes K.
        widths: channels of the hidden blocks (w0, w1[, w2]).
        method: "single", "dropout" (MC-Dropout) or "masksembles".
        rate: dropout rate (method "dropout").
        samples: members at inference: stochastic passes for "dropout", masks for "masksembles".
        masks: one (n, widths[i]) bool array per hidden block (method "masksembles").
        scale: the S the masks were made with (method "masksembles").
    """

    arch: str
    in_shape: tuple[int, ...]
    classes: int
    widths: tuple[int, ...]
    method: str = "single"
    rate: float = 0.0
    samples: int = 1
    masks: tuple[NDArray[np.bool_], ...] = ()
    scale: float = 1.0

    def __post_init__(self) -> None:
        blocks = {"mlp": 2, "cnn": 3}[self.arch]
        if len(self.widths) != blocks or self.method not in METHODS:
            raise ValueError(f"bad ModelSpec: arch={self.arch!r} needs {blocks} widths; method={self.method!r}")
        if self.method == "masksembles" and [m.shape for m in self.masks] != [(self.samples, w) for w in self.widths]:
            raise ValueError(f"masks {[m.shape for m in self.masks]} do not fit n={self.samples}, widths={self.widths}")


@dataclass(frozen=True)
class TrainConfig:
    """Adam on the cross-entropy, ``epochs`` passes over shuffled mini-batches."""

    epochs: int
    batch_size: int
    learning_rate: float


def softmax(logits: NDArray[np.floating]) -> NDArray[np.float64]:
    """Probabilities over the last axis, in float64."""
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
    result: NDArray[np.float64] = shifted / shifted.sum(axis=-1, keepdims=True)
    return result


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
        """Member probabilities, (B, ...) -> (members, B, K)."""
        ...


class Framework(Protocol):
    """One framework's model code (a module such as ``_demo_torch``)."""

    def train(
        self,
        spec: ModelSpec,
        x: NDArray[np.float32],
        y: NDArray[np.int64],
        config: TrainConfig,
        *,
        seed: int,
        desc: str,
    ) -> Trained:
        """Build ``spec`` with weights from ``seed``, train it on (x, y), show a progress bar named ``desc``."""
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
