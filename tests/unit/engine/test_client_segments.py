"""The solver pool reads a client's snapshot segment and writes its result segment itself.

This is the daemon's same-host path without the daemon: segments made the way a client makes
them (``protocol.shm``), tasks pointing at them the way the servicer builds them. Checked: the
result lands in the client's segment under its seqlock and equals the solver's; a snapshot
overwritten before the worker reads it ends as *overwritten*; a bad segment is that task's error
and the pool keeps serving.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from asteria_server.engine import solve
from asteria_server.engine.workers import PoolConfig, PoolEvent, WorkerPool
from asteria_server.errors import InvalidInputError
from asteria_server.protocol.shm import (
    Segment,
    create_segment,
    map_segment,
    private_result,
    result_layout,
    segment_bytes,
    snapshot_layout,
    snapshot_specs,
)
from asteria_server.types import SharedArrays, SolveKind, SolveTask
from tests.unit.engine.test_engine import spd

WAIT_S = 60.0
N = 24


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool(PoolConfig(num_workers=1, solve_timeout_s=30.0))
    yield p
    p.close()


def run(pool: WorkerPool, job_id: int, task: SolveTask) -> PoolEvent:
    pool.submit(job_id, task)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        events = pool.poll(0.5)
        if events:
            return events[0]
    raise AssertionError("no answer from the worker pool")


def client_segments(kind: SolveKind) -> tuple[Segment, Segment]:
    """A snapshot and a result segment as a client makes them, mapped as the daemon maps them."""
    out = []
    for specs in (snapshot_layout(N, kind, 4), result_layout(N, kind)):
        fd, own = create_segment(segment_bytes(specs))
        out.append(map_segment(fd, own.size_bytes, keep_fd=True))
        own.close()
        os.close(fd)
    return out[0], out[1]


def shm_task(kind: SolveKind, snap: Segment, result: Segment, version: int) -> SolveTask:
    plain = SolveTask(block="b", version=version, kind=kind, matrix=spd(N, version))
    sequence = snap.write(snapshot_specs(plain), [plain.matrix])
    stand_ins = snap.stand_ins(snapshot_specs(plain))  # as the servicer queues it: no values
    return dataclasses.replace(
        plain,
        matrix=stand_ins[0],
        shm_source=SharedArrays(snap, "snap", sequence),
        shm_result=SharedArrays(result, "res"),
    )


@pytest.mark.parametrize("kind", list(SolveKind))
def test_the_worker_writes_the_result_into_the_clients_segment(
    pool: WorkerPool, kind: SolveKind
) -> None:
    snap, res = client_segments(kind)
    task = shm_task(kind, snap, res, 1)
    expected = solve(dataclasses.replace(task, matrix=spd(N, 1), shm_source=None))
    event = run(pool, 1, task)
    assert event.result is not None and event.result.shm is not None
    assert event.result.shm.segment is res and event.result.shm.segment_id == "res"
    # The task's matrix held no values (a stand-in): the worker read the client's segment. The
    # result here holds none either: its values lie in the client's segment alone.
    assert not np.any(task.matrix) and task.matrix.strides == (0, 0)
    assert event.result.matrix.strides == (0, 0) and not event.result.matrix.flags.writeable
    # What the client reads under the seqlock at the announced sequence is the solver's result.
    specs = [spec for spec in result_layout(N, kind)][: 2 if kind is SolveKind.EIGENBASIS else 1]
    copies = res.read(specs, event.result.shm.sequence)
    assert copies is not None
    np.testing.assert_allclose(copies[0], expected.matrix, rtol=1e-5, atol=1e-6)
    if kind is SolveKind.EIGENBASIS:
        assert expected.eigenvalues is not None
        np.testing.assert_allclose(copies[1], expected.eigenvalues, rtol=1e-5)


def test_an_overwritten_snapshot_is_neither_solved_nor_a_failure(pool: WorkerPool) -> None:
    snap, res = client_segments(SolveKind.INVERSE_ROOT)
    task = shm_task(SolveKind.INVERSE_ROOT, snap, res, 1)
    snap.write(snapshot_specs(task), [spd(N, 2)])  # the client's next snapshot, not announced
    event = run(pool, 2, task)
    assert event.overwritten and event.result is None and event.error is None


def test_a_refresh_reads_its_basis_from_the_clients_result_segment(pool: WorkerPool) -> None:
    """A refresh naming its basis by the block's previous result (``shm_basis``): the worker
    reads that basis from the client's result segment, then writes the new result there; the
    result is the QR refresh of exactly that basis. Once the segment was written again (a
    newer result), the basis is gone: the task becomes a full decomposition, base_version -1,
    and is delivered, not rejected for lacking a refresh's permutation."""
    kind = SolveKind.EIGENBASIS
    snap, res = client_segments(kind)
    first = run(pool, 10, shm_task(kind, snap, res, 1))
    assert first.result is not None and first.result.shm is not None
    basis = private_result(first.result)
    assert basis is not None
    task = dataclasses.replace(
        shm_task(kind, snap, res, 2), base_version=1, shm_basis=first.result.shm
    )
    expected = solve(
        dataclasses.replace(
            task, matrix=spd(N, 2), shm_source=None, shm_basis=None, basis=basis.matrix
        )
    )
    event = run(pool, 11, task)
    assert event.result is not None and event.error is None, event.error
    assert event.result.base_version == 1 and event.result.permutation is not None
    got = private_result(event.result)
    assert got is not None
    np.testing.assert_array_equal(got.matrix, expected.matrix)

    stale = dataclasses.replace(
        shm_task(kind, snap, res, 3), base_version=1, shm_basis=first.result.shm
    )  # version 1's result was overwritten by version 2's
    event = run(pool, 12, stale)
    assert event.result is not None and event.error is None, event.error
    assert event.result.base_version == -1 and event.result.permutation is None


def test_a_bad_snapshot_is_that_tasks_error_and_the_pool_keeps_serving(pool: WorkerPool) -> None:
    snap, res = client_segments(SolveKind.INVERSE_ROOT)
    task = shm_task(SolveKind.INVERSE_ROOT, snap, res, 1)
    snap.views(snapshot_specs(task))[0][0, 0] = np.nan  # written outside the seqlock
    event = run(pool, 3, task)
    assert event.result is None and event.error is not None and "NaN or Inf" in event.error
    restarts = pool.restarts
    # An unsealed "segment": the worker refuses to map it; its task fails, nothing crashes.
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    own_fd, own = create_segment(snap.size_bytes)
    os.ftruncate(fd, snap.size_bytes)
    os.close(own_fd)
    own.close()

    class Unsealed:
        token, size_bytes, slot_index = 10**9, snap.size_bytes, -1

        @property
        def mapping(self) -> Unsealed:
            return self

        def fileno(self) -> int:
            return fd

        def read(self, specs: object, sequence: int) -> None:
            return None

    bad = dataclasses.replace(task, shm_source=SharedArrays(Unsealed(), "x", 2))  # type: ignore[arg-type]
    event = run(pool, 4, bad)
    os.close(fd)
    assert event.result is None and event.error is not None and "mapped" in event.error
    good = run(pool, 5, shm_task(SolveKind.INVERSE_ROOT, snap, res, 6))
    assert good.result is not None and pool.restarts == restarts


def _worker_maps(pool: WorkerPool, name: str) -> int:
    """How many mappings of memfds named ``name`` the pool's one worker holds."""
    (pid,) = pool.worker_pids()
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if f"/memfd:{name} " in line)


def test_segments_a_client_let_go_of_are_unmapped_at_the_workers_next_task(
    pool: WorkerPool,
) -> None:
    """The worker maps a client's segments once and keeps them; once the last reference to
    them goes (the client's handover closed), its next task tells it to unmap them."""

    def named(name: str) -> tuple[Segment, Segment]:
        out = []
        for specs in (
            snapshot_layout(N, SolveKind.INVERSE_ROOT, 4),
            result_layout(N, SolveKind.INVERSE_ROOT),
        ):
            fd, own = create_segment(segment_bytes(specs), name=name)
            out.append(map_segment(fd, own.size_bytes, keep_fd=True))
            own.close()
            os.close(fd)
        return out[0], out[1]

    snap, res = named("asteria-test-gone")
    event = run(pool, 10, shm_task(SolveKind.INVERSE_ROOT, snap, res, 1))
    assert event.result is not None
    assert _worker_maps(pool, "asteria-test-gone") == 2
    kept_snap, kept_res = named("asteria-test-kept")
    assert run(pool, 11, shm_task(SolveKind.INVERSE_ROOT, kept_snap, kept_res, 1)).result
    assert _worker_maps(pool, "asteria-test-gone") == 2  # still held here: kept mapped
    del event, snap, res
    gc.collect()
    assert run(pool, 12, shm_task(SolveKind.INVERSE_ROOT, kept_snap, kept_res, 2)).result
    assert _worker_maps(pool, "asteria-test-gone") == 0
    assert _worker_maps(pool, "asteria-test-kept") == 2


def test_a_solve_that_fails_after_writing_leaves_no_readable_result() -> None:
    """The worker converts a solve's results straight into the client's result segment, under
    its seqlock (no separate copy into shared memory). A solve that fails after that (here an
    output corrupted before the final check) ends the write under a sequence nobody announces:
    the segment is not left mid-write, the result announced in it before is no longer
    accepted (never a mix of the two), and the next solve writes and announces normally."""
    faulty = WorkerPool(PoolConfig(num_workers=1, solve_timeout_s=30.0, test_fault_prefix="x"))
    kind = SolveKind.EIGENBASIS
    snap, res = client_segments(kind)
    try:
        good = run(faulty, 1, shm_task(kind, snap, res, 1))
        assert good.result is not None and good.result.shm is not None
        assert good.result.shm.segment is res
        assert private_result(good.result) is not None
        bad = run(faulty, 2, dataclasses.replace(shm_task(kind, snap, res, 2), block="xnan:b"))
        assert bad.result is None and "NaN or Inf" in (bad.error or "")
        assert res.sequence % 2 == 0  # the write was ended, not left open
        assert res.sequence != good.result.shm.sequence
        assert private_result(good.result) is None  # rejected, never read half-overwritten
        again = run(faulty, 3, shm_task(kind, snap, res, 3))
        assert again.result is not None
        copied = private_result(again.result)
        assert copied is not None
        reference = solve(dataclasses.replace(again.task, matrix=spd(N, 3), shm_source=None))
        np.testing.assert_array_equal(copied.matrix, reference.matrix)
    finally:
        faulty.close()
        snap.close()
        res.close()


def test_stand_ins_are_shared_read_only_and_checked_against_the_capacity() -> None:
    snap, _ = client_segments(SolveKind.EIGENBASIS)
    specs = snapshot_layout(N, SolveKind.EIGENBASIS, 4)
    first, second = snap.stand_ins(specs)
    assert first.shape == (N, N) and first.dtype == np.float32 and first is second
    with pytest.raises(ValueError):
        first[0, 0] = 1.0
    too_big = snapshot_layout(4 * N, SolveKind.EIGENBASIS, 4)
    with pytest.raises(InvalidInputError, match="larger segment"):
        snap.stand_ins(too_big)
