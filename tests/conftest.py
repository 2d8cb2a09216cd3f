"""One JAX compilation cache folder per pytest-xdist worker.

The JAX sessions of noxfile.py set ``JAX_COMPILATION_CACHE_DIR`` to a folder emptied at the start of the run; JAX
writes each entry in place, so two workers sharing the folder could read each other's entries half-written. Each
worker (``PYTEST_XDIST_WORKER``, e.g. ``gw0``) uses a subfolder of its own, set here before any test imports jax.
"""

from __future__ import annotations

import os
import sys

_cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _cache and _worker:
    if "jax" in sys.modules:  # the environment variable would come too late
        raise RuntimeError("jax was imported before tests/conftest.py could give this worker its own cache folder")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.path.abspath(_cache), _worker)
