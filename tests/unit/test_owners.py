"""One owner rule for the client's replicas and the daemons (``asteria_server.owners``)."""

from __future__ import annotations

from asteria_client.distributed import BlockOwners
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
