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
