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
- a **session thread** (:class:`~asteria_client.transport.session.DaemonSession`) opens the
  session, holds one ``StreamResults`` stream open and reconnects with one backoff policy; this
  source keeps, per block, the newest result received (a result never replaces a newer one). On
  every new session it resubmits the newest snapshot of each block the daemon has not answered
  yet, so a restarted daemon (a new *incarnation*) catches up at once.

The blocks' shared-memory segments and their handover are a
:class:`~asteria_client.transport.segments.SegmentSet`'s, which also heals a lost handover
connection.

While there is no session, snapshots are dropped and counted, ``take`` finds nothing and ``wait``
returns at once: the optimizer's staleness budget turns that into a local computation, so
training continues through a daemon restart. The calls themselves, each with a deadline, are
:class:`~asteria_client.transport.connection.DaemonConnection`'s.
"""

from __future__ import annotations

import collections
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
    result_fields,
    result_from_engine,
)
from asteria_client.runtime.transfer import DeviceTransfer, PendingCopy, StagedArrays
from asteria_client.transport import peer
from asteria_client.transport.connection import (
    DaemonClientConfig,
    DaemonConnection,
    RegisteredJob,
    SessionInfo,
)
from asteria_client.transport.segments import SegmentSet
from asteria_client.transport.session import DaemonSession
from asteria_client.transport.shm import ClientSegment
from asteria_server.errors import (
    AsteriaError,
    DaemonBusyError,
    EngineUnavailableError,
    InvalidInputError,
)
from asteria_server.protocol.shm import (
    ArraySpec,
    SegmentRef,
    SharedMemoryUnavailableError,
    snapshot_specs,
)
from asteria_server.types import (
    ArrivalOrder,
    BlockStatus,
    BlockTable,
    Credit,
    EngineStats,
    SolveKind,
    SolveResult,
    SolveTask,
)

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
    "shm_refused_resent",
    "snapshots_expected",
    "results_invalid",
    "results_received",
    "credit_messages",
)
#: Submit times kept per block for latency measurement (versions awaiting a result).
_SUBMIT_TIMES_KEPT = 16


class _HostCopies:
    """A snapshot's copies into host memory (views of the pinned buffer its step's snapshots
    were packed into, see ``DeviceTransfer.pack``), started on the transfer layer's side
    stream: the sender waits for them, never the step, then writes them into the block's
    segment or sends them in chunks."""

    def __init__(self, copies: list[PendingCopy]) -> None:
        self._copies = copies
        self._done = False

    @property
    def arrays(self) -> list[np.ndarray]:
        """NumPy views of the host buffers (valid once :meth:`finish` returned)."""
        return [c.host.numpy() for c in self._copies]

    @property
    def on_host(self) -> bool:
        return all(c.event is None for c in self._copies)

    @property
    def finished(self) -> bool:
        return self._done

    def ready(self) -> bool:
        return self._done or all(c.ready() for c in self._copies)

    def finish(self) -> None:
        for copy in self._copies:
            copy.wait()
        self._done = True


def _filled(outs: list[np.ndarray]) -> bool:
    """A staging that the chunks of a result fill as they arrive (see ``result_arrays``)."""
    return True


@dataclass
class _Block:
    """What the client knows about one block."""

    device: torch.device
    #: the source's blocks whose snapshot waits for the sender, by name (shared by every
    #: block of a source: the sender and ``credit()`` read it instead of scanning every block)
    waiting: dict[str, _Block]
    name: str
    #: False for a block first seen in a result (a warm start from what the daemon holds for
    #: the job): its device is taken from the first snapshot.
    device_known: bool = True
    latest: SolveTask | None = None  # newest snapshot, kept for a resubmit after a reconnect
    sent_version: int = -1  # newest version the current session accepted
    received_version: int = -1  # newest result received (never goes back)
    ready: SolveResult | None = None  # newest result not taken yet
    ready_staged: StagedArrays | None = None  # its arrays, staged for ``device``
    dropped: int = 0  # snapshots dropped while the daemon was unreachable
    replaced: int = 0  # snapshots replaced by a newer one before the sender sent them
    rejected: int = 0  # snapshots the daemon refused (bad input)
    last_error: str = ""
    submitted_at: dict[int, float] = field(default_factory=dict)  # version -> monotonic time
    #: where the sender writes snapshots (it alone writes it), once created
    snapshot_seg: ClientSegment | None = None
    result_seg: ClientSegment | None = None  # where the daemon writes this block's results
    #: ``latest``'s copies from the device into host memory, not waited for yet
    latest_write: _HostCopies | None = None
    shm_error: str = ""  # why this block's segments could not be made (it uses gRPC)

    @property
    def pending(self) -> bool:
        """``latest`` waits for the sender (kept in ``waiting``, under the source's lock)."""
        return self.name in self.waiting

    @pending.setter
    def pending(self, value: bool) -> None:
        if value:
            self.waiting[self.name] = self
        else:
            self.waiting.pop(self.name, None)


def _result_problem(result: SolveResult, latest: SolveTask | None) -> str | None:
    """Why a result from the daemon must not be installed (None when it may): the shape the
    block's snapshots announce (n), the kind asked for, and finite values. The daemon checks
    this too; the client does not have to trust it."""
    arrays = {
        "matrix": result.matrix,
        "eigenvalues": result.eigenvalues,
        "permutation": result.permutation,
        "rotation": result.rotation,
    }
    n = result.matrix.shape[0] if result.matrix.ndim == 2 else -1
    if latest is not None:
        n = latest.n
        if result.kind is not latest.kind:
            return f"it is a {result.kind.name} result for a {latest.kind.name} block"
    shapes = {"matrix": (n, n), "eigenvalues": (n,), "permutation": (n,), "rotation": (n, n)}
    for field_name, array in arrays.items():
        if array is None:
            continue
        if array.shape != shapes[field_name]:
            return f"its {field_name} has shape {array.shape}, expected {shapes[field_name]}"
        if array.dtype.kind == "f" and not bool(np.isfinite(array).all()):
            return f"its {field_name} holds NaN or Inf"
    if result.kind is SolveKind.EIGENBASIS and result.eigenvalues is None:
        return "an eigenbasis result without its eigenvalues"
    return None


#: The daemon settings that can refuse a RegisterJob, and how an operator raises each.
JOB_LIMITS = ("tenant_max_jobs", "max_job_daemons", "tenant_max_peers", "peer_allow")


def job_refused_message(job: str, address: str, exc: Exception) -> str:
    """What a node leader logs when its daemon refuses the job's layout: that multi-node sync
    is off for this job on this node (training goes on, every block computed here), the
    daemon's reason, and which setting of the daemon raises the limit it names."""
    reason = str(exc)
    limits = [name for name in JOB_LIMITS if name in reason]
    how = (
        "; to raise it, the daemon's operator sets "
        + " / ".join(
            f"{name} (asteria-server --{name.replace('_', '-')}, ASTERIA_{name.upper()}, "
            "or the TOML)"
            for name in limits
        )
        if limits
        else ""
    )
    return (
        f"multi-node sync is OFF for job {job!r} on this node: the daemon at {address} refused "
        f"its layout (RegisterJob, {type(exc).__name__}): {reason}{how}. Training goes on; "
        "this node's ranks get every block from their own daemon (no results from other nodes)"
    )


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
        pulls: bool = False,
        transfer: DeviceTransfer | None = None,
    ) -> None:
        env = client_env()
        self.address = resolve_address(address)
        self.config = config or DaemonClientConfig()
        #: Prefix of this source's block names on the daemon: the job (``ASTERIA_JOB``, else the
        #: launcher's run id; data-parallel replicas
        #: of one job share blocks and results), else a name of its own, so that another run in
        #: the same tenant never hands this one its results.
        self.namespace = (env.job_name if job is None else job) or f"run-{uuid.uuid4().hex[:12]}"
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
        self._waiting: dict[str, _Block] = {}  # the blocks whose snapshot waits for the sender
        self._registered: set[str] = set()  # blocks declared to the current session
        self._job: RegisteredJob | None = None  # registered again on every new session
        #: the warning logged for the job's last refused registration (logged once per reason)
        self._job_refused: str | None = None
        self._results_epoch = 0  # results received so far: lets the runtime skip idle scans
        #: whether a refresh may name its basis by version (see reuses_bases)
        self.bases_home = True
        #: the blocks by the epoch their results became ready at (for results_since)
        self._ready_order = ArrivalOrder()
        #: Seconds from ``submit`` to the result's arrival, newest last (results of every block).
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        #: the staging the session thread just read a result's segment into (see result())
        self._arriving: StagedArrays | None = None
        #: Shared memory: wanted for a ``unix://`` daemon unless turned off.
        self._segments = SegmentSet(
            enabled=self.config.shared_memory
            and env.transport != "grpc"
            and self.address.startswith("unix:")
        )
        self._counts = collections.Counter[str]()
        #: ``refresh="continuous"`` pulls snapshots by :meth:`credit`: the result stream then
        #: carries the daemon's Credit messages (the newest in ``_credit``, None before the
        #: first of a session), and ``_sent`` counts this session's snapshots sent, of which
        #: the daemon's ``snapshots_answered`` tells how many it has taken.
        self._pulls = pulls
        self._credit: Credit | None = None
        self._sent = 0
        #: every copy between the device and the host: snapshots into segments or host
        #: buffers, results to the device, on the side stream
        self._transfer = DeviceTransfer() if transfer is None else transfer
        self._session = DaemonSession(self._conn, self.config, self._lock, self)
        self._sender = threading.Thread(
            target=self._send_loop, name="asteria-daemon-sender", daemon=True
        )
        self._session.start()
        self._sender.start()
        if not self.wait_connected(self.config.connect_timeout_s) and not self._session.refused:
            # (a refused daemon was logged once for the process, with the fix: transport.peer)
            logger.warning(
                "no session with the daemon at %s after %.1f s (%s); training starts with local "
                "computations and switches to the daemon once it answers",
                self.address,
                self.config.connect_timeout_s,
                self._session.last_connect_error or "no answer",
            )

    # ------------------------------------------------------------------ state, for tests and status
    @property
    def connected(self) -> bool:
        with self._lock:
            return self._session.current is not None

    @property
    def incarnation_id(self) -> str:
        """The incarnation of the daemon last connected to ('' before the first session)."""
        with self._lock:
            return self._session.incarnation_id

    @property
    def peer_address(self) -> str:
        """The address this daemon's peers reach it at (its peer listener), as its last session
        said; '' when it has none (or before the first session)."""
        with self._lock:
            return self._session.peer_address

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until a session is open (True) or ``timeout_s`` passes (False)."""
        return self._session.wait_connected(timeout_s)

    # ------------------------------------------------------------------ snapshots in
    def _block(self, name: str, device: torch.device) -> _Block:
        """The record of block ``name`` (locked), made on first sight; a record made for a
        result that came before this process used the block learns its device here."""
        block = self._blocks.get(name)
        if block is None:
            block = self._blocks[name] = _Block(device=device, waiting=self._waiting, name=name)
        elif not block.device_known:
            block.device, block.device_known = device, True
            if block.ready is not None:
                # A warm-start result that came before this first snapshot can be taken now:
                # tell the scans that skip tiles while no result arrived to look again.
                self._note_ready(name)
        return block

    def expect(self, request: PreconditionerRequest) -> None:
        """Another rank of this node uploads this snapshot (data-parallel replicas hold the
        same factor): count its result as in flight here, so ``wait`` waits for it, without
        copying or sending anything. The daemon delivers every result of the job's namespace
        to every session of it."""
        with self._lock:
            block = self._block(request.block, request.matrix.device)
            if self._session.current is not None:
                block.sent_version = max(block.sent_version, request.version)
            block.submitted_at[request.version] = time.monotonic()
            while len(block.submitted_at) > _SUBMIT_TIMES_KEPT:
                del block.submitted_at[min(block.submitted_at)]
            self._counts["snapshots_expected"] += 1

    def submit(self, request: PreconditionerRequest) -> None:
        with self._lock:
            block = self._block(request.block, request.factor_device)
            if block.latest is not None and request.version <= block.latest.version:
                return  # versions never go back
        staged = request.staged
        if staged is None:  # a caller's own request: packed here, as the runtime packs its own
            tensors = [request.matrix] if request.basis is None else [request.matrix, request.basis]
            staged = tuple(self._transfer.pack(tensors))
        copies = _HostCopies(list(staged))
        arrays = copies.arrays
        write: _HostCopies | None = None
        if copies.on_host:
            copies.finish()
        else:
            write = copies  # the sender waits for the copies before it reads them
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
            if block.pending:  # the sender had not sent the one before: latest wins
                block.replaced += 1
            block.latest = task
            block.latest_write = write
            block.submitted_at[task.version] = time.monotonic()
            while len(block.submitted_at) > _SUBMIT_TIMES_KEPT:
                del block.submitted_at[min(block.submitted_at)]
            if self._session.current is None:
                block.pending = False
                block.dropped += 1
                return
            block.pending = True
            self._lock.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while not self._session.closed and (
                    self._session.current is None or not self._waiting
                ):
                    self._lock.wait()
                if self._session.closed:
                    return
                session = self._session.current
                assert session is not None
                writes = [b.latest_write for b in self._waiting.values()]
            for write in writes:  # device copies still in flight: wait here, not in the step,
                if write is not None:  # and without the lock the training thread takes
                    write.finish()
            with self._lock:
                if self._session.current is not session:
                    continue
                batch: list[tuple[_Block, SolveTask]] = []
                for block in list(self._waiting.values()):
                    write = block.latest_write
                    if write is not None:
                        if not write.finished:
                            continue  # a newer copy since: waited for next round, unlocked
                        block.latest_write = None
                    if block.latest is not None:
                        batch.append((block, block.latest))
                        # In flight from now on, so ``wait`` waits for it.
                        block.sent_version = max(block.sent_version, block.latest.version)
                    block.pending = False
                self._sent += len(batch)  # counted from now, so credit() never misses them
                new = [t for _, t in batch if t.block not in self._registered]
            if not batch:
                continue
            try:
                self._send(session, new, batch)
            except Exception as exc:  # a bug here must cost results, never the training run
                logger.exception("sending snapshots to the daemon failed")
                self._session.lost(session, exc)

    def _send(
        self,
        session: SessionInfo,
        new: list[SolveTask],
        batch: list[tuple[_Block, SolveTask]],
    ) -> None:
        try:
            if new:
                self._conn.register(session.session_id, new)
                with self._lock:
                    self._registered.update(t.block for t in new)
        except (InvalidInputError, DaemonBusyError) as exc:  # a limit: registering is advisory
            logger.warning("the daemon refused to register %d blocks: %s", len(new), exc)
        except AsteriaError as exc:
            self._session.lost(session, exc)
            return
        announced: list[tuple[_Block, SolveTask, SegmentRef]] = []
        chunked: list[tuple[_Block, SolveTask]] = []
        self._create_many_segments(session, batch)
        for block, task in batch:
            if task.n > session.max_matrix_n:
                self._reject(task, f"n={task.n} exceeds the daemon's max_matrix_n")
                continue
            shm = self._wire_form(block, task)
            if shm is not None:
                announced.append((block, task, shm))
            else:
                chunked.append((block, task))
        self._count_sent(session, len(announced) + len(chunked) - len(batch))  # not sent
        if announced and not self._announce(session, announced):
            return
        for block, task in chunked:
            try:
                self._conn.submit(session, task)
            except AsteriaError as exc:
                if not self._refused(session, block, task, exc):
                    return
                continue
            self._counts["chunked_snapshots"] += 1

    def _count_sent(self, session: SessionInfo, delta: int) -> None:
        """Correct this session's count of snapshots sent (see ``_sent``); a count of a
        session that ended meanwhile is gone with it."""
        if delta:
            with self._lock:
                if self._session.current is session:
                    self._sent += delta

    def _refused(
        self, session: SessionInfo, block: _Block, task: SolveTask, exc: AsteriaError
    ) -> bool:
        """What the daemon's refusal of one snapshot means: bad input is that snapshot's
        (rejected); a full daemon drops it (the block's next one will go); anything else lost
        the session (False: stop sending this batch)."""
        if isinstance(exc, InvalidInputError):
            self._reject(task, str(exc))
        elif isinstance(exc, DaemonBusyError):
            self._counts["submits_busy"] += 1
            self._unanswered(block)
        else:
            self._session.lost(session, exc)
            return False
        return True

    def _announce(
        self, session: SessionInfo, announced: list[tuple[_Block, SolveTask, SegmentRef]]
    ) -> bool:
        """Announce the snapshots written in segments, all in one call (sender thread); False
        when the session was lost meanwhile."""
        try:
            answers = self._conn.announce(session, [(task, ref) for _, task, ref in announced])
        except AsteriaError as exc:
            self._session.lost(session, exc)
            return False
        for (block, task, shm), answer in zip(announced, answers, strict=True):
            if not isinstance(answer, AsteriaError):
                self._counts["shm_snapshots"] += 1
                continue
            try:
                if not isinstance(answer, InvalidInputError):
                    raise answer
                self._resend_refused(session, block, task, shm, answer)
            except AsteriaError as exc:
                if not self._refused(session, block, task, exc):
                    return False
        return True

    def _resend_refused(
        self,
        session: SessionInfo,
        block: _Block,
        task: SolveTask,
        shm: SegmentRef,
        refusal: InvalidInputError,
    ) -> None:
        """The daemon refused (``refusal``) a snapshot announced in ``shm``: hand the block's
        segments over again (the daemon may have lost them) and send this one in chunks, once.
        Raises what that submit raises."""
        if block.snapshot_seg is None or block.result_seg is None:
            raise refusal
        self._segments.refused((block.snapshot_seg, block.result_seg))
        self._count_sent(session, 1)  # a second snapshot for the daemon to answer
        self._conn.submit(session, task)  # its own arrays: the segment may hold a newer one
        self._counts["shm_refused_resent"] += 1
        self._counts["chunked_snapshots"] += 1

    def _wire_form(self, block: _Block, task: SolveTask) -> SegmentRef | None:
        """How to send ``task`` (sender thread): the ref that announces it in the block's
        snapshot segment, or None to send it in chunks (no segment could be made, it does not
        fit, or the daemon does not hold the segment). The sender is the segment's only
        writer: the training thread's copies land in pinned memory, never in a segment."""
        segment = block.snapshot_seg
        if segment is None:
            return self._create_segments(block, task)
        if not segment.fits(snapshot_specs(task)):
            return None
        ref = segment.write_snapshot(task)
        return ref if self._segments.is_attached(segment) else None

    def _create_many_segments(
        self, session: SessionInfo, batch: list[tuple[_Block, SolveTask]]
    ) -> None:
        """Give the batch's blocks that have none their segments at once (sender thread): a
        first refresh of thousands of blocks hands them over in a few requests. Each block's
        snapshot is written by ``_wire_form`` afterwards, on this thread (its only writer)."""
        fresh = [
            (block, task)
            for block, task in batch
            if block.snapshot_seg is None and not block.shm_error and task.n <= session.max_matrix_n
        ]
        if len(fresh) < 2:
            return
        made = self._segments.create_many([task for _, task in fresh])
        if not made:
            return
        with self._lock:
            for block, task in fresh:
                pair = made.get(task.block)
                if pair is not None:
                    block.snapshot_seg, block.result_seg = pair

    def _create_segments(self, block: _Block, task: SolveTask) -> SegmentRef | None:
        """Give ``block`` its snapshot and result segments and hand them over (sender thread);
        the ref of ``task`` written into the new snapshot segment, or None: use gRPC for it.

        The new snapshot segment is written here, *before* it is published in the block's
        record, and only this thread ever writes it (see ``_wire_form``).
        """
        if block.shm_error:
            return None
        try:
            pair = self._segments.create(task)
        except SharedMemoryUnavailableError as exc:
            block.shm_error = str(exc)
            return None
        if pair is None:
            return None
        snapshot = pair[0]
        ref = snapshot.write_snapshot(task)
        with self._lock:
            block.snapshot_seg, block.result_seg = pair
        return ref if self._segments.is_attached(snapshot) else None

    def _result_device(self, wire_name: str) -> torch.device:
        """Where block ``wire_name``'s results go (the host until its first snapshot)."""
        name = self._local_name(wire_name)
        with self._lock:
            known = None if name is None else self._blocks.get(name)
            return torch.device("cpu") if known is None else known.device

    def result_arrays(self, block: str, specs: list[ArraySpec]) -> list[np.ndarray]:
        """Where a chunked result of ``block`` is assembled (session thread): its staging for
        the block's device, so the assembly is the result's one host copy. (Another run's
        result, which the stream may carry for this tenant, is assembled and dropped.)"""
        if self._local_name(block) is None:
            return [np.empty(spec.shape, spec.dtype) for spec in specs]
        staged = self._transfer.stage(
            [(spec.dtype, spec.shape) for spec in specs], self._result_device(block), _filled
        )
        assert staged is not None  # _filled always fills: the chunks do, as they arrive
        self._arriving = staged  # the result() that follows on this thread is built from it
        return [a for a in staged.arrays if a is not None]

    def _read_result(self, ref: SegmentRef, specs: list[ArraySpec]) -> list[np.ndarray] | None:
        """Copy a result out of its segment (session thread) straight into its staging for
        the block's device (the result's one host copy); None when a newer one replaced it."""
        segment = self._segments.result_segment(ref)
        staged = self._transfer.stage(
            [(spec.dtype, spec.shape) for spec in specs],
            self._result_device(segment.block),
            lambda outs: segment.segment.read_into(specs, ref.sequence, outs) is not None,
        )
        self._counts["shm_results" if staged is not None else "shm_results_overwritten"] += 1
        if staged is None:
            return None
        self._arriving = staged  # the result() that follows on this thread is built from it
        return [a for a in staged.arrays if a is not None]

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

    # ------------------------------------------------------------------ session events
    def session_opened(self, session: SessionInfo, restarted: bool) -> None:
        """A new session (lock held): resubmit every block's newest unanswered snapshot."""
        self._registered = set()
        self._credit, self._sent = None, 0
        for block in self._blocks.values():
            block.sent_version = -1
            latest = block.latest
            block.pending = latest is not None and latest.version > block.received_version

    def session_ready(self, session: SessionInfo) -> Any:
        """Hand the segments over to the new session; the stream reads results from them.
        A job registered before is registered again (a restarted daemon forgot it)."""
        self._segments.open(session)
        if self._job is not None:
            self._register_job(session, self._job)
        return self._read_result if self._segments.active else None

    def held_versions(self) -> dict[str, int]:
        with self._lock:
            return {
                self._prefix + name: b.received_version
                for name, b in self._blocks.items()
                if b.received_version >= 0
            }

    def session_lost(self, session: SessionInfo) -> None:
        """The session ended (lock held): snapshots waiting for the sender are dropped."""
        for block in list(self._waiting.values()):
            block.pending = False
            block.dropped += 1

    def session_closed(self) -> None:
        self._segments.close_channel()

    def result(self, result: SolveResult) -> None:
        name = self._local_name(result.block)
        if name is None:
            return  # another job's block
        with self._lock:
            self._counts["results_received"] += 1  # each was staged once, kept or not
            block = self._blocks.get(name)
            if block is None:  # held by the daemon from before this process: a warm start
                block = self._blocks[name] = _Block(
                    device=torch.device("cpu"), waiting=self._waiting, name=name, device_known=False
                )
            if result.version <= block.received_version:
                return  # older than one received: versions never go back
            latest = block.latest
        # n² reads: never under the lock the training thread's submit and take need
        problem = _result_problem(result, latest)
        arriving, self._arriving = self._arriving, None
        fields = result_fields(result)
        staged: StagedArrays | None = None
        if problem is None:  # staged once, here: read from its segment, or copied from chunks
            staged = (
                StagedArrays(arriving.buffer, fields)
                if arriving is not None and arriving.holds(fields)
                else self._transfer.stage_arrays(fields, block.device)
            )
        with self._lock:
            if result.version <= block.received_version:
                return  # a newer one came meanwhile
            if problem is not None:
                # Dropped, never installed: the block keeps its last good result, and nothing
                # waits for this version any more, so the staleness budget computes it locally.
                self._counts["results_invalid"] += 1
                block.last_error = f"the daemon sent an invalid result: {problem}"
                if block.sent_version <= result.version:
                    block.sent_version = block.received_version
                self._lock.notify_all()
                if self._counts["results_invalid"] == 1:
                    logger.warning(
                        "dropped a result of block %s version %d from the daemon: %s",
                        name,
                        result.version,
                        problem,
                    )
                return
            block.received_version = result.version
            block.ready = result
            block.ready_staged = staged
            self._note_ready(name)
            submitted = block.submitted_at.pop(result.version, None)
            if submitted is not None:
                self._latencies.append(time.monotonic() - submitted)
            for version in [v for v in block.submitted_at if v < result.version]:
                del block.submitted_at[version]  # superseded: they will never be answered
            self._lock.notify_all()

    def snapshot_transfer(self) -> DeviceTransfer:
        return self._transfer

    def solves_on_this_host(self) -> bool:
        return self.address.startswith("unix:")

    def credit_wanted(self) -> bool:
        return self._pulls

    def credit_received(self, credit: Credit) -> None:
        with self._lock:
            self._credit = credit
            self._counts["credit_messages"] += 1

    def credit(self) -> int | None:
        """What the daemon's newest Credit message allows (see ``Credit.for_client``), less
        the snapshots sent or waiting for the sender that it does not count yet. Without a
        session: 0 (the staleness budget computes locally). Before the session's first Credit
        message (or from a daemon that sends none): one snapshot outstanding at a time."""
        with self._lock:
            if self._session.current is None:
                return 0
            pending = len(self._waiting)
            credit = self._credit
            if credit is None:
                unanswered = sum(
                    1 for b in self._blocks.values() if b.sent_version > b.received_version
                )
                return max(0, 1 - pending - unanswered)
            return credit.for_client(pending + max(0, self._sent - credit.snapshots_answered))

    # ------------------------------------------------------------------ results out
    def _to_torch(
        self, result: SolveResult, device: torch.device, staged: StagedArrays | None
    ) -> PreconditionerResult:
        name = result.block[len(self._prefix) :]
        return result_from_engine(result, device, self._transfer, block=name, staged=staged)

    def take(self, block: str) -> PreconditionerResult | None:
        with self._lock:
            record = self._blocks.get(block)
            if record is None or record.ready is None or not record.device_known:
                return None  # (a warm-start result waits for the block's first snapshot)
            result, record.ready = record.ready, None
            staged, record.ready_staged = record.ready_staged, None
            device = record.device
        return self._to_torch(result, device, staged)

    def reuses_bases(self) -> bool:
        """A refresh names the basis in use by its version and the daemon refreshes from its
        own result of it (read by the solver worker from this client's result segment), so the
        basis stays on the device; where the daemon no longer holds that result (a newer one,
        a restart, or one that predates this) it makes a full eigendecomposition instead.
        Off (``bases_home``) for a job on several nodes, whose blocks' results may come from
        another node's daemon."""
        return self.bases_home

    def results_epoch(self) -> int | None:
        return self._results_epoch  # an int read: no lock needed

    def results_since(self, epoch: int) -> list[str] | None:
        with self._lock:
            return self._ready_order.since(epoch)

    def _note_ready(self, name: str) -> None:
        """Block ``name`` has a result to take (lock held): a new epoch, the block moved to
        the end of the epoch order."""
        self._results_epoch += 1
        self._ready_order.note(name, self._results_epoch)

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
                hopeless = (
                    self._session.current is None or in_flight is None or in_flight < min_version
                )
                left = deadline - time.monotonic()
                if self._session.closed or hopeless or left <= 0:
                    return None
                self._lock.wait(left)
            result, record.ready = record.ready, None
            staged, record.ready_staged = record.ready_staged, None
            device = record.device
        return self._to_torch(result, device, staged)

    def in_flight_version(self, block: str) -> int | None:
        with self._lock:
            record = self._blocks.get(block)
            if record is None or self._session.current is None:
                return None
            return self._in_flight(record)

    # ------------------------------------------------------------------ jobs
    def register_job(self, job: RegisteredJob) -> bool:
        """Register the job's layout with the daemon now and again on every new session (a
        restarted daemon learns it back). False when there is no session now: the next one
        registers it."""
        with self._lock:
            self._job = job
            session = self._session.current
        return session is not None and self._register_job(session, job)

    def _register_job(self, session: SessionInfo, job: RegisteredJob) -> bool:
        try:
            self._conn.register_job(session.session_id, job)
        except AsteriaError as exc:  # the job registry is advisory: training goes on
            message = job_refused_message(job.job, self.address, exc)
            if message != self._job_refused:  # once per refusal, not on every new session
                logger.warning("%s", message)
            self._job_refused = message
            return False
        self._job_refused = None
        return True

    def jobs(self) -> list[RegisteredJob]:
        """The jobs this tenant registered with the daemon ([] while unreachable)."""
        with self._lock:
            session = self._session.current
        if session is None:
            return []
        try:
            return self._conn.list_jobs(session.session_id)
        except AsteriaError:
            return []

    # ------------------------------------------------------------------ status
    def status(self) -> tuple[EngineStats, BlockTable] | None:
        """The daemon's engine numbers and this tenant's blocks, or None while unreachable."""
        with self._lock:
            session = self._session.current
        if session is None:
            return None
        try:
            return self._conn.status(session.session_id, timeout_s=self.config.status_timeout_s)
        except AsteriaError:
            return None

    def status_page(self) -> int:
        """One Status RPC of this session (its first page): what a dashboard polling the
        daemon costs it. Raises an AsteriaError when there is no session or the call fails."""
        with self._lock:
            session = self._session.current
        if session is None:
            raise EngineUnavailableError("no session with the daemon")
        return self._conn.status_page(session.session_id, timeout_s=self.config.status_timeout_s)

    def registered_blocks(self) -> int:
        """How many blocks the current session has declared to the daemon (RegisterBlocks)."""
        with self._lock:
            return len(self._registered)

    def records(self) -> dict[str, SourceRecord]:
        answer = self.status()
        remote = {} if answer is None else {s.block: s for s in answer[1]}
        remote = {
            n[len(self._prefix) :]: s for n, s in remote.items() if n.startswith(self._prefix)
        }
        with self._lock:
            return {
                name: self._record_of(name, block, remote.get(name))
                for name, block in self._blocks.items()
            }

    def _record_of(self, name: str, block: _Block, status: BlockStatus | None) -> SourceRecord:
        """One block's record (locked): this client's view, with the daemon's ``status`` of
        it when known."""
        connected = self._session.current is not None
        extra: dict[str, Any] = {
            "daemon_incarnation": self._session.incarnation_id,
            "connected": connected,
            "daemon_block": self._prefix + name,
            "submits_dropped": block.dropped,
            "submits_replaced": block.replaced,
            "submits_rejected": block.rejected,
        }
        rec = SourceRecord(
            submitted_version=-1 if block.latest is None else block.latest.version,
            computed_version=block.received_version,
            last_error=block.last_error,
            extra=extra,
        )
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
        return rec

    def record(self, block: str) -> SourceRecord:
        """This client's view of one block, without a call to the daemon (``records()`` adds
        the daemon's view of every block, in one status read)."""
        with self._lock:
            known = self._blocks.get(block)
            return SourceRecord() if known is None else self._record_of(block, known, None)

    def stats(self) -> dict[str, Any]:
        """Client-side counters: connection, incarnations seen, dropped, replaced (by a newer
        snapshot before they were sent) and rejected snapshots."""
        with self._lock:
            latencies = np.asarray(self._latencies, dtype=np.float64)
            timed = latencies.size > 0
            return {
                "results_timed": int(latencies.size),
                "result_latency_p50_s": float(np.percentile(latencies, 50)) if timed else None,
                "result_latency_p99_s": float(np.percentile(latencies, 99)) if timed else None,
                "address": self.address,
                "connected": self._session.current is not None,
                "daemon_incarnation": self._session.incarnation_id,
                "incarnations_seen": self._session.incarnations_seen,
                "submits_dropped": sum(b.dropped for b in self._blocks.values()),
                "submits_replaced": sum(b.replaced for b in self._blocks.values()),
                "submits_rejected": sum(b.rejected for b in self._blocks.values()),
                "transport": "shm" if self._segments.active else "grpc",
                "shm_segments": len(self._segments),
                "shm_mappings": self._segments.num_mappings,
                "shm_rehandovers": self._segments.rehandovers,
                "shm_refusals": self._segments.refusals,
                "shm_blocks_refused": sum(bool(b.shm_error) for b in self._blocks.values()),
                # Daemons refused for their uid: by this source now, by the process ever.
                "daemon_refused": self._session.refused,
                "daemon_refusals": peer.refusals(),
                **{k: self._counts[k] for k in _COUNTERS},
            }

    def refused_reason(self) -> str | None:
        with self._lock:
            refused = self._session.current is None and self._session.refused
            return self._session.last_connect_error if refused else None

    def segments(self) -> dict[str, ClientSegment]:
        """This source's shared-memory segments by id (tests and diagnostics)."""
        return self._segments.by_id()

    def result_latencies(self) -> list[float]:
        """Seconds from ``submit`` to the arrival of that version's result, oldest first, for the
        newest :data:`LATENCY_WINDOW` results (superseded snapshots have none)."""
        with self._lock:
            return list(self._latencies)

    def close(self) -> None:
        if self._session.closed:
            return
        self._session.close()
        self._sender.join(timeout=self.config.call_timeout_s)
        self._conn.close()
        # Copies still landing in host memory (nothing waited for them: no session, or the
        # sender gave up) complete before their buffers can be let go.
        self._transfer.drain()
        self._segments.close()
