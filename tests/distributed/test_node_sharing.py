"""One daemon serving four DDP ranks of one job: each (block, version) is uploaded by one rank
and solved once, the uploads are spread over the ranks, and the job's layout is registered.

Real parts: a real ``asteria-server`` process, four spawned gloo ranks, DDP, shared memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asteria_client import SOAP
from asteria_client.cli import main
from asteria_client.status import StatusReader
from tests.distributed.spawn import init, leave
from tests.integration.test_daemon import start_daemon, stop_daemon

WORLD = 4
STEPS = 8
FREQ = 2
JOB = "four-ranks"


def _model() -> torch.nn.Module:
    """Blocks of mixed sizes (24, 16, 8), so owners are chosen by cost."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 16), torch.nn.Linear(16, 8)
    )


def _rank(rank: int, tmp: str, address: str) -> None:
    init(rank, WORLD, tmp)
    try:
        model = _model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        g = torch.Generator().manual_seed(1 + rank)
        opt = SOAP(
            model.named_parameters(),
            lr=1e-2,
            mode="daemon",
            address=address,
            staleness_budget=0,  # every version is waited for, so every version is solved
            precondition_frequency=FREQ,
        )
        try:
            for _ in range(STEPS):
                x = torch.randn(32, 16, generator=g)
                opt.zero_grad()
                ddp(x).square().mean().backward()
                opt.step()
            stats: dict[str, Any] = opt.runtime_stats()["source"]
            stats["local_fallbacks"] = opt.runtime_stats()["local_fallbacks"]
        finally:
            opt.close()
        (Path(tmp) / f"stats{rank}.json").write_text(json.dumps(stats))
        del ddp, opt
        leave()
    finally:
        dist.destroy_process_group()


def test_four_ranks_upload_and_solve_each_block_version_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", JOB)  # what torchrun sets: the job's id
    daemon = start_daemon(tmp_path, name="node")
    try:
        mp.start_processes(
            _rank, args=(str(tmp_path), daemon.target), nprocs=WORLD, start_method="spawn"
        )
        stats = [json.loads((tmp_path / f"stats{r}.json").read_text()) for r in range(WORLD)]
        reader = StatusReader(daemon.target, "", "")
        try:
            engine, blocks, transport = reader.read()
            jobs = reader.jobs()
        finally:
            reader.close()
        assert main(["status", "--address", daemon.target]) == 0
        table = capsys.readouterr().out
    finally:
        stop_daemon(daemon)

    # Every rank snapshots every block at every refresh; one of them uploads it.
    submitted = [s["snapshots_uploaded"] + s["snapshots_left_to_peers"] for s in stats]
    assert len(set(submitted)) == 1 and submitted[0] > 0
    versions = submitted[0]  # (block, version) pairs of the job
    uploaded = [s["snapshots_uploaded"] for s in stats]
    sent = [s["shm_snapshots"] + s["chunked_snapshots"] for s in stats]
    assert sum(uploaded) == versions and sent == uploaded  # one upload per block version
    assert all(u > 0 for u in uploaded), uploaded  # spread over the local ranks
    assert max(uploaded) <= 2 * min(uploaded), uploaded
    assert all(s["local_fallbacks"] == 0 for s in stats)

    # The daemon solved each block version once, and was never sent one twice.
    ours = [b for b in blocks if b.block.startswith(f"{JOB}:")]
    assert engine.solves_done == versions
    assert transport is not None and transport.snapshots_received == versions
    one_copy = {s["snapshot_bytes_uploaded"] + s["snapshot_bytes_left_to_peers"] for s in stats}
    assert len(one_copy) == 1  # every rank held the same snapshots
    assert transport.snapshot_bytes_received == one_copy.pop()  # and the daemon got them once
    assert sum(s["snapshot_bytes_uploaded"] for s in stats) == transport.snapshot_bytes_received
    assert sum(b.duplicates + b.stale_ignored + b.superseded for b in ours) == 0
    assert sum(1 for b in ours) * (STEPS // FREQ) == versions

    # The node leader registered the job: one node, four ranks.
    (job,) = [j for j in jobs if j.job == JOB]
    assert job.world_size == WORLD and len(job.nodes) == 1 and job.nodes[0].ranks == (0, 1, 2, 3)
    assert job.nodes[0].daemon_address == daemon.target and job.nodes[0].daemon_incarnation
    assert f"job {JOB}: 4 ranks on 1 node(s)" in table
