"""Differential test of pack/extract_member over generated models (``tests/torch/generated_models.py``): every
program of ``pack`` and every extracted member equal ``predict`` on a batch that n divides and on one it does not,
with nothing left to the verification fallback, and the packed program exports with a dynamic batch.

The default session runs ``DEFAULT_MODELS`` seeded models; ``pytest -m slow tests/torch/test_packing_generated.py``
runs ``SLOW_MODELS`` more, each with every member and an export.
"""

from __future__ import annotations

import pytest
import torch

import masksembles_torch as mt
from tests.torch.generated_models import OPERATIONS, N, generate

DEFAULT_MODELS = 200
SLOW_MODELS = 1000
EXPORT_EVERY = 8  # in the default session, the packed program of every 8th model is exported
AUTO_EVERY = 4  # and every 4th model is packed with program="auto" (it builds and times every program)


def assert_equal_to_predict(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 rounding, relative to the output's scale (exp and cumsum make large values)."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


def check(seed: int, *, every_member: bool, export: bool, auto: bool) -> None:
    model, shape = generate(seed)
    generator = torch.Generator().manual_seed(seed)
    example = torch.randn(shape.batched(6), generator=generator)  # 6 samples: n=4 does not divide it
    batches = (example, torch.randn(shape.batched(8), generator=generator))
    expected = [mt.predict(model, x, N) for x in batches]
    programs = ("packed", "dense", "auto") if auto else ("packed", "dense")
    for program in programs:
        packed = mt.pack(model, example, program=program)
        assert not [reason for reason in packed.fallbacks if reason.startswith("verification")], model.description
        for x, wanted in zip(batches, expected, strict=True):
            assert_equal_to_predict(packed(x), wanted)
    for k in range(N) if every_member else (seed % N,):
        member = mt.extract_member(model, k, example)
        assert not [reason for reason in member.fallbacks if reason.startswith("verification")], model.description
        for x, wanted in zip(batches, expected, strict=True):
            assert_equal_to_predict(member(x), wanted[k])
    if export:
        packed = mt.pack(model, example, program="packed")
        dynamic = ({0: torch.export.Dim("batch", min=2, max=64)},)
        exported = torch.export.export(packed, (example,), dynamic_shapes=dynamic).module()
        for x, wanted in zip(batches, expected, strict=True):
            assert_equal_to_predict(exported(x), wanted)


def test_the_grammar_has_the_operations_asked_for() -> None:
    names = {operation.name for operation in OPERATIONS}
    asked = {
        "hardtanh(0.1)", "sigmoid", "softplus", "x + 1", "clamp(min=0.1)", "exp", "where", "flip", "roll", "shuffle",
        "strided slice", "reversed chunks", "pixel_shuffle", "minus max", "over norm", "softmax", "cumsum",
        "F.normalize", "LayerNorm", "GroupNorm", "BatchNorm", "view(x.size(0), -1)", "view(-1, F)", "windows",
        "autograd.Function", "minus batch mean", "batch position",
    }  # fmt: skip
    assert asked <= names and len(names) >= 30


@pytest.mark.filterwarnings("ignore::masksembles_core.DuplicateMasksWarning")  # masks on as few as 4 channels
@pytest.mark.parametrize("seed", range(DEFAULT_MODELS))
def test_generated_model_packs_equal_to_predict(seed: int) -> None:
    check(seed, every_member=False, export=seed % EXPORT_EVERY == 0, auto=seed % AUTO_EVERY == 0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::masksembles_core.DuplicateMasksWarning")
@pytest.mark.parametrize("seed", range(DEFAULT_MODELS, DEFAULT_MODELS + SLOW_MODELS))
def test_more_generated_models_pack_equal_to_predict(seed: int) -> None:
    check(seed, every_member=True, export=True, auto=True)
