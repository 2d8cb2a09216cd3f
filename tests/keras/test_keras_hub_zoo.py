"""keras-hub 0.32 models beyond BERT and ViT, each from a tiny config (nothing downloaded), as a user runs them:
``convert_dropout`` or ``insert`` with its defaults, ``predict`` on a batch of 6 (which 4 members do not divide), one
``fit`` step, a ``.keras`` round trip, and ``pack``/``extract_member`` equal to ``predict``.

Collected when the ``keras_hub`` backend is requested (as tests/keras/test_transformers.py). Three models run by
default (a causal LM with a tied embedding, an image task with a ``Sequential`` head, a backbone with two outputs);
the others are marked ``slow`` (``-m slow``). Not here: ``convert_dropout`` on ``MobileNetImageClassifier`` (it has
no dropout). ``VGGBackbone.get_config`` leaves out the backbone's name, so the copy ``insert`` makes (and the model
loaded from its file) holds a backbone Keras names anew. Gemma's projections are all ``EinsumDense`` layers:
``insert`` masks those whose equation contracts the last axis alone (each decoder's report is checked by
``test_a_decoders_projections_get_masks_where_their_equation_allows``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import masksembles_keras as mk
from masksembles_core.insertion import INSERTED, LEFT
from masksembles_keras._pack_capture import example_leaves
from tests.backends import requested_backends

if "keras_hub" not in requested_backends():
    pytest.skip(
        f"backend 'keras_hub' not requested (MASKSEMBLES_TEST_BACKENDS={requested_backends()})", allow_module_level=True
    )

import keras_hub

# a decoder backbone with an untied output projection (Llama, Mistral) never uses it: no gradient reaches it
pytestmark = pytest.mark.filterwarnings("ignore:Gradients do not exist for variables .*reverse_embeddings:UserWarning")
N = 4
BATCH = 6  # not a multiple of N
LENGTH = 8
VOCABULARY = 64
TEXT = {"num_layers": 2, "hidden_dim": 32, "intermediate_dim": 64}  # and 2 heads
DECODER = {"num_layers": 2, "num_query_heads": 2, "num_key_value_heads": 1, "hidden_dim": 32, "intermediate_dim": 64}
hub = keras_hub.models


def text_inputs(model: keras.Model) -> dict[str, np.ndarray]:
    """What the task's preprocessor returns, for the inputs the model declares: padding in every 2nd row."""
    rng = np.random.default_rng(0)
    padding_mask = np.ones((BATCH, LENGTH), "int32")
    padding_mask[::2, 6:] = 0
    given = {
        "token_ids": rng.integers(1, VOCABULARY, (BATCH, LENGTH)).astype("int32") * padding_mask,
        "padding_mask": padding_mask,
        "segment_ids": np.zeros((BATCH, LENGTH), "int32"),
    }
    return {name: given[name] for name in model.input}


def images(size: int = 32) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(BATCH, size, size, 3)).astype("float32")


def text_task(task: type, backbone: keras.Model, **options: Any) -> tuple[keras.Model, Any]:
    model = task(backbone, num_classes=3, preprocessor=None, **options)
    return model, text_inputs(model)


def distil_bert() -> tuple[keras.Model, Any]:
    backbone = hub.DistilBertBackbone(vocabulary_size=VOCABULARY, num_heads=2, max_sequence_length=16, **TEXT)
    return text_task(hub.DistilBertTextClassifier, backbone)


def roberta() -> tuple[keras.Model, Any]:
    backbone = hub.RobertaBackbone(vocabulary_size=VOCABULARY, num_heads=2, max_sequence_length=16, **TEXT)
    return text_task(hub.RobertaTextClassifier, backbone, dropout=0.1)


def xlm_roberta() -> tuple[keras.Model, Any]:
    backbone = hub.XLMRobertaBackbone(vocabulary_size=VOCABULARY, num_heads=2, max_sequence_length=16, **TEXT)
    return text_task(hub.XLMRobertaTextClassifier, backbone, dropout=0.1)


def albert() -> tuple[keras.Model, Any]:
    backbone = hub.AlbertBackbone(
        vocabulary_size=VOCABULARY, num_heads=2, embedding_dim=16, dropout=0.1, max_sequence_length=16, **TEXT
    )
    return text_task(hub.AlbertTextClassifier, backbone)


def deberta_v3() -> tuple[keras.Model, Any]:
    backbone = hub.DebertaV3Backbone(
        vocabulary_size=VOCABULARY, num_heads=2, max_sequence_length=16, bucket_size=4, **TEXT
    )
    return text_task(hub.DebertaV3TextClassifier, backbone, dropout=0.1)


def electra() -> tuple[keras.Model, Any]:
    backbone = hub.ElectraBackbone(vocab_size=VOCABULARY, num_heads=2, embedding_dim=16, max_sequence_length=16, **TEXT)
    return backbone, text_inputs(backbone)


def gpt2() -> tuple[keras.Model, Any]:
    backbone = hub.GPT2Backbone(vocabulary_size=VOCABULARY, num_heads=2, max_sequence_length=16, **TEXT)
    model = hub.GPT2CausalLM(backbone, preprocessor=None)
    return model, text_inputs(model)


def opt() -> tuple[keras.Model, Any]:
    backbone = hub.OPTBackbone(vocabulary_size=VOCABULARY, num_heads=2, max_sequence_length=16, **TEXT)
    return backbone, text_inputs(backbone)


def gemma() -> tuple[keras.Model, Any]:
    backbone = hub.GemmaBackbone(vocabulary_size=VOCABULARY, head_dim=16, dropout=0.1, **DECODER)
    return backbone, text_inputs(backbone)


def gemma3() -> tuple[keras.Model, Any]:
    """Text only (no vision encoder: ``image_size`` is not used)."""
    backbone = hub.Gemma3Backbone(vocabulary_size=VOCABULARY, image_size=16, head_dim=16, dropout=0.1, **DECODER)
    return backbone, text_inputs(backbone)


def llama() -> tuple[keras.Model, Any]:
    backbone = hub.LlamaBackbone(vocabulary_size=VOCABULARY, dropout=0.1, **DECODER)
    return backbone, text_inputs(backbone)


def mistral() -> tuple[keras.Model, Any]:
    backbone = hub.MistralBackbone(vocabulary_size=VOCABULARY, sliding_window=8, dropout=0.1, **DECODER)
    return backbone, text_inputs(backbone)


def qwen() -> tuple[keras.Model, Any]:
    backbone = hub.QwenBackbone(vocabulary_size=VOCABULARY, dropout=0.1, **DECODER)
    return backbone, text_inputs(backbone)


def phi3() -> tuple[keras.Model, Any]:
    backbone = hub.Phi3Backbone(vocabulary_size=VOCABULARY, dropout=0.1, **DECODER)
    return backbone, text_inputs(backbone)


def resnet_backbone() -> keras.Model:
    return hub.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 32],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block", image_shape=(32, 32, 3),
    )  # fmt: skip


def resnet() -> tuple[keras.Model, Any]:
    return hub.ResNetImageClassifier(resnet_backbone(), num_classes=3, preprocessor=None, dropout=0.1), images()


def deit() -> tuple[keras.Model, Any]:
    backbone = hub.DeiTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64,
        dropout_rate=0.1, attention_dropout=0.1,
    )  # fmt: skip
    return hub.DeiTImageClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.1), images(16)


def efficientnet() -> tuple[keras.Model, Any]:
    backbone = hub.EfficientNetBackbone(  # num_features left at its default: the config does not keep it
        stackwise_width_coefficients=[1.0, 1.0], stackwise_depth_coefficients=[1.0, 1.0],
        stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1], stackwise_input_filters=[8, 8],
        stackwise_output_filters=[8, 16], stackwise_expansion_ratios=[1, 2],
        stackwise_squeeze_and_excite_ratios=[0.0, 0.25], stackwise_strides=[1, 2],
        stackwise_block_types=["fused", "unfused"], stackwise_force_input_filters=[0, 0],
        stackwise_nores_option=[False, False], dropout=0.1, input_shape=(32, 32, 3),
    )  # fmt: skip
    return hub.EfficientNetImageClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.1), images()


def mobilenet() -> tuple[keras.Model, Any]:
    backbone = hub.MobileNetBackbone(
        stackwise_expansion=[[16, 24], [32, 48]], stackwise_num_blocks=[2, 2],
        stackwise_num_filters=[[8, 8], [16, 16]], stackwise_kernel_size=[[3, 3], [3, 3]],
        stackwise_num_strides=[[2, 1], [2, 1]], stackwise_se_ratio=[[None, None], [0.25, 0.25]],
        stackwise_activation=[["relu", "relu"], ["hard_swish", "hard_swish"]], stackwise_padding=[[1, 1], [1, 1]],
        output_num_filters=32, depthwise_filters=8, depthwise_stride=1, depthwise_residual=False,
        last_layer_filter=32, squeeze_and_excite=0.5, image_shape=(32, 32, 3), input_num_filters=8,
    )  # fmt: skip
    return hub.MobileNetImageClassifier(backbone, num_classes=3, num_features=32, preprocessor=None), images()


def vgg() -> tuple[keras.Model, Any]:
    backbone = hub.VGGBackbone(stackwise_num_repeats=[1, 1], stackwise_num_filters=[8, 16], image_shape=(32, 32, 3))
    return hub.VGGImageClassifier(
        backbone, num_classes=3, preprocessor=None, pooling_hidden_dim=32, dropout=0.1
    ), images()


def densenet() -> tuple[keras.Model, Any]:
    backbone = hub.DenseNetBackbone(stackwise_num_repeats=[1, 1], growth_rate=8, image_shape=(32, 32, 3))
    return hub.DenseNetImageClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.1), images()


def xception() -> tuple[keras.Model, Any]:
    backbone = hub.XceptionBackbone(
        stackwise_conv_filters=[[8, 8], [16, 16], [32, 32]], stackwise_pooling=[True, True, False],
        image_shape=(32, 32, 3),
    )  # fmt: skip
    return hub.XceptionImageClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.1), images()


def swin() -> tuple[keras.Model, Any]:
    backbone = hub.SwinTransformerBackbone(
        image_shape=(32, 32, 3), embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4, patch_size=4,
        dropout_rate=0.1, attention_dropout=0.1, drop_path=0.1,
    )  # fmt: skip
    return hub.SwinTransformerImageClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.1), images()


def sequential_resnet() -> tuple[keras.Model, Any]:
    """A keras-hub backbone as a layer of a Sequential model."""
    layers = [keras.layers.GlobalAveragePooling2D(), keras.layers.Dropout(0.1), keras.layers.Dense(3)]
    return keras.Sequential([keras.Input((32, 32, 3)), resnet_backbone(), *layers]), images()


def functional_distil_bert() -> tuple[keras.Model, Any]:
    """A keras-hub backbone called by a functional model on its dict of inputs."""
    backbone = hub.DistilBertBackbone(vocabulary_size=VOCABULARY, num_heads=2, max_sequence_length=16, **TEXT)
    inputs = {name: keras.Input((None,), dtype="int32", name=name) for name in ("token_ids", "padding_mask")}
    x = keras.layers.Dropout(0.1)(backbone(inputs)[:, 0, :])
    x = keras.layers.Dense(32, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    return model, text_inputs(model)


MODELS: dict[str, Callable[[], tuple[keras.Model, Any]]] = {
    builder.__name__: builder
    for builder in (
        distil_bert, roberta, xlm_roberta, albert, deberta_v3, electra, gpt2, opt, gemma, gemma3, llama, mistral, qwen,
        phi3, resnet, deit, efficientnet, mobilenet, vgg, densenet, xception, swin, sequential_resnet,
        functional_distil_bert,
    )
}  # fmt: skip
SKIPPED = {("mobilenet", "convert_dropout")}  # module docstring
DEFAULT = {("gpt2", "insert"), ("vgg", "convert_dropout"), ("electra", "convert_dropout")}
# Keras' warnings about keras-hub's Swin when it is built (and copied through its config): its stages have no
# build(), its blocks pass a masked tensor to its window attention
SWIN_BUILD = pytest.mark.filterwarnings("ignore::UserWarning:keras")
CASES = [
    pytest.param(
        name,
        operation,
        id=f"{name}-{operation}",
        marks=[
            *(() if (name, operation) in DEFAULT else [pytest.mark.slow]),
            *([SWIN_BUILD] if name == "swin" else []),
        ],
    )
    for name in MODELS
    for operation in ("convert_dropout", "insert")
    if (name, operation) not in SKIPPED
]


def surgery(model: keras.Model, operation: str) -> keras.Model:
    if operation == "convert_dropout":
        return mk.convert_dropout(model, N, 2.0, seed=0)
    return mk.insert(model, N, 2.0, seed=0)


def targets(model: keras.Model, x: Any) -> tuple[Any, Any]:
    """Labels and a loss for one training step: class labels for the tasks' logits (per token for a causal LM),
    zeros and a squared error for each output of a backbone."""
    outputs = model(x, training=False)
    if isinstance(model, keras_hub.models.Backbone):
        zeros = keras.tree.map_structure(lambda y: np.zeros(tuple(y.shape), "float32"), outputs)
        return zeros, keras.tree.map_structure(lambda _: "mse", outputs)
    shape = tuple(outputs.shape[:-1])
    labels = np.arange(int(np.prod(shape))).reshape(shape) % 3
    return labels, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def assert_close(actual: Any, expected: Any) -> None:
    for a, e in zip(keras.tree.flatten(actual), keras.tree.flatten(expected), strict=True):
        assert a.shape == e.shape
        assert float(np.max(np.abs(a - e))) <= 1e-5 * float(np.max(np.abs(e))), float(np.max(np.abs(a - e)))


@pytest.mark.parametrize(("name", "operation"), CASES)
def test_a_keras_hub_model_gets_members_that_train_save_and_pack(name: str, operation: str, tmp_path: Path) -> None:
    keras.utils.set_random_seed(0)
    model, x = MODELS[name]()
    result = surgery(model, operation)
    assert type(result).__name__ == type(model).__name__ and isinstance(result, type(model)), "the model's class"
    assert result.masksembles_report.changed, str(result.masksembles_report)

    before = mk.predict(result, x)
    first = keras.tree.flatten(before)[0]
    assert first.shape[:2] == (N, BATCH) and all(np.isfinite(leaf).all() for leaf in keras.tree.flatten(before))
    assert not np.allclose(first[0], first[1]), "the members differ"

    labels, loss = targets(result, x)
    result.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    result.fit(x, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    members = mk.predict(result, x)
    assert not np.allclose(keras.tree.flatten(members)[0], first), "the step changed the weights"

    result.save(tmp_path / "model.keras")
    with warnings.catch_warnings():  # Keras' own: a keras-hub task loads with its default compilation
        warnings.simplefilter("ignore", UserWarning)
        loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert type(loaded).__name__ == type(model).__name__
    for a, b in zip(keras.tree.flatten(mk.predict(loaded, x)), keras.tree.flatten(members), strict=True):
        np.testing.assert_array_equal(a, b)

    packed = mk.pack(result, x, program="packed")
    assert_close(keras.tree.map_structure(lambda y: np.moveaxis(y, 1, 0), packed.predict(x, verbose=0)), members)
    member = mk.extract_member(result, 1, x)
    assert_close(member.predict(x, verbose=0), keras.tree.map_structure(lambda y: y[1], members))


def xlnet() -> tuple[keras.Model, Any]:
    """XLNet's encoder layers return their memory as None (no ``mems`` asked for) beside their output."""
    backbone = hub.XLNetBackbone(vocabulary_size=VOCABULARY, num_heads=2, dropout=0.1, **TEXT)
    return backbone, text_inputs(backbone)


def esm() -> tuple[keras.Model, Any]:
    """A task whose one input is a dict of one key (``{"token_ids": ...}``)."""
    backbone = hub.ESMBackbone(vocabulary_size=VOCABULARY, num_heads=2, max_sequence_length=16, **TEXT)
    return hub.ESMProteinClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.1), text_inputs(backbone)


@pytest.mark.parametrize("build", [xlnet, esm])
def test_a_model_with_a_none_output_or_a_one_key_dict_input_packs(build: Callable[[], tuple[keras.Model, Any]]) -> None:
    """Regression: ``pack`` of XLNet crashed on the None its encoders return ("Invalid dtype: object" on torch), and
    ESM's dict input was refused ("batch of at least 1 ... received ()"); both equal ``predict`` now, with the input
    structure the model takes."""
    keras.utils.set_random_seed(0)
    model, x = build()
    result = mk.insert(model, N, 2.0, seed=0)
    members = mk.predict(result, x)
    packed = mk.pack(result, x, program="packed")
    assert_close(keras.tree.map_structure(lambda y: np.moveaxis(y, 1, 0), packed.predict(x, verbose=0)), members)
    member = mk.extract_member(result, 2, x)
    assert_close(member.predict(x, verbose=0), keras.tree.map_structure(lambda y: y[2], members))
    if len(x) == 1:  # the bare array of a one-key dict is the same example
        (bare,) = x.values()
        assert [leaf.tolist() for leaf in example_leaves(result, bare)] == [bare.tolist()]


OUTPUT_PROJECTION = r"einsum '\w+,\w+->\w+' contracts 2 axes of its input \(\w, \w\), not one channel axis"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma", "gemma3", "llama", "mistral", "qwen", "phi3"])
def test_a_decoders_projections_get_masks_where_their_equation_allows(name: str) -> None:
    """``insert``'s default on the decoders, as PyTorch's on ``transformers``' (every Linear layer): in each block
    the attention's query, key and value projections and the three MLP layers (Gemma's are EinsumDense layers too)
    get masks (hidden size, or the intermediate size for the MLP's last layer); the attention output projection, an
    EinsumDense that contracts the heads and the head size together, is left alone with that reason."""
    model, _ = MODELS[name]()
    report = mk.insert(model, N, 2.0, seed=0).masksembles_report
    blocks = {row.path.split("/")[0] for row in report.rows}
    assert len(blocks) == DECODER["num_layers"]
    for block in blocks:
        actions = sorted(row.action for row in report.rows if row.path.split("/")[0] == block)
        assert actions == [INSERTED] * 6 + [LEFT], str(report)
    for row in report.unchanged:
        assert row.layer == "EinsumDense" and row.path.endswith("/attention_output"), str(report)
        assert re.fullmatch(OUTPUT_PROJECTION, row.reason), row.reason
    widths = {DECODER["hidden_dim"], DECODER["intermediate_dim"], DECODER["intermediate_dim"] // 2}
    assert {row.channels for row in report.changed} <= widths, str(report)
