"""``pack``'s capture of a model torch.fx cannot trace, or that takes more than one input (``transformers`` models,
called with keyword tensors): ``torch.export`` in eval mode, then the ATen graph rewritten for ``_pack_capture``.

``torch.export`` (non-strict, the batch one symbolic size shared by every batch-first tensor) gives a graph of ATen
operations with the parameters as attributes. Two rewrites make it the graph ``_pack_capture`` classifies:

- every Masksembles layer's call, which export inlines into a gather of masks and a multiply, becomes one
  ``call_module`` of the layer again: its nodes are found by the module stack export records on every node
  (``nn_module_stack``), and a call that does not read exactly one tensor and give one is left inlined (then it is
  not recognized, and ``pack`` says the model has no Masksembles layer);
- every ATen operation that has a torch-level twin with the same arguments becomes that twin (``aten.linear`` ->
  ``F.linear``, ``aten.view`` -> ``Tensor.view``, ``aten.add.Tensor`` -> ``operator.add``, ``aten.select.int`` ->
  indexing, ...), and GPT-2's ``Conv1D`` (``addmm`` on the rows of a ``view``, viewed back) becomes ``F.linear`` on
  the transposed weight: the rules ``_pack_capture`` has for those calls then apply unchanged. Anything else stays an
  ATen call, which falls back (runs as the model runs it).
"""

from __future__ import annotations

import inspect
import operator
import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.fx.graph import _PyTreeInfo

from ._layers import Masksembles
from ._structures import Inputs, batched_tensors, call_arguments, map_batched

ATEN = torch.ops.aten

# ATen operations whose torch-level twin takes the same arguments: (target, how many leading arguments it keeps)
FUNCTIONS: dict[Any, tuple[Callable[..., Any], int | None]] = {
    ATEN.linear.default: (F.linear, None), ATEN.conv1d.default: (F.conv1d, None),
    ATEN.conv2d.default: (F.conv2d, None), ATEN.conv3d.default: (F.conv3d, None),
    ATEN.conv1d.padding: (F.conv1d, None), ATEN.conv2d.padding: (F.conv2d, None),  # padding "same" or "valid"
    ATEN.conv3d.padding: (F.conv3d, None),
    ATEN.layer_norm.default: (F.layer_norm, 5), ATEN.group_norm.default: (F.group_norm, 5),
    ATEN.dropout.default: (F.dropout, None), ATEN.gelu.default: (F.gelu, None),
    ATEN.relu.default: (torch.relu, None), ATEN.tanh.default: (torch.tanh, None),
    ATEN.sigmoid.default: (torch.sigmoid, None), ATEN.silu.default: (F.silu, None),
    ATEN.erf.default: (torch.erf, None), ATEN.exp.default: (torch.exp, None), ATEN.sqrt.default: (torch.sqrt, None),
    ATEN.rsqrt.default: (torch.rsqrt, None), ATEN.neg.default: (torch.neg, None), ATEN.abs.default: (torch.abs, None),
    ATEN.pow.Tensor_Scalar: (torch.pow, None), ATEN.transpose.int: (torch.transpose, None),
    ATEN.permute.default: (torch.permute, None), ATEN.unsqueeze.default: (torch.unsqueeze, None),
    ATEN.squeeze.dim: (torch.squeeze, None), ATEN.flatten.using_ints: (torch.flatten, None),
    ATEN.cat.default: (torch.cat, None), ATEN.split.Tensor: (torch.split, None), ATEN.unbind.int: (torch.unbind, None),
    ATEN.scaled_dot_product_attention.default: (F.scaled_dot_product_attention, None),
    ATEN.softmax.int: (torch.softmax, None), ATEN.matmul.default: (torch.matmul, None),
    ATEN.bmm.default: (torch.bmm, None), ATEN.add.Tensor: (operator.add, 2), ATEN.sub.Tensor: (operator.sub, 2),
    ATEN.mul.Tensor: (operator.mul, 2), ATEN.div.Tensor: (operator.truediv, 2),
    ATEN.hardswish.default: (F.hardswish, None), ATEN.hardsigmoid.default: (F.hardsigmoid, None),
    ATEN.hardtanh.default: (F.hardtanh, None), ATEN.relu6.default: (F.relu6, None),
    ATEN.leaky_relu.default: (F.leaky_relu, None), ATEN.celu.default: (F.celu, None), ATEN.selu.default: (F.selu, None),
    ATEN.mish.default: (F.mish, None), ATEN.softplus.default: (F.softplus, None),
    ATEN.log_sigmoid.default: (F.logsigmoid, None), ATEN.hardshrink.default: (F.hardshrink, None),
    ATEN.softshrink.default: (F.softshrink, None), ATEN.threshold.default: (F.threshold, None),
    ATEN.rrelu.default: (F.rrelu, 4), ATEN.prelu.default: (F.prelu, None), ATEN.clamp.default: (torch.clamp, None),
    ATEN.clamp_min.default: (torch.clamp, None), ATEN.square.default: (torch.square, None),
    ATEN.sign.default: (torch.sign, None), ATEN.log.default: (torch.log, None), ATEN.sin.default: (torch.sin, None),
    ATEN.cos.default: (torch.cos, None), ATEN.pad.default: (F.pad, None),
    ATEN.avg_pool1d.default: (F.avg_pool1d, None), ATEN.avg_pool2d.default: (F.avg_pool2d, None),
    ATEN.avg_pool3d.default: (F.avg_pool3d, None), ATEN.max_pool1d.default: (F.max_pool1d, None),
    ATEN.max_pool2d.default: (F.max_pool2d, None), ATEN.max_pool3d.default: (F.max_pool3d, None),
    ATEN.adaptive_avg_pool1d.default: (F.adaptive_avg_pool1d, None),
    ATEN.adaptive_avg_pool2d.default: (F.adaptive_avg_pool2d, None),
    ATEN.adaptive_avg_pool3d.default: (F.adaptive_avg_pool3d, None),
    ATEN.linalg_vector_norm.default: (torch.linalg.vector_norm, None), ATEN.addcmul.default: (torch.addcmul, None),
    ATEN.addcdiv.default: (torch.addcdiv, None), ATEN.im2col.default: (F.unfold, None),
    ATEN.col2im.default: (F.fold, None), ATEN.roll.default: (torch.roll, None),
}  # fmt: skip


# ATen operations whose twin is a Tensor method with the same arguments
METHODS = {
    ATEN.view.default: "view", ATEN.reshape.default: "reshape", ATEN.expand.default: "expand",
    ATEN.sym_size.int: "size", ATEN.contiguous.default: "contiguous", ATEN.clone.default: "clone",
    ATEN.mean.dim: "mean", ATEN.sum.dim_IntList: "sum", ATEN.amax.default: "amax", ATEN.amin.default: "amin",
    ATEN.var.dim: "var", ATEN.var.correction: "var", ATEN.std.dim: "std", ATEN.std.correction: "std",
    ATEN.to.dtype: "to",
}  # fmt: skip


def _batch_norm(x: Any, weight: Any, bias: Any, mean: Any, var: Any, training: Any, momentum: Any, eps: Any,
                _cudnn: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:  # fmt: skip
    """``aten.batch_norm`` -> ``F.batch_norm`` (the statistics before the affine parameters; ``cudnn_enabled`` only
    picks a kernel)."""
    return F.batch_norm, (x, mean, var, weight, bias, training, momentum, eps)


def _elu(x: Any, alpha: Any = 1.0, scale: Any = 1.0, input_scale: Any = 1.0) -> Any:
    """``aten.elu`` -> ``F.elu``, which has no ``scale``/``input_scale``: only where both are 1."""
    return (F.elu, (x, alpha)) if scale == 1 and input_scale == 1 else None


def _rsub(x: Any, other: Any, alpha: Any = 1) -> Any:
    """``aten.rsub.Scalar(x, c)`` (``c - x``) -> ``operator.sub(c, x)``, as torch.fx records ``c - x``."""
    return (operator.sub, (other, x)) if alpha == 1 else None


def _clamp_max(x: Any, maximum: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return torch.clamp, (x, None, maximum)


def _constant_pad(x: Any, pad: Any, value: Any = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return F.pad, (x, pad, "constant", value)


def _upsample(mode: str, aligned: bool) -> Callable[..., Any]:
    """``aten.upsample_<mode>.vec`` -> ``F.interpolate`` (which calls it with the same sizes and scale factors)."""

    def rewrite(x: Any, size: Any, *rest: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        align_corners, scale_factors = rest if aligned else (None, *rest)
        return F.interpolate, (x, size, scale_factors, mode, align_corners)

    return rewrite


# ATen operations whose twin takes the arguments in another order or form: a function of the node's arguments that
# gives the twin and its arguments, or None where the twin would not compute the same (the node then stays ATen)
REORDERED: dict[Any, Callable[..., Any]] = {
    ATEN.batch_norm.default: _batch_norm, ATEN.elu.default: _elu, ATEN.rsub.Scalar: _rsub,
    ATEN.clamp_max.default: _clamp_max, ATEN.constant_pad_nd.default: _constant_pad,
    ATEN.upsample_nearest1d.vec: _upsample("nearest", False), ATEN.upsample_nearest2d.vec: _upsample("nearest", False),
    ATEN.upsample_nearest3d.vec: _upsample("nearest", False), ATEN.upsample_linear1d.vec: _upsample("linear", True),
    ATEN.upsample_bilinear2d.vec: _upsample("bilinear", True), ATEN.upsample_bicubic2d.vec: _upsample("bicubic", True),
    ATEN.upsample_trilinear3d.vec: _upsample("trilinear", True),
}  # fmt: skip


# twins (Python functions) that take the arguments after the tensor by keyword, as torch.fx records an ``F`` call (the
# packed program then runs them in place where the fx capture's would: ``inplace=True``)
KEYWORD_TWINS = {
    F.hardswish, F.hardsigmoid, F.hardtanh, F.relu6, F.leaky_relu, F.elu, F.celu, F.selu, F.mish, F.threshold,
}  # fmt: skip


# checks export adds (of metadata and guards), which the packed program does not need
CHECKS = {ATEN._assert_tensor_metadata.default, ATEN._assert_scalar.default, ATEN.sym_constrain_range_for_size.default}


def exported(model: nn.Module, example: Inputs) -> tuple[fx.GraphModule, _PyTreeInfo]:
    """The model (in eval mode) as an fx graph of torch-level calls where ATen has them, its Masksembles layers
    called as modules, the batch symbolic; and how its inputs flatten to the graph's placeholders and its output
    leaves unflatten to the model's output structure.

    Raises:
        ValueError: torch.export fails on the model.
    """
    if min(tensor.shape[0] for tensor in _batched(example)) < 2:  # export fixes a batch of 1 at 1
        example = map_batched(example, lambda tensor: torch.cat([tensor, tensor]))
    args, kwargs = call_arguments(example)
    batch = torch.export.Dim("batch")
    shapes = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    dynamic = {name: _batch_dims(value, batch) for name, value in shapes.items()}
    gm = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False).module()
    info = cast(_PyTreeInfo, gm.graph._codegen.pytree_info)  # type: ignore[attr-defined]
    gm.graph._codegen = fx.graph.CodeGen()  # placeholders and output as they are: the flat leaves
    _module_paths(gm)
    _drop_checks(gm)
    _layers_as_modules(gm, model)
    _out_of_place(gm)
    for node in list(gm.graph.nodes):  # before the views it reads become methods
        if node.op == "call_function" and node.target is ATEN.addmm.default:
            _addmm_as_linear(gm, node)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in FACTORIES:
            _factory_of_metadata(gm, node)
    _batch_identities(gm)
    _masks_as_broadcast(gm)
    for node in list(gm.graph.nodes):
        _rewrite(node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm, info


def flat_inputs(info: _PyTreeInfo, inputs: Inputs) -> list[Any]:
    """``inputs`` (of the example's structure) as the graph's placeholders take them."""
    return list(torch.fx._pytree.tree_flatten_spec(call_arguments(inputs), info.in_spec))


def _batched(inputs: Inputs) -> list[Tensor]:
    return [tensor for _, tensor in batched_tensors(inputs)]


def _batch_dims(value: Any, batch: Any) -> Any:
    """The dynamic-shape spec of one argument: axis 0 of each batch-first tensor is ``batch``."""
    if isinstance(value, Tensor):
        return {0: batch} if value.ndim else None
    if isinstance(value, Mapping):
        return {key: _batch_dims(item, batch) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_batch_dims(item, batch) for item in value)
    return None


def _module_paths(gm: fx.GraphModule) -> None:
    """Each node's module stack keyed by module path (as torch.fx records it; export keys it by its own names)."""
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {path: kind for path, kind in stack.values() if path}


def _drop_checks(gm: fx.GraphModule) -> None:
    for node in reversed(list(gm.graph.nodes)):
        guard = node.op == "call_module" and str(node.target) == "_guards_fn"
        if (guard or (node.op == "call_function" and node.target in CHECKS)) and not node.users:
            gm.graph.erase_node(node)


def _layers_as_modules(gm: fx.GraphModule, model: nn.Module) -> None:
    """Each call of a Masksembles layer, which export inlined, as one ``call_module`` of the layer: the nodes the
    call's result is computed from within the layer (export may share some, such as the masks' cast, between two
    calls of one layer), which must read one tensor from outside it."""
    layers = {path: module for path, module in model.named_modules() if isinstance(module, Masksembles)}
    within: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or node.target is ATEN.sym_size.int:
            continue
        path = next((p for p in reversed(node.meta.get("nn_module_stack") or {}) if p in layers), None)
        if path is not None:
            within.setdefault(path, []).append(node)
    for path, nodes in within.items():
        inside = set(nodes)
        for result in [node for node in nodes if any(user not in inside for user in node.users)]:
            call, pending = set(), [result]
            while pending:
                node = pending.pop()
                if node not in call:
                    call.add(node)
                    pending += [a for a in node.all_input_nodes if a in inside]
            read = {a for node in call for a in node.all_input_nodes if a not in inside and a.op != "get_attr"}
            tensors = [a for a in read if isinstance(a.meta.get("val"), Tensor)]
            if len(tensors) != 1:
                continue
            if not isinstance(gm.get_submodule(path), Masksembles):
                gm.set_submodule(path, layers[path])
            with gm.graph.inserting_before(result):
                layer = gm.graph.call_module(path, (tensors[0],))
            layer.meta = {key: result.meta[key] for key in ("val", "nn_module_stack") if key in result.meta}
            result.replace_all_uses_with(layer)
        for node in reversed(nodes):
            if not node.users:
                gm.graph.erase_node(node)


def _out_of_place(gm: fx.GraphModule) -> None:
    """In-place ATen calls (``relu_``, ``hardswish_``, ``add_.Tensor``, ...) as their twins out of place, each reader
    reading the value written last before it, where that is proven to be the memory's value: for each tensor the model
    writes in place, every call that shares its memory (the calls' schemas say which: views, ``split``, and in-place
    calls, which return what they write) must be an in-place call that has a twin out of place here, and the tensor
    must not be a parameter or buffer. Otherwise (a view written in place, or read after a write) its calls stay as the
    model runs them: they fall back."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    alias: dict[fx.Node, fx.Node] = {}  # a call -> the value whose memory its result shares
    for node in gm.graph.nodes:
        source = node.args[0] if node.op == "call_function" and node.args else None
        shares = _returns_alias(node.target) or _writes_first(node.target) or node.target is operator.getitem
        if isinstance(source, fx.Node) and shares and (node.target is not operator.getitem or source in alias):
            alias[node] = source
    families: dict[fx.Node, list[fx.Node]] = {}
    for node in alias:
        root = node
        while root in alias:
            root = alias[root]
        families.setdefault(root, []).append(node)
    for root, calls in families.items():
        twins = [_out_of_place_twin(call.target) for call in calls]
        if root.op == "get_attr" or not all(twins):
            continue
        for call, twin in zip(calls, twins, strict=True):
            call.target = twin
        values = [root, *calls]  # the memory's value after each write, in graph order
        for value in values:
            for reader in list(value.users):
                latest = max((v for v in values if order[v] < order[reader]), key=order.__getitem__)
                reader.replace_input_with(value, latest)


def _writes_first(target: Any) -> bool:
    """Whether an ATen call writes its first argument in place (and returns it)."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.arguments:
        return False
    alias_info = target._schema.arguments[0].alias_info
    return alias_info is not None and alias_info.is_write


def _returns_alias(target: Any) -> bool:
    """Whether an ATen call's result shares memory with an argument without writing it (a view: ``view``,
    ``select``, ``split``, ...)."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias_info = target._schema.returns[0].alias_info
    return alias_info is not None and not alias_info.is_write


def _out_of_place_twin(target: Any) -> Any:
    """``aten.<name>_.<overload>`` -> ``aten.<name>.<overload>`` where the schema writes the first argument and the
    out-of-place call has a twin here (else None)."""
    name = target._schema.name.split("::")[-1] if isinstance(target, torch._ops.OpOverload) else ""
    if not name.endswith("_") or not _writes_first(target):
        return None
    packet = getattr(ATEN, name[:-1], None)
    twin = getattr(packet, target._overloadname, None) if packet is not None else None
    return twin if twin in FUNCTIONS or twin in REORDERED or twin in METHODS else None


# ATen views whose result may be the tensor itself: then the batch size they read changes nothing
SAME_SHAPE_VIEWS = {ATEN.view.default, ATEN.reshape.default, ATEN._unsafe_view.default, ATEN.expand.default}

ZERO_PADS = {ATEN.pad.default, ATEN.constant_pad_nd.default}  # pads as the first argument after the tensor


def _batch_identities(gm: fx.GraphModule) -> None:
    """Drop the reads of the batch size that change nothing (``transformers``' padding and causal masks read it):

    - a view, reshape or expand whose result has its input's shape (symbolic sizes compared as expressions):
      ``expand(mask, [B, -1, L, L])`` of a (B, 1, L, L) mask, ``view(attention_mask, [B, -1])``; the tensor itself;
    - an expand's size that is its input's size there: -1 (``expand(mask, [B, -1, L, L])`` of a (B, 1, 1, L) mask
      -> ``expand(mask, [-1, -1, L, L])``);
    - ``index(x, [arange(B) as (B, 1, ..., 1), *rest])`` with ``B`` the size of x's axis 0 (the i-th sample from
      the i-th: ``padding_mask_function``'s ``batch_arange``): ``index(x, [None, *rest])`` with each of ``rest``
      (of static shapes, size 1 on the leading axis of the indices' broadcast shape) without that axis.

    Each is an identity, proven from the graph; what they leave reads no batch size, so ``_pack_capture`` can show
    it keeps the samples apart (a mask from ``attention_mask`` alone is then computed once, on the batch, for every
    member). A pad of 0 on every side (Swin's ``maybe_pad`` where the windows fit the image) is the tensor itself
    too, dropped so that the window partition after it is not read from a fallback."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        source = node.args[0]
        same = node.target in SAME_SHAPE_VIEWS and _same_shape(_shape(source), _shape(node))
        if same or (node.target in ZERO_PADS and len(node.args) > 1 and all(pad == 0 for pad in node.args[1])):
            node.replace_all_uses_with(source)
        elif node.target is ATEN.expand.default and _shape(source) is not None and len(node.args) == 2:
            before, sizes = cast(tuple[Any, ...], _shape(source)), list(cast(list[Any], node.args[1]))
            new = len(sizes) - len(before)  # leading axes the expand adds
            node.args = (source, [size if j < new or not _same_size(before[j - new], _size(size)) else -1
                                  for j, size in enumerate(sizes)])  # fmt: skip
        elif node.target is ATEN.index.Tensor and not node.kwargs:
            _batch_index_as_slice(gm, node)


def _shape(node: Any) -> tuple[Any, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, Tensor) else None


def _size(size: Any) -> Any:
    """A size argument's value: an integer, or the symbolic size an fx node gives."""
    return size.meta.get("val") if isinstance(size, fx.Node) else size


def _same_size(a: Any, b: Any) -> bool:
    """Two sizes of the export graph known equal: the same integer, or the same symbolic expression."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return bool(a.node.expr == b.node.expr)
    return isinstance(a, int) and isinstance(b, int) and a == b


def _same_shape(a: tuple[Any, ...] | None, b: tuple[Any, ...] | None) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(map(_same_size, a, b))


def _batch_index_as_slice(gm: fx.GraphModule, node: fx.Node) -> None:
    """``index(x, [arange(B) as (B, 1, ..., 1), *rest])`` -> ``index(x, [None, *rest])`` (see ``_batch_identities``)."""
    source, indices = node.args[0], node.args[1]
    if not isinstance(indices, (list, tuple)) or len(indices) < 2 or not isinstance(indices[0], fx.Node):
        return
    first, rest = indices[0], list(indices[1:])
    shapes = [_shape(index) for index in indices]
    if any(shape is None for shape in shapes):
        return
    rank = len(cast(tuple[Any, ...], shapes[0]))
    batch = cast(tuple[Any, ...], _shape(source))[0]
    if rank == 0 or not _is_batch_arange(first, batch) or any(len(cast(tuple[Any, ...], s)) > rank for s in shapes):
        return
    kept = []
    for index, shape in zip(rest, shapes[1:], strict=True):
        padded = (1,) * (rank - len(cast(tuple[Any, ...], shape))) + cast(tuple[Any, ...], shape)
        if not all(isinstance(size, int) for size in padded) or padded[0] != 1:
            return
        with gm.graph.inserting_before(node):
            kept.append(gm.graph.call_function(ATEN.view.default, (index, list(padded[1:]))))
        kept[-1].meta["val"] = cast(fx.Node, index).meta["val"].view(padded[1:])
    node.args = (source, [None, *kept])


def _whole_slice(node: fx.Node) -> bool:
    """``slice(x, dim, 0, end)`` that takes the whole axis (step 1, an end past it)."""
    if node.target is not ATEN.slice.Tensor:
        return False
    start, end, step = [*node.args[2:], None, None, None][:3]
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= sys.maxsize)) and step in (1, None)


def _is_batch_arange(node: fx.Node, batch: Any) -> bool:
    """Whether ``node`` is ``arange(batch)`` (from 0, step 1) with only size-1 axes added after it: (B, 1, ..., 1),
    its i-th row holding i."""
    shape = _shape(node)
    if shape is None or not _same_size(shape[0], batch) or any(size != 1 for size in shape[1:]):
        return False
    while node.target in (ATEN.unsqueeze.default, ATEN.view.default, ATEN.reshape.default) or _whole_slice(node):
        node = cast(fx.Node, node.args[0])
    if node.target is ATEN.arange.default:
        end = node.args[0]
    elif node.target is ATEN.arange.start and node.args[0] == 0:
        end = node.args[1]
    else:
        return False
    size = end.meta.get("val") if isinstance(end, fx.Node) else end
    return _same_size(size, batch) and _shape(node) is not None


def _masks_as_broadcast(gm: fx.GraphModule) -> None:
    """An attention mask that is a constant expanded over the batch (``transformers``' mask for a model called
    without one: ``arange(L) >= 0`` expanded to (B, 1, L, L)) read as the constant, which
    ``scaled_dot_product_attention`` broadcasts to the same mask: then the mask does not follow the batch size, and
    the attention can run with the members folded into its heads (``_pack_attention``)."""

    def mask_of(node: fx.Node) -> Any:
        if node.op != "call_function" or node.target is not ATEN.scaled_dot_product_attention.default:
            return None
        return node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)

    for mask in list(gm.graph.nodes):
        source = mask.args[0] if mask.target is ATEN.expand.default else None
        if not isinstance(source, fx.Node) or _reads_inputs(source):
            continue
        if all(mask_of(user) is mask and mask not in user.args[:3] for user in mask.users):
            mask.replace_all_uses_with(source)


def _reads_inputs(node: fx.Node) -> bool:
    """Whether ``node``'s value follows a placeholder (an input, or a size of one)."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        if current.op == "placeholder":
            return True
        if current not in seen:
            seen.add(current)
            pending += current.all_input_nodes
    return False


def _rewrite(node: fx.Node) -> None:
    """``node`` as its torch-level twin, where it has one (the node keeps its name, users and metadata)."""
    if node.op != "call_function":
        return
    target = node.target
    if target in FUNCTIONS and not (target in (ATEN.add.Tensor, ATEN.sub.Tensor) and node.kwargs):
        function, kept = FUNCTIONS[target]
        node.target = function
        node.args = node.args if kept is None else node.args[:kept]
    elif target in METHODS:
        node.op, node.target = "call_method", METHODS[target]
    elif target in REORDERED and not node.kwargs:
        twin = REORDERED[target](*node.args)
        if twin is not None:
            node.target, node.args = twin
    elif target in (ATEN.select.int, ATEN.slice.Tensor):
        _as_index(node)
    elif target is ATEN.index.Tensor:
        _list_index(node)
    if node.target in KEYWORD_TWINS:
        arguments = inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments
        first, *rest = arguments
        node.args, node.kwargs = (arguments[first],), {name: arguments[name] for name in rest}


def _rank(node: Any) -> int | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value.dim() if isinstance(value, Tensor) else None


def _list_index(node: fx.Node) -> None:
    """``index.Tensor(x, [None, ..., positions])`` with constant positions (a 1-D integer tensor held by the module,
    as export lifts ``x[..., [-2]]``'s list) -> ``x[..., [p0, p1, ...]]``, the list on the same axis."""
    source, indices = node.args
    if not isinstance(indices, (list, tuple)) or not indices or any(i is not None for i in indices[:-1]):
        return
    held = indices[-1]
    if isinstance(held, fx.Node) and held.target is ATEN.lift_fresh_copy.default:
        held = held.args[0]
    if not isinstance(held, fx.Node) or held.op != "get_attr" or held.graph.owning_module is None:
        return
    positions: Any = held.graph.owning_module
    for name in str(held.target).split("."):
        positions = getattr(positions, name, None)
    if not isinstance(positions, Tensor) or positions.dim() != 1 or positions.dtype not in (torch.int64, torch.int32):
        return
    node.target = operator.getitem
    node.args = (source, (*[slice(None)] * (len(indices) - 1), positions.tolist()))


def _as_index(node: fx.Node) -> None:
    """``select(x, dim, i)`` -> ``x[..., i]`` and ``slice(x, dim, start, end, step)`` -> ``x[..., start:end:step]``
    (``dim`` leading full slices), for constant integer arguments."""
    source, dim, *rest = node.args
    rank = _rank(source)
    if rank is None or not isinstance(source, fx.Node) or not isinstance(dim, int):
        return
    if not all(isinstance(a, int | None) for a in rest):
        return
    if node.target is ATEN.select.int:
        entry: Any = rest[0]
    else:
        start, end, step = cast(list[int | None], [*rest, None, None, None][:3])
        if start in (0, None) and (end is None or end >= sys.maxsize) and step in (1, None):
            node.replace_all_uses_with(source)  # the whole axis: the tensor itself
            return
        entry = slice(start, end, step if step != 1 else None)
    node.target = operator.getitem
    node.args = (source, (*[slice(None)] * (dim % rank), entry))


# ``x.new_zeros(size)`` and its kin: a tensor of ``size`` with x's dtype, layout and device, whatever x holds
FACTORIES: dict[Any, Callable[..., Any]] = {
    ATEN.new_zeros.default: torch.zeros, ATEN.new_ones.default: torch.ones, ATEN.new_empty.default: torch.empty,
    ATEN.new_full.default: torch.full,
}  # fmt: skip


def _factory_of_metadata(gm: fx.GraphModule, node: fx.Node) -> None:
    """``new_zeros(x, size)`` -> ``torch.zeros(size, dtype=x.dtype, layout=x.layout, device=x.device)`` (the
    metadata the call does not name, read as queries): the call reads no value of ``x``, and now says so, so what it
    builds from constants is seen to be the same for every sample (torchvision's Swin builds its shifted windows' mask
    on ``x.new_zeros((pad_H, pad_W))`` of the windows)."""
    source, *rest = node.args
    factory, kwargs = FACTORIES[node.target], dict(node.kwargs)
    with gm.graph.inserting_before(node):
        for name in ("dtype", "layout", "device"):
            if kwargs.get(name) is None:
                kwargs[name] = gm.graph.call_function(getattr, (source, name))
    node.target, node.args, node.kwargs = factory, tuple(rest), kwargs


def _addmm_as_linear(gm: fx.GraphModule, node: fx.Node) -> None:
    """``view(addmm(bias, view(x, [-1, K]), weight), [*lead, N])`` (GPT-2's ``Conv1D``) -> ``F.linear(x, weight.t(),
    bias)`` when ``lead`` is the leading shape of ``x``."""
    bias, rows, weight = node.args
    if node.kwargs or len(node.users) != 1 or not all(isinstance(a, fx.Node) for a in (bias, rows, weight)):
        return
    (back,) = node.users
    rows, weight = cast(fx.Node, rows), cast(fx.Node, weight)
    if rows.op != "call_function" or rows.target is not ATEN.view.default or back.target is not ATEN.view.default:
        return
    source = cast(fx.Node, rows.args[0])
    before, after = source.meta.get("val"), back.meta.get("val")
    if not isinstance(before, Tensor) or not isinstance(after, Tensor) or before.dim() < 2:
        return
    if tuple(before.shape[:-1]) != tuple(after.shape[:-1]) or weight.op != "get_attr":
        return
    with gm.graph.inserting_before(back):
        transposed = gm.graph.call_function(torch.t, (weight,))
    back.target, back.args = F.linear, (source, transposed, bias)
