"""`asteria bench throughput`: how many solves per second the daemon delivers for a batch of blocks,
against the same LAPACK calls in a bare loop with the same number of processes.

For each size n and solve kind, a batch of B random SPD float32 factors (``G G^T / n`` plus a small
ridge, like Kronecker factors) is solved round after round on both sides:

- daemon: a real ``asteria-server`` (``--workers W --blas-threads 1``) on a private Unix socket;
  one session submits all B snapshots (a new version each round) and a results stream receives
  them, over shared memory as a client on the same host does by default (written into the
  blocks' segments and announced in one AnnounceSnapshots call, as the daemon source sends one
  step's snapshots; ``--transport grpc``: in gRPC chunks, one call each); a round is timed from
  the first submit to the arrival of the last result;
- bare: W spawned processes with 1 BLAS thread each, at the daemon workers' nice value and
  with their C allocator settings (``asteria_server.malloc.tune_solver_allocator``: process
  configuration, like the thread count, not work Asteria adds), each running on its share of
  the same batch exactly the LAPACK/BLAS calls the engine's solver makes (``scipy.linalg.eigh``
  in float64 with the ``evd`` driver; for an inverse root also the one product
  ``U diag(lam^-p) U^T``, as the solver makes it: ``B B^T`` with ``B = U diag(lam^(-p/2))``),
  without Asteria's validation, copies or IPC;
- solver alone: W more such processes that run the engine's own solver (``EighSolver``: its
  input checks, the solve, its output checks, the conversion into a float32 result array) on
  the same shares, with no daemon, segments or messages: the floor under the daemon's CPU per
  solve that no transport work can lower.

Rounds of the three sides alternate (the machine is shared and noisy), after one warm-up round
each.
The figure is ratio = bare median round time / daemon median round time = daemon solves/s over
bare solves/s. Target (issue: benchmarks): ratio >= 0.95.

This process flushes subnormal floats to zero unless --no-flush-denormal, like every benchmark;
the timed solves run in the daemon's workers and the bare processes, which it does not reach
(neither side flushes, so the comparison stays like for like). The setting is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from asteria_client.bench import output
from asteria_client.bench.stats import summarize
from asteria_client.tables import markdown_table, text_table
from asteria_server.types import SolveKind

logger = logging.getLogger(__name__)

RATIO_TARGET = 0.95
#: Ridge added to every factor (relative to its unit-scale spectrum).
RIDGE = 1e-3
#: The engine solver's LAPACK driver for a first attempt (``solvers.eigh_fp64``).
EIGH_DRIVER = "evd"
#: Epsilon and exponent of the tasks (``SolveTask`` defaults: Shampoo order 2).
EPSILON = 1e-12
EXPONENT = 0.25
#: How long the daemon may take to return one round, beyond its expected time.
ROUND_SLACK_S = 120.0
#: Largest batch the calibration may choose.
MAX_BATCH = 4096
#: Fewest blocks per process the calibration may choose (one straggler skews shorter rounds).
MIN_BLOCKS_PER_WORKER = 3


def worker_niceness() -> int:
    """The nice value of the engine's solver workers (the daemon's default)."""
    from asteria_client.runtime.embedded import EngineConfig

    return EngineConfig().worker_niceness


@dataclass(frozen=True, kw_only=True)
class ThroughputConfig:
    """What to measure.

    Attributes:
        sizes: factor dimensions n.
        kinds: solve kinds to measure at each n.
        workers: daemon solver processes, and bare processes.
        rounds: timed rounds per side and (n, kind), after one warm-up round each.
        target_round_s: the batch size B per n is chosen so that a bare round takes about this.
        batch: a fixed B for every n instead (None: calibrated from ``target_round_s``).
        bare_niceness: nice value of the bare processes (default: the daemon workers' value).
        seed: seeds the factors.
        transport: ``shm`` (shared memory, a same-host client's default) or ``grpc``.
        flush_denormal: flush subnormal floats to zero in this process (not in the solvers).
    """

    sizes: tuple[int, ...] = (256, 512, 1024)
    kinds: tuple[SolveKind, ...] = (SolveKind.EIGENBASIS, SolveKind.INVERSE_ROOT)
    workers: int = 2
    rounds: int = 5
    target_round_s: float = 1.5
    batch: int | None = None
    bare_niceness: int = field(default_factory=lambda: worker_niceness())
    seed: int = 0
    transport: str = "shm"
    flush_denormal: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.flush_denormal, bool):
            raise ValueError(f"flush_denormal must be True or False, got {self.flush_denormal!r}")
        if self.transport not in ("shm", "grpc"):
            raise ValueError(f"transport must be shm or grpc, got {self.transport!r}")
        if not self.sizes or any(not isinstance(n, int) or n < 2 for n in self.sizes):
            raise ValueError(f"sizes must be integers >= 2, got {self.sizes!r}")
        if not self.kinds:
            raise ValueError("kinds must name at least one solve kind")
        for name in ("workers", "rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 < self.target_round_s < math.inf:
            raise ValueError(f"target_round_s must be > 0, got {self.target_round_s!r}")
        if self.batch is not None and not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"batch must be in [1, {MAX_BATCH}], got {self.batch!r}")
        if not 0 <= self.bare_niceness <= 19:
            raise ValueError(f"bare_niceness must be in [0, 19], got {self.bare_niceness!r}")


# --------------------------------------------------------------------------- the factors


def make_factor(n: int, seed: int, index: int) -> np.ndarray:
    """Factor ``index`` of a batch: float32 SPD ``G G^T / n + RIDGE I``, exactly symmetric."""
    rng = np.random.default_rng([seed, n, index])
    g = rng.standard_normal((n, n), dtype=np.float32)
    a = g @ g.T
    a = (a + a.T) * np.float32(0.5 / n)
    a[np.diag_indices(n)] += np.float32(RIDGE)
    return a


def _load_lapack() -> None:
    """Load SciPy (and the BLAS it ships) *before* limiting BLAS threads: threadpoolctl limits
    only libraries already loaded, and a bare process whose SciPy BLAS came later ran with every
    core per process — oversubscribed, several times slower than the daemon it is the ceiling
    for."""
    import scipy.linalg  # noqa: F401


def bare_solve(matrix: np.ndarray, kind: SolveKind) -> None:
    """The LAPACK/BLAS work of one engine solve (``solvers.EighSolver``), nothing else."""
    import scipy.linalg

    # The factor is symmetric, so its transpose (Fortran-ordered, as LAPACK takes it) is the
    # same matrix and converts with a straight copy, as the engine's solver makes its copy:
    # converting the C-ordered factor itself into Fortran order is a transposing copy, which
    # cost the bare loop 3 ms per solve at n = 1024 and flattered the daemon by 2%.
    work = np.array(matrix.T, dtype=np.float64, order="F")
    w, v = scipy.linalg.eigh(work, driver=EIGH_DRIVER, overwrite_a=True, check_finite=False)
    if kind is SolveKind.INVERSE_ROOT:  # the solver's one product, B B^T (a syrk)
        lam = np.maximum(w, 0.0) + EPSILON
        half = v * np.power(lam, -0.5 * EXPONENT)
        _ = half @ half.T


# --------------------------------------------------------------------------- bare processes


def _engine_solve(solver: Any, out: np.ndarray) -> Callable[[np.ndarray, SolveKind], None]:
    """One solve as a daemon worker's solver makes it, its n x n result written into ``out``
    (where a worker writes into the client's result segment)."""
    from asteria_server.types import SolveTask

    def run(matrix: np.ndarray, kind: SolveKind) -> None:
        task = SolveTask(
            block="floor", version=1, kind=kind, matrix=matrix, exponent=EXPONENT, epsilon=EPSILON
        )
        solver.solve(task, outputs=lambda _field: out)

    return run


def _bare_worker(
    conn: Connection, index: int, num_workers: int, niceness: int, engine_solver: bool
) -> None:
    """A bare process: hold its share of the batch, run it when told, report the seconds. With
    ``engine_solver`` each solve is the engine's solver's, as a daemon worker runs it, instead
    of the bare LAPACK calls."""
    _load_lapack()
    solver = None
    if engine_solver:
        import dataclasses

        from asteria_client.runtime.embedded import EighSolver, SolverConfig

        # As a daemon worker makes it: BLAS threads are limited for the whole process below.
        solver = EighSolver(dataclasses.replace(SolverConfig(), blas_threads=None))
    from threadpoolctl import threadpool_limits

    from asteria_server.malloc import tune_solver_allocator

    tune_solver_allocator()  # as the daemon's solver workers do
    threadpool_limits(limits=1, user_api="blas")
    if niceness > 0:
        os.nice(niceness)
    share: list[np.ndarray] = []
    solve: Callable[[np.ndarray, SolveKind], None] = bare_solve
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "load":
            _, n, batch, seed = msg
            share = [make_factor(n, seed, i) for i in range(index, batch, num_workers)]
            if solver is not None:
                solve = _engine_solve(solver, np.empty((n, n), np.float32))
            conn.send(("loaded", len(share)))
        else:
            kind = SolveKind(msg[1])
            start, cpu = time.perf_counter(), time.process_time()
            for matrix in share:
                solve(matrix, kind)
            conn.send(("done", (time.perf_counter() - start, time.process_time() - cpu)))
    conn.close()


class BarePool:
    """W spawned processes that run the bare loop (or, with ``engine_solver``, the engine's
    solver) on their shares of a batch."""

    def __init__(self, num_workers: int, niceness: int, *, engine_solver: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self.last_cpu_s = 0.0  # CPU seconds of every process in the last round
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for index in range(num_workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_bare_worker,
                args=(child, index, num_workers, niceness, engine_solver),
                name=f"asteria-bench-{'solver' if engine_solver else 'bare'}-{index}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    def _gather(self) -> list[Any]:
        return [conn.recv()[1] for conn in self._conns]

    def load(self, n: int, batch: int, seed: int) -> None:
        for conn in self._conns:
            conn.send(("load", n, batch, seed))
        self._gather()

    def run_round(self, kind: SolveKind) -> float:
        """Seconds from telling every process to start to the last one's end."""
        start = time.perf_counter()
        for conn in self._conns:
            conn.send(("run", kind.value))
        self.last_cpu_s = sum(cpu for _, cpu in self._gather())
        return time.perf_counter() - start

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()


# --------------------------------------------------------------------------- the daemon side


class DaemonClient:
    """One session on the benchmark's daemon and a thread draining its results stream."""

    def __init__(self, address: str, *, shared_memory: bool = True) -> None:
        from asteria_client.transport.connection import DaemonConnection
        from asteria_client.transport.segments import SegmentSet

        self._conn = DaemonConnection(address)
        self._session = self._conn.open_session()
        # The daemon source's own segment set: handover, and results read out of segments.
        self._shm = SegmentSet(enabled=shared_memory)
        self._shm.open(self._session)
        if shared_memory and not self._shm.active:
            raise RuntimeError(f"the daemon at {address} offers no shared memory")
        self._segments: dict[str, Any] = {}  # block -> its snapshot segment
        # What the drain thread waits for: block -> version, and what arrived: block ->
        # (arrival time, the worker's solve seconds). It wakes the caller once, when the last
        # awaited result is in (or the stream failed), as a training client is not woken per
        # result either: a wake per result would be this harness's CPU, not the daemon path's.
        self._lock = threading.Lock()
        self._awaited: dict[str, int] = {}
        self._arrived: dict[str, tuple[float, float]] = {}
        self._all_in = threading.Event()
        self._failure: BaseException | None = None
        self._cancel: Callable[[], object] | None = None
        self._cancel_set = threading.Event()
        self._closing = False
        self._thread = threading.Thread(
            target=self._drain, name="asteria-bench-results", daemon=True
        )
        self._thread.start()
        self._cancel_set.wait(timeout=10.0)

    def _on_call(self, cancel: Callable[[], object]) -> None:
        self._cancel = cancel
        self._cancel_set.set()

    def _submit(self, tasks: Sequence[Any]) -> None:
        """Send ``tasks`` as the daemon source's sender does: over shared memory, written into
        their blocks' segments and announced together in one call; else in chunks, one call
        each."""
        if not self._shm.active:
            for task in tasks:
                self._conn.submit(self._session, task)
            return
        announced = []
        for task in tasks:
            snap = self._segments.get(task.block)
            if snap is None:  # made and handed over on the block's first snapshot
                made = self._shm.create(task)
                assert made is not None, "the segment set is active"
                snap = self._segments[task.block] = made[0]
            announced.append((task, snap.write_snapshot(task)))
        for (task, _), answer in zip(
            announced, self._conn.announce(self._session, announced), strict=True
        ):
            if isinstance(answer, Exception):
                raise RuntimeError(f"the daemon refused block {task.block}: {answer}")

    def _drain(self) -> None:
        reader = self._shm.read_result if self._shm.active else None
        try:
            for result in self._conn.results(self._session, {}, self._on_call, reader=reader):
                arrived = time.perf_counter()
                with self._lock:
                    if self._awaited.get(result.block) == result.version:
                        del self._awaited[result.block]
                        self._arrived[result.block] = (arrived, result.solve_time_s)
                        if not self._awaited:
                            self._all_in.set()
        except BaseException as exc:  # surfaced by _wait unless we are closing
            if not self._closing:
                with self._lock:  # not between _await's look at it and its clear()
                    self._failure = exc
                    self._all_in.set()

    def _await(self, versions: dict[str, int]) -> None:
        """Expect ``versions`` (block -> version): before their snapshots are sent."""
        with self._lock:
            self._awaited = dict(versions)
            self._arrived = {}
            if self._failure is None:  # a failed stream stays failed
                self._all_in.clear()

    def _wait(self, what: str) -> dict[str, tuple[float, float]]:
        """Wait for every awaited result; per block (arrival time, solve seconds)."""
        if not self._all_in.wait(timeout=ROUND_SLACK_S):
            with self._lock:
                got, missing = len(self._arrived), len(self._awaited)
            raise RuntimeError(
                f"the daemon returned {got} of {got + missing} results of {what} within "
                f"{ROUND_SLACK_S:g} s; a solve failed or the daemon is stuck"
            )
        if self._failure is not None:
            raise RuntimeError(
                f"the daemon's results stream failed: {self._failure}"
            ) from self._failure
        with self._lock:
            return dict(self._arrived)

    def run_round(
        self, matrices: Sequence[np.ndarray], kind: SolveKind, prefix: str, version: int
    ) -> float:
        """Submit every matrix as block ``prefix-i`` at ``version``; seconds from the first
        submit to the last result's arrival."""
        from asteria_server.types import SolveTask

        names = [f"{prefix}-{i}" for i in range(len(matrices))]
        self._await(dict.fromkeys(names, version))
        start = time.perf_counter()
        self._submit(
            [
                SolveTask(
                    block=name,
                    version=version,
                    kind=kind,
                    matrix=matrix,
                    exponent=EXPONENT,
                    epsilon=EPSILON,
                )
                for name, matrix in zip(names, matrices, strict=True)
            ]
        )
        arrived = self._wait(f"round {version} ({prefix})")
        return max(at for at, _ in arrived.values()) - start

    def latency(
        self, matrix: np.ndarray, kind: SolveKind, block: str, version: int
    ) -> tuple[float, float]:
        """One block alone: seconds from its submit to its result in this process, and the
        seconds the worker's solve took."""
        from asteria_server.types import SolveTask

        task = SolveTask(block=block, version=version, kind=kind, matrix=matrix, epsilon=EPSILON)
        self._await({block: version})
        start = time.perf_counter()
        self._submit([task])
        arrived, solve_s = self._wait(f"block {block} version {version}")[block]
        return arrived - start, solve_s

    def close(self) -> None:
        self._closing = True
        if self._cancel is not None:
            self._cancel()
        self._thread.join(timeout=10.0)
        try:
            self._conn.close_session(self._session.session_id)
        except Exception as exc:  # the daemon is stopped right after; nothing to keep
            logger.debug("closing the benchmark session failed: %s", exc)
        self._conn.close()
        self._shm.close()


# --------------------------------------------------------------------------- the run


def _progress(message: str) -> None:
    print(f"[throughput] {message}", file=sys.stderr, flush=True)


def calibrate_batch(n: int, cfg: ThroughputConfig) -> tuple[int, float]:
    """B for size n (a multiple of the worker count) and the measured seconds per bare solve."""
    _load_lapack()
    from threadpoolctl import threadpool_limits

    matrix = make_factor(n, cfg.seed, 0)
    with threadpool_limits(limits=1, user_api="blas"):
        bare_solve(matrix, SolveKind.EIGENBASIS)  # warm caches and the library
        seconds = math.inf
        for _ in range(2):
            start = time.perf_counter()
            bare_solve(matrix, SolveKind.EIGENBASIS)
            seconds = min(seconds, time.perf_counter() - start)
    if cfg.batch is not None:
        return cfg.batch, seconds
    per_worker = max(MIN_BLOCKS_PER_WORKER, round(cfg.target_round_s / max(seconds, 1e-6)))
    return min(MAX_BATCH, per_worker * cfg.workers), seconds


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` itself (all its threads), from /proc; 0 once
    it has exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The live children of process ``pid`` (the daemon's solver workers), from /proc."""
    children: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(child) for child in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass  # it (or a thread) exited meanwhile
    return children


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants, from /proc."""
    return process_cpu_s(pid) + sum(tree_cpu_s(child) for child in child_pids(pid))


class CpuSplit:
    """CPU seconds of the daemon side of a round, split into the daemon process itself, its
    solver workers (and their descendants: live ones only, as :func:`tree_cpu_s`) and this
    process (the client)."""

    def __init__(self, daemon_pid: int) -> None:
        self._pid = daemon_pid
        self._start = self._now()

    def _now(self) -> tuple[float, float, float]:
        workers = sum(tree_cpu_s(child) for child in child_pids(self._pid))
        return process_cpu_s(self._pid), workers, time.process_time()

    def since(self) -> tuple[float, float, float]:
        """(daemon, workers, client) CPU seconds since this object was made."""
        (daemon, workers, client), start = self._now(), self._start
        return daemon - start[0], workers - start[1], client - start[2]


def _entry(
    n: int, kind: SolveKind, batch: int, daemon_s: list[float], bare_s: list[float]
) -> dict[str, Any]:
    daemon_median = summarize(daemon_s)["median"]
    bare_median = summarize(bare_s)["median"]
    paired = [b / d for b, d in zip(bare_s, daemon_s, strict=True)]
    ratio = bare_median / daemon_median
    return {
        "n": n,
        "kind": kind.value,
        "batch": batch,
        "daemon_round_s": daemon_s,
        "bare_round_s": bare_s,
        "daemon_median_s": daemon_median,
        "bare_median_s": bare_median,
        "daemon_solves_per_s": batch / daemon_median,
        "bare_solves_per_s": batch / bare_median,
        "ratio": ratio,
        "paired_ratio_median": summarize(paired)["median"],
        "paired_ratio_min": min(paired),
        "paired_ratio_max": max(paired),
        "target_met": ratio >= RATIO_TARGET,
    }


def run_throughput(cfg: ThroughputConfig) -> dict[str, Any]:
    """Measure every (n, kind) with alternating daemon and bare rounds; return the report."""
    from asteria_client.train.cpu import flush_denormal

    with flush_denormal(cfg.flush_denormal):
        return _run_throughput(cfg)


def _run_throughput(cfg: ThroughputConfig) -> dict[str, Any]:
    from asteria_client.daemon_process import DaemonProcess

    started = time.time()
    plan = {n: calibrate_batch(n, cfg) for n in cfg.sizes}
    for n, (batch, seconds) in plan.items():
        _progress(f"n={n}: one bare eigh {seconds * 1e3:.1f} ms -> batch of {batch}")
    _progress(
        f"starting the daemon ({cfg.workers} workers), {cfg.workers} bare processes and "
        f"{cfg.workers} running the engine's solver alone"
    )
    entries: list[dict[str, Any]] = []
    daemon = DaemonProcess(workers=cfg.workers, blas_threads=1).start()
    bare = floor = None
    client = None
    try:
        bare = BarePool(cfg.workers, cfg.bare_niceness)
        floor = BarePool(cfg.workers, cfg.bare_niceness, engine_solver=True)
        client = DaemonClient(daemon.address, shared_memory=cfg.transport == "shm")
        version = 0
        for n in cfg.sizes:
            batch = plan[n][0]
            matrices = [make_factor(n, cfg.seed, i) for i in range(batch)]
            bare.load(n, batch, cfg.seed)
            floor.load(n, batch, cfg.seed)
            for kind in cfg.kinds:
                prefix = f"{kind.value}-n{n}"
                client.run_round(matrices, kind, prefix, version)  # warm-up
                bare.run_round(kind)
                floor.run_round(kind)
                version += 1
                daemon_s: list[float] = []
                bare_s: list[float] = []
                daemon_cpu: list[float] = []  # CPU-s per solve: daemon + workers + client
                split: list[tuple[float, float, float]] = []  # the same, per part
                bare_cpu: list[float] = []
                floor_cpu: list[float] = []  # CPU-s per solve of the solver alone
                for r in range(cfg.rounds):
                    sides = ("daemon", "bare", "solver")
                    for side in sides if r % 2 == 0 else sides[::-1]:
                        if side == "bare":
                            bare_s.append(bare.run_round(kind))
                            bare_cpu.append(bare.last_cpu_s / batch)
                            continue
                        if side == "solver":
                            floor.run_round(kind)
                            floor_cpu.append(floor.last_cpu_s / batch)
                            continue
                        cpu = CpuSplit(daemon.pid)
                        daemon_s.append(client.run_round(matrices, kind, prefix, version))
                        parts = cpu.since()
                        split.append(parts)
                        daemon_cpu.append(sum(parts) / batch)
                    version += 1
                    _progress(
                        f"n={n} {kind.value} round {r + 1}/{cfg.rounds}: daemon "
                        f"{daemon_s[-1]:.3f} s, bare {bare_s[-1]:.3f} s "
                        f"(ratio {bare_s[-1] / daemon_s[-1]:.3f})"
                    )
                entry = _entry(n, kind, batch, daemon_s, bare_s)
                entry["cpu_s_per_solve_vs_bare"] = (
                    summarize(daemon_cpu)["median"] / summarize(bare_cpu)["median"]
                )
                # Where the daemon side's CPU goes, per solve (medians over the rounds).
                entry["cpu_ms_per_solve"] = {
                    "daemon": 1e3 * summarize([p[0] for p in split])["median"] / batch,
                    "workers": 1e3 * summarize([p[1] for p in split])["median"] / batch,
                    "client": 1e3 * summarize([p[2] for p in split])["median"] / batch,
                    "bare": 1e3 * summarize(bare_cpu)["median"],
                }
                # The floor under cpu_s_per_solve_vs_bare: the engine's own solver, no IPC.
                entry["solver_cpu_vs_bare"] = (
                    summarize(floor_cpu)["median"] / summarize(bare_cpu)["median"]
                )
                # One block at a time: what submit -> result adds to the worker's solve.
                latencies, solves = [], []
                for i in range(max(5, 2 * cfg.rounds)):
                    latency_s, solve_s = client.latency(matrices[0], kind, f"{prefix}-lat", i)
                    latencies.append(latency_s)
                    solves.append(solve_s)
                entry["result_overhead_ms_p50"] = 1e3 * (
                    summarize(latencies)["median"] - summarize(solves)["median"]
                )
                entries.append(entry)
    finally:
        if client is not None:
            client.close()
        for pool in (bare, floor):
            if pool is not None:
                pool.close()
        daemon_cpu_s = daemon.stop().cpu_s
    config = asdict(cfg)
    config["kinds"] = [k.value for k in cfg.kinds]
    config["sizes"] = list(cfg.sizes)
    return {
        "benchmark": "throughput",
        "config": config,
        "ratio_target": RATIO_TARGET,
        "ratio_definition": "bare median round time / daemon median round time "
        "(= daemon solves/s / bare solves/s)",
        "results": entries,
        "daemon_cpu_s": daemon_cpu_s,
        "wall_time_s": time.time() - started,
    }


# --------------------------------------------------------------------------- reporting


#: What the table's CPU and latency columns are (under the table, in text and markdown).
COLUMNS_NOTE = (
    "CPU/solve vs bare = CPU-s per solve of daemon + workers + client / bare loop's "
    "(target <= 1.10), next to it the three parts and the bare loop's in ms (medians "
    "over the rounds; /proc counts in clock ticks of 10 ms, so small parts are coarse); "
    "solver alone vs bare = CPU per solve of the engine's solver (input checks, solve, "
    "output checks, float32 conversion) in processes like the bare loop's, no IPC, over "
    "the bare loop's: the part of CPU/solve vs bare no transport work can remove; "
    "result overhead = median submit->result of one block alone - median worker solve "
    "time (target <= 2 ms at n=256)"
)


def _split(ms: dict[str, float] | None) -> str:
    """``daemon+workers+client (bare)`` CPU ms per solve (reports from before the split: -)."""
    if not ms:
        return "-"
    return f"{ms['daemon']:.2f}+{ms['workers']:.2f}+{ms['client']:.2f} ({ms['bare']:.2f})"


def _table(results: Sequence[dict[str, Any]], markdown: bool) -> list[str]:
    head = ["n", "kind", "batch", "daemon solves/s", "bare solves/s", "ratio", "paired (min-max)"]
    head += ["CPU/solve vs bare", "solver alone vs bare"]
    head += ["CPU ms/solve: daemon+workers+client (bare)"]
    head += ["result overhead ms"]
    rows = [
        [
            str(e["n"]),
            e["kind"],
            str(e["batch"]),
            f"{e['daemon_solves_per_s']:.2f}",
            f"{e['bare_solves_per_s']:.2f}",
            f"{e['ratio']:.3f}" + ("" if e["target_met"] else " (below target)"),
            f"{e['paired_ratio_median']:.3f} ({e['paired_ratio_min']:.3f}-"
            f"{e['paired_ratio_max']:.3f})",
            f"{e.get('cpu_s_per_solve_vs_bare', math.nan):.3f}",
            f"{e['solver_cpu_vs_bare']:.3f}" if "solver_cpu_vs_bare" in e else "-",
            _split(e.get("cpu_ms_per_solve")),
            f"{e.get('result_overhead_ms_p50', math.nan):.2f}",
        ]
        for e in results
    ]
    if markdown:
        return markdown_table(head, rows)
    return text_table([head, *rows], align=">")


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = _table(report["results"], markdown=False)
    lines += [
        "",
        f"ratio = bare median round / daemon median round (target >= {report['ratio_target']}); "
        f"{cfg['workers']} daemon workers vs {cfg['workers']} bare processes, 1 BLAS thread "
        f"each, {cfg['rounds']} alternating rounds; paired = per-round ratios",
        COLUMNS_NOTE,
    ]
    return "\n".join(lines)


def write_figure(report: dict[str, Any], path: Path) -> Path:
    """Bars of daemon and bare solves/s per (n, kind), ratio written above each pair."""
    results = report["results"]
    fig, ax = output.new_figure(max(6.0, 1.3 * len(results) + 2.0), 4.0)
    x = np.arange(len(results))
    width = 0.38
    daemon = [e["daemon_solves_per_s"] for e in results]
    bare = [e["bare_solves_per_s"] for e in results]
    ax.bar(x - width / 2, daemon, width, label="daemon")
    ax.bar(x + width / 2, bare, width, label="bare LAPACK loop")
    for xi, e in zip(x, results, strict=True):
        top = max(e["daemon_solves_per_s"], e["bare_solves_per_s"])
        ax.annotate(f"{e['ratio']:.2f}", (xi, top), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"n={e['n']}\n{e['kind']}" for e in results], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("solves / s (log)")
    ax.set_title(
        f"Throughput, {report['config']['workers']} processes: daemon vs bare "
        f"(ratio above, target >= {report['ratio_target']})",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    return output.save_figure(fig, path)


def report_section(data: dict[str, Any]) -> str:
    """A markdown section of a throughput report for ``asteria bench report``."""
    cfg = data["config"]
    lines = [
        f"Daemon solves/s for a batch of blocks against the same LAPACK calls in a bare loop, "
        f"{cfg['workers']} processes on each side with 1 BLAS thread, medians of "
        f"{cfg['rounds']} alternating rounds, client over {cfg.get('transport', 'grpc')}. "
        "Ratio = daemon solves/s / bare solves/s "
        f"(target >= {data['ratio_target']}).",
        "",
        *_table(data["results"], markdown=True),
        "",
        COLUMNS_NOTE,
    ]
    for figure in data.get("figures", []):
        lines += ["", f"![throughput]({figure})"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- command line


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not sizes or any(n < 2 for n in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be integers >= 2, got {text!r}")
    return sizes


def register(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "throughput",
        help="daemon solves/s vs the same LAPACK calls in a bare loop",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="n in {64, 128}, short rounds (well under a minute)"
    )
    parser.add_argument(
        "--sizes", type=_sizes, metavar="N,N,...", help="factor sizes (default 256,512,1024)"
    )
    parser.add_argument(
        "--kind",
        choices=["eigenbasis", "inverse_root", "both"],
        default="both",
        help="solve kinds to measure (default: both)",
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="daemon workers = bare processes (default 2)"
    )
    parser.add_argument("--rounds", type=int, help="timed rounds per side (default 5; quick 2)")
    parser.add_argument(
        "--round-s",
        type=float,
        metavar="S",
        help="batch sized for bare rounds of about S seconds (default 1.5; quick 0.02)",
    )
    parser.add_argument("--batch", type=int, help="a fixed batch size for every n instead")
    parser.add_argument(
        "--bare-niceness",
        type=int,
        help="nice value of the bare processes (default: the daemon workers' value)",
    )
    parser.add_argument(
        "--transport",
        choices=["shm", "grpc"],
        default="shm",
        help="how the client reaches the daemon (default shm, a same-host client's default)",
    )
    parser.add_argument("--seed", type=int, default=0)
    output.add_flush_denormal_argument(parser, "this process (not the solvers)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the report here")
    return run_command


def run_command(args: argparse.Namespace) -> int:
    kinds = (
        (SolveKind.EIGENBASIS, SolveKind.INVERSE_ROOT)
        if args.kind == "both"
        else (SolveKind(args.kind),)
    )
    default_sizes = (64, 128) if args.quick else (256, 512, 1024)
    cfg = ThroughputConfig(
        sizes=args.sizes if args.sizes is not None else default_sizes,
        kinds=kinds,
        workers=args.workers,
        rounds=args.rounds if args.rounds is not None else (2 if args.quick else 5),
        target_round_s=args.round_s if args.round_s is not None else (0.02 if args.quick else 1.5),
        batch=args.batch,
        bare_niceness=args.bare_niceness if args.bare_niceness is not None else worker_niceness(),
        seed=args.seed,
        transport=args.transport,
        flush_denormal=args.flush_denormal,
    )
    report = run_throughput(cfg)
    report["quick"] = bool(args.quick)
    output.publish(
        report,
        format_report(report),
        args.json,
        lambda r, path: [write_figure(r, output.figure_path(path, "throughput"))],
    )
    return 0
