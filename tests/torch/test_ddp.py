"""DistributedDataParallel (gloo, CPU, 2 processes): same masks on every rank, single-process results."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # before any process group exists: see worker
import torch.multiprocessing as mp
from torch import nn

import masksembles_torch as mt
from tests.rounding import assert_rounding_close

WORLD = 2
LOCAL_BATCH = 6  # not a multiple of n: grouping applies to each rank's local batch


def build_model() -> nn.Module:
    torch.manual_seed(0)  # same weights everywhere; masks use seed=None, so they differ before DDP syncs them
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), mt.Masksembles1D(16, 4, 2.0), nn.Linear(16, 3))


def local_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(LOCAL_BATCH, 5, generator=generator), torch.randn(LOCAL_BATCH, 3, generator=generator)


def worker(rank: int, store: str, out: str) -> None:
    """One rank's step, saved to ``out``; the process group and its gloo threads are gone before the rank exits.

    DDP imports torch._dynamo, which imports ``torch.distributed.nn.functional``, whose functions default to
    ``group=group.WORLD``: imported after ``init_process_group``, they held the default group for the life of the
    interpreter, so ``destroy_process_group`` left gloo's threads running into interpreter teardown, where a rank
    sometimes aborted ("terminate called without an active exception"). This module imports it first.
    """
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    group = weakref.ref(dist.group.WORLD)
    model = build_model()
    masks_before = model[2].masks.clone()
    ddp = nn.parallel.DistributedDataParallel(model)
    x, target = local_data(rank)
    output = ddp(x)
    nn.functional.mse_loss(output, target).backward()
    torch.save(
        {
            "masks_before": masks_before,
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "output": output.detach(),
            "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        },
        Path(out) / f"rank{rank}.pt",
    )
    del ddp, output  # DDP's reducer holds the process group too
    dist.barrier()  # both ranks done with their collectives before either closes its connections
    dist.destroy_process_group()
    assert group() is None, "the process group outlives destroy_process_group: gloo's threads would outlive it too"


def test_ddp_matches_single_process(tmp_path: Path) -> None:
    mp.spawn(worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    assert not torch.equal(ranks[0]["masks_before"], ranks[1]["masks_before"]), "seed=None differs per rank"
    assert torch.equal(ranks[0]["state"]["2.masks"], ranks[1]["state"]["2.masks"]), "DDP syncs the masks"
    assert torch.equal(ranks[0]["state"]["2.masks"], ranks[0]["masks_before"]), "rank 0's masks win"

    single = build_model()
    single.load_state_dict(ranks[0]["state"])
    grads: dict[str, torch.Tensor] = {}
    for rank in range(WORLD):
        single.zero_grad()
        x, target = local_data(rank)
        output = single(x)
        # DDP runs the module's forward on the same local batch: the same arithmetic, so the same bits
        torch.testing.assert_close(ranks[rank]["output"], output.detach(), rtol=0, atol=0)
        nn.functional.mse_loss(output, target).backward()
        for name, p in single.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad / WORLD
    for rank in range(WORLD):
        for name, grad in grads.items():
            assert_rounding_close(ranks[rank]["grads"][name], grad, err_msg=name)  # all-reduced: another order
