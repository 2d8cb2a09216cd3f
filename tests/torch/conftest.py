from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.backends import require_backend


@pytest.fixture(autouse=True)
def _torch_requested() -> None:
    require_backend("torch")


@pytest.fixture(autouse=True)
def _pack_needs_no_safety_net(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every program pack/extract_member builds in these tests equals predict as built: verification (the safety net
    that replaces a program that differs) must find nothing, except in tests marked ``verification_fallback``."""
    from masksembles_torch import _packing

    found: list[str] = []
    check = _packing._Verifier.mismatch

    def recorded(self: _packing._Verifier, packed: torch.nn.Module) -> str | None:
        why = check(self, packed)
        if why is not None:
            found.append(why)
        return why

    monkeypatch.setattr(_packing._Verifier, "mismatch", recorded)
    yield
    if request.node.get_closest_marker("verification_fallback") is None:
        assert not found, f"pack built a program that differs from predict: {found}"
