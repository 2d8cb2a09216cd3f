"""Flax NNX pack and extract_member equal the dense masked model on nnx.Sequential stacks (the layers of the first
Flax packer, and any others now), shrink the weights as planned, and refuse only what cannot be packed.

Module styles (a user's __call__, residual blocks, lists of blocks, Mixer, ViT) and single code patterns are in
test_packing_modules.py."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import masksembles_flax as mf
from masksembles_flax.nnx import Flatten, Masksembles, Residual, extract_member, pack

N = 4
ModelFactory = Callable[[float, int, nnx.Rngs], nnx.Sequential]


def relative_error(actual: jax.Array, expected: jax.Array) -> float:
    assert actual.shape == expected.shape
    return float(jnp.linalg.norm(actual - expected) / jnp.maximum(jnp.linalg.norm(expected), 1e-12))


# Weights, statistics and inputs are drawn by NumPy: on a small shared CPU, XLA compiling jax.random for every new
# shape costs seconds per model.
def numpy_init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Normal(0, 1/fan_in) values seeded by the key's bits."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    fan_in = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return jnp.asarray(rng.normal(size=shape) / np.sqrt(fan_in), dtype)


def linear(inputs: int, outputs: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(inputs, outputs, kernel_init=numpy_init, bias_init=numpy_init, rngs=rngs)


def conv(inputs: int, outputs: int, kernel: tuple[int, ...], rngs: nnx.Rngs, **options: Any) -> nnx.Conv:
    return nnx.Conv(inputs, outputs, kernel, kernel_init=numpy_init, bias_init=numpy_init, rngs=rngs, **options)


def random_input(shape: tuple[int, ...], seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def randomize_norms(model: nnx.Sequential, seed: int) -> nnx.Sequential:
    """Random running statistics, scale and bias in every BatchNorm, then eval mode."""
    rng = np.random.default_rng(seed)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            shape = module.mean.shape
            module.mean.set_value(jnp.asarray(rng.normal(size=shape), jnp.float32))
            module.var.set_value(jnp.asarray(rng.uniform(0.5, 1.5, size=shape), jnp.float32))
            for variable in (module.scale, module.bias):
                if variable is not None:
                    variable.set_value(jnp.asarray(rng.normal(size=shape), jnp.float32))
    model.eval()
    return model


def pool(fn: Callable[..., jax.Array], window: tuple[int, ...], **kwargs: Any) -> Callable[..., jax.Array]:
    return functools.partial(fn, window_shape=window, **kwargs)


def mlp(scale: float, seed: int, rngs: nnx.Rngs) -> nnx.Sequential:
    return nnx.Sequential(
        linear(12, 48, rngs), nnx.gelu, Masksembles(48, N, scale, seed=seed),
        linear(48, 40, rngs), jnp.tanh, nnx.Dropout(0.3, rngs=rngs), Masksembles(40, N, scale, seed=seed + 1),
        linear(40, 3, rngs),
    )  # fmt: skip


def cnn2d(scale: float, seed: int, rngs: nnx.Rngs) -> nnx.Sequential:
    return nnx.Sequential(
        conv(3, 16, (3, 3), rngs, padding="VALID"), nnx.BatchNorm(16, rngs=rngs), nnx.relu,
        Masksembles(16, N, scale, seed=seed), pool(nnx.max_pool, (2, 2), strides=(2, 2)),
        conv(16, 24, (3, 3), rngs, padding="CIRCULAR"), nnx.relu, Masksembles(24, N, scale, seed=seed + 1),
        nnx.BatchNorm(24, rngs=rngs), Flatten(), linear(24 * 3 * 3, 32, rngs), nnx.silu,
        Masksembles(32, N, scale, seed=seed + 2), linear(32, 4, rngs),
    )  # fmt: skip


def cnn1d(scale: float, seed: int, rngs: nnx.Rngs) -> nnx.Sequential:
    return nnx.Sequential(
        conv(2, 12, (3,), rngs, padding="VALID"), nnx.relu, Masksembles(12, N, scale, seed=seed),
        conv(12, 8, (1,), rngs), pool(nnx.avg_pool, (2,), strides=(2,)), nnx.sigmoid,
        Masksembles(8, N, scale, seed=seed + 1), Flatten(), linear(8 * 3, 2, rngs),
    )  # fmt: skip


def cnn3d(scale: float, seed: int, rngs: nnx.Rngs) -> nnx.Sequential:
    return nnx.Sequential(
        conv(1, 8, (2, 2, 2), rngs, padding="VALID"), nnx.BatchNorm(8, use_bias=False, rngs=rngs),
        Masksembles(8, N, scale, seed=seed), functools.partial(nnx.leaky_relu, negative_slope=0.2),
        conv(8, 6, (1, 1, 1), rngs, strides=2), pool(nnx.max_pool, (1, 1, 1)), Flatten(),
        linear(6, 2, rngs),
    )  # fmt: skip


def sequence_model(scale: float, seed: int, rngs: nnx.Rngs) -> nnx.Sequential:
    """A Linear on (B, T, F): channels on the last axis, T an extra batch-like axis."""
    return nnx.Sequential(linear(6, 32, rngs), nnx.relu, Masksembles(32, N, scale, seed=seed), linear(32, 5, rngs))


def resnet(scale: float, seed: int, rngs: nnx.Rngs, *, masked_input: bool = False) -> nnx.Sequential:
    """Residual blocks with Masksembles in the branch; ``masked_input`` also masks what the first skip carries."""

    def block(channels: int, block_seed: int) -> Residual:
        return Residual(
            conv(channels, channels, (3, 3), rngs, use_bias=False), nnx.BatchNorm(channels, rngs=rngs),
            nnx.relu, Masksembles(channels, N, scale, seed=block_seed), conv(channels, channels, (3, 3), rngs),
            nnx.BatchNorm(channels, rngs=rngs),
        )  # fmt: skip

    stem = nnx.Sequential(conv(3, 16, (3, 3), rngs), nnx.BatchNorm(16, rngs=rngs), nnx.relu)
    entry = [Masksembles(16, N, scale, seed=seed + 100)] if masked_input else []
    return nnx.Sequential(
        stem, *entry, block(16, seed), nnx.relu, block(16, seed + 1), nnx.relu, pool(nnx.avg_pool, (6, 6)), Flatten(),
        Masksembles(16, N, scale, seed=seed + 2), linear(16, 5, rngs),
    )  # fmt: skip


MODELS: dict[str, tuple[ModelFactory, tuple[int, ...]]] = {
    "mlp": (mlp, (12,)),
    "cnn2d": (cnn2d, (8, 8, 3)),
    "cnn1d": (cnn1d, (8, 2)),
    "cnn3d": (cnn3d, (3, 3, 3, 1)),
    "sequence": (sequence_model, (7, 6)),
    "resnet": (resnet, (6, 6, 3)),
    "resnet-masked-input": (functools.partial(resnet, masked_input=True), (6, 6, 3)),
}


def build(name: str, scale: float, seed: int) -> tuple[nnx.Sequential, tuple[int, ...]]:
    factory, shape = MODELS[name]
    return randomize_norms(factory(scale, seed, nnx.Rngs(seed)), seed), shape


@nnx.jit
def packed_and_dense(
    model: nnx.Module, packed: nnx.Module, members: Sequence[nnx.Module], x: jax.Array
) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """One compilation for pack(x), predict(model, x, N) and every extracted member on x."""
    return packed(x), mf.predict(model, x, N), [member(x) for member in members]


@pytest.mark.parametrize(
    "seed,scale", list(enumerate([1.0, 1.7, 3.0, 50.0])), ids=lambda v: f"S{v}" if isinstance(v, float) else f"seed{v}"
)
@pytest.mark.parametrize("name", list(MODELS))
def test_pack_and_extract_equal_the_dense_model(name: str, seed: int, scale: float) -> None:
    model, shape = build(name, scale, seed)
    x = random_input((5, *shape), seed + 10)
    members = [extract_member(model, k, jax.ShapeDtypeStruct(x.shape, x.dtype)) for k in range(N)]
    packed, expected, outputs = packed_and_dense(model, pack(model, x, program="packed"), members, x)
    assert packed.shape == (N, *expected.shape[1:]) == expected.shape
    assert relative_error(packed, expected) <= 1e-5
    dense_parameters = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    for k, (member, output) in enumerate(zip(members, outputs, strict=True)):
        assert relative_error(output, expected[k]) <= 1e-5
        assert sum(p.size for p in jax.tree.leaves(nnx.state(member, nnx.Param))) <= dense_parameters


LEAKY_RELU = functools.partial(nnx.leaky_relu, negative_slope=0.1)
Activation = Callable[[jax.Array], jax.Array]
ACTIVATION_CHOICES: list[Activation] = [nnx.relu, nnx.gelu, jnp.tanh, nnx.sigmoid, nnx.softplus, nnx.silu, LEAKY_RELU]


def random_model(seed: int) -> tuple[nnx.Sequential, tuple[int, ...]]:
    """A random CNN: conv blocks, residual blocks, masks and pools in random order, then a masked MLP head."""
    rng = np.random.default_rng(seed)
    rngs = nnx.Rngs(seed)
    scale = float(rng.choice([1.0, 1.5, 2.0, 4.0]))
    seeds = iter(range(100 * seed, 100 * seed + 100))

    def activation() -> Activation:
        return ACTIVATION_CHOICES[int(rng.integers(len(ACTIVATION_CHOICES)))]

    def masks(channels: int) -> Masksembles:
        return Masksembles(channels, N, scale, seed=next(seeds))

    spatial, channels = int(rng.integers(3, 7)), int(rng.integers(2, 5))
    shape = (spatial, spatial, channels)
    layers: list[Activation] = []
    for _ in range(int(rng.integers(2, 5))):
        choice = int(rng.integers(4))
        if choice == 0:
            out, stride = int(rng.integers(4, 13)), int(rng.integers(1, 3))
            after = [nnx.BatchNorm(out, rngs=rngs), activation(), masks(out)]  # after the conv, in random order
            layers += [conv(channels, out, (3, 3), rngs, strides=stride), *(after[i] for i in rng.permutation(3))]
            channels, spatial = out, -(-spatial // stride)
        elif choice == 1:
            branch: list[Callable[..., Any]] = [
                conv(channels, channels, (3, 3), rngs),
                nnx.BatchNorm(channels, rngs=rngs),
            ]
            branch.append(activation())
            layers.append(Residual(*branch, masks(channels), conv(channels, channels, (1, 1), rngs)))
        elif choice == 2:
            layers += [masks(channels), activation()]
        else:
            fn = [nnx.max_pool, nnx.avg_pool][int(rng.integers(2))]
            layers.append(pool(fn, (2, 2), strides=(2, 2), padding="SAME"))
            spatial = -(-spatial // 2)
    hidden = int(rng.integers(4, 17))
    features = spatial * spatial * channels
    head = [masks(features)] if rng.random() < 0.5 else []
    layers += [Flatten(), *head, linear(features, hidden, rngs), activation(), masks(hidden), linear(hidden, 3, rngs)]
    return randomize_norms(nnx.Sequential(*layers), seed), shape


@pytest.mark.filterwarnings("ignore::masksembles_core.DuplicateMasksWarning")  # random layers as narrow as 2 channels
@pytest.mark.parametrize("seed", range(8), ids=lambda seed: f"seed{seed}")
def test_randomly_built_models(seed: int) -> None:
    model, shape = random_model(seed)
    x = random_input((4, *shape), seed)
    members = [extract_member(model, k, x) for k in range(N)]
    packed, expected, outputs = packed_and_dense(model, pack(model, x, program="packed"), members, x)
    assert relative_error(packed, expected) <= 1e-5
    for k, output in enumerate(outputs):
        assert relative_error(output, expected[k]) <= 1e-5


def ones_per_layer(model: nnx.Sequential, k: int) -> list[int]:
    return [int(np.asarray(layer.masks[...])[k].sum()) for layer in model.layers if isinstance(layer, Masksembles)]


def kernels(module: nnx.Module, primitive: str) -> list[tuple[int, ...]]:
    """Shapes of a packed module's weights of one primitive, in program order (one per copy)."""
    return [
        tuple(copy.shape) for key in sorted(module.weights) if key.startswith(primitive) for copy in module.weights[key]
    ]


def test_extracted_member_is_physically_smaller() -> None:
    model, _ = build("mlp", 2.0, 0)
    member = extract_member(model, 1, jnp.zeros((2, 12)))
    ones = ones_per_layer(model, 1)
    assert kernels(member, "dot_general") == [(12, ones[0]), (ones[0], ones[1]), (ones[1], 3)]
    assert member.members == (1,) and member.fallbacks == ()


def test_packed_weights_are_member_blocks_after_a_shared_prefix() -> None:
    model, _ = build("mlp", 2.0, 0)
    packed = pack(model, jnp.zeros((2, 12)), program="packed")
    widths = [max(ones_per_layer(model, k)[i] for k in range(N)) for i in range(2)]
    assert kernels(packed, "dot_general") == [(12, 48), (N, widths[0], widths[1]), (N, widths[1], 3)], (
        "the first Linear runs once; the others as one batched matmul over the members' blocks"
    )


def test_packed_convolutions_run_one_per_member() -> None:
    model, shape = build("cnn2d", 2.0, 0)
    x = jnp.zeros((2, *shape))
    packed = pack(model, x, program="packed")
    widths = [max(ones_per_layer(model, k)[i] for k in range(N)) for i in range(2)]
    assert kernels(packed, "conv_general_dilated") == [(3, 3, 3, 16)] + [(3, 3, widths[0], widths[1])] * N
    convolutions = [e for e in jax.make_jaxpr(packed)(x).jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    assert [e.invars[1].aval.shape for e in convolutions] == [(3, 3, 3, 16)] + [(3, 3, widths[0], widths[1])] * N
    assert all(e.params["feature_group_count"] == 1 for e in convolutions), "not one grouped convolution"


@pytest.mark.parametrize("name", ["resnet", "cnn2d"])
def test_packed_call_eager_and_jitted_on_any_batch(name: str) -> None:
    model, shape = build(name, 2.0, 0)
    packed = pack(model, random_input((4, *shape), 0), program="packed")
    graphdef, state = nnx.split(packed)
    for batch in (1, 6):
        x = random_input((batch, *shape), batch)
        expected = mf.predict(model, x, N)
        assert relative_error(packed(x), expected) <= 1e-5, "eager"
        assert relative_error(nnx.jit(lambda module, v: module(v))(packed, x), expected) <= 1e-5, "nnx.jit"
        assert relative_error(jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))(state, x), expected) <= 1e-5, "jax.jit"


def test_pack_leaves_the_model_untouched() -> None:
    model, shape = build("cnn2d", 2.0, 0)
    model.train()
    before = jax.tree.map(np.asarray, nnx.state(model))
    pack(model, jnp.zeros((4, *shape)), program="packed")
    extract_member(model, 0, jnp.zeros((4, *shape)))
    norm = model.layers[1]
    assert isinstance(norm, nnx.BatchNorm) and norm.use_running_average is False, "the model stays in training mode"
    after = jax.tree.map(np.asarray, nnx.state(model))
    assert jax.tree.all(jax.tree.map(np.array_equal, before, after)), "no weight or BatchNorm statistic changes"


def test_flatten_and_residual() -> None:
    x = random_input((2, 3, 4, 5), 0)
    assert Flatten()(x).shape == (2, 60)
    assert np.array_equal(Flatten()(x)[:, 7], x[:, 0, 1, 2]), "row-major: channels last vary fastest"
    layer = linear(5, 5, nnx.Rngs(0))
    assert np.allclose(Residual(layer, nnx.relu)(x), x + nnx.relu(layer(x)))


class Gate(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return x * nnx.sigmoid(x)


class Noisy(nnx.Module):
    """Noise added in eval mode too: another draw from its RNG stream at every call."""

    def __init__(self) -> None:
        self.rngs = nnx.Rngs(noise=0)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jax.random.normal(self.rngs.noise(), x.shape)


def linear_masks(*tail: Callable[..., Any], n: int = N, channel_axis: int = -1) -> nnx.Sequential:
    return nnx.Sequential(linear(4, 8, nnx.Rngs(0)), Masksembles(8, n, 2.0, channel_axis=channel_axis), *tail)


# Layers the first Flax packer refused with "unsupported layer": they pack now (compacted or at full width).
FORMERLY_REFUSED = {
    "layernorm": linear_masks(nnx.LayerNorm(8, rngs=nnx.Rngs(0)), linear(8, 3, nnx.Rngs(1))),
    "custom-module": linear_masks(Gate(), linear(8, 3, nnx.Rngs(1))),
    "lambda": linear_masks(lambda x: x * 2, linear(8, 3, nnx.Rngs(1))),
    "unknown-function": linear_masks(jnp.exp, linear(8, 3, nnx.Rngs(1))),
    "partial-with-positional": linear_masks(functools.partial(jax.nn.leaky_relu, 0.5), linear(8, 3, nnx.Rngs(1))),
    "nested": nnx.Sequential(
        linear(4, 8, nnx.Rngs(0)), Residual(nnx.PReLU()), Masksembles(8, N, 2.0), linear(8, 3, nnx.Rngs(1))
    ),
    "grouped-conv": nnx.Sequential(
        conv(4, 8, (1,), nnx.Rngs(0)), Masksembles(8, N, 2.0), conv(8, 8, (3,), nnx.Rngs(1), feature_group_count=2)
    ),
    "pool-over-channels": nnx.Sequential(
        conv(4, 8, (1,), nnx.Rngs(0)),
        Masksembles(8, N, 2.0),
        functools.partial(
            jax.lax.reduce_window,
            init_value=-jnp.inf,
            computation=jax.lax.max,
            window_dimensions=(1, 1, 2),
            window_strides=(1, 1, 2),
            padding="VALID",
        ),
        conv(4, 3, (1,), nnx.Rngs(1)),
    ),
    "masks-not-last": nnx.Sequential(
        conv(4, 3, (1,), nnx.Rngs(0)), Masksembles(3, N, 1.0, channel_axis=1), conv(3, 2, (1,), nnx.Rngs(1))
    ),
}


@pytest.mark.parametrize("model", list(FORMERLY_REFUSED.values()), ids=list(FORMERLY_REFUSED))
def test_layers_the_first_packer_refused_pack(model: nnx.Module) -> None:
    first = model.layers[0]
    x = random_input((5, 3, 4) if isinstance(first, nnx.Conv) else (5, 4), 0)
    members = [extract_member(model, k, x) for k in range(N)]
    packed, expected, outputs = packed_and_dense(model, pack(model, x[:2], program="packed"), members, x)
    assert relative_error(packed, expected) <= 1e-5
    for k, output in enumerate(outputs):
        assert relative_error(output, expected[k]) <= 1e-5


REFUSED = {
    "untraceable-shapes": (
        linear_masks(Residual(linear(8, 6, nnx.Rngs(0)))),
        r"need a model JAX can trace in eval mode .*tracing Sequential failed: TypeError: add got incompatible shapes",
    ),
    "no-masks": (nnx.Sequential(linear(4, 8, nnx.Rngs(0)), nnx.relu), "the model has no Masksembles layer"),
    "random-per-call": (
        linear_masks(Noisy(), linear(8, 3, nnx.Rngs(1))),
        r"Sequential reads an RNG stream \(nnx\.Rngs\) in eval mode: it draws random numbers at every call",
    ),
    "no-masks-in-a-module": (Gate(), "the model has no Masksembles layer"),
    "mixed-n": (
        linear_masks(linear(8, 8, nnx.Rngs(0)), Masksembles(8, 3, 2.0), n=2),
        r"the same n; found \[2, 3\]",
    ),
}


@pytest.mark.parametrize("model,message", list(REFUSED.values()), ids=list(REFUSED))
def test_what_cannot_be_packed_is_a_named_error(model: nnx.Module, message: str) -> None:
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match=message):
        pack(model, x)
    with pytest.raises(ValueError, match=message):
        extract_member(model, 0, x)


def test_not_a_module_and_a_bad_example() -> None:
    model, _ = build("mlp", 2.0, 0)
    with pytest.raises(TypeError, match=r"need an nnx\.Module; received function"):
        pack(lambda x: x, jnp.ones((2, 12)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"need an example input with a batch of at least 1 on axis 0; received \(\)"):
        pack(model, jnp.ones(()))


@pytest.mark.parametrize("member", [4, -1, 1.0, True], ids=["too-large", "negative", "float", "bool"])
def test_member_out_of_range(member: object) -> None:
    model, _ = build("mlp", 2.0, 0)
    with pytest.raises(ValueError, match=rf"member must be an integer in \[0, 4\); received {member!r}"):
        extract_member(model, member, jnp.zeros((2, 12)))  # type: ignore[arg-type]


def test_a_batch_mean_reads_the_rows_of_a_member_that_needs_none_of_them() -> None:
    """The masks after ``x - x.mean(0)`` keep none of member 0's channels (``third``'s first mask is the complement of
    ``second``'s): member 0 needs nothing of its own rows, but in predict's member-stacked batch the mean reads them
    for every other member."""
    first = np.array([[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 1, 0, 1, 1, 0, 1], [1, 1, 0, 1, 0, 0, 0, 1],
                      [1, 0, 0, 1, 0, 1, 0, 1]])  # fmt: skip
    second = np.array([[0, 1, 0, 0, 1, 0, 1, 1], [1, 0, 1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 1, 1, 0, 1],
                       [0, 0, 1, 0, 1, 0, 1, 1]])  # fmt: skip
    third = np.concatenate([1 - second[:1], np.ones((3, 8), int)])
    model = nnx.Sequential(
        linear(6, 8, nnx.Rngs(0)),
        Masksembles(8, N, 2.0, masks=first),
        lambda v: v - v.mean(0, keepdims=True),
        Masksembles(8, N, 2.0, masks=second),
        Masksembles(8, N, 2.0, masks=third),
        linear(8, 3, nnx.Rngs(1)),
    )
    x = random_input((8, 6), 0)
    packed = pack(model, x, program="packed")
    assert relative_error(packed(x), mf.predict(model, x, N)) <= 1e-5
