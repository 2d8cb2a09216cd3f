"""pack/extract_member on the model zoo (faithful re-implementations of torchvision/timm blocks, tests/torch/zoo.py)
with masks placed by insert: equal to predict, member by member, on batches that do and do not divide by n."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import masksembles_torch as mt
from tests.torch import zoo

N = 4


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def middle_layer(model: nn.Module) -> str:
    """The path of the middle Conv/Linear layer: insertion from there on, as the paper's ImageNet recipe."""
    paths = [path for path, module in model.named_modules() if isinstance(module, (nn.Conv2d, nn.Linear))]
    return paths[len(paths) // 2]


@pytest.mark.parametrize("half", [False, True], ids=["everywhere", "second-half"])
@pytest.mark.parametrize("name", list(zoo.BUILDERS))
def test_inserted_zoo_model_packs_equal_to_predict(name: str, half: bool) -> None:
    model = zoo.build(name)
    masked = mt.insert(model, N, 2.0, seed=0, start=middle_layer(model) if half else None).eval()
    x = zoo.images(6)
    expected = mt.predict(masked, x, N)
    packed = mt.pack(masked, x[:2], program="packed")
    assert relative_error(packed(x), expected) <= 1e-5
    assert relative_error(packed(x[:3]), expected[:, :3]) <= 1e-5
    parameters = sum(p.numel() for p in model.parameters())
    for k in (0, N - 1):
        member = mt.extract_member(masked, k, x[:2])
        assert relative_error(member(x), expected[k]) <= 1e-5
        # one member's compacted layers (a class token expanded to the batch size does not need the others)
        assert sum(p.numel() for p in member.parameters()) < parameters


@pytest.mark.parametrize("name", ["vit", "vit_fused"])
def test_attention_is_folded_into_the_heads_between_member_blocks(name: str) -> None:
    """The members' qkv Linear writes each of q, k and v with the members' heads side by side (as a view of each
    member's matmul output, read by the region's reshape without a copy), the attention runs
    once on (B, 4*heads, L, d) and the projection reads its members' channels from the result: no move to or from
    the member-stacked batch around the attention, which no longer falls back."""
    masked = mt.insert(zoo.build(name), N, 2.0, seed=0).eval()
    x = zoo.images(5)
    packed = mt.pack(masked, x[:2], program="packed")
    assert "to_batch" not in packed.code and not any("attn" in name for name in packed.fallbacks)
    assert "output_split=3, split_heads=2" in repr(packed) and "reshape([-1, 17, 3, 8, 8])" in packed.code
    written: list[torch.Tensor] = []
    for module in packed.modules():
        if getattr(module, "split_heads", 0):
            module.register_forward_hook(lambda _, args, output: written.append(output))
    assert relative_error(packed(x), mt.predict(masked, x, N)) <= 1e-5
    # q, k and v are views of the members' matmul outputs: the reshape before the attention copies nothing
    assert written and all(y.reshape(-1, 17, 3, 8, 8)._base is y._base is not None for y in written)


def test_the_folded_qkv_view_exports_with_a_dynamic_batch() -> None:
    """The fused qkv's (B, L, 3, 4*heads, d) view of each member's matmul output keeps a dynamic batch exportable."""
    masked = mt.insert(zoo.build("vit_fused"), N, 2.0, seed=0).eval()
    x = zoo.images(5)
    packed = mt.pack(masked, x[:2], program="packed")
    assert "split_heads=2" in repr(packed)
    batch = torch.export.Dim("batch", min=2)
    exported = torch.export.export(packed, (x[:2],), dynamic_shapes=({0: batch},)).module()
    for samples in (3, 5):
        assert relative_error(exported(x[:samples]), mt.predict(masked, x[:samples], N)) <= 1e-5
