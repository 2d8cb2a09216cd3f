"""The README's code blocks run as written, each on its own, in the session of the framework it imports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.backends import requested_backends, require_backend

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
FRAMEWORKS = {  # the import that marks a block -> the backends whose sessions run it
    "masksembles_torch": ("torch",),
    "masksembles_keras": ("keras-tensorflow", "keras-jax", "keras-torch"),
    "masksembles_flax": ("flax",),
}


def backends_of(block: str) -> tuple[str, ...]:
    for module, backends in FRAMEWORKS.items():
        if re.search(rf"^import {module}|^from {module}", block, flags=re.M):
            return backends
    return ("numpy",)


def test_the_readme_has_a_block_per_framework() -> None:
    assert {backends_of(block) for block in BLOCKS} == {*FRAMEWORKS.values(), ("numpy",)}


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"block{i}-{backends_of(BLOCKS[i])[0]}")
def test_readme_block_runs(index: int) -> None:
    block = BLOCKS[index]
    backends = backends_of(block)
    if not any(backend in requested_backends() for backend in backends):
        require_backend(backends[0])
    exec(compile(block, f"README.md block {index}", "exec"), {"__name__": f"readme_block_{index}"})
