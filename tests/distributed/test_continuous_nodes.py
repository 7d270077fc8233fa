"""Continuous refresh across nodes (issue 26, item 4): two simulated nodes of two DDP ranks
each (gloo), one daemon per node synced with the other, SOAP with ``refresh="continuous"``
attached to the model, S = 1 and 2, with and without node 1's daemon SIGSTOPped for 5 s.

Each replicated block has one chooser in the whole job: the rank that uploads it on the node
whose daemon owns it (``asteria_client.distributed.replicas.PullChoosers``), so its credit is
that of the daemon that solves the block. The other three ranks follow its versions through
the step-start agreement round; the other node's daemon gets the result by the owner's push.
Before, the optimizer refused this at construction ("refresh='continuous' with daemons on
several nodes is not supported yet"), so every rank of these tests failed there.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import sync_cluster as sc

FAST = sc.sync_env(heartbeat_s=0.1, suspect_s=0.6, dead_s=1.5, patience_s=1.0)
FREQUENCY = 5  # floors every 5 steps: room for extra pulls between them
STEPS = 30


def _at_step(tmp: Path) -> int:
    try:
        return int((tmp / "at_step").read_text())
    except (FileNotFoundError, ValueError):
        return -1


def _run(
    tmp_path: Path, budget: int, sigstop: bool, node_of_rank: tuple[int, ...] = (0, 0, 1, 1)
) -> tuple[sc.RunSpec, list[dict[str, Any]]]:
    """The ranks' results; with ``sigstop`` node 1's daemon is stopped for 5 s from step 8 on
    (the ranks sleep 0.2 s a step, so the run outlasts the stop)."""
    with sc.daemons(tmp_path, 2, env=FAST) as ds:
        spec = sc.RunSpec(
            addresses=[d.address for d in ds],
            node_of_rank=list(node_of_rank),
            steps=STEPS,
            frequency=FREQUENCY,
            budget=budget,
            step_sleep_s=0.2 if sigstop else 0.02,
            barrier_timeout_s=2.0,
            refresh="continuous",
        )
        seen: dict[str, Any] = {"phase": "before"}

        def during() -> None:
            if not sigstop:
                return
            step = _at_step(tmp_path)
            if seen["phase"] == "before" and step >= 8:
                os.kill(ds[1].pid, signal.SIGSTOP)
                seen.update(phase="stopped", stopped_at=time.monotonic(), step_at_stop=step)
            elif seen["phase"] == "stopped" and time.monotonic() - seen["stopped_at"] >= 5.0:
                os.kill(ds[1].pid, signal.SIGCONT)
                seen.update(phase="continued", step_at_cont=step)

        try:
            sc.join(sc.start_ranks(tmp_path, spec), 240, during)
        finally:
            if seen["phase"] == "stopped":
                os.kill(ds[1].pid, signal.SIGCONT)
        time.sleep(1.0)  # the last pushes
        views = [sc.view(d.address) for d in ds]
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(spec.world)]
    if sigstop:
        assert seen["phase"] == "continued", seen
    # Nothing solved twice in the cluster: a quiet owner's versions are held for it, not
    # solved by the survivor, and a claim sees what its owner already computed (sync/manager).
    solved: dict[str, list[int]] = {}
    for v in views:
        for b in v.group["blocks"]:
            solved.setdefault(b["block"], []).extend(b["solved_versions"] + b["discarded_versions"])
    twice = {b: sorted(vs) for b, vs in solved.items() if len(vs) != len(set(vs))}
    print(f"sigstop: {seen}; solves per daemon {[v.solves_done for v in views]}; twice {twice}")
    assert not twice, f"(block, version)s solved on both daemons: {twice}"
    # every solve the daemons ran is one of those: each is counted with its version (sync/group.py
    # local_result), so none can hide a duplicate
    assert sum(v.solves_done for v in views) == sum(len(vs) for vs in solved.values())
    # Versions solved that no rank registered, a cost in solves (1-6 per block here, with one
    # chooser per block or, tried, two; where they come from is not established: perhaps
    # extra pulls overtaken by a newer snapshot before the round reported them).
    prefix = f"{sc.JOB}:"
    unused = {
        b.removeprefix(prefix): len(set(vs)) - sum(ranks[0]["pulls"][b.removeprefix(prefix)])
        for b, vs in solved.items()
    }
    print(f"versions solved, less those registered, per block: {unused}")
    return spec, ranks


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sigstop", [False, True], ids=["steady", "sigstop"])
@pytest.mark.parametrize("budget", [1, 2])
def test_continuous_ddp_replicas_on_two_synced_daemons_stay_identical(
    tmp_path: Path, budget: int, sigstop: bool
) -> None:
    spec, ranks = _run(tmp_path, budget, sigstop)
    for r, rank in enumerate(ranks[1:], start=1):
        for key, value in ranks[0]["params"].items():
            assert rank["params"][key] == value, (r, key)  # exact: float32 values through JSON
    # every rank registered the same pulls: the choosers' extras and the floors alike ...
    pulls = [rank["pulls"] for rank in ranks]
    assert all(p == pulls[0] for p in pulls), pulls
    # ... the schedule did take extra pulls, on more than one block ...
    extra = [b for b, (_, e) in pulls[0].items() if e > 0]
    assert len(extra) >= 2, pulls[0]
    for rank in ranks:
        assert rank["agreement"]["agreement_failed"] == "", rank["agreement"]
        assert rank["agreement"]["agreement_pulls"] > 0, rank["agreement"]
        # ... and no rank went past its budget
        assert rank["max_lag_steps"] <= budget * spec.frequency, rank["max_lag_steps"]
    uploaded = [rank["source"]["snapshots_uploaded"] for rank in ranks]
    print(
        f"S={budget} sigstop={sigstop}: pulls (floor, extra) {pulls[0]}; uploaded {uploaded}; "
        f"local fallbacks {[r['local_fallbacks'] for r in ranks]}; max lag "
        f"{[r['max_lag_steps'] for r in ranks]}; agreement {ranks[0]['agreement']}"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_continuous_ddp_replicas_one_rank_per_node_stay_identical(tmp_path: Path) -> None:
    """A node of one rank has no node share source of its own on the amortized schedule; on
    the continuous one it gets one, so that it follows the job's choosers too."""
    spec, ranks = _run(tmp_path, 1, False, node_of_rank=(0, 1))
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["pulls"] == ranks[1]["pulls"]
    assert sum(e for _, e in ranks[0]["pulls"].values()) > 0, ranks[0]["pulls"]
    assert all(r["max_lag_steps"] <= spec.frequency for r in ranks)
