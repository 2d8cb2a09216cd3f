"""The per-sample shapes and shape predicates that the generated-model grammars share (``tests/<framework>/
generated_models.py``); framework-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """A per-sample shape: ``layout`` "image" (S, S, C), "tokens" (S, C) or "flat" (C,); channels last."""

    layout: str
    channels: int
    size: int = 1

    @property
    def features(self) -> int:
        return self.channels * (self.size**2 if self.layout == "image" else self.size)

    def batched(self, batch: int) -> tuple[int, ...]:
        if self.layout == "image":
            return (batch, self.size, self.size, self.channels)
        if self.layout == "tokens":
            return (batch, self.size, self.channels)
        return (batch, self.channels)


def always(_: Shape) -> bool:
    return True


def image(shape: Shape) -> bool:
    return shape.layout == "image"


def even(shape: Shape) -> bool:
    """An even number of channels."""
    return shape.channels % 2 == 0
