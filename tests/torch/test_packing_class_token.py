"""pack on a class token expanded to the batch size (``cls.expand(x.shape[0], -1, -1)``, as ViTs write it): the
expand only repeats a tensor that does not follow the batch, so it and what reads it before the first Masksembles run
once on the batch, shared by every member, and the result equals predict at any batch; a tensor built from the batch
positions (``arange(x.shape[0])``) is not such a repeat and runs per member, still equal to predict. A concatenation of
two tensors is compacted like one of more."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import masksembles_torch as mt

N = 4


class ClassToken(nn.Module):
    """(B, L, 6) tokens -> Linear -> class token prepended (expanded to the batch) + positions -> LayerNorm -> Linear
    -> Masksembles -> Linear on the class token; ``by_position`` adds ``arange(B)`` to the class token instead."""

    def __init__(self, by_position: bool = False) -> None:
        super().__init__()
        self.by_position = by_position
        self.embed = nn.Linear(6, 8)
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.pos = nn.Parameter(torch.randn(1, 6, 8))
        self.norm = nn.LayerNorm(8)
        self.hidden = nn.Linear(8, 16)
        self.masks = mt.Masksembles(16, N, 2.0, seed=0, channel_axis=-1)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x)
        cls = self.cls.expand(x.shape[0], -1, -1)
        if self.by_position:
            cls = cls + torch.arange(x.shape[0], dtype=x.dtype)[:, None, None]
        tokens = torch.cat([cls, tokens], dim=1) + self.pos
        return self.head(self.masks(self.hidden(self.norm(tokens))))[:, 0]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("by_position", [False, True])
def test_a_class_token_expanded_to_the_batch_runs_once_on_it(by_position: bool) -> None:
    torch.manual_seed(0)
    model = ClassToken(by_position).eval()
    packed = mt.pack(model, torch.randn(8, 5, 6), program="packed")
    assert not [reason for reason in packed.fallbacks if reason.startswith("verification")]
    # the expand reads the batch size of the program's input, the packed batch: it is computed once, shared; the
    # class token plus arange(B) reads the batch positions, so it runs per member and repeats the shared tokens
    assert "x.size(0)" in packed.code
    assert ("tile" in packed.code) is by_position
    if not by_position:  # the expand (of no model value) is the one operation run as the model runs it, once
        assert [name.split(" ")[0] for name in packed.fallbacks] == ["expand"]
        assert "to_batch" not in packed.code and "to_channels" not in packed.code
    for batch in (8, 4, 5, 7, 1):  # N divides the batch or not
        x = torch.randn(batch, 5, 6)
        assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5


class TwoBranches(nn.Module):
    """Masksembles -> two Linear layers whose results are concatenated along the channels -> Masksembles -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.masks1 = nn.Linear(5, 12), mt.Masksembles(12, N, 2.0, seed=1)
        self.a, self.b = nn.Linear(12, 6), nn.Linear(12, 4)
        self.masks2, self.head = mt.Masksembles(10, N, 2.0, seed=2), nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.masks1(self.stem(x))
        return self.head(self.masks2(torch.cat([torch.relu(self.a(x)), self.b(x)], dim=1)))


def test_a_concatenation_of_two_member_tensors_is_compacted() -> None:
    torch.manual_seed(0)
    model = TwoBranches().eval()
    packed = mt.pack(model, torch.randn(8, 5), program="packed")
    assert packed.fallbacks == () and "to_batch" not in packed.code
    for batch in (8, 5):
        x = torch.randn(batch, 5)
        assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5
