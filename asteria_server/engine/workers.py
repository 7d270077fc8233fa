"""A pool of solver worker processes fed through shared memory; crashes and hangs are survived.

Why processes: SciPy's eigh holds the GIL, so solving in a thread of a training process would
stall it. Why a fresh interpreter (``subprocess``, the default; ``spawn``/``forkserver`` on
request), never ``fork``: the parent may be a torch training process with threads, CUDA state and
locks that a forked child would inherit broken; and unlike spawn, a fresh ``python -m`` child
does not re-import the training script (see :mod:`asteria_server.engine.launch`).

Data path: each worker slot owns one input and one output shared-memory segment, created by the
pool (see :mod:`asteria_server.engine.shm` for ownership), sized for the largest n seen and
replaced by a larger one when needed. The pipe to the worker carries only small metadata; the
factor (and basis) go in through the input segment, the result comes back through the output one.

Fault handling: a worker that dies (signal, ``os._exit``), stops answering within its task's
timeout, or breaks its pipe is killed and replaced in the same slot; its task is run again up to
``max_worker_attempts`` runs, then reported failed. A solver error (bad input, numerics that no
retry fixed) is reported at once. The pool keeps serving throughout.

The timeout scales with the task: ``max(solve_timeout_floor_s, solve_timeout_factor * expected)``
where ``expected`` is the cost model's estimate, capped by ``solve_timeout_s``. So a stopped or
hung worker holds its slot for a bounded multiple of what its block should cost (an n=1024 solve
that stops is replaced after the floor, not after ten minutes), and the blocks queued behind it,
of every tenant, are served again as soon as its replacement is up: a task that timed out is not
run again in its slot at once but handed back (``PoolEvent.requeue``) for the engine to queue
behind the work that waited meanwhile. :meth:`WorkerPool.states`
shows each worker's block and how long it has run; one past twice its estimate is ``overdue``,
one whose process is stopped by a signal (SIGSTOP, a debugger) is ``stopped``. An idle worker
found stopped when a task is dispatched is replaced at once instead of being given the task.

Spares: while a worker is overdue, the pool runs one **spare** worker beside it (at most as many
spares as configured workers), so the blocks queued behind a stuck or far-too-slow solve — of
every tenant — are served at once, not after its timeout; a spare retires when it is idle and no
worker is overdue any more. So a pool always has a worker not held by a block far beyond its
expected cost.

Threading: the pool belongs to one thread (the engine's dispatcher). Only :meth:`WorkerPool.wakeup`
and :meth:`WorkerPool.states` (a racy but consistent-per-worker read) may be called from others.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import multiprocessing.connection as mpc
import os
import select
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from asteria_server.engine import faults
from asteria_server.engine.launch import START_METHODS, WorkerHandle, start_worker
from asteria_server.engine.shm import (
    SEGMENT_PREFIX,
    input_bytes,
    output_bytes,
    pool_segment,
    send_segment_fds,
)
from asteria_server.engine.solvers import SolverConfig
from asteria_server.errors import EngineUnavailableError
from asteria_server.protocol.shm import (
    RESULT_FIELDS,
    Segment,
    payload_bytes,
    result_field_spec,
    result_layout,
    snapshot_specs,
)
from asteria_server.types import (
    SharedArrays,
    SharedSegment,
    SolveResult,
    SolveTask,
    WorkerState,
)

logger = logging.getLogger(__name__)

#: consecutive worker deaths before ever becoming ready, after which the pool gives up.
MAX_START_FAILURES = 3
#: segments one worker keeps mapped (besides those dropped as soon as nothing holds them). A
#: client has two per block; with fewer than that, a model of a few hundred blocks had every
#: task hand its segments over, map and fault them in again (about 0.3 ms per solve at n=256).
#: A mapping of a live client segment costs the worker only page tables; this many stay far
#: below Linux's default 65530 mappings per process (vm.max_map_count).
MAX_MAPPED_PER_WORKER = 8192
#: a pool segment larger than this is released when its task is done (made again when needed):
#: an input segment this size holds n=1024 fp64 snapshots; larger ones are rare and slow anyway.
KEEP_SEGMENT_BYTES = 24 << 20


def _note_death(died: set[int], token: int, _: object) -> None:
    """A handed segment's weak-reference callback: its token joins its slot's ``died`` set."""
    died.add(token)


def _where(segment: SharedSegment) -> tuple[int, int, int]:
    """How a worker finds ``segment``: its mapping's token, its slot index there (-1: the whole
    mapping) and its size."""
    return (segment.token, segment.slot_index, segment.size_bytes)


def _process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal or a tracer (``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # "pid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ")".
    fields = stat[stat.rfind(b")") + 1 :].split()
    return bool(fields) and fields[0] in (b"T", b"t")


def default_num_workers() -> int:
    """The host's spare cores: usable CPUs minus one for the training process, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus - 1)


def check_cpu_affinity(owner: str, value: object) -> tuple[int, ...] | None:
    """``value`` as a sorted tuple of this host's CPU numbers, or None; a ValueError naming
    ``owner`` (e.g. ``PoolConfig.cpu_affinity``) and the value otherwise.

    Not checked against this thread's own affinity: a trainer pinned to CPU 0 may well give its
    workers CPU 1. Outside the process's cpuset, the pinning fails with a warning at start.
    """
    if value is None:
        return None
    num_cpus = os.cpu_count() or 1
    if not isinstance(value, tuple | list | set | frozenset) or not value:
        raise ValueError(f"{owner} must be None or a non-empty tuple of CPU numbers, got {value!r}")
    cpus = list(value)
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cpus):
        raise ValueError(f"{owner} must hold CPU numbers (ints >= 0), got {value!r}")
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{owner} names a CPU twice: {value!r}")
    missing = sorted(c for c in cpus if c >= num_cpus)
    if missing:
        raise ValueError(
            f"{owner}={value!r} names CPU(s) {missing} this host does not have "
            f"(it has {num_cpus}: 0 to {num_cpus - 1})"
        )
    return tuple(sorted(cpus))


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """Configuration of :class:`WorkerPool`.

    Attributes:
        num_workers: worker processes (default: usable CPUs - 1, at least 1).
        blas_threads: BLAS threads per worker (oversubscribed BLAS runs many times slower).
        niceness: added to the workers' nice value (0-19): solves yield to training on a busy
            host.
        solve_timeout_s: the cap of every solve's timeout (``math.inf``: none); a solve running
            past its timeout is killed and retried.
        solve_timeout_floor_s: the least timeout of a solve with a cost estimate.
        solve_timeout_factor: a solve with a cost estimate times out after this many times its
            estimate (or the floor, whichever is longer).
        max_worker_attempts: runs of one task lost to a crash or timeout before it fails.
        start_timeout_s: a worker not ready this long after its start is replaced.
        start_method: ``"subprocess"`` (default), ``"spawn"`` or ``"forkserver"``; never fork
            (see the module docstring and :mod:`asteria_server.engine.launch`).
        solver: tolerances and numeric retries of the solver inside each worker.
        segment_prefix: name prefix of the pool's shared-memory segments.
        cpu_affinity: CPUs the workers may run on (None: the parent's); e.g. the cores a
            trainer pinned to core 0 leaves free, so that solves never share its core.
        test_fault_prefix: TEST-ONLY fault injection (see :mod:`asteria_server.engine.faults`);
            None, the default, disables it.
    """

    num_workers: int = field(default_factory=default_num_workers)
    blas_threads: int = 1
    niceness: int = 10
    solve_timeout_s: float = 600.0
    solve_timeout_floor_s: float = 30.0
    solve_timeout_factor: float = 20.0
    max_worker_attempts: int = 2
    start_timeout_s: float = 60.0
    start_method: str = "subprocess"
    solver: SolverConfig = field(default_factory=SolverConfig)
    segment_prefix: str = SEGMENT_PREFIX
    cpu_affinity: tuple[int, ...] | None = None
    test_fault_prefix: str | None = None

    def timeout_for(self, expected_s: float | None) -> float:
        """The timeout of a solve the cost model expects to take ``expected_s`` (None: the cap)."""
        if expected_s is None or not math.isfinite(expected_s):
            return self.solve_timeout_s
        scaled = max(self.solve_timeout_floor_s, self.solve_timeout_factor * expected_s)
        return min(self.solve_timeout_s, scaled)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "cpu_affinity", check_cpu_affinity("PoolConfig.cpu_affinity", self.cpu_affinity)
        )
        if not isinstance(self.niceness, int) or not 0 <= self.niceness <= 19:
            raise ValueError(
                f"PoolConfig.niceness must be an int in [0, 19], got {self.niceness!r}"
            )
        for name in ("num_workers", "blas_threads", "max_worker_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PoolConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("solve_timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or math.isnan(value) or value <= 0:
                raise ValueError(f"PoolConfig.{name} must be a number > 0, got {value!r}")
        for name in ("solve_timeout_floor_s", "solve_timeout_factor"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"PoolConfig.{name} must be a number, got {value!r}")
            if not 0 < value < math.inf:
                raise ValueError(f"PoolConfig.{name} must be a finite number > 0, got {value!r}")
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"PoolConfig.start_method must be one of {START_METHODS}, got {self.start_method!r}"
            )


#: A solve running longer than ``OVERDUE_FACTOR`` times its estimate (and ``OVERDUE_MIN_S``) is
#: overdue: shown so in status, and a spare worker takes its place meanwhile.
OVERDUE_FACTOR = 2.0
OVERDUE_MIN_S = 1.0


def _overdue_after(job: _Job) -> float:
    """Seconds after which ``job``'s run is overdue."""
    return max(OVERDUE_MIN_S, OVERDUE_FACTOR * (job.expected_s or 0.0))


# slots: one is made per task solved, a transient of every refresh
@dataclass(frozen=True, slots=True)
class PoolEvent:
    """A task's end: ``result`` on success, else ``error`` says why (after all retries);
    ``overwritten``: neither, its snapshot was overwritten by a newer one before it was read;
    ``requeue``: neither, its worker timed out and it has runs left: queue it again (with
    ``worker_runs`` runs spent), behind what waited meanwhile."""

    job_id: int
    task: SolveTask
    result: SolveResult | None
    error: str | None
    worker_runs: int
    overwritten: bool = False
    requeue: bool = False


@dataclass
class _Job:
    job_id: int
    task: SolveTask
    runs: int = 1  # worker runs, counting the current one
    expected_s: float | None = None  # the cost model's estimate of one run
    timeout_s: float = math.inf  # a run lasting longer is killed
    result_to: SharedSegment | None = None  # where the current run writes its result


@dataclass
class _Slot:
    index: int
    process: WorkerHandle | None = None
    conn: mpc.Connection | None = None
    ready: bool = False
    started_at: float = 0.0
    job: _Job | None = None
    sent_at: float | None = None  # when the current job reached a ready worker
    inp: Segment | None = None
    out: Segment | None = None
    names: dict[int, str] = field(default_factory=dict)  # own segments' token -> name
    #: segments the current worker process maps, by token (oldest first), as weak references:
    #: one that died (its client let go of it) is unmapped at the worker's next task
    handed: OrderedDict[int, weakref.ref[Any]] = field(default_factory=OrderedDict)
    #: tokens of handed segments that died since (added by their weak references' callbacks,
    #: in whichever thread dropped the last reference): the next task's release list, without
    #: a look at every mapped segment per task (8192 of them may be mapped)
    died: set[int] = field(default_factory=set)


class WorkerPool:
    """Worker processes solving :class:`SolveTask` s; see the module docstring."""

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config if config is not None else PoolConfig()
        self._wake_r, self._wake_w = os.pipe()
        self._wake_pending = False  # a wakeup byte was written and not drained yet
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._slots = [_Slot(i) for i in range(self.config.num_workers)]
        self._events: list[PoolEvent] = []
        #: what :meth:`poll` waits on, kept between calls (one ``poll`` syscall a round, not a
        #: selector built per wait and per pipe checked): rebuilt when a slot's pipe or process
        #: changes, which ``_watched`` (the fds it was built for) tells
        self._poller = select.poll()
        self._watched: tuple[int, ...] = ()
        self._closed = False
        self._start_failures = 0
        self.broken_reason: str | None = None
        self.restarts = 0
        self.spares_started = 0  # spare workers started beside overdue ones, all time
        self.segment_names_created: list[str] = []
        try:
            for slot in self._slots:
                self._spawn(slot)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ queries

    @property
    def num_workers(self) -> int:
        return len(self._slots)

    def num_idle(self) -> int:
        """Slots free for a new task (0 once the pool is broken or closed)."""
        if self._closed or self.broken_reason is not None:
            return 0
        return sum(1 for s in self._slots if s.job is None)

    def num_busy(self) -> int:
        return sum(1 for s in self._slots if s.job is not None)

    def worker_pids(self) -> list[int]:
        """Pids of the current worker processes (tests check they are gone after close)."""
        return [s.process.pid for s in self._slots if s.process is not None and s.process.pid]

    def segment_names(self) -> list[str]:
        """Names of the pool's own live shared-memory segments."""
        return [
            s.names[seg.token] for s in self._slots for seg in (s.inp, s.out) if seg is not None
        ]

    # ------------------------------------------------------------------ lifecycle

    def _spawn(self, slot: _Slot) -> None:
        process, parent_conn = start_worker(
            self.config.start_method,
            self.config.blas_threads,
            self.config.solver,
            f"asteria-solver-{slot.index}",
            self.config.niceness,
            self.config.cpu_affinity,
        )
        slot.process, slot.conn, slot.ready = process, parent_conn, False
        slot.handed = OrderedDict()  # a new process: it maps no segment yet
        slot.died = set()
        slot.started_at, slot.sent_at = time.monotonic(), None

    def _kill(self, slot: _Slot) -> int | None:
        process, conn = slot.process, slot.conn
        slot.process = slot.conn = None
        slot.ready = False
        if conn is not None:
            conn.close()
        if process is None:
            return None
        if process.is_alive():
            process.kill()
        process.join(timeout=5.0)
        code = process.exitcode
        if code is not None:
            process.close()
        return code

    def close(self) -> None:
        """Stop every worker, unlink every segment (idempotent). Running solves are killed."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:  # ask idle workers to leave politely
            if slot.conn is not None and slot.ready and slot.job is None:
                with contextlib.suppress(OSError):
                    slot.conn.send(None)
        deadline = time.monotonic() + 2.0
        for slot in self._slots:
            if slot.process is not None and slot.job is None and slot.ready:
                slot.process.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill(slot)
            for seg in (slot.inp, slot.out):
                if seg is not None:
                    seg.close()
            slot.inp = slot.out = None
            slot.handed.clear()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def wakeup(self) -> None:
        """Interrupt a :meth:`poll` in progress (thread-safe, never blocks)."""
        if self._closed:
            return
        if self._wake_pending:
            return  # a byte is in the pipe: poll wakes anyway (one write, not one a submit)
        self._wake_pending = True
        with contextlib.suppress(OSError):  # BlockingIOError: a wakeup is already pending
            os.write(self._wake_w, b"!")

    # ------------------------------------------------------------------ submitting

    def states(self, viewer: str | None = None) -> list[WorkerState]:
        """Each worker now (see the module docstring). Block names are shown only for tasks of
        tenant ``viewer`` (None: for none)."""
        now = time.monotonic()
        out = []
        for slot in self._slots:
            process, job, sent_at = slot.process, slot.job, slot.sent_at  # read once each
            pid = process.pid if process is not None and process.pid else 0
            if pid == 0 or not slot.ready:
                state = "starting"
            elif job is None:
                state = "idle"
            else:
                state = "busy"
            elapsed = 0.0
            if job is not None and sent_at is not None:
                elapsed = max(0.0, now - sent_at)
                if elapsed > _overdue_after(job):
                    state = "overdue"
            if pid and _process_stopped(pid):
                state = "stopped"
            shown = job is not None and viewer is not None and job.task.tenant == viewer
            out.append(
                WorkerState(
                    index=slot.index,
                    pid=pid,
                    state=state,
                    block=job.task.block if shown and job is not None else "",
                    n=0 if job is None else job.task.n,
                    elapsed_s=elapsed,
                    expected_s=0.0 if job is None or job.expected_s is None else job.expected_s,
                    timeout_s=0.0 if job is None else job.timeout_s,
                )
            )
        return out

    def submit(
        self,
        job_id: int,
        task: SolveTask,
        *,
        expected_s: float | None = None,
        runs_spent: int = 0,
    ) -> None:
        """Start ``task`` on an idle worker (it waits in the slot if the worker is starting).

        ``expected_s``, the cost model's estimate, sets its timeout (see the module docstring);
        ``runs_spent``: worker runs of this task already lost to timeouts.
        """
        if self._closed:
            raise EngineUnavailableError("the worker pool is closed")
        if self.broken_reason is not None:
            raise EngineUnavailableError(f"the worker pool is broken: {self.broken_reason}")
        while True:
            slot = min(
                (s for s in self._slots if s.job is None),
                key=lambda s: (not s.ready, s.index),
                default=None,
            )
            if slot is None:
                raise EngineUnavailableError("no idle worker (the caller must check num_idle())")
            pid = slot.process.pid if slot.process is not None else None
            if not (slot.ready and pid and _process_stopped(pid)):
                break
            # An idle worker known to be stopped (SIGSTOP, a debugger) would hold this task
            # until its timeout: replace it now (one /proc read per dispatch); the new one is
            # not ready yet, so another ready worker, if any, is taken first.
            self._lost_worker(slot, "its process was stopped (SIGSTOP or a tracer) while idle")
        self._ensure_segments(slot, task.n)
        timeout = self.config.timeout_for(expected_s)
        slot.job = _Job(job_id, task, runs=runs_spent + 1, expected_s=expected_s, timeout_s=timeout)
        if slot.ready:
            self._send(slot)

    def _ensure_segments(self, slot: _Slot, n: int) -> None:
        need_in, need_out = input_bytes(n), output_bytes(n)
        if slot.inp is None or slot.inp.size_bytes < need_in:
            slot.inp = self._new_segment(slot, slot.inp, need_in)
        if slot.out is None or slot.out.size_bytes < need_out:
            slot.out = self._new_segment(slot, slot.out, need_out)

    def _new_segment(self, slot: _Slot, old: Segment | None, size: int) -> Segment:
        name, new = pool_segment(size, prefix=self.config.segment_prefix)
        self.segment_names_created.append(name)
        slot.names[new.token] = name
        if old is not None:
            slot.names.pop(old.token, None)
            old.close()
        return new

    def _send(self, slot: _Slot) -> None:
        job, conn = slot.job, slot.conn
        assert (
            job is not None and conn is not None and slot.inp is not None and slot.out is not None
        )
        task, n = job.task, job.task.n
        specs = snapshot_specs(task)
        source: SharedSegment
        if task.shm_source is not None:  # the client's segment: read by the worker itself
            source, sequence = task.shm_source.segment, task.shm_source.sequence
        else:
            source = slot.inp
            sequence = slot.inp.write(
                specs, [a for a in (task.matrix, task.basis) if a is not None]
            )
        result_to: SharedSegment = slot.out
        if task.shm_result is not None and self._fits(task.shm_result.segment, task):
            result_to = task.shm_result.segment
        job.result_to = result_to
        using = [source, result_to]
        basis_from = None
        if task.shm_basis is not None:  # the basis: the block's last result, in a client's segment
            using.append(task.shm_basis.segment)
            spec = result_field_spec("matrix", n)
            basis_from = (
                _where(task.shm_basis.segment),
                task.shm_basis.sequence,
                (spec.dtype.str, spec.shape),
            )
        release, hand = self._hand_plan(slot, using)
        fault = faults.fault_for(task.block, self.config.test_fault_prefix, job.runs)
        msg = {
            "job": job.job_id,
            "block": task.block,
            "tenant": task.tenant,
            "version": task.version,
            "kind": task.kind.value,
            "n": n,
            "exponent": float(task.exponent),
            "epsilon": float(task.epsilon),
            "base_version": task.base_version,
            "snapshot": (_where(source), sequence, [(s.dtype.str, s.shape) for s in specs]),
            "result": _where(result_to),
            "basis_from": basis_from,
            "release": release,
            "map": [(seg.token, seg.size_bytes) for seg in hand],  # their fds follow
            "fault": None if fault is None else fault.value,
        }
        slot.sent_at = time.monotonic()
        try:
            conn.send(msg)
            send_segment_fds(conn, [seg.fileno() for seg in hand])
        except OSError:
            self._lost_worker(slot, "its pipe broke while sending the task")

    @staticmethod
    def _fits(segment: SharedSegment, task: SolveTask) -> bool:
        """Whether any result of ``task`` fits ``segment`` (else it comes back through the pool's
        own segment and is sent in chunks)."""
        return payload_bytes(result_layout(task.n, task.kind)) <= segment.size_bytes - 4096

    @staticmethod
    def _hand_plan(
        slot: _Slot, using: list[SharedSegment]
    ) -> tuple[list[int], list[SharedSegment]]:
        """Which segments the worker should unmap (tokens) and which it must be handed (their
        descriptors follow the message), to use the segments ``using`` now."""
        handed, died = slot.handed, slot.died
        hand: list[SharedSegment] = []
        for seg in (s.mapping for s in using):  # an arena slot: its arena is what is mapped
            if seg.token in handed:
                handed.move_to_end(seg.token)
            elif seg not in hand:
                hand.append(seg)
                handed[seg.token] = weakref.ref(
                    seg, functools.partial(_note_death, died, seg.token)
                )
        in_use = {seg.token for seg in using}
        release = []
        while died:
            token = died.pop()
            ref = handed.get(token)
            if ref is not None and ref() is None and token not in in_use:
                release.append(token)
        for token in handed:
            if len(handed) - len(release) <= MAX_MAPPED_PER_WORKER:
                break
            if token not in in_use and token not in release:
                release.append(token)
        for token in release:
            del handed[token]
        return release, hand

    # ------------------------------------------------------------------ polling

    def poll(self, timeout_s: float | None) -> list[PoolEvent]:
        """Wait up to ``timeout_s`` (None: no limit; less if a worker speaks or dies, a solve or
        start deadline passes, or :meth:`wakeup` comes first) and return the tasks that ended."""
        if self._closed:
            return []
        now = time.monotonic()
        wait_s = None if timeout_s is None else max(0.0, timeout_s)
        for slot in self._slots:
            for limit in (self._deadline(slot), self._overdue_at(slot)):
                if limit is not None:
                    left = max(0.0, limit - now)
                    wait_s = left if wait_s is None else min(wait_s, left)
        if wait_s is not None and math.isinf(wait_s):
            wait_s = None  # a solve timeout of math.inf
        if self._events:
            wait_s = 0.0  # news to return already: only look
        ready = {fd for fd, _ in self._watch().poll(None if wait_s is None else wait_s * 1e3)}
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            # After the drain: a wakeup between the two wrote nothing, but its work is seen by
            # the caller's look at the queue after this poll returns.
            self._wake_pending = False
        for slot in list(self._slots):
            conn, process = slot.conn, slot.process
            if conn is not None and process is not None:
                self._service(slot, conn.fileno() in ready, process.sentinel in ready)
        self._enforce_deadlines()
        self._balance_spares()
        events, self._events = self._events, []
        return events

    def _watch(self) -> select.poll:
        """The poller, watching the wakeup pipe and every worker's pipe and process."""
        fds = [self._wake_r]
        for slot in self._slots:
            if slot.conn is not None and slot.process is not None:
                fds += [slot.conn.fileno(), slot.process.sentinel]
        watched = tuple(fds)
        if watched != self._watched:
            self._poller = select.poll()
            for fd in watched:
                self._poller.register(fd, select.POLLIN)
            self._watched = watched
        return self._poller

    def _overdue_at(self, slot: _Slot) -> float | None:
        """When the slot's running solve becomes overdue (None: nothing runs)."""
        job, sent_at = slot.job, slot.sent_at
        if job is None or sent_at is None or slot.process is None:
            return None
        return sent_at + _overdue_after(job)

    def _balance_spares(self) -> None:
        """One spare worker per overdue one, at most ``num_workers`` of them; an idle spare
        retires once fewer workers are overdue than spares run."""
        if self._closed or self.broken_reason is not None:
            return
        now = time.monotonic()
        overdue = sum(
            1 for s in self._slots if (at := self._overdue_at(s)) is not None and now >= at
        )
        base = self.config.num_workers
        spares = [s for s in self._slots if s.index >= base]
        if overdue > len(spares) and len(spares) < base:
            slot = _Slot(max(s.index for s in self._slots) + 1)
            self._slots.append(slot)
            self.spares_started += 1
            logger.warning(
                "%d solver worker(s) overdue: starting spare worker %d so queued blocks are "
                "served meanwhile",
                overdue,
                slot.index,
            )
            self._spawn(slot)
        elif overdue < len(spares):
            idle = next((s for s in reversed(spares) if s.job is None), None)
            if idle is not None:
                self._retire(idle)

    def _retire(self, slot: _Slot) -> None:
        """Stop a spare worker and drop its slot (it is idle)."""
        if slot.conn is not None and slot.ready:
            with contextlib.suppress(OSError):
                slot.conn.send(None)  # leave politely
        self._kill(slot)
        for seg in (slot.inp, slot.out):
            if seg is not None:
                seg.close()
        slot.inp = slot.out = None
        slot.handed.clear()
        self._slots.remove(slot)

    def _deadline(self, slot: _Slot) -> float | None:
        if slot.process is None:
            return None
        if not slot.ready:
            return slot.started_at + self.config.start_timeout_s
        if slot.job is not None and slot.sent_at is not None:
            return slot.sent_at + slot.job.timeout_s
        return None

    def _service(self, slot: _Slot, said: bool, ended: bool) -> None:
        """Read what a worker said, when its pipe is readable (one message: a worker says one
        thing per task, and the poller reports a pipe with more again at once); notice if it
        died, when its process's sentinel is."""
        conn = slot.conn
        if conn is None:
            return
        if said:
            try:
                self._handle(slot, conn.recv())
            except (EOFError, OSError):
                self._lost_worker(slot, "it closed its pipe")
                return
            if slot.conn is not conn:
                return
        if ended and slot.process is not None and not slot.process.is_alive():
            self._lost_worker(slot, "it exited")

    def _handle(self, slot: _Slot, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "ready":
            slot.ready = True
            self._start_failures = 0
            if slot.job is not None:
                self._send(slot)
            return
        job = slot.job
        if job is None or msg[1] != job.job_id:
            logger.warning("worker %d sent an unexpected message %r; ignored", slot.index, kind)
            return
        slot.job, slot.sent_at = None, None
        if kind == "done":
            self._events.append(self._collect(slot, job, msg[2]))
        elif kind == "overwritten":
            self._events.append(PoolEvent(job.job_id, job.task, None, None, job.runs, True))
        else:
            self._events.append(PoolEvent(job.job_id, job.task, None, str(msg[2]), job.runs))
        self._shrink(slot)

    def _shrink(self, slot: _Slot) -> None:
        """Let go of a segment of the slot's grown past :data:`KEEP_SEGMENT_BYTES` once its task
        is done: one big block must not pin its size in shared memory for the daemon's life. The
        worker unmaps it at its next task (its reference here was the last)."""
        for name in ("inp", "out"):
            seg = getattr(slot, name)
            if seg is not None and seg.size_bytes > KEEP_SEGMENT_BYTES:
                setattr(slot, name, None)
                slot.names.pop(seg.token, None)
                seg.close()

    def _collect(self, slot: _Slot, job: _Job, meta: dict[str, Any]) -> PoolEvent:
        task, n, sequence = job.task, job.task.n, int(meta["sequence"])
        names = [name for name in RESULT_FIELDS if name in meta["fields"]]
        specs = [result_field_spec(name, n) for name in names]
        segment = job.result_to
        shm = None
        if segment is slot.out and slot.out is not None:  # ours: copied out, the one buffer
            arrays = slot.out.read(specs, sequence)
            if arrays is None:  # only this pool writes there; a worker killed mid-write?
                return PoolEvent(job.job_id, task, None, "result segment was torn", job.runs)
        else:  # the client's: where the client will read it (stand-ins of its arrays here)
            assert isinstance(segment, Segment) and task.shm_result is not None
            arrays = segment.stand_ins(specs)
            shm = SharedArrays(segment, task.shm_result.segment_id, sequence)
        by_name = dict(zip(names, arrays, strict=True))
        result = SolveResult(
            block=task.block,
            version=task.version,
            kind=task.kind,
            matrix=by_name["matrix"],
            eigenvalues=by_name.get("eigenvalues"),
            permutation=by_name.get("permutation"),
            rotation=by_name.get("rotation"),
            base_version=int(meta.get("base_version", task.base_version)),
            epsilon_used=float(meta["epsilon_used"]),
            solve_time_s=float(meta["solve_time_s"]),
            attempts=int(meta["attempts"]) + job.runs - 1,
            tenant=task.tenant,
            shm=shm,
        )
        return PoolEvent(job.job_id, task, result, None, job.runs)

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            limit = self._deadline(slot)
            if limit is None or now < limit:
                continue
            if slot.ready and slot.job is not None:
                job = slot.job
                expected = "" if job.expected_s is None else f", expected {job.expected_s:.3g} s"
                self._lost_worker(
                    slot,
                    f"its solve of n={job.task.n} exceeded its {job.timeout_s:.3g} s timeout"
                    f"{expected}",
                    timed_out=True,
                )
            else:
                self._lost_worker(
                    slot, f"it did not start within {self.config.start_timeout_s:g} s"
                )

    def _lost_worker(self, slot: _Slot, why: str, *, timed_out: bool = False) -> None:
        """Kill and replace a worker; run its task again (a timed-out one: hand it back to be
        queued behind the others) or report it failed."""
        was_ready = slot.ready
        code = self._kill(slot)
        job, slot.job, slot.sent_at = slot.job, None, None
        if not was_ready:
            self._start_failures += 1
        detail = f"solver worker {slot.index} was lost: {why} (exit code {code})"
        if self._start_failures >= MAX_START_FAILURES:
            self.broken_reason = (
                f"{self._start_failures} solver workers died before becoming ready; last: {detail}"
            )
            logger.error("worker pool broken: %s", self.broken_reason)
        else:
            self.restarts += 1
            logger.warning("%s; restarting it", detail)
            self._spawn(slot)
        if job is None:
            return
        task = job.task
        if self.broken_reason is None and job.runs < self.config.max_worker_attempts:
            if timed_out:
                self._events.append(PoolEvent(job.job_id, task, None, None, job.runs, requeue=True))
                return
            job.runs += 1
            slot.job = job
            return  # sent when the new worker says it is ready
        self._events.append(
            PoolEvent(
                job.job_id,
                task,
                None,
                f"block {task.block!r} version {task.version}: {detail}; "
                f"gave up after {job.runs} worker run(s)",
                job.runs,
            )
        )
        if self.broken_reason is not None:
            for other in self._slots:
                if other.job is not None:
                    j, other.job = other.job, None
                    self._events.append(
                        PoolEvent(j.job_id, j.task, None, self.broken_reason, j.runs)
                    )
