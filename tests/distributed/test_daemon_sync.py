"""Hierarchical sync between node daemons: K real daemons on loopback TCP (tenant tokens), one
per simulated node, and real gloo DDP ranks (``ASTERIA_NODE=node{i}``, ``ASTERIA_ADDRESS`` of
daemon i), SOAP in daemon mode. See tests/distributed/sync_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from asteria_server.sync.owners import balance, owner_map
from tests.distributed import sync_cluster as sc


def _exactly_once(tmp_path: Path, k: int, ranks_per_node: int) -> None:
    with sc.daemons(tmp_path, k) as ds:
        spec = sc.RunSpec(
            addresses=[d.address for d in ds],
            node_of_rank=[i for i in range(k) for _ in range(ranks_per_node)],
            steps=20,
            frequency=2,
            budget=1,
        )
        ranks = sc.run_ranks(tmp_path, spec)
        views = [sc.view(d.address) for d in ds]

    last = spec.steps - 1  # snapshots of each block at steps 1, 3, ..., 19
    assert all(r["local_fallbacks"] == 0 for r in ranks), [r["local_fallbacks"] for r in ranks]
    groups = [v.group for v in views]
    assert all(g["agreed"] and g["fallbacks"] == 0 for g in groups)
    solved: dict[str, list[int]] = {}
    owners: dict[str, set[int]] = {}
    for g in groups:
        for b in g["blocks"]:
            solved.setdefault(b["block"], []).extend(b["solved_versions"])
            owners.setdefault(b["block"], set()).add(b["owner"])
            assert b["version"] == last  # every daemon holds the newest result
    assert len(solved) == sc.NUM_BLOCKS
    assert all(len(o) == 1 for o in owners.values()), owners  # every daemon's map is the same
    # Every (block, version) solved exactly once in the whole cluster: no version twice, and
    # from its first solve on (the first snapshots wait while the daemons agree on the blocks,
    # and a newer one replaces them) every version of every block; the engines' solve counts
    # add up to exactly that.
    for block, versions in solved.items():
        assert len(versions) == len(set(versions)), (block, sorted(versions))
        assert set(versions) == set(range(min(versions), last + 1, spec.frequency)), versions
        assert min(versions) <= 2 * spec.frequency, versions
    assert sum(v.solves_done for v in views) == sum(len(vs) for vs in solved.values())
    # Each block was solved on its owner only; the others received each version from it.
    for g in groups:
        for b in g["blocks"]:
            if b["owner"] == g["node"]:
                assert b["origin"] == "local" and b["solves"] == len(solved[b["block"]])
            else:
                assert b["solves"] == 0 and b["origin"] == f"node{b['owner']}"
                assert b["received"] == len(solved[b["block"]])
    # Balanced owners: estimated CPU-seconds per version, max over mean.
    costs = [p["owned_cost_s"] for p in groups[0]["peers"]]
    assert len(costs) == k and max(costs) / (sum(costs) / k) <= 1.25, costs
    # Every daemon pushed each of its results once to every other daemon.
    for g in groups:
        for p in g["peers"]:
            if p["state"] != "self":
                assert p["state"] == "alive"
                mine = [b for b in g["blocks"] if b["owner"] == g["node"]]
                theirs = [b for b in g["blocks"] if b["owner"] == p["node"]]
                assert p["results_sent"] == sum(len(solved[b["block"]]) for b in mine)
                assert p["results_received"] == sum(len(solved[b["block"]]) for b in theirs)


def test_two_daemons_solve_each_block_version_once(tmp_path: Path) -> None:
    _exactly_once(tmp_path, k=2, ranks_per_node=1)


@pytest.mark.slow
def test_three_daemons_solve_each_block_version_once(tmp_path: Path) -> None:
    _exactly_once(tmp_path, k=3, ranks_per_node=1)


def test_owner_map_is_balanced_and_moves_only_a_dead_nodes_blocks() -> None:
    blocks = {f"j:{i}": n for i, n in enumerate([48, 32, 40, 48, 24, 40, 16, 24, 8, 64])}
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
