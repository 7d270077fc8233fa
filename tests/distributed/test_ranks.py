"""Real ranks (torch.distributed on gloo, spawned processes): the job layout, and DDP replicas
whose optimizers equal one process with the whole batch."""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asteria_client import SOAP, Shampoo
from asteria_client.distributed import JobLayout, discover_layout
from asteria_client.distributed.layout import group_job
from asteria_server.engine import EngineConfig
from tests.distributed.spawn import init, leave
from tests.integration.test_daemon import LaunchedDaemon, start_daemon, stop_daemon

WORLD = 2
STEPS = 20
BATCH = 16  # per rank; the single-process reference sees WORLD * BATCH
DIM = 12


def _init(rank: int, tmp: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rendezvous",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),  # a hung collective fails, never hangs CI
    )


def _spawn(fn: Any, *args: Any) -> None:
    mp.start_processes(fn, args=args, nprocs=WORLD, start_method="spawn", join=True)


# --------------------------------------------------------------------------- layout


def test_layout_from_host_names() -> None:
    layout = JobLayout.from_hosts(["a", "a", "b", "b"], 2, "job")
    assert (layout.node, layout.node_rank, layout.num_nodes) == ("b", 1, 2)
    assert (layout.local_rank, layout.local_world_size, layout.is_node_leader) == (0, 2, True)
    assert layout.local_ranks == (2, 3) and layout.ranks_by_node == ((0, 1), (2, 3))
    assert not JobLayout.from_hosts(["a", "a", "b", "b"], 3, "job").is_node_leader


def test_no_process_group_means_no_layout() -> None:
    assert discover_layout() is None


def _layout_rank(rank: int, tmp: str) -> None:
    if rank == 1:
        os.environ["TORCHELASTIC_RUN_ID"] = "not-rank-0s"  # ranks disagree: rank 0 wins
    _init(rank, tmp)
    try:
        layout = discover_layout()
        torch.save(layout, f"{tmp}/layout{rank}.pt")
        dist.barrier()  # see _ddp_rank
    finally:
        dist.destroy_process_group()


def test_ranks_discover_one_layout_and_one_job_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASTERIA_JOB", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-42")  # what torchrun sets
    _spawn(_layout_rank, str(tmp_path))
    layouts = [torch.load(tmp_path / f"layout{r}.pt", weights_only=False) for r in range(WORLD)]
    assert [lay.rank for lay in layouts] == [0, 1]
    assert all(lay.world_size == WORLD and lay.num_nodes == 1 for lay in layouts)
    assert [lay.local_rank for lay in layouts] == [0, 1]
    assert [lay.is_node_leader for lay in layouts] == [True, False]
    assert {lay.job_id for lay in layouts} == {"run-42"}


# --------------------------------------------------------------------------- DDP


def _model() -> torch.nn.Module:
    """Square layers and more samples than dims: full-rank factors, whose eigenbases are
    defined. (Rank-deficient factors have an arbitrary null-space basis, which turns the rounding
    difference of an all-reduced gradient into a different trajectory.)"""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, DIM), torch.nn.Tanh(), torch.nn.Linear(DIM, DIM)
    )


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(WORLD * BATCH, DIM, generator=g) for _ in range(STEPS)]


def _optimizer(model: torch.nn.Module, name: str, address: str = "") -> torch.optim.Optimizer:
    """``name`` is optimizer-mode; S = 0, so replicas must install the same versions at the
    same steps as one process does."""
    optimizer, mode = name.split("-")
    kwargs: dict[str, Any] = {"mode": mode, "precondition_frequency": 3}
    if mode == "embedded":
        kwargs["engine_config"] = EngineConfig(num_workers=1)
    if mode == "daemon":
        kwargs["address"] = address
    if mode != "native":
        kwargs["staleness_budget"] = 0
    cls = Shampoo if optimizer == "shampoo" else SOAP
    return cls(model.named_parameters(), lr=1e-2, **kwargs)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int | None) -> None:
    for batch in _batches():
        x = batch if rank is None else batch[rank * BATCH : (rank + 1) * BATCH]
        opt.zero_grad()
        (model(x) - x).square().mean().backward()
        opt.step()


def _ddp_rank(rank: int, tmp: str, name: str, address: str) -> None:
    torch.set_num_threads(1)
    _init(rank, tmp)
    try:
        model = _model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = _optimizer(ddp.module, name, address)
        try:
            _train(ddp, opt, rank)
            stats = opt.runtime_stats()["source"]  # type: ignore[attr-defined]
        finally:
            opt.close()  # type: ignore[attr-defined]
        torch.save(model.state_dict(), f"{tmp}/params{rank}.pt")
        torch.save(stats, f"{tmp}/stats{rank}.pt")
        # The reducer, which holds the group, goes first; then every rank gets here before any
        # tears gloo down (see leave()).
        del ddp, opt
        leave()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def node_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedDaemon]:
    """One daemon for the node, as in production: every rank of every test's job uses it."""
    daemon = start_daemon(tmp_path_factory.mktemp("node"))
    yield daemon
    stop_daemon(daemon)


@pytest.mark.parametrize(
    "name",
    [
        "soap-native",
        "soap-embedded",
        "soap-daemon",
        "shampoo-native",
        "shampoo-embedded",
        "shampoo-daemon",
    ],
)
def test_ddp_replicas_equal_one_process_with_the_whole_batch(
    tmp_path: Path, name: str, request: pytest.FixtureRequest
) -> None:
    """Gradients are averaged, so every replica's optimizer sees the whole batch's gradient:
    2 ranks x batch b end where 1 rank with batch 2b does (S = 0 for the engine and the daemon,
    whose blocks the replicas share: each is solved on one rank or uploaded by one)."""
    address = request.getfixturevalue("node_daemon").target if name.endswith("daemon") else ""
    _spawn(_ddp_rank, str(tmp_path), name, address)
    single = _model()
    torch.set_num_threads(1)
    opt = _optimizer(single, name, address)
    try:
        _train(single, opt, None)
    finally:
        opt.close()  # type: ignore[attr-defined]
    stats = [torch.load(tmp_path / f"stats{rank}.pt") for rank in range(WORLD)]
    if name.endswith("embedded"):  # each rank solved its own blocks and received the others'
        assert all(s["share"] == "job" and not s["exchange_failed"] for s in stats)
        assert all(s["blocks_owned"] > 0 and s["exchange_results_received"] > 0 for s in stats)
    if name.endswith("daemon"):  # each rank uploaded its own blocks and was sent the others'
        assert all(s["share"] == "node" and s["snapshots_uploaded"] > 0 for s in stats)
        assert all(s["snapshots_left_to_peers"] > 0 for s in stats)
    reference = single.state_dict()
    for rank in range(WORLD):
        replica = torch.load(tmp_path / f"params{rank}.pt")
        for key, value in reference.items():
            torch.testing.assert_close(replica[key], value, rtol=1e-4, atol=1e-5, msg=key)


def _warning_rank(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    _init(rank, tmp)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        seen = {}
        for budget, share in ((0, True), (1, True), (2, True), (0, False), (1, False)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt = SOAP(
                    ddp.module.named_parameters(),
                    mode="embedded",
                    staleness_budget=budget,
                    share_blocks=share,
                    engine_config=EngineConfig(num_workers=1, calibrate=False),
                )
                opt.close()
            seen[budget, share] = [
                str(w.message) for w in caught if "drift apart" in str(w.message)
            ]
        torch.save(seen, f"{tmp}/warnings{rank}.pt")
        del ddp
        leave()
    finally:
        dist.destroy_process_group()


def test_ddp_replicas_are_warned_only_where_nothing_agrees_their_installs(
    tmp_path: Path,
) -> None:
    """Replicas that share their blocks agree on install steps, so they stay identical at any
    budget (test_replicas_agree) and nobody is warned. With ``share_blocks=False`` each rank
    installs a result in the step it arrives there, so with S >= 1 their parameters may drift
    apart: every rank is told so at construction, and how to keep them identical."""
    _spawn(_warning_rank, str(tmp_path))
    for rank in range(WORLD):
        seen = torch.load(tmp_path / f"warnings{rank}.pt")
        assert seen[0, True] == seen[1, True] == seen[2, True] == seen[0, False] == [], seen
        assert len(seen[1, False]) == 1
        assert "staleness_budget=0 to keep replicas identical" in seen[1, False][0]


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({"TORCHELASTIC_RUN_ID": "abc"}, "abc"),
        ({"TORCHELASTIC_RUN_ID": "none"}, ""),  # torchrun's placeholder is no name
        ({"TORCHELASTIC_RUN_ID": "abc", "ASTERIA_JOB": "mine"}, "mine"),
        ({}, ""),
    ],
)
def test_the_job_name_defaults_to_the_launchers_run_id(
    environ: dict[str, str], expected: str
) -> None:
    from asteria_client.config import client_env

    assert client_env(environ).job_name == expected


def _two_node_rank(rank: int, tmp: str) -> None:
    os.environ["ASTERIA_NODE"] = f"node{rank // 2}"  # one host plays two nodes
    init(rank, 4, tmp)
    try:
        torch.save(discover_layout(), f"{tmp}/layout{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_asteria_node_names_the_node_where_host_names_cannot(tmp_path: Path) -> None:
    mp.start_processes(_two_node_rank, args=(str(tmp_path),), nprocs=4, start_method="spawn")
    layouts = [torch.load(tmp_path / f"layout{r}.pt", weights_only=False) for r in range(4)]
    assert [lay.node for lay in layouts] == ["node0", "node0", "node1", "node1"]
    assert layouts[0].ranks_by_node == ((0, 1), (2, 3)) and layouts[0].num_nodes == 2
    assert [lay.is_node_leader for lay in layouts] == [True, False, True, False]


def _group_jobs_rank(rank: int, tmp: str) -> None:
    os.environ["ASTERIA_JOB"] = "mesh-job"
    init(rank, 4, tmp)
    try:
        dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank enters both
        tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = {
            "world": discover_layout(),
            "dp": discover_layout(dp[rank % 2]),
            "tp": discover_layout(tp[rank // 2]),
        }
        torch.save({k: (v.job_id, v.rank, v.world_size) for k, v in mine.items()}, f"{tmp}/j{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_group_smaller_than_the_world_is_a_job_of_its_own(tmp_path: Path) -> None:
    """Under HSDP or DP x TP each data-parallel group names its blocks alike: one job name for
    all of them would make them one namespace on a daemon, where one group's results would be
    installed in another's parameters (see distributed/layout.py)."""
    mp.start_processes(_group_jobs_rank, args=(str(tmp_path),), nprocs=4, start_method="spawn")
    jobs = [torch.load(tmp_path / f"j{r}", weights_only=False) for r in range(4)]
    assert {j["world"][0] for j in jobs} == {"mesh-job"}  # the world keeps the job's name
    dp = [j["dp"] for j in jobs]
    tp = [j["tp"] for j in jobs]
    assert dp[0][0] == dp[2][0] == group_job("mesh-job", [0, 2])  # one name per group
    assert dp[1][0] == dp[3][0] == group_job("mesh-job", [3, 1])
    assert tp[0][0] == tp[1][0] and tp[2][0] == tp[3][0]
    names = {dp[0][0], dp[1][0], tp[0][0], tp[2][0], "mesh-job"}
    assert len(names) == 5, names  # every group another one, {0, 1} and {0, 2} included
    assert all(n.startswith("mesh-job/g") for n in names - {"mesh-job"})
    assert [d[1:] for d in dp] == [(0, 2), (0, 2), (1, 2), (1, 2)]  # ranks within the group
