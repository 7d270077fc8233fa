"""One owner rule for the client's replicas and the daemons (``asteria_server.owners``)."""

from __future__ import annotations

from types import SimpleNamespace

from asteria_client.distributed import BlockOwners, JobLayout, PullChoosers
from asteria_client.distributed.replicas import _members, _shared
from asteria_server.owners import SHARD_MARK, balance, is_shard_block, owner_map


def _blocks() -> dict[str, int]:
    sizes = [512, 64, 64, 256, 1024, 32, 128, 128, 512, 16, 768, 64]
    return {f"layer{i}.weight/tile0/dim{i % 2}": n for i, n in enumerate(sizes)}


def test_replicas_assign_owners_by_the_daemons_rule() -> None:
    blocks = _blocks()
    owners = BlockOwners([0, 1, 2])
    owners.plan({**blocks, f"fc.weight{SHARD_MARK}rows0:12/tile0/dim0": 12})
    mapped = {block: owners.owner(block, n) for block, n in blocks.items()}
    assert mapped == owner_map(blocks, [0, 1, 2], [0, 1, 2])
    # a shard's block is never shared, so it is never planned (it has no owner among ranks)
    assert all(not is_shard_block(block) for block in owners._owner)


def test_the_old_greedy_rule_was_less_balanced_than_the_shared_one() -> None:
    """The client used to give each block, as first seen, to the least loaded rank: on blocks
    seen small first that is far from the LPT map the daemons use (which a later param group's
    blocks still join greedily)."""
    blocks = dict(sorted(_blocks().items(), key=lambda item: item[1]))
    greedy = BlockOwners([0, 1])
    seen = {block: greedy.owner(block, n) for block, n in blocks.items()}
    planned = BlockOwners([0, 1])
    planned.plan(blocks)
    shared = {block: planned.owner(block, n) for block, n in blocks.items()}
    assert balance(blocks, shared, [0, 1]) < balance(blocks, seen, [0, 1])
    late = planned.owner("late.weight/tile0/dim0", 8)  # not planned: the least loaded rank
    assert late in (0, 1)


def test_a_block_some_members_use_is_owned_by_one_of_them() -> None:
    """HSDP across nodes: a shard's blocks are used by the nodes that hold a replica of it.
    Each goes to one of its users, by the same LPT rule; a block every node uses is placed as
    without ``users``; a block whose users are all dead has no owner, and a dead user's blocks
    move to a living user only."""
    shared = _blocks()
    shards = {
        f"fc.weight{SHARD_MARK}rows{s}:4/tile0/dim{i}": n
        for s in (0, 1)
        for i, n in enumerate((256, 96, 48))
    }
    users = {**{b: [0, 1, 2, 3] for b in shared}}
    users.update({b: [0, 2] if "rows0" in b else [1, 3] for b in shards})
    blocks = {**shared, **shards}
    owners = owner_map(blocks, range(4), range(4), users=users)
    assert set(owners) == set(blocks)
    assert all(owners[b] in users[b] for b in blocks)
    assert owner_map(shared, range(4), range(4), users={b: range(4) for b in shared}) == (
        owner_map(shared, range(4), range(4))
    )
    # node 2 dead: the rows0 blocks it owned go to node 0, its only other user
    after = owner_map(blocks, range(4), [0, 1, 3], users=users)
    assert all(after[b] == 0 for b in shards if "rows0" in b)
    assert all(after[b] == owners[b] for b in blocks if owners[b] != 2)
    # both users of rows1 dead: those blocks have no owner
    gone = owner_map(blocks, range(4), [0, 2], users=users)
    assert not any("rows1" in b for b in gone)
    assert all(gone[b] in (0, 2) for b in gone)


# --------------------------------------------------------------------------- pull choosers


def _choosers(hosts: list[str], members: list[int]) -> list[PullChoosers]:
    """Every rank's PullChoosers of one job (its local uploaders planned by itself first, as
    the node's share source plans them), over :func:`_blocks` and a shard's block."""
    out = []
    for rank in range(len(hosts)):
        layout = JobLayout.from_hosts(hosts, rank, "job")
        local = BlockOwners(layout.local_ranks)
        local.plan(_blocks())
        choosers = PullChoosers(layout, members, "job", _shared, local=local)
        choosers.plan(_blocks())
        out.append(choosers)
    return out


def test_one_rank_of_the_job_chooses_a_block_the_uploader_on_its_owner_daemons_node() -> None:
    hosts = ["a", "a", "b", "b"]
    ranks = _choosers(hosts, [0, 1])
    daemons = owner_map({f"job:{b}": n for b, n in _blocks().items()}, [0, 1], [0, 1])
    nodes = [(0, 1), (2, 3)]
    for block, n in _blocks().items():
        choosing = [r for r, c in enumerate(ranks) if c.chooses(block, n)]
        node = daemons[f"job:{block}"]
        uploaders = BlockOwners(nodes[node])
        uploaders.plan(_blocks())
        # exactly one rank in the job, the one that uploads it to the daemon that solves it
        assert choosing == [uploaders.owner(block, n)], (block, choosing, node)
    chosen_on = {ranks[0].chooser(b, n) // 2 for b, n in _blocks().items()}
    assert chosen_on == {0, 1}  # both daemons own blocks, so both nodes choose
    shard = f"fc.weight{SHARD_MARK}rows0:12/tile0/dim0"
    assert all(c.chooses(shard, 12) for c in ranks)  # a shard's block: each rank's own


def test_nodes_that_share_a_daemon_choose_on_the_lowest_of_them() -> None:
    """Nodes a and b use one daemon (member 0), c its own (member 1): member 0's blocks are
    chosen by node a's uploader, never by node b's ranks."""
    ranks = _choosers(["a", "b", "c"], [0, 0, 1])
    daemons = owner_map({f"job:{b}": n for b, n in _blocks().items()}, [0, 1], [0, 1])
    for block, n in _blocks().items():
        choosing = [r for r, c in enumerate(ranks) if c.chooses(block, n)]
        assert choosing == [0 if daemons[f"job:{block}"] == 0 else 2], block


def test_members_number_the_distinct_daemons_in_node_order() -> None:
    nodes = [SimpleNamespace(daemon_address=a) for a in ["x:1", "y:1", "x:1", "z:1"]]
    assert _members(nodes) == [0, 1, 0, 2]
