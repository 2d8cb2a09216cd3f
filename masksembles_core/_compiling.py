"""Running a model compiled where it compiles, eagerly where it does not: the adapters' ``predict``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def compiled_or_eager(compiled: Callable[[], T], eager: Callable[[], T], on_fallback: Callable[[], None]) -> T:
    """``compiled()``; where it raises (a model that cannot be traced: a data-dependent shape, a conversion of a traced
    value to NumPy) and ``eager()`` does not, ``on_fallback()`` (the caller remembers to run that model eagerly) and
    ``eager()``'s result. Where both raise, ``eager()``'s error, not chained to the compiled one: the refusal is the
    eager call's, as if nothing had been compiled."""
    try:
        return compiled()
    except Exception:  # any failure of the compiled call is answered by the eager call below
        pass
    result = eager()
    on_fallback()
    return result
