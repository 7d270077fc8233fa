"""The engine's bookkeeping without threads: registry and scheduler kept in step.

:class:`Coordinator` is what :class:`~asteria_server.engine.engine.PreconditionerEngine` calls
under its lock. It has no locks, threads or processes of its own, so every rule of the runtime
(latest wins, dedupe, no version regression, failures counted, garbage never delivered) can be
tested with plain calls.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import numpy as np

from asteria_server.engine.registry import CoherenceRegistry
from asteria_server.engine.scheduler import CostModel, ScheduledTask, Scheduler
from asteria_server.types import BlockStatus, SolveKind, SolveResult, SolveTask, SubmitOutcome

logger = logging.getLogger(__name__)


def result_problem(task: SolveTask, result: SolveResult) -> str | None:
    """Why ``result`` cannot be delivered for ``task`` (None when it can).

    The last line of defence: whatever a worker sends back, a result of the wrong identity,
    shape or dtype, or holding NaN/Inf, never reaches a client.
    """
    n = task.n
    if result.key != task.key or result.version != task.version or result.kind is not task.kind:
        return "result does not match its task"
    if result.matrix.shape != (n, n) or result.matrix.dtype != np.float32:
        return f"result matrix has shape {result.matrix.shape} and dtype {result.matrix.dtype}"
    if task.kind is SolveKind.EIGENBASIS:
        if result.eigenvalues is None or result.eigenvalues.shape != (n,):
            return "eigenbasis result lacks its n eigenvalue estimates"
        # (a basis read from a segment that was overwritten since gave a full decomposition)
        refreshed = task.basis is not None or (task.is_refresh and result.base_version >= 0)
        if refreshed and (result.permutation is None or result.permutation.shape != (n,)):
            return "QR refresh result lacks its permutation"
    if result.shm is None and not result.is_finite():
        # A result in a client's segment was checked by the worker before it wrote it; reading
        # it here would be a race with that client, whose own business its segment is.
        return "result holds NaN or Inf"
    return None


def task_host_bytes(task: SolveTask) -> int:
    """The bytes ``task``'s arrays take in this process (0 when they lie in a client's segment)."""
    if task.shm_source is not None:
        return 0
    return task.matrix.nbytes + (0 if task.basis is None else task.basis.nbytes)


class Coordinator:
    """Registry + scheduler: one call per event of a snapshot's life."""

    def __init__(
        self,
        *,
        cost_model: CostModel | None = None,
        max_consecutive_failures: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = CoherenceRegistry(
            max_consecutive_failures=max_consecutive_failures, clock=clock
        )
        self.scheduler = Scheduler(cost_model)
        self.solves_done = 0
        self.solves_failed = 0
        self.results_discarded = 0
        #: per block, the versions of its last discarded results (solved, but a newer or equal
        #: result was in already): the sync between node daemons shows them
        self.discarded_versions: dict[tuple[str, str], collections.deque[int]] = {}
        #: snapshot bytes held in this process by queued or running tasks: per tenant, and per
        #: (tenant, block) the running task's (a task in a client's segment holds none)
        self._held_of: dict[str, int] = {}
        self._running_bytes: dict[tuple[str, str], int] = {}

    def held_bytes_of(self, tenant: str | None = None) -> int:
        """Snapshot bytes queued or solving in this process, of ``tenant`` (None: all)."""
        if tenant is None:
            return sum(self._held_of.values())
        return self._held_of.get(tenant, 0)

    def _hold(self, tenant: str, num_bytes: int) -> None:
        if num_bytes:
            total = self._held_of.get(tenant, 0) + num_bytes
            if total:
                self._held_of[tenant] = total
            else:
                self._held_of.pop(tenant, None)

    def submit(self, task: SolveTask, job: str = "") -> SubmitOutcome:
        """Classify and (if accepted) queue a snapshot (``job``: of the submitting session)."""
        outcome = self.registry.on_submit(task.tenant, task.block, task.version, job)
        if outcome.accepted:
            replaced = self.scheduler.pending_task(task.tenant, task.block)
            queued = self.scheduler.push(task, self.registry.key(task.tenant, task.block))
            assert queued is outcome, (queued, outcome)
            if replaced is not None:
                self._hold(task.tenant, -task_host_bytes(replaced))
            self._hold(task.tenant, task_host_bytes(task))
        return outcome

    def next_task(self, *, workers: int = 0) -> ScheduledTask | None:
        """Pop the next task to run and mark its block running (``workers``: see
        :meth:`Scheduler.pop`)."""
        entry = self.scheduler.pop(workers=workers)
        if entry is not None:
            self.registry.on_dispatch(entry.task.tenant, entry.task.block, entry.task.version)
            self._running_bytes[entry.task.key] = task_host_bytes(entry.task)
        return entry

    def _finished(self, task: SolveTask) -> None:
        self._hold(task.tenant, -self._running_bytes.pop(task.key, 0))

    def complete(self, task: SolveTask, result: SolveResult) -> bool:
        """A worker returned ``result`` for ``task``. Returns True when it became the block's
        newest result; a malformed or non-finite result is recorded as a failure instead."""
        problem = result_problem(task, result)
        if problem is not None:
            self.fail(task, f"block {task.block!r} version {task.version}: {problem}")
            return False
        self._finished(task)
        self.scheduler.finish(task.tenant, task.block, result.solve_time_s)
        self.solves_done += 1
        accepted = self.registry.on_result(result)
        if not accepted:
            self.results_discarded += 1
            kept = self.discarded_versions.get(task.key)
            if kept is None:
                kept = self.discarded_versions[task.key] = collections.deque(maxlen=64)
            kept.append(task.version)
        return accepted

    def requeue(self, task: SolveTask) -> bool:
        """A running task's worker timed out and it has runs left: queue it again, behind the
        tasks that waited meanwhile. False when a newer snapshot of its block already waits."""
        queued = self.scheduler.requeue(task)
        if queued:
            self.registry.on_requeue(task.tenant, task.block, task.version)
        else:
            self._finished(task)  # dropped: its bytes are no longer held
            self.registry.on_overwritten(task.tenant, task.block, task.version)
        return queued

    def forget(self, tenant: str, block: str) -> None:
        """Forget a block: its record, result and queued snapshot (a running solve of it is
        :meth:`discard` ed when it ends)."""
        queued = self.scheduler.forget(tenant, block)
        if queued is not None:
            self._hold(tenant, -task_host_bytes(queued))
        self.registry.forget(tenant, block)
        self.discarded_versions.pop((tenant, block), None)

    def withdraw(self, tenant: str, block: str, max_version: int) -> SolveTask | None:
        """Take the block's queued task out of the queue when its version <= ``max_version``
        (another daemon solves it); it may be submitted again once."""
        task = self.scheduler.pending_task(tenant, block)
        if task is None or task.version > max_version:
            return None
        self.scheduler.withdraw(tenant, block)
        self._hold(tenant, -task_host_bytes(task))
        self.registry.on_withdrawn(tenant, block, task.version)
        return task

    def discard(self, task: SolveTask) -> None:
        """A task of a forgotten block ended, whichever way: nothing of it is recorded."""
        self._finished(task)
        self.scheduler.finish(task.tenant, task.block, None)

    def drop_result(self, tenant: str, block: str) -> None:
        """A block's result was evicted without a copy: its client may resubmit the version."""
        self.registry.drop(tenant, block)
        self.scheduler.allow_resubmit(tenant, block, self.registry.submitted_version(tenant, block))

    def overwritten(self, task: SolveTask) -> None:
        """A dispatched snapshot was overwritten in its client's segment before a worker read
        it: the block is free again; the newer snapshot was (or will be) submitted itself."""
        self._finished(task)
        self.scheduler.finish(task.tenant, task.block, None)
        self.registry.on_overwritten(task.tenant, task.block, task.version)

    def fail(self, task: SolveTask, message: str, *, measured_s: float | None = None) -> None:
        """A task failed for good (solver error, crash or timeout after its retries)."""
        self._finished(task)
        self.scheduler.finish(task.tenant, task.block, measured_s)
        self.solves_failed += 1
        marked = self.registry.on_failure(task.tenant, task.block, task.version, message)
        where = {"tenant": task.tenant, "block": task.block}  # fields of structured logs
        if marked:
            logger.warning(
                "block %r (tenant %r) marked FAILED after %d consecutive failed solves; "
                "its last good result stays in use. Last error: %s",
                task.block,
                task.tenant,
                self.registry.max_consecutive_failures,
                message,
                extra=where,
            )
        elif self.registry.consecutive_failures(task.tenant, task.block) == 1:
            # repeats of a streak are logged at debug
            logger.info("solve failed: %s", message, extra=where)
        else:
            logger.debug("solve failed: %s", message, extra=where)

    def take(self, tenant: str, block: str) -> SolveResult | None:
        return self.registry.take(tenant, block)

    def in_flight_version(self, tenant: str, block: str) -> int | None:
        return self.registry.in_flight_version(tenant, block)

    def queue_depth(self, tenant: str | None = None) -> int:
        """Snapshots waiting for a worker: all tenants', or ``tenant``'s."""
        return len(self.scheduler) if tenant is None else self.scheduler.queued_of(tenant)

    def status(
        self,
        tenant: str | None = None,
        tier_of: Callable[[tuple[str, str], SolveResult | None], str] | None = None,
    ) -> list[BlockStatus]:
        return self.registry.status(tenant, self.scheduler.positions(), tier_of)

    def status_page(
        self,
        tenant: str,
        after: str,
        limit: int,
        tier_of: Callable[[tuple[str, str], SolveResult | None], str] | None = None,
    ) -> tuple[list[BlockStatus], int]:
        """One status page: the page's queue positions are read by rank (the queue is not
        sorted), so it costs the page's blocks, not the queue."""
        names = self.registry.page_names(tenant, after, limit)
        queued = self.scheduler.positions_of(tenant, names)
        positions = {(tenant, b): at for b, at in zip(names, queued, strict=True) if at is not None}
        return self.registry.status_page(tenant, after, limit, positions, tier_of)
