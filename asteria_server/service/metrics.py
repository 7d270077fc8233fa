"""The daemon's Prometheus metrics (``asteria-server --metrics-listen HOST:PORT``).

Two sources feed one registry of the daemon's own, never ``prometheus_client``'s global one
(an engine embedded in a training process that exports metrics of its own cannot clash with it):

- :class:`_StatusCollector` reads what the daemon keeps anyway — engine stats, every block's
  status, the sessions, the shared-memory and upload numbers — when Prometheus scrapes. Nothing on
  the submit or solve path pays for these, and they cannot drift from what ``asteria status``
  shows.
- The peer groups of multi-node jobs (``asteria_server/sync``), read on the daemon's event loop
  at scrape time: peers by state, push lag, bytes and results between daemons, fallbacks.
- Counters and histograms that the engine's observer feeds as each dispatched solve ends (on the
  dispatcher thread; ``prometheus_client`` metrics are thread-safe): solves and failures by kind
  and size, solve seconds, queue wait, CPU-seconds per tenant.

The HTTP port also answers ``/healthz`` (200 while the process and its engine work: the engine
not broken or closed, a solver worker alive; 503 otherwise) and ``/readyz`` (200 while the daemon
serves: health SERVING and not draining at shutdown; 503 otherwise), each with a one-line
reason; any other path than these and ``/metrics`` is 404.

Staleness is reported as a distribution per tenant — gauge histograms of every block's lag, in
steps and in seconds, at scrape time — never one series per block: a job has thousands of
blocks, and a series each would cost Prometheus more than the daemon. Every label has a bounded
set of values: tenants come from the token table (or the one anonymous tenant), kinds and size
buckets are the fixed lists below.
"""

from __future__ import annotations

import bisect
import logging
import os
import socket
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from asteria_server import __version__
from asteria_server.config import TcpAddress
from asteria_server.engine import BlockStatus, PreconditionerEngine
from asteria_server.engine.engine import FinishedSolve
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.service.loopwatch import StallTally
from asteria_server.types import EngineStats, TransportStats

logger = logging.getLogger(__name__)

#: Upper bounds of the ``size`` label (the factor dimension n); larger ones are ``>8192``.
SIZE_BOUNDS = (128, 256, 512, 1024, 2048, 4096, 8192)
#: Values of the ``kind`` label: what a solve computed.
KINDS = ("inverse_root", "eigenbasis", "refresh")
SOLVE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0, 600.0)  # fmt: skip
WAIT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0, 60.0, 120.0)  # fmt: skip
LAG_STEPS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
LAG_SECONDS_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
#: Values of the ``state`` label of ``asteria_peers`` (every one is exported, 0 included, so an
#: alert on ``state="dead"`` has a series to watch).
PEER_STATES = ("alive", "suspect", "dead", "unknown")

#: (tenant, peer group) of every multi-node job this daemon syncs, as the sync reports them.
PeerGroups = Callable[[], Sequence[tuple[str, ppb.PeerGroup]]]


def size_bucket(n: int) -> str:
    """The ``size`` label of an n×n factor: ``<=128`` … ``<=8192``, ``>8192``."""
    for bound in SIZE_BOUNDS:
        if n <= bound:
            return f"<={bound}"
    return f">{SIZE_BOUNDS[-1]}"


def kind_label(record: FinishedSolve) -> str:
    """``inverse_root``, ``eigenbasis`` (a full eigh) or ``refresh`` (one QR power step)."""
    return "refresh" if record.refresh else record.kind.value


def lag_seconds(block: BlockStatus) -> float:
    """How long the block's newest snapshot has waited for its result (0 once it has one)."""
    if block.staleness_steps <= 0 or block.submitted_age_s is None:
        return 0.0
    return block.submitted_age_s


class DaemonSources(Protocol):
    """What the collector reads at scrape time (the servicer provides all of it)."""

    def transport_stats(self) -> TransportStats: ...

    def sessions_by_tenant(self) -> Mapping[str, int]: ...

    def memory_held_bytes(self) -> int: ...

    @property
    def memory_budget_bytes(self) -> int: ...

    def auth_failures(self) -> Mapping[str, int]: ...

    def refusal_counts(self) -> Mapping[tuple[str, str], int]: ...

    def expiry_counts(self) -> tuple[int, int]: ...


#: (ready, why): what /readyz answers.
Readiness = Callable[[], tuple[bool, str]]
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(pid: int) -> int | None:
    """The resident memory of process ``pid`` (``/proc/PID/statm``), None when it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


#: Connections the metrics endpoint serves at once, and how long one may send nothing.
METRICS_MAX_CONNECTIONS = 16
METRICS_TIMEOUT_S = 5.0


class _QuietHandler(WSGIRequestHandler):
    """A request handler that logs nothing per request (a scrape every few seconds)."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class BoundedWSGIServer(ThreadingMixIn, WSGIServer):
    """A threaded WSGI server with at most ``limit`` connections served at once; one more is
    closed unanswered (and counted in ``refused``). Each handler's ``timeout`` bounds how long
    a connection may send nothing."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def limit(self, max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class DaemonMetrics:
    """The daemon's registry, its solve observer and its HTTP endpoint."""

    def __init__(self, *, blas_threads: int = 1, memory_limit_bytes: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._blas_threads = blas_threads
        self.drain_finished = Counter(
            "asteria_drain_finished_solves",
            "Solves that finished during the shutdown drain (SIGTERM).",
            registry=self.registry,
        )
        self.drain_dropped = Counter(
            "asteria_drain_dropped_solves",
            "Solves still queued or running when the shutdown drain's grace period ended "
            "(grace_period_s): dropped, their clients resubmit or compute locally.",
            registry=self.registry,
        )
        self.solves = Counter(
            "asteria_solves",
            "Solves that produced a result, by what they computed and the factor size n.",
            ["kind", "size"],
            registry=self.registry,
        )
        self.failures = Counter(
            "asteria_solve_failures",
            "Solves that failed for good (after retries), by kind and factor size n.",
            ["kind", "size"],
            registry=self.registry,
        )
        self.solve_seconds = Histogram(
            "asteria_solve_duration_seconds",
            "Seconds a successful solve took in its worker process.",
            ["kind"],
            buckets=SOLVE_BUCKETS_S,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "asteria_queue_wait_seconds",
            "Seconds a snapshot waited from its submission until a worker took it.",
            ["tenant"],
            buckets=WAIT_BUCKETS_S,
            registry=self.registry,
        )
        self.cpu_seconds = Counter(
            "asteria_tenant_cpu_seconds",
            "Worker CPU-seconds spent on the tenant's solves (solve time x BLAS threads; a "
            "failed solve counts its time from dispatch to failure).",
            ["tenant"],
            registry=self.registry,
        )
        self.collector = _StatusCollector(memory_limit_bytes)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def observe(self, record: FinishedSolve) -> None:
        """The engine's observer: one dispatched solve ended."""
        kind, size = kind_label(record), size_bucket(record.n)
        if record.ok and record.solve_s is not None:
            self.solves.labels(kind, size).inc()
            self.solve_seconds.labels(kind).observe(record.solve_s)
            busy_s = record.solve_s
        else:
            self.failures.labels(kind, size).inc()
            busy_s = record.run_s
        self.queue_wait.labels(record.tenant).observe(record.wait_s)
        self.cpu_seconds.labels(record.tenant).inc(busy_s * self._blas_threads)

    def bind(
        self,
        engine: PreconditionerEngine,
        sources: DaemonSources,
        peers: PeerGroups | None = None,
        *,
        ready: Readiness | None = None,
        stalls: StallTally | None = None,
    ) -> None:
        """Start reading the running daemon's numbers at scrape time; ``ready`` says whether
        it serves (/readyz); ``stalls``, how often its event loop was blocked."""
        self.collector.bind(engine, sources, peers, stalls)
        self._ready = ready

    def drained(self, finished: int, dropped: int) -> None:
        """The shutdown drain ended: ``finished`` solves finished in it, ``dropped`` did not."""
        self.drain_finished.inc(finished)
        self.drain_dropped.inc(dropped)

    def health(self) -> tuple[bool, str]:
        """What /healthz answers: the engine works and a solver worker process is alive."""
        engine = self.collector.engine
        if engine is None:
            return True, "starting"
        stats = engine.stats()
        if stats.broken_reason is not None:
            return False, f"engine broken: {stats.broken_reason}"
        if stats.closed:
            return False, "engine closed (shutting down)"
        alive = [w for w in stats.workers if w.pid and resident_bytes(w.pid) is not None]
        if not alive:
            return False, "no solver worker process is alive"
        return True, f"ok: {len(alive)} of {stats.num_workers} workers alive"

    def readiness(self) -> tuple[bool, str]:
        """What /readyz answers."""
        ready = getattr(self, "_ready", None)
        if ready is None or self.collector.engine is None:
            return False, "starting"
        healthy, why = self.health()
        if not healthy:
            return False, why
        return ready()

    def _app(self) -> Callable[..., Iterable[bytes]]:
        """The WSGI app: /metrics, /healthz, /readyz; anything else 404."""
        metrics_app = make_wsgi_app(self.registry)

        def app(
            environ: dict[str, object], start_response: Callable[..., object]
        ) -> Iterable[bytes]:
            path = environ.get("PATH_INFO") or "/"
            if path in ("/metrics", "/metrics/"):
                return metrics_app(environ, start_response)
            if path in ("/healthz", "/readyz"):
                try:
                    ok, why = self.health() if path == "/healthz" else self.readiness()
                except Exception as exc:  # a probe must get an answer
                    ok, why = False, f"{type(exc).__name__}: {exc}"
                return _text(start_response, "200 OK" if ok else "503 Service Unavailable", why)
            return _text(
                start_response,
                "404 Not Found",
                "not found; this port serves /metrics, /healthz, /readyz",
            )

        return app

    def serve(
        self,
        address: TcpAddress,
        *,
        max_connections: int = METRICS_MAX_CONNECTIONS,
        timeout_s: float = METRICS_TIMEOUT_S,
    ) -> str:
        """Serve ``/metrics`` over HTTP in a thread; returns its URL (with the bound port).

        At most ``max_connections`` connections are served at once (one thread each; one more
        is closed at once, unanswered), and a connection that sends nothing for ``timeout_s``
        is closed: idle connections cannot hold threads and descriptors without bound.
        Raises OSError when the address cannot be bound.
        """
        handler = type("_Handler", (_QuietHandler,), {"timeout": timeout_s})
        server_class = type(
            "_Server",
            (BoundedWSGIServer,),
            {"address_family": socket.AF_INET6 if ":" in address.host else socket.AF_INET},
        )
        http: WSGIServer = make_server(
            address.host,
            address.port,
            self._app(),
            server_class=server_class,
            handler_class=handler,
        )
        assert isinstance(http, BoundedWSGIServer)
        http.limit(max_connections)
        self._http = http
        self._thread = threading.Thread(
            target=http.serve_forever, name="asteria-metrics", daemon=True
        )
        self._thread.start()
        port = self._http.server_address[1]
        url = f"http://{TcpAddress(address.host, port).target}/metrics"
        logger.info("metrics served at %s", url)
        return url

    def close(self) -> None:
        """Stop the HTTP endpoint (idempotent)."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _text(start_response: Callable[..., object], status: str, body: str) -> list[bytes]:
    data = (body + "\n").encode()
    start_response(
        status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    )
    return [data]


class _StatusCollector(Collector):
    """Reads engine stats, block status, sessions and the data path at scrape time."""

    def __init__(self, memory_limit_bytes: int | None = None) -> None:
        self._engine: PreconditionerEngine | None = None
        self._sources: DaemonSources | None = None
        self._peers: PeerGroups | None = None
        self._stalls: StallTally | None = None
        self._memory_limit_bytes = memory_limit_bytes

    @property
    def engine(self) -> PreconditionerEngine | None:
        return self._engine

    def bind(
        self,
        engine: PreconditionerEngine,
        sources: DaemonSources,
        peers: PeerGroups | None,
        stalls: StallTally | None = None,
    ) -> None:
        self._engine, self._sources, self._peers = engine, sources, peers
        self._stalls = stalls

    def describe(self) -> Iterable[Metric]:
        return []  # names are only known once bound; nothing to check them against

    def collect(self) -> Iterator[Metric]:
        engine, sources = self._engine, self._sources
        if engine is None or sources is None:
            return
        stats = engine.stats()
        blocks = engine.status()
        transport = sources.transport_stats()
        sessions = sources.sessions_by_tenant()

        yield InfoMetricFamily(
            "asteria_daemon",
            "The daemon's incarnation (a new one after every restart) and version.",
            value={"incarnation": stats.incarnation_id, "version": __version__},
        )
        yield _gauge("asteria_uptime_seconds", "Seconds since the engine started.", stats.uptime_s)
        if self._stalls is not None:
            yield CounterMetricFamily(
                "asteria_event_loop_stalls",
                "Times the event loop answering every RPC (health included) was blocked for "
                "over a second (the daemon's log says in what).",
                value=self._stalls.stalls,
            )
            yield _gauge(
                "asteria_event_loop_stall_seconds_max",
                "The longest the event loop has been blocked, in seconds.",
                self._stalls.longest_s,
            )
        yield _gauge(
            "asteria_engine_broken",
            "1 when the engine stopped working (the daemon then reports NOT_SERVING).",
            1.0 if stats.broken_reason is not None else 0.0,
        )
        workers = GaugeMetricFamily(
            "asteria_workers", "Solver worker processes, busy or idle.", labels=["state"]
        )
        workers.add_metric(["busy"], stats.workers_busy)
        workers.add_metric(["idle"], stats.workers_idle)
        yield workers
        yield CounterMetricFamily(
            "asteria_worker_restarts",
            "Worker processes replaced after a crash, a hung solve or a failed start.",
            value=stats.worker_restarts,
        )
        yield CounterMetricFamily(
            "asteria_results_discarded",
            "Results computed but dropped because a newer one of the block was already there.",
            value=stats.results_discarded,
        )
        yield _gauge(
            "asteria_queue_depth", "Snapshots queued for a worker, all tenants.", stats.queue_depth
        )
        by_state = GaugeMetricFamily(
            "asteria_blocks",
            "Blocks the daemon holds, by tenant and state (idle, queued, running, failed).",
            labels=["tenant", "state"],
        )
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for block in blocks:
            counts[(block.tenant, block.state.value)] += 1
        for (tenant, state), count in sorted(counts.items()):
            by_state.add_metric([tenant, state], count)
        yield by_state
        session_gauge = GaugeMetricFamily(
            "asteria_sessions", "Open sessions, by tenant.", labels=["tenant"]
        )
        for tenant, count in sorted(sessions.items()):
            session_gauge.add_metric([tenant], count)
        yield session_gauge
        yield _gauge(
            "asteria_shm_connections",
            "Clients connected to the shared-memory handover socket.",
            transport.shm_connections,
        )
        yield _gauge(
            "asteria_shm_segments",
            "Shared-memory segments clients handed over (each mapped in the daemon).",
            transport.shm_segments,
        )
        yield _gauge(
            "asteria_shm_mapped_bytes",
            "Bytes of the shared-memory segments mapped.",
            transport.shm_mapped_bytes,
        )
        yield _gauge(
            "asteria_upload_bytes_in_flight",
            "Snapshot bytes being received now (counted against max_upload_bytes).",
            transport.upload_bytes_in_flight,
        )
        yield _gauge(
            "asteria_upload_budget_bytes",
            "The daemon's max_upload_bytes.",
            transport.upload_budget_bytes,
        )
        yield CounterMetricFamily(
            "asteria_snapshots_received",
            "Snapshots received and handed to the engine.",
            value=transport.snapshots_received,
        )
        yield CounterMetricFamily(
            "asteria_snapshot_bytes_received",
            "Bytes of those snapshots (chunks, or announced in shared memory).",
            value=transport.snapshot_bytes_received,
        )
        yield _gauge(
            "asteria_uploads_waiting",
            "Uploads waiting for room in the upload budget.",
            transport.uploads_waiting,
        )
        steps: dict[str, list[float]] = defaultdict(list)
        seconds: dict[str, list[float]] = defaultdict(list)
        for block in blocks:
            steps[block.tenant].append(float(max(0, block.staleness_steps)))
            seconds[block.tenant].append(lag_seconds(block))
        yield _gauge_histogram(
            "asteria_block_lag_steps",
            "Blocks by lag in steps: newest submitted version minus newest computed one "
            "(a block never computed: its submitted version + 1).",
            steps,
            LAG_STEPS_BUCKETS,
        )
        yield _gauge_histogram(
            "asteria_block_lag_seconds",
            "Blocks by how long their newest snapshot has waited for its result (0: it has it).",
            seconds,
            LAG_SECONDS_BUCKETS,
        )
        yield from self._memory_families(stats, sources)
        yield from _refusal_families(sources)
        if self._peers is not None:
            yield from _peer_families(self._peers)

    def _memory_families(self, stats: EngineStats, sources: DaemonSources) -> Iterator[Metric]:
        """The memory budget and its use, the result cache's tiers, each worker's RSS."""
        held, budget = sources.memory_held_bytes(), sources.memory_budget_bytes
        yield _gauge(
            "asteria_memory_held_bytes",
            "Bytes the daemon holds for clients as max_memory_bytes counts them: queued "
            "snapshots, cached results, uploads, registrations, result streams.",
            held,
        )
        yield _gauge("asteria_memory_budget_bytes", "The daemon's max_memory_bytes.", budget)
        yield _gauge(
            "asteria_memory_budget_used_ratio",
            "asteria_memory_held_bytes / asteria_memory_budget_bytes (1: new blocks are refused).",
            held / budget if budget else 0.0,
        )
        if self._memory_limit_bytes is not None:
            yield _gauge(
                "asteria_memory_limit_bytes",
                "The memory limit of the daemon's cgroup (memory.max) it derived its defaults "
                "from; the daemon and its workers together must stay below it.",
                self._memory_limit_bytes,
            )
        cache = GaugeMetricFamily(
            "asteria_cache_bytes",
            "Result bytes of the cache by tier: host (daemon memory) and spill (files in "
            "spill_dir).",
            labels=["tier"],
        )
        cache.add_metric(["host"], stats.cache_host_bytes)
        cache.add_metric(["spill"], stats.spill_bytes)
        yield cache
        yield _gauge(
            "asteria_cache_budget_bytes",
            "The cache's host tier (cache_memory_bytes): results beyond it spill or are dropped.",
            stats.cache_budget_bytes,
        )
        yield _gauge(
            "asteria_spilled_results",
            "Results held in spill files now.",
            stats.results_spilled,
        )
        yield CounterMetricFamily(
            "asteria_cache_results_dropped",
            "Results that left the host tier with nowhere to spill (their clients resubmit).",
            value=stats.results_dropped,
        )
        rss = GaugeMetricFamily(
            "asteria_worker_resident_bytes",
            "Resident memory of each solver worker process (label: its slot, 0..workers-1).",
            labels=["worker"],
        )
        for worker in stats.workers:
            size = resident_bytes(worker.pid) if worker.pid else None
            if size is not None:
                rss.add_metric([str(worker.index)], size)
        yield rss


def _refusal_families(sources: DaemonSources) -> Iterator[Metric]:
    """Requests refused for a limit or quota, failed authentications, expired jobs."""
    refusals = CounterMetricFamily(
        "asteria_limit_refusals",
        "Requests refused for a limit or quota (RESOURCE_EXHAUSTED), by tenant and the setting "
        "that refused them (tenant_max_blocks, max_memory_bytes, ...; 'other' when none).",
        labels=["tenant", "limit"],
    )
    for (tenant, limit), count in sorted(sources.refusal_counts().items()):
        refusals.add_metric([tenant, limit], count)
    yield refusals
    auth = CounterMetricFamily(
        "asteria_auth_failures",
        "Failed authentications (wrong token), by tenant ('unknown': a tenant not configured).",
        labels=["tenant"],
    )
    for tenant, count in sorted(sources.auth_failures().items()):
        auth.add_metric([tenant], count)
    yield auth
    jobs, blocks = sources.expiry_counts()
    yield CounterMetricFamily(
        "asteria_jobs_expired",
        "Jobs whose blocks were forgotten job_ttl_s after their last session here ended.",
        value=jobs,
    )
    yield CounterMetricFamily(
        "asteria_blocks_expired",
        "Blocks forgotten so (their results and spill files with them).",
        value=blocks,
    )


def _peer_families(read: PeerGroups) -> Iterator[Metric]:
    """Peer groups summed per tenant (a job's groups are few, but labels stay per tenant)."""
    try:
        groups = read()
    except Exception as exc:  # a scrape must not fail for the sync's part: leave it out
        logger.warning("peer metrics left out of this scrape: %s", exc)
        return
    peers = GaugeMetricFamily(
        "asteria_peers",
        "Other daemons of this daemon's multi-node jobs, by tenant and state "
        "(alive, suspect, dead, unknown: never heard).",
        labels=["tenant", "state"],
    )
    lag_versions = GaugeMetricFamily(
        "asteria_peer_push_lag_versions",
        "The most versions a result still to push to a peer lags behind the newest one here.",
        labels=["tenant"],
    )
    lag_seconds = GaugeMetricFamily(
        "asteria_peer_push_lag_seconds",
        "Seconds since the oldest result still to push to a peer was computed.",
        labels=["tenant"],
    )
    bytes_total = CounterMetricFamily(
        "asteria_peer_bytes",
        "Result bytes pushed to (sent) and received from the other daemons of multi-node jobs.",
        labels=["tenant", "direction"],
    )
    results_total = CounterMetricFamily(
        "asteria_peer_results",
        "Results pushed to (sent) and received from the other daemons of multi-node jobs.",
        labels=["tenant", "direction"],
    )
    events = CounterMetricFamily(
        "asteria_peer_events",
        "Times a peer went suspect, was declared dead, or came back (rejoined).",
        labels=["tenant", "event"],
    )
    waiting = GaugeMetricFamily(
        "asteria_sync_waiting",
        "Snapshots here waiting for their owner's push now.",
        labels=["tenant"],
    )
    left = CounterMetricFamily(
        "asteria_sync_left_to_owner",
        "Snapshots not solved here because another daemon owns their block.",
        labels=["tenant"],
    )
    fallbacks = CounterMetricFamily(
        "asteria_sync_fallbacks",
        "Snapshots solved here although another daemon owns them (owner dead or not answering, "
        "daemons not agreed on the blocks): each may be a second solve of that version.",
        labels=["tenant"],
    )
    claims = CounterMetricFamily(
        "asteria_sync_claims",
        "Late versions claimed from their owner instead of solved twice: claims sent, granted "
        "to this daemon, and granted by it to others (handed_over).",
        labels=["tenant", "outcome"],
    )
    late = CounterMetricFamily(
        "asteria_sync_late_arrivals",
        "Pushed results that arrived after their staleness budget's deadline step.",
        labels=["tenant"],
    )
    by_tenant: dict[str, list[ppb.PeerGroup]] = defaultdict(list)
    for tenant, group in groups:
        by_tenant[tenant].append(group)
    for tenant, tenant_groups in sorted(by_tenant.items()):
        others = [p for g in tenant_groups for p in g.peers if p.state != "self"]
        for state in PEER_STATES:
            peers.add_metric([tenant, state], sum(p.state == state for p in others))
        lag_versions.add_metric([tenant], max((p.push_lag_versions for p in others), default=0))
        lag_seconds.add_metric([tenant], max((p.push_lag_s for p in others), default=0.0))
        bytes_total.add_metric([tenant, "sent"], sum(p.bytes_sent for p in others))
        bytes_total.add_metric([tenant, "received"], sum(p.bytes_received for p in others))
        results_total.add_metric([tenant, "sent"], sum(p.results_sent for p in others))
        results_total.add_metric([tenant, "received"], sum(p.results_received for p in others))
        for event in ("suspected", "died", "rejoined"):
            events.add_metric([tenant, event], sum(getattr(p, event) for p in others))
        waiting.add_metric([tenant], sum(g.waiting for g in tenant_groups))
        left.add_metric([tenant], sum(g.left_to_owner for g in tenant_groups))
        fallbacks.add_metric([tenant], sum(g.fallbacks for g in tenant_groups))
        claims.add_metric([tenant, "sent"], sum(g.claims_sent for g in tenant_groups))
        claims.add_metric([tenant, "granted"], sum(g.claims_granted for g in tenant_groups))
        claims.add_metric([tenant, "handed_over"], sum(g.claims_handed_over for g in tenant_groups))
        late.add_metric([tenant], sum(g.late_arrivals for g in tenant_groups))
    yield from (peers, lag_versions, lag_seconds, bytes_total, results_total, events)
    yield from (waiting, left, fallbacks, claims, late)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _gauge_histogram(
    name: str,
    documentation: str,
    values_by_tenant: Mapping[str, list[float]],
    bounds: Sequence[float],
) -> GaugeHistogramMetricFamily:
    family = GaugeHistogramMetricFamily(name, documentation, labels=["tenant"])
    for tenant, values in sorted(values_by_tenant.items()):
        values = sorted(values)
        buckets = [(floatToGoString(b), float(bisect.bisect_right(values, b))) for b in bounds]
        buckets.append(("+Inf", float(len(values))))
        family.add_metric([tenant], buckets, gsum_value=float(sum(values)))
    return family
