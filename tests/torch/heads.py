"""Small Masksembles models for the uncertainty head's tests (one per kind of member output) and the comparison of a
head's dict with ``masksembles_core.heads.uncertainty_head`` on ``predict``'s members."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import masksembles_torch as mt
from masksembles_core import heads

N = 4
FEATURES = 6
EPS32 = float(torch.finfo(torch.float32).eps)
# The head sums n·K float32 terms of size at most log K (and the oracle reads predict's members, which a packed
# program reproduces only up to float32 rounding): a few dozen units of roundoff, times the values' scale.
ROUNDOFF_UNITS = 32


class GaussianOutput(nn.Module):
    """(B, 2) -> (B, 2): the mean, and channel 1 as a variance through a softplus (``head="variance"``)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack([x[:, 0], F.softplus(x[:, 1])], dim=-1)


# case -> (outputs, final module, with_uncertainty's arguments)
CASES: dict[str, tuple[int, nn.Module | None, dict[str, Any]]] = {
    "logits": (3, None, {}),
    "binary logit": (1, None, {}),
    "probabilities": (3, nn.Softmax(dim=-1), {"logits": False}),
    "point regression": (2, None, {"task": "regression"}),
    "gaussian log_variance": (2, None, {"task": "regression", "head": "log_variance"}),
    "gaussian variance": (2, GaussianOutput(), {"task": "regression", "head": "variance", "min_variance": 1e-3}),
}


def masksembles_model(case: str) -> nn.Module:
    """A Masksembles MLP (B, 6) -> (B, outputs) of ``CASES[case]``, in eval mode."""
    outputs, final, _ = CASES[case]
    torch.manual_seed(0)
    layers = [nn.Linear(FEATURES, 16), nn.ReLU(), mt.Masksembles1D(16, N, 2.0, seed=0), nn.Linear(16, 16), nn.ReLU()]
    layers += [mt.Masksembles1D(16, N, 2.0, seed=1), nn.Linear(16, outputs)]
    return nn.Sequential(*layers, *([final] if final is not None else [])).eval()


@functools.cache
def packed_model(case: str, program: str = "packed") -> mt.PackedMasksembles:
    return mt.pack(masksembles_model(case), torch.randn(8, FEATURES), program=program)


def assert_members_match(actual: Tensor | np.ndarray, model: nn.Module, x: Tensor) -> None:
    """``actual`` (n, B, ...) equals ``predict(model, x)`` in float32 rounding (``ROUNDOFF_UNITS`` units of scale)."""
    expected = mt.predict(model, x).numpy()
    values = actual.detach().numpy() if isinstance(actual, Tensor) else actual
    tolerance = ROUNDOFF_UNITS * EPS32
    np.testing.assert_allclose(values, expected, rtol=tolerance, atol=tolerance * max(1.0, np.abs(expected).max()))


def assert_head_matches(answer: Mapping[str, Any], model: nn.Module, x: Any, arguments: Mapping[str, Any]) -> None:
    """``answer`` (tensors or arrays by name) equals ``uncertainty_head`` on ``predict(model, x)`` (``x``: a tensor, a
    tuple or a dict) in float32 rounding: the same names in the same order, each within ``ROUNDOFF_UNITS`` units of
    the values' scale."""
    members = mt.predict(model, x).numpy()
    expected = heads.uncertainty_head(members, **arguments)
    assert list(answer) == list(expected)
    scale = 1.0 if arguments.get("task", "classification") == "classification" else max(1.0, np.abs(members).max())
    tolerance = ROUNDOFF_UNITS * EPS32
    for name, value in answer.items():
        actual = value.detach().numpy() if isinstance(value, Tensor) else np.asarray(value)
        assert actual.dtype == np.float32, name
        reference = expected[name]
        squared = name in ("variance", "aleatoric", "epistemic")  # a member's rounding times its deviation
        bound = tolerance * max(scale, float(np.abs(reference).max())) ** (2 if squared else 1)
        np.testing.assert_allclose(actual, reference, rtol=tolerance, atol=bound, err_msg=name)
