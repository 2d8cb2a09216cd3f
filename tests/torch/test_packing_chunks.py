"""On CPU, pack/extract_member run a program proven to compute each sample from that sample alone on chunks of the
batch (large fresh buffers page-fault on every call), sized from the program's own tensors; a program that mixes
samples is never split."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import masksembles_torch as mt
from tests.torch import zoo
from tests.torch.test_packing_patterns import Block, masks, relative_error

N = 4
packing = importlib.import_module("masksembles_torch._pack_chunks")
LARGEST = N * 6 * 8 * 8 * 4  # TwoOutputs' largest packed tensor per sample: 4 members x 6 kept channels x 8 x 8 floats


class TwoOutputs(nn.Module):
    """A conv net returning a dict of logits (B, 5) and a tuple holding the features (B, 12, 6, 6)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.masks1 = nn.Conv2d(3, 12, 3, padding=1), masks(12, 1)
        self.body, self.masks2 = nn.Sequential(nn.BatchNorm2d(12), nn.GELU(), nn.Conv2d(12, 12, 3)), masks(12, 2)
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        features = self.masks2(self.body(self.masks1(self.stem(x))))
        return {"logits": self.head(features.mean((2, 3))), "more": (features,)}


def tiled(model: nn.Module, x: torch.Tensor) -> dict[str, object]:
    with torch.no_grad():
        out = model(mt.tile(x, N))
    return {"logits": mt.untile(out["logits"], N), "more": (mt.untile(out["more"][0], N),)}


def test_a_per_sample_program_runs_in_chunks_and_joins_every_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """The largest tensor the program makes, 4 members x 6 kept channels x 8 x 8 floats per sample (the single model's
    has 12 channels), is 10/3 CHUNK_BYTES at the example's batch of 10: 4 chunks of up to 3 samples (3, 3, 2, 2). Equal
    to the dense model at batches that do and do not divide, dict and tuple outputs joined on their batch axes; one call
    when exported with a dynamic batch; the extracted member too."""
    monkeypatch.setattr(packing, "CHUNK_BYTES", 3 * LARGEST)
    model = TwoOutputs().eval()
    packed = mt.pack(model, torch.randn(10, 3, 8, 8), program="packed")
    assert "in chunks of up to 3 samples" in repr(packed) and "in_chunks" in packed.code
    exported = torch.export.export(
        packed, (torch.randn(4, 3, 8, 8),), dynamic_shapes=({0: torch.export.Dim("batch", min=2)},)
    ).module()
    for batch in (1, 3, 7, 10, 11):
        x = torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(batch))
        expected = tiled(model, x)
        for result in (packed(x), exported(x)) if batch > 1 else (packed(x),):
            assert relative_error(result["logits"], expected["logits"]) <= 1e-5
            assert relative_error(result["more"][0], expected["more"][0]) <= 1e-5
    monkeypatch.setattr(packing, "CHUNK_BYTES", LARGEST // N)  # one member holds a quarter: a sample a chunk
    member = mt.extract_member(model, 2, torch.randn(10, 3, 8, 8))
    assert "in chunks of up to 1 samples" in repr(member)
    x = torch.randn(5, 3, 8, 8)
    assert relative_error(member(x)["logits"], tiled(model, x)["logits"][2]) <= 1e-5


def test_chunks_follow_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """One call when the largest tensor at the example's batch is at most CHUNK_BYTES; the default size leaves small
    models alone."""
    model = TwoOutputs().eval()
    assert "in_chunks" not in mt.pack(model, torch.randn(10, 3, 8, 8), program="packed").code
    monkeypatch.setattr(packing, "CHUNK_BYTES", 10 * LARGEST)
    assert "in_chunks" not in mt.pack(model, torch.randn(10, 3, 8, 8), program="packed").code
    monkeypatch.setattr(packing, "CHUNK_BYTES", 4 * LARGEST)
    assert "in chunks of up to 4 samples" in repr(mt.pack(model, torch.randn(10, 3, 8, 8), program="packed"))


# layers with constant weights that read the batch: a convolution along it, a GroupNorm over it (each item of axis 0)
BATCH_CONV, BATCH_NORM = nn.Conv1d(12, 12, 3, padding=1), nn.GroupNorm(3, 12)
LAYERS = {"convolution along the batch": BATCH_CONV, "group norm over the batch": BATCH_NORM}
MIXING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "convolution along the batch": lambda x: (  # (H*W, C, B): the positions as the convolution's batch
        BATCH_CONV(x.permute(2, 3, 1, 0).flatten(0, 1)).unflatten(0, x.shape[2:]).permute(3, 2, 0, 1)
    ),
    "group norm over the batch": lambda x: (  # (1, C, B*H*W): every sample in one item
        BATCH_NORM(x.transpose(0, 1).flatten(1)[None])[0].unflatten(1, (-1, *x.shape[2:])).transpose(0, 1)
    ),
    "mean over the batch": lambda x: x - x.mean(0, keepdim=True),
    "roll over the batch": lambda x: torch.roll(x, 1, 0),
    "flip of the batch": lambda x: x.flip(0) + x,
    "the sample index": lambda x: x + torch.arange(x.shape[0], dtype=x.dtype).view(-1, 1, 1, 1),
    "padded and cut batch": lambda x: F.pad(x, (0, 0, 0, 0, 0, 0, 1, 0))[:-1],
    "sum over the batch": lambda x: x * x.sum(),
    "softmax over the batch": lambda x: x.softmax(0),
    "reshape that moves the batch": lambda x: x.reshape(x.shape[1], x.shape[0], -1).transpose(0, 1).reshape(x.shape),
    "attention across the batch": lambda x: (
        F.scaled_dot_product_attention(*[x.flatten(2).transpose(0, 1)] * 3).transpose(0, 1).reshape(x.shape)
    ),
}


@pytest.mark.parametrize("name", list(MIXING))
def test_a_program_that_mixes_samples_is_not_split(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pattern makes a sample's result depend on other samples or on its position: one call on the whole batch,
    equal to the tiled dense model, however small CHUNK_BYTES is."""
    monkeypatch.setattr(packing, "CHUNK_BYTES", 1)
    torch.manual_seed(0)
    model = Block(MIXING[name], LAYERS.get(name)).eval()
    x = torch.randn(6, 3, 5, 5)
    packed = mt.pack(model, x, program="packed")
    assert "in_chunks" not in packed.code and "chunks" not in repr(packed)
    with torch.no_grad():
        expected = mt.untile(model(mt.tile(x, N)), N)
    assert relative_error(packed(x), expected) <= 1e-5


def test_auto_also_times_the_packed_program_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the packed program would run in chunks, ``program="auto"`` times it in chunks, in one call and tiled,
    and returns its choice, which equals the dense model."""
    monkeypatch.setattr(packing, "CHUNK_BYTES", 3 * LARGEST)
    model = TwoOutputs().eval()
    x = torch.randn(10, 3, 8, 8)
    packed = mt.pack(model, x)
    assert set(packed.seconds) == {"packed", "packed, one call", "dense"}
    chosen = packed.choice.split(" (")[0]  # the packed program unless another was over 10 % faster
    assert packed.program == ("dense" if chosen == "dense" else "packed")
    assert ("in_chunks" in packed.code) is (chosen == "packed")
    result, expected = packed(x), tiled(model, x)
    assert relative_error(result["logits"], expected["logits"]) <= 1e-5


@pytest.mark.parametrize("name", ["vit", "vit_fused", "vit_torch"])
def test_a_vit_whose_fallbacks_keep_samples_apart_runs_in_chunks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its fallbacks (the class token expanded to the batch, the concatenation along the tokens, the reshapes with the
    batch first that split the heads, unbind, scaled dot-product attention over the tokens, and torchvision's
    ``nn.MultiheadAttention`` written out as those) each keep samples apart, so the ViTs run in chunks and equal the
    dense model."""
    monkeypatch.setattr(packing, "CHUNK_BYTES", 1)
    masked = mt.insert(zoo.build(name), N, 2.0, seed=0).eval()
    x = zoo.images(5)
    packed = mt.pack(masked, x[:3], program="packed")
    assert packed.fallbacks and "in_chunks" in packed.code
    assert relative_error(packed(x), mt.predict(masked, x, N)) <= 1e-5


def test_a_multihead_attention_kept_as_one_call_runs_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nn.MultiheadAttention`` whose attention weights are read stays one call, not among the operations known to
    keep samples apart: the program runs in one call."""
    monkeypatch.setattr(packing, "CHUNK_BYTES", 1)
    torch.manual_seed(0)
    masked = mt.insert(zoo.Multihead("weights"), N, 2.0, seed=0).eval()
    x = torch.randn(5, zoo.SEQUENCE, 6)
    packed = mt.pack(masked, x[:3], program="packed")
    assert "attention (MultiheadAttention)" in packed.fallbacks and "in_chunks" not in packed.code
    assert relative_error(packed(x), mt.predict(masked, x, N)) <= 1e-5


def test_a_bert_with_a_padding_mask_from_its_token_ids_runs_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its fallbacks (the word embedding, ``tokens == 0``, ``[:, None, None, :]`` that makes it a (B, 1, 1, L) mask,
    the scaling, the sum with the positions) each keep samples apart, so it runs in chunks and equals the dense
    model, its padding mask included."""
    monkeypatch.setattr(packing, "CHUNK_BYTES", 1)
    torch.manual_seed(0)
    masked = mt.insert(zoo.Bert(), N, 2.0, seed=0).eval()
    packed = mt.pack(masked, zoo.tokens(3), program="packed")
    assert "in_chunks" in packed.code
    x = zoo.tokens(7, seed=7)
    assert relative_error(packed(x), mt.predict(masked, x, N)) <= 1e-5
