"""One channel to an ``asteria-server`` and its calls, for the daemon source and ``asteria status``.

Every call has a deadline, and a failed call comes out as the Asteria exception that
``protocol.errors`` maps its status to; no gRPC type leaves this module and ``daemon.py``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import grpc

from asteria_client.config import client_env
from asteria_client.transport.peer import caller_ticket, check_socket_owner
from asteria_server.errors import AsteriaError, DaemonBusyError, InvalidInputError
from asteria_server.protocol import convert, framing
from asteria_server.protocol.errors import from_status
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2 as jpb
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2_grpc as jpb_grpc
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.protocol.generated.asteria.v1 import peer_pb2_grpc as ppb_grpc
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc
from asteria_server.protocol.shm import SegmentRef
from asteria_server.types import (
    BlockSummary,
    BlockTable,
    Credit,
    EngineStats,
    SolveResult,
    SolveTask,
    SubmitOutcome,
    TransportStats,
)

#: Largest gRPC message this client sends or accepts (a 1 MiB chunk plus framing fits).
MAX_MESSAGE_BYTES = 8 << 20
#: Snapshots announced per AnnounceSnapshots call: a first refresh of 20,000 blocks in one call
#: took the daemon longer than a call's deadline while other clients did the same.
ANNOUNCE_BATCH = 1024


@dataclass(frozen=True, kw_only=True)
class JobNodeInfo:
    """One node of a registered job: its host, its global ranks, the daemon serving them."""

    host: str
    ranks: tuple[int, ...]
    daemon_address: str = ""
    daemon_incarnation: str = ""


@dataclass(frozen=True, kw_only=True)
class RegisteredJob:
    """A job's layout as registered with a daemon (``node_rank``: the node that daemon serves);
    the age and count are filled in by ``list_jobs``."""

    job: str
    world_size: int
    nodes: tuple[JobNodeInfo, ...]
    node_rank: int
    registered_age_s: float = 0.0
    registrations: int = 0
    #: this run of the job, drawn by rank 0 (its peer-call token is bound to it)
    run_nonce: str = ""


@dataclass(frozen=True, kw_only=True)
class DaemonClientConfig:
    """Timeouts and retry pacing of a daemon client.

    Attributes:
        call_timeout_s: deadline of each unary or client-streaming call (sessions, snapshots).
        status_timeout_s: deadline of a Status call made for ``records()``.
        connect_timeout_s: how long a new daemon source waits for its first session before it
            starts degraded (its snapshots are then computed locally until it connects).
        backoff_initial_s: first wait before reconnecting to an unreachable daemon.
        backoff_max_s: the cap of the doubling reconnect wait.
        shared_memory: use the shared-memory transport when the daemon is on this host and
            offers it (``ASTERIA_TRANSPORT=grpc`` turns it off too).
        tls_ca: PEM file of the certificate authority to trust; set, a ``host:port`` daemon is
            reached over TLS (default: ``ASTERIA_TLS_CA``).
    """

    call_timeout_s: float = 10.0
    status_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    shared_memory: bool = True
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "call_timeout_s",
            "status_timeout_s",
            "connect_timeout_s",
            "backoff_initial_s",
            "backoff_max_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < math.inf):
                raise InvalidInputError(
                    f"DaemonClientConfig.{name} must be a positive finite number, got {value!r}"
                )
        if not isinstance(self.shared_memory, bool):
            raise InvalidInputError(
                f"DaemonClientConfig.shared_memory must be a bool, got {self.shared_memory!r}"
            )
        if self.tls_ca is not None and not os.path.isfile(self.tls_ca):
            raise InvalidInputError(
                f"DaemonClientConfig.tls_ca={self.tls_ca!r} is not a readable PEM file"
            )
        if self.backoff_initial_s > self.backoff_max_s:
            raise InvalidInputError(
                f"DaemonClientConfig.backoff_initial_s={self.backoff_initial_s} must not exceed "
                f"backoff_max_s={self.backoff_max_s}"
            )


#: gRPC status codes by number (an AnnounceSnapshots answer carries a refusal's code as one).
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _error(exc: grpc.RpcError) -> AsteriaError:
    """The Asteria exception for a failed call (``protocol.errors``' table)."""
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    return from_status(code, details or "")


@dataclass(frozen=True)
class SessionInfo:
    """An open session: its id, the daemon's incarnation and the limits it announced."""

    session_id: str
    incarnation_id: str
    max_chunk_bytes: int
    max_matrix_n: int
    shm_socket: str = ""  # the daemon's segment-handover socket; empty: no shared memory
    #: where other nodes' daemons reach this one (its peer listener); empty: none
    peer_address: str = ""


#: Status pages read for one report (a page holds thousands of blocks).
MAX_STATUS_PAGES = 1000
#: Blocks a full read asks for in each Status page of columns: a few large pages cost fewer
#: round trips than many of a polling call's size. The daemon caps it (one that predates
#: larger pages at its default page), and the read pages on from wherever a page stops.
STATUS_BULK_PAGE_BLOCKS = 10_000


class StatusPage(NamedTuple):
    """One Status answer of a full read: the engine's numbers when it was built, a page of the
    tenant's blocks, and the data-path numbers (None from a daemon that predates them)."""

    stats: EngineStats
    table: BlockTable
    transport: TransportStats | None


def _status_reply(call: grpc.Future) -> pb.StatusResponse:
    """A started Status call's reply; its failure as an Asteria exception."""
    try:
        reply: pb.StatusResponse = call.result()
    except grpc.RpcError as exc:
        raise _error(exc) from None
    return reply


def _page_blocks(reply: pb.StatusResponse) -> int:
    """Blocks a Status page carries, read before it is converted."""
    return len(reply.columns.block) if reply.HasField("columns") else len(reply.blocks)


class DaemonConnection:
    """One channel to a daemon and the calls on it, each with a deadline; gRPC failures come
    out as Asteria exceptions. Shared by :class:`DaemonSource` and ``asteria status``."""

    def __init__(
        self,
        address: str,
        *,
        tenant: str = "",
        token: str = "",
        job: str = "",
        rank: int = 0,
        config: DaemonClientConfig | None = None,
    ) -> None:
        self.address = address
        self.config = config or DaemonClientConfig()
        self._tenant, self._token, self._job, self._rank = tenant, token, job, rank
        self._ticket = ""  # the caller ticket of the last open_session (see caller_ticket)
        self._announce_supported = True  # False once the daemon answered UNIMPLEMENTED
        #: StreamResults messages received, all streams of this connection (a daemon that
        #: batches results sends fewer messages than results)
        self.result_messages = 0
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # One backoff policy: the session's (transport.session). gRPC's own reconnect
            # backoff is pinned to the initial wait, so a reconnect the session asks for is
            # never delayed further by the channel.
            ("grpc.initial_reconnect_backoff_ms", int(self.config.backoff_initial_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(self.config.backoff_initial_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.config.backoff_initial_s * 1000)),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ]
        tls_ca = self.config.tls_ca or client_env().tls_ca
        if tls_ca is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            if address.startswith("unix:"):
                raise InvalidInputError(
                    f"TLS ({tls_ca}) applies to host:port daemons, not to {address}: a Unix "
                    "socket is local and protected by its file mode"
                )
            try:
                with open(tls_ca, "rb") as f:
                    root = f.read()
            except OSError as exc:
                raise InvalidInputError(f"cannot read the TLS CA file {tls_ca}: {exc}") from None
            credentials = grpc.ssl_channel_credentials(root_certificates=root)
            self._channel = grpc.secure_channel(address, credentials, options=options)
        self._stub = pb_grpc.PreconditionerStub(self._channel)
        self._jobs = jpb_grpc.JobsStub(self._channel)
        self._peers = ppb_grpc.PeerStub(self._channel)

    def open_session(self) -> SessionInfo:
        check_socket_owner(self.address)  # never hand a token to another user's process
        self._ticket = caller_ticket(self.address)  # throttled as this process, not all local
        request = pb.OpenSessionRequest(
            tenant=self._tenant,
            token=self._token,
            job=self._job,
            rank=self._rank,
            caller_ticket=self._ticket,
        )
        try:
            reply = self._stub.OpenSession(request, timeout=self.config.call_timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return SessionInfo(
            session_id=reply.session_id,
            incarnation_id=reply.incarnation_id,
            max_chunk_bytes=reply.limits.max_chunk_bytes or framing.DEFAULT_CHUNK_BYTES,
            max_matrix_n=reply.limits.max_matrix_n or framing.DEFAULT_MAX_MATRIX_N,
            shm_socket=reply.shm_socket,
            peer_address=reply.peer_address,
        )

    def close_session(self, session_id: str, *, forget_blocks: bool = False) -> None:
        """End the session; ``forget_blocks`` also forgets its job's blocks on the daemon."""
        request = pb.CloseSessionRequest(
            session_id=session_id,
            forget_blocks=forget_blocks,
            token=self._token,
            caller_ticket=self._ticket,
        )
        try:
            self._stub.CloseSession(request, timeout=self.config.call_timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def register(self, session_id: str, tasks: list[SolveTask]) -> None:
        request = pb.RegisterBlocksRequest(
            session_id=session_id,
            blocks=[
                pb.BlockSpec(block=t.block, n=t.n, kind=convert.snapshot_header(t).kind)
                for t in tasks
            ],
        )
        try:
            self._stub.RegisterBlocks(request, timeout=self.config.call_timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def submit(
        self, session: SessionInfo, task: SolveTask, *, shm: SegmentRef | None = None
    ) -> None:
        """Send ``task`` in chunks, or with ``shm`` only announce it (its bytes are there)."""
        messages = framing.snapshot_messages(
            task, session_id=session.session_id, chunk_bytes=session.max_chunk_bytes, shm=shm
        )
        try:
            self._stub.SubmitSnapshot(messages, timeout=self.config.call_timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def announce(
        self, session: SessionInfo, snapshots: list[tuple[SolveTask, SegmentRef]]
    ) -> list[SubmitOutcome | AsteriaError]:
        """Announce snapshots written in the session's segments, all in one call; per snapshot
        its outcome, or the error a :meth:`submit` of it would have raised. Raises (for all of
        them) when the call itself fails: the session is unknown, the daemon unreachable. A
        daemon that does not know the call gets one :meth:`submit` per snapshot instead."""
        if not snapshots:
            return []
        if len(snapshots) > ANNOUNCE_BATCH:  # each call within its deadline, whatever the model
            out: list[SubmitOutcome | AsteriaError] = []
            for start in range(0, len(snapshots), ANNOUNCE_BATCH):
                out += self.announce(session, snapshots[start : start + ANNOUNCE_BATCH])
            return out
        if not self._announce_supported:
            return self._announce_one_by_one(session, snapshots)
        request = pb.AnnounceSnapshotsRequest(
            session_id=session.session_id,
            snapshots=[convert.snapshot_header(task, shm=ref) for task, ref in snapshots],
        )
        try:
            reply = self._stub.AnnounceSnapshots(request, timeout=self.config.call_timeout_s)
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                self._announce_supported = False  # an older daemon: one call per snapshot
                return self._announce_one_by_one(session, snapshots)
            raise _error(exc) from None
        if len(reply.snapshots) != len(snapshots):
            raise InvalidInputError(
                f"the daemon answered {len(reply.snapshots)} of {len(snapshots)} announced "
                "snapshots"
            )
        answers: list[SubmitOutcome | AsteriaError] = []
        for answer in reply.snapshots:
            got = convert.announced_from_proto(answer)
            if isinstance(got, tuple):
                code = _STATUS_CODES.get(got[0], grpc.StatusCode.UNKNOWN)
                answers.append(from_status(code, got[1]))
            else:
                answers.append(got)
        return answers

    def _announce_one_by_one(
        self, session: SessionInfo, snapshots: list[tuple[SolveTask, SegmentRef]]
    ) -> list[SubmitOutcome | AsteriaError]:
        out: list[SubmitOutcome | AsteriaError] = []
        for task, ref in snapshots:
            try:
                self.submit(session, task, shm=ref)
            except (InvalidInputError, DaemonBusyError) as exc:  # this snapshot's own refusal
                out.append(exc)
                continue
            out.append(SubmitOutcome.QUEUED)  # submit does not say which acceptance it was
        return out

    def register_job(self, session_id: str, job: RegisteredJob) -> bool:
        """Record ``job``'s layout with the daemon (``job.node_rank``: the node it serves);
        True when the daemon knew the job and replaced its layout."""
        request = jpb.RegisterJobRequest(
            session_id=session_id,
            node_rank=job.node_rank,
            layout=jpb.JobLayout(
                job=job.job,
                world_size=job.world_size,
                nodes=[
                    jpb.JobNode(
                        host=node.host,
                        ranks=list(node.ranks),
                        daemon_address=node.daemon_address,
                        daemon_incarnation=node.daemon_incarnation,
                    )
                    for node in job.nodes
                ],
                run_nonce=job.run_nonce,
            ),
        )
        try:
            reply = self._jobs.RegisterJob(request, timeout=self.config.call_timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return bool(reply.replaced)

    def peer_status(self, session_id: str) -> ppb.PeerStatusResponse:
        """The peer groups (multi-node jobs) of the session's tenant as the daemon sees them."""
        try:
            return self._peers.PeerStatus(
                ppb.PeerStatusRequest(session_id=session_id), timeout=self.config.call_timeout_s
            )
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def list_jobs(self, session_id: str) -> list[RegisteredJob]:
        """The jobs the session's tenant registered with the daemon, newest first."""
        try:
            reply = self._jobs.ListJobs(
                jpb.ListJobsRequest(session_id=session_id), timeout=self.config.call_timeout_s
            )
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return [
            RegisteredJob(
                job=entry.layout.job,
                world_size=entry.layout.world_size,
                nodes=tuple(
                    JobNodeInfo(
                        host=node.host,
                        ranks=tuple(node.ranks),
                        daemon_address=node.daemon_address,
                        daemon_incarnation=node.daemon_incarnation,
                    )
                    for node in entry.layout.nodes
                ),
                node_rank=entry.node_rank,
                registered_age_s=entry.registered_age_s,
                registrations=entry.registrations,
            )
            for entry in reply.jobs
        ]

    def status(
        self, session_id: str = "", *, timeout_s: float | None = None
    ) -> tuple[EngineStats, BlockTable]:
        """The engine's numbers and the session's tenant's blocks."""
        stats, blocks, _ = self.status_report(session_id, timeout_s=timeout_s)
        return stats, blocks

    def status_report(
        self, session_id: str = "", *, timeout_s: float | None = None
    ) -> tuple[EngineStats, BlockTable, TransportStats | None]:
        """:meth:`status` and the daemon's data-path numbers (None from an older daemon): every
        page of :meth:`status_pages` in one table, with the last page's numbers."""
        blocks = BlockTable(self._tenant)
        last: StatusPage | None = None
        for last in self.status_pages(session_id, timeout_s=timeout_s):
            if len(last.table) and last.table.tenant != blocks.tenant:
                blocks.tenant = last.table.tenant
            blocks.extend(last.table)
        assert last is not None  # the first page comes or its call raises
        return last.stats, blocks, last.transport

    def status_pages(
        self, session_id: str = "", *, timeout_s: float | None = None
    ) -> Generator[StatusPage, None, None]:
        """The session's tenant's blocks page by page, in name order, as the daemon answers
        them (each within its message limit, as columns where it can), up to
        ``MAX_STATUS_PAGES``. The next page's call is sent as soon as a page arrives, before it
        is converted or handed on: the daemon builds page k+1 while this process converts
        page k and its caller uses it (``asteria status --json --blocks`` writes it out), so
        neither side waits for the other. Raises an Asteria error when a call fails; pages
        already yielded stay valid."""
        timeout = self.config.call_timeout_s if timeout_s is None else timeout_s
        pending: grpc.Future | None = self._status_call(session_id, "", timeout)
        try:
            for _ in range(MAX_STATUS_PAGES):
                assert pending is not None
                reply = _status_reply(pending)
                pending = None
                if reply.next_after_block and _page_blocks(reply):
                    pending = self._status_call(session_id, reply.next_after_block, timeout)
                yield StatusPage(
                    convert.engine_stats_from_proto(reply.engine),
                    self._status_page_table(reply),
                    convert.transport_stats_from_proto(reply),
                )
                if pending is None:
                    return
        finally:
            if pending is not None:  # a failed conversion, a caller that stopped, or the cap
                pending.cancel()

    def _status_call(self, session_id: str, after: str, timeout: float) -> grpc.Future:
        """One full-read Status page's call, started (its reply is read with _status_reply)."""
        request = pb.StatusRequest(
            session_id=session_id,
            after_block=after,
            columns=True,
            max_blocks=STATUS_BULK_PAGE_BLOCKS,
        )
        return self._stub.Status.future(request, timeout=timeout)

    def _status_page_table(self, reply: pb.StatusResponse) -> BlockTable:
        if reply.HasField("columns"):
            return convert.block_table_from_proto(reply.columns)
        # a daemon that predates columns: a message per block
        return BlockTable.of(self._tenant, convert.status_from_proto(reply)[1])

    def status_summary(
        self, session_id: str, *, worst: int = 0, timeout_s: float | None = None
    ) -> tuple[EngineStats, BlockSummary | None, TransportStats | None]:
        """The engine's numbers, what the session's tenant's blocks add up to (with its
        ``worst`` blocks, 0: the daemon's default) and the data-path numbers: one RPC, however
        many blocks. The summary is None from a daemon that predates summaries."""
        timeout = self.config.call_timeout_s if timeout_s is None else timeout_s
        request = pb.StatusRequest(session_id=session_id, summary=True, max_blocks=worst)
        try:
            reply = self._stub.Status(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        summary = (
            convert.block_summary_from_proto(reply.summary) if reply.HasField("summary") else None
        )
        return (
            convert.engine_stats_from_proto(reply.engine),
            summary,
            convert.transport_stats_from_proto(reply),
        )

    def status_page(self, session_id: str, *, timeout_s: float | None = None) -> int:
        """One Status RPC (the first page, as columns); the number of blocks it carried."""
        timeout = self.config.call_timeout_s if timeout_s is None else timeout_s
        request = pb.StatusRequest(session_id=session_id, columns=True)
        try:
            reply = self._stub.Status(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        if reply.HasField("columns"):
            return len(convert.block_table_from_proto(reply.columns))
        return len(reply.blocks)

    def results(
        self,
        session: SessionInfo,
        held_versions: dict[str, int],
        on_call: Callable[[Callable[[], object]], None],
        *,
        reader: framing.SegmentReader | None = None,
        on_credit: Callable[[Credit], None] | None = None,
        allocate: framing.ArrayAllocator | None = None,
    ) -> Iterator[SolveResult]:
        """The session's results as they arrive; ``on_call(cancel)`` receives a function that
        ends the stream from another thread. Raises an Asteria error when the stream fails.
        With ``reader``, blocks with a result segment get their results through it; with
        ``on_credit``, the daemon's Credit messages are asked for and handed to it; with
        ``allocate``, chunked results are assembled in the arrays it gives."""
        request = pb.StreamResultsRequest(
            session_id=session.session_id,
            held_versions=held_versions,
            shm_results=reader is not None,
            credit=on_credit is not None,
            batch_results=True,
        )
        call = self._stub.StreamResults(request)
        on_call(call.cancel)
        receiver = framing.ResultReceiver(
            max_chunk_bytes=session.max_chunk_bytes,
            max_matrix_n=session.max_matrix_n,
            reader=reader,
            on_credit=on_credit,
            allocate=allocate,
        )
        try:
            for message in call:
                self.result_messages += 1
                yield from receiver.feed_all(message)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    def close(self) -> None:
        self._channel.close()
