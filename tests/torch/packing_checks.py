"""Checks the torch packing tests share: the code a packed model runs, and a packed model or one member against
``predict`` up to float32 rounding."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, fx, nn

import masksembles_torch as mt
from tests.rounding import assert_rounding_close


def program_code(packed: nn.Module) -> str:
    """The code of the program and of the graphs it calls (a torch.export capture's program is called by its entry)."""
    return "\n".join(module.code for module in packed.modules() if isinstance(module, fx.GraphModule))


def check_member_equal_to_predict(model: nn.Module, x: Tensor, n: int) -> None:
    """Member 1 alone (``extract_member``, built on the same capture and planner) equals its part of predict."""
    assert_rounding_close(mt.extract_member(model, 1, x[:2])(x), mt.predict(model, x, n)[1])


def check_equal_to_predict(model: nn.Module, packed: nn.Module, batch_of: Callable[[int], Tensor], n: int) -> None:
    """``packed`` equals ``predict(model, x, n)`` on ``x = batch_of(batch)`` for a batch of 3 and one of 8."""
    for batch in (3, 8):
        x = batch_of(batch)
        assert_rounding_close(packed(x), mt.predict(model, x, n))
