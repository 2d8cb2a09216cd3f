"""Small models written the way keras-hub writes its transformers (read from keras-team/keras-hub 0.32:
``TransformerEncoder``, ``BertBackbone``, ``BertTextClassifier``), so the Keras tests cover its patterns without
keras-hub installed.

- ``Encoder``: a custom layer that creates its sublayers in ``build()`` as attributes (a ``MultiHeadAttention``, two
  ``LayerNormalization``, the feedforward ``Dense`` pair and two ``Dropout``) and calls them in its own ``call``,
  with a padding mask; its config holds hyperparameters only.
- ``Backbone``: a functional model whose class builds its graph in ``__init__`` from hyperparameters (token,
  position and segment embeddings, a dropout, the encoders, a pooled ``Dense`` on the first token) and returns a
  dict; ``from_config`` is ``cls(**config)``.
- ``Classifier``: a task holding a backbone (``classifier.backbone``), a dropout and a ``Dense`` head on the pooled
  output; its config serializes the backbone.
- ``HeadClassifier``: a task whose head is a nested ``Sequential`` (keras-hub's ``VGGImageClassifier``).
- ``NamelessBackbone``: a ``Backbone`` whose config leaves out its name (keras-hub's ``VGGBackbone``).
"""

from __future__ import annotations

from typing import Any, Self

import keras
from keras import layers, ops

PACKAGE = "masksembles_tests"


@keras.saving.register_keras_serializable(package=PACKAGE)
class Encoder(layers.Layer):  # type: ignore[misc]
    """A post-norm encoder block: attention, dropout, residual, norm; feedforward, dropout, residual, norm."""

    def __init__(self, intermediate_dim: int, num_heads: int, dropout: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.intermediate_dim, self.num_heads, self.dropout = intermediate_dim, num_heads, dropout

    def build(self, inputs_shape: tuple[int | None, ...]) -> None:
        hidden = inputs_shape[-1]
        self._self_attention_layer = layers.MultiHeadAttention(
            self.num_heads, hidden // self.num_heads, dropout=self.dropout, name="self_attention_layer"
        )
        self._self_attention_layer.build(inputs_shape, inputs_shape)
        self._self_attention_layer_norm = layers.LayerNormalization(name="self_attention_layer_norm")
        self._self_attention_layer_norm.build(inputs_shape)
        self._self_attention_dropout = layers.Dropout(self.dropout, name="self_attention_dropout")
        self._feedforward_layer_norm = layers.LayerNormalization(name="feedforward_layer_norm")
        self._feedforward_layer_norm.build(inputs_shape)
        self._feedforward_intermediate_dense = layers.Dense(
            self.intermediate_dim, activation="gelu", name="feedforward_intermediate_dense"
        )
        self._feedforward_intermediate_dense.build(inputs_shape)
        self._feedforward_output_dense = layers.Dense(hidden, name="feedforward_output_dense")
        self._feedforward_output_dense.build((*inputs_shape[:-1], self.intermediate_dim))
        self._feedforward_dropout = layers.Dropout(self.dropout, name="feedforward_dropout")
        self.built = True

    def call(self, inputs: Any, padding_mask: Any = None, training: bool | None = None) -> Any:
        mask = None if padding_mask is None else ops.cast(padding_mask, "bool")[:, None, :]
        x = self._self_attention_layer(query=inputs, value=inputs, attention_mask=mask, training=training)
        x = self._self_attention_layer_norm(self._self_attention_dropout(x, training=training) + inputs)
        residual = x
        x = self._feedforward_output_dense(self._feedforward_intermediate_dense(x))
        return self._feedforward_layer_norm(self._feedforward_dropout(x, training=training) + residual)

    def compute_output_shape(self, inputs_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return inputs_shape

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "intermediate_dim": self.intermediate_dim,
            "num_heads": self.num_heads,
            "dropout": self.dropout,
        }


@keras.saving.register_keras_serializable(package=PACKAGE)
class PositionEmbedding(layers.Layer):  # type: ignore[misc]
    """A learned position embedding added by the caller: (B, L, H) -> (B, L, H), rows 0..L-1 of its table."""

    def __init__(self, sequence_length: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sequence_length = sequence_length

    def build(self, inputs_shape: tuple[int | None, ...]) -> None:
        self.position_embeddings = self.add_weight(name="embeddings", shape=(self.sequence_length, inputs_shape[-1]))

    def call(self, inputs: Any) -> Any:
        length = ops.shape(inputs)[1]
        return ops.broadcast_to(self.position_embeddings[None, :length, :], ops.shape(inputs))

    def compute_output_shape(self, inputs_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return inputs_shape

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "sequence_length": self.sequence_length}


@keras.saving.register_keras_serializable(package=PACKAGE)
class Backbone(keras.Model):  # type: ignore[misc]
    """A BERT-like backbone built in ``__init__``: {"token_ids", "segment_ids", "padding_mask"} ->
    {"sequence_output": (B, L, H), "pooled_output": (B, H)}."""

    def __init__(
        self,
        vocabulary_size: int = 50,
        num_layers: int = 2,
        num_heads: int = 2,
        hidden_dim: int = 16,
        intermediate_dim: int = 32,
        max_sequence_length: int = 16,
        dropout: float = 0.1,
        **kwargs: Any,
    ) -> None:
        token_ids = keras.Input((None,), dtype="int32", name="token_ids")
        segment_ids = keras.Input((None,), dtype="int32", name="segment_ids")
        padding_mask = keras.Input((None,), dtype="int32", name="padding_mask")
        token_embedding = layers.Embedding(vocabulary_size, hidden_dim, name="token_embedding")
        tokens = token_embedding(token_ids)
        positions = PositionEmbedding(max_sequence_length, name="position_embedding")(tokens)
        segments = layers.Embedding(2, hidden_dim, name="segment_embedding")(segment_ids)
        x = layers.Add(name="embeddings_add")([tokens, positions, segments])
        x = layers.LayerNormalization(name="embeddings_layer_norm")(x)
        x = layers.Dropout(dropout, name="embeddings_dropout")(x)
        transformer_layers = []
        for index in range(num_layers):
            encoder = Encoder(intermediate_dim, num_heads, dropout, name=f"transformer_layer_{index}")
            transformer_layers.append(encoder)
            x = encoder(x, padding_mask=padding_mask)
        pooled = layers.Dense(hidden_dim, activation="tanh", name="pooled_dense")(x[:, 0, :])
        super().__init__(
            inputs={"token_ids": token_ids, "segment_ids": segment_ids, "padding_mask": padding_mask},
            outputs={"sequence_output": x, "pooled_output": pooled},
            **kwargs,
        )
        self.token_embedding, self.transformer_layers = token_embedding, transformer_layers
        self.vocabulary_size, self.num_layers, self.num_heads = vocabulary_size, num_layers, num_heads
        self.hidden_dim, self.intermediate_dim = hidden_dim, intermediate_dim
        self.max_sequence_length, self.dropout = max_sequence_length, dropout

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "trainable": self.trainable,
            "vocabulary_size": self.vocabulary_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "hidden_dim": self.hidden_dim,
            "intermediate_dim": self.intermediate_dim,
            "max_sequence_length": self.max_sequence_length,
            "dropout": self.dropout,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Backbone:
        return cls(**config)


@keras.saving.register_keras_serializable(package=PACKAGE)
class NamelessBackbone(Backbone):
    """A ``Backbone`` whose ``get_config`` leaves out its name, as keras-hub's ``VGGBackbone.get_config`` does: a copy
    built from its config, or a model loaded from a file, gets a name Keras makes up (``nameless_backbone_1``)."""

    def get_config(self) -> dict[str, Any]:
        return {key: value for key, value in super().get_config().items() if key != "name"}


class Task(keras.Model):  # type: ignore[misc]
    """A task on a ``Backbone`` whose config holds the backbone, as keras-hub's tasks hold theirs."""

    backbone: Backbone
    num_classes: int
    dropout: float

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backbone": keras.saving.serialize_keras_object(self.backbone),
            "num_classes": self.num_classes,
            "dropout": self.dropout,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)


@keras.saving.register_keras_serializable(package=PACKAGE)
class Classifier(Task):
    """A text classifier task: the backbone's pooled output, a dropout and a Dense head of ``num_classes`` logits."""

    def __init__(self, backbone: Backbone, num_classes: int = 3, dropout: float = 0.1, **kwargs: Any) -> None:
        inputs = backbone.input
        x = layers.Dropout(dropout, name="classifier_dropout")(backbone(inputs)["pooled_output"])
        outputs = layers.Dense(num_classes, name="logits")(x)
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.backbone, self.num_classes, self.dropout = backbone, num_classes, dropout


@keras.saving.register_keras_serializable(package=PACKAGE)
class HeadClassifier(Task):
    """A task whose head is a nested ``Sequential`` (a Dense, a dropout, the logits), as keras-hub's
    ``VGGImageClassifier`` builds its ``head``, on the backbone's pooled output."""

    def __init__(self, backbone: Backbone, num_classes: int = 3, dropout: float = 0.1, **kwargs: Any) -> None:
        head = keras.Sequential(
            [
                layers.Dense(backbone.hidden_dim, activation="relu", name="fc"),
                layers.Dropout(dropout, name="head_dropout"),
                layers.Dense(num_classes, name="predictions"),
            ],
            name="head",
        )
        inputs = backbone.input
        super().__init__(inputs=inputs, outputs=head(backbone(inputs)["pooled_output"]), **kwargs)
        self.backbone, self.head, self.num_classes, self.dropout = backbone, head, num_classes, dropout
