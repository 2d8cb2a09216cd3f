"""The Python blocks of a section of docs/torch.md, for the tests that run them."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "torch.md"


def guide_section(title: str) -> list[str]:
    """The Python blocks of one section (``## title``) of docs/torch.md."""
    text = GUIDE.read_text()
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
