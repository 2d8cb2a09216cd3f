"""Packed inference: all N members at about the cost of one model.

    python benchmarks/bench_packing.py [--rounds 15] [--device cpu|cuda]

Fixed capacity N=4, S=2 (M·S = C). Models: an MLP 784→1024→1024→1024→10 with Masksembles before
each Linear after the first, and a small ResNet on 3×32×32. For batch sizes 1, 32, 256 (medians of
interleaved rounds, every ratio from the same run):
(a) ``pack(model)`` on the batch ÷ one forward of the same network without Masksembles;
(a′) for the ResNet, the same ÷ that network in channels-last memory format (as ``pack`` runs its convolutions):
the stricter baseline, since channels-last alone speeds the single network up on CPU;
(b) tiled dense ``predict(model, x, 4)`` ÷ the same;
(c) one ``extract_member`` model ÷ the same (latency and parameters).
Next to each, the multiply-accumulate (MAC) ratio of its Linear/Conv layers, counted on the run:
the floor that no implementation of that computation can beat.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from _report import arguments, interleaved_medians, machine, publish
from _torch_setup import torch_device
from torch import nn

import masksembles_torch as mt

N, SCALE = 4, 2.0


def mlp(masks: bool) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(784, 1024), nn.ReLU()]
    for i in range(2):
        layers += [mt.Masksembles1D(1024, N, SCALE, seed=i) if masks else nn.Identity()]
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    layers += [mt.Masksembles1D(1024, N, SCALE, seed=2) if masks else nn.Identity()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


class Block(nn.Module):
    def __init__(self, channels: int, masks: bool, seed: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.masks = mt.Masksembles2D(channels, N, SCALE, seed=seed) if masks else nn.Identity()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.conv2(self.masks(F.relu(self.bn1(self.conv1(x)))))) + x)


class ResNet(nn.Module):
    def __init__(self, masks: bool) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.block1 = Block(64, masks, 0)
        self.down = nn.Sequential(
            nn.Conv2d(64, 128, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU()
        )
        self.block2 = Block(128, masks, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head_masks = mt.Masksembles1D(128, N, SCALE, seed=2) if masks else nn.Identity()
        self.fc = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.block2(self.down(self.block1(self.stem(x))))).flatten(1)
        return self.fc(self.head_masks(y))


def macs(model: nn.Module, x: torch.Tensor) -> int:
    """Multiply-accumulates of the Linear, Conv and grouped-Linear layers in one forward of ``x``."""
    total = 0

    def count(module: nn.Module, _inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Linear):
            total += output.numel() * module.in_features
        elif isinstance(module, nn.modules.conv._ConvNd):
            total += output.numel() * module.weight[0].numel()
        elif type(module).__name__ == "_GroupedLinear":
            total += output.numel() * module.weight.shape[2]

    hooks = [m.register_forward_hook(count) for m in model.modules()]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return total


def main() -> None:
    args = arguments(device=True)
    device, sync, where = torch_device(args)
    lines = [
        f"## Packed inference, PyTorch ({where})",
        "",
        f"torch {torch.__version__}, float32, N={N}, S={SCALE} at fixed capacity (M·S = C); medians of {args.rounds} "
        f"interleaved rounds on {machine()}. Every ratio is ÷ one forward of the same network without Masksembles "
        "on the same batch; in brackets, the MAC ratio of its Linear/Conv layers: the bound on its time ratio when "
        "both run at the same speed per MAC (small or grouped kernels run slower per MAC, large ones faster). "
        "Targets: packed within 1.3× of its MAC ratio and ≤ 1.5× for the MLP; tiled predict ≈ N×. `pack` runs "
        "2-D/3-D convolutions in channels-last memory format (grouped convolutions run near the dense speed per MAC "
        "there, not in NCHW); (a′) divides by the single ResNet in channels-last too.",
        "",
        "| model | batch | single (ms) | (a) packed ÷ single [MACs] | (a′) packed ÷ single channels-last "
        "| (b) tiled predict ÷ single [MACs] | (c) one member ÷ single [MACs] | member params ÷ full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    torch.manual_seed(0)
    for name, factory, shape in (("MLP", mlp, (784,)), ("ResNet", ResNet, (3, 32, 32))):
        masked = factory(True).to(device).eval()
        single = factory(False).to(device).eval()
        single.load_state_dict({k: v for k, v in masked.state_dict().items() if not k.endswith("masks")})
        convolutional = len(shape) == 3
        single_cl = copy.deepcopy(single).to(memory_format=torch.channels_last)
        for batch in (1, 32, 256):
            x = torch.randn(batch, *shape, device=device)
            packed = mt.pack(masked, x)
            member = mt.extract_member(masked, 0, x)
            tiled = copy.deepcopy(masked)

            def run(fn, x=x):
                def call() -> None:
                    with torch.no_grad():
                        fn(x)
                    sync()

                return call

            contenders = {
                "single": run(single),
                "packed": run(packed),
                "tiled": run(lambda v, model=tiled: mt.predict(model, v, N)),
                "member": run(member),
            }
            if convolutional:
                contenders["single_cl"] = run(
                    lambda v, model=single_cl: model(v.contiguous(memory_format=torch.channels_last))
                )
            medians = interleaved_medians(contenders, rounds=args.rounds)
            base = macs(single, x)
            ratio = {k: medians[k] / medians["single"] for k in medians}
            row = (
                f"| {name} | {batch} | {medians['single'] * 1e3:.3f} "
                f"| {ratio['packed']:.2f}× [{macs(packed, x) / base:.2f}×] "
                + (f"| {medians['packed'] / medians['single_cl']:.2f}× " if convolutional else "| — ")
                + f"| {ratio['tiled']:.2f}× [{macs(masked, mt.tile(x, N)) / base:.2f}×] "
                f"| {ratio['member']:.2f}× [{macs(member, x) / base:.2f}×] "
                f"| {sum(p.numel() for p in member.parameters()) / sum(p.numel() for p in single.parameters()):.2f}× |"
            )
            lines.append(row)
            print(row, flush=True)
    text = "\n".join(lines)
    publish(f"packing-{device.type}", text, write=not args.no_write)


if __name__ == "__main__":
    main()
