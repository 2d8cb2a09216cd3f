"""pack/extract_member refuse a model whose output changes from one call to the next on the same input (random per
call, as ``transformers``' ViTMAE without ``noise``), saying so and what to do, instead of returning the whole model
with figures that mean nothing; the same model with its randomness passed in as an input packs, equal to predict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import masksembles_torch as mt

N = 4
RANDOM = r"changed between two calls on the example input .*random per call.*Pass its randomness in"


class NoisyInEval(nn.Module):
    """Linear -> masks -> ReLU -> Linear, plus noise drawn in forward (in eval too) unless it is passed in."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 16)
        self.masks = mt.Masksembles1D(16, N, 2.0, seed=0)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        hidden = torch.relu(self.masks(self.inner(x)))
        return self.head(hidden + (torch.rand_like(hidden) if noise is None else noise))


@pytest.mark.parametrize("program", ["packed", "auto"])
def test_a_model_random_per_call_is_refused_with_what_to_do(program: str) -> None:
    torch.manual_seed(0)
    model, x = NoisyInEval().eval(), torch.randn(6, 8)
    with pytest.raises(ValueError, match=RANDOM):
        mt.pack(model, x, program=program)
    with pytest.raises(ValueError, match=RANDOM):
        mt.pack(model, (x,), program=program)  # the torch.export capture
    with pytest.raises(ValueError, match=RANDOM):
        mt.extract_member(model, 1, x)


def test_the_model_with_its_randomness_passed_in_packs_equal_to_predict() -> None:
    torch.manual_seed(0)
    model = NoisyInEval().eval()
    batch = {"x": torch.randn(6, 8), "noise": torch.rand(6, 16)}
    packed = mt.pack(model, batch, program="packed")
    assert packed.program == "packed"
    torch.testing.assert_close(packed(**batch), mt.predict(model, batch, N), rtol=1e-5, atol=1e-6)
