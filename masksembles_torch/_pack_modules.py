"""torch.nn's transformer modules written out as the operations they compute in eval, so that ``pack`` can compact
and fold them.

torch.fx keeps a module of ``torch.nn`` as one call (``nn.MultiheadAttention`` and the encoder and decoder modules
branch on their arguments and on fused inference paths), and a call the capture cannot see into runs at full width
on the member-stacked batch, with any Masksembles layer inside it hidden. Where a call's masks are None or model
values, its ``is_causal`` hints constants and, for attention, it has no extra key/value bias and nothing reads its
attention weights, it computes exactly this:

- ``nn.TransformerEncoder``: its layers in turn, each given the mask, the padding mask and the hint, then its
  ``norm`` (with a padding mask and no mask, only where it would not turn the batch into a nested tensor, which
  zeroes the padded positions);
- ``nn.TransformerEncoderLayer``: its unfused path (``norm_first`` or not): self-attention, ``dropout1``, the
  residual sum, ``linear1``, the activation, ``dropout``, ``linear2``, ``dropout2``, the residual sum, the norms;
- ``nn.TransformerDecoder``: its layers in turn, then its ``norm``; ``nn.TransformerDecoderLayer``: self-attention
  (``tgt_mask``), ``dropout1``, attention on ``memory`` (``memory_mask``), ``dropout2``, the feed-forward with
  ``dropout3``, each with its residual sum and norm (``norm_first`` or not);
- ``nn.MultiheadAttention`` (``F.multi_head_attention_forward`` in eval): the query, key and value projections (one
  Linear over the packed ``in_proj_weight`` when query, key and value are one tensor), the heads split as (batch,
  heads, tokens, head_dim), ``F.scaled_dot_product_attention`` (no dropout in eval) with the masks merged as torch
  merges them (below), the heads merged and ``out_proj``.

The masks, as ``F.multi_head_attention_forward`` merges them: a boolean mask is additive, -inf where True (left out),
0 elsewhere; a (L, S) ``attn_mask`` broadcasts over the batch and heads, a (batch * heads, L, S) one is split as
(batch, heads, L, S); a (batch, S) ``key_padding_mask`` is added as (batch, 1, 1, S) (alone, as SDPA's boolean or
additive mask). ``is_causal`` is a hint that needs an ``attn_mask``: where no padding mask is given and the weights
are not asked for (``need_weights=False``, as the encoder and decoder layers call it), torch drops the mask and runs
SDPA with ``is_causal=True``; otherwise the mask is used. An encoder or decoder called without the hint (None)
detects whether its mask is causal and passes that on; its layers are given ``False`` here, so they use the mask,
which then equals the causal mask that torch would apply.

The capture replaces such calls by those operations, reading the modules' own submodules and parameters, before it
classifies anything: Linear layers and norms then compact, Masksembles layers inside are seen, and the attention
folds like any other (``_pack_attention``). Any other call is left as it is and stays a fallback.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from ._surgery import Masked


def write_out_torch_modules(gm: fx.GraphModule, example: Tensor) -> None:
    """Write out the plain calls of ``gm``'s graph to torch's transformer encoder and decoder modules (the layers of
    those written out too) and to ``nn.MultiheadAttention`` on batched (3-D) inputs; the graph is recompiled if any
    was. ``example``: the model's input, run once to see the attention's ranks if the graph has such a call."""
    written = False
    for kind, write_out in (
        (nn.TransformerEncoder, _encoder),
        (nn.TransformerEncoderLayer, _encoder_layer),
        (nn.TransformerDecoder, _decoder),
        (nn.TransformerDecoderLayer, _decoder_layer),
    ):
        for node, module in _plain_calls(gm, kind):
            write_out(gm, node, module)
            written = True
    calls = dict(_plain_calls(gm, nn.MultiheadAttention))
    if calls:
        seen = _Seen(gm, calls)
        with torch.no_grad():
            seen.run(example)
        for node, module in calls.items():
            if _batched(seen.values.get(node, {})):
                _attention(gm, node, module, seen.values[node])
                written = True
    if written:
        gm.graph.eliminate_dead_code()
        gm.recompile()


class _Seen(fx.Interpreter):
    """Runs the graph, noting the (rank, dtype) of the tensor arguments of the attention calls asked for."""

    def __init__(self, gm: fx.GraphModule, calls: dict[fx.Node, nn.Module]) -> None:
        super().__init__(gm)
        self.calls, self.values = calls, dict[fx.Node, dict[str, tuple[int, torch.dtype]]]()

    def run_node(self, n: fx.Node) -> Any:
        if n in self.calls:
            arguments = _arguments(n, self.calls[n])
            values = {name: self.env.get(value) for name, value in arguments.items() if isinstance(value, fx.Node)}
            self.values[n] = {name: (v.dim(), v.dtype) for name, v in values.items() if isinstance(v, Tensor)}
        return super().run_node(n)


def _batched(values: dict[str, tuple[int, torch.dtype]]) -> bool:
    """Query, key and value of rank 3, a key padding mask, if any, of rank 2 (batch, keys) and an attention mask, if
    any, of rank 2 (L, S) or 3 (batch * heads, L, S), the masks boolean or floating (as torch requires); not
    unbatched (L, E): attention across what is the batch here."""
    ranks = [values.get(name, (0, None))[0] for name in ("query", "key", "value")]
    masks = [values[name] for name in ("key_padding_mask", "attn_mask") if name in values]
    return (
        ranks == [3, 3, 3]
        and values.get("key_padding_mask", (2, None))[0] == 2
        and values.get("attn_mask", (2, None))[0] in (2, 3)
        and all(dtype is torch.bool or dtype.is_floating_point for _, dtype in masks)
    )


def _plain_calls(gm: fx.GraphModule, kind: type[nn.Module]) -> list[tuple[fx.Node, nn.Module]]:
    """The calls of ``gm``'s graph to a module of type ``kind`` that compute what its write-out does (a subclass only
    where it keeps every method of ``kind``: one that changes ``forward`` or a block of it computes something else)."""
    found = []
    for node in gm.graph.nodes:
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if isinstance(module, kind) and _unchanged(module, kind) and _PLAIN[kind](node, module):
            found.append((node, module))
    return found


def _unchanged(module: nn.Module, kind: type[nn.Module]) -> bool:
    methods = [name for name, value in vars(kind).items() if inspect.isfunction(value) and not name.startswith("__")]
    return all(getattr(type(module), name) is getattr(kind, name) for name in methods)


def _arguments(node: fx.Node, module: nn.Module) -> dict[str, Any]:
    """The call's arguments by name, defaults included (empty where they do not fit ``forward``)."""
    try:
        bound = inspect.signature(module.forward).bind(*node.args, **node.kwargs)
    except TypeError:
        return {}
    bound.apply_defaults()
    return dict(bound.arguments)


def _known_call(
    node: fx.Node, module: nn.Module, tensors: tuple[str, ...], masks: tuple[str, ...], flags: tuple[str, ...]
) -> bool:
    """``tensors`` are model values, ``masks`` None or model values, and ``flags`` (the ``is_causal`` hints, a
    ``need_weights``) constants: True, False or None."""
    arguments = _arguments(node, module)
    return (
        bool(arguments)
        and all(isinstance(arguments[name], fx.Node) for name in tensors)
        and all(arguments[name] is None or isinstance(arguments[name], fx.Node) for name in masks)
        and all(arguments[name] in (None, True, False) for name in flags)
    )


def _known_activation(module: nn.Module) -> bool:
    """An activation that can be written as a call: ReLU, GELU or a module."""
    activation = getattr(module, "activation", None)
    return isinstance(activation, nn.Module) or activation in (F.relu, F.gelu)


def _plain_encoder(node: fx.Node, module: nn.Module) -> bool:
    """A padding mask only where the encoder does not turn the batch into a nested tensor (which zeroes the padded
    positions of its output): with a mask too, or ``use_nested_tensor`` off."""
    if not _known_call(node, module, ("src",), ("mask", "src_key_padding_mask"), ("is_causal",)):
        return False
    arguments = _arguments(node, module)
    nested = getattr(module, "use_nested_tensor", False) and arguments["mask"] is None
    return arguments["src_key_padding_mask"] is None or not nested


def _plain_encoder_layer(node: fx.Node, module: nn.Module) -> bool:
    return _known_activation(module) and _known_call(
        node, module, ("src",), ("src_mask", "src_key_padding_mask"), ("is_causal",)
    )


_DECODER_MASKS = ("tgt_mask", "memory_mask", "tgt_key_padding_mask", "memory_key_padding_mask")


def _plain_decoder(node: fx.Node, module: nn.Module) -> bool:
    return _known_call(node, module, ("tgt", "memory"), _DECODER_MASKS, ("tgt_is_causal", "memory_is_causal"))


def _plain_decoder_layer(node: fx.Node, module: nn.Module) -> bool:
    return _known_activation(module) and _plain_decoder(node, module)


def _plain_attention(node: fx.Node, module: nn.Module) -> bool:
    """No extra key/value biases or zero attention, a causal hint only with a mask (torch refuses it without), and
    nothing reads the attention weights."""
    assert isinstance(module, nn.MultiheadAttention)
    if module.bias_k is not None or module.bias_v is not None or module.add_zero_attn:
        return False
    masks = ("key_padding_mask", "attn_mask")
    if not _known_call(node, module, ("query", "key", "value"), masks, ("is_causal", "need_weights")):
        return False
    arguments = _arguments(node, module)
    if arguments["is_causal"] and arguments["attn_mask"] is None:
        return False
    return all(  # (output, weights): the output read by index, the weights not at all
        user.target is operator.getitem and user.args[1] in (0, 1) and not (user.args[1] == 1 and user.users)
        for user in node.users
    )


_PLAIN: dict[type[nn.Module], Callable[[fx.Node, nn.Module], bool]] = {
    nn.TransformerEncoder: _plain_encoder,
    nn.TransformerEncoderLayer: _plain_encoder_layer,
    nn.TransformerDecoder: _plain_decoder,
    nn.TransformerDecoderLayer: _plain_decoder_layer,
    nn.MultiheadAttention: _plain_attention,
}


class _Writer:
    """Nodes written before ``node``, a call of a module: calls of functions, methods, its submodules and
    parameters, each attributed to that module (``nn_module_stack``, as torch.fx records it)."""

    def __init__(self, gm: fx.GraphModule, node: fx.Node, module: nn.Module) -> None:
        self.gm, self.graph, self.node, self.path = gm, gm.graph, node, str(node.target)
        self.stack = {**node.meta.get("nn_module_stack", {}), self.path: (self.path, type(module))}

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        """``target(*args, **kwargs)``: a function, or a method by its name."""
        op = "call_method" if isinstance(target, str) else "call_function"
        return self._made(self.graph.create_node(op, target, args, kwargs))

    def submodule(self, name: str, *args: Any, **kwargs: Any) -> fx.Node:
        """A call of the submodule ``name``; an ``insert`` wrapper as its masks, then its layer."""
        path = f"{self.path}.{name}"
        if isinstance(self.gm.get_submodule(path), Masked):
            masked = self._made(self.graph.call_module(f"{path}.masksembles", args[:1]))
            return self._made(self.graph.call_module(f"{path}.layer", (masked, *args[1:]), kwargs))
        return self._made(self.graph.call_module(path, args, kwargs))

    def parameter(self, name: str) -> fx.Node:
        return self._made(self.graph.get_attr(f"{self.path}.{name}"))

    def _made(self, node: fx.Node) -> fx.Node:
        node.meta["nn_module_stack"] = self.stack
        return node

    def replace(self, output: fx.Node) -> None:
        """Readers of the call read ``output``; the call is removed."""
        self.node.replace_all_uses_with(output)
        self.graph.erase_node(self.node)


def _given(values: dict[str, Any]) -> dict[str, Any]:
    """The values that are not None."""
    return {name: value for name, value in values.items() if value is not None}


def _encoder(gm: fx.GraphModule, node: fx.Node, module: nn.Module) -> None:
    """Its layers, given the masks as the encoder's call was, and the hint as given (None: False, the mask used)."""
    assert isinstance(module, nn.TransformerEncoder)
    graph, write = gm.graph, _Writer(gm, node, module)
    arguments = _arguments(node, module)
    options = _given({"src_mask": arguments["mask"], "src_key_padding_mask": arguments["src_key_padding_mask"]})
    if arguments["is_causal"]:
        options["is_causal"] = True
    with graph.inserting_before(node):
        x = arguments["src"]
        for index in range(len(module.layers)):
            x = write.submodule(f"layers.{index}", x, **options)
        if module.norm is not None:
            x = write.submodule("norm", x)
    write.replace(x)


def _decoder(gm: fx.GraphModule, node: fx.Node, module: nn.Module) -> None:
    """Its layers, given the masks and hints as the decoder's call was (``tgt_is_causal`` None: False)."""
    assert isinstance(module, nn.TransformerDecoder)
    graph, write = gm.graph, _Writer(gm, node, module)
    arguments = _arguments(node, module)
    options = _given({name: arguments[name] for name in _DECODER_MASKS})
    options.update({name: True for name in ("tgt_is_causal", "memory_is_causal") if arguments[name]})
    with graph.inserting_before(node):
        x = arguments["tgt"]
        for index in range(len(module.layers)):
            x = write.submodule(f"layers.{index}", x, arguments["memory"], **options)
        if module.norm is not None:
            x = write.submodule("norm", x)
    write.replace(x)


def _feed_forward(write: _Writer, module: nn.Module, x: fx.Node, last_dropout: str) -> fx.Node:
    """``linear1``, the activation, ``dropout``, ``linear2`` and ``last_dropout``, as a layer's ``_ff_block``."""
    hidden = write.submodule("linear1", x)
    if isinstance(module.activation, nn.Module):
        hidden = write.submodule("activation", hidden)
    else:
        hidden = write.call(module.activation, hidden)
    return write.submodule(last_dropout, write.submodule("linear2", write.submodule("dropout", hidden)))


def _attention_block(
    write: _Writer, name: str, dropout: str, query: fx.Node, memory: fx.Node, masks: dict[str, Any], causal: bool | None
) -> fx.Node:
    """``dropout(name(query, memory, memory, attn_mask, key_padding_mask, need_weights=False, is_causal)[0])``;
    ``masks``: the attention mask and the padding mask, by the layer's names, each None or a model value."""
    attn_mask, key_padding_mask = masks.values()
    options = _given({"attn_mask": attn_mask, "key_padding_mask": key_padding_mask})
    if causal:
        options["is_causal"] = True
    attended = write.submodule(name, query, memory, memory, need_weights=False, **options)
    return write.submodule(dropout, write.call(operator.getitem, attended, 0))


def _encoder_layer(gm: fx.GraphModule, node: fx.Node, module: nn.Module) -> None:
    assert isinstance(module, nn.TransformerEncoderLayer)
    graph, write = gm.graph, _Writer(gm, node, module)
    arguments = _arguments(node, module)
    masks = {name: arguments[name] for name in ("src_mask", "src_key_padding_mask")}

    def attention(x: fx.Node) -> fx.Node:
        return _attention_block(write, "self_attn", "dropout1", x, x, masks, arguments["is_causal"])

    with graph.inserting_before(node):
        x = arguments["src"]
        if module.norm_first:
            x = write.call(operator.add, x, attention(write.submodule("norm1", x)))
            x = write.call(operator.add, x, _feed_forward(write, module, write.submodule("norm2", x), "dropout2"))
        else:
            x = write.submodule("norm1", write.call(operator.add, x, attention(x)))
            x = write.submodule("norm2", write.call(operator.add, x, _feed_forward(write, module, x, "dropout2")))
    write.replace(x)


def _decoder_layer(gm: fx.GraphModule, node: fx.Node, module: nn.Module) -> None:
    assert isinstance(module, nn.TransformerDecoderLayer)
    graph, write = gm.graph, _Writer(gm, node, module)
    arguments = _arguments(node, module)
    memory = arguments["memory"]

    def self_attention(x: fx.Node) -> fx.Node:
        masks = {name: arguments[name] for name in ("tgt_mask", "tgt_key_padding_mask")}
        return _attention_block(write, "self_attn", "dropout1", x, x, masks, arguments["tgt_is_causal"])

    def cross_attention(x: fx.Node) -> fx.Node:
        masks = {name: arguments[name] for name in ("memory_mask", "memory_key_padding_mask")}
        return _attention_block(write, "multihead_attn", "dropout2", x, memory, masks, arguments["memory_is_causal"])

    with graph.inserting_before(node):
        x = arguments["tgt"]
        if module.norm_first:
            x = write.call(operator.add, x, self_attention(write.submodule("norm1", x)))
            x = write.call(operator.add, x, cross_attention(write.submodule("norm2", x)))
            x = write.call(operator.add, x, _feed_forward(write, module, write.submodule("norm3", x), "dropout3"))
        else:
            x = write.submodule("norm1", write.call(operator.add, x, self_attention(x)))
            x = write.submodule("norm2", write.call(operator.add, x, cross_attention(x)))
            x = write.submodule("norm3", write.call(operator.add, x, _feed_forward(write, module, x, "dropout3")))
    write.replace(x)


def _attention(gm: fx.GraphModule, node: fx.Node, module: nn.Module, seen: dict[str, tuple[int, torch.dtype]]) -> None:
    """``seen``: the rank and dtype of each tensor argument."""
    assert isinstance(module, nn.MultiheadAttention)
    arguments = _arguments(node, module)
    query, key, value = (arguments[name] for name in ("query", "key", "value"))
    graph, write = gm.graph, _Writer(gm, node, module)
    heads, width = module.num_heads, module.embed_dim
    head_dim = width // heads
    # (batch, heads, tokens, head_dim) from (tokens, batch, heads, head_dim) or (batch, tokens, heads, head_dim)
    to_heads = (0, 2, 1, 3) if module.batch_first else (1, 2, 0, 3)

    def parameter(name: str, part: int | None = None) -> fx.Node | None:
        if getattr(module, name) is None:
            return None
        read = write.parameter(name)
        return read if part is None else write.call(operator.getitem, read, slice(part * width, (part + 1) * width))

    def projected(x: fx.Node, part: int) -> fx.Node:
        if module._qkv_same_embed_dim:
            weight = parameter("in_proj_weight", part)
        else:
            weight = parameter(("q_proj_weight", "k_proj_weight", "v_proj_weight")[part])
        linear = write.call(F.linear, x, weight, parameter("in_proj_bias", part))
        return write.call("permute", write.call("unflatten", linear, -1, (heads, head_dim)), to_heads)

    with graph.inserting_before(node):
        if module._qkv_same_embed_dim and query is key is value:  # one Linear; its output split as (3, heads, dim)
            fused = write.call(F.linear, query, parameter("in_proj_weight"), parameter("in_proj_bias"))
            split = write.call("unflatten", fused, -1, (3, heads, head_dim))
            parts = write.call("unbind", write.call("permute", split, (2, *(a + (a > 1) for a in to_heads))), 0)
            q, k, v = (write.call(operator.getitem, parts, i) for i in range(3))
        else:
            q, k, v = (projected(x, part) for part, x in enumerate((query, key, value)))
        if _causal(arguments):  # torch drops the mask and passes the hint on
            attended = write.call(F.scaled_dot_product_attention, q, k, v, None, is_causal=True)
        else:
            attended = write.call(F.scaled_dot_product_attention, q, k, v, _mask(write, arguments, seen, heads))
        merged = write.call("flatten", write.call("permute", attended, tuple(to_heads.index(a) for a in range(4))), 2)
        output = write.submodule("out_proj", merged)
    for user in list(node.users):  # (output, weights)[0] reads the output; the unread weights go
        if user.args[1] == 0:
            user.replace_all_uses_with(output)
        graph.erase_node(user)
    graph.erase_node(node)


def _causal(arguments: dict[str, Any]) -> bool:
    """Whether ``F.multi_head_attention_forward`` runs SDPA with ``is_causal=True`` and no mask: the hint given, and
    neither a padding mask (merged into the mask) nor the weights (computed from the mask) asked for."""
    return bool(arguments["is_causal"]) and arguments["key_padding_mask"] is None and not arguments["need_weights"]


def _mask(
    write: _Writer, arguments: dict[str, Any], seen: dict[str, tuple[int, torch.dtype]], heads: int
) -> fx.Node | None:
    """SDPA's mask for (batch, heads, L, S) scores, as ``F.multi_head_attention_forward`` merges the call's masks:
    the (L, S) or (batch * heads, L, S) -> (batch, heads, L, S) ``attn_mask`` plus the (batch, S) padding mask as
    (batch, 1, 1, S), each additive (a boolean one -inf where True); the padding mask alone as SDPA's boolean mask
    (True where a key takes part) or additive mask. None without masks."""
    dtype = seen["query"][1]
    keys = (slice(None), None, None, slice(None))  # (batch, S) -> (batch, 1, 1, S)
    attn_mask, padding = arguments["attn_mask"], arguments["key_padding_mask"]
    if attn_mask is None:
        if padding is None:
            return None
        if seen["key_padding_mask"][1] is torch.bool:
            kept = write.call(operator.eq, padding, False)  # SDPA's boolean masks say which keys take part
        else:
            kept = write.call("to", padding, dtype)
        return write.call(operator.getitem, kept, keys)

    def additive(name: str) -> fx.Node:  # torch's _canonical_mask
        given: fx.Node = arguments[name]
        if seen[name][1] is not torch.bool:
            return given
        return write.call("masked_fill", write.call(torch.zeros_like, given, dtype=dtype), given, float("-inf"))

    mask = additive("attn_mask")
    if seen["attn_mask"][0] == 3:
        mask = write.call("unflatten", mask, 0, (-1, heads))
    if padding is not None:
        mask = write.call(operator.add, mask, write.call(operator.getitem, additive("key_padding_mask"), keys))
    return mask
