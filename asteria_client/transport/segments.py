"""The shared-memory side of a daemon source: every block's segment pair and their handover.

Each block that goes over shared memory gets two segments, created once by this client (see
:mod:`asteria_client.transport.shm`): ``submit`` writes snapshots into one, the daemon writes
results into the other. The daemon maps a segment only after it was *handed over* on the
session's handover socket (``<socket>.shm``), and it drops every mapping of a handover
connection when that connection closes.

:class:`SegmentSet` keeps which segments the daemon holds now, and heals when it stops holding
them: a handover connection that died (the daemon closed it, or a request on it failed) is
reopened and every segment is handed over again; a snapshot the daemon refused although its
segment was announced makes the block's segments be handed over again before the next one.
Without that, a client would keep announcing segments the daemon no longer maps, and every
later snapshot of those blocks would be refused.

Threading: the sender thread creates segments and hands them over; the session thread opens
and closes the channel and reads results. One lock serializes handover requests.

Descriptors: a segment holds two in this process (its memfd and its mapping's own), so a
model of tens of thousands of blocks would take every descriptor of the training process (and
then its data loader, its checkpoints and its sockets fail with EMFILE). The segments of all
sources in a process hold at most :func:`segment_budget` of them; the blocks beyond go over
gRPC, said once in a warning. Refusals (by the daemon or this budget) are logged once per
source and counted.
"""

from __future__ import annotations

import logging
import resource
import threading

import numpy as np

from asteria_client.transport.connection import SessionInfo
from asteria_client.transport.shm import ClientSegment, HandoverChannel, segments_for
from asteria_server.errors import InvalidInputError
from asteria_server.protocol.shm import ArraySpec, SegmentRef, SharedMemoryUnavailableError
from asteria_server.types import SolveTask

logger = logging.getLogger(__name__)

#: Descriptors one segment holds in this process (the memfd and its mapping's duplicate).
FDS_PER_SEGMENT = 2
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
        self._lock = threading.Lock()  # one handover request at a time
        self._channel: HandoverChannel | None = None
        self._session: SessionInfo | None = None  # whose handover socket the channel is on
        self._attached: set[str] = set()  # segment ids the daemon holds in this session
        self._segments: dict[str, ClientSegment] = {}  # every segment, by id
        self.rehandovers = 0  # times the segments were handed over again after a loss
        self.refusals = 0  # segments not made (budget, host) or not handed over (the daemon)

    # ------------------------------------------------------------------ state
    @property
    def active(self) -> bool:
        """A handover channel is open: results may come back through segments."""
        return self._channel is not None

    def __len__(self) -> int:
        return len(self._segments)

    def by_id(self) -> dict[str, ClientSegment]:
        """Every segment of this source, by id (a copy)."""
        with self._lock:
            return dict(self._segments)

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
            self._connect_locked()
            segments = list(self._segments.values())
        for segment in segments:
            self.hand_over(segment)

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

    def hand_over(self, segment: ClientSegment) -> bool:
        """Give ``segment`` to the session's daemon; False when it is not held afterwards.

        A handover connection found dead is reopened once and every segment handed over again.
        """
        with self._lock:
            if self._channel is None:
                return False
            try:
                self._channel.attach(segment)
            except SharedMemoryUnavailableError as exc:
                if self._channel_alive_locked():
                    self._refused_once(f"segment of block {segment.block} not handed over: {exc}")
                    return False
                return self._reconnect_locked(why=str(exc)) and self.is_attached(segment)
            self._attached.add(segment.segment_id)
            return True

    def _channel_alive_locked(self) -> bool:
        channel = self._channel
        return channel is not None and channel.alive()

    def _reconnect_locked(self, why: str) -> bool:
        """The channel died: a new one, and every segment handed over on it (lock held)."""
        old, self._channel = self._channel, None
        self._attached = set()
        if old is not None:
            old.close()
        logger.warning("the daemon's handover connection was lost (%s); handing over again", why)
        if not self._connect_locked():
            return False
        self.rehandovers += 1
        channel = self._channel
        assert channel is not None
        for segment in self._segments.values():
            try:
                channel.attach(segment)
            except SharedMemoryUnavailableError as exc:
                self._refused_once(f"segment of block {segment.block} not handed over: {exc}")
                continue
            self._attached.add(segment.segment_id)
        return True

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
        for segment in segments:
            self.hand_over(segment)

    # ------------------------------------------------------------------ segments
    def create(self, task: SolveTask) -> tuple[ClientSegment, ClientSegment] | None:
        """A new snapshot and result segment for ``task``'s block, handed over; None without a
        handover channel. Raises SharedMemoryUnavailableError (after a warning) when they cannot
        be made on this host: the caller sends that block over gRPC from then on."""
        if not self.enabled or self._channel is None:
            return None
        if not _ProcessSegments.reserve(2):
            budget = segment_budget()
            message = (
                f"this process's segments hold {budget * FDS_PER_SEGMENT} descriptors, "
                f"{SEGMENT_FD_SHARE:.0%} of its descriptor limit (ulimit -n); raise it for "
                "more blocks over shared memory"
            )
            self._refused_once(f"block {task.block} and later ones go over gRPC: {message}")
            raise SharedMemoryUnavailableError(message)
        try:
            snapshot, result = segments_for(task)
        except SharedMemoryUnavailableError as exc:
            _ProcessSegments.release(2)
            self._refused_once(f"block {task.block} goes over gRPC: {exc}")
            raise
        with self._lock:
            self._segments[snapshot.segment_id] = snapshot
            self._segments[result.segment_id] = result
        self.hand_over(snapshot)
        self.hand_over(result)
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
        for segment in segments:
            segment.close()
        _ProcessSegments.release(len(segments))
