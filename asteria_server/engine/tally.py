"""What one tenant's blocks add up to, kept as their records change: ``asteria status``'s default.

A summary used to visit every block: it copied seven fields of each record under the engine's
lock and added them up as arrays. At 8 clients of 20,000 blocks that took ~0.31 s of a quiet
core (``scripts/status_cost.py --queued 160000``) and 1.1-1.4 s while the clients trained
(``asteria bench blocks``), so ``asteria status`` as a command missed its 2 s target (issue 27).

A :class:`Tally` is instead updated by the registry at each event that changes a record, at a
few operations per event, and a summary reads it at a cost that does not grow with the blocks
held:

- counts by state, by what result is held (none, in this process, in a client's segment), the
  failures, and how many blocks have each staleness (the percentiles walk the distinct values);
- the blocks that have a result, oldest result first: a block moves to the end at each new
  result, so the first is the oldest one (the registry's clock never goes back);
- the blocks of each staleness that have not failed, and the failed ones: the worst blocks are
  the failed ones, then the highest staleness buckets whole, and only the bucket at the edge
  needs ranking by age, which reads the oldest-first order until it has enough.

The two orders are lists linked through the records themselves (:class:`Linked`: four
pointers, 32 bytes a block). As dicts of keys they cost 131 bytes a block at 160,000 blocks
(a dict that churns keeps a table of three times its entries), and ``asteria bench blocks``
measured the daemon's RSS per block grow from ~1,815 to 1,931 bytes of its 2 KiB target.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from typing import Any, Protocol

Key = tuple[str, str]

#: State indices of :attr:`Tally.states`, in :class:`~asteria_server.types.BlockSummary` order.
IDLE, QUEUED, RUNNING, FAILED = range(4)
STATE_NAMES = ("idle", "queued", "running", "failed")
#: Held-result indices of :attr:`Tally.held_counts`: no result, one in this process, one in a
#: client's shared-memory segment.
NO_RESULT, HOST_RESULT, SHM_RESULT = range(3)


class Linked(Protocol):
    """The record fields a tally reads, and the links it keeps in each record: ``older`` and
    ``newer`` in the order of results (both None while it has none), ``prev_same`` and
    ``next_same`` among the blocks of its staleness bucket (None while it has failed)."""

    key: Key
    submitted_version: int
    computed_version: int
    queued_version: int
    running_version: int
    computed_at: float | None
    failures: int
    failed: bool
    older: Any
    newer: Any
    prev_same: Any
    next_same: Any


#: A record's facts that a tally counts: (staleness, state index, failures).
Facts = tuple[int, int, int]


def facts(rec: Linked) -> Facts:
    state = (
        FAILED
        if rec.failed
        else RUNNING
        if rec.running_version >= 0
        else QUEUED
        if rec.queued_version >= 0
        else IDLE
    )
    return rec.submitted_version - rec.computed_version, state, rec.failures


class _Bucket:
    """The blocks of one staleness that have not failed: the first of a list linked through
    ``next_same``, and how many."""

    __slots__ = ("first", "size")

    def __init__(self) -> None:
        self.first: Any = None
        self.size = 0

    def __iter__(self) -> Iterator[Any]:
        rec = self.first
        while rec is not None:
            yield rec
            rec = rec.next_same


class Tally:
    """One tenant's counts (see the module docstring). The registry calls :meth:`add` for a new
    record, :meth:`change` after an event with the record's :func:`facts` from before it,
    :meth:`computed` at each accepted result, :meth:`held` at each change of the held result,
    and :meth:`remove` when the record goes."""

    __slots__ = (
        "failed",
        "failures",
        "held_counts",
        "newest",
        "oldest",
        "stale",
        "stale_counts",
        "states",
        "with_result",
    )

    def __init__(self) -> None:
        self.states = [0, 0, 0, 0]
        self.held_counts = [0, 0, 0]
        self.failures = 0
        self.stale_counts: dict[int, int] = {}  # staleness -> blocks, failed ones included
        self.stale: dict[int, _Bucket] = {}  # staleness -> blocks not failed
        self.failed: dict[Key, Linked] = {}
        #: the ends of the blocks with a result, linked oldest result first, and how many
        self.oldest: Any = None
        self.newest: Any = None
        self.with_result = 0

    @property
    def blocks(self) -> int:
        return sum(self.states)

    # ------------------------------------------------------------------ events

    def add(self, rec: Linked) -> None:
        self._count(rec, facts(rec), 1)
        self.held_counts[NO_RESULT] += 1

    def remove(self, rec: Linked, held: int) -> None:
        """``rec`` goes, holding a result of kind ``held``."""
        self._count(rec, facts(rec), -1)
        self.held_counts[held] -= 1
        if rec.computed_at is not None:
            self._unlink_result(rec)

    def change(self, rec: Linked, before: Facts) -> None:
        after = facts(rec)
        if after != before:
            self._count(rec, before, -1)
            self._count(rec, after, 1)

    def computed(self, rec: Linked, had_result: bool) -> None:
        """``rec`` has a new result (``had_result``: it had one before): it goes last in the
        order of results."""
        if had_result:
            self._unlink_result(rec)
        rec.older, rec.newer = self.newest, None
        if self.newest is None:
            self.oldest = rec
        else:
            self.newest.newer = rec
        self.newest = rec
        self.with_result += 1

    def held(self, before: int, after: int) -> None:
        self.held_counts[before] -= 1
        self.held_counts[after] += 1

    def _unlink_result(self, rec: Linked) -> None:
        older, newer = rec.older, rec.newer
        if older is None:
            self.oldest = newer
        else:
            older.newer = newer
        if newer is None:
            self.newest = older
        else:
            newer.older = older
        rec.older = rec.newer = None
        self.with_result -= 1

    def _count(self, rec: Linked, f: Facts, sign: int) -> None:
        stale, state, failures = f
        self.states[state] += sign
        self.failures += sign * failures
        left = self.stale_counts.get(stale, 0) + sign
        if left:
            self.stale_counts[stale] = left
        else:
            del self.stale_counts[stale]
        if state == FAILED:
            if sign > 0:
                self.failed[rec.key] = rec
            else:
                del self.failed[rec.key]
        elif sign > 0:
            bucket = self.stale.get(stale)
            if bucket is None:
                bucket = self.stale[stale] = _Bucket()
            rec.prev_same, rec.next_same = None, bucket.first
            if bucket.first is not None:
                bucket.first.prev_same = rec
            bucket.first = rec
            bucket.size += 1
        else:
            bucket = self.stale[stale]
            prev, nxt = rec.prev_same, rec.next_same
            if prev is None:
                bucket.first = nxt
            else:
                prev.next_same = nxt
            if nxt is not None:
                nxt.prev_same = prev
            rec.prev_same = rec.next_same = None
            bucket.size -= 1
            if not bucket.size:
                del self.stale[stale]

    # ------------------------------------------------------------------ reads

    def numbers(self, now: float) -> dict[str, Any]:
        """The :class:`~asteria_server.types.BlockSummary` numbers, but ``tier_spill``: its
        ``tier_none`` counts every block without a result, spilled or not (the engine's tiers
        know which)."""
        n = self.blocks
        out: dict[str, Any] = dict(zip(STATE_NAMES, self.states, strict=True))
        out["tier_host"] = self.held_counts[HOST_RESULT]
        out["tier_shm"] = self.held_counts[SHM_RESULT]
        out["tier_none"] = self.held_counts[NO_RESULT]
        out["never_computed"] = n - self.with_result
        out["failures"] = self.failures
        out["oldest_result_age_s"] = (
            None if self.oldest is None else max(0.0, now - self.oldest.computed_at)
        )
        if n:
            ranks = {"p50": n // 2, "p99": min(n - 1, (99 * n) // 100), "max": n - 1}
            for name, value in _order_statistics(self.stale_counts, ranks).items():
                out[f"staleness_steps_{name}"] = value
        return out

    def worst(self, count: int) -> list[str]:
        """The names of the ``count`` largest ``(failed, staleness, older, name)`` (older:
        -computed_at, never computed the oldest): the failed blocks, then whole staleness
        buckets from the highest down, and of the bucket at the edge only its oldest."""
        if count <= 0:
            return []
        candidates: list[Linked] = list(self.failed.values())
        need = count - len(candidates)
        for stale in sorted(self.stale, reverse=True):
            if need <= 0:
                break
            bucket = self.stale[stale]
            candidates += bucket if bucket.size <= need else self._oldest(stale, bucket, need)
            need -= bucket.size
        return [rec.key[1] for rec in heapq.nlargest(count, candidates, key=_rank)]

    def _oldest(self, stale: int, bucket: _Bucket, need: int) -> list[Linked]:
        """The ``need`` blocks of ``bucket`` (staleness ``stale``) with the oldest results,
        never computed first (the last names of those, as the ranking takes them), and every
        block tied in age with the last one taken (the ranking's name decides among those)."""
        never: list[Linked] = []
        if self.with_result < self.blocks:  # some never computed: they rank first
            never = [rec for rec in bucket if rec.computed_at is None]
            if len(never) >= need:
                return heapq.nlargest(need, never, key=_name)
        taken = never
        last: float | None = None
        rec = self.oldest
        while rec is not None:
            if not rec.failed and rec.submitted_version - rec.computed_version == stale:
                if len(taken) >= need and rec.computed_at != last:
                    break
                taken.append(rec)
                last = rec.computed_at
            rec = rec.newer
        return taken


def _rank(rec: Linked) -> tuple[bool, int, float, str]:
    at = rec.computed_at
    older = math.inf if at is None else -at
    return rec.failed, rec.submitted_version - rec.computed_version, older, rec.key[1]


def _name(rec: Linked) -> str:
    return rec.key[1]


def _order_statistics(counts: dict[int, int], ranks: dict[str, int]) -> dict[str, int]:
    """The values at the 0-based ``ranks`` (name -> rank) of the multiset ``counts`` (value ->
    how many times)."""
    out: dict[str, int] = {}
    wanted = iter(sorted(ranks.items(), key=lambda item: item[1]))
    step = next(wanted, None)
    below = 0
    for value in sorted(counts):
        below += counts[value]
        while step is not None and step[1] < below:
            out[step[0]] = value
            step = next(wanted, None)
        if step is None:
            break
    return out
