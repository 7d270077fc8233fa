"""AnnounceSnapshots: the snapshots of many blocks, written in shared-memory segments, announced
in one call; each checked and queued on its own, with its own answer. A real daemon, real
segments handed over on its socket, results read back from the result segments.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from asteria_client.transport.connection import DaemonConnection, SessionInfo
from asteria_client.transport.segments import SegmentSet
from asteria_server.errors import InvalidInputError, UnknownSessionError
from asteria_server.protocol import convert
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.shm import SegmentRef
from asteria_server.service.servicer import RESULT_BATCH_RESULTS
from asteria_server.types import SolveKind, SolveResult, SolveTask, SubmitOutcome
from tests.integration.test_daemon import Daemon, start_daemon, stop_daemon

WAIT_S = 60.0


def spd(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((n, n + 4)).astype(np.float32)
    a = g @ g.T / n
    a = (a + a.T) * np.float32(0.5)
    a[np.diag_indices(n)] += np.float32(1e-2)
    return a


def inverse_root(a: np.ndarray, p: float = 0.25) -> np.ndarray:
    w, v = np.linalg.eigh(a.astype(np.float64))
    return (v * np.power(np.maximum(w, 0.0) + 1e-12, -p)) @ v.T


class Client:
    """One session with its segments and a thread draining its results stream."""

    def __init__(self, address: str) -> None:
        self.conn = DaemonConnection(address)
        self.session: SessionInfo = self.conn.open_session()
        self.shm = SegmentSet(enabled=True)
        self.shm.open(self.session)
        assert self.shm.active, "the test daemon offers shared memory"
        self.results: queue.Queue[SolveResult] = queue.Queue()
        self._cancel: Callable[[], object] | None = None
        ready = threading.Event()

        def on_call(cancel: Callable[[], object]) -> None:
            self._cancel = cancel
            ready.set()

        def drain() -> None:
            try:
                for result in self.conn.results(
                    self.session, {}, on_call, reader=self.shm.read_result
                ):
                    self.results.put(result)
            except Exception:  # cancelled at close
                pass

        self._thread = threading.Thread(target=drain, daemon=True)
        self._thread.start()
        assert ready.wait(10.0)
        self.snapshots: dict[str, Any] = {}

    def write(self, task: SolveTask) -> SegmentRef:
        """``task`` written into its block's snapshot segment (made on first use)."""
        snap = self.snapshots.get(task.block)
        if snap is None:
            made = self.shm.create(task)
            assert made is not None
            snap = self.snapshots[task.block] = made[0]
        return snap.write_snapshot(task)

    def wait_results(self, count: int) -> dict[str, SolveResult]:
        got: dict[str, SolveResult] = {}
        while len(got) < count:
            result = self.results.get(timeout=WAIT_S)
            got[result.block] = result
        return got

    def close(self) -> None:
        if self._cancel is not None:
            self._cancel()
        self._thread.join(timeout=10.0)
        self.conn.close_session(self.session.session_id)
        self.conn.close()
        self.shm.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path)
    yield d
    stop_daemon(d)


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    c = Client(daemon.target)
    yield c
    c.close()


def task(block: str, version: int, matrix: np.ndarray) -> SolveTask:
    return SolveTask(block=block, version=version, kind=SolveKind.INVERSE_ROOT, matrix=matrix)


def test_many_blocks_in_one_call_are_each_solved(client: Client) -> None:
    matrices = {f"b{i}": spd(12 + i, seed=i) for i in range(4)}
    tasks = [task(block, 3, matrix) for block, matrix in matrices.items()]
    refs = [(t, client.write(t)) for t in tasks]
    answers = client.conn.announce(client.session, refs)
    assert answers == [SubmitOutcome.QUEUED] * 4
    results = client.wait_results(4)
    for block, matrix in matrices.items():
        got = results[block]
        assert got.version == 3
        expected = inverse_root(matrix)
        assert np.abs(got.matrix - expected).max() <= 1e-4 * np.abs(expected).max()


def test_a_refused_snapshot_does_not_fail_the_others(client: Client) -> None:
    good = task("good", 1, spd(10, seed=1))
    bad = task("bad", 1, spd(10, seed=2))
    good_ref = client.write(good)
    client.write(bad)
    unknown = SegmentRef("0" * 32, 2)  # a segment this session never handed over
    stale_task = task("stale", 1, spd(10, seed=3))
    stale_ref = client.write(stale_task)
    client.write(task("stale", 2, spd(10, seed=4)))  # overwrites version 1 in the segment
    answers = client.conn.announce(
        client.session, [(good, good_ref), (bad, unknown), (stale_task, stale_ref)]
    )
    assert answers[0] is SubmitOutcome.QUEUED
    assert isinstance(answers[1], InvalidInputError), answers[1]
    assert answers[2] is SubmitOutcome.STALE_IGNORED  # a newer write replaced it: not solved
    assert client.wait_results(1)["good"].version == 1
    with pytest.raises(queue.Empty):
        client.results.get(timeout=1.0)  # neither the refused nor the stale one came back


def test_the_call_fails_for_an_unknown_session_or_a_snapshot_without_segment(
    client: Client, daemon: Daemon
) -> None:
    t = task("x", 1, spd(8, seed=5))
    ref = client.write(t)
    ghost = dataclasses.replace(client.session, session_id="no-such-session")
    with pytest.raises(UnknownSessionError):
        client.conn.announce(ghost, [(t, ref)])
    header = convert.snapshot_header(t)  # no shm: its bytes would have to follow
    request = pb.AnnounceSnapshotsRequest(session_id=client.session.session_id, snapshots=[header])
    with pytest.raises(grpc.RpcError) as info:
        daemon.stub().AnnounceSnapshots(request, timeout=10.0)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "SubmitSnapshot" in (info.value.details() or "")


def test_results_that_piled_up_reach_the_stream_several_to_a_message(daemon: Daemon) -> None:
    """``batch_results``: results that are ready when the stream gets to them (here all of
    them: no stream was open while they were solved, as when a busy daemon's worker finishes
    faster than its loop writes) come many to a message, not a message each: read from its
    segment by the session that owns it, and copied out, arrays in the batch, to the other
    sessions of the tenant that have no segments (data-parallel replicas; two at once, which
    share the entries one of them copied)."""
    conn = DaemonConnection(daemon.target)
    session = conn.open_session()
    replicas = [DaemonConnection(daemon.target) for _ in range(2)]
    sessions = [session, *(r.open_session() for r in replicas)]
    shm = SegmentSet(enabled=True)
    shm.open(session)
    count = 300
    try:
        tasks = [task(f"b{i:03d}", 2, spd(8, seed=i)) for i in range(count)]
        refs = []
        for t in tasks:
            made = shm.create(t)
            assert made is not None
            refs.append((t, made[0].write_snapshot(t)))
        assert conn.announce(session, refs) == [SubmitOutcome.QUEUED] * count
        deadline = time.monotonic() + WAIT_S
        while True:
            _, summary, _ = conn.status_summary(session.session_id)
            assert summary is not None
            if summary.blocks == count and summary.never_computed == 0:
                break
            assert time.monotonic() < deadline, summary
            time.sleep(0.05)
        cancels: list[Callable[[], object]] = []
        got: list[dict[str, SolveResult]] = [{}, {}, {}]

        def drain(i: int, c: DaemonConnection, reader: Any) -> None:
            for result in c.results(sessions[i], {}, cancels.append, reader=reader):
                got[i][result.block] = result
                if len(got[i]) == count:
                    break

        drain(0, conn, shm.read_result)
        threads = [
            threading.Thread(target=drain, args=(i + 1, c, None), daemon=True)
            for i, c in enumerate(replicas)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        for i, c in enumerate([conn, *replicas]):
            assert len(got[i]) == count, (i, len(got[i]))
            for t in tasks[:: count // 10]:
                expected = inverse_root(t.matrix)
                assert got[i][t.block].version == 2
                error = np.abs(got[i][t.block].matrix - expected).max()
                assert error <= 1e-4 * np.abs(expected).max()
            assert c.result_messages <= -(-count // RESULT_BATCH_RESULTS) + 1, c.result_messages
    finally:
        for c, s in zip([conn, *replicas], sessions, strict=True):
            c.close_session(s.session_id)
            c.close()
        shm.close()
