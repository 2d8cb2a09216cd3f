"""masksembles_flax.nnx.insert: Masksembles before the chosen layers of any NNX model, by the shared core rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import masksembles_core as mc
from masksembles_core.insertion import INSERTED, LEFT, LayerReport, check_insert_arguments
from masksembles_flax import predict
from masksembles_flax.nnx import Masked, Masks, insert
from tests.flax.common import assert_same_bits, raises_like
from tests.rounding import assert_rounding_close

FIRST = "the network's first layer: it reads the raw input (include_first=True masks it)"
DEPTHWISE = "depthwise convolution: each output channel reads one input channel (before=... includes it)"
IMAGES = jax.random.normal(jax.random.key(0), (8, 8, 8, 3))


class CNN(nnx.Module):
    """The Flax examples' CNN shape: conv-bn-relu-pool twice (the second conv depthwise + pointwise), then an MLP."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.depthwise = nnx.Conv(8, 8, (3, 3), feature_group_count=8, rngs=rngs)
        self.pointwise = nnx.Conv(8, 16, (1, 1), rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, rngs=rngs)
        self.linear1 = nnx.Linear(4 * 4 * 16, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.relu(self.bn2(self.pointwise(self.depthwise(x))))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


class Block(nnx.Module):
    """A ResNet basic block; a 1x1 projection on the shortcut when the width changes."""

    def __init__(self, features_in: int, features: int, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(features_in, features, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(features, rngs=rngs)
        self.conv2 = nnx.Conv(features, features, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(features, rngs=rngs)
        self.projection = nnx.Conv(features_in, features, (1, 1), rngs=rngs) if features_in != features else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.bn2(self.conv2(nnx.relu(self.bn1(self.conv1(x)))))
        shortcut = x if self.projection is None else self.projection(x)
        return nnx.relu(shortcut + y)


class ResNet(nnx.Module):
    """Stem conv, a list of residual blocks, global average pooling, a linear head."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.stem = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.blocks = nnx.List([Block(8, 8, rngs), Block(8, 16, rngs)])
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


class Containers(nnx.Module):
    """Layers in a plain list, a tuple, a dict, an nnx.Dict and a nested nnx.Sequential."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = nnx.Linear(3, 8, rngs=rngs)
        self.items = nnx.data([nnx.Linear(8, 8, rngs=rngs)])
        self.pair = nnx.data((nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)))
        self.named = nnx.data({"b": nnx.Linear(8, 8, rngs=rngs), "a": nnx.Linear(8, 8, rngs=rngs)})
        self.heads = nnx.Dict(
            hidden=nnx.Linear(8, 8, rngs=rngs), out=nnx.Sequential(nnx.relu, nnx.Linear(8, 4, rngs=rngs))
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.items[0](self.first(x))
        x = self.pair[1](self.pair[0](x))
        x = self.heads["hidden"](self.named["a"](self.named["b"](x)))
        return self.heads["out"](x)


CONTAINER_PATHS = ["first", "items.0", "pair.0", "pair.1", "named.b", "named.a", "heads.hidden", "heads.out.layers.1"]


def inserted_layers(model: nnx.Module) -> list[tuple[str, Masked]]:
    return [(".".join(map(str, path)), node) for path, node in nnx.iter_graph(model) if isinstance(node, Masked)]


def actions(report: LayerReport) -> dict[str, str]:
    return {row.path: row.action for row in report.rows}


def test_cnn_gets_masks_before_its_layers_and_a_report() -> None:
    model = CNN(nnx.Rngs(0))
    inserted = insert(model, 4, 2.0, seed=0)
    report = inserted.masksembles_report
    assert (report.operation, report.n, report.scale) == ("insert", 4, 2.0)
    assert actions(report) == {
        "conv1": LEFT, "depthwise": LEFT, "pointwise": INSERTED, "linear1": INSERTED, "linear2": INSERTED,
    }  # fmt: skip
    assert {row.path: row.reason for row in report.unchanged} == {"conv1": FIRST, "depthwise": DEPTHWISE}
    assert [(row.channels, row.channel_axis) for row in report.changed] == [(8, -1), (256, -1), (32, -1)]
    assert [row.seed for row in report.changed] == [mc.derive_seed(0, i) for i in range(3)]
    for row in report.changed:
        wrapper = getattr(inserted, row.path)
        assert isinstance(wrapper, Masked)
        original = getattr(model, row.path)
        assert type(wrapper.layer) is type(original)
        assert np.array_equal(wrapper.layer.kernel[...], original.kernel[...])  # weights kept, width unchanged
        masks = np.asarray(wrapper.masksembles.masks[...])
        assert np.array_equal(masks, mc.generate_masks(row.channels, 4, 2.0, seed=row.seed))
    assert "| pointwise | Conv | inserted | 8 | -1 |" in str(report)


def public_attributes(module: nnx.Module) -> list[str]:
    return [name for name in vars(module) if not name.startswith("_")]


def test_the_copy_keeps_the_attribute_order() -> None:
    model = ResNet(nnx.Rngs(0))
    inserted = insert(model, 4, 2.0, seed=0)
    assert public_attributes(inserted) == ["stem", "blocks", "head", "masksembles_report"]
    assert public_attributes(model) == ["stem", "blocks", "head"]
    assert public_attributes(inserted.blocks[1]) == ["conv1", "bn1", "conv2", "bn2", "projection"]
    again = insert(inserted, 3, 2.0, seed=0, include_first=True).masksembles_report
    assert [row.path for row in again.changed] == ["stem"]


def test_the_input_model_is_untouched() -> None:
    model = CNN(nnx.Rngs(0))
    model.eval()
    before = model(IMAGES)
    inserted = insert(model, 4, 2.0, seed=0)
    kernel = inserted.linear2.layer.kernel
    assert kernel[...].unsafe_buffer_pointer() != model.linear2.kernel[...].unsafe_buffer_pointer()  # own arrays
    kernel[...] = jnp.zeros_like(kernel[...])
    assert not inserted_layers(model)
    assert not hasattr(model, "masksembles_report")
    assert_same_bits(model(IMAGES), np.asarray(before))


MODELS = {
    "cnn": (CNN, IMAGES),
    "resnet": (ResNet, IMAGES),
    "containers": (Containers, jnp.ones((6, 3))),
    "sequential": (
        lambda rngs: nnx.Sequential(
            nnx.Linear(3, 8, rngs=rngs), nnx.relu, nnx.Sequential(nnx.Linear(8, 8, rngs=rngs), nnx.gelu)
        ),
        jnp.ones((6, 3)),
    ),
}


@pytest.mark.parametrize(("make", "x"), MODELS.values(), ids=MODELS.keys())
def test_masks_of_scale_one_keep_the_outputs_and_scale_two_makes_members(make: Any, x: jax.Array) -> None:
    model = make(nnx.Rngs(0))
    model.eval()
    single = insert(model, 4, 1.0, seed=0, include_first=True)
    wrappers = inserted_layers(single)
    assert len(wrappers) == len(single.masksembles_report.changed) >= 2
    assert all(np.asarray(wrapper.masksembles.masks[...]).all() for _, wrapper in wrappers)
    expected = np.asarray(model(x))
    assert_same_bits(single(x), expected)  # masks of ones: x * 1 is x, then the same layers on the same batch
    members = predict(single, x, 4)
    assert members.shape == (4, *expected.shape)
    for member in members:  # the tiled batch: 4 times the rows, which a kernel may round differently
        assert_rounding_close(member, expected)
    ensemble = insert(model, 4, 2.0, seed=0)
    members = nnx.jit(lambda model, x: predict(model, x, 4))(ensemble, x)
    assert members.shape == (4, *expected.shape)
    assert not np.allclose(members[0], members[1])


def test_resnet_blocks_and_start() -> None:
    model = ResNet(nnx.Rngs(0))
    report = insert(model, 4, 2.0, seed=1).masksembles_report
    assert [row.path for row in report.rows] == [
        "stem", "blocks.0.conv1", "blocks.0.conv2", "blocks.1.conv1", "blocks.1.conv2", "blocks.1.projection", "head",
    ]  # fmt: skip
    assert [row.path for row in report.unchanged] == ["stem"]
    started = insert(model, 4, 2.0, seed=1, start="blocks.1").masksembles_report
    assert [row.path for row in started.changed] == [
        "blocks.1.conv1", "blocks.1.conv2", "blocks.1.projection", "head"
    ]  # fmt: skip
    reasons = {row.path: row.reason for row in started.unchanged}
    assert reasons["blocks.0.conv2"] == "before start='blocks.1'"
    assert reasons["stem"] == FIRST
    assert [row.seed for row in started.changed] == [mc.derive_seed(1, i) for i in range(4)]
    with pytest.raises(ValueError, match=r"start='layer3' names no layer of the model; its top-level layers are "):
        insert(model, 4, 2.0, start="layer3")


def test_include_first_masks_the_raw_input() -> None:
    report = insert(ResNet(nnx.Rngs(0)), 3, 2.0, seed=0, include_first=True).masksembles_report
    assert report.rows[0].path == "stem" and report.rows[0].action == INSERTED
    assert report.rows[0].channels == 3
    rgb = insert(ResNet(nnx.Rngs(0)), 4, 2.0, seed=0, include_first=True).masksembles_report
    assert rgb.rows[0].reason.startswith("3 input channels: only 3 distinct masks of 2 ones"), "n=4 needs more"


def test_layers_in_lists_tuples_dicts_and_sequentials_are_replaced_in_place() -> None:
    model = Containers(nnx.Rngs(0))
    inserted = insert(model, 2, 2.0, seed=0, include_first=True)
    assert [path for path, _ in inserted_layers(inserted)] == sorted(CONTAINER_PATHS)
    assert [row.path for row in inserted.masksembles_report.changed] == CONTAINER_PATHS
    assert isinstance(inserted.pair, tuple) and isinstance(inserted.items, list)
    assert isinstance(inserted.named["a"], Masked) and isinstance(inserted.heads["hidden"], Masked)
    assert isinstance(inserted.heads["out"].layers[1], Masked)
    assert inserted.named["a"].layer.kernel[...].shape == (8, 8)


def test_layer_choice_by_types_and_predicate() -> None:
    model = ResNet(nnx.Rngs(0))
    only_linear = insert(model, 4, 2.0, seed=0, before=nnx.Linear).masksembles_report
    assert [row.path for row in only_linear.rows] == ["head"]
    assert only_linear.rows[0].action == INSERTED, "the head does not read the raw input: not the first layer"
    as_list = insert(model, 4, 2.0, seed=0, before=[nnx.Linear]).masksembles_report
    assert as_list.rows == only_linear.rows

    def second_block_convs(path: str, layer: nnx.Module) -> bool:
        return path.startswith("blocks.1.") and isinstance(layer, nnx.Conv)

    report = insert(model, 4, 2.0, before=second_block_convs).masksembles_report
    assert actions(report) == {"blocks.1.conv1": INSERTED, "blocks.1.conv2": INSERTED, "blocks.1.projection": INSERTED}
    no_channels = insert(model, 4, 2.0, before=(nnx.BatchNorm, nnx.Linear)).masksembles_report
    reasons = {row.path: row.reason for row in no_channels.unchanged}
    assert reasons["blocks.0.bn1"] == "no integer in_features: the channel count of its input is unknown"
    for bad in ("Conv", (), [], (nnx.Conv, "Linear")):
        with pytest.raises(TypeError, match=r"^before must be a layer type, a non-empty tuple or list of layer types"):
            insert(model, 4, 2.0, before=bad)  # type: ignore[arg-type]


class Shared(nnx.Module):
    """One Linear called twice, reachable at two paths."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = nnx.Linear(3, 8, rngs=rngs)
        self.hidden = nnx.Linear(8, 8, rngs=rngs)
        self.again = self.hidden
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.again(self.hidden(self.first(x))))


def test_a_layer_at_several_paths_is_left_alone() -> None:
    inserted = insert(Shared(nnx.Rngs(0)), 4, 2.0, seed=0)
    report = inserted.masksembles_report
    assert actions(report) == {"first": LEFT, "hidden": LEFT, "out": INSERTED}
    assert report.unchanged[1].reason == (
        "shared: the same Linear also sits at again; masks at one place would miss the others"
    )
    assert inserted.again is inserted.hidden and isinstance(inserted.out, Masked)


class Child(nnx.Module):
    def __init__(self, owner: nnx.Module, rngs: nnx.Rngs) -> None:
        self.owner = owner  # a reference back up the graph: a cycle, which NNX allows
        self.linear = nnx.Linear(8, 2, rngs=rngs)


class WithCycle(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = nnx.Linear(3, 8, rngs=rngs)
        self.child = Child(self, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.child.linear(self.first(x))


def test_a_reference_back_up_the_graph_is_not_followed() -> None:
    inserted = insert(WithCycle(nnx.Rngs(0)), 4, 2.0, seed=0)
    assert [row.path for row in inserted.masksembles_report.rows] == ["first", "child.linear"]
    assert inserted.child.owner is inserted and isinstance(inserted.child.linear, Masked)
    assert inserted(jnp.ones((4, 3))).shape == (4, 2)


def test_inserting_again_leaves_masked_layers_alone() -> None:
    once = insert(CNN(nnx.Rngs(0)), 4, 2.0, seed=0)
    with pytest.raises(ValueError, match=r"(?s)insert found no layer to put masks before.*already has Masksembles"):
        insert(once, 4, 2.0, seed=0)
    twice = insert(once, 3, 2.0, seed=0, include_first=True).masksembles_report
    assert [row.path for row in twice.changed] == ["conv1"]


def test_masks_are_reproducible_per_seed() -> None:
    model = ResNet(nnx.Rngs(0))

    def masks(seed: int | None) -> list[np.ndarray]:
        return [np.asarray(masks) for masks in jax.tree.leaves(nnx.state(insert(model, 4, 2.0, seed=seed), Masks))]

    assert all(np.array_equal(a, b) for a, b in zip(masks(3), masks(3), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(masks(3), masks(4), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(masks(None), masks(None), strict=True))


def test_training_updates_the_weights_never_the_masks() -> None:
    model = insert(ResNet(nnx.Rngs(0)), 4, 2.0, seed=0)
    masks_before = jax.tree.map(np.asarray, nnx.state(model, Masks))
    params_before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    labels = jnp.arange(8) % 10

    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer[Any], x: jax.Array, y: jax.Array) -> jax.Array:
        def loss_fn(model: nnx.Module) -> jax.Array:
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    model.train()
    losses = [float(step(model, optimizer, IMAGES[:size], labels[:size])) for size in (8, 8, 5)]
    assert np.isfinite(losses).all()
    assert not jax.tree.leaves(nnx.state(optimizer.opt_state, Masks))
    assert jax.tree.all(jax.tree.map(np.array_equal, masks_before, nnx.state(model, Masks)))
    unchanged = jax.tree.map(np.array_equal, params_before, nnx.state(model, nnx.Param))
    assert not any(jax.tree.leaves(unchanged))


def test_split_merge_and_checkpoint_keep_the_masks(tmp_path: Path) -> None:
    model = insert(CNN(nnx.Rngs(0)), 4, 2.0, seed=0)
    model.eval()
    expected = np.asarray(model(IMAGES))
    graphdef, state = nnx.split(model)
    hash(graphdef)  # the report is a static attribute of the graph: it must be hashable for nnx.jit
    merged = nnx.merge(graphdef, state)
    assert merged.masksembles_report == model.masksembles_report
    assert_same_bits(merged(IMAGES), expected)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", nnx.state(model))
        checkpointer.wait_until_finished()
        # Built from another seed: the restored masks must be the saved ones.
        abstract = nnx.eval_shape(lambda: insert(CNN(nnx.Rngs(1)), 4, 2.0, seed=9))
        graphdef, abstract_state = nnx.split(abstract)
        restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "ckpt", abstract_state))
    restored.eval()
    assert_same_bits(restored(IMAGES), expected)


BAD_ARGUMENTS = {
    "n": (0, 2.0, None, None),
    "scale": (4, 0.5, None, None),
    "seed": (4, 2.0, -1, None),
    "start": (4, 2.0, None, 3),
}


@pytest.mark.parametrize("arguments", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_arguments_are_checked_like_every_framework(arguments: tuple[Any, Any, Any, Any]) -> None:
    n, scale, seed, start = arguments
    with raises_like(lambda: check_insert_arguments(*arguments)):
        insert(CNN(nnx.Rngs(0)), n, scale, seed=seed, start=start)


def test_a_model_must_be_a_module_with_a_layer_to_mask() -> None:
    with pytest.raises(TypeError, match=r"^insert needs an nnx\.Module; received list"):
        insert([CNN(nnx.Rngs(0))], 4, 2.0)  # type: ignore[type-var]
    with pytest.raises(ValueError, match=r"insert found no layer to put masks before \(1 candidates\)"):
        insert(nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0))), 4, 2.0)


class ReadsAKernel(nnx.Module):
    """Uses ``qkv``'s weights without calling it, as torchvision's shifted-window attention does with F.linear."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.stem = nnx.Linear(3, 8, rngs=rngs)
        self.qkv = nnx.Linear(8, 8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm(nnx.relu(self.stem(x)))
        return self.head(h @ self.qkv.kernel[...] + self.qkv.bias[...])


def test_a_layer_whose_weights_the_model_reads_outside_its_call_is_left_alone_with_example_input() -> None:
    x = jax.random.normal(jax.random.key(0), (6, 3))
    without = insert(ReadsAKernel(nnx.Rngs(0)), 4, 2.0, seed=0)
    with pytest.raises(AttributeError, match=r"does not forward attributes to its Linear: read \.layer\.kernel"):
        without(x)
    model = ReadsAKernel(nnx.Rngs(0))
    inserted = insert(model, 4, 2.0, seed=0, example_input=x)
    report = inserted.masksembles_report
    assert actions(report) == {"stem": LEFT, "qkv": LEFT, "head": INSERTED}
    assert report.unchanged[1].reason == (
        "its weights (kernel) are used by the model's own code outside its own call: a mask on its input would not "
        "apply there"
    )
    assert report.changed[0].seed == mc.derive_seed(0, 0)  # seeds count the layers that got masks
    assert isinstance(inserted.qkv, nnx.Linear) and isinstance(inserted.head, Masked)
    statistics = np.asarray(inserted.norm.mean[...]).copy()
    assert predict(inserted, x, 4).shape == (4, 6, 2)
    np.testing.assert_array_equal(np.asarray(inserted.norm.mean[...]), statistics)  # the trial ran on a clone


def test_a_model_that_fails_on_example_input_is_an_error_that_says_whether_masks_are_the_cause() -> None:
    with pytest.raises(ValueError, match="insert: the model fails on example_input without masks"):
        insert(ReadsAKernel(nnx.Rngs(0)), 4, 2.0, seed=0, example_input=jnp.ones((6, 5)))


def test_a_wrapped_layer_called_with_its_input_by_keyword_gets_it_masked() -> None:
    layer = insert(CNN(nnx.Rngs(0)), 4, 2.0, seed=0).linear2
    assert isinstance(layer, Masked)
    x = jax.random.normal(jax.random.key(1), (8, 32))
    np.testing.assert_array_equal(np.asarray(layer(inputs=x)), np.asarray(layer(x)))
    with pytest.raises(TypeError, match="needs the input of its Linear"):
        layer(other=x)
