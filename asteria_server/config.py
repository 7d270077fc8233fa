"""The daemon's configuration: one frozen dataclass, loaded from TOML, then env, then flags.

:class:`DaemonConfig` holds every setting of ``asteria-server``. :func:`load_config` builds it in
this order, later sources winning: the TOML file (``--config PATH``), ``ASTERIA_*`` environment
variables (read here and nowhere else), then command-line flags. Every field has one name in all
three: ``chunk_bytes`` is TOML ``chunk_bytes``, env ``ASTERIA_CHUNK_BYTES`` and flag
``--chunk-bytes``. Tenant tokens come from a TOML ``[tenants]`` table (``name = "token"``) or
``ASTERIA_TOKENS="tenant1=tok1,tenant2=tok2"``; they are never printed.

:func:`effective_settings` renders a loaded config for ``asteria-server --check-config`` (tokens
redacted), with :func:`memory_estimate_bytes`: the ceiling that a supervisor's memory limit
(systemd ``MemoryMax=``, a Kubernetes memory limit) should stay above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import ipaddress
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asteria_server.engine.workers import default_num_workers

ENV_PREFIX = "ASTERIA_"
#: Level names ``--log-level`` accepts.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: The host of a ``--metrics-listen`` given as ``:PORT``: metrics stay on this host unless a
#: host is named.
DEFAULT_METRICS_HOST = "127.0.0.1"
#: The shortest tenant token accepted (``openssl rand -hex 32`` gives 64 characters).
MIN_TOKEN_CHARS = 16
#: A token containing this (any case) is a placeholder never replaced, such as the shipped
#: ``REPLACE-WITH-A-RANDOM-TOKEN``: refused.
TOKEN_PLACEHOLDER = "REPLACE"
#: Where cgroup file systems are mounted (``cgroup_root``; tests point it at a fake tree).
DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"


class LogFormat(enum.Enum):
    """How the daemon writes its log lines."""

    #: ``time LEVEL logger: message``, for people.
    TEXT = "text"
    #: One JSON object a line: time, level, logger, event and, where known, tenant, job, block.
    JSON = "json"


def default_listen() -> str:
    """``unix://$XDG_RUNTIME_DIR/asteria/asteria.sock``, else ``/tmp/asteria-$UID/asteria.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "asteria" if runtime else Path(f"/tmp/asteria-{os.getuid()}")
    return f"unix://{base / 'asteria.sock'}"


@dataclass(frozen=True)
class UnixAddress:
    """A Unix socket path (absolute)."""

    path: Path

    @property
    def target(self) -> str:
        return f"unix://{self.path}"

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")


@dataclass(frozen=True)
class TcpAddress:
    """A TCP host and port (port 0: any free port)."""

    host: str
    port: int

    @property
    def target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_metrics_listen(text: str) -> TcpAddress:
    """``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` (``127.0.0.1:PORT``); port 0 picks a free one."""
    where = f"DaemonConfig.metrics_listen must be HOST:PORT or :PORT (loopback), got {text!r}"
    if not isinstance(text, str) or text.startswith("unix:"):
        raise ValueError(where)
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]") or DEFAULT_METRICS_HOST
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(where)
    return TcpAddress(host, int(port))


def _parse_tcp(name: str, text: str) -> TcpAddress:
    """``HOST:PORT`` or ``[V6]:PORT`` for the field ``name``; ValueError naming it."""
    where = f"DaemonConfig.{name} must be HOST:PORT (TCP), got {text!r}"
    if not isinstance(text, str) or text.startswith("unix:"):
        raise ValueError(where)
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(where)
    return TcpAddress(host, int(port))


def parse_listen(listen: str) -> UnixAddress | TcpAddress:
    """``unix:///abs/path.sock`` or ``HOST:PORT`` (``[::1]:PORT`` for IPv6)."""
    if listen.startswith("unix:"):
        path = listen.removeprefix("unix:")
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/"):
            raise ValueError(
                f"DaemonConfig.listen must name an absolute socket path "
                f"(unix:///path/to.sock), got {listen!r}"
            )
        return UnixAddress(Path(path))
    host, sep, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(
            f"DaemonConfig.listen must be unix:///path/to.sock or HOST:PORT, got {listen!r}"
        )
    return TcpAddress(host, int(port))


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Configuration of ``asteria-server``.

    Attributes:
        listen: ``unix:///path/to.sock`` (default; see :func:`default_listen`) or ``HOST:PORT``.
        workers: solver worker processes (default: usable CPUs - 1, at least 1).
        blas_threads: BLAS threads per worker.
        tokens: tenant -> token. Empty: only tenant ``local`` with an empty token, Unix socket only.
        max_message_bytes: largest gRPC message sent or received.
        chunk_bytes: array chunk size of snapshot and result streams.
        max_matrix_n: largest factor dimension accepted.
        grace_period_s: how long in-flight calls may finish at shutdown.
        keepalive_time_s: seconds between keepalive pings on idle connections.
        keepalive_timeout_s: a ping unanswered this long closes the connection.
        handshake_timeout_s: a connection that has not completed its HTTP/2 handshake this long
            after it opened is closed (raw connections cannot hold descriptors for long).
        max_connections: gRPC connections each listener (the gRPC socket, the peer listener)
            holds at once, raw ones still in their handshake included; one more is closed at
            once, before its handshake (gRPC core's ``grpc.max_allowed_incoming_connections``).
            0: a quarter of the descriptor budget, at most 1024.
        connection_idle_s: a gRPC connection with no call in flight for this long is closed
            with a GOAWAY (a client reconnects at its next call, unnoticed).
        max_streams_per_connection: calls one gRPC connection may have in flight at once
            (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; a client queues more until one ends). Kept
            well above ``tenant_max_streams``: gRPC Python's channels to one address share one
            connection in a process, so a tenant's open result streams and its other calls all
            count here, and the tenant's own limit must answer first, with an error that names
            it, not a call that waits unseen.
        max_sessions: open sessions at most, all tenants together (never one dropped for another).
        tls_cert: PEM certificate chain for TCP (required beyond loopback), with ``tls_key``.
        tls_key: PEM private key of ``tls_cert``.
        log_level: one of ``LOG_LEVELS``.
        ready_file: written (address, incarnation, workers) once serving; removed at exit.
        stop_with_pid: stop (as on SIGTERM) when the process of this PID exits: for a launcher
            (a test suite, a benchmark) whose daemon must not outlive it, even when it is killed
            with SIGKILL. Watched through a pidfd on the event loop (Linux >= 5.3), not polled.
        shared_memory: offer same-host clients the shared-memory transport (Unix socket only):
            a segment-handover socket ``<socket>.shm`` next to the gRPC socket.
        max_shm_segments: shared-memory segments one client connection may hand over.
        max_upload_bytes: snapshot bytes the daemon receives at once, all clients together (in
            chunks, or copied out of shared memory); an upload waits for room up to
            ``upload_wait_s``, then fails RESOURCE_EXHAUSTED, and one larger than this fails.
        upload_wait_s: how long an upload may wait for room in ``max_upload_bytes``.
        metrics_listen: serve Prometheus metrics over HTTP at ``HOST:PORT`` (``:PORT`` means
            ``127.0.0.1:PORT``); None (default): no metrics endpoint.
        log_format: :class:`LogFormat` (TOML, env and flags give its value, ``text``/``json``).
        solve_timeout_s: the most any solve may run before its worker is killed and replaced.
        solve_timeout_floor_s: the least time a solve is given (see ``solve_timeout_factor``).
        solve_timeout_factor: a solve is given this many times the calibrated cost model's
            estimate for it (at least ``solve_timeout_floor_s``, at most ``solve_timeout_s``);
            a hung or stopped worker is killed and replaced after that.
        cache_memory_bytes: the result cache's host tier: results held in the daemon's memory
            beyond it leave, least recently used first, to ``spill_dir`` (or are dropped, and
            their clients resubmit). 0: half of ``max_memory_bytes``.
        spill_dir: a local directory (absolute path) where results leaving the host tier are
            written, one checksummed file each, and read back on demand; the daemon removes the
            spill files it finds there at start. None: such results are dropped.
        test_fault_prefix: TEST-ONLY worker fault injection by block name (TOML or env only,
            never a flag; see ``asteria_server.engine.faults``). Unset in production.
        max_memory_bytes: host memory the daemon's snapshots and results may hold, all tenants
            together (queued snapshots, cached results, uploads being received); an upload
            beyond it fails RESOURCE_EXHAUSTED. Default: a quarter of the host's RAM.
        tenant_queued_bytes: snapshot bytes one tenant may have queued or solving in daemon
            memory (snapshots in shared memory cost nothing). 0: half of ``max_memory_bytes``.
        tenant_cached_bytes: result bytes one tenant may have cached in daemon memory; a
            snapshot of a new block beyond it fails RESOURCE_EXHAUSTED. 0: half of
            ``max_memory_bytes``.
        tenant_max_blocks: blocks one tenant may have (registered or submitted).
        max_block_name_bytes: longest block name (UTF-8 bytes) accepted.
        tenant_max_sessions: sessions one tenant may hold open (``max_sessions`` caps all
            tenants together); beyond either an OpenSession fails RESOURCE_EXHAUSTED and no
            session is ever dropped to make room.
        session_ttl_s: a session with no call and no open result stream for this long expires
            (its handover connection is closed); every call and an open stream renew it.
        tenant_max_streams: StreamResults calls one tenant may hold open at once.
        stream_stall_s: a result stream whose client reads nothing for this long ends with
            RESOURCE_EXHAUSTED (what it held is freed).
        tenant_upload_share: the fraction of ``max_upload_bytes`` one tenant's uploads may hold.
        upload_idle_s: an upload that sends no message for this long fails RESOURCE_EXHAUSTED.
        upload_max_s: the most time one upload may take, however it trickles.
        tenant_max_jobs: jobs (RegisterJob layouts) one tenant may have in the job registry;
            beyond it RegisterJob fails RESOURCE_EXHAUSTED (a job is dropped after ``job_idle_s``
            without a session, or at once by ``asteria forget --job``).
        job_idle_s: a registered job with no open session of its job for this long leaves the
            registry.
        metrics_max_connections: connections the metrics endpoint serves at once (one more is
            closed unanswered).
        metrics_timeout_s: a metrics connection that sends nothing for this long is closed.
        max_job_daemons: distinct daemons one job's layout may list (its peer group's size).
        tenant_max_peers: peer daemons one tenant's peer groups may contact together.
        tenant_max_push_streams: PushResults streams (other daemons' pushes) one tenant may
            have open at once.
        peer_allow: comma-separated patterns of the peer daemons a peer group may contact: IP
            networks (``10.0.0.0/8``) or host-name patterns (``node-*.cluster``). Empty: a
            daemon on loopback or a Unix socket contacts loopback peers only, one on another
            interface (with TLS) any.
        tenant_shm_segments: shared-memory segments (one descriptor each) one tenant may have
            handed over, all its connections together. 0: half of the daemon's descriptor
            budget (all of it when there are no tenant tokens).
        peer_listen: a second listener, ``HOST:PORT``, for the peer daemons of multi-node jobs
            (the node's own ranks keep ``listen``, typically its Unix socket). Always TLS, with
            ``peer_tls_cert``/``peer_tls_key``; mutual TLS with ``peer_tls_ca``: a peer must
            present a certificate that CA signed (the cluster's). None: no such listener.
        peer_advertise: the address other nodes' daemons dial to reach ``peer_listen``
            (``HOST:PORT``); told to this daemon's clients, which put it in their job's layout.
            Default: ``peer_listen`` itself, or this host's name with its port when it listens
            on every address (``0.0.0.0``, ``::``).
        peer_tls_cert: PEM certificate chain this daemon shows its peers (server and client).
        peer_tls_key: PEM private key of ``peer_tls_cert``.
        peer_tls_ca: PEM CA certificate(s) that sign the cluster's daemons: peers are verified
            against it, both ways (mutual TLS).
        peer_tls_server_name: the name a peer's certificate must carry (subjectAltName), checked
            instead of the address dialed, so one name covers every node whatever its IP.
        socket_group_access: make the Unix socket (and its ``.shm`` socket) 0660 instead of 0600,
            so members of the daemon's group connect; the directory must then be 0750 (the
            daemon refuses a group-writable one). Needs tenant tokens: without them every group
            member would be the same anonymous tenant.
    """

    listen: str = field(default_factory=default_listen)
    workers: int = field(default_factory=default_num_workers)
    blas_threads: int = 1
    tokens: Mapping[str, str] = field(default_factory=dict, repr=False)
    max_message_bytes: int = 4 << 20
    chunk_bytes: int = 1 << 20
    max_matrix_n: int = 16384
    grace_period_s: float = 10.0
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    handshake_timeout_s: float = 10.0
    max_connections: int = 0
    connection_idle_s: float = 300.0
    max_streams_per_connection: int = 2048
    max_sessions: int = 4096
    tls_cert: str | None = None
    tls_key: str | None = None
    log_level: str = "INFO"
    ready_file: str | None = None
    stop_with_pid: int | None = None
    shared_memory: bool = True
    max_shm_segments: int = 4096
    max_upload_bytes: int = 2 << 30
    upload_wait_s: float = 5.0
    metrics_listen: str | None = None
    metrics_max_connections: int = 16
    metrics_timeout_s: float = 5.0
    log_format: LogFormat = LogFormat.TEXT
    socket_group_access: bool = False
    max_memory_bytes: int = 0
    tenant_queued_bytes: int = 0
    tenant_cached_bytes: int = 0
    tenant_max_blocks: int = 100_000
    max_block_name_bytes: int = 1024
    tenant_max_sessions: int = 1024
    session_ttl_s: float = 300.0
    tenant_max_streams: int = 1024
    stream_stall_s: float = 60.0
    tenant_upload_share: float = 0.5
    upload_idle_s: float = 30.0
    upload_max_s: float = 300.0
    tenant_max_jobs: int = 64
    job_idle_s: float = 120.0
    max_job_daemons: int = 64
    tenant_max_peers: int = 256
    tenant_max_push_streams: int = 16
    peer_allow: str = ""
    peer_listen: str | None = None
    peer_advertise: str | None = None
    peer_tls_cert: str | None = None
    peer_tls_key: str | None = None
    peer_tls_ca: str | None = None
    peer_tls_server_name: str = "asteria-peer"
    tenant_shm_segments: int = 0
    solve_timeout_s: float = 600.0
    solve_timeout_floor_s: float = 30.0
    solve_timeout_factor: float = 20.0
    test_fault_prefix: str | None = None
    cache_memory_bytes: int = 0
    spill_dir: str | None = None
    cgroup_root: str = DEFAULT_CGROUP_ROOT
    job_ttl_s: float = 600.0
    #: The memory limit of the daemon's own cgroup (derived at load, never set): see
    #: :func:`cgroup_memory_limit`. None: no limit found.
    cgroup_memory_limit_bytes: int | None = field(default=None, init=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.cgroup_root, str) or not os.path.isabs(self.cgroup_root):
            raise ValueError(
                "DaemonConfig.cgroup_root must be an absolute directory path, "
                f"got {self.cgroup_root!r}"
            )
        limit = cgroup_memory_limit(Path(self.cgroup_root))
        object.__setattr__(self, "cgroup_memory_limit_bytes", None if limit is None else limit[0])
        if self.max_memory_bytes == 0:  # derived: from the RAM and the cgroup's limit
            object.__setattr__(
                self, "max_memory_bytes", default_max_memory_bytes(self.cgroup_memory_limit_bytes)
            )
        job_ttl = self.job_ttl_s
        if (
            not isinstance(job_ttl, int | float)
            or isinstance(job_ttl, bool)
            or not (0 <= job_ttl < math.inf)
        ):
            raise ValueError(
                f"DaemonConfig.job_ttl_s must be a finite number >= 0 (0: never), got {job_ttl!r}"
            )
        _check_int("cache_memory_bytes", self.cache_memory_bytes, 0)
        if self.spill_dir is not None and not (
            isinstance(self.spill_dir, str) and os.path.isabs(self.spill_dir)
        ):
            raise ValueError(
                f"DaemonConfig.spill_dir must be an absolute directory path, got {self.spill_dir!r}"
            )
        address = parse_listen(self.listen)
        if self.metrics_listen is not None:
            parse_metrics_listen(self.metrics_listen)
        if isinstance(self.log_format, str):
            with contextlib.suppress(ValueError):  # reported below with the accepted values
                object.__setattr__(self, "log_format", LogFormat(self.log_format.lower()))
        if not isinstance(self.log_format, LogFormat):
            raise ValueError(
                f"DaemonConfig.log_format must be one of {[f.value for f in LogFormat]}, "
                f"got {self.log_format!r}"
            )
        if not isinstance(self.socket_group_access, bool):
            raise ValueError(
                "DaemonConfig.socket_group_access must be true or false, "
                f"got {self.socket_group_access!r}"
            )
        if self.socket_group_access:
            if not isinstance(address, UnixAddress):
                raise ValueError(
                    "DaemonConfig.socket_group_access applies to a Unix socket, "
                    f"not to listen {self.listen!r}"
                )
            if not self.tokens:
                raise ValueError(
                    "DaemonConfig.socket_group_access lets every member of the daemon's group "
                    "connect, but no tenant tokens are configured, so they would all be one "
                    "anonymous tenant. Add a [tenants] table or set ASTERIA_TOKENS"
                )
        for name in ("workers", "blas_threads", "max_message_bytes", "chunk_bytes"):
            _check_int(name, getattr(self, name), 1)
        _check_int("max_matrix_n", self.max_matrix_n, 1)
        _check_int("max_sessions", self.max_sessions, 1)
        _check_int("max_shm_segments", self.max_shm_segments, 1)
        if self.stop_with_pid is not None:
            _check_int("stop_with_pid", self.stop_with_pid, 1)
        if not isinstance(self.shared_memory, bool):
            raise ValueError(
                f"DaemonConfig.shared_memory must be true or false, got {self.shared_memory!r}"
            )
        if self.max_message_bytes < self.chunk_bytes + 4096:
            raise ValueError(
                f"DaemonConfig.max_message_bytes must be >= chunk_bytes + 4096 "
                f"({self.chunk_bytes + 4096}) so a chunk and its framing fit, "
                f"got {self.max_message_bytes}"
            )
        _check_int("max_upload_bytes", self.max_upload_bytes, 1)
        self._check_limits()
        for name in (
            "grace_period_s",
            "keepalive_time_s",
            "keepalive_timeout_s",
            "handshake_timeout_s",
            "connection_idle_s",
            "upload_wait_s",
            "solve_timeout_s",
            "solve_timeout_floor_s",
            "solve_timeout_factor",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"DaemonConfig.{name} must be a number, got {value!r}")
            if not (0 < value < math.inf):
                raise ValueError(f"DaemonConfig.{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.tokens, Mapping):
            raise ValueError("DaemonConfig.tokens must be a mapping tenant -> token")
        for tenant, token in self.tokens.items():
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(
                    f"DaemonConfig.tokens: tenant must be a non-empty string, got {tenant!r}"
                )
            if not isinstance(token, str) or not token:
                # The token itself is never echoed.
                raise ValueError(f"DaemonConfig.tokens: tenant {tenant!r} has an empty token")
            if TOKEN_PLACEHOLDER in token.upper():
                raise ValueError(
                    f"DaemonConfig.tokens: tenant {tenant!r} still has a placeholder token (it "
                    f"contains {TOKEN_PLACEHOLDER!r}); give it a random one, e.g. from "
                    "`openssl rand -hex 32`"
                )
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(
                    f"DaemonConfig.tokens: tenant {tenant!r} has a token of {len(token)} "
                    f"characters; a token needs at least {MIN_TOKEN_CHARS} (e.g. from "
                    "`openssl rand -hex 32`)"
                )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"DaemonConfig.log_level must be one of {LOG_LEVELS}, got {self.log_level!r}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("DaemonConfig.tls_cert and tls_key must be given together")
        if isinstance(address, UnixAddress) and self.tls_cert is not None:
            raise ValueError("DaemonConfig.tls_cert applies to TCP only; a Unix socket is local")
        if isinstance(address, TcpAddress):
            if not self.tokens:
                raise ValueError(
                    f"DaemonConfig.listen is TCP ({self.listen!r}) but no tenant tokens are "
                    "configured: a TCP port is reachable by every local user. Add a [tenants] "
                    "table to the config file or set ASTERIA_TOKENS='tenant=token', or listen on "
                    "a Unix socket (unix:///path/to.sock)"
                )
            if not address.is_loopback and self.tls_cert is None:
                raise ValueError(
                    f"DaemonConfig.listen {self.listen!r} is not a loopback address: serving "
                    "beyond this host needs TLS (--tls-cert and --tls-key)"
                )
        self._check_peer_listener(address)

    def _check_peer_listener(self, address: UnixAddress | TcpAddress) -> None:
        """``peer_listen`` and its TLS files: all or nothing, TCP only, never plaintext."""
        peer_files = ("peer_tls_cert", "peer_tls_key", "peer_tls_ca")
        if self.peer_listen is None:
            given = [name for name in (*peer_files, "peer_advertise") if getattr(self, name)]
            if given:
                raise ValueError(
                    f"DaemonConfig.{given[0]} is set but peer_listen is not: set peer_listen "
                    "(HOST:PORT) for the peer listener they belong to"
                )
            return
        peer = _parse_tcp("peer_listen", self.peer_listen)
        if not self.tokens:
            raise ValueError(
                f"DaemonConfig.peer_listen {self.peer_listen!r} needs tenant tokens: peers "
                "present their job's tenant token. Add a [tenants] table or set ASTERIA_TOKENS"
            )
        missing = [name for name in peer_files if not getattr(self, name)]
        if missing:
            raise ValueError(
                f"DaemonConfig.peer_listen {self.peer_listen!r} needs {', '.join(missing)}: peer "
                "daemons reach each other over mutual TLS only (deploy/tls/make-cluster-certs.sh "
                "makes a CA and one certificate per node)"
            )
        if isinstance(address, TcpAddress) and address.port == peer.port and peer.port != 0:
            raise ValueError(
                f"DaemonConfig.peer_listen {self.peer_listen!r} uses the port of listen "
                f"{self.listen!r}: give the peer listener a port of its own"
            )
        if self.peer_advertise is not None:
            advertised = _parse_tcp("peer_advertise", self.peer_advertise)
            if advertised.port == 0:
                raise ValueError(
                    f"DaemonConfig.peer_advertise {self.peer_advertise!r} must name a port"
                )
        if not isinstance(self.peer_tls_server_name, str) or not self.peer_tls_server_name:
            raise ValueError(
                "DaemonConfig.peer_tls_server_name must be a non-empty name, got "
                f"{self.peer_tls_server_name!r}"
            )

    @property
    def peer_address(self) -> TcpAddress | None:
        """Where the peer listener binds (None: no peer listener)."""
        return None if self.peer_listen is None else _parse_tcp("peer_listen", self.peer_listen)

    def _check_limits(self) -> None:
        """The resource limits of issue 10; 0 in the ``tenant_*_bytes`` fields means derived."""
        _check_int("max_memory_bytes", self.max_memory_bytes, 1)
        for name in ("tenant_queued_bytes", "tenant_cached_bytes", "tenant_shm_segments"):
            _check_int(name, getattr(self, name), 0)
        for name in ("tenant_queued_bytes", "tenant_cached_bytes"):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, max(1, self.max_memory_bytes // 2))
        for name in (
            "tenant_max_blocks",
            "max_block_name_bytes",
            "tenant_max_sessions",
            "tenant_max_streams",
            "tenant_max_jobs",
            "max_job_daemons",
            "tenant_max_peers",
            "tenant_max_push_streams",
            "metrics_max_connections",
            "max_streams_per_connection",
        ):
            _check_int(name, getattr(self, name), 1)
        _check_int("max_connections", self.max_connections, 0)
        for name in (
            "session_ttl_s",
            "stream_stall_s",
            "upload_idle_s",
            "upload_max_s",
            "job_idle_s",
            "metrics_timeout_s",
        ):
            _check_seconds(name, getattr(self, name))
        if not isinstance(self.peer_allow, str):
            raise ValueError(f"DaemonConfig.peer_allow must be a string, got {self.peer_allow!r}")
        from asteria_server.sync.policy import parse_patterns  # the rule lives with the sync

        parse_patterns(self.peer_allow)
        share = self.tenant_upload_share
        if not isinstance(share, int | float) or isinstance(share, bool) or not 0 < share <= 1:
            raise ValueError(
                f"DaemonConfig.tenant_upload_share must be a number in (0, 1], got {share!r}"
            )

    @property
    def cache_budget_bytes(self) -> int:
        """The result cache's host tier in bytes (``cache_memory_bytes``, else its default)."""
        return self.cache_memory_bytes or max(1, self.max_memory_bytes // 2)

    @property
    def address(self) -> UnixAddress | TcpAddress:
        return parse_listen(self.listen)

    def allows_anonymous(self) -> bool:
        """True when tenant ``local`` may connect with an empty token (no tokens, Unix socket)."""
        return not self.tokens and isinstance(self.address, UnixAddress)

    @property
    def metrics_address(self) -> TcpAddress | None:
        return None if self.metrics_listen is None else parse_metrics_listen(self.metrics_listen)

    @property
    def socket_mode(self) -> int:
        """The mode of the Unix socket and of its ``.shm`` handover socket."""
        return 0o660 if self.socket_group_access else 0o600


#: Resident memory of one Python process with NumPy and SciPy loaded (daemon or worker), rounded up.
PROCESS_BASE_BYTES = 160 << 20
#: Peak bytes per n² of one solve in a worker: the fp64 copy and LAPACK's evd workspace (~3 n²
#: doubles), the shared-memory input and the fp32 result.
SOLVE_BYTES_PER_N2 = 40


def memory_estimate_bytes(config: DaemonConfig) -> int:
    """The most the daemon and its workers hold at once, cached results aside.

    ``max_upload_bytes`` of snapshots being received, plus, per worker, a process and one solve
    of the largest accepted factor (``max_matrix_n``). Each block also keeps its newest result
    and at most one queued snapshot (about ``8 n²`` bytes for both): add that for the blocks
    the node's jobs have when choosing a memory limit.
    """
    per_worker = PROCESS_BASE_BYTES + SOLVE_BYTES_PER_N2 * config.max_matrix_n**2
    return PROCESS_BASE_BYTES + config.max_upload_bytes + config.workers * per_worker


def total_memory_estimate_bytes(config: DaemonConfig) -> int:
    """What the daemon may hold at most, its budgets full: :func:`memory_estimate_bytes`'s
    processes and solves, plus the larger of ``max_memory_bytes`` (queued snapshots, cached
    results and uploads together), the upload budget and the result cache's host tier. This is
    what must fit in the daemon's cgroup."""
    per_worker = PROCESS_BASE_BYTES + SOLVE_BYTES_PER_N2 * config.max_matrix_n**2
    budgets = max(config.max_memory_bytes, config.max_upload_bytes, config.cache_budget_bytes)
    return PROCESS_BASE_BYTES + config.workers * per_worker + budgets


def memory_limit_problem(config: DaemonConfig) -> str | None:
    """Why the daemon's budgets do not fit its cgroup's memory limit (None: they do, or there is
    no limit): the kernel would kill the daemon before its own eviction began."""
    limit = config.cgroup_memory_limit_bytes
    if limit is None:
        return None
    total = total_memory_estimate_bytes(config)
    if total <= limit:
        return None
    mib = 1 << 20
    found = cgroup_memory_limit(Path(config.cgroup_root))
    where = f" ({found[1]})" if found is not None else ""
    return (
        f"the daemon may use ~{total / mib:.0f} MiB ({config.workers} worker(s) solving "
        f"max_matrix_n = {config.max_matrix_n}, max_memory_bytes = {config.max_memory_bytes}, "
        f"max_upload_bytes = {config.max_upload_bytes}) but its cgroup's memory limit"
        f"{where} is {limit / mib:.0f} MiB: the kernel would kill it before its own eviction "
        "starts. Lower workers, max_matrix_n, max_memory_bytes or max_upload_bytes, or raise "
        "the limit (systemd MemoryMax=, the container's memory limit)"
    )


def effective_settings(config: DaemonConfig) -> str:
    """The config as ``key = value`` lines (TOML), tokens redacted, then the memory estimate."""
    lines = []
    for f in dataclasses.fields(config):
        if f.name == "tokens" or not f.init:  # derived fields are shown below
            continue
        value = getattr(config, f.name)
        if f.name == "metrics_listen" and config.metrics_address is not None:
            value = config.metrics_address.target  # ":PORT" shown as the host it means
        if isinstance(value, enum.Enum):
            value = value.value
        if value is None:
            lines.append(f"# {f.name} is not set")
        elif isinstance(value, bool):
            lines.append(f"{f.name} = {str(value).lower()}")
        elif isinstance(value, str):
            lines.append(f"{f.name} = {_toml_string(value)}")
        else:
            lines.append(f"{f.name} = {value!r}")
    lines.append("")
    lines.append("[tenants]  # tokens are never printed")
    lines.extend(f'{_toml_key(tenant)} = "<redacted>"' for tenant in sorted(config.tokens))
    if not config.tokens:
        lines.append(
            "# none: only tenant 'local' with an empty token, on a Unix socket"
            if config.allows_anonymous()
            else "# none"
        )
    lines.append("")
    mib = memory_estimate_bytes(config) / (1 << 20)
    lines.append(
        f"# memory: at most ~{mib:.0f} MiB for uploads, the daemon and {config.workers} worker(s) "
        f"solving n={config.max_matrix_n}; add ~8 n^2 bytes per cached block"
    )
    total_mib = total_memory_estimate_bytes(config) / (1 << 20)
    limit = config.cgroup_memory_limit_bytes
    lines.append(
        f"# memory with the budgets full: ~{total_mib:.0f} MiB; cgroup memory limit: "
        + ("none found" if limit is None else f"{limit / (1 << 20):.0f} MiB")
    )
    return "\n".join(lines) + "\n"


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_key(key: str) -> str:
    bare = key and all(c.isalnum() or c in "-_" for c in key) and key.isascii()
    return key if bare else _toml_string(key)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"DaemonConfig.{name} must be an int >= {minimum}, got {value!r}")


def _check_seconds(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ValueError(f"DaemonConfig.{name} must be a finite number > 0, got {value!r}")


def physical_memory_bytes() -> int | None:
    """This host's RAM (None when it cannot be read)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return None


def default_max_memory_bytes(cgroup_limit_bytes: int | None = None) -> int:
    """The default ``max_memory_bytes``: a quarter of this host's RAM (the host is shared with
    its trainers), and at most half of the daemon's cgroup limit where it has one (the cgroup is
    the daemon's own; the other half is for its processes, solves and uploads). 1 GiB when
    neither can be read."""
    candidates = []
    ram = physical_memory_bytes()
    if ram is not None:
        candidates.append(ram // 4)
    if cgroup_limit_bytes is not None:
        candidates.append(cgroup_limit_bytes // 2)
    return max(1, min(candidates)) if candidates else 1 << 30


#: A cgroup v1 ``memory.limit_in_bytes`` at or above this means "no limit" (the kernel writes
#: the largest page-aligned 64-bit value).
_V1_UNLIMITED = 1 << 62


def cgroup_memory_limit(
    root: Path, proc_cgroup: Path = Path("/proc/self/cgroup")
) -> tuple[int, Path] | None:
    """The memory limit of this process's cgroup and the file that sets it, or None.

    The cgroup comes from ``/proc/self/cgroup``: v2's ``0::/path`` (limit in
    ``root/path/memory.max``) or v1's memory controller (``root/memory/path/
    memory.limit_in_bytes``). The cgroup and every ancestor up to ``root`` are read and the
    smallest limit wins, as the kernel enforces it; a missing file is skipped (inside a
    container the process's path often names a cgroup mounted as the root itself)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[int, Path]] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            file = base.joinpath(*parts[:depth], name)
            try:
                text = file.read_text().strip()
            except OSError:
                continue
            if text == "max" or not text.isdigit():
                continue
            value = int(text)
            if value >= _V1_UNLIMITED or value <= 0:
                continue
            found.append((value, file))
    return min(found, key=lambda item: item[0]) if found else None


def parse_tokens(text: str) -> dict[str, str]:
    """``"tenant1=tok1,tenant2=tok2"`` as a mapping (the form of ``ASTERIA_TOKENS``)."""
    tokens: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        tenant, sep, token = item.partition("=")
        if not sep or not tenant.strip() or not token.strip():
            raise ValueError(
                "ASTERIA_TOKENS must look like 'tenant1=token1,tenant2=token2' "
                f"(an entry for tenant {tenant.strip()!r} is malformed)"
            )
        tokens[tenant.strip()] = token.strip()
    return tokens


def _as_float(text: str) -> float:
    return float(text)


def _as_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


#: Fields settable from env and flags, with how to read their text. ``tokens`` is separate.
_PARSERS: dict[str, Callable[[str], Any]] = {
    "listen": str,
    "workers": int,
    "blas_threads": int,
    "max_message_bytes": int,
    "chunk_bytes": int,
    "max_matrix_n": int,
    "grace_period_s": _as_float,
    "keepalive_time_s": _as_float,
    "keepalive_timeout_s": _as_float,
    "handshake_timeout_s": _as_float,
    "max_connections": int,
    "connection_idle_s": _as_float,
    "max_streams_per_connection": int,
    "max_sessions": int,
    "tls_cert": str,
    "tls_key": str,
    "log_level": str.upper,
    "ready_file": str,
    "stop_with_pid": int,
    "shared_memory": _as_bool,
    "max_shm_segments": int,
    "max_upload_bytes": int,
    "upload_wait_s": _as_float,
    "metrics_listen": str,
    "metrics_max_connections": int,
    "metrics_timeout_s": _as_float,
    "log_format": str.lower,
    "socket_group_access": _as_bool,
    "max_memory_bytes": int,
    "tenant_queued_bytes": int,
    "tenant_cached_bytes": int,
    "tenant_max_blocks": int,
    "max_block_name_bytes": int,
    "tenant_max_sessions": int,
    "session_ttl_s": _as_float,
    "tenant_max_streams": int,
    "stream_stall_s": _as_float,
    "tenant_upload_share": _as_float,
    "upload_idle_s": _as_float,
    "upload_max_s": _as_float,
    "tenant_max_jobs": int,
    "job_idle_s": _as_float,
    "max_job_daemons": int,
    "tenant_max_peers": int,
    "tenant_max_push_streams": int,
    "peer_allow": str,
    "peer_listen": str,
    "peer_advertise": str,
    "peer_tls_cert": str,
    "peer_tls_key": str,
    "peer_tls_ca": str,
    "peer_tls_server_name": str,
    "tenant_shm_segments": int,
    "solve_timeout_s": _as_float,
    "solve_timeout_floor_s": _as_float,
    "solve_timeout_factor": _as_float,
    "test_fault_prefix": str,
    "cache_memory_bytes": int,
    "spill_dir": str,
    "cgroup_root": str,
    "job_ttl_s": _as_float,
}
_FIELDS = {f.name for f in dataclasses.fields(DaemonConfig) if f.init}
assert set(_PARSERS) | {"tokens"} == _FIELDS, "every DaemonConfig field needs a parser"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _from_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read config file {path!r}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path!r} is not valid TOML: {exc}") from exc
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "tenants":
            if not isinstance(value, dict):
                raise ValueError(f"config file {path!r}: [tenants] must be a table tenant = token")
            values["tokens"] = {str(t): v for t, v in value.items()}
        elif key in _PARSERS:
            values[key] = value
        else:
            raise ValueError(
                f"config file {path!r}: unknown key {key!r}; known: {sorted(_PARSERS)} "
                "and the [tenants] table"
            )
    return values


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, parse in _PARSERS.items():
        text = environ.get(env_name(name))
        if text is None or text == "":
            continue
        try:
            values[name] = parse(text)
        except ValueError as exc:
            raise ValueError(f"{env_name(name)}={text!r} is not valid: {exc}") from exc
    tokens = environ.get(env_name("tokens"))
    if tokens:
        values["tokens"] = parse_tokens(tokens)
    return values


def load_config(
    *,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> DaemonConfig:
    """TOML file, then ``ASTERIA_*`` env, then ``overrides`` (flags; None values are unset)."""
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(_from_toml(config_file))
    values.update(_from_env(os.environ if environ is None else environ))
    for key, value in (overrides or {}).items():
        if value is not None:
            if key not in _FIELDS:
                raise ValueError(f"unknown DaemonConfig field {key!r}")
            values[key] = value
    return DaemonConfig(**values)
