"""Who owns (alone computes) each replicated block: one rule for the daemons and the client.

The daemons of a job choose an owner daemon per block replicated across nodes
(:mod:`asteria_server.sync.manager`); the ranks of a job choose an owner rank per block their
data-parallel replicas share (``asteria_client.distributed.replicas``: the rank that uploads it
to its node's daemon, or whose engine solves it). Both apply :func:`owner_map`, with nodes or
ranks as the members. A leaf: it imports nothing of the project, so the client takes it without
the daemon's gRPC.

Which blocks are shared at all is the other half of the rule: a block of a parameter shard
(FSDP2) carries the shard's global coordinates after :data:`SHARD_MARK` in its name.

The owner rule is a pure function of the replicated blocks (name and dimension), the members
and which of them are alive, so every member computes the same map without a coordinator:

1. **Base map, over every node of the layout** (alive or not): longest processing time first.
   Blocks are taken largest first (cost n³; equal sizes in the order of a hash of the name), and
   each goes to the node with the least work so far (equal loads: the lowest hash of block and
   node, so ties do not all fall to node 0). LPT keeps the largest load within 4/3 of the
   optimum, and for many blocks of mixed sizes much closer.
2. **Dead members' blocks move to the living**, again largest first to the least loaded living
   node. Blocks of living nodes never move, so a death moves only the dead node's blocks, and
   when it comes back (alive again, or a new incarnation) exactly those move back.

A block that only some members use (a parameter shard replicated on some nodes: HSDP) is
owned by one of its *users*: both steps above choose among the nodes that use it, and a block
none of whose users lives has no owner. Without ``users`` every node uses every block.

The base map depends on the whole block set: a block that appears later can move others. The
sync therefore decides owners only once every live peer holds the same block lists (see
:mod:`asteria_server.sync.manager`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

#: Marks the name of a shard's block (FSDP2): ``fc.weight@rows0:12/tile0/dim0``.
SHARD_MARK = "@"


def is_shard_block(block: str) -> bool:
    """Whether ``block`` belongs to a parameter shard (its name carries :data:`SHARD_MARK`)."""
    return SHARD_MARK in block


def block_cost(n: int) -> float:
    """The relative cost of one solve of an n×n factor (an eigendecomposition: n³)."""
    return float(n) ** 3


def _rank(*parts: object) -> int:
    text = "\0".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


def _lpt(
    blocks: Iterable[tuple[str, int]],
    nodes: list[int],
    load: dict[int, float],
    users: Mapping[str, Iterable[int]] | None,
) -> dict[str, int]:
    out: dict[str, int] = {}
    for block, n in sorted(blocks, key=lambda b: (-block_cost(b[1]), _rank(b[0]), b[0])):
        if users is None:
            candidates = nodes
        else:
            allowed = set(users[block])
            candidates = [m for m in nodes if m in allowed]
        if not candidates:
            continue
        node = min(candidates, key=lambda m: (load[m], _rank(block, m), m))
        out[block] = node
        load[node] += block_cost(n)
    return out


def owner_map(
    blocks: Mapping[str, int],
    nodes: Iterable[int],
    alive: Iterable[int],
    users: Mapping[str, Iterable[int]] | None = None,
) -> dict[str, int]:
    """block -> owner node, for ``blocks`` (name -> n) over the layout's ``nodes`` of which
    ``alive`` are alive, each block owned by one of its ``users`` (default: every node; see
    the module docstring). Empty when no node is alive; a block none of whose users is alive
    is left out."""
    every = sorted(set(nodes))
    living = sorted(set(alive) & set(every))
    if not living or not blocks:
        return {}
    base = _lpt(blocks.items(), every, dict.fromkeys(every, 0.0), users)
    dead = set(every) - set(living)
    if not dead:
        return base
    load = dict.fromkeys(living, 0.0)
    for block, node in base.items():
        if node not in dead:
            load[node] += block_cost(blocks[block])
    orphans = [(b, blocks[b]) for b, node in base.items() if node in dead]
    kept = {b: node for b, node in base.items() if node not in dead}
    return {**kept, **_lpt(orphans, living, load, users)}


def balance(blocks: Mapping[str, int], owners: Mapping[str, int], nodes: Iterable[int]) -> float:
    """Largest over mean estimated work per node (1.0: perfect); 1.0 without blocks."""
    load = dict.fromkeys(nodes, 0.0)
    for block, node in owners.items():
        load[node] = load.get(node, 0.0) + block_cost(blocks[block])
    if not load or not any(load.values()):
        return 1.0
    mean = sum(load.values()) / len(load)
    return max(load.values()) / mean
