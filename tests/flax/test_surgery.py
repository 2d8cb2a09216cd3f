"""insert and convert_dropout on Flax-examples-style models, linen and NNX: the report, a jitted training step that
touches only the weights, predict, an orbax round trip, nn.tabulate, and (NNX) pack equal to predict."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import masksembles_core as mc
from masksembles_core.insertion import CONVERTED, INSERTED, LEFT, PER_SAMPLE, ZERO_RATE, LayerReport
from masksembles_flax import linen as ml
from masksembles_flax import nnx as mn
from masksembles_flax import predict
from masksembles_flax._linen_surgery import LIFTED
from tests.flax.common import assert_same_bits
from tests.rounding import assert_rounding_close

FIRST = "the network's first layer: it reads the raw input (include_first=True masks it)"
IMAGES = jax.random.normal(jax.random.key(0), (8, 8, 8, 3))
TOKENS = jax.random.normal(jax.random.key(1), (8, 5, 8))
FEATURES = jax.random.normal(jax.random.key(2), (8, 6))
LABELS = jnp.arange(8) % 4


def actions(report: LayerReport) -> dict[str, str]:
    return {row.path: row.action for row in report.rows}


def reasons(report: LayerReport) -> dict[str, str]:
    return {row.path: row.reason for row in report.unchanged}


# --- linen: the Flax examples' CNN and ResNet, a ViT, scan-over-layers -------------------------------------------


class LinenCNN(nn.Module):
    """The Flax MNIST example's CNN, with dropouts: channel, per-sample and rate 0."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.avg_pool(nn.relu(nn.Conv(8, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(16, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(32)(x)))
        x = nn.Dropout(0.2, broadcast_dims=(1,), deterministic=not train)(x)
        x = nn.Dropout(0.0, deterministic=not train)(x)
        return nn.Dense(4)(x)


class LinenBlock(nn.Module):
    """The Flax ImageNet example's ResNet block."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        norm = nn.BatchNorm(use_running_average=not train)
        y = nn.relu(norm(nn.Conv(self.features, (3, 3))(x)))
        y = nn.BatchNorm(use_running_average=not train)(nn.Conv(self.features, (3, 3))(y))
        if x.shape[-1] != self.features:
            x = nn.Conv(self.features, (1, 1), name="projection")(x)
        return nn.relu(x + y)


class LinenResNet(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x)))
        for features in (8, 16):
            x = LinenBlock(features)(x, train)
        return nn.Dense(4)(x.mean(axis=(1, 2)))


class LinenViT(nn.Module):
    """Patch embedding, two pre-norm encoder blocks (attention with dropout_rate, an MLP with dropout), a head."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.Dense(16)(x)
        for _ in range(2):
            x = x + nn.MultiHeadDotProductAttention(2, dropout_rate=0.1, deterministic=not train)(nn.LayerNorm()(x))
            y = nn.gelu(nn.Dense(32)(nn.LayerNorm()(x)))
            x = x + nn.Dense(16)(nn.Dropout(0.1, deterministic=not train)(y))
        return nn.Dense(4)(x.mean(axis=1))


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return x + nn.relu(nn.Dense(16)(nn.LayerNorm()(x))), None


class LinenStack(nn.Module):
    """Scan-over-layers: 3 layers under nn.scan (remat'd), the masks collection broadcast over the stack or not."""

    carries_masks: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        broadcast = ("masksembles",) if self.carries_masks else ()
        layers = nn.scan(
            nn.remat(LinenLayer), variable_axes={"params": 0}, variable_broadcast=broadcast,
            split_rngs={"params": True}, length=3,
        )  # fmt: skip
        x, _ = layers(name="layers")(nn.Dense(16)(x), None)
        return nn.Dense(4)(x)


LINEN_CASES = {
    "cnn-convert_dropout": (LinenCNN, IMAGES, ml.convert_dropout),
    "resnet-insert": (LinenResNet, IMAGES, ml.insert),
    "vit-insert": (LinenViT, TOKENS, ml.insert),
    "vit-convert_dropout": (LinenViT, TOKENS, ml.convert_dropout),
    "stack-insert": (LinenStack, FEATURES, ml.insert),
}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_linen_insert_on_the_cnn_reports_like_every_framework() -> None:
    inserted = ml.insert(LinenCNN(), 4, 2.0, seed=0)
    report = inserted.masksembles_report(IMAGES)
    assert actions(report) == {"Conv_0": LEFT, "Conv_1": INSERTED, "Dense_0": INSERTED, "Dense_1": INSERTED}
    assert reasons(report) == {"Conv_0": FIRST}
    assert [(row.channels, row.channel_axis) for row in report.changed] == [(8, -1), (64, -1), (32, -1)]
    assert [row.seed for row in report.changed] == [mc.derive_seed(0, i) for i in range(3)]
    variables = jax.jit(inserted.init)(jax.random.key(0), IMAGES)
    original = jax.eval_shape(LinenCNN().init, jax.random.key(0), IMAGES)
    assert jax.tree.structure(variables["params"]) == jax.tree.structure(original["params"])  # the same checkpoint
    for row in report.changed:
        masks = np.asarray(variables["masksembles"][row.path]["masks"])
        assert np.array_equal(masks, mc.generate_masks(row.channels, 4, 2.0, seed=row.seed))
    assert set(variables["masksembles"]) == {row.path for row in report.changed}
    started = ml.insert(LinenResNet(), 4, 2.0, seed=0, start="LinenBlock_1").masksembles_report(IMAGES)
    assert [row.path for row in started.changed] == [
        "LinenBlock_1/Conv_0", "LinenBlock_1/Conv_1", "LinenBlock_1/projection", "Dense_0"
    ]  # fmt: skip
    assert reasons(started)["LinenBlock_0/Conv_1"] == "before start='LinenBlock_1'"


def test_linen_insert_with_scale_one_keeps_the_outputs_and_the_weights_load() -> None:
    model = LinenCNN()
    variables = jax.jit(model.init)(jax.random.key(0), IMAGES)
    single = ml.insert(model, 4, 1.0, seed=0)
    masks = jax.jit(single.init)(jax.random.key(1), IMAGES)["masksembles"]
    expected = np.asarray(jax.jit(model.apply)(variables, IMAGES))
    assert_same_bits(jax.jit(single.apply)({**variables, "masksembles": masks}, IMAGES), expected)
    with pytest.raises(ValueError, match=r"the variables given to apply hold no 'masksembles' collection"):
        single.apply(variables, IMAGES)


def test_linen_insert_in_scan_over_layers_and_remat() -> None:
    report = ml.insert(LinenStack(), 4, 2.0, seed=0).masksembles_report(FEATURES)
    assert actions(report) == {"Dense_0": LEFT, "layers/Dense_0": INSERTED, "Dense_1": INSERTED}
    variables = jax.jit(ml.insert(LinenStack(), 4, 2.0, seed=0).init)(jax.random.key(0), FEATURES)
    assert variables["masksembles"]["layers"]["Dense_0"]["masks"].shape == (4, 16)  # shared by the 3 layers
    uncarried = ml.insert(LinenStack(carries_masks=False), 4, 2.0, seed=0).masksembles_report(FEATURES)
    assert reasons(uncarried) == {"Dense_0": FIRST, "layers/Dense_0": LIFTED}


def test_linen_convert_dropout_reports_what_it_leaves() -> None:
    report = ml.convert_dropout(LinenCNN(), 4, 2.0, seed=0).masksembles_report(IMAGES)
    assert (report.operation, actions(report)) == (
        "convert_dropout", {"Dropout_0": CONVERTED, "Dropout_1": LEFT, "Dropout_2": LEFT}
    )  # fmt: skip
    assert reasons(report) == {"Dropout_1": PER_SAMPLE, "Dropout_2": ZERO_RATE}
    assert (report.changed[0].channels, report.changed[0].seed) == (32, mc.derive_seed(0, 0))
    vit = ml.convert_dropout(LinenViT(), 4, 2.0, seed=0).masksembles_report(TOKENS)
    assert actions(vit) == {
        "MultiHeadDotProductAttention_0": LEFT, "Dropout_0": CONVERTED,
        "MultiHeadDotProductAttention_1": LEFT, "Dropout_1": CONVERTED,
    }  # fmt: skip
    assert reasons(vit)["MultiHeadDotProductAttention_0"] == (
        "attention-weight dropout (MultiHeadDotProductAttention's dropout_rate=0.1): its input is attention weights, "
        "not channels"
    )
    with pytest.raises(ValueError, match=r"convert_dropout converted no dropout \(0 looked at"):
        ml.convert_dropout(LinenResNet(), 4, 2.0).init(jax.random.key(0), IMAGES)


@pytest.mark.parametrize(("make", "x", "change"), LINEN_CASES.values(), ids=LINEN_CASES.keys())
def test_linen_models_train_predict_checkpoint_and_tabulate(
    make: Any, x: jax.Array, change: Any, tmp_path: Path
) -> None:
    model = change(make(), 4, 2.0, seed=0)
    variables = jax.jit(model.init)({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    params, masks = variables["params"], variables["masksembles"]
    others = {name: value for name, value in variables.items() if name not in ("params", "masksembles")}
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params: Any, others: Any, opt_state: Any, key: jax.Array) -> tuple[Any, Any, Any]:
        def loss_fn(params: Any) -> tuple[jax.Array, Any]:
            logits, updates = model.apply(
                {"params": params, "masksembles": masks, **others}, x, train=True,
                rngs={"dropout": key}, mutable=list(others),
            )  # fmt: skip
            return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean(), updates

        (_, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        changes, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, changes), {**others, **updates}, opt_state

    opt_state = optimizer.init(params)
    trained, others, opt_state = step(params, others, opt_state, jax.random.key(2))
    assert not any(jax.tree.leaves(jax.tree.map(np.array_equal, params, trained)))
    trained_variables = {"params": trained, "masksembles": masks, **others}
    members = jax.jit(lambda v, x: predict(lambda batch: model.apply(v, batch), x, 4))(trained_variables, x)
    assert members.shape == (4, x.shape[0], 4)
    assert not np.allclose(members[0], members[1])
    read = jax.jit(lambda v, x: predict(lambda batch: model.apply(v, batch), x))(trained_variables, x)
    assert_same_bits(read, np.asarray(members))  # n read from the apply, as docs/flax.md says
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", trained_variables)
        checkpointer.wait_until_finished()
        target = jax.eval_shape(lambda: change(make(), 4, 2.0, seed=9).init(jax.random.key(5), x))
        restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert jax.tree.all(jax.tree.map(np.array_equal, restored["masksembles"], masks))
    again = jax.jit(lambda v, x: predict(lambda batch: model.apply(v, batch), x, 4))(restored, x)
    assert_same_bits(again, np.asarray(members))
    table = ANSI.sub("", model.tabulate(jax.random.key(0), x, depth=2, console_kwargs={"width": 400}))
    header = table.splitlines()[3].split()
    assert "masksembles" in header and "params" in header and "masks: bool[4," in table  # its own column


# --- NNX: CNN, ViT with nnx.MultiHeadAttention, scan-over-layers with nnx.vmap/nnx.scan -----------------------------


class NnxCNN(nnx.Module):
    """The Flax MNIST tutorial's CNN (NNX), with a channel dropout, a per-sample one and a rate-0 one."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(4 * 4 * 16, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.drop_sample = nnx.Dropout(0.2, broadcast_dims=(1,), rngs=rngs)
        self.off = nnx.Dropout(0.0, rngs=rngs)
        self.linear2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.avg_pool(nnx.relu(self.conv2(nnx.relu(self.conv1(x)))), (2, 2), strides=(2, 2))
        x = self.dropout(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))
        return self.linear2(self.off(self.drop_sample(x)))


class NnxEncoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm1, self.norm2 = nnx.LayerNorm(16, rngs=rngs), nnx.LayerNorm(16, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(2, 16, dropout_rate=0.1, decode=False, rngs=rngs)
        self.mlp1, self.mlp2 = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp2(self.dropout(nnx.gelu(self.mlp1(self.norm2(x)))))


class NnxViT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Linear(8, 16, rngs=rngs)
        self.blocks = nnx.List([NnxEncoder(rngs) for _ in range(2)])
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=1))


class NnxLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.linear = nnx.Linear(16, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.dropout(nnx.relu(self.linear(self.norm(x))))


class NnxStack(nnx.Module):
    """Scan-over-layers as the Flax guides write it: 3 layers made under nnx.vmap, run with nnx.scan."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Linear(6, 16, rngs=rngs)

        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs) -> NnxLayer:
            return NnxLayer(rngs)

        self.layers = create(rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x: jax.Array, layer: NnxLayer) -> jax.Array:
            return layer(x)

        return self.head(forward(self.embed(x), self.layers))


def test_nnx_insert_gives_each_layer_of_a_stack_its_own_masks() -> None:
    model = mn.insert(NnxStack(nnx.Rngs(0)), 4, 2.0, seed=0)
    report = model.masksembles_report
    assert actions(report) == {"embed": LEFT, "layers.linear": INSERTED, "head": INSERTED}
    row = report.changed[0]
    assert row.reason == "a stack of 3 layers (nnx.vmap): layer j's masks from derive_seed(seed, j)"
    masks = np.asarray(model.layers.linear.masksembles.masks[...])
    assert masks.shape == (3, 4, 16)
    for j in range(3):
        assert np.array_equal(masks[j], mc.generate_masks(16, 4, 2.0, seed=mc.derive_seed(row.seed, j)))
    assert not np.array_equal(masks[0], masks[1])


def test_nnx_convert_dropout_reports_what_it_leaves() -> None:
    converted = mn.convert_dropout(NnxCNN(nnx.Rngs(0)), IMAGES, 4, 2.0, seed=0)
    report = converted.masksembles_report
    assert actions(report) == {"dropout": CONVERTED, "drop_sample": LEFT, "off": LEFT}
    assert reasons(report) == {"drop_sample": PER_SAMPLE, "off": ZERO_RATE}
    assert isinstance(converted.dropout, mn.Masksembles) and converted.dropout.channels == 32
    vit = mn.convert_dropout(NnxViT(nnx.Rngs(0)), TOKENS, 4, 2.0, seed=0).masksembles_report
    assert actions(vit) == {
        "blocks.0.attention": LEFT, "blocks.0.dropout": CONVERTED,
        "blocks.1.attention": LEFT, "blocks.1.dropout": CONVERTED,
    }  # fmt: skip
    assert reasons(vit)["blocks.1.attention"] == (
        "attention-weight dropout (MultiHeadAttention's dropout_rate=0.1): its input is attention weights, not channels"
    )
    stack = mn.convert_dropout(NnxStack(nnx.Rngs(0)), FEATURES, 4, 2.0, seed=0)
    assert stack.layers.dropout.masks[...].shape == (3, 4, 16)
    with pytest.raises(ValueError, match=r"convert_dropout converted no dropout \(0 looked at"):
        mn.convert_dropout(NnxStack(nnx.Rngs(0)).embed, FEATURES, 4, 2.0)


NNX_CASES = {
    "cnn-convert_dropout": (NnxCNN, IMAGES, "convert_dropout"),
    "vit-insert": (NnxViT, TOKENS, "insert"),
    "stack-insert": (NnxStack, FEATURES, "insert"),
    "stack-convert_dropout": (NnxStack, FEATURES, "convert_dropout"),
}


@pytest.mark.parametrize(("make", "x", "operation"), NNX_CASES.values(), ids=NNX_CASES.keys())
def test_nnx_models_train_predict_pack_and_checkpoint(make: Any, x: jax.Array, operation: str, tmp_path: Path) -> None:
    def change(model: nnx.Module) -> Any:
        if operation == "insert":
            return mn.insert(model, 4, 2.0, seed=0)
        return mn.convert_dropout(model, x, 4, 2.0, seed=0)

    model = change(make(nnx.Rngs(0)))
    masks_before = jax.tree.map(np.asarray, nnx.state(model, mn.Masks))
    params_before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer[Any]) -> jax.Array:
        def loss_fn(model: nnx.Module) -> jax.Array:
            return optax.softmax_cross_entropy_with_integer_labels(model(x), LABELS).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    model.train()
    assert np.isfinite(float(step(model, optimizer)))
    assert jax.tree.all(jax.tree.map(np.array_equal, masks_before, nnx.state(model, mn.Masks)))
    assert not any(jax.tree.leaves(jax.tree.map(np.array_equal, params_before, nnx.state(model, nnx.Param))))
    model.eval()
    members = nnx.jit(lambda model, x: predict(model, x, 4))(model, x)
    assert members.shape == (4, x.shape[0], 4) and not np.allclose(members[0], members[1])
    packed = mn.pack(model, x, program="packed")
    np.testing.assert_allclose(nnx.jit(lambda m, v: m(v))(packed, x), members, rtol=1e-5, atol=1e-5)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", nnx.state(model))
        checkpointer.wait_until_finished()
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: change(make(nnx.Rngs(1)))))
        restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "ckpt", abstract))
    restored.eval()
    assert jax.tree.all(jax.tree.map(np.array_equal, masks_before, nnx.state(restored, mn.Masks)))
    assert_rounding_close(nnx.jit(lambda model, x: predict(model, x, 4))(restored, x), members)
