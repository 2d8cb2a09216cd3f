"""The operations a packed module's graph calls: channel moves between placements, and member-blocked kernels.

Tensors of a packed module are in one of two forms (``masksembles_core.packing``): *compacted*, with the members'
blocks side by side on the channel axis, (B, m*P, ...); or *dense*, every channel on the member-stacked batch,
(m*B, C, ...) with member ``k``'s copy of the batch in block ``k``, as the tiled dense model holds it.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn


def gather_channels(x: Tensor, axis: int, index: Tensor) -> Tensor:
    """``x.index_select(axis, index)``; a ``torch.gather`` over rows when ``axis`` is the innermost axis in memory
    (the last axis of a contiguous tensor, axis 1 of a channels-last one), 2-4x faster there on CPU.

    Exported (``torch.export``, ONNX, where the layout in memory is the runtime's), by the axis's place: the row
    gather on the last axis, ``index_select`` elsewhere. In onnxruntime (CPU, one thread) a ``Gather`` copies one
    block of the axes after ``axis`` per index, one element on the last axis: (32, 65, 384) -> 204 channels took
    14 ms as ``Gather``, 0.6 ms as the row gather (``GatherElements``); (32, 64, 32, 32) -> 136 channels on axis 1
    14 ms as ``Gather``, 46 ms as the row gather with the axis moved last and back (``Transpose``)."""
    exporting = torch.compiler.is_exporting()
    rows = x.movedim(axis, -1)
    if x.dim() > 1 and (axis == x.dim() - 1 if exporting else rows.is_contiguous()):
        flat = rows.reshape(-1, rows.shape[-1])
        picked = torch.gather(flat, 1, index.expand(flat.shape[0], -1))
        return picked.view(*rows.shape[:-1], -1).movedim(-1, axis)
    return x.index_select(axis, index)


def index_members(x: Tensor, axis: int, members: int, index: tuple[Any, ...], landing: int) -> Tensor:
    """``index`` (written out, with a full slice where ``axis`` is split) of each member's block of ``axis``: x's
    ``axis`` split as (members, -1), indexed, the result's member axis (``landing``) and the one after it merged."""
    split: Tensor = x.unflatten(axis, (members, -1))  # type: ignore[no-untyped-call]
    return split[index].flatten(landing, landing + 1)


def to_batch(x: Tensor, members: int, batch_axis: int, channel_axis: int) -> Tensor:
    """(…B…, m*C…) -> (…m*B…, C…): the members' channel blocks onto the batch, member ``k`` in block ``k``.

    Axes are non-negative. One concatenation, not a view of (…m, B…) flattened: merging a symbolic batch axis into
    the member axis before it gives strides ``min(C, C*B)`` under ``torch.export``, whose guards stop a dynamic batch.
    """
    return torch.cat(x.chunk(members, channel_axis), batch_axis)


def batch_of_members(x: Tensor) -> Tensor:
    """(m, B, ...) -> (m*B, ...) as a view, for a tensor whose member blocks follow each other in memory (a
    member-major members' Linear's output). Its strides are given, not derived: ``flatten(0, 1)`` would make them
    ``min(S, S*B)`` under ``torch.export``, as in ``to_batch``."""
    return x.as_strided((x.shape[0] * x.shape[1], *x.shape[2:]), x.stride()[1:], x.storage_offset())


def to_channels(x: Tensor, members: int, batch_axis: int, channel_axis: int) -> Tensor:
    """(…m*B…, C…) -> (…B…, m*C…): the reverse of ``to_batch`` (non-negative axes)."""
    split: Tensor = x.unflatten(batch_axis, (members, -1))  # type: ignore[no-untyped-call]
    return split.movedim(batch_axis, channel_axis).flatten(channel_axis, channel_axis + 1)


def tile(x: Tensor, members: int, batch_axis: int) -> Tensor:
    """A shared tensor repeated for every member along its batch axis: (…B…) -> (…m*B…)."""
    repeats = [1] * x.dim()
    repeats[batch_axis] = members
    return x.repeat(repeats)


def frame_size(x: Tensor, batch_axes: Sequence[int], factor: int, channel_axis: int, channels: int) -> torch.Size:
    """The size ``x`` has in the dense model: batch-proportional axes times ``factor``, the channel axis ``channels``.

    ``channel_axis`` -1 leaves the channels as they are (a dense tensor).
    """
    sizes = list(x.shape)
    for axis in batch_axes:
        sizes[axis] = sizes[axis] * factor
    if channel_axis >= 0:
        sizes[channel_axis] = channels
    return torch.Size(sizes)


def gather_member_blocks(x: Tensor, members: int, index: Tensor) -> Tensor:
    """(m*B, ..., C) on the member-stacked batch -> (m, B, ..., P): member ``k``'s channels ``index[k]`` (m, P)."""
    split: Tensor = x.unflatten(0, (members, -1))  # type: ignore[no-untyped-call]
    shape = (members, *([1] * (split.dim() - 2)), index.shape[1])
    return torch.gather(split, -1, index.view(shape).expand(*split.shape[:-1], index.shape[1]))


def members_first(x: Tensor, members: int, axis: int) -> Tensor:
    """(…, m*X, …) on ``axis`` -> (m, …, X, …): the members' blocks of one axis as the leading axis."""
    split: Tensor = x.unflatten(axis, (members, -1))  # type: ignore[no-untyped-call]
    return split.movedim(axis, 0)


def add_shared(member: Tensor, shared: Tensor, members: int, axis: int) -> Tensor:
    """``member + shared`` where ``shared`` holds one block that every member's block reads (no repeated copy)."""
    grouped: Tensor = member.unflatten(axis, (members, -1))  # type: ignore[no-untyped-call]
    return (grouped + shared.unsqueeze(axis)).flatten(axis, axis + 1)


def add_shared_(member: Tensor, shared: Tensor, members: int, axis: int) -> Tensor:
    """``add_shared`` written into ``member`` (which must have the result's shape and dtype)."""
    grouped: Tensor = member.unflatten(axis, (members, -1))  # type: ignore[no-untyped-call]  # a view: one axis split
    grouped.add_(shared.unsqueeze(axis))
    return member


def concat_members(parts: Sequence[Tensor], members: int, axis: int) -> Tensor:
    """Concatenate the parts member by member: block ``k`` of the result is the parts' blocks ``k``, in order."""
    split = [part.unflatten(axis, (members, -1)) for part in parts]  # type: ignore[no-untyped-call]
    return torch.cat(split, axis + 1).flatten(axis, axis + 1)


def flatten_members_last(x: Tensor, members: int) -> Tensor:
    """(B, *spatial, m*P) -> (B, m*spatial*P): a channels-last flatten with every member's features in one block."""
    split: Tensor = x.unflatten(-1, (members, -1))  # type: ignore[no-untyped-call]
    return split.movedim(-2, 1).flatten(1)


def layer_norm_members(x: Tensor, members: int, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over each member's block of the last axis (every channel of the member, zeros included)."""
    split: Tensor = x.unflatten(-1, (members, -1))  # type: ignore[no-untyped-call]
    return F.layer_norm(split, split.shape[-1:], weight, bias, eps).flatten(-2)


def mean_ratio(g: Tensor, dim: int, eps: float) -> Tensor:
    """GRN's ``g / (g.mean(dim, keepdim=True) + eps)``, the operations the model runs, in its order: what ``pack``'s
    capture makes of that pattern (one call the core reads as a ``"mean_ratio"``)."""
    return g / (g.mean(dim=dim, keepdim=True) + eps)


def mean_ratio_members(x: Tensor, members: int, axis: int, valid: Tensor, channels: int, eps: float) -> Tensor:
    """``mean_ratio`` on each member's block of ``axis`` (non-negative), its mean the sum of the block's channels
    (``valid``, (m*P,) bool: where the layout holds a channel, not padding) divided by the full width ``channels``:
    the channels a block leaves out are zeros, which add nothing to the sum."""
    split: Tensor = x.unflatten(axis, (members, -1))  # type: ignore[no-untyped-call]
    shape = [1] * split.dim()
    shape[axis : axis + 2] = [members, -1]
    total = torch.where(valid.view(shape), split, 0.0).sum(dim=axis + 1, keepdim=True)
    return (split / (total / channels + eps)).flatten(axis, axis + 1)


def unfold_patches(x: Tensor, kernel_size: Any, dilation: Any, padding: Any, stride: Any) -> Tensor:
    """MobileViT-v2's patches: ``F.unfold`` of (B, C, H, W) viewed (B, C, K, L), as the model computes them (on any
    number of channels: the sizes are read from ``x``)."""
    patches = F.unfold(x, kernel_size, dilation, padding, stride)
    return patches.reshape(x.shape[0], x.shape[1], -1, patches.shape[-1])


def fold_patches(
    patches: Tensor, output_size: Any, kernel_size: Any, dilation: Any, padding: Any, stride: Any
) -> Tensor:
    """MobileViT-v2's folding: (B, C, K, L) viewed (B, C*K, L), then ``F.fold`` to (B, C, H, W)."""
    return F.fold(patches.flatten(1, 2), output_size, kernel_size, dilation, padding, stride)


def patches_to_rows(x: Tensor, patch_height: int, patch_width: int) -> Tensor:
    """MobileViT's unfolding: (B, C, H, W) -> (B*ph*pw, (H/ph)*(W/pw), C), row b*ph*pw + i*pw + j holding position
    (i, j) of every patch of sample b (sizes read from ``x``: any number of channels)."""
    batch, channels, height, width = x.shape
    grid = x.reshape(batch, channels, height // patch_height, patch_height, width // patch_width, patch_width)
    return grid.permute(0, 3, 5, 2, 4, 1).reshape(batch * patch_height * patch_width, -1, channels)


def rows_to_patches(rows: Tensor, patch_height: int, patch_width: int, patches_high: int, patches_wide: int) -> Tensor:
    """MobileViT's folding, the inverse of ``patches_to_rows``: (B*ph*pw, patches, C) -> (B, C, H, W)."""
    channels = rows.shape[-1]
    grid = rows.reshape(-1, patch_height, patch_width, patches_high, patches_wide, channels)
    return grid.permute(0, 5, 3, 1, 4, 2).reshape(-1, channels, patches_high * patch_height, patches_wide * patch_width)


def group_norm_members(
    x: Tensor, members: int, groups: int, weight: Tensor | None, bias: Tensor | None, eps: float
) -> Tensor:
    """GroupNorm over each member's block of axis 1: ``groups`` groups per member (weights repeated per member)."""
    return F.group_norm(
        x,
        members * groups,
        None if weight is None else weight.repeat(members),
        None if bias is None else bias.repeat(members),
        eps,
    )


class Affine(nn.Module):
    """A per-channel map ``x * scale + shift`` (BatchNorm in eval) on ``axis`` of a rank-``rank`` input."""

    scale: Tensor
    shift: Tensor

    def __init__(self, scale: Tensor, shift: Tensor, axis: int, rank: int, *, inplace: bool = False) -> None:
        super().__init__()
        shape = [1] * rank
        shape[axis] = len(scale)
        self.register_buffer("scale", scale.reshape(shape))
        self.register_buffer("shift", shift.reshape(shape))
        self.inplace = inplace

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(self.scale).add_(self.shift) if self.inplace else torch.addcmul(self.shift, x, self.scale)

    def extra_repr(self) -> str:
        return f"channels={self.scale.numel()}, inplace={self.inplace}"


class MemberLinear(nn.Module):
    """One Linear per member on the member blocks of the last axis: (..., m*I) -> (..., m*O).

    ``per_member`` (chosen by ``pack`` from the rows at the example's batch size, so that the graph has no branch on
    shapes): one matmul per member, reading its block of the input in place and writing its block of the output, one
    fresh buffer; otherwise one batched matmul with the members moved to the front and back (faster on few rows).
    ``member_major_in``/``member_major_out`` (set by ``pack`` where the neighbouring operation reads or writes that
    layout) take/give (m, ..., I)/(m, ..., O) instead: every member's rows in one block, no copy.
    ``output_split`` s > 1 writes the output as (..., s, m, O/s): each of the s parts of the output holds the members'
    blocks side by side (a fused qkv Linear whose heads the members are folded into). With ``split_heads`` H as well
    (each part read as (H, O/(s*H)): heads of a size), it gives (..., s, m*H, O/(s*H)) instead, the heads of every
    member of a part on one axis, as a view: the weight's outputs are stored in (H, s, O/(s*H)) order, so that each
    member's matmul writes its block of a (rows, m, O) buffer in place and every part's head axis has one stride
    (one batched call, which runs one matmul per member: ``per_member`` does not apply).
    """

    def __init__(
        self, weight: Tensor, bias: Tensor | None, *, per_member: bool = False, output_split: int = 1,
        split_heads: int = 0,
    ) -> None:  # fmt: skip
        super().__init__()
        members, outputs, inputs = weight.shape
        if split_heads:  # outputs (s, H, D) -> (H, s, D): the parts of each head side by side
            order = (members, output_split, split_heads, -1)
            weight = weight.reshape(*order, inputs).transpose(1, 2).reshape(members, outputs, inputs)
            bias = None if bias is None else bias.reshape(order).transpose(1, 2).reshape(-1)
        self.weight = nn.Parameter(weight.transpose(1, 2).contiguous(), requires_grad=False)  # (m, I, O)
        self.bias = None if bias is None else nn.Parameter(bias.view(members, 1, outputs), requires_grad=False)
        self.per_member = per_member and not split_heads
        self.member_major_in = False
        self.member_major_out = False
        self.output_split = output_split
        self.split_heads = split_heads

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_exporting():
            return self.exported(x)
        stacked, lead = self.blocks(x)
        if self.split_heads:
            members, _, outputs = self.weight.shape
            y = stacked.new_empty(stacked.shape[1], members, outputs)
            self.batched(stacked, out=y.transpose(0, 1))  # one matmul per member, each writing its block
            return self.heads_split(y.view(*lead, members, outputs))
        if self.output_split > 1:
            members, _, outputs = self.weight.shape
            y = self.batched(stacked).view(members, -1, self.output_split, outputs // self.output_split)
            return y.permute(1, 2, 0, 3).reshape(*lead, members * outputs)
        if self.per_member:
            y, outs = self.result(stacked, lead)
            for k, (block, out) in enumerate(zip(stacked.unbind(0), outs.unbind(0), strict=True)):
                if self.bias is None:
                    _written(torch.mm, block, self.weight[k], out=out)
                else:
                    _written(torch.addmm, self.bias[k, 0], block, self.weight[k], out=out)
            return y
        return self.laid_out(self.batched(stacked), lead)

    def exported(self, x: Tensor) -> Tensor:
        """``forward`` as exported (``torch.export``, ONNX): one 2-D matmul per member on its block of the input, the
        results joined in the output's layout, every result a fresh tensor. onnxruntime prepacks a constant 2-D
        weight once, at load, and no stack of them (CPU, one thread, all 4 members: 32 rows, 1024 -> 1024, 10 ms as
        2-D matmuls, 18 ms batched; 2080 rows, 96 -> 384, 26 and 24 ms). A write into a block of a buffer would be a
        scatter over the whole buffer (ScatterElements)."""
        return self.joined([self.member_output(k, block) for k, block in enumerate(self.member_blocks(x))])

    def member_blocks(self, x: Tensor) -> list[Tensor]:
        """The input's member blocks, each (*lead, I)."""
        return list(x.unbind(0) if self.member_major_in else x.chunk(self.weight.shape[0], -1))

    def member_output(self, member: int, block: Tensor) -> Tensor:
        """Member ``member``'s Linear on its block: (*lead, I) -> (*lead, O)."""
        y = torch.matmul(block, self.weight[member])
        return y if self.bias is None else y + self.bias[member, 0]

    def joined(self, outputs: Sequence[Tensor]) -> Tensor:
        """The members' outputs, each (*lead, O), in the layout ``forward`` gives."""
        if self.member_major_out:
            return torch.stack(list(outputs))
        if self.split_heads:
            return self.heads_split(torch.stack(list(outputs), -2))
        if self.output_split > 1:
            y: Tensor = torch.stack(list(outputs), -2).unflatten(-1, (self.output_split, -1))  # type: ignore[no-untyped-call]
            return y.transpose(-3, -2).flatten(-3)  # (*lead, m, s, O/s) -> (*lead, s*m*O/s)
        return torch.cat(list(outputs), -1)

    def heads_split(self, y: Tensor) -> Tensor:
        """(*lead, m, O), O in (H, s, D) order -> (*lead, s, m*H, D) (``split_heads`` H, ``output_split`` s)."""
        heads: Tensor = y.unflatten(-1, (self.split_heads, self.output_split, -1))  # type: ignore[no-untyped-call]
        return heads.flatten(-4, -3).transpose(-3, -2)

    def laid_out(self, y: Tensor, lead: torch.Size) -> Tensor:
        """(m, rows, O) -> the output's layout: (m, *lead, O) when ``member_major_out``, else (*lead, m*O)."""
        members, _, outputs = self.weight.shape
        if self.member_major_out:
            return y.view(members, *lead, outputs)
        return y.transpose(0, 1).reshape(*lead, members * outputs)

    def blocks(self, x: Tensor) -> tuple[Tensor, torch.Size]:
        """The input's member blocks as (m, rows, I) (a view) and the input's leading shape (without m)."""
        members, inputs, _ = self.weight.shape
        if self.member_major_in:
            return x.reshape(members, -1, inputs), x.shape[1:-1]
        return x.reshape(-1, members, inputs).transpose(0, 1), x.shape[:-1]

    def result(self, stacked: Tensor, lead: torch.Size) -> tuple[Tensor, Tensor]:
        """A fresh output, (*lead, m*O) or (m, *lead, O) when ``member_major_out``, and its (m, rows, O) view."""
        members, _, outputs = self.weight.shape
        rows = stacked.shape[1]
        if self.member_major_out:
            y = stacked.new_empty(members, rows, outputs)
            return y.view(members, *lead, outputs), y
        y = stacked.new_empty(rows, members * outputs)
        return y.view(*lead, members * outputs), y.view(rows, members, outputs).transpose(0, 1)

    def batched(self, stacked: Tensor, out: Tensor | None = None) -> Tensor:
        """(m, rows, I) -> (m, rows, O): one batched matmul, written to ``out`` when given."""
        if self.bias is None:
            return _written(torch.bmm, stacked, self.weight, out=out)
        return _written(torch.baddbmm, self.bias, stacked, self.weight, out=out)

    def extra_repr(self) -> str:
        members, inputs, outputs = self.weight.shape
        flags = ("per_member", "member_major_in", "member_major_out")
        layout = "".join(f", {name}=True" for name in flags if getattr(self, name))
        layout += f", output_split={self.output_split}" if self.output_split > 1 else ""
        layout += f", split_heads={self.split_heads}" if self.split_heads else ""
        return f"members={members}, in_features={inputs}, out_features={outputs}, bias={self.bias is not None}{layout}"


class MemberConv(nn.Module):
    """The members' convolutions one by one, each on its block of the channels: (B, m*I, ...) -> (B, m*O, ...),
    equal to the grouped convolution ``grouped`` (groups = m, weights and settings its own) it is made from. On CPU
    oneDNN runs a grouped convolution of few positions several times slower than its groups apart (``pack`` chooses
    this form by ``MEMBER_CONV_POSITIONS``)."""

    def __init__(self, grouped: nn.Module, members: int) -> None:
        super().__init__()
        assert isinstance(grouped, nn.Conv1d | nn.Conv2d | nn.Conv3d) and grouped.groups == members
        outputs = grouped.out_channels // members
        self.convs = nn.ModuleList()
        for k in range(members):
            conv = nn.utils.skip_init(  # type: ignore[no-untyped-call]  # weights not drawn: they are set below
                type(grouped), grouped.in_channels // members, outputs, grouped.kernel_size, stride=grouped.stride,
                padding=grouped.padding, dilation=grouped.dilation, bias=grouped.bias is not None,
                padding_mode=grouped.padding_mode, device=grouped.weight.device, dtype=grouped.weight.dtype,
            )  # fmt: skip
            conv.weight = nn.Parameter(grouped.weight[k * outputs : (k + 1) * outputs].clone(), requires_grad=False)
            if grouped.bias is not None:
                conv.bias = nn.Parameter(grouped.bias[k * outputs : (k + 1) * outputs].clone(), requires_grad=False)
            self.convs.append(conv)

    def forward(self, x: Tensor) -> Tensor:
        blocks = x.chunk(len(self.convs), 1)
        return torch.cat([conv(block) for conv, block in zip(self.convs, blocks, strict=True)], 1)


def _written(function: Callable[..., Tensor], *args: Tensor, out: Tensor | None) -> Tensor:
    """``function(*args, out=out)``; when compiled or exported, computed and then copied into ``out`` (the compiler
    traces no strided ``out=``, and plans the memory itself)."""
    if out is None:
        return function(*args)
    if torch.compiler.is_compiling():
        return out.copy_(function(*args))
    return function(*args, out=out)


class MemberMLP(nn.Module):
    """Two members' Linear layers joined by elementwise activations: (..., m*I) -> (..., m*O), in and out in the
    layouts the two layers were given. On CPU they run on tiles of about ``tile_rows`` rows: each tile's hidden
    activations are made, activated in place and read while they are in cache, and the hidden layer is never held
    whole. One tile elsewhere and when compiled (the compiler fuses the activations itself, and tile bounds would
    put guards on the batch size); exported, each member's two layers and activations apart, as
    ``MemberLinear.exported``, into a fresh result. The hidden layer gets ``padding`` zero units that make its width a
    multiple of ``hidden_multiple``, where the activations keep 0 finite: the first layer writes 0 there (no weight,
    no bias), the second reads them with zero weights. MKL's matmul on CPU runs several times slower per unit on a
    width such as 205 or 273 than on 208 or 280.
    """

    tile_rows = 2048
    hidden_multiple = 8

    def __init__(self, first: MemberLinear, activation: fx.GraphModule, second: MemberLinear) -> None:
        super().__init__()
        self.first, self.activation, self.second = first, activation, second
        self.padding = self._pad_hidden()

    def _pad_hidden(self) -> int:
        """Zero hidden units up to a multiple of ``hidden_multiple``; how many (none where an activation of 0 is not
        finite: its value there is multiplied by 0)."""
        weight, bias = self.first.weight, self.first.bias  # (m, I, H), (m, 1, H)
        extra = -weight.shape[2] % self.hidden_multiple
        with torch.no_grad():
            if not extra or not bool(self.activation(weight.new_zeros(1, 1, extra)).isfinite().all()):
                return 0
            self.first.weight = nn.Parameter(F.pad(weight, (0, extra)), requires_grad=False)
            if bias is not None:
                self.first.bias = nn.Parameter(F.pad(bias, (0, extra)), requires_grad=False)
            self.second.weight = nn.Parameter(F.pad(self.second.weight, (0, 0, 0, extra)), requires_grad=False)
        return extra

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_exporting():  # each member's two layers apart, as MemberLinear.exported
            blocks = self.first.member_blocks(x)
            hidden = [self.activation(self.first.member_output(k, block)) for k, block in enumerate(blocks)]
            return self.second.joined([self.second.member_output(k, h) for k, h in enumerate(hidden)])
        stacked, lead = self.first.blocks(x)
        y, outs = self.second.result(stacked, lead)
        rows = stacked.shape[1]
        cpu = stacked.device.type == "cpu" and not torch.compiler.is_compiling()
        tiles = max(1, round(rows / self.tile_rows)) if cpu else 1
        for start, stop in itertools.pairwise([rows * t // tiles for t in range(tiles + 1)]):
            self.second.batched(self.activation(self.first.batched(stacked[:, start:stop])), out=outs[:, start:stop])
        return y

    def extra_repr(self) -> str:
        names = [
            type(self.activation.get_submodule(str(node.target))).__name__
            if node.op == "call_module"
            else getattr(node.target, "__name__", str(node.target))
            for node in self.activation.graph.nodes
            if node.op.startswith("call")
        ]
        padding = f", hidden_padding={self.padding}" if self.padding else ""
        return f"tile_rows={self.tile_rows}, activations=[{', '.join(names)}]{padding}"


def macs(weight_shape: Sequence[int], output_shape: Sequence[int], channel_axis: int) -> int:
    """Multiply-adds of a Linear/convolution: its output elements times the inputs each one reads."""
    per_output = math.prod(weight_shape[1:]) if len(weight_shape) > 2 else weight_shape[-1]
    return int(math.prod(output_shape)) * int(per_output) if channel_axis >= 0 else 0


def tile_parts(parts: Sequence[Tensor], members: int, batch_axes: Sequence[int]) -> tuple[Tensor, ...]:
    """``tile`` for each tensor of a tuple (batch axis -1: the same for every member, left as it is)."""
    return tuple(part if axis < 0 else tile(part, members, axis) for part, axis in zip(parts, batch_axes, strict=True))


def _map_leaves(function: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` (tuples, lists and dicts of leaves) with ``function`` applied to every leaf, in order."""
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_leaves(function, item) for item in tree)
    if isinstance(tree, dict):  # a transformers ModelOutput keeps its class
        mapped = copy.copy(tree)
        for key, item in tree.items():
            mapped[key] = _map_leaves(function, item)
        return mapped
    return function(tree)


def leaves(tree: Any) -> list[Any]:
    found: list[Any] = []
    _map_leaves(found.append, tree)
    return found


def leaf_batch_layout(small: Any, large: Any, batch: int) -> tuple[tuple[int, int], ...]:
    """The batch axis of each tensor leaf of a model's output and how many blocks of the batch it holds there, from
    its outputs on ``batch`` samples (``small``) and on more (``large``): ``(axis, 1)`` for the batch on ``axis``,
    ``(axis, m)`` for m blocks of it (a packed program's members in ``predict``'s layout), ``(-1, 1)`` for a leaf that
    does not follow the batch."""
    layout = []
    for a, b in zip(leaves(small), leaves(large), strict=True):
        if not isinstance(a, Tensor):
            layout.append((-1, 1))
            continue
        changed = [i for i, (p, q) in enumerate(zip(a.shape, b.shape, strict=True)) if p != q]
        if changed and (len(changed) > 1 or a.shape[changed[0]] % batch):
            raise ValueError(f"pack/extract_member: an output of shape {tuple(a.shape)} has no member-stacked batch")
        layout.append((changed[0], a.shape[changed[0]] // batch) if changed else (-1, 1))
    return tuple(layout)


def leaf_batch_axes(small: Any, large: Any, batch: int) -> tuple[int, ...]:
    """The batch axis of each tensor leaf of a model's output, from its outputs on ``batch`` member-stacked samples
    (``small``) and on more (``large``); -1 for a leaf that does not follow the batch."""
    layout = leaf_batch_layout(small, large, batch)
    for leaf, (_, blocks) in zip(leaves(small), layout, strict=True):
        if blocks != 1:
            raise ValueError(f"pack/extract_member: an output of shape {tuple(leaf.shape)} has no member-stacked batch")
    return tuple(axis for axis, _ in layout)


def member_blocks(x: Tensor, members: int, axis: int, chosen: Sequence[int]) -> Tensor:
    """The ``chosen`` members' blocks of ``axis``, in ``chosen``'s order: (…, m*X, …) -> (…, len(chosen)*X, …)."""
    picked: Tensor = members_first(x, members, axis)[list(chosen)]
    return picked.movedim(0, axis).flatten(axis, axis + 1)


def blocks_on(x: Tensor, members: int, axis: int, batch_axis: int, chosen: Sequence[int] | None) -> Tensor:
    """The members' blocks of ``axis`` (all, or the ``chosen`` ones in order) moved onto ``batch_axis`` of the
    member-free shape: ``predict``'s layout (…, m*B, …) of an output whose batch is on ``batch_axis`` (> 0), from a
    packed value that holds the members elsewhere (side by side in its channels, (L, B, m*C))."""
    split = members_first(x, members, axis)
    if chosen is not None:
        split = split[list(chosen)]
    return split.movedim(0, batch_axis).flatten(batch_axis, batch_axis + 1)


def select_members(tree: Any, members: int, axes: Sequence[int], chosen: Sequence[int], squeeze: bool) -> Any:
    """Every tensor leaf (…, m*B, …) with its batch on ``axes[i]`` in ``predict``'s layout for the ``chosen`` members:
    (len(chosen), B, …) for a batch on axis 0, the members' blocks left on the batch axis for one on another axis
    (…, len(chosen)*B, …), as ``predict`` returns a leaf whose axis 0 is not the tiled batch (XLNet's ``mems``, (L,
    n*B, H)); (…, B, …) for one member when ``squeeze``. Leaves without a batch axis are returned as they are."""
    positions = iter(axes)
    every = list(range(members))

    def select(leaf: Any) -> Any:
        axis = next(positions)
        if axis < 0:
            return leaf
        if axis > 0 and not squeeze:
            return leaf if list(chosen) == every else member_blocks(leaf, members, axis, chosen)
        split = members_first(leaf, members, axis)[list(chosen)]
        return split[0] if squeeze else split

    return _map_leaves(select, tree)


def in_chunks(program: nn.Module, x: Tensor, samples: int, layout: Sequence[tuple[int, int]]) -> Any:
    """``program(x)`` computed on chunks of equal size (at most ``samples`` samples) of ``x``, each output leaf
    joined along its batch axis (``layout``, ``leaf_batch_layout``: a leaf holding m blocks of the batch on its axis
    joined block by block): for a program whose outputs for a sample depend on that sample alone. One call when
    compiled or exported (a loop over the batch would put guards on its size)."""
    if torch.compiler.is_compiling() or x.shape[0] <= samples:
        return program(x)
    results = [program(part) for part in x.tensor_split(-(-x.shape[0] // samples))]
    columns = zip(*(leaves(result) for result in results), strict=True)
    joined = iter([_joined(parts, axis, blocks) for parts, (axis, blocks) in zip(columns, layout, strict=True)])
    return _map_leaves(lambda _: next(joined), results[0])


def _joined(parts: Sequence[Tensor], axis: int, blocks: int) -> Tensor:
    """Chunks' parts of one output leaf joined on ``axis``, where each holds ``blocks`` blocks of its chunk."""
    if blocks == 1:
        return torch.cat(list(parts), axis)
    split = [part.unflatten(axis, (blocks, -1)) for part in parts]  # type: ignore[no-untyped-call]
    return torch.cat(split, axis + 1).flatten(axis, axis + 1)


def repeat_members(x: Tensor, members: int) -> Tensor:
    """A shared result as every member's: (B, ...) -> (m, B, ...) (a broadcast view)."""
    return x.unsqueeze(0).expand(members, *x.shape)
