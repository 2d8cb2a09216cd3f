"""Deployed: the packed model with its uncertainty head, exported to ONNX and run in onnxruntime (CPU).

    python benchmarks/bench_deploy.py [--rounds 15] [--models MLP,ResNet,ViT-like]

N=4, S=2; the MLP, ResNet and ViT-like models of ``bench_packing.py`` (its builders). Every program is exported with
``torch.onnx.export(..., dynamo=True)`` and a dynamic batch, and runs in its own onnxruntime CPU session (one
intra-op thread, ``ORT_THREADS``). For batch 1 and 32: ``with_uncertainty(pack(model, x, program="packed"))`` (the
members and the head's dict in one graph) ÷ one forward of the same network without Masksembles, and
÷ ``with_uncertainty(model)`` (the Masksembles model on the tiled batch, as ``predict`` runs it, with the same head);
the packed program without the head ÷ single shows what the head costs. Both heads are first checked against
``uncertainty_head`` on ``predict``'s members. Interleaved rounds; the ratios are medians of the per-round ratios,
with their interquartile range. Beside them, the MAC ratio of the packed program (its Linear/Conv layers and
attention products ÷ one dense model's); target: packed + head ÷ single within 1.3× of the MAC ratio.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime
import torch
from _report import arguments, machine, publish
from bench_packing import MODELS, N, example, randomize_norms
from torch import nn

import masksembles_torch as mt
from masksembles_core import heads
from masksembles_core.packing import timed_rounds

BENCH_MODELS = ["MLP", "ResNet", "ViT-like"]
BATCHES = (1, 32)
TARGET = 1.3
# One intra-op thread per session: on a shared, loaded machine a thread pool's hand-offs between its threads (which
# sleep between runs, so that an idle session leaves the cores to the others) time the scheduler, not the model.
ORT_THREADS = 1


def onnx_session(module: nn.Module, x: torch.Tensor, path: Path) -> onnxruntime.InferenceSession:
    """``module`` exported to ONNX with a dynamic batch, in an onnxruntime CPU session."""
    batch = torch.export.Dim("batch", min=1, max=1024)
    names = list(module.outputs) if isinstance(module, mt.UncertaintyHead) else None
    torch.onnx.export(module, (x,), str(path), dynamo=True, dynamic_shapes=({0: batch},), output_names=names)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = ORT_THREADS, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle sessions leave the cores alone
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check_head(session: onnxruntime.InferenceSession, model: nn.Module, x: torch.Tensor) -> None:
    """The session's outputs equal ``uncertainty_head`` on ``predict(model, x)`` within float32 rounding, or raise:
    a benchmark of a program that differs would measure the wrong thing."""
    members = mt.predict(model, x).numpy()
    expected = heads.uncertainty_head(members)
    tolerance = 64 * float(np.finfo(np.float32).eps)
    for name, value in zip(expected, session.run(None, {"inputs": x.numpy()}), strict=True):
        np.testing.assert_allclose(value, expected[name], rtol=tolerance, atol=tolerance, err_msg=name)


def runner(session: onnxruntime.InferenceSession, x: np.ndarray, repeats: int) -> Callable[[], object]:
    """``repeats`` runs of ``session`` on ``x``: one timed call."""
    feed = {session.get_inputs()[0].name: x}

    def run() -> None:
        for _ in range(repeats):
            session.run(None, feed)

    return run


def repeats_for(call: Callable[[], object], seconds: float = 0.02) -> int:
    """How many runs of ``call`` take about ``seconds`` (a timed call long enough for the timer and the scheduler)."""
    times = timed_rounds({"call": call}, rounds=5, warmup=2)["call"]
    return max(1, round(seconds / statistics.median(times)))


def ratio(times: dict[str, list[float]], top: str, bottom: str) -> tuple[float, str]:
    """The median of the per-round ratios ``top`` ÷ ``bottom``, and it written with their interquartile range."""
    ratios = [a / b for a, b in zip(times[top], times[bottom], strict=True)]
    low, _, high = statistics.quantiles(ratios, n=4)
    median = statistics.median(ratios)
    return median, f"{median:.2f}× ({low:.2f}–{high:.2f})"


def main() -> None:
    args = arguments(models=BENCH_MODELS)
    lines = [
        "## Deployed: packed + uncertainty head in onnxruntime (CPU)",
        "",
        f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, float32, N={N}, S=2, {ORT_THREADS} "
        "intra-op thread (a thread pool's hand-offs on a loaded machine time the scheduler); "
        f"{args.rounds} interleaved rounds on {machine()} (a shared, loaded machine). Every program "
        "is exported with `torch.onnx.export(..., dynamo=True)` and a dynamic batch and runs in its own onnxruntime "
        "session; a timed call is as many runs as take the single model about 20 ms. Ratios: median of the "
        "per-round ratios (interquartile range). *packed + head*: "
        '`with_uncertainty(pack(model, x, program="packed"))`; *single*: the network without Masksembles; *tiled + '
        "head*: `with_uncertainty(model)`, the Masksembles model on the tiled batch as `predict` runs it, same head. "
        "Both heads' outputs are checked against `uncertainty_head` on `predict`'s members before timing. "
        f"Target: packed + head ÷ single within {TARGET}× of the MAC ratio.",
        "",
        "| model | batch | single (ms) | packed + head ÷ single | MAC ratio | within target | packed + head ÷ tiled "
        "+ head | packed (no head) ÷ single |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            factory, shape, _ = MODELS[name]
            masked = randomize_norms(factory(True)).eval()
            single = randomize_norms(factory(False)).eval()
            cpu = torch.device("cpu")
            probe = example(name, BATCHES[-1], shape, cpu)
            sessions = {
                "single": onnx_session(single, probe, Path(folder, f"{name}-single.onnx")),
                "tiled": onnx_session(mt.with_uncertainty(masked), probe, Path(folder, f"{name}-tiled.onnx")),
            }
            for batch in BATCHES:
                x = example(name, batch, shape, cpu)
                packed = mt.pack(masked, x, program="packed")
                head = mt.with_uncertainty(packed)
                # exported on the probe, as the others: on one sample torch.export fixes the batch at 1
                sessions["packed + head"] = onnx_session(head, probe, Path(folder, f"{name}-{batch}-head.onnx"))
                sessions["packed"] = onnx_session(packed, probe, Path(folder, f"{name}-{batch}.onnx"))
                for checked in ("packed + head", "tiled"):
                    check_head(sessions[checked], masked, x)
                repeats = repeats_for(runner(sessions["single"], x.numpy(), 1))
                calls = {key: runner(session, x.numpy(), repeats) for key, session in sessions.items()}
                times = timed_rounds(calls, rounds=args.rounds, warmup=3)
                macs = packed.macs
                mac_ratio = macs["packed"] / (macs["dense"] / N)
                to_single, written = ratio(times, "packed + head", "single")
                row = (
                    f"| {name} | {batch} | {statistics.median(times['single']) / repeats * 1e3:.2f} | {written} "
                    f"| {mac_ratio:.2f}× | {'yes' if to_single <= TARGET * mac_ratio else 'no'} "
                    f"({to_single / mac_ratio:.2f}× the MACs) | {ratio(times, 'packed + head', 'tiled')[1]} "
                    f"| {ratio(times, 'packed', 'single')[1]} |"
                )
                lines.append(row)
                print(row, flush=True)
    publish("deploy-onnxruntime-cpu", "\n".join(lines), write=not args.no_write)


if __name__ == "__main__":
    main()
