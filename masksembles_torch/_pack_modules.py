"""torch.nn's transformer modules written out as the operations they compute in eval, so that ``pack`` can compact
and fold them.

torch.fx keeps a module of ``torch.nn`` as one call (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
``nn.TransformerEncoder`` branch on their arguments and on fused inference paths), and a call the capture cannot see
into runs at full width on the member-stacked batch, with any Masksembles layer inside it hidden. Where a call uses
no attention mask (a key padding mask is fine) and, for attention, no extra key/value bias and not its attention
weights, it computes exactly this:

- ``nn.TransformerEncoder``: its layers in turn, then its ``norm`` (with a padding mask, only where it would not turn
  the batch into a nested tensor, which zeroes the padded positions);
- ``nn.TransformerEncoderLayer``: its unfused path (``norm_first`` or not): self-attention, ``dropout1``, the
  residual sum, ``linear1``, the activation, ``dropout``, ``linear2``, ``dropout2``, the residual sum, the norms;
- ``nn.MultiheadAttention`` (``F.multi_head_attention_forward`` in eval): the query, key and value projections (one
  Linear over the packed ``in_proj_weight`` when query, key and value are one tensor), the heads split as (batch,
  heads, tokens, head_dim), ``F.scaled_dot_product_attention`` (no dropout in eval; the (batch, keys) padding mask
  as its (batch, 1, 1, keys) mask), the heads merged and ``out_proj``.

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
    """Write out the plain calls of ``gm``'s graph to ``nn.TransformerEncoder``, ``nn.TransformerEncoderLayer`` (the
    encoders' layers too) and ``nn.MultiheadAttention`` on batched (3-D) inputs; the graph is recompiled if any was.
    ``example``: the model's input, run once to see the attention's ranks if the graph has such a call."""
    written = False
    for kind, write_out in ((nn.TransformerEncoder, _encoder), (nn.TransformerEncoderLayer, _encoder_layer)):
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
    """Query, key and value of rank 3 and a key padding mask, if any, of rank 2 (batch, keys); not unbatched
    (L, E): attention across what is the batch here."""
    ranks = [values.get(name, (0, None))[0] for name in ("query", "key", "value")]
    return ranks == [3, 3, 3] and values.get("key_padding_mask", (2, None))[0] == 2


def _plain_calls(gm: fx.GraphModule, kind: type[nn.Module]) -> list[tuple[fx.Node, nn.Module]]:
    """The calls of ``gm``'s graph to a module of type ``kind`` that compute what its write-out does."""
    found = []
    for node in gm.graph.nodes:
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if isinstance(module, kind) and _PLAIN[kind](node, module):
            found.append((node, module))
    return found


def _arguments(node: fx.Node, module: nn.Module) -> dict[str, Any]:
    """The call's arguments by name, defaults included (empty where they do not fit ``forward``)."""
    try:
        bound = inspect.signature(module.forward).bind(*node.args, **node.kwargs)
    except TypeError:
        return {}
    bound.apply_defaults()
    return dict(bound.arguments)


def _no_masks(
    node: fx.Node, module: nn.Module, tensors: tuple[str, ...], masks: tuple[str, ...], padding: tuple[str, ...] = ()
) -> bool:
    """``tensors`` are model values, ``masks`` are None (but the ``padding`` one, None or a model value) and
    ``is_causal`` is not set."""
    arguments = _arguments(node, module)
    return (
        bool(arguments)
        and all(isinstance(arguments[name], fx.Node) for name in tensors)
        and all(arguments[name] is None or (name in padding and isinstance(arguments[name], fx.Node)) for name in masks)
        and not arguments["is_causal"]
    )


def _plain_encoder(node: fx.Node, module: nn.Module) -> bool:
    """No mask, and a padding mask only where the encoder does not turn the batch into a nested tensor (which
    zeroes the padded positions of its output)."""
    padding = () if getattr(module, "use_nested_tensor", False) else ("src_key_padding_mask",)
    return _no_masks(node, module, ("src",), ("mask", "src_key_padding_mask"), padding)


def _plain_encoder_layer(node: fx.Node, module: nn.Module) -> bool:
    """No mask but a padding mask, and an activation that can be written as a call: ReLU, GELU or a module."""
    activation = getattr(module, "activation", None)
    known = isinstance(activation, nn.Module) or activation in (F.relu, F.gelu)
    return known and _no_masks(node, module, ("src",), ("src_mask", "src_key_padding_mask"), ("src_key_padding_mask",))


def _plain_attention(node: fx.Node, module: nn.Module) -> bool:
    """No masks, extra key/value biases or zero attention, and nothing reads the attention weights."""
    assert isinstance(module, nn.MultiheadAttention)
    if module.bias_k is not None or module.bias_v is not None or module.add_zero_attn:
        return False
    if not _no_masks(node, module, ("query", "key", "value"), ("key_padding_mask", "attn_mask"), ("key_padding_mask",)):
        return False
    return all(  # (output, weights): the output read by index, the weights not at all
        user.target is operator.getitem and user.args[1] in (0, 1) and not (user.args[1] == 1 and user.users)
        for user in node.users
    )


_PLAIN: dict[type[nn.Module], Callable[[fx.Node, nn.Module], bool]] = {
    nn.TransformerEncoder: _plain_encoder,
    nn.TransformerEncoderLayer: _plain_encoder_layer,
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


def _encoder(gm: fx.GraphModule, node: fx.Node, module: nn.Module) -> None:
    assert isinstance(module, nn.TransformerEncoder)
    graph, write = gm.graph, _Writer(gm, node, module)
    arguments = _arguments(node, module)
    padding = (
        {} if arguments["src_key_padding_mask"] is None else {"src_key_padding_mask": arguments["src_key_padding_mask"]}
    )
    with graph.inserting_before(node):
        x = arguments["src"]
        for index in range(len(module.layers)):
            x = write.submodule(f"layers.{index}", x, **padding)
        if module.norm is not None:
            x = write.submodule("norm", x)
    write.replace(x)


def _encoder_layer(gm: fx.GraphModule, node: fx.Node, module: nn.Module) -> None:
    assert isinstance(module, nn.TransformerEncoderLayer)
    graph, write = gm.graph, _Writer(gm, node, module)

    padding = _arguments(node, module)["src_key_padding_mask"]
    options = {} if padding is None else {"key_padding_mask": padding}

    def attention(x: fx.Node) -> fx.Node:
        attended = write.submodule("self_attn", x, x, x, need_weights=False, **options)
        return write.submodule("dropout1", write.call(operator.getitem, attended, 0))

    def feed_forward(x: fx.Node) -> fx.Node:
        hidden = write.submodule("linear1", x)
        if isinstance(module.activation, nn.Module):
            hidden = write.submodule("activation", hidden)
        else:
            hidden = write.call(module.activation, hidden)
        return write.submodule("dropout2", write.submodule("linear2", write.submodule("dropout", hidden)))

    with graph.inserting_before(node):
        x = _arguments(node, module)["src"]
        if module.norm_first:
            x = write.call(operator.add, x, attention(write.submodule("norm1", x)))
            x = write.call(operator.add, x, feed_forward(write.submodule("norm2", x)))
        else:
            x = write.submodule("norm1", write.call(operator.add, x, attention(x)))
            x = write.submodule("norm2", write.call(operator.add, x, feed_forward(x)))
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
        mask = None
        if "key_padding_mask" in seen:  # (batch, keys): True (or -inf) where a key is left out, as (B, 1, 1, S)
            given = arguments["key_padding_mask"]
            if seen["key_padding_mask"][1] is torch.bool:
                kept = write.call(operator.eq, given, False)  # SDPA's boolean masks say which keys take part
            else:
                kept = write.call("to", given, seen["query"][1])
            mask = write.call(operator.getitem, kept, (slice(None), None, None, slice(None)))
        attended = write.call(F.scaled_dot_product_attention, q, k, v, mask)
        merged = write.call("flatten", write.call("permute", attended, tuple(to_heads.index(a) for a in range(4))), 2)
        output = write.submodule("out_proj", merged)
    for user in list(node.users):  # (output, weights)[0] reads the output; the unread weights go
        if user.args[1] == 0:
            user.replace_all_uses_with(output)
        graph.erase_node(user)
    graph.erase_node(node)
