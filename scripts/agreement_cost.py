"""What agreeing on install steps costs: DDP on gloo ranks (one host), SOAP embedded at a budget
S, against one process with the global batch in native mode.

Prints, as JSON: the median step time (every rank's steps after the first 5), the step at
which the replicas' 5-step mean loss first reaches the target (the loss one native process
reaches at half the run), the largest parameter difference between replicas, the lag
histogram, and, where the code agrees on install steps, how many steps each result was held
(``agreement_held_steps``: the freshness the agreement costs).

    python scripts/agreement_cost.py [--ranks 2] [--steps 200] [--budget 1] [--frequency 2]

Runs against whichever ``asteria_client`` is importable (PYTHONPATH=<another checkout> measures
that one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WIDTH = 32
BATCH = 32  # per rank


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, WIDTH),
    )


def _batches(steps: int, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(world * BATCH, WIDTH, generator=g) for _ in range(steps)]


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x.flip(1).tanh()).square().mean()


def _soap(model: torch.nn.Module, args: argparse.Namespace, mode: str) -> Any:
    from asteria_client import SOAP
    from asteria_server.engine import EngineConfig

    kwargs: dict[str, Any] = {"mode": mode, "precondition_frequency": args.frequency}
    if mode == "embedded":
        kwargs["staleness_budget"] = args.budget
        kwargs["engine_config"] = EngineConfig(num_workers=1)
    return SOAP(model.named_parameters(), lr=3e-3, **kwargs)


def _rank(rank: int, args: argparse.Namespace, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rendezvous",
        rank=rank,
        world_size=args.ranks,
        timeout=datetime.timedelta(seconds=120),
    )
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = _soap(ddp.module, args, "embedded")
    losses, times = [], []
    for batch in _batches(args.steps, args.ranks):
        x = batch[rank * BATCH : (rank + 1) * BATCH]
        start = time.perf_counter()
        opt.zero_grad()
        loss = _loss(ddp, x)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / args.ranks)
    stats = opt.runtime_stats()
    opt.close()
    torch.save(
        {"params": model.state_dict(), "losses": losses, "times": times, "stats": stats},
        f"{tmp}/rank{rank}.pt",
    )
    del ddp, opt
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--budget", type=int, default=1)
    parser.add_argument("--frequency", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    native = _model()
    opt = _soap(native, args, "native")
    reference = []
    for batch in _batches(args.steps, args.ranks):
        opt.zero_grad()
        loss = _loss(native, batch)
        loss.backward()
        opt.step()
        reference.append(float(loss.detach()))
    target = sum(reference[args.steps // 2 - 2 : args.steps // 2 + 3]) / 5
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(args, tmp), nprocs=args.ranks, start_method="spawn")
        runs = [torch.load(f"{tmp}/rank{r}.pt", weights_only=False) for r in range(args.ranks)]
    losses = runs[0]["losses"]
    smooth = [
        sum(losses[max(0, i - 4) : i + 1]) / len(losses[max(0, i - 4) : i + 1])
        for i in range(len(losses))
    ]
    reached = next((i + 1 for i, v in enumerate(smooth) if v <= target), None)
    diff = max(
        float((run["params"][k] - runs[0]["params"][k]).abs().max())
        for run in runs[1:]
        for k in runs[0]["params"]
    )
    stats = runs[0]["stats"]
    print(
        json.dumps(
            {
                "ranks": args.ranks,
                "steps": args.steps,
                "budget": args.budget,
                "frequency": args.frequency,
                "median_step_ms": 1e3
                * statistics.median(t for run in runs for t in run["times"][5:]),
                "target_loss": target,
                "steps_to_target": reached,
                "native_steps_to_target": args.steps // 2,
                "final_loss_5": sum(losses[-5:]) / 5,
                "native_final_loss_5": sum(reference[-5:]) / 5,
                "max_replica_param_diff": diff,
                "max_lag_steps": stats["max_lag_steps"],
                "lag_histogram": stats["lag_histogram"],
                "barrier_waits": stats["barrier_waits"],
                "local_fallbacks": stats["local_fallbacks"],
                "agreement_rounds": stats.get("agreement_rounds"),
                "agreement_forced_rounds": stats.get("agreement_forced_rounds"),
                "agreement_held_steps": stats.get("agreement_held_steps"),
                "agreement_collective_s": stats.get("agreement_collective_s"),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
