"""insert and convert_dropout on transformers: layers inside custom layers (a TransformerEncoder's Dense and Dropout
attributes, MultiHeadAttention's) are reached, the model keeps its class and task API, trains, predicts and saves.

Models: the keras-hub-like replicas of tests/keras/hub_like.py always; keras-hub's ``BertTextClassifier`` and
``ViTImageClassifier`` from tiny configs (nothing downloaded) when the ``keras_hub`` backend is requested.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import masksembles_keras as mk
from masksembles_core.insertion import CONVERTED, INSERTED, LEFT
from tests.backends import requested_backends
from tests.keras.common import masks_of, run
from tests.keras.hub_like import Backbone, Classifier, Encoder, HeadClassifier, NamelessBackbone

N = 4
BATCH = 5  # not a multiple of N
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "keras.md"
ATTENTION = (
    r"attention-weight dropout \(applied to the output of Softmax '.*/softmax(_\d+)?'\): its input is attention "
    "weights, not channels"
)
FIRST = re.escape("the network's first layer: it reads the raw input (include_first=True masks it)")
OUTPUT_PROJECTION = re.escape("einsum 'abcd,cde->abe' contracts 2 axes of its input (c, d), not one channel axis")
HUB = "keras_hub" in requested_backends()


def text_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """What a BERT preprocessor returns: token ids, segment ids, and a padding mask with padding in every 2nd row."""
    rng = np.random.default_rng(seed)
    padding_mask = np.ones((BATCH, 8), "int32")
    padding_mask[::2, 6:] = 0
    token_ids = rng.integers(1, 50, (BATCH, 8)).astype("int32") * padding_mask
    return {"token_ids": token_ids, "segment_ids": np.zeros((BATCH, 8), "int32"), "padding_mask": padding_mask}


def replica() -> tuple[keras.Model, Any]:
    keras.utils.set_random_seed(0)
    return Classifier(Backbone(name="backbone"), name="classifier"), text_batch()


def bert() -> tuple[keras.Model, Any]:
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=16
    )
    return keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None), text_batch()


def vit() -> tuple[keras.Model, Any]:
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
        dropout_rate=0.1, attention_dropout=0.1,
    )  # fmt: skip
    classifier = keras_hub.models.ViTImageClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.1)
    return classifier, np.random.default_rng(0).normal(size=(BATCH, 16, 16, 3)).astype("float32")


MODELS: dict[str, Callable[[], tuple[keras.Model, Any]]] = {"replica": replica}
if HUB:
    MODELS.update(bert=bert, vit=vit)


# (model, operation) -> (layers looked at, layers given masks): BERT-like, 8 dropouts of which 2 attention-weight;
# ViT, its MLP's dropout (used twice) and 2 attention-weight dropouts left; insert: every Dense and the attention's
# query, key and value EinsumDense, not its output projection (ViT: nor the patch projection, a Conv2D that reads the
# image)
COUNTS = {
    ("replica", "convert_dropout"): (8, 6),
    ("replica", "insert"): (14, 12),
    ("bert", "convert_dropout"): (8, 6),
    ("bert", "insert"): (14, 12),
    ("vit", "convert_dropout"): (8, 4),
    ("vit", "insert"): (14, 11),
}


def surgery(model: keras.Model, operation: str, scale: float = 2.0) -> keras.Model:
    if operation == "convert_dropout":
        return mk.convert_dropout(model, N, scale, seed=0)
    return mk.insert(model, N, scale, seed=0)


def expected_row(name: str, path: str, operation: str) -> tuple[str, str]:
    """The action and the reason (a pattern) each layer of the three models gets."""
    if operation == "insert":  # ViT's patch projection, a Conv2D in a custom layer, reads the image
        if path.endswith("/patch_embedding"):
            return LEFT, FIRST
        return (LEFT, OUTPUT_PROJECTION) if path.endswith("/attention_output") else (INSERTED, "")
    if re.search(r"self_attention_layer/dropout|/mha/dropout", path):  # MultiHeadAttention's own dropout
        return LEFT, ATTENTION
    if name == "vit" and path.endswith("/mlp/dropout"):  # one Dropout called after both MLP Dense layers
        return LEFT, re.escape("called on inputs with different channel counts (16, 32)")
    return CONVERTED, ""


@pytest.mark.parametrize("operation", ["convert_dropout", "insert"])
@pytest.mark.parametrize("name", list(MODELS))
def test_surgery_reaches_inside_custom_layers_and_keeps_the_class(name: str, operation: str) -> None:
    model, _ = MODELS[name]()
    result = surgery(model, operation)
    report = result.masksembles_report
    assert isinstance(result, type(model)) and type(result).__name__ == type(model).__name__, "the task's class"
    assert type(result.backbone) is type(model.backbone), "the task API: its backbone"
    assert (len(report.rows), len(report.changed)) == COUNTS[name, operation], str(report)
    inside = [row for row in report.rows if row.path.count("/") >= 2]
    assert inside, "layers inside custom layers are looked at"
    for row in report.rows:
        action, reason = expected_row(name, row.path, operation)
        assert row.action == action and re.fullmatch(reason or "", row.reason), (row.path, row.action, row.reason)
    assert all(row.channels in (16, 32) and row.channel_axis == -1 for row in report.changed)
    assert not [layer for layer in model._flatten_layers() if isinstance(layer, mk.Masksembles)], "input unchanged"
    masks = [layer for layer in result._flatten_layers() if isinstance(layer, mk.Masksembles)]
    assert len(masks) == len(report.changed)


def test_the_replicas_layers_are_replaced_where_the_encoder_keeps_them() -> None:
    model, _ = replica()
    converted = mk.convert_dropout(model, N, 2.0, seed=0)
    encoder = converted.backbone.transformer_layers[1]
    assert isinstance(encoder, Encoder)
    assert type(encoder._feedforward_dropout) is mk.Masksembles1D
    assert encoder._feedforward_dropout.name == "feedforward_dropout"
    assert type(encoder._self_attention_layer._dropout_layer) is keras.layers.Dropout
    assert type(converted.get_layer("classifier_dropout")) is mk.Masksembles1D, "a graph layer, swapped in place"
    inserted = mk.insert(model, N, 2.0, seed=0)
    wrapped = inserted.backbone.transformer_layers[0]._feedforward_output_dense
    assert isinstance(wrapped, mk.Masked) and isinstance(wrapped.layer, keras.layers.Dense)
    assert wrapped.masksembles.channels == 32 and wrapped.name == "feedforward_output_dense"
    logits = inserted.get_layer("logits")
    assert isinstance(logits, mk.Masked) and logits.output is inserted.outputs[0]


@pytest.mark.parametrize("operation", ["convert_dropout", "insert"])
@pytest.mark.parametrize("name", list(MODELS))
def test_all_ones_masks_reproduce_the_model(name: str, operation: str) -> None:
    """scale=1: every weight copied, every layer in its place, the same outputs."""
    model, x = MODELS[name]()
    result = surgery(model, operation, scale=1.0)
    assert len(result.masksembles_report.changed) >= 4
    np.testing.assert_allclose(run(result, x), run(model, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("operation", ["convert_dropout", "insert"])
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_predicts_and_round_trips_a_keras_file(name: str, operation: str, tmp_path: Path) -> None:
    model, x = MODELS[name]()
    result = surgery(model, operation)
    result.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    masks = {id(layer): masks_of(layer) for layer in result._flatten_layers() if isinstance(layer, mk.Masksembles)}
    trainable = [keras.ops.convert_to_numpy(weight) for weight in result.trainable_weights]
    result.fit(x, np.arange(BATCH) % 3, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    after = [keras.ops.convert_to_numpy(weight) for weight in result.trainable_weights]
    assert all(not np.array_equal(a, b) for a, b in zip(trainable, after, strict=True)), "every weight trains"
    for layer in result._flatten_layers():
        if isinstance(layer, mk.Masksembles):
            assert np.array_equal(masks_of(layer), masks[id(layer)]), "masks are fixed"
    members = mk.predict(result, x)
    assert members.shape == (N, BATCH, 3) and np.isfinite(members).all()
    assert not np.allclose(members[0], members[1]), "the members differ"
    result.save(tmp_path / "model.keras")
    if name == "replica":
        loaded = keras.saving.load_model(tmp_path / "model.keras")
    else:  # Keras' own warnings for a model whose class has its own compile() (keras-hub tasks): compile it again
        with pytest.warns(UserWarning) as caught:
            loaded = keras.saving.load_model(tmp_path / "model.keras")
        assert {str(warning.message).split(" ")[0] for warning in caught} <= {"`compile()`", "Skipping"}
    assert isinstance(loaded, type(model)) and type(loaded.backbone) is type(model.backbone)
    assert [layer.path for layer in loaded._flatten_layers() if isinstance(layer, mk.Masksembles)] == [
        layer.path for layer in result._flatten_layers() if isinstance(layer, mk.Masksembles)
    ]
    np.testing.assert_array_equal(mk.predict(loaded, x), members)


@pytest.mark.parametrize(
    ("name", "operation"), [(name, "insert") for name in MODELS] + [("replica", "convert_dropout")]
)
def test_pack_and_extract_member_equal_predict_called_as_the_model_is(name: str, operation: str) -> None:
    """The task called with its own inputs (a dict for the text models): the packed model and a member equal
    ``predict`` in the task's output structure. The custom encoder layers run at full width and are listed; a layer
    ``insert`` wrapped (``Masked``) in the task's own graph compacts: the head."""
    model, x = MODELS[name]()
    result = surgery(model, operation)
    packed = mk.pack(result, x, program="packed")
    members = mk.predict(result, x)
    np.testing.assert_allclose(np.moveaxis(packed.predict(x, verbose=0), 1, 0), members, rtol=1e-5, atol=1e-6)
    member = mk.extract_member(result, 1, x)
    np.testing.assert_allclose(member.predict(x, verbose=0), members[1], rtol=1e-5, atol=1e-6)
    assert any(f.endswith("(Encoder)") or "encoder" in f.lower() for f in packed.fallbacks), packed.fallbacks
    # the task's graph compacts: the masks convert_dropout put in a dropout's node (which holds training=False), a
    # layer insert wrapped
    assert not [f for f in packed.fallbacks if f.endswith(("(Masksembles1D)", "(Masked)"))], packed.fallbacks
    assert packed.macs["packed"] < packed.macs["dense"]


def test_a_dropout_in_a_nested_sequential_head_is_converted_where_the_head_runs_it(tmp_path: Path) -> None:
    """A task whose class builds its graph, with a Sequential head (keras-hub's VGGImageClassifier): the masks
    replace the dropout in the head's layers and in the graph the head runs, so the members differ."""
    keras.utils.set_random_seed(0)
    model, x = HeadClassifier(Backbone(dropout=0.0, name="backbone"), name="classifier"), text_batch()
    converted = mk.convert_dropout(model, N, 2.0, seed=0)
    assert [row.path for row in converted.masksembles_report.changed] == ["head/head_dropout"]
    assert isinstance(converted, HeadClassifier) and type(converted.head.layers[1]) is mk.Masksembles1D
    members = mk.predict(converted, x)
    assert not np.allclose(members[0], members[1]), "the head's masks run"
    packed = mk.pack(converted, x, program="packed")
    np.testing.assert_allclose(np.moveaxis(packed.predict(x, verbose=0), 1, 0), members, rtol=1e-5, atol=1e-6)
    converted.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert type(loaded.head.layers[1]) is mk.Masksembles1D
    np.testing.assert_array_equal(mk.predict(loaded, x), members)


@pytest.mark.parametrize("operation", ["convert_dropout", "insert"])
@pytest.mark.parametrize("task", [Classifier, HeadClassifier])
def test_a_backbone_whose_config_drops_its_name_gets_masks_and_round_trips(
    task: type, operation: str, tmp_path: Path
) -> None:
    """keras-hub's VGGBackbone.get_config has no name: the task's copy (and a task loaded from a file) holds a backbone
    Keras names anew, where the masks must still go and load."""
    keras.utils.set_random_seed(0)
    model, x = task(NamelessBackbone(name="backbone"), name="classifier"), text_batch()
    result = surgery(model, operation)
    assert result.backbone.name != "backbone", "the copy's backbone has another name"
    inside = [row for row in result.masksembles_report.changed if row.path.startswith("backbone/")]
    masks = [layer for layer in result.backbone._flatten_layers() if isinstance(layer, mk.Masksembles)]
    assert inside and len(masks) == len(inside)
    np.testing.assert_allclose(run(surgery(model, operation, scale=1.0), x), run(model, x), rtol=1e-5, atol=1e-6)
    members = mk.predict(result, x)
    assert not np.allclose(members[0], members[1]), "the members differ"
    result.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.backbone.name != result.backbone.name, "loaded next to the copy: another name again"
    assert len([layer for layer in loaded.backbone._flatten_layers() if isinstance(layer, mk.Masksembles)]) == len(
        masks
    )
    np.testing.assert_array_equal(mk.predict(loaded, x), members)


def test_a_tied_embedding_the_graph_calls_twice_packs() -> None:
    """A ReversibleEmbedding called on the tokens and again as the output projection (keras-hub's causal LMs):
    one copy of it in the packed model, called at both places, equal to predict."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="token_ids")
    embedding = keras.layers.ReversibleEmbedding(50, 16, name="token_embedding")
    x = keras.layers.Dense(16, activation="gelu", name="hidden")(embedding(tokens))
    model = keras.Model(tokens, embedding(keras.layers.Dropout(0.1, name="drop")(x), reverse=True))
    x = text_batch()["token_ids"]
    for result in (mk.insert(model, N, 2.0, seed=0), mk.convert_dropout(model, N, 2.0, seed=0)):
        members = mk.predict(result, x)
        packed = mk.pack(result, x, program="packed")
        np.testing.assert_allclose(np.moveaxis(packed.predict(x, verbose=0), 1, 0), members, rtol=1e-5, atol=1e-6)
        copies = [layer for layer in packed._flatten_layers() if isinstance(layer, keras.layers.ReversibleEmbedding)]
        assert len(copies) == 1, "one copy, called twice"
        member = mk.extract_member(result, 2, x)
        np.testing.assert_allclose(member.predict(x, verbose=0), members[2], rtol=1e-5, atol=1e-6)


def test_a_keras_hub_task_keeps_its_task_api(tmp_path: Path) -> None:
    if not HUB:
        pytest.skip(f"backend 'keras_hub' not requested (MASKSEMBLES_TEST_BACKENDS={requested_backends()})")
    import keras_hub

    model, _ = bert()
    converted = mk.convert_dropout(model, N, 2.0, seed=0)
    assert isinstance(converted, keras_hub.models.BertTextClassifier) and converted.preprocessor is None
    assert isinstance(converted.backbone, keras_hub.models.BertBackbone)
    assert converted.backbone.token_embedding is converted.backbone.get_layer("token_embedding")
    converted.save_to_preset(tmp_path / "preset")
    assert (tmp_path / "preset" / "config.json").exists() and (tmp_path / "preset" / "task.json").exists()


@keras.saving.register_keras_serializable(package="masksembles_tests")
class Pair(keras.layers.Layer):  # type: ignore[misc]
    """Two custom layers holding one Dense (weights shared between them)."""

    def __init__(self, dense: keras.layers.Dense, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dense = dense
        self.drop = keras.layers.Dropout(0.2, name=f"{self.name}_drop")

    def call(self, x: Any) -> Any:
        return self.drop(self.dense(x))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "dense": keras.saving.serialize_keras_object(self.dense)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Pair:
        return cls(keras.saving.deserialize_keras_object(config.pop("dense")), **config)


def test_a_layer_two_custom_layers_hold_is_left_alone_and_stays_shared() -> None:
    inputs = keras.Input((6,))
    shared = keras.layers.Dense(6, name="shared")
    x = keras.layers.Dense(6, name="stem")(inputs)
    x = Pair(shared, name="second")(Pair(shared, name="first")(x))
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
    inserted = mk.insert(model, 2, 2.0, seed=0)
    rows = {row.path: (row.action, row.reason) for row in inserted.masksembles_report.rows}
    assert rows["first/shared"] == (
        LEFT,
        "its weights are used by custom layer 'second' (Pair) outside its own call: a mask on its input would not "
        "apply there",
    )
    assert rows["head"] == (INSERTED, "")
    converted = mk.convert_dropout(model, 2, 2.0, seed=0)
    assert [row.path for row in converted.masksembles_report.changed] == ["first/first_drop", "second/second_drop"]
    for result in (inserted, converted):
        first, second = result.get_layer("first"), result.get_layer("second")
        assert first.dense is second.dense, "the copy keeps the Dense shared"
        assert first.dense is not shared
    x = np.ones((2, 6), "float32")
    np.testing.assert_allclose(run(mk.convert_dropout(model, 2, 1.0), x), run(model, x), rtol=1e-6)


def guide_blocks() -> list[str]:
    """The Python blocks of docs/keras.md's "Transformers" section."""
    section = GUIDE.read_text().split("\n## Transformers\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)


def test_the_guide_transformers_section_runs(capsys: pytest.CaptureFixture[str]) -> None:
    if not HUB:
        pytest.skip(f"backend 'keras_hub' not requested (MASKSEMBLES_TEST_BACKENDS={requested_backends()})")
    blocks = guide_blocks()
    assert blocks
    namespace: dict[str, Any] = {"__name__": "guide_transformers"}
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/keras.md Transformers block {index}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "convert_dropout: Masksembles n=4" in out and "| nll |" in out
