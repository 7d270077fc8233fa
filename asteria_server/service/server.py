"""The daemon's server: a grpc.aio server over the engine, its socket, lock and shutdown.

:func:`serve` runs until SIGTERM or SIGINT, then drains: health NOT_SERVING, no new sessions,
block registrations or snapshots (UNAVAILABLE: clients keep their last results and resubmit to
the next daemon or compute locally), queued and running solves get ``grace_period_s`` to finish
while the open result streams send their results; what is still queued or running then is
dropped, counted and logged (never silently). Then the streams end, the engine closes (worker
processes and shared memory go with it), and the socket, lock and ready files are removed. A
second SIGTERM ends the drain at once.

SIGHUP reloads what can change while serving (tenant tokens, the log level, the limits and
quotas, the job TTL) from the config file and environment, and logs one line saying what it
changed and what needs a restart (:mod:`asteria_server.service.reload`).

A Unix socket lives in a directory of mode 0700 (created if missing; an existing one must be ours
and not writable by others), has mode 0600 (0660 with ``socket_group_access``), and is guarded
by ``<socket>.lock`` (``flock``): a second daemon on the same path fails with the pid of the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import signal
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from asteria_server.config import DaemonConfig, TcpAddress, UnixAddress, memory_limit_problem
from asteria_server.engine import EngineConfig, PreconditionerEngine
from asteria_server.engine.engine import SolveObserver
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2_grpc, peer_pb2_grpc
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.service.allocator import reclaim_periodically
from asteria_server.service.descriptors import (
    SEGMENT_FDS,
    DescriptorWatch,
    watch_descriptors,
)
from asteria_server.service.handover import SegmentHandover
from asteria_server.service.jobs import JobsServicer
from asteria_server.service.limits import (
    CallerTickets,
    FdBudget,
    fd_budget_for,
    raise_nofile_limit,
)
from asteria_server.service.loopwatch import LoopWatch
from asteria_server.service.servicer import (
    Authenticator,
    PreconditionerServicer,
    ServiceLimits,
    add_servicer_to_server,
)
from asteria_server.sync.manager import GatedEngine, SyncManager
from asteria_server.sync.policy import PeerPolicy, parse_patterns
from asteria_server.sync.push import PushTimeouts
from asteria_server.sync.service import PeerServicer

if TYPE_CHECKING:
    from asteria_server.service.metrics import DaemonMetrics

logger = logging.getLogger(__name__)

#: The daemon's exit status when its engine broke (a supervisor restarts it).
EXIT_ENGINE_BROKEN = 3
#: Seconds the open result streams get, past the drain's grace period, to send the results
#: that came in it (sending is local work; a client that reads nothing is cut off after this).
DRAIN_FLUSH_S = 2.0
#: How long a metrics scrape waits for the event loop to read the peer groups.
PEER_METRICS_WAIT_S = 2.0
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Preconditioner"].full_name
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to do."""


@dataclass(frozen=True)
class DrainReport:
    """How a shutdown's drain ended: solves finished during it, and those still queued or
    running at its end (dropped: their clients resubmit or compute locally)."""

    finished: int
    dropped_queued: int
    dropped_running: int
    seconds: float

    @property
    def dropped(self) -> int:
        return self.dropped_queued + self.dropped_running


def service_limits(config: DaemonConfig) -> ServiceLimits:
    """What the servicer enforces, from the daemon's config (at start and on SIGHUP)."""
    address = config.address
    return ServiceLimits(
        chunk_bytes=config.chunk_bytes,
        max_message_bytes=config.max_message_bytes,
        max_matrix_n=config.max_matrix_n,
        max_upload_bytes=config.max_upload_bytes,
        upload_wait_s=config.upload_wait_s,
        max_memory_bytes=config.max_memory_bytes,
        tenant_queued_bytes=config.tenant_queued_bytes,
        tenant_cached_bytes=config.tenant_cached_bytes,
        tenant_max_blocks=config.tenant_max_blocks,
        max_block_name_bytes=config.max_block_name_bytes,
        tenant_max_sessions=min(config.tenant_max_sessions, config.max_sessions),
        session_ttl_s=config.session_ttl_s,
        tenant_max_streams=config.tenant_max_streams,
        stream_stall_s=config.stream_stall_s,
        # One tenant (no tokens) may use the whole budget: there is no one to share with.
        tenant_upload_share=(1.0 if config.allows_anonymous() else config.tenant_upload_share),
        upload_idle_s=config.upload_idle_s,
        upload_max_s=config.upload_max_s,
        private_status=isinstance(address, TcpAddress),
        job_ttl_s=config.job_ttl_s,
    )


# ---------------------------------------------------------------------------- socket and lock


def _prepare_socket_dir(directory: Path) -> None:
    """Create the socket directory (0700) or check an existing one (:func:`prepare_private_dir`)."""
    prepare_private_dir(
        directory, "socket directory", "a directory of your own with --listen unix:///path/to.sock"
    )


def prepare_private_dir(directory: Path, what: str, instead: str, *, create: bool = True) -> None:
    """Create ``directory`` (0700) or check an existing one: a real directory, never a
    symbolic link (whoever owns the link could point it elsewhere once the daemon started and
    receive clients' tokens, or their results), owned by this user and not writable by others.
    The socket directory and the spill directory get the same checks. ``what`` names it in
    errors, ``instead`` says what to use instead; ``create`` False: only check one that exists.

    It is judged through a descriptor opened with ``O_NOFOLLOW``, checked to be the entry
    ``lstat`` saw, so the directory cannot be swapped between the check and its use."""
    try:
        seen = os.lstat(directory)
    except FileNotFoundError:
        if not create:
            return
        directory.mkdir(mode=0o700, parents=True)
        os.chmod(directory, 0o700, follow_symlinks=False)  # mkdir's mode is masked by the umask
        seen = os.lstat(directory)
    if stat.S_ISLNK(seen.st_mode):
        raise StartupError(
            f"{what} {directory} is a symbolic link: refusing it (whoever controls the link "
            f"could redirect what the daemon puts there); use {instead}"
        )
    if not stat.S_ISDIR(seen.st_mode):
        raise StartupError(f"{what} {directory} exists and is not a directory")
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise StartupError(f"cannot open {what} {directory}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if (info.st_dev, info.st_ino) != (seen.st_dev, seen.st_ino):
        raise StartupError(f"{what} {directory} changed while it was checked; retry")
    if info.st_uid != os.getuid():
        raise StartupError(
            f"{what} {directory} is owned by uid {info.st_uid}, not by this user "
            f"({os.getuid()}); use {instead}"
        )
    if info.st_mode & 0o022:
        raise StartupError(
            f"{what} {directory} has mode {stat.S_IMODE(info.st_mode):04o}: others can "
            f"replace what the daemon keeps there; run `chmod 700 {directory}` or use {instead}"
        )


SPILL_INSTEAD = "a directory of your own with --spill-dir DIR"
#: In the spill directory: held with flock for the daemon's life (one daemon per directory).
SPILL_LOCK_NAME = "asteria-spill.lock"


class SocketLock:
    """``<socket>.lock`` (or the spill directory's lock) held with ``flock`` for the daemon's
    life; holds the daemon's pid."""

    def __init__(
        self, path: Path, what: str = "serves this socket", instead: str = "another --listen path"
    ) -> None:
        self.path = path
        self._what = what
        self._instead = instead
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        while True:
            f = open(self.path, "a+")  # noqa: SIM115 - held open for the daemon's life
            os.chmod(self.path, 0o600)
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                f.close()
                raise StartupError(
                    f"another asteria-server (pid {holder}) already {self._what}: it holds "
                    f"{self.path}. Stop it first or start this one with {self._instead}"
                ) from None
            # The previous holder may have unlinked the file between our open and flock.
            try:
                same = os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # before unlocking, so a newcomer never locks a stale file
        self._file.close()
        self._file = None


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


# ---------------------------------------------------------------------------- the server


@dataclass
class RunningDaemon:
    """What :func:`start` built; :meth:`stop` tears it down in order."""

    config: DaemonConfig
    engine: PreconditionerEngine
    server: grpc.aio.Server
    servicer: PreconditionerServicer
    health: health.aio.HealthServicer
    target: str
    lock: SocketLock | None
    handover: SegmentHandover | None = None
    sync: SyncManager | None = None
    spill_lock: SocketLock | None = None
    jobs: JobsServicer | None = None
    #: the readiness the metrics port's /readyz reports (health SERVING, not draining)
    serving: bool = False
    draining: bool = False
    #: set to end a drain early (a second SIGTERM)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    drain_report: DrainReport | None = None

    async def drain(self) -> DrainReport:
        """Take no new work; give queued and running solves up to ``grace_period_s`` to finish
        and the open result streams time to send them; count what is left (dropped)."""
        grace_s = self.config.grace_period_s
        self.draining = True
        self.servicer.start_draining()
        await self.health.enter_graceful_shutdown()
        before = self.engine.stats()
        pending = before.queue_depth + before.workers_busy
        logger.info(
            "draining: no new sessions or snapshots; %d queued and %d running solves get up to "
            "%.1f s to finish (grace_period_s; a second SIGTERM stops at once)",
            before.queue_depth,
            before.workers_busy,
            grace_s,
        )
        started = time.monotonic()
        deadline = started + grace_s
        while pending and not self.hurry.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or await asyncio.to_thread(self.engine.wait_idle, min(left, 0.25)):
                break
        # The results that came: the open streams send them before they end. What is dropped
        # is counted with every stream idle, and the streams end at once after (no await in
        # between): a result is either sent or counted, never neither and never both.
        flush_until = max(deadline, time.monotonic()) + DRAIN_FLUSH_S
        while True:
            while (
                not self.servicer.streams_idle()
                and not self.hurry.is_set()
                and time.monotonic() < flush_until
            ):
                await asyncio.sleep(0.01)
            after = self.engine.stats()
            if (
                self.servicer.streams_idle()
                or self.hurry.is_set()
                or time.monotonic() >= flush_until
            ):
                break
        self.servicer.stop_streams()
        finished = (after.solves_done + after.solves_failed) - (
            before.solves_done + before.solves_failed
        )
        report = DrainReport(
            finished=finished,
            dropped_queued=after.queue_depth,
            dropped_running=after.workers_busy,
            seconds=time.monotonic() - started,
        )
        self.drain_report = report
        dropped = report.dropped_queued + report.dropped_running
        log = logger.warning if dropped else logger.info
        log(
            "drained in %.1f s: %d solves finished, %d dropped (%d queued, %d running)%s",
            report.seconds,
            report.finished,
            dropped,
            report.dropped_queued,
            report.dropped_running,
            "; their clients resubmit to the next daemon or compute those blocks locally"
            if dropped
            else "",
        )
        return report

    async def stop(self, *, drain: bool = True) -> None:
        """Drain (unless ``drain`` is False or it drained already), then tear down in order."""
        if drain and self.drain_report is None:
            await self.drain()
        logger.info("shutting down")
        if self.sync is not None:
            await self.sync.stop()
        self.servicer.stop_streams()
        await self.server.stop(1.0)
        if self.handover is not None:
            await asyncio.to_thread(self.handover.stop)
        await asyncio.to_thread(self.engine.close)
        address = self.config.address
        if isinstance(address, UnixAddress):
            with contextlib.suppress(FileNotFoundError):
                address.path.unlink()
        if self.lock is not None:
            self.lock.release()
        if self.spill_lock is not None:  # after the engine removed its spill files
            self.spill_lock.release()
        if self.config.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.ready_file)
        logger.info("stopped")


#: The most gRPC connections per listener a daemon takes when ``max_connections`` is 0.
MAX_CONNECTIONS_DEFAULT_CAP = 1024


def connections_per_listener(config: DaemonConfig, nofile: int) -> int:
    """``max_connections``, or for 0 a quarter of the descriptor budget (at most 1024): with
    the peer listener, the metrics endpoint and the segment handover, the connections alone
    cannot fill the descriptor table."""
    if config.max_connections:
        return config.max_connections
    return max(4, min(MAX_CONNECTIONS_DEFAULT_CAP, fd_budget_for(nofile) // 4))


def _server_options(config: DaemonConfig, max_connections: int) -> list[tuple[str, int]]:
    return [
        # A hard cap per listener, checked at accept (before the handshake): one more is closed
        # at once, so a flood of connections, raw or HTTP/2, cannot exhaust the descriptors.
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.max_connection_idle_ms", int(config.connection_idle_s * 1000)),
        ("grpc.max_concurrent_streams", config.max_streams_per_connection),
        ("grpc.so_reuseport", 0),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_pings_without_data", 0),
        # A raw connection that never speaks HTTP/2 holds a descriptor only this long.
        ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout_s * 1000)),
    ]


def _credentials(config: DaemonConfig) -> grpc.ServerCredentials:
    assert config.tls_cert is not None and config.tls_key is not None
    try:
        cert = Path(config.tls_cert).read_bytes()
        key = Path(config.tls_key).read_bytes()
    except OSError as exc:
        raise StartupError(f"cannot read the TLS certificate or key: {exc}") from exc
    return grpc.ssl_server_credentials([(key, cert)])


@dataclass(frozen=True)
class PeerTls:
    """The peer listener's mutual TLS, read once at start: the credentials it serves with and
    those this daemon dials its peers with (the same certificate, the same cluster CA)."""

    server: grpc.ServerCredentials
    channel: grpc.ChannelCredentials
    server_name: str


def _peer_tls(config: DaemonConfig) -> PeerTls | None:
    """None without ``peer_listen``; StartupError naming the unreadable file."""
    if config.peer_listen is None:
        return None
    files = {}
    for name in ("peer_tls_cert", "peer_tls_key", "peer_tls_ca"):
        path = getattr(config, name)
        try:
            files[name] = Path(path).read_bytes()
        except OSError as exc:
            raise StartupError(f"cannot read {name} {path}: {exc.strerror}") from exc
    cert, key, ca = files["peer_tls_cert"], files["peer_tls_key"], files["peer_tls_ca"]
    return PeerTls(
        # require_client_auth: a peer without a certificate of the cluster's CA is refused in
        # the handshake, before any call (the job token is checked on top, per call).
        server=grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        ),
        channel=grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        ),
        server_name=config.peer_tls_server_name,
    )


def advertised_peer_address(config: DaemonConfig, port: int) -> str:
    """What other nodes dial for the peer listener bound on ``port``: ``peer_advertise``, else
    ``peer_listen`` with the bound port (this host's name when it binds every address)."""
    if config.peer_advertise is not None:
        return config.peer_advertise
    bound = config.peer_address
    assert bound is not None
    host = bound.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return TcpAddress(host, port).target


async def start(config: DaemonConfig, *, observer: SolveObserver | None = None) -> RunningDaemon:
    """Bind, start the engine and the server; raises StartupError with a clear message.

    ``observer`` is told how every solve ended (the metrics endpoint counts them).
    """
    address = config.address
    nofile = raise_nofile_limit()
    lock: SocketLock | None = None
    if isinstance(address, UnixAddress):
        _prepare_socket_dir(address.path.parent)
        lock = SocketLock(address.lock_path)
        lock.acquire()
        if address.path.exists() or address.path.is_symlink():
            address.path.unlink()  # left by a daemon that died; we hold the lock
    spill_lock: SocketLock | None = None
    if config.spill_dir is not None:  # the socket directory's checks, and one daemon per dir
        try:
            spill_dir = Path(config.spill_dir)
            prepare_private_dir(spill_dir, "spill directory", SPILL_INSTEAD)
            spill_lock = SocketLock(
                spill_dir / SPILL_LOCK_NAME, "uses this spill directory", "another --spill-dir"
            )
            spill_lock.acquire()
        except BaseException:
            if lock is not None:
                lock.release()
            raise
    try:
        engine = await asyncio.to_thread(
            PreconditionerEngine,
            EngineConfig(
                num_workers=config.workers,
                blas_threads=config.blas_threads,
                solve_timeout_s=config.solve_timeout_s,
                solve_timeout_floor_s=config.solve_timeout_floor_s,
                solve_timeout_factor=config.solve_timeout_factor,
                test_fault_prefix=config.test_fault_prefix,
                cache_memory_bytes=config.cache_budget_bytes,
                spill_dir=config.spill_dir,
            ),
            observer=observer,
        )
    except BaseException:
        if lock is not None:
            lock.release()
        if spill_lock is not None:
            spill_lock.release()
        raise
    handover: SegmentHandover | None = None
    try:
        max_connections = connections_per_listener(config, nofile)
        server = grpc.aio.server(options=_server_options(config, max_connections))
        logger.info(
            "at most %d gRPC connections per listener (max_connections), each closed after %g s "
            "without a call (connection_idle_s), %d calls in flight on one",
            max_connections,
            config.connection_idle_s,
            config.max_streams_per_connection,
        )
        if isinstance(address, UnixAddress) and config.shared_memory:
            total_fds = fd_budget_for(nofile)
            per_tenant = SEGMENT_FDS * config.tenant_shm_segments or (
                total_fds if config.allows_anonymous() else max(1, total_fds // 2)
            )
            handover = SegmentHandover(
                address.path.with_name(address.path.name + ".shm"),
                is_session=lambda session_id: servicer.has_session(session_id),
                max_segments=config.max_shm_segments,
                mode=config.socket_mode,
                on_release=engine.release_shared,
                tenant_of=lambda session_id: servicer.tenant_of(session_id),
                touch=lambda session_id: servicer.touch(session_id),
                fds=FdBudget(total_fds, per_tenant),
                tickets=CallerTickets(),
            )
            logger.info(
                "descriptor limit %d: at most %d for clients' segments and connections (%d "
                "segments at %d each), %d per tenant",
                nofile,
                total_fds,
                total_fds // SEGMENT_FDS,
                SEGMENT_FDS,
                per_tenant,
            )
        # The daemons of a multi-node job sync through the Peer service: a block another
        # daemon owns is not solved here (asteria_server/sync).
        peer_tls = _peer_tls(config)
        peer_address = config.peer_address
        # Which peers a group may dial without peer_allow: loopback ones only, unless this
        # daemon listens for peers (or clients) on another interface, behind TLS.
        reach = address if peer_address is None else peer_address
        sync = SyncManager(
            engine,
            config.tokens,
            chunk_bytes=config.chunk_bytes,
            max_message_bytes=config.max_message_bytes,
            max_matrix_n=config.max_matrix_n,
            tls_root=None if config.tls_cert is None else Path(config.tls_cert).read_bytes(),
            peer_credentials=None if peer_tls is None else peer_tls.channel,
            peer_server_name=None if peer_tls is None else peer_tls.server_name,
            max_push_streams=config.tenant_max_push_streams,
            policy=PeerPolicy(
                max_job_daemons=config.max_job_daemons,
                tenant_max_peers=config.tenant_max_peers,
                allow=parse_patterns(config.peer_allow),
                loopback_only=isinstance(reach, UnixAddress) or reach.is_loopback,
            ),
            push_timeouts=PushTimeouts(
                wait_s=config.upload_wait_s,
                idle_s=config.upload_idle_s,
                max_s=config.upload_max_s,
            ),
        )
        servicer = PreconditionerServicer(
            cast(PreconditionerEngine, GatedEngine(engine, sync)),
            Authenticator(config.tokens, allow_anonymous=config.allows_anonymous()),
            service_limits(config),
            max_sessions=config.max_sessions,
            handover=handover,
        )
        sync.uploads = servicer.uploads  # a peer's push holds upload budget as a client's does
        sync.auth_throttle = servicer.auth_throttle  # one guesser meets one throttle everywhere
        sync.on_auth_failed = servicer.count_auth_failure  # ... and one counter
        add_servicer_to_server(servicer, server)
        jobs = JobsServicer(
            servicer.session_tenant,
            engine.incarnation_id,
            sync.job_registered,
            check_register=sync.check_job,
            job_sessions=servicer.job_sessions,
            max_jobs_per_tenant=config.tenant_max_jobs,
            job_idle_s=config.job_idle_s,
        )
        jobs.on_busy = servicer.count_refusal
        jobs_pb2_grpc.add_JobsServicer_to_server(jobs, server)

        def forget_job(tenant: str, job: str) -> None:
            jobs.forget(tenant, job)
            sync.forget_job(tenant, job)

        servicer.on_forget_job = forget_job
        peer_pb2_grpc.add_PeerServicer_to_server(
            PeerServicer(sync, servicer.session_tenant), server
        )
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        with _umask(0o177):
            if isinstance(address, TcpAddress) and config.tls_cert is not None:
                port = server.add_secure_port(address.target, _credentials(config))
            else:
                port = server.add_insecure_port(address.target)
            if isinstance(address, TcpAddress) and port == 0:
                raise StartupError(f"cannot listen on {address.target}: the port is not free")
            if peer_address is not None:
                assert peer_tls is not None
                bound = server.add_secure_port(peer_address.target, peer_tls.server)
                if bound == 0:
                    raise StartupError(
                        f"cannot listen for peers on {peer_address.target}: the port is not free"
                    )
                servicer.peer_address = advertised_peer_address(config, bound)
                logger.info(
                    "peer listener on %s (mutual TLS), advertised to peers as %s",
                    TcpAddress(peer_address.host, bound).target,
                    servicer.peer_address,
                )
            await server.start()
            sync.job_sessions = servicer.job_sessions
            sync.start()
            if handover is not None:
                handover.start()
        if isinstance(address, UnixAddress):
            os.chmod(address.path, config.socket_mode)
            target = address.target
        else:
            assert isinstance(address, TcpAddress)
            target = TcpAddress(address.host, port).target
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    except BaseException:
        if handover is not None:
            handover.stop()
        await asyncio.to_thread(engine.close)
        if lock is not None:
            lock.release()
        if spill_lock is not None:
            spill_lock.release()
        raise
    return RunningDaemon(
        config,
        engine,
        server,
        servicer,
        health_servicer,
        target,
        lock,
        handover,
        sync,
        spill_lock,
        jobs,
        serving=True,
    )


async def serve(config: DaemonConfig, reload: Callable[[], DaemonConfig] | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit status. ``reload`` reads the
    configuration again (SIGHUP)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    running: list[RunningDaemon] = []

    def stop_signal() -> None:
        if stop.is_set() and running:  # a second SIGTERM: end the drain now
            logger.warning("second stop signal: ending the drain now")
            running[0].hurry.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_signal)
    # Until the daemon serves, SIGHUP is ignored rather than fatal (its default action).
    loop.add_signal_handler(signal.SIGHUP, lambda: logger.warning("SIGHUP ignored while starting"))
    watch = None if config.stop_with_pid is None else _stop_with(loop, config.stop_with_pid, stop)
    problem = memory_limit_problem(config)
    if problem is not None:
        logger.warning("memory: %s", problem)
    metrics, metrics_url = _start_metrics(config)
    try:
        daemon = await start(config, observer=None if metrics is None else metrics.observe)
    except BaseException:
        if metrics is not None:
            metrics.close()
        _unwatch(loop, watch)
        loop.remove_signal_handler(signal.SIGHUP)
        raise
    running.append(daemon)
    current = [config]
    loop_watch = LoopWatch()  # says when (and in what) the loop serving every RPC is blocked
    loop_watch.start()

    def hangup() -> None:
        if reload is None:
            logger.warning("SIGHUP: this daemon has no configuration to reload")
            return
        if stop.is_set():
            logger.warning("SIGHUP ignored: the daemon is shutting down")
            return
        current[0] = reload_config(daemon, current[0], reload)

    loop.add_signal_handler(signal.SIGHUP, hangup)
    line = (
        f"asteria-server serving on {daemon.target} incarnation={daemon.engine.incarnation_id} "
        f"workers={config.workers} pid={os.getpid()}"
    )
    if metrics is not None:
        peers = None if daemon.sync is None else _peer_groups_on(loop, daemon.sync)
        metrics.bind(
            daemon.engine,
            daemon.servicer,
            peers,
            ready=lambda: _readiness(daemon),
            stalls=loop_watch.tally,
        )
        line += f" metrics={metrics_url}"
    if config.ready_file:
        tmp = f"{config.ready_file}.tmp"
        with open(tmp, "w") as f:
            f.write(line + "\n")
        os.replace(tmp, config.ready_file)
    print(line, flush=True)
    logger.info("%s", line)
    broken = asyncio.ensure_future(asyncio.to_thread(daemon.engine.wait_stopped))
    stopping = asyncio.ensure_future(stop.wait())
    reclaiming = asyncio.ensure_future(reclaim_periodically())  # garbage goes back

    unable: set[str] = set()  # why the daemon cannot serve now: health SERVING when empty

    def serving_unless(reason: str) -> Callable[[bool], Awaitable[None]]:
        async def set_serving(ok: bool) -> None:
            (unable.discard if ok else unable.add)(reason)
            daemon.serving = not unable
            status = health_pb2.HealthCheckResponse.SERVING if daemon.serving else NOT_SERVING
            for name in ("", SERVICE_NAME):
                await daemon.health.set(name, status)

        return set_serving

    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    descriptors = asyncio.ensure_future(
        watch_descriptors(DescriptorWatch(nofile), serving_unless("descriptors"))
    )  # NOT_SERVING before the descriptor table is full
    loop_watch.on_health = serving_unless("stalled")  # and after the loop was blocked
    why: str | None = None
    try:
        await asyncio.wait((broken, stopping), return_when=asyncio.FIRST_COMPLETED)
        why = broken.result() if broken.done() else None
        if why is not None:
            # The engine cannot work any more: say so to every health check, then exit
            # non-zero so that the supervisor starts a fresh daemon.
            logger.error("the engine stopped working (%s); exiting so it can be restarted", why)
            descriptors.cancel()  # it must not say SERVING again
            loop_watch.on_health = None
            daemon.serving = False
            for name in ("", SERVICE_NAME):
                await daemon.health.set(name, NOT_SERVING)
    finally:
        stopping.cancel()
        reclaiming.cancel()
        descriptors.cancel()
        await loop_watch.stop()
        _unwatch(loop, watch)
        loop.remove_signal_handler(signal.SIGHUP)
        daemon.serving = False
        if why is None:
            report = await daemon.drain()
            if metrics is not None:
                metrics.drained(report.finished, report.dropped)
        await daemon.stop(drain=False)
        if metrics is not None:
            await asyncio.to_thread(metrics.close)
        await broken  # the engine is closed now: the watcher has returned
    return EXIT_ENGINE_BROKEN if why is not None else 0


def _stop_with(loop: asyncio.AbstractEventLoop, pid: int, stop: asyncio.Event) -> int | None:
    """Set ``stop`` when process ``pid`` exits (``--stop-with-pid``): its pidfd becomes readable
    then, so the event loop watches it like a socket, with no polling. Returns the pidfd (None:
    the process is gone already, and ``stop`` is set)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        logger.warning("process %d (--stop-with-pid) has exited already; stopping", pid)
        stop.set()
        return None
    except (AttributeError, OSError) as exc:  # no pidfd_open: Linux < 5.3, or a seccomp filter
        raise StartupError(
            f"--stop-with-pid {pid}: cannot watch the process ({exc}); it needs pidfd_open "
            "(Linux >= 5.3)"
        ) from exc

    def exited() -> None:
        logger.warning("process %d (--stop-with-pid) exited; stopping", pid)
        loop.remove_reader(fd)
        stop.set()

    loop.add_reader(fd, exited)
    return fd


def _unwatch(loop: asyncio.AbstractEventLoop, fd: int | None) -> None:
    """Stop watching (and close) a pidfd of :func:`_stop_with`."""
    if fd is not None:
        loop.remove_reader(fd)
        os.close(fd)


def _peer_groups_on(
    loop: asyncio.AbstractEventLoop, sync: SyncManager
) -> Callable[[], list[tuple[str, ppb.PeerGroup]]]:
    """The sync's peer groups, for the metrics thread: read on the event loop that owns them."""

    async def groups() -> list[tuple[str, ppb.PeerGroup]]:
        return sync.groups()

    def read() -> list[tuple[str, ppb.PeerGroup]]:
        return asyncio.run_coroutine_threadsafe(groups(), loop).result(PEER_METRICS_WAIT_S)

    return read


def _start_metrics(config: DaemonConfig) -> tuple[DaemonMetrics | None, str]:
    """The metrics endpoint, serving before the engine starts (so a taken port fails fast)."""
    address = config.metrics_address
    if address is None:
        return None, ""
    from asteria_server.service.metrics import DaemonMetrics

    metrics = DaemonMetrics(
        blas_threads=config.blas_threads, memory_limit_bytes=config.cgroup_memory_limit_bytes
    )
    try:
        url = metrics.serve(
            address,
            max_connections=config.metrics_max_connections,
            timeout_s=config.metrics_timeout_s,
        )
    except OSError as exc:
        raise StartupError(
            f"cannot serve metrics on {address.target}: {exc.strerror or exc}; choose another "
            "--metrics-listen port"
        ) from exc
    return metrics, url


def _readiness(daemon: RunningDaemon) -> tuple[bool, str]:
    """What /readyz answers: ready while the daemon serves (health SERVING) and is not
    draining."""
    if daemon.draining:
        return False, "draining: the daemon is shutting down"
    if not daemon.serving:
        return False, "not serving (health NOT_SERVING)"
    return True, "serving"


def reload_config(
    daemon: RunningDaemon, old: DaemonConfig, reload: Callable[[], DaemonConfig]
) -> DaemonConfig:
    """SIGHUP: read the configuration again and apply what can change while serving; one log
    line says what changed and what needs a restart. Returns the configuration now in force
    (``old`` when the new one is invalid)."""
    from asteria_server.service.reload import plan_reload

    try:
        new = reload()
    except ValueError as exc:
        logger.error("SIGHUP: the configuration is invalid; nothing reloaded: %s", exc)
        return old
    plan = plan_reload(old, new)
    applied = plan.applied_config(old, new)
    if plan.changed:
        if "log_level" in plan.changed:
            logging.getLogger().setLevel(applied.log_level)
        daemon.servicer.update(
            service_limits(applied),
            Authenticator(applied.tokens, allow_anonymous=applied.allows_anonymous()),
            applied.max_sessions,
        )
        if daemon.sync is not None:
            daemon.sync.set_tokens(applied.tokens)
        if daemon.jobs is not None:
            daemon.jobs.max_jobs_per_tenant = applied.tenant_max_jobs
            daemon.jobs.job_idle_s = applied.job_idle_s
    logger.info("%s", plan.describe())
    return applied


def run(config: DaemonConfig, reload: Callable[[], DaemonConfig] | None = None) -> int:
    """:func:`serve` on uvloop (plain asyncio, with a warning, when uvloop is missing)."""
    try:
        import uvloop
    except ImportError:
        logger.warning("uvloop is not installed; running on the plain asyncio event loop")
        return asyncio.run(serve(config, reload))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(serve(config, reload))
