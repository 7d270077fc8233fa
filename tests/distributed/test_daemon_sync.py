"""Hierarchical sync between node daemons: K real daemons on loopback TCP (tenant tokens), one
per simulated node, and real gloo DDP ranks (``ASTERIA_NODE=node{i}``, ``ASTERIA_ADDRESS`` of
daemon i), SOAP in daemon mode. See tests/distributed/sync_cluster.py."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asteria_client.cli import main
from asteria_client.distributed.layout import group_job
from asteria_server.errors import AsteriaError
from asteria_server.owners import balance, owner_map
from tests.distributed import sync_cluster as sc


def _exactly_once(
    tmp_path: Path, k: int, ranks_per_node: int, capsys: pytest.CaptureFixture[str]
) -> None:
    with sc.daemons(tmp_path, k) as ds:
        spec = sc.RunSpec(
            addresses=[d.address for d in ds],
            node_of_rank=[i for i in range(k) for _ in range(ranks_per_node)],
            steps=20,
            frequency=2,
            budget=1,
        )
        ranks = sc.run_ranks(tmp_path, spec)
        last = spec.steps - 1  # snapshots of each block at steps 1, 3, ..., 19
        deadline = time.monotonic() + 10
        while True:  # the last pushes may still be on their way
            views = [sc.view(d.address) for d in ds]
            newest = [b["version"] for v in views for b in v.group["blocks"]]
            if set(newest) == {last} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        status = ["status", "--address", ds[0].address, "--tenant", sc.TENANT, "--token", sc.TOKEN]
        capsys.readouterr()
        assert main(status) == 0
        table = capsys.readouterr().out
        assert main([*status, "--json"]) == 0
        document = json.loads(capsys.readouterr().out)

    # `asteria status` shows the peers table (text) and every peer and block (--json).
    assert f"peers of job {sc.JOB} (this daemon: node 0; owners agreed" in table
    assert all(d.address in table for d in ds)
    (group,) = document["peer_groups"]
    assert [p["state"] for p in group["peers"]] == ["self"] + ["alive"] * (k - 1)
    assert len(group["blocks"]) == sc.NUM_BLOCKS

    assert all(r["local_fallbacks"] == 0 for r in ranks), [r["local_fallbacks"] for r in ranks]
    groups = [v.group for v in views]
    assert all(g["agreed"] and g["fallbacks"] == 0 for g in groups), [
        (g["agreed"], g["fallback_reasons"], [b["fallbacks"] for b in g["blocks"]]) for g in groups
    ]
    solved = _solved_once(groups, views)
    owners: dict[str, set[int]] = {}
    for g in groups:
        for b in g["blocks"]:
            owners.setdefault(b["block"], set()).add(b["owner"])
            assert b["version"] == last  # every daemon holds the newest result
    assert len(solved) == sc.NUM_BLOCKS
    assert all(len(o) == 1 for o in owners.values()), owners  # every daemon's map is the same
    # Every (block, version) solved exactly once in the whole cluster: no version twice, and
    # each version not solved anywhere was replaced by a newer snapshot before any daemon
    # solved it (latest wins: the first ones while the daemons agree on the blocks, and any
    # that waited in a busy owner's queue); the engines' solve counts add up to exactly that.
    expected = set(range(1, last + 1, spec.frequency))
    for block, versions in solved.items():
        assert set(versions) <= expected and last in versions, versions
        replaced = sum(v.superseded.get(block, 0) for v in views) + sum(
            b["superseded"] for g in groups for b in g["blocks"] if b["block"] == block
        )
        assert len(expected - set(versions)) <= replaced, (block, sorted(versions), replaced)
    # Each block was solved on its owner, except versions another daemon claimed (granted by
    # the owner when its push would have come too late: on a loaded host); the others received
    # its results (the newest of each block when a push goes out).
    taken = {block: 0 for block in solved}
    for g in groups:
        for b in g["blocks"]:
            if b["owner"] != g["node"]:
                assert b["solves"] + len(b["discarded_versions"]) == b["taken_over"], b
                assert b["origin"] == f"node{b['owner']}" or b["taken_over"] > 0, b
                assert 1 <= b["received"] + b["taken_over"] <= len(solved[b["block"]])
                taken[b["block"]] += b["taken_over"]
    for g in groups:
        for b in g["blocks"]:
            if b["owner"] == g["node"]:
                solves = len(solved[b["block"]]) - taken[b["block"]] - len(b["discarded_versions"])
                assert b["solves"] == solves, b
                assert b["handed_over"] == taken[b["block"]], b
    # Balanced owners: estimated CPU-seconds per version, max over mean.
    costs = [p["owned_cost_s"] for p in groups[0]["peers"]]
    assert len(costs) == k and max(costs) / (sum(costs) / k) <= 1.25, costs
    # Both ends of every link count the same pushes and bytes: nothing lost on the way.
    for g in groups:
        for p in g["peers"]:
            if p["state"] != "self":
                assert p["state"] == "alive"
                back = next(q for q in groups[p["node"]]["peers"] if q["node"] == g["node"])
                assert p["results_sent"] == back["results_received"] > 0
                assert p["bytes_sent"] == back["bytes_received"] > 0


def test_two_daemons_solve_each_block_version_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _exactly_once(tmp_path, k=2, ranks_per_node=1, capsys=capsys)


@pytest.mark.slow
def test_three_daemons_solve_each_block_version_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _exactly_once(tmp_path, k=3, ranks_per_node=1, capsys=capsys)


def test_owner_map_is_balanced_and_moves_only_a_dead_nodes_blocks() -> None:
    blocks = {f"j:{i}": n for i, n in enumerate([48, 32, 40, 48, 24, 40, 16, 24, 8, 36])}
    for k in (2, 3, 4):
        owners = owner_map(blocks, range(k), range(k))
        assert set(owners) == set(blocks) and set(owners.values()) <= set(range(k))
        assert balance(blocks, owners, range(k)) <= 1.25
        assert owner_map(dict(reversed(blocks.items())), range(k), range(k)) == owners
    owners = owner_map(blocks, range(3), range(3))
    failed = owner_map(blocks, range(3), [0, 2])
    moved = {b for b in blocks if owners[b] != failed[b]}
    assert moved == {b for b in blocks if owners[b] == 1}  # only node 1's blocks move
    assert set(failed.values()) <= {0, 2}
    assert owner_map(blocks, range(3), range(3)) == owners  # it comes back: they move back
    assert owner_map(blocks, range(3), []) == {}


@pytest.mark.slow
def test_s0_parameters_equal_the_single_daemon_run(tmp_path: Path) -> None:
    """At S = 0 every rank installs every version at its step, so two nodes with a daemon each
    (blocks solved once, on their owners, and pushed) end exactly where one daemon serving both
    ranks ends."""
    with sc.daemons(tmp_path / "one", 1) as ds:
        spec = sc.RunSpec(addresses=[ds[0].address], node_of_rank=[0, 0], budget=0)
        single = sc.run_ranks(tmp_path / "one", spec)
    with sc.daemons(tmp_path / "two", 2) as ds:
        spec = sc.RunSpec(addresses=[d.address for d in ds], node_of_rank=[0, 1], budget=0)
        synced = sc.run_ranks(tmp_path / "two", spec)
        views = [sc.view(d.address) for d in ds]
    assert all(r["local_fallbacks"] == 0 for r in single + synced)
    groups = [v.group for v in views]
    assert all(b["received"] > 0 for g in groups for b in g["blocks"] if b["owner"] != g["node"])
    # Bitwise equal: the owners' results are the very float32 bytes one daemon computes, and
    # every rank installs a tile's results in dim order whichever owner's push came first (the
    # order two owners' results arrive in used to change the rounding of the moments' rotation).
    for name, value in single[0]["params"].items():
        for rank in [*single, *synced]:
            assert torch.equal(torch.tensor(rank["params"][name]), torch.tensor(value)), (
                name,
                (torch.tensor(rank["params"][name]) - torch.tensor(value)).abs().max(),
            )


def _versions(group: dict[str, Any]) -> dict[str, int]:
    return {b["block"]: b["version"] for b in group["blocks"]}


def _owners(group: dict[str, Any]) -> dict[str, int]:
    return {b["block"]: b["owner"] for b in group["blocks"]}


def _peer(group: dict[str, Any], node: int) -> dict[str, Any]:
    (found,) = [p for p in group["peers"] if p["node"] == node]
    return found


def _at_step(tmp: Path) -> int:
    try:
        return int((tmp / "at_step").read_text())
    except (FileNotFoundError, ValueError):
        return -1


#: Short failure detection for the fault tests (the defaults are 2 s suspect, 5 s dead).
FAST = sc.sync_env(heartbeat_s=0.1, suspect_s=0.6, dead_s=1.5, patience_s=1.0)


@pytest.mark.slow
def test_kill_one_daemon_mid_run_fails_over_and_a_restart_rejoins(tmp_path: Path) -> None:
    """Three nodes; daemon 1 is killed with SIGKILL at step 15 and restarted on its port 3 s
    later. Every rank finishes (node 1's rank computes locally while its daemon is gone);
    daemons 0 and 2 declare node 1 dead and own all its blocks, and once the restarted daemon
    (a new incarnation) is back its blocks move back to it; no daemon's versions go back."""
    with sc.daemons(tmp_path, 3, env=FAST) as ds:
        port = int(ds[1].address.rsplit(":", 1)[1])
        first_incarnation = ds[1].serving_line.split("incarnation=")[1].split()[0]
        spec = sc.RunSpec(
            addresses=[d.address for d in ds],
            node_of_rank=[0, 1, 2],
            steps=240,
            step_sleep_s=0.05,
            barrier_timeout_s=3.0,
        )
        seen: dict[str, Any] = {"phase": "before", "versions": []}

        def during() -> None:
            now = time.monotonic()
            if seen["phase"] == "restarted" or now < seen.get("next_look", 0.0):
                return
            seen["next_look"] = now + 0.3
            try:
                views = [sc.view(ds[i].address) for i in (0, 2)]
            except AsteriaError:  # a survivor slow to answer on a loaded host: look again
                seen["missed_looks"] = seen.get("missed_looks", 0) + 1
                return
            if not all(v.groups for v in views):
                return  # the job is not registered yet
            survivors = [v.group for v in views]
            seen["versions"].append([_versions(g) for g in survivors])
            if seen["phase"] == "before" and _at_step(tmp_path) >= 15:
                seen["owners_before"] = _owners(survivors[0])
                ds[1].process.kill()  # SIGKILL
                ds[1].process.wait()
                seen["phase"], seen["killed_at"] = "killed", now
            elif seen["phase"] == "killed" and now - seen["killed_at"] > 3.0:
                seen["dead"] = survivors
                ds[1].stop()  # reaps it (already dead) and removes its files
                ds[1] = sc.daemon(tmp_path, 1, port=port, env=FAST).start()
                seen["phase"] = "restarted"

        sc.join(sc.start_ranks(tmp_path, spec), 150, during)
        assert seen["phase"] == "restarted", seen["phase"]
        # The restarted daemon rejoins: its rank registered the job again.
        deadline = time.monotonic() + 10
        while True:
            final = [sc.view(ds[i].address).group for i in range(3)]
            back = _peer(final[0], 1)
            if (back["state"] == "alive" and final[0]["agreed"]) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]

    assert ranks[1]["local_fallbacks"] > 0  # node 1's rank computed while its daemon was gone
    # While it was dead: both survivors say so, and own every block between them.
    for group in seen["dead"]:
        assert _peer(group, 1)["state"] == "dead" and _peer(group, 1)["died"] >= 1
        assert group["agreed"] and set(_owners(group).values()) <= {0, 2}, _owners(group)
    moved = {b for b, o in seen["owners_before"].items() if o == 1}
    assert moved and all(
        _owners(seen["dead"][0])[b] == seen["owners_before"][b]
        for b in seen["owners_before"]
        if b not in moved
    )  # only its blocks
    # Back: a new incarnation, rejoined, and the owners are those before the kill again.
    assert back["state"] == "alive" and back["incarnation_id"] != first_incarnation
    assert back["rejoined"] >= 1
    assert _owners(final[0]) == seen["owners_before"]
    # Versions never went back on the survivors.
    for i in range(2):
        history = [sample[i] for sample in seen["versions"]] + [_versions(final[2 * i])]
        for older, newer in itertools.pairwise(history):
            assert all(newer.get(b, -1) >= v for b, v in older.items()), (older, newer)


@pytest.mark.slow
def test_a_sigstopped_daemon_does_not_stall_the_others_and_rejoins(tmp_path: Path) -> None:
    """Two nodes whose ranks train the same batches without DDP. Daemon 1 is SIGSTOPped for
    10 s: daemon 0 keeps answering, suspects then buries it and takes its blocks; the ranks keep
    training within the staleness budget. They are replicas of one another (the same blocks in
    one process group), so they install at agreed steps: at a deadline that rank 1 cannot meet
    (its daemon is stopped) both wait out the barrier and compute that block locally together,
    and they end bitwise equal. (Before install steps were agreed, rank 0 trained on at its own
    pace while its replica drifted.) After SIGCONT daemon 1 is heard again."""
    with sc.daemons(tmp_path, 2, env=FAST) as ds:
        spec = sc.RunSpec(
            addresses=[d.address for d in ds],
            node_of_rank=[0, 1],
            steps=400,
            step_sleep_s=0.02,
            barrier_timeout_s=2.0,
            ddp=False,
        )
        seen: dict[str, Any] = {"phase": "before", "status_s": 0.0}

        def during() -> None:
            now = time.monotonic()
            step = _at_step(tmp_path)
            if seen["phase"] == "before" and step >= 15:
                os.kill(ds[1].pid, signal.SIGSTOP)
                seen.update(phase="stopped", stopped_at=now, step_at_stop=step)
            elif seen["phase"] == "stopped":
                started = time.monotonic()
                group = sc.view(ds[0].address).group
                seen["status_s"] = max(seen["status_s"], time.monotonic() - started)
                if now - seen["stopped_at"] >= 10.0:
                    seen.update(during=group, step_at_cont=_at_step(tmp_path), phase="continued")
                    os.kill(ds[1].pid, signal.SIGCONT)

        try:
            sc.join(sc.start_ranks(tmp_path, spec), 150, during)
        finally:
            if seen["phase"] == "stopped":
                os.kill(ds[1].pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while True:
            final = sc.view(ds[0].address).group
            if _peer(final, 1)["state"] == "alive" or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    assert seen["phase"] == "continued"
    # The ranks trained on while daemon 1 was stopped (a deadline costs at most the barrier's
    # 2 s, one every f = 2 steps), within their budget (S = 1, f = 2), as replicas: equal, and
    # every block computed locally was computed by both at the same step.
    assert seen["step_at_cont"] - seen["step_at_stop"] >= 2, seen
    for rank in ranks:
        assert rank["max_lag_steps"] <= spec.budget * spec.frequency
    assert ranks[0]["local_fallbacks"] == ranks[1]["local_fallbacks"]
    assert ranks[0]["params"] == ranks[1]["params"]
    assert seen["status_s"] < 2.0  # daemon 0's Status answered promptly throughout
    during_group = seen["during"]
    assert _peer(during_group, 1)["state"] == "dead" and during_group["agreed"]
    assert set(_owners(during_group).values()) == {0}  # all of node 1's blocks moved to node 0
    # SIGCONT: the same incarnation is heard again, rejoins, and owns its blocks again.
    back = _peer(final, 1)
    assert back["state"] == "alive" and back["rejoined"] >= 1
    assert set(_owners(final).values()) == {0, 1}


def _solved_once(groups: list[dict[str, Any]], views: list[sc.DaemonView]) -> dict[str, list[int]]:
    """Every (block, version) solved once in the whole cluster: the versions each daemon solved,
    its results kept or thrown away (a newer or equal one was in already: overtaken by a later
    version's push while it ran, or solved a second time), hold no version twice and add up to
    the engines' solve counts."""
    solved: dict[str, list[int]] = {}
    for g in groups:
        for b in g["blocks"]:
            solved.setdefault(b["block"], []).extend(b["solved_versions"] + b["discarded_versions"])
    for block, versions in solved.items():
        assert len(versions) == len(set(versions)), (block, sorted(versions))
    assert sum(v.solves_done for v in views) == sum(len(vs) for vs in solved.values())
    return solved


@pytest.mark.slow
def test_a_slowed_owner_hands_late_versions_over_and_nothing_is_solved_twice(
    tmp_path: Path,
) -> None:
    """Two nodes whose ranks train the same batches without DDP (S = 1, f = 2). Daemon 1's
    solver workers are SIGSTOPped 6 s of every 6.5 s (a host too loaded to run them) while the
    daemon itself answers at once: longer than a late push waits before its claim (the job's
    pace, slowed by those stalls, sets that wait; with 3 s stops the pushes often came first and
    nothing was claimed). Daemon 0, whose rank needs daemon 1's blocks, claims each
    version whose push is late; daemon 1 hands over those it has not started (out of its queue,
    or not arrived yet) and refuses the one its stopped worker holds. Every (block, version)
    is still solved exactly once across both daemons, with no local fallback, no rank past its
    budget, and every claim granted on one side counted as handed over on the other."""
    with sc.daemons(tmp_path, 2) as ds:
        spec = sc.RunSpec(
            addresses=[d.address for d in ds],
            node_of_rank=[0, 1],
            steps=24,
            frequency=2,
            budget=1,
            ddp=False,
        )
        throttle = sc.Throttle(ds[1].pid, stop_s=6.0, run_s=0.5)
        ctx = sc.start_ranks(tmp_path, spec)
        throttle.start()
        try:
            sc.join(ctx, 200)
        finally:
            throttle.stop()
        last = spec.steps - 1
        deadline = time.monotonic() + 10
        while True:  # the last pushes may still be on their way
            views = [sc.view(d.address) for d in ds]
            newest = [b["version"] for v in views for b in v.group["blocks"]]
            if set(newest) == {last} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    assert throttle.cycles >= 2
    groups = [v.group for v in views]
    assert all(g["fallbacks"] == 0 for g in groups), [g["fallback_reasons"] for g in groups]
    assert all(r["local_fallbacks"] == 0 for r in ranks), [r["local_fallbacks"] for r in ranks]
    assert all(r["max_lag_steps"] <= spec.budget * spec.frequency for r in ranks), ranks
    solved = _solved_once(groups, views)
    # Daemon 0 took versions of daemon 1's blocks over, each granted by daemon 1.
    assert groups[0]["claims_granted"] > 0, groups[0]
    assert groups[0]["claims_granted"] == groups[1]["claims_handed_over"]
    taken = {b["block"]: b["taken_over"] for b in groups[0]["blocks"] if b["owner"] == 1}
    handed = {b["block"]: b["handed_over"] for b in groups[1]["blocks"] if b["owner"] == 1}
    assert sum(taken.values()) == groups[0]["claims_granted"] and taken == handed
    for g in groups:
        for b in g["blocks"]:
            if b["owner"] != g["node"]:  # a non-owner solved only what it won
                assert b["solves"] + len(b["discarded_versions"]) == b["taken_over"], b
            assert b["version"] == last
    # A version solved nowhere was replaced by a newer snapshot first (latest wins): in a
    # daemon's queue or a client's segment, while it waited for a push, or in a rank's sender
    # before it went out (while the slowed daemon's rank waits at its barrier, its sender does).
    expected = set(range(1, last + 1, spec.frequency))
    missing = replaced = 0
    for block, versions in solved.items():
        assert set(versions) <= expected and last in versions, (block, versions)
        missing += len(expected - set(versions))
        replaced += sum(v.superseded.get(block, 0) for v in views) + sum(
            b["superseded"] for g in groups for b in g["blocks"] if b["block"] == block
        )
    replaced += sum(r["source"]["submits_replaced"] for r in ranks)
    assert missing <= replaced, (missing, replaced)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("budget", [1, 2])
def test_ddp_replicas_on_two_synced_daemons_stay_identical_through_a_sigstop(
    tmp_path: Path, budget: int
) -> None:
    """Two nodes of two DDP ranks each, one daemon per node synced with the other; daemon 1 is
    SIGSTOPped for 5 s mid-run. The four replicas install every result at one agreed step
    (DESIGN.md "Replicas agree"), so they end bitwise identical: results from either daemon,
    and the blocks computed locally while node 1's daemon was stopped (all four ranks compute
    them together). No rank goes past its budget, and no block version is solved twice in the
    cluster (see the end)."""
    with sc.daemons(tmp_path, 2, env=FAST) as ds:
        spec = sc.RunSpec(
            addresses=[d.address for d in ds],
            node_of_rank=[0, 0, 1, 1],
            steps=80,
            frequency=2,
            budget=budget,
            step_sleep_s=0.05,
            barrier_timeout_s=2.0,
        )
        seen: dict[str, Any] = {"phase": "before"}

        def during() -> None:
            step = _at_step(tmp_path)
            if seen["phase"] == "before" and step >= 10:
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
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]

    assert seen["phase"] == "continued", seen
    for rank in ranks[1:]:
        for key, value in ranks[0]["params"].items():
            assert rank["params"][key] == value, key  # exact: float32 values through JSON
    assert all(r["max_lag_steps"] <= budget * spec.frequency for r in ranks)
    # Every (block, version) solved once in the cluster (a solve run on a worker of either
    # daemon, its result kept or not), the versions the stopped daemon had queued or on its
    # worker included: the survivor does not solve those again when the block moves to it
    # (its old owner is waited for until takeover_grace_s after it is declared dead), and the
    # daemon that was stopped does not take its own silence for its peers' deaths.
    solved: dict[str, list[int]] = {}
    for v in views:
        for b in v.group["blocks"]:
            solved.setdefault(b["block"], []).extend(b["solved_versions"] + b["discarded_versions"])
    twice = {b: sorted(vs) for b, vs in solved.items() if len(vs) != len(set(vs))}
    assert not twice, twice
    assert sum(v.solves_done for v in views) == sum(len(vs) for vs in solved.values())


def _hsdp_rank(
    rank: int, world: int, tmp: str, addresses: list[str], budget: int, refresh: str
) -> None:
    """One rank of HSDP 2 x 2 on two simulated nodes: ranks 0, 1 on node 0 and 2, 3 on node 1;
    the shard dim within a node, the replicas of a shard (ranks 0 and 2, 1 and 3) on the two
    nodes, each node's ranks on that node's daemon."""
    from torch.distributed.device_mesh import init_device_mesh

    from asteria_client import SOAP
    from tests.distributed import spawn as ranks

    node = rank // 2
    sc.enter_node(node)
    ranks.init(rank, world, tmp)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        net = ranks.shard(ranks.model(), mesh=mesh)
        opt = SOAP(
            net.named_parameters(),
            lr=1e-2,
            mode="daemon",
            address=addresses[node],
            staleness_budget=budget,
            precondition_frequency=2 if refresh == "amortized" else 5,
            refresh=refresh,
            refresh_overhead=0.5,
        )
        if refresh == "continuous":
            opt.attach(net)
        try:
            ranks.train(net, opt, ranks.batches(30, world * 8), rank, world)
            time.sleep(1.0)  # the last snapshots reach the daemon
            stats = opt.runtime_stats()
        finally:
            opt.close()
        local = {k: v.to_local().detach().tolist() for k, v in net.state_dict().items()}
        blocks = stats["refreshes"]["blocks"]
        pulls = {b: r.get("extra_pulls", 0) for b, r in blocks.items()}
        out = {"params": local, "max_lag_steps": stats["max_lag_steps"], "extra_pulls": pulls}
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(out))
        del net, opt
    finally:
        ranks.finish()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("refresh", "budget"), [("amortized", 1), ("continuous", 1), ("continuous", 2)]
)
def test_hsdp_shard_replicas_on_two_synced_daemons_share_each_shard_block(
    tmp_path: Path, refresh: str, budget: int
) -> None:
    """HSDP 2 x 2 across two simulated nodes, one daemon each, synced: a shard's blocks
    (names with ``@``) are held on both nodes, by the shard's two replicas. Each (block,
    version) is solved on one daemon only, each daemon solves some and receives the others
    by push, and the replicas of a shard end bitwise equal. Before shard blocks were synced,
    each daemon solved every shard block itself (duplicates of every version).

    Each shard's replica group is a job of its own on the daemons (``distributed/layout.py``:
    both groups' leaders registered one job's layout, each with its own run nonce, over the
    other's). On the continuous schedule each shard block's chooser is its uploader on the
    node of its owner daemon among that job's daemons, as for DDP; before, HSDP across nodes
    was refused there."""
    from tests.distributed.spawn import spawn

    with sc.daemons(tmp_path, 2) as ds:
        spawn(_hsdp_rank, 4, str(tmp_path), [d.address for d in ds], budget, refresh)
        time.sleep(1.0)  # the last pushes
        views = [sc.view(d.address) for d in ds]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    frequency = 2 if refresh == "amortized" else 5
    for a, b in ((0, 2), (1, 3)):
        assert ranks[a]["params"] == ranks[b]["params"], (a, b)
        assert ranks[a]["extra_pulls"] == ranks[b]["extra_pulls"], (a, b)
    assert all(r["max_lag_steps"] <= budget * frequency for r in ranks)
    if refresh == "continuous":  # extras were pulled, on both shards
        assert all(sum(r["extra_pulls"].values()) > 0 for r in ranks), ranks[0]["extra_pulls"]
    jobs = {group_job(sc.JOB, [0, 2]), group_job(sc.JOB, [1, 3])}
    solved: dict[tuple[str, str], list[int]] = {}
    for v in views:
        assert {g["job"] for g in v.groups} == jobs, [g["job"] for g in v.groups]
        for g in v.groups:
            for blk in g["blocks"]:
                versions = blk["solved_versions"] + blk["discarded_versions"]
                solved.setdefault((g["job"], blk["block"]), []).extend(versions)
    assert all("@" in blk for _, blk in solved), sorted(solved)
    twice = {key: sorted(vs) for key, vs in solved.items() if len(vs) != len(set(vs))}
    assert not twice, twice
    # every solve the daemons ran is one of those (none of a block outside the sync)
    assert sum(v.solves_done for v in views) == sum(len(vs) for vs in solved.values())
    for v in views:  # each daemon solved some shard blocks and received others
        mine = [blk for g in v.groups for blk in g["blocks"]]
        assert any(blk["solves"] > 0 for blk in mine), mine
        assert any(blk["received"] > 0 for blk in mine), mine
