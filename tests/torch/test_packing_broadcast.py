"""pack/extract_member on a product with an operand broadcast along the channels: a padding mask from the token ids
(shared by every member) is read as it is by the members' compacted blocks; one computed from a masked value runs
at full width."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import masksembles_torch as mt

N = 4
VOCAB, WIDTH, CLASSES, LENGTH = 11, 16, 3, 7


class PaddedMean(nn.Module):
    """Token ids -> embedding -> Linear -> ReLU -> masks, multiplied by a (B, L, 1) mask, a Linear, a masked mean
    over the sequence, a Linear head. ``mask``: "padding" ((tokens != 0) as float) or "norm" (the masked hidden
    state's norm over the channels: a value per member)."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.masks = mt.Masksembles(WIDTH, N, 2.0, seed=0, channel_axis=-1)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.masks(torch.relu(self.fc(self.embed(tokens))))
        mask = (tokens != 0).float()[..., None] if self.mask == "padding" else hidden.norm(dim=-1, keepdim=True)
        hidden = self.proj(hidden * mask)
        return self.head(hidden.sum(1) / mask.sum(1).clamp_min(1.0))


def tokens(batch: int, seed: int) -> torch.Tensor:
    ids = torch.randint(1, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(seed))
    ids[:, LENGTH - 2 :] = 0  # padding at the end of every sequence
    ids[0, 2:] = 0
    return ids


def model_of(mask: str) -> PaddedMean:
    torch.manual_seed(0)
    return PaddedMean(mask).eval()


def fallback_nodes(packed: mt.PackedMasksembles) -> set[str]:
    """The graph nodes ``packed.fallbacks`` names ("sum (node 'sum_2')" -> "sum_2"; a module by its path)."""
    return {name.split("'")[1] if "'" in name else name.split()[0] for name in packed.fallbacks}


def expected_macs(read: int) -> dict[str, int]:
    """Multiply-adds per sample: fc once (before the masks, shared), proj reading ``read`` channels per member, the
    head every channel (the division is never known zero)."""
    fc, proj, head = LENGTH * WIDTH * WIDTH, LENGTH * WIDTH * read, WIDTH * CLASSES
    return {"dense": N * (2 * fc + head), "packed": fc + N * (proj + head), "fallback": 0}


def test_a_padding_mask_broadcast_along_the_channels_is_read_as_it_is_by_the_members_blocks() -> None:
    model = model_of("padding")
    x = tokens(5, 1)
    packed = mt.pack(model, x, program="packed")
    expected = mt.predict(model, x, N)
    torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-6)
    assert packed.program == "packed"
    assert fallback_nodes(packed) == {"embed", "ne", "float_1", "getitem", "sum_2", "clamp_min"}, (
        "the mask is computed once from the token ids; the product, the sum over the sequence and the division run "
        "on the members' blocks"
    )
    live = {int(row.sum()) for row in model.masks.masks}
    assert live == {9}
    assert packed.macs == expected_macs(9), "proj reads each member's 9 live channels"
    for k in range(N):
        torch.testing.assert_close(mt.extract_member(model, k, x)(x), expected[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", [1, 5])
def test_a_broadcast_operand_computed_per_member_runs_at_full_width(batch: int) -> None:
    model = model_of("norm")
    x = tokens(batch, 2)
    packed = mt.pack(model, x, program="packed")
    expected = mt.predict(model, x, N)
    torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-6)
    assert {"norm", "mul"} <= fallback_nodes(packed), packed.fallbacks
    assert packed.macs == expected_macs(WIDTH), "proj reads every channel of the member-stacked product"
    for k in range(N):
        torch.testing.assert_close(mt.extract_member(model, k, x)(x), expected[k], rtol=1e-5, atol=1e-6)
