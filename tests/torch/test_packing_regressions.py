"""pack/extract_member on small models that once failed: each equals predict, in every program and for every member."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import masksembles_torch as mt

N = 4


def assert_packs_like_predict(model: nn.Module, x: torch.Tensor) -> None:
    """Every program of ``pack`` and every extracted member equal ``predict``, on the example and on a batch that n
    does not divide; nothing falls back for lack of verification."""
    model.eval()
    for batch in (x, x[:3]):
        expected = mt.predict(model, batch, N)
        for program in ("packed", "dense", "auto"):
            packed = mt.pack(model, x, program=program)
            assert not any(reason.startswith("verification") for reason in packed.fallbacks)
            torch.testing.assert_close(packed(batch), expected, rtol=1e-5, atol=1e-5)
        for k in range(N):
            torch.testing.assert_close(mt.extract_member(model, k, x)(batch), expected[k], rtol=1e-5, atol=1e-5)


class FlattenFirst(nn.Module):
    """``x.view(x.size(0), -1)`` at the top of ``forward``: the input is read by the flatten only."""

    def __init__(self, activation: bool) -> None:
        super().__init__()
        self.activation = activation
        self.masks, self.fc = mt.Masksembles(48, N, 2.0, seed=0), nn.Linear(48, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.size(0), -1)
        return self.fc(self.masks(x.relu() if self.activation else x))


@pytest.mark.parametrize("activation", [False, True], ids=["masks", "relu-masks"])
def test_flatten_of_the_input_by_view_of_its_batch_size(activation: bool) -> None:
    torch.manual_seed(0)
    assert_packs_like_predict(FlattenFirst(activation), torch.randn(8, 3, 4, 4))


class ViewAfterConvolution(nn.Module):
    """LeNet's ``x.view(-1, 400)`` after a masked convolution (the packed convolution runs channels-last)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.masks1 = nn.Conv2d(3, 16, 5), mt.Masksembles2D(16, N, 2.0, seed=0)
        self.masks2, self.fc = mt.Masksembles1D(400, N, 2.0, seed=1), nn.Linear(400, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.masks1(self.conv(x)).relu()
        return self.fc(self.masks2(x.view(-1, 400)))


def test_view_of_a_convolution_output() -> None:
    torch.manual_seed(0)
    assert_packs_like_predict(ViewAfterConvolution(), torch.randn(8, 3, 9, 9))


class FlattenAfterFallback(nn.Module):
    """``h.view(h.size(0), -1)`` of a tensor computed at full width before any masks (``cumsum`` falls back)."""

    def __init__(self) -> None:
        super().__init__()
        self.masks, self.fc = mt.Masksembles(48, N, 2.0, seed=0), nn.Linear(48, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.cumsum(1)
        return self.fc(self.masks(h.view(h.size(0), -1)))


def test_flatten_by_view_of_a_shared_tensor_computed_at_full_width() -> None:
    torch.manual_seed(0)
    assert_packs_like_predict(FlattenAfterFallback(), torch.randn(8, 3, 4, 4))


class WindowAttention(nn.Module):
    """Swin's pattern: roll, windows folded into the batch, masks on the windows' tokens before qkv and before the
    projection (they fall back: their batch axis holds B x windows), attention inside each window, and back."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.masks_in = nn.Linear(6, 16), mt.Masksembles(16, N, 2.0, seed=0, channel_axis=-1)
        self.masks_qkv, self.qkv = mt.Masksembles(16, N, 2.0, seed=1, channel_axis=-1), nn.Linear(16, 48)
        self.masks_proj, self.proj = mt.Masksembles(16, N, 2.0, seed=2, channel_axis=-1), nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        h = self.masks_in(self.embed(x))
        windows = torch.roll(h, 2, dims=1).view(-1, 4, 16)  # (B * length/4, 4, 16)
        q, k, v = self.qkv(self.masks_qkv(windows)).chunk(3, dim=-1)
        attended = (q @ k.transpose(-2, -1) * 0.25).softmax(-1) @ v
        y = torch.roll(self.proj(self.masks_proj(attended)).view(b, length, 16), -2, dims=1)
        return self.head(h + y).mean(1)


def test_window_attention_with_masks_on_the_windows() -> None:
    """extract_member(k) once ran those masks on member k's batch alone, which Masksembles groups into n members."""
    torch.manual_seed(0)
    assert_packs_like_predict(WindowAttention(), torch.randn(8, 8, 6))


class BatchPosition(nn.Module):
    """Each sample scaled by its place in the batch, ``arange(B) / B``, after the masks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.masks, self.fc2 = nn.Linear(6, 12), mt.Masksembles(12, N, 2.0, seed=0), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.masks(self.fc1(x))
        position = torch.arange(h.shape[0], dtype=h.dtype) / h.shape[0]
        return self.fc2(h * (1 + position.view(-1, 1)))


def test_a_model_that_reads_the_batch_size() -> None:
    torch.manual_seed(0)
    assert_packs_like_predict(BatchPosition(), torch.randn(8, 6))


class BatchMixing(nn.Module):
    """Operations along the batch after the masks: a mean over it, or a cumulative sum along it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc1 = nn.Linear(6, 12)
        self.masks = mt.Masksembles(12, N, 2.0, seed=0, channel_axis=-1)
        self.fc2 = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.masks(self.fc1(x))
        mixed = h - h.mean(0, keepdim=True) if self.how == "mean" else h.cumsum(0)
        return self.fc2(mixed)


@pytest.mark.parametrize("how", ["mean", "cumsum"])
def test_operations_along_the_batch(how: str) -> None:
    """extract_member(k) once ran them on member k's batch alone; in the dense model the batch holds every member."""
    torch.manual_seed(0)
    assert_packs_like_predict(BatchMixing(how), torch.randn(8, 6))


class ViewOfTheMemberStackedBatch(nn.Module):
    """A view onto the member-stacked batch after masked channels (``to_batch``, generated model 215) or after a
    masked Linear whose output the member-stacked batch reads in place (``batch_of_members``), returned as it is."""

    def __init__(self, after: str) -> None:
        super().__init__()
        self.after = after
        self.masks = mt.Masksembles(8, N, 2.0, seed=0, channel_axis=-1 if after == "linear" else 1)
        self.fc = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.after == "linear":  # (B, 5, 8) -> (B, 5, 6) -> (B, 30)
            return self.fc(self.masks(x)).reshape(-1, 30)
        return (self.masks(x) + 1).view(-1, 8 * 4 * 4)  # (B, 8, 4, 4) -> (B, 128)


@pytest.mark.parametrize("after", ["channels", "linear"])
def test_a_view_of_the_member_stacked_batch_exports_with_a_dynamic_batch(after: str) -> None:
    """Merging the batch into the member axis by a view gave strides ``min(S, S*B)``, and torch.export refused a
    dynamic batch ("Constraints violated (batch)! ... L['x'].size()[0]*min(48, 48*L['x'].size()[0])")."""
    torch.manual_seed(0)
    model = ViewOfTheMemberStackedBatch(after).eval()
    x = torch.randn(6, 5, 8) if after == "linear" else torch.randn(6, 8, 4, 4)
    assert_packs_like_predict(model, x)
    packed = mt.pack(model, x, program="packed")
    batch = torch.export.Dim("batch", min=2, max=64)
    exported = torch.export.export(packed, (x,), dynamic_shapes=({0: batch},)).module()
    for samples in (3, 9):
        other = torch.randn(samples, *x.shape[1:])
        torch.testing.assert_close(exported(other), mt.predict(model, other, N), rtol=1e-5, atol=1e-5)


class TokensAsRows(nn.Module):
    """Every sample's tokens as rows through two Linear layers that ``insert`` masks, folded tokens first, (L*B, C):
    the rows of a sample are not together, so those Masksembles layers run per member, at full width (OPT's
    sample-major (B*L, C) rows compact: ``test_packing_folded_rows.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        rows = self.embed(x).relu().transpose(0, 1).reshape(-1, 8)
        return self.fc2(self.fc1(rows).relu()).view(length, batch, 3).transpose(0, 1)


@pytest.mark.parametrize("capture", ["torch.fx", "torch.export"])
def test_macs_count_every_token_of_a_linear_layer_on_tokens_as_rows(capture: str) -> None:
    """``packed.macs`` per sample: the fallback Linear layers on (B*L, C) rows count L rows per sample (before, one),
    and a torch.export capture's ``F.linear`` fallback counts at all (before, nothing)."""
    torch.manual_seed(0)
    model = mt.insert(TokensAsRows(), N, 2.0, seed=0).eval()
    x, tokens = torch.randn(6, 5, 4), 5
    packed = mt.pack(model, x if capture == "torch.fx" else {"x": x}, program="packed")
    assert packed.macs["dense"] == N * tokens * (4 * 8 + 8 * 16 + 16 * 3)
    assert packed.macs["fallback"] == N * tokens * (8 * 16 + 16 * 3), "fc1 and fc2, per member at full width"
    torch.testing.assert_close(
        packed(x) if capture == "torch.fx" else packed(x=x), mt.predict(model, x), rtol=1e-5, atol=1e-6
    )


class CentredOnTheBatch(nn.Module):
    """``x - x.mean(0)`` between masks, and the masks after it keep none of member 0's channels (``masks3``'s first
    mask is the complement of ``masks2``'s): member 0 needs nothing of its own rows, but in predict's member-stacked
    batch the mean reads them for every other member (found by the generated models, seed 30288: ``pack`` fell back
    to the dense program on verification)."""

    def __init__(self) -> None:
        super().__init__()
        first = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 1, 0, 1, 1, 0, 1], [1, 1, 0, 1, 0, 0, 0, 1],
                              [1, 0, 0, 1, 0, 1, 0, 1]])  # fmt: skip
        second = torch.tensor([[0, 1, 0, 0, 1, 0, 1, 1], [1, 0, 1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 1, 1, 0, 1],
                               [0, 0, 1, 0, 1, 0, 1, 1]])  # fmt: skip
        self.masks1, self.masks2 = mt.Masksembles1D(masks=first), mt.Masksembles1D(masks=second)
        self.masks3 = mt.Masksembles1D(masks=torch.cat([1 - second[:1], torch.ones(3, 8, dtype=torch.long)]))
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.masks1(x)
        return self.fc(self.masks3(self.masks2(x - x.mean(0, keepdim=True))))


def test_a_batch_mean_reads_the_rows_of_a_member_that_needs_none_of_them() -> None:
    torch.manual_seed(0)
    assert_packs_like_predict(CentredOnTheBatch(), torch.randn(8, 8))
