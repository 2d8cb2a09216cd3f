"""pack and extract_member on replicas of timm/torchvision blocks with ``insert`` defaults: equal to predict at
batches that do and do not divide by n, with no verification fallback."""

from __future__ import annotations

import pytest
import torch

import masksembles_torch as mt

from .replicas import REPLICAS, build, images

N = 4


def leaves(tree: object) -> list[torch.Tensor]:
    return list(tree) if isinstance(tree, tuple) else [tree]  # type: ignore[list-item]


def assert_close(actual: object, expected: object) -> None:
    for got, wanted in zip(leaves(actual), leaves(expected), strict=True):
        assert got.shape == wanted.shape
        assert ((got - wanted).norm() / wanted.norm().clamp_min(1e-12)).item() <= 1e-5


def predicted(model: torch.nn.Module, x: torch.Tensor) -> object:
    with torch.no_grad():
        out = model(mt.tile(x, N))
    return tuple(mt.untile(leaf, N) for leaf in out) if isinstance(out, tuple) else mt.untile(out, N)


@pytest.mark.parametrize("name", list(REPLICAS))
def test_replicas_pack_and_extract_exactly(name: str) -> None:
    model = mt.insert(build(name), N, 2.0, seed=0)
    assert model.masksembles_report.changed  # type: ignore[union-attr]
    for program in ("packed", "auto"):
        packed = mt.pack(model, images(6), program=program)
        assert not any(entry.startswith("verification") for entry in packed.fallbacks), packed.fallbacks[:1]
        for batch in (5, 8):
            x = images(batch, seed=batch)
            assert_close(packed(x), predicted(model, x))
    x = images(7, seed=1)
    expected = predicted(model, x)
    for k in range(N):
        member = mt.extract_member(model, k, images(3))
        assert not any(entry.startswith("verification") for entry in member.fallbacks), member.fallbacks[:1]
        assert_close(member(x), tuple(e[k] for e in expected) if isinstance(expected, tuple) else expected[k])


@pytest.mark.parametrize("name", ["swin", "levit", "deit_distilled"])
def test_packed_replicas_export_with_a_dynamic_batch(name: str) -> None:
    """The timm Swin and LeViT failed here ("Constraints violated (batch)!" from the packed program's views)."""
    model = mt.insert(build(name), N, 2.0, seed=0)
    packed = mt.pack(model, images(6), program="packed")
    batch = torch.export.Dim("batch", min=2, max=64)
    exported = torch.export.export(packed, (images(6),), dynamic_shapes=({0: batch},))
    x = images(9, seed=3)
    assert_close(exported.module()(x), predicted(model, x))
