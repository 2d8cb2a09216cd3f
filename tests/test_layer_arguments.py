"""One bad call, one message: every framework's Masksembles layer validates its arguments through the core's
``layer_arguments``, in one order, so the same mistake raises the same exception with the same message everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import masksembles_core.adapter as mca
from tests.backends import requested_backends, require_backend

CHANNELS = 8
ONES = np.ones((2, CHANNELS))
BAD_CALLS: dict[str, dict[str, Any]] = {
    "n-zero": {"n": 0, "scale": 2.0},
    "n-float": {"n": 4.0, "scale": 2.0},
    "n-missing": {"n": None, "scale": 2.0},
    "scale-below-one": {"n": 4, "scale": 0.5},
    "scale-string": {"n": 4, "scale": "2"},
    "scale-infinite": {"n": 4, "scale": float("inf")},
    "seed-negative": {"n": 4, "scale": 2.0, "seed": -1},
    "seed-float": {"n": 4, "scale": 2.0, "seed": 1.5},
    "masks-all-zero-row": {"n": 2, "scale": 2.0, "masks": np.stack([np.zeros(CHANNELS), np.ones(CHANNELS)])},
    "masks-not-binary": {"n": 2, "scale": 2.0, "masks": 2 * ONES},
    "masks-disagree-with-n": {"n": 3, "scale": 2.0, "masks": ONES},
    "channel-axis-batch": {"n": 4, "scale": 2.0, "channel_axis": 0},
    "channel-axis-float": {"n": 4, "scale": 2.0, "channel_axis": 1.0},
    "mode": {"n": 4, "scale": 2.0, "mode": "mixed"},
    "scale-before-mode": {"n": 4, "scale": 0.5, "mode": "mixed"},
    "seed-before-axis": {"n": 4, "scale": 2.0, "seed": -1, "channel_axis": 0},
}


def core(n: Any, scale: Any, **kwargs: Any) -> object:
    return mca.layer_arguments(CHANNELS, n, scale, channel_axis=kwargs.pop("channel_axis", -1), **kwargs)


def torch_layer(n: Any, scale: Any, **kwargs: Any) -> object:
    import masksembles_torch as mt

    return mt.Masksembles(CHANNELS, n, scale, **kwargs)


def keras_layer(n: Any, scale: Any, **kwargs: Any) -> object:
    import masksembles_keras as mk

    return mk.Masksembles(n, scale, **kwargs)


def linen_layer(n: Any, scale: Any, **kwargs: Any) -> object:
    from masksembles_flax.linen import Masksembles

    return Masksembles(n=n, scale=scale, **kwargs)


def nnx_layer(n: Any, scale: Any, **kwargs: Any) -> object:
    from masksembles_flax.nnx import Masksembles

    return Masksembles(CHANNELS, n, scale, **kwargs)


# adapter -> (the backend that must be requested, the layer's constructor)
ADAPTERS: dict[str, tuple[tuple[str, ...], Callable[..., object]]] = {
    "torch": (("torch",), torch_layer),
    "keras": (("keras-tensorflow", "keras-jax", "keras-torch"), keras_layer),
    "flax-linen": (("flax",), linen_layer),
    "flax-nnx": (("flax",), nnx_layer),
}


def raised(make: Callable[..., object], arguments: dict[str, Any]) -> tuple[type[BaseException], str]:
    with pytest.raises((TypeError, ValueError)) as error:
        make(**arguments)
    return error.type, str(error.value)


@pytest.mark.parametrize("call", list(BAD_CALLS))
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_every_layer_says_what_the_core_says(adapter: str, call: str) -> None:
    backends, make = ADAPTERS[adapter]
    if not any(backend in requested_backends() for backend in backends):
        require_backend(backends[0])
    assert raised(make, BAD_CALLS[call]) == raised(core, BAD_CALLS[call])


def test_the_core_message_names_the_first_bad_argument() -> None:
    assert raised(core, BAD_CALLS["scale-before-mode"]) == (
        ValueError,
        "scale must be a finite real number >= 1; received 0.5",
    )
    assert raised(core, BAD_CALLS["seed-before-axis"]) == (
        ValueError,
        "seed must be None, an integer >= 0 or a numpy.random.Generator; received -1",
    )
