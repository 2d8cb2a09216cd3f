"""Device setup shared by the PyTorch benchmarks."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch


def torch_device(args: argparse.Namespace) -> tuple[torch.device, Callable[[], None], str]:
    """(device, a function that waits for it, its description) after setting the thread count."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        return device, torch.cuda.synchronize, torch.cuda.get_device_name(device)
    return device, lambda: None, f"CPU, {args.threads} threads"
