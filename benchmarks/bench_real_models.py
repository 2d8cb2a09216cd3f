"""``pack`` on real architectures at their published sizes (Hugging Face ``transformers``, random init, no download).

    python benchmarks/bench_real_models.py --out run1.json [--rounds 5] [--batches 1,32] [--models ResNet-50,...]
    python benchmarks/bench_real_models.py --combine run1.json run2.json run3.json [--no-write]
    python benchmarks/bench_real_models.py --smoke --out smoke.json   # one tiny config, seconds

Issue #39's "real models" table. Each model is built from its config (``transformers`` initialises the weights at
random; nothing is downloaded) at its published size, float32, eval mode, and gets its masks the way a user would:
``convert_dropout`` where the published config has hidden-state dropout (BERT-base, GPT-2), ``insert``'s defaults
elsewhere; N=4, S=2. Images are 224×224 (MobileViT-v2: 256×256, its published size), text is 128 token ids with an
``attention_mask`` (each sample right-padded with id 0 after a random length of 64-128), classified by the
``...ForSequenceClassification`` head (2 labels; GPT-2 and Falcon: the last real token, ``use_cache=False``).

For every model and batch size: ``pack(model, x, program="packed")`` and ``pack(model, x)`` (``program="auto"``), each
build timed; both programs' outputs are checked against ``predict`` on the whole example batch with ``pack``'s own
rule (``masksembles_core.packing.output_mismatch``: ``sqrt(eps)`` times the largest ``|value|``), and the run stops
on a difference. Then, timed in turn within each round (median of ``--rounds`` rounds after one warm-up round): one
forward of the same network without masks (same weights), tiled ``predict``, the packed program, and the auto one
where it is not the packed program itself (``program == "packed"`` with the same chunking; it then is that program,
so its time is the packed one's). Each run writes its rows to ``--out`` (JSON); ``--combine`` turns one or more runs
into the BENCHMARKS.md section: medians over the runs, the runs' range in brackets. Not part of ``nox -s bench``:
the ten models at batch 1 took 43 minutes on the loaded 2-core machine, and batch 32 far longer."""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as T
from _report import machine, publish
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import masksembles_torch as mt
from masksembles_core.packing import output_mismatch, timed_rounds

N, SCALE = 4, 2.0
LENGTH = 128  # text: tokens per sample
SECTION = "real-models-torch"
VACUOUS = 1e-20  # outputs this small (random init vanishing to denormals or 0) make the check say nothing
AUTO_TOLERANCE = 1.10  # auto "picks the faster" where its program is within the 10 % its rule allows


@dataclass(frozen=True)
class RealModel:
    """A ``transformers`` model built from a config: how it gets its masks and what it is called with."""

    build: Callable[[], nn.Module]
    masks: str  # "insert" or "convert_dropout"
    image_size: int | None = None  # None: text of LENGTH tokens
    causal: bool = False  # a decoder: called with use_cache=False


def vit_small() -> nn.Module:
    """ViT-S/16: hidden 384, 12 layers, 6 heads, MLP 1536, 224×224, 16×16 patches."""
    config = T.ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536)
    return T.ViTForImageClassification(config)


def activations_kept(model: nn.Module) -> nn.Module:
    """``model`` with its convolutions drawn He-normal by fan-in and its BatchNorm/GroupNorm scales 1 (biases 0):
    ``transformers`` draws both from N(0, 0.02), under which EfficientNet's and MobileViT-v2's activations shrink
    block by block to denormals and then 0 (no output to check, and denormal arithmetic in the timings); drawn so,
    their last hidden states stay near 0.01 and 7 (batch 2, no masks), and the masked models' largest outputs at
    batch 32 are 3e-6 and 0.5."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.BatchNorm2d | nn.GroupNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    return model


def efficientnet_b0() -> nn.Module:
    """EfficientNet-B0 (google/efficientnet-b0's config): width and depth 1.0, 224×224, head 1280, dropout 0.2."""
    config = T.EfficientNetConfig(
        width_coefficient=1.0, depth_coefficient=1.0, image_size=224, hidden_dim=1280, dropout_rate=0.2
    )
    return activations_kept(T.EfficientNetForImageClassification(config))


def mobilevit_v2() -> nn.Module:
    """MobileViT-v2 at width 1.0, 256×256."""
    return activations_kept(T.MobileViTV2ForImageClassification(T.MobileViTV2Config(width_multiplier=1.0)))


def falcon_small() -> nn.Module:
    """Falcon-7B's layout (multi-query attention: 12 query heads of 64, one key/value head; attention and MLP in
    parallel; rotary positions; vocabulary 65,024) at GPT-2 small's size: hidden 768, 12 layers, MLP 3072."""
    config = T.FalconConfig(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_hidden_size=3072, multi_query=True,
        parallel_attn=True, new_decoder_architecture=False, alibi=False, pad_token_id=0, num_labels=2,
    )  # fmt: skip
    return T.FalconForSequenceClassification(config)


def bert_tiny() -> nn.Module:
    """``--smoke`` only: BERT at hidden 32, 2 layers, 2 heads."""
    config = T.BertConfig(
        vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=LENGTH, num_labels=2,
    )  # fmt: skip
    return T.BertForSequenceClassification(config)


MODELS: dict[str, RealModel] = {
    "ConvNeXt-V2-T": RealModel(lambda: T.ConvNextV2ForImageClassification(T.ConvNextV2Config()), "insert", 224),
    "PoolFormer-S12": RealModel(lambda: T.PoolFormerForImageClassification(T.PoolFormerConfig()), "insert", 224),
    "ResNet-50": RealModel(lambda: T.ResNetForImageClassification(T.ResNetConfig()), "insert", 224),
    "ViT-S/16": RealModel(vit_small, "insert", 224),
    "MobileViT-v2-1.0": RealModel(mobilevit_v2, "insert", 256),
    "EfficientNet-B0": RealModel(efficientnet_b0, "insert", 224),
    "Swin-T": RealModel(lambda: T.SwinForImageClassification(T.SwinConfig()), "insert", 224),
    "GPT-2": RealModel(
        lambda: T.GPT2ForSequenceClassification(T.GPT2Config(pad_token_id=0, num_labels=2)),
        "convert_dropout",
        causal=True,
    ),
    "BERT-base": RealModel(lambda: T.BertForSequenceClassification(T.BertConfig(num_labels=2)), "convert_dropout"),
    "Falcon-MQA-768": RealModel(falcon_small, "insert", causal=True),
}
SMOKE = {"BERT-tiny (smoke)": RealModel(bert_tiny, "convert_dropout")}


def example(spec: RealModel, model: nn.Module, batch: int) -> dict[str, Any]:
    """What ``model`` is called with for ``batch`` samples (seeded by the batch size)."""
    generator = torch.Generator().manual_seed(batch)
    if spec.image_size is not None:
        return {"pixel_values": torch.randn(batch, 3, spec.image_size, spec.image_size, generator=generator)}
    vocabulary = model.config.vocab_size
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (batch, 1), generator=generator)
    mask = (torch.arange(LENGTH) < lengths).long()
    ids = torch.randint(1, vocabulary, (batch, LENGTH), generator=generator) * mask  # padding: id 0
    return {"input_ids": ids, "attention_mask": mask, **({"use_cache": False} if spec.causal else {})}


def masked_copy(single: nn.Module, spec: RealModel, x: dict[str, Any]) -> nn.Module:
    """The model with Masksembles layers placed as a user would, the same weights as ``single``."""
    model = copy.deepcopy(single)
    if spec.masks == "insert":
        return mt.insert(model, N, SCALE, seed=0, example_input=x).eval()
    return mt.convert_dropout(model, x, N, SCALE, seed=0).eval()


def leaves(output: Any) -> dict[str, np.ndarray]:
    """The tensors of a ``ModelOutput`` by key, as float64 arrays."""
    return {key: value.detach().to(torch.float64).numpy() for key, value in output.items() if isinstance(value, Tensor)}


def checked(program: nn.Module, members: Any, x: dict[str, Any], what: str) -> float:
    """``program``'s output on ``x`` against ``predict``'s (``pack``'s rule; raises on a difference): the largest
    ``|difference|`` ÷ the largest ``|predict|``."""
    with torch.no_grad():
        got = leaves(program(**x))
    want = leaves(members)
    if list(got) != list(want):
        raise AssertionError(f"{what} returns {list(got)} where predict returns {list(want)}")
    why = output_mismatch(list(want.values()), list(got.values()), [torch.finfo(torch.float32).eps] * len(want))
    if why is not None:
        raise AssertionError(f"{what} differs from predict: {why}")
    return max(float(np.abs(got[key] - want[key]).max() / max(np.abs(want[key]).max(), 1e-30)) for key in want)


def counted_macs(model: nn.Module, x: dict[str, Any]) -> float:
    """Multiply-adds per sample of one forward of ``model`` (``FlopCounterMode``'s flops / 2), attention by torch's
    math kernel (``FlopCounterMode`` does not count the CPU's fused one)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(**x)
    batch = next(value for value in x.values() if isinstance(value, Tensor)).shape[0]
    return counter.get_total_flops() / 2 / batch


def timed(build: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = build()
    return result, time.perf_counter() - start


def measure(name: str, spec: RealModel, batch: int, rounds: int) -> dict[str, Any]:
    """One row: builds, checks and interleaved medians of model ``name`` at ``batch``."""
    torch.manual_seed(0)
    single = spec.build().eval()
    x = example(spec, single, batch)
    masked = masked_copy(single, spec, x)
    load = os.getloadavg()[0]
    packed, packed_build = timed(lambda: mt.pack(masked, x, program="packed"))
    auto, auto_build = timed(lambda: mt.pack(masked, x))
    members = mt.predict(masked, x)
    error = checked(packed, members, x, f"{name} at batch {batch}: the packed program")
    chunk = packed.meta["masksembles"].get("chunk")
    auto_is_packed = auto.program == "packed" and auto.meta["masksembles"].get("chunk") == chunk
    auto_error = error if auto_is_packed else checked(auto, members, x, f"{name} at batch {batch}: pack()'s program")

    def call(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                module(**x)

        return run

    contenders = {"single": call(single), "predict": lambda: mt.predict(masked, x), "packed": call(packed)}
    if not auto_is_packed:
        contenders["auto"] = call(auto)
    times = timed_rounds(contenders, rounds=rounds, warmup=1)
    medians = {key: statistics.median(values) for key, values in times.items()}
    if auto_is_packed:
        medians["auto"] = medians["packed"]
    one = example(spec, single, 1)
    return {
        "model": name,
        "masks": spec.masks,
        "batch": batch,
        "rounds": rounds,
        "seconds": medians,
        "round_seconds": times,
        "build_seconds": {"packed": packed_build, "auto": auto_build},
        "auto": {
            "program": auto.program,
            "same_as_packed": auto_is_packed,
            "choice": auto.choice,
            "seconds": auto.seconds,
        },
        "macs": dict(packed.macs),
        "counted_single_macs": counted_macs(single, one),
        "fallbacks": list(packed.fallbacks),
        "chunk": chunk,
        "error": error,
        "auto_error": auto_error,
        "output_scale": max(float(np.abs(value).max()) for value in leaves(members).values()),
        "layers": sum(1 for module in masked.modules() if isinstance(module, mt.Masksembles)),
        "load_average": [load, os.getloadavg()[0]],
    }


def run(args: argparse.Namespace) -> int:
    """Measure the rows, writing the JSON after each; returns how many failed (a crash or a difference from
    ``predict``: recorded with its traceback, and the run goes on to the next row)."""
    torch.set_num_threads(args.threads)
    models = SMOKE if args.smoke else MODELS
    names = list(models) if args.smoke or args.models is None else args.models
    batches = (1, 2) if args.smoke else args.batches
    out = Path(args.out)
    report: dict[str, Any] = {"torch": torch.__version__, "transformers": T.__version__, "machine": machine(),
                              "threads": args.threads, "rows": []}  # fmt: skip
    failures = 0
    for name in names:
        for batch in batches:
            try:
                row = measure(name, models[name], batch, 1 if args.smoke else args.rounds)
            except Exception as error:  # a crash or a difference is the finding to report
                failures += 1
                row = {"model": name, "masks": models[name].masks, "batch": batch, "failure": repr(error)[:2000],
                       "traceback": traceback.format_exc()[-6000:]}  # fmt: skip
                print(row["traceback"], file=sys.stderr, flush=True)
            report["rows"].append(row)
            out.write_text(json.dumps(report, indent=1))  # after every row: a run cut short keeps what it measured
            print(line([row]), flush=True)
    return failures


def ratio(rows: list[dict[str, Any]], top: str, bottom: str) -> str:
    """The median over the runs of ``top`` ÷ ``bottom`` (medians of each run's rounds) and, in brackets, its range
    over the runs; for one run, in parentheses, the range of the ratio within each of its interleaved rounds."""
    values = [row["seconds"][top] / row["seconds"][bottom] for row in rows]
    within = rows[0].get("round_seconds", {})
    if len(rows) > 1 or top not in within:
        return spread(values, unit="×")
    rounds = [a / b for a, b in zip(within[top], within[bottom], strict=True)]
    return f"{values[0]:.2f}× ({min(rounds):.2f}–{max(rounds):.2f})"


def spread(values: list[float], digits: int = 2, unit: str = "") -> str:
    """The median, and the range over the runs in brackets where there are several."""
    middle = f"{statistics.median(values):.{digits}f}{unit}"
    return middle if len(values) == 1 else f"{middle} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def line(rows: list[dict[str, Any]]) -> str:
    """The table row of one model at one batch size from its runs (a failure, if any run failed)."""
    first = rows[0]
    failed = [row for row in rows if "failure" in row]
    if failed:
        return (
            f"| {first['model']} ({first['masks']}) | {first['batch']} | {len(rows)} "
            f"| failed in {len(failed)} of {len(rows)} runs: `{failed[0]['failure'][:300]}` |"
        )
    macs = first["macs"]
    faster = [row["seconds"]["auto"] / min(row["seconds"]["packed"], row["seconds"]["predict"]) for row in rows]
    picked = sum(value <= AUTO_TOLERANCE for value in faster)
    programs = "/".join(sorted({row["auto"]["program"] for row in rows}))
    builds = [spread([row["build_seconds"][kind] for row in rows], 0) for kind in ("packed", "auto")]
    error = max(max(row["error"], row["auto_error"]) for row in rows)
    scale = min(row.get("output_scale", np.inf) for row in rows)
    checked_cell = f"{error:.1e}" if scale > VACUOUS else f"{error:.1e}, vacuous: largest \\|predict\\| {scale:.0e}"
    return (
        f"| {first['model']} ({first['masks']}) | {first['batch']} | {len(rows)} "
        f"| {spread([row['seconds']['single'] * 1e3 for row in rows], 1)} | {ratio(rows, 'packed', 'predict')} "
        f"| {ratio(rows, 'packed', 'single')} | {macs['packed'] / (macs['dense'] / N):.2f}× "
        f"| {macs['fallback'] / macs['packed'] if macs['packed'] else 1.0:.0%} ({len(first['fallbacks'])}) "
        f"| {macs['dense'] / N / first['counted_single_macs']:.2f} | {programs} "
        f"| {spread(faster, unit='×')}: {picked} of {len(rows)} | {builds[0]} / {builds[1]} | {checked_cell} |"
    )


def combine(paths: list[str], write: bool) -> None:
    """The BENCHMARKS.md section from the runs in ``paths``: per model and batch, medians over the runs."""
    reports = [json.loads(Path(path).read_text()) for path in paths]
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for report in reports:
        for row in report["rows"]:
            grouped.setdefault((row["model"], row["batch"]), []).append(row)
    rounds = sorted({row["rounds"] for rows in grouped.values() for row in rows if "rounds" in row})
    loads = [value for rows in grouped.values() for row in rows for value in row.get("load_average", [])] or [
        float("nan")
    ]
    header = [
        "## Real models (torch)",
        "",
        f"`transformers` {reports[0]['transformers']} architectures at their published sizes, random init, float32, "
        f"eval mode, N={N}, S={SCALE}, torch {reports[0]['torch']}, {reports[0]['threads']} threads on "
        f"{reports[0]['machine']}, shared with other engineers' jobs while it ran (1-minute load average "
        f"{min(loads):.1f}–{max(loads):.1f} at the rows' starts and ends). Each "
        f"figure is the median over `runs` separate runs of `benchmarks/bench_real_models.py` (each itself a median "
        f"of {'/'.join(map(str, rounds))} interleaved rounds after one warm-up), the runs' range in brackets; where "
        "there is one run, the range of the ratio within its rounds in parentheses. "
        "`single`: one forward of the same network without masks; `predict`: tiled `predict`; `packed`: "
        '`pack(program="packed")`; MAC ratio: `packed.macs` packed ÷ dense/N, fallback: the share of its MACs that '
        "run at full width (and the count of fallback nodes); `macs` check: `packed.macs` dense/N ÷ "
        "`FlopCounterMode`'s count of one forward of the single model, attention by the math kernel (1.00: nothing "
        "left out); auto: the program "
        "`pack()` returned, its time ÷ the faster of packed and tiled `predict`, and in how many runs that was within "
        f'{AUTO_TOLERANCE - 1:.0%} (its own rule\'s margin); build: seconds for `pack(program="packed")` / `pack()`; '
        "error: the largest |packed − predict| ÷ the largest |predict| over the whole example batch, checked before "
        "timing against pack's own bound (√eps × largest |value|, 3.5e-4 in float32). Targets (issue #39): the "
        "packed program never slower than tiled predict, and auto picks the faster.",
        "",
        "| model (masks) | batch | runs | single (ms) | packed ÷ tiled predict | packed ÷ single | MAC ratio "
        "| fallback (nodes) | `macs` check | auto | auto ÷ faster: picked it | build packed / auto (s) | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    body = [line(rows) for rows in grouped.values()]
    publish(SECTION, "\n".join(header + body), write=write)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the run's JSON (rewritten after every row)")
    parser.add_argument("--combine", nargs="+", metavar="RUN", help="runs' JSON files: write the table")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    parser.add_argument("--batches", type=lambda text: [int(v) for v in text.split(",")], default=[1, 32])
    parser.add_argument(
        "--models", type=lambda text: [v.strip() for v in text.split(",")], help=f"from: {', '.join(MODELS)}"
    )
    parser.add_argument("--smoke", action="store_true", help="one tiny config at batch 1 and 2, one round")
    parser.add_argument("--no-write", action="store_true", help="--combine: print only, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    if args.combine:
        combine(args.combine, write=not args.no_write)
    elif args.out:
        sys.exit(1 if run(args) else 0)
    else:
        parser.error("give --out (measure) or --combine (write the table)")


if __name__ == "__main__":
    main()
