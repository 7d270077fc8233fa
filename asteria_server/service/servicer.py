"""The ``asteria.v1.Preconditioner`` gRPC servicer: protobuf in, engine call, protobuf out.

It is thin on purpose. Messages become Python values through ``protocol.convert`` only, failures
become statuses through ``protocol.errors`` only, and the work is the engine's. What it adds is
sessions: ``OpenSession`` authenticates a tenant (constant-time token comparison) and every later
call names its session, whose tenant namespaces every block it touches: a tenant never submits to,
streams from or sees the status of another tenant's blocks.

StreamResults is woken, never polled: the engine tells the servicer (from its dispatcher thread,
through ``loop.call_soon_threadsafe``) which tenant's block got a newer result, and the servicer
sets the asyncio.Event of each of that tenant's streams. A woken stream sends each subscribed
block's newest result once, holding at most one result at a time; an idle stream costs nothing.
A stream that asked for credit (a client refreshing continuously, which pulls snapshots instead
of pushing them) is also woken when workers start or finish, and sends a Credit message when
the daemon's free workers, its tenant's queued snapshots or its session's answered snapshots
changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import math
import sys
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from asteria_server.engine import PreconditionerEngine, SolveKind, SolveResult, SolveTask
from asteria_server.engine.engine import SUMMARY_WORST_BLOCKS
from asteria_server.errors import (
    AuthenticationError,
    DaemonBusyError,
    EngineUnavailableError,
    InvalidInputError,
    UnknownSessionError,
)
from asteria_server.protocol import convert, framing
from asteria_server.protocol.errors import abort_call, to_status
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc
from asteria_server.protocol.shm import SegmentRef, private_result, result_specs
from asteria_server.service.budget import UploadBudget
from asteria_server.service.expiry import JobExpiry
from asteria_server.service.handover import SegmentHandover
from asteria_server.service.limits import (
    AuthThrottle,
    QuotaRefusals,
    RefusalLog,
    Session,
    SessionTable,
    throttle_key,
)
from asteria_server.types import (
    MAX_VERSION,
    MAX_VERSION_JUMP,
    Credit,
    SharedArrays,
    SubmitOutcome,
    TransportStats,
)

logger = logging.getLogger(__name__)

#: The tenant of anonymous sessions (no tokens configured, Unix socket only).
ANONYMOUS_TENANT = "local"
#: What a block registration costs the daemon beyond its name's bytes (its table entry, the
#: name's object, the (n, kind) pair): counted in max_memory_bytes.
REGISTRATION_OVERHEAD_BYTES = 200
#: Blocks in one Status answer unless the request asks for fewer.
STATUS_PAGE_BLOCKS = 2_000
#: Blocks in one Status page of columns (``StatusRequest.columns``): about 100 bytes each on
#: the wire, so a page is about 200 KB and 160,000 blocks take 80 round trips. A page's build
#: shares the daemon's GIL with every client's traffic, so its size is what one Status call's
#: latency grows with: at 8 x 20,000 blocks while the clients trained, a 5,000-block page's p99
#: was 311 ms and a 2,000-block one's 54 ms (``asteria bench blocks``).
STATUS_COLUMN_PAGE_BLOCKS = 2_000
#: The most blocks a Status page of columns holds when the request asks for more than the
#: default (``max_blocks``): a full read (``asteria status --blocks``) takes the whole table
#: in a few pages; a call that asks for nothing in particular keeps the default's latency.
MAX_STATUS_COLUMN_PAGE_BLOCKS = 10_000
#: AnnounceSnapshots gives the event loop back after this many snapshots: a training process
#: of 20,000 blocks over shared memory announces them all in one call, and taking them in one
#: go held every other call (Status, other clients' sessions and streams) for seconds.
ANNOUNCE_YIELD_EVERY = 256
#: The most blocks a Status summary lists with their records.
MAX_SUMMARY_WORST_BLOCKS = 1_000
#: How to get past the block quota, said with it.
RAISE_BLOCKS = (
    "; raise it with asteria-server --tenant-max-blocks N (TOML tenant_max_blocks, env "
    "ASTERIA_TENANT_MAX_BLOCKS), or drop a finished job's blocks with asteria forget --job JOB"
)
#: Shared-memory copies larger than this run in a thread, off the event loop.
_COPY_IN_THREAD_BYTES = 4 << 20
#: Seconds before a stream looks again at a result that was overwritten while it copied it out.
_RETRY_COPY_S = 0.005
#: Looks at one overwritten result before a stream waits for news of the block instead (a
#: result whose segment holds something else for good: a solve that failed after writing, or
#: a result discarded as older; the next result of the block wakes the stream as usual).
_MAX_COPY_RETRIES = 40
#: Results in one batch message at most (``StreamResultsRequest.batch_results``): the stream
#: writes, and so lets the loop serve other calls, at least this often.
RESULT_BATCH_RESULTS = 256
#: A stream that batches lets the loop serve other calls after this many results, nearly as
#: often as one that wrote a message a result did: a round can hold every block of the tenant
#: (a stream that reconnects), and other calls must not wait for all of it. At 16, one of 8
#: clients of 20,000 blocks each (asteria bench blocks) saw a call pass its 10 s deadline.
RESULT_YIELD_EVERY = 4
#: After a batch (or a Credit message), a stream that batches waits this long before it sends
#: the next, so that results finishing in quick succession go out together instead of a
#: message each; news that comes to an idle stream goes at once. The added delay is at most
#: this, and only while news comes faster than once per this interval: then a stream writes
#: ~200 messages a second instead of one or two per result (8 replicas' streams at 1,000
#: results a second wrote 8,000, which kept the loop busy all the time).
RESULT_BATCH_WAIT_S = 0.005
#: A batch message's bytes at most (never more than the daemon's chunk_bytes either); a result
#: whose arrays take more goes as a header and chunks.
RESULT_BATCH_BYTES = 256 << 10
#: What refuses one snapshot (bad input, a lost session, an engine that cannot take it, a full
#: daemon): the call, or that snapshot's answer in AnnounceSnapshots, carries it as a status.
SNAPSHOT_REFUSALS = (
    InvalidInputError,
    UnknownSessionError,
    EngineUnavailableError,
    DaemonBusyError,
)


@dataclass(frozen=True)
class ServiceLimits:
    """What the servicer enforces and announces in ``OpenSession``."""

    chunk_bytes: int
    max_message_bytes: int
    max_matrix_n: int
    max_upload_bytes: int = 2 << 30
    upload_wait_s: float = 5.0
    max_memory_bytes: int = 1 << 62
    tenant_queued_bytes: int = 1 << 62
    tenant_cached_bytes: int = 1 << 62
    tenant_max_blocks: int = 100_000
    max_block_name_bytes: int = 1024
    tenant_max_sessions: int = 1024
    session_ttl_s: float = 300.0
    tenant_max_streams: int = 1024
    stream_stall_s: float = 60.0
    tenant_upload_share: float = 1.0
    upload_idle_s: float = 30.0
    upload_max_s: float = 300.0
    #: Status without a session shows no daemon-wide counts (a TCP daemon: others can reach it)
    private_status: bool = False
    #: a job's blocks are forgotten this long after its last session here ended (0: never)
    job_ttl_s: float = 0.0


#: What a draining daemon answers to new work (UNAVAILABLE: clients treat it as a daemon that
#: went away, keep their last results and resubmit to its successor or compute locally).
DRAINING = (
    "the daemon is shutting down: it finishes the solves it has (the drain) and takes no new "
    "sessions or snapshots; resubmit once it (or its replacement) serves again"
)


@dataclass(eq=False)
class _Stream:
    """One open StreamResults call: set ``wake`` when it has something to look at."""

    session_id: str
    wake: asyncio.Event
    #: it asked for Credit messages (StreamResultsRequest.credit)
    credit: bool = False
    #: it waits for news, having sent everything it had (a drain waits for this)
    waiting: bool = False
    tenant: str = ""
    #: the blocks it sends (empty: all of its tenant's), and the results epoch it has seen
    wanted: frozenset[str] = frozenset()
    epoch: int = -1


class _Entry:
    """One result as an entry of a batch. An entry that carries its arrays (copied out of
    another session's segment) is shared, read-only, by every stream that batches the same
    result meanwhile (a weak reference in the servicer's cache, as :class:`_Frames`)."""

    __slots__ = ("__weakref__", "batched", "size", "version")

    def __init__(self, version: int, batched: pb.BatchedResult) -> None:
        self.version = version
        self.batched = batched
        self.size = batched.ByteSize() + 8  # and its tag and length in the batch, generously


class _ResultBatch:
    """Results gathered into one StreamResults message: each message written costs the event
    loop ~0.1 ms of CPU in gRPC, about as much as finding, copying and describing a small
    result did, so a message a result (two with its chunk) was most of the daemon's cost."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: list[_Entry] = []
        self._bytes = 0
        #: entries added since the stream last let the loop serve other calls
        self.since_yield = 0

    def add(self, entry: _Entry) -> bytes | None:
        """Gather ``entry``; returns the batch to write first when it had no room left."""
        full = None
        if self._entries and (
            len(self._entries) >= RESULT_BATCH_RESULTS or self._bytes + entry.size > self.max_bytes
        ):
            full = self.take()
        self._entries.append(entry)
        self._bytes += entry.size
        self.since_yield += 1
        return full

    def take(self) -> bytes | None:
        """The gathered results as one message (None when there are none); starts anew."""
        if not self._entries:
            return None
        entries, self._entries, self._bytes = self._entries, [], 0
        batch = pb.ResultBatch(results=[entry.batched for entry in entries])
        return pb.StreamResultsResponse(batch=batch).SerializeToString()


class _Frames:
    """One result's StreamResults messages, serialized once and shared, read-only, by every
    stream that sends it (a weak reference in the servicer's cache: gone once none sends it)."""

    __slots__ = ("__weakref__", "messages", "version")

    def __init__(self, version: int, messages: tuple[bytes, ...]) -> None:
        self.version = version
        self.messages = messages


def _nbytes(result: SolveResult) -> int:
    """The bytes of ``result``'s arrays, wherever they lie."""
    return sum(spec.num_bytes for spec in result_specs(result))


def _serialize(message: pb.StreamResultsResponse | bytes) -> bytes:
    """StreamResults' response serializer: a frame already serialized passes as it is."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_servicer_to_server(servicer: PreconditionerServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` like the generated ``add_PreconditionerServicer_to_server``, except
    that StreamResults sends frames serialized once per result (:class:`_Frames`)."""
    handlers = {
        "OpenSession": grpc.unary_unary_rpc_method_handler(
            servicer.OpenSession,
            request_deserializer=pb.OpenSessionRequest.FromString,
            response_serializer=pb.OpenSessionResponse.SerializeToString,
        ),
        "CloseSession": grpc.unary_unary_rpc_method_handler(
            servicer.CloseSession,
            request_deserializer=pb.CloseSessionRequest.FromString,
            response_serializer=pb.CloseSessionResponse.SerializeToString,
        ),
        "RegisterBlocks": grpc.unary_unary_rpc_method_handler(
            servicer.RegisterBlocks,
            request_deserializer=pb.RegisterBlocksRequest.FromString,
            response_serializer=pb.RegisterBlocksResponse.SerializeToString,
        ),
        "SubmitSnapshot": grpc.stream_unary_rpc_method_handler(
            servicer.SubmitSnapshot,
            request_deserializer=pb.SubmitSnapshotRequest.FromString,
            response_serializer=pb.SubmitSnapshotResponse.SerializeToString,
        ),
        "AnnounceSnapshots": grpc.unary_unary_rpc_method_handler(
            servicer.AnnounceSnapshots,
            request_deserializer=pb.AnnounceSnapshotsRequest.FromString,
            response_serializer=pb.AnnounceSnapshotsResponse.SerializeToString,
        ),
        "StreamResults": grpc.unary_stream_rpc_method_handler(
            servicer.StreamResults,
            request_deserializer=pb.StreamResultsRequest.FromString,
            response_serializer=_serialize,
        ),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status,
            request_deserializer=pb.StatusRequest.FromString,
            response_serializer=pb.StatusResponse.SerializeToString,
        ),
    }
    name = pb.DESCRIPTOR.services_by_name["Preconditioner"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))


class Authenticator:
    """Checks a tenant's token in constant time; never logs or echoes a token."""

    def __init__(self, tokens: Mapping[str, str], *, allow_anonymous: bool) -> None:
        self._tokens = {t: tok.encode() for t, tok in tokens.items()}
        self._allow_anonymous = allow_anonymous

    def knows(self, tenant: str) -> bool:
        """Whether ``tenant`` is one this daemon has a token for (or its anonymous tenant): a
        metric label may name it; any other claimed name is ``unknown``."""
        if self._allow_anonymous:
            return tenant in ("", ANONYMOUS_TENANT)
        return tenant in self._tokens

    def label(self, tenant: str) -> str:
        """``tenant`` as a bounded metric label."""
        if self._allow_anonymous and tenant == "":
            return ANONYMOUS_TENANT
        return tenant if self.knows(tenant) else "unknown"

    @property
    def allows_anonymous(self) -> bool:
        """True when no tokens are configured (tenant ``local`` only)."""
        return self._allow_anonymous

    def tenant_of(self, tenant: str, token: str) -> str:
        """The authenticated tenant, or AuthenticationError."""
        if self._allow_anonymous:
            if tenant in ("", ANONYMOUS_TENANT) and token == "":
                return ANONYMOUS_TENANT
            raise AuthenticationError(
                f"this daemon has no tenant tokens configured and accepts only tenant "
                f"{ANONYMOUS_TENANT!r} with an empty token, not tenant {tenant!r}"
            )
        expected = self._tokens.get(tenant)
        # Compare against a stand-in for an unknown tenant so timing does not tell them apart.
        ok = hmac.compare_digest(token.encode(), expected if expected is not None else b"\0" * 32)
        if expected is None or not ok:
            raise AuthenticationError(
                f"unknown tenant or wrong token for tenant {tenant!r}; check the token the "
                "daemon's [tenants] table or ASTERIA_TOKENS holds for it"
            )
        return tenant


@functools.lru_cache(maxsize=1024)
def _spec_of(n: int, kind: SolveKind) -> tuple[int, SolveKind]:
    """The one ``(n, kind)`` tuple the registered blocks of that shape share."""
    return (n, kind)


def _registration_cost(block: str) -> int:
    return len(block.encode()) + REGISTRATION_OVERHEAD_BYTES


def _result_bytes(header: pb.SnapshotHeader) -> int:
    """About what a block's result takes in daemon memory: its float32 n x n matrix (twice for
    a refresh, which adds a rotation) and n eigenvalues or permutation entries."""
    n = header.n
    return 4 * n * n * (2 if header.has_basis else 1) + 16 * n


class PreconditionerServicer(pb_grpc.PreconditionerServicer):
    """``asteria.v1.Preconditioner`` over one :class:`PreconditionerEngine`."""

    def __init__(
        self,
        engine: PreconditionerEngine,
        authenticator: Authenticator,
        limits: ServiceLimits,
        *,
        max_sessions: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        handover: SegmentHandover | None = None,
    ) -> None:
        self._engine = engine
        self._auth = authenticator
        self._limits = limits
        self._max_sessions = max_sessions
        self._clock = clock
        self._sessions = SessionTable(
            max_sessions=max_sessions,
            tenant_max_sessions=limits.tenant_max_sessions,
            ttl_s=limits.session_ttl_s,
            incarnation_id=engine.incarnation_id,
            clock=clock,
            on_job_idle=self._job_idle,
            on_job_active=self._job_active,
        )
        self._reaper: asyncio.TimerHandle | None = None
        self._auth_throttle = AuthThrottle()
        self._refusals = RefusalLog(logger)
        #: refusals for a limit or quota, counted per tenant and limit, logged per tenant
        self.quota_refusals = QuotaRefusals(logger)
        #: failed authentications by tenant label (a configured tenant, or "unknown")
        self._auth_failures: dict[str, int] = {}
        #: jobs whose last session here ended: their blocks expire after job_ttl_s
        self._expiry = JobExpiry(limits.job_ttl_s)
        self._job_expiry: asyncio.TimerHandle | None = None
        #: jobs whose blocks expired (job_ttl_s), and those blocks
        self.jobs_expired = 0
        self.blocks_expired = 0
        #: set at shutdown: no new sessions, blocks or snapshots (see DRAINING)
        self.draining = False
        #: told (tenant, job) when CloseSession forgets a job's blocks (the job registry, the
        #: sync's peer group of the job)
        self.on_forget_job: Callable[[str, str], None] | None = None
        #: (tenant, block) -> the batch entry with arrays that result streams hold now
        self._entries: weakref.WeakValueDictionary[tuple[str, str], _Entry] = (
            weakref.WeakValueDictionary()
        )
        #: (tenant, block) -> the frames of the result streams are sending now
        self._frames: weakref.WeakValueDictionary[tuple[str, str], _Frames] = (
            weakref.WeakValueDictionary()
        )
        #: tenant -> blocks it submitted without registering them (they count in its quota)
        self._unregistered: dict[str, set[str]] = {}
        self._registered: dict[str, dict[str, tuple[int, SolveKind]]] = {}
        #: what the registrations cost in memory (REGISTRATION_OVERHEAD_BYTES + the name each)
        self._registration_bytes = 0
        self._stopping = False
        self._received = [0, 0]  # snapshots handed to the engine, and their bytes
        #: tenant -> its open StreamResults calls (touched on the event loop only)
        self._streams: dict[str, set[_Stream]] = {}
        #: of them, those that asked for Credit messages: at most one per session
        self._credit_streams: dict[str, _Stream] = {}
        self._credit_wake_due = False  # a wake of the credit streams is scheduled on the loop
        #: tenants whose streams' wake is scheduled on the loop (news of more results meanwhile
        #: needs no second one)
        self._result_wake_due: set[str] = set()
        #: session -> its snapshots answered so far (Credit.snapshots_answered)
        self._answered: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        engine.add_result_listener(self._on_result)
        engine.add_capacity_listener(self._on_capacity)
        self._handover = handover
        self._tickets = None if handover is None else handover.tickets
        #: where other nodes' daemons reach this one (its peer listener), told to every session
        self.peer_address = ""
        share = max(1, int(limits.max_upload_bytes * limits.tenant_upload_share))
        self._uploads = UploadBudget(limits.max_upload_bytes, share)

    @property
    def auth_throttle(self) -> AuthThrottle:
        """Failed authentications per peer host and tenant (the Peer service counts its own
        refused calls in it too, so one guesser meets one throttle at every door)."""
        return self._auth_throttle

    @property
    def uploads(self) -> UploadBudget:
        """The daemon's upload budget (peers' pushes hold their share of it too)."""
        return self._uploads

    def has_session(self, session_id: str) -> bool:
        """Whether ``session_id`` is open (the segment handover asks, from its threads)."""
        return session_id in self._sessions

    def session_tenant(self, session_id: str) -> str:
        """The tenant of an open session (UnknownSessionError otherwise): other services of
        the daemon authenticate their calls with the sessions opened here."""
        return self._session(session_id).tenant

    def tenant_of(self, session_id: str) -> str | None:
        """The tenant of an open session, or None (the segment handover asks, from its
        threads)."""
        session = self._sessions.peek(session_id)
        return None if session is None else session.tenant

    def touch(self, session_id: str) -> None:
        """Renew a session's lease: its client handed a segment over (from a handover thread,
        so on the event loop)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._sessions.touch, session_id)

    def job_sessions(self, tenant: str, job: str) -> int:
        """Open sessions of ``tenant`` that named ``job`` (the sync ends a job's peer group
        some time after the last one)."""
        return self._sessions.job_sessions(tenant, job)

    def sessions_by_tenant(self) -> dict[str, int]:
        """Open sessions per tenant (the metrics endpoint asks, from its own thread)."""
        counts: dict[str, int] = {}
        for session in self._sessions.values():  # one C-level copy: no GIL switch inside
            counts[session.tenant] = counts.get(session.tenant, 0) + 1
        return counts

    def start_draining(self) -> None:
        """Take no new sessions, block registrations or snapshots from now on (shutdown): the
        engine finishes what it has, and open result streams keep sending it."""
        self.draining = True

    def streams_idle(self) -> bool:
        """Whether every open result stream has sent all it had and waits for news (a drain
        ends when the engine is idle and this is true)."""
        if self._result_wake_due:
            return False
        for streams in self._streams.values():
            for stream in streams:
                if not stream.waiting or stream.wake.is_set():
                    return False
                news = self._engine.blocks_with_results_since(stream.epoch, stream.tenant)
                if any(not stream.wanted or block in stream.wanted for block in news):
                    return False  # results it has not looked at yet (its wake is on the way)
        return True

    def update(
        self, limits: ServiceLimits, authenticator: Authenticator, max_sessions: int
    ) -> None:
        """New limits and tokens (SIGHUP): calls from now on see them; sessions already open
        stay open, and what is held beyond a lowered limit stays until it is released."""
        self._limits = limits
        self._expiry.ttl_s = limits.job_ttl_s
        if self._job_expiry is not None:  # due sooner or later now
            self._job_expiry.cancel()
            self._job_expiry = None
        self._arm_job_expiry()
        self._auth = authenticator
        self._max_sessions = max_sessions
        self._sessions.max_sessions = max_sessions
        self._sessions.tenant_max_sessions = limits.tenant_max_sessions
        self._sessions.ttl_s = limits.session_ttl_s
        self._uploads.limit_bytes = limits.max_upload_bytes
        self._uploads.tenant_limit_bytes = max(
            1,
            min(limits.max_upload_bytes, int(limits.max_upload_bytes * limits.tenant_upload_share)),
        )

    def memory_held_bytes(self) -> int:
        """What the daemon holds for clients, as ``max_memory_bytes`` counts it."""
        return self._held_bytes()

    @property
    def memory_budget_bytes(self) -> int:
        return self._limits.max_memory_bytes

    def refusal_counts(self) -> dict[tuple[str, str], int]:
        """Refusals for a limit or quota so far, by (tenant, limit) (for the metrics)."""
        return self.quota_refusals.counts()

    def expiry_counts(self) -> tuple[int, int]:
        """Jobs expired (job_ttl_s) and their blocks forgotten so far."""
        return self.jobs_expired, self.blocks_expired

    def auth_failures(self) -> dict[str, int]:
        """Failed authentications so far by tenant label (a copy, for the metrics)."""
        return dict(self._auth_failures)

    def count_auth_failure(self, tenant: str) -> None:
        """One failed authentication claiming ``tenant`` (here, or at the Peer service)."""
        self._auth_failed(tenant)

    def _auth_failed(self, tenant: str) -> None:
        label = self._auth.label(tenant)
        self._auth_failures[label] = self._auth_failures.get(label, 0) + 1

    def count_refusal(self, tenant: str, exc: BaseException) -> None:
        """A request of ``tenant`` (a bounded label) was refused: count a DaemonBusyError, the
        error of every limit and quota, and log it (rate-limited)."""
        if isinstance(exc, DaemonBusyError):
            self.quota_refusals.refused(tenant, str(exc))

    # ------------------------------------------------------------------ job expiry

    def _job_idle(self, tenant: str, job: str) -> None:
        """The job's last session here ended (SessionTable): its blocks expire after
        ``job_ttl_s`` unless a session of it opens again."""
        self._expiry.idle((tenant, job), self._clock())
        self._arm_job_expiry()

    def _job_active(self, tenant: str, job: str) -> None:
        self._expiry.active((tenant, job))

    def _arm_job_expiry(self) -> None:
        loop, at = self._loop, self._expiry.next_due()
        if loop is None or self._job_expiry is not None or at is None:
            return
        self._job_expiry = loop.call_later(max(0.0, at - self._clock()) + 0.05, self._expire_jobs)

    def _expire_jobs(self) -> None:
        self._job_expiry = None
        for tenant, job in self._expiry.due(self._clock()):
            if self._sessions.job_sessions(tenant, job) > 0 or self._stopping:
                continue
            blocks = self.forget_job(tenant, job)
            self.jobs_expired += 1
            self.blocks_expired += len(blocks)
            logger.info(
                "job %r of tenant %r expired: no session of it for %g s (job_ttl_s); forgot its "
                "%d blocks and their results",
                job,
                tenant,
                self._expiry.ttl_s,
                len(blocks),
                extra={"tenant": tenant, "job": job},
            )
        self._arm_job_expiry()

    def forget_job(self, tenant: str, job: str) -> list[str]:
        """Forget every block of ``tenant``'s ``job`` (versions, queued snapshots, cached and
        spilled results, registrations) and its entry in the job registry; returns the
        blocks."""
        registered = self._registered.get(tenant, {})
        unregistered = self._unregistered.get(tenant, set())
        blocks = self._engine.forget(tenant, job)
        for block in blocks:
            if registered.pop(block, None) is not None:
                self._registration_bytes -= _registration_cost(block)
            unregistered.discard(block)
        if self.on_forget_job is not None:  # ... and its entry in the job registry
            self.on_forget_job(tenant, job)
        return blocks

    def stop_streams(self) -> None:
        """End every StreamResults stream now (daemon shutdown; on the event loop)."""
        self._stopping = True
        if self._job_expiry is not None:
            self._job_expiry.cancel()
            self._job_expiry = None
        self._engine.remove_result_listener(self._on_result)
        self._engine.remove_capacity_listener(self._on_capacity)
        self._wake(lambda stream: True)

    def _on_result(self, tenant: str, block: str, version: int | None) -> None:
        """The engine's news of a newer result (its dispatcher thread): wake the tenant's
        streams on the event loop."""
        loop = self._loop
        if loop is not None and tenant in self._streams and tenant not in self._result_wake_due:
            # The wake runs after this check, which follows the result's booking: a result
            # that finds a wake due is seen by it (the wake first clears the tenant here).
            self._result_wake_due.add(tenant)
            try:
                loop.call_soon_threadsafe(self._wake_tenant, tenant)
            except RuntimeError:  # the loop closed: nobody is listening
                self._result_wake_due.discard(tenant)

    def _on_capacity(self) -> None:
        """Workers started or finished (the dispatcher thread): streams that report credit
        look again; nothing is scheduled while none does."""
        loop = self._loop
        if loop is not None and self._credit_streams and not self._credit_wake_due:
            # One wake pass however many solves started or ended before it runs (a benign
            # race on the flag costs at most one extra pass).
            self._credit_wake_due = True
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(self._wake_credit_streams)

    def _wake_credit_streams(self) -> None:
        self._credit_wake_due = False
        for stream in self._credit_streams.values():
            stream.wake.set()

    def _wake_tenant(self, tenant: str) -> None:
        self._result_wake_due.discard(tenant)
        for stream in self._streams.get(tenant, ()):
            stream.wake.set()

    def _wake(self, which: Callable[[_Stream], bool]) -> None:
        for streams in self._streams.values():
            for stream in streams:
                if which(stream):
                    stream.wake.set()

    def _wake_session(self, session_id: str) -> None:
        """The session ended: its streams see that and end."""
        self._wake(lambda stream: stream.session_id == session_id)

    # ------------------------------------------------------------------ sessions

    def _session(self, session_id: str) -> Session:
        """The open session (its lease renewed), or UnknownSessionError saying why not."""
        try:
            return self._sessions.get(session_id)
        except UnknownSessionError:
            self._ended(session_id)  # it may have just expired: its handover goes too
            raise

    def _ended(self, session_id: str) -> None:
        """A session ended (closed, expired): its streams end, its handover is closed."""
        self._answered.pop(session_id, None)
        self._wake_session(session_id)
        if self._handover is not None:
            self._handover.drop_session(session_id)

    def _arm_reaper(self) -> None:
        """Expire idle sessions when the earliest lease runs out (no timer while none can)."""
        loop = self._loop
        if loop is None or self._reaper is not None:
            return
        at = self._sessions.next_expiry()
        if at is not None:
            delay = max(0.0, at - self._clock()) + 0.05
            self._reaper = loop.call_later(delay, self._reap)

    def _reap(self) -> None:
        self._reaper = None
        for session in self._sessions.reap():
            self._expired(session)
        self._arm_reaper()

    def _expired(self, session: Session) -> None:
        logger.info(
            "session of tenant %r job %r expired (no call for %g s)",
            session.tenant,
            session.job,
            self._limits.session_ttl_s,
            extra={"tenant": session.tenant, "job": session.job},
        )
        self._ended(session.session_id)

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OpenSessionResponse:
        self._loop = asyncio.get_running_loop()
        # Failures are counted per caller (its host over TCP, its process over the Unix socket:
        # see CallerTickets) and claimed tenant: guessing one tenant's token never locks out
        # another tenant, nor the claimed tenant's own processes.
        caller = throttle_key(context.peer() or "", request.caller_ticket, self._tickets)
        peer = f"{caller} for tenant {request.tenant[:64]!r}"
        try:
            if self.draining:
                raise EngineUnavailableError(DRAINING)
            self._auth_throttle.check(peer)
            try:
                tenant = self._auth.tenant_of(request.tenant, request.token)
            except AuthenticationError:
                self._auth_throttle.failed(peer)
                self._auth_failed(request.tenant)
                logger.warning(
                    "refused a session for tenant %r: wrong token",
                    request.tenant,
                    extra={"tenant": request.tenant, "job": request.job},
                )
                raise
            for expired in self._sessions.reap():  # their room first
                self._expired(expired)
            session = Session(uuid.uuid4().hex, tenant, request.job, request.rank, self._clock())
            self._sessions.open(session)
        except (AuthenticationError, DaemonBusyError, EngineUnavailableError) as exc:
            self.count_refusal(self._auth.label(request.tenant), exc)
            await abort_call(context, exc)
        self._arm_reaper()
        logger.info(
            "session opened: tenant %r job %r rank %d",
            tenant,
            request.job,
            request.rank,
            extra={"tenant": tenant, "job": request.job, "rank": request.rank},
        )
        return pb.OpenSessionResponse(
            session_id=session.session_id,
            incarnation_id=self._engine.incarnation_id,
            limits=pb.ServerLimits(
                max_chunk_bytes=self._limits.chunk_bytes,
                max_message_bytes=self._limits.max_message_bytes,
                max_matrix_n=self._limits.max_matrix_n,
            ),
            shm_socket="" if self._handover is None else str(self._handover.path),
            peer_address=self.peer_address,
        )

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CloseSessionResponse:
        # Guesses (of a session's token, or of session ids) are throttled as OpenSession's are,
        # per caller and the tenant of the session named (or "session ids" for unknown ones).
        host = throttle_key(context.peer() or "", request.caller_ticket, self._tickets)
        named = self._sessions.peek(request.session_id)
        key = f"{host} for " + ("session ids" if named is None else f"tenant {named.tenant!r}")
        try:
            self._auth_throttle.check(key)
            try:
                session = self._session(request.session_id)
                if not self._auth.allows_anonymous:
                    # A session id alone does not end a session: its tenant's token must come too.
                    self._auth.tenant_of(session.tenant, request.token)
            except (UnknownSessionError, AuthenticationError) as exc:
                self._auth_throttle.failed(key)
                if isinstance(exc, AuthenticationError) and named is not None:
                    self._auth_failed(named.tenant)
                self._refusals.refused("CloseSession", f"from {key}: {type(exc).__name__}")
                raise
        except (
            UnknownSessionError,
            InvalidInputError,
            AuthenticationError,
            DaemonBusyError,
        ) as exc:
            await abort_call(context, exc)
        self._sessions.end(request.session_id, "was closed by CloseSession")
        self._ended(request.session_id)
        if request.forget_blocks:  # the session's job: its blocks, results and spill files
            self.forget_job(session.tenant, session.job)
        return pb.CloseSessionResponse()

    async def RegisterBlocks(
        self, request: pb.RegisterBlocksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterBlocksResponse:
        session = None
        try:
            if self.draining:
                raise EngineUnavailableError(DRAINING)
            session = self._session(request.session_id)
            known = self._registered.setdefault(session.tenant, {})
            specs: dict[str, tuple[int, SolveKind]] = {}
            for spec in request.blocks:
                what = f"RegisterBlocks: block {spec.block!r}"
                self._check_name(spec.block, "RegisterBlocks")
                if spec.block in specs:
                    raise InvalidInputError(f"{what} is named twice")
                if not 1 <= spec.n <= self._limits.max_matrix_n:
                    raise InvalidInputError(
                        f"{what}: n must be between 1 and {self._limits.max_matrix_n}, got {spec.n}"
                    )
                kind = convert.kind_from_proto(spec.kind, what=what)
                old = known.get(spec.block)
                if old is not None and old != (spec.n, kind):
                    raise InvalidInputError(
                        f"{what} was registered as n={old[0]} {old[1].name}, now n={spec.n} "
                        f"{kind.name}; use a new block name for a different shape or kind"
                    )
                # Kept as long as the block: its name interned (one string with the engine's and
                # the handover's), its shape one tuple per (n, kind), not a copy of each a block.
                specs[sys.intern(spec.block)] = _spec_of(spec.n, kind)
            new = [b for b in specs if b not in known]
            unregistered = self._unregistered.get(session.tenant, set())
            held = len(known) + len(unregistered)
            added = sum(1 for b in new if b not in unregistered)
            quota = self._limits.tenant_max_blocks
            if held + added > quota:
                raise DaemonBusyError(
                    f"RegisterBlocks: tenant {session.tenant!r} has {held} blocks and {added} "
                    f"new would exceed its quota of {quota} (tenant_max_blocks){RAISE_BLOCKS}"
                )
            cost = sum(_registration_cost(b) for b in new)
            held_bytes = self._held_bytes()
            if cost and held_bytes + cost > self._limits.max_memory_bytes:
                raise DaemonBusyError(
                    f"RegisterBlocks: {len(new)} new blocks need {cost} bytes of daemon memory; "
                    f"the daemon holds {held_bytes} of its max_memory_bytes "
                    f"({self._limits.max_memory_bytes}); register fewer blocks or forget old ones"
                )
            self._registration_bytes += cost
            known.update(specs)
            unregistered.difference_update(specs)
        except (
            UnknownSessionError,
            InvalidInputError,
            DaemonBusyError,
            EngineUnavailableError,
        ) as exc:
            if session is not None:
                self.count_refusal(session.tenant, exc)
            await abort_call(context, exc)
        return pb.RegisterBlocksResponse(num_new=len(new), num_known=len(specs) - len(new))

    # ------------------------------------------------------------------ snapshots

    async def SubmitSnapshot(
        self,
        request_iterator: AsyncIterator[pb.SubmitSnapshotRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.SubmitSnapshotResponse:
        answering = ""  # the session, once known: its answers are counted for its credit
        tenant = ""
        try:
            if self.draining:
                raise EngineUnavailableError(DRAINING)
            first = await anext(request_iterator, None)
            if first is None:
                raise InvalidInputError("SubmitSnapshot stream: no messages (expected a header)")
            receiver = framing.SnapshotReceiver(
                first,
                max_chunk_bytes=self._limits.chunk_bytes,
                max_matrix_n=self._limits.max_matrix_n,
            )
            session = self._session(receiver.session_id)
            answering, tenant = session.session_id, session.tenant
            num_bytes = sum(spec.num_bytes for spec in receiver.specs)
            upload = 0 if receiver.shm else num_bytes
            what = self._admit(session, receiver.header, "SubmitSnapshot", upload)
            started = self._clock()
            async with self._uploads.hold(
                num_bytes, wait_s=self._upload_wait_s(context), what=what, tenant=session.tenant
            ):
                while (
                    message := await self._next_chunk(request_iterator, started, what)
                ) is not None:
                    receiver.feed(message)
                task: SolveTask | None
                if receiver.shm is None:
                    task = receiver.finish(tenant=session.tenant)
                else:
                    task = await self._from_segment(receiver, session)
            outcome = self._queue(session, task, num_bytes)
        except SNAPSHOT_REFUSALS as exc:
            self._count_answer(answering)
            if tenant:
                self.count_refusal(tenant, exc)
            await abort_call(context, exc)
        self._count_answer(answering)
        return convert.outcome_to_proto(outcome)

    async def AnnounceSnapshots(
        self, request: pb.AnnounceSnapshotsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AnnounceSnapshotsResponse:
        """Many snapshots announced in the session's segments, each checked and queued as its
        own SubmitSnapshot would be (nothing is uploaded, so no upload budget is held), each
        with its own answer: one refused snapshot does not fail the others."""
        try:
            session = self._session(request.session_id)
            if len(request.snapshots) > self._limits.tenant_max_blocks:
                raise InvalidInputError(
                    f"AnnounceSnapshots: {len(request.snapshots)} snapshots in one call, more than "
                    f"the tenant's block quota ({self._limits.tenant_max_blocks})"
                )
            for header in request.snapshots:
                if header.session_id not in ("", request.session_id):
                    raise InvalidInputError(
                        "AnnounceSnapshots: every snapshot must belong to the call's session"
                    )
                if not header.HasField("shm"):
                    raise InvalidInputError(
                        f"AnnounceSnapshots: block {header.block!r} names no shared-memory "
                        "segment; send its bytes with SubmitSnapshot"
                    )
        except (InvalidInputError, UnknownSessionError) as exc:
            await abort_call(context, exc)
        answers = []
        for i, header in enumerate(request.snapshots):
            if i and i % ANNOUNCE_YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let the loop serve the other calls
            try:
                if self.draining:
                    raise EngineUnavailableError(DRAINING)
                outcome = await self._announce_one(session, header)
            except SNAPSHOT_REFUSALS as exc:
                self.count_refusal(session.tenant, exc)
                code, message = to_status(exc)
                answers.append(pb.AnnouncedSnapshot(error_code=code.value[0], error=message))
                continue
            finally:
                self._count_answer(session.session_id)
            answers.append(convert.announced_to_proto(outcome))
        return pb.AnnounceSnapshotsResponse(snapshots=answers)

    async def _announce_one(self, session: Session, header: pb.SnapshotHeader) -> SubmitOutcome:
        """One announced snapshot, as :meth:`SubmitSnapshot` takes one in a segment."""
        if not header.session_id:
            header.session_id = session.session_id
        receiver = framing.SnapshotReceiver(
            pb.SubmitSnapshotRequest(header=header),
            max_chunk_bytes=self._limits.chunk_bytes,
            max_matrix_n=self._limits.max_matrix_n,
        )
        self._admit(session, header, "AnnounceSnapshots", 0)
        task = await self._from_segment(receiver, session)
        return self._queue(session, task, sum(spec.num_bytes for spec in receiver.specs))

    def _admit(
        self, session: Session, header: pb.SnapshotHeader, call: str, upload_bytes: int
    ) -> str:
        """Check one snapshot's block name, registration and the tenant's quotas (``upload_bytes``
        to come over the call); returns how errors name it. Raises as SubmitSnapshot does."""
        self._check_name(header.block, call)
        self._check_registered(session.tenant, header)
        what = f"{call} of block {header.block!r}"
        self._check_quotas(session.tenant, header, upload_bytes, what)
        return what

    def _count_answer(self, session_id: str) -> None:
        """One more snapshot of the session answered. Counted right after the engine took it,
        with no await between, so a Credit message sees both or neither."""
        if session_id and session_id in self._sessions:
            self._answered[session_id] = self._answered.get(session_id, 0) + 1

    def _queue(self, session: Session, task: SolveTask | None, num_bytes: int) -> SubmitOutcome:
        """Count a received snapshot and hand it to the engine; None: the client already wrote a
        newer snapshot over this one."""
        if task is None:
            return SubmitOutcome.STALE_IGNORED
        self._received[0] += 1
        self._received[1] += num_bytes
        return self._engine.submit(task, job=session.job)

    async def _next_chunk(
        self, messages: AsyncIterator[pb.SubmitSnapshotRequest], started: float, what: str
    ) -> pb.SubmitSnapshotRequest | None:
        """The upload's next message (None at its end), within ``upload_idle_s`` of the last one
        and ``upload_max_s`` of its start: a stalled upload does not hold the budget."""
        limits = self._limits
        left = limits.upload_max_s - (self._clock() - started)
        wait = min(limits.upload_idle_s, left)
        try:
            async with asyncio.timeout(max(0.0, wait)):  # no task per chunk, unlike wait_for
                return await anext(messages, None)
        except TimeoutError:
            if wait < limits.upload_idle_s:
                why = f"took longer than {limits.upload_max_s:g} s (upload_max_s)"
            else:
                why = f"sent nothing for {limits.upload_idle_s:g} s (upload_idle_s)"
            raise DaemonBusyError(
                f"{what}: the upload {why}; the daemon dropped it and freed its share of the "
                "upload budget; send the next snapshot"
            ) from None

    def _check_name(self, block: str, call: str) -> None:
        if not block:
            raise InvalidInputError(f"{call}: every block needs a non-empty name")
        size = len(block.encode())
        if size > self._limits.max_block_name_bytes:
            raise InvalidInputError(
                f"{call}: block name {block[:64]!r}... is {size} bytes, longer than the "
                f"daemon's max_block_name_bytes ({self._limits.max_block_name_bytes})"
            )

    def _check_quotas(
        self, tenant: str, header: pb.SnapshotHeader, upload_bytes: int, what: str
    ) -> None:
        """Refuse a snapshot the tenant's quotas or the daemon's memory budget have no room
        for (before anything is received), naming the limit."""
        limits = self._limits
        if not 0 <= header.version <= MAX_VERSION:
            raise InvalidInputError(f"{what}: version {header.version} is not in 0..{MAX_VERSION}")
        known, submitted = self._engine.block_versions(header.block, tenant)
        if submitted >= 0 and header.version - submitted > MAX_VERSION_JUMP:
            raise InvalidInputError(
                f"{what}: version {header.version} jumps more than {MAX_VERSION_JUMP} past the "
                f"block's newest version {submitted}; versions are optimizer steps"
            )
        registered = self._registered.get(tenant, {})
        unregistered = self._unregistered.setdefault(tenant, set())
        if header.block not in registered and header.block not in unregistered:
            held = len(registered) + len(unregistered)
            if held >= limits.tenant_max_blocks:
                raise DaemonBusyError(
                    f"{what}: tenant {tenant!r} has {held} blocks, its quota "
                    f"(tenant_max_blocks = {limits.tenant_max_blocks}){RAISE_BLOCKS}"
                )
            counted = header.block
        else:
            counted = None
        usage = self._engine.usage(tenant)
        if upload_bytes and usage.queued_bytes + upload_bytes > limits.tenant_queued_bytes:
            raise DaemonBusyError(
                f"{what}: tenant {tenant!r} has {usage.queued_bytes} snapshot bytes queued in "
                f"daemon memory; {upload_bytes} more would exceed its quota of "
                f"{limits.tenant_queued_bytes} (tenant_queued_bytes); send the next snapshot "
                "once results come back"
            )
        result_bytes = 0 if known else _result_bytes(header)
        if result_bytes and usage.cached_bytes + result_bytes > limits.tenant_cached_bytes:
            raise DaemonBusyError(
                f"{what}: tenant {tenant!r} has {usage.cached_bytes} result bytes cached in "
                f"daemon memory; a new block's {result_bytes} would exceed its quota of "
                f"{limits.tenant_cached_bytes} (tenant_cached_bytes); forget blocks or use fewer"
            )
        if upload_bytes or result_bytes:
            held = self._held_bytes()
            if held + upload_bytes + result_bytes > limits.max_memory_bytes:
                raise DaemonBusyError(
                    f"{what}: the daemon holds {held} bytes of snapshots, results, uploads, "
                    "registrations and result streams; "
                    f"{upload_bytes + result_bytes} more would exceed its max_memory_bytes "
                    f"({limits.max_memory_bytes}); send the next snapshot later"
                )
        if counted is not None:
            unregistered.add(counted)

    def _held_bytes(self) -> int:
        """What the daemon holds for clients, as ``max_memory_bytes`` counts it: queued
        snapshots and cached results (the engine's), uploads being received (clients' and
        peers'), block registrations, and a chunk in flight per open result stream (what a
        stream its client does not read keeps in the transport)."""
        total = self._engine.usage()
        streams = sum(len(s) for s in self._streams.values())
        return (
            total.queued_bytes
            + total.cached_bytes
            + self._uploads.in_use_bytes
            + self._registration_bytes
            + streams * self._limits.chunk_bytes
        )

    def _upload_wait_s(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        """How long an upload may wait for room: the configured wait, within its deadline."""
        remaining = context.time_remaining()
        if remaining is None:
            return self._limits.upload_wait_s
        return max(0.0, min(self._limits.upload_wait_s, 0.8 * remaining))

    async def _from_segment(
        self, receiver: framing.SnapshotReceiver, session: Session
    ) -> SolveTask | None:
        """The task of a snapshot announced in shared memory, *not copied*: its arrays lie in
        the session's segment, which the solver worker reads itself (under the seqlock; the
        task carries stand-ins of their dtypes and shapes, :meth:`Segment.stand_ins`), and its
        result goes to the session's result segment of the block, if there is one. None when a
        newer write already replaced it (a cheap look at the sequence word)."""
        if self._handover is None:
            raise InvalidInputError("this daemon offers no shared memory; send chunks instead")
        ref = receiver.shm
        assert ref is not None
        segment = self._handover.segment(session.session_id, ref.segment_id)
        views = segment.stand_ins(receiver.specs)  # InvalidInputError: does not fit it
        if segment.sequence != ref.sequence:
            return None
        found = self._handover.result_segment(session.session_id, receiver.header.block)
        return receiver.task_from(
            views,
            tenant=session.tenant,
            shm_source=SharedArrays(segment, sequence=ref.sequence),
            shm_result=None if found is None else SharedArrays(found[1], found[0]),
        )

    def _check_registered(self, tenant: str, header: pb.SnapshotHeader) -> None:
        spec = self._registered.get(tenant, {}).get(header.block)
        if spec is None:
            return  # registration is optional
        n, kind = spec
        sent = convert.kind_from_proto(header.kind, what=f"block {header.block!r}")
        if header.n != n or sent is not kind:
            raise InvalidInputError(
                f"SubmitSnapshot of block {header.block!r}: it was registered as n={n} "
                f"{kind.name}, the snapshot is n={header.n} {sent.name}"
            )

    # ------------------------------------------------------------------ results

    async def StreamResults(  # type: ignore[override]  # writes instead of yielding
        self, request: pb.StreamResultsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Writes (``context.write``) rather than yields, so a write the client does not read
        is bounded by ``stream_stall_s``; results go out as frames serialized once per result
        and shared by every stream that sends them."""
        try:
            session = self._session(request.session_id)
            tenant = session.tenant
            open_streams = len(self._streams.get(tenant, ()))
            if open_streams >= self._limits.tenant_max_streams:
                raise DaemonBusyError(
                    f"tenant {tenant!r} holds {open_streams} open result streams "
                    f"(tenant_max_streams = {self._limits.tenant_max_streams}); a session needs "
                    "one: cancel the streams it no longer reads"
                )
            if request.credit and session.session_id in self._credit_streams:
                raise DaemonBusyError(
                    "this session already receives credit on another result stream; a session "
                    "gets Credit messages on one stream at a time"
                )
            held_bytes = self._held_bytes()
            if held_bytes + self._limits.chunk_bytes > self._limits.max_memory_bytes:
                raise DaemonBusyError(
                    f"StreamResults: the daemon holds {held_bytes} bytes of snapshots, results, "
                    "uploads, registrations and result streams; one more stream (a chunk of "
                    f"{self._limits.chunk_bytes} bytes in flight) would exceed its "
                    f"max_memory_bytes ({self._limits.max_memory_bytes}); cancel the streams "
                    "it no longer reads"
                )
        except (UnknownSessionError, DaemonBusyError) as exc:
            if isinstance(exc, DaemonBusyError):
                self.count_refusal(session.tenant, exc)
            await abort_call(context, exc)
        wanted = set(request.blocks)
        sent: dict[str, int] = dict(request.held_versions)
        epoch = -1
        retry: set[str] = set()  # blocks whose copy-out found the result overwritten
        #: block -> (version, its copies rejected so far)
        failed_copies: dict[str, tuple[int, int]] = {}
        loop = self._loop = asyncio.get_running_loop()
        stream = _Stream(
            session.session_id,
            asyncio.Event(),
            credit=request.credit,
            tenant=tenant,
            wanted=frozenset(wanted),
        )
        self._streams.setdefault(tenant, set()).add(stream)
        if stream.credit:
            self._credit_streams[session.session_id] = stream
        self._sessions.stream_started(session.session_id)
        last_credit: Credit | None = None
        ended: BaseException | None = None
        batch = (
            _ResultBatch(min(RESULT_BATCH_BYTES, self._limits.chunk_bytes))
            if request.batch_results
            else None
        )
        last_sent = -math.inf  # when this stream last sent news (loop time)
        try:
            while not self._stopping and session.session_id in self._sessions:
                stream.wake.clear()  # news from now on wakes the wait below
                now_epoch = self._engine.results_epoch
                if now_epoch != epoch or retry:
                    wait = last_sent + RESULT_BATCH_WAIT_S - loop.time()
                    if batch is not None and wait > 0:  # news soon after the last: gather more
                        await asyncio.sleep(wait)
                        stream.wake.clear()
                        now_epoch = self._engine.results_epoch
                    changed = self._engine.blocks_with_results_since(epoch, tenant)
                    epoch = stream.epoch = now_epoch
                    chosen = set(b for b in changed if b in wanted) if wanted else set(changed)
                    chosen |= retry
                    retry = set()
                    for block in sorted(chosen):
                        result = self._engine.latest_result(
                            block, tenant, newer_than=sent.get(block, -1)
                        )
                        if result is None:
                            continue
                        entry = sending = None
                        if batch is not None:
                            if batch.since_yield >= RESULT_YIELD_EVERY:
                                batch.since_yield = 0
                                await asyncio.sleep(0)  # let the loop serve the other calls
                            # one another stream copied out and still holds, if any
                            entry = self._shared_entry(
                                session.session_id, result, request.shm_results
                            )
                        if entry is None:
                            sending = await self._to_send(
                                session.session_id, result, request.shm_results
                            )
                        if entry is None and sending is None:
                            # Overwritten while copied out (another replica's segment): look
                            # again shortly, whether or not a newer result is announced, a
                            # bounded number of times.
                            version, count = failed_copies.get(block, (result.version, 0))
                            count = count + 1 if version == result.version else 1
                            failed_copies[block] = (result.version, count)
                            if count <= _MAX_COPY_RETRIES:
                                retry.add(block)
                                loop.call_later(_RETRY_COPY_S, stream.wake.set)
                            continue
                        failed_copies.pop(block, None)
                        sent[block] = result.version
                        if batch is not None and entry is None and sending is not None:
                            entry = self._entry_of(*sending, max_inline=batch.max_bytes // 2)
                        if batch is not None and entry is not None:
                            result = sending = None  # hold no client's segment while idle
                            full = batch.add(entry)
                            if full is not None:
                                await self._write(context, full)
                            continue
                        assert sending is not None
                        if batch is not None and (gathered := batch.take()) is not None:
                            await self._write(context, gathered)  # in the order taken
                        frames = await self._frames_of(sending[0], sending[1])
                        result = sending = None  # hold no client's segment while idle
                        for frame in frames.messages:
                            await self._write(context, frame)
                        del frames
                    if batch is not None and (gathered := batch.take()) is not None:
                        await self._write(context, gathered)
                    if chosen:
                        last_sent = loop.time()
                    continue  # results may have come while this stream was sending
                if stream.credit:
                    credit = self._credit_of(session.session_id, tenant)
                    if credit != last_credit:
                        wait = last_sent + RESULT_BATCH_WAIT_S - loop.time()
                        if batch is not None and wait > 0:  # credit changes with every solve
                            await asyncio.sleep(wait)
                            continue  # then the news of both kinds gathered meanwhile
                        frame = convert.credit_to_proto(credit).SerializeToString()
                        await self._write(context, frame)
                        last_credit = credit
                        last_sent = loop.time()
                        continue  # news may have come while this stream was sending
                stream.waiting = True
                try:
                    await stream.wake.wait()
                finally:
                    stream.waiting = False
            if not self._stopping and session.session_id not in self._sessions:
                try:
                    self._sessions.get(session.session_id)
                except UnknownSessionError as exc:
                    ended = exc  # closed or expired: the stream says so, not OK
        except DaemonBusyError as exc:
            ended = exc
            self.count_refusal(tenant, exc)
        finally:
            if stream.credit:
                del self._credit_streams[session.session_id]
            streams = self._streams.get(tenant)
            if streams is not None:
                streams.discard(stream)
                if not streams:
                    del self._streams[tenant]
            self._sessions.stream_ended(session.session_id)
            self._arm_reaper()
        if ended is not None:
            await abort_call(context, ended)

    def _credit_of(self, session_id: str, tenant: str) -> Credit:
        """What a Credit message tells the session now."""
        idle, queued = self._engine.capacity(tenant)
        answered = self._answered.get(session_id, 0)
        return Credit(workers_idle=idle, queued=queued, snapshots_answered=answered)

    async def _write(self, context: grpc.aio.ServicerContext[Any, Any], frame: bytes) -> None:
        """Send one frame; DaemonBusyError when the client has not read for stream_stall_s."""
        stall_s = self._limits.stream_stall_s
        try:
            async with asyncio.timeout(stall_s):  # no task per frame, unlike wait_for
                await context.write(frame)
        except TimeoutError:
            raise DaemonBusyError(
                f"the client read nothing of its result stream for {stall_s:g} s "
                "(stream_stall_s); the daemon ended the stream and freed what it held for it; "
                "open a new stream (held_versions skips what arrived)"
            ) from None

    def _shared_entry(
        self, session_id: str, result: SolveResult, shm_results: bool
    ) -> _Entry | None:
        """The batch entry of ``result`` with its arrays that another stream built (copied out
        of a segment) and still holds, when this session would be sent the same; None when
        there is none, or when the result lies in this session's own result segment (it is
        announced there, not copied)."""
        entry = self._entries.get((result.tenant, result.block))
        if entry is None or entry.version != result.version:
            return None
        return None if self._own_ref(session_id, result, shm_results) else entry

    def _entry_of(
        self, result: SolveResult, shm: SegmentRef | None, *, max_inline: int
    ) -> _Entry | None:
        """``result`` as a batch entry: announced in ``shm``, or with its arrays (shared with
        the other streams that send it meanwhile); None when its arrays, to go with it, take
        more than ``max_inline`` bytes (it goes as a header and chunks)."""
        if shm is None and _nbytes(result) > max_inline:
            return None
        entry = _Entry(
            result.version,
            framing.batched_result(result, chunk_bytes=self._limits.chunk_bytes, shm=shm),
        )
        if shm is None:
            key = (result.tenant, result.block)
            current = self._entries.get(key)
            if current is None or current.version < entry.version:
                self._entries[key] = entry
        return entry

    def _own_ref(
        self, session_id: str, result: SolveResult, shm_results: bool
    ) -> SegmentRef | None:
        """Where ``result`` lies when that is this session's result segment of its block (the
        session asked for results there), else None."""
        if result.shm is None or not shm_results or self._handover is None:
            return None
        target = self._handover.result_segment(session_id, result.block)
        if target is not None and target[1] is result.shm.segment:
            return SegmentRef(result.shm.segment_id, result.shm.sequence)
        return None

    async def _frames_of(self, result: SolveResult, shm: SegmentRef | None) -> _Frames:
        """``result``'s messages, serialized once: shared with every other stream sending the
        same result now. A result announced in a segment is one small header, never shared."""
        if shm is not None:
            messages = framing.result_messages(
                result, chunk_bytes=self._limits.chunk_bytes, shm=shm
            )
            return _Frames(result.version, tuple(m.SerializeToString() for m in messages))
        key = (result.tenant, result.block)
        frames = self._frames.get(key)
        if frames is not None and frames.version == result.version:
            return frames

        def build() -> _Frames:
            messages = framing.result_messages(result, chunk_bytes=self._limits.chunk_bytes)
            return _Frames(result.version, tuple(m.SerializeToString() for m in messages))

        if _nbytes(result) > _COPY_IN_THREAD_BYTES:
            frames = await asyncio.to_thread(build)
        else:
            frames = build()
        current = self._frames.get(key)
        if current is None or current.version < frames.version:
            self._frames[key] = frames
        return frames

    async def _to_send(
        self, session_id: str, result: SolveResult, shm_results: bool
    ) -> tuple[SolveResult, SegmentRef | None] | None:
        """How to send ``result`` on this session's stream: announced where the worker wrote it,
        when that is this session's result segment of the block; else in chunks (copied out of
        another session's segment first, under its seqlock). None: it was overwritten meanwhile
        (a newer result of the block follows).

        The daemon process never writes into a client's segment: its solver workers are the
        only writers of result segments, so a seqlock never has two writers."""
        if result.shm is None:
            return result, None
        own = self._own_ref(session_id, result, shm_results)
        if own is not None:
            return result, own
        if _nbytes(result) > _COPY_IN_THREAD_BYTES:
            copied = await asyncio.to_thread(private_result, result)
        else:
            copied = private_result(result)
        return None if copied is None else (copied, None)

    # ------------------------------------------------------------------ status

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StatusResponse:
        if not request.session_id:  # no credentials: daemon-wide numbers only
            stats = self._engine.stats()
            if self._limits.private_status:  # reachable by others: no counts without a session
                engine = pb.EngineStats(
                    incarnation_id=stats.incarnation_id,
                    uptime_s=stats.uptime_s,
                    closed=stats.closed,
                    broken_reason=stats.broken_reason,
                )
                return pb.StatusResponse(engine=engine)
            return convert.status_to_proto(stats, [], self.transport_stats())
        try:
            session = self._session(request.session_id)
            if request.tenant and request.tenant != session.tenant:
                raise AuthenticationError(
                    f"session of tenant {session.tenant!r} may not read tenant {request.tenant!r}"
                )
            if request.max_blocks < 0:
                raise InvalidInputError(
                    f"Status: max_blocks must be >= 0, got {request.max_blocks}"
                )
        except (UnknownSessionError, AuthenticationError, InvalidInputError) as exc:
            await abort_call(context, exc)
        stats = self._engine.stats(session.tenant)  # its own blocks' names in the workers
        reply = convert.status_to_proto(stats, [], self.transport_stats())
        after = request.after_block
        if request.summary:
            worst = min(request.max_blocks or SUMMARY_WORST_BLOCKS, MAX_SUMMARY_WORST_BLOCKS)
            summary = await asyncio.to_thread(self._engine.status_summary, session.tenant, worst)
            reply.summary.CopyFrom(convert.block_summary_to_proto(summary))
            reply.total_blocks = summary.blocks
            return reply
        if request.columns:
            return await self._status_columns(request, session.tenant, reply)
        page = min(request.max_blocks or STATUS_PAGE_BLOCKS, STATUS_PAGE_BLOCKS)
        # One page's blocks, sorted by name: the engine builds no status for the others, and
        # reads the page's queue positions by rank (it sorts no queue).
        blocks, total = self._engine.status_page(session.tenant, after, page + 1)
        # Stop well short of the message limit: the engine numbers and framing need room too.
        room = self._limits.max_message_bytes - reply.ByteSize() - 4096
        taken: list[pb.BlockStatus] = []
        for block in blocks:
            message = convert.block_status_to_proto(block)
            room -= message.ByteSize() + 8
            if len(taken) >= page or (room < 0 and taken):
                break
            taken.append(message)
        reply.blocks.extend(taken)
        reply.total_blocks = total
        if len(taken) < len(blocks) and taken:
            reply.next_after_block = taken[-1].block
        return reply

    async def _status_columns(
        self,
        request: pb.StatusRequest,
        tenant: str,
        reply: pb.StatusResponse,
    ) -> pb.StatusResponse:
        """A Status page as columns (``request.columns``): up to ``STATUS_COLUMN_PAGE_BLOCKS``
        blocks, or what ``max_blocks`` asks up to ``MAX_STATUS_COLUMN_PAGE_BLOCKS``, in a few
        packed lists. It is built in a thread, so the event loop keeps serving uploads and
        results meanwhile, and it holds the engine's lock only to copy the page's records and
        queue positions, a chunk at a time (see :meth:`Engine.status_table`)."""
        page = min(request.max_blocks or STATUS_COLUMN_PAGE_BLOCKS, MAX_STATUS_COLUMN_PAGE_BLOCKS)
        room = self._limits.max_message_bytes - reply.ByteSize() - 4096

        def build() -> tuple[pb.BlockColumns, int, str]:
            table, total = self._engine.status_table(tenant, request.after_block, page + 1)
            more = len(table) > page
            shown = table.head(page) if more else table
            message = convert.block_table_to_proto(shown)
            while message.ByteSize() > room and len(shown) > 1:  # long names: a smaller page
                shown = shown.head(len(shown) // 2)
                message = convert.block_table_to_proto(shown)
                more = True
            return (
                message,
                total,
                shown.columns["block"][-1] if more and len(shown) else "",
            )

        columns, total, next_after = await asyncio.to_thread(build)
        reply.columns.CopyFrom(columns)
        reply.total_blocks = total
        if next_after:
            reply.next_after_block = next_after
        return reply

    def transport_stats(self) -> TransportStats:
        """The data path's numbers now (shared memory, uploads); for Status and metrics."""
        shm = self._handover.stats() if self._handover is not None else {}
        return TransportStats(
            shm_connections=shm.get("connections", 0),
            shm_segments=shm.get("segments", 0),
            shm_mapped_bytes=shm.get("mapped_bytes", 0),
            upload_bytes_in_flight=self._uploads.in_use_bytes,
            upload_budget_bytes=self._uploads.limit_bytes,
            uploads_waiting=self._uploads.waiting,
            snapshots_received=self._received[0],
            snapshot_bytes_received=self._received[1],
        )
