"""A 2-D mesh (DP x TP, 2 x 2 on 4 gloo ranks): Asteria's own groups neither hang nor join the
wrong ranks, whatever order the ranks build their optimizers in.

Each tensor-parallel slice (ranks {0, 2} and {1, 3}) holds its own "TP shard" of a model,
replicated over its data-parallel group (DDP with ``process_group=`` that group), and the whole
world shares a small head (DDP over the world). Slice 0 builds its optimizers head first, slice 1
its data-parallel one first. Every optimizer construction makes gloo side groups of its ranks;
with ``torch.distributed.new_group`` (every rank of the world must enter each call, in one
order) the two slices' calls were paired with each other: the data-parallel exchange of slice 0
was created under the same name as the world's exchange of slice 1, and the run hung or mixed
ranks. Now each side group rendezvouses under its members' own key (``distributed/groups.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asteria_client import SOAP
from asteria_server.engine import EngineConfig
from tests.distributed.spawn import init, leave, spawn

DIM = 8
STEPS = 30
BATCH = 16


def _soap(params: Any, group: Any, refresh: str = "amortized", budget: int = 1) -> SOAP:
    continuous = refresh == "continuous"
    return SOAP(
        params,
        lr=1e-2,
        mode="embedded",
        precondition_frequency=5 if continuous else 2,  # f = 5: room for extra pulls
        staleness_budget=budget,
        refresh=refresh,
        refresh_overhead=0.5 if continuous else 0.04,
        process_group=group,
        engine_config=EngineConfig(num_workers=1, calibrate=False),
    )


def _mesh_rank(
    rank: int, world: int, tmp: str, refresh: str = "amortized", budget: int = 1
) -> None:
    init(rank, world, tmp)
    try:
        tp, dp = rank % 2, rank // 2
        # the user's groups, made as torch asks (every rank enters every call, in one order)
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        dp_group = dp_groups[tp]
        torch.manual_seed(10 + tp)  # each TP slice holds another shard
        shard = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh())
        torch.manual_seed(0)
        head = torch.nn.Linear(DIM, DIM)
        shard_ddp = torch.nn.parallel.DistributedDataParallel(shard, process_group=dp_group)
        head_ddp = torch.nn.parallel.DistributedDataParallel(head)
        if tp == 0:  # the slices build their optimizers in different orders
            head_opt = _soap(head.named_parameters(), None, refresh, budget)
            shard_opt = _soap(shard.named_parameters(), dp_group, refresh, budget)
        else:
            shard_opt = _soap(shard.named_parameters(), dp_group, refresh, budget)
            head_opt = _soap(head.named_parameters(), None, refresh, budget)
        if refresh == "continuous":  # pulls at the hooks too: each rank's own timing
            shard_opt.attach(shard)
            head_opt.attach(head)
        g = torch.Generator().manual_seed(100 + tp)  # each slice its own data
        try:
            for _ in range(STEPS):
                x = torch.randn(2 * BATCH, DIM, generator=g)[dp * BATCH : (dp + 1) * BATCH]
                shard_opt.zero_grad()
                head_opt.zero_grad()
                (head_ddp(shard_ddp(x)) - x.flip(1)).square().mean().backward()
                shard_opt.step()
                head_opt.step()
            stats = {"shard": shard_opt.runtime_stats(), "head": head_opt.runtime_stats()}
        finally:
            shard_opt.close()
            head_opt.close()
        torch.save(
            {"shard": shard.state_dict(), "head": head.state_dict(), "stats": stats},
            f"{tmp}/mesh{rank}.pt",
        )
        del shard_ddp, head_ddp, shard_opt, head_opt
        leave()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("budget", [1, 2])
@pytest.mark.parametrize("refresh", ["amortized", "continuous"])
def test_a_2d_mesh_builds_its_groups_in_any_order_and_keeps_each_group_apart(
    tmp_path: Path, refresh: str, budget: int
) -> None:
    """DP x TP 2 x 2 for 30 steps at S = 1 and 2, amortized and continuous (where each block's
    owner in its group chooses its extra pulls): the replicas stay bitwise equal, each within
    its budget."""
    spawn(_mesh_rank, 4, str(tmp_path), refresh, budget)
    runs = [torch.load(tmp_path / f"mesh{r}.pt", weights_only=False) for r in range(4)]
    for run in runs:
        for which in ("shard", "head"):
            source = run["stats"][which]["source"]
            assert not source["exchange_failed"] and source["exchange_results_received"] > 0
            assert run["stats"][which]["agreement_failed"] == ""
            frequency = 5 if refresh == "continuous" else 2
            assert run["stats"][which]["max_lag_steps"] <= budget * frequency
    for key in runs[0]["shard"]:
        # replicas of one TP shard (its DP group) are bitwise equal ...
        assert torch.equal(runs[0]["shard"][key], runs[2]["shard"][key]), key
        assert torch.equal(runs[1]["shard"][key], runs[3]["shard"][key]), key
        # ... and the two shards were never mixed up
        assert not torch.equal(runs[0]["shard"][key], runs[1]["shard"][key]), key
    for key in runs[0]["head"]:  # the world's head: one replica set of four
        assert all(torch.equal(runs[0]["head"][key], run["head"][key]) for run in runs[1:]), key
    if refresh == "continuous":  # the schedule did pull extras, registered alike by replicas
        for which in ("shard", "head"):
            pulls = [
                {b: r["extra_pulls"] for b, r in run["stats"][which]["refreshes"]["blocks"].items()}
                for run in runs
            ]
            assert sum(pulls[0].values()) > 0, (which, pulls)
            groups = [(0, 2), (1, 3)] if which == "shard" else [(0, 1, 2, 3)]
            for group in groups:
                assert all(pulls[r] == pulls[group[0]] for r in group), (which, pulls)
