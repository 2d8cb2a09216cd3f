"""Writes a ``masksembles_core.packing.Program`` as a torch.fx graph: one kernel per step and per move over a root
module that holds the compacted layers, then rewrites for speed (in-place activations and sums, member-major blocks
between members' Linear layers, token MLPs as one ``MemberMLP``, outputs read as views). Counts multiply-adds.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from masksembles_core.packing import (
    OUTPUT,
    Cost,
    Move,
    Program,
    Step,
    block_indices,
    channel_indices,
    program_macs,
)

from . import _packed_ops as ops
from ._layers import Masksembles
from ._pack_attention import Fold, Region, fuse_written_attention, is_expand, written_attentions
from ._pack_capture import (
    ELEMENTWISE_FUNCTIONS,
    ELEMENTWISE_MODULES,
    IN_PLACE_OPERATORS,
    METADATA,
    _Capture,
    _dtype_view,
    _in_place,
    _Op,
    _target_name,
)
from ._pack_graph import _leaves


class _Emitter:
    """Writes the program as an fx graph over a root module that holds the compacted layers and the moves' indices."""

    def __init__(
        self, capture: _Capture, axis: dict[fx.Node, int], program: Program, squeeze: bool, samples: int,
        chosen: Sequence[int], regions: Sequence[Region] = (),
    ) -> None:  # fmt: skip
        self.capture, self.axis, self.program, self.samples = capture, axis, program, samples
        self.folds = {node: fold for region in regions for node, fold in region.folds.items()}
        self.fold_shapes = {node: shape for region in regions for node, shape in region.shapes.items()}
        self.fold_chunks = {node: parts for region in regions for node, parts in region.chunks.items()}
        self.fold_repeats = {node: sides for region in regions for node, sides in region.repeats.items()}
        self.fold_indexes = {node: index for region in regions for node, index in region.indexes.items()}
        self.fold_shared_heads = {node for region in regions for node in region.shared_heads}
        self.split_outputs = {entry: outer for region in regions for entry, outer in region.entries.items()}
        self.m = len(program.members)
        # the members returned, as positions in the program's (None: all of them, in order)
        self.returned = None if list(chosen) == list(program.members) else [program.members.index(k) for k in chosen]
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.by_name = {node.name: node for node in capture.gm.graph.nodes}
        self.values: dict[str, fx.Node] = {}
        self.scalars: dict[fx.Node, Any] = {}
        self.moved: dict[tuple[Any, ...], fx.Node] = {}
        self.copies: dict[str, str] = {}
        self.costs: dict[str, Cost] = {}
        self.same_shape: dict[fx.Node, tuple[int, ...]] = {}  # combines: the arguments shaped like the result
        self.last_axis_frames: dict[fx.Node, int] = {}  # to_batch/to_channels of (B, ..., m*C): C
        self.mlps: list[tuple[fx.Node, list[fx.Node], fx.Node]] = []  # members' Linear, activations, members' Linear
        for step in program.steps:
            self.values[step.name] = self._step(step)
        self.macs = program_macs(program, self.costs)
        self._fuse_attention()
        self._output(squeeze)
        self._in_place()
        self._member_major()
        self._fuse_mlps()
        self._direct_outputs()

    # ---- attributes of the root

    def _attribute(self, prefix: str, value: Tensor) -> fx.Node:
        """A tensor held by the root as a buffer, read in the graph."""
        name = f"{prefix}_{len(self.root._buffers)}"
        self.root.register_buffer(name, value)
        return self.graph.get_attr(name)

    def _call(self, prefix: str, module: nn.Module, *args: Any) -> fx.Node:
        """A module held by the root, called in the graph."""
        name = f"{prefix}_{len(self.root._modules)}"
        self.root.add_module(name, module)
        return self.graph.call_module(name, args)

    def _module(self, target: str) -> str:
        """The model's own module, copied once into the root (for the operations run as the model runs them)."""
        if target not in self.copies:
            module = copy.deepcopy(self.capture.gm.get_submodule(target))
            module.eval().requires_grad_(False)
            if getattr(module, "inplace", False) is True:
                module.inplace = False  # type: ignore[assignment]
            if isinstance(module, Masksembles):  # block j of the member-stacked batch is member members[j]
                module.masks = module.masks[list(self.program.members)]
                module.n = len(self.program.members)
            name = f"model_{target}".replace(".", "_")
            self.root.add_module(name, module)
            self.copies[target] = name
        return self.copies[target]

    # ---- values that are not model tensors: constants, sizes as the dense model sees them

    def _argument(self, value: Any) -> Any:
        """An argument for an emitted node: model values as emitted, constants folded, sizes in the dense frame."""
        return fx.node.map_arg(value, self._scalar)

    def _scalar(self, node: fx.Node) -> Any:
        if node.name in self.values:
            return self.values[node.name]
        if node in self.scalars:
            return self.scalars[node]
        capture = self.capture
        if node not in capture.dynamic:
            constant = capture.constants.get(node)
            if isinstance(constant, Tensor):
                result: Any = self._attribute("constant", constant)
            elif isinstance(constant, nn.Module):
                result = self.graph.get_attr(self._module(str(node.target)))
            else:
                result = constant
        elif capture.is_query(node):
            result = self._query(node)
        else:
            args, kwargs = self._argument(node.args), self._argument(node.kwargs)
            result = self.graph.create_node(node.op, node.target, args, kwargs)
        self.scalars[node] = result
        return result

    def _query(self, node: fx.Node) -> fx.Node:
        """A size or metadata query, answered as the dense model (member-stacked batch, every channel) would."""
        tensor = cast(fx.Node, node.args[0])
        value = self.values[tensor.name]
        name = str(node.args[1]) if node.target is getattr else _target_name(node)
        if name in METADATA:
            return self.graph.create_node(node.op, node.target, (value, *node.args[1:]), dict(node.kwargs))
        step = self.program.step(tensor.name)
        seen = self.capture.seen[tensor]
        dense = step.placement.dense
        factor = 1 if dense and not step.placement.shared else self.m
        channel_axis = -1 if dense or tensor is self.capture.input else self.axis.get(tensor, -1)  # input: every one
        fold = self.folds.get(tensor)
        if step.name in self.program.folded and isinstance(fold, Fold):  # the members' blocks of the fold's axis
            channel_axis = fold.axis
        channels = seen.shapes[0][channel_axis] if channel_axis >= 0 else 0
        size = self.graph.call_function(ops.frame_size, (value, seen.batch_axes, factor, channel_axis, channels))
        if name in ("numel", "nelement") or node.target is torch.numel:
            return self.graph.call_function(math.prod, (size,))
        if name == "size" and len(node.args) + len(node.kwargs) > 1:
            dim = self._argument(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None))
            return self.graph.call_function(operator.getitem, (size, dim))
        return size

    # ---- moves

    def _edge(self, step: Step, index: int) -> fx.Node:
        edge = step.edges[index]
        value = self.values[edge.source]
        source = self.by_name.get(edge.source)
        key: tuple[Any, ...] = (edge.source,)
        for move in edge.moves:
            key = (*key, move.kind, _bytes(move.index), _bytes(move.scale))
            if key in self.moved:
                value = self.moved[key]
                continue
            value = self._move(move, value, cast(fx.Node, source))
            self.moved[key] = value
        return value

    def _move(self, move: Move, value: fx.Node, source: fx.Node) -> fx.Node:
        seen = self.capture.seen[source]
        if move.kind == "tile":
            if seen.parts:
                axes = tuple(part.batch_axis if part.batch_axes else -1 for part in seen.parts)
                return self.graph.call_function(ops.tile_parts, (value, self.m, axes))
            if not seen.tensor or not seen.batch_axes:
                return value  # the same for every member
            return self.graph.call_function(ops.tile, (value, self.m, seen.sole_batch_axis))
        axis = self.axis[source] if source in self.axis else self._input_axis()
        if move.kind in ("to_batch", "to_channels"):
            function = ops.to_batch if move.kind == "to_batch" else ops.to_channels
            frame = self.graph.call_function(function, (value, self.m, seen.sole_batch_axis, axis))
            if seen.sole_batch_axis == 0 and axis == seen.rank - 1:  # batch first, channels last: see _member_major
                self.last_axis_frames[frame] = seen.shapes[0][axis]
            return frame
        assert move.index is not None and move.scale is not None
        rank = seen.rank
        if np.array_equal(move.index, np.arange(len(move.index))):
            value = self.graph.call_method("narrow", (value, axis, 0, len(move.index)))
        else:
            index = self._attribute("index", torch.as_tensor(move.index, dtype=torch.long, device=self.capture.device))
            value = self.graph.call_function(ops.gather_channels, (value, axis, index))
        if not (move.scale == 1).all():
            shape = [1] * rank
            shape[axis] = len(move.scale)
            scale = torch.as_tensor(move.scale, dtype=seen.dtype, device=self.capture.device).view(shape)
            value = self.graph.call_function(operator.mul, (value, self._attribute("scale", scale)))
        return value

    def _input_axis(self) -> int:
        return self.axis.get(self.capture.input, self.capture.seen[self.capture.input].rank - 1)

    # ---- steps

    def _step(self, step: Step) -> fx.Node:
        if step.node.kind == "input":
            return self.graph.placeholder(step.name)
        shared_sum = self._shared_sum(step)
        if shared_sum is not None:
            return shared_sum
        inputs = [self._edge(step, i) for i in range(len(step.edges))]
        if step.name == OUTPUT:
            return self.graph.call_function(tuple, (inputs,))
        node = self.by_name[step.name]
        op = self.capture.ops[node]
        self._count(step, op)
        if step.placement.dense and op.kind == "flatten":  # (B, ...) -> (B, features) on the frame's batch, which
            return self.graph.call_function(torch.flatten, (inputs[0], 1))  # the model's view(B, -1) does not know
        if node in self.fold_shapes:  # a reshape or expand of a folded region: the members' blocks on its fold's axis
            members = 1 if step.placement.shared else self.m
            fold = cast(Fold, self.folds[node])
            shape = [size * members if a == fold.axis else size for a, size in enumerate(self.fold_shapes[node])]
            return self.graph.call_method("expand" if is_expand(node) else "reshape", (inputs[0], shape))
        if node in self.fold_chunks:  # a split of a folded region's axis: equal parts, whatever its width
            return self.graph.call_function(torch.chunk, (inputs[0], *self.fold_chunks[node]))
        if node in self.fold_indexes:  # an index of a folded region's heads: the same heads of every member's block
            members = 1 if step.placement.shared else self.m
            axis, index, landing = self.fold_indexes[node]
            return self.graph.call_function(ops.index_members, (inputs[0], axis, members, index, landing))
        if node in self.fold_shared_heads and step.name in self.program.folded:  # member i's own key/value head
            attention = self._as_model(op, inputs)
            attention.args, attention.kwargs = attention.args[:7], {**attention.kwargs, "enable_gqa": True}
            return attention
        read = op.batch_size_read if step.placement.shared else None
        if read is not None:  # computed once on the batch: the batch size is the input's, not the dense model's
            batch = self.graph.call_method("size", (self.values[self.capture.input.name], 0))
            return self._as_model(op, inputs, replaced={read: batch})
        if step.name in self.program.folded and node in self.fold_repeats and self.m > 1:
            repeated = self._per_member(op, inputs, self.fold_repeats[node])
            inputs = [repeated.get(t, value) for t, value in zip(op.tensors, inputs, strict=True)]
            return self._as_model(op, inputs, replaced=repeated)
        if step.placement.dense or step.name in self.program.folded:
            return self._as_model(op, inputs)
        return self._compact(step, op, inputs)

    def _shared_sum(self, step: Step) -> fx.Node | None:
        """``member + shared`` where the shared tensor is repeated for every member: added by broadcasting its one
        block instead of copying it m times (a residual connection around the first masked block)."""
        node = self.by_name.get(step.name)
        op = self.capture.ops.get(node) if node is not None else None
        if op is None or step.node.kind != "combine" or step.placement.dense or step.placement.shared or self.m < 2:
            return None
        if node is None or node.target not in (operator.add, torch.add, operator.iadd) or node.kwargs:
            return None
        for shared, other in ((0, 1), (1, 0)):
            (move, *rest) = step.edges[shared].moves or (None,)
            if move is None or rest or move.repeats != self.m or move.index is None:
                continue
            source = self.values[step.edges[shared].source]
            block = move.index[: len(move.index) // self.m]
            if not np.array_equal(block, np.arange(self.program.step(step.edges[shared].source).placement.width)):
                index = torch.as_tensor(block, dtype=torch.long, device=self.capture.device)
                axis = self.axis[cast(fx.Node, self.by_name[step.edges[shared].source])]
                source = self.graph.call_function(ops.gather_channels, (source, axis, self._attribute("index", index)))
            value = self._edge(step, other)
            self._count(step, op)
            result = self.graph.call_function(ops.add_shared, (value, source, self.m, op.axis))
            seen, member = self.capture.seen, op.tensors[other]
            if (seen[member].shapes[0], seen[member].dtype) == (seen[node].shapes[0], seen[node].dtype):
                self.same_shape[result] = (0,)  # it may be computed in place on the members' tensor
            return result
        return None

    def _per_member(self, op: _Op, inputs: list[fx.Node], sides: Mapping[fx.Node, int]) -> dict[fx.Node, fx.Node]:
        """A folded step's inputs from outside its region that hold one member's heads (a per-head position bias),
        each repeated for every member along its axis of the fold, members outermost: the values in the program,
        the constants once, here."""
        repeated: dict[fx.Node, fx.Node] = {}
        for side, axis in sides.items():
            if side in self.capture.dynamic:
                value = inputs[op.tensors.index(side)]
                counts = [1] * self.capture.seen[side].rank
                counts[axis] = self.m
                repeated[side] = self.graph.call_method("repeat", (value, counts))
            else:
                constant = cast(Tensor, self.capture.constants[side])
                counts = [1] * constant.dim()
                counts[axis] = self.m
                repeated[side] = self._attribute("constant", constant.repeat(counts))
        return repeated

    def _as_model(
        self, op: _Op, inputs: list[fx.Node], constants: Callable[[Tensor], Any] | None = None,
        replaced: Mapping[fx.Node, fx.Node] | None = None,
    ) -> fx.Node:  # fmt: skip
        """The model's own operation on the given values of its model inputs (dense, or compacted elementwise), with
        the ``replaced`` arguments read instead of the dense model's (a batch size read from the packed input, a
        per-head tensor repeated for every member)."""
        node = op.node
        given = {**(replaced or {}), **dict(zip(op.tensors, inputs, strict=True))}
        if _in_place(node, self.capture.gm) and node.args and node.args[0] in given:
            mutated = cast(fx.Node, node.args[0])
            given[mutated] = self.graph.call_method("clone", (given[mutated],))

        def argument(a: fx.Node) -> Any:
            if a in given:
                return given[a]
            if (
                constants is not None
                and a not in self.capture.dynamic
                and isinstance(self.capture.constants.get(a), Tensor)
            ):
                return constants(self.capture.constants[a])
            return self._scalar(a)

        args = fx.node.map_arg(node.args, argument)
        kwargs = fx.node.map_arg(node.kwargs, argument)
        target: Any = node.target
        if node.op == "call_module":
            target = self._module(str(node.target))
        elif node.op == "call_method" and target in RESHAPING_VIEWS and not _dtype_view(node):
            target = RESHAPING_VIEWS[target]  # the values a view gives, on tensors laid out unlike the dense model's
        elif node.op == "call_function" and target in IN_PLACE_OPERATORS and constants is not None:
            target = IN_PLACE_OPERATORS[target]
        elif (
            node.op == "call_method"
            and constants is not None
            and str(target).endswith("_")
            and not str(target).endswith("__")
        ):
            target = str(target)[:-1]
        return self.graph.create_node(node.op, target, args, kwargs)

    def _compact(self, step: Step, op: _Op, inputs: list[fx.Node]) -> fx.Node:
        kind, placement = step.node.kind, step.placement
        member = not placement.shared and self.m > 1
        if kind == "masks" or op.how == "identity":
            return inputs[0]
        if op.how == "rows":  # the batch's rows first (any number), the sizes between as given, the channels as held
            shape = self.capture.seen[op.node].shapes[0][1:-1]
            channels = self.graph.call_method("size", (inputs[0], -1))
            return self.graph.call_method("reshape", (inputs[0], (-1, *shape, channels)))
        if kind in ("mixing", "grouped"):
            return self._mixing(step, op, inputs[0])
        if op.how == "affine":
            assert op.weight is not None and op.bias is not None
            scale = _per_channel(op.weight, placement.layouts, 1.0)
            shift = _per_channel(op.bias, placement.layouts, 0.0)
            affine = ops.Affine(scale, shift, op.axis, self.capture.seen[op.node].rank)
            return self._call("affine", affine, inputs[0])
        if op.how == "prelu":
            assert op.weight is not None
            weight = _per_channel(op.weight, placement.layouts, 0.0)
            return self.graph.call_function(F.prelu, (inputs[0], self._attribute("prelu", weight)))
        if kind == "concat":
            parts = [value for value, edge in zip(inputs, step.edges, strict=True) if edge.placement.width > 0]
            if member:
                return self.graph.call_function(ops.concat_members, (parts, self.m, op.axis))
            return self.graph.call_function(torch.cat, (parts, op.axis))
        if kind == "norm":
            return self._norm(op, inputs[0], member) if member else self._as_model(op, inputs)
        if kind == "mean_ratio":  # each block's channels summed, divided by the full width
            _, valid = channel_indices(placement.layouts)
            held = self._attribute("valid", torch.as_tensor(valid, device=self.capture.device))
            eps = self.capture.argument(op.node, "eps", 2)
            blocks = len(placement.layouts)
            args = (inputs[0], blocks, op.axis, held, step.node.channels, eps)
            return self.graph.call_function(ops.mean_ratio_members, args)
        if kind == "flatten":
            last = step.node.channels_last
            if last and member:
                return self.graph.call_function(ops.flatten_members_last, (inputs[0], self.m))
            return self.graph.call_function(torch.flatten, (inputs[0], 1))
        if kind == "combine" and len(inputs) == 2:
            return self._note_same_shape(op, inputs, self._as_model(op, inputs, constants=lambda t: t))
        result = self._as_model(op, inputs, constants=lambda t: self._laid_out(t, step, op))
        return self._note_same_shape(op, inputs, result)

    def _note_same_shape(self, op: _Op, inputs: list[fx.Node], result: fx.Node) -> fx.Node:
        """Record which arguments of a sum or product ``result`` have its shape and dtype (it may be computed in
        place on one of them)."""
        if result.op != "call_function" or result.target not in (operator.add, operator.mul) or result.kwargs:
            return result
        seen = self.capture.seen
        like_result = {
            value for value, tensor in zip(inputs, op.tensors, strict=True)
            if (seen[tensor].shapes[0], seen[tensor].dtype) == (seen[op.node].shapes[0], seen[op.node].dtype)
        }  # fmt: skip
        self.same_shape[result] = tuple(i for i, argument in enumerate(result.args) if argument in like_result)
        return result

    def _laid_out(self, constant: Tensor, step: Step, op: _Op) -> fx.Node:
        """A constant operand of an elementwise operation, with its channels laid out like the compacted tensor."""
        rank = self.capture.seen[op.node].rank
        at = op.axis - (rank - constant.dim())
        if 0 <= at < constant.dim() and constant.shape[at] > 1:
            index, _ = channel_indices(step.placement.layouts)
            constant = constant.index_select(at, torch.as_tensor(index, device=constant.device))
        return self._attribute("operand", constant)

    def _mixing(self, step: Step, op: _Op, value: fx.Node) -> fx.Node:
        assert op.weight is not None
        rows = step.placement.layouts
        member = not step.placement.shared and self.m > 1
        bias = None if op.bias is None else _per_channel(op.bias, rows, 0.0)
        if step.node.kind == "grouped":
            index, valid = channel_indices(rows)
            weight = op.weight[torch.as_tensor(index, device=op.weight.device)]
            keep = torch.as_tensor(valid, device=weight.device).view(-1, *([1] * (weight.dim() - 1)))
            weight = torch.where(keep, weight, torch.zeros((), dtype=weight.dtype, device=weight.device))
            groups = step.groups * (len(rows) if not step.placement.shared else 1)
        else:
            cols = step.edges[0].placement.member_layouts(len(rows))
            r, c, valid = block_indices(rows, cols)
            picked = op.weight[torch.as_tensor(r), torch.as_tensor(c)]
            keep = torch.as_tensor(valid, device=picked.device).view(*valid.shape, *([1] * (op.weight.dim() - 2)))
            blocks = torch.where(keep, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
            if op.how == "linear" and member:
                shape = self.capture.seen[op.node].shapes[0]  # rows per call: at the example's batch, or chunk
                count = math.prod(shape[:-1]) * self.samples // self.capture.seen[self.capture.input].shapes[0][0]
                split = self.split_outputs.get(op.node, 1)  # a folded region's qkv: the members inside each part
                members = ops.MemberLinear(
                    blocks, bias, per_member=count >= PER_MEMBER_ROWS, output_split=split,
                    split_heads=self._split_heads(op.node, blocks.shape[1] // split) if split > 1 else 0,
                )  # fmt: skip
                return self._call("linear", members, value)
            weight = blocks.flatten(0, 1)
            groups = len(rows) if member else 1
        if op.how == "linear":
            linear = nn.Linear(
                weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
            )
            _load(linear, weight, bias)
            return self._call("linear", linear, value)
        settings = op.conv
        rows = settings["dims"] == 1  # a Conv1d runs as a Conv2d on one row of positions, channels last (below)
        if rows:
            settings = {
                **settings,
                "dims": 2,
                **{k: _one_row(settings[k], k) for k in ("stride", "padding", "dilation")},
            }
            weight = weight.unsqueeze(2)
            value = self.graph.call_method("unsqueeze", (value, 2))
        conv_type = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[settings["dims"]]
        conv = conv_type(
            weight.shape[1] * groups, weight.shape[0], cast(Any, tuple(weight.shape[2:])), stride=settings["stride"],
            padding=settings["padding"], dilation=settings["dilation"], groups=groups, bias=bias is not None,
            padding_mode=settings["padding_mode"], device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        _load(conv, weight, bias)
        memory_format = {4: torch.channels_last, 5: torch.channels_last_3d}.get(weight.dim())
        if memory_format is not None:
            conv = conv.to(memory_format=memory_format)  # type: ignore[call-overload]
            value = self.graph.call_method("contiguous", (value,), {"memory_format": memory_format})
        if step.node.kind != "grouped" and groups > 1 and self._few_positions(op, weight):
            result = self._call("conv", ops.MemberConv(conv, groups), value)
        else:
            result = self._call("conv", conv, value)
        return self.graph.call_method("squeeze", (result, 2)) if rows else result

    def _few_positions(self, op: _Op, weight: Tensor) -> bool:
        """Whether the members' convolution runs one member at a time (``MemberConv``): on CPU, where each member
        reads at least ``MEMBER_CONV_CHANNELS`` channels and its input has at most ``MEMBER_CONV_POSITIONS``
        positions per sample (a window wider than 1) or in all (the samples of a call at the example's batch
        size)."""
        if self.capture.device.type != "cpu" or weight.shape[1] < MEMBER_CONV_CHANNELS:
            return False
        shape = self.capture.seen[op.tensors[0]].shapes[0]
        positions = math.prod(shape[2:])
        if weight[0, 0].numel() > 1 and positions <= MEMBER_CONV_POSITIONS:
            return True
        return positions * self.samples <= MEMBER_CONV_POSITIONS

    def _split_heads(self, entry: fx.Node, part: int) -> int:
        """The heads per member of each ``part``-channel part of a split members' Linear ``entry`` (a fused qkv),
        where the reshape that reads it puts the members' heads of a part on one axis with the head's channels after
        it, (..., s, m*H, D); 0 otherwise (no such axis to give as a view)."""
        (reshape,) = entry.users
        if reshape not in self.fold_shapes:  # a split, not a reshape
            return 0
        fold, shape = self.folds.get(reshape), self.fold_shapes.get(reshape)
        if not isinstance(fold, Fold) or fold.outer != 1 or shape is None or fold.axis == len(shape) - 1:
            return 0
        heads = shape[fold.axis]
        return heads if heads * math.prod(shape[fold.axis + 1 :]) == part else 0

    def _norm(self, op: _Op, value: fx.Node, member: bool) -> fx.Node:
        node, module = op.node, op.module
        if isinstance(module, nn.LayerNorm) or node.target is F.layer_norm:
            if isinstance(module, nn.LayerNorm):
                weight, bias, eps = module.weight, module.bias, module.eps
            else:
                c = self.capture
                weight, bias, eps = (
                    c.argument(node, "weight", 2),
                    c.argument(node, "bias", 3),
                    c.argument(node, "eps", 4, 1e-5),
                )
            args = (value, self.m, self._optional(weight), self._optional(bias), eps)
            return self.graph.call_function(ops.layer_norm_members, args)
        if isinstance(module, nn.GroupNorm):
            groups, weight, bias, eps = module.num_groups, module.weight, module.bias, module.eps
        else:
            c = self.capture
            groups, weight, bias = (
                c.argument(node, "num_groups", 1),
                c.argument(node, "weight", 2),
                c.argument(node, "bias", 3),
            )
            eps = c.argument(node, "eps", 4, 1e-5)
        return self.graph.call_function(
            ops.group_norm_members, (value, self.m, groups, self._optional(weight), self._optional(bias), eps)
        )

    def _optional(self, tensor: Any) -> fx.Node | None:
        return None if tensor is None else self._attribute("norm", tensor.detach())

    def _count(self, step: Step, op: _Op) -> None:
        """The cost of each node (``masksembles_core.packing.program_macs``): a fallback's multiply-adds as the probe
        counted them in the dense model (matmuls, convolutions and attention, whatever function runs them), a
        compacted Linear or convolution's from its shapes."""
        seen = self.capture.seen[op.node]
        if step.node.kind == "fallback":
            if seen.macs:
                self.costs[step.name] = Cost(fallback=seen.macs)
            return
        seen = seen.parts[0] if seen.parts else seen
        if not seen.tensor or len(seen.batch_axes) != 1:
            return
        if op.weight is not None and op.how in ("linear", "conv"):
            positions = seen.per_sample // seen.shapes[0][op.axis]
            self.costs[step.name] = Cost(positions, math.prod(op.weight.shape[2:]))

    # ---- in place where nothing else reads

    def _fuse_attention(self) -> None:
        """Attention written out operation by operation (``softmax(q @ k^T * scale + mask) @ v``) as one
        ``F.scaled_dot_product_attention`` call, whose fused kernel reads the scores block by block instead of
        writing them, and every step after them, whole: m times the single model's where the members are folded
        into the heads."""
        for attention in written_attentions(self.capture):
            for node in fuse_written_attention(self.graph, self.values, attention):
                self.same_shape.pop(node, None)

    def _in_place(self) -> None:
        """Run elementwise operations, BatchNorm maps and sums in place on tensors that this graph made and that
        nothing else reads (fresh allocations of large activations cost more than the operations themselves)."""
        for node in list(self.graph.nodes):
            module = self.root.get_submodule(str(node.target)) if node.op == "call_module" else None
            if not node.args or (not self._owned(node.args[0]) and node not in self.same_shape):
                continue
            if isinstance(module, ops.Affine):
                module.inplace = True
            elif isinstance(module, nn.GELU) or (node.op == "call_function" and node.target is F.gelu):
                approximate = module.approximate if isinstance(module, nn.GELU) else node.kwargs.get("approximate")
                if len(node.args) == 1 and set(node.kwargs) <= {"approximate"}:
                    with self.graph.inserting_before(node):
                        gelu = self.graph.call_function(
                            torch.ops.aten.gelu_, node.args, {"approximate": approximate or "none"}
                        )
                    node.replace_all_uses_with(gelu)
                    self.graph.erase_node(node)
            elif _activation(module):
                twin = copy.copy(module)
                twin.inplace = True  # type: ignore[union-attr]
                name = f"{node.target}_inplace"
                self.root.add_module(name, twin)
                node.target = name
            elif node.op == "call_function" and node.target in IN_PLACE_FUNCTIONS:
                if len(node.args) == 1 and not node.kwargs:
                    node.target = IN_PLACE_FUNCTIONS[node.target]
            elif node.op == "call_function" and node.target in INPLACE_KEYWORD:
                if ("inplace" not in node.kwargs and len(node.args) == 1) or node.kwargs.get("inplace") is False:
                    node.kwargs = {**node.kwargs, "inplace": True}
            elif node.target is ops.add_shared:
                if node in self.same_shape and self._owned(node.args[0]):
                    node.target = ops.add_shared_
            elif node in self.same_shape:
                for i in self.same_shape[node]:
                    if self._owned(node.args[i]):
                        name = "add_" if node.target is operator.add else "mul_"
                        with self.graph.inserting_before(node):
                            replacement = self.graph.call_method(name, (node.args[i], node.args[1 - i]))
                        node.replace_all_uses_with(replacement)
                        self.graph.erase_node(node)
                        break

    def _member_major(self) -> None:
        """Hold each member's rows as one block, (m, ..., C), where a members' Linear layer reads or writes it
        without a copy: between two of them joined only by elementwise activations, from one into the
        member-stacked batch (``to_batch`` is then a view) and from the member-stacked batch through a channel
        gather into one (the gather picks each member's channels in its block)."""
        for node in list(self.graph.nodes):
            if self._member_linear(node):
                self._member_major_after(node)
            elif node in self.last_axis_frames and node.target is ops.to_channels:
                self._member_major_gather(node)

    def _member_major_after(self, node: fx.Node) -> None:
        current, chain = node, list[fx.Node]()
        while len(current.users) == 1:
            (user,) = current.users
            if self._member_linear(user) and user.args[0] is current:
                self._linear(node).member_major_out = self._linear(user).member_major_in = True
                self.mlps.append((node, chain, user))
                return
            if user in self.last_axis_frames and user.target is ops.to_batch and current is node:
                self._linear(node).member_major_out = True
                with self.graph.inserting_before(user):
                    user.replace_all_uses_with(self.graph.call_function(ops.batch_of_members, (node,)))
                self.graph.erase_node(user)
                return
            if not self._activation_of(user, current):
                return
            current = user
            chain.append(user)

    def _fuse_mlps(self) -> None:
        """Each members' Linear -> elementwise activations -> members' Linear becomes one ``MemberMLP`` (which runs
        them on tiles of rows on CPU)."""
        fused: set[fx.Node] = set()
        step_of = {node: name for name, node in self.values.items() if name in self.costs}  # the Linear layers'
        for first, chain, second in self.mlps:
            if first in fused:  # the second layer of the previous pair: that pair holds it
                continue
            graph = fx.Graph()
            copied = {first: graph.placeholder("hidden")}
            for node in chain:
                copied[node] = graph.node_copy(node, copied.__getitem__)
            graph.output(copied[chain[-1] if chain else first])
            modules = {str(n.target): self.root.get_submodule(str(n.target)) for n in chain if n.op == "call_module"}
            layers = self._linear(first), self._linear(second)
            for layer in layers:
                layer.per_member = False  # each tile runs one batched matmul
            activation = fx.GraphModule(modules, graph, class_name="Activation")
            name = f"mlp_{len(fused)}"
            mlp = ops.MemberMLP(layers[0], activation, layers[1])
            self.root.add_module(name, mlp)
            if mlp.padding:  # its zero hidden units are multiplied too: (m, I, H + padding), (m, H + padding, O)
                rows = self.costs[step_of[first]].positions  # rows per sample
                reads_and_writes = mlp.first.weight.shape[1] + mlp.second.weight.shape[2]
                self.macs["packed"] += rows * self.m * mlp.padding * reads_and_writes
            with self.graph.inserting_before(second):
                second.replace_all_uses_with(self.graph.call_module(name, (first.args[0],)))
            for node in (second, *reversed(chain), first):
                self.graph.erase_node(node)
            fused.add(second)

    def _direct_outputs(self) -> None:
        """An output leaf read from the members' blocks by a view of them, without the member-stacked batch in
        between: ``members_first(to_batch(x))`` becomes ``members_first`` of ``x``'s channel axis, and
        ``members_first`` of a member-major members' Linear's ``batch_of_members`` that output itself. Fewer copies,
        and no reshape whose size guards stop ``torch.export`` with a dynamic batch."""
        unread: list[fx.Node] = []  # what the outputs read before, erased once nothing reads it
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target is not ops.members_first:
                continue
            source, members, axis = node.args
            held = source
            if source.op == "call_function" and source.target is operator.getitem:
                parts, i = source.args
                if parts.op == "call_function" and parts.target is tuple:
                    held = parts.args[0][i]
                    unread.append(parts)
            if held.op == "call_function" and held.target is ops.to_batch and held.args[1:3] == (members, axis):
                with self.graph.inserting_before(node):
                    direct = self.graph.call_function(ops.members_first, (held.args[0], members, held.args[3]))
            elif held.op == "call_function" and held.target is ops.batch_of_members and axis == 0:
                direct = held.args[0]
            else:
                continue
            node.replace_all_uses_with(direct)
            unread += [held, source, node]
        unread = list(dict.fromkeys(unread))
        while dead := [node for node in unread if not node.users]:
            for node in dead:
                self.graph.erase_node(node)
                unread.remove(node)

    def _member_major_gather(self, frame: fx.Node) -> None:
        """``to_channels`` -> (``gather_channels`` on the channel axis ->) a members' Linear: each member's block of
        the member-stacked batch read as it is (a view), or its channels gathered from there."""
        if len(frame.users) != 1:
            return
        (user,) = frame.users
        if self._member_linear(user, reading=True) and user.args[0] is frame:
            with self.graph.inserting_before(frame):
                frame.replace_all_uses_with(self.graph.call_method("unflatten", (frame.args[0], 0, (self.m, -1))))
            self.graph.erase_node(frame)
            self._linear(user).member_major_in = True
            return
        gather = user
        if gather.target is not ops.gather_channels or len(gather.users) != 1 or gather.args[1] != frame.args[3]:
            return
        (linear,) = gather.users
        if not self._member_linear(linear, reading=True) or linear.args[0] is not gather:
            return
        index = self.root.get_buffer(str(cast(fx.Node, gather.args[2]).target))
        channels, width = self.last_axis_frames[frame], index.numel() // self.m
        local = index.view(self.m, width) - torch.arange(self.m, device=index.device).view(-1, 1) * channels
        if index.numel() != self.m * width or bool(((local < 0) | (local >= channels)).any()):
            return
        with self.graph.inserting_before(gather):
            picked = self.graph.call_function(
                ops.gather_member_blocks, (frame.args[0], self.m, self._attribute("index", local))
            )
        gather.replace_all_uses_with(picked)
        self.graph.erase_node(gather)
        self.graph.erase_node(frame)
        self._linear(linear).member_major_in = True

    def _linear(self, node: fx.Node) -> ops.MemberLinear:
        return cast(ops.MemberLinear, self.root.get_submodule(str(node.target)))

    def _member_linear(self, node: fx.Node, *, reading: bool = False) -> bool:
        """A members' Linear; unless only its input matters (``reading``), one whose output is in member blocks (not
        split for a folded region)."""
        if node.op != "call_module":
            return False
        module = self.root.get_submodule(str(node.target))
        return isinstance(module, ops.MemberLinear) and (reading or module.output_split == 1)

    def _activation_of(self, node: fx.Node, value: fx.Node) -> bool:
        """``node`` is an elementwise activation of ``value`` alone (its other arguments constants), whatever the
        layout of ``value``."""
        if not node.args or node.args[0] is not value:
            return False
        others = [*node.args[1:], *node.kwargs.values()]
        if any(isinstance(other, fx.Node) for other in others):
            return False
        if node.op == "call_module":
            module = self.root.get_submodule(str(node.target))
            return _activation(module) and not any(True for _ in module.parameters())
        if node.op == "call_function":
            return node.target in IN_PLACE_RESULTS or (
                node.target in ELEMENTWISE_FUNCTIONS and node.target is not F.rrelu
            )
        return False

    def _owned(self, value: Any) -> bool:
        """A tensor only one node reads that this graph allocated (not the caller's input or a buffer), or a view of
        one or an in-place result on one, each read by one node only."""
        if not isinstance(value, fx.Node) or len(value.users) != 1:
            return False
        if value.op == "call_module":
            module = self.root.get_submodule(str(value.target))
            if getattr(module, "inplace", False) is True:
                return self._owned(value.args[0])
            return isinstance(module, FRESH_MODULES) or _activation(module)
        if value.op == "call_function":
            written = value.target in IN_PLACE_RESULTS or value.target is ops.add_shared_
            if written or value.kwargs.get("inplace") is True:
                return self._owned(value.args[0])
            return value.target in FRESH_FUNCTIONS or (
                value.target in (operator.add, operator.mul) and value in self.same_shape
            )
        if value.op == "call_method" and str(value.target) in ("add_", "mul_", *VIEW_METHODS):
            return self._owned(value.args[0])
        return False

    # ---- the result

    def _output(self, squeeze: bool) -> None:
        program, capture = self.program, self.capture
        final = program.step(program.output)
        value = self.values[program.output]
        if program.output == OUTPUT:
            structure = next(n for n in capture.gm.graph.nodes if n.op == "output").args[0]
            leaves = [leaf for leaf in _leaves(structure) if leaf in capture.values]
            results = {}
            for i, leaf in enumerate(leaves):
                part = self.graph.call_function(operator.getitem, (value, i))
                results[leaf] = self._output_leaf(part, capture.seen[leaf].batch_axis, squeeze)
            self.graph.output(fx.node.map_arg(structure, lambda n: results[n] if n in results else self._scalar(n)))
            return
        if final.placement.shared:
            if not squeeze:
                members = self.m if self.returned is None else len(self.returned)
                value = self.graph.call_function(ops.repeat_members, (value, members))
        else:
            node = self.by_name[program.output]
            batch_axis = capture.seen[node].batch_axis
            axis = batch_axis if final.placement.dense else self.axis[node]
            if batch_axis <= 0 or squeeze:
                value = self._members_first(value, axis, squeeze)
            elif axis == batch_axis:  # sequence-first, the members' blocks on its batch axis: predict's layout
                value = self._output_leaf(value, axis, squeeze)
            else:  # sequence-first, the members elsewhere (side by side in the channels): moved into those blocks
                value = self.graph.call_function(ops.blocks_on, (value, self.m, axis, batch_axis, self.returned))
        self.graph.output(value)

    def _output_leaf(self, value: fx.Node, axis: int, squeeze: bool) -> fx.Node:
        """A leaf of the output structure, its batch on ``axis``, in ``predict``'s layout: (m, B, …) for a batch on
        axis 0; for one on another axis the members' blocks stay on it, (…, m*B, …), as ``predict`` returns a leaf
        whose axis 0 is not the tiled batch (XLNet's ``mems``, (L, n*B, H)); (…, B, …) for one member."""
        if axis <= 0 or squeeze:
            return self._members_first(value, axis, squeeze)
        if self.returned is None:
            return value
        return self.graph.call_function(ops.member_blocks, (value, self.m, axis, self.returned))

    def _members_first(self, value: fx.Node, axis: int, squeeze: bool) -> fx.Node:
        if axis < 0:  # no batch axis (a loss over the member-stacked batch): as predict returns it
            return value
        if self.returned is not None:  # computed for every member, some returned
            first = self.graph.call_function(ops.members_first, (value, self.m, axis))
            picked = self.graph.call_function(operator.getitem, (first, self.returned))
            return self.graph.call_function(operator.getitem, (picked, 0)) if squeeze else picked
        if squeeze:
            return value
        return self.graph.call_function(ops.members_first, (value, self.m, axis))


MATMULS = {torch.matmul, operator.matmul, torch.bmm}


# members' Linear layers on at least this many rows (at the example's batch size) run one matmul per member, reading
# and writing each member's block in place; fewer run one batched matmul (measured faster on CPU below ~1000 rows)
PER_MEMBER_ROWS = 1024


# the members' convolutions run one member at a time on CPU (``ops.MemberConv``) where each reads at least
# MEMBER_CONV_CHANNELS channels and their input has at most MEMBER_CONV_POSITIONS positions per sample (a window wider
# than 1) or in all at the example's batch size. Measured on CPU (2 threads, oneDNN), grouped / apart: a 3×3
# convolution of 4 × 512 channels on 4×4 positions 17.4 / 3.9 ms at batch 1, 36 / 24 at batch 8, 70 / 46 at batch 32
# (on 8×8, 2.1 / 2.0 at batch 1 and 12.1 / 13.2 at batch 8); a 1×1 convolution of 4 × 1024 channels on 4×4 positions
# 3.2 / 0.84 ms at batch 1, 6.4 / 8.2 at batch 8; narrower ones are as fast grouped or faster (4 × 256 channels, 3×3 on
# 2×2 positions: 0.59 / 0.53 ms at batch 1; 4 × 128, 3×3 on 4×4: 0.21 / 0.24), and a squeeze-excite block's 1×1
# convolutions on one position several times faster grouped at batch 16 (0.05 / 0.21 ms)
MEMBER_CONV_CHANNELS = 512
MEMBER_CONV_POSITIONS = 16


# producers whose result is a new tensor, and elementwise functions with an in-place form
FRESH_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, ops.MemberLinear, ops.MemberConv, ops.Affine)


FRESH_FUNCTIONS = {
    ops.gather_channels, ops.add_shared, ops.concat_members, ops.layer_norm_members, ops.group_norm_members,
    ops.mean_ratio_members,
    torch.relu, torch.sigmoid, torch.tanh, F.relu, F.gelu, F.silu, F.hardswish, F.hardsigmoid, F.prelu,
}  # fmt: skip


IN_PLACE_FUNCTIONS = {torch.relu: torch.relu_, torch.sigmoid: torch.sigmoid_, torch.tanh: torch.tanh_}


IN_PLACE_RESULTS = {*IN_PLACE_FUNCTIONS.values(), torch.ops.aten.gelu_}  # return their first argument, written


VIEW_METHODS = ("permute", "transpose", "view", "reshape", "flatten", "unflatten", "movedim", "contiguous", "squeeze")


INPLACE_KEYWORD = {F.relu, F.relu6, F.silu, F.hardswish, F.hardsigmoid, F.leaky_relu, F.elu, F.selu, F.celu, F.mish}


# views whose strides the packed program does not keep as the dense model has them (channels-last convolutions, the
# member-stacked batch): reshapes give the same values, copying where a view cannot
RESHAPING_VIEWS = {"view": "reshape", "view_as": "reshape_as"}


def _activation(module: nn.Module | None) -> bool:
    """An elementwise activation module with an ``inplace`` switch."""
    return isinstance(module, ELEMENTWISE_MODULES) and isinstance(getattr(module, "inplace", None), bool)


def _bytes(array: np.ndarray | None) -> bytes | None:
    return None if array is None else array.tobytes()


def _one_row(setting: Any, name: str) -> Any:
    """A Conv1d's stride, padding or dilation for the Conv2d that runs it on a (B, C, 1, L) view: 1, 0 and 1 on the
    height of one row ("same"/"valid" padding as it is). On CPU (2 threads, oneDNN; one run on a loaded machine,
    medians of 9 interleaved calls) a grouped Conv1d of 4 members took 1.2-1.5x the time of a dense Conv1d of as many
    multiply-adds (4 × 16 -> 4 × 32 channels, kernel 5, and 4 × 32 -> 4 × 32, kernel 3, on 256 positions at batch
    86), the same grouped Conv2d in channels-last memory 0.77x: issue #39's 1-D CNN ran packed at 2.5x its MAC
    ratio."""
    if isinstance(setting, str):
        return setting
    (width,) = setting if isinstance(setting, (tuple, list)) else (setting,)
    return (0 if name == "padding" else 1, width)


def _per_channel(vector: Tensor, layouts: Sequence[np.ndarray], padding: float) -> Tensor:
    """A per-channel vector laid out like ``layouts`` (member blocks side by side), ``padding`` at padded positions."""
    index, valid = channel_indices(layouts)
    picked = vector.detach()[torch.as_tensor(index, device=vector.device)]
    return torch.where(torch.as_tensor(valid, device=vector.device), picked, torch.full_like(picked, padding))


def _load(module: nn.Module, weight: Tensor, bias: Tensor | None) -> None:
    with torch.no_grad():
        cast(Tensor, module.weight).copy_(weight)
        if bias is not None:
            cast(Tensor, module.bias).copy_(bias)
    for parameter in module.parameters():
        parameter.requires_grad_(False)
