"""The shared-memory side of a daemon source: every block's segment pair and their handover.

Each block that goes over shared memory gets two segments, created once by this client (see
:mod:`asteria_client.transport.shm`): ``submit`` writes snapshots into one, the daemon writes
results into the other. The daemon maps a segment only after it was *handed over* on the
session's handover socket (``<socket>.shm``), and it drops every mapping of a handover
connection when that connection closes.

**Arenas.** A block's two segments are slots of *arenas* (``protocol.shm``): one memfd per
arena holds many blocks' slots of one size, handed over once, and each block's pair of slots is
then *bound* in one small request. An arena of a slot size holds 16 slots, the next one of that
size twice as many as the last, up to :data:`ARENA_MAX_BYTES`: a small model reserves little,
and 20,000 blocks of a few sizes take a few dozen arenas (descriptors and daemon mappings), not
40,000 segments. A daemon that predates arenas refuses the first one; this set then gives each
block memfds of its own, as before (:attr:`SegmentSet.per_block`).

:class:`SegmentSet` keeps which segments the daemon holds now, and heals when it stops holding
them: a handover connection that died (the daemon closed it, or a request on it failed) is
reopened and every arena and segment is handed over again (and every slot bound again); a
snapshot the daemon refused although its segment was announced makes the block's segments be
handed over again before the next one. Without that, a client would keep announcing segments
the daemon no longer maps, and every later snapshot of those blocks would be refused.

Threading: the sender thread creates segments and hands them over; the session thread opens
and closes the channel and reads results. One lock serializes handover requests.

Descriptors: an arena or a segment holds two in this process (its memfd and its mapping's
own). The arenas and segments of all sources in a process hold at most :func:`segment_budget`
of them; the blocks beyond go over gRPC, said once in a warning. Refusals (by the daemon or
this budget) are logged once per source and counted.
"""

from __future__ import annotations

import logging
import resource
import threading

import numpy as np

from asteria_client.transport.connection import SessionInfo
from asteria_client.transport.shm import (
    ClientArena,
    ClientSegment,
    HandoverChannel,
    segments_for,
    slot_sizes,
)
from asteria_server.errors import InvalidInputError
from asteria_server.protocol.shm import ArraySpec, SegmentRef, SharedMemoryUnavailableError
from asteria_server.types import SolveTask

logger = logging.getLogger(__name__)

#: Descriptors one segment or arena holds in this process (the memfd and its mapping's duplicate).
FDS_PER_SEGMENT = 2
#: Slots of the first arena of a slot size; each later one of that size holds twice the last's.
ARENA_FIRST_SLOTS = 16
#: An arena grows no larger than this (unless one slot is larger).
ARENA_MAX_BYTES = 64 << 20
#: How a daemon that predates arenas refuses one (``protocol.handover``'s attach roles then).
_NO_ARENAS = "got 'arena'"
#: The share of the process's soft descriptor limit that segments may hold.
SEGMENT_FD_SHARE = 0.5


def segment_budget() -> int:
    """How many segments this process's sources may hold together: :data:`SEGMENT_FD_SHARE`
    of the soft ``RLIMIT_NOFILE`` (``ulimit -n``), two descriptors each. The soft limit is
    raised to the hard one first (once), as the daemon does: the usual soft 1024 would keep
    a model's blocks off shared memory beyond 128."""
    global _NOFILE_RAISED
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not _NOFILE_RAISED:
        _NOFILE_RAISED = True
        if hard != resource.RLIM_INFINITY and hard > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                soft = hard
            except (ValueError, OSError):
                pass
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return int(soft * SEGMENT_FD_SHARE) // FDS_PER_SEGMENT


_NOFILE_RAISED = False


class _ProcessSegments:
    """The segments every source of this process holds, against :func:`segment_budget`."""

    lock = threading.Lock()
    held = 0

    @classmethod
    def reserve(cls, count: int) -> bool:
        with cls.lock:
            if cls.held + count > segment_budget():
                return False
            cls.held += count
            return True

    @classmethod
    def release(cls, count: int) -> None:
        with cls.lock:
            cls.held = max(0, cls.held - count)


class SegmentSet:
    """Every segment of one daemon source, and which of them the current session holds."""

    def __init__(self, *, enabled: bool) -> None:
        #: Shared memory is wanted (a ``unix://`` daemon, not turned off by configuration).
        self.enabled = enabled
        #: The daemon refused arenas (it predates them): each block gets memfds of its own.
        self.per_block = False
        self._no_arenas = False  # the daemon refused an arena as one that predates them does
        self._lock = threading.Lock()  # one handover request at a time
        self._channel: HandoverChannel | None = None
        self._session: SessionInfo | None = None  # whose handover socket the channel is on
        self._attached: set[str] = set()  # segment, arena and slot ids the daemon holds
        self._segments: dict[str, ClientSegment] = {}  # every segment and slot, by id
        self._arenas: dict[int, list[ClientArena]] = {}  # by slot size, oldest first
        self._pairs: dict[str, tuple[ClientSegment, ClientSegment]] = {}  # block -> its pair
        self.rehandovers = 0  # times the segments were handed over again after a loss
        self.refusals = 0  # segments not made (budget, host) or not handed over (the daemon)

    # ------------------------------------------------------------------ state
    @property
    def active(self) -> bool:
        """A handover channel is open: results may come back through segments."""
        return self._channel is not None

    def __len__(self) -> int:
        return len(self._segments)

    @property
    def num_mappings(self) -> int:
        """Arenas and per-block segments: what holds descriptors here and in the daemon."""
        with self._lock:
            arenas = sum(len(a) for a in self._arenas.values())
            return arenas + sum(s.arena is None for s in self._segments.values())

    def by_id(self) -> dict[str, ClientSegment]:
        """Every segment (and arena slot) of this source, by id (a copy)."""
        with self._lock:
            return dict(self._segments)

    def arenas(self) -> list[ClientArena]:
        """Every arena of this source (tests and diagnostics)."""
        with self._lock:
            return [a for arenas in self._arenas.values() for a in arenas]

    def is_attached(self, segment: ClientSegment) -> bool:
        return segment.segment_id in self._attached

    # ------------------------------------------------------------------ the channel
    def open(self, session: SessionInfo) -> None:
        """Connect to ``session``'s handover socket and hand every segment over (again)."""
        self.close_channel()
        if not (self.enabled and session.shm_socket):
            return
        with self._lock:
            self._session = session
            if self._connect_locked():
                self._hand_over_all_locked()

    def _connect_locked(self) -> bool:
        session = self._session
        if session is None or not session.shm_socket:
            return False
        try:
            self._channel = HandoverChannel(session.shm_socket, session.session_id)
        except SharedMemoryUnavailableError as exc:
            logger.warning("shared memory unavailable, using gRPC: %s", exc)
            self._channel = None
            return False
        return True

    def close_channel(self) -> None:
        """Forget the session's channel (its daemon drops the mappings of this connection)."""
        with self._lock:
            channel, self._channel, self._session = self._channel, None, None
            self._attached = set()
        if channel is not None:
            channel.close()

    def _hand_over_all_locked(self) -> None:
        """Hand every arena and segment over on the (new) channel and bind every slot."""
        for segment in list(self._segments.values()):
            if segment.arena is None:
                self._attach_locked(segment)
        self._hand_over_pairs_locked([p for p in self._pairs.values() if p[0].arena is not None])

    def _attach_locked(self, segment: ClientSegment) -> bool:
        """Attach a per-block segment; False when refused (the channel may have died)."""
        channel = self._channel
        if channel is None:
            return False
        try:
            channel.attach(segment)
        except SharedMemoryUnavailableError as exc:
            self._refused_once(f"segment of block {segment.block} not handed over: {exc}")
            return False
        self._attached.add(segment.segment_id)
        return True

    def _hand_over_pair_locked(self, pair: tuple[ClientSegment, ClientSegment]) -> bool:
        """Hand a block's pair over: its arenas (those the daemon does not hold yet) and the
        binding of its slots, or its own segments. False when the daemon does not hold both
        afterwards (refused: the reason is logged once and counted)."""
        if pair[0].arena is None:
            return self._channel is not None and all(
                [self._attach_locked(segment) for segment in pair]
            )
        return bool(self._hand_over_pairs_locked([pair]))

    def _hand_over_pairs_locked(self, pairs: list[tuple[ClientSegment, ClientSegment]]) -> set[str]:
        """Hand many blocks' slot pairs over: the arenas the daemon does not hold yet, then the
        slots' bindings, a few hundred blocks a request. The blocks the daemon holds afterwards
        (a refusal is logged once and counted; one of an arena by a daemon that predates them
        sets ``_no_arenas``)."""
        channel = self._channel
        if channel is None or not pairs:
            return set()
        try:
            for pair in pairs:
                for slot in pair:
                    arena = slot.arena
                    assert arena is not None
                    if arena.segment_id not in self._attached:
                        channel.attach_arena(arena)
                        self._attached.add(arena.segment_id)
        except SharedMemoryUnavailableError as exc:
            if _NO_ARENAS in str(exc):
                self._no_arenas = True  # create() goes over to segments per block
            else:
                self._refused_once(f"an arena of block {pairs[0][0].block} not handed over: {exc}")
            return set()
        bound, errors = channel.bind(pairs)
        for error in errors:
            self._refused_once(f"segments not handed over: {error}")
        for pair in pairs:
            if pair[0].block in bound:
                self._attached.update(slot.segment_id for slot in pair)
        return bound

    def _channel_alive_locked(self) -> bool:
        channel = self._channel
        return channel is not None and channel.alive()

    def _reconnect_locked(self, why: str) -> bool:
        """The channel died: a new one, and everything handed over on it (lock held)."""
        old, self._channel = self._channel, None
        self._attached = set()
        if old is not None:
            old.close()
        logger.warning("the daemon's handover connection was lost (%s); handing over again", why)
        if not self._connect_locked():
            return False
        self.rehandovers += 1
        self._hand_over_all_locked()
        return True

    def _hand_over_or_heal_locked(self, pair: tuple[ClientSegment, ClientSegment]) -> None:
        """Hand ``pair`` over; when that fails on a channel that died, reconnect (which hands
        everything over again, this pair too)."""
        if self._hand_over_pair_locked(pair) or self._channel is None:
            return
        if not self._channel_alive_locked():
            self._reconnect_locked(why="a segment handover failed")

    def refused(self, segments: tuple[ClientSegment, ...]) -> None:
        """The daemon refused a snapshot announced in ``segments[0]``: it may no longer hold
        them (its handover connection went away). Check the channel, then hand them over
        again, so the block's next snapshot can be announced."""
        with self._lock:
            if self._channel is None:
                return
            if not self._channel_alive_locked():
                self._reconnect_locked(why="a snapshot in a handed-over segment was refused")
                return
            for segment in segments:
                self._attached.discard(segment.segment_id)
            pair = self._pairs.get(segments[0].block)
            if pair is not None:
                self._hand_over_or_heal_locked(pair)

    # ------------------------------------------------------------------ segments
    def create(self, task: SolveTask) -> tuple[ClientSegment, ClientSegment] | None:
        """A new snapshot and result segment for ``task``'s block, handed over; None without a
        handover channel. Raises SharedMemoryUnavailableError (after a warning) when they cannot
        be made on this host: the caller sends that block over gRPC from then on."""
        if not self.enabled or self._channel is None:
            return None
        with self._lock:
            if self._channel is None:
                return None
            pair = None if self.per_block else self._new_slots_locked(task)
            if pair is not None:
                if self._hand_over_pair_locked(pair):
                    return pair
                if not self._no_arenas:
                    if not self._channel_alive_locked():  # heals, and hands this pair over
                        self._reconnect_locked(why="a segment handover failed")
                    return pair  # else refused (logged, counted): this block uses gRPC
                self._drop_pair_locked(pair)
            pair = self._new_segments_locked(task)
            self._hand_over_or_heal_locked(pair)
            return pair

    def create_many(self, tasks: list[SolveTask]) -> dict[str, tuple[ClientSegment, ClientSegment]]:
        """:meth:`create` for many blocks at once (the blocks of a first refresh), their slots
        bound in a few requests instead of one a block; by block, the pairs made (handed over or
        not: :meth:`is_attached` says). Blocks left out (this process's descriptor budget, no
        channel, a daemon without arenas) are for :meth:`create` to try, one by one."""
        if not self.enabled or self._channel is None or self.per_block:
            return {}
        with self._lock:
            if self._channel is None or self.per_block:
                return {}
            pairs = []
            for task in tasks:
                try:
                    pairs.append(self._new_slots_locked(task))
                except SharedMemoryUnavailableError:
                    break  # said once; create() raises it for each of the rest
            if not pairs:
                return {}
            if not self._hand_over_pairs_locked(pairs) and self._channel is not None:
                if self._no_arenas:
                    for pair in pairs[1:]:
                        self._forget_locked(pair)
                        del self._pairs[pair[0].block]
                    self._drop_pair_locked(pairs[0])
                    return {}
                if not self._channel_alive_locked():  # heals, and hands the pairs over
                    self._reconnect_locked(why="a segment handover failed")
            return {pair[0].block: pair for pair in pairs}

    def _new_slots_locked(self, task: SolveTask) -> tuple[ClientSegment, ClientSegment]:
        snapshot_bytes, result_bytes = slot_sizes(task)
        snapshot = self._take_slot_locked("snapshot", task.block, snapshot_bytes)
        try:
            result = self._take_slot_locked("result", task.block, result_bytes)
        except BaseException:
            snapshot.close()
            raise
        pair = (snapshot, result)
        self._segments[snapshot.segment_id] = snapshot
        self._segments[result.segment_id] = result
        old = self._pairs.get(task.block)
        self._pairs[task.block] = pair
        if old is not None:
            self._forget_locked(old)
        return pair

    def _take_slot_locked(self, role: str, block: str, slot_bytes: int) -> ClientSegment:
        arenas = self._arenas.setdefault(slot_bytes, [])
        for arena in reversed(arenas):
            slot = arena.take(role, block)
            if slot is not None:
                return slot
        num_slots = max(1, min(ARENA_FIRST_SLOTS << len(arenas), ARENA_MAX_BYTES // slot_bytes))
        self._reserve(block)
        try:
            arena = ClientArena.create(slot_bytes, num_slots)
        except SharedMemoryUnavailableError as exc:
            _ProcessSegments.release(1)
            self._refused_once(f"block {block} goes over gRPC: {exc}")
            raise
        arenas.append(arena)
        slot = arena.take(role, block)
        assert slot is not None
        return slot

    def _reserve(self, block: str) -> None:
        if not _ProcessSegments.reserve(1):
            budget = segment_budget()
            message = (
                f"this process's segments hold {budget * FDS_PER_SEGMENT} descriptors, "
                f"{SEGMENT_FD_SHARE:.0%} of its descriptor limit (ulimit -n); raise it for "
                "more blocks over shared memory"
            )
            self._refused_once(f"block {block} and later ones go over gRPC: {message}")
            raise SharedMemoryUnavailableError(message)

    def _drop_pair_locked(self, pair: tuple[ClientSegment, ClientSegment]) -> None:
        """The daemon takes no arenas: forget ``pair`` and every arena, and make segments per
        block from now on (said once)."""
        logger.warning(
            "the daemon does not take shared-memory arenas (it predates them): each block gets "
            "segments of its own, which costs descriptors per block"
        )
        self.per_block = True
        self._forget_locked(pair)
        del self._pairs[pair[0].block]
        for arenas in self._arenas.values():
            for arena in arenas:
                self._attached.discard(arena.segment_id)
                arena.close()
                _ProcessSegments.release(1)
        self._arenas = {}

    def _forget_locked(self, pair: tuple[ClientSegment, ClientSegment]) -> None:
        for segment in pair:
            self._segments.pop(segment.segment_id, None)
            self._attached.discard(segment.segment_id)
            segment.close()
            if segment.arena is None:
                _ProcessSegments.release(1)

    def _new_segments_locked(self, task: SolveTask) -> tuple[ClientSegment, ClientSegment]:
        """Two memfds of the block's own (a daemon without arenas)."""
        self._reserve(task.block)
        try:
            self._reserve(task.block)
        except SharedMemoryUnavailableError:
            _ProcessSegments.release(1)
            raise
        try:
            snapshot, result = segments_for(task)
        except SharedMemoryUnavailableError as exc:
            _ProcessSegments.release(2)
            self._refused_once(f"block {task.block} goes over gRPC: {exc}")
            raise
        self._segments[snapshot.segment_id] = snapshot
        self._segments[result.segment_id] = result
        old = self._pairs.get(task.block)
        self._pairs[task.block] = (snapshot, result)
        if old is not None:
            self._forget_locked(old)
        return snapshot, result

    def _refused_once(self, message: str) -> None:
        """One warning per source; the later refusals are counted (``shm_refusals``)."""
        self.refusals += 1
        if self.refusals == 1:
            logger.warning("%s (further refusals are counted in stats(), not logged)", message)

    def result_segment(self, ref: SegmentRef) -> ClientSegment:
        """The result segment ``ref`` names (raises InvalidInputError for an unknown one)."""
        segment = self._segments.get(ref.segment_id)
        if segment is None or segment.role != "result":
            raise InvalidInputError(f"the daemon named an unknown result segment {ref.segment_id}")
        return segment

    def read_result(self, ref: SegmentRef, specs: list[ArraySpec]) -> list[np.ndarray] | None:
        """Copy a result out of its segment; None when a newer one replaced it meanwhile."""
        return self.result_segment(ref).read(specs, ref.sequence)

    def close(self) -> None:
        self.close_channel()
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
            arenas = [a for arenas in self._arenas.values() for a in arenas]
            self._arenas, self._pairs = {}, {}
        for segment in segments:
            segment.close()
        for arena in arenas:
            arena.close()
        _ProcessSegments.release(len(arenas) + sum(s.arena is None for s in segments))
