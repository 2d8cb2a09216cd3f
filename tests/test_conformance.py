"""Every adapter reproduces the NumPy reference bit for bit: masks, outputs, input gradients."""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends import requested_backends
from tests.conformance import (
    ADAPTER_BACKENDS,
    ADAPTER_MODULES,
    Case,
    assert_bit_identical,
    cases,
    golden,
    load_adapter,
    mask_cases,
)

# Only the adapters of requested backends are parametrized; tests/test_backends_installed.py
# fails when a requested backend is missing.
ADAPTER_IDS = [a for a in ADAPTER_MODULES if ADAPTER_BACKENDS[a] in requested_backends()]
CASES = cases()
MASK_CASES = mask_cases()


@pytest.fixture(params=ADAPTER_IDS)
def adapter_id(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("mask_case", MASK_CASES, ids=lambda c: "masks-{}-{}-{}-seed{}".format(*c))
def test_masks_from_seed(adapter_id: str, mask_case: tuple[int, int, float, int]) -> None:
    channels, n, scale, seed = mask_case
    masks = load_adapter(adapter_id).masks_from_seed(channels, n, scale, seed)
    expected = golden()[f"masks/{channels}-{n}-{scale}-{seed}"]
    assert masks.dtype == np.bool_
    assert np.array_equal(masks, expected)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_input_gradient(adapter_id: str, case: Case) -> None:
    adapter = load_adapter(adapter_id)
    if case.dtype not in adapter.dtypes:
        pytest.skip(f"{adapter_id} has no {case.dtype}")
    data = golden()
    y, grad_input = adapter.forward_backward(
        data["layer_masks"], data[f"{case.name}/x"], data[f"{case.name}/grad_output"], case.channel_axis, case.dtype
    )
    assert_bit_identical(y, data[f"{case.name}/y"])
    assert_bit_identical(grad_input, data[f"{case.name}/grad_input"])
