"""Differential test of Keras pack/extract_member over generated models (``tests/keras/generated_models.py``): both
programs of ``pack`` and the first and last extracted members equal ``predict`` on a batch that n divides and on one
it does not, with nothing left to the verification fallback (the autouse fixture of tests/keras/conftest.py).

The default session runs ``DEFAULT_MODELS`` seeded models (every Keras session runs it once per backend, so it is
small), plus ``WHERE_MODELS``, seeds whose model uses ``keras.ops.where`` (a boolean intermediate, on which pack's
capture once failed on TensorFlow); ``pytest -m slow tests/keras/test_packing_generated.py`` runs ``SLOW_MODELS``
more.
"""

from __future__ import annotations

import numpy as np
import pytest

import masksembles_keras as mk
from tests.keras.common import BACKEND
from tests.keras.generated_models import OPERATIONS, N, generate
from tests.keras.test_packing import assert_close, call, members_first

# JAX compiles every pack, extraction and comparison (about 4 s each here): it checks fewer of the same models, whose
# capture and plan do not depend on the backend
DEFAULT_MODELS = 4 if BACKEND == "jax" else 10
SLOW_MODELS = 60
WHERE_MODELS = (29,)  # DepthwiseConv2D -> where(x > 0, x, 1.0) -> masks
EXAMPLE_BATCH = 6  # n=4 does not divide it
OTHER_BATCH = 8


def check(seed: int) -> None:
    model, description = generate(seed)
    rng = np.random.default_rng(seed)
    batches = [rng.standard_normal((batch, *model.inputs[0].shape[1:])).astype("float32")
               for batch in (EXAMPLE_BATCH, OTHER_BATCH)]  # fmt: skip
    expected = [mk.predict(model, x, N) for x in batches]
    for program in ("packed", "dense"):
        packed = mk.pack(model, batches[0], program=program)
        assert packed.program == program, description
        for x, wanted in zip(batches, expected, strict=True):
            assert_close(members_first(packed, x), wanted)
    for k in (0, N - 1):
        member = mk.extract_member(model, k, batches[0])
        for x, wanted in zip(batches, expected, strict=True):
            assert_close(call(member, x), wanted[k])


def test_the_grammar_has_the_operations_asked_for() -> None:
    names = {operation.name for operation in OPERATIONS}
    asked = {
        "Dense", "Conv2D", "Conv2D groups=2", "DepthwiseConv2D", "BatchNormalization", "LayerNormalization", "sigmoid",
        "softplus", "x + 1.0", "maximum(x, 0.1)", "exp", "where(x > 0, x, 1.0)", "hard_sigmoid", "relu", "gelu", "elu",
        "flip", "roll", "shuffle", "x[..., ::2]", "reversed halves", "x - max", "x / (norm + 1)", "softmax", "cumsum",
        "l2-normalize", "MaxPooling2D", "AveragePooling2D", "Flatten", "Reshape((-1,))", "reshape(x, (-1, F))",
        "GlobalAveragePooling2D",
    }  # fmt: skip
    assert asked <= names and len(names) >= 30


@pytest.mark.parametrize("seed", [*range(DEFAULT_MODELS), *WHERE_MODELS])
def test_generated_model_packs_equal_to_predict(seed: int) -> None:
    check(seed)


@pytest.mark.slow
@pytest.mark.parametrize(
    "seed", [seed for seed in range(DEFAULT_MODELS, DEFAULT_MODELS + SLOW_MODELS) if seed not in WHERE_MODELS]
)
def test_more_generated_models_pack_equal_to_predict(seed: int) -> None:
    check(seed)
