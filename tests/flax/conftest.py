"""The Flax tests import jax at module level, so they are only collected when the flax backend is requested.

Direct runs get the 4 virtual CPU devices of the sharding tests by default (the nox session sets the same flag).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

from tests.backends import requested_backends

if "flax" in requested_backends():
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    collect_ignore_glob: list[str] = []
else:
    collect_ignore_glob = ["test_*.py"]


if "flax" in requested_backends():
    import pytest

    @pytest.fixture(autouse=True)
    def _pack_needs_no_safety_net(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        """Every program pack/extract_member builds in these tests equals predict as built: verification (the safety
        net that replaces a program that differs) must find nothing, except in tests marked
        ``verification_fallback``."""
        from masksembles_flax import _packing

        found: list[str] = []
        check = _packing._Verifier.mismatch

        def recorded(self: _packing._Verifier, packed: _packing.PackedMasksembles) -> str | None:
            why = check(self, packed)
            if why is not None:
                found.append(why)
            return why

        monkeypatch.setattr(_packing._Verifier, "mismatch", recorded)
        yield
        if request.node.get_closest_marker("verification_fallback") is None:
            assert not found, f"pack built a program that differs from predict: {found}"
