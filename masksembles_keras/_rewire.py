"""Replacing a layer inside a built layer or model in place, and saving models changed that way.

``insert`` and ``convert_dropout`` rebuild Sequential and functional graphs (``_surgery._Rebuilder``). What a graph
cannot describe is changed here, in a copy of the model: a layer a custom layer holds as an attribute (keras-hub's
``TransformerEncoder`` holds its ``Dense`` and ``Dropout`` layers and calls them in its ``call``), and a layer of a
functional model whose class builds its own graph in ``__init__`` (keras-hub's ``BertBackbone`` and tasks), which a
rebuilt graph would turn into a plain ``Functional``. ``replace`` swaps one layer object for another where its holder
keeps it: attributes (lists, tuples and dicts of layers too), the holder's tracked layers and, for a functional
holder, the graph nodes that call it (for a Sequential holder, its layer list and the graph it runs). This reads
Keras internals (``_tracker``, ``_layers``, ``_functional``, ``_nodes_by_depth``, ``_operations``,
``_keras_history``), which Keras has no public API for; the Keras tests run every path on the three backends.

A model changed that way no longer equals what its class builds from its config, so its class becomes a subclass
(``rewired_class``: same name, same methods) whose config holds the class's own config and the list of changes;
``keras.saving.load_model`` builds the class from its config and makes the same changes again before loading the
weights, so masks and weights come back. Each change is a ``Locator``, the path of steps from the model to the
replaced layer (a graph layer's index in its model's ``layers``, an attribute, an item of a list or dict). A graph
layer is found by its place, not its name: a model built from its class's config has the same layers in the same order,
but not always their names (keras-hub's ``VGGBackbone.get_config`` leaves its name out, and Keras names a layer built
without one anew: ``vgg_backbone_1`` next to ``vgg_backbone``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import keras

from ._layers import SERIALIZATION_PACKAGE, Masksembles

Step = tuple[str, Any]  # ("layer", index in layers, or name) in a graph, ("attr", name), ("item", index or key)
Locator = tuple[Step, ...]

# Keras' own bookkeeping attributes that hold layers: not places where a layer's code keeps its sublayers (and on
# the TensorFlow backend, the checkpoint dependencies ``tf.Module``'s tracking keeps)
_BOOKKEEPING = frozenset(
    {
        "_layers",
        "_operations",
        "_operations_by_depth",
        "nnx_operations",
        "_nnx_op_mapping",
        "_self_unconditional_checkpoint_dependencies",
        "_self_unconditional_dependency_names",
        "_self_unconditional_deferred_dependencies",
        "_self_name_based_restores",
        "_self_saveable_object_factories",
    }
)


def _attributes(layer: Any) -> dict[str, Any]:
    """The layer's attributes; on the torch backend sublayers live in ``_modules`` (a ``torch.nn.Module``)."""
    found = dict(vars(layer))
    found.update(found.pop("_modules", None) or {})
    return {name: value for name, value in found.items() if name not in _BOOKKEEPING}


def held_layers(layer: Any) -> Iterator[tuple[tuple[Step, ...], Any]]:
    """The layers ``layer`` holds as attributes, directly or in a list, tuple or dict, with the steps to each."""
    for name, value in sorted(_attributes(layer).items()):
        if isinstance(value, keras.layers.Layer):
            yield (("attr", name),), value
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                if isinstance(item, keras.layers.Layer):
                    yield (("attr", name), ("item", index)), item
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, keras.layers.Layer) and isinstance(key, str | int):
                    yield (("attr", name), ("item", key)), item


def holder_of(root: Any, locator: Sequence[Step]) -> Any:
    """The layer or model that keeps the layer at ``locator`` (its attribute, or a layer of its graph)."""
    last = max(index for index, (kind, _) in enumerate(locator) if kind in ("attr", "layer"))
    return resolve(root, locator[:last])


def resolve(root: Any, locator: Sequence[Step]) -> Any:
    """The object at ``locator`` from ``root``."""
    current = root
    for kind, key in locator:
        if kind == "layer":
            current = current.get_layer(index=key) if isinstance(key, int) else current.get_layer(key)
        elif kind == "attr":
            current = _attributes(current)[key]
        else:
            current = current[key]
    return current


class _Unlocked:
    """Keras locks a built layer's tracker (no new sublayers); a replacement is allowed in, once."""

    def __init__(self, layer: Any) -> None:
        self.tracker: Any = getattr(layer, "_tracker", None)
        self.locked = bool(self.tracker is not None and self.tracker.locked)

    def __enter__(self) -> None:
        if self.locked:
            self.tracker.unlock()

    def __exit__(self, *error: object) -> None:
        if self.locked:
            self.tracker.locked = True


def _retrack(holder: Any, old: Any, new: Any) -> None:
    """Put ``new`` where ``old`` is in the holder's tracked layers (same place: the weights keep their order)."""
    tracker = getattr(holder, "_tracker", None)
    if tracker is None or "layers" not in tracker.config:
        return
    store = tracker.config["layers"][1]
    ids = tracker.stored_ids["layers"]
    for index, layer in enumerate(store):
        if layer is old:
            store[index] = new
            ids.discard(id(old))
            ids.add(id(new))
            return


def _replace_in_graph(graph: Any, old: Any, new: Any) -> None:
    """Every node of the functional ``graph`` that calls ``old`` calls ``new`` instead."""
    for nodes in graph._nodes_by_depth.values():
        for node in nodes:
            if node.operation is old:
                node.operation = new
                new._inbound_nodes.append(node)
                for tensor in node.outputs:  # ``layer.output`` and new graphs built from these tensors find ``new``
                    history = tensor._keras_history
                    tensor._keras_history = type(history)(new, len(new._inbound_nodes) - 1, history.tensor_index)
    graph._operations[:] = [new if op is old else op for op in graph._operations]
    for ops in graph._operations_by_depth.values():
        ops[:] = [new if op is old else op for op in ops]


def replace(holder: Any, old: Any, new: Any) -> None:
    """Replace layer ``old`` by layer ``new`` wherever ``holder`` keeps or calls it (not in other layers)."""
    with _Unlocked(holder):
        _retrack(holder, old, new)
        for name, value in _attributes(holder).items():
            if value is old:
                setattr(holder, name, new)
            elif isinstance(value, list):
                value[:] = [new if item is old else item for item in value]
            elif isinstance(value, tuple) and any(item is old for item in value):
                setattr(holder, name, type(value)(new if item is old else item for item in value))
            elif isinstance(value, dict):
                for key, item in list(value.items()):
                    if item is old:
                        value[key] = new
        if isinstance(holder, keras.Function):
            _replace_in_graph(holder, old, new)
        if isinstance(holder, keras.Sequential):  # its layer list, and the graph it runs once built
            holder._layers[:] = [new if layer is old else layer for layer in holder._layers]
            if holder._functional is not None:
                _replace_in_graph(holder._functional, old, new)


def apply_change(root: Any, change: dict[str, Any]) -> None:
    """Make one recorded change (``record``) in ``root``: masks in place of the layer, or a ``Masked`` wrapper."""
    locator = tuple((kind, key) for kind, key in change["locator"])
    holder, old = holder_of(root, locator), resolve(root, locator)
    masks = keras.saving.deserialize_keras_object(change["masks"])
    masks.build(tuple(change["input_shape"]))
    replace(holder, old, Masked(masks, old, name=old.name) if change["wrap"] else masks)


def record(locator: Locator, masks: Masksembles, input_shape: Sequence[int | None], wrap: bool) -> dict[str, Any]:
    """A change as ``apply_change`` makes it again: JSON-ready, saved in the model's config."""
    return {
        "locator": [list(step) for step in locator],
        "masks": keras.saving.serialize_keras_object(masks),
        "input_shape": list(input_shape),
        "wrap": wrap,
    }


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class Masked(keras.layers.Layer):  # type: ignore[misc]  # keras is untyped: Layer is Any to mypy
    """A layer whose input gets Masksembles masks: ``layer(masksembles(x), *args, **kwargs)``. Made by ``insert``
    inside custom layers and in functional models whose class builds its graph itself.

    Args:
        masksembles: the Masksembles layer applied to the first input.
        layer: the wrapped layer (a Dense, a Conv2D, ...), called on the masked input; its weights stay its own
            (``masked.layer.kernel``).

    Shape:
        input: what ``layer`` takes, with ``masksembles.channels`` channels on ``masksembles.channel_axis``;
        output: what ``layer`` returns.
    """

    def __init__(self, masksembles: Masksembles, layer: keras.layers.Layer, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.masksembles = masksembles
        self.layer = layer
        self.built = masksembles.built and layer.built

    def build(self, input_shape: Sequence[int | None]) -> None:
        self.masksembles.build(input_shape)
        self.layer.build(input_shape)

    def call(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """``layer`` on the masked ``inputs``: (B, ...) -> ``layer``'s output."""
        return self.layer(self.masksembles(inputs), *args, **kwargs)

    def compute_output_shape(self, input_shape: Sequence[int | None]) -> Any:
        return self.layer.compute_output_shape(input_shape)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "masksembles": keras.saving.serialize_keras_object(self.masksembles),
            "layer": keras.saving.serialize_keras_object(self.layer),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Masked:
        config = dict(config)
        masks = keras.saving.deserialize_keras_object(config.pop("masksembles"))
        return cls(masks, keras.saving.deserialize_keras_object(config.pop("layer")), **config)


class Rewired:
    """Mixed into the class of a model changed in place (``rewired_class``): its config is its class's config and
    the list of changes, and ``from_config`` builds the class and makes the changes again."""

    masksembles_changes: list[dict[str, Any]]

    def get_config(self) -> dict[str, Any]:
        base = type(self).__mro__[2]  # rewired_class(base) is (Rewired, base)
        model = {
            "module": base.__module__,
            "class_name": base.__name__,
            "registered_name": keras.saving.get_registered_name(base),
            "config": keras.saving.serialize_keras_object(super().get_config()),  # type: ignore[misc]
        }
        return {"model": model, "changes": self.masksembles_changes}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        model = keras.saving.deserialize_keras_object(config["model"], custom_objects=custom_objects)
        for change in config["changes"]:
            apply_change(model, change)
        mark_rewired(model, config["changes"])
        return model


keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)(Rewired)
_REWIRED_CLASSES: dict[type, type] = {}


def rewired_class(base: type) -> type:
    """The subclass of ``base`` that saves its changes (one per base class, registered as ``masksembles>Rewired``:
    any of them loads any rewired model)."""
    if base not in _REWIRED_CLASSES:
        rewired = type(base.__name__, (Rewired, base), {"__module__": __name__, "__qualname__": base.__qualname__})
        keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE, name="Rewired")(rewired)
        _REWIRED_CLASSES[base] = rewired
    return _REWIRED_CLASSES[base]


def mark_rewired(model: Any, changes: list[dict[str, Any]]) -> None:
    """Make ``model`` (changed in place by ``changes``) save and load its changes."""
    base = type(model).__mro__[2] if isinstance(model, Rewired) else type(model)
    object.__setattr__(model, "masksembles_changes", changes)
    model.__class__ = rewired_class(base)
