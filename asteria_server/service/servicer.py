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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from asteria_server.engine import PreconditionerEngine, SolveKind, SolveResult, SolveTask
from asteria_server.errors import (
    AuthenticationError,
    DaemonBusyError,
    EngineUnavailableError,
    InvalidInputError,
    UnknownSessionError,
)
from asteria_server.protocol import convert, framing
from asteria_server.protocol.errors import to_status
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc
from asteria_server.protocol.shm import SegmentRef, private_result, result_specs
from asteria_server.service.budget import UploadBudget
from asteria_server.service.handover import SegmentHandover
from asteria_server.types import SharedArrays, SubmitOutcome, TransportStats

logger = logging.getLogger(__name__)

#: The tenant of anonymous sessions (no tokens configured, Unix socket only).
ANONYMOUS_TENANT = "local"
#: Registered blocks kept per tenant (bounds memory; registration is advisory).
MAX_REGISTERED_BLOCKS = 1_000_000
#: Shared-memory copies larger than this run in a thread, off the event loop.
_COPY_IN_THREAD_BYTES = 4 << 20
#: Seconds before a stream looks again at a result that was overwritten while it copied it out.
_RETRY_COPY_S = 0.005


@dataclass(frozen=True)
class ServiceLimits:
    """What the servicer enforces and announces in ``OpenSession``."""

    chunk_bytes: int
    max_message_bytes: int
    max_matrix_n: int
    max_upload_bytes: int = 2 << 30
    upload_wait_s: float = 5.0


@dataclass(eq=False)
class _Stream:
    """One open StreamResults call: set ``wake`` when it has something to look at."""

    session_id: str
    wake: asyncio.Event


@dataclass(frozen=True)
class Session:
    """One training process's session."""

    session_id: str
    tenant: str
    job: str
    rank: int
    opened_at: float


class Authenticator:
    """Checks a tenant's token in constant time; never logs or echoes a token."""

    def __init__(self, tokens: Mapping[str, str], *, allow_anonymous: bool) -> None:
        self._tokens = {t: tok.encode() for t, tok in tokens.items()}
        self._allow_anonymous = allow_anonymous

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


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> NoReturn:
    code, message = to_status(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("internal error in a call", exc_info=exc)
    await context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises


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
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._registered: dict[str, dict[str, tuple[int, SolveKind]]] = {}
        self._stopping = False
        #: tenant -> its open StreamResults calls (touched on the event loop only)
        self._streams: dict[str, set[_Stream]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        engine.add_result_listener(self._on_result)
        self._handover = handover
        self._uploads = UploadBudget(limits.max_upload_bytes)

    def has_session(self, session_id: str) -> bool:
        """Whether ``session_id`` is open (the segment handover asks, from its threads)."""
        return session_id in self._sessions

    def session_tenant(self, session_id: str) -> str:
        """The tenant of an open session (UnknownSessionError otherwise): other services of
        the daemon authenticate their calls with the sessions opened here."""
        return self._session(session_id).tenant

    def sessions_by_tenant(self) -> dict[str, int]:
        """Open sessions per tenant (the metrics endpoint asks, from its own thread)."""
        counts: dict[str, int] = {}
        for session in tuple(self._sessions.values()):  # one C-level copy: no GIL switch inside
            counts[session.tenant] = counts.get(session.tenant, 0) + 1
        return counts

    def stop_streams(self) -> None:
        """End every StreamResults stream now (daemon shutdown; on the event loop)."""
        self._stopping = True
        self._engine.remove_result_listener(self._on_result)
        self._wake(lambda stream: True)

    def _on_result(self, tenant: str, block: str) -> None:
        """The engine's news of a newer result (its dispatcher thread): wake the tenant's
        streams on the event loop."""
        loop = self._loop
        if loop is not None and tenant in self._streams:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(self._wake_tenant, tenant)

    def _wake_tenant(self, tenant: str) -> None:
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
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSessionError(
                f"unknown session {session_id!r} on daemon incarnation "
                f"{self._engine.incarnation_id}: the daemon restarted or the session was closed; "
                "open a new session, re-register the blocks and resubmit"
            )
        return session

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OpenSessionResponse:
        try:
            tenant = self._auth.tenant_of(request.tenant, request.token)
        except AuthenticationError as exc:
            logger.warning(
                "refused a session for tenant %r: wrong token",
                request.tenant,
                extra={"tenant": request.tenant, "job": request.job},
            )
            await _abort(context, exc)
        session = Session(uuid.uuid4().hex, tenant, request.job, request.rank, self._clock())
        self._sessions[session.session_id] = session
        while len(self._sessions) > self._max_sessions:
            _, dropped = self._sessions.popitem(last=False)
            self._wake_session(dropped.session_id)
            logger.warning(
                "session limit reached: dropped the oldest (tenant %r)",
                dropped.tenant,
                extra={"tenant": dropped.tenant, "job": dropped.job},
            )
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
        )

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CloseSessionResponse:
        try:
            session = self._session(request.session_id)
        except (UnknownSessionError, InvalidInputError) as exc:
            await _abort(context, exc)
        del self._sessions[request.session_id]
        self._wake_session(request.session_id)
        if self._handover is not None:
            self._handover.drop_session(request.session_id)
        if request.forget_blocks:  # the session's job: its blocks, results and spill files
            registered = self._registered.get(session.tenant, {})
            for block in self._engine.forget(session.tenant, session.job):
                registered.pop(block, None)
        return pb.CloseSessionResponse()

    async def RegisterBlocks(
        self, request: pb.RegisterBlocksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterBlocksResponse:
        try:
            session = self._session(request.session_id)
            known = self._registered.setdefault(session.tenant, {})
            specs: dict[str, tuple[int, SolveKind]] = {}
            for spec in request.blocks:
                what = f"RegisterBlocks: block {spec.block!r}"
                if not spec.block:
                    raise InvalidInputError("RegisterBlocks: every block needs a non-empty name")
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
                specs[spec.block] = (spec.n, kind)
            new = [b for b in specs if b not in known]
            if len(known) + len(new) > MAX_REGISTERED_BLOCKS:
                raise InvalidInputError(
                    f"RegisterBlocks: tenant {session.tenant!r} would exceed "
                    f"{MAX_REGISTERED_BLOCKS} registered blocks"
                )
            known.update(specs)
        except (UnknownSessionError, InvalidInputError) as exc:
            await _abort(context, exc)
        return pb.RegisterBlocksResponse(num_new=len(new), num_known=len(specs) - len(new))

    # ------------------------------------------------------------------ snapshots

    async def SubmitSnapshot(
        self,
        request_iterator: AsyncIterator[pb.SubmitSnapshotRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.SubmitSnapshotResponse:
        try:
            first = await anext(request_iterator, None)
            if first is None:
                raise InvalidInputError("SubmitSnapshot stream: no messages (expected a header)")
            receiver = framing.SnapshotReceiver(
                first,
                max_chunk_bytes=self._limits.chunk_bytes,
                max_matrix_n=self._limits.max_matrix_n,
            )
            session = self._session(receiver.session_id)
            self._check_registered(session.tenant, receiver.header)
            num_bytes = sum(spec.num_bytes for spec in receiver.specs)
            what = f"SubmitSnapshot of block {receiver.header.block!r}"
            async with self._uploads.hold(
                num_bytes, wait_s=self._upload_wait_s(context), what=what
            ):
                async for message in request_iterator:
                    receiver.feed(message)
                task: SolveTask | None
                if receiver.shm is None:
                    task = receiver.finish(tenant=session.tenant)
                else:
                    task = await self._from_segment(receiver, session)
            if task is None:  # the client already wrote a newer snapshot over this one
                return convert.outcome_to_proto(SubmitOutcome.STALE_IGNORED)
            outcome = self._engine.submit(task, job=session.job)
        except (
            InvalidInputError,
            UnknownSessionError,
            EngineUnavailableError,
            DaemonBusyError,
        ) as exc:
            await _abort(context, exc)
        return convert.outcome_to_proto(outcome)

    def _upload_wait_s(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        """How long an upload may wait for room: the configured wait, within its deadline."""
        remaining = context.time_remaining()
        if remaining is None:
            return self._limits.upload_wait_s
        return max(0.0, min(self._limits.upload_wait_s, 0.8 * remaining))

    async def _from_segment(
        self, receiver: framing.SnapshotReceiver, session: Session
    ) -> SolveTask | None:
        """The task of a snapshot announced in shared memory, *not copied*: its arrays are views
        of the session's segment, which the solver worker reads itself (under the seqlock), and
        its result goes to the session's result segment of the block, if there is one. None
        when a newer write already replaced it (a cheap look at the sequence word)."""
        if self._handover is None:
            raise InvalidInputError("this daemon offers no shared memory; send chunks instead")
        ref = receiver.shm
        assert ref is not None
        segment = self._handover.segment(session.session_id, ref.segment_id)
        views = segment.views(receiver.specs)  # InvalidInputError: does not fit the segment
        if segment.sequence != ref.sequence:
            return None
        task = receiver.task_from(views, tenant=session.tenant)
        found = self._handover.result_segment(session.session_id, task.block)
        return dataclasses.replace(
            task,
            shm_source=SharedArrays(segment, ref.segment_id, ref.sequence),
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

    async def StreamResults(
        self, request: pb.StreamResultsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.StreamResultsResponse]:
        try:
            session = self._session(request.session_id)
        except UnknownSessionError as exc:
            await _abort(context, exc)
        tenant = session.tenant
        wanted = set(request.blocks)
        sent: dict[str, int] = dict(request.held_versions)
        epoch = -1
        retry: set[str] = set()  # blocks whose copy-out found the result overwritten
        loop = self._loop = asyncio.get_running_loop()
        stream = _Stream(session.session_id, asyncio.Event())
        self._streams.setdefault(tenant, set()).add(stream)
        try:
            while not self._stopping and session.session_id in self._sessions:
                stream.wake.clear()  # news from now on wakes the wait below
                now_epoch = self._engine.results_epoch
                if now_epoch != epoch or retry:
                    changed = self._engine.blocks_with_results_since(epoch, tenant)
                    epoch = now_epoch
                    blocks = [b for b in changed if b in wanted] if wanted else changed
                    blocks = set(blocks) | retry
                    retry = set()
                    for block in sorted(blocks):
                        result = self._engine.latest_result(
                            block, tenant, newer_than=sent.get(block, -1)
                        )
                        if result is None:
                            continue
                        sending = await self._to_send(
                            session.session_id, result, request.shm_results
                        )
                        if sending is None:
                            # Overwritten while copied out (another replica's segment): look
                            # again shortly, whether or not a newer result is announced.
                            retry.add(block)
                            loop.call_later(_RETRY_COPY_S, stream.wake.set)
                            continue
                        sent[block] = result.version
                        for message in framing.result_messages(
                            sending[0], chunk_bytes=self._limits.chunk_bytes, shm=sending[1]
                        ):
                            yield message
                        result = sending = None  # hold no client's segment while idle
                    continue  # results may have come while this stream was sending
                await stream.wake.wait()
        finally:
            streams = self._streams.get(tenant)
            if streams is not None:
                streams.discard(stream)
                if not streams:
                    del self._streams[tenant]

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
        target = None
        if shm_results and self._handover is not None:
            target = self._handover.result_segment(session_id, result.block)
        if target is not None and target[1] is result.shm.segment:
            return result, SegmentRef(result.shm.segment_id, result.shm.sequence)
        if sum(spec.num_bytes for spec in result_specs(result)) > _COPY_IN_THREAD_BYTES:
            copied = await asyncio.to_thread(private_result, result)
        else:
            copied = private_result(result)
        return None if copied is None else (copied, None)

    # ------------------------------------------------------------------ status

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StatusResponse:
        stats, transport = self._engine.stats(), self.transport_stats()
        if not request.session_id:  # no credentials: daemon-wide numbers only
            return convert.status_to_proto(stats, [], transport)
        try:
            session = self._session(request.session_id)
            if request.tenant and request.tenant != session.tenant:
                raise AuthenticationError(
                    f"session of tenant {session.tenant!r} may not read tenant {request.tenant!r}"
                )
        except (UnknownSessionError, AuthenticationError) as exc:
            await _abort(context, exc)
        stats = self._engine.stats(session.tenant)  # its own blocks' names in the workers
        return convert.status_to_proto(stats, self._engine.status(session.tenant), transport)

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
        )
