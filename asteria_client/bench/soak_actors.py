"""The processes of `asteria bench soak`: a well-behaved training client and a misbehaving tenant.

Run as ``python -m asteria_client.bench.soak_actors {client,bad} ...`` by the benchmark (each in
a process of its own, so that one can be killed with SIGKILL and restarted like a real trainer).

**client**: one job of the well-behaved tenant, through the real client (:class:`DaemonSource`,
shared memory when it can): every ``--interval-s`` it submits a new version of each of its
blocks (mixed sizes), until ``--duration-s`` is over; then it stops submitting and waits up to
``--drain-s`` for the result of each block's last version. Versions come from the wall clock
(``--epoch``), so a restarted client keeps counting up where its killed predecessor stopped, as
a trainer resumed from a checkpoint near its last step would. It writes one JSON document:
versions submitted, results received with their latencies (submit to arrival), and per block
whether its last version was delivered (a block whose last version never came is *lost*).

**bad**: a tenant that tries to take the daemon from the others, until SIGTERM: uploads that
send a header and one chunk and then stall; OpenSession in a tight loop, never closing; result
streams opened and never read; and bursts of big snapshots (distinct blocks, n=2048 fp64). It
also uses the daemon's newer doors: a job layout of 4,096 nodes (this daemon and closed ports)
registered again and again; peer pushes (PushResults with its own job token) that announce an
n=4096 result and stall after the first chunk; a flood of idle connections to the metrics
endpoint (``--metrics-address``), reopened as the daemon closes them; and peer calls with
wrong job tokens. It counts how each attempt ended (the daemon's status codes) and writes them
as JSON at exit.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import hmac
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

#: The bad tenant's attacks, each a thread (or several); ``--attacks`` picks some.
ATTACKS = (
    "stalled_uploads",
    "silent_streams",
    "big_snapshots",
    "wide_layouts",
    "stalled_pushes",
    "peer_guesses",
    "session_spam",
    "metrics_flood",
)

#: Largest gRPC message the bad tenant's channel takes (a 1 MiB chunk and framing fit).
_MAX_MESSAGE_BYTES = 8 << 20


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _spd(n: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed).standard_normal((n, n))
    return np.asarray(g @ g.T / n + np.eye(n))


# ---------------------------------------------------------------------------- well-behaved client


def run_client(args: argparse.Namespace) -> int:
    import torch

    from asteria_client.runtime.source import PreconditionerRequest
    from asteria_client.transport.connection import DaemonClientConfig
    from asteria_client.transport.daemon import DaemonSource
    from asteria_server.types import SolveKind

    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    names = [f"b{i}-n{n}" for i, n in enumerate(sizes)]
    factors = {
        name: torch.from_numpy(_spd(n, args.seed * 1000 + i)).float()
        for i, (name, n) in enumerate(zip(names, sizes, strict=True))
    }
    started = time.monotonic()
    source = DaemonSource(
        args.address,
        tenant=args.tenant,
        token=args.token,
        job=args.job,
        config=DaemonClientConfig(connect_timeout_s=30.0),
    )
    connected_s = time.monotonic() - started
    last: dict[str, int] = {}
    submitted = 0
    version = -1
    deadline = time.monotonic() + args.duration_s
    while time.monotonic() < deadline:
        round_started = time.monotonic()
        version = max(version + 1, int((time.time() - args.epoch) / args.interval_s))
        for name in names:
            source.submit(
                PreconditionerRequest(
                    block=name, version=version, kind=SolveKind.EIGENBASIS, matrix=factors[name]
                )
            )
            last[name] = version
            submitted += 1
        time.sleep(max(0.0, args.interval_s - (time.monotonic() - round_started)))
    drain_deadline = time.monotonic() + args.drain_s
    delivered = {}
    for name in names:
        if name not in last:
            continue
        left = max(0.0, drain_deadline - time.monotonic())
        result = source.wait(name, last[name], timeout_s=left)
        delivered[name] = result is not None and result.version >= last[name]
    stats = source.stats()
    latencies = source.result_latencies()
    source.close()
    _write_json(
        Path(args.out),
        {
            "job": args.job,
            "pid": os.getpid(),
            "blocks": dict(zip(names, sizes, strict=True)),
            "connected_s": connected_s,
            "snapshots_submitted": submitted,
            "last_versions": last,
            "delivered": delivered,
            "expected": len(last),
            "delivered_count": sum(delivered.values()),
            "lost": sorted(name for name, ok in delivered.items() if not ok),
            "results": len(latencies),
            "latencies_s": latencies,
            "source": {k: v for k, v in stats.items() if isinstance(v, int | float | str)},
        },
    )
    return 0


# ---------------------------------------------------------------------------- misbehaving tenant


class _BadTenant:
    """The misbehaving tenant's threads and counters (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
        from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc

        self.pb = pb
        self.args = args
        self.stop = threading.Event()
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self.channel = grpc.insecure_channel(
            args.address,
            options=[
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ],
        )
        self.stub = pb_grpc.PreconditionerStub(self.channel)
        self.big = _spd(args.big_n, 7)
        self.serial = 0

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def _code(self, what: str, exc: grpc.RpcError) -> None:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        self.count(f"{what}:{code.name if code is not None else 'ERROR'}")

    def session(self) -> str | None:
        request = self.pb.OpenSessionRequest(
            tenant=self.args.tenant, token=self.args.token, job="bad"
        )
        try:
            return str(self.stub.OpenSession(request, timeout=10.0).session_id)
        except grpc.RpcError as exc:
            self._code("open_session", exc)
            return None

    def _task(self, block: str) -> Any:
        from asteria_server.types import SolveKind, SolveTask

        with self._lock:
            self.serial += 1
            serial = self.serial
        return SolveTask(
            block=f"{block}-{serial}", version=1, kind=SolveKind.EIGENBASIS, matrix=self.big
        )

    def stalled_uploads(self, session: str | None) -> None:
        from asteria_server.protocol import framing

        while not self.stop.is_set():
            if session is None:
                session = self.session()
            if session is None:
                self.stop.wait(1.0)
                continue
            messages = framing.snapshot_messages(self._task("stall"), session_id=session)

            try:
                self.stub.SubmitSnapshot(self._stalling(messages), timeout=self.args.stall_s + 30.0)
                self.count("stalled_upload:OK")
            except grpc.RpcError as exc:
                self._code("stalled_upload", exc)
                if exc.code() is grpc.StatusCode.NOT_FOUND:
                    session = None  # expired: open another

    def _stalling(self, messages: Any) -> Any:
        yield next(messages)  # the header
        yield next(messages)  # one chunk
        self.stop.wait(self.args.stall_s)  # then nothing, for as long as it lasts

    def session_spam(self) -> None:
        while not self.stop.is_set():
            if self.session() is not None:
                self.count("open_session:OK")
            self.stop.wait(self.args.spam_interval_s)

    def silent_streams(self, session: str | None) -> None:
        calls: list[Any] = []
        while not self.stop.is_set():
            if session is None or not calls:
                session = self.session() if session is None else session
            if session is not None:
                for _ in range(self.args.silent_streams):
                    calls.append(
                        self.stub.StreamResults(self.pb.StreamResultsRequest(session_id=session))
                    )
                    self.count("silent_stream:opened")
            self.stop.wait(20.0)  # never read; open more now and then
            for call in calls:
                if call.done():
                    self.count(f"silent_stream:{call.code().name}")
            calls = [c for c in calls if not c.done()]
            if not calls:
                session = None  # the daemon ended them all (its session may be gone too)
        for call in calls:
            call.cancel()

    def big_snapshots(self, session: str | None) -> None:
        from asteria_server.protocol import framing

        while not self.stop.is_set():
            if session is None:
                session = self.session()
            if session is None:
                self.stop.wait(1.0)
                continue
            for _ in range(self.args.burst):
                if self.stop.is_set() or session is None:
                    break
                messages = framing.snapshot_messages(self._task("big"), session_id=session)
                try:
                    self.stub.SubmitSnapshot(messages, timeout=30.0)
                    self.count("big_snapshot:OK")
                except grpc.RpcError as exc:
                    self._code("big_snapshot", exc)
                    if exc.code() is grpc.StatusCode.NOT_FOUND:
                        session = None  # expired: open another
            self.stop.wait(self.args.burst_interval_s)

    # ------------------------------------------------------------------ the newer doors

    def _register(self, session: str, job: str, addresses: list[str], what: str) -> bool:
        from asteria_server.protocol.generated.asteria.v1 import jobs_pb2 as jpb
        from asteria_server.protocol.generated.asteria.v1 import jobs_pb2_grpc as jpb_grpc

        layout = jpb.JobLayout(
            job=job,
            world_size=len(addresses),
            nodes=[
                jpb.JobNode(host=f"h{i}", ranks=[i], daemon_address=a)
                for i, a in enumerate(addresses)
            ],
        )
        request = jpb.RegisterJobRequest(session_id=session, layout=layout, node_rank=0)
        try:
            jpb_grpc.JobsStub(self.channel).RegisterJob(request, timeout=10.0)
        except grpc.RpcError as exc:
            self._code(what, exc)
            return False
        self.count(f"{what}:OK")
        return True

    def wide_layouts(self, session: str | None) -> None:
        """A layout of 4,096 nodes: this daemon and closed ports, registered every 10 s."""
        closed = [f"127.0.0.1:{1 + i}" for i in range(4095)]
        while not self.stop.is_set():
            if session is None:
                session = self.session()
            if session is not None:
                self._register(session, "bad-wide", [self.args.address, *closed], "wide_layout")
            self.stop.wait(10.0)

    def _job_token(self, job: str) -> str:
        return hmac.new(self.args.token.encode(), job.encode(), hashlib.sha256).hexdigest()

    def stalled_pushes(self) -> None:
        """PushResults as node 1 of its own two-node job: an n=4096 result's header and first
        chunk, then nothing."""
        from asteria_server.protocol import framing
        from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
        from asteria_server.protocol.generated.asteria.v1 import peer_pb2_grpc as ppb_grpc
        from asteria_server.types import SolveKind, SolveResult

        addresses = [self.args.address, "127.0.0.1:9"]
        sessions: list[str] = []

        def registered() -> bool:
            # A session of the job itself: the daemon ends a job's peer group (and forgets the
            # job) once no session of it is open, and the attack would stop with it.
            request = self.pb.OpenSessionRequest(
                tenant=self.args.tenant, token=self.args.token, job="bad-sync"
            )
            try:
                sid = str(self.stub.OpenSession(request, timeout=10.0).session_id)
            except grpc.RpcError as exc:
                self._code("open_session", exc)
                return False
            sessions[:] = [sid]
            return self._register(sid, "bad-sync", addresses, "sync_layout")

        if not registered():
            return
        peer = ppb_grpc.PeerStub(self.channel)
        creds = ppb.PeerCredentials(
            tenant=self.args.tenant, job="bad-sync", job_token=self._job_token("bad-sync"), node=1
        )
        n = 4096
        result = SolveResult(
            tenant=self.args.tenant,
            block="bad-sync:unknown",
            version=1,
            kind=SolveKind.INVERSE_ROOT,
            matrix=np.zeros((n, n), np.float32),
            eigenvalues=None,
            permutation=None,
            base_version=-1,
            epsilon_used=0.0,
            solve_time_s=0.0,
            attempts=1,
        )
        messages = framing.result_messages(result)
        first = [next(messages).SerializeToString(), next(messages).SerializeToString()]

        def stalling() -> Any:
            yield ppb.PushResultsRequest(hello=ppb.PushHello(credentials=creds))
            for frame in first:
                yield ppb.PushResultsRequest(frame=frame)
            self.stop.wait(self.args.stall_s)

        while not self.stop.is_set():
            try:
                peer.PushResults(stalling(), timeout=self.args.stall_s + 30.0)
                self.count("stalled_push:OK")
            except grpc.RpcError as exc:
                self._code("stalled_push", exc)
                if exc.code() is grpc.StatusCode.NOT_FOUND:  # the job was forgotten: again
                    registered()
            with contextlib.suppress(grpc.RpcError):  # the job's session lives on
                self.stub.Status(self.pb.StatusRequest(session_id=sessions[0]), timeout=5.0)
            self.stop.wait(0.5)

    def metrics_flood(self) -> None:
        """Idle connections to the metrics endpoint, reopened once the daemon closes them."""
        host, _, port = self.args.metrics_address.rpartition(":")
        held: list[socket.socket] = []
        while not self.stop.is_set():
            alive = []
            for s in held:
                try:
                    if s.recv(1, socket.MSG_DONTWAIT) == b"":
                        self.count("metrics_connection:closed_by_daemon")
                        s.close()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    continue
                alive.append(s)
            held = alive
            while len(held) < self.args.metrics_connections and not self.stop.is_set():
                try:
                    held.append(socket.create_connection((host, int(port)), timeout=2.0))
                    self.count("metrics_connection:opened")
                except OSError:
                    self.count("metrics_connection:refused")
                    break
            self.stop.wait(1.0)
        for s in held:
            s.close()

    def peer_guesses(self) -> None:
        """Heartbeats with guessed job tokens (a tenant that does not exist, so no one else's
        authentications are throttled by them), about 50 a second."""
        from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
        from asteria_server.protocol.generated.asteria.v1 import peer_pb2_grpc as ppb_grpc

        peer = ppb_grpc.PeerStub(self.channel)
        guess = 0
        while not self.stop.is_set():
            guess += 1
            creds = ppb.PeerCredentials(
                tenant="nobody", job="bad-sync", job_token=f"{guess:064x}", node=1
            )
            try:
                peer.Heartbeat(ppb.HeartbeatRequest(credentials=creds), timeout=5.0)
                self.count("peer_guess:OK")
            except grpc.RpcError as exc:
                self._code("peer_guess", exc)
            self.stop.wait(0.02)

    def run(self) -> dict[str, Any]:
        # The other attacks open their sessions first: the spam soon fills the tenant's quota.
        only = set(self.args.attacks.split(",")) if self.args.attacks else set(ATTACKS)
        unknown = only - set(ATTACKS)
        if unknown:
            raise SystemExit(f"unknown attacks {sorted(unknown)}; known: {', '.join(ATTACKS)}")
        plan: list[tuple[str, Any, int, bool]] = [  # name, target, threads, takes a session
            ("stalled_uploads", self.stalled_uploads, self.args.stalled_uploads, True),
            ("silent_streams", self.silent_streams, 1, True),
            ("big_snapshots", self.big_snapshots, 1, True),
            ("wide_layouts", self.wide_layouts, 1, True),
            ("stalled_pushes", self.stalled_pushes, self.args.stalled_pushes, False),
            ("peer_guesses", self.peer_guesses, 1, False),
            ("session_spam", self.session_spam, 1, False),
        ]
        if self.args.metrics_address:
            plan.append(("metrics_flood", self.metrics_flood, 1, False))
        threads = [
            threading.Thread(target=target, args=(self.session(),) if session else (), daemon=True)
            for name, target, count, session in plan
            if name in only
            for _ in range(count)
        ]
        for thread in threads:
            thread.start()
        self.stop.wait()
        for thread in threads:
            thread.join(timeout=5.0)
        self.channel.close()
        with self._lock:
            return dict(self.counts)


def run_bad(args: argparse.Namespace) -> int:
    bad = _BadTenant(args)
    signal.signal(signal.SIGTERM, lambda *_: bad.stop.set())
    started = time.monotonic()
    counts = bad.run()
    _write_json(Path(args.out), {"counts": counts, "run_s": time.monotonic() - started})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asteria_client.bench.soak_actors")
    roles = parser.add_subparsers(dest="role", required=True)
    client = roles.add_parser("client")
    bad = roles.add_parser("bad")
    for sub in (client, bad):
        sub.add_argument("--address", required=True)
        sub.add_argument("--tenant", required=True)
        sub.add_argument("--token", default="")
        sub.add_argument("--out", required=True)
    client.add_argument("--job", required=True)
    client.add_argument("--sizes", required=True, help="block sizes n, comma-separated")
    client.add_argument("--duration-s", type=float, required=True)
    client.add_argument("--interval-s", type=float, required=True)
    client.add_argument("--drain-s", type=float, default=30.0)
    client.add_argument("--epoch", type=float, required=True)
    client.add_argument("--seed", type=int, default=0)
    bad.add_argument("--big-n", type=int, default=2048)
    bad.add_argument("--burst", type=int, default=4)
    bad.add_argument("--burst-interval-s", type=float, default=5.0)
    bad.add_argument("--stalled-uploads", type=int, default=4)
    bad.add_argument("--stall-s", type=float, default=120.0)
    bad.add_argument("--silent-streams", type=int, default=16)
    bad.add_argument("--spam-interval-s", type=float, default=0.01)
    bad.add_argument("--stalled-pushes", type=int, default=4)
    bad.add_argument("--metrics-address", default="", help="HOST:PORT of the metrics endpoint")
    bad.add_argument("--metrics-connections", type=int, default=200)
    bad.add_argument(
        "--attacks", default="", help=f"comma-separated, of {','.join(ATTACKS)} (default: all)"
    )
    args = parser.parse_args(argv)
    return run_client(args) if args.role == "client" else run_bad(args)


if __name__ == "__main__":
    sys.exit(main())
