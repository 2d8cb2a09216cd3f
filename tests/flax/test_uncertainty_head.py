"""with_uncertainty (NNX and linen): the head's dict equals masksembles_core.heads.uncertainty_head on predict's
members, eager and compiled, on packed and inserted models; bad arguments, models without members and models in
training mode are refused."""

from __future__ import annotations

import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import masksembles_flax as mf
from masksembles_core.heads import check_head, uncertainty_head
from masksembles_flax import linen as ml
from masksembles_flax import nnx as mn
from tests.flax.common import assert_head_equals

N = 4

# What each task's members are: the model's output width and how its last layer's output is read.
TASKS: dict[str, tuple[int, dict[str, Any]]] = {
    "logits": (3, {}),
    "sigmoid-logit": (1, {}),
    "probabilities": (3, {"logits": False}),
    "regression": (2, {"task": "regression"}),
    "gaussian-log-variance": (2, {"task": "regression", "head": "log_variance"}),
    "gaussian-variance": (2, {"task": "regression", "head": "variance", "min_variance": 0.05}),
}


class Net(nnx.Module):
    """Linear -> relu -> Masksembles -> Linear (-> softmax, or softplus on the variance channel)."""

    def __init__(self, outputs: int, read: str = "", *, rngs: nnx.Rngs) -> None:
        self.hidden, self.out = nnx.Linear(5, 16, rngs=rngs), nnx.Linear(16, outputs, rngs=rngs)
        self.masks = mn.Masksembles(16, N, 2.0, seed=0)
        self.read = read

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.out(self.masks(nnx.relu(self.hidden(x))))
        if self.read == "softmax":
            return jax.nn.softmax(y, axis=-1)
        if self.read == "softplus":
            return jnp.stack([y[..., 0], jax.nn.softplus(y[..., 1])], axis=-1)
        return y


class Plain(nnx.Module):
    """A model for insert: Linear -> BatchNorm -> relu -> Dropout -> Linear, no Masksembles layer."""

    def __init__(self, outputs: int, *, rngs: nnx.Rngs) -> None:
        self.first, self.norm = nnx.Linear(5, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs)
        self.dropout, self.last = nnx.Dropout(0.2, rngs=rngs), nnx.Linear(16, outputs, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.last(self.dropout(nnx.relu(self.norm(self.first(x)))))


def read_of(task: str) -> str:
    return {"probabilities": "softmax", "gaussian-variance": "softplus"}.get(task, "")


def nnx_model(task: str, source: str) -> nnx.Module:
    outputs, _ = TASKS[task]
    if source == "own-layers":
        model: nnx.Module = Net(outputs, read_of(task), rngs=nnx.Rngs(0))
    else:
        model = mn.insert(Plain(outputs, rngs=nnx.Rngs(1)), N, 2.0, seed=0)
    model.eval()  # type: ignore[no-untyped-call]
    return model


# Which NNX model each task runs on: insert's (Masksembles on the last Linear's input of Plain) or Net's own layers
# (where the softmax/softplus read-out is the model's).
NNX_SOURCES = {
    "logits": "inserted",
    "sigmoid-logit": "own-layers",
    "probabilities": "own-layers",
    "regression": "inserted",
    "gaussian-log-variance": "inserted",
    "gaussian-variance": "own-layers",
}


def inputs(batch: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(batch).normal(size=(batch, 5)), jnp.float32)


def cases(first: str, second: str, both: tuple[str, ...]) -> list[Any]:
    """Every task with ``first`` or ``second`` in turn, and with both for the tasks in ``both``; the other pairings
    are near-duplicates, marked slow."""
    pairs = []
    for index, task in enumerate(TASKS):
        for variant in (first, second):
            default = task in both or variant == (first, second)[index % 2]
            pairs.append(pytest.param(task, variant, marks=() if default else pytest.mark.slow))
    return pairs


@pytest.mark.parametrize(("task", "wrapped"), cases("tiled", "packed", both=("logits",)))
def test_nnx_head_is_the_core_head_on_predict_eager_and_jitted(task: str, wrapped: str) -> None:
    model = nnx_model(task, NNX_SOURCES[task])
    x = inputs(6)
    target = mn.pack(model, x, program="packed") if wrapped == "packed" else model
    options = TASKS[task][1]
    head = mn.with_uncertainty(target, **options)
    expected = uncertainty_head(np.asarray(mf.predict(model, x)), **options)
    assert_head_equals(head(x), expected)
    assert_head_equals(nnx.jit(lambda module, v: module(v))(head, x), expected)
    graphdef, state = nnx.split(head)
    assert_head_equals(jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))(state, x), expected)


def test_a_packed_model_inside_a_module_gives_its_members_on_member_axis() -> None:
    model = nnx_model("logits", "own-layers")
    x = inputs(5)

    class BatchFirst(nnx.Module):
        def __init__(self, packed: mn.PackedMasksembles) -> None:
            self.packed = packed

        def __call__(self, v: jax.Array) -> jax.Array:
            return jnp.swapaxes(self.packed(v), 0, 1)  # (B, n, K)

    head = mn.with_uncertainty(BatchFirst(mn.pack(model, x, program="packed")), member_axis=1)
    assert head.n == N and not head.tiled
    assert_head_equals(head(x), uncertainty_head(np.asarray(mf.predict(model, x))))


def test_the_dict_keeps_the_core_order_through_jit() -> None:
    head = mn.with_uncertainty(nnx_model("logits", "own-layers"))
    assert tuple(nnx.jit(lambda module, v: module(v))(head, inputs(2))) == check_head().outputs


def test_the_head_shares_the_model_state() -> None:
    model = nnx_model("regression", "own-layers")
    head = mn.with_uncertainty(model, task="regression")
    assert head.model is model
    model.out.bias.set_value(model.out.bias[...] + 1.0)
    x = inputs(3)
    assert_head_equals(head(x), uncertainty_head(np.asarray(mf.predict(model, x)), task="regression"))


# --- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"task": "segmentation"}, ValueError),
        ({"head": "variance"}, ValueError),
        ({"task": "regression", "head": "std"}, ValueError),
        ({"task": "regression", "head": "variance", "min_variance": 0.0}, ValueError),
        ({"logits": 1}, TypeError),
    ],
)
def test_bad_arguments_raise_the_core_messages(arguments: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error) as core:
        check_head(**arguments)
    model = nnx_model("logits", "own-layers")
    with pytest.raises(error, match=f"^{re.escape(str(core.value))}$"):
        mn.with_uncertainty(model, **arguments)
    with pytest.raises(error):
        ml.with_uncertainty(LinenNet(3), **arguments)


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_a_model_without_members_is_refused(task: str) -> None:
    plain = Plain(2, rngs=nnx.Rngs(0))
    plain.eval()  # type: ignore[no-untyped-call]
    with pytest.raises(ValueError, match="Plain has no Masksembles layer and no packed program"):
        mn.with_uncertainty(plain, task=task, n=4)
    model = nnx_model("logits", "own-layers")
    with pytest.raises(ValueError, match="one member alone"):
        mn.with_uncertainty(mn.extract_member(model, 0, inputs(4)), task=task)


def test_n_and_member_axis_are_checked() -> None:
    model = nnx_model("logits", "own-layers")
    with pytest.raises(ValueError, match="n=3 does not match the model's Masksembles layers, which have n=4"):
        mn.with_uncertainty(model, n=3)
    with pytest.raises(ValueError, match="n=2 does not match"):
        mn.with_uncertainty(mn.pack(model, inputs(4), program="packed"), n=2)
    with pytest.raises(ValueError, match="member_axis=1 is for a model that returns its members"):
        mn.with_uncertainty(model, member_axis=1)


def test_eager_members_are_checked_as_the_core_checks_them() -> None:
    probabilities = mn.with_uncertainty(nnx_model("probabilities", "own-layers"))  # logits=True on probabilities
    logits = mn.with_uncertainty(nnx_model("logits", "own-layers"), logits=False)
    x = inputs(4)
    for head in (probabilities, logits):
        with pytest.raises(ValueError) as core:
            uncertainty_head(np.asarray(mf.predict(head.model, x)), logits=head.spec.logits)
        with pytest.raises(ValueError, match=f"^{re.escape(str(core.value))}$"):
            head(x)
    traced = nnx.jit(lambda module, v: module(v))(logits, x)  # traced: not checked (the docstring says so)
    assert np.isfinite(np.asarray(traced["probabilities"])).all()


@pytest.mark.parametrize("layer", ["dropout", "norm"])
def test_a_model_in_training_mode_is_refused(layer: str) -> None:
    model = nnx_model("logits", "inserted")
    getattr(model, layer).train()
    flag = "deterministic" if layer == "dropout" else "use_running_average"
    with pytest.raises(ValueError, match=f"set to train: {layer} .* has {flag}=False. Call model.eval"):
        mn.with_uncertainty(model)
    model.eval()  # type: ignore[no-untyped-call]
    head = mn.with_uncertainty(model)
    model.train()  # type: ignore[no-untyped-call]
    with pytest.raises(ValueError, match="set to train"):
        head(inputs(2))


def test_random_masks_in_training_are_refused_and_grouped_layers_ignore_the_flag() -> None:
    model = Net(3, rngs=nnx.Rngs(0))  # grouped Masksembles: deterministic=False by default, and no effect
    assert model.masks.deterministic is False
    mn.with_uncertainty(model)
    random = nnx.Sequential(nnx.Linear(5, 8, rngs=nnx.Rngs(0)), mn.Masksembles(8, N, 2.0, seed=0, mode="random"))
    with pytest.raises(ValueError, match=r"set to train: layers.1 \(Masksembles\) has deterministic=False"):
        mn.with_uncertainty(random)


def test_a_model_with_several_outputs_is_refused() -> None:
    class Two(Net):
        def __call__(self, x: jax.Array) -> Any:
            y = super().__call__(x)
            return y, y

    model = Two(3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="returns one array; it returned tuple"):
        mn.with_uncertainty(model)(inputs(2))


# --- linen -------------------------------------------------------------------------------------------------------


class LinenNet(nn.Module):
    """Dense -> BatchNorm -> relu -> Dropout -> Masksembles -> Dense; ``train`` switches BatchNorm and Dropout."""

    outputs: int
    read: str = ""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x)))
        x = nn.Dropout(0.2, deterministic=not train)(x)
        y = nn.Dense(self.outputs)(ml.Masksembles(n=N, scale=2.0, seed=0)(x))
        if self.read == "softmax":
            return jax.nn.softmax(y, axis=-1)
        if self.read == "softplus":
            return jnp.stack([y[..., 0], jax.nn.softplus(y[..., 1])], axis=-1)
        return y


def linen_variables(module: nn.Module, x: jax.Array) -> Any:
    """Variables with BatchNorm statistics that are not the identity, so that a wrong mode would show."""
    variables = module.init(jax.random.key(0), x)
    rng = np.random.default_rng(0)
    stats = jax.tree.map(lambda a: jnp.asarray(rng.uniform(0.5, 1.5, a.shape), a.dtype), variables["batch_stats"])
    return {**variables, "batch_stats": stats}


@pytest.mark.parametrize(("task", "source"), cases("own-layers", "inserted", both=("logits",)))
def test_linen_head_is_the_core_head_on_predict_eager_and_jitted(task: str, source: str) -> None:
    outputs, options = TASKS[task]
    module: nn.Module = LinenNet(outputs, read_of(task))
    if source == "inserted":  # Masksembles on the input of the last Dense too (the softmax/softplus read-out kept)
        module = ml.insert(LinenNet(outputs, read_of(task)), N, 2.0, seed=0)
    x = inputs(6)
    variables = linen_variables(module, x)
    head = ml.with_uncertainty(module, **options)
    expected = uncertainty_head(np.asarray(mf.predict(lambda b: module.apply(variables, b), x, n=N)), **options)
    assert_head_equals(head.apply(variables, x), expected)
    assert_head_equals(jax.jit(head.apply)(variables, x), expected)
    assert_head_equals(head.apply(variables, x, train=False), expected)


def test_linen_head_init_makes_the_module_variables() -> None:
    module, x = LinenNet(3), inputs(4)
    made = ml.with_uncertainty(module).init(jax.random.key(0), x)
    assert jax.tree.all(jax.tree.map(np.array_equal, made, module.init(jax.random.key(0), x)))


class Switchable(nn.Module):
    """Dense -> ``layer`` (Dropout or BatchNorm, switched by ``train``) -> Masksembles -> Dense."""

    layer: str

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.Dense(8)(x)
        x = nn.Dropout(0.2, deterministic=not train)(x) if self.layer == "dropout" else nn.BatchNorm(not train)(x)
        return nn.Dense(2)(ml.Masksembles(n=N, scale=2.0, seed=0)(x))


@pytest.mark.parametrize(("layer", "wanted"), [("dropout", "a random stream"), ("norm", "a variable update")])
def test_linen_training_mode_is_refused(layer: str, wanted: str) -> None:
    module, x = Switchable(layer), inputs(4)
    variables, head = module.init(jax.random.key(0), x), ml.with_uncertainty(module)
    with pytest.raises(ValueError, match=f"inference mode, and it asked for {wanted}"):
        head.apply(variables, x, train=True)
    with pytest.raises(ValueError, match="apply it without rngs"):
        head.apply(variables, x, rngs={"dropout": jax.random.key(0)})
    with pytest.raises(ValueError, match="apply it with nothing mutable"):
        head.apply(variables, x, mutable=["batch_stats"])


def test_linen_module_without_masks_and_n_mismatch_are_refused() -> None:
    dense, x = nn.Dense(3), inputs(4)
    with pytest.raises(ValueError, match="hold no 'masksembles' masks: Dense has no Masksembles layer"):
        ml.with_uncertainty(dense, task="regression").apply(dense.init(jax.random.key(0), x), x)
    module = LinenNet(3)
    with pytest.raises(ValueError, match="n=2 does not match"):
        ml.with_uncertainty(module, n=2).apply(linen_variables(module, x), x)
    with pytest.raises(TypeError, match=r"takes a linen nn\.Module"):
        ml.with_uncertainty(nnx_model("logits", "own-layers"))  # type: ignore[arg-type]
