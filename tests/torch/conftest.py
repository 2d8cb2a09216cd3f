from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.backends import require_backend
from tests.pack_safety import no_verification_fallback


@pytest.fixture(autouse=True)
def _torch_requested() -> None:
    require_backend("torch")


@pytest.fixture(autouse=True)
def _pack_needs_no_safety_net(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from masksembles_torch import _packing

    yield from no_verification_fallback(request, monkeypatch, _packing._Verifier)
