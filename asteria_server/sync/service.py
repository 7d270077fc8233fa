"""The ``asteria.v1.Peer`` gRPC servicer: calls of other daemons of a job, and PeerStatus."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from asteria_server.errors import (
    AuthenticationError,
    DaemonBusyError,
    InvalidInputError,
    UnknownSessionError,
)
from asteria_server.protocol.errors import abort_call
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.protocol.generated.asteria.v1 import peer_pb2_grpc as ppb_grpc
from asteria_server.service.limits import throttle_key
from asteria_server.sync.manager import SyncManager

_REFUSED = (AuthenticationError, InvalidInputError, DaemonBusyError, LookupError)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> NoReturn:
    if isinstance(exc, LookupError):
        await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    await abort_call(context, exc)


class PeerServicer(ppb_grpc.PeerServicer):
    """Peer calls go to the :class:`SyncManager`; ``tenant_of`` maps a Preconditioner session
    to its tenant (PeerStatus), like the Jobs service."""

    def __init__(self, manager: SyncManager, tenant_of: Callable[[str], str]) -> None:
        self._manager = manager
        self._tenant_of = tenant_of

    async def Heartbeat(
        self, request: ppb.HeartbeatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ppb.HeartbeatResponse:
        try:
            return self._manager.heartbeat(request, _caller(context))
        except _REFUSED as exc:
            await _abort(context, exc)

    async def PushResults(
        self,
        request_iterator: AsyncIterator[ppb.PushResultsRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> ppb.PushResultsResponse:
        try:
            return await self._manager.receive(request_iterator, _caller(context))
        except _REFUSED as exc:
            await _abort(context, exc)

    async def Claim(
        self, request: ppb.ClaimRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ppb.ClaimResponse:
        try:
            return self._manager.claim(request, _caller(context))
        except _REFUSED as exc:
            await _abort(context, exc)

    async def PeerStatus(
        self, request: ppb.PeerStatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ppb.PeerStatusResponse:
        try:
            tenant = self._tenant_of(request.session_id)
        except UnknownSessionError as exc:
            await _abort(context, exc)
        return self._manager.status(tenant)


def _caller(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The authentication throttle's key for a peer call's caller: its host over TCP; over the
    Unix socket (no caller ticket on peer calls) the key of every local caller without one."""
    return throttle_key(context.peer() or "", "", None)
