"""The coherence registry: per block, which version was submitted, computed and delivered.

One record per ``(tenant, block)``. The rules it enforces are the runtime's version rules:

- **versions never go backwards**: a submitted version older than the latest submitted one is
  ``STALE_IGNORED`` and the same one is a ``DUPLICATE`` (both counted, neither an error);
- **latest wins**: a newer submission replaces a queued older one (``SUPERSEDED_QUEUED``);
- **a result never replaces a newer one**: it is accepted only if its version is newer than the
  computed version;
- **failures are counted, never delivered**: the last good result stays; after
  ``max_consecutive_failures`` failed solves in a row the block is FAILED until a solve succeeds.

Staleness here is measured against what the client has *submitted*:
``staleness_steps = submitted_version - version`` where ``version`` is the newest computed one and
-1 when none exists, so a block never computed has staleness ``submitted_version + 1`` and a block
never submitted has 0. (The client adds its own current step to this picture.)

The registry is not thread-safe; the engine serializes access with its lock.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from asteria_server.engine.tally import (
    HOST_RESULT,
    NO_RESULT,
    SHM_RESULT,
    Tally,
    facts,
)
from asteria_server.types import (
    BLOCK_COLUMNS,
    BlockState,
    BlockStatus,
    BlockTable,
    SolveResult,
    SubmitOutcome,
)

Key = tuple[str, str]

#: What :meth:`CoherenceRegistry.status_columns` copies of each record: one list per field,
#: each filled by one C loop (``map`` of an attrgetter) over the chunk's records. A tuple per
#: record, transposed into columns after, cost ~3x more (the tuples, the transpose, the
#: ``block`` property read per record where the names are at hand).
_COLUMN_FIELDS = (
    "computed_version",
    "submitted_version",
    "queued_version",
    "running_version",
    "delivered_version",
    "computed_at",
    "submitted_at",
    "delivered_at",
    "last_solve_s",
    "failures",
    "consecutive_failures",
    "duplicates",
    "stale_ignored",
    "superseded",
    "failed",
    "last_error",
)
_COLUMN_GETTERS = tuple((name, operator.attrgetter(name)) for name in _COLUMN_FIELDS)
#: Copied status fields of many blocks: the record fields above, ``block`` and ``tier``, a list
#: each, entry i of every list of block i.
StatusColumns = dict[str, list[Any]]
_result_of = operator.attrgetter("result")
#: The tiers of many blocks at once, from their keys and held results (``ResultTiers.tiers``).
TiersOf = Callable[[list[Key], list[SolveResult | None]], list[str]]


def empty_status_columns() -> StatusColumns:
    """:data:`StatusColumns` of no block, for a reader to extend chunk by chunk."""
    return {name: [] for name in ("block", *_COLUMN_FIELDS, "tier")}


def block_table(
    tenant: str,
    columns: StatusColumns,
    now: float,
    positions: list[int | None] | None,
) -> BlockTable:
    """The :class:`BlockTable` of ``columns`` (from :meth:`CoherenceRegistry.status_columns`,
    taken at ``now``) with the queue ``positions``, block by block (None: none queued): the
    part of a status page built without the engine's lock."""
    c = columns
    if not c["block"]:
        return BlockTable(tenant)

    def ages(times: list[float | None]) -> list[float | None]:
        # max(0.0, now - t) without a call per block
        return [None if t is None else d if (d := now - t) > 0.0 else 0.0 for t in times]

    state = [
        BlockState.FAILED
        if f
        else BlockState.RUNNING
        if r >= 0
        else BlockState.QUEUED
        if q >= 0
        else BlockState.IDLE
        for f, r, q in zip(c["failed"], c["running_version"], c["queued_version"], strict=True)
    ]
    values = (
        c["block"], c["computed_version"], c["submitted_version"], c["queued_version"],
        c["running_version"], c["delivered_version"], ages(c["computed_at"]),
        ages(c["submitted_at"]), ages(c["delivered_at"]), c["last_solve_s"], c["failures"],
        c["consecutive_failures"], c["duplicates"], c["stale_ignored"], c["superseded"], state,
        c["last_error"], [None] * len(state) if positions is None else positions, c["tier"],
    )  # fmt: skip
    return BlockTable(tenant, dict(zip(BLOCK_COLUMNS, values, strict=True)))


def held_kind(result: SolveResult | None) -> int:
    """What a held result is, as a :class:`~asteria_server.engine.tally.Tally` counts it."""
    if result is None:
        return NO_RESULT
    return HOST_RESULT if result.shm is None else SHM_RESULT


def host_bytes(result: SolveResult | None) -> int:
    """The bytes ``result``'s arrays take in this process (0 when they lie in a client's
    segment, or for None)."""
    if result is None or result.shm is not None:
        return 0
    return sum(
        a.nbytes
        for a in (result.matrix, result.eigenvalues, result.permutation, result.rotation)
        if a is not None
    )


@dataclass(slots=True)
class _Record:
    #: ``(tenant, block)``: the one tuple of the block, which the scheduler's and the tiers'
    #: tables share as their key too (a tuple per table was ~56 bytes a block each)
    key: Key
    submitted_version: int = -1
    queued_version: int = -1
    running_version: int = -1
    computed_version: int = -1
    delivered_version: int = -1
    submitted_at: float | None = None
    computed_at: float | None = None
    delivered_at: float | None = None
    last_solve_s: float | None = None
    failures: int = 0
    consecutive_failures: int = 0
    duplicates: int = 0
    stale_ignored: int = 0
    superseded: int = 0
    failed: bool = False
    last_error: str | None = None
    result: SolveResult | None = None
    job: str = ""  # the job of the session that submitted it last (what a forget names)
    resubmit_ok: bool = False  # its result was dropped: its newest version may come again
    #: the newest version another daemon solves for it (the sync between node daemons): a
    #: submission of that version here is still accepted once (a local fallback)
    elsewhere_version: int = -1
    #: links a tenant's :class:`~asteria_server.engine.tally.Tally` keeps: the next older and
    #: newer result, and the neighbours in its staleness bucket
    older: _Record | None = dataclasses.field(default=None, repr=False, compare=False)
    newer: _Record | None = dataclasses.field(default=None, repr=False, compare=False)
    prev_same: _Record | None = dataclasses.field(default=None, repr=False, compare=False)
    next_same: _Record | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def tenant(self) -> str:
        return self.key[0]

    @property
    def block(self) -> str:
        return self.key[1]

    @property
    def in_flight_version(self) -> int:
        return self.queued_version if self.queued_version >= 0 else self.running_version

    @property
    def state(self) -> BlockState:
        if self.failed:
            return BlockState.FAILED
        if self.running_version >= 0:
            return BlockState.RUNNING
        if self.queued_version >= 0:
            return BlockState.QUEUED
        return BlockState.IDLE


class CoherenceRegistry:
    """Per-block versions, times and failures; holds the newest good result of every block."""

    def __init__(
        self, *, max_consecutive_failures: int = 3, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not isinstance(max_consecutive_failures, int) or max_consecutive_failures < 1:
            raise ValueError(
                "CoherenceRegistry.max_consecutive_failures must be an int >= 1, "
                f"got {max_consecutive_failures!r}"
            )
        self.max_consecutive_failures = max_consecutive_failures
        self._clock = clock
        self._records: dict[Key, _Record] = {}
        #: tenant -> its blocks (records); tenant -> bytes of its results held in this
        #: process's memory (results in a client's segment cost nothing here). Kept as results
        #: change, so a quota check or a cache that spills never scans every block.
        self._blocks_of: dict[str, int] = {}
        self._host_bytes_of: dict[str, int] = {}
        #: tenant -> its block names, sorted: built by the first status page after a block
        #: went, then shared by every page (a status read of many pages sorts once)
        self._sorted_names: dict[str, list[str]] = {}
        #: tenant -> names of blocks that came since its sorted names were built: merged into
        #: them at the next page (one C merge of a long sorted run and a few new names), not a
        #: new sort of every record. While 8 clients of 20,000 blocks registered, every status
        #: page sorted all 160,000 names again, under the engine's lock: the daemon spent most of
        #: its time there and its clients' calls ran past their deadlines.
        self._new_names: dict[str, list[str]] = {}
        #: tenant -> what its blocks add up to, kept at each event (``asteria status``'s
        #: default reads it instead of every record)
        self._tallies: dict[str, Tally] = {}

    def key(self, tenant: str, block: str) -> Key:
        """The block's key tuple as the registry holds it (a new one if it holds no record):
        what other per-block tables should key by, so that a block has one tuple."""
        rec = self._records.get((tenant, block))
        return (tenant, block) if rec is None else rec.key

    def _record(self, tenant: str, block: str) -> _Record:
        rec = self._records.get((tenant, block))
        if rec is None:
            key = (tenant, block)
            rec = self._records[key] = _Record(key)
            self._blocks_of[tenant] = self._blocks_of.get(tenant, 0) + 1
            tally = self._tallies.get(tenant)
            if tally is None:
                tally = self._tallies[tenant] = Tally()
            tally.add(rec)
            if tenant in self._sorted_names:
                self._new_names.setdefault(tenant, []).append(block)
        return rec

    def _set_result(self, rec: _Record, result: SolveResult | None) -> None:
        """Every change of a record's held result goes through here (the byte accounting)."""
        delta = host_bytes(result) - host_bytes(rec.result)
        before, after = held_kind(rec.result), held_kind(result)
        if before != after:
            self._tallies[rec.tenant].held(before, after)
        rec.result = result
        if delta:
            total = self._host_bytes_of.get(rec.tenant, 0) + delta
            if total:
                self._host_bytes_of[rec.tenant] = total
            else:
                self._host_bytes_of.pop(rec.tenant, None)

    def blocks_of(self, tenant: str) -> int:
        """How many blocks ``tenant`` has."""
        return self._blocks_of.get(tenant, 0)

    def host_bytes_of(self, tenant: str | None = None) -> int:
        """Bytes of results held in this process's memory, of ``tenant`` (None: all tenants)."""
        if tenant is None:
            return sum(self._host_bytes_of.values())
        return self._host_bytes_of.get(tenant, 0)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    # ------------------------------------------------------------------ events

    def on_submit(self, tenant: str, block: str, version: int, job: str = "") -> SubmitOutcome:
        """Record a submission and classify it (see the module docstring). After its result
        was dropped (:meth:`drop`), the block's newest version is accepted once more: its
        client resubmits it because nothing else will bring that result back."""
        rec = self._record(tenant, block)
        if job:
            rec.job = job
        if version < rec.submitted_version:
            rec.stale_ignored += 1
            return SubmitOutcome.STALE_IGNORED
        idle = rec.queued_version < 0 and rec.running_version < 0
        elsewhere = version == rec.elsewhere_version
        if version == rec.submitted_version and not (rec.resubmit_ok and idle) and not elsewhere:
            rec.duplicates += 1
            return SubmitOutcome.DUPLICATE
        before = facts(rec)
        rec.resubmit_ok = False
        rec.elsewhere_version = -1
        outcome = SubmitOutcome.QUEUED
        if rec.queued_version >= 0:
            rec.superseded += 1
            outcome = SubmitOutcome.SUPERSEDED_QUEUED
        rec.submitted_version = rec.queued_version = version
        rec.submitted_at = self._clock()
        self._tallies[tenant].change(rec, before)
        return outcome

    def on_elsewhere(self, tenant: str, block: str, version: int, job: str = "") -> None:
        """A snapshot of ``version`` arrived here but another daemon solves it (its owner, in
        the sync between node daemons): it counts as submitted (status, staleness, ``forget``)
        without being queued, and may still be submitted here once (a local fallback)."""
        rec = self._record(tenant, block)
        if job:
            rec.job = job
        if version > rec.submitted_version:
            before = facts(rec)
            rec.submitted_version = rec.elsewhere_version = version
            rec.submitted_at = self._clock()
            self._tallies[tenant].change(rec, before)

    def on_withdrawn(self, tenant: str, block: str, version: int) -> None:
        """The queued ``version`` left the queue: another daemon solves it (as
        :meth:`on_elsewhere`, it may still be submitted here once)."""
        rec = self._record(tenant, block)
        before = facts(rec)
        if rec.queued_version == version:
            rec.queued_version = -1
        rec.elsewhere_version = version
        self._tallies[tenant].change(rec, before)

    def on_dispatch(self, tenant: str, block: str, version: int) -> None:
        """The queued version of a block was handed to a worker."""
        rec = self._record(tenant, block)
        assert rec.queued_version == version, (rec.queued_version, version)
        assert rec.running_version < 0, rec.running_version
        before = facts(rec)
        rec.queued_version = -1
        rec.running_version = version
        self._tallies[tenant].change(rec, before)

    def on_result(self, result: SolveResult) -> bool:
        """A solve succeeded; store it if it is newer than the computed one. Returns accepted."""
        rec = self._record(result.tenant, result.block)
        tally = self._tallies[rec.tenant]
        before = facts(rec)
        if rec.running_version == result.version:
            rec.running_version = -1
        rec.consecutive_failures = 0
        rec.failed = False
        if result.version < rec.computed_version or (
            result.version == rec.computed_version and rec.result is not None
        ):
            tally.change(rec, before)
            return False
        had_result = rec.computed_at is not None
        rec.computed_version = result.version
        rec.computed_at = self._clock()
        rec.last_solve_s = result.solve_time_s
        self._set_result(rec, result)
        tally.change(rec, before)
        tally.computed(rec, had_result)
        return True

    def on_requeue(self, tenant: str, block: str, version: int) -> None:
        """A running version goes back to the queue (its worker was lost, it runs again)."""
        rec = self._record(tenant, block)
        before = facts(rec)
        if rec.running_version == version:
            rec.running_version = -1
        if rec.queued_version < 0:
            rec.queued_version = version
        self._tallies[tenant].change(rec, before)

    def on_overwritten(self, tenant: str, block: str, version: int) -> None:
        """A dispatched snapshot was overwritten in the client's segment before it was read (or
        a timed-out one found a newer snapshot waiting): no result and no failure; it counts as
        superseded, as a queued snapshot replaced by a newer one does (the newer snapshot is
        announced on its own)."""
        rec = self._record(tenant, block)
        rec.superseded += 1
        if rec.running_version == version:
            before = facts(rec)
            rec.running_version = -1
            self._tallies[tenant].change(rec, before)

    def on_failure(self, tenant: str, block: str, version: int, message: str) -> bool:
        """A solve failed for good. Returns True when this failure marked the block FAILED."""
        rec = self._record(tenant, block)
        before = facts(rec)
        if rec.running_version == version:
            rec.running_version = -1
        rec.failures += 1
        rec.consecutive_failures += 1
        rec.last_error = message
        marked = not rec.failed and rec.consecutive_failures >= self.max_consecutive_failures
        if marked:
            rec.failed = True
        self._tallies[tenant].change(rec, before)
        return marked

    def replace_results(self, fn: Callable[[SolveResult], SolveResult | None]) -> None:
        """Hold ``fn(r)`` instead of each held result ``r``; None drops it (the block keeps its
        versions, times and counts, only its arrays go)."""
        for rec in self._records.values():
            if rec.result is not None:
                self._set_result(rec, fn(rec.result))

    def hold(self, tenant: str, block: str, result: SolveResult | None) -> None:
        """Hold ``result`` (a spilled one brought back) or None (spilled) as the block's newest
        result; its versions and counts do not change."""
        rec = self._records.get((tenant, block))
        if rec is not None:
            self._set_result(rec, result)

    def drop(self, tenant: str, block: str) -> None:
        """The block's result is gone for good (evicted without a copy): hold none, and accept
        its newest version once more when its client resubmits it."""
        rec = self._records.get((tenant, block))
        if rec is not None:
            self._set_result(rec, None)
            rec.resubmit_ok = True

    def forget(self, tenant: str, block: str) -> None:
        """Remove the block's record: versions, counts, result."""
        rec = self._records.pop((tenant, block), None)
        if rec is not None:
            self._set_result(rec, None)
            tally = self._tallies[tenant]
            tally.remove(rec, NO_RESULT)
            if not tally.blocks:
                del self._tallies[tenant]
            self._sorted_names.pop(tenant, None)
            self._new_names.pop(tenant, None)
            self._blocks_of[tenant] = self._blocks_of.get(tenant, 1) - 1
            if not self._blocks_of[tenant]:
                del self._blocks_of[tenant]

    def blocks_of_job(self, tenant: str, job: str) -> list[str]:
        """The tenant's blocks last submitted by a session of ``job``."""
        return [b for (t, b), rec in self._records.items() if t == tenant and rec.job == job]

    def take(self, tenant: str, block: str) -> SolveResult | None:
        """The newest computed result if not delivered yet (it becomes delivered), else None."""
        rec = self._records.get((tenant, block))
        if rec is None or rec.result is None or rec.computed_version <= rec.delivered_version:
            return None
        rec.delivered_version = rec.computed_version
        rec.delivered_at = self._clock()
        return rec.result

    # ------------------------------------------------------------------ queries

    def latest_result(self, tenant: str, block: str) -> SolveResult | None:
        """The newest good result, delivered or not (None if there is none)."""
        rec = self._records.get((tenant, block))
        return None if rec is None else rec.result

    def computed_version(self, tenant: str, block: str) -> int:
        rec = self._records.get((tenant, block))
        return -1 if rec is None else rec.computed_version

    def delivered_version(self, tenant: str, block: str) -> int:
        rec = self._records.get((tenant, block))
        return -1 if rec is None else rec.delivered_version

    def submitted_version(self, tenant: str, block: str) -> int:
        rec = self._records.get((tenant, block))
        return -1 if rec is None else rec.submitted_version

    def submitted_at(self, tenant: str, block: str) -> float | None:
        """When the block's newest snapshot was submitted (the registry's clock), or None."""
        rec = self._records.get((tenant, block))
        return None if rec is None else rec.submitted_at

    def consecutive_failures(self, tenant: str, block: str) -> int:
        rec = self._records.get((tenant, block))
        return 0 if rec is None else rec.consecutive_failures

    def in_flight_version(self, tenant: str, block: str) -> int | None:
        """The queued version if any, else the running one, else None."""
        rec = self._records.get((tenant, block))
        if rec is None or rec.in_flight_version < 0:
            return None
        return rec.in_flight_version

    def state(self, tenant: str, block: str) -> BlockState | None:
        rec = self._records.get((tenant, block))
        return None if rec is None else rec.state

    def keys(self) -> Iterable[Key]:
        return self._records.keys()

    def status(
        self,
        tenant: str | None = None,
        queue_positions: Mapping[Key, int] | None = None,
        tier_of: Callable[[Key, SolveResult | None], str] | None = None,
    ) -> list[BlockStatus]:
        """Every block's status (of one tenant if given), sorted by (tenant, block)."""
        now = self._clock()
        positions = queue_positions or {}
        keys = (
            sorted(self._records) if tenant is None else [(tenant, b) for b in self._names(tenant)]
        )
        return [self._status_of(key, now, positions, tier_of) for key in keys]

    def status_page(
        self,
        tenant: str,
        after: str,
        limit: int,
        queue_positions: Mapping[Key, int] | None = None,
        tier_of: Callable[[Key, SolveResult | None], str] | None = None,
    ) -> tuple[list[BlockStatus], int]:
        """The status of at most ``limit`` of ``tenant``'s blocks, the first ones by name
        after ``after`` (from the start when empty), and how many blocks the tenant has. Costs
        the page, not the tenant's blocks (their sorted names are kept between pages)."""
        names = self._names(tenant)
        first = bisect.bisect_right(names, after) if after else 0
        now = self._clock()
        positions = queue_positions or {}
        page = [
            self._status_of((tenant, name), now, positions, tier_of)
            for name in names[first : first + limit]
        ]
        return page, len(names)

    def page_names(self, tenant: str, after: str, limit: int) -> list[str]:
        """The names of the blocks :meth:`status_page` would give."""
        names = self._names(tenant)
        first = bisect.bisect_right(names, after) if after else 0
        return names[first : first + limit]

    def now(self) -> float:
        """The registry's clock now (what its ages are measured against)."""
        return self._clock()

    def status_columns(
        self,
        tenant: str,
        after: str,
        limit: int,
        tiers_of: TiersOf | None = None,
    ) -> tuple[StatusColumns, int, float]:
        """The page :meth:`status_page` would give, as plain copies of the records' fields (a
        list per field, no object per block), how many blocks the tenant has, and the clock's
        time they were copied at. :func:`block_table` makes them a table, outside any lock."""
        names = self._names(tenant)
        first = bisect.bisect_right(names, after) if after else 0
        page = names[first : first + limit]
        return self._columns(tenant, page, tiers_of), len(names), self._clock()

    def status_columns_of(
        self, tenant: str, names: Iterable[str], tiers_of: TiersOf | None = None
    ) -> StatusColumns:
        """:meth:`status_columns` of the named blocks (those still held)."""
        held = [name for name in names if (tenant, name) in self._records]
        return self._columns(tenant, held, tiers_of)

    def _columns(
        self,
        tenant: str,
        names: list[str],
        tiers_of: TiersOf | None,
        getters: tuple[tuple[str, Callable[[_Record], Any]], ...] = _COLUMN_GETTERS,
    ) -> StatusColumns:
        """The fields ``getters`` copy of the records of ``tenant``'s ``names`` (a status
        page's by default), one C loop per field, and their tiers: what a status read does
        under the engine's lock, so as little as can be."""
        keys = list(zip(itertools.repeat(tenant), names))
        records = list(map(self._records.__getitem__, keys))
        columns: StatusColumns = {"block": names}
        for name, copy in getters:
            columns[name] = list(map(copy, records))
        if tiers_of is None:
            columns["tier"] = [""] * len(keys)
        else:
            columns["tier"] = tiers_of(keys, list(map(_result_of, records)))
        return columns

    def summary(self, tenant: str, worst: int) -> tuple[dict[str, Any], list[str]]:
        """What ``tenant``'s blocks add up to (the :class:`~asteria_server.types.BlockSummary`
        numbers but the split of blocks without a result into spilled and none), and the names
        of its ``worst`` worst blocks: read from its tally, without a visit to every block."""
        tally = self._tallies.get(tenant)
        if tally is None:
            return {}, []
        return tally.numbers(self._clock()), tally.worst(worst)

    def without_result(self, tenant: str, keys: Iterable[Key]) -> int:
        """How many of ``keys`` are ``tenant``'s blocks that hold no result."""
        records = self._records
        return sum(
            1
            for key in keys
            if key[0] == tenant and (rec := records.get(key)) is not None and rec.result is None
        )

    def _names(self, tenant: str) -> list[str]:
        names = self._sorted_names.get(tenant)
        if names is None:
            names = sorted(b for t, b in self._records if t == tenant)
            self._sorted_names[tenant] = names
            self._new_names.pop(tenant, None)
        elif tenant in self._new_names:
            # Timsort finds the long sorted run and merges the few new names into it.
            names = sorted(names + self._new_names.pop(tenant))
            self._sorted_names[tenant] = names
        return names

    def _status_of(
        self,
        key: Key,
        now: float,
        positions: Mapping[Key, int],
        tier_of: Callable[[Key, SolveResult | None], str] | None,
    ) -> BlockStatus:
        def age(t: float | None) -> float | None:
            return None if t is None else max(0.0, now - t)

        rec = self._records[key]
        return BlockStatus(
            tenant=rec.tenant,
            block=rec.block,
            version=rec.computed_version,
            submitted_version=rec.submitted_version,
            in_flight_version=rec.in_flight_version,
            queued_version=rec.queued_version,
            running_version=rec.running_version,
            delivered_version=rec.delivered_version,
            staleness_steps=rec.submitted_version - rec.computed_version,
            age_s=age(rec.computed_at),
            submitted_age_s=age(rec.submitted_at),
            delivered_age_s=age(rec.delivered_at),
            last_solve_s=rec.last_solve_s,
            failures=rec.failures,
            consecutive_failures=rec.consecutive_failures,
            duplicates=rec.duplicates,
            stale_ignored=rec.stale_ignored,
            superseded=rec.superseded,
            state=rec.state,
            last_error=rec.last_error,
            queue_position=positions.get(key),
            tier="" if tier_of is None else tier_of(key, rec.result),
        )
