"""A fake clock for ``pack(program="auto")``'s timing in the Keras and Flax adapters: it moves only while a timed call
runs, by that call's batch size, so that building takes no time and no time is left for timing rounds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class BatchClock:
    """Patch an adapter's ``clock`` with this and its ``_timed`` with ``self.timed``; ``sizes`` lists the batch size
    of every timed call, in order."""

    def __init__(self, real_timed: Callable[[Any, Any], Callable[[], object]], batch_size: Callable[[Any], int]):
        self.now = 0.0
        self.sizes: list[int] = []
        self._real_timed, self._batch_size = real_timed, batch_size

    def __call__(self) -> float:
        return self.now

    def timed(self, program: Any, x: Any) -> Callable[[], object]:
        run = self._real_timed(program, x)

        def counted() -> object:
            self.sizes.append(self._batch_size(x))
            self.now += self.sizes[-1]
            return run()

        return counted
