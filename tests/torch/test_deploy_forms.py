"""The packed program's ONNX forms (what its operations run as under ``torch.compiler.is_exporting()``): the members'
Linear layers as one 2-D matmul per member on its block (``MemberLinear.exported``, ``MemberMLP`` per member, a
folded attention's split qkv), a channel gather before the last axis as ``index_select`` (ONNX ``Gather`` on that
axis, not ``GatherElements`` on the axis moved last), every result a fresh tensor. Each model below holds the forms
named in its case; exported with a dynamic batch and run in onnxruntime at two batch sizes (one of them 1), the
packed program equals ``predict`` and its uncertainty head ``uncertainty_head`` in float32 rounding, and the graph
holds none of the operations onnxruntime runs slowly there: no scatter (a write into a block of a buffer), no
matmul over a stack of weights, no ``GatherElements`` for a gather on the channel axis of a convolution's output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

import masksembles_torch as mt
from masksembles_torch import _packed_ops as ops
from tests.torch.heads import N, assert_head_matches, assert_members_match

SIZES = (5, 1)
SCATTERS = {"ScatterND", "ScatterElements"}


def member_mlp() -> nn.Module:
    """Two members' Linear layers joined by a GELU (a ``MemberMLP``), between two Masksembles layers."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), mt.Masksembles1D(16, N, 2.0, seed=0),
        nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16), nn.ReLU(), mt.Masksembles1D(16, N, 2.0, seed=1),
        nn.Linear(16, 3),
    ).eval()  # fmt: skip


def conv_gather() -> nn.Module:
    """Members' convolutions whose outputs a second Masksembles layer gathers on the channel axis."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), mt.Masksembles2D(8, N, 2.0, seed=0),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), mt.Masksembles2D(8, N, 2.0, seed=1),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    ).eval()  # fmt: skip


class Attention(nn.Module):
    """A fused qkv Linear split into heads, SDPA, an output projection (the members fold into the heads)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class TinyViT(nn.Module):
    """One pre-norm transformer block on 4 patch tokens of a 3x8x8 image, masks placed by ``insert``."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(dim), Attention(dim, heads), nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = x + self.attn(self.norm1(x))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.head(self.norm(x).mean(1))


def tiny_vit() -> nn.Module:
    torch.manual_seed(0)
    return mt.insert(TinyViT(), N, 2.0, seed=0).eval()


# case -> (the Masksembles model, an input of a batch size, what the packed program must hold, the ONNX operations
# its graph must not hold)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Tensor], Callable[[nn.Module], bool], set[str]]] = {
    "member MLP": (
        member_mlp,
        lambda batch: torch.randn(batch, 6),
        lambda packed: any(isinstance(m, ops.MemberMLP) for m in packed.modules()),
        SCATTERS,
    ),
    "channel gather": (
        conv_gather,
        lambda batch: torch.randn(batch, 3, 6, 6),
        lambda packed: any("gather_channels" in m.code for m in packed.modules() if isinstance(m, fx.GraphModule)),
        SCATTERS | {"GatherElements"},
    ),
    "split heads": (
        tiny_vit,
        lambda batch: torch.randn(batch, 3, 8, 8),
        lambda packed: any(isinstance(m, ops.MemberLinear) and m.split_heads for m in packed.modules()),
        SCATTERS,
    ),
}


@pytest.mark.parametrize("head", [False, True], ids=["packed", "packed + head"])
@pytest.mark.parametrize("case", list(CASES))
def test_packed_forms_in_onnxruntime(case: str, head: bool, tmp_path: Path) -> None:
    import onnx  # the torch nox session installs both (dependency group test-torch)
    import onnxruntime

    build, example, holds, slow = CASES[case]
    model = build()
    packed = mt.pack(model, example(8), program="packed")
    assert holds(packed), packed
    module: nn.Module = mt.with_uncertainty(packed) if head else packed
    names = list(module.outputs) if isinstance(module, mt.UncertaintyHead) else None
    path = str(tmp_path / "model.onnx")
    batch = torch.export.Dim("batch", min=1, max=1024)
    torch.onnx.export(module, (example(8),), path, dynamo=True, dynamic_shapes=({0: batch},), output_names=names)
    graph = onnx.load(path).graph
    assert not slow & {node.op_type for node in graph.node}
    weights = {initializer.name: len(initializer.dims) for initializer in graph.initializer}
    assert all(weights.get(node.input[1], 2) <= 2 for node in graph.node if node.op_type == "MatMul")
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    for size in SIZES:
        x = example(size)
        results = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        if names:
            assert_head_matches(dict(zip(names, results, strict=True)), model, x, {})
        else:
            assert_members_match(results[0], model, x)
