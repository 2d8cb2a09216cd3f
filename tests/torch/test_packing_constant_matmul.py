"""A matmul by a constant matrix compacted as the Linear it is: ``x @ w`` with ``w`` a (K, N) matrix that does not
depend on the input contracts ``x``'s last axis with ``w``'s rows, each row of ``x`` alone, as ``F.linear(x, w.T)``
does. ``transformers``' ``FalconLinear`` computes ``x @ self.weight.T + bias``, which torch.fx records as
``operator.matmul(x, weight.T)`` and torch.export as ``aten.matmul(x, aten.numpy_T(weight))``: before, every Falcon
projection (and the attention after it) ran at full width. A matmul of two model values, a constant on the left
(``w @ x`` mixes another axis) or a constant vector (it drops the last axis) is not a Linear and stays a fallback;
every program equals ``predict``."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import masksembles_torch as mt
from tests.backends import requested_backends
from tests.rounding import assert_rounding_close
from tests.torch.packing_checks import check_equal_to_predict, check_member_equal_to_predict, program_code

N, DIM, LENGTH = 4, 8, 5


class MatmulLinear(nn.Linear):
    """``transformers``' ``FalconLinear``: a Linear computed as ``x @ self.weight.T`` plus the bias."""

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class FalconMLP(nn.Module):
    """Falcon's MLP as its Linear layers compute it (no bias on the first, as Falcon's config has by default), on
    (B, L, DIM) tokens, a mask before each projection, mean-pooled to 3 outputs by a plain Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = MatmulLinear(DIM, 4 * DIM, bias=False), MatmulLinear(4 * DIM, DIM)
        self.masks = nn.ModuleList(
            mt.Masksembles(c, N, 2.0, channel_axis=-1, seed=i) for i, c in enumerate((DIM, 4 * DIM))
        )
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up(self.masks[0](x)).relu()
        return self.head(self.down(self.masks[1](h)).mean(1))


class Contracted(nn.Module):
    """A mask, then one of the matmuls below on (B, L, DIM) tokens, a mask and a Linear head on the mean token.

    ``"untransposed"``: ``x @ w`` with ``w`` a (DIM, DIM) parameter as it is (a Linear of weight ``w.T``);
    ``"tied"``: ``(x @ w.T) @ w``, one parameter read transposed and as it is (two Linear layers, transposes of each
    other); not Linear layers: ``"activations"``: ``x @ x.transpose(1, 2) @ x`` (two model values), ``"left"``:
    ``p @ x`` with ``p`` an (L, L) parameter (it mixes the tokens of each channel), ``"vector"``: ``x @ v`` with ``v``
    a (DIM,) parameter (one value per token, broadcast back over the channels)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.first, self.second = (mt.Masksembles(DIM, N, 2.0, channel_axis=-1, seed=s) for s in (0, 1))
        generator = torch.Generator().manual_seed(1)
        self.matrix = nn.Parameter(torch.randn(DIM, DIM, generator=generator) / DIM**0.5)
        self.tokens = nn.Parameter(torch.randn(LENGTH, LENGTH, generator=generator) / LENGTH**0.5)
        self.vector = nn.Parameter(torch.randn(DIM, generator=generator))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.first(x)
        if self.how == "untransposed":
            y = x @ self.matrix
        elif self.how == "tied":
            y = (x @ self.matrix.T).relu() @ self.matrix
        elif self.how == "activations":
            y = x @ x.transpose(1, 2) @ x / DIM
        elif self.how == "left":
            y = self.tokens @ x
        else:
            y = x * (x @ self.vector).unsqueeze(-1)
        return self.head(self.second(y).mean(1))


def tokens(batch: int, seed: int = 0) -> Tensor:
    return torch.randn(batch, LENGTH, DIM, generator=torch.Generator().manual_seed(seed))


def built(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return module.eval()


def matmul_fallbacks(packed: mt.PackedMasksembles) -> list[str]:
    return [row for row in packed.fallbacks if "matmul" in row]


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_falcon_linear_compacts_as_a_linear(capture: str) -> None:
    """Both FalconLinear layers (``x @ weight.T``, one with its bias added after it) compacted: nothing falls back,
    the packed program runs fewer multiply-adds than the dense models; equal to predict, a member too."""
    model = built(FalconMLP())
    x = tokens(4)
    packed = mt.pack(model, x if capture == "fx" else (x,), program="packed")
    assert packed.fallbacks == (), packed.fallbacks
    assert "matmul" not in program_code(packed)
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    check_equal_to_predict(model, packed, lambda batch: tokens(batch, seed=batch), N)
    if capture == "fx":
        check_member_equal_to_predict(model, tokens(5, seed=5), N)


@pytest.mark.parametrize("how", ["untransposed", "tied"])
def test_a_constant_matrix_on_the_right_compacts_however_it_is_laid_out(how: str) -> None:
    """``x @ w`` and ``(x @ w.T) @ w`` (one parameter read both ways): each matmul a Linear of its own weight."""
    model = built(Contracted(how))
    packed = mt.pack(model, tokens(4), program="packed")
    assert matmul_fallbacks(packed) == [] and packed.macs["fallback"] == 0, packed.fallbacks
    assert packed.macs["packed"] < packed.macs["dense"]
    check_equal_to_predict(model, packed, lambda batch: tokens(batch, seed=batch), N)


@pytest.mark.parametrize("how", ["activations", "left", "vector"])
def test_a_matmul_that_is_not_a_linear_falls_back(how: str) -> None:
    """Two model values, a constant on the left, a constant vector: the matmul runs as the dense model runs it,
    counted in ``macs["fallback"]`` (except the vector's: ``FlopCounterMode`` counts no matrix-vector product), and
    the program equals predict."""
    model = built(Contracted(how))
    packed = mt.pack(model, tokens(4), program="packed")
    assert matmul_fallbacks(packed), packed.fallbacks
    assert (packed.macs["fallback"] > 0) == (how != "vector")
    check_equal_to_predict(model, packed, lambda batch: tokens(batch, seed=batch), N)


@pytest.mark.skipif("transformers" not in requested_backends(), reason="backend 'transformers' not requested")
def test_the_real_falcon_packs_with_its_projections_compacted_and_attention_folded() -> None:
    """``transformers``' Falcon (multi-query attention, rotary positions, parallel attention and MLP) at a tiny size:
    before, 99 % of its multiply-adds fell back (every projection a matmul); now none, equal to predict at two batch
    sizes, padded samples among them."""
    import transformers

    config = transformers.FalconConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        parallel_attn=True, new_decoder_architecture=False, alibi=False, pad_token_id=0, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    single = transformers.FalconForSequenceClassification(config).eval()

    def batch_of(size: int, seed: int = 0) -> dict[str, object]:
        generator = torch.Generator().manual_seed(seed)
        mask = (torch.arange(LENGTH) < torch.randint(2, LENGTH + 1, (size, 1), generator=generator)).long()
        ids = torch.randint(1, 64, (size, LENGTH), generator=generator) * mask
        return {"input_ids": ids, "attention_mask": mask, "use_cache": False}

    model = mt.insert(single, N, 2.0, seed=0, example_input=batch_of(4)).eval()
    packed = mt.pack(model, batch_of(4), program="packed")
    assert not [row for row in packed.fallbacks if ".h." in row], packed.fallbacks
    assert packed.macs["fallback"] == 0 < packed.macs["packed"] < packed.macs["dense"]
    for size in (3, 6):
        batch = batch_of(size, seed=size)
        assert_rounding_close(packed(**batch).logits, mt.predict(model, batch).logits)
