"""PyTorch path of the demo: builds, trains and runs the models that ``_demo_common.ModelSpec`` describes."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from _demo_common import ModelSpec, TrainConfig
from numpy.typing import NDArray
from torch import nn
from tqdm.auto import tqdm

import masksembles_torch as mt

# The demo's models are tiny: one intra-op thread is faster than two, and gives the same numbers on every machine.
torch.set_num_threads(1)

PREDICT_BATCH = 1024


def regularizer(spec: ModelSpec, block: int, *, conv: bool) -> nn.Module:
    """What follows hidden block ``block``: Masksembles with its masks, channel dropout, or nothing."""
    if spec.method == "masksembles":
        return (mt.Masksembles2D if conv else mt.Masksembles1D)(scale=spec.scale, masks=spec.masks[block])
    if spec.method == "dropout":
        return nn.Dropout2d(spec.rate) if conv else nn.Dropout(spec.rate)
    return nn.Identity()


def build(spec: ModelSpec) -> nn.Sequential:
    """The network of ``spec`` (see ``ModelSpec``), initialized from the current torch seed."""
    widths = spec.widths
    if spec.arch == "mlp":
        (features,) = spec.in_shape
        return nn.Sequential(
            nn.Linear(features, widths[0]),
            nn.ReLU(),
            regularizer(spec, 0, conv=False),
            nn.Linear(widths[0], widths[1]),
            nn.ReLU(),
            regularizer(spec, 1, conv=False),
            nn.Linear(widths[1], spec.outputs),
        )
    channels, height, width = spec.in_shape
    return nn.Sequential(
        nn.Conv2d(channels, widths[0], 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        regularizer(spec, 0, conv=True),
        nn.Conv2d(widths[0], widths[1], 3, padding=1),
        nn.ReLU(),
        regularizer(spec, 1, conv=True),
        nn.Flatten(),
        nn.Linear(widths[1] * (height // 2) * (width // 2), widths[2]),
        nn.ReLU(),
        regularizer(spec, 2, conv=False),
        nn.Linear(widths[2], spec.outputs),
    )


@dataclass
class TorchModel:
    """A trained torch model and how to get its members' predictions."""

    model: nn.Sequential
    spec: ModelSpec
    seed: int
    parameters: int
    seconds: float

    def predict(self, x: NDArray[np.float32]) -> NDArray[np.float64]:
        """Member outputs (logits, or mean and log-variance), (B, ...) -> (members, B, K)."""
        inputs = torch.from_numpy(x)
        self.model.eval()
        if self.spec.method == "masksembles":
            logits = mt.predict(self.model, inputs, self.spec.samples, batch_size=PREDICT_BATCH)
        elif self.spec.method == "dropout":
            logits = self.mc_dropout(inputs)
        else:
            with torch.no_grad():
                logits = self.model(inputs)[None]
        return logits.numpy().astype(np.float64)

    def mc_dropout(self, inputs: torch.Tensor) -> torch.Tensor:
        """``spec.samples`` forward passes with dropout on (the rest in eval mode): (B, ...) -> (samples, B, K)."""
        dropouts = [m for m in self.model.modules() if isinstance(m, nn.Dropout | nn.Dropout2d)]
        for module in dropouts:
            module.train()
        try:
            with torch.random.fork_rng(), torch.no_grad():
                torch.manual_seed(self.seed)
                return torch.stack([self.model(inputs) for _ in range(self.spec.samples)])
        finally:
            for module in dropouts:
                module.eval()


def train(
    spec: ModelSpec,
    x: NDArray[np.float32],
    y: NDArray[np.int64] | NDArray[np.float32],
    config: TrainConfig,
    *,
    seed: int,
    desc: str,
) -> TorchModel:
    """Build ``spec`` from ``seed`` and train it with Adam on shuffled mini-batches of (x, y).

    Classifiers minimize the cross-entropy, regressors the Gaussian NLL of ``mt.gaussian_nll_loss``.
    """
    torch.manual_seed(seed)
    model = build(spec)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    inputs, targets = torch.from_numpy(x), torch.from_numpy(y)
    shuffle = torch.Generator().manual_seed(seed)
    criterion = F.cross_entropy if spec.task == "classification" else mt.gaussian_nll_loss
    model.train()
    start = time.perf_counter()
    for _ in tqdm(range(config.epochs), desc=desc, leave=False, disable=None, unit="epoch"):
        for batch in torch.randperm(len(inputs), generator=shuffle).split(config.batch_size):
            loss = criterion(model(inputs[batch]), targets[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    seconds = time.perf_counter() - start
    parameters = sum(p.numel() for p in model.parameters())
    return TorchModel(model, spec, seed, parameters, seconds)
