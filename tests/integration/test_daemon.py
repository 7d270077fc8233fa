"""The daemon end to end: a real `asteria-server` subprocess and a real gRPC client.

The client side uses only the generated stubs and ``protocol.convert``, as the client's gRPC
transport does. Results are compared with ``engine.solve`` on the same task.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asteria_client.config import environ_without_asteria
from asteria_client.daemon_process import DaemonProcess, DaemonStartError
from asteria_server.engine import SolveKind, SolveResult, SolveTask, SubmitOutcome, solve
from asteria_server.engine.shm import SEGMENT_PREFIX
from asteria_server.protocol import convert, framing
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc
from tests.protocol_readers import read_results

START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0


@dataclass
class Daemon:
    """A daemon subprocess as the tests see it. Tests that start one their own way (like
    systemd, in test_metrics) build this from their own ``Popen``."""

    proc: subprocess.Popen[Any]
    sock: Path
    target: str
    serving_line: str

    def stub(self) -> pb_grpc.PreconditionerStub:
        channel = grpc.insecure_channel(self.target)
        return pb_grpc.PreconditionerStub(channel)


@dataclass
class LaunchedDaemon(Daemon):
    """A daemon started by the client's launcher (:class:`DaemonProcess`), as benchmarks do."""

    launcher: DaemonProcess


def _clean_env() -> dict[str, str]:
    return environ_without_asteria() | {"ASTERIA_LOG_LEVEL": "WARNING"}


def start_daemon(
    tmp_path: Path, *extra: str, name: str = "d", env: dict[str, str] | None = None
) -> LaunchedDaemon:
    """A one-worker daemon on ``tmp_path/name/asteria.sock``, serving when this returns
    (``env``: variables set for it, e.g. ``ASTERIA_*`` settings)."""
    launcher = DaemonProcess(workers=1, extra_args=extra, socket_dir=tmp_path / name, env=env)
    try:
        launcher.start()
    except DaemonStartError as exc:
        pytest.fail(str(exc))
    assert launcher.socket_path is not None
    return LaunchedDaemon(
        launcher.process, launcher.socket_path, launcher.address, launcher.serving_line, launcher
    )


def stop_daemon(daemon: Daemon) -> tuple[int, str]:
    """SIGTERM, and the exit status and stderr; fails the test if SIGTERM did not stop it."""
    if isinstance(daemon, LaunchedDaemon):
        end = daemon.launcher.stop()
        if end.killed:
            pytest.fail(f"daemon did not stop on SIGTERM:\n{end.stderr}")
        return end.returncode, end.stderr
    if daemon.proc.poll() is None:
        daemon.proc.send_signal(signal.SIGTERM)
    try:
        _, err = daemon.proc.communicate(timeout=CALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        daemon.proc.kill()
        _, err = daemon.proc.communicate()
        pytest.fail(f"daemon did not stop on SIGTERM:\n{err}")
    return daemon.proc.returncode, err


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("daemon"), "--max-matrix-n", "32")
    yield d
    stop_daemon(d)


def spd(n: int, seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal((n, n))
    return a @ a.T + n * np.eye(n)


def open_session(stub: pb_grpc.PreconditionerStub, tenant: str = "", token: str = "") -> str:
    reply = stub.OpenSession(
        pb.OpenSessionRequest(tenant=tenant, token=token, job="test"), timeout=CALL_TIMEOUT_S
    )
    assert reply.incarnation_id and reply.limits.max_chunk_bytes == 1 << 20
    return reply.session_id


def submit(stub: pb_grpc.PreconditionerStub, session: str, task: SolveTask) -> SubmitOutcome:
    messages = framing.snapshot_messages(task, session_id=session)
    reply = stub.SubmitSnapshot(messages, timeout=CALL_TIMEOUT_S)
    return convert.outcome_from_proto(reply)


def receive(
    stub: pb_grpc.PreconditionerStub, session: str, blocks: list[str]
) -> dict[str, SolveResult]:
    stream = stub.StreamResults(
        pb.StreamResultsRequest(session_id=session, blocks=blocks), timeout=CALL_TIMEOUT_S
    )
    got: dict[str, SolveResult] = {}
    for result in read_results(stream):
        got[result.block] = result
        if len(got) == len(blocks):
            break
    stream.cancel()
    return got


def block_status(stub: pb_grpc.PreconditionerStub, session: str) -> dict[str, pb.BlockStatus]:
    reply = stub.Status(pb.StatusRequest(session_id=session), timeout=CALL_TIMEOUT_S)
    return {b.block: b for b in reply.blocks}


def expect_code(code: grpc.StatusCode, call: object, *args: object) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=CALL_TIMEOUT_S)  # type: ignore[operator]
    assert info.value.code() is code, info.value.details()
    return str(info.value.details())


def test_results_match_the_engine_and_bad_input_keeps_the_last_result(daemon: Daemon) -> None:
    stub = daemon.stub()
    session = open_session(stub)
    root = SolveTask(block="w.L", version=1, kind=SolveKind.INVERSE_ROOT, matrix=spd(16, 0))
    eig = SolveTask(block="w.R", version=1, kind=SolveKind.EIGENBASIS, matrix=spd(16, 1))
    assert submit(stub, session, root) is SubmitOutcome.QUEUED
    assert submit(stub, session, eig) is SubmitOutcome.QUEUED
    assert submit(stub, session, root) is SubmitOutcome.DUPLICATE  # a second replica

    got = receive(stub, session, ["w.L", "w.R"])
    # Every data-parallel replica's stream gets the result, not only the first to ask.
    replica = open_session(stub)
    assert receive(stub, replica, ["w.L"])["w.L"].version == 1
    want_root, want_eig = solve(root), solve(eig)
    assert got["w.L"].version == 1 and got["w.L"].tenant == "local"
    np.testing.assert_allclose(got["w.L"].matrix, want_root.matrix, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got["w.R"].eigenvalues, want_eig.eigenvalues, rtol=1e-9)
    # Eigenvectors are unique up to sign; the basis travels in its solver's dtype.
    q, q_want = got["w.R"].matrix, want_eig.matrix
    assert q.dtype == q_want.dtype
    signs = np.sign(np.sum(q * q_want, axis=0))
    np.testing.assert_allclose(q * signs, q_want, atol=100 * np.finfo(q.dtype).eps)
    q64, lam = q.astype(np.float64), got["w.R"].eigenvalues.astype(np.float64)
    tol = 100 * np.finfo(q.dtype).eps * np.linalg.norm(eig.matrix)
    assert np.linalg.norm(q64 @ np.diag(lam) @ q64.T - eig.matrix) < tol

    status = block_status(stub, session)
    assert status["w.L"].version == 1 and status["w.R"].version == 1

    # Framing errors: INVALID_ARGUMENT, nothing reaches the engine.
    wrong_dtype = list(framing.snapshot_messages(root, session_id=session))
    wrong_dtype[0].header.version = 2
    wrong_dtype[0].header.dtype = pb.DTYPE_INT64
    msg = expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.SubmitSnapshot, iter(wrong_dtype))
    assert "w.L" in msg and "dtype" in msg

    not_square = list(framing.snapshot_messages(root, session_id=session))[:1]
    not_square[0].header.version = 2
    not_square.append(pb.SubmitSnapshotRequest(chunk=np.zeros((16, 15)).tobytes()))
    msg = expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.SubmitSnapshot, iter(not_square))
    assert "ended early" in msg

    too_big = SolveTask(block="w.L", version=2, kind=SolveKind.INVERSE_ROOT, matrix=spd(64, 2))
    messages = framing.snapshot_messages(too_big, session_id=session)
    msg = expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.SubmitSnapshot, messages)
    assert "max_matrix_n" in msg

    big_chunk = list(framing.snapshot_messages(root, session_id=session))[:1]
    big_chunk[0].header.version = 2
    big_chunk[0].header.n = 32
    big_chunk.append(pb.SubmitSnapshotRequest(chunk=b"\0" * ((1 << 20) + 1)))
    msg = expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.SubmitSnapshot, iter(big_chunk))
    assert "exceeds the limit" in msg

    assert block_status(stub, session)["w.L"].submitted_version == 1  # none was accepted

    # NaN is numerics, not framing: accepted, then a counted solve failure (engine semantics).
    nan = spd(16, 3)
    nan[0, 0] = np.nan
    bad = SolveTask(block="w.L", version=2, kind=SolveKind.INVERSE_ROOT, matrix=nan)
    assert submit(stub, session, bad) is SubmitOutcome.QUEUED
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while (s := block_status(stub, session)["w.L"]).failures == 0:
        assert time.monotonic() < deadline, "the NaN snapshot's failure was never recorded"
        time.sleep(0.05)
    assert s.version == 1 and "NaN" in s.last_error  # the last good result stays

    expect_code(
        grpc.StatusCode.NOT_FOUND, stub.Status, pb.StatusRequest(session_id="no-such-session")
    )


def test_socket_is_private_and_a_second_daemon_is_refused(daemon: Daemon) -> None:
    assert stat.S_IMODE(daemon.sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(daemon.sock.parent.stat().st_mode) == 0o700
    second = subprocess.run(
        [sys.executable, "-m", "asteria_server", "--listen", daemon.target, "--workers", "1"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=START_TIMEOUT_S,
    )
    assert second.returncode != 0
    assert f"pid {daemon.proc.pid}" in second.stderr and "already serves" in second.stderr
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(daemon.target))
    reply = health.Check(health_pb2.HealthCheckRequest(service="asteria.v1.Preconditioner"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (init reaps orphans on its own time)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_tenants_are_isolated_and_sigterm_cleans_up(tmp_path: Path) -> None:
    config = tmp_path / "asteria.toml"
    config.write_text(
        'grace_period_s = 2.0\n[tenants]\nalice = "a-secret-0123456789"\n'
        'bob = "b-secret-0123456789"\n'
    )
    d = start_daemon(tmp_path, "--config", str(config))
    try:
        stub = d.stub()
        details = expect_code(
            grpc.StatusCode.UNAUTHENTICATED,
            stub.OpenSession,
            pb.OpenSessionRequest(tenant="alice", token="b-secret-0123456789"),
        )
        assert "b-secret-0123456789" not in details
        expect_code(grpc.StatusCode.UNAUTHENTICATED, stub.OpenSession, pb.OpenSessionRequest())
        alice, bob = (
            open_session(stub, "alice", "a-secret-0123456789"),
            open_session(stub, "bob", "b-secret-0123456789"),
        )
        task = SolveTask(
            block="shared.name", version=3, kind=SolveKind.INVERSE_ROOT, matrix=spd(8, 4)
        )
        assert submit(stub, alice, task) is SubmitOutcome.QUEUED
        assert receive(stub, alice, ["shared.name"])["shared.name"].tenant == "alice"
        assert list(block_status(stub, alice)) == ["shared.name"]
        assert block_status(stub, bob) == {}  # bob sees none of alice's blocks
        # The same name under bob is bob's own block: not a duplicate of alice's.
        assert submit(stub, bob, task) is SubmitOutcome.QUEUED

        workers = _children(d.proc.pid)
        assert workers, "the daemon should run a solver worker process"
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(d.target))
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        code, err = stop_daemon(d)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert code == 0, err
    assert not d.sock.exists() and not d.sock.with_name("asteria.sock.lock").exists()
    # A worker whose daemon is gone exits when its pipe closes: allow it a moment, not forever.
    deadline = time.monotonic() + 10.0
    while [pid for pid in workers if _running(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _running(pid)], "solver workers outlived the daemon"
    leaked = [p for p in os.listdir("/dev/shm") if p.startswith(f"{SEGMENT_PREFIX}{d.proc.pid}_")]
    assert leaked == []


def test_tcp_without_tokens_is_refused(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asteria_server", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=START_TIMEOUT_S,
    )
    assert out.returncode == 2 and "no tenant tokens" in out.stderr


def test_the_upload_budget_refuses_oversized_and_busies_concurrent_uploads(
    tmp_path: Path,
) -> None:
    """A 16 KiB budget: a 32x32 float32 snapshot (4 KiB) fits; one of 96x96 (36 KiB) is refused;
    while a slow client holds 12 KiB, another 8 KiB upload gets RESOURCE_EXHAUSTED."""
    d = start_daemon(tmp_path, "--max-upload-bytes", "16384", "--upload-wait-s", "0.3")
    try:
        stub = d.stub()
        session = stub.OpenSession(pb.OpenSessionRequest(), timeout=CALL_TIMEOUT_S).session_id

        def snapshot(block: str, n: int, pause_s: float = 0.0) -> Iterator[Any]:
            task = SolveTask(
                block=block,
                version=0,
                kind=SolveKind.INVERSE_ROOT,
                matrix=spd(n, 0).astype(np.float32),
            )
            messages = list(framing.snapshot_messages(task, session_id=session, chunk_bytes=2048))
            yield messages[0]
            yield messages[1]
            time.sleep(pause_s)  # hold the budget with a half-sent snapshot
            yield from messages[2:]

        assert stub.SubmitSnapshot(snapshot("fits", 32), timeout=CALL_TIMEOUT_S).outcome == (
            pb.SUBMIT_OUTCOME_QUEUED
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.SubmitSnapshot(snapshot("big", 96), timeout=CALL_TIMEOUT_S)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "max_upload_bytes" in (refused.value.details() or "")

        slow = stub.SubmitSnapshot.future(snapshot("slow", 55, pause_s=2.0), timeout=30)
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as busy:
            stub.SubmitSnapshot(snapshot("second", 45), timeout=CALL_TIMEOUT_S)
        assert busy.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert slow.result().outcome == pb.SUBMIT_OUTCOME_QUEUED
        # Room again once the slow upload finished.
        assert stub.SubmitSnapshot(snapshot("second", 45), timeout=CALL_TIMEOUT_S).outcome == (
            pb.SUBMIT_OUTCOME_QUEUED
        )
    finally:
        stop_daemon(d)


def test_forgetting_blocks_on_close_forgets_the_sessions_job(daemon: Daemon) -> None:
    """(More in test_daemon_tiers: other jobs' blocks stay, spill files go.)"""
    stub = daemon.stub()
    session = open_session(stub)  # job "test"
    submit(
        stub,
        session,
        SolveTask(block="gone", version=1, kind=SolveKind.INVERSE_ROOT, matrix=spd(4, 1)),
    )
    close = pb.CloseSessionRequest(session_id=session, forget_blocks=True)
    stub.CloseSession(close, timeout=CALL_TIMEOUT_S)
    assert "gone" not in block_status(stub, open_session(stub))


def test_the_launcher_reports_a_tcp_port_its_pid_and_cpu_time() -> None:
    with DaemonProcess(listen="127.0.0.1:0", env={"ASTERIA_TOKENS": "t=secret-0123456789abc"}) as d:
        host, port = d.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0 and d.socket_path is None
        assert f"pid={d.pid}" in d.serving_line and d.cpu_s is None
    assert d.exit is not None and d.exit.returncode == 0 and not d.exit.killed
    assert d.cpu_s is not None and d.cpu_s > 0  # the daemon's own start-up at least
    assert d.stop() is d.exit


def test_the_launcher_reports_why_a_daemon_did_not_start() -> None:
    with pytest.raises(DaemonStartError, match=r"(?s)exited with 2.*no tenant tokens"):
        DaemonProcess(listen="127.0.0.1:0").start()


LAUNCHER = """
import sys, time
from pathlib import Path
from asteria_client.daemon_process import DaemonProcess
daemon = DaemonProcess(workers=1, socket_dir=Path(sys.argv[1])).start()
print(daemon.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie nobody reaped yet counts as exited)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat_line.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_a_launched_daemon_stops_when_its_launcher_is_killed(tmp_path: Path) -> None:
    """A benchmark or test run killed with SIGKILL leaves no daemon (nor workers) behind: the
    launcher's daemon watches it (--stop-with-pid) and stops as on SIGTERM."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "d")],
        stdout=subprocess.PIPE,
        text=True,
        env=_clean_env(),
    )
    try:
        assert launcher.stdout is not None
        pid = int(launcher.stdout.readline())
        workers = _children(pid)
        assert workers and (tmp_path / "d" / "asteria.sock").exists()
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in (pid, *workers) if not _gone(p)]
    finally:
        launcher.kill()
        launcher.wait()
    if alive:
        for p in alive:
            os.kill(p, signal.SIGKILL)
        pytest.fail(f"processes {alive} outlived the launcher that was killed")
    # It stopped as on SIGTERM: the socket was removed on the way out.
    assert not (tmp_path / "d" / "asteria.sock").exists()
