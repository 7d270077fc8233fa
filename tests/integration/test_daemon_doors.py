"""Issue 28: the daemon's newer doors (the Peer and Jobs services, the metrics endpoint, the
spill directory) under the Preconditioner service's discipline, each finding provoked for real.

Every test attacks a real ``asteria-server`` subprocess with raw gRPC stubs, the way another
daemon of a job or a hostile tenant would: a peer push is a ``PushResults`` stream with the
job token (HMAC of the job id under the tenant's token), sent to the daemon's own socket. The
limits and timings are lowered by flags or ``ASTERIA_SYNC_*`` so that each test takes seconds.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
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
from asteria_client.transport.connection import DaemonClientConfig, JobNodeInfo, RegisteredJob
from asteria_client.transport.daemon import DaemonSource
from asteria_client.transport.shm import HandoverChannel
from asteria_server.engine import SolveKind, SolveResult, SolveTask, SubmitOutcome
from asteria_server.protocol import framing
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2 as jpb
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2_grpc as jpb_grpc
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.protocol.generated.asteria.v1 import peer_pb2_grpc as ppb_grpc
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc
from asteria_server.protocol.shm import SharedMemoryUnavailableError
from asteria_server.sync.manager import job_token
from tests.integration.test_daemon import (
    CALL_TIMEOUT_S,
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
from tests.integration.test_daemon_limits import (
    TOKENS,
    _attach_page,
    _LimitedDaemon,
    start_tenants_daemon,
    tokens_config,
)
from tests.protocol_readers import read_results

JOB = "doors"
#: a port nothing listens on: the job's second daemon, never up
CLOSED = "127.0.0.1:9"


def job_session(d: LaunchedDaemon, tenant: str = "alice", job: str = JOB) -> str:
    reply = d.stub().OpenSession(
        pb.OpenSessionRequest(tenant=tenant, token=TOKENS[tenant], job=job),
        timeout=CALL_TIMEOUT_S,
    )
    return reply.session_id


def register_two_node_job(d: LaunchedDaemon, session: str, job: str = JOB) -> None:
    """``job`` on two nodes: node 0 served by ``d``, node 1 by a daemon that is never up."""
    layout = jpb.JobLayout(
        job=job,
        world_size=2,
        nodes=[
            jpb.JobNode(host="a", ranks=[0], daemon_address=d.target),
            jpb.JobNode(host="b", ranks=[1], daemon_address=CLOSED),
        ],
    )
    jobs = jpb_grpc.JobsStub(grpc.insecure_channel(d.target))
    jobs.RegisterJob(
        jpb.RegisterJobRequest(session_id=session, layout=layout, node_rank=0),
        timeout=CALL_TIMEOUT_S,
    )


def peer_credentials(tenant: str = "alice", job: str = JOB, node: int = 1) -> ppb.PeerCredentials:
    return ppb.PeerCredentials(
        tenant=tenant,
        job=job,
        job_token=job_token(TOKENS[tenant], job),
        node=node,
        incarnation_id="peer-incarnation",
    )


def pushed(block: str, version: int, n: int, kind: SolveKind, tenant: str = "alice") -> SolveResult:
    q = np.linalg.qr(np.random.default_rng(version % 1000).standard_normal((n, n)))[0]
    eigenbasis = kind is SolveKind.EIGENBASIS
    return SolveResult(
        tenant=tenant,
        block=block,
        version=version,
        kind=kind,
        matrix=(q if eigenbasis else np.eye(n)).astype(np.float32),
        eigenvalues=np.ones(n, np.float32) if eigenbasis else None,
        permutation=None,
        base_version=-1,
        epsilon_used=1e-12,
        solve_time_s=0.01,
        attempts=1,
    )


def push_messages(
    results: list[SolveResult], creds: ppb.PeerCredentials | None = None
) -> Iterator[ppb.PushResultsRequest]:
    yield ppb.PushResultsRequest(hello=ppb.PushHello(credentials=creds or peer_credentials()))
    for result in results:
        for message in framing.result_messages(result, chunk_bytes=1 << 16):
            yield ppb.PushResultsRequest(frame=message.SerializeToString())


def peer_stub(d: LaunchedDaemon) -> ppb_grpc.PeerStub:
    return ppb_grpc.PeerStub(grpc.insecure_channel(d.target))


def inverse_root_task(block: str, version: int, n: int) -> SolveTask:
    matrix = spd(n, version).astype(np.float32)
    return SolveTask(block=block, version=version, kind=SolveKind.INVERSE_ROOT, matrix=matrix)


# ----------------------------------------------------------------------- 4. pushed results


def job_with_a_block(d: LaunchedDaemon, n: int) -> tuple[Any, str, str, Any]:
    """A session of a registered two-node job with one inverse-root block of size ``n``
    submitted at version 1: the stub, the session, the block and a Peer stub."""
    stub = d.stub()
    sid = job_session(d)
    register_two_node_job(d, sid)
    block = f"{JOB}:w.L"
    assert submit(stub, sid, inverse_root_task(block, 1, n)) is SubmitOutcome.QUEUED
    return stub, sid, block, peer_stub(d)


def test_a_peer_push_is_validated_like_a_local_result(tmp_path: Path) -> None:
    """A push far ahead in version, of the wrong kind or shape is refused naming what is
    wrong; the block is not pinned: the next local snapshot is still taken, not a DUPLICATE."""
    d = start_tenants_daemon(tmp_path)
    try:
        stub, sid, block, peer = job_with_a_block(d, 8)
        narrow = pushed(block, 3, 8, SolveKind.INVERSE_ROOT)
        wider = dataclasses.replace(narrow, matrix=narrow.matrix.astype(np.float64))
        bad = [
            (pushed(block, 1 << 62, 8, SolveKind.INVERSE_ROOT), "version"),
            (pushed(block, 1 << 31, 8, SolveKind.INVERSE_ROOT), "version"),
            (pushed(block, 3, 8, SolveKind.EIGENBASIS), "kind"),
            (pushed(block, 3, 6, SolveKind.INVERSE_ROOT), "n="),
            (wider, "float32"),
        ]
        for result, named in bad:
            details = expect_code(
                grpc.StatusCode.INVALID_ARGUMENT, peer.PushResults, push_messages([result])
            )
            assert named in details and block in details, details
        status = block_status(stub, sid)[block]
        assert status.version < 3, status
        accepted = (SubmitOutcome.QUEUED, SubmitOutcome.SUPERSEDED_QUEUED)
        assert submit(stub, sid, inverse_root_task(block, 2, 8)) in accepted
        # A good push is kept.
        reply = peer.PushResults(
            push_messages([pushed(block, 4, 8, SolveKind.INVERSE_ROOT)]), timeout=CALL_TIMEOUT_S
        )
        assert reply.kept == 1, reply
        assert block_status(stub, sid)[block].version == 4
    finally:
        stop_daemon(d)


# ----------------------------------------------------------------------- 2. stalled pushes


def stalled_push(
    result: SolveResult, release: threading.Event, creds: ppb.PeerCredentials | None = None
) -> Iterator[ppb.PushResultsRequest]:
    """A push that sends its hello, the result's header and first chunk, then stalls until
    ``release`` is set."""
    messages = list(push_messages([result], creds))
    yield from messages[:3]
    release.wait(60)


def uploads_in_flight(d: LaunchedDaemon, session: str) -> int:
    reply = d.stub().Status(pb.StatusRequest(session_id=session), timeout=CALL_TIMEOUT_S)
    return reply.transport.upload_bytes_in_flight


def test_a_push_holds_upload_budget_is_checked_first_and_a_stalled_one_ends(
    tmp_path: Path,
) -> None:
    """With a 1 MiB upload budget and --upload-idle-s 4: a stalled push of a known n=370 block
    holds its 535 KiB in the budget (upload_bytes_in_flight), so a second one finds no room and
    is refused naming max_upload_bytes; the stalled one ends RESOURCE_EXHAUSTED naming
    upload_idle_s, and so does a stalled push of a block unknown here."""
    d = start_tenants_daemon(
        tmp_path,
        *("--max-upload-bytes", str(1 << 20), "--tenant-upload-share", "1.0"),
        # the wait for room ends well before the stalled push's idle timeout frees it
        *("--upload-wait-s", "0.5", "--upload-idle-s", "4", "--upload-max-s", "8"),
    )
    release = threading.Event()
    n = 370
    try:
        _, sid, block, peer = job_with_a_block(d, n)
        stalled = peer.PushResults.future(
            stalled_push(pushed(block, 2, n, SolveKind.INVERSE_ROOT), release), timeout=15
        )
        time.sleep(0.3)
        held = uploads_in_flight(d, sid)
        details = expect_code(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            peer.PushResults,
            push_messages([pushed(block, 3, n, SolveKind.INVERSE_ROOT)]),
        )
        assert "max_upload_bytes" in details, details
        unknown = peer.PushResults.future(
            stalled_push(pushed(f"{JOB}:unknown", 2, 1024, SolveKind.INVERSE_ROOT), release),
            timeout=15,
        )
        for call in (stalled, unknown):
            with pytest.raises(grpc.RpcError) as ended:
                call.result()
            assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, ended.value.details()
            assert "upload_idle_s" in (ended.value.details() or "")
        assert held >= n * n * 4, f"a stalled {n * n * 4}-byte push holds {held} upload bytes"
        assert uploads_in_flight(d, sid) == 0
        reply = peer.PushResults(
            push_messages([pushed(block, 4, n, SolveKind.INVERSE_ROOT)]), timeout=CALL_TIMEOUT_S
        )
        assert reply.kept == 1, reply
    finally:
        release.set()
        stop_daemon(d)


def test_a_tenants_open_pushes_are_capped(tmp_path: Path) -> None:
    """tenant_max_push_streams 2: with two pushes stalled, a third is refused naming the
    limit; once the daemon ended the stalled ones (upload_idle_s), a push goes through."""
    env = {"ASTERIA_TENANT_MAX_PUSH_STREAMS": "2"}
    d = start_env_daemon(tmp_path, env, "--upload-idle-s", "2")
    release = threading.Event()
    try:
        _, _, block, peer = job_with_a_block(d, 8)
        stalled = [
            peer.PushResults.future(
                stalled_push(pushed(f"{JOB}:u{i}", 1, 64, SolveKind.INVERSE_ROOT), release),
                timeout=10,
            )
            for i in range(2)
        ]
        time.sleep(0.5)
        one = push_messages([pushed(block, 2, 8, SolveKind.INVERSE_ROOT)])
        details = expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, peer.PushResults, one)
        assert "tenant_max_push_streams" in details, details
        for call in stalled:
            with pytest.raises(grpc.RpcError) as ended:
                call.result()
            assert "upload_idle_s" in (ended.value.details() or "")
        reply = peer.PushResults(
            push_messages([pushed(block, 3, 8, SolveKind.INVERSE_ROOT)]), timeout=CALL_TIMEOUT_S
        )
        assert reply.kept == 1, reply
    finally:
        release.set()
        stop_daemon(d)


# ----------------------------------------------------------------------- 5. token guesses


def heartbeat(creds: ppb.PeerCredentials) -> ppb.HeartbeatRequest:
    return ppb.HeartbeatRequest(credentials=creds, state=ppb.PeerState(node=1))


def codes_of(call: object, requests: list[object]) -> list[grpc.StatusCode]:
    codes = []
    for request in requests:
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=CALL_TIMEOUT_S)  # type: ignore[operator]
        codes.append(info.value.code())
    return codes


def test_wrong_token_peer_calls_and_close_session_guesses_are_throttled(tmp_path: Path) -> None:
    """Peer calls with a wrong job token meet OpenSession's throttle (shared: guesses at one
    door count at the others), CloseSession guesses too; an unknown tenant gets the answer a
    wrong token gets; the refusals are logged in a few lines, not one per guess."""
    d = start_tenants_daemon(tmp_path)
    try:
        stub = d.stub()
        bob = job_session(d, "bob")
        alice = job_session(d, "alice")
        register_two_node_job(d, alice)
        peer = peer_stub(d)
        # The same answer whether the tenant exists or not.
        answers = []
        for tenant in ("alice", "nobody"):
            creds = ppb.PeerCredentials(tenant=tenant, job=JOB, job_token="0" * 64, node=1)
            details = expect_code(grpc.StatusCode.UNAUTHENTICATED, peer.Heartbeat, heartbeat(creds))
            answers.append(details.replace(repr(tenant), "TENANT"))
        assert answers[0] == answers[1], answers
        # 30 wrong-token heartbeats for Alice: throttled after the burst.
        guesses = [
            heartbeat(ppb.PeerCredentials(tenant="alice", job=JOB, job_token=f"{i:064x}", node=1))
            for i in range(30)
        ]
        codes = codes_of(peer.Heartbeat, guesses)
        limited = [c for c in codes if c is grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(limited) >= 15, codes
        # ... and the throttle is OpenSession's: a guess there is refused unanswered too.
        request = pb.OpenSessionRequest(tenant="alice", token="guess")
        assert codes_of(stub.OpenSession, [request]) == [grpc.StatusCode.RESOURCE_EXHAUSTED]
        # CloseSession guesses at Bob's session's token.
        closes = [pb.CloseSessionRequest(session_id=bob, token=f"g{i}") for i in range(30)]
        codes = codes_of(stub.CloseSession, closes)
        assert len([c for c in codes if c is grpc.StatusCode.RESOURCE_EXHAUSTED]) >= 15, codes
        assert block_status(stub, bob) == {}  # Bob's session is still open
    finally:
        _, err = stop_daemon(d)
    refusals = [line for line in err.splitlines() if "refused peer call" in line]
    assert 1 <= len(refusals) <= 3, refusals
    closes_logged = [line for line in err.splitlines() if "refused CloseSession" in line]
    assert 1 <= len(closes_logged) <= 3, closes_logged


#: Bob's process: guesses Alice's token through the real client (which fetches its own caller
#: ticket) and through a raw stub without a ticket, for argv[2] seconds; says "throttled" once
#: both ways met the throttle, and at the end how every guess was answered.
_GUESSER = """
import json, sys, time
import grpc
from asteria_client.transport import DaemonConnection
from asteria_server.errors import AuthenticationError, DaemonBusyError
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc

seen = {"ticket": [], "none": []}
conn = DaemonConnection(sys.argv[1], tenant="alice", token="not-alices-token-at-all", job="j")
stub = pb_grpc.PreconditionerStub(grpc.insecure_channel(sys.argv[1]))
said = False
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        conn.open_session()
        seen["ticket"].append("OK")
    except (AuthenticationError, DaemonBusyError) as exc:
        seen["ticket"].append(type(exc).__name__)
    try:
        stub.OpenSession(pb.OpenSessionRequest(tenant="alice", token="guess"), timeout=30)
        seen["none"].append("OK")
    except grpc.RpcError as exc:
        seen["none"].append(exc.code().name)
    if not said and "DaemonBusyError" in seen["ticket"] and "RESOURCE_EXHAUSTED" in seen["none"]:
        print("throttled", flush=True)
        said = True
print(json.dumps(seen), flush=True)
"""


def test_one_process_guessing_a_token_over_the_unix_socket_locks_out_no_other_process(
    tmp_path: Path,
) -> None:
    """gRPC tells the daemon nothing of a Unix-socket caller, so the throttle keyed every local
    caller as one host: Bob's wrong guesses for Alice locked Alice's own processes out. Now a
    client names a caller ticket the handover socket issued for its process (SO_PEERCRED), and
    the throttle counts per process; callers without a ticket share one key of their own."""
    d = start_tenants_daemon(tmp_path)
    guesser = subprocess.Popen(
        [sys.executable, "-c", _GUESSER, d.target, "20"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert guesser.stdout is not None
        assert guesser.stdout.readline().strip() == "throttled"
        for _ in range(3):  # while Bob keeps guessing
            alice = DaemonConnection(d.target, tenant="alice", token=TOKENS["alice"], job="j")
            try:
                session = alice.open_session()  # refused: "too many failed authentications"
                alice.close_session(session.session_id)
            finally:
                alice.close()
        seen = json.loads(guesser.stdout.readline())
        assert guesser.wait(timeout=60) == 0
        assert "OK" not in seen["ticket"] and "OK" not in seen["none"], seen
    finally:
        if guesser.poll() is None:
            guesser.kill()
            guesser.wait()
        stop_daemon(d)


class _RecordingPeer(ppb_grpc.PeerServicer):
    """Node 1 of a job, as a raw server: it keeps the job token of every heartbeat the daemon
    sends it (the token the daemon would accept from node 1) and refuses each."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    def Heartbeat(self, request: ppb.HeartbeatRequest, context: grpc.ServicerContext) -> None:
        self.tokens.append(request.credentials.job_token)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "recorded")


def _token_other_than(fake: _RecordingPeer, old: str | None) -> str:
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while not fake.tokens or fake.tokens[-1] == old:
        assert time.monotonic() < deadline, f"no heartbeat with a new job token ({fake.tokens})"
        time.sleep(0.05)
    return fake.tokens[-1]


def _raw_peer_server(servicer: Any) -> tuple[grpc.Server, int]:
    """A started Peer server on loopback that is no daemon (it records what it is sent)."""
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    ppb_grpc.add_PeerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_a_job_token_is_good_for_one_registration_of_the_job_only(tmp_path: Path) -> None:
    """The job token a daemon sends its peers (recorded by a raw node-1 server) is accepted
    from node 1 while that run of the job is registered; once the job registers again (a new
    run of the same job id: a new run nonce) the old token is refused and the new one works;
    once the job is forgotten (``asteria forget --job``) the new one is refused too, with the
    answer a wrong token gets."""
    d = start_tenants_daemon(tmp_path)
    fake = _RecordingPeer()
    server, port = _raw_peer_server(fake)
    try:
        sid = job_session(d)
        jobs = jpb_grpc.JobsStub(grpc.insecure_channel(d.target))
        peer = peer_stub(d)

        def register(run_nonce: str) -> None:
            layout = layout_of(d, JOB, [f"127.0.0.1:{port}"])
            layout.run_nonce = run_nonce
            request = jpb.RegisterJobRequest(session_id=sid, layout=layout, node_rank=0)
            jobs.RegisterJob(request, timeout=CALL_TIMEOUT_S)

        def from_node_1(token: str) -> ppb.HeartbeatRequest:
            creds = ppb.PeerCredentials(tenant="alice", job=JOB, job_token=token, node=1)
            return heartbeat(creds)

        register("run-1")
        first = _token_other_than(fake, None)
        peer.Heartbeat(from_node_1(first), timeout=CALL_TIMEOUT_S)  # accepted
        register("run-2")  # the job restarted: same id, a new run
        stale = expect_code(grpc.StatusCode.UNAUTHENTICATED, peer.Heartbeat, from_node_1(first))
        second = _token_other_than(fake, first)
        peer.Heartbeat(from_node_1(second), timeout=CALL_TIMEOUT_S)  # accepted
        argv = ["forget", "--job", JOB, "--address", d.target, "--tenant", "alice"]
        assert cli_main([*argv, "--token", TOKENS["alice"]]) == 0
        gone = expect_code(grpc.StatusCode.UNAUTHENTICATED, peer.Heartbeat, from_node_1(second))
        assert gone == stale  # a job that is not here and a wrong token: one answer
    finally:
        server.stop(None)
        stop_daemon(d)


# ----------------------------------------------------------------------- 6. the job registry


def start_env_daemon(tmp_path: Path, env: dict[str, str], *extra: str) -> LaunchedDaemon:
    """A tenants daemon with ``ASTERIA_*`` settings from ``env`` (a daemon that does not know
    a setting ignores it, so a test of a new limit still runs against the old code)."""
    return start_daemon(tmp_path, "--config", str(tokens_config(tmp_path)), *extra, env=env)


def register_job(d: LaunchedDaemon, session: str, job: str) -> None:
    layout = jpb.JobLayout(
        job=job,
        world_size=1,
        nodes=[jpb.JobNode(host="a", ranks=[0], daemon_address=d.target)],
    )
    jpb_grpc.JobsStub(grpc.insecure_channel(d.target)).RegisterJob(
        jpb.RegisterJobRequest(session_id=session, layout=layout, node_rank=0),
        timeout=CALL_TIMEOUT_S,
    )


def listed_jobs(d: LaunchedDaemon, session: str) -> set[str]:
    reply = jpb_grpc.JobsStub(grpc.insecure_channel(d.target)).ListJobs(
        jpb.ListJobsRequest(session_id=session), timeout=CALL_TIMEOUT_S
    )
    return {j.layout.job for j in reply.jobs}


def close(d: LaunchedDaemon, session: str, tenant: str = "alice") -> None:
    d.stub().CloseSession(
        pb.CloseSessionRequest(session_id=session, token=TOKENS[tenant]), timeout=CALL_TIMEOUT_S
    )


def test_the_job_registry_forgets_idle_jobs_and_asteria_forget_drops_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tenant_max_jobs 4, job_idle_s 1: a fifth job while four have sessions is refused naming
    the quota and what frees it; a job with no session for job_idle_s leaves the registry;
    ``asteria forget --job`` drops a job from it at once."""
    env = {"ASTERIA_TENANT_MAX_JOBS": "4", "ASTERIA_JOB_IDLE_S": "1"}
    d = start_env_daemon(tmp_path, env)
    try:
        sessions = {f"j{i}": job_session(d, job=f"j{i}") for i in range(5)}
        for i in range(4):
            register_job(d, sessions[f"j{i}"], f"j{i}")
        details = expect_code(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            jpb_grpc.JobsStub(grpc.insecure_channel(d.target)).RegisterJob,
            jpb.RegisterJobRequest(
                session_id=sessions["j4"],
                layout=jpb.JobLayout(
                    job="j4",
                    world_size=1,
                    nodes=[jpb.JobNode(host="a", ranks=[0], daemon_address=d.target)],
                ),
            ),
        )
        assert "tenant_max_jobs" in details and "job_idle_s" in details, details
        close(d, sessions.pop("j0"))
        close(d, sessions.pop("j1"))
        time.sleep(1.5)  # past job_idle_s: j0 and j1 have no session any more
        register_job(d, sessions["j4"], "j4")
        assert listed_jobs(d, sessions["j4"]) == {"j2", "j3", "j4"}
        argv = ["forget", "--job", "j3", "--address", d.target, "--tenant", "alice"]
        assert cli_main([*argv, "--token", TOKENS["alice"]]) == 0
        assert listed_jobs(d, sessions["j4"]) == {"j2", "j4"}
    finally:
        stop_daemon(d)


def test_a_node_leader_refused_at_register_job_is_told_the_limit_and_how_to_raise_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """tenant_max_jobs 1: the second job's node leader (the real client) logs one warning that
    says multi-node sync is off for its job, the daemon's reason, and which setting raises it;
    registering again with the same refusal does not log it again."""
    d = start_env_daemon(tmp_path, {"ASTERIA_TENANT_MAX_JOBS": "1"})
    config = DaemonClientConfig(connect_timeout_s=30.0)
    sources = [
        DaemonSource(d.target, tenant="alice", token=TOKENS["alice"], job=job, config=config)
        for job in ("first", "second")
    ]

    def layout(job: str) -> RegisteredJob:
        node = JobNodeInfo(host="a", ranks=(0,), daemon_address=d.target)
        return RegisteredJob(job=job, world_size=1, nodes=(node,), node_rank=0)

    try:
        assert sources[0].register_job(layout("first"))
        with caplog.at_level(logging.WARNING, logger="asteria_client.transport.daemon"):
            assert not sources[1].register_job(layout("second"))
            assert not sources[1].register_job(layout("second"))
        warnings = [r.getMessage() for r in caplog.records if "RegisterJob" in r.getMessage()]
        assert len(warnings) == 1, warnings
        (warning,) = warnings
        assert "multi-node sync is OFF for job 'second'" in warning, warning
        assert "tenant_max_jobs = 1" in warning, warning  # the daemon's reason, with the quota
        assert "--tenant-max-jobs" in warning and "ASTERIA_TENANT_MAX_JOBS" in warning, warning
    finally:
        for source in sources:
            source.close()
        stop_daemon(d)


# ----------------------------------------------------------------------- 9. a stopped idle worker


def test_a_stopped_idle_worker_is_replaced_before_the_next_block_waits_for_it(
    tmp_path: Path,
) -> None:
    """The only worker, idle, is stopped with SIGSTOP: the next block is solved by a fresh
    worker long before the 60 s timeout floor (within the 20 s this test waits), and the
    stopped process is gone."""
    d = start_daemon(tmp_path, "--solve-timeout-floor-s", "60")
    try:
        stub = d.stub()
        sid = open_session(stub)
        assert submit(stub, sid, inverse_root_task("warm", 1, 8)) is SubmitOutcome.QUEUED
        assert receive(stub, sid, ["warm"])  # the worker is up, and idle now
        (worker,) = _children(d.proc.pid)
        os.kill(worker, signal.SIGSTOP)
        try:
            while Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
                time.sleep(0.01)  # stopped (as status shows it) before the next block comes
            assert submit(stub, sid, inverse_root_task("next", 1, 8)) is SubmitOutcome.QUEUED
            stream = stub.StreamResults(
                pb.StreamResultsRequest(session_id=sid, blocks=["next"]), timeout=20
            )
            try:
                got = next(read_results(stream))
            except grpc.RpcError as exc:
                pytest.fail(f"the block waited for the stopped worker: {exc.code()}")
            assert got.block == "next"
            stream.cancel()
            assert worker not in _children(d.proc.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
    finally:
        stop_daemon(d)


# ----------------------------------------------------------------------- 1. peer groups bounded


class _CountingPeer(ppb_grpc.PeerServicer):
    """A server at a layout's address that is no daemon of the job: it counts the heartbeats
    it gets and refuses each."""

    def __init__(self) -> None:
        self.heartbeats = 0

    def Heartbeat(self, request: ppb.HeartbeatRequest, context: grpc.ServicerContext) -> None:
        self.heartbeats += 1
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "not a daemon of this job")


def layout_of(d: LaunchedDaemon, job: str, others: list[str]) -> jpb.JobLayout:
    addresses = [d.target, *others]
    return jpb.JobLayout(
        job=job,
        world_size=len(addresses),
        nodes=[
            jpb.JobNode(host=f"h{i}", ranks=[i], daemon_address=a) for i, a in enumerate(addresses)
        ],
    )


def test_peer_groups_are_bounded_allowed_and_unproven_peers_are_asked_slowly(
    tmp_path: Path,
) -> None:
    """A layout of 200 daemons is refused naming max_job_daemons; one naming a non-loopback
    peer of a daemon on a Unix socket is refused naming peer_allow; an address that answers
    but never as a daemon of the job gets a heartbeat about once a second or less, not every
    heartbeat_s (0.25 s)."""
    d = start_tenants_daemon(tmp_path)
    fake = _CountingPeer()
    server, port = _raw_peer_server(fake)
    try:
        sid = job_session(d)
        jobs = jpb_grpc.JobsStub(grpc.insecure_channel(d.target))

        def register(layout: jpb.JobLayout, timeout: float = CALL_TIMEOUT_S) -> object:
            request = jpb.RegisterJobRequest(session_id=sid, layout=layout, node_rank=0)
            return jobs.RegisterJob(request, timeout=timeout)

        many = layout_of(d, "many", [f"127.0.0.1:{1 + i}" for i in range(199)])
        details = expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, register, many)
        assert "max_job_daemons" in details, details
        far = layout_of(d, "far", ["192.0.2.7:50051"])
        details = expect_code(grpc.StatusCode.INVALID_ARGUMENT, register, far)
        assert "peer_allow" in details and "192.0.2.7" in details, details
        register(layout_of(d, JOB, [f"127.0.0.1:{port}"]))
        time.sleep(4.0)
        assert 1 <= fake.heartbeats <= 6, f"{fake.heartbeats} heartbeats in 4 s to a stranger"
    finally:
        server.stop(None)
        stop_daemon(d)


def test_heartbeats_to_unproven_peers_are_capped_daemon_wide_across_tenants(
    tmp_path: Path,
) -> None:
    """Two tenants each register a job of 16 strangers (servers that never answer as daemons
    of the job). Each peer alone is asked at most once a second, backing off, so together they
    would get ~3 heartbeats each in 4 s (~90); with ASTERIA_SYNC_UNPROVEN_HEARTBEATS_PER_S = 2
    the daemon sends at most 2 a second to strangers, all tenants together."""
    env = {"ASTERIA_SYNC_UNPROVEN_HEARTBEATS_PER_S": "2"}
    d = start_env_daemon(tmp_path, env)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    fake = _CountingPeer()
    ppb_grpc.add_PeerServicer_to_server(fake, server)
    ports = [server.add_insecure_port("127.0.0.1:0") for _ in range(32)]
    server.start()
    try:
        jobs = jpb_grpc.JobsStub(grpc.insecure_channel(d.target))
        for i, tenant in enumerate(("alice", "bob")):
            sid = job_session(d, tenant=tenant)
            strangers = [f"127.0.0.1:{port}" for port in ports[16 * i : 16 * (i + 1)]]
            request = jpb.RegisterJobRequest(
                session_id=sid, layout=layout_of(d, JOB, strangers), node_rank=0
            )
            jobs.RegisterJob(request, timeout=CALL_TIMEOUT_S)
        time.sleep(4.0)
        assert 2 <= fake.heartbeats <= 14, f"{fake.heartbeats} heartbeats in 4 s to strangers"
    finally:
        server.stop(None)
        stop_daemon(d)


# ----------------------------------------------------------------------- 7. spill files

SPILL_N = 64
#: two n=64 inverse roots (16 KiB each) fit the host tier; older ones spill
SPILL_CACHE_BYTES = 40_000


def _computed(stub: pb_grpc.PreconditionerStub, session: str, block: str) -> None:
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while block_status(stub, session).get(block, pb.BlockStatus(version=-1)).version < 1:
        assert time.monotonic() < deadline, f"{block} was not computed"
        time.sleep(0.05)


def _spill_file_of(spill: Path, block: str) -> Path:
    for path in spill.glob("asteria-spill-*.res"):
        if f'"block": "{block}"'.encode() in path.read_bytes()[:4096]:
            return path
    raise AssertionError(f"no spill file holds {block}")


def _edit(path: Path, old: bytes, new: bytes) -> None:
    assert len(old) == len(new)
    data = path.read_bytes()
    assert old in data, (old, data[:300])
    path.write_bytes(data.replace(old, new, 1))


def test_spill_files_are_checked_whole_and_their_directory_like_the_sockets(
    tmp_path: Path,
) -> None:
    """A spill file whose header was edited (kind, dtype; lengths kept) fails its checksum and
    is dropped, never served; a spill directory that others may write, that is a symbolic link
    or that another daemon uses is refused at start, and --check-config says so."""
    spill = tmp_path / "spill"
    spill.mkdir(mode=0o700)
    d = start_daemon(
        tmp_path, "--cache-memory-bytes", str(SPILL_CACHE_BYTES), "--spill-dir", str(spill)
    )
    try:
        stub = d.stub()
        sid = open_session(stub)
        for i in range(4):
            assert submit(stub, sid, inverse_root_task(f"s{i}", 1, SPILL_N)) is SubmitOutcome.QUEUED
            _computed(stub, sid, f"s{i}")
        _edit(_spill_file_of(spill, "s0"), b'"kind": "inverse_root",', b'"kind":   "eigenbasis",')
        _edit(_spill_file_of(spill, "s1"), b'"dtype": "<f4"', b'"dtype": "<i4"')
        # A second daemon on the same spill directory is refused (and removes nothing).
        files = sorted(spill.glob("asteria-spill-*.res"))
        with pytest.raises(DaemonStartError, match="spill"):
            DaemonProcess(
                workers=1, extra_args=("--spill-dir", str(spill)), socket_dir=tmp_path / "other"
            ).start()
        assert sorted(spill.glob("asteria-spill-*.res")) == files
        stream = stub.StreamResults(
            pb.StreamResultsRequest(session_id=open_session(stub), blocks=["s0", "s1"]),
            timeout=3.0,
        )
        headers = []
        try:
            for message in stream:
                if message.HasField("header"):
                    headers.append(message.header)
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, exc.details()
        assert [h.block for h in headers] == [], [(h.block, h.kind) for h in headers]
        for block in ("s0", "s1"):  # dropped: the version may come again, and is solved
            assert submit(stub, sid, inverse_root_task(block, 1, SPILL_N)) is SubmitOutcome.QUEUED
    finally:
        stop_daemon(d)

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(spill)
    for directory, why in ((shared, "mode 0777"), (link, "symbolic link")):
        with pytest.raises(DaemonStartError, match=why):
            DaemonProcess(
                workers=1, extra_args=("--spill-dir", str(directory)), socket_dir=tmp_path / "x"
            ).start()
    check = subprocess.run(
        [sys.executable, "-m", "asteria_server", "--check-config", "--spill-dir", str(shared)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode != 0 and "0777" in check.stderr, (check.returncode, check.stderr)


# ----------------------------------------------------------------------- 3. descriptors


def _health(channel: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S
    )
    return int(reply.status)


def test_descriptors_are_counted_as_held_and_health_says_when_they_run_out(
    tmp_path: Path,
) -> None:
    """Under a 256-descriptor limit, one tenant (no tokens) hands over page-sized segments
    until refused: the refusal is the descriptor budget's (two per segment), never an mmap
    failure for want of descriptors; then raw connections fill the table: health turns
    NOT_SERVING before it is full, the daemon closes them after --handshake-timeout-s, and
    health is SERVING again; a killed worker is replaced
    and the daemon serves and exits 0."""
    launcher = _LimitedDaemon(
        256, workers=1, socket_dir=tmp_path / "d", env={"ASTERIA_HANDSHAKE_TIMEOUT_S": "3"}
    )
    try:
        launcher.start()
    except DaemonStartError as exc:
        pytest.fail(str(exc))
    flood: list[socket.socket] = []
    try:
        conn = DaemonConnection(launcher.address)
        session = conn.open_session()
        channel = HandoverChannel(session.shm_socket, session.session_id)
        refused = ""
        for i in range(300):
            try:
                _attach_page(channel, f"seg{i}")
            except SharedMemoryUnavailableError as exc:
                refused = str(exc)
                break
        assert "descriptors for clients" in refused, refused
        assert channel.alive()
        grpc_channel = grpc.insecure_channel(launcher.address)
        assert _health(grpc_channel) == health_pb2.HealthCheckResponse.SERVING
        assert launcher.socket_path is not None
        seen = []
        for i in range(200):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(launcher.socket_path))
            flood.append(s)
            if i % 8 == 7:
                time.sleep(0.6)  # the daemon looks at its table twice a second
                seen.append(_health(grpc_channel))
                if seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
        assert seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, (len(flood), seen)
        # They never speak HTTP/2: the daemon closes them after --handshake-timeout-s (3 s).
        for s in flood:
            s.settimeout(10)
            while s.recv(4096):
                pass
        deadline = time.monotonic() + 10
        while _health(grpc_channel) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "health stayed NOT_SERVING"
            time.sleep(0.2)
        channel.close()
        (worker,) = _children(launcher.process.pid)
        os.kill(worker, signal.SIGKILL)
        stub = pb_grpc.PreconditionerStub(grpc_channel)
        sid = open_session(stub)
        assert submit(stub, sid, inverse_root_task("after", 1, 8)) is SubmitOutcome.QUEUED
        assert receive(stub, sid, ["after"])["after"].version == 1
        conn.close()
    finally:
        for s in flood:
            s.close()
        end = launcher.stop()
    assert end.returncode == 0, end.stderr


def _own_channel(d: LaunchedDaemon) -> grpc.Channel:
    """A channel with a connection of its own (not shared with other channels to ``d``)."""
    return grpc.insecure_channel(d.target, options=[("grpc.use_local_subchannel_pool", 1)])


def _served(d: LaunchedDaemon, channel: grpc.Channel | None = None) -> bool:
    try:
        health_pb2_grpc.HealthStub(channel or _own_channel(d)).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=2.0
        )
    except grpc.RpcError:
        return False
    return True


def test_grpc_connections_are_capped_per_listener_and_idle_ones_closed(tmp_path: Path) -> None:
    """max_connections 3, connection_idle_s 1 (set by ASTERIA_* variables: a daemon that does
    not know them ignores them): of 10 raw connections that never speak, at most 3 are held
    and the rest closed by the daemon at once, before any handshake; while they are held a
    gRPC client is not served; once they close it is. Three clients that made a call hold the
    three places; a fourth is not served until they have been idle for connection_idle_s,
    and the first is served again at its next call (its channel reconnects)."""
    env = {
        "ASTERIA_MAX_CONNECTIONS": "3",
        "ASTERIA_CONNECTION_IDLE_S": "1",
        "ASTERIA_HANDSHAKE_TIMEOUT_S": "60",  # the raw ones are not closed for that
    }
    d = start_daemon(tmp_path, env=env)
    raws: list[socket.socket] = []
    try:
        for _ in range(10):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(d.sock))
            raws.append(s)
        time.sleep(0.5)
        closed = 0
        for s in raws:
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass  # held open by the daemon
            except ConnectionResetError:
                closed += 1
        assert closed >= 7, f"the daemon held {10 - closed} of 10 raw connections"
        assert not _served(d), "a client was served while the raw connections held every place"
        for s in raws:
            s.close()
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not _served(d):
            assert time.monotonic() < deadline, "not served after the raw connections closed"
            time.sleep(0.2)
        time.sleep(1.5)  # that client's connection idles out
        clients = [_own_channel(d) for _ in range(3)]
        assert all(_served(d, c) for c in clients)
        assert not _served(d), "a fourth client was served beside three holding the places"
        time.sleep(2.5)  # past connection_idle_s: the daemon closed the three
        assert _served(d), "the daemon kept idle connections past connection_idle_s"
        time.sleep(1.5)
        assert _served(d, clients[0])  # its channel reconnects at its next call
        for c in clients:
            c.close()
    finally:
        for s in raws:
            s.close()
        stop_daemon(d)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_the_metrics_endpoint_bounds_its_connections_and_closes_idle_ones(
    tmp_path: Path,
) -> None:
    """metrics_max_connections 4, metrics_timeout_s 1: 40 idle connections cost the daemon at
    most 4 threads, are closed by it within the timeout, and a scrape then works."""
    env = {"ASTERIA_METRICS_MAX_CONNECTIONS": "4", "ASTERIA_METRICS_TIMEOUT_S": "1"}
    d = start_env_daemon(tmp_path, env, "--metrics-listen", "127.0.0.1:0")
    idle: list[socket.socket] = []
    try:
        url = d.serving_line.split("metrics=")[1].split()[0]
        host, port = url.removeprefix("http://").split("/")[0].rsplit(":", 1)
        before = _threads(d.proc.pid)
        for _ in range(40):
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        time.sleep(0.5)
        grown = _threads(d.proc.pid) - before
        assert grown <= 6, f"40 idle metrics connections took {grown} threads"
        for s in idle:  # each is closed by the daemon: refused at once, or after the timeout
            s.settimeout(5)
            assert s.recv(1) == b""
        with urllib.request.urlopen(url, timeout=CALL_TIMEOUT_S) as reply:
            assert b"asteria_" in reply.read()
    finally:
        for s in idle:
            s.close()
        stop_daemon(d)


# ----------------------------------------------------------------------- 8. memory budget


def test_registrations_and_result_streams_count_in_the_memory_budget(tmp_path: Path) -> None:
    """--max-memory 2 MiB: 3000 registrations of 1000-byte names (3 MB) are refused naming
    max_memory_bytes, and so is a result stream beyond what the budget holds (a 1 MiB chunk
    in flight each); the refusals cost nothing: a small registration and a stream still work
    once the others are gone."""
    d = start_tenants_daemon(tmp_path, "--max-memory", str(2 << 20))
    try:
        stub = d.stub()
        sid = job_session(d)
        specs = [
            pb.BlockSpec(block=f"{i:05d}" + "r" * 995, n=8, kind=pb.SOLVE_KIND_INVERSE_ROOT)
            for i in range(3000)
        ]
        details = expect_code(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            stub.RegisterBlocks,
            pb.RegisterBlocksRequest(session_id=sid, blocks=specs),
        )
        assert "max_memory_bytes" in details, details
        stub.RegisterBlocks(
            pb.RegisterBlocksRequest(session_id=sid, blocks=specs[:100]), timeout=CALL_TIMEOUT_S
        )
        streams = []
        refused = ""
        for _ in range(8):
            call = stub.StreamResults(pb.StreamResultsRequest(session_id=sid), timeout=30)
            streams.append(call)
            time.sleep(0.2)
            if call.done():
                with pytest.raises(grpc.RpcError) as info:
                    next(call)
                assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                refused = str(info.value.details())
                break
        assert "max_memory_bytes" in refused, f"{len(streams)} streams opened: {refused!r}"
        for call in streams:
            call.cancel()
        time.sleep(0.5)
        assert submit(stub, sid, inverse_root_task(specs[0].block, 1, 8)) is SubmitOutcome.QUEUED
        assert receive(stub, sid, [specs[0].block])
    finally:
        stop_daemon(d)
