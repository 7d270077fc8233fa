"""Real gloo ranks for the FSDP2 and checkpoint tests: spawned processes, a file rendezvous in
``tmp_path``, a 60 s collective timeout (a hung collective fails the test, never CI)."""

from __future__ import annotations

import datetime
import gc
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DIM = 24  # every weight (24, 24): FSDP2 on 2 ranks gives (12, 24) shards


def init(rank: int, world: int, tmp: str, tag: str = "rendezvous") -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/{tag}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )


def leave() -> None:
    """Before a rank tears gloo down, after it dropped its DDP wrappers and optimizers: free
    them now, then wait for every rank. A group destroyed while a peer still talks to it
    aborts the process ("terminate called without an active exception"), and so may a DDP
    reducer freed after its group: the reducer sits in reference cycles, which only a
    collection frees (a CI run saw that abort once, after ``del ddp`` alone)."""
    gc.collect()
    dist.barrier()


def finish() -> None:
    """Every rank gets here before any tears gloo down (:func:`leave`)."""
    leave()
    dist.destroy_process_group()


def spawn(fn: Any, world: int, *args: Any) -> None:
    mp.start_processes(fn, args=(world, *args), nprocs=world, start_method="spawn", join=True)


def model() -> torch.nn.Module:
    """Two square layers; more samples per step than rows per tile, so factors are full rank
    and eigenbases are defined (see test_ranks._model)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, DIM), torch.nn.Tanh(), torch.nn.Linear(DIM, DIM)
    )


def shard(net: torch.nn.Module, mesh: Any = None) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def batches(steps: int, samples: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(samples, DIM, generator=g) for _ in range(steps)]


def loss_of(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (net(x) - x.flip(1)).square().mean()


def train(
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: list[torch.Tensor],
    rank: int = 0,
    world: int = 1,
) -> list[float]:
    """Each rank trains on its slice of every batch; returns the global batch's losses (the
    mean of the ranks' equal-sized slices)."""
    losses = []
    for batch in data:
        per_rank = batch.shape[0] // world
        x = batch[rank * per_rank : (rank + 1) * per_rank]
        opt.zero_grad()
        loss = loss_of(net, x)
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
    return losses


def full_state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as whole tensors (a collective for FSDP2: every rank calls it)."""
    out = {}
    for key, value in net.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[key] = full.detach().clone()
    return out
