"""The client's side of the shared-memory transport: its segments and the handover connection.

When the daemon is on this host (``unix://`` address) and offers a handover socket in its
``OpenSession`` answer, the daemon source gives every block two segments (``protocol.shm``),
each a slot of an arena (:class:`ClientArena`: many blocks' slots of one size in one memfd, so
that 20,000 blocks take a few descriptors, not 80,000), or, with a daemon that predates arenas,
a memfd of its own:

- a **snapshot segment**, which the daemon source's sender thread (its only writer) fills
  under the seqlock from the pinned host buffer a step's snapshots were packed into
  (``DeviceTransfer.pack``: one device-to-host copy per step and device, not per block);
- a **result segment**, which the daemon's solver worker fills with the block's results; the
  client copies them out under the seqlock when the result's header arrives on the gRPC stream.

Their layout is ``protocol.shm``'s; the handover connection speaks ``protocol.handover``.

Segments belong to the client: they are created once per block, reserved and pre-faulted, and
reused for every snapshot; after a daemon restart the same segments are handed to the new
incarnation. Anything that goes wrong here (no memfd, not enough memory, a refused handover)
raises :class:`SharedMemoryUnavailableError`, and the caller sends that block over gRPC instead.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from asteria_client.transport.peer import UntrustedDaemonError, check_peer
from asteria_server.errors import InvalidInputError
from asteria_server.protocol.handover import (
    MAX_BIND_BLOCKS,
    MAX_BIND_BYTES,
    MAX_MESSAGE_BYTES,
    Attach,
    Bind,
    BlockSlots,
    Detach,
    HandoverRequest,
    Hello,
    SegmentRole,
    SlotBinding,
    decode_reply,
    encode_request,
)
from asteria_server.protocol.shm import (
    HEADER_BYTES,
    ArraySpec,
    Segment,
    SegmentRef,
    SharedMemoryUnavailableError,
    create_arena,
    create_segment,
    result_layout,
    segment_bytes,
    snapshot_layout,
    snapshot_specs,
)
from asteria_server.types import SolveTask

#: The handover connection's timeout for each request.
HANDOVER_TIMEOUT_S = 10.0
#: Bytes a bind request's blocks may take (less room for its envelope).
_BIND_ROOM = MAX_BIND_BYTES - 512


@dataclass(eq=False)
class ClientSegment:
    """A segment this client created, or a slot of one of its arenas: its id, descriptor,
    mapping and purpose."""

    segment_id: str
    fd: int  # a slot's is its arena's (the arena owns it)
    segment: Segment
    role: str  # "snapshot" or "result"
    block: str  # the block's name on the daemon
    arena: ClientArena | None = None  # set for a slot

    @classmethod
    def create(cls, role: str, block: str, specs: Sequence[ArraySpec]) -> ClientSegment:
        fd, segment = create_segment(segment_bytes(specs), name=f"asteria-{role}")
        return cls(uuid.uuid4().hex, fd, segment, role, block)

    def fits(self, specs: Sequence[ArraySpec]) -> bool:
        return segment_bytes(specs) <= self.segment.size_bytes

    def write_snapshot(self, task: SolveTask) -> SegmentRef:
        """Write ``task``'s snapshot (the matrix, then the basis) into this snapshot segment
        under the seqlock, and return the ref that announces it in ``submit(..., shm=ref)``."""
        arrays = [task.matrix] if task.basis is None else [task.matrix, task.basis]
        return self.ref(self.segment.write(snapshot_specs(task), arrays))

    def read(self, specs: Sequence[ArraySpec], sequence: int) -> list[np.ndarray] | None:
        return self.segment.read(specs, sequence)

    def ref(self, sequence: int) -> SegmentRef:
        return SegmentRef(self.segment_id, sequence)

    def close(self) -> None:
        if self.arena is not None:  # a slot: back to its arena, whose descriptor stays
            self.segment.close()
            self.arena.free.append(self.segment.slot_index)
            return
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.segment.close()


@dataclass(eq=False)
class ClientArena:
    """An arena this client created (``protocol.shm.create_arena``): many blocks' slots of one
    size in one memfd, handed over once. ``free`` lists the slots no block holds."""

    segment_id: str
    fd: int
    segment: Segment
    slot_bytes: int
    free: list[int]

    @classmethod
    def create(cls, slot_bytes: int, num_slots: int) -> ClientArena:
        fd, segment = create_arena(slot_bytes, num_slots)
        return cls(uuid.uuid4().hex, fd, segment, slot_bytes, list(range(num_slots - 1, -1, -1)))

    @property
    def num_slots(self) -> int:
        return (self.segment.size_bytes - HEADER_BYTES) // self.slot_bytes

    def take(self, role: str, block: str) -> ClientSegment | None:
        """A free slot as a segment for ``block`` (its id made here), or None when full."""
        if not self.free:
            return None
        index = self.free.pop()
        slot = self.segment.slot(index, self.slot_bytes)
        # Named after the arena (unique per connection) and the slot: short, in every bind.
        return ClientSegment(f"{self.segment_id[:16]}.{index}", self.fd, slot, role, block, self)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.segment.close()


def slot_sizes(task: SolveTask) -> tuple[int, int]:
    """The sizes of ``task``'s block's snapshot and result segments (or slots): the largest
    snapshot at the dtype of its arrays, and the largest result of its kind."""
    itemsize = max(a.dtype.itemsize for a in (task.matrix, task.basis) if a is not None)
    return (
        segment_bytes(snapshot_layout(task.n, task.kind, itemsize)),
        segment_bytes(result_layout(task.n, task.kind)),
    )


def segments_for(task: SolveTask) -> tuple[ClientSegment, ClientSegment]:
    """A block's snapshot and result segments, sized for the largest snapshot (at the dtype of
    ``task``'s arrays) and the largest result of its kind. Raises
    SharedMemoryUnavailableError when they cannot be made here."""
    itemsize = max(a.dtype.itemsize for a in (task.matrix, task.basis) if a is not None)
    snapshot = snapshot_layout(task.n, task.kind, itemsize)
    snap = ClientSegment.create("snapshot", task.block, snapshot)
    try:
        result = ClientSegment.create("result", task.block, result_layout(task.n, task.kind))
    except BaseException:
        snap.close()
        raise
    return snap, result


class HandoverChannel:
    """One connection to the daemon's handover socket, bound to one session."""

    def __init__(self, path: str, session_id: str, *, timeout_s: float = HANDOVER_TIMEOUT_S):
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise SharedMemoryUnavailableError(
                f"cannot connect to the daemon's handover socket {path}: {exc}"
            ) from None
        try:
            check_peer(sock, path)  # no segment goes to a process of an unexpected user
        except UntrustedDaemonError as exc:
            sock.close()
            raise SharedMemoryUnavailableError(str(exc)) from None
        self._sock = sock
        try:
            self._request(Hello(session_id), [])
        except BaseException:
            sock.close()
            raise

    def attach(self, seg: ClientSegment) -> None:
        """Hand ``seg`` over (again); raises SharedMemoryUnavailableError when refused."""
        request = Attach(seg.segment_id, seg.segment.size_bytes, SegmentRole(seg.role), seg.block)
        self._request(request, [seg.fd])

    def attach_arena(self, arena: ClientArena) -> None:
        """Hand ``arena`` over (again); raises SharedMemoryUnavailableError when refused (a
        daemon that predates arenas refuses the role)."""
        request = Attach(
            arena.segment_id,
            arena.segment.size_bytes,
            SegmentRole.ARENA,
            slot_bytes=arena.slot_bytes,
        )
        self._request(request, [arena.fd])

    def bind(self, pairs: Sequence[Sequence[ClientSegment]]) -> tuple[set[str], list[str]]:
        """Bind each block's slots (a pair of one block, in arenas handed over before), a few
        hundred blocks a request; the blocks bound, and the daemon's refusals (a refused
        request binds none of its blocks). Raises SharedMemoryUnavailableError when the
        connection fails."""
        bound: set[str] = set()
        errors: list[str] = []
        batch: list[BlockSlots] = []
        size = 0
        for pair in pairs:
            entry = BlockSlots(
                pair[0].block,
                tuple(
                    SlotBinding(
                        s.segment_id,
                        s.arena.segment_id if s.arena is not None else "",
                        s.segment.slot_index,
                        SegmentRole(s.role),
                    )
                    for s in pair
                ),
            )
            cost = (
                len(entry.block.encode())
                + sum(len(b.segment_id) + len(b.arena_id) + 32 for b in entry.slots)
                + 8
            )
            if batch and (size + cost > _BIND_ROOM or len(batch) >= MAX_BIND_BLOCKS):
                self._bind_batch(batch, bound, errors)
                batch, size = [], 0
            batch.append(entry)
            size += cost
        if batch:
            self._bind_batch(batch, bound, errors)
        return bound, errors

    def _bind_batch(self, batch: list[BlockSlots], bound: set[str], errors: list[str]) -> None:
        try:
            self._request(Bind(tuple(batch)), [])
        except SharedMemoryUnavailableError as exc:
            if not self.alive():
                raise
            errors.append(str(exc))
            return
        bound.update(entry.block for entry in batch)

    def detach(self, seg: ClientSegment) -> None:
        self._request(Detach(seg.segment_id), [])

    def _request(self, request: HandoverRequest, fds: list[int]) -> None:
        try:
            socket.send_fds(self._sock, [encode_request(request)], fds)
            answer = decode_reply(self._sock.recv(MAX_MESSAGE_BYTES))
        except (OSError, InvalidInputError) as exc:
            raise SharedMemoryUnavailableError(f"segment handover failed: {exc}") from None
        if not answer.ok:
            raise SharedMemoryUnavailableError(f"the daemon refused the segment: {answer.error}")

    def alive(self) -> bool:
        """False once the daemon closed this connection (it then dropped its mappings)."""
        try:
            poller = select.poll()
            poller.register(self._sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            events = poller.poll(0)
            if not events:
                return True
            if events[0][1] & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                return False
            return self._sock.recv(1, socket.MSG_PEEK) != b""  # readable: data, or end of file
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self._sock.close()
