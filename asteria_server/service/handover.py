"""The daemon's end of the shared-memory transport: a Unix socket where clients hand over segments.

The sub-protocol spoken there (messages, versions) is specified in
:mod:`asteria_server.protocol.handover`; this module serves it. A client on the same host connects,
names its gRPC session (``Hello``), then hands over memfd segments (``Attach``, one descriptor each)
and may ``Detach`` them. Most clients hand over *arenas* instead (``Attach`` with role ``arena``):
one memfd of many slots, each then *bound* (``Bind``) to a block's snapshot or result and named by
the gRPC calls like a segment. A mapping (segment or arena) holds two descriptors and counts
against ``max_segments``; a slot holds none (it views its arena's mapping) and counts against
:data:`MAX_SLOTS_PER_CONNECTION`, so a client's 20,000 blocks take a few dozen mappings.
``protocol.shm.map_segment`` checks each segment's seals and size before
it is mapped, and the mapping keeps a descriptor of it: the solver workers are handed that
descriptor and read snapshots from, and write results into, the client's segments themselves.

A connection's segments live as long as the connection: when the client exits, even by
``kill -9``, the socket closes and the daemon drops its mappings and descriptors (a task still
queued keeps its segment until it is done), and with the client's descriptors gone the kernel
frees the memory. The socket sits next to the gRPC socket, in the same 0700 directory, with mode
0600. Each connection is served by its own thread; the servicer reads segments from the event
loop through :meth:`SegmentHandover.segment` and :meth:`SegmentHandover.result_segment`, under one
lock.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from asteria_server.errors import InvalidInputError
from asteria_server.protocol.handover import (
    MAX_BIND_BYTES,
    Attach,
    Bind,
    Detach,
    HandoverRequest,
    Hello,
    Reply,
    SegmentRole,
    SlotBinding,
    Ticket,
    decode_request,
    encode_reply,
)
from asteria_server.protocol.shm import HEADER_BYTES, Segment, map_segment
from asteria_server.service.descriptors import SEGMENT_FDS
from asteria_server.service.limits import CallerTickets, FdBudget

logger = logging.getLogger(__name__)

#: ``struct ucred`` as SO_PEERCRED gives it: pid, uid, gid.
_UCRED = struct.Struct("3i")


#: Arena slots one connection may bind (each is a small object in the daemon; a training
#: process has two per block over shared memory).
MAX_SLOTS_PER_CONNECTION = 1 << 18
#: A handover message renews its session's lease at most this often (each renewal is a call
#: onto the event loop, and a client binding 20,000 blocks sends many messages).
TOUCH_EVERY_S = 1.0


@dataclass(eq=False)
class _Arena:
    """An arena a connection handed over: its slot size and which slot ids are bound where."""

    slot_bytes: int
    #: slot index -> the segment id bound there (None: free). A list of the arena's slots, not
    #: a dict of the bound ones: 8 bytes a slot, where a dict entry and its int key were ~100.
    bound: list[str | None]
    #: slot index -> the block whose result slot it is (None: not a result slot). Beside
    #: ``bound`` for the same reason: a connection-wide dict of result slot id -> block held
    #: ~70 bytes a block.
    result_of: list[str | None]

    @classmethod
    def of(cls, mapping: Segment, slot_bytes: int) -> _Arena:
        slots = (mapping.size_bytes - HEADER_BYTES) // slot_bytes
        return cls(slot_bytes, [None] * slots, [None] * slots)


@dataclass(eq=False)
class _Connection:
    """One client's handover connection and the segments it handed over.

    ``mappings`` are what the daemon maps (segments and arenas: each holds descriptors and
    counts against ``max_segments``); ``segments`` are what calls name (segments and arena
    slots bound to a block)."""

    sock: socket.socket
    session_id: str = ""
    tenant: str | None = None  # charged for the connection's descriptors once it said hello
    mappings: dict[str, Segment] = field(default_factory=dict)
    arenas: dict[str, _Arena] = field(default_factory=dict)
    #: an arena's token (its slots' too) -> the arena: how a bound slot finds its arena. (A
    #: table of slot id -> (arena id, index) held a tuple and a copy of the arena id per slot.)
    arena_of: dict[int, _Arena] = field(default_factory=dict)
    segments: dict[str, Segment] = field(default_factory=dict)
    slots: int = 0  # how many of ``segments`` are arena slots
    results: dict[str, str] = field(default_factory=dict)  # block -> segment id
    #: result segment id -> block, for whole result segments (a result slot's block is in its
    #: arena's ``result_of``)
    result_of: dict[str, str] = field(default_factory=dict)
    mapped_bytes: int = 0
    touched_at: float = -math.inf  # when a message last renewed the session's lease

    def forget(self, segment_id: str) -> tuple[list[Segment], int]:
        """Drop ``segment_id`` (a segment, an arena with every slot bound in it, or a slot):
        the segments no longer served, and how many mappings went. Under the handover's lock."""
        released: list[Segment] = []
        mapping = self.mappings.pop(segment_id, None)
        if mapping is not None:
            self.mapped_bytes -= mapping.size_bytes
            arena = self.arenas.pop(segment_id, None)
            if arena is not None:
                for slot_id in [slot_id for slot_id in arena.bound if slot_id is not None]:
                    released += self._unbind(slot_id)
                del self.arena_of[mapping.token]
        released += self._unbind(segment_id)
        return released, int(mapping is not None)

    def is_slot(self, segment_id: str) -> bool:
        segment = self.segments.get(segment_id)
        return segment is not None and segment.slot_index >= 0

    def _unbind(self, segment_id: str) -> list[Segment]:
        segment = self.segments.pop(segment_id, None)
        block = self.result_of.pop(segment_id, None)
        if segment is not None and segment.slot_index >= 0:
            self.slots -= 1
            arena = self.arena_of.get(segment.token)
            if arena is not None and arena.bound[segment.slot_index] == segment_id:
                arena.bound[segment.slot_index] = None
                block = arena.result_of[segment.slot_index]
                arena.result_of[segment.slot_index] = None
        if block is not None and self.results.get(block) == segment_id:
            del self.results[block]
        return [] if segment is None else [segment]

    def mark_result(self, segment_id: str, block: str | None) -> None:
        """Note (or, with None, forget) that the bound segment ``segment_id`` is ``block``'s
        result segment: in its arena's list when it is a slot."""
        segment = self.segments.get(segment_id)
        index = -1 if segment is None else segment.slot_index
        arena = None if segment is None or index < 0 else self.arena_of.get(segment.token)
        if arena is not None:
            arena.result_of[index] = block
        elif block is None:
            self.result_of.pop(segment_id, None)
        else:
            self.result_of[segment_id] = block

    def clear(self) -> tuple[list[Segment], int]:
        """Drop everything: the segments no longer served and the mappings that went."""
        released, mappings = list(self.segments.values()), len(self.mappings)
        self.mappings.clear()
        self.arenas.clear()
        self.arena_of.clear()
        self.segments.clear()
        self.slots = 0
        self.results.clear()
        self.result_of.clear()
        self.mapped_bytes = 0
        return released, mappings


class SegmentHandover:
    """Accepts segment handovers on ``path`` (see the module docstring).

    Args:
        path: the socket path (its directory exists, mode 0700).
        is_session: whether a session id names an open session.
        max_segments: segments and arenas one connection may hold (each is one mapping and two
            descriptors in the daemon); an arena's slots count only against
            :data:`MAX_SLOTS_PER_CONNECTION`.
        max_mapped_bytes: bytes one connection may have mapped.
        mode: the socket's file mode (0600; 0660 when the daemon's group may connect).
        on_release: told the segments the daemon stops serving (detached, replaced, or their
            connection closed), so that nothing keeps a gone client's memory mapped
            (``PreconditionerEngine.release_shared``); called from a connection's thread.
        tenant_of: the tenant of an open session (None when it is not open); with it every
            message renews the session (``touch``).
        touch: renews a session's lease (called from a connection's thread).
        fds: the descriptor budget: each connection and each segment holds one descriptor in
            the daemon, counted per tenant and in total; beyond it a connection is closed at
            once or a segment refused, with the reason.
    """

    def __init__(
        self,
        path: Path,
        *,
        is_session: Callable[[str], bool],
        max_segments: int = 4096,
        max_mapped_bytes: int = 64 << 30,
        max_slots: int = MAX_SLOTS_PER_CONNECTION,
        mode: int = 0o600,
        on_release: Callable[[list[Segment]], None] | None = None,
        tenant_of: Callable[[str], str | None] | None = None,
        touch: Callable[[str], None] | None = None,
        fds: FdBudget | None = None,
        tickets: CallerTickets | None = None,
    ) -> None:
        self.path = path
        #: issues the caller tickets the authentication throttle keys Unix-socket callers by
        self.tickets = tickets
        self._tenant_of = tenant_of
        self._touch = touch
        self.fds = fds if fds is not None else FdBudget(1 << 30, 1 << 30)
        self._on_release = on_release
        self._mode = mode
        self._is_session = is_session
        self._max_segments = max_segments
        self._max_mapped_bytes = max_mapped_bytes
        self._max_slots = max_slots
        self._lock = threading.Lock()
        self._by_session: dict[str, _Connection] = {}
        self._connections: set[_Connection] = set()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by a daemon that died; the caller holds the lock
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, self._mode)
        listener.listen(64)
        self._listener = listener
        thread = threading.Thread(target=self._accept_loop, name="asteria-handover", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        """Stop accepting, close every connection, drop every segment, remove the socket."""
        with self._lock:
            self._stopping = True
            connections = list(self._connections)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5.0)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    # ------------------------------------------------------------------ for the servicer
    def segment(self, session_id: str, segment_id: str) -> Segment:
        """The session's segment ``segment_id``; InvalidInputError when it has none such."""
        with self._lock:
            conn = self._by_session.get(session_id)
            segment = None if conn is None else conn.segments.get(segment_id)
        if segment is None:
            raise InvalidInputError(
                f"shared-memory segment {segment_id!r} was not handed over in this session; "
                "hand it over on the daemon's shm_socket first (or send the snapshot in chunks)"
            )
        return segment

    def result_segment(self, session_id: str, block: str) -> tuple[str, Segment] | None:
        """The segment that receives ``block``'s results in this session, with its id."""
        with self._lock:
            conn = self._by_session.get(session_id)
            segment_id = None if conn is None else conn.results.get(block)
            if conn is None or segment_id is None:
                return None
            return segment_id, conn.segments[segment_id]

    def drop_session(self, session_id: str) -> None:
        """Forget the session's segments (CloseSession); its connection is closed."""
        with self._lock:
            conn = self._by_session.pop(session_id, None)
            released, mappings = ([], 0) if conn is None else conn.clear()
        self._release(released)
        if conn is not None:
            self.fds.release(conn.tenant, mappings * SEGMENT_FDS)
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "descriptors": self.fds.used,
                "connections": len(self._connections),
                "segments": sum(len(c.mappings) for c in self._connections),
                "slots": sum(c.slots for c in self._connections),
                "mapped_bytes": sum(c.mapped_bytes for c in self._connections),
            }

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._stopping or exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                    return  # the listener was closed: stopping
                # Out of descriptors for a moment: the connection waits in the backlog.
                logger.warning("handover socket cannot accept a connection now: %s", exc)
                time.sleep(0.1)
                continue
            why = self.fds.acquire(None)
            if why is not None:
                with contextlib.suppress(OSError):
                    sock.send(encode_reply(Reply(False, why)))
                sock.close()
                continue
            conn = _Connection(sock)
            with self._lock:
                if self._stopping:
                    sock.close()
                    self.fds.release(None)
                    return
                self._connections.add(conn)
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="asteria-handover-conn", daemon=True
            )
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _serve(self, conn: _Connection) -> None:
        try:
            while True:
                try:
                    data, fds, flags, _ = socket.recv_fds(conn.sock, MAX_BIND_BYTES, 1)
                except OSError:
                    return
                if not data and not fds:
                    return  # the client closed (or was killed)
                try:
                    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                        raise InvalidInputError(
                            "handover message too long or with more than one descriptor"
                        )
                    answer = self._handle(conn, decode_request(data), fds)
                except InvalidInputError as exc:
                    answer = Reply(False, str(exc))
                except Exception as exc:  # one bad request never takes the connection down
                    logger.exception("a segment handover request failed")
                    answer = Reply(False, f"the daemon could not serve this request: {exc}")
                finally:
                    for fd in fds:
                        os.close(fd)  # refused, or mapped with a descriptor of its own
                with contextlib.suppress(OSError):
                    conn.sock.send(encode_reply(answer))
        finally:
            with self._lock:
                self._connections.discard(conn)
                if self._by_session.get(conn.session_id) is conn:
                    del self._by_session[conn.session_id]
                released, mappings = conn.clear()  # the mappings go with the last reference
            self._release(released)
            self.fds.release(conn.tenant, mappings * SEGMENT_FDS)
            conn.sock.close()
            self.fds.release(conn.tenant)  # the connection's own descriptor
            logger.debug("handover connection of session %s closed", conn.session_id or "-")

    def _handle(self, conn: _Connection, request: HandoverRequest, fds: list[int]) -> Reply:
        if isinstance(request, Ticket):
            if fds:
                raise InvalidInputError("a ticket request carries no descriptor")
            if self.tickets is None:
                raise InvalidInputError("this daemon issues no caller tickets")
            creds = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            pid, uid, _ = _UCRED.unpack(creds)
            return Reply(True, ticket=self.tickets.issue(uid, pid))
        self._handle_segments(conn, request, fds)
        return Reply(True)

    def _handle_segments(
        self, conn: _Connection, request: Hello | Attach | Detach | Bind, fds: list[int]
    ) -> None:
        if isinstance(request, Hello):
            if conn.session_id or not self._is_session(request.session_id):
                raise InvalidInputError(
                    f"unknown session {request.session_id!r} (or hello sent twice)"
                )
            tenant = self._tenant_of(request.session_id) if self._tenant_of else None
            if tenant is not None:
                why = self.fds.charge(tenant)
                if why is not None:
                    raise InvalidInputError(why)
            with self._lock:
                conn.session_id = request.session_id
                conn.tenant = tenant
                self._by_session[request.session_id] = conn
            return
        if not conn.session_id:
            raise InvalidInputError("the first handover message must be hello with a session_id")
        now = time.monotonic()
        if self._touch is not None and now - conn.touched_at >= TOUCH_EVERY_S:
            conn.touched_at = now  # a lease lasts far longer; one renewal a second is plenty
            self._touch(conn.session_id)
        if isinstance(request, Bind):
            self._bind(conn, request)
            return
        segment_id = request.segment_id
        if isinstance(request, Detach):
            with self._lock:
                released, mappings = conn.forget(segment_id)
            self._release(released)
            self.fds.release(conn.tenant, mappings * SEGMENT_FDS)
            return
        assert isinstance(request, Attach)
        if len(fds) != 1:
            raise InvalidInputError("attach needs exactly one descriptor (SCM_RIGHTS)")
        size = request.size_bytes
        arena = request.role is SegmentRole.ARENA
        if arena and (
            request.slot_bytes < HEADER_BYTES
            or request.slot_bytes % mmap.PAGESIZE
            or (size - HEADER_BYTES) % request.slot_bytes
            or size <= HEADER_BYTES
        ):
            raise InvalidInputError(
                f"arena {segment_id!r} of {size} bytes cannot hold whole slots of "
                f"{request.slot_bytes} bytes (whole pages, after a {HEADER_BYTES}-byte header)"
            )
        with self._lock:
            old = conn.mappings.get(segment_id)
            held = len(conn.mappings) - (old is not None)
            mapped = conn.mapped_bytes - (old.size_bytes if old is not None else 0)
        if held + 1 > self._max_segments or mapped + size > self._max_mapped_bytes:
            raise InvalidInputError(
                f"this connection would hold more than {self._max_segments} segments or "
                f"{self._max_mapped_bytes} bytes; send further blocks in chunks"
            )
        why = self.fds.acquire(conn.tenant, SEGMENT_FDS)  # the fd kept and mmap's own
        if why is not None:
            raise InvalidInputError(f"segment {segment_id!r} refused: {why}")
        try:
            segment = map_segment(fds[0], size, keep_fd=True, arena=arena)
        except BaseException as exc:
            self.fds.release(conn.tenant, SEGMENT_FDS)
            if isinstance(exc, OSError):
                raise InvalidInputError(_map_failure(segment_id, exc)) from None
            raise
        with self._lock:
            released, mappings = conn.forget(segment_id)
            conn.mappings[segment_id] = segment
            conn.mapped_bytes += segment.size_bytes
            if arena:
                conn.arenas[segment_id] = conn.arena_of[segment.token] = _Arena.of(
                    segment, request.slot_bytes
                )
            else:
                conn.segments[segment_id] = segment
                if request.role is SegmentRole.RESULT:
                    self._bind_result_locked(conn, request.block, segment_id)
        self._release(released)
        self.fds.release(conn.tenant, mappings * SEGMENT_FDS)

    @staticmethod
    def _bind_result_locked(conn: _Connection, block: str, segment_id: str) -> None:
        old = conn.results.get(block)
        if old is not None:
            conn.mark_result(old, None)
        conn.results[block] = segment_id
        conn.mark_result(segment_id, block)

    def _bind(self, conn: _Connection, request: Bind) -> None:
        """Bind blocks' slots in arenas of this connection (all checked before any is bound).

        The slots are made and checked without the lock, which the event loop takes for every
        announced snapshot: a bind of a thousand blocks must not hold it up. (Only this
        connection's thread changes its arenas and bindings; a connection dropped meanwhile
        is cleared again by that thread on its way out.)"""
        slots = [
            (entry.block, binding, *self._slot_of(conn, entry.block, binding))
            for entry in request.blocks
            for binding in entry.slots
        ]
        with self._lock:
            fresh = sum(not conn.is_slot(binding.segment_id) for _, binding, _, _ in slots)
            if conn.slots + fresh > self._max_slots:
                raise InvalidInputError(
                    f"block {request.blocks[0].block!r} and the rest of this bind: the connection "
                    f"would bind more than {self._max_slots} arena slots; send further blocks in "
                    "chunks"
                )
            released: list[Segment] = []
            for block, binding, arena, slot in slots:
                if conn.arenas.get(binding.arena_id) is not arena:
                    continue  # the arena went meanwhile (detached, or the connection dropped)
                released += conn._unbind(binding.segment_id)
                previous = arena.bound[binding.index]
                if previous is not None:
                    released += conn._unbind(previous)
                arena.bound[binding.index] = binding.segment_id
                conn.segments[binding.segment_id] = slot
                conn.slots += 1
                if binding.role is SegmentRole.RESULT:
                    self._bind_result_locked(conn, block, binding.segment_id)
        self._release(released)

    @staticmethod
    def _slot_of(conn: _Connection, block: str, binding: SlotBinding) -> tuple[_Arena, Segment]:
        """The arena and the checked slot ``binding`` names (InvalidInputError naming the block
        otherwise)."""
        arena = conn.arenas.get(binding.arena_id)
        mapping = conn.mappings.get(binding.arena_id)
        if arena is None or mapping is None:
            raise InvalidInputError(
                f"block {block!r}: arena {binding.arena_id!r} was not handed over on this "
                "connection; attach it first"
            )
        if binding.segment_id in conn.mappings:
            raise InvalidInputError(
                f"block {block!r}: slot id {binding.segment_id!r} names a handed-over segment "
                "or arena"
            )
        try:
            return arena, mapping.slot(binding.index, arena.slot_bytes)
        except InvalidInputError as exc:
            raise InvalidInputError(f"block {block!r}: arena {binding.arena_id!r}: {exc}") from None

    def _release(self, segments: list[Segment]) -> None:
        if segments and self._on_release is not None:
            try:
                self._on_release(segments)
            except Exception:  # the engine's trouble must not take the handover down
                logger.exception("releasing %d shared-memory segments failed", len(segments))


def _map_failure(segment_id: str, exc: OSError) -> str:
    """Why a handed-over descriptor could not be mapped, for the client."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"segment {segment_id!r} cannot be mapped for reading and writing ({exc.strerror}): "
            "it is read-only or sealed against writes (F_SEAL_WRITE); hand over a writable "
            "memfd sealed against resizing only"
        )
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return (
            f"segment {segment_id!r} refused: the daemon is out of file descriptors "
            f"({exc.strerror}); send further blocks in chunks"
        )
    return f"segment {segment_id!r} cannot be mapped: {exc.strerror or exc}"
