"""Receiving a peer's PushResults stream under the rules a client's upload lives by.

A push is another daemon's results for blocks its job's ranks use here. It gets nothing a
client's SubmitSnapshot does not get:

- **Checked before anything is allocated.** Each result's header is checked first (the job's
  tenant and namespace, no shared memory, the block's size and kind as its own ranks submit it,
  a version within ``MAX_VERSION`` and at most ``MAX_VERSION_JUMP`` past the block's newest
  here, float32 arrays as every result has) by :func:`check_header`, which reads the header
  only; the arrays are allocated (by the framing's receiver) only after that, and once the
  upload budget holds their announced bytes.
- **In the upload budget.** A result being received holds its announced bytes in the daemon's
  upload budget (the tenant's share of it, as a client's upload does) from its header to its
  last chunk, so the daemon's memory budget and ``upload_bytes_in_flight`` see it; a push that
  finds no room within ``wait_s`` fails RESOURCE_EXHAUSTED and the peer pushes again later.
- **Timed out.** Every message must come within ``idle_s`` of the one before, and the whole
  stream within ``max_s``: a stalled push holds nothing for long (the client upload's
  ``upload_idle_s`` and ``upload_max_s``).
- **Validated as a local result.** A complete result must be finite.

A result of a block its ranks do not use here (yet) is skipped chunk by chunk, never assembled.
One tenant may have at most ``tenant_max_push_streams`` pushes open on a daemon at once (the
manager counts them): stalled pushes of blocks nobody uses hold no budget, but a stream each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from asteria_server.errors import DaemonBusyError, InvalidInputError
from asteria_server.protocol import convert
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.types import MAX_VERSION, MAX_VERSION_JUMP, SolveKind


@dataclass(frozen=True, kw_only=True)
class PushTimeouts:
    """How long a push may wait for room in the upload budget, between two messages, in all
    (seconds: the daemon's upload_wait_s, upload_idle_s, upload_max_s)."""

    wait_s: float = 5.0
    idle_s: float = 30.0
    max_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("wait_s", "idle_s", "max_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"PushTimeouts.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class BlockUse:
    """How this daemon's ranks use a block: its size, its kind, its newest version here."""

    n: int
    kind: SolveKind | None
    newest_version: int


def check_header(
    header: pb.ResultHeader, *, tenant: str, prefix: str, job: str, use: BlockUse | None
) -> bool:
    """Whether a pushed result announced by ``header`` is for a block used here (False: skip
    it); InvalidInputError naming the block and what is wrong when it cannot be kept at all.
    Reads the header only."""
    block = header.block[:128]
    what = f"PushResults: result of block {block!r} version {header.version}"
    if header.tenant != tenant or not header.block.startswith(prefix):
        raise InvalidInputError(f"{what}: not a block of job {job!r}")
    if header.HasField("shm"):
        raise InvalidInputError(f"{what}: a push carries its arrays in chunks, not in a segment")
    if not 0 <= header.version <= MAX_VERSION:
        raise InvalidInputError(f"{what}: the version is not in 0..{MAX_VERSION}")
    if use is None:
        return False
    if use.newest_version >= 0 and header.version - use.newest_version > MAX_VERSION_JUMP:
        raise InvalidInputError(
            f"{what}: the version jumps more than {MAX_VERSION_JUMP} past the block's newest "
            f"version here ({use.newest_version}); versions are optimizer steps"
        )
    if header.n != use.n:
        raise InvalidInputError(f"{what}: n={header.n}, but its ranks here use n={use.n}")
    for name in ("matrix", "eigenvalues", "rotation"):
        if header.HasField(name) and getattr(header, name).dtype != pb.DTYPE_FLOAT32:
            raise InvalidInputError(f"{what}: its {name} is not float32, as every result is")
    kind = convert.kind_from_proto(header.kind, what=what)
    if use.kind is not None and kind is not use.kind:
        raise InvalidInputError(
            f"{what}: its kind is {kind.value}, but its ranks here need {use.kind.value}"
        )
    return True


class PushStream:
    """A push's messages, each within ``idle_s`` of the last and all within ``max_s``."""

    def __init__(
        self,
        requests: AsyncIterator[ppb.PushResultsRequest],
        timeouts: PushTimeouts,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._requests = requests
        self._timeouts = timeouts
        self._clock = clock
        self._started = clock()
        #: serialized bytes of the frames read so far (what a peer's bytes_sent counts)
        self.frame_bytes = 0
        self.last_frame_bytes = 0

    async def next_request(self) -> ppb.PushResultsRequest | None:
        timeouts = self._timeouts
        left = timeouts.max_s - (self._clock() - self._started)
        wait = max(0.0, min(timeouts.idle_s, left))
        try:
            async with asyncio.timeout(wait):
                return await anext(self._requests, None)
        except TimeoutError:
            why = (
                f"took longer than {timeouts.max_s:g} s (upload_max_s)"
                if wait < timeouts.idle_s
                else f"sent nothing for {timeouts.idle_s:g} s (upload_idle_s)"
            )
            raise DaemonBusyError(
                f"PushResults: the push {why}; the daemon dropped it and freed its share of the "
                "upload budget"
            ) from None

    async def next_frame(self) -> pb.StreamResultsResponse | None:
        """The next frame (None at the stream's end)."""
        request = await self.next_request()
        if request is None:
            return None
        if request.WhichOneof("part") != "frame":
            raise InvalidInputError("PushResults: only frames may follow the hello")
        self.last_frame_bytes = len(request.frame)
        self.frame_bytes += self.last_frame_bytes
        return pb.StreamResultsResponse.FromString(request.frame)

    async def skip(self, num_bytes: int, what: str) -> None:
        """Read and drop the chunks of one result (``num_bytes`` of arrays)."""
        while num_bytes > 0:
            frame = await self.next_frame()
            if frame is None or frame.WhichOneof("part") != "chunk":
                raise InvalidInputError(f"{what}: the stream ended or moved on inside a result")
            num_bytes -= len(frame.chunk)
        if num_bytes < 0:
            raise InvalidInputError(f"{what}: its chunks hold more bytes than announced")
