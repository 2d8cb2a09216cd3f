"""Differential test of pack/extract_member over generated NNX models (``tests/flax/generated_models.py``): every
program of ``pack`` and the first and last extracted member equal ``predict`` on a batch that n divides and on one it
does not (packed from the other), with nothing left to the verification fallback (``tests/pack_safety.py``).

JAX compiles every program, so the default session runs the twelve small models of ``DEFAULT_SEEDS``;
``pytest -m slow tests/flax/test_packing_generated.py`` runs the hundred of ``SLOW_SEEDS``, each with every member.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import masksembles_flax as mf
from masksembles_flax.nnx import extract_member, pack
from tests.flax.generated_models import OPERATIONS, N, generate
from tests.flax.test_packing import relative_error

# Twelve models: the first four seeds and eight that, with them, use every operation of the grammar (a greedy cover
# over seeds 0-299; ``test_the_default_models_use_every_operation`` keeps it one).
DEFAULT_SEEDS = (0, 1, 2, 3, 13, 14, 48, 130, 160, 177, 219, 225)
SLOW_SEEDS = tuple(seed for seed in range(107) if seed not in DEFAULT_SEEDS)  # a hundred
# seeds divisible by 6 (0 and 48 of the default ones) are also packed with program="auto" (it builds and times both)
AUTO_EVERY = 6


@nnx.jit
def outputs(model: nnx.Module, programs: list[nnx.Module], x: jax.Array) -> tuple[Any, list[Any]]:
    """One compilation for predict(model, x, N) and every program on x."""
    return mf.predict(model, x, N), [program(x) for program in programs]


def check(seed: int, *, members: tuple[int, ...], auto: bool) -> None:
    model, shape = generate(seed)
    rng = np.random.default_rng(seed)
    example, other = (jnp.asarray(rng.normal(size=shape.batched(b)), jnp.float32) for b in (6, 8))
    kinds = ("packed", "dense", "auto") if auto else ("packed", "dense")
    packed = [pack(model, example, program=kind) for kind in kinds]
    assert [p.program for p in packed[:2]] == ["packed", "dense"], model.description
    extracted = [extract_member(model, k, example) for k in members]
    for x in (example, other):  # 6 samples (n=4 does not divide it) and 8
        expected, actual = outputs(model, [*packed, *extracted], x)
        for program, got in zip(kinds, actual[: len(kinds)], strict=True):
            assert got.shape == expected.shape and relative_error(got, expected) <= 1e-5, (program, model.description)
        for k, got in zip(members, actual[len(kinds) :], strict=True):
            assert relative_error(got, expected[k]) <= 1e-5, (f"member {k}", model.description)


def test_the_grammar_has_the_operations_asked_for() -> None:
    names = {operation.name for operation in OPERATIONS}
    asked = {
        "clip(x, 0.1, 1)", "sigmoid", "softplus", "x + 1", "maximum(x, 0.1)", "exp", "where(x > 0, x, 1)", "flip",
        "roll", "shuffle", "strided slice", "reversed halves", "x - max", "x / (norm + 1)", "softmax", "cumsum",
        "l2 normalize", "LayerNorm", "GroupNorm", "BatchNorm", "reshape(B, -1)", "reshape(-1, F)", "custom_vjp",
        "conv or linear", "grouped conv", "depthwise conv", "relu", "gelu",
    }  # fmt: skip
    assert asked <= names and len(names) >= 30


@pytest.mark.filterwarnings("ignore::masksembles_core.DuplicateMasksWarning")
def test_the_default_models_use_every_operation() -> None:
    used = set().union(*(generate(seed)[0].operations for seed in DEFAULT_SEEDS))
    assert used == {operation.name for operation in OPERATIONS}


@pytest.mark.filterwarnings("ignore::masksembles_core.DuplicateMasksWarning")  # masks on as few as 4 channels
@pytest.mark.parametrize("seed", DEFAULT_SEEDS)
def test_generated_model_packs_equal_to_predict(seed: int) -> None:
    check(seed, members=(0, N - 1), auto=seed % AUTO_EVERY == 0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::masksembles_core.DuplicateMasksWarning")
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_more_generated_models_pack_equal_to_predict(seed: int) -> None:
    check(seed, members=tuple(range(N)), auto=True)
