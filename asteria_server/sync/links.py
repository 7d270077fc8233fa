"""The push link to each peer: what it has, what is queued for it, and the channel to it.

The I/O half of a peer group, apart from its membership (:mod:`.membership`) and its decisions
(:mod:`.decide`): per peer, the newest version of each block it has (pushed to it or received
from it in this incarnation), the blocks with a result to push and the wake-up of its sender,
the byte and result counters its status shows, and the gRPC channel (opened on first use by a
:class:`PeerDialer`, with the daemon's message limits, keepalive and peer TLS).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from asteria_server.protocol.generated.asteria.v1 import peer_pb2_grpc as ppb_grpc
from asteria_server.protocol.shm import private_result
from asteria_server.sync.config import SyncConfig
from asteria_server.types import SolveResult


@dataclass
class PeerLink:
    """This daemon's push link to another member of a job."""

    member: int
    address: str
    #: block -> newest version pushed to (or received from) it in this incarnation
    has: dict[str, int] = field(default_factory=dict)
    #: blocks with a result to push, and the wake-up of its sender
    queued: set[str] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    oldest_queued_at: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    results_sent: int = 0
    results_received: int = 0
    channel: grpc.aio.Channel | None = None
    stub: ppb_grpc.PeerStub | None = None

    def queue(self, block: str) -> None:
        """Queue ``block``'s newest result for this peer and wake its sender."""
        if not self.queued:
            self.oldest_queued_at = time.monotonic()
        self.queued.add(block)
        self.wake.set()

    def lacks(self, block: str, version: int) -> bool:
        """Whether the peer may not have ``version`` of ``block`` yet."""
        return self.has.get(block, -1) < version

    def got(self, block: str, version: int) -> None:
        """The peer has ``version`` of ``block`` (pushed to it, or pushed by it)."""
        self.has[block] = max(self.has.get(block, -1), version)

    def next_push(
        self,
        deadlines: Mapping[str, float],
        peek: Callable[[str], SolveResult | None],
    ) -> list[SolveResult]:
        """The queued results, the most urgent deadline first (``peek``: a block's newest
        result here), each the block's newest and only if newer than what the peer has."""
        blocks = sorted(self.queued, key=lambda b: (deadlines.get(b, math.inf), b))
        self.queued.clear()
        self.oldest_queued_at = None
        out = []
        for block in blocks:
            result = peek(block)
            if result is None or result.version <= self.has.get(block, -1):
                continue
            if result.shm is not None:
                result = private_result(result)
                if result is None:
                    continue  # overwritten by a newer result: queued again when it lands
            out.append(result)
        return out

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close(grace=None)


@dataclass(frozen=True, kw_only=True)
class PeerDialer:
    """How this daemon opens a channel to a peer's listener."""

    config: SyncConfig
    max_message_bytes: int
    tls_root: bytes | None = None
    #: mutual TLS to peer listeners (the cluster CA and this daemon's certificate), checked
    #: against ``server_name`` rather than the address dialed; None: ``tls_root``
    credentials: grpc.ChannelCredentials | None = None
    server_name: str | None = None

    def stub(self, link: PeerLink) -> ppb_grpc.PeerStub:
        """The link's stub, its channel opened on first use."""
        if link.stub is None:
            options: list[tuple[str, Any]] = [
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.keepalive_time_ms", 5000),
                ("grpc.keepalive_timeout_ms", int(1000 * self.config.call_timeout_s)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", int(1000 * self.config.heartbeat_s * 4)),
            ]
            target = link.address.removeprefix("dns:")
            if self.credentials is not None:
                if self.server_name:
                    options.append(("grpc.ssl_target_name_override", self.server_name))
                link.channel = grpc.aio.secure_channel(target, self.credentials, options=options)
            elif self.tls_root is not None:
                creds = grpc.ssl_channel_credentials(root_certificates=self.tls_root)
                link.channel = grpc.aio.secure_channel(target, creds, options=options)
            else:
                link.channel = grpc.aio.insecure_channel(target, options=options)
            link.stub = ppb_grpc.PeerStub(link.channel)
        return link.stub
