"""``nn.MultiheadAttention`` written out as the operations it computes in eval, so that ``pack`` can fold it.

torch.fx keeps ``nn.MultiheadAttention`` as one call (its ``forward`` branches on its arguments), and a call the
capture cannot see into runs at full width on the member-stacked batch. Where a call uses no mask, no extra key/value
bias and not its attention weights, it computes exactly this (``F.multi_head_attention_forward`` in eval): the query,
key and value projections (one Linear over the packed ``in_proj_weight`` when query, key and value are one tensor),
the heads split as (batch, heads, tokens, head_dim), ``F.scaled_dot_product_attention`` (no dropout in eval), the
heads merged and ``out_proj``. The capture replaces such a call by those operations, reading the module's own
parameters, before it classifies anything: the region then folds like any other attention (``_pack_attention``). Any
other call is left as it is and stays a fallback.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn


def write_out_multihead_attention(gm: fx.GraphModule, example: Tensor) -> None:
    """Replace every ``nn.MultiheadAttention`` call of ``gm``'s graph that computes plain attention on batched
    (3-D) inputs by its operations (the graph is recompiled if any was). ``example``: the model's input, run once to
    see the ranks if the graph has such a call."""
    calls: dict[fx.Node, nn.MultiheadAttention] = {}
    for node in gm.graph.nodes:
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if isinstance(module, nn.MultiheadAttention) and _plain(node, module):
            calls[node] = module
    if not calls:
        return
    ranks = _Ranks(gm, calls)
    with torch.no_grad():
        ranks.run(example)
    for node, module in calls.items():
        if ranks.seen.get(node) == (3, 3, 3):  # not unbatched (L, E): attention across what is the batch here
            _write_out(gm.graph, node, module)
    gm.graph.eliminate_dead_code()
    gm.recompile()


class _Ranks(fx.Interpreter):
    """Runs the graph, noting the ranks of the query, key and value of the calls asked for."""

    def __init__(self, gm: fx.GraphModule, calls: dict[fx.Node, nn.MultiheadAttention]) -> None:
        super().__init__(gm)
        self.calls, self.seen = calls, dict[fx.Node, tuple[int, ...]]()

    def run_node(self, n: fx.Node) -> Any:
        if n in self.calls:
            arguments = _arguments(n, self.calls[n])
            assert arguments is not None
            values = [self.env[arguments[name]] for name in ("query", "key", "value")]
            self.seen[n] = tuple(v.dim() if isinstance(v, Tensor) else -1 for v in values)
        return super().run_node(n)


def _arguments(node: fx.Node, module: nn.MultiheadAttention) -> dict[str, Any] | None:
    try:
        bound = inspect.signature(module.forward).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _plain(node: fx.Node, module: nn.MultiheadAttention) -> bool:
    """A call without masks, extra key/value biases or zero attention, whose attention weights nothing reads."""
    arguments = _arguments(node, module)
    if arguments is None or module.bias_k is not None or module.bias_v is not None or module.add_zero_attn:
        return False
    if any(arguments[name] is not None for name in ("key_padding_mask", "attn_mask")) or arguments["is_causal"]:
        return False
    if any(not isinstance(arguments[name], fx.Node) for name in ("query", "key", "value")):
        return False
    for user in node.users:  # (output, weights): the output read by index, the weights not at all
        if user.target is not operator.getitem or user.args[1] not in (0, 1) or (user.args[1] == 1 and user.users):
            return False
    return True


def _write_out(graph: fx.Graph, node: fx.Node, module: nn.MultiheadAttention) -> None:
    arguments = _arguments(node, module)
    assert arguments is not None
    query, key, value = (arguments[name] for name in ("query", "key", "value"))
    path = str(node.target)
    heads, width = module.num_heads, module.embed_dim
    head_dim = width // heads
    # (batch, heads, tokens, head_dim) from (tokens, batch, heads, head_dim) or (batch, tokens, heads, head_dim)
    to_heads = (0, 2, 1, 3) if module.batch_first else (1, 2, 0, 3)

    def call(target: Any, *args: Any) -> fx.Node:
        made = graph.call_method(target, args) if isinstance(target, str) else graph.call_function(target, args)
        made.meta["nn_module_stack"] = {**node.meta.get("nn_module_stack", {}), path: (path, type(module))}
        return made

    def parameter(name: str, part: int | None = None) -> fx.Node | None:
        if getattr(module, name) is None:
            return None
        read = graph.get_attr(f"{path}.{name}")
        return read if part is None else call(operator.getitem, read, slice(part * width, (part + 1) * width))

    def projected(x: fx.Node, part: int) -> fx.Node:
        if module._qkv_same_embed_dim:
            weight = parameter("in_proj_weight", part)
        else:
            weight = parameter(("q_proj_weight", "k_proj_weight", "v_proj_weight")[part])
        split = call("unflatten", call(F.linear, x, weight, parameter("in_proj_bias", part)), -1, (heads, head_dim))
        return call("permute", split, to_heads)

    with graph.inserting_before(node):
        if module._qkv_same_embed_dim and query is key is value:  # one Linear; its output split as (3, heads, dim)
            fused = call(F.linear, query, parameter("in_proj_weight"), parameter("in_proj_bias"))
            split = call("unflatten", fused, -1, (3, heads, head_dim))
            parts = call("unbind", call("permute", split, (2, *(a + (a > 1) for a in to_heads))), 0)
            q, k, v = (call(operator.getitem, parts, i) for i in range(3))
        else:
            q, k, v = (projected(x, part) for part, x in enumerate((query, key, value)))
        attended = call(F.scaled_dot_product_attention, q, k, v)
        merged = call("flatten", call("permute", attended, tuple(to_heads.index(a) for a in range(4))), 2)
        output = graph.call_module(f"{path}.out_proj", (merged,))
        output.meta["nn_module_stack"] = merged.meta["nn_module_stack"]
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(output)
        graph.erase_node(user)
    graph.erase_node(node)
