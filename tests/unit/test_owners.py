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
