"""Every adapter on its accelerator: one prepared check that measures the package on a GPU (issue #23).

    PYTHONPATH=. python3 benchmarks/device_check.py --out DIR [--budget-s 360] [--sections a,b] [--smoke]

Runs with the machine's own Python and packages (no install step) and writes ``DIR/device_check.md`` and
``DIR/device_check.json``, both rewritten after every row, so a run cut short still reports what it measured.
Sections (``--help`` lists their names), each in its own ``try``: an error is recorded (type, message, traceback)
and the next section runs; a section whose framework does not import is reported as unavailable, with the import
error.

- ``environment``: versions, devices and every import that failed (torch, JAX, Flax, Keras, timm, torchvision,
  transformers).
- ``conformance-torch`` / ``conformance-jax`` / ``conformance-keras``: masks bit-identical to
  ``masksembles_core.generate_masks``, layer outputs and input gradients bit-identical to the NumPy reference
  (``masksembles_core.apply_masks``/``apply_masks_grad``) on inputs with inf/NaN, on the device, in float32,
  bfloat16 and float16, channels-first, channels-last and ``torch.channels_last``, eager and compiled.
- ``layer-speed-torch`` / ``layer-speed-jax``: forward and forward+backward ÷ ``x * 1.0`` on a large activation (the
  memory-bound floor), torch eager and ``torch.compile``d, JAX jitted (linen and NNX, from bench_flax.py).
- ``cuda-choices``: figures for what the CPU constants of ``masksembles_torch`` decide (``PER_MEMBER_ROWS``,
  ``MemberMLP.tile_rows``, ``CHUNK_BYTES``), timing each alternative on this device.
- ``training-step``: one AMP bfloat16 SGD step with masks before every conv/linear layer (``insert``) ÷ without
  (timm or torchvision ResNet-50 at batch 128 where installed).
- ``pack-torch``: ``pack(program="packed")`` ÷ one unmasked forward and ÷ tiled ``predict`` for ResNet-50 (``insert``
  defaults), ConvNeXt-T and ViT-S/16 (timm, no weights; the replicas of bench_packing.py where timm is missing or
  cannot be packed) at batch 1/32/256 in float32 and bfloat16, eager, then ``torch.compile``d while time is left,
  with the MAC ratio (``packed.macs``).
- ``pack-nnx``: the same for ``masksembles_flax.nnx.pack`` on the models of bench_flax_packing.py.

Timings are medians of interleaved rounds (every contender once per round, in the same process; CUDA synchronized
and JAX blocked until ready inside each timed call), so every ratio compares figures measured side by side. A global
time budget (``--budget-s``) is shared among the sections still to run in proportion to their weights; work past a
section's share is skipped and listed. ``--smoke`` runs tiny sizes in seconds on CPU (the test suite runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
from _report import interleaved_medians, machine

import masksembles_core as mc

N, SCALE = 4, 2.0
TESTED_TORCH = (2, 13)  # the lower bound pyproject.toml declares and the test sessions run
MASK_CASES = ((64, 4, 2.0, 0), (256, 4, 2.0, 1), (100, 3, 3.0, 7), (1024, 8, 1.5, 42))
MARKDOWN, JSON = "device_check.md", "device_check.json"
Row = dict[str, Any]


@dataclass(frozen=True)
class Sizes:
    """Problem sizes and repetitions of one mode (full, on the accelerator, or smoke)."""

    rounds: int  # interleaved rounds of the layer timings
    model_rounds: int  # interleaved rounds of whole-model timings
    calls_per_timing: int  # layer calls per timed sample (short kernels: fewer syncs per call)
    layer_shape: tuple[int, int, int, int]  # (B, C, H, W) for torch, (B, H, W, C) for JAX; C must be 256
    dense_shape: tuple[int, int]  # (B, C) of Masksembles1D
    train_batch: int
    pack_batches: tuple[int, ...]
    member_rows: tuple[int, ...]  # rows of the MemberLinear timings
    mlp_rows: tuple[int, ...]  # rows of the MemberMLP timings
    tile_rows: tuple[int, ...]  # MemberMLP tile sizes timed against one tile
    nnx_models: tuple[str, ...]
    conformance_dtypes: tuple[str, ...]
    layer_cases: int  # how many of layer-speed-torch's cases run (most telling first)
    compiled_pack_cells: int | None  # torch.compile'd cells of pack-torch (None: as many as its time allows)


FULL = Sizes(
    rounds=20,
    model_rounds=7,
    calls_per_timing=5,
    layer_shape=(128, 256, 56, 56),
    dense_shape=(65536, 1024),
    train_batch=128,
    pack_batches=(1, 32, 256),
    member_rows=(256, 1024, 4096, 16384, 65536),
    mlp_rows=(4096, 16384, 65536),
    tile_rows=(512, 2048, 8192),
    nnx_models=("MLP", "ResNet", "CNN module (insert)"),
    conformance_dtypes=("float32", "bfloat16", "float16"),
    layer_cases=4,
    compiled_pack_cells=None,
)
SMOKE = Sizes(
    rounds=2,
    model_rounds=2,
    calls_per_timing=1,
    layer_shape=(8, 256, 4, 4),
    dense_shape=(64, 64),
    train_batch=8,
    pack_batches=(4,),
    member_rows=(8, 64),
    mlp_rows=(64,),
    tile_rows=(16,),
    nnx_models=("MLP",),
    conformance_dtypes=("float32", "bfloat16"),
    layer_cases=2,
    compiled_pack_cells=1,
)


class Interrupted(BaseException):
    """SIGTERM (a time limit): recorded in the running section, then the run stops."""


# ------------------------------------------------------------------------------------------------ the report


def error_text(error: BaseException) -> str:
    """The error's type and the first line of its message (for a table cell)."""
    first = str(error).strip().splitlines()
    return f"{type(error).__name__}: {first[0] if first else ''}"


def failure(error: BaseException, **where: str) -> dict[str, str]:
    """An error as the JSON report keeps it: type, whole message and traceback."""
    return {**where, "type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}


@dataclass
class Section:
    """One section's state and results, saved into the report after every change."""

    name: str
    title: str
    weight: float
    requires: tuple[str, ...]
    run: Callable[[Context, Section], None]
    status: str = "not run"
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    error: dict[str, str] | None = None
    failures: list[dict[str, str]] = field(default_factory=list)  # each failed part: case, type, message, traceback
    deadline: float = math.inf
    report: Report | None = None

    def add(self, row: Row) -> None:
        """Append a row, print it and save the report."""
        self.rows.append(row)
        print("  " + ", ".join(f"{k}={format_value(k, v)}" for k, v in row.items() if k != "table"), flush=True)
        self.save()

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.save()

    def save(self) -> None:
        if self.report is not None:
            self.report.save()

    def out_of_time(self) -> bool:
        return time.perf_counter() >= self.deadline

    def attempt(self, label: str, work: Callable[[], Row | list[Row] | None], **context: Any) -> bool:
        """Run one part of the section; a failure becomes a row with its error, and the section goes on."""
        if self.out_of_time():
            self.skipped.append(label)
            self.save()
            return False
        try:
            result = work()
        except Exception as error:  # recorded, and the next part runs
            self.failures.append(failure(error, case=label))
            print(self.failures[-1]["traceback"], flush=True)
            self.add({**context, "case": label, "error": error_text(error)})
            release_memory()
            return False
        for row in [] if result is None else [result] if isinstance(result, dict) else result:
            self.add({**context, "case": label, **row})
        return True

    def as_json(self) -> dict[str, Any]:
        keys = ("name", "title", "status", "seconds", "notes", "rows", "skipped", "error", "failures")
        return {key: getattr(self, key) for key in keys}


@dataclass
class Report:
    out: Path
    meta: dict[str, Any]
    sections: list[Section]
    start: float = field(default_factory=time.perf_counter)

    def save(self) -> None:
        self.meta["elapsed_s"] = time.perf_counter() - self.start
        data = {"meta": self.meta, "sections": [section.as_json() for section in self.sections]}
        write_atomic(self.out / JSON, json.dumps(data, indent=1, default=str) + "\n")
        write_atomic(self.out / MARKDOWN, self.markdown())

    def markdown(self) -> str:
        meta = self.meta
        lines = [
            "# Device check",
            "",
            f"`{meta['command']}`, {meta['mode']} mode, started {meta['started']}, {meta['elapsed_s']:.0f} s of a "
            f"{meta['budget_s']:.0f} s budget. Machine: {meta['machine']}. torch device: {meta.get('device', 'none')}; "
            f"JAX device: {meta.get('jax_device', 'none')}. N={N}, S={SCALE}.",
            "",
            "| section | status | seconds |",
            "|---|---|---:|",
            *(f"| {s.name} | {s.status} | {s.seconds:.1f} |" for s in self.sections),
        ]
        for section in self.sections:
            lines += ["", section_markdown(section)]
        return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def format_value(key: str, value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if "÷" in key:
            return f"{value:.2f}×"
        if not math.isfinite(value) or value == 0:
            return str(value)
        if abs(value) < 1e-3:
            return f"{value:.1e}"
        digits = max(0, 2 - math.floor(math.log10(abs(value))))
        return f"{value:.{min(digits, 4)}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def section_markdown(section: Section) -> str:
    lines = [f"## {section.title} (`{section.name}`)", "", f"Status: {section.status}, {section.seconds:.1f} s."]
    if section.error:
        lines += ["", f"Error: `{section.error['type']}: {section.error['message']}`"]
    lines += [f"\n{note}" for note in section.notes]
    if section.skipped:
        lines += ["", f"Skipped (its share of the time budget was spent): {'; '.join(section.skipped)}."]
    tables: dict[str, list[Row]] = {}
    for row in section.rows:
        tables.setdefault(row.get("table", ""), []).append(row)
    for title, rows in tables.items():
        columns = [key for key in dict.fromkeys(key for row in rows for key in row) if key != "table"]
        lines += [f"\n**{title}**"] if title else []
        lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(format_value(c, row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the context


@dataclass
class Context:
    """What the sections share: options, sizes, the torch device and the modules found by ``environment``."""

    args: argparse.Namespace
    sizes: Sizes
    compile_backend: str
    missing: dict[str, str] = field(default_factory=dict)  # requirement -> why it is not available
    device: Any = None  # torch.device
    on_cuda: bool = False

    def sync(self) -> None:
        if self.on_cuda:
            import torch

            torch.cuda.synchronize()


def release_memory() -> None:
    """Free what the caching allocators hold between parts (torch and JAX share the GPU)."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def try_import(name: str) -> tuple[Any, str | None, float]:
    """(the module or None, why it failed, seconds the import took)."""
    start = time.perf_counter()
    try:
        module = importlib.import_module(name)
    except Exception as error:  # any failure to import (a CUDA build on a CPU torch raises more than ImportError)
        return None, error_text(error), time.perf_counter() - start
    return module, None, time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ environment

# module -> the requirement it stands for (sections list requirements); torch first, before JAX and Keras
MODULES = {
    "torch": "torch", "masksembles_torch": "torch", "jax": "jax", "flax": "flax", "masksembles_flax": "flax",
    "keras": "keras", "masksembles_keras": "keras", "timm": "timm", "torchvision": "torchvision",
    "transformers": "transformers",
}  # fmt: skip


def environment(ctx: Context, section: Section) -> None:
    """Versions, devices and what could not be imported."""
    for name, requirement in MODULES.items():
        if requirement in ctx.missing:
            continue
        if name == "keras" and "KERAS_BACKEND" not in os.environ:  # read once, at import: never TensorFlow here
            os.environ["KERAS_BACKEND"] = "torch" if "torch" not in ctx.missing else "jax"
        module, problem, seconds = try_import(name)
        if module is None:
            ctx.missing[requirement] = f"{name}: {problem}"
        detail = f"not importable: {problem}" if module is None else describe(ctx, section, name, module)
        version = None if module is None else getattr(module, "__version__", None)
        section.add({"module": name, "version": version, "import (s)": seconds, "detail": detail})
    section.add({"module": "masksembles_core", "version": mc.__version__, "import (s)": None, "detail": commit()})


def describe(ctx: Context, section: Section, name: str, module: Any) -> str:
    """What matters of an imported module: torch's and JAX's devices (chosen here for torch), Keras' backend."""
    report = section.report
    assert report is not None
    if name == "torch":
        ctx.on_cuda = module.cuda.is_available() and not ctx.args.smoke
        ctx.device = module.device("cuda" if ctx.on_cuda else "cpu")
        report.meta["device"] = (
            module.cuda.get_device_name(0) if ctx.on_cuda else f"CPU, {module.get_num_threads()} threads"
        )
        if module.cuda.is_available() and not ctx.on_cuda:
            section.note("CUDA is available, but --smoke runs on CPU.")
        elif not ctx.on_cuda:
            section.note("No CUDA device: every torch figure below is from the CPU.")
        version = tuple(int(part) for part in module.__version__.split("+")[0].split(".")[:2])
        if version < TESTED_TORCH:
            section.note(
                f"torch {module.__version__} is older than the tested lower bound "
                f"{'.'.join(map(str, TESTED_TORCH))}: failures below may come from that (each feature is tried)."
            )
        if not ctx.on_cuda:
            return f"device: {report.meta['device']}"
        properties, cudnn = module.cuda.get_device_properties(0), module.backends.cudnn
        return (
            f"device: {report.meta['device']}, CUDA {module.version.cuda}, capability {properties.major}."
            f"{properties.minor}, {properties.total_memory / 2**30:.0f} GiB; TF32 conv {cudnn.allow_tf32}, TF32 "
            f"matmul {module.backends.cuda.matmul.allow_tf32}, cudnn.benchmark {cudnn.benchmark}"
        )
    if name == "jax":
        device = module.devices()[0]
        report.meta["jax_device"] = f"{device.platform} ({device.device_kind})"
        if device.platform == "cpu" and not ctx.args.smoke:
            section.note("JAX runs on the CPU (no GPU backend): every JAX figure below is from the CPU.")
        return f"devices: {module.devices()}"
    if name == "keras":
        return f"backend: {module.backend.backend()}"
    return ""


def commit() -> str:
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "no git"
    return f"checkout {result.stdout.strip()}" if result.returncode == 0 else "no git checkout"


# ------------------------------------------------------------------------------------------------ conformance


def special_values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 values exact in bfloat16/float16 (halves in [-16, 16]) with inf, -inf and NaN sprinkled in."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-32, 33, size=shape).astype(np.float32) / 2
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, size=3, replace=False)] = [np.inf, -np.inf, np.nan]
    return x


def differing(actual: np.ndarray, expected: np.ndarray) -> int:
    """How many values differ in bits (NaN anywhere but where the reference has one counts; NaN payloads do not)."""
    actual = np.asarray(actual).astype(expected.dtype)
    if actual.shape != expected.shape:
        raise ValueError(f"shape {actual.shape} != reference {expected.shape}")
    nan_actual, nan_expected = np.isnan(actual), np.isnan(expected)
    both = ~nan_actual & ~nan_expected
    bits = np.dtype(f"u{expected.dtype.itemsize}")
    return int((nan_actual != nan_expected).sum() + (actual[both].view(bits) != expected[both].view(bits)).sum())


@dataclass(frozen=True)
class Layout:
    name: str
    shape: tuple[int, ...]
    channel_axis: int
    channels_last_memory: bool = False


CHANNELS = 48
LAYOUTS = (  # a batch of 10 with n=4: groups of unequal size
    Layout("(B, C)", (10, CHANNELS), 1),
    Layout("(B, C, H, W)", (10, CHANNELS, 5, 6), 1),
    Layout("(B, C, H, W), torch.channels_last", (10, CHANNELS, 5, 6), 1, channels_last_memory=True),
    Layout("(B, H, W, C)", (10, 5, 6, CHANNELS), -1),
)


def reference(layout: Layout, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(masks, x, grad_output, y, grad_input) of the NumPy reference (``masksembles_core``) for one layout."""
    masks = mc.generate_masks(CHANNELS, N, SCALE, seed=seed)
    x, grad_output = special_values(layout.shape, seed), special_values(layout.shape, seed + 1)
    with np.errstate(invalid="ignore"):  # inf * 0 is NaN, as the adapters compute it
        y = mc.apply_masks(x, masks, channel_axis=layout.channel_axis)
        grad_input = mc.apply_masks_grad(grad_output, masks, channel_axis=layout.channel_axis)
    return masks, x, grad_output, y, grad_input


MASKS_TABLE = "Masks from seeds: entries differing from masksembles_core.generate_masks"
VALUES_TABLE = (
    "Outputs and input gradients: values differing in bits from masksembles_core.apply_masks / apply_masks_grad "
    f"(inputs with inf, -inf and NaN; a batch of 10 in {N} groups of unequal size)"
)


def mask_rows(masks_of: Callable[[int, int, float, int], np.ndarray]) -> Iterator[Row]:
    for channels, n, scale, seed in MASK_CASES:
        got = np.asarray(masks_of(channels, n, scale, seed)) != 0
        expected = mc.generate_masks(channels, n, scale, seed=seed)
        yield {
            "masks (C, n, scale, seed)": f"({channels}, {n}, {scale}, {seed})",
            "mismatches": differing(got, expected),
        }


def conformance_torch(ctx: Context, section: Section) -> None:
    import torch

    import masksembles_torch as mt

    def masks_of(channels: int, n: int, scale: float, seed: int) -> np.ndarray:
        layer = mt.Masksembles(channels, n, scale, seed=seed, device=ctx.device, dtype=torch.bfloat16)
        return layer.masks.float().cpu().numpy()

    section.attempt("bfloat16 buffer on the device", lambda: list(mask_rows(masks_of)), table=MASKS_TABLE)
    for compiled, layout, dtype in itertools.product((False, True), LAYOUTS, ctx.sizes.conformance_dtypes):
        mode = f"torch.compile(backend={ctx.compile_backend!r})" if compiled else "eager"

        def case(compiled: bool = compiled, layout: Layout = layout, dtype: str = dtype) -> Row:
            masks, x_np, grad_np, y_ref, grad_ref = reference(layout, seed=3)
            layer = mt.Masksembles(masks=masks, channel_axis=layout.channel_axis, device=ctx.device)
            if compiled:
                torch._dynamo.reset()
            fn = torch.compile(layer, backend=ctx.compile_backend) if compiled else layer
            memory = torch.channels_last if layout.channels_last_memory else torch.contiguous_format

            def tensor(a: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(a).to(ctx.device, getattr(torch, dtype)).contiguous(memory_format=memory)

            x = tensor(x_np).requires_grad_(True)
            y = fn(x)
            y.backward(tensor(grad_np))
            assert x.grad is not None
            return {
                "output mismatches": differing(y.detach().float().cpu().numpy(), y_ref),
                "gradient mismatches": differing(x.grad.float().cpu().numpy(), grad_ref),
                "dtype kept": y.dtype == x.dtype,
                "memory format kept": y.is_contiguous(memory_format=memory),
                "on": str(y.device),
            }

        section.attempt(f"{mode}, {dtype}, {layout.name}", case, table=VALUES_TABLE)


def conformance_jax(ctx: Context, section: Section) -> None:
    import jax
    import jax.numpy as jnp

    from masksembles_flax import linen, nnx

    def linen_masks(channels: int, n: int, scale: float, seed: int) -> np.ndarray:
        layer = linen.Masksembles(n=n, scale=scale, seed=seed)
        return np.asarray(layer.init(jax.random.key(0), jnp.zeros((n, channels)))[linen.MASKS_COLLECTION]["masks"])

    def nnx_masks(channels: int, n: int, scale: float, seed: int) -> np.ndarray:
        return np.asarray(nnx.Masksembles(channels, n, scale, seed=seed).masks[...])

    section.attempt("linen", lambda: list(mask_rows(linen_masks)), table=MASKS_TABLE)
    section.attempt("NNX", lambda: list(mask_rows(nnx_masks)), table=MASKS_TABLE)
    layouts = [layout for layout in LAYOUTS if not layout.channels_last_memory]
    for flavour, layout, dtype in itertools.product(("linen", "NNX"), layouts, ctx.sizes.conformance_dtypes):

        def case(flavour: str = flavour, layout: Layout = layout, dtype: str = dtype) -> Row:
            masks, x_np, grad_np, y_ref, grad_ref = reference(layout, seed=3)
            layer: Callable[[jax.Array], jax.Array]
            if flavour == "linen":
                module = linen.Masksembles(n=N, scale=1.0, masks=masks, channel_axis=layout.channel_axis)
                variables = module.init(jax.random.key(0), jnp.zeros(layout.shape))
                layer = lambda v: module.apply(variables, v)  # noqa: E731
            else:
                layer = nnx.Masksembles(CHANNELS, N, 1.0, masks=masks, channel_axis=layout.channel_axis)

            def forward_backward(x: jax.Array, grad_output: jax.Array) -> tuple[jax.Array, jax.Array]:
                y, pullback = jax.vjp(layer, x)
                return y, pullback(grad_output)[0]

            y, grad = jax.jit(forward_backward)(jnp.asarray(x_np, dtype), jnp.asarray(grad_np, dtype))
            return {
                "output mismatches": differing(np.asarray(y.astype(jnp.float32)), y_ref),
                "gradient mismatches": differing(np.asarray(grad.astype(jnp.float32)), grad_ref),
                "dtype kept": y.dtype == jnp.dtype(dtype),
                "on": ", ".join(sorted(str(d) for d in y.devices())),
            }

        section.attempt(f"{flavour} jitted, {dtype}, {layout.name}", case, table=VALUES_TABLE)


def conformance_keras(ctx: Context, section: Section) -> None:
    import keras
    from keras import ops

    import masksembles_keras as mk

    backend = keras.backend.backend()
    section.note(f"Keras {keras.__version__} on its {backend} backend (KERAS_BACKEND).")

    def vjp(fn: Callable[[Any], Any], x: Any, cotangent: Any) -> tuple[Any, Any]:
        if backend == "torch":
            import torch

            x = x.detach().requires_grad_(True)
            y = fn(x)
            return y, torch.autograd.grad(y, x, grad_outputs=cotangent)[0]
        if backend == "jax":
            import jax

            y, pullback = jax.vjp(fn, x)
            return y, pullback(cotangent)[0]
        raise NotImplementedError(f"no gradient here for the {backend} backend (run with KERAS_BACKEND=torch or jax)")

    def masks_of(channels: int, n: int, scale: float, seed: int) -> np.ndarray:
        layer = mk.Masksembles(n, scale, seed=seed)
        layer.build((None, channels))
        return np.asarray(ops.convert_to_numpy(layer.masks))

    section.attempt("Masksembles.build", lambda: list(mask_rows(masks_of)), table=MASKS_TABLE)
    layouts = [layout for layout in LAYOUTS if not layout.channels_last_memory]
    for layout, dtype in itertools.product(layouts, ("float32", "bfloat16")):

        def case(layout: Layout = layout, dtype: str = dtype) -> Row:
            masks, x_np, grad_np, y_ref, grad_ref = reference(layout, seed=3)
            layer = mk.Masksembles(masks=masks, channel_axis=layout.channel_axis, dtype=dtype)
            x = ops.cast(ops.convert_to_tensor(x_np), dtype)
            y, grad = vjp(layer, x, ops.cast(ops.convert_to_tensor(grad_np), dtype))
            device = y.device if backend == "torch" else ", ".join(sorted(str(d) for d in y.devices()))
            return {
                "output mismatches": differing(ops.convert_to_numpy(ops.cast(y, "float32")), y_ref),
                "gradient mismatches": differing(ops.convert_to_numpy(ops.cast(grad, "float32")), grad_ref),
                "on": str(device),
            }

        section.attempt(f"{dtype}, {layout.name}", case, table=VALUES_TABLE)


# ------------------------------------------------------------------------------------------------ layer speed


def repeated(call: Callable[[], None], times: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(times):
            call()

    return run


def layer_speed_torch(ctx: Context, section: Section) -> None:
    import bench_torch
    import torch

    import masksembles_torch as mt

    batch, channels, height, width = ctx.sizes.layer_shape
    image = (batch, channels, height, width)
    cases = {
        f"Masksembles2D {image}, float32": (image, "float32", False),
        f"Masksembles1D {ctx.sizes.dense_shape}, float32": (ctx.sizes.dense_shape, "float32", False),
        f"Masksembles2D {image}, bfloat16": (image, "bfloat16", False),
        f"Masksembles2D {image}, float32, channels_last": (image, "float32", True),
    }
    cases = dict(list(cases.items())[: ctx.sizes.layer_cases])
    section.note(
        f"Median ms of {ctx.sizes.calls_per_timing} calls (synchronized after each) over {ctx.sizes.rounds} "
        f"interleaved rounds; layer ÷ `x * 1.0` (the memory-bound floor) of the same pass, eager and "
        f"`torch.compile(backend={ctx.compile_backend!r})`, all four timed in the same rounds."
    )
    for (case, (shape, dtype, channels_last)), backward in itertools.product(cases.items(), (False, True)):

        def measure(shape: tuple[int, ...] = shape, dtype: str = dtype, cl: bool = channels_last, bw: bool = backward):
            memory = torch.channels_last if cl else torch.contiguous_format
            x = torch.randn(*shape, device=ctx.device, dtype=getattr(torch, dtype)).contiguous(memory_format=memory)
            layer = mt.Masksembles(shape[1], N, SCALE, seed=0, device=ctx.device)
            torch._dynamo.reset()
            fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
                "eager floor": lambda v: v * 1.0,
                "eager layer": layer,
                "compiled floor": torch.compile(lambda v: v * 1.0, backend=ctx.compile_backend),
                "compiled layer": torch.compile(layer, backend=ctx.compile_backend),
            }
            calls = {
                name: repeated(bench_torch.timed(fn, x, bw, ctx.sync), ctx.sizes.calls_per_timing)
                for name, fn in fns.items()
            }
            ms = {
                k: v * 1e3 / ctx.sizes.calls_per_timing
                for k, v in interleaved_medians(calls, rounds=ctx.sizes.rounds).items()
            }
            return [
                {
                    "mode": mode,
                    "floor (ms)": ms[f"{mode} floor"],
                    "layer (ms)": ms[f"{mode} layer"],
                    "layer ÷ floor": ms[f"{mode} layer"] / ms[f"{mode} floor"],
                }
                for mode in ("eager", "compiled")
            ]

        section.attempt(f"{case}, {'forward+backward' if backward else 'forward'}", measure)
        release_memory()


def layer_speed_jax(ctx: Context, section: Section) -> None:
    import bench_flax
    import jax

    batch, channels, height, width = ctx.sizes.layer_shape
    shape = (batch, height, width, channels)
    if channels != bench_flax.SHAPE[-1]:
        raise ValueError(
            f"bench_flax.forwards builds its NNX layer for {bench_flax.SHAPE[-1]} channels, not {channels}"
        )
    section.note(
        f"bench_flax.py's jitted functions on {shape} float32, ÷ a jitted `x * 1.0`; median ms of "
        f"{ctx.sizes.calls_per_timing} calls over {ctx.sizes.rounds} interleaved rounds, each blocked until ready."
    )

    def measure() -> list[Row]:
        key = jax.random.key(0)
        x = jax.random.normal(key, shape)
        grad_output = jax.random.normal(jax.random.key(1), shape)
        calls: dict[tuple[str, str], Callable[[], object]] = {}
        for name, (forward, state) in bench_flax.forwards(x, key).items():
            jitted_forward, jitted_backward = jax.jit(forward), jax.jit(bench_flax.with_backward(forward))
            calls[name, "forward"] = repeated(
                lambda f=jitted_forward, s=state: bench_flax.run_to_completion(f, s, x), ctx.sizes.calls_per_timing
            )
            calls[name, "forward+backward"] = repeated(
                lambda f=jitted_backward, s=state: bench_flax.run_to_completion(f, s, x, grad_output),
                ctx.sizes.calls_per_timing,
            )
        seconds = bench_flax.interleaved_medians(calls, rounds=ctx.sizes.rounds)
        rows = []
        for (name, what), value in seconds.items():
            floor = seconds[bench_flax.BASELINE, what]
            ms = value * 1e3 / ctx.sizes.calls_per_timing
            rows.append({"function": name, "pass": what, "ms": ms, "÷ `x * 1.0`": value / floor})
        return rows

    section.attempt(f"jitted on {jax.devices()[0].platform}", measure)


# ------------------------------------------------------------------------------------------------ models


@dataclass(frozen=True)
class Candidate:
    """One way to build a model: its description, a builder of the unmasked network and its input shape."""

    label: str
    build: Callable[[], Any]
    shape: tuple[int, ...]
    requires: str | None = None  # a module environment must have imported (timm, torchvision)


def timm_model(name: str) -> Callable[[], Any]:
    def build() -> Any:
        import timm

        return timm.create_model(name, pretrained=False)

    return build


def torchvision_resnet50() -> Any:
    import torchvision

    return torchvision.models.resnet50(weights=None)


def replica(name: str, **options: Any) -> Callable[[], Any]:
    def build() -> Any:
        import bench_packing

        factory = getattr(bench_packing, name)
        return factory(False, **options) if name in ("ResNet", "ResNet50") else factory(**options)

    return build


def importable(ctx: Context, section: Section, candidates: list[Candidate]) -> list[Candidate]:
    """The candidates whose module imports; each one left out is noted once per section."""
    kept = []
    for candidate in candidates:
        if candidate.requires in ctx.missing:
            note = f"{candidate.label} left out: {ctx.missing[candidate.requires]}."
            if note not in section.notes:
                section.note(note)
        else:
            kept.append(candidate)
    return kept


def pack_candidates(smoke: bool) -> dict[str, list[Candidate]]:
    """Per model, timm's network first and bench_packing.py's replica after it (tiny replicas in smoke mode)."""
    if smoke:
        return {
            "ResNet": [Candidate("replica: bench_packing ResNet (small)", replica("ResNet"), (3, 32, 32))],
            "ConvNeXt": [
                Candidate(
                    "replica: bench_packing ConvNeXt-like (8, 16, 32)",
                    replica("ConvNeXt", dims=(8, 16, 32)),
                    (3, 16, 16),
                ),
            ],
            "ViT": [
                Candidate(
                    "replica: bench_packing ViT-like (dim 32)", replica("ViT", dim=32, depth=1, heads=2), (3, 32, 32)
                )
            ],
        }
    return {
        "ResNet-50": [
            Candidate("timm resnet50", timm_model("resnet50"), (3, 224, 224), "timm"),
            Candidate("replica: bench_packing ResNet-50 (32×32)", replica("ResNet50"), (3, 32, 32)),
        ],
        "ConvNeXt": [
            Candidate("timm convnext_tiny", timm_model("convnext_tiny"), (3, 224, 224), "timm"),
            Candidate("replica: bench_packing ConvNeXt-like", replica("ConvNeXt"), (3, 64, 64)),
        ],
        "ViT": [
            Candidate("timm vit_small_patch16_224", timm_model("vit_small_patch16_224"), (3, 224, 224), "timm"),
            Candidate("replica: bench_packing ViT-like", replica("ViT"), (3, 32, 32)),
        ],
    }


def training_candidates(smoke: bool) -> list[Candidate]:
    if smoke:
        return [Candidate("replica: bench_packing ResNet (small)", replica("ResNet"), (3, 32, 32))]
    return [
        Candidate("timm resnet50", timm_model("resnet50"), (3, 224, 224), "timm"),
        Candidate("torchvision resnet50", torchvision_resnet50, (3, 224, 224), "torchvision"),
        Candidate("replica: bench_packing ResNet-50 (32×32)", replica("ResNet50"), (3, 32, 32)),
    ]


def seeded(build: Callable[[], Any]) -> Any:
    import torch

    torch.manual_seed(0)
    return build()


def randomized_norms(model: Any) -> Any:
    """bench_packing's BatchNorm statistics (not the identity of a fresh model)."""
    import bench_packing

    return bench_packing.randomize_norms(model)


def peak_mib(ctx: Context, call: Callable[[], object]) -> float | None:
    """Memory the call allocates at its peak beyond what was allocated before it (CUDA only)."""
    if not ctx.on_cuda:
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


# ------------------------------------------------------------------------------------------------ training step


def training_step(ctx: Context, section: Section) -> None:
    import torch
    import torch.nn.functional as F

    import masksembles_torch as mt

    batch = ctx.sizes.train_batch
    memory = torch.channels_last if ctx.on_cuda else torch.contiguous_format
    section.note(
        f"One SGD step (momentum 0.9) under `torch.autocast({ctx.device.type!r}, torch.bfloat16)`, batch {batch}, "
        f"{'channels_last, ' if ctx.on_cuda else ''}eager; median ms of {ctx.sizes.model_rounds} interleaved rounds. "
        f"`insert(model, {N}, {SCALE})` puts Masksembles before every conv/linear layer but the first. A Deep "
        f"Ensemble of {N} trains {N} such models: {N} × without ÷ with is its cost ÷ Masksembles'."
    )
    for candidate in importable(ctx, section, training_candidates(ctx.args.smoke)):

        def measure(candidate: Candidate = candidate) -> Row:
            plain = seeded(candidate.build).to(ctx.device, memory_format=memory).train()
            masked = mt.insert(plain, N, SCALE, seed=0)
            x = torch.randn(batch, *candidate.shape, device=ctx.device).contiguous(memory_format=memory)
            labels = torch.randint(0, 10, (batch,), device=ctx.device)

            def step_of(model: torch.nn.Module) -> Callable[[], None]:
                optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

                def step() -> None:
                    optimizer.zero_grad(set_to_none=True)
                    with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                        loss = F.cross_entropy(model(x), labels)
                    loss.backward()
                    optimizer.step()
                    ctx.sync()

                return step

            steps = {"without": step_of(plain), "with": step_of(masked)}
            ms = {k: v * 1e3 for k, v in interleaved_medians(steps, rounds=ctx.sizes.model_rounds).items()}
            return {
                "batch": batch,
                "masked layers": sum(isinstance(m, mt.Masked) for m in masked.modules()),
                "without (ms)": ms["without"],
                "with masks (ms)": ms["with"],
                "with ÷ without": ms["with"] / ms["without"],
                f"{N} × without ÷ with": N * ms["without"] / ms["with"],
                "peak MiB without": peak_mib(ctx, steps["without"]),
                "peak MiB with": peak_mib(ctx, steps["with"]),
            }

        if section.attempt(candidate.label, measure):
            break
        release_memory()


# ------------------------------------------------------------------------------------------------ pack (torch)


@dataclass
class Prepared:
    """A model of the pack section in one dtype: the unmasked network, its masked copy and its input shape."""

    label: str
    single: Any
    masked: Any
    shape: tuple[int, ...]
    packed: dict[int, Any] = field(default_factory=dict)  # batch -> pack(masked, x, program="packed")
    summary: str = ""


def prepare(ctx: Context, candidate: Candidate, dtype: Any, batch: int) -> Prepared:
    import masksembles_torch as mt

    single = randomized_norms(seeded(candidate.build)).to(ctx.device, dtype).eval()
    masked = mt.insert(single, N, SCALE, seed=0).eval()
    prepared = Prepared(candidate.label, single, masked, candidate.shape)
    packed = packed_for(ctx, prepared, dtype, batch)  # packs, or raises: the next candidate is tried
    layers = sum(isinstance(module, mt.Masked) for module in masked.modules())
    prepared.summary = f"{layers} masked layers, {len(packed.fallbacks)} fallbacks" + (
        f" ({'; '.join(packed.fallbacks[:4])}{', ...' if len(packed.fallbacks) > 4 else ''})"
        if packed.fallbacks
        else ""
    )
    return prepared


def example(ctx: Context, shape: tuple[int, ...], batch: int, dtype: Any) -> Any:
    import torch

    generator = torch.Generator().manual_seed(batch)
    return torch.randn(batch, *shape, generator=generator).to(ctx.device, dtype)


def packed_for(ctx: Context, prepared: Prepared, dtype: Any, batch: int) -> Any:
    import masksembles_torch as mt

    if batch not in prepared.packed:
        prepared.packed[batch] = mt.pack(prepared.masked, example(ctx, prepared.shape, batch, dtype), program="packed")
    return prepared.packed[batch]


def pack_cell(ctx: Context, prepared: Prepared, dtype: Any, batch: int, compiled: bool) -> Row:
    """packed ÷ single and ÷ tiled predict on one batch, eager or compiled."""
    import torch

    import masksembles_torch as mt

    x = example(ctx, prepared.shape, batch, dtype)
    packed = packed_for(ctx, prepared, dtype, batch)
    single, masked = prepared.single, prepared.masked
    if compiled:
        torch._dynamo.reset()
        single, masked, packed_run = (
            torch.compile(module, backend=ctx.compile_backend, dynamic=False) for module in (single, masked, packed)
        )
    else:
        packed_run = packed

    def run(fn: Callable[[Any], object]) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad():
                fn(x)
            ctx.sync()

        return call

    contenders = {"single": run(single), "packed": run(packed_run), "tiled": run(lambda v: mt.predict(masked, v, N))}
    seconds = interleaved_medians(contenders, rounds=ctx.sizes.model_rounds)
    with torch.no_grad():
        expected = mt.predict(masked, x, N).float()
        error = float((packed_run(x).float() - expected).abs().max() / expected.abs().max())
    macs = packed.macs
    return {
        "single (ms)": seconds["single"] * 1e3,
        "packed ÷ single": seconds["packed"] / seconds["single"],
        "MACs ÷ single": macs["packed"] / (macs["dense"] / N) if macs else None,
        "fallback MACs": f"{macs['fallback'] / macs['packed']:.0%}" if macs else "whole model",
        "tiled ÷ single": seconds["tiled"] / seconds["single"],
        "packed ÷ tiled": seconds["packed"] / seconds["tiled"],
        f"{N} singles ÷ packed": N * seconds["single"] / seconds["packed"],
        "packed vs predict: max abs error (rel.)": error,
        "peak MiB single": peak_mib(ctx, contenders["single"]),
        "peak MiB packed": peak_mib(ctx, contenders["packed"]),
        "peak MiB tiled": peak_mib(ctx, contenders["tiled"]),
    }


def pack_torch(ctx: Context, section: Section) -> None:
    import torch

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    batches = ctx.sizes.pack_batches
    section.note(
        f'`pack(model, x, program="packed")` of the model with `insert({N}, {SCALE})`\'s masks, ÷ one forward of the '
        f"same network without masks on the same batch, and ÷ `predict(model, x, {N})` (the tiled batch); medians of "
        f"{ctx.sizes.model_rounds} interleaved rounds under `torch.no_grad()`. MACs ÷ single: the MAC ratio of its "
        f"Linear/Conv layers and attention products (`packed.macs`); {N} singles ÷ packed: a Deep Ensemble of {N} "
        f"run one after another ÷ packed. Eager cells first, then `torch.compile(backend={ctx.compile_backend!r}, "
        "dynamic=False)` of all three while the section's time lasts (bfloat16 and the large batches first)."
    )
    prepared: dict[tuple[str, str], Prepared] = {}
    for (model, candidates), dtype in itertools.product(pack_candidates(ctx.args.smoke).items(), dtypes):
        for candidate in importable(ctx, section, candidates):
            key = (model, dtype)

            def build(candidate: Candidate = candidate, key: tuple[str, str] = key, dtype: str = dtype) -> None:
                prepared[key] = prepare(ctx, candidate, dtypes[dtype], max(batches))
                section.note(f"{key[0]}, {dtype}: {candidate.label}, {prepared[key].summary}.")

            label = f"{candidate.label}: insert and pack"
            if section.attempt(label, build, table="Models that failed to build or pack", model=model, dtype=dtype):
                break
            release_memory()
    eager = [(False, key, batch) for key in prepared for batch in sorted(batches, reverse=True)]
    compiled = sorted(  # the large batches and bfloat16 first: what serving on a GPU looks like
        ((True, key, batch) for key in prepared for batch in batches),
        key=lambda cell: (-cell[2], list(dtypes).index(cell[1][1])),
    )
    for is_compiled, (model, dtype), batch in eager + compiled[: ctx.sizes.compiled_pack_cells]:
        item = prepared[model, dtype]
        section.attempt(
            f"{item.label}, {dtype}, batch {batch}, {'compiled' if is_compiled else 'eager'}",
            lambda item=item, dtype=dtype, batch=batch, is_compiled=is_compiled: pack_cell(
                ctx, item, dtypes[dtype], batch, is_compiled
            ),
            model=model,
        )
        release_memory()
    if len(compiled) > len(compiled[: ctx.sizes.compiled_pack_cells]):
        section.note(f"Compiled: the first {ctx.sizes.compiled_pack_cells} of {len(compiled)} cells (--smoke).")


# ------------------------------------------------------------------------------------------------ pack (NNX)


def pack_nnx(ctx: Context, section: Section) -> None:
    import bench_flax_packing as bench
    import jax

    import masksembles_flax as mf
    from masksembles_flax.nnx import pack

    models = {
        "MLP": (bench.mlp, (784,)),
        "ResNet": (bench.resnet, (32, 32, 3)),
        "CNN module (insert)": (bench.cnn, (32, 32, 3)),
    }
    section.note(
        f"bench_flax_packing.py's models, float32, on {jax.devices()[0].platform}: jitted `pack(model, x, "
        f'program="packed")` ÷ one jitted forward without masks, and ÷ jitted `predict(model, x, {N})`; medians of '
        f"{ctx.sizes.model_rounds} interleaved rounds; MACs counted on the jitted programs (bench_flax_packing.macs)."
    )
    for name in ctx.sizes.nnx_models:
        factory, shape = models[name]
        for batch in sorted(ctx.sizes.pack_batches, key=lambda b: -b):

            def cell(factory: Callable[[bool], Any] = factory, shape: tuple[int, ...] = shape, batch: int = batch):
                masked, single = factory(True), factory(False)
                masked.eval()
                single.eval()
                x = jax.random.normal(jax.random.key(batch), (batch, *shape))
                calls = {
                    "single": (single, bench.forward),
                    "packed": (pack(masked, x, program="packed"), bench.forward),
                    "tiled": (masked, lambda m, v: mf.predict(m, v, N)),
                }
                seconds = interleaved_medians(
                    {k: bench.timed(bench.jitted(*call), x) for k, call in calls.items()},
                    rounds=ctx.sizes.model_rounds,
                )
                macs = {k: bench.macs(*call, x) for k, call in calls.items()}
                return {
                    "batch": batch,
                    "single (ms)": seconds["single"] * 1e3,
                    "packed ÷ single": seconds["packed"] / seconds["single"],
                    "MACs ÷ single": macs["packed"] / macs["single"],
                    "tiled ÷ single": seconds["tiled"] / seconds["single"],
                    "packed ÷ tiled": seconds["packed"] / seconds["tiled"],
                    f"{N} singles ÷ packed": N * seconds["single"] / seconds["packed"],
                }

            section.attempt(f"{name}, batch {batch}", cell)
            release_memory()


# ------------------------------------------------------------------------------------------------ CUDA choices


def library_constant(module: Any, name: str) -> Any:
    value = getattr(module, name, None)
    return "not found (renamed?)" if value is None else value


def cuda_choices(ctx: Context, section: Section) -> None:
    """What the CPU-measured constants of masksembles_torch decide, each alternative timed here."""
    import torch

    from masksembles_torch import _pack_chunks as chunks
    from masksembles_torch import _pack_emit as emit
    from masksembles_torch import _packed_ops as ops

    rows_constant = library_constant(emit, "PER_MEMBER_ROWS")
    chunk_constant = library_constant(chunks, "CHUNK_BYTES")
    tile_constant = getattr(getattr(ops, "MemberMLP", None), "tile_rows", "not found (renamed?)")
    section.note(
        f"Constants measured on a 2-core CPU: PER_MEMBER_ROWS = {rows_constant} (members' Linear layers on at least "
        f"that many rows run one matmul per member, fewer one batched matmul), MemberMLP.tile_rows = {tile_constant} "
        f"(on CPU only; one tile elsewhere), CHUNK_BYTES = {chunk_constant} (CPU only; on CUDA pack runs the batch "
        f"in one call). Each alternative below is timed on {ctx.device}, medians of {ctx.sizes.rounds} interleaved "
        "rounds."
    )
    table = f"PER_MEMBER_ROWS: MemberLinear ({N} members), one matmul per member ÷ one batched matmul"
    for dtype, (inputs, outputs) in itertools.product(("float32", "bfloat16"), ((192, 768), (768, 192))):
        section.attempt(
            f"{inputs}→{outputs} per member, {dtype}",
            lambda dtype=dtype, i=inputs, o=outputs: member_linear_rows(ctx, section, ops, getattr(torch, dtype), i, o),
            table=table,
        )
    table = f"MemberMLP.tile_rows: MemberMLP 192→768 (GELU)→192 per member ({N} members) on tiles of rows ÷ one tile"
    for dtype in ("float32", "bfloat16"):
        section.attempt(
            f"{dtype}",
            lambda dtype=dtype: member_mlp_rows(ctx, section, ops, getattr(torch, dtype)),
            table=table,
        )
    table = "CHUNK_BYTES: the packed program on chunks of the batch ÷ in one call (float32)"
    for candidate in importable(ctx, section, pack_candidates(ctx.args.smoke)["ConvNeXt"]):
        if section.attempt(candidate.label, lambda c=candidate: chunk_rows(ctx, section, c), table=table):
            break
        release_memory()


def crossover(counts: list[int], ratios: list[float]) -> str:
    """From which of the (increasing) row counts on the ratio stays below 1."""
    faster = [ratio < 1 for ratio in ratios]
    if all(faster):
        return f"faster at every row count timed ({counts[0]}-{counts[-1]})"
    if not faster[-1]:
        return f"not faster at {counts[-1]} rows (the most timed)"
    first = max(i for i, is_faster in enumerate(faster) if not is_faster) + 1
    return f"faster from {counts[first]} rows on (slower at {counts[first - 1]})"


def member_linear_rows(ctx: Context, section: Section, ops: Any, dtype: Any, inputs: int, outputs: int) -> list[Row]:
    import torch

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(N, outputs, inputs, generator=generator) / inputs**0.5).to(ctx.device, dtype)
    bias = torch.randn(N * outputs, generator=generator).to(ctx.device, dtype)
    layers = {flag: ops.MemberLinear(weight, bias, per_member=flag) for flag in (True, False)}
    rows = []
    for count in ctx.sizes.member_rows:
        x = torch.randn(count, N * inputs, generator=generator).to(ctx.device, dtype)
        times = ctx.sizes.calls_per_timing
        calls = {flag: timed_no_grad(ctx, layer, x, times) for flag, layer in layers.items()}
        seconds = interleaved_medians(calls, rounds=ctx.sizes.rounds)
        rows.append(
            {
                "rows": count,
                "per member (ms)": seconds[True] * 1e3 / times,
                "batched (ms)": seconds[False] * 1e3 / times,
                "per member ÷ batched": seconds[True] / seconds[False],
            }
        )
    verdict = crossover([row["rows"] for row in rows], [row["per member ÷ batched"] for row in rows])
    section.note(f"MemberLinear {inputs}→{outputs}, {str(dtype).removeprefix('torch.')}: per member is {verdict}.")
    return rows


def timed_no_grad(ctx: Context, fn: Callable[[Any], object], x: Any, times: int = 1) -> Callable[[], None]:
    """``times`` calls of ``fn(x)`` without autograd, then one synchronization."""
    import torch

    def call() -> None:
        for _ in range(times):
            with torch.no_grad():
                fn(x)
        ctx.sync()

    return call


def tiled_mlp(mlp: Any, x: Any, tile_rows: int | None) -> Any:
    """``MemberMLP.forward`` with its CPU tiling forced on any device (``tile_rows`` None: one tile)."""
    stacked, lead = mlp.first.blocks(x)
    y, outs = mlp.second.result(stacked, lead)
    rows = stacked.shape[1]
    tiles = 1 if tile_rows is None else max(1, round(rows / tile_rows))
    for start, stop in itertools.pairwise([rows * t // tiles for t in range(tiles + 1)]):
        mlp.second.batched(mlp.activation(mlp.first.batched(stacked[:, start:stop])), out=outs[:, start:stop])
    return y


def member_mlp_rows(ctx: Context, section: Section, ops: Any, dtype: Any) -> list[Row]:
    import torch
    from torch import fx, nn

    generator = torch.Generator().manual_seed(0)
    inputs, hidden = 192, 768

    def linear(i: int, o: int) -> Any:
        weight = (torch.randn(N, o, i, generator=generator) / i**0.5).to(ctx.device, dtype)
        return ops.MemberLinear(weight, torch.randn(N * o, generator=generator).to(ctx.device, dtype))

    mlp = ops.MemberMLP(linear(inputs, hidden), fx.symbolic_trace(nn.GELU()), linear(hidden, inputs))
    rows = []
    for count in ctx.sizes.mlp_rows:
        x = torch.randn(count, N * inputs, generator=generator).to(ctx.device, dtype)
        times = ctx.sizes.calls_per_timing
        calls: dict[object, Callable[[], None]] = {
            tile: timed_no_grad(ctx, lambda v, tile=tile: tiled_mlp(mlp, v, tile), x, times)
            for tile in (None, *ctx.sizes.tile_rows)
        }
        calls["as shipped"] = timed_no_grad(ctx, mlp, x, times)  # one tile on CUDA, tile_rows on CPU
        seconds = interleaved_medians(calls, rounds=ctx.sizes.rounds)
        for tile, value in seconds.items():
            name = "one tile" if tile is None else str(tile)
            rows.append(
                {"rows": count, "tile rows": name, "ms": value * 1e3 / times, "÷ one tile": value / seconds[None]}
            )
        best = min((tile for tile in seconds if tile != "as shipped"), key=seconds.__getitem__)
        section.note(
            f"MemberMLP, {str(dtype).removeprefix('torch.')}, {count} rows: fastest "
            f"{'in one tile' if best is None else f'on tiles of {best} rows'}."
        )
    return rows


def largest_output_bytes(model: Any, x: Any) -> int:
    """Bytes per sample of the largest tensor any leaf module of ``model`` returns for ``x`` (a batch of one)."""
    import torch

    largest = 0

    def hook(module: Any, args: Any, output: Any) -> None:
        nonlocal largest
        if isinstance(output, torch.Tensor):
            largest = max(largest, output.numel() * output.element_size() // x.shape[0])

    leaves = [module for module in model.modules() if not list(module.children())]
    handles = [module.register_forward_hook(hook) for module in leaves]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return largest


def chunk_rows(ctx: Context, section: Section, candidate: Candidate) -> list[Row]:
    """The packed program in one call ÷ in chunks: those CPU's rule would pick for several CHUNK_BYTES, and halves."""
    import torch

    batch = max(ctx.sizes.pack_batches)
    prepared = prepare(ctx, candidate, torch.float32, batch)
    packed = prepared.packed[batch]
    x = example(ctx, prepared.shape, batch, torch.float32)
    per_sample = N * largest_output_bytes(prepared.single, x[:1])  # every member's copy, as wide as the dense one
    sizes: dict[int, list[str]] = {0: [f"pack on {ctx.device.type}"]}
    for mib in (4, 16, 64, 256):
        total = per_sample * batch
        samples = 0 if total <= 2 * mib * 2**20 else -(-batch // -(-total // (mib * 2**20)))
        sizes.setdefault(samples, []).append(f"CHUNK_BYTES {mib} MiB")
    for samples in (batch // 2, batch // 4):
        if samples >= 1:
            sizes.setdefault(samples, []).append(f"batch ÷ {batch // samples}")

    def chunked(samples: int) -> Callable[[Any], Any]:
        if samples == 0:
            return packed
        return lambda v: torch.cat([packed(part) for part in v.tensor_split(-(-batch // samples))], dim=1)

    calls = {samples: timed_no_grad(ctx, chunked(samples), x) for samples in sizes}
    seconds = interleaved_medians(calls, rounds=ctx.sizes.model_rounds)
    best = min(seconds, key=seconds.__getitem__)
    section.note(
        f"{candidate.label} at batch {batch}: fastest {'in one call' if best == 0 else f'in chunks of {best} samples'}"
        f" ({seconds[best] / seconds[0]:.2f}× one call)."
    )
    return [
        {
            "batch": batch,
            f"{N} × largest tensor per sample (KiB)": per_sample / 1024,
            "chunk": "one call" if samples == 0 else f"{samples} samples",
            "chosen by": ", ".join(sizes[samples]),
            "ms": seconds[samples] * 1e3,
            "÷ one call": seconds[samples] / seconds[0],
        }
        for samples in sorted(sizes)
    ]


# ------------------------------------------------------------------------------------------------ the run


def sections() -> list[Section]:
    torch, jax, keras = ("torch",), ("jax", "flax"), ("keras",)
    specs: list[tuple[str, str, float, tuple[str, ...], Callable[[Context, Section], None]]] = [
        ("environment", "Environment", 0.0, (), environment),
        ("conformance-torch", "Conformance: PyTorch layer on the device", 12, torch, conformance_torch),
        ("conformance-jax", "Conformance: Flax linen and NNX layers on the JAX device", 3, jax, conformance_jax),
        ("conformance-keras", "Conformance: Keras layer on its backend's device", 2, keras, conformance_keras),
        ("layer-speed-torch", "Layer speed, PyTorch", 12, torch, layer_speed_torch),
        ("layer-speed-jax", "Layer speed, JAX (linen and NNX)", 4, jax, layer_speed_jax),
        ("cuda-choices", "The CPU-measured constants, timed on this device", 10, torch, cuda_choices),
        ("training-step", "Training step with masks ÷ without", 5, torch, training_step),
        ("pack-torch", "Packed inference, PyTorch", 37, torch, pack_torch),
        ("pack-nnx", "Packed inference, Flax NNX", 15, jax, pack_nnx),
    ]
    return [Section(name, title, weight, requires, run) for name, title, weight, requires, run in specs]


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    names = [section.name for section in sections()]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for device_check.md and .json")
    parser.add_argument("--budget-s", type=float, default=360.0, help="time budget in seconds (default 360)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, seconds (the test suite runs it)")
    parser.add_argument(
        "--sections", type=lambda text: text.split(","), default=names, help=f"{', '.join(names)} (environment always)"
    )
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor; eager with --smoke)")
    parser.add_argument("--fail", action="append", default=[], choices=names, help="inject a failure (tests)")
    args = parser.parse_args(argv)
    unknown = set(args.sections) - set(names)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {names}")
    return args


def run_section(ctx: Context, section: Section, remaining: list[Section], clock_end: float) -> None:
    """Run one section in its share of the time left, recording whatever happens."""
    now = time.perf_counter()
    if section.name not in ctx.args.sections and section.name != "environment":  # it chooses the torch device
        section.status = "not selected (--sections)"
        return
    missing = [ctx.missing[r] for r in section.requires if r in ctx.missing]
    if missing:
        section.status = "unavailable"
        section.notes.append("Not importable: " + "; ".join(missing))
        return
    if section.weight and now >= clock_end:
        section.status = "skipped"
        section.notes.append("The time budget (--budget-s) was spent before this section.")
        return
    weights = sum(s.weight for s in remaining)
    section.deadline = now + (clock_end - now) * section.weight / weights if section.weight else math.inf
    section.status = "running"
    section.save()
    try:
        if section.name in ctx.args.fail:
            raise RuntimeError(f"failure injected by --fail {section.name}")
        section.run(ctx, section)
        errors = sum("error" in row for row in section.rows)
        section.status = f"{errors} parts failed" if errors else "ok"
    except Exception as error:  # recorded; the next section runs
        section.status = "error"
        section.error = failure(error)
        print(section.error["traceback"], flush=True)
    except Interrupted:
        section.status = "interrupted (SIGTERM)"
        raise
    finally:
        section.seconds = time.perf_counter() - now
        release_memory()


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX takes GPU memory as needed, beside torch
    sizes = SMOKE if args.smoke else FULL
    budget = args.budget_s
    ctx = Context(args, sizes, args.compile_backend or ("eager" if args.smoke else "inductor"))
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report = Report(
        args.out,
        {
            "command": " ".join(["python3", *sys.argv]),
            "mode": "smoke" if args.smoke else "full",
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "budget_s": budget,
            "elapsed_s": 0.0,
            "machine": f"{machine()}, {platform.platform()}",
            "compile_backend": ctx.compile_backend,
            "sizes": sizes.__dict__,
        },
        sections(),
    )
    for section in report.sections:
        section.report = report

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise Interrupted

    signal.signal(signal.SIGTERM, interrupt)
    status = 0
    with contextlib.suppress(Interrupted):
        for index, section in enumerate(report.sections):
            print(f"\n== {section.name}", flush=True)
            later = [
                s for s in report.sections[index:] if s.name in args.sections and not set(s.requires) & set(ctx.missing)
            ]
            try:
                run_section(ctx, section, later, start + budget)
            except Interrupted:
                status = 124
                raise
            finally:
                report.save()
                print(section_markdown(section), flush=True)
    print(f"\nwrote {args.out / MARKDOWN} and {args.out / JSON} in {time.perf_counter() - start:.0f} s", flush=True)
    failed = any(s.status == "error" or s.status.endswith("parts failed") for s in report.sections)
    return status or int(failed)


if __name__ == "__main__":
    sys.exit(main())
