"""The daemon source: roots and bases from the node's ``asteria-server``.

Snapshots and results travel over **shared memory** when the daemon is on this host and offers
it (``transport.shm``; gRPC then only announces them), else over **gRPC** in chunks; a block
whose segment cannot be created or handed over falls back to gRPC on its own, with a warning.

Three places run, and only the first is on the training path:

- ``submit`` (the optimizer's step) copies the factor into the block's snapshot segment (or, for
  gRPC, to host memory) and marks the block pending; a newer snapshot of the same block replaces
  one not sent yet (latest wins). It never touches the network and never raises.
- a **sender thread** streams each slot's snapshot to the daemon (``SubmitSnapshot``), declaring
  new blocks first (``RegisterBlocks``);
- a **session thread** opens the session, holds one ``StreamResults`` stream open and keeps, per
  block, the newest result received (a result never replaces a newer one). When the daemon is
  unreachable it retries with exponential backoff (``backoff_initial_s`` doubling up to
  ``backoff_max_s``). On every new session it resubmits the newest snapshot of each block the
  daemon has not answered yet, so a restarted daemon (a new *incarnation*) catches up at once.

While there is no session, snapshots are dropped and counted, ``take`` finds nothing and ``wait``
returns at once: the optimizer's staleness budget turns that into a local computation, so
training continues through a daemon restart. The calls themselves, each with a deadline, are
:class:`~asteria_client.transport.connection.DaemonConnection`'s.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asteria_client.config import client_env, resolve_address
from asteria_client.runtime.source import (
    PreconditionerRequest,
    PreconditionerResult,
    PreconditionerSource,
    SourceRecord,
    result_from_engine,
)
from asteria_client.transport.connection import DaemonClientConfig, DaemonConnection, SessionInfo
from asteria_client.transport.shm import ClientSegment, HandoverChannel, segments_for
from asteria_server.errors import (
    AsteriaError,
    DaemonBusyError,
    InvalidInputError,
    UnknownSessionError,
)
from asteria_server.protocol.shm import (
    ArraySpec,
    SegmentRef,
    SharedMemoryUnavailableError,
    snapshot_specs,
)
from asteria_server.types import BlockStatus, EngineStats, SolveResult, SolveTask

logger = logging.getLogger(__name__)

#: Result latencies kept for ``result_latencies()`` (the newest ones).
LATENCY_WINDOW = 100_000
#: Transport counters in ``stats()``.
_COUNTERS = (
    "shm_snapshots",
    "chunked_snapshots",
    "shm_results",
    "shm_results_overwritten",
    "submits_busy",
)
#: Submit times kept per block for latency measurement (versions awaiting a result).
_SUBMIT_TIMES_KEPT = 16


def _host_copy(tensor: torch.Tensor) -> np.ndarray:
    """A host copy of ``tensor`` the caller may keep while the factor changes in place."""
    return tensor.detach().to(device="cpu", copy=True).contiguous().numpy()


_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}


def _specs_of(tensors: list[torch.Tensor]) -> list[ArraySpec] | None:
    """The segment specs of a snapshot's tensors, or None when a dtype has no place there."""
    specs = []
    for tensor in tensors:
        dtype = _NUMPY_DTYPES.get(tensor.dtype)
        if dtype is None or tensor.dim() != 2:
            return None
        specs.append(ArraySpec(dtype, tuple(tensor.shape)))
    return specs


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(array if array.flags.writeable else array.copy())
    return host.to(device)


@dataclass
class _Block:
    """What the client knows about one block."""

    device: torch.device
    latest: SolveTask | None = None  # newest snapshot, kept for a resubmit after a reconnect
    pending: bool = False  # ``latest`` waits for the sender
    sent_version: int = -1  # newest version the current session accepted
    received_version: int = -1  # newest result received (never goes back)
    ready: SolveResult | None = None  # newest result not taken yet
    dropped: int = 0  # snapshots dropped while the daemon was unreachable
    rejected: int = 0  # snapshots the daemon refused (bad input)
    last_error: str = ""
    submitted_at: dict[int, float] = field(default_factory=dict)  # version -> monotonic time
    snapshot_seg: ClientSegment | None = None  # where ``submit`` writes, once created
    result_seg: ClientSegment | None = None  # where the daemon writes this block's results
    latest_sequence: int = -1  # ``latest`` lies in snapshot_seg under this sequence (-1: a copy)
    shm_error: str = ""  # why this block's segments could not be made (it uses gRPC)


class DaemonSource(PreconditionerSource):
    """Results from the node's daemon over gRPC (see the module docstring)."""

    synchronous = False

    def __init__(
        self,
        address: str | None = None,
        *,
        tenant: str | None = None,
        token: str | None = None,
        job: str | None = None,
        rank: int = 0,
        config: DaemonClientConfig | None = None,
    ) -> None:
        env = client_env()
        self.address = resolve_address(address)
        self.config = config or DaemonClientConfig()
        #: Prefix of this source's block names on the daemon: the job (data-parallel replicas
        #: of one job share blocks and results), else a name of its own, so that another run in
        #: the same tenant never hands this one its results.
        self.namespace = (env.job if job is None else job) or f"run-{uuid.uuid4().hex[:12]}"
        self._prefix = f"{self.namespace}:"
        self._conn = DaemonConnection(
            self.address,
            tenant=env.tenant if tenant is None else tenant,
            token=env.token if token is None else token,
            job=self.namespace,
            rank=rank,
            config=self.config,
        )
        self._lock = threading.Condition()
        self._blocks: dict[str, _Block] = {}
        self._session: SessionInfo | None = None
        self._registered: set[str] = set()  # blocks declared to the current session
        self._incarnation = ""
        self._incarnations_seen = 0
        self._cancel_stream: Any = None
        self._closed = False
        self._last_connect_error = ""
        #: Seconds from ``submit`` to the result's arrival, newest last (results of every block).
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        #: Shared memory: wanted for a ``unix://`` daemon unless turned off.
        self._want_shm = (
            self.config.shared_memory
            and env.transport != "grpc"
            and self.address.startswith("unix:")
        )
        self._channel: HandoverChannel | None = None  # the current session's handover socket
        self._channel_lock = threading.Lock()  # one handover request at a time
        self._attached: set[str] = set()  # segment ids the current session holds
        self._segments: dict[str, ClientSegment] = {}  # every segment of this source, by id
        self._counts = collections.Counter[str]()
        self._threads = [
            threading.Thread(target=self._session_loop, name="asteria-daemon-session", daemon=True),
            threading.Thread(target=self._send_loop, name="asteria-daemon-sender", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        if not self.wait_connected(self.config.connect_timeout_s):
            logger.warning(
                "no session with the daemon at %s after %.1f s (%s); training starts with local "
                "computations and switches to the daemon once it answers",
                self.address,
                self.config.connect_timeout_s,
                self._last_connect_error or "no answer",
            )

    # ------------------------------------------------------------------ state, for tests and status
    @property
    def connected(self) -> bool:
        with self._lock:
            return self._session is not None

    @property
    def incarnation_id(self) -> str:
        """The incarnation of the daemon last connected to ('' before the first session)."""
        with self._lock:
            return self._incarnation

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until a session is open (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._session is None and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return self._session is not None

    # ------------------------------------------------------------------ snapshots in
    def submit(self, request: PreconditionerRequest) -> None:
        with self._lock:
            block = self._blocks.get(request.block)
            if block is None:
                block = self._blocks[request.block] = _Block(device=request.matrix.device)
            if block.latest is not None and request.version <= block.latest.version:
                return  # versions never go back
            segment = block.snapshot_seg
        tensors = [request.matrix] if request.basis is None else [request.matrix, request.basis]
        specs = _specs_of(tensors)
        sequence = -1
        if segment is not None and specs is not None and segment.fits(specs):
            # The training thread is the only writer of a published snapshot segment.
            sequence = segment.write_tensors(specs, tensors)
            arrays = segment.segment.views(specs)  # read-only use: shapes for the header
        else:
            arrays = [_host_copy(t) for t in tensors]
        try:
            task = SolveTask(
                block=self._prefix + request.block,
                version=request.version,
                kind=request.kind,
                matrix=arrays[0],
                exponent=request.exponent,
                epsilon=request.epsilon,
                basis=arrays[1] if len(arrays) > 1 else None,
                base_version=request.base_version,
                deadline=float(request.deadline_step),
            )
        except InvalidInputError as exc:  # e.g. a dtype the daemon does not take
            self._reject_local(request.block, block, str(exc))
            return
        with self._lock:
            block.latest = task
            block.latest_sequence = sequence
            block.submitted_at[task.version] = time.monotonic()
            while len(block.submitted_at) > _SUBMIT_TIMES_KEPT:
                del block.submitted_at[min(block.submitted_at)]
            if self._session is None:
                block.pending = False
                block.dropped += 1
                return
            block.pending = True
            self._lock.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (
                    self._session is None or not any(b.pending for b in self._blocks.values())
                ):
                    self._lock.wait()
                if self._closed:
                    return
                session = self._session
                assert session is not None
                batch = []
                for block in self._blocks.values():
                    if block.pending and block.latest is not None:
                        batch.append((block, block.latest, block.latest_sequence))
                        # In flight from now on, so ``wait`` waits for it.
                        block.sent_version = max(block.sent_version, block.latest.version)
                    block.pending = False
                new = [t for _, t, _ in batch if t.block not in self._registered]
            try:
                self._send(session, new, batch)
            except Exception as exc:  # a bug here must cost results, never the training run
                logger.exception("sending snapshots to the daemon failed")
                self._lost(session, exc)

    def _send(
        self,
        session: SessionInfo,
        new: list[SolveTask],
        batch: list[tuple[_Block, SolveTask, int]],
    ) -> None:
        try:
            if new:
                self._conn.register(session.session_id, new)
                with self._lock:
                    self._registered.update(t.block for t in new)
        except InvalidInputError as exc:
            logger.warning("the daemon refused to register %d blocks: %s", len(new), exc)
        except AsteriaError as exc:
            self._lost(session, exc)
            return
        for block, latest, sequence in batch:
            if latest.n > session.max_matrix_n:
                self._reject(latest, f"n={latest.n} exceeds the daemon's max_matrix_n")
                continue
            task, shm = self._wire_form(block, latest, sequence)
            if task is None:
                continue  # overwritten by a newer snapshot, which is pending itself
            try:
                self._conn.submit(session, task, shm=shm)
                self._counts["shm_snapshots" if shm else "chunked_snapshots"] += 1
            except InvalidInputError as exc:
                self._reject(task, str(exc))
                continue
            except DaemonBusyError:  # no room on the daemon now: the block's next one will go
                self._counts["submits_busy"] += 1
                self._unanswered(block)
                continue
            except AsteriaError as exc:
                self._lost(session, exc)
                return

    def _wire_form(
        self, block: _Block, task: SolveTask, sequence: int
    ) -> tuple[SolveTask | None, SegmentRef | None]:
        """How to send ``task`` (sender thread): announced in its segment, or in chunks.

        A task written into the snapshot segment is announced when the daemon holds that
        segment, else copied out under the seqlock for chunks (None: a newer snapshot replaced
        it). A private copy moves into new segments when the block has none yet.
        """
        segment = block.snapshot_seg
        if sequence >= 0:
            assert segment is not None
            if segment.segment_id in self._attached:
                return task, segment.ref(sequence)
            copies = segment.read(snapshot_specs(task), sequence)
            if copies is None:
                return None, None
            basis = copies[1] if len(copies) > 1 else None
            return dataclasses.replace(task, matrix=copies[0], basis=basis), None
        if segment is None and self._create_segments(block, task):
            segment = block.snapshot_seg
            assert segment is not None
            sequence = segment.segment.write(
                snapshot_specs(task), [a for a in (task.matrix, task.basis) if a is not None]
            )
            return task, segment.ref(sequence)
        return task, None

    def _create_segments(self, block: _Block, task: SolveTask) -> bool:
        """Give ``block`` its snapshot and result segments and hand them over (sender thread).

        The new snapshot segment is written here once, before it is published to ``submit``;
        from then on the training thread is its only writer. False: use gRPC for this block.
        """
        if not self._want_shm or block.shm_error or self._channel is None:
            return False
        try:
            snap, result = segments_for(task)
        except SharedMemoryUnavailableError as exc:
            block.shm_error = str(exc)
            logger.warning("block %s goes over gRPC: %s", task.block, exc)
            return False
        for seg in (snap, result):
            self._segments[seg.segment_id] = seg
            self._hand_over(seg)
        with self._lock:
            block.snapshot_seg, block.result_seg = snap, result
        return snap.segment_id in self._attached

    def _hand_over(self, seg: ClientSegment) -> None:
        """Give ``seg`` to the current session's daemon; a refusal leaves it unattached."""
        with self._channel_lock:
            channel = self._channel
            if channel is None:
                return
            try:
                channel.attach(seg)
            except SharedMemoryUnavailableError as exc:
                logger.warning("segment of block %s not handed over: %s", seg.block, exc)
                return
            self._attached.add(seg.segment_id)

    def _open_channel(self, session: SessionInfo) -> None:
        """Connect to the new session's handover socket and hand every segment over again."""
        self._close_channel()
        if not (self._want_shm and session.shm_socket):
            return
        try:
            channel = HandoverChannel(session.shm_socket, session.session_id)
        except SharedMemoryUnavailableError as exc:
            logger.warning("shared memory unavailable, using gRPC: %s", exc)
            return
        with self._channel_lock:
            self._channel = channel
        for seg in list(self._segments.values()):
            self._hand_over(seg)

    def _close_channel(self) -> None:
        with self._channel_lock:
            channel, self._channel = self._channel, None
            self._attached = set()
        if channel is not None:
            channel.close()

    def _read_result(self, ref: SegmentRef, specs: list[ArraySpec]) -> list[np.ndarray] | None:
        """Copy a result out of its segment (session thread); None when a newer one replaced it."""
        seg = self._segments.get(ref.segment_id)
        if seg is None or seg.role != "result":
            raise InvalidInputError(f"the daemon named an unknown result segment {ref.segment_id}")
        copies = seg.read(specs, ref.sequence)
        self._counts["shm_results" if copies is not None else "shm_results_overwritten"] += 1
        return copies

    def _local_name(self, wire_name: str) -> str | None:
        """The optimizer's name of a block named ``wire_name`` on the daemon, if it is ours."""
        return wire_name[len(self._prefix) :] if wire_name.startswith(self._prefix) else None

    def _reject_local(self, name: str, block: _Block, message: str) -> None:
        """A snapshot that cannot be sent at all: counted and shown like a daemon's refusal."""
        with self._lock:
            block.rejected += 1
            block.last_error = message
        if block.rejected == 1:
            logger.warning("a snapshot of block %s cannot be sent: %s", name, message)

    def _reject(self, task: SolveTask, message: str) -> None:
        name = self._local_name(task.block)
        with self._lock:
            block = self._blocks[name or task.block]
            block.rejected += 1
            block.last_error = message
            if block.rejected == 1:
                logger.warning("the daemon refused a snapshot of block %s: %s", name, message)
        self._unanswered(block)

    def _unanswered(self, block: _Block) -> None:
        """Nothing will come back for the snapshot just sent: ``wait`` must not wait for it."""
        with self._lock:
            block.sent_version = block.received_version
            self._lock.notify_all()

    # ------------------------------------------------------------------ the session
    def _lost(self, session: SessionInfo, exc: BaseException) -> None:
        """The session failed: drop it (once) so the session thread reconnects."""
        with self._lock:
            if self._session is not session:
                return
            self._session = None
            for block in self._blocks.values():
                if block.pending:
                    block.pending = False
                    block.dropped += 1
            cancel = self._cancel_stream
            closed = self._closed
            self._lock.notify_all()
        if not closed:
            logger.warning(
                "lost the daemon at %s (%s); reconnecting in the background", self.address, exc
            )
        if cancel is not None:
            cancel()

    def _session_loop(self) -> None:
        backoff = self.config.backoff_initial_s
        while not self._closed:
            try:
                session = self._conn.open_session()
            except AsteriaError as exc:
                self._note_connect_error(exc)
                with self._lock:
                    self._lock.wait_for(lambda: self._closed, timeout=backoff)
                backoff = min(2 * backoff, self.config.backoff_max_s)
                continue
            opened = time.monotonic()
            self._open_channel(session)
            self._start(session)
            reader = self._read_result if self._channel is not None else None
            try:
                results = self._conn.results(session, self._held(), self._set_cancel, reader=reader)
                for result in results:
                    self._receive(result)
                    if self._closed:
                        break
                reason: BaseException = UnknownSessionError("the result stream ended")
            except AsteriaError as exc:
                reason = exc
            except Exception as exc:  # a bug here must cost results, never the training run
                logger.exception("receiving results from the daemon failed")
                reason = exc
            self._lost(session, reason)
            self._close_channel()
            if time.monotonic() - opened > self.config.backoff_max_s:
                backoff = self.config.backoff_initial_s  # it was a working session: retry now
                continue
            with self._lock:  # a session that fails at once must not spin
                self._lock.wait_for(lambda: self._closed, timeout=backoff)
            backoff = min(2 * backoff, self.config.backoff_max_s)

    def _note_connect_error(self, exc: AsteriaError) -> None:
        message = str(exc)
        if message != self._last_connect_error:
            self._last_connect_error = message
            logger.warning("cannot open a session with the daemon at %s: %s", self.address, exc)

    def _start(self, session: SessionInfo) -> None:
        """Install a new session; resubmit every block's newest unanswered snapshot."""
        with self._lock:
            if self._incarnation and self._incarnation != session.incarnation_id:
                logger.warning(
                    "the daemon at %s restarted (incarnation %s -> %s); resubmitting %d blocks",
                    self.address,
                    self._incarnation,
                    session.incarnation_id,
                    len(self._blocks),
                )
            if self._incarnation != session.incarnation_id:
                self._incarnations_seen += 1
            self._incarnation = session.incarnation_id
            self._session = session
            self._registered = set()
            self._last_connect_error = ""
            for block in self._blocks.values():
                block.sent_version = -1
                latest = block.latest
                block.pending = latest is not None and latest.version > block.received_version
            self._lock.notify_all()
        logger.info("session open with the daemon at %s (%s)", self.address, session.incarnation_id)

    def _set_cancel(self, cancel: Any) -> None:
        with self._lock:
            self._cancel_stream = cancel
            closed = self._closed
        if closed:
            cancel()

    def _held(self) -> dict[str, int]:
        with self._lock:
            return {
                self._prefix + name: b.received_version
                for name, b in self._blocks.items()
                if b.received_version >= 0
            }

    def _receive(self, result: SolveResult) -> None:
        name = self._local_name(result.block)
        with self._lock:
            block = None if name is None else self._blocks.get(name)
            if block is None or result.version <= block.received_version:
                return  # not ours, or older than one received: versions never go back
            block.received_version = result.version
            block.ready = result
            submitted = block.submitted_at.pop(result.version, None)
            if submitted is not None:
                self._latencies.append(time.monotonic() - submitted)
            for version in [v for v in block.submitted_at if v < result.version]:
                del block.submitted_at[version]  # superseded: they will never be answered
            self._lock.notify_all()

    # ------------------------------------------------------------------ results out
    def _to_torch(self, result: SolveResult, device: torch.device) -> PreconditionerResult:
        return result_from_engine(
            result, device, _to_device, block=result.block[len(self._prefix) :]
        )

    def take(self, block: str) -> PreconditionerResult | None:
        with self._lock:
            record = self._blocks.get(block)
            if record is None or record.ready is None:
                return None
            result, record.ready = record.ready, None
            device = record.device
        return self._to_torch(result, device)

    def _in_flight(self, block: _Block) -> int | None:
        """The newest version queued or sent in this session and not answered yet (locked)."""
        versions = [block.sent_version]
        if block.pending and block.latest is not None:
            versions.append(block.latest.version)
        newest = max(versions)
        return newest if newest > block.received_version else None

    def wait(self, block: str, min_version: int, timeout_s: float) -> PreconditionerResult | None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            record = self._blocks.get(block)
            if record is None:
                return None
            while record.ready is None or record.ready.version < min_version:
                in_flight = self._in_flight(record)
                hopeless = self._session is None or in_flight is None or in_flight < min_version
                left = deadline - time.monotonic()
                if self._closed or hopeless or left <= 0:
                    return None
                self._lock.wait(left)
            result, record.ready = record.ready, None
            device = record.device
        return self._to_torch(result, device)

    def in_flight_version(self, block: str) -> int | None:
        with self._lock:
            record = self._blocks.get(block)
            if record is None or self._session is None:
                return None
            return self._in_flight(record)

    # ------------------------------------------------------------------ status
    def status(self) -> tuple[EngineStats, list[BlockStatus]] | None:
        """The daemon's engine numbers and this tenant's blocks, or None while unreachable."""
        with self._lock:
            session = self._session
        if session is None:
            return None
        try:
            return self._conn.status(session.session_id, timeout_s=self.config.status_timeout_s)
        except AsteriaError:
            return None

    def records(self) -> dict[str, SourceRecord]:
        answer = self.status()
        remote = {} if answer is None else {s.block: s for s in answer[1]}
        remote = {
            n[len(self._prefix) :]: s for n, s in remote.items() if n.startswith(self._prefix)
        }
        with self._lock:
            connected = self._session is not None
            out = {}
            for name, block in self._blocks.items():
                extra: dict[str, Any] = {
                    "daemon_incarnation": self._incarnation,
                    "connected": connected,
                    "daemon_block": self._prefix + name,
                    "submits_dropped": block.dropped,
                    "submits_rejected": block.rejected,
                }
                rec = SourceRecord(
                    submitted_version=-1 if block.latest is None else block.latest.version,
                    computed_version=block.received_version,
                    last_error=block.last_error,
                    extra=extra,
                )
                status = remote.get(name)
                if status is not None:
                    rec.computed_version = max(rec.computed_version, status.version)
                    rec.failures = status.failures
                    rec.consecutive_failures = status.consecutive_failures
                    rec.last_solve_s = status.last_solve_s or 0.0
                    rec.last_error = status.last_error or rec.last_error
                    extra.update(
                        state=status.state.value,
                        queue_position=status.queue_position,
                        in_flight_version=status.in_flight_version,
                        delivered_version=status.delivered_version,
                        age_s=status.age_s,
                    )
                else:
                    in_flight = self._in_flight(block) if connected else None
                    extra.update(
                        state="unknown",
                        queue_position=None,
                        in_flight_version=-1 if in_flight is None else in_flight,
                    )
                out[name] = rec
        return out

    def record(self, block: str) -> SourceRecord:
        return self.records().get(block, SourceRecord())

    def stats(self) -> dict[str, Any]:
        """Client-side counters: connection, incarnations seen, dropped and rejected snapshots."""
        with self._lock:
            latencies = np.asarray(self._latencies, dtype=np.float64)
            timed = latencies.size > 0
            return {
                "results_timed": int(latencies.size),
                "result_latency_p50_s": float(np.percentile(latencies, 50)) if timed else None,
                "result_latency_p99_s": float(np.percentile(latencies, 99)) if timed else None,
                "address": self.address,
                "connected": self._session is not None,
                "daemon_incarnation": self._incarnation,
                "incarnations_seen": self._incarnations_seen,
                "submits_dropped": sum(b.dropped for b in self._blocks.values()),
                "submits_rejected": sum(b.rejected for b in self._blocks.values()),
                "transport": "shm" if self._channel is not None else "grpc",
                "shm_segments": len(self._segments),
                "shm_blocks_refused": sum(bool(b.shm_error) for b in self._blocks.values()),
                **{k: self._counts[k] for k in _COUNTERS},
            }

    def result_latencies(self) -> list[float]:
        """Seconds from ``submit`` to the arrival of that version's result, oldest first, for the
        newest :data:`LATENCY_WINDOW` results (superseded snapshots have none)."""
        with self._lock:
            return list(self._latencies)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            session, cancel = self._session, self._cancel_stream
            self._lock.notify_all()
        if cancel is not None:
            cancel()
        if session is not None:
            with contextlib.suppress(AsteriaError):  # a daemon gone or restarted: nothing to close
                self._conn.close_session(session.session_id)
        for thread in self._threads:
            thread.join(timeout=self.config.call_timeout_s)
        self._conn.close()
        self._close_channel()
        for seg in self._segments.values():
            seg.close()
