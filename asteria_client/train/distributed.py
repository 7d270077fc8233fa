"""`asteria train` under torchrun: data parallelism (DDP) or sharding (FSDP2) over the ranks.

``torchrun --standalone --nproc-per-node 2 --no-python asteria train ...`` starts one process per
rank with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous in the environment;
:func:`start` joins them (gloo on the CPU, nccl on CUDA, one GPU per local rank).

``--batch-size`` stays the *global* batch: every rank draws the same batches from the same seeded
stream and trains on its own slice of rows, so a run on W ranks sees exactly the data a run on
one rank sees, and the two are comparable step for step (DDP averages the slices' gradients into
the whole batch's). Rank 0 logs progress and writes ``--json``; every rank evaluates (with FSDP2
the forward pass is collective).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from asteria_server.errors import InvalidInputError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranks:
    """This process's place in a torchrun job (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    #: True when this module initialized the process group (and so destroys it at the end)
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_ranks(environ: Mapping[str, str] | None = None) -> int:
    """The world size torchrun (or any launcher setting ``WORLD_SIZE``) started; 1 otherwise."""
    env = os.environ if environ is None else environ
    try:
        return max(1, int(env.get("WORLD_SIZE", "1")))
    except ValueError:
        raise InvalidInputError(
            f"WORLD_SIZE={env.get('WORLD_SIZE')!r} is not a number; launch with torchrun"
        ) from None


def start(
    device: torch.device, environ: Mapping[str, str] | None = None
) -> tuple[Ranks, torch.device]:
    """Join the launcher's process group when there is more than one rank, and pick this rank's
    device (``cuda:LOCAL_RANK`` for a CUDA run). A group already initialized is used as is."""
    env = os.environ if environ is None else environ
    world = launched_ranks(env)
    if world == 1 and not dist.is_initialized():
        return Ranks(), device
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns = True
    return Ranks(dist.get_rank(), dist.get_world_size(), local_rank, owns), device


def finish(ranks: Ranks) -> None:
    """Leave the process group this module joined: every rank first, then teardown."""
    if ranks.owns_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def wrap(model: nn.Module, ranks: Ranks, *, fsdp: bool, device: torch.device) -> nn.Module:
    """The module the training step calls: ``model`` itself for one rank, DDP around it, or
    ``model`` sharded in place with FSDP2 (each transformer block, then the whole)."""
    if not ranks.distributed:
        if fsdp:
            raise InvalidInputError("--fsdp needs more than one rank: launch with torchrun")
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in getattr(model, "blocks", ()):
            fully_shard(block)
        fully_shard(model)
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def rows(batch: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """This rank's slice of a global batch (all of it for one rank)."""
    if not ranks.distributed:
        return batch
    per_rank = batch.shape[0] // ranks.world_size
    return batch[ranks.rank * per_rank : (ranks.rank + 1) * per_rank]


def mean(value: torch.Tensor, ranks: Ranks) -> float:
    """The mean of a scalar over the ranks (itself for one rank): with equal slices, the
    global batch's loss."""
    if not ranks.distributed:
        return value.item()
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / ranks.world_size


def check_batch(batch_size: int, ranks: Ranks) -> None:
    if batch_size % ranks.world_size:
        raise InvalidInputError(
            f"--batch-size {batch_size} is the global batch and must divide evenly over "
            f"{ranks.world_size} ranks"
        )


def describe(ranks: Ranks, optimizer: Any) -> str:
    """``2 ranks on 1 node, job J, daemon unix:///...`` (or the embedded engine / native)."""
    if not ranks.distributed:
        return "1 rank"
    layout = getattr(optimizer, "layout", None)
    nodes = 1 if layout is None else layout.num_nodes
    job = "" if layout is None else f", job {layout.job_id}"
    address = getattr(getattr(optimizer, "source", None), "address", None)
    mode = getattr(optimizer, "mode", None)
    if address:
        where = f"daemon {address}"
    elif mode is not None:
        where = f"{mode.value} engine per rank"
    else:
        where = "no preconditioner"
    return f"{ranks.world_size} ranks on {nodes} node(s){job}, {where}"
