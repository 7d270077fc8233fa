"""What one tenant's blocks add up to, kept as their records change: ``asteria status``'s default.

A summary used to visit every block: it copied seven fields of each record under the engine's
lock and added them up as arrays. At 8 clients of 20,000 blocks that took ~0.34 s of a quiet
core (``scripts/status_cost.py --queued 160000``) and 1.1-1.4 s while the clients trained
(``asteria bench blocks``), so ``asteria status`` as a command passed its 2 s target (issue 27).

A :class:`Tally` is instead updated by the registry at each event that changes a record, at a
few dict operations per event, and a summary reads it at a cost that does not grow with the
blocks held:

- counts by state, by what result is held (none, in this process, in a client's segment), the
  failures, and how many blocks have each staleness (the percentiles walk the distinct values);
- the blocks that have a result, oldest result first: a block moves to the end at each new
  result, so the first is the oldest one (the registry's clock never goes back);
- the blocks of each staleness, and the failed ones, as sets: the worst blocks are the failed
  ones, then the highest staleness buckets, and only the bucket at the edge needs ranking by
  age, which reads the oldest-first order until it has enough.

Its cost in memory is about two dict entries a block (the staleness set and the age order).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from typing import Any, Protocol

Key = tuple[str, str]

#: State indices of :attr:`Tally.states`, in :class:`~asteria_server.types.BlockSummary` order.
IDLE, QUEUED, RUNNING, FAILED = range(4)
STATE_NAMES = ("idle", "queued", "running", "failed")
#: Held-result indices of :attr:`Tally.held`: no result, one in this process, one in a client's
#: shared-memory segment.
NO_RESULT, HOST_RESULT, SHM_RESULT = range(3)


class Counted(Protocol):
    """The record fields a tally reads."""

    key: Key
    submitted_version: int
    computed_version: int
    queued_version: int
    running_version: int
    computed_at: float | None
    failures: int
    failed: bool


#: A record's facts that a tally counts: (staleness, state index, failures).
Facts = tuple[int, int, int]


def facts(rec: Counted) -> Facts:
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


class Tally:
    """One tenant's counts (see the module docstring). The registry calls :meth:`add` for a new
    record, :meth:`change` after an event with the record's :func:`facts` from before it,
    :meth:`computed` at each accepted result, :meth:`held` at each change of the held result,
    and :meth:`remove` when the record goes."""

    __slots__ = ("failed", "failures", "held_counts", "order", "stale", "stale_counts", "states")

    def __init__(self) -> None:
        self.states = [0, 0, 0, 0]
        self.held_counts = [0, 0, 0]
        self.failures = 0
        self.stale_counts: dict[int, int] = {}  # staleness -> blocks, failed ones included
        self.stale: dict[int, dict[Key, None]] = {}  # staleness -> blocks not failed
        self.failed: dict[Key, None] = {}
        self.order: dict[Key, None] = {}  # blocks with a result, oldest result first

    @property
    def blocks(self) -> int:
        return sum(self.states)

    # ------------------------------------------------------------------ events

    def add(self, rec: Counted) -> None:
        self._count(rec.key, facts(rec), 1)
        self.held_counts[NO_RESULT] += 1

    def remove(self, rec: Counted, held: int) -> None:
        """``rec`` goes, holding a result of kind ``held``."""
        self._count(rec.key, facts(rec), -1)
        self.held_counts[held] -= 1
        self.order.pop(rec.key, None)

    def change(self, rec: Counted, before: Facts) -> None:
        after = facts(rec)
        if after != before:
            self._count(rec.key, before, -1)
            self._count(rec.key, after, 1)

    def computed(self, key: Key) -> None:
        """``key`` has a new result: its result is now the newest."""
        self.order.pop(key, None)
        self.order[key] = None

    def held(self, before: int, after: int) -> None:
        self.held_counts[before] -= 1
        self.held_counts[after] += 1

    def _count(self, key: Key, f: Facts, sign: int) -> None:
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
                self.failed[key] = None
            else:
                del self.failed[key]
        elif sign > 0:
            self.stale.setdefault(stale, {})[key] = None
        else:
            bucket = self.stale[stale]
            del bucket[key]
            if not bucket:
                del self.stale[stale]

    # ------------------------------------------------------------------ reads

    def numbers(self, records: Mapping[Key, Counted], now: float) -> dict[str, Any]:
        """The :class:`~asteria_server.types.BlockSummary` numbers, but ``tier_spill``: its
        ``tier_none`` counts every block without a result, spilled or not (the engine's tiers
        know which)."""
        n = self.blocks
        out: dict[str, Any] = dict(zip(STATE_NAMES, self.states, strict=True))
        out["tier_host"] = self.held_counts[HOST_RESULT]
        out["tier_shm"] = self.held_counts[SHM_RESULT]
        out["tier_none"] = self.held_counts[NO_RESULT]
        out["never_computed"] = n - len(self.order)
        out["failures"] = self.failures
        out["oldest_result_age_s"] = None
        if self.order:
            oldest = records[next(iter(self.order))].computed_at
            assert oldest is not None
            out["oldest_result_age_s"] = max(0.0, now - oldest)
        if n:
            ranks = {"p50": n // 2, "p99": min(n - 1, (99 * n) // 100), "max": n - 1}
            for name, value in _order_statistics(self.stale_counts, ranks).items():
                out[f"staleness_steps_{name}"] = value
        return out

    def worst(self, count: int, records: Mapping[Key, Counted]) -> list[str]:
        """The names of the ``count`` largest ``(failed, staleness, older, name)`` (older:
        -computed_at, never computed the oldest): the failed blocks, then whole staleness
        buckets from the highest down, and of the bucket at the edge only its oldest."""
        if count <= 0:
            return []
        candidates = list(self.failed)
        need = count - len(candidates)
        for stale in sorted(self.stale, reverse=True):
            if need <= 0:
                break
            bucket = self.stale[stale]
            candidates += bucket if len(bucket) <= need else self._oldest(bucket, need, records)
            need -= len(bucket)

        def rank(key: Key) -> tuple[bool, int, float, str]:
            rec = records[key]
            at = rec.computed_at
            older = math.inf if at is None else -at
            return rec.failed, rec.submitted_version - rec.computed_version, older, key[1]

        return [key[1] for key in heapq.nlargest(count, candidates, key=rank)]

    def _oldest(
        self, bucket: dict[Key, None], need: int, records: Mapping[Key, Counted]
    ) -> list[Key]:
        """The ``need`` blocks of ``bucket`` with the oldest results, never computed first
        (the last names of those, as the ranking takes them), and every block tied in age with
        the last one taken (the ranking's name decides among those)."""
        if len(self.order) < self.blocks:  # some never computed: they rank first
            never = [key for key in bucket if key not in self.order]
            if len(never) >= need:
                return heapq.nlargest(need, never, key=_name)
        else:
            never = []
        taken = never
        last: float | None = None
        for key in self.order:  # oldest result first
            if key not in bucket:
                continue
            at = records[key].computed_at
            if len(taken) >= need and at != last:
                break
            taken.append(key)
            last = at
        return taken


def _name(key: Key) -> str:
    return key[1]


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
