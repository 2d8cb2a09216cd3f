"""The Flax tests import jax at module level, so they are only collected when the flax backend is requested.

Direct runs get the 4 virtual CPU devices of the sharding tests by default (the nox session sets the same flag).
"""

from __future__ import annotations

import os
import sys

from tests.backends import requested_backends

if "flax" in requested_backends():
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    collect_ignore_glob: list[str] = []
else:
    collect_ignore_glob = ["test_*.py"]
