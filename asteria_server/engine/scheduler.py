"""Which snapshot is solved next: latest wins, earliest deadline first, fair across tenants.

Rules, in order:

1. **Dedupe and latest wins.** Per block (``(tenant, block)``) the scheduler remembers the highest
   version it ever accepted. An older version is ``STALE_IGNORED``, the same one a ``DUPLICATE``.
   A newer one replaces a still-queued older one (``SUPERSEDED_QUEUED``) or is ``QUEUED``. So the
   versions a block is popped with strictly increase.
2. **One solve per block at a time.** A block whose previous version is still running is not
   popped again until :meth:`Scheduler.finish`; its newest snapshot waits (and keeps being
   superseded), so no CPU is spent on two versions of one block at once.
3. **Fairness across tenants by estimated CPU-seconds.** Each tenant has a *consumed* counter,
   charged with a task's estimated cost when it is popped (and corrected to the measured time by
   ``finish``). The next task comes from the tenant with the least consumed among those with an
   eligible task; ties go to the tenant whose candidate was submitted first. A tenant that
   becomes active again starts at the smallest counter of the active tenants, so idle time is not
   banked into a later monopoly (the idea of CFS's virtual runtime).
4. **Within a tenant, earliest deadline first**, ties by smaller estimated cost, then FIFO.
   Deadlines are optimizer steps of *that* tenant's job, so they are never compared across
   tenants.
5. **No tenant takes the last worker while another is active.** A solve is not preempted, so
   fairness by consumed CPU-seconds alone lets one tenant's burst of large solves (an n=2048
   eigh takes a second or more) hold every worker, and another tenant's small solve waits for
   the first of them to end (the soak's bursts of n=2048 snapshots alone took the well-behaved
   tenant's p99 from 1.2 s to 18 s on a loaded 2-core host, before this rule).
   With ``workers`` >= 2 given to :meth:`Scheduler.pop`, a tenant already running
   ``workers - 1`` solves gets no more while another tenant has work queued or running, or
   submitted within ``share_window_s``; so one worker is always free for (or used by) the
   others. A lone tenant keeps every worker.

The cost model is ``seconds ~ c * n^3``; ``c`` comes from timing one small eigh at start-up
(:meth:`CostModel.calibrate`) or is injected (tests, or a daemon that measured it before).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import math
import operator
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import InitVar, dataclass, field

import numpy as np
from threadpoolctl import ThreadpoolController

from asteria_server.engine.ranked import RankedQueue, rank_key, rank_seq
from asteria_server.types import SolveTask, SubmitOutcome

Key = tuple[str, str]

#: How long a tenant's last submit keeps a worker free for it (rule 5): a few of the soak's
#: submit intervals, short enough that a tenant gone quiet soon leaves every worker to the rest.
DEFAULT_SHARE_WINDOW_S = 10.0

#: c in seconds/n^3 measured on these hosts (one core, fp64 evd: n=1024 in ~0.13 s).
DEFAULT_SECONDS_PER_N3 = 1.2e-10
#: a QR refresh (two GEMMs and a QR) relative to a full eigh of the same size.
DEFAULT_REFRESH_RATIO = 0.3


@functools.lru_cache(maxsize=1024)
def _cost_s(model: CostModel, n: int, refresh: bool) -> float:
    return model.estimate_s(n, refresh=refresh)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Estimated CPU-seconds of a solve: ``seconds_per_n3 * n^3`` (times ``refresh_ratio`` for a
    QR refresh)."""

    seconds_per_n3: float = DEFAULT_SECONDS_PER_N3
    refresh_ratio: float = DEFAULT_REFRESH_RATIO

    def __post_init__(self) -> None:
        for name in ("seconds_per_n3", "refresh_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not (0.0 < value < math.inf):
                raise ValueError(f"CostModel.{name} must be a finite number > 0, got {value!r}")

    def estimate_s(self, n: int, *, refresh: bool = False) -> float:
        """Estimated seconds for one solve of an n×n factor."""
        seconds = self.seconds_per_n3 * float(n) ** 3
        return seconds * self.refresh_ratio if refresh else seconds

    def task_cost_s(self, task: SolveTask) -> float:
        """Estimated seconds for ``task``: one float object per model, size and kind of solve,
        shared by every queued task of them (a float each was ~24 bytes a queued block)."""
        return _cost_s(self, task.n, task.is_refresh)

    @classmethod
    def calibrate(cls, n: int = 256, repeats: int = 3, blas_threads: int | None = 1) -> CostModel:
        """Time a few small fp64 eighs (and QR refreshes) with the workers' BLAS setting.

        Takes a few milliseconds per repeat at the default n. The minimum over repeats is used,
        which is the least noisy estimate on a shared machine.
        """
        from asteria_server.engine.solvers import eigh_fp64, qr_refresh

        rng = np.random.default_rng(1234)
        g = rng.standard_normal((n, n))
        a = g @ g.T / n + np.eye(n)
        limit: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if blas_threads is not None:
            limit = ThreadpoolController().limit(limits=blas_threads, user_api="blas")
        best_eigh = best_refresh = math.inf
        with limit:
            for _ in range(max(1, repeats)):
                t0 = time.perf_counter()
                _, v = eigh_fp64(a)
                t1 = time.perf_counter()
                qr_refresh(a, v)
                t2 = time.perf_counter()
                best_eigh = min(best_eigh, t1 - t0)
                best_refresh = min(best_refresh, t2 - t1)
        c = max(best_eigh, 1e-9) / float(n) ** 3
        ratio = min(max(best_refresh / max(best_eigh, 1e-9), 0.05), 2.0)
        return cls(seconds_per_n3=c, refresh_ratio=ratio)


@dataclass(frozen=True, slots=True)  # one per queued block: no __dict__ each
class ScheduledTask:
    """A task as the scheduler holds it: with its estimated cost and arrival number."""

    task: SolveTask
    cost_s: float
    #: the arrival number, kept only inside :attr:`rank_key` (its low 64 bits): an int object
    #: of its own was ~30 bytes a queued block
    arrival: InitVar[int]
    #: :attr:`priority` as one int, as its tenant's :class:`RankedQueue` holds it (the same
    #: object: kept here, a status read finds the entry without packing it again).
    rank_key: int = field(init=False, repr=False, compare=False)

    def __post_init__(self, arrival: int) -> None:
        key = rank_key(float(self.task.deadline), self.cost_s, arrival)
        object.__setattr__(self, "rank_key", key)

    @property
    def seq(self) -> int:
        """The arrival number: the order of submission across all tenants."""
        return rank_seq(self.rank_key)

    @property
    def priority(self) -> tuple[float, float, int]:
        """Within-tenant order: earliest deadline, then cheapest, then first submitted."""
        return (float(self.task.deadline), self.cost_s, self.seq)


class Scheduler:
    """Pending snapshots keyed by ``(tenant, block)``. Not thread-safe: the engine locks it."""

    def __init__(
        self,
        cost_model: CostModel | None = None,
        *,
        share_window_s: float = DEFAULT_SHARE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self.share_window_s = share_window_s
        self._clock = clock
        #: tenant -> when it last submitted (rule 5); entries older than the window are dropped
        self._submitted_at: dict[str, float] = {}
        self._pending: dict[str, dict[str, ScheduledTask]] = {}
        #: per tenant, its queued entries in pop order, kept on every change: pop
        #: reads a tenant's next task from its front, and a status read a block's queue
        #: position by rank, neither with a look at all of the queue. It names blocks, never
        #: holds a task: a replaced snapshot's arrays are not kept alive by it.
        self._ranked: dict[str, RankedQueue] = {}
        self._latest: dict[Key, int] = {}
        self._running: dict[Key, float] = {}
        self._consumed: dict[str, float] = {}
        self._seq = 0

    # ------------------------------------------------------------------ submit side

    def push(self, task: SolveTask, key: Key | None = None) -> SubmitOutcome:
        """Queue ``task`` under the rules in the module docstring; ``key``: the block's key
        tuple as the registry holds it, kept instead of a copy of it."""
        self._submitted_at[task.tenant] = self._clock()
        latest = self._latest.get(task.key, -1)
        if task.version < latest:
            return SubmitOutcome.STALE_IGNORED
        if task.version == latest:
            return SubmitOutcome.DUPLICATE
        queue = self._pending.get(task.tenant)
        if queue is None:
            queue = self._pending[task.tenant] = {}
            self._reactivate(task.tenant)
        replaced = task.block in queue
        self._seq += 1
        self._enqueue(queue, ScheduledTask(task, self.cost_model.task_cost_s(task), self._seq))
        self._latest[task.key if key is None else key] = task.version
        return SubmitOutcome.SUPERSEDED_QUEUED if replaced else SubmitOutcome.QUEUED

    def _enqueue(self, queue: dict[str, ScheduledTask], entry: ScheduledTask) -> None:
        """Put ``entry`` in its tenant's ``queue`` and order, replacing the block's queued one."""
        tenant, block = entry.task.key
        ranked = self._ranked.get(tenant)
        if ranked is None:
            ranked = self._ranked[tenant] = RankedQueue()
        old = queue.get(block)
        if old is not None:
            ranked.remove(old.rank_key)
        queue[block] = entry
        ranked.add(entry.rank_key, entry.cost_s, block)

    def _unqueue(self, tenant: str, block: str) -> ScheduledTask | None:
        """Take the block's queued entry out of its tenant's queue and order, if any."""
        queue = self._pending.get(tenant)
        entry = None if queue is None else queue.pop(block, None)
        if entry is not None:
            self._ranked[tenant].remove(entry.rank_key)
        if queue is not None and not queue:
            del self._pending[tenant]
            self._ranked.pop(tenant, None)
        return entry

    def _head(self, tenant: str, queue: dict[str, ScheduledTask]) -> ScheduledTask | None:
        """The tenant's queued entry of the smallest priority whose block is not running."""
        ranked = self._ranked.get(tenant)
        if ranked is None:
            return None
        for block in ranked:  # those queued behind their block's running solve are passed over
            if (tenant, block) not in self._running:
                return queue[block]
        return None

    def _reactivate(self, tenant: str) -> None:
        others = [self._consumed.get(t, 0.0) for t in self._pending if t != tenant]
        floor = min(others) if others else 0.0
        self._consumed[tenant] = max(self._consumed.get(tenant, 0.0), floor)

    # ------------------------------------------------------------------ dispatch side

    def _capped(self, workers: int) -> set[str]:
        """The tenants that may not take another worker now (rule 5)."""
        if workers < 2:
            return set()
        now = self._clock()
        for tenant, at in list(self._submitted_at.items()):
            if now - at >= self.share_window_s:
                del self._submitted_at[tenant]
        running = Counter(tenant for tenant, _ in self._running)
        active = set(self._pending) | set(running) | set(self._submitted_at)
        if len(active) < 2:
            return set()
        return {tenant for tenant, num in running.items() if num >= workers - 1}

    def free_workers_for(self, tenant: str, workers: int) -> int:
        """Workers of a pool of ``workers`` that ``tenant``'s next snapshot could get now: the
        idle ones, or none while rule 5 holds the last one back for another tenant."""
        if tenant in self._capped(workers):
            return 0
        return max(0, workers - len(self._running))

    def pop(self, *, workers: int = 0) -> ScheduledTask | None:
        """Remove and return the next task to run (its block is then *running*), or None.

        ``workers``: the pool's size, for rule 5 (0: no worker is kept free for others)."""
        best: ScheduledTask | None = None
        best_rank: tuple[float, int] | None = None
        capped = self._capped(workers)
        for tenant, queue in self._pending.items():
            if tenant in capped:
                continue
            head = self._head(tenant, queue)
            if head is None:
                continue
            rank = (self._consumed.get(tenant, 0.0), head.seq)
            if best_rank is None or rank < best_rank:
                best, best_rank = head, rank
        if best is None:
            return None
        tenant, block = best.task.key
        self._unqueue(tenant, block)
        self._consumed[tenant] = self._consumed.get(tenant, 0.0) + best.cost_s
        self._running[best.task.key] = best.cost_s
        return best

    def requeue(self, task: SolveTask) -> bool:
        """Queue a running task again (its worker was lost), behind every task queued now.

        Its tenant stays charged with the run that was lost. False, and nothing queued, when a
        newer version of the block waits already (latest wins)."""
        self._running.pop(task.key, None)
        queue = self._pending.get(task.tenant)
        if queue is not None and task.block in queue:
            return False
        if queue is None:
            queue = self._pending[task.tenant] = {}
        self._seq += 1
        self._enqueue(queue, ScheduledTask(task, self.cost_model.task_cost_s(task), self._seq))
        return True

    def forget(self, tenant: str, block: str) -> SolveTask | None:
        """Forget a block: its queued task (returned) and its newest accepted version, so that
        it may start again from any version. A running task of it ends through ``finish``."""
        entry = self._unqueue(tenant, block)
        self._latest.pop((tenant, block), None)
        return None if entry is None else entry.task

    def withdraw(self, tenant: str, block: str) -> SolveTask | None:
        """Remove the block's queued task (returned) and accept its version once more."""
        entry = self._unqueue(tenant, block)
        if entry is None:
            return None
        self.allow_resubmit(tenant, block, entry.task.version)
        return entry.task

    def allow_resubmit(self, tenant: str, block: str, version: int) -> None:
        """Accept ``version`` of the block once more (its result was dropped), unless a newer
        one was accepted since."""
        key = (tenant, block)
        if self._latest.get(key, -1) == version:
            self._latest[key] = version - 1

    def finish(self, tenant: str, block: str, actual_s: float | None = None) -> None:
        """The running solve of a block ended (either way); charge its measured time if known."""
        charged = self._running.pop((tenant, block), None)
        if charged is not None and actual_s is not None and math.isfinite(actual_s):
            self._consumed[tenant] = self._consumed.get(tenant, 0.0) + max(actual_s, 0.0) - charged

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return sum(len(q) for q in self._pending.values())

    def queued_of(self, tenant: str) -> int:
        """Snapshots of ``tenant`` waiting for a worker."""
        return len(self._pending.get(tenant, ()))

    def num_tenants_queued(self) -> int:
        """Tenants with snapshots waiting: each other one adds a count per block to
        :meth:`positions_of`."""
        return len(self._pending)

    def __iter__(self) -> Iterator[ScheduledTask]:
        for queue in self._pending.values():
            yield from queue.values()

    def pending_task(self, tenant: str, block: str) -> SolveTask | None:
        """The queued (not yet running) task of a block, if any."""
        entry = self._pending.get(tenant, {}).get(block)
        return None if entry is None else entry.task

    def pending_version(self, tenant: str, block: str) -> int | None:
        """The queued (not yet running) version of a block, if any."""
        entry = self._pending.get(tenant, {}).get(block)
        return None if entry is None else entry.task.version

    def is_running(self, tenant: str, block: str) -> bool:
        """True between :meth:`pop` of the block and :meth:`finish`."""
        return (tenant, block) in self._running

    def latest_version(self, tenant: str, block: str) -> int:
        """The highest version ever accepted for a block (-1 if none)."""
        return self._latest.get((tenant, block), -1)

    def consumed_s(self, tenant: str) -> float:
        """The tenant's fairness counter (estimated/measured CPU-seconds charged so far)."""
        return self._consumed.get(tenant, 0.0)

    def num_running(self) -> int:
        """Blocks popped and not finished."""
        return len(self._running)

    def order(self) -> list[Key]:
        """The order the queued tasks would be popped in if nothing changed (for status).

        Blocks that wait for their running previous version are placed as if eligible.
        """
        return queue_order(*self.queue_snapshot())

    def queue_snapshot(self) -> tuple[dict[str, list[ScheduledTask]], dict[str, float]]:
        """What :func:`queue_order` needs, copied: each tenant's queued entries (immutable) and
        the CPU-seconds each has consumed. Costs a copy of references, so a caller holding the
        engine's lock can take it there and sort outside."""
        queues = {tenant: list(queue.values()) for tenant, queue in self._pending.items()}
        return queues, {tenant: self._consumed.get(tenant, 0.0) for tenant in queues}

    def positions_of(self, tenant: str, blocks: list[str]) -> list[int | None]:
        """The 0-based position in :meth:`order` of each of ``tenant``'s ``blocks`` (None: not
        queued), read from the tenants' ordered queues: O(tenants * log Q) a block, so a status
        page pays for its own blocks, not for the whole queue. With one tenant queued the whole
        page is looked up in C loops (:meth:`RankedQueue.ranks`); each other tenant queued
        adds a :meth:`RankedQueue.count_before` a block."""
        queue = self._pending.get(tenant)
        if queue is None:
            return [None] * len(blocks)
        entries = list(map(queue.get, blocks))
        queued = [entry for entry in entries if entry is not None]
        keys = list(map(_RANK_KEY, queued))
        others = [
            (self._ranked[t], self._consumed.get(t, 0.0)) for t in self._pending if t != tenant
        ]
        ranked = self._ranked[tenant]
        if others:
            ranks, costs = ranked.ranks_and_costs(keys)
            consumed = self._consumed.get(tenant, 0.0)
            for i, (entry, cost_before) in enumerate(zip(queued, costs, strict=True)):
                spent = consumed + cost_before
                ranks[i] += sum(q.count_before(spent, entry.seq, c) for q, c in others)
        else:
            ranks = ranked.ranks(keys)
        if len(queued) == len(entries):
            return list(ranks)
        found = iter(ranks)
        return [None if entry is None else next(found) for entry in entries]

    def positions(self) -> dict[Key, int]:
        """``{key: 0-based position in order()}`` for every queued block."""
        return {key: i for i, key in enumerate(self.order())}


_PRIORITY = operator.attrgetter("task.deadline", "cost_s", "seq")
_RANK_KEY = operator.attrgetter("rank_key")


def queue_order(queues: dict[str, list[ScheduledTask]], consumed: dict[str, float]) -> list[Key]:
    """The pop order of a :meth:`Scheduler.queue_snapshot`: each tenant's entries by priority,
    the tenants interleaved by the CPU-seconds consumed (the least first, ties to the earliest
    arrival). The sort keys come from one C call per entry and the tenants' heads from a heap,
    so it costs O(Q log Q) in C, not a Python comparison per entry per tenant."""
    ordered = {
        tenant: sorted(entries, key=_PRIORITY) for tenant, entries in queues.items() if entries
    }
    if len(ordered) == 1:
        (entries,) = ordered.values()
        return [e.task.key for e in entries]
    used = dict(consumed)
    heads = [(used.get(t, 0.0), e[0].seq, t, 0) for t, e in ordered.items()]
    heapq.heapify(heads)
    out: list[Key] = []
    while heads:
        spent, _, tenant, i = heapq.heappop(heads)
        entries = ordered[tenant]
        out.append(entries[i].task.key)
        spent += entries[i].cost_s
        if i + 1 < len(entries):
            heapq.heappush(heads, (spent, entries[i + 1].seq, tenant, i + 1))
    return out
