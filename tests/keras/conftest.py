"""The Keras tests import keras at module level, so they are only collected when ``keras-<backend>`` is requested.

``KERAS_BACKEND`` (default ``tensorflow``, as in Keras) picks the backend for the whole process;
tests/test_backends_installed.py fails when it disagrees with the requested one.
"""

from __future__ import annotations

import os

from tests.backends import requested_backends

if f"keras-{os.environ.get('KERAS_BACKEND', 'tensorflow')}" in requested_backends():
    collect_ignore_glob: list[str] = []
else:
    collect_ignore_glob = ["test_*.py"]

if not collect_ignore_glob:
    from collections.abc import Iterator

    import pytest

    from tests.pack_safety import no_verification_fallback

    @pytest.fixture(autouse=True)
    def _pack_needs_no_safety_net(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        from masksembles_keras import _packing

        yield from no_verification_fallback(request, monkeypatch, _packing._Verifier)
