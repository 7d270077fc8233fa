"""The preconditioner engine: the one object a training process (or the daemon) talks to.

:class:`PreconditionerEngine` owns the bookkeeping (:class:`Coordinator`: registry + scheduler),
the :class:`WorkerPool`, and one *dispatcher* thread that feeds idle workers from the scheduler
and records what they return. Its API is transport-free and thread-safe: plain Python values in
and out, so the embedded mode calls it directly and the gRPC service wraps it thinly.

Guarantees:

- ``submit`` never blocks on a solve and never raises for numerical problems (those are solve
  failures, counted in ``status()``); it raises only when the engine is closed or broken.
- A result is delivered at most once per version, only if newer than what was computed before,
  and only if finite and well-formed. A failed solve keeps the last good result.
- ``wait_result`` is bounded by its timeout and returns early when waiting cannot succeed.
- ``close`` stops the thread, the workers and removes every shared-memory segment.
- Nothing waits on a timer: the dispatcher sleeps on its workers' pipes and the pool's wake-up
  fd (a submit or close writes to it), and a new result is *pushed* to the result listeners
  (:meth:`PreconditionerEngine.add_result_listener`), so an idle engine uses no CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from asteria_server.engine.coordinator import Coordinator
from asteria_server.engine.registry import (
    block_table,
    empty_status_columns,
)
from asteria_server.engine.scheduler import CostModel
from asteria_server.engine.solvers import SolverConfig
from asteria_server.engine.tiers import ResultTiers, SpillEnd, write_spill_file
from asteria_server.engine.workers import (
    START_METHODS,
    PoolConfig,
    PoolEvent,
    WorkerPool,
    check_cpu_affinity,
    default_num_workers,
)
from asteria_server.errors import EngineUnavailableError
from asteria_server.protocol.shm import private_result
from asteria_server.ratelog import RefusalLog
from asteria_server.types import (
    DEFAULT_TENANT,
    ArrivalOrder,
    BlockStatus,
    BlockSummary,
    BlockTable,
    EngineStats,
    SharedSegment,
    SolveKind,
    SolveResult,
    SolveTask,
    SubmitOutcome,
)

logger = logging.getLogger(__name__)

#: Results that may wait for their spill files at least (bytes; at most the cache budget if
#: larger): beyond, results leaving the host tier are dropped until the disk catches up.
SPILL_BACKLOG_MIN_BYTES = 64 << 20
#: Blocks whose fields and queue positions a status page copies per hold of the engine's lock
#: while other tenants have snapshots queued too (each of a page's blocks then counts their
#: entries before it, a few µs per tenant).
STATUS_CHUNK_BLOCKS = 1_000
#: The same with only the page's tenant queued: its positions are looked up in C loops, so
#: 2,000 hold the lock about as long (~4 ms) as 1,000 did before, and a read of 160,000 blocks
#: waits for the lock half as often while its clients submit.
STATUS_CHUNK_BLOCKS_ALONE = 2_000
#: Blocks a status summary lists with their records unless asked for another number.
SUMMARY_WORST_BLOCKS = 10

#: Told ``(tenant, block, version)`` when a block gets a newer result; see
#: ``add_result_listener``.
ResultListener = Callable[[str, str, "int | None"], None]
#: Called (no arguments) when workers may have started or finished; see
#: ``add_capacity_listener``.
CapacityListener = Callable[[], None]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Configuration of :class:`PreconditionerEngine`.

    Attributes:
        num_workers: solver worker processes (default: usable CPUs - 1, at least 1).
        blas_threads: BLAS threads per worker.
        worker_niceness: nice value added to the workers (0-19), so that on an oversubscribed
            host the training step runs first and solves take the CPU that is left.
        solve_timeout_s: the cap of every solve's timeout (``math.inf``: none); a solve running
            past its timeout is killed and run again.
        solve_timeout_floor_s: the least timeout of a solve (see ``solve_timeout_factor``).
        solve_timeout_factor: a solve times out after this many times the calibrated cost
            model's estimate for it, or ``solve_timeout_floor_s`` if longer (capped by
            ``solve_timeout_s``): a hung worker is replaced after a multiple of its block's cost.
        max_attempts: numeric attempts per solve, escalating epsilon (inside the worker).
        max_worker_attempts: worker runs of one task lost to a crash/timeout before it fails.
        max_consecutive_failures: failed solves in a row after which a block is FAILED.
        calibrate: time a small eigh at start to calibrate the cost model (a few ms).
        seconds_per_n3: a known cost-model constant; set, it skips calibration (tests).
        start_method: ``"subprocess"`` (default), ``"spawn"`` or ``"forkserver"``.
        worker_start_timeout_s: a worker not ready this long after its start is replaced.
        cache_memory_bytes: the host tier of the result cache: results held in this process's
            memory (not those in a client's segment) beyond it leave, least recently used first,
            to ``spill_dir`` or dropped (their clients resubmit). None: unbounded.
        spill_dir: where results leaving the host tier are written (one checksummed file
            each, brought back on demand); None: they are dropped. Spill files a previous
            engine left there are removed at start.
        cpu_affinity: CPUs the solver workers may run on (None, the default: this process's);
            a trainer pinned to one core gives the workers the others, so no solve takes the
            step's core. Stored as a sorted tuple; every CPU must be one this process may use.
        test_fault_prefix: TEST-ONLY fault injection by block name (see ``engine.faults``);
            None, the default, disables it.
    """

    num_workers: int = field(default_factory=default_num_workers)
    blas_threads: int = 1
    worker_niceness: int = 10
    solve_timeout_s: float = 600.0
    solve_timeout_floor_s: float = 30.0
    solve_timeout_factor: float = 20.0
    max_attempts: int = 3
    max_worker_attempts: int = 2
    max_consecutive_failures: int = 3
    calibrate: bool = True
    seconds_per_n3: float | None = None
    start_method: str = "subprocess"
    worker_start_timeout_s: float = 60.0
    cpu_affinity: tuple[int, ...] | None = None
    test_fault_prefix: str | None = None
    cache_memory_bytes: int | None = None
    spill_dir: str | None = None

    def __post_init__(self) -> None:
        if self.cache_memory_bytes is not None and (
            not isinstance(self.cache_memory_bytes, int)
            or isinstance(self.cache_memory_bytes, bool)
            or self.cache_memory_bytes < 0
        ):
            raise ValueError(
                "EngineConfig.cache_memory_bytes must be None or an int >= 0, "
                f"got {self.cache_memory_bytes!r}"
            )
        if self.spill_dir is not None and not (
            isinstance(self.spill_dir, str) and os.path.isabs(self.spill_dir)
        ):
            raise ValueError(
                f"EngineConfig.spill_dir must be None or an absolute path, got {self.spill_dir!r}"
            )
        object.__setattr__(
            self,
            "cpu_affinity",
            check_cpu_affinity("EngineConfig.cpu_affinity", self.cpu_affinity),
        )
        for name in (
            "num_workers",
            "blas_threads",
            "max_attempts",
            "max_worker_attempts",
            "max_consecutive_failures",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("solve_timeout_s", "worker_start_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or math.isnan(value) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a number > 0, got {value!r}")
        if not isinstance(self.calibrate, bool):
            raise ValueError(f"EngineConfig.calibrate must be a bool, got {self.calibrate!r}")
        if self.seconds_per_n3 is not None and not (
            isinstance(self.seconds_per_n3, int | float) and 0 < self.seconds_per_n3 < math.inf
        ):
            raise ValueError(
                f"EngineConfig.seconds_per_n3 must be None or a finite number > 0, "
                f"got {self.seconds_per_n3!r}"
            )
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"EngineConfig.start_method must be one of {START_METHODS}, "
                f"got {self.start_method!r}"
            )
        if self.test_fault_prefix is not None and not (
            isinstance(self.test_fault_prefix, str) and self.test_fault_prefix
        ):
            raise ValueError(
                "EngineConfig.test_fault_prefix must be None or a non-empty string, "
                f"got {self.test_fault_prefix!r}"
            )

    def pool_config(self) -> PoolConfig:
        """The worker pool's share of this config."""
        return PoolConfig(
            num_workers=self.num_workers,
            blas_threads=self.blas_threads,
            niceness=self.worker_niceness,
            solve_timeout_s=self.solve_timeout_s,
            solve_timeout_floor_s=self.solve_timeout_floor_s,
            solve_timeout_factor=self.solve_timeout_factor,
            max_worker_attempts=self.max_worker_attempts,
            start_timeout_s=self.worker_start_timeout_s,
            start_method=self.start_method,
            solver=SolverConfig(max_attempts=self.max_attempts, blas_threads=None),
            cpu_affinity=self.cpu_affinity,
            test_fault_prefix=self.test_fault_prefix,
        )


@dataclass(frozen=True, kw_only=True)
class FinishedSolve:
    """How one dispatched task ended, for an observer such as the daemon's metrics.

    Attributes:
        tenant: the block's tenant.
        kind: what was computed; ``refresh`` tells a QR refresh from a full eigh.
        refresh: True for an EIGENBASIS task that refreshed a given basis.
        n: the factor's dimension.
        ok: a result came back (False: the solve failed for good, after its retries).
        solve_s: seconds the successful solve took in its worker; None when it failed.
        wait_s: seconds from the snapshot's submission to its dispatch to a worker.
        run_s: seconds from dispatch to the end (transfers and worker retries included).
    """

    tenant: str
    kind: SolveKind
    refresh: bool
    n: int
    ok: bool
    solve_s: float | None
    wait_s: float
    run_s: float


#: Called on the dispatcher thread with the engine's lock held: it must be quick and must not
#: call the engine.
SolveObserver = Callable[[FinishedSolve], None]


@dataclass(frozen=True)
class EngineUsage:
    """Memory and blocks held in the engine (see :meth:`PreconditionerEngine.usage`)."""

    queued_bytes: int
    cached_bytes: int
    blocks: int


class PreconditionerEngine:
    """Asynchronous inverse roots and eigenbases for many blocks; see the module docstring."""

    def __init__(
        self, config: EngineConfig | None = None, *, observer: SolveObserver | None = None
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        self._observer = observer
        #: job id -> (dispatched at, seconds it waited in the queue); kept only with an observer.
        self._dispatched: dict[int, tuple[float, float]] = {}
        self.incarnation_id = uuid.uuid4().hex
        self._started = time.monotonic()
        if self.config.seconds_per_n3 is not None:
            cost = CostModel(seconds_per_n3=self.config.seconds_per_n3)
        elif self.config.calibrate:
            cost = CostModel.calibrate(blas_threads=self.config.blas_threads)
        else:
            cost = CostModel()
        self._coord = Coordinator(
            cost_model=cost, max_consecutive_failures=self.config.max_consecutive_failures
        )
        self._cond = threading.Condition(threading.Lock())
        self._jobs: dict[int, SolveTask] = {}
        #: dispatched jobs whose block was forgotten meanwhile: their outcome is discarded
        self._forgotten_jobs: set[int] = set()
        self._tiers = ResultTiers(
            budget_bytes=self.config.cache_memory_bytes,
            spill_dir=None if self.config.spill_dir is None else Path(self.config.spill_dir),
            incarnation=self.incarnation_id,
        )
        #: (tenant, block) -> (version, worker runs lost) of tasks queued again after a timeout
        self._runs_spent: dict[tuple[str, str], tuple[int, int]] = {}
        self._next_job = 0
        self._closing = False
        self._closed = False
        self._broken: str | None = None
        #: set once ``_closing`` or ``_broken`` is: what :meth:`wait_stopped` waits on (not
        #: ``_cond``, whose every notify would wake the watcher thread for nothing)
        self._stopped = threading.Event()
        self._results_epoch = 0
        #: refreshes that named their basis by version and found it here (see submit)
        self.bases_reused = 0
        #: tenant -> its blocks by the results epoch at which their newest results arrived
        #: (see _note_result)
        self._result_epochs: dict[str, ArrivalOrder] = {}
        self._listeners: list[ResultListener] = []
        self._capacity_listeners: list[CapacityListener] = []
        #: clients' result segments whose client let go of them (see release_shared)
        self._released: weakref.WeakSet[SharedSegment] = weakref.WeakSet()
        self._pool = WorkerPool(self.config.pool_config())
        self._thread = threading.Thread(
            target=self._dispatch_loop, name="asteria-engine-dispatch", daemon=True
        )
        self._thread.start()
        #: results to write to spill files, by a thread of their own (None: stop); see tiers
        self._spills: queue.SimpleQueue[tuple[tuple[str, str], Path] | None] = queue.SimpleQueue()
        #: results waiting for their spill files at most (bytes); past it they are dropped
        self._spill_backlog_bytes = max(
            SPILL_BACKLOG_MIN_BYTES, self.config.cache_memory_bytes or 0
        )
        self._spill_refusals = RefusalLog(logger)  # a line every 10 s while the disk is behind
        self._spiller: threading.Thread | None = None
        if self.config.spill_dir is not None:
            self._spiller = threading.Thread(
                target=self._spill_loop, name="asteria-engine-spill", daemon=True
            )
            self._spiller.start()
        atexit.register(self.close)
        logger.info(
            "preconditioner engine %s started: %d workers, %d BLAS thread(s) each",
            self.incarnation_id,
            self.config.num_workers,
            self.config.blas_threads,
        )

    # ------------------------------------------------------------------ client API

    def submit(self, task: SolveTask, *, job: str = "") -> SubmitOutcome:
        """Hand over a snapshot (non-blocking). Raises EngineUnavailableError when closed.

        ``job`` names the submitting session's job: :meth:`forget` forgets a job's blocks."""
        if not isinstance(task, SolveTask):
            raise TypeError(f"submit() takes a SolveTask, got {type(task).__name__}")
        with self._cond:
            self._check_usable()
            if task.kind is SolveKind.EIGENBASIS and task.basis is None and task.base_version >= 0:
                task = self._with_own_basis(task)
            outcome = self._coord.submit(task, job)
            if outcome.accepted:
                self._pool.wakeup()
            return outcome

    def _with_own_basis(self, task: SolveTask) -> SolveTask:
        """A refresh that names its basis by version (``basis`` None, ``base_version`` v: the
        basis this engine delivered as v, which the client kept home): from that result's
        matrix while it is the block's newest, else a full eigendecomposition whose result says
        it continues no basis (``base_version`` -1). A result that lies in a client's result
        segment is not copied here: the task names it (``shm_basis``) and the solver worker
        reads it. Called with ``_cond`` held."""
        self._bring_back(task.tenant, task.block)
        held = self._coord.registry.latest_result(task.tenant, task.block)
        if (
            held is None
            or held.version != task.base_version
            or held.kind is not SolveKind.EIGENBASIS
            or held.matrix.shape != task.matrix.shape
        ):
            return dataclasses.replace(task, base_version=-1)
        if held.shm is not None and task.shm_source is not None:
            self.bases_reused += 1
            return dataclasses.replace(task, shm_basis=held.shm)
        if task.shm_source is None:  # (a segment's task reads its arrays from segments)
            private = private_result(held) if held.shm is not None else held
            if private is not None:
                self.bases_reused += 1
                return dataclasses.replace(task, basis=private.matrix)
        return dataclasses.replace(task, base_version=-1)

    def take_result(self, block: str, tenant: str = DEFAULT_TENANT) -> SolveResult | None:
        """The newest computed result of ``block`` not yet delivered (now delivered), or None."""
        with self._cond:
            self._bring_back(tenant, block)
            return self._coord.take(tenant, block)

    def latest_result(
        self, block: str, tenant: str = DEFAULT_TENANT, *, newer_than: int = -1
    ) -> SolveResult | None:
        """The newest computed result of ``block`` if its version is > ``newer_than``, else None.

        Unlike :meth:`take_result` it returns a result again to every caller that asks (each
        data-parallel replica's stream needs it); it is recorded as delivered all the same.
        """
        with self._cond:
            if self._coord.registry.computed_version(tenant, block) <= newer_than:
                return None
            self._bring_back(tenant, block)
            result = self._coord.registry.latest_result(tenant, block)
            if result is None or result.version <= newer_than:
                return None
            self._coord.take(tenant, block)  # records the delivery if it is the first
            return result

    @property
    def results_epoch(self) -> int:
        """A counter that grows whenever a block gets a newer result (cheap to poll)."""
        return self._results_epoch

    def blocks_with_results_since(self, epoch: int, tenant: str = DEFAULT_TENANT) -> list[str]:
        """The tenant's blocks whose newest result arrived after ``results_epoch`` was ``epoch``
        (``-1``: every block with a result). Costs a scan of one dict, not a status build, so a
        stream can ask after every result."""
        with self._cond:
            order = self._result_epochs.get(tenant)
            return [] if order is None else order.since(epoch)

    def add_result_listener(self, listener: ResultListener) -> None:
        """Call ``listener(tenant, block, version)`` whenever a block gets a newer result:
        ``version`` is the snapshot's a worker here solved, None for a result installed from
        elsewhere (:meth:`install_result`). Each solve is told on its own, with its version,
        even when a newer one lands before the listener's thread gets to it.

        It runs on the dispatcher thread, outside the engine's lock: it must be quick and must
        not block (hand the news to another thread, e.g. with ``loop.call_soon_threadsafe``).
        """
        with self._cond:
            self._listeners = [*self._listeners, listener]

    def remove_result_listener(self, listener: ResultListener) -> None:
        with self._cond:
            self._listeners = [f for f in self._listeners if f is not listener]

    def add_capacity_listener(self, listener: CapacityListener) -> None:
        """Call ``listener()`` after the dispatcher started or finished solves (what
        :meth:`capacity` answers may have changed). Same rules as a result listener: it runs on
        the dispatcher thread, must be quick and must not block."""
        with self._cond:
            self._capacity_listeners = [*self._capacity_listeners, listener]

    def remove_capacity_listener(self, listener: CapacityListener) -> None:
        with self._cond:
            self._capacity_listeners = [f for f in self._capacity_listeners if f is not listener]

    def capacity(self, tenant: str = DEFAULT_TENANT) -> tuple[int, int]:
        """``(idle workers, snapshots of tenant waiting for a worker)`` now: what a client
        that pulls snapshots (the continuous schedule) needs to know. Cheap: two counts."""
        with self._cond:
            if self._closing or self._broken is not None:
                return 0, self._coord.queue_depth(tenant)
            free = self._coord.scheduler.free_workers_for(tenant, self._pool.num_workers)
            return free, self._coord.queue_depth(tenant)

    def release_shared(self, segments: Iterable[SharedSegment]) -> None:
        """The daemon no longer serves these client segments (the client detached them or went
        away): results held in them are copied into the engine's own memory now (a result
        overwritten meanwhile is dropped), so that no mapping of a gone client is kept, and
        results still to come for them are copied as they arrive."""
        gone = set(segments)
        if not gone:
            return
        with self._cond:
            self._released.update(gone)
            registry = self._coord.registry
            registry.replace_results(
                lambda r: private_result(r) if r.shm is not None and r.shm.segment in gone else r
            )
            for key in list(registry.keys()):  # the copies now count in the host tier
                held = registry.latest_result(*key)
                if held is not None and held.shm is None and not self._tiers.tracks(key):
                    self._tiers.held(key, held)
            self._enforce_cache()

    def forget(self, tenant: str, job: str) -> list[str]:
        """Forget every block of ``tenant`` that a session of ``job`` submitted last: versions,
        queued snapshots, cached and spilled results; a solve running for one is discarded when
        it ends. Returns the blocks' names."""
        with self._cond:
            blocks = self._coord.registry.blocks_of_job(tenant, job)
            gone = {(tenant, block) for block in blocks}
            for job_id, task in self._jobs.items():
                if task.key in gone:
                    self._forgotten_jobs.add(job_id)
            order = self._result_epochs.get(tenant)
            for block in blocks:
                self._coord.forget(tenant, block)
                self._tiers.forget((tenant, block))
                if order is not None:
                    order.forget(block)
                self._runs_spent.pop((tenant, block), None)
            self._cond.notify_all()
        if blocks:
            logger.info("forgot %d blocks of tenant %r job %r", len(blocks), tenant, job)
        return blocks

    def wait_result(
        self, block: str, min_version: int, timeout_s: float, tenant: str = DEFAULT_TENANT
    ) -> SolveResult | None:
        """Wait up to ``timeout_s`` for an undelivered result with version >= ``min_version``
        and take it.

        Returns None at once when waiting cannot help: the newest result, >= ``min_version``, was
        already delivered; nothing >= ``min_version`` is queued or running (never submitted,
        ignored as stale, or its solve failed); or the engine is closed. A version that was
        superseded in the queue by a newer one still satisfies the wait through the newer one.
        """
        registry = self._coord.registry
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            self._bring_back(tenant, block)
            while True:
                computed = registry.computed_version(tenant, block)
                delivered = registry.delivered_version(tenant, block)
                if computed >= min_version and computed > delivered:
                    return self._coord.take(tenant, block)
                if delivered >= min_version:
                    return None
                in_flight = self._coord.in_flight_version(tenant, block)
                if self._closing or self._broken or in_flight is None or in_flight < min_version:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def peek_result(self, block: str, tenant: str = DEFAULT_TENANT) -> SolveResult | None:
        """The newest computed result of ``block`` (None: none), *not* recorded as delivered:
        for the sync between node daemons, which forwards it to a peer, not to a client."""
        with self._cond:
            self._bring_back(tenant, block)
            return self._coord.registry.latest_result(tenant, block)

    def note_elsewhere(self, task: SolveTask, *, job: str = "") -> None:
        """``task`` arrived here but another daemon solves it (the sync between node daemons):
        the registry counts its version as submitted, nothing is queued, and the same task may
        still be submitted here once if its owner's result does not come."""
        with self._cond:
            self._check_usable()
            self._coord.registry.on_elsewhere(task.tenant, task.block, task.version, job)

    def discarded_versions(self, block: str, tenant: str = DEFAULT_TENANT) -> list[int]:
        """Versions of ``block`` solved here whose result was not kept because a newer or
        equal one was in already (the last 64, oldest first)."""
        with self._cond:
            return list(self._coord.discarded_versions.get((tenant, block), ()))

    def withdraw(self, block: str, tenant: str, max_version: int) -> SolveTask | None:
        """Another daemon solves the queued snapshot of ``block`` (the sync between node
        daemons: a claim its owner granted, or a peer's result of that version or newer came
        first): when the block's queued, not yet running, version is <= ``max_version`` it
        leaves the queue and is returned, counted as submitted here (``note_elsewhere``) and
        accepted once more should it have to be solved here after all; otherwise None."""
        with self._cond:
            self._check_usable()
            return self._coord.withdraw(tenant, block, max_version)

    def install_result(self, result: SolveResult) -> bool:
        """Keep a result computed elsewhere (a peer daemon that owns the block) as the block's
        newest, exactly like one of its own workers': streams serve it, versions never go back.
        False (nothing changes) when it is not newer than the block's computed version."""
        with self._cond:
            self._check_usable()
            registry = self._coord.registry
            if result.version <= registry.computed_version(result.tenant, result.block):
                return False
            if not registry.on_result(result):
                return False
            self._note_result(result.tenant, result.block)
            self._tiers.held(self._coord.registry.key(*result.key), result)
            self._enforce_cache()
            self._cond.notify_all()
            listeners = self._listeners
        self._tell(listeners, [(*result.key, None)])
        return True

    def in_flight_version(self, block: str, tenant: str = DEFAULT_TENANT) -> int | None:
        """The queued (else running) version of ``block``, or None."""
        with self._cond:
            return self._coord.in_flight_version(tenant, block)

    def computed_version(self, block: str, tenant: str = DEFAULT_TENANT) -> int:
        """The newest computed version of ``block`` (-1: none), its own workers' or installed.
        The sync asks it when a peer claims a version: the result listener tells the sync of a
        new result only later, on its event loop, and in between the version is neither queued
        nor running, so it would look as if it had not arrived yet."""
        with self._cond:
            return self._coord.registry.computed_version(tenant, block)

    def usage(self, tenant: str | None = None) -> EngineUsage:
        """What ``tenant`` (None: every tenant) holds in this process now: the daemon's quotas
        and memory budget are checked against it. Cheap: kept as counts, never a scan."""
        with self._cond:
            registry = self._coord.registry
            return EngineUsage(
                queued_bytes=self._coord.held_bytes_of(tenant),
                cached_bytes=registry.host_bytes_of(tenant),
                blocks=len(registry) if tenant is None else registry.blocks_of(tenant),
            )

    def block_versions(self, block: str, tenant: str = DEFAULT_TENANT) -> tuple[bool, int]:
        """Whether the engine knows ``block`` and its newest submitted version (-1: none)."""
        with self._cond:
            registry = self._coord.registry
            return (tenant, block) in registry, registry.submitted_version(tenant, block)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until nothing is queued or running (a daemon draining at
        shutdown); whether that came. False at once when the engine closed or broke."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while True:
                if self._closing or self._broken is not None:
                    return False
                if self._coord.queue_depth() == 0 and self._coord.scheduler.num_running() == 0:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)

    def wait_stopped(self) -> str | None:
        """Block until the engine breaks or closes; the reason it broke (None: it closed).
        For a watcher thread: it costs nothing while it waits."""
        self._stopped.wait()
        with self._cond:
            return self._broken

    def status(self, tenant: str | None = None) -> list[BlockStatus]:
        """Per-block status, of one tenant or all."""
        with self._cond:
            return self._coord.status(tenant, self._tiers.tier)

    def status_page(self, tenant: str, after: str, limit: int) -> tuple[list[BlockStatus], int]:
        """The status of at most ``limit`` of ``tenant``'s blocks, the first by name after
        ``after`` (from the first when empty), and how many blocks the tenant has: what one
        Status answer carries, at the cost of the page, not of every block (the page's queue
        positions are read by rank, the queue is not sorted)."""
        with self._cond:
            return self._coord.status_page(tenant, after, limit, self._tiers.tier)

    def status_table(self, tenant: str, after: str, limit: int) -> tuple[BlockTable, int]:
        """:meth:`status_page` as a :class:`BlockTable`, built mostly without the engine's
        lock: it is held ``STATUS_CHUNK_BLOCKS`` blocks at a time (``STATUS_CHUNK_BLOCKS_ALONE``
        after a chunk found no other tenant queued), to copy their record fields and read
        their queue positions (O(log Q) each), and the table is made after it is released,
        so a status read of thousands of blocks holds up no submit or result for long. The
        last chunk takes a tail of up to an eighth of a chunk more: the one block past the
        servicer's page, which says whether more follow, takes no hold (no wait for the lock
        while clients submit) of its own. The positions are the queue's at each chunk's copy,
        as the records are."""
        columns = empty_status_columns()
        positions: list[int | None] = []
        total, now, size = 0, 0.0, STATUS_CHUNK_BLOCKS
        while len(positions) < limit:
            want = limit - len(positions)
            if want > size + size // 8:
                want = size
            start = columns["block"][-1] if positions else after
            with self._cond:
                chunk, total, now = self._coord.registry.status_columns(
                    tenant, start, want, self._tiers.tiers
                )
                positions += self._coord.scheduler.positions_of(tenant, chunk["block"])
                alone = self._coord.scheduler.num_tenants_queued() <= 1
            size = STATUS_CHUNK_BLOCKS_ALONE if alone else STATUS_CHUNK_BLOCKS
            for name, column in columns.items():
                column += chunk[name]
            if len(chunk["block"]) < want:
                break
        return block_table(tenant, columns, now, positions), total

    def status_summary(self, tenant: str, worst: int = SUMMARY_WORST_BLOCKS) -> BlockSummary:
        """What ``tenant``'s blocks add up to, with its ``worst`` blocks' records: read from the
        counts the registry keeps as blocks change (see ``tally``), in one short hold of the
        lock that does not grow with the blocks held (the spilled ones are counted from the
        spill tier's own table)."""
        registry = self._coord.registry
        with self._cond:
            numbers, names = registry.summary(tenant, worst)
            if not numbers:
                return BlockSummary(worst=BlockTable(tenant))
            spilled = registry.without_result(tenant, self._tiers.spilled_keys())
            shown = registry.status_columns_of(tenant, names, self._tiers.tiers)
            now = registry.now()
        numbers["tier_none"] -= spilled
        return BlockSummary(
            **numbers,
            tier_spill=spilled,
            worst=block_table(tenant, shown, now, None),
        )

    def stats(self, viewer: str | None = None) -> EngineStats:
        """Engine-wide numbers. The workers' block names are shown for tenant ``viewer``'s tasks
        only (None: for none), so a tenant never learns another's block names."""
        with self._cond:
            busy = self._coord.scheduler.num_running()
            return EngineStats(
                incarnation_id=self.incarnation_id,
                uptime_s=time.monotonic() - self._started,
                num_workers=self._pool.num_workers,
                workers_busy=busy,
                workers_idle=max(0, self._pool.num_workers - busy) if not self._closed else 0,
                worker_restarts=self._pool.restarts,
                queue_depth=self._coord.queue_depth(),
                blocks=len(self._coord.registry),
                solves_done=self._coord.solves_done,
                solves_failed=self._coord.solves_failed,
                results_discarded=self._coord.results_discarded,
                seconds_per_n3=self._coord.scheduler.cost_model.seconds_per_n3,
                closed=self._closing,
                broken_reason=self._broken,
                workers=() if self._closed else tuple(self._pool.states(viewer)),
                cache_host_bytes=self._tiers.memory_bytes,
                cache_budget_bytes=self.config.cache_memory_bytes or 0,
                results_spilled=self._tiers.num_spilled,
                spill_bytes=self._tiers.spill_bytes,
                results_dropped=self._tiers.dropped,
            )

    def worker_pids(self) -> list[int]:
        """Pids of the solver processes (for tests and diagnostics)."""
        return self._pool.worker_pids()

    def close(self) -> None:
        """Stop the dispatcher and the workers, unlink shared memory. Idempotent."""
        with self._cond:
            if self._closing:
                already = True
            else:
                already = False
                self._closing = True
                self._stopped.set()
                self._pool.wakeup()
                self._cond.notify_all()
        if already:
            self._thread.join()
            return
        self._thread.join()
        self._pool.close()
        if self._spiller is not None:  # it skips what is left: the files would go at once
            self._spills.put(None)
            self._spiller.join()
        with self._cond:
            self._closed = True
            self._tiers.close()
            self._cond.notify_all()
        atexit.unregister(self.close)
        logger.info("preconditioner engine %s closed", self.incarnation_id)

    def __enter__(self) -> PreconditionerEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ dispatcher thread

    def _check_usable(self) -> None:
        if self._closing:
            raise EngineUnavailableError("the preconditioner engine is closed")
        if self._broken is not None:
            raise EngineUnavailableError(
                f"the preconditioner engine stopped working: {self._broken}; "
                "create a new engine (the optimizer keeps its last good results meanwhile)"
            )

    def _dispatch_loop(self) -> None:
        try:
            while self._dispatch_round():
                pass
        except Exception as exc:
            logger.exception("preconditioner engine dispatcher crashed")
            with self._cond:
                self._broken = f"dispatcher crashed: {type(exc).__name__}: {exc}"
                self._stopped.set()
                self._fail_all_queued(self._broken)
                self._cond.notify_all()

    def _dispatch_round(self) -> bool:
        """Feed idle workers, wait for news, book it; False when the dispatcher must stop.

        A method of its own so that its locals (tasks, results: references to clients'
        segments) are gone while the dispatcher waits for the next round."""
        with self._cond:
            if self._closing:
                return False
            batch = []
            for _ in range(self._pool.num_idle()):
                entry = self._coord.next_task(workers=self._pool.num_workers)
                if entry is None:
                    break
                self._next_job += 1
                self._jobs[self._next_job] = entry.task
                if self._observer is not None:
                    self._dispatched[self._next_job] = self._dispatch_times(entry.task)
                spent = self._runs_spent.pop(entry.task.key, None)
                runs = spent[1] if spent is not None and spent[0] == entry.task.version else 0
                batch.append((self._next_job, entry.task, entry.cost_s, runs))
        failed = []
        for job_id, task, cost_s, runs in batch:  # copies into shared memory: outside the lock
            try:
                self._pool.submit(job_id, task, expected_s=cost_s, runs_spent=runs)
            except EngineUnavailableError as exc:
                failed.append((job_id, task, str(exc)))
        if batch:
            self._tell_capacity()  # fewer idle workers now
        del batch
        events = self._pool.poll(None)  # until a worker speaks, a deadline or a wakeup
        fresh: list[tuple[str, str, int | None]] = []
        with self._cond:
            for job_id, task, why in failed:
                self._jobs.pop(job_id, None)
                if job_id in self._forgotten_jobs:
                    self._forgotten_jobs.discard(job_id)
                    self._coord.discard(task)
                    continue
                self._coord.fail(task, f"block {task.block!r}: {why}")
                self._observe(job_id, task, None)
            for event in events:
                if self._record(event):
                    fresh.append((*event.task.key, event.task.version))
            listeners = self._listeners
            if self._pool.broken_reason is not None and self._broken is None:
                self._broken = self._pool.broken_reason
                self._stopped.set()
            if failed or events or self._broken:
                self._cond.notify_all()
            if self._broken is not None:
                self._fail_all_queued(self._broken)
                return False
        self._tell(listeners, fresh)
        if events or failed:
            self._tell_capacity()  # workers finished
        return True

    def _tell_capacity(self) -> None:
        for listener in self._capacity_listeners:  # replaced whole, never mutated: no lock
            try:
                listener()
            except Exception:  # a listener's bug must not stop the dispatcher
                logger.exception("a capacity listener failed")

    def _record(self, event: PoolEvent) -> bool:
        """Book a finished task; True when its block got a newer result."""
        task = self._jobs.pop(event.job_id, event.task)
        if event.job_id in self._forgotten_jobs:  # its block was forgotten while it ran
            self._forgotten_jobs.discard(event.job_id)
            self._dispatched.pop(event.job_id, None)
            self._coord.discard(task)
            return False
        failed_before = self._coord.solves_failed
        fresh = False
        if event.overwritten:
            self._coord.overwritten(task)
            self._dispatched.pop(event.job_id, None)
            return False
        if event.requeue:
            self._dispatched.pop(event.job_id, None)
            if self._coord.requeue(task):
                self._runs_spent[task.key] = (task.version, event.worker_runs)
            return False
        result = event.result
        if result is not None and result.shm is not None and result.shm.segment in self._released:
            result = private_result(result)
            if result is None:
                self._coord.overwritten(task)
                return False
        if result is not None:
            if self._coord.complete(task, result):
                self._note_result(task.tenant, task.block)
                fresh = True
                self._tiers.held(
                    self._coord.registry.key(*task.key),
                    self._coord.registry.latest_result(*task.key),
                )
                self._enforce_cache()
        else:
            self._coord.fail(task, event.error or "unknown worker failure")
        # complete() turns a malformed result into a failure: count what the coordinator counted.
        ok = self._coord.solves_failed == failed_before
        self._observe(event.job_id, task, result if ok else None)
        return fresh

    def _note_result(self, tenant: str, block: str) -> None:
        """The block got a newer result (lock held): a new epoch, and the block moves to the end
        of its tenant's epochs, which so stay in epoch order for blocks_with_results_since (a
        stream woken per result then reads the blocks newer than it saw, not every block)."""
        self._results_epoch += 1
        self._result_epochs.setdefault(tenant, ArrivalOrder()).note(block, self._results_epoch)

    def _bring_back(self, tenant: str, block: str) -> None:
        """Use the block's result (lock held): a spilled one is brought back into memory
        first (a corrupt one is dropped: its client resubmits)."""
        key = (tenant, block)
        if self._tiers.spilled(key) is None:
            self._tiers.touch(key)
            return
        result = self._tiers.load(key)
        if result is None:
            self._coord.drop_result(tenant, block)
            return
        self._coord.registry.hold(tenant, block, result)
        self._tiers.held(key, result)
        self._enforce_cache()

    def _enforce_cache(self) -> None:
        """Move the least recently used results out of the host tier until it meets its
        budget (lock held; see :mod:`asteria_server.engine.tiers`). Spill files are written by
        the spill thread, without the lock; until then the results stay served from memory."""
        registry = self._coord.registry
        for tenant, block in self._tiers.victims():
            result = registry.latest_result(tenant, block)
            if result is None or result.shm is not None:
                self._tiers.held((tenant, block), result)  # not in the host tier (any more)
            elif self._spiller is None:
                self._tiers.drop((tenant, block))
                self._coord.drop_result(tenant, block)
            elif self._tiers.leaving_bytes >= self._spill_backlog_bytes:
                # The disk is not keeping up: what would wait for it is dropped instead (its
                # client resubmits), so memory stays within the budget plus this backlog.
                self._tiers.drop((tenant, block))
                self._coord.drop_result(tenant, block)
                self._spill_refusals.refused(
                    "a result spill (the disk is behind; the result is dropped and its client "
                    "resubmits)",
                    f"{self._tiers.leaving_bytes} bytes of results already wait for the spill "
                    "directory's disk",
                )
            else:
                path = self._tiers.begin_spill((tenant, block), result)
                self._spills.put(((tenant, block), path))

    def _spill_loop(self) -> None:
        """The spill thread: writes the files :meth:`_enforce_cache` asked for, one at a time,
        outside the engine's lock (a slow or full disk holds up no call), then settles each
        result under the lock."""
        while (item := self._spills.get()) is not None:
            if not self._closing:
                self._spill(*item)

    def _spill(self, key: tuple[str, str], path: Path) -> None:
        # The queue names the block only: a result forgotten or replaced while it waits is
        # not kept alive by it. Nothing of the result stays here once this returns.
        with self._cond:
            result = self._tiers.leaving(key, path)
        if result is None:
            return
        try:
            size: int | None = write_spill_file(path, result)
        except OSError as exc:
            logger.warning("cannot spill a result to %s (%s); dropping it", path, exc)
            size = None
        except Exception:  # a bug here must not end the thread: this result is dropped
            logger.exception("writing spill file %s failed", path)
            size = None
        with self._cond:
            if self._closed:  # the tiers are closed: nobody will ask for the file
                outcome = SpillEnd.KEPT
            else:
                held = self._coord.registry.latest_result(*key) is result
                outcome = self._tiers.end_spill(key, result, size, still_held=held)
            if outcome is SpillEnd.SPILLED:
                self._coord.registry.hold(*key, None)
            elif outcome is SpillEnd.DROPPED:
                self._coord.drop_result(*key)
        if outcome is SpillEnd.KEPT and size is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    @staticmethod
    def _tell(listeners: list[ResultListener], fresh: list[tuple[str, str, int | None]]) -> None:
        for tenant, block, version in fresh:
            for listener in listeners:
                try:
                    listener(tenant, block, version)
                except Exception:  # a listener's bug must not stop the dispatcher
                    logger.exception("a result listener failed")

    def _dispatch_times(self, task: SolveTask) -> tuple[float, float]:
        now = time.monotonic()
        submitted = self._coord.registry.submitted_at(task.tenant, task.block)
        return now, 0.0 if submitted is None else max(0.0, now - submitted)

    def _observe(self, job_id: int, task: SolveTask, result: SolveResult | None) -> None:
        times = self._dispatched.pop(job_id, None)
        if self._observer is None or times is None:
            return
        dispatched_at, wait_s = times
        record = FinishedSolve(
            tenant=task.tenant,
            kind=task.kind,
            refresh=task.is_refresh,
            n=task.n,
            ok=result is not None,
            solve_s=None if result is None else result.solve_time_s,
            wait_s=wait_s,
            run_s=max(0.0, time.monotonic() - dispatched_at),
        )
        try:
            self._observer(record)
        except Exception:  # an observer's bug must not stop the dispatcher
            logger.exception("the solve observer failed; it is no longer called")
            self._observer = None

    def _fail_all_queued(self, why: str) -> None:
        self._dispatched.clear()
        for job_id in list(self._jobs):  # first the running ones: that unblocks their successors
            task = self._jobs.pop(job_id)
            self._coord.fail(task, f"block {task.block!r}: engine stopped: {why}")
        while (entry := self._coord.next_task()) is not None:
            self._coord.fail(entry.task, f"block {entry.task.block!r}: engine stopped: {why}")
