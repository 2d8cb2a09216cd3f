"""Flax (linen) path of the demo: builds, trains and runs the models that ``_demo_common.ModelSpec`` describes.

The Adam step and the inference call are jitted once per architecture (the masks are an argument, not a constant);
the step is compiled before the training time starts, so the reported time is training only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _demo_common import ModelSpec, TrainConfig
from numpy.typing import NDArray
from tqdm.auto import tqdm

import masksembles_flax
from masksembles_flax import linen as masksembles_linen

Variables = dict[str, Any]


class Network(nn.Module):
    """The network of ``spec`` (see ``ModelSpec``); images come in (B, C, H, W) and run channels-last."""

    spec: ModelSpec

    def regularize(self, h: jax.Array, block: int, *, train: bool) -> jax.Array:
        """What follows hidden block ``block``: Masksembles with its masks, channel dropout, or nothing."""
        spec = self.spec
        if spec.method == "masksembles":
            return masksembles_linen.Masksembles(n=spec.samples, scale=spec.scale, masks=spec.masks[block])(h)
        if spec.method == "dropout":
            spatial = (1, 2) if h.ndim == 4 else ()  # one draw per channel of an image, like nn.Dropout2d
            return nn.Dropout(spec.rate, broadcast_dims=spatial, deterministic=not train)(h)
        return h

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        spec, widths = self.spec, self.spec.widths
        if spec.arch == "mlp":
            h = self.regularize(nn.relu(nn.Dense(widths[0])(x)), 0, train=train)
            h = self.regularize(nn.relu(nn.Dense(widths[1])(h)), 1, train=train)
            return nn.Dense(spec.outputs)(h)
        h = jnp.transpose(x, (0, 2, 3, 1))
        h = nn.max_pool(nn.relu(nn.Conv(widths[0], (3, 3), padding="SAME")(h)), (2, 2), strides=(2, 2))
        h = self.regularize(h, 0, train=train)
        h = self.regularize(nn.relu(nn.Conv(widths[1], (3, 3), padding="SAME")(h)), 1, train=train)
        h = self.regularize(nn.relu(nn.Dense(widths[2])(h.reshape(h.shape[0], -1))), 2, train=train)
        return nn.Dense(spec.outputs)(h)


@dataclass
class FlaxModel:
    """A trained linen model (parameters and masks) and how to get its members' predictions."""

    network: Network
    variables: Variables
    seed: int
    parameters: int
    seconds: float

    def predict(self, x: NDArray[np.float32]) -> NDArray[np.float64]:
        """Member outputs (logits, or mean and log-variance), (B, ...) -> (members, B, K)."""
        spec, inputs = self.network.spec, jnp.asarray(x)
        apply = inference_call(self.network)
        if spec.method == "dropout":
            keys = jax.random.split(jax.random.key(self.seed), spec.samples)
            logits = jnp.stack([apply(self.variables, inputs, key) for key in keys])
        elif spec.method == "masksembles":
            logits = masksembles_flax.predict(lambda xb: apply(self.variables, xb, None), inputs, spec.samples)
        else:
            logits = apply(self.variables, inputs, None)[None]
        return np.asarray(logits, dtype=np.float64)


Apply = Callable[[Variables, jax.Array, jax.Array | None], jax.Array]
APPLIES: dict[tuple[Any, ...], Apply] = {}


def architecture(spec: ModelSpec) -> tuple[Any, ...]:
    """What fixes a network's program: everything in ``spec`` but its masks (which come in with the variables)."""
    return (spec.arch, spec.in_shape, spec.outputs, spec.widths, spec.task, spec.method, spec.rate, spec.samples)


def inference_call(network: Network) -> Apply:
    """``network.apply`` jitted once per architecture: ``apply(variables, x, key)`` draws dropout from ``key`` (a
    training-mode pass, MC-Dropout's sample), or runs in inference mode where ``key`` is None."""
    key = architecture(network.spec)
    if key not in APPLIES:

        @jax.jit
        def apply(variables: Variables, x: jax.Array, dropout_key: jax.Array | None) -> jax.Array:
            if dropout_key is None:
                return network.apply(variables, x, train=False)
            return network.apply(variables, x, train=True, rngs={"dropout": dropout_key})

        APPLIES[key] = apply
    return APPLIES[key]


Step = Callable[[Any, Any, Variables, jax.Array, jax.Array, jax.Array], tuple[Any, Any]]
STEPS: dict[tuple[Any, ...], tuple[Step, optax.GradientTransformation]] = {}


def training_step(network: Network, learning_rate: float) -> tuple[Step, optax.GradientTransformation]:
    """A jitted Adam step, compiled once per architecture: the masks come in with the fixed variables."""
    spec = network.spec
    key = (*architecture(spec), learning_rate)
    if key not in STEPS:
        optimizer = optax.adam(learning_rate)

        @jax.jit
        def step(
            params: Any, state: Any, fixed: Variables, xb: jax.Array, yb: jax.Array, rng: jax.Array
        ) -> tuple[Any, Any]:
            def loss(p: Any) -> jax.Array:
                outputs = network.apply({"params": p, **fixed}, xb, train=True, rngs={"dropout": rng})
                if spec.task == "regression":
                    return masksembles_flax.gaussian_nll_loss(outputs, yb).mean()
                return optax.softmax_cross_entropy_with_integer_labels(outputs, yb).mean()

            updates, state = optimizer.update(jax.grad(loss)(params), state, params)
            return optax.apply_updates(params, updates), state

        STEPS[key] = (step, optimizer)
    return STEPS[key]


def train(
    spec: ModelSpec,
    x: NDArray[np.float32],
    y: NDArray[np.int64] | NDArray[np.float32],
    config: TrainConfig,
    *,
    seed: int,
    desc: str,
) -> FlaxModel:
    """Build ``spec`` from ``seed`` and train it with Adam (optax) on shuffled mini-batches of (x, y).

    Classifiers minimize the cross-entropy, regressors the Gaussian NLL of ``masksembles_flax.gaussian_nll_loss``.
    """
    network = Network(spec)
    init_key, dropout_key = jax.random.split(jax.random.key(seed))
    variables = network.init(init_key, jnp.asarray(x[:1]), train=False)
    fixed = {name: value for name, value in variables.items() if name != "params"}  # the masks collection
    step, optimizer = training_step(network, config.learning_rate)
    params, state = variables["params"], optimizer.init(variables["params"])
    for size in {min(config.batch_size, len(x)), len(x) % config.batch_size} - {0}:  # compile outside the timing
        jax.block_until_ready(step(params, state, fixed, jnp.asarray(x[:size]), jnp.asarray(y[:size]), dropout_key))
    shuffle = np.random.default_rng(seed)
    start = time.perf_counter()
    for epoch in tqdm(range(config.epochs), desc=desc, leave=False, disable=None, unit="epoch"):
        order = shuffle.permutation(len(x))
        for index, begin in enumerate(range(0, len(x), config.batch_size)):
            batch = order[begin : begin + config.batch_size]
            rng = jax.random.fold_in(dropout_key, epoch * len(x) + index)
            params, state = step(params, state, fixed, jnp.asarray(x[batch]), jnp.asarray(y[batch]), rng)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    parameters = sum(leaf.size for leaf in jax.tree.leaves(params))
    return FlaxModel(network, {"params": params, **fixed}, seed, parameters, seconds)
