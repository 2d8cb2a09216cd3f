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

    from tests.pack_safety import no_verification_fallback

    @pytest.fixture(autouse=True)
    def _pack_needs_no_safety_net(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        from masksembles_flax import _packing

        yield from no_verification_fallback(request, monkeypatch, _packing._Verifier)
