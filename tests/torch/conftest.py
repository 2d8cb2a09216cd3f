from __future__ import annotations

import pytest

from tests.backends import require_backend


@pytest.fixture(autouse=True)
def _torch_requested() -> None:
    require_backend("torch")
