"""Asteria's value types: what both sides of every boundary speak. A leaf: it imports nothing
else of the project but :mod:`asteria_server.errors`.

The engine, the protocol layer, the daemon and the torch client all exchange these, so that no
layer needs another's implementation to name what it passes around:

- :class:`SolveTask` carries one factor snapshot of one block, tagged with the optimizer step it
  was taken at (its *version*); :class:`SolveResult` carries what was computed from it. Both are
  plain frozen dataclasses of NumPy arrays and scalars.
- :class:`SubmitOutcome` says how a submit went (none of its values is an error).
- :class:`BlockStatus` / :class:`BlockState`, :class:`EngineStats` and :class:`TransportStats` are
  what ``Status`` reports.

Construction checks only what can be checked cheaply and is the caller's fault (shape, dtype,
ranges) and raises :class:`~asteria_server.errors.InvalidInputError`. Whether the matrix is
finite, symmetric and positive semi-definite is the solver's business: such a snapshot is
accepted here and its solve is reported as *failed*, because a factor that went bad during
training is a numerical event to count and survive, not a programming error.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, overload

import numpy as np

from asteria_server.errors import InvalidInputError

#: dtypes a factor snapshot or a basis may have (results are always float32).
ACCEPTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

DEFAULT_TENANT = "local"

#: The largest version a snapshot (or a peer's pushed result) may carry, and the most a block's
#: version may jump at once: a client's or a peer's bug (or malice) cannot put a block out of
#: reach of every later version. The Preconditioner and Peer services both apply them.
MAX_VERSION = 1 << 48
MAX_VERSION_JUMP = 1 << 30


class ArrivalOrder:
    """Names with the epoch each last arrived at, kept in arrival order (newest last), so
    :meth:`since` reads only the names newer than asked, not all of them. The epochs come
    from the caller's counter (one counter may serve several orders). Not thread-safe: the
    owner's lock guards it."""

    def __init__(self) -> None:
        self._epochs: dict[str, int] = {}

    def note(self, name: str, epoch: int) -> None:
        """``name`` arrived at ``epoch`` (not below any epoch noted before): it moves last."""
        self._epochs.pop(name, None)
        self._epochs[name] = epoch

    def forget(self, name: str) -> None:
        self._epochs.pop(name, None)

    def since(self, epoch: int) -> list[str]:
        """The names that arrived after ``epoch``, newest first."""
        newer = []
        for name in reversed(self._epochs):
            if self._epochs[name] <= epoch:
                break
            newer.append(name)
        return newer


class SolveKind(enum.Enum):
    """What a block needs computed from its factor snapshot."""

    #: ``(A + epsilon I)^(-exponent)`` with negative eigenvalues of A clamped to zero (Shampoo).
    INVERSE_ROOT = "inverse_root"
    #: An orthonormal eigenbasis with eigenvalue estimates (SOAP, KL-Shampoo).
    EIGENBASIS = "eigenbasis"


class SubmitOutcome(enum.Enum):
    """What happened to a submitted snapshot. None of these is an error."""

    #: Accepted; nothing older of this block was waiting.
    QUEUED = "queued"
    #: Accepted; it replaced an older snapshot of the same block that had not started (latest wins).
    SUPERSEDED_QUEUED = "superseded_queued"
    #: This exact (block, version) was already submitted; nothing changed.
    DUPLICATE = "duplicate"
    #: Older than a version already submitted for this block; ignored (versions never go back).
    STALE_IGNORED = "stale_ignored"

    @property
    def accepted(self) -> bool:
        """True when the snapshot will be computed."""
        return self in (SubmitOutcome.QUEUED, SubmitOutcome.SUPERSEDED_QUEUED)


class SharedSegment(Protocol):
    """A shared-memory segment as the engine hands it on (``protocol.shm.Segment`` is one)."""

    size_bytes: int

    @property
    def token(self) -> int:
        """Unique in this process while its mapping lives (a descriptor number is reused, this
        not); an arena's slots share the arena's."""
        ...

    @property
    def slot_index(self) -> int:
        """The slot's index in its arena (-1: a whole segment)."""
        ...

    @property
    def mapping(self) -> SharedSegment:
        """What is mapped (and handed to a worker): a slot's arena, else the segment itself."""
        ...

    @property
    def map_bytes(self) -> int:
        """The size of :attr:`mapping`."""
        ...

    def fileno(self) -> int:
        """A descriptor of the segment, open while this object lives."""
        ...

    def read(self, specs: Any, sequence: int) -> list[np.ndarray] | None:
        """Private copies of the arrays written with ``sequence`` (None: overwritten since)."""
        ...


# slots: the engine holds one with every shared-memory result (no __dict__ each)
@dataclass(frozen=True, eq=False, slots=True)
class SharedArrays:
    """Where a snapshot's or a result's arrays lie in a client's shared-memory segment.

    The daemon's same-host path: the client wrote its snapshot into ``segment`` (a write that
    ended with seqlock value ``sequence``), and a solver worker reads it from there and writes
    the result into the client's result segment itself, so the daemon process copies neither.
    ``segment_id`` is the client's name for a result's segment (what the client is told to read);
    a snapshot's source leaves it empty: the worker reads it through ``segment``, and a name kept
    per queued snapshot was ~70 bytes a block at the height of a refresh round. Holding this
    keeps the segment (and its descriptor) alive.
    """

    segment: SharedSegment
    segment_id: str = ""
    sequence: int = 0


def _fail(block: object, field_name: str, problem: str) -> InvalidInputError:
    return InvalidInputError(f"SolveTask for block {block!r}: {field_name} {problem}")


def _check_square(block: object, field_name: str, array: object) -> int:
    """Return n for an n×n float32/float64 ndarray, else raise naming the field."""
    if not isinstance(array, np.ndarray):
        raise _fail(block, field_name, f"must be a numpy.ndarray, got {type(array).__name__}")
    if array.ndim != 2 or array.shape[0] != array.shape[1]:
        raise _fail(block, field_name, f"must be a square 2-D matrix, got shape {array.shape}")
    if array.shape[0] < 1:
        raise _fail(block, field_name, "must be at least 1x1, got an empty matrix")
    if array.dtype not in ACCEPTED_DTYPES:
        raise _fail(block, field_name, f"must be float32 or float64, got dtype {array.dtype}")
    return int(array.shape[0])


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


# slots: a daemon holds one per queued block, all of a client's blocks at a refresh step
# (no __dict__ each; what the queue held at its peak stays in the daemon's RSS)
@dataclass(frozen=True, kw_only=True, eq=False, slots=True, weakref_slot=True)
class SolveTask:
    """One factor snapshot of one block and what to compute from it.

    The engine does not copy ``matrix`` or ``basis`` at submit time: it reads them when the task
    is handed to a worker. The caller gives up the right to modify them once submitted (take a
    copy first if the buffer is reused).

    Attributes:
        block: the block's key within its tenant (any non-empty string).
        version: the optimizer step the snapshot was taken at (>= 0).
        kind: what to compute.
        matrix: the n×n float32 or float64 factor snapshot.
        exponent: INVERSE_ROOT computes ``A^(-exponent)`` (> 0; Shampoo order 2: 0.25).
        epsilon: the ``epsilon * I`` regularizer (>= 0); the solver may escalate it on retries.
        basis: EIGENBASIS only: the basis Q in use, refreshed by one QR power step; None asks for
            a full eigendecomposition.
        base_version: the version ``basis`` was computed from (-1 when there is none).
        deadline: priority; smaller is more urgent. The client passes the step at which this
            block would exceed its staleness budget. Compared only within one tenant.
        tenant: who the block belongs to; tenants never see each other's blocks.
        shm_source: set when the snapshot lies in a client's segment (the daemon's same-host
            path): nobody but the solver worker reads it, there, under the seqlock at
            ``shm_source.sequence``; a newer write there supersedes this task. ``matrix`` and
            ``basis`` are then only the arrays' dtypes and shapes: views of the segment or
            stand-ins that hold nothing (``Segment.stand_ins``: what a daemon queues).
        shm_result: the client's segment that receives this task's result, if it has one.
        shm_basis: EIGENBASIS only, with ``basis`` None: the basis to refresh is the block's
            result of ``base_version``, which lies in a client's result segment (written with
            ``shm_basis.sequence``); the solver worker reads it there (it never crosses this
            process), and where it was overwritten since, makes a full eigendecomposition
            instead (its result's ``base_version`` is then -1).
    """

    block: str
    version: int
    kind: SolveKind
    matrix: np.ndarray
    exponent: float = 0.25
    epsilon: float = 1e-12
    basis: np.ndarray | None = None
    base_version: int = -1
    deadline: float = math.inf
    tenant: str = DEFAULT_TENANT
    shm_source: SharedArrays | None = None
    shm_result: SharedArrays | None = None
    shm_basis: SharedArrays | None = None

    def __post_init__(self) -> None:
        block = self.block
        if not isinstance(block, str) or not block:
            raise _fail(block, "block", "must be a non-empty string")
        if not isinstance(self.tenant, str) or not self.tenant:
            raise _fail(block, "tenant", f"must be a non-empty string, got {self.tenant!r}")
        if not isinstance(self.kind, SolveKind):
            raise _fail(block, "kind", f"must be a SolveKind, got {self.kind!r}")
        if not _is_int(self.version) or self.version < 0:
            raise _fail(block, "version", f"must be an int >= 0, got {self.version!r}")
        n = _check_square(block, "matrix", self.matrix)
        if not _is_real(self.exponent) or not (0.0 < float(self.exponent) < math.inf):
            raise _fail(block, "exponent", f"must be a finite number > 0, got {self.exponent!r}")
        if not _is_real(self.epsilon) or not (0.0 <= float(self.epsilon) < math.inf):
            raise _fail(block, "epsilon", f"must be a finite number >= 0, got {self.epsilon!r}")
        if not _is_real(self.deadline) or math.isnan(float(self.deadline)):
            raise _fail(block, "deadline", f"must be a number (inf allowed), got {self.deadline!r}")
        if not _is_int(self.base_version) or self.base_version < -1:
            raise _fail(block, "base_version", f"must be an int >= -1, got {self.base_version!r}")
        if self.basis is not None:
            if self.kind is not SolveKind.EIGENBASIS:
                raise _fail(block, "basis", f"is only meaningful for EIGENBASIS, not {self.kind}")
            m = _check_square(block, "basis", self.basis)
            if m != n:
                raise _fail(block, "basis", f"must be {n}x{n} like matrix, got {self.basis.shape}")
        if self.shm_basis is not None and (
            self.kind is not SolveKind.EIGENBASIS or self.basis is not None or self.base_version < 0
        ):
            raise _fail(
                block, "shm_basis", "needs an EIGENBASIS task without basis, base_version >= 0"
            )

    @property
    def n(self) -> int:
        """The factor's dimension."""
        return int(self.matrix.shape[0])

    @property
    def key(self) -> tuple[str, str]:
        """``(tenant, block)``: the identity of the block across versions."""
        return (self.tenant, self.block)

    @property
    def is_refresh(self) -> bool:
        """True for an EIGENBASIS task that refreshes a given basis with one QR step."""
        return self.basis is not None or self.shm_basis is not None


# slots: the engine holds one per block (no __dict__ each); weakly referable for the tests
# that check nothing keeps a dropped one alive
@dataclass(frozen=True, kw_only=True, eq=False, slots=True, weakref_slot=True)
class SolveResult:
    """What the engine computed from one snapshot.

    Attributes:
        block, version, kind: copied from the task (``version`` is the snapshot's step).
        matrix: float32 n×n: the inverse root, or the basis Q (orthonormal columns, each column's
            largest-magnitude entry positive).
        eigenvalues: EIGENBASIS only: float32 eigenvalue estimates of the factor (not including
            epsilon), in Q's column order; descending for a full decomposition.
        permutation: QR refresh only: int64 column order applied to the *base* basis before the
            QR step (``Q_base[:, permutation]``), so a client can permute its second moments the
            same way SOAP does.
        rotation: QR refresh only: float32 ``Q_new^T Q_base``, the change of basis a client applies
            to moments kept in the base basis.
        base_version: the version of the basis a refresh started from (-1 otherwise).
        epsilon_used: the regularizer of the attempt that succeeded.
        solve_time_s: seconds the successful solve took in its worker.
        attempts: tries it took: solver attempts of the successful run plus worker runs lost to
            a crash or timeout before it.
        tenant: copied from the task.
        shm: set when the worker wrote the arrays into a client's result segment (the write
            that ended with ``shm.sequence``), which the client may overwrite: the arrays here
            are then only their dtypes and shapes (stand-ins that hold nothing,
            ``Segment.stand_ins``: a daemon keeps no views of every block's result), and
            whoever wants their values reads them there under that seqlock
            (``protocol.shm.private_result``).
    """

    block: str
    version: int
    kind: SolveKind
    matrix: np.ndarray
    eigenvalues: np.ndarray | None
    permutation: np.ndarray | None
    base_version: int
    epsilon_used: float
    solve_time_s: float
    attempts: int
    tenant: str = DEFAULT_TENANT
    rotation: np.ndarray | None = None
    shm: SharedArrays | None = None

    @property
    def key(self) -> tuple[str, str]:
        """``(tenant, block)``."""
        return (self.tenant, self.block)

    def is_finite(self) -> bool:
        """True when every array in the result is finite (the engine never delivers otherwise).
        Not for a result in a client's segment, whose arrays here hold nothing: read it with
        ``protocol.shm.private_result`` first."""
        if self.shm is not None:
            raise ValueError(f"result of {self.block!r} lies in a shared segment: copy it first")
        arrays = [a for a in (self.matrix, self.eigenvalues, self.rotation) if a is not None]
        return all(bool(np.isfinite(a).all()) for a in arrays)


class BlockState(enum.Enum):
    """Where a block is. FAILED wins over the others until a solve of the block succeeds."""

    IDLE = "idle"
    QUEUED = "queued"
    RUNNING = "running"
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True)
class BlockStatus:
    """A snapshot of one block's record, for ``status()`` and ``asteria status``.

    Versions are -1 when there is none; times are None when the event never happened.
    ``in_flight_version`` is the queued version if any, else the running one.
    """

    tenant: str
    block: str
    version: int
    submitted_version: int
    in_flight_version: int
    queued_version: int
    running_version: int
    delivered_version: int
    staleness_steps: int
    age_s: float | None
    submitted_age_s: float | None
    delivered_age_s: float | None
    last_solve_s: float | None
    failures: int
    consecutive_failures: int
    duplicates: int
    stale_ignored: int
    superseded: int
    state: BlockState
    last_error: str | None
    queue_position: int | None
    tier: str = ""  # where its newest result is held: "host", "shm", "spill"; "" none

    def to_dict(self) -> dict[str, object]:
        """JSON-ready mapping (``state`` as its string value)."""
        out = asdict(self)
        out["state"] = self.state.value
        return out


#: The columns :class:`BlockTable` keeps, in :class:`BlockStatus` field order; the fields it
#: leaves out (``tenant``, ``in_flight_version``, ``staleness_steps``) follow from them.
BLOCK_COLUMNS = (
    "block",
    "version",
    "submitted_version",
    "queued_version",
    "running_version",
    "delivered_version",
    "age_s",
    "submitted_age_s",
    "delivered_age_s",
    "last_solve_s",
    "failures",
    "consecutive_failures",
    "duplicates",
    "stale_ignored",
    "superseded",
    "state",
    "last_error",
    "queue_position",
    "tier",
)

_STATUS_FIELDS = (
    "tenant",
    "block",
    "version",
    "submitted_version",
    "in_flight_version",
    "queued_version",
    "running_version",
    "delivered_version",
    "staleness_steps",
    *BLOCK_COLUMNS[6:],
)


class BlockTable(Sequence[BlockStatus]):
    """Many blocks of one tenant as columns (one list per field, entry i of each is block i):
    what a Status read of thousands of blocks is held as. Indexing or iterating gives
    :class:`BlockStatus` values, made on demand; :meth:`to_dicts` gives the JSON rows without
    making them. A record per block cost about 40 µs from the engine to ``asteria status
    --json`` (160,000 blocks: seconds), a table row a few."""

    __slots__ = ("columns", "tenant")

    def __init__(self, tenant: str, columns: dict[str, list[Any]] | None = None) -> None:
        self.tenant = tenant
        self.columns: dict[str, list[Any]] = (
            {name: [] for name in BLOCK_COLUMNS} if columns is None else columns
        )
        lengths = {len(v) for v in self.columns.values()}
        if set(self.columns) != set(BLOCK_COLUMNS) or len(lengths) > 1:
            raise InvalidInputError(
                f"BlockTable: columns must be {BLOCK_COLUMNS} of one length, got "
                f"{ {k: len(v) for k, v in self.columns.items()} }"
            )

    @classmethod
    def of(cls, tenant: str, blocks: Iterable[BlockStatus]) -> BlockTable:
        """The table of ``blocks`` (records, e.g. from a daemon that sends no columns)."""
        table = cls(tenant)
        for b in blocks:
            for name, column in table.columns.items():
                column.append(getattr(b, name))
        return table

    def head(self, count: int) -> BlockTable:
        """The first ``count`` blocks, as a table of their own."""
        return BlockTable(self.tenant, {k: v[:count] for k, v in self.columns.items()})

    def extend(self, other: BlockTable) -> None:
        for name, column in self.columns.items():
            column.extend(other.columns[name])

    def __len__(self) -> int:
        return len(self.columns["block"])

    @overload
    def __getitem__(self, index: int) -> BlockStatus: ...
    @overload
    def __getitem__(self, index: slice) -> list[BlockStatus]: ...
    def __getitem__(self, index: int | slice) -> BlockStatus | list[BlockStatus]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        c = self.columns
        queued, running = c["queued_version"][index], c["running_version"][index]
        values = {name: column[index] for name, column in c.items()}
        return BlockStatus(
            tenant=self.tenant,
            in_flight_version=queued if queued >= 0 else running,
            staleness_steps=values["submitted_version"] - values["version"],
            **values,
        )

    def __iter__(self) -> Iterator[BlockStatus]:
        for i in range(len(self)):
            yield self[i]

    def to_dicts(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per block, equal to its :meth:`BlockStatus.to_dict`."""
        c = self.columns
        n = len(self)
        derived = {
            "tenant": [self.tenant] * n,
            "in_flight_version": [
                q if q >= 0 else r
                for q, r in zip(c["queued_version"], c["running_version"], strict=True)
            ],
            "staleness_steps": [
                s - v for s, v in zip(c["submitted_version"], c["version"], strict=True)
            ],
            "state": [s.value for s in c["state"]],
        }
        ordered = [derived[name] if name in derived else c[name] for name in _STATUS_FIELDS]
        return [dict(zip(_STATUS_FIELDS, row, strict=True)) for row in zip(*ordered, strict=True)]


@dataclass(frozen=True, kw_only=True)
class BlockSummary:
    """What a tenant's blocks add up to (``asteria status`` without ``--blocks``): counts by
    state and tier, staleness in steps (median, p99, largest), the oldest result's age, all
    failures, and ``worst``: the failed blocks, then the most stale (their queue positions are
    None: not computed for a summary)."""

    idle: int = 0
    queued: int = 0
    running: int = 0
    failed: int = 0
    tier_host: int = 0
    tier_shm: int = 0
    tier_spill: int = 0
    tier_none: int = 0
    never_computed: int = 0
    staleness_steps_p50: int = 0
    staleness_steps_p99: int = 0
    staleness_steps_max: int = 0
    oldest_result_age_s: float | None = None
    failures: int = 0
    worst: BlockTable = dataclasses.field(default_factory=lambda: BlockTable(""))

    @property
    def blocks(self) -> int:
        return self.idle + self.queued + self.running + self.failed

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "worst"
        }
        out["blocks"] = self.blocks
        out["worst"] = self.worst.to_dicts()
        return out


@dataclass(frozen=True, kw_only=True)
class WorkerState:
    """One solver worker now, for ``asteria status``.

    ``state`` is ``starting``, ``idle``, ``busy``, ``overdue`` (running past twice its expected
    cost and at least a second) or ``stopped`` (its process is stopped by a signal). ``block``
    is empty when idle, or when the viewer may not see the block's tenant.
    """

    index: int
    pid: int
    state: str
    block: str = ""
    n: int = 0
    elapsed_s: float = 0.0
    expected_s: float = 0.0
    timeout_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """Engine-wide health numbers for ``asteria status``."""

    incarnation_id: str
    uptime_s: float
    num_workers: int
    workers_busy: int
    workers_idle: int
    worker_restarts: int
    queue_depth: int
    blocks: int
    solves_done: int
    solves_failed: int
    results_discarded: int
    seconds_per_n3: float
    closed: bool
    broken_reason: str | None
    workers: tuple[WorkerState, ...] = ()
    cache_host_bytes: int = 0
    cache_budget_bytes: int = 0  # 0: unbounded
    results_spilled: int = 0
    spill_bytes: int = 0
    results_dropped: int = 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Credit:
    """A daemon's capacity as one session sees it (the proto's Credit message): what a client
    that pulls snapshots (``refresh="continuous"``) may send.

    Attributes:
        workers_idle: solver workers waiting for work, all tenants together.
        queued: snapshots of the session's tenant waiting for a worker.
        snapshots_answered: the session's snapshots the daemon has answered so far.
    """

    workers_idle: int
    queued: int
    snapshots_answered: int

    def for_client(self, unanswered: int) -> int:
        """How many more snapshots to send, ``unanswered`` being those the client sent that
        ``snapshots_answered`` does not count: free workers + 1, less what waits for one; 0
        while every worker is busy (as the embedded engine's credit)."""
        if self.workers_idle <= 0:
            return 0
        return max(0, self.workers_idle + 1 - self.queued - unanswered)


@dataclass(frozen=True, kw_only=True)
class TransportStats:
    """Shared-memory handovers and snapshot uploads of one daemon, right now.

    Attributes:
        shm_connections: clients connected to the segment-handover socket.
        shm_segments: segments those clients handed over (each one mapping in the daemon).
        shm_mapped_bytes: their total size.
        upload_bytes_in_flight: snapshot bytes being received now (chunks or segment copies).
        upload_budget_bytes: the limit on those (``max_upload_bytes``).
        uploads_waiting: uploads waiting for room in that budget.
        snapshots_received: snapshots received and handed to the engine, all time.
        snapshot_bytes_received: their bytes (chunks, or announced in shared memory).
    """

    shm_connections: int = 0
    shm_segments: int = 0
    shm_mapped_bytes: int = 0
    upload_bytes_in_flight: int = 0
    upload_budget_bytes: int = 0
    uploads_waiting: int = 0
    snapshots_received: int = 0
    snapshot_bytes_received: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
