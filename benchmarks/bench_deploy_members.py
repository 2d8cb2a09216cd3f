"""Where the deployed packed model's time goes in onnxruntime (CPU): the members run apart, and each kind of operation.

    python benchmarks/bench_deploy_members.py [--rounds 15] [--models ViT-like,ResNet] [--profile-runs 5]

Every program is exported and run as ``bench_deploy.py`` runs it (``torch.onnx.export(..., dynamo=True)``, dynamic
batch, one intra-op thread). For batch 1 and 32:

- interleaved rounds of the single model, ``with_uncertainty(pack(model, x, program="packed"))`` and each of the N
  members exported alone (``extract_member``: the member's layers shrunk to its channels, an ordinary dense network,
  checked against ``predict``'s member), run one after another. *members ÷ single* is what the members cost with
  nothing packed: a packed program that runs each member's operations on that member's data does the same work, so its
  time stays near this however its members are laid out (packed + head ÷ members says how near). Beside it, the MAC
  ratio (``bench_deploy.py``'s); the target there is packed + head ÷ single within 1.3× of it.
- onnxruntime's profiler on the single model, member 0 and packed + head (``--profile-runs`` runs after 3 warm-ups, one
  profile each, not interleaved: compare the kinds within a program, and programs only roughly): kernel time per run
  by kind of operation, and the fusions each optimized graph got (fused ops' names, counted).

``--models`` also takes the ViT-like made wider (``WIDER``), where the layers the masks narrow weigh more.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import torch
from bench_deploy import ORT_THREADS, check_head, onnx_session, ratio, repeats_for, runner
from bench_packing import MODELS, N, ViT, example, inserted, randomize_norms
from torch import nn

import masksembles_torch as mt
from masksembles_core.packing import timed_rounds

BATCHES = (1, 32)
# the ViT-like made wider (``--models``): its Linear layers, which the masks narrow, take a larger share of its time
WIDER = {
    "ViT-like dim 192": (inserted(lambda: ViT(dim=192, heads=3)), (3, 32, 32), BATCHES),
    "ViT-like dim 384 (6 heads)": (inserted(lambda: ViT(dim=384, heads=6)), (3, 32, 32), BATCHES),
}
ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Relu", "Gelu", "BiasGelu", "Erf", "Where", "Clip", "Sum", "Max", "Min"}
LAYOUT = {"Transpose", "Split", "Concat", "Reshape", "Slice", "Squeeze", "Unsqueeze", "ReorderInput", "ReorderOutput"}
FUSED = {"BiasGelu", "FusedMatMul", "FusedConv", "Gemm", "LayerNormalization", "SkipLayerNormalization", "Attention"}


def kind(op: str, input_ranks: list[int]) -> str:
    """The row of the profile table that an operation's kernel time goes to."""
    if op in {"MatMul", "FusedMatMul", "Gemm"}:
        return "attention matmuls (QK, AV)" if input_ranks and min(input_ranks[:2]) == 4 else "Linear matmuls"
    if op in {"Conv", "FusedConv"}:  # FusedConv: a Conv with its activation (or sum) that NCHWc does not take
        return "Conv"
    if op in {"Gather", "GatherElements", "Expand"}:
        return f"channel gathers: {op}"
    if op in {"Softmax", "LayerNormalization", "SkipLayerNormalization", "BatchNormalization"}:
        return op if op != "SkipLayerNormalization" else "LayerNormalization"
    if op in LAYOUT:
        return f"layout: {op}" if op in {"Transpose", "Split", "Concat"} else "layout: other"
    return "elementwise" if op in ELEMENTWISE else "other"


def profile(
    module: nn.Module, probe: torch.Tensor, x: torch.Tensor, folder: Path, tag: str, runs: int
) -> tuple[dict[str, float], str]:
    """Kernel milliseconds per run on ``x`` by ``kind`` over ``runs`` profiled runs (after 3 warm-ups, which the
    profile also records: only the last ``runs`` runs' events count) of ``module`` exported on ``probe`` (a dynamic
    batch), and the fused operations of the optimized graph, counted."""
    path = folder / f"{tag}.onnx"
    batch = torch.export.Dim("batch", min=1, max=1024)
    names = list(module.outputs) if isinstance(module, mt.UncertaintyHead) else None
    torch.onnx.export(module, (probe,), str(path), dynamo=True, dynamic_shapes=({0: batch},), output_names=names)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = ORT_THREADS, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.optimized_model_filepath = str(folder / f"{tag}.optimized.onnx")
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / tag)
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x.numpy()}
    for _ in range(3 + runs):
        session.run(None, feed)
    events = json.loads(Path(session.end_profiling()).read_text())
    runs_seen = [e for e in events if e.get("name") == "model_run"]
    first_counted = runs_seen[-runs]["ts"]
    totals: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= first_counted:
            ranks = [len(next(iter(shape.values()))) for shape in event["args"].get("input_type_shape", [])]
            totals[kind(event["args"]["op_name"], ranks)] += event["dur"] / runs / 1e3
    graph = onnx.load(str(folder / f"{tag}.optimized.onnx")).graph
    fused = collections.Counter(node.op_type for node in graph.node if node.op_type in FUSED)
    return dict(totals), ", ".join(f"{op} {count}" for op, count in sorted(fused.items()))


def timings(
    name: str, masked: nn.Module, single: nn.Module, x: torch.Tensor, probe: torch.Tensor, folder: Path, rounds: int
) -> str:
    """The interleaved row of one model and batch ``x`` (markdown), every program exported on ``probe`` (a batch of
    another size: exported on one sample, ``torch.export`` fixes the batch at 1)."""
    packed = mt.pack(masked, x, program="packed")
    head = mt.with_uncertainty(packed)
    sessions = {
        "single": onnx_session(single, probe, folder / "single.onnx"),
        "packed + head": onnx_session(head, probe, folder / "head.onnx"),
    }
    check_head(sessions["packed + head"], masked, x)
    expected = mt.predict(masked, x).numpy()
    tolerance = 64 * float(np.finfo(np.float32).eps)
    for k in range(N):
        session = onnx_session(mt.extract_member(masked, k, x), probe, folder / f"member{k}.onnx")
        (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        np.testing.assert_allclose(got, expected[k], rtol=tolerance, atol=tolerance, err_msg=f"member {k}")
        sessions[f"member {k}"] = session
    repeats = repeats_for(runner(sessions["single"], x.numpy(), 1))
    calls = {key: runner(session, x.numpy(), repeats) for key, session in sessions.items()}
    times = timed_rounds(calls, rounds=rounds, warmup=3)
    times["members"] = [sum(column) for column in zip(*(times[f"member {k}"] for k in range(N)), strict=True)]
    macs = packed.macs
    mac_ratio = macs["packed"] / (macs["dense"] / N)
    apart, apart_written = ratio(times, "members", "single")
    packed_ratio, packed_written = ratio(times, "packed + head", "single")
    return (
        f"| {name} | {x.shape[0]} | {statistics.median(times['single']) / repeats * 1e3:.2f} | {mac_ratio:.2f}× "
        f"| {apart_written} | {apart / mac_ratio:.2f}× | {packed_written} | {packed_ratio / mac_ratio:.2f}× "
        f"| {ratio(times, 'packed + head', 'members')[1]} |"
    )


def profile_table(
    name: str, masked: nn.Module, single: nn.Module, x: torch.Tensor, probe: torch.Tensor, folder: Path, runs: int
) -> str:
    """The profile of one model and batch (markdown): kernel ms per run by kind, and each graph's fusions."""
    programs = {
        "single": single,
        "member 0": mt.extract_member(masked, 0, x),
        "packed + head": mt.with_uncertainty(mt.pack(masked, x, program="packed")),
    }
    profiles = {
        key: profile(module, probe, x, folder, key.replace(" ", "_").replace("+", "p"), runs)
        for key, module in programs.items()
    }
    kinds = sorted(
        {k for totals, _ in profiles.values() for k in totals}, key=lambda k: -profiles["packed + head"][0].get(k, 0.0)
    )
    lines = [
        f"{name}, batch {x.shape[0]}: kernel ms per run ({runs} runs)",
        "",
        "| kind | single | member 0 | packed + head | member 0 ÷ single | packed + head ÷ single |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in [*kinds, "total"]:
        ms = {key: sum(t.values()) if row == "total" else t.get(row, 0.0) for key, (t, _) in profiles.items()}
        shares = [
            f"{ms[key] / ms['single']:.2f}×" if ms["single"] > 0.005 else "–" for key in ("member 0", "packed + head")
        ]
        lines.append(
            f"| {row} | {ms['single']:.2f} | {ms['member 0']:.2f} | {ms['packed + head']:.2f} | {' | '.join(shares)} |"
        )
    lines += ["", *(f"- fusions, {key}: {fused}" for key, (_, fused) in profiles.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--profile-runs", type=int, default=5, help="profiled runs (0: no profile)")
    parser.add_argument(
        "--models",
        type=lambda text: text.split(","),
        default=["ViT-like", "ResNet"],
        help=f"comma-separated, from: {', '.join([*MODELS, *WIDER])}",
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, float32, N={N}, S=2, {ORT_THREADS} "
        f"intra-op thread; {args.rounds} interleaved rounds. Ratios: median of the per-round ratios (interquartile "
        "range); members: the N members each exported alone (extract_member), run one after another.\n\n"
        "| model | batch | single (ms) | MAC ratio | members ÷ single | members' multiple of the MACs "
        "| packed + head ÷ single | packed + head's multiple of the MACs | packed + head ÷ members |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        flush=True,
    )
    profiles = []
    for name in args.models:
        factory, shape, _ = {**MODELS, **WIDER}[name]
        masked = randomize_norms(factory(True)).eval()
        single = randomize_norms(factory(False)).eval()
        probe = example(name, max(BATCHES), shape, torch.device("cpu"))
        for batch in BATCHES:
            x = example(name, batch, shape, torch.device("cpu"))
            with tempfile.TemporaryDirectory() as folder:
                print(timings(name, masked, single, x, probe, Path(folder), args.rounds), flush=True)
                if args.profile_runs:
                    profiles.append(profile_table(name, masked, single, x, probe, Path(folder), args.profile_runs))
    print("", *profiles, sep="\n\n")


if __name__ == "__main__":
    main()
