"""Masksembles layer speed in PyTorch against the memory-bound floor and other implementations.

    python benchmarks/bench_torch.py [--rounds 15] [--device cpu|cuda]

Forward and forward+backward of Masksembles2D on (64, 256, 32, 32) and Masksembles1D on
(4096, 1024), float32, n=4, scale=2, each timed in turn with: ``x * 1.0`` (the memory-bound
floor), ``F.dropout``, the official masksembles 1.1.1 layer and torch-uncertainty 0.13's masking
step (``Mask2d``/``Mask1d``). Medians; every ratio from the same run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from _report import arguments, interleaved_medians, machine, publish
from _torch_setup import torch_device

import masksembles_torch as mt

CASES = {"Masksembles2D (64, 256, 32, 32)": (64, 256, 32, 32), "Masksembles1D (4096, 1024)": (4096, 1024)}
N, SCALE = 4, 2.0


def torch_uncertainty_masks() -> ModuleType:
    """torch-uncertainty's masksembles module, loaded alone (its package __init__ needs many extras)."""
    spec = importlib.util.find_spec("torch_uncertainty")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps torch-uncertainty==0.13.0 (the bench nox session does)")
    path = Path(next(iter(spec.submodule_search_locations))) / "layers" / "masksembles.py"
    module_spec = importlib.util.spec_from_file_location("torch_uncertainty_masksembles", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def implementations(shape: tuple[int, ...], device: torch.device) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from masksembles import torch as official

    tu = torch_uncertainty_masks()
    channels, two_d = shape[1], len(shape) == 4
    ours = (mt.Masksembles2D if two_d else mt.Masksembles1D)(channels, N, SCALE, seed=0).to(device)
    official_layer = (official.Masksembles2D if two_d else official.Masksembles1D)(channels, N, SCALE).to(device)
    tu_layer = (tu.Mask2d if two_d else tu.Mask1d)(channels, N, SCALE, device=device, dtype=None)
    return {
        "x * 1.0": lambda x: x * 1.0,
        "masksembles-kit": ours,
        "F.dropout": lambda x: F.dropout(x, 0.5, training=True),
        "official 1.1.1": official_layer,
        "torch-uncertainty 0.13": tu_layer,
    }


def timed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, backward: bool, sync: Callable[[], None]):
    grad = torch.ones_like(x)

    def forward() -> None:
        with torch.no_grad():
            fn(x)
        sync()

    def forward_backward() -> None:
        leaf = x.detach().requires_grad_(True)
        fn(leaf).backward(grad)
        sync()

    return forward_backward if backward else forward


def main() -> None:
    args = arguments(device=True)
    device, sync, where = torch_device(args)

    lines = [
        f"## PyTorch layer ({where})",
        "",
        f"torch {torch.__version__}, float32, n={N}, scale={SCALE}; medians of {args.rounds} interleaved rounds on "
        f"{machine()}. Ratios: time ÷ the same pass of `x * 1.0` (the memory-bound floor); the last columns are "
        "the other layer's time ÷ ours. Targets: forward ≤ 1.10× the floor, forward+backward ≤ 1.2×, "
        "≥ 2.5× faster than the official layer.",
        "",
        "| case | pass | floor (ms) | ours (ms) | ours ÷ floor | F.dropout ÷ ours | official ÷ ours "
        "| torch-uncertainty ÷ ours |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case, shape in CASES.items():
        x = torch.randn(*shape, device=device)
        fns = implementations(shape, device)
        for backward in (False, True):
            medians = interleaved_medians(
                {name: timed(fn, x, backward, sync) for name, fn in fns.items()}, rounds=args.rounds
            )
            ours, floor = medians["masksembles-kit"], medians["x * 1.0"]
            row = (
                f"| {case} | {'forward+backward' if backward else 'forward'} | {floor * 1e3:.2f} | {ours * 1e3:.2f} "
                f"| {ours / floor:.2f}× | {medians['F.dropout'] / ours:.2f}× | {medians['official 1.1.1'] / ours:.2f}× "
                f"| {medians['torch-uncertainty 0.13'] / ours:.2f}× |"
            )
            lines.append(row)
            print(row, flush=True)
    text = "\n".join(lines)
    publish(f"torch-{device.type}", text, write=not args.no_write)


if __name__ == "__main__":
    main()
