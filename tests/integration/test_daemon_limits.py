"""Issue 10: the daemon is bounded and isolated, each limit provoked for real.

Every test attacks a real ``asteria-server`` subprocess the way a hostile or unlucky tenant
would (raw gRPC with the project's own framing, raw segment handovers, a process descriptor
limit set with ``prlimit``, a solver worker stopped with SIGSTOP or killed), with the limits
lowered by flags so that it stays small and fast, and checks that the attack costs the attacker
a clear error and nobody else anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asteria_client.cli import main as cli_main
from asteria_client.daemon_process import DaemonProcess, DaemonStartError
from asteria_client.transport import DaemonConnection
from asteria_client.transport.shm import HandoverChannel
from asteria_server.engine import SolveKind, SolveTask, SubmitOutcome
from asteria_server.protocol import framing
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc
from asteria_server.protocol.handover import Attach, SegmentRole
from asteria_server.protocol.shm import SharedMemoryUnavailableError, create_segment
from tests.integration.test_daemon import (
    CALL_TIMEOUT_S,
    Daemon,
    LaunchedDaemon,
    _children,
    block_status,
    expect_code,
    open_session,
    receive,
    spd,
    start_daemon,
    stop_daemon,
    submit,
)
from tests.protocol_readers import read_results

TOKENS = {"alice": "a-secret-0123456789", "bob": "b-secret-0123456789"}


def tokens_config(tmp_path: Path) -> Path:
    config = tmp_path / "asteria.toml"
    body = "".join(f'{tenant} = "{token}"\n' for tenant, token in TOKENS.items())
    config.write_text(f"grace_period_s = 2.0\n[tenants]\n{body}")
    return config


def start_tenants_daemon(tmp_path: Path, *extra: str) -> LaunchedDaemon:
    return start_daemon(tmp_path, "--config", str(tokens_config(tmp_path)), *extra)


def task(block: str, version: int, n: int, dtype: Any = np.float64) -> SolveTask:
    return SolveTask(
        block=block,
        version=version,
        kind=SolveKind.INVERSE_ROOT,
        matrix=spd(n, version).astype(dtype),
    )


def busy(call: Any, *args: Any) -> str:
    """The message of a RESOURCE_EXHAUSTED answer."""
    return expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, call, *args)


def submit_error(stub: pb_grpc.PreconditionerStub, session: str, t: SolveTask) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        submit(stub, session, t)
    return info.value


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def vm_peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmPeak:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmPeak")


def wait_computed(stub: pb_grpc.PreconditionerStub, session: str, blocks: list[str]) -> None:
    """Until every block has a computed result (read from Status, not from a stream)."""
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while time.monotonic() < deadline:
        status = block_status(stub, session)
        if all(b in status and status[b].version >= 0 for b in blocks):
            return
        time.sleep(0.05)
    pytest.fail(f"not all of {blocks} were computed")


@contextlib.contextmanager
def stopped_workers(daemon: Daemon) -> Iterator[list[int]]:
    """The daemon's solver workers stopped with SIGSTOP (nothing is solved meanwhile)."""
    workers = _children(daemon.proc.pid)
    assert workers, "the daemon should run a solver worker"
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield workers
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


# ----------------------------------------------------------------------- 1. descriptors


class _LimitedDaemon(DaemonProcess):
    """A daemon started under ``prlimit --nofile=N:N`` (soft and hard: it cannot raise it)."""

    def __init__(self, nofile: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nofile = nofile

    def command(self, listen: str, ready_file: Path) -> list[str]:
        limit = f"--nofile={self.nofile}:{self.nofile}"
        return ["prlimit", limit, "--", *super().command(listen, ready_file)]


def _attach_page(channel: HandoverChannel, segment_id: str) -> None:
    fd, segment = create_segment(mmap.PAGESIZE)
    try:
        channel._request(Attach(segment_id, mmap.PAGESIZE, SegmentRole.SNAPSHOT), [fd])
    finally:
        os.close(fd)  # the daemon keeps its own descriptor of it
        segment.close()


def test_descriptor_exhaustion_refuses_segments_and_the_engine_keeps_serving(
    tmp_path: Path,
) -> None:
    """Under a 256-descriptor limit a tenant hands over page-sized segments on 3 connections
    until refused: the refusal names the limit, no connection drops, the other tenant still
    hands segments over, and snapshots are still solved (the engine never ran out)."""
    launcher = _LimitedDaemon(
        256,
        workers=1,
        extra_args=("--config", str(tokens_config(tmp_path))),
        socket_dir=tmp_path / "d",
    )
    try:
        launcher.start()
    except DaemonStartError as exc:
        pytest.fail(str(exc))
    try:
        alice = DaemonConnection(launcher.address, tenant="alice", token=TOKENS["alice"])
        session = alice.open_session()
        channels = [HandoverChannel(session.shm_socket, session.session_id) for _ in range(3)]
        refused = ""
        for i in range(300):
            try:
                _attach_page(channels[i % 3], f"seg{i}")
            except SharedMemoryUnavailableError as exc:
                refused = str(exc)
                break
        assert "refused" in refused and "tenant_shm_segments" in refused, refused
        assert all(channel.alive() for channel in channels), "a refusal dropped a connection"

        bob = DaemonConnection(launcher.address, tenant="bob", token=TOKENS["bob"])
        bob_session = bob.open_session()
        bob_channel = HandoverChannel(bob_session.shm_socket, bob_session.session_id)
        for i in range(10):
            _attach_page(bob_channel, f"b{i}")

        stub = pb_grpc.PreconditionerStub(grpc.insecure_channel(launcher.address))
        sid = open_session(stub, "alice", TOKENS["alice"])
        assert submit(stub, sid, task("after", 1, 16)) is SubmitOutcome.QUEUED
        assert receive(stub, sid, ["after"])["after"].version == 1
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(launcher.address))
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for channel in [*channels, bob_channel]:
            channel.close()
    finally:
        end = launcher.stop()
    assert end.returncode == 0, end.stderr


def test_a_broken_engine_turns_health_not_serving_and_the_daemon_exits_non_zero(
    tmp_path: Path,
) -> None:
    """Solver workers killed before they become ready break the worker pool for good: the
    daemon must then say NOT_SERVING and exit non-zero so its supervisor restarts it."""
    d = start_daemon(tmp_path)
    try:
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(d.target))
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        deadline = time.monotonic() + 45
        while d.proc.poll() is None and time.monotonic() < deadline:
            for pid in _children(d.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        assert d.proc.poll() is not None, "the daemon kept running with a broken engine"
        seen = []
        with contextlib.suppress(grpc.RpcError):
            for reply in watch:
                seen.append(reply.status)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen or not seen
    finally:
        code, err = stop_daemon(d)
    assert code == 3, err
    assert "stopped working" in err


# ----------------------------------------------------------------------- 2. memory


def test_queued_snapshots_are_bounded_per_tenant_and_by_the_memory_budget(
    tmp_path: Path,
) -> None:
    """With the worker stopped, distinct n=128 fp64 snapshots (128 KiB each) pile up in the
    queue: the tenant's quota stops them, naming it; once solved, room comes back."""
    d = start_daemon(tmp_path, "--tenant-queued-bytes", "600000")
    try:
        stub = d.stub()
        sid = open_session(stub)
        with stopped_workers(d):
            outcomes = []
            for i in range(10):
                try:
                    outcomes.append(submit(stub, sid, task(f"q{i}", 1, 128)))
                except grpc.RpcError as exc:
                    assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                    assert "tenant_queued_bytes" in (exc.details() or "")
                    break
            assert 3 <= len(outcomes) <= 5, outcomes
        got = receive(stub, sid, [f"q{i}" for i in range(len(outcomes))])
        assert len(got) == len(outcomes)
        assert submit(stub, sid, task("q9", 1, 128)) is SubmitOutcome.QUEUED
    finally:
        stop_daemon(d)

    d = start_daemon(
        tmp_path, "--max-memory", "400000", "--tenant-queued-bytes", "10000000", name="m"
    )
    try:
        stub = d.stub()
        sid = open_session(stub)
        with stopped_workers(d):
            for i in range(10):
                try:
                    submit(stub, sid, task(f"m{i}", 1, 128))
                except grpc.RpcError as exc:
                    assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                    assert "max_memory_bytes" in (exc.details() or "")
                    break
            else:
                pytest.fail("1.3 MB of snapshots fit a 400 kB memory budget")
    finally:
        stop_daemon(d)


def test_cached_results_and_blocks_are_bounded_per_tenant(tmp_path: Path) -> None:
    """Results of n=128 take 66 KiB each in the daemon: a fifth new block exceeds a 300 kB
    cache quota; a new version of a known block does not."""
    d = start_daemon(tmp_path, "--tenant-cached-bytes", "300000")
    try:
        stub = d.stub()
        sid = open_session(stub)
        for i in range(4):
            assert submit(stub, sid, task(f"c{i}", 1, 128, np.float32)) is SubmitOutcome.QUEUED
            assert receive(stub, sid, [f"c{i}"])
        error = submit_error(stub, sid, task("c4", 1, 128, np.float32))
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant_cached_bytes" in (error.details() or "")
        assert submit(stub, sid, task("c0", 2, 128, np.float32)) is SubmitOutcome.QUEUED
    finally:
        stop_daemon(d)


def test_a_default_daemon_registers_20000_blocks_in_one_session(tmp_path: Path) -> None:
    """A 7B model's shards on one rank: 20,000 blocks in one RegisterBlocks of one session fit
    a default daemon's quotas, and so do five such sessions' worth; past the quota (100,000)
    the error names the limit, what the tenant holds, and how to raise it."""

    def register(sid: str, names: list[str]) -> pb.RegisterBlocksRequest:
        specs = [pb.BlockSpec(block=b, n=2048, kind=pb.SOLVE_KIND_EIGENBASIS) for b in names]
        return pb.RegisterBlocksRequest(session_id=sid, blocks=specs)

    d = start_tenants_daemon(tmp_path)
    try:
        stub = d.stub()
        sid = open_session(stub, "alice", TOKENS["alice"])
        names = [f"layers.{i // 64}.mlp.up_proj/tile{i % 64}/dim0" for i in range(20_000)]
        stub.RegisterBlocks(register(sid, names), timeout=60)
        for shard in range(1, 5):  # four more ranks' worth: 100,000, the default quota
            shards = [f"shard{shard}.{name}" for name in names]
            stub.RegisterBlocks(register(sid, shards), timeout=60)
        details = busy(stub.RegisterBlocks, register(sid, ["one-too-many"]))
        assert "has 100000 blocks" in details and "quota of 100000" in details, details
        assert "--tenant-max-blocks" in details and "tenant_max_blocks" in details, details
    finally:
        stop_daemon(d)


def test_registrations_and_block_names_are_bounded(tmp_path: Path) -> None:
    d = start_tenants_daemon(tmp_path, "--tenant-max-blocks", "50", "--max-block-name-bytes", "64")
    try:
        stub = d.stub()
        sid = open_session(stub, "alice", TOKENS["alice"])

        def register(names: list[str]) -> pb.RegisterBlocksRequest:
            specs = [pb.BlockSpec(block=b, n=8, kind=pb.SOLVE_KIND_INVERSE_ROOT) for b in names]
            return pb.RegisterBlocksRequest(session_id=sid, blocks=specs)

        details = busy(stub.RegisterBlocks, register([f"r{i}" for i in range(60)]))
        assert "tenant_max_blocks" in details
        long_name = "x" * 65
        details = expect_code(
            grpc.StatusCode.INVALID_ARGUMENT, stub.RegisterBlocks, register([long_name])
        )
        assert "max_block_name_bytes" in details
        error = submit_error(stub, sid, task(long_name, 1, 8))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        stub.RegisterBlocks(register([f"r{i}" for i in range(40)]), timeout=CALL_TIMEOUT_S)
        for i in range(10):  # unregistered blocks count as well
            assert submit(stub, sid, task(f"u{i}", 1, 8)) is SubmitOutcome.QUEUED
        receive(stub, sid, [f"u{i}" for i in range(10)])
        error = submit_error(stub, sid, task("u10", 1, 8))
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant_max_blocks" in (error.details() or "")
        # Another tenant's quota is its own.
        bob = open_session(stub, "bob", TOKENS["bob"])
        assert submit(stub, bob, task("u10", 1, 8)) is SubmitOutcome.QUEUED
    finally:
        stop_daemon(d)


def test_streams_that_do_not_read_are_bounded(tmp_path: Path) -> None:
    """A tenant holds at most --tenant-max-streams streams; results go out from one shared
    buffer (6 streams that read nothing of 8 MiB of results hold far less than a copy each);
    a stream whose client reads nothing ends after --stream-stall-s with RESOURCE_EXHAUSTED."""
    d = start_daemon(tmp_path, "--tenant-max-streams", "6", "--stream-stall-s", "2")
    try:
        stub = d.stub()
        sid = open_session(stub)
        blocks = [f"s{i}" for i in range(8)]
        for block in blocks:
            submit(stub, sid, task(block, 1, 512, np.float32))  # 1 MiB results
        wait_computed(stub, sid, blocks)  # no stream yet: all 6 below are the tenant's
        before = rss_mib(d.proc.pid)
        # No BDP probing: the client's flow-control window stays small, so a stream it does not
        # read stalls in the daemon instead of being buffered in this process.
        options = [("grpc.http2.bdp_probe", 0)]
        channels = [grpc.insecure_channel(d.target, options=options) for _ in range(6)]
        calls = [
            pb_grpc.PreconditionerStub(ch).StreamResults(
                pb.StreamResultsRequest(session_id=sid), timeout=60
            )
            for ch in channels
        ]
        time.sleep(1.0)
        held = rss_mib(d.proc.pid) - before
        details = busy(
            lambda **kw: next(stub.StreamResults(pb.StreamResultsRequest(session_id=sid), **kw))
        )
        assert "tenant_max_streams" in details
        time.sleep(3.0)  # past --stream-stall-s: reading now no longer unblocks them
        ends = []
        for call in calls:  # read now: what was buffered, then the stall's status
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            ends.append((info.value.code(), info.value.details()))
        assert all(code is grpc.StatusCode.RESOURCE_EXHAUSTED for code, _ in ends), ends
        assert all("stream_stall_s" in (why or "") for _, why in ends), ends
        # The streams are gone: a reading stream is accepted again and gets every result.
        assert set(receive(stub, sid, blocks)) == set(blocks)
        assert held < 6 * 8 * 0.25, f"{held:.0f} MiB held for 6 streams of 8 MiB of results"
        for ch in channels:
            ch.close()
    finally:
        stop_daemon(d)


# ----------------------------------------------------------------------- 4. uploads


def _stalling(
    session: str, t: SolveTask, *, chunk_bytes: int, pause_s: float, every: bool = False
) -> Iterator[pb.SubmitSnapshotRequest]:
    """A SubmitSnapshot stream that sends its header and first chunk, then pauses (after every
    chunk with ``every``)."""
    messages = list(framing.snapshot_messages(t, session_id=session, chunk_bytes=chunk_bytes))
    yield messages[0]
    for message in messages[1:]:
        yield message
        time.sleep(pause_s)
        if not every:
            time.sleep(60)


def test_a_stalled_upload_holds_neither_the_budget_nor_another_tenant(tmp_path: Path) -> None:
    """A 64 KiB upload budget, half of it per tenant. Alice stalls two 32 KiB uploads: the
    second finds no room in her share, Bob's upload goes through, and her stalled upload is
    dropped after --upload-idle-s; a trickling one after --upload-max-s."""
    d = start_tenants_daemon(
        tmp_path,
        "--max-upload-bytes",
        "65536",
        "--tenant-upload-share",
        "0.5",
        "--upload-wait-s",
        "0.5",
        "--upload-idle-s",
        "2",
        "--upload-max-s",
        "3",
    )
    try:
        stub = d.stub()
        alice = open_session(stub, "alice", TOKENS["alice"])
        bob = open_session(stub, "bob", TOKENS["bob"])
        stalled = stub.SubmitSnapshot.future(
            _stalling(alice, task("a0", 1, 64), chunk_bytes=4096, pause_s=0), timeout=30
        )
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as second:
            stub.SubmitSnapshot(
                _stalling(alice, task("a1", 1, 64), chunk_bytes=4096, pause_s=0), timeout=30
            )
        assert second.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant_upload_share" in (second.value.details() or "")
        assert submit(stub, bob, task("b0", 1, 64)) is SubmitOutcome.QUEUED
        with pytest.raises(grpc.RpcError) as idle:
            stalled.result()
        assert idle.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "upload_idle_s" in (idle.value.details() or "")
        with pytest.raises(grpc.RpcError) as slow:
            stub.SubmitSnapshot(
                _stalling(alice, task("a2", 1, 64), chunk_bytes=4096, pause_s=1.0, every=True),
                timeout=30,
            )
        assert slow.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "upload_max_s" in (slow.value.details() or "")
        assert submit(stub, alice, task("a3", 1, 64)) is SubmitOutcome.QUEUED
    finally:
        stop_daemon(d)


# ----------------------------------------------------------------------- 5. sessions


def test_sessions_are_capped_per_tenant_and_never_taken_from_another(tmp_path: Path) -> None:
    d = start_tenants_daemon(tmp_path, "--tenant-max-sessions", "3", "--max-sessions", "5")
    try:
        stub = d.stub()
        bob = open_session(stub, "bob", TOKENS["bob"])
        bob_stream = stub.StreamResults(pb.StreamResultsRequest(session_id=bob), timeout=60)
        assert submit(stub, bob, task("b", 1, 8)) is SubmitOutcome.QUEUED
        assert next(read_results(bob_stream)).block == "b"
        for _ in range(3):
            open_session(stub, "alice", TOKENS["alice"])
        request = pb.OpenSessionRequest(tenant="alice", token=TOKENS["alice"])
        assert "tenant_max_sessions" in busy(stub.OpenSession, request)
        open_session(stub, "bob", TOKENS["bob"])  # 5 sessions now, the daemon's cap
        request = pb.OpenSessionRequest(tenant="bob", token=TOKENS["bob"])
        assert "max_sessions" in busy(stub.OpenSession, request)
        # Nothing of Bob's was dropped: his session and his stream still work.
        assert list(block_status(stub, bob)) == ["b"]
        assert submit(stub, bob, task("b", 2, 8)) is SubmitOutcome.QUEUED
        assert next(read_results(bob_stream)).version == 2
        bob_stream.cancel()
    finally:
        stop_daemon(d)


def test_idle_sessions_expire_close_their_handover_and_end_with_a_clear_status(
    tmp_path: Path,
) -> None:
    """--session-ttl-s 1.5: a session with no call and no stream expires (its handover
    connection is closed); one with an open stream lives on. A closed session's stream ends
    NOT_FOUND saying so; an unknown id's NOT_FOUND says the daemon never opened it."""
    d = start_daemon(tmp_path, "--session-ttl-s", "1.5")
    try:
        stub = d.stub()
        conn = DaemonConnection(d.target)
        idle = conn.open_session()
        channel = HandoverChannel(idle.shm_socket, idle.session_id)
        _attach_page(channel, "page")
        kept = open_session(stub)
        stream = stub.StreamResults(pb.StreamResultsRequest(session_id=kept), timeout=60)
        time.sleep(4.0)
        request = pb.StatusRequest(session_id=idle.session_id)
        details = expect_code(grpc.StatusCode.NOT_FOUND, stub.Status, request)
        assert "expired" in details and "session_ttl_s" in details
        assert not channel.alive(), "the expired session's handover connection is still open"
        assert block_status(stub, kept) == {}  # the stream kept its session alive
        stub.CloseSession(pb.CloseSessionRequest(session_id=kept), timeout=CALL_TIMEOUT_S)
        with pytest.raises(grpc.RpcError) as ended:
            next(stream)
        assert ended.value.code() is grpc.StatusCode.NOT_FOUND
        assert "closed by CloseSession" in (ended.value.details() or "")
        request = pb.StatusRequest(session_id="f" * 32)
        assert "never opened" in expect_code(grpc.StatusCode.NOT_FOUND, stub.Status, request)
        channel.close()
        conn.close()
    finally:
        stop_daemon(d)


# ----------------------------------------------------------------------- 8. status


def test_status_is_paged_and_asteria_status_shows_every_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """300 blocks with 120-character names do not fit one 24 KiB message: Status answers a
    page with the total and where to go on, and ``asteria status`` reads every page."""
    d = start_daemon(tmp_path, "--chunk-bytes", "16384", "--max-message-bytes", "24576")
    try:
        stub = d.stub()
        sid = stub.OpenSession(pb.OpenSessionRequest(), timeout=CALL_TIMEOUT_S).session_id
        names = [f"{i:04d}." + "n" * 115 for i in range(300)]
        for name in names:
            assert submit(stub, sid, task(name, 1, 2)) is SubmitOutcome.QUEUED
        reply = stub.Status(pb.StatusRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
        assert reply.total_blocks == 300 and 0 < len(reply.blocks) < 300
        assert reply.next_after_block == reply.blocks[-1].block
        capsys.readouterr()
        assert cli_main(["status", "--address", d.target, "--json", "--blocks"]) == 0
        shown = json.loads(capsys.readouterr().out)["blocks"]
        assert sorted(b["block"] for b in shown) == names
    finally:
        stop_daemon(d)


# ----------------------------------------------------------------------- 9. small holes


@pytest.fixture(scope="module")
def tenants_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_tenants_daemon(tmp_path_factory.mktemp("tenants"))
    yield d
    stop_daemon(d)


def test_a_write_sealed_or_read_only_segment_is_refused_and_the_connection_stays(
    tenants_daemon: Daemon,
) -> None:
    conn = DaemonConnection(tenants_daemon.target, tenant="alice", token=TOKENS["alice"])
    session = conn.open_session()
    channel = HandoverChannel(session.shm_socket, session.session_id)
    try:
        sealed = os.memfd_create("sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(sealed, mmap.PAGESIZE)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, seals)
        with pytest.raises(SharedMemoryUnavailableError, match="sealed against writes"):
            channel._request(Attach("w", mmap.PAGESIZE, SegmentRole.SNAPSHOT), [sealed])
        os.close(sealed)
        fd, segment = create_segment(mmap.PAGESIZE)
        read_only = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        with pytest.raises(SharedMemoryUnavailableError, match="read-only"):
            channel._request(Attach("r", mmap.PAGESIZE, SegmentRole.SNAPSHOT), [read_only])
        os.close(read_only)
        assert channel.alive()
        channel._request(Attach("ok", mmap.PAGESIZE, SegmentRole.SNAPSHOT), [fd])
        os.close(fd)
        segment.close()
    finally:
        channel.close()
        conn.close()
    assert tenants_daemon.proc.poll() is None


def test_a_version_far_ahead_is_refused_and_cannot_block_the_block(
    tenants_daemon: Daemon,
) -> None:
    stub = tenants_daemon.stub()
    sid = open_session(stub, "alice", TOKENS["alice"])
    assert submit(stub, sid, task("v", 5, 8)) is SubmitOutcome.QUEUED
    error = submit_error(stub, sid, task("v", 1 << 62, 8))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    accepted = (SubmitOutcome.QUEUED, SubmitOutcome.SUPERSEDED_QUEUED)  # 5 may still wait
    assert submit(stub, sid, task("v", 6, 8)) in accepted


def test_a_header_allocates_nothing_before_the_session_and_budget_checks(
    tenants_daemon: Daemon,
) -> None:
    """Headers for n=16384 fp64 with a basis (4 GiB) from an unknown session and beyond the
    upload budget are refused without the daemon reserving their memory."""
    stub = tenants_daemon.stub()
    pid = tenants_daemon.proc.pid
    before = vm_peak_mib(pid)
    sid = open_session(stub, "alice", TOKENS["alice"])
    n = 16384
    header = pb.SnapshotHeader(
        session_id="no-such-session",
        block="huge",
        version=1,
        kind=pb.SOLVE_KIND_EIGENBASIS,
        n=n,
        dtype=pb.DTYPE_FLOAT64,
        exponent=0.25,
        has_basis=True,
        basis_dtype=pb.DTYPE_FLOAT64,
        base_version=0,
        deadline=float("inf"),
    )
    first = pb.SubmitSnapshotRequest(header=header)
    expect_code(grpc.StatusCode.NOT_FOUND, stub.SubmitSnapshot, iter([first]))
    header.session_id = sid
    second = pb.SubmitSnapshotRequest(header=header)
    with pytest.raises(grpc.RpcError) as refused:  # beyond the upload budget and the quota
        stub.SubmitSnapshot(iter([second]), timeout=CALL_TIMEOUT_S)
    assert refused.value.code() in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    assert vm_peak_mib(pid) - before < 1024, "a header reserved gigabytes"


def test_status_without_a_session_shows_no_counts_on_tcp() -> None:
    env = {"ASTERIA_TOKENS": f"alice={TOKENS['alice']}"}
    with DaemonProcess(listen="127.0.0.1:0", workers=1, env=env) as d:
        stub = pb_grpc.PreconditionerStub(grpc.insecure_channel(d.address))
        reply = stub.Status(pb.StatusRequest(), timeout=CALL_TIMEOUT_S)
        assert reply.engine.incarnation_id and not reply.HasField("transport")
        assert reply.engine.num_workers == 0 and reply.engine.blocks == 0
        session = open_session(stub, "alice", TOKENS["alice"])
        with_session = stub.Status(pb.StatusRequest(session_id=session), timeout=CALL_TIMEOUT_S)
        assert with_session.engine.num_workers == 1


def test_close_session_needs_the_tenants_token(tenants_daemon: Daemon) -> None:
    stub = tenants_daemon.stub()
    sid = open_session(stub, "alice", TOKENS["alice"])
    for token in ("", TOKENS["bob"]):
        request = pb.CloseSessionRequest(session_id=sid, token=token)
        details = expect_code(grpc.StatusCode.UNAUTHENTICATED, stub.CloseSession, request)
        assert TOKENS["bob"] not in details
    block_status(stub, sid)  # still open
    stub.CloseSession(
        pb.CloseSessionRequest(session_id=sid, token=TOKENS["alice"]), timeout=CALL_TIMEOUT_S
    )
    expect_code(grpc.StatusCode.NOT_FOUND, stub.Status, pb.StatusRequest(session_id=sid))
    # The client's own transport sends its token when it closes.
    conn = DaemonConnection(tenants_daemon.target, tenant="bob", token=TOKENS["bob"])
    conn.close_session(conn.open_session().session_id)
    conn.close()


def test_failed_authentication_is_rate_limited(tmp_path: Path) -> None:
    d = start_tenants_daemon(tmp_path)
    try:
        stub = d.stub()
        codes = []
        for i in range(30):
            request = pb.OpenSessionRequest(tenant="alice", token=f"guess-{i}")
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenSession(request, timeout=CALL_TIMEOUT_S)
            codes.append(info.value.code())
        assert codes[0] is grpc.StatusCode.UNAUTHENTICATED
        limited = [c for c in codes if c is grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(limited) >= 15, codes
        # Another tenant is not locked out by guesses at Alice's token.
        assert open_session(stub, "bob", TOKENS["bob"])
    finally:
        stop_daemon(d)
