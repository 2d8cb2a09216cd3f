"""The check every framework's pack tests share: programs are right as built, not saved by verification."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


def no_verification_fallback(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, verifier: Any
) -> Iterator[None]:
    """Record every difference ``verifier.mismatch`` (a pack module's ``_Verifier``) finds during a test, and fail the
    test if there was one, unless it is marked ``verification_fallback``: verification is the safety net that
    replaces a program that differs from predict, and no test model may need it."""
    found: list[str] = []
    check = verifier.mismatch

    def recorded(self: Any, packed: Any) -> str | None:
        why: str | None = check(self, packed)
        if why is not None:
            found.append(why)
        return why

    monkeypatch.setattr(verifier, "mismatch", recorded)
    yield
    if request.node.get_closest_marker("verification_fallback") is None:
        assert not found, f"pack built a program that differs from predict: {found}"
