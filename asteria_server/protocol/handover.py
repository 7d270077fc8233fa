"""The segment-handover sub-protocol spoken on the daemon's ``<socket>.shm`` Unix socket.

Shared memory needs one thing gRPC cannot carry: a file descriptor. So a client on the daemon's
host opens a second connection, a ``SOCK_SEQPACKET`` Unix socket (every message keeps its
boundaries), and hands its memfd segments (``protocol.shm``) over there, one descriptor per
message as ``SCM_RIGHTS``. The gRPC calls then only name the segments. Both ends of that socket
(``asteria_server.service.handover`` and the client's ``transport.shm``) speak it through this
module only.

Every message is a UTF-8 JSON object of at most :data:`MAX_MESSAGE_BYTES` bytes carrying
``"v": HANDOVER_VERSION``; every request gets exactly one :class:`Reply`. Requests:

====================  =========================================================================
``hello``             ``{"v", "op": "hello", "session_id"}``: binds the connection to an open
                      gRPC session. Must come first, once.
``attach`` (+1 fd)    ``{"v", "op": "attach", "segment_id", "size_bytes", "role", "block"}``:
                      map the segment (sealed, of exactly ``size_bytes``). ``role`` is
                      ``snapshot`` (the client writes snapshots there) or ``result`` (the
                      daemon's solver writes block ``block``'s results there). Re-attaching an
                      id replaces the segment.

Reply: ``{"v", "ok": true}`` (``ticket`` added for a ticket) or ``{"v", "ok": false, "error":
"..."}``. A message of another
=======
``detach``            ``{"v", "op": "detach", "segment_id"}``: forget a segment (an arena:
                      and every slot bound in it).
``attach`` an arena   ``{"v", "op": "attach", "segment_id", "size_bytes", "role": "arena",
(+1 fd)               "slot_bytes"}``: map an arena (``protocol.shm.create_arena``) of slots of
                      ``slot_bytes`` each; it holds nothing until slots are bound.
``bind``              ``{"v", "op": "bind", "blocks": [[block, [[segment_id, arena_id, index,
                      role], ...]], ...]}``: for each block, slot ``index`` of the session's arena
                      ``arena_id`` is segment ``segment_id`` from now on (one or two a block: its
                      snapshot and result slots), with ``role`` snapshot or result as for
                      ``attach``. Many blocks a message (up to :data:`MAX_BIND_BYTES`), all
                      checked before any is bound. Rebinding an id or a slot replaces the old
                      binding.
``ticket``            ``{"v", "op": "ticket"}``: a caller ticket (before ``hello``, or without
                      one). The daemon reads the connecting process's credentials
                      (``SO_PEERCRED``) and answers ``{"v", "ok": true, "ticket"}``; the client
                      names that ticket in OpenSession and CloseSession, so that over the Unix
                      socket (where gRPC tells the daemon nothing of its callers) failed
                      authentications are throttled per calling process, and one tenant's
                      guesses cannot lock another tenant's processes out. A daemon that
                      predates it refuses the op; the client then goes without.
====================  =========================================================================

Arenas and ``bind`` came later than the rest: a daemon that predates them refuses an arena's
``attach`` (role) and ``bind`` (op) with an error, and its client goes back to one segment per
block (see ``asteria_client.transport.segments``). Once bound, a slot is named in gRPC calls by
its ``segment_id`` like any segment, so the gRPC side did not change.

Reply: ``{"v", "ok": true}`` (``ticket`` added for a ticket) or ``{"v", "ok": false, "error":
"..."}``. A message of another
version is refused with an error naming both versions (and a reply the peer cannot decode as
the version it speaks is its cue to upgrade or fall back to gRPC): bump :data:`HANDOVER_VERSION`
whenever a field changes meaning.
"""

from __future__ import annotations

import enum
import json
import sys
from dataclasses import dataclass
from typing import Any

from asteria_server.errors import InvalidInputError

#: The version of this sub-protocol; both ends send it in every message.
HANDOVER_VERSION = 1
#: Largest handover message, either way, but a bind.
MAX_MESSAGE_BYTES = 4096
#: Largest bind message (many blocks' slots: one message per few hundred blocks, not one a block,
#: since a daemon's handover thread competes for the GIL with its event loop). A daemon reads
#: requests of up to this many bytes.
MAX_BIND_BYTES = 1 << 16
#: Most blocks in one bind message.
MAX_BIND_BLOCKS = 1024


class SegmentRole(enum.Enum):
    """What a handed-over segment is for."""

    SNAPSHOT = "snapshot"
    RESULT = "result"
    ARENA = "arena"  # many slots, each bound to a block's snapshot or result by Bind


@dataclass(frozen=True)
class Hello:
    """Bind the connection to the gRPC session ``session_id``."""

    session_id: str


@dataclass(frozen=True)
class Attach:
    """Map the segment whose descriptor comes with this message."""

    segment_id: str
    size_bytes: int
    role: SegmentRole
    block: str = ""  # the block whose results a RESULT segment receives
    slot_bytes: int = 0  # an ARENA's slot size


@dataclass(frozen=True)
class SlotBinding:
    """Slot ``index`` of arena ``arena_id`` serves as segment ``segment_id`` (role SNAPSHOT or
    RESULT)."""

    segment_id: str
    arena_id: str
    index: int
    role: SegmentRole


@dataclass(frozen=True)
class BlockSlots:
    """A block's slots (its snapshot and/or result slot) in arenas handed over before."""

    block: str
    slots: tuple[SlotBinding, ...]


@dataclass(frozen=True)
class Bind:
    """Bind many blocks' slots in one request."""

    blocks: tuple[BlockSlots, ...]


@dataclass(frozen=True)
class Detach:
    """Forget segment ``segment_id``."""

    segment_id: str


@dataclass(frozen=True)
class Ticket:
    """Ask for a caller ticket (see the module)."""


HandoverRequest = Hello | Attach | Detach | Bind | Ticket


@dataclass(frozen=True)
class Reply:
    """The answer to one request."""

    ok: bool
    error: str = ""
    ticket: str = ""  # the answer to a Ticket request


def _encode(fields: dict[str, Any], limit: int = MAX_MESSAGE_BYTES) -> bytes:
    data = json.dumps({"v": HANDOVER_VERSION, **fields}, separators=(",", ":")).encode()
    if len(data) > limit:
        raise InvalidInputError(
            f"handover message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES} (a block name "
            "that long cannot use shared memory)"
        )
    return data


def _decode(data: bytes, what: str) -> dict[str, Any]:
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise InvalidInputError(f"a handover {what} must be a JSON object") from None
    if not isinstance(message, dict):
        raise InvalidInputError(f"a handover {what} must be a JSON object")
    version = message.get("v")
    if version != HANDOVER_VERSION:
        raise InvalidInputError(
            f"handover {what} of protocol version {version!r}; this side speaks version "
            f"{HANDOVER_VERSION} (upgrade the older of client and daemon)"
        )
    return message


def _str(message: dict[str, Any], key: str, *, required: bool = True) -> str:
    value = message.get(key, "")
    if not isinstance(value, str) or (required and not value):
        raise InvalidInputError(f"handover {message.get('op')!r} needs a non-empty string {key}")
    return value


def encode_request(request: HandoverRequest) -> bytes:
    """The bytes of ``request`` on the socket."""
    if isinstance(request, Hello):
        return _encode({"op": "hello", "session_id": request.session_id})
    if isinstance(request, Attach):
        fields = {
            "op": "attach",
            "segment_id": request.segment_id,
            "size_bytes": request.size_bytes,
            "role": request.role.value,
            "block": request.block,
        }
        if request.role is SegmentRole.ARENA:
            fields["slot_bytes"] = request.slot_bytes
        return _encode(fields)
    if isinstance(request, Bind):
        blocks = [
            [entry.block, [[b.segment_id, b.arena_id, b.index, b.role.value] for b in entry.slots]]
            for entry in request.blocks
        ]
        return _encode({"op": "bind", "blocks": blocks}, MAX_BIND_BYTES)
    if isinstance(request, Ticket):
        return _encode({"op": "ticket"})
    return _encode({"op": "detach", "segment_id": request.segment_id})


def decode_request(data: bytes) -> HandoverRequest:
    """The request in ``data``; InvalidInputError saying what is wrong with it."""
    message = _decode(data, "request")
    op = message.get("op")
    if op == "hello":
        return Hello(_str(message, "session_id"))
    if op == "detach":
        return Detach(_str(message, "segment_id"))
    if op == "bind":
        return _decode_bind(message)
    if op == "ticket":
        return Ticket()
    if op != "attach":
        raise InvalidInputError(
            f"unknown handover op {op!r} (hello, attach, bind, detach or ticket)"
        )
    size = message.get("size_bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise InvalidInputError(f"handover attach needs size_bytes >= 1, got {size!r}")
    try:
        role = SegmentRole(message.get("role"))
    except ValueError:
        raise InvalidInputError(
            f"handover attach needs role snapshot, result or arena, got {message.get('role')!r}"
        ) from None
    block = sys.intern(_str(message, "block", required=role is SegmentRole.RESULT))
    slot_bytes: Any = 0
    if role is SegmentRole.ARENA:
        slot_bytes = message.get("slot_bytes")
        if not isinstance(slot_bytes, int) or isinstance(slot_bytes, bool) or slot_bytes < 1:
            raise InvalidInputError(
                f"handover attach of an arena needs slot_bytes >= 1, got {slot_bytes!r}"
            )
    return Attach(_str(message, "segment_id"), size, role, block, slot_bytes)


def _decode_bind(message: dict[str, Any]) -> Bind:
    blocks = message.get("blocks")
    if not isinstance(blocks, list) or not 1 <= len(blocks) <= MAX_BIND_BLOCKS:
        raise InvalidInputError(f"handover bind needs 1 to {MAX_BIND_BLOCKS} blocks")
    return Bind(tuple(_decode_block_slots(entry) for entry in blocks))


def _decode_block_slots(entry: Any) -> BlockSlots:
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and entry[0]):
        raise InvalidInputError(f"handover bind: each block is [name, slots], got {entry!r:.200}")
    slots = entry[1]
    # The daemon keeps the name as long as the block: one string shared with the engine's
    # records (which intern theirs too), not a copy per table (~120 bytes each).
    block = sys.intern(entry[0])
    if not isinstance(slots, list) or not 1 <= len(slots) <= 2:
        raise InvalidInputError(f"handover bind of block {block!r} needs one or two slots")
    bindings = []
    for slot in slots:
        if not (
            isinstance(slot, list)
            and len(slot) == 4
            and isinstance(slot[0], str)
            and slot[0]
            and isinstance(slot[1], str)
            and slot[1]
            and isinstance(slot[2], int)
            and not isinstance(slot[2], bool)
            and slot[2] >= 0
            and slot[3] in (SegmentRole.SNAPSHOT.value, SegmentRole.RESULT.value)
        ):
            raise InvalidInputError(
                f"handover bind of block {block!r}: each slot is [segment_id, arena_id, "
                f"index >= 0, 'snapshot' or 'result'], got {slot!r:.200}"
            )
        bindings.append(SlotBinding(slot[0], slot[1], slot[2], SegmentRole(slot[3])))
    return BlockSlots(block, tuple(bindings))


def encode_reply(reply: Reply) -> bytes:
    """The bytes of ``reply`` on the socket (an over-long error is cut, never refused)."""
    if reply.ok:
        return _encode({"ok": True, "ticket": reply.ticket} if reply.ticket else {"ok": True})
    return _encode({"ok": False, "error": reply.error[: MAX_MESSAGE_BYTES // 2]})


def decode_reply(data: bytes) -> Reply:
    """The reply in ``data``; an empty ``data`` (the daemon closed the socket) is a refusal."""
    if not data:
        return Reply(False, "the daemon closed the handover connection")
    message = _decode(data, "reply")
    return Reply(
        bool(message.get("ok")), str(message.get("error", "")), str(message.get("ticket", ""))
    )
