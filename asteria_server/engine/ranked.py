"""One tenant's queue kept in pop order, so a status read finds a block's queue position in
O(log Q) instead of sorting the whole queue (160,000 entries took 1.3-1.6 s to sort, per read).

An entry is its block's name, its cost and its key: ``(deadline, cost_s, seq)`` packed into one
int (:func:`rank_key`), so the bisects compare ints in one C call each, where tuples of equal
deadlines and costs took several (a status page's positions cost 4x more). Entries live in
sorted buckets of a few hundred (the layout of a B-tree's leaves,
flat): an insert or removal is a bisect and a short ``list.insert``/``del`` (a memmove in C),
and a bucket that grows past ``2 * LOAD`` is split. Two things a position needs are kept per
bucket and refreshed lazily, at the next query after a change, in C (``itertools.accumulate``):

- each bucket's running sum of its entries' costs (only the buckets that changed), and
- over the buckets, the entries and the costs before each bucket (one pass over the buckets,
  Q / LOAD of them, not over the entries).

So a query costs two bisects, and a read of many positions between changes (one hold of the
engine's lock) pays for the refresh once.

The *spent* of an entry is its tenant's consumed CPU-seconds plus the costs of the entries
before it: the scheduler pops the tenant of least spent next (ties by seq), so a block's global
position is its rank in its own tenant plus, per other tenant, the entries whose spent comes
before its own (:meth:`RankedQueue.count_before`). Spent is summed per bucket and then over the
buckets, not entry by entry as :func:`~asteria_server.engine.scheduler.queue_order` does, so two
entries whose spent differ by a rounding error only may be placed in the other order.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import struct
from collections.abc import Iterator
from typing import NoReturn, cast

_DOUBLE = struct.Struct("<d")
_UINT64 = struct.Struct("<Q")
_SIGN = 1 << 63
_LOW64 = (1 << 64) - 1


def rank_key(deadline: float, cost_s: float, seq: int) -> int:
    """``(deadline, cost_s, seq)`` as one int of the same order (seq: 0 <= seq < 2**64)."""
    return (_ordered_bits(deadline) << 128) | (_ordered_bits(cost_s) << 64) | seq


def rank_seq(key: int) -> int:
    """The ``seq`` that :func:`rank_key` packed into ``key``."""
    return key & _LOW64


def _ordered_bits(value: float) -> int:
    """A float's IEEE bits as an unsigned int that sorts as the floats do (not NaN): the
    sign bit set for positive ones, every bit flipped for negative ones."""
    (bits,) = _UINT64.unpack(_DOUBLE.pack(value + 0.0))  # + 0.0: -0.0 is 0.0
    return bits ^ _LOW64 if bits & _SIGN else bits | _SIGN


#: Entries a bucket holds at most twice of before it is split; a quarter of it merges.
LOAD = 512


class RankedQueue:
    """Entries sorted by :func:`rank_key`, with rank and cost-prefix queries; not thread-safe."""

    def __init__(self) -> None:
        self._keys: list[list[int]] = []
        self._costs: list[list[float]] = []  # each bucket's costs, parallel to its keys
        self._blocks: list[list[str]] = []  # and its blocks' names
        self._maxes: list[int] = []  # each bucket's last key
        #: per bucket, the running sum of its costs (``[0, c0, c0+c1, ...]``); None: changed
        self._prefix: list[list[float] | None] = []
        #: per bucket, each key's index in it, built by the first query that needs it (a
        #: status read) and dropped with the prefix when the bucket changes; None: not built
        self._index: list[dict[int, int] | None] = []
        self._count_before: list[int] = []  # entries before each bucket
        self._cost_before: list[float] = []  # costs before each bucket
        self._stale = False
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[str]:
        """The entries' blocks, in order."""
        return itertools.chain.from_iterable(self._blocks)

    def add(self, key: int, cost_s: float, block: str) -> None:
        """Insert an entry (``key`` not in the queue yet)."""
        self._stale = True
        self._len += 1
        if not self._keys:
            self._keys.append([key])
            self._costs.append([cost_s])
            self._blocks.append([block])
            self._maxes.append(key)
            self._prefix.append(None)
            self._index.append(None)
            return
        b = min(bisect.bisect_left(self._maxes, key), len(self._maxes) - 1)
        keys = self._keys[b]
        k = bisect.bisect_left(keys, key)
        keys.insert(k, key)
        self._costs[b].insert(k, cost_s)
        self._blocks[b].insert(k, block)
        self._maxes[b] = keys[-1]
        self._prefix[b] = self._index[b] = None
        if len(keys) > 2 * LOAD:
            self._split(b)

    def remove(self, key: int) -> None:
        """Remove the entry of ``key``; KeyError if it is not queued."""
        b, k = self._find(key)
        self._stale = True
        self._len -= 1
        keys = self._keys[b]
        del keys[k]
        del self._costs[b][k]
        del self._blocks[b][k]
        self._prefix[b] = self._index[b] = None
        if not keys:
            self._drop(b)
            return
        self._maxes[b] = keys[-1]
        if len(keys) < LOAD // 4 and len(self._keys) > 1:
            self._merge(b if b + 1 < len(self._keys) else b - 1)

    def rank(self, key: int) -> tuple[int, float]:
        """``(entries before key, their summed cost)``; KeyError if it is not queued."""
        b, k = self._find(key)
        self._refresh()
        prefix = self._prefix[b]
        assert prefix is not None
        return self._count_before[b] + k, self._cost_before[b] + prefix[k]

    def ranks(self, keys: list[int]) -> list[int]:
        """The entries before each of ``keys`` (:meth:`rank` without the costs); KeyError if
        one is not queued. Each step runs over all the keys in one C loop (``map``), so a
        status chunk of 1,000 blocks pays two bisects a key and no Python bytecode per key:
        the per-key loop took ~40% more."""
        buckets, at = self._locate(keys)
        return list(map(operator.add, map(self._count_before.__getitem__, buckets), at))

    def ranks_and_costs(self, keys: list[int]) -> tuple[list[int], list[float]]:
        """:meth:`ranks`, and the summed cost of the entries before each key."""
        buckets, at = self._locate(keys)
        prefix = cast(list[list[float]], self._prefix)  # refreshed: none is None
        sums = map(operator.getitem, map(prefix.__getitem__, buckets), at)
        costs = map(operator.add, map(self._cost_before.__getitem__, buckets), sums)
        ranks = map(operator.add, map(self._count_before.__getitem__, buckets), at)
        return list(ranks), list(costs)

    def count_before(self, spent: float, seq: int, consumed: float) -> int:
        """Entries whose ``consumed`` + costs before them is below ``spent`` (equal: whose seq
        is below ``seq``): those the scheduler pops before an entry of another tenant with that
        spent and seq."""
        if not self._len:
            return 0
        self._refresh()
        if not self._before(0, 0, spent, seq, consumed):
            return 0
        # The last bucket whose first entry comes before: a bisect on the costs before each
        # bucket finds it up to a rounding error, then the exact test moves it if need be.
        b = bisect.bisect_left(self._cost_before, spent - consumed) - 1
        b = min(max(b, 0), len(self._keys) - 1)
        while b + 1 < len(self._keys) and self._before(b + 1, 0, spent, seq, consumed):
            b += 1
        while b > 0 and not self._before(b, 0, spent, seq, consumed):
            b -= 1
        prefix = self._prefix[b]
        assert prefix is not None
        size = len(self._keys[b])
        k = bisect.bisect_left(prefix, spent - consumed - self._cost_before[b], 0, size)
        k = min(max(k, 1), size)
        while k < size and self._before(b, k, spent, seq, consumed):
            k += 1
        while k > 1 and not self._before(b, k - 1, spent, seq, consumed):
            k -= 1
        return self._count_before[b] + k

    # ------------------------------------------------------------------ internals

    def _before(self, b: int, k: int, spent: float, seq: int, consumed: float) -> bool:
        """Whether entry ``k`` of bucket ``b`` is popped before ``(spent, seq)``."""
        prefix = self._prefix[b]
        assert prefix is not None
        mine = consumed + (self._cost_before[b] + prefix[k])
        return mine < spent or (mine == spent and self._keys[b][k] & _LOW64 < seq)

    def _find(self, key: int) -> tuple[int, int]:
        b = bisect.bisect_left(self._maxes, key)
        if b < len(self._keys):
            keys = self._keys[b]
            k = bisect.bisect_left(keys, key)
            if k < len(keys) and keys[k] == key:
                return b, k
        raise KeyError(key)

    def _locate(self, keys: list[int]) -> tuple[list[int], list[int]]:
        """Each key's bucket and index in it, refreshed first; KeyError if one is not queued.

        The bucket is a bisect on the buckets' last keys (a few hundred ints, in cache); the
        index is a lookup in the bucket's key-to-index dict (built here the first time a bucket
        is asked for after it changed: ~0.1 ms a bucket), not a bisect of the bucket's keys,
        whose nine comparisons each read an int object somewhere in memory: with 160,000 keys
        queued a status read of them all took 0.47 s in those bisects, 0.12 s in the lookups.
        The dicts cost ~55 B a queued entry while they are kept."""
        self._refresh()
        buckets = list(map(bisect.bisect_left, itertools.repeat(self._maxes), keys))
        index = self._index
        wanted = set(buckets)
        if wanted and max(wanted) >= len(index):
            self._not_queued(keys)  # past the last bucket's last key
        for b in wanted:
            if index[b] is None:
                held = self._keys[b]
                index[b] = dict(zip(held, range(len(held)), strict=True))
        dicts = cast(list[dict[int, int]], index)
        try:
            at = list(map(operator.getitem, map(dicts.__getitem__, buckets), keys))
        except KeyError:
            self._not_queued(keys)
        return buckets, at

    def _not_queued(self, keys: list[int]) -> NoReturn:
        """Raise the KeyError of the first of ``keys`` that is not queued."""
        for key in keys:
            self._find(key)
        raise AssertionError("every key is queued")

    def _refresh(self) -> None:
        if not self._stale:
            return
        prefix = self._prefix
        for b, sums in enumerate(prefix):
            if sums is None:
                prefix[b] = list(itertools.accumulate(self._costs[b], initial=0.0))
        totals = [sums[-1] for sums in prefix if sums is not None]
        self._cost_before = list(itertools.accumulate(totals, initial=0.0))[:-1]
        self._count_before = list(itertools.accumulate(map(len, self._keys), initial=0))[:-1]
        self._stale = False

    def _split(self, b: int) -> None:
        keys, costs, blocks = self._keys[b], self._costs[b], self._blocks[b]
        self._keys[b : b + 1] = [keys[:LOAD], keys[LOAD:]]
        self._costs[b : b + 1] = [costs[:LOAD], costs[LOAD:]]
        self._blocks[b : b + 1] = [blocks[:LOAD], blocks[LOAD:]]
        self._maxes[b : b + 1] = [keys[LOAD - 1], keys[-1]]
        self._prefix[b : b + 1] = [None, None]
        self._index[b : b + 1] = [None, None]

    def _drop(self, b: int) -> None:
        del self._keys[b], self._costs[b], self._blocks[b], self._maxes[b]
        del self._prefix[b], self._index[b]

    def _merge(self, b: int) -> None:
        """Join bucket ``b + 1`` into ``b`` (split again if that makes it too large)."""
        self._keys[b] += self._keys[b + 1]
        self._costs[b] += self._costs[b + 1]
        self._blocks[b] += self._blocks[b + 1]
        self._maxes[b] = self._keys[b][-1]
        self._prefix[b] = self._index[b] = None
        self._drop(b + 1)
        if len(self._keys[b]) > 2 * LOAD:
            self._split(b)
