"""On CPU, a packed program proven to compute each sample from that sample alone runs on chunks of the batch (large
fresh buffers page-fault on every call): the proof over the traced graph (each operation's is ``_pack_samples``') and
the module that runs the chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, fx, nn

from masksembles_core.packing import OUTPUT, Program, samples_per_chunk

from . import _packed_ops as ops
from ._pack_capture import _Capture, _Seen
from ._pack_graph import _leaves
from ._pack_samples import _broadcast, _keeps_samples

# a CPU program proven per-sample whose largest tensor exceeds this size runs on chunks of the batch where it is at
# most this size: glibc hands large freed blocks back to the system (over 32 MiB at once, or when the top of its heap
# grows past twice the largest freed one), and every call then page-faults on them
CHUNK_BYTES = 16 * 2**20


def _samples_per_chunk(capture: _Capture, program: Program, example: Tensor) -> int:
    """How many samples a CPU program runs at a time, so that no tensor it makes is over ``CHUNK_BYTES`` (large fresh
    buffers page-fault on every call); 0 for one call on the whole batch, as when its largest tensor is at most that at
    the example's batch size. Tensors are sized as the program holds them (``_packed_scales``), not as the single model
    does: a member tensor holds its kept channels for every member, a folded one every channel of every member (BERT's
    attention scores, n times the single model's). Only a program proven to compute each sample's outputs from that
    sample alone is split: what falls back is an operation known to keep samples apart (``_keeps_samples``), every
    tensor the input reaches has one axis of exactly the batch size or none, no tensor without one is made from one with
    one (a reduction over the batch), none with one from none unless it broadcasts a tensor along it (a tensor built
    from the batch size), and every output has one."""
    by_name = {node.name: node for node in capture.gm.graph.nodes}
    scales = _packed_scales(program)
    fallbacks = [by_name[name] for name in (*program.fallbacks, *program.folded) if name != OUTPUT]
    if example.device.type != "cpu" or not all(_keeps_samples(capture, node) for node in fallbacks):
        return 0
    batch, largest = example.shape[0], 1

    def follows(seen: _Seen) -> bool | None:  # True: the batch is its one axis; False: no batch axis; None: neither
        if seen.parts:
            kinds = {follows(part) for part in seen.parts}
            return None if None in kinds or len(kinds) > 1 else kinds.pop()
        if not seen.tensor:
            return False
        axes = seen.batch_axes
        if not axes:
            return False
        if len(axes) != 1 or seen.shapes[0][axes[0]] != batch or seen.shapes[1][axes[0]] != batch + 1:
            return None
        return True

    for node in capture.dynamic:
        if node.op == "output":
            leaves = [leaf for leaf in _leaves(node.args[0]) if isinstance(leaf, fx.Node)]
            if not leaves or not all(follows(capture.seen[leaf]) for leaf in leaves):
                return 0
            continue
        seen = capture.seen[node]
        kind = follows(seen)
        if kind is None:
            return 0
        if kind and seen.tensor:  # not planned: as wide as the dense model's on the member-stacked batch
            scale = scales.get(node.name, len(program.members))
            largest = max(largest, round(seen.per_sample * (seen.dtype.itemsize if seen.dtype else 4) * scale))
        if node.op != "placeholder" and (seen.tensor or seen.parts):  # sizes and other values: each chunk its own
            inputs = [follows(capture.seen[n]) for n in node.all_input_nodes if n in capture.dynamic]
            if None in inputs or (kind != any(inputs) and not (kind and _broadcast(capture, node))):
                return 0
    return samples_per_chunk(batch, largest, CHUNK_BYTES)


def _packed_scales(program: Program) -> dict[str, float]:
    """Each planned node's tensor in the program ÷ the single model's: its copies (1 shared, else one per member)
    times the share of the channels each holds (its kept ones, padded; every one where it runs dense or folded)."""
    scales = {}
    for step in program.steps:
        copies = 1 if step.placement.shared else len(program.members)
        channels = step.node.channels
        scales[step.name] = copies * (step.placement.width / channels if channels > 0 else 1.0)
    return scales


def _in_chunks(packed: fx.GraphModule, example: Tensor, samples: int) -> tuple[nn.Module, fx.Graph]:
    """The root and graph of a program that runs ``packed`` on chunks of at most ``samples`` samples (the root holds
    it as ``per_chunk``)."""
    with torch.no_grad():
        layout = ops.leaf_batch_layout(packed(example[:1]), packed(example[:2]), 1)
    root = nn.Module()
    root.per_chunk = fx.GraphModule(packed, packed.graph, class_name="PerChunk")
    graph = fx.Graph()
    result = graph.call_function(ops.in_chunks, (graph.get_attr("per_chunk"), graph.placeholder("x"), samples, layout))
    graph.output(result)
    return root, graph


def _planned(capture: _Capture, chosen: Sequence[int]) -> list[int]:
    """The members to compute for ``chosen``: every member where a node runs per member on the member-stacked batch
    because it reads the batch (its size, as ``x.shape[0]`` or ``arange(B)``, or other samples, as a mean over the
    batch): in the dense model that batch holds every member's copy. Not for a node proven to compute each sample
    from that sample alone (``_keeps_samples``: a class token expanded to the batch size, a reshape with the batch
    first), whose rows do not depend on how many members the batch holds, nor for a Masksembles layer that falls back
    (the program's copy of it holds the computed members' masks, ``_Emitter._module``)."""
    per_member = any(
        op.kind == "fallback"
        and op.batch_dependent
        and not capture.calls_masks(op.node)
        and not _keeps_samples(capture, op.node)
        for op in capture.ops.values()
    )
    return list(range(capture.n)) if per_member else list(chosen)
