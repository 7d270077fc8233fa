"""The one module that converts between protobuf messages and Asteria's Python values.

Values: :class:`SolveTask` (a SubmitSnapshot header), :class:`SolveResult` (a StreamResults
header), :class:`SubmitOutcome`, :class:`BlockStatus` and :class:`EngineStats` (a
StatusResponse), :class:`SegmentRef` (where shared-memory arrays lie). Everything outside
``asteria_server.protocol`` and the two gRPC endpoints (the daemon's servicers, the client's gRPC
transport) handles only those Python values.

A header announces the arrays that follow it (``proto/asteria/v1/preconditioner.proto``): this
module turns it into the arrays' names and specs, checked (kind, dtype, shape, size, the block's
limits) before anything is allocated, and builds the value once the arrays are there. How the
arrays' bytes travel, in chunks or in a shared-memory segment, is ``protocol.framing``'s.
Whether the numbers are finite or a permutation is one stays the engine's and the client's
business, as for any other source of a task or result.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.descriptor import EnumDescriptor

from asteria_server.errors import InvalidInputError
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.shm import RESULT_FIELDS, ArraySpec, SegmentRef
from asteria_server.types import (
    BlockState,
    BlockStatus,
    BlockSummary,
    BlockTable,
    Credit,
    EngineStats,
    SharedArrays,
    SolveKind,
    SolveResult,
    SolveTask,
    SubmitOutcome,
    TransportStats,
    WorkerState,
)

_KINDS: dict[SolveKind, pb.SolveKind.ValueType] = {
    SolveKind.INVERSE_ROOT: pb.SOLVE_KIND_INVERSE_ROOT,
    SolveKind.EIGENBASIS: pb.SOLVE_KIND_EIGENBASIS,
}
_OUTCOMES: dict[SubmitOutcome, pb.SubmitOutcome.ValueType] = {
    SubmitOutcome.QUEUED: pb.SUBMIT_OUTCOME_QUEUED,
    SubmitOutcome.SUPERSEDED_QUEUED: pb.SUBMIT_OUTCOME_SUPERSEDED_QUEUED,
    SubmitOutcome.DUPLICATE: pb.SUBMIT_OUTCOME_DUPLICATE,
    SubmitOutcome.STALE_IGNORED: pb.SUBMIT_OUTCOME_STALE_IGNORED,
}
_STATES: dict[BlockState, pb.BlockState.ValueType] = {
    BlockState.IDLE: pb.BLOCK_STATE_IDLE,
    BlockState.QUEUED: pb.BLOCK_STATE_QUEUED,
    BlockState.RUNNING: pb.BLOCK_STATE_RUNNING,
    BlockState.FAILED: pb.BLOCK_STATE_FAILED,
}
_DTYPES: dict[np.dtype, pb.DType.ValueType] = {
    np.dtype(np.float32): pb.DTYPE_FLOAT32,
    np.dtype(np.float64): pb.DTYPE_FLOAT64,
    np.dtype(np.int64): pb.DTYPE_INT64,
}
_KINDS_BACK: dict[int, SolveKind] = {v: k for k, v in _KINDS.items()}
_OUTCOMES_BACK: dict[int, SubmitOutcome] = {v: k for k, v in _OUTCOMES.items()}
_STATES_BACK: dict[int, BlockState] = {v: k for k, v in _STATES.items()}
#: :data:`_STATES` by the state's value, for a column of states: an Enum's hash is a Python
#: call (``hash(self._name_)``) and its ``value`` a property, where ``_value_`` is a plain
#: attribute and a str's hash is kept, so a page's states map in C (10,000: ~4 ms less).
_STATES_BY_VALUE: dict[str, pb.BlockState.ValueType] = {k.value: v for k, v in _STATES.items()}
_ENUM_VALUE = operator.attrgetter("_value_")
_DTYPES_BACK: dict[int, np.dtype] = {v: k for k, v in _DTYPES.items()}
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_INT64 = (np.dtype(np.int64),)


def _bad(what: str, problem: str) -> InvalidInputError:
    return InvalidInputError(f"{what}: {problem}")


def _name(enum: EnumDescriptor, value: int) -> str:
    """The wire name of an enum value, for messages."""
    known = enum.values_by_number.get(value)
    return known.name if known is not None else f"unknown value {value}"


def kind_from_proto(value: int, *, what: str) -> SolveKind:
    """The SolveKind of a wire value; InvalidInputError naming ``what`` for an unset one."""
    kind = _KINDS_BACK.get(value)
    if kind is None:
        problem = (
            f"kind must be INVERSE_ROOT or EIGENBASIS, got {_name(pb.SolveKind.DESCRIPTOR, value)}"
        )
        raise _bad(what, problem)
    return kind


def dtype_from_proto(value: int, allowed: Sequence[np.dtype], what: str, field: str) -> np.dtype:
    dtype = _DTYPES_BACK.get(value)
    if dtype is None or dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise _bad(what, f"{field} must be {names}, got {_name(pb.DType.DESCRIPTOR, value)}")
    return dtype


# --------------------------------------------------------------------------- announced arrays


@dataclass(frozen=True)
class AnnouncedArray:
    """One array a header announces: its field name and its spec."""

    name: str
    spec: ArraySpec

    @property
    def num_bytes(self) -> int:
        return math.prod(self.spec.shape) * self.spec.dtype.itemsize


def ref_to_proto(ref: SegmentRef) -> pb.ShmRef:
    return pb.ShmRef(segment_id=ref.segment_id, sequence=ref.sequence)


def ref_from_proto(message: pb.ShmRef, what: str) -> SegmentRef:
    if not message.segment_id or message.sequence < 0 or message.sequence % 2:
        raise _bad(what, "shm needs a segment_id and an even sequence >= 0")
    return SegmentRef(message.segment_id, message.sequence)


def _check_n(n: int, max_matrix_n: int, what: str) -> int:
    if not 1 <= n <= max_matrix_n:
        raise _bad(what, f"n must be between 1 and {max_matrix_n} (max_matrix_n), got {n}")
    return n


# --------------------------------------------------------------------------------- snapshots


def snapshot_header(
    task: SolveTask, *, session_id: str = "", shm: SegmentRef | None = None
) -> pb.SnapshotHeader:
    """The header of ``task``'s SubmitSnapshot stream (its tenant is the session's); with
    ``shm``, it announces the arrays in that segment instead of chunks."""
    basis = task.basis
    return pb.SnapshotHeader(
        shm=None if shm is None else ref_to_proto(shm),
        session_id=session_id,
        block=task.block,
        version=int(task.version),
        kind=_KINDS[task.kind],
        n=task.n,
        dtype=_DTYPES[task.matrix.dtype],
        exponent=float(task.exponent),
        epsilon=float(task.epsilon),
        has_basis=basis is not None,
        basis_dtype=_DTYPES[basis.dtype] if basis is not None else pb.DTYPE_UNSPECIFIED,
        base_version=int(task.base_version),
        deadline=float(task.deadline),
    )


def snapshot_what(header: pb.SnapshotHeader) -> str:
    """How messages name the snapshot ``header`` announces."""
    return f"SubmitSnapshot of block {header.block!r} version {header.version}"


def snapshot_arrays(header: pb.SnapshotHeader, *, max_matrix_n: int) -> list[AnnouncedArray]:
    """The arrays ``header`` announces (the matrix, then the basis), after checking it all:
    its arrays and, by SolveTask's own rules, its scalar fields."""
    what = snapshot_what(header)
    kind = kind_from_proto(header.kind, what=what)
    n = _check_n(header.n, max_matrix_n, what)
    matrix = ArraySpec(dtype_from_proto(header.dtype, _FLOATS, what, "dtype"), (n, n))
    arrays = [AnnouncedArray("matrix", matrix)]
    if header.has_basis:
        if kind is not SolveKind.EIGENBASIS:
            raise _bad(what, "has_basis is only meaningful for EIGENBASIS")
        basis_dtype = dtype_from_proto(header.basis_dtype, _FLOATS, what, "basis_dtype")
        arrays.append(AnnouncedArray("basis", ArraySpec(basis_dtype, (n, n))))
    elif header.basis_dtype != pb.DTYPE_UNSPECIFIED:
        raise _bad(what, "basis_dtype is set but has_basis is false")
    stand_in = np.zeros((1, 1), matrix.dtype)
    task_from_header(header, stand_in, stand_in if header.has_basis else None, tenant="(session)")
    return arrays


#: The few exponents, epsilons and deadlines a daemon sees at a time, one float object each
#: (:func:`_shared_float`).
_SHARED_FLOATS: dict[float, float] = {}
#: Distinct values :data:`_SHARED_FLOATS` keeps before it starts afresh (a client that varies them).
_MAX_FLOATS = 256


def _shared_float(value: float) -> float:
    """``value`` as one float object per value: protobuf gives a fresh 24-byte float per field
    read, and a daemon keeps every queued snapshot's exponent, epsilon and deadline until it is
    solved: three floats a block at the height of a round, of a handful of values across all
    blocks (the blocks of one step share their deadline)."""
    kept = _SHARED_FLOATS.get(value)
    if kept is None:
        if len(_SHARED_FLOATS) >= _MAX_FLOATS:
            _SHARED_FLOATS.clear()
        kept = _SHARED_FLOATS[value] = value
    return kept


def task_from_header(
    header: pb.SnapshotHeader,
    matrix: np.ndarray,
    basis: np.ndarray | None,
    *,
    tenant: str,
    shm_source: SharedArrays | None = None,
    shm_result: SharedArrays | None = None,
) -> SolveTask:
    """The task ``header`` announced, with its arrays (or views where they lie: ``shm_source``
    and ``shm_result`` say which segments, see :class:`SolveTask`)."""
    return SolveTask(
        # interned: the daemon's records, queue and result of the block, and the handover's
        # tables, keep this one string, not a copy each (~120 bytes)
        block=sys.intern(header.block),
        version=header.version,
        kind=kind_from_proto(header.kind, what=snapshot_what(header)),
        matrix=matrix,
        exponent=_shared_float(header.exponent),
        epsilon=_shared_float(header.epsilon),
        basis=basis,
        base_version=header.base_version,
        deadline=_shared_float(header.deadline),
        tenant=tenant,
        shm_source=shm_source,
        shm_result=shm_result,
    )


def outcome_to_proto(outcome: SubmitOutcome) -> pb.SubmitSnapshotResponse:
    """The SubmitSnapshot answer for ``outcome``."""
    return pb.SubmitSnapshotResponse(outcome=_OUTCOMES[outcome])


def outcome_from_proto(message: pb.SubmitSnapshotResponse) -> SubmitOutcome:
    """The outcome in a SubmitSnapshot answer."""
    outcome = _OUTCOMES_BACK.get(message.outcome)
    if outcome is None:
        value = _name(pb.SubmitOutcome.DESCRIPTOR, message.outcome)
        raise _bad("SubmitSnapshot response", f"outcome must be set, got {value}")
    return outcome


def announced_to_proto(outcome: SubmitOutcome) -> pb.AnnouncedSnapshot:
    """An AnnounceSnapshots answer for a snapshot that was taken with ``outcome``."""
    return pb.AnnouncedSnapshot(outcome=_OUTCOMES[outcome])


def announced_from_proto(message: pb.AnnouncedSnapshot) -> SubmitOutcome | tuple[int, str]:
    """The outcome of one announced snapshot, or ``(status code, reason)`` when it was
    refused."""
    if message.outcome == pb.SUBMIT_OUTCOME_UNSPECIFIED:
        if not message.error_code:
            raise _bad("AnnounceSnapshots response", "neither an outcome nor an error is set")
        return int(message.error_code), message.error
    outcome = _OUTCOMES_BACK.get(message.outcome)
    if outcome is None:
        value = _name(pb.SubmitOutcome.DESCRIPTOR, message.outcome)
        raise _bad("AnnounceSnapshots response", f"unknown outcome {value}")
    return outcome


def credit_to_proto(credit: Credit) -> pb.StreamResultsResponse:
    """The StreamResults message that tells a session ``credit``."""
    return pb.StreamResultsResponse(
        credit=pb.Credit(
            workers_idle=credit.workers_idle,
            queued=credit.queued,
            snapshots_answered=credit.snapshots_answered,
        )
    )


def credit_from_proto(message: pb.Credit) -> Credit:
    """The daemon's Credit message as a value; counts must not be negative."""
    credit = Credit(
        workers_idle=message.workers_idle,
        queued=message.queued,
        snapshots_answered=message.snapshots_answered,
    )
    if min(credit.workers_idle, credit.queued, credit.snapshots_answered) < 0:
        raise _bad("StreamResults credit", f"counts must not be negative, got {credit}")
    return credit


# ----------------------------------------------------------------------------------- results

#: Per result field (``protocol.shm.RESULT_FIELDS`` order): n x n (else length n), allowed dtypes.
_RESULT_ARRAYS: dict[str, tuple[bool, tuple[np.dtype, ...]]] = {
    "matrix": (True, _FLOATS),
    "eigenvalues": (False, _FLOATS),
    "permutation": (False, _INT64),
    "rotation": (True, _FLOATS),
}
assert tuple(_RESULT_ARRAYS) == RESULT_FIELDS


def _result_array(
    name: str, dtype: np.dtype, shape: tuple[int, ...], n: int, kind: SolveKind, what: str
) -> AnnouncedArray:
    """Check one announced (or present) result array against its field's rules."""
    square, allowed = _RESULT_ARRAYS[name]
    if name != "matrix" and kind is not SolveKind.EIGENBASIS:
        raise _bad(what, f"{name} is only meaningful for EIGENBASIS results")
    if dtype not in allowed:
        raise _bad(what, f"{name} must be {' or '.join(map(str, allowed))}, got {dtype}")
    expected = (n, n) if square else (n,)
    if shape != expected:
        raise _bad(what, f"{name} must have shape {expected}, got {shape}")
    return AnnouncedArray(name, ArraySpec(dtype, shape))


def result_what(header: pb.ResultHeader) -> str:
    """How messages name the result ``header`` announces."""
    return f"result of block {header.block!r} version {header.version}"


def result_header(result: SolveResult, *, shm: SegmentRef | None = None) -> pb.ResultHeader:
    """The header of ``result`` in a StreamResults stream; checks its arrays' shapes and dtypes.
    With ``shm``, it announces the arrays in that segment instead of chunks."""
    what = f"result of block {result.block!r} version {result.version}"
    if (
        not isinstance(result.matrix, np.ndarray)
        or result.matrix.ndim != 2
        or not result.matrix.size
    ):
        raise _bad(what, "matrix must be a non-empty 2-D numpy.ndarray")
    n = int(result.matrix.shape[0])
    header = pb.ResultHeader(
        tenant=result.tenant,
        block=result.block,
        version=int(result.version),
        kind=_KINDS[result.kind],
        n=n,
        base_version=int(result.base_version),
        epsilon_used=float(result.epsilon_used),
        solve_time_s=float(result.solve_time_s),
        attempts=int(result.attempts),
        shm=None if shm is None else ref_to_proto(shm),
    )
    for name in RESULT_FIELDS:
        array = getattr(result, name)
        if array is None:
            continue
        if not isinstance(array, np.ndarray):
            raise _bad(what, f"{name} must be a numpy.ndarray, got {type(array).__name__}")
        announced = _result_array(name, array.dtype, array.shape, n, result.kind, what)
        getattr(header, name).CopyFrom(
            pb.ArrayHeader(
                dtype=_DTYPES[announced.spec.dtype],
                shape=announced.spec.shape,
                num_bytes=announced.num_bytes,
            )
        )
    return header


def result_arrays_announced(header: pb.ResultHeader, *, max_matrix_n: int) -> list[AnnouncedArray]:
    """The arrays ``header`` announces, in stream order, after checking the header."""
    what = result_what(header)
    if not header.block or not header.tenant:
        raise _bad(what, "block and tenant must be non-empty")
    if header.version < 0 or header.base_version < -1 or header.attempts < 0:
        raise _bad(what, "version >= 0, base_version >= -1 and attempts >= 0 are required")
    kind = kind_from_proto(header.kind, what=what)
    n = _check_n(header.n, max_matrix_n, what)
    if not header.HasField("matrix"):
        raise _bad(what, "the matrix header is missing")
    arrays = []
    for name in RESULT_FIELDS:
        if not header.HasField(name):  # type: ignore[arg-type]  # a field name, not a Literal
            continue
        array = getattr(header, name)
        dtype = dtype_from_proto(array.dtype, (*_FLOATS, *_INT64), what, f"{name} dtype")
        announced = _result_array(name, dtype, tuple(array.shape), n, kind, what)
        if array.num_bytes != announced.num_bytes:
            raise _bad(
                what,
                f"{name} announces {array.num_bytes} bytes but {dtype} of shape "
                f"{announced.spec.shape} is {announced.num_bytes}",
            )
        arrays.append(announced)
    return arrays


def result_from_header(header: pb.ResultHeader, arrays: Mapping[str, np.ndarray]) -> SolveResult:
    """The result ``header`` announced, with its arrays by field name."""
    return SolveResult(
        tenant=header.tenant,
        block=header.block,
        version=header.version,
        kind=kind_from_proto(header.kind, what=result_what(header)),
        matrix=arrays["matrix"],
        eigenvalues=arrays.get("eigenvalues"),
        permutation=arrays.get("permutation"),
        rotation=arrays.get("rotation"),
        base_version=header.base_version,
        epsilon_used=header.epsilon_used,
        solve_time_s=header.solve_time_s,
        attempts=header.attempts,
    )


# ------------------------------------------------------------------------------------ status


def block_status_to_proto(status: BlockStatus) -> pb.BlockStatus:
    """``status`` as a wire message."""
    return pb.BlockStatus(
        tenant=status.tenant,
        block=status.block,
        version=status.version,
        submitted_version=status.submitted_version,
        in_flight_version=status.in_flight_version,
        queued_version=status.queued_version,
        running_version=status.running_version,
        delivered_version=status.delivered_version,
        staleness_steps=status.staleness_steps,
        age_s=status.age_s,
        submitted_age_s=status.submitted_age_s,
        delivered_age_s=status.delivered_age_s,
        last_solve_s=status.last_solve_s,
        failures=status.failures,
        consecutive_failures=status.consecutive_failures,
        duplicates=status.duplicates,
        stale_ignored=status.stale_ignored,
        superseded=status.superseded,
        state=_STATES[status.state],
        last_error=status.last_error,
        queue_position=status.queue_position,
        tier=status.tier,
    )


def block_status_from_proto(message: pb.BlockStatus) -> BlockStatus:
    """A wire BlockStatus as the engine's value."""
    m = message
    state = _STATES_BACK.get(m.state)
    if state is None:
        what = f"status of block {m.block!r}"
        raise _bad(what, f"state must be set, got {_name(pb.BlockState.DESCRIPTOR, m.state)}")
    return BlockStatus(
        tenant=m.tenant,
        block=m.block,
        version=m.version,
        submitted_version=m.submitted_version,
        in_flight_version=m.in_flight_version,
        queued_version=m.queued_version,
        running_version=m.running_version,
        delivered_version=m.delivered_version,
        staleness_steps=m.staleness_steps,
        age_s=m.age_s if m.HasField("age_s") else None,
        submitted_age_s=m.submitted_age_s if m.HasField("submitted_age_s") else None,
        delivered_age_s=m.delivered_age_s if m.HasField("delivered_age_s") else None,
        last_solve_s=m.last_solve_s if m.HasField("last_solve_s") else None,
        failures=m.failures,
        consecutive_failures=m.consecutive_failures,
        duplicates=m.duplicates,
        stale_ignored=m.stale_ignored,
        superseded=m.superseded,
        state=state,
        last_error=m.last_error if m.HasField("last_error") else None,
        queue_position=m.queue_position if m.HasField("queue_position") else None,
        tier=m.tier,
    )


def engine_stats_to_proto(stats: EngineStats) -> pb.EngineStats:
    """``stats`` as a wire message."""
    return pb.EngineStats(
        incarnation_id=stats.incarnation_id,
        uptime_s=stats.uptime_s,
        num_workers=stats.num_workers,
        workers_busy=stats.workers_busy,
        workers_idle=stats.workers_idle,
        worker_restarts=stats.worker_restarts,
        queue_depth=stats.queue_depth,
        blocks=stats.blocks,
        solves_done=stats.solves_done,
        solves_failed=stats.solves_failed,
        results_discarded=stats.results_discarded,
        seconds_per_n3=stats.seconds_per_n3,
        closed=stats.closed,
        broken_reason=stats.broken_reason,
        workers=[pb.WorkerStatus(**dataclasses.asdict(w)) for w in stats.workers],
        cache_host_bytes=stats.cache_host_bytes,
        cache_budget_bytes=stats.cache_budget_bytes,
        results_spilled=stats.results_spilled,
        spill_bytes=stats.spill_bytes,
        results_dropped=stats.results_dropped,
    )


def engine_stats_from_proto(message: pb.EngineStats) -> EngineStats:
    """A wire EngineStats as the engine's value."""
    m = message
    return EngineStats(
        incarnation_id=m.incarnation_id,
        uptime_s=m.uptime_s,
        num_workers=m.num_workers,
        workers_busy=m.workers_busy,
        workers_idle=m.workers_idle,
        worker_restarts=m.worker_restarts,
        queue_depth=m.queue_depth,
        blocks=m.blocks,
        solves_done=m.solves_done,
        solves_failed=m.solves_failed,
        results_discarded=m.results_discarded,
        seconds_per_n3=m.seconds_per_n3,
        closed=m.closed,
        broken_reason=m.broken_reason if m.HasField("broken_reason") else None,
        workers=tuple(
            WorkerState(
                index=w.index,
                pid=w.pid,
                state=w.state,
                block=w.block,
                n=w.n,
                elapsed_s=w.elapsed_s,
                expected_s=w.expected_s,
                timeout_s=w.timeout_s,
            )
            for w in m.workers
        ),
        cache_host_bytes=m.cache_host_bytes,
        cache_budget_bytes=m.cache_budget_bytes,
        results_spilled=m.results_spilled,
        spill_bytes=m.spill_bytes,
        results_dropped=m.results_dropped,
    )


_NAN = math.nan


def block_table_to_proto(table: BlockTable) -> pb.BlockColumns:
    """A status page as columns: a few packed lists, not a message per block."""
    c = table.columns

    def seconds(values: list[float | None]) -> list[float]:
        return [_NAN if v is None else v for v in values]

    errors = [(i, e) for i, e in enumerate(c["last_error"]) if e is not None]
    return pb.BlockColumns(
        tenant=table.tenant,
        block=c["block"],
        version=c["version"],
        submitted_version=c["submitted_version"],
        queued_version=c["queued_version"],
        running_version=c["running_version"],
        delivered_version=c["delivered_version"],
        age_s=seconds(c["age_s"]),
        submitted_age_s=seconds(c["submitted_age_s"]),
        delivered_age_s=seconds(c["delivered_age_s"]),
        last_solve_s=seconds(c["last_solve_s"]),
        failures=c["failures"],
        consecutive_failures=c["consecutive_failures"],
        duplicates=c["duplicates"],
        stale_ignored=c["stale_ignored"],
        superseded=c["superseded"],
        state=list(map(_STATES_BY_VALUE.__getitem__, map(_ENUM_VALUE, c["state"]))),
        queue_position=[-1 if p is None else p for p in c["queue_position"]],
        tier=c["tier"],
        error_index=[i for i, _ in errors],
        error=[e for _, e in errors],
    )


def block_table_from_proto(message: pb.BlockColumns) -> BlockTable:
    """A wire status page of columns as a :class:`BlockTable`. Raises InvalidInputError when
    its lists differ in length or a state is unset."""
    m = message
    n = len(m.block)

    def seconds(values: Sequence[float]) -> list[float | None]:
        return [None if v != v else v for v in values]  # NaN: never

    states = [_STATES_BACK.get(s) for s in m.state]
    columns: dict[str, list[Any]] = {
        "block": list(m.block),
        "version": list(m.version),
        "submitted_version": list(m.submitted_version),
        "queued_version": list(m.queued_version),
        "running_version": list(m.running_version),
        "delivered_version": list(m.delivered_version),
        "age_s": seconds(m.age_s),
        "submitted_age_s": seconds(m.submitted_age_s),
        "delivered_age_s": seconds(m.delivered_age_s),
        "last_solve_s": seconds(m.last_solve_s),
        "failures": list(m.failures),
        "consecutive_failures": list(m.consecutive_failures),
        "duplicates": list(m.duplicates),
        "stale_ignored": list(m.stale_ignored),
        "superseded": list(m.superseded),
        "state": states,
        "last_error": [None] * n,
        "queue_position": [None if p < 0 else p for p in m.queue_position],
        "tier": list(m.tier),
    }
    short = [k for k, v in columns.items() if len(v) != n]
    if short:
        raise _bad("status columns", f"{short} must have one entry per block ({n})")
    if None in states:
        block = m.block[states.index(None)]
        raise _bad(f"status of block {block!r}", "state must be set")
    if len(m.error_index) != len(m.error) or any(not 0 <= i < n for i in m.error_index):
        raise _bad("status columns", "error_index must name one block per error")
    for i, e in zip(m.error_index, m.error, strict=True):
        columns["last_error"][i] = e
    return BlockTable(m.tenant, columns)


_SUMMARY_COUNTS = (
    "idle",
    "queued",
    "running",
    "failed",
    "tier_host",
    "tier_shm",
    "tier_spill",
    "tier_none",
    "never_computed",
    "staleness_steps_p50",
    "staleness_steps_p99",
    "staleness_steps_max",
    "failures",
)


def block_summary_to_proto(summary: BlockSummary) -> pb.BlockSummary:
    return pb.BlockSummary(
        **{name: getattr(summary, name) for name in _SUMMARY_COUNTS},
        oldest_result_age_s=summary.oldest_result_age_s,
        worst=block_table_to_proto(summary.worst),
    )


def block_summary_from_proto(message: pb.BlockSummary) -> BlockSummary:
    return BlockSummary(
        **{name: getattr(message, name) for name in _SUMMARY_COUNTS},
        oldest_result_age_s=(
            message.oldest_result_age_s if message.HasField("oldest_result_age_s") else None
        ),
        worst=block_table_from_proto(message.worst),
    )


def status_to_proto(
    stats: EngineStats, blocks: Iterable[BlockStatus], transport: TransportStats | None = None
) -> pb.StatusResponse:
    """The Status answer for engine-wide ``stats``, the caller's ``blocks`` and the daemon's
    ``transport`` numbers."""
    return pb.StatusResponse(
        engine=engine_stats_to_proto(stats),
        blocks=[block_status_to_proto(b) for b in blocks],
        transport=None if transport is None else pb.TransportStats(**transport.to_dict()),
    )


def transport_stats_from_proto(message: pb.StatusResponse) -> TransportStats | None:
    """The data-path numbers of a Status answer (None from a daemon that does not send them)."""
    if not message.HasField("transport"):
        return None
    t = message.transport
    return TransportStats(
        shm_connections=t.shm_connections,
        shm_segments=t.shm_segments,
        shm_mapped_bytes=t.shm_mapped_bytes,
        upload_bytes_in_flight=t.upload_bytes_in_flight,
        upload_budget_bytes=t.upload_budget_bytes,
        uploads_waiting=t.uploads_waiting,
        snapshots_received=t.snapshots_received,
        snapshot_bytes_received=t.snapshot_bytes_received,
    )


def status_from_proto(message: pb.StatusResponse) -> tuple[EngineStats, list[BlockStatus]]:
    """The engine-wide numbers and per-block records of a Status answer."""
    return (
        engine_stats_from_proto(message.engine),
        [block_status_from_proto(b) for b in message.blocks],
    )
