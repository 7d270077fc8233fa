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

Bitwise-equal replicas could still train the wrong thing (a wrong learning rate, a slice's data
split wrong), so the mesh's loss is also held against one process with the global batch.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asteria_client import SOAP
from asteria_client.distributed.layout import group_job
from asteria_server.engine import EngineConfig
from tests.distributed import sync_cluster as sc
from tests.distributed.spawn import init, leave, spawn

DIM = 8
STEPS = 30
BATCH = 16


def _frequency(refresh: str) -> int:
    return 5 if refresh == "continuous" else 2  # f = 5: room for extra pulls


def _soap(
    params: Any,
    group: Any,
    refresh: str = "amortized",
    budget: int = 1,
    native: bool = False,
    address: str | None = None,
) -> SOAP:
    """The mesh's SOAP; ``native``: every basis computed in its step, at the same f;
    ``address``: in daemon mode, on the daemon there (else embedded)."""
    if native:
        return SOAP(params, lr=1e-2, mode="native", precondition_frequency=_frequency(refresh))
    where: dict[str, Any] = (
        {"mode": "daemon", "address": address}
        if address is not None
        else {"mode": "embedded", "engine_config": EngineConfig(num_workers=1, calibrate=False)}
    )
    return SOAP(
        params,
        lr=1e-2,
        precondition_frequency=_frequency(refresh),
        staleness_budget=budget,
        refresh=refresh,
        refresh_overhead=0.5 if refresh == "continuous" else 0.04,
        process_group=group,
        **where,
    )


def _shard(tp: int) -> torch.nn.Module:
    """TP slice ``tp``'s shard: each slice holds another one."""
    torch.manual_seed(10 + tp)
    return torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh())


def _head() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(DIM, DIM)


def _slice_batches(tp: int, data_seed: int = 0) -> list[torch.Tensor]:
    """TP slice ``tp``'s batch at every step (its DP ranks take one half each); ``data_seed``
    other than 0 draws other data, for the one-process spread."""
    g = torch.Generator().manual_seed(100 + tp + 1000 * data_seed)
    return [torch.randn(2 * BATCH, DIM, generator=g) for _ in range(STEPS)]


def _loss(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (y - x.flip(1)).square().mean()


def _one_process(
    refresh: str,
    budget: int,
    data_seed: int = 0,
    native: bool = False,
    states: list[dict[str, torch.Tensor]] | None = None,
) -> list[float]:
    """One process trains the mesh's model on the global batch: both shards, the head on both
    slices' outputs, one optimizer per module as on the mesh, each without a process group.

    Gradients are the mesh's: the head's is the mean over all 4 x BATCH samples (DDP over the
    world), each shard's the mean over its own slice's 2 x BATCH (DDP over its DP group only),
    so each shard's gradient of the global mean is scaled by 2 (exact in float). ``states``
    gets each shard's parameters at the end, slice 0's first."""
    torch.set_num_threads(1)
    shards, head = [_shard(0), _shard(1)], _head()
    shard_opts = [_soap(s.named_parameters(), None, refresh, budget, native) for s in shards]
    head_opt = _soap(head.named_parameters(), None, refresh, budget, native)
    opts = [*shard_opts, head_opt]
    if refresh == "continuous" and not native:
        for opt, module in zip(opts, [*shards, head], strict=True):
            opt.attach(module)
    losses = []
    try:
        for batches in zip(_slice_batches(0, data_seed), _slice_batches(1, data_seed), strict=True):
            for opt in opts:
                opt.zero_grad()
            x = torch.cat(batches)
            hidden = torch.cat([s(b) for s, b in zip(shards, batches, strict=True)])
            loss = _loss(head(hidden), x)
            loss.backward()
            for p in (p for s in shards for p in s.parameters()):
                assert p.grad is not None
                p.grad.mul_(2)
            for opt in opts:
                opt.step()
            losses.append(float(loss.detach()))
    finally:
        for opt in opts:
            opt.close()
    if states is not None:
        states.extend({k: v.detach().clone() for k, v in s.state_dict().items()} for s in shards)
    return losses


def _tail(losses: list[float]) -> float:
    """The mean loss of the last 5 steps: one step's batch alone moves it more."""
    return sum(losses[-5:]) / 5


def _mesh_rank(
    rank: int,
    world: int,
    tmp: str,
    refresh: str = "amortized",
    budget: int = 1,
    addresses: list[str] | None = None,
) -> None:
    """One rank of the mesh; with ``addresses`` in daemon mode, ranks 0 and 1 on node 0's
    daemon and 2 and 3 on node 1's (so each data-parallel group spans both nodes)."""
    address = None
    if addresses is not None:
        node = rank // 2
        address = addresses[node]
        sc.enter_node(node)
    init(rank, world, tmp)
    try:
        tp, dp = rank % 2, rank // 2
        # the user's groups, made as torch asks (every rank enters every call, in one order)
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        dp_group = dp_groups[tp]
        shard, head = _shard(tp), _head()
        shard_ddp = torch.nn.parallel.DistributedDataParallel(shard, process_group=dp_group)
        head_ddp = torch.nn.parallel.DistributedDataParallel(head)
        if tp == 0:  # the slices build their optimizers in different orders
            head_opt = _soap(head.named_parameters(), None, refresh, budget, address=address)
            shard_opt = _soap(shard.named_parameters(), dp_group, refresh, budget, address=address)
        else:
            shard_opt = _soap(shard.named_parameters(), dp_group, refresh, budget, address=address)
            head_opt = _soap(head.named_parameters(), None, refresh, budget, address=address)
        if refresh == "continuous":  # pulls at the hooks too: each rank's own timing
            shard_opt.attach(shard)
            head_opt.attach(head)
        losses = []
        try:
            for batch in _slice_batches(tp):
                x = batch[dp * BATCH : (dp + 1) * BATCH]
                shard_opt.zero_grad()
                head_opt.zero_grad()
                loss = _loss(head_ddp(shard_ddp(x)), x)
                loss.backward()
                shard_opt.step()
                head_opt.step()
                value = loss.detach().clone()
                dist.all_reduce(value)  # the global batch's loss: the mean of 4 equal slices
                losses.append(float(value) / world)
            stats = {"shard": shard_opt.runtime_stats(), "head": head_opt.runtime_stats()}
        finally:
            shard_opt.close()
            head_opt.close()
        torch.save(
            {
                "shard": shard.state_dict(),
                "head": head.state_dict(),
                "stats": stats,
                "losses": losses,
            },
            f"{tmp}/mesh{rank}.pt",
        )
        del shard_ddp, head_ddp, shard_opt, head_opt
        leave()
    finally:
        dist.destroy_process_group()


def _check_loss_within_noise(losses: list[float], refresh: str, budget: int) -> None:
    """The mesh's loss (the global batch's, mean of the last 5 steps) lies within noise of one
    process training the same model on the same global batch with the same optimizer.

    Noise, measured here on the one process, has two parts. The schedule: the step at which
    each basis lands follows each process's timing (the mesh runs 8 engines on the host and
    agrees install steps; one process runs 3 and installs a result the step it arrives, and on
    the continuous schedule pulls about 3x as many extras), and on this small model that moves
    the tail by up to ~13%; so the band spans one process at this S and one in native mode
    (every basis in its step, at the same f). The data: the sample standard deviation of the
    one process's tail over three data seeds (the mesh's and two others), 0.02-0.03 here; the
    band is widened by twice that, at least 0.01. Measured (seed 0, tails): one process at S
    0.59-0.69, native 0.69, the mesh 0.65-0.68. A learning rate 1.5x or 0.5x the mesh's moves
    the mesh's tail to 0.49 or 0.88: outside the band. The first loss (before any step) must
    equal the one process's: the same model and data, or the comparison means nothing."""
    reference = _one_process(refresh, budget)
    native = _one_process(refresh, budget, native=True)
    assert losses[0] == pytest.approx(reference[0], rel=1e-6), (losses[0], reference[0])
    assert _tail(losses) < 0.8 * losses[0], losses  # it learned: the band is not vacuous
    tails = [_tail(reference), *(_tail(_one_process(refresh, budget, s)) for s in (1, 2))]
    margin = max(2 * statistics.stdev(tails), 0.01)
    low = min(tails[0], _tail(native)) - margin
    high = max(tails[0], _tail(native)) + margin
    assert low <= _tail(losses) <= high, (_tail(losses), tails, _tail(native), margin)


def _check_bitwise_replicas(runs: list[dict[str, Any]]) -> None:
    for key in runs[0]["shard"]:
        # replicas of one TP shard (its DP group) are bitwise equal ...
        assert torch.equal(runs[0]["shard"][key], runs[2]["shard"][key]), key
        assert torch.equal(runs[1]["shard"][key], runs[3]["shard"][key]), key
        # ... and the two shards were never mixed up
        assert not torch.equal(runs[0]["shard"][key], runs[1]["shard"][key]), key
    for key in runs[0]["head"]:  # the world's head: one replica set of four
        assert all(torch.equal(runs[0]["head"][key], run["head"][key]) for run in runs[1:]), key


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("budget", [1, 2])
@pytest.mark.parametrize("refresh", ["amortized", "continuous"])
def test_a_2d_mesh_builds_its_groups_in_any_order_and_keeps_each_group_apart(
    tmp_path: Path, refresh: str, budget: int
) -> None:
    """DP x TP 2 x 2 for 30 steps at S = 1 and 2, amortized and continuous (where each block's
    owner in its group chooses its extra pulls): the replicas stay bitwise equal, each within
    its budget, and the loss stays within noise of one process with the global batch
    (:func:`_check_loss_within_noise`)."""
    spawn(_mesh_rank, 4, str(tmp_path), refresh, budget)
    runs = [torch.load(tmp_path / f"mesh{r}.pt", weights_only=False) for r in range(4)]
    for run in runs:
        for which in ("shard", "head"):
            source = run["stats"][which]["source"]
            assert not source["exchange_failed"] and source["exchange_results_received"] > 0
            assert run["stats"][which]["agreement_failed"] == ""
            assert run["stats"][which]["max_lag_steps"] <= budget * _frequency(refresh)
    _check_bitwise_replicas(runs)
    _check_loss_within_noise(runs[0]["losses"], refresh, budget)
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


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("refresh", "budget"), [("amortized", 0), ("amortized", 1), ("continuous", 1)]
)
def test_a_2d_mesh_on_two_synced_daemons_keeps_each_groups_blocks_apart(
    tmp_path: Path, refresh: str, budget: int
) -> None:
    """DP x TP 2 x 2 in daemon mode on two simulated nodes, a synced daemon each, S = 1: each
    data-parallel group spans both nodes, and both TP slices name their shard's blocks alike
    (``0.weight``, ...). Each group is a job of its own on the daemons (``distributed/layout.py``),
    so a slice's snapshots never replace the other's: under one job name they were one
    namespace, where one slice's bases were installed in the other. On the continuous
    schedule each block's chooser is the uploader on its owner daemon's node, within its group
    (before, a ``process_group`` smaller than the world was refused on several nodes). The
    replicas stay bitwise equal within their budget, no (job, block, version) is solved twice in
    the cluster, and the loss stays within noise of one process with the global batch. At S = 0
    every basis is its own step's, so the shards equal one native process's up to the solver's
    and the reductions' rounding: a slice given the other's bases is off by far more."""
    env = sc.sync_env(heartbeat_s=0.1, suspect_s=0.6, dead_s=1.5, patience_s=1.0)
    with sc.daemons(tmp_path, 2, env=env) as ds:
        spawn(_mesh_rank, 4, str(tmp_path), refresh, budget, [d.address for d in ds])
        time.sleep(1.0)  # the last pushes
        views = [sc.view(d.address) for d in ds]
    runs = [torch.load(tmp_path / f"mesh{r}.pt", weights_only=False) for r in range(4)]
    jobs = {sc.JOB, group_job(sc.JOB, [0, 2]), group_job(sc.JOB, [1, 3])}
    for v in views:  # every daemon syncs three jobs: the world's head and each DP group
        assert {g["job"] for g in v.groups} == jobs, [g["job"] for g in v.groups]
    solved: dict[tuple[str, str], list[int]] = {}
    for v in views:
        for g in v.groups:
            for b in g["blocks"]:
                versions = b["solved_versions"] + b["discarded_versions"]
                solved.setdefault((g["job"], b["block"]), []).extend(versions)
    twice = {k: sorted(vs) for k, vs in solved.items() if len(vs) != len(set(vs))}
    assert not twice, twice
    for v in views:  # each daemon solved some shard blocks and received others
        shards = [b for g in v.groups if g["job"] != sc.JOB for b in g["blocks"]]
        assert any(b["solves"] > 0 for b in shards) and any(b["received"] > 0 for b in shards)
    for run in runs:
        for which in ("shard", "head"):
            assert run["stats"][which]["agreement_failed"] == ""
            assert run["stats"][which]["max_lag_steps"] <= budget * _frequency(refresh)
    _check_bitwise_replicas(runs)
    if budget == 0:
        native: list[dict[str, torch.Tensor]] = []
        _one_process(refresh, budget, native=True, states=native)
        for tp in (0, 1):
            for key, value in native[tp].items():
                off = float((runs[tp]["shard"][key] - value).abs().max())
                assert off < 1e-4, (tp, key, off)
    else:
        _check_loss_within_noise(runs[0]["losses"], refresh, budget)
