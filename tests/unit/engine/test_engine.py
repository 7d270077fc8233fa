"""The engine with real worker processes: real solves, injected faults, and clean shutdown."""

from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asteria_server.engine import (
    BlockState,
    EighSolver,
    EngineConfig,
    PreconditionerEngine,
    SolveKind,
    SolveTask,
    SubmitOutcome,
)
from asteria_server.engine.shm import SEGMENT_PREFIX
from asteria_server.engine.workers import PoolConfig, WorkerPool
from asteria_server.errors import EngineUnavailableError

FAULT = "FAULT/"
WAIT_S = 60.0  # generous bound for a loaded machine; never reached when things work
REPO_ROOT = Path(__file__).resolve().parents[3]


def spd(n: int, seed: int = 0, dtype: Any = np.float32) -> np.ndarray:
    g = np.random.default_rng(seed).standard_normal((n, n))
    return ((g @ g.T) / n + 0.1 * np.eye(n)).astype(dtype)


def root_task(block: str, version: int, n: int = 16, **kw: Any) -> SolveTask:
    return SolveTask(
        block=block, version=version, kind=SolveKind.INVERSE_ROOT, matrix=spd(n, version), **kw
    )


def own_segments() -> set[str]:
    """This process's engine segments: memfds it holds open (``/memfd:<name> (deleted)``)."""
    prefix = f"/memfd:{SEGMENT_PREFIX}{os.getpid()}_"
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith(prefix):
            names.add(target.removeprefix("/memfd:").removesuffix(" (deleted)"))
    return names


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def engine() -> Iterator[PreconditionerEngine]:
    config = EngineConfig(
        num_workers=2,
        solve_timeout_s=1.0,
        max_worker_attempts=2,
        max_consecutive_failures=3,
        calibrate=False,
        seconds_per_n3=1e-10,
        test_fault_prefix=FAULT,
    )
    with PreconditionerEngine(config) as eng:
        yield eng


# --------------------------------------------------------------------------- real solves


def test_engine_computes_every_kind_like_the_solver(engine: PreconditionerEngine) -> None:
    solver = EighSolver()
    a = spd(24, seed=1)
    tasks = [
        root_task("root", 3, n=16),
        SolveTask(block="eig", version=5, kind=SolveKind.EIGENBASIS, matrix=a, deadline=7),
    ]
    for t in tasks:
        assert engine.submit(t) is SubmitOutcome.QUEUED
    for t in tasks:
        got = engine.wait_result(t.block, t.version, WAIT_S)
        assert got is not None and got.version == t.version and got.kind is t.kind
        want = solver.solve(t)
        np.testing.assert_allclose(got.matrix, want.matrix, atol=1e-6)
        assert got.matrix.dtype == np.float32 and got.attempts >= 1
    eig = engine.status()[[s.block for s in engine.status()].index("eig")]
    assert eig.delivered_version == 5 and eig.state is BlockState.IDLE
    # QR refresh from the delivered basis, fp64 factor this time
    basis = solver.solve(tasks[1]).matrix
    refresh = SolveTask(
        block="eig",
        version=9,
        kind=SolveKind.EIGENBASIS,
        matrix=spd(24, seed=2, dtype=np.float64),
        basis=basis,
        base_version=5,
    )
    engine.submit(refresh)
    got = engine.wait_result("eig", 9, WAIT_S)
    assert got is not None and got.base_version == 5
    want = solver.solve(refresh)
    assert got.permutation is not None and want.permutation is not None
    assert np.array_equal(got.permutation, want.permutation)
    np.testing.assert_allclose(got.matrix, want.matrix, atol=1e-6)
    assert got.eigenvalues is not None and want.eigenvalues is not None
    np.testing.assert_allclose(got.eigenvalues, want.eigenvalues, rtol=1e-6)


def test_latest_wins_and_versions_only_go_forward(engine: PreconditionerEngine) -> None:
    outcomes = [engine.submit(root_task("lw", v, n=32)) for v in range(1, 21)]
    assert all(o.accepted for o in outcomes)
    assert engine.submit(root_task("lw", 20, n=32)) is SubmitOutcome.DUPLICATE
    assert engine.submit(root_task("lw", 3, n=32)) is SubmitOutcome.STALE_IGNORED
    delivered = [0]
    while delivered[-1] < 20:
        result = engine.wait_result("lw", delivered[-1] + 1, WAIT_S)
        assert result is not None and result.version > delivered[-1]
        delivered.append(result.version)
    assert delivered[-1] == 20
    assert engine.take_result("lw") is None
    assert engine.wait_result("lw", 20, WAIT_S) is None  # already delivered
    (status,) = [s for s in engine.status() if s.block == "lw"]
    assert status.version == 20 and status.stale_ignored == 1 and status.duplicates == 1
    assert status.staleness_steps == 0 and engine.in_flight_version("lw") is None


def test_blocks_with_results_since_names_exactly_the_newer_blocks(
    engine: PreconditionerEngine,
) -> None:
    """A stream asks which blocks got a newer result since the epoch it saw: exactly those, in
    any order, also after a block's second result (it moves past the others) and a forget."""
    solver, tenant = EighSolver(), "epochs-tenant"

    def install(block: str, version: int) -> int:
        task = root_task(block, version, tenant=tenant)
        engine.note_elsewhere(task, job="j")
        assert engine.install_result(solver.solve(task))
        return engine.results_epoch

    assert engine.blocks_with_results_since(-1, tenant) == []
    first = install("e-a", 1)
    install("e-b", 1)
    after_b = install("e-c", 1)
    assert sorted(engine.blocks_with_results_since(-1, tenant)) == ["e-a", "e-b", "e-c"]
    assert sorted(engine.blocks_with_results_since(first, tenant)) == ["e-b", "e-c"]
    install("e-a", 2)  # e-a is newer than e-b and e-c now
    assert sorted(engine.blocks_with_results_since(first, tenant)) == ["e-a", "e-b", "e-c"]
    assert engine.blocks_with_results_since(after_b, tenant) == ["e-a"]
    assert engine.blocks_with_results_since(engine.results_epoch, tenant) == []
    assert engine.blocks_with_results_since(-1, "another-tenant") == []
    engine.forget(tenant, "j")
    assert engine.blocks_with_results_since(-1, tenant) == []


def test_wait_result_returns_none_when_waiting_cannot_help(engine: PreconditionerEngine) -> None:
    assert engine.wait_result("never-submitted", 0, WAIT_S) is None
    engine.submit(root_task("w", 4))
    assert engine.wait_result("w", 5, WAIT_S) is None  # nothing >= 5 is in flight
    assert engine.wait_result("w", 4, WAIT_S) is not None
    assert engine.wait_result("w", 4, WAIT_S) is None  # already delivered


def test_tenants_do_not_see_each_other(engine: PreconditionerEngine) -> None:
    engine.submit(root_task("shared-name", 1, tenant="job-a"))
    result = engine.wait_result("shared-name", 1, WAIT_S, tenant="job-a")
    assert result is not None and result.tenant == "job-a"
    assert engine.take_result("shared-name") is None
    assert engine.take_result("shared-name", tenant="job-b") is None
    assert [s.block for s in engine.status("job-a")] == ["shared-name"]
    assert engine.status("job-b") == []


# --------------------------------------------------------------------------- failures


def test_bad_snapshots_fail_keep_last_good_result_and_mark_block(
    engine: PreconditionerEngine,
) -> None:
    assert engine.submit(root_task("nb", 1)) is SubmitOutcome.QUEUED
    good = engine.wait_result("nb", 1, WAIT_S)
    assert good is not None
    for version in (2, 3, 4):
        bad = spd(16, version)
        bad[3, 5] = np.nan if version != 3 else bad[3, 5] + 1.0  # NaN, or asymmetric
        engine.submit(
            SolveTask(block="nb", version=version, kind=SolveKind.INVERSE_ROOT, matrix=bad)
        )
        assert engine.wait_result("nb", version, WAIT_S) is None
    (status,) = [s for s in engine.status() if s.block == "nb"]
    assert status.state is BlockState.FAILED and status.consecutive_failures == 3
    assert status.version == 1 and status.failures == 3 and "'nb'" in (status.last_error or "")
    assert engine.take_result("nb") is None
    engine.submit(root_task("nb", 5))
    result = engine.wait_result("nb", 5, WAIT_S)
    assert result is not None and result.is_finite()
    (status,) = [s for s in engine.status() if s.block == "nb"]
    assert status.state is BlockState.IDLE and status.consecutive_failures == 0


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("crash", "exit code -9"),
        ("exit", "exit code 3"),
        ("hang", "timeout"),
        ("nan", "NaN"),
        ("error", "injected worker error"),
    ],
)
def test_injected_faults_never_deliver_and_the_pool_recovers(
    engine: PreconditionerEngine, fault: str, message: str
) -> None:
    block = f"{FAULT}{fault}:1"
    assert engine.submit(root_task(block, 1)) is SubmitOutcome.QUEUED
    if fault == "hang":
        assert engine.in_flight_version(block) == 1  # it hangs for >= 2 x 1.0 s
    assert engine.wait_result(block, 1, WAIT_S) is None
    assert engine.take_result(block) is None
    (status,) = [s for s in engine.status() if s.block == block]
    assert status.failures == 1 and status.version == -1 and status.in_flight_version == -1
    assert message in (status.last_error or "")
    # the pool survived: an ordinary solve still works on every worker
    for i in range(2):
        engine.submit(root_task(f"after-{fault}-{i}", 1))
    for i in range(2):
        result = engine.wait_result(f"after-{fault}-{i}", 1, WAIT_S)
        assert result is not None and result.is_finite()


@pytest.mark.parametrize("fault", ["crash-once", "hang-once"])
def test_a_lost_worker_run_is_retried(engine: PreconditionerEngine, fault: str) -> None:
    block = f"{FAULT}{fault}:1"
    before = engine.stats().worker_restarts
    engine.submit(root_task(block, 1))
    result = engine.wait_result(block, 1, WAIT_S)
    assert result is not None and result.is_finite() and result.attempts >= 2
    assert engine.stats().worker_restarts > before


def test_stats(engine: PreconditionerEngine) -> None:
    stats = engine.stats()
    assert len(stats.incarnation_id) == 32 and int(stats.incarnation_id, 16) >= 0
    assert stats.num_workers == 2 and stats.workers_busy + stats.workers_idle == 2
    assert stats.solves_done > 0 and stats.uptime_s > 0 and not stats.closed
    assert stats.seconds_per_n3 == 1e-10
    assert set(stats.to_dict()) >= {"incarnation_id", "queue_depth", "solves_done", "uptime_s"}


# --------------------------------------------------------------------------- lifecycle


def test_close_leaves_no_processes_threads_or_segments() -> None:
    before = own_segments()
    threads_before = set(threading.enumerate())
    config = EngineConfig(
        num_workers=1, calibrate=False, test_fault_prefix=FAULT, solve_timeout_s=30.0
    )
    engine = PreconditionerEngine(config)
    pids = set(engine.worker_pids())
    for version, n in ((1, 8), (2, 48)):  # the second one grows the worker's segments
        engine.submit(root_task("grow", version, n=n))
        assert engine.wait_result("grow", version, WAIT_S) is not None
    pids |= set(engine.worker_pids())
    assert len(own_segments() - before) == 2  # one input + one output, the old pair unlinked
    engine.submit(root_task(f"{FAULT}crash-once:x", 1))
    assert engine.wait_result(f"{FAULT}crash-once:x", 1, WAIT_S) is not None
    pids |= set(engine.worker_pids())
    assert len(pids) >= 2  # the crashed worker was replaced
    engine.close()
    engine.close()  # idempotent
    assert own_segments() == before
    assert not any(pid_alive(pid) for pid in pids)
    assert not any(p.pid in pids for p in multiprocessing.active_children())
    assert set(threading.enumerate()) <= threads_before
    with pytest.raises(EngineUnavailableError, match="closed"):
        engine.submit(root_task("grow", 3))
    assert engine.wait_result("grow", 3, 1.0) is None
    assert engine.stats().closed


def test_pool_reuses_and_grows_segments_directly() -> None:
    pool = WorkerPool(PoolConfig(num_workers=1, solve_timeout_s=30.0))
    try:

        def run(job_id: int, task: SolveTask) -> Any:
            pool.submit(job_id, task)
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                events = pool.poll(0.5)
                if events:
                    return events[0]
            raise AssertionError("no result from the worker pool")

        first = run(1, root_task("p", 1, n=8))
        names = set(pool.segment_names())
        assert first.result is not None and first.error is None
        second = run(2, root_task("p", 2, n=8))
        assert second.result is not None and set(pool.segment_names()) == names  # reused
        third = run(3, root_task("p", 3, n=64))
        assert third.result is not None and not names & set(pool.segment_names())
        assert not names & own_segments()  # replaced segments are released
        pids = pool.worker_pids()
        created = list(pool.segment_names_created)
    finally:
        pool.close()
    assert not set(created) & own_segments()
    assert not any(n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}_") for n in os.listdir("/dev/shm"))
    assert not any(pid_alive(pid) for pid in pids)


def test_killed_worker_and_exit_leave_no_tracker_complaints(tmp_path: Path) -> None:
    """End to end in a fresh interpreter: kill -9 a worker from outside, keep solving, exit.

    The resource tracker must neither unlink a live segment nor report leaks or errors.
    """
    script = tmp_path / "run_engine.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, time
            import numpy as np
            from asteria_server.engine import (
                EngineConfig, PreconditionerEngine, SolveKind, SolveTask)

            def task(v):
                return SolveTask(block="b", version=v, kind=SolveKind.INVERSE_ROOT,
                                 matrix=np.eye(16, dtype=np.float32) * (v + 1))

            if __name__ == "__main__":
                with PreconditionerEngine(EngineConfig(num_workers=1, calibrate=False)) as eng:
                    eng.submit(task(1))
                    assert eng.wait_result("b", 1, 60) is not None
                    (pid,) = eng.worker_pids()
                    os.kill(pid, signal.SIGKILL)
                    deadline = time.monotonic() + 60
                    while eng.worker_pids() in ([pid], []) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    eng.submit(task(2))
                    result = eng.wait_result("b", 2, 60)
                    assert result is not None and result.is_finite()
                    assert eng.stats().worker_restarts == 1
                print("ok")
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    for bad in ("resource_tracker", "leaked", "Traceback", "Warning"):
        assert bad not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_workers", 0),
        ("blas_threads", 0),
        ("solve_timeout_s", 0.0),
        ("solve_timeout_s", math.nan),
        ("max_attempts", 0),
        ("max_worker_attempts", 1.5),
        ("max_consecutive_failures", 0),
        ("calibrate", "yes"),
        ("seconds_per_n3", -1.0),
        ("start_method", "fork"),
        ("test_fault_prefix", ""),
        ("cpu_affinity", ()),
        ("cpu_affinity", "0"),
        ("cpu_affinity", (-1,)),
        ("cpu_affinity", (True,)),
        ("cpu_affinity", (0, 0)),
        ("cpu_affinity", (100_000,)),
    ],
)
def test_engine_config_validation_names_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as info:
        EngineConfig(**{field: value})  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


def test_engine_config_defaults() -> None:
    config = EngineConfig()
    assert config.num_workers >= 1 and config.blas_threads == 1
    assert config.test_fault_prefix is None and config.start_method == "subprocess"
    assert config.cpu_affinity is None and config.pool_config().cpu_affinity is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPUs")
@pytest.mark.parametrize("start_method", ["subprocess", "spawn"])
def test_cpu_affinity_confines_the_workers(start_method: str) -> None:
    usable = sorted(os.sched_getaffinity(0))
    solver_cpus = usable[1:]  # as a trainer pinned to the first CPU would leave them
    config = EngineConfig(
        num_workers=1,
        calibrate=False,
        cpu_affinity=list(reversed(solver_cpus)),  # any order and sequence type
        start_method=start_method,
    )
    assert config.cpu_affinity == tuple(solver_cpus)
    with PreconditionerEngine(config) as engine:
        engine.submit(root_task("pinned", 1))
        assert engine.wait_result("pinned", 1, WAIT_S) is not None  # it still solves
        (pid,) = engine.worker_pids()
        assert os.sched_getaffinity(pid) == set(solver_cpus)
    assert os.sched_getaffinity(0) == set(usable)  # the parent keeps its own CPUs
