"""The one module that converts between protobuf messages and Asteria's Python values.

Values: :class:`SolveTask` (a SubmitSnapshot stream), :class:`SolveResult` (one result of a
StreamResults stream), :class:`SubmitOutcome`, :class:`BlockStatus` and :class:`EngineStats` (a
StatusResponse). Everything outside ``asteria_server.protocol`` and the two gRPC endpoints (the
daemon's servicers, the client's gRPC transport) handles only those Python values.

Arrays travel as raw little-endian C-order bytes, in chunks of at most ``chunk_bytes``, after a
header that announces them (see ``proto/asteria/v1/preconditioner.proto``). Senders are
generators of messages. Receivers are fed one message at a time, so a grpc.aio servicer drives
them from ``async for`` and a synchronous client from ``for``; ``read_snapshot`` and
``read_results`` do that for plain iterables. A receiver validates a header before it allocates
anything, then every chunk, and raises :class:`InvalidInputError` naming the block for a stream
that is short, too long, out of order, or announces a wrong kind, dtype or shape. It checks the
framing only: whether the numbers are finite or a permutation is one stays the engine's and the
client's business, as for any other source of a task or result.

On the same host the arrays may lie in a shared-memory segment instead (``protocol.shm``): the
header then carries a ``shm`` reference and no chunks follow. The receivers hand the reference
and the announced arrays' specs to a *reader* the transport supplies, which copies them out of
the segment (or reports that a newer write replaced them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.descriptor import EnumDescriptor

from asteria_server.errors import InvalidInputError
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.shm import ArraySpec, SegmentRef
from asteria_server.types import (
    BlockState,
    BlockStatus,
    EngineStats,
    SolveKind,
    SolveResult,
    SolveTask,
    SubmitOutcome,
    TransportStats,
)

#: Copies announced arrays out of a shared-memory segment: ``reader(ref, specs)`` returns them,
#: or None when a newer write replaced them (the announcement is then skipped).
SegmentReader = Callable[[SegmentRef, list[ArraySpec]], list[np.ndarray] | None]

#: Chunk size of array streams (gRPC moved 2.3-3 GB/s on loopback in 1 MiB chunks).
DEFAULT_CHUNK_BYTES = 1 << 20
#: Largest factor dimension a receiver accepts unless told otherwise (n x n fp64: 2 GiB).
DEFAULT_MAX_MATRIX_N = 16384

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
_DTYPES_BACK: dict[int, np.dtype] = {v: k for k, v in _DTYPES.items()}
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_INT64 = (np.dtype(np.int64),)


def _bad(what: str, problem: str) -> InvalidInputError:
    return InvalidInputError(f"{what}: {problem}")


def _name(enum: EnumDescriptor, value: int) -> str:
    """The wire name of an enum value, for messages."""
    known = enum.values_by_number.get(value)
    return known.name if known is not None else f"unknown value {value}"


def _check_limit(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def kind_from_proto(value: int, *, what: str) -> SolveKind:
    """The SolveKind of a wire value; InvalidInputError naming ``what`` for an unset one."""
    kind = _KINDS_BACK.get(value)
    if kind is None:
        problem = (
            f"kind must be INVERSE_ROOT or EIGENBASIS, got {_name(pb.SolveKind.DESCRIPTOR, value)}"
        )
        raise _bad(what, problem)
    return kind


def _dtype_from_proto(value: int, allowed: Sequence[np.dtype], what: str, field: str) -> np.dtype:
    dtype = _DTYPES_BACK.get(value)
    if dtype is None or dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise _bad(what, f"{field} must be {names}, got {_name(pb.DType.DESCRIPTOR, value)}")
    return dtype


# ----------------------------------------------------------------------------- array streams


def array_chunks(array: np.ndarray, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """``array``'s bytes, C order and little-endian, in pieces of at most ``chunk_bytes``."""
    _check_limit("chunk_bytes", chunk_bytes)
    wire = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    data = wire.reshape(-1).view(np.uint8)
    for start in range(0, data.size, chunk_bytes):
        yield data[start : start + chunk_bytes].tobytes()


@dataclass(frozen=True)
class _Slot:
    """One announced array of a stream."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def spec(self) -> ArraySpec:
        return ArraySpec(self.dtype, self.shape)


def _ref_to_proto(ref: SegmentRef) -> pb.ShmRef:
    return pb.ShmRef(segment_id=ref.segment_id, sequence=ref.sequence)


def _ref_from_proto(message: pb.ShmRef, what: str) -> SegmentRef:
    if not message.segment_id or message.sequence < 0 or message.sequence % 2:
        raise _bad(what, "shm needs a segment_id and an even sequence >= 0")
    return SegmentRef(message.segment_id, message.sequence)


def snapshot_specs(task: SolveTask) -> list[ArraySpec]:
    """The arrays of ``task``'s snapshot in segment order: the matrix, then the basis."""
    arrays = [task.matrix] if task.basis is None else [task.matrix, task.basis]
    return [ArraySpec(a.dtype, a.shape) for a in arrays]


def result_arrays(result: SolveResult) -> list[np.ndarray]:
    """The arrays of ``result`` in segment (and stream) order."""
    return [array for _, array in _result_arrays(result)]


def result_specs(result: SolveResult) -> list[ArraySpec]:
    """The specs of :func:`result_arrays`."""
    return [ArraySpec(a.dtype, a.shape) for a in result_arrays(result)]


class _Assembler:
    """Fills announced arrays, in order, from the chunks of a stream."""

    def __init__(self, what: str, slots: Sequence[_Slot], max_chunk_bytes: int) -> None:
        self._what = what
        self._slots = list(slots)
        self._max_chunk_bytes = max_chunk_bytes
        self._arrays = [np.empty(s.shape, s.dtype.newbyteorder("<")) for s in self._slots]
        self._index = 0  # the array being filled
        self._offset = 0  # bytes of it received
        self.total_bytes = sum(s.num_bytes for s in self._slots)
        self.received_bytes = 0

    @property
    def complete(self) -> bool:
        return self._index == len(self._slots)

    def add(self, chunk: bytes) -> None:
        size = len(chunk)
        if size == 0:
            raise _bad(self._what, "empty chunk (a chunk carries 1..max_chunk_bytes bytes)")
        if size > self._max_chunk_bytes:
            raise _bad(
                self._what,
                f"chunk of {size} bytes exceeds the limit of {self._max_chunk_bytes} bytes",
            )
        if self.complete:
            raise _bad(
                self._what,
                f"stream is longer than announced: {self.total_bytes} bytes were complete "
                f"before a further chunk of {size} bytes",
            )
        slot = self._slots[self._index]
        left = slot.num_bytes - self._offset
        if size > left:
            raise _bad(
                self._what,
                f"chunk of {size} bytes overruns {slot.name} ({left} of its {slot.num_bytes} "
                "bytes left; a chunk never spans two arrays)",
            )
        flat = self._arrays[self._index].reshape(-1).view(np.uint8)
        flat[self._offset : self._offset + size] = np.frombuffer(chunk, dtype=np.uint8)
        self._offset += size
        self.received_bytes += size
        if self._offset == slot.num_bytes:
            self._index += 1
            self._offset = 0

    def finish(self) -> list[np.ndarray]:
        """The filled arrays (native byte order); raises if the stream stopped short."""
        if not self.complete:
            slot = self._slots[self._index]
            raise _bad(
                self._what,
                f"stream ended early: {self.received_bytes} of {self.total_bytes} bytes "
                f"arrived ({slot.name}: {self._offset} of {slot.num_bytes})",
            )
        return [a.astype(a.dtype.newbyteorder("="), copy=False) for a in self._arrays]


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
        shm=None if shm is None else _ref_to_proto(shm),
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


def snapshot_messages(
    task: SolveTask,
    *,
    session_id: str = "",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shm: SegmentRef | None = None,
) -> Iterator[pb.SubmitSnapshotRequest]:
    """The whole SubmitSnapshot stream of ``task``: its header, then matrix and basis chunks
    (none when ``shm`` says where they were written; ``task``'s arrays then only give shapes)."""
    _check_limit("chunk_bytes", chunk_bytes)
    yield pb.SubmitSnapshotRequest(header=snapshot_header(task, session_id=session_id, shm=shm))
    if shm is not None:
        return
    for array in (task.matrix, task.basis):
        if array is not None:
            for chunk in array_chunks(array, chunk_bytes):
                yield pb.SubmitSnapshotRequest(chunk=chunk)


class SnapshotReceiver:
    """Rebuilds a :class:`SolveTask` from a SubmitSnapshot stream, one message at a time.

    Construct it from the stream's first message (the header is checked there, before anything
    is allocated), look up ``session_id``, ``feed`` it every later message, then ``finish``.
    """

    def __init__(
        self,
        first: pb.SubmitSnapshotRequest,
        *,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_matrix_n: int = DEFAULT_MAX_MATRIX_N,
    ) -> None:
        _check_limit("max_chunk_bytes", max_chunk_bytes)
        _check_limit("max_matrix_n", max_matrix_n)
        if first.WhichOneof("part") != "header":
            raise _bad("SubmitSnapshot stream", "the first message must be a header")
        header = first.header
        what = f"SubmitSnapshot of block {header.block!r} version {header.version}"
        kind = kind_from_proto(header.kind, what=what)
        n = _check_n(header.n, max_matrix_n, what)
        slots = [_Slot("matrix", _dtype_from_proto(header.dtype, _FLOATS, what, "dtype"), (n, n))]
        if header.has_basis:
            if kind is not SolveKind.EIGENBASIS:
                raise _bad(what, "has_basis is only meaningful for EIGENBASIS")
            basis_dtype = _dtype_from_proto(header.basis_dtype, _FLOATS, what, "basis_dtype")
            slots.append(_Slot("basis", basis_dtype, (n, n)))
        elif header.basis_dtype != pb.DTYPE_UNSPECIFIED:
            raise _bad(what, "basis_dtype is set but has_basis is false")
        self.header = header
        self._kind = kind
        self._what = what
        #: Where the arrays lie when they come through shared memory (no chunks then).
        self.shm = _ref_from_proto(header.shm, what) if header.HasField("shm") else None
        #: The announced arrays: the matrix, then the basis.
        self.specs = [slot.spec for slot in slots]
        # The scalar fields are checked now, by SolveTask's own rules, not after all the bytes.
        stand_in = np.zeros((1, 1), slots[0].dtype)
        self._task(stand_in, stand_in if header.has_basis else None, tenant="(session)")
        self._assembler = _Assembler(what, slots, max_chunk_bytes)

    @property
    def session_id(self) -> str:
        """The session the header names (the caller resolves it to a tenant)."""
        return self.header.session_id

    def feed(self, message: pb.SubmitSnapshotRequest) -> None:
        """Take the next message of the stream; it must be a chunk."""
        part = message.WhichOneof("part")
        if self.shm is not None:
            raise _bad(self._what, "no chunks may follow a snapshot announced in shared memory")
        if part != "chunk":
            raise _bad(self._what, f"expected a chunk, got {part or 'an empty message'}")
        self._assembler.add(message.chunk)

    def finish(self, *, tenant: str, reader: SegmentReader | None = None) -> SolveTask | None:
        """The task, once the stream ended; raises if bytes are missing. A snapshot in shared
        memory is copied out by ``reader``; None means a newer write replaced it."""
        if self.shm is None:
            arrays = self._assembler.finish()
        else:
            if reader is None:
                raise _bad(self._what, "shared memory is not available on this connection")
            copied = reader(self.shm, self.specs)
            if copied is None:
                return None
            arrays = copied
        return self._task(arrays[0], arrays[1] if self.header.has_basis else None, tenant=tenant)

    def _task(self, matrix: np.ndarray, basis: np.ndarray | None, *, tenant: str) -> SolveTask:
        h = self.header
        return SolveTask(
            block=h.block,
            version=h.version,
            kind=self._kind,
            matrix=matrix,
            exponent=h.exponent,
            epsilon=h.epsilon,
            basis=basis,
            base_version=h.base_version,
            deadline=h.deadline,
            tenant=tenant,
        )


def read_snapshot(
    messages: Iterable[pb.SubmitSnapshotRequest],
    *,
    tenant: str,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_matrix_n: int = DEFAULT_MAX_MATRIX_N,
) -> SolveTask:
    """The task a whole SubmitSnapshot stream carries."""
    it = iter(messages)
    first = next(it, None)
    if first is None:
        raise _bad("SubmitSnapshot stream", "no messages (expected a header, then chunks)")
    receiver = SnapshotReceiver(first, max_chunk_bytes=max_chunk_bytes, max_matrix_n=max_matrix_n)
    for message in it:
        receiver.feed(message)
    task = receiver.finish(tenant=tenant)
    assert task is not None  # no reader, so never a skipped shared-memory snapshot
    return task


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


# ----------------------------------------------------------------------------------- results

#: A result's arrays in stream order: field -> (n x n (else length n), allowed dtypes). The
#: matrix is always there; the others only in EIGENBASIS results.
_RESULT_ARRAYS: dict[str, tuple[bool, tuple[np.dtype, ...]]] = {
    "matrix": (True, _FLOATS),
    "eigenvalues": (False, _FLOATS),
    "permutation": (False, _INT64),
    "rotation": (True, _FLOATS),
}


def _result_slot(
    name: str, dtype: np.dtype, shape: tuple[int, ...], n: int, kind: SolveKind, what: str
) -> _Slot:
    """Check one announced (or present) result array against its field's rules."""
    square, allowed = _RESULT_ARRAYS[name]
    if name != "matrix" and kind is not SolveKind.EIGENBASIS:
        raise _bad(what, f"{name} is only meaningful for EIGENBASIS results")
    if dtype not in allowed:
        raise _bad(what, f"{name} must be {' or '.join(map(str, allowed))}, got {dtype}")
    expected = (n, n) if square else (n,)
    if shape != expected:
        raise _bad(what, f"{name} must have shape {expected}, got {shape}")
    return _Slot(name, dtype, shape)


def _result_arrays(result: SolveResult) -> list[tuple[str, np.ndarray]]:
    present = [(name, getattr(result, name)) for name in _RESULT_ARRAYS]
    return [(name, array) for name, array in present if array is not None]


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
        shm=None if shm is None else _ref_to_proto(shm),
    )
    for name, array in _result_arrays(result):
        if not isinstance(array, np.ndarray):
            raise _bad(what, f"{name} must be a numpy.ndarray, got {type(array).__name__}")
        slot = _result_slot(name, array.dtype, array.shape, n, result.kind, what)
        getattr(header, name).CopyFrom(
            pb.ArrayHeader(dtype=_DTYPES[slot.dtype], shape=slot.shape, num_bytes=slot.num_bytes)
        )
    return header


def result_messages(
    result: SolveResult, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, shm: SegmentRef | None = None
) -> Iterator[pb.StreamResultsResponse]:
    """``result``'s part of a StreamResults stream: its header, then its arrays' chunks (none
    when ``shm`` says where the arrays were written)."""
    _check_limit("chunk_bytes", chunk_bytes)
    yield pb.StreamResultsResponse(header=result_header(result, shm=shm))
    if shm is not None:
        return
    for _, array in _result_arrays(result):
        for chunk in array_chunks(array, chunk_bytes):
            yield pb.StreamResultsResponse(chunk=chunk)


class ResultReceiver:
    """Rebuilds :class:`SolveResult` values from a StreamResults stream, one message at a time."""

    def __init__(
        self,
        *,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_matrix_n: int = DEFAULT_MAX_MATRIX_N,
        reader: SegmentReader | None = None,
    ) -> None:
        self._max_chunk_bytes = _check_limit("max_chunk_bytes", max_chunk_bytes)
        self._max_matrix_n = _check_limit("max_matrix_n", max_matrix_n)
        self._reader = reader
        self._header: pb.ResultHeader | None = None
        self._kind = SolveKind.INVERSE_ROOT
        self._what = ""
        self._names: list[str] = []
        self._slots: list[_Slot] = []
        self._assembler: _Assembler | None = None

    @property
    def in_progress(self) -> bool:
        """True between a result's header and its last chunk."""
        return self._header is not None

    def feed(self, message: pb.StreamResultsResponse) -> SolveResult | None:
        """Take the next message; returns a result when this message completed it."""
        part = message.WhichOneof("part")
        if part == "header":
            if self._header is not None:
                raise _bad(self._what, "a new header arrived before this result was complete")
            self._start(message.header)
            if message.header.HasField("shm"):
                return self._from_segment(message.header)
        elif part == "chunk":
            if self._assembler is None:
                raise _bad("StreamResults stream", "a chunk arrived before any result header")
            self._assembler.add(message.chunk)
        else:
            raise _bad(self._what or "StreamResults stream", "an empty message arrived")
        assert self._assembler is not None
        return self._finish() if self._assembler.complete else None

    def close(self) -> None:
        """The stream ended; raises if it ended inside a result."""
        if self._header is not None and self._assembler is not None:
            self._assembler.finish()

    def _start(self, header: pb.ResultHeader) -> None:
        what = f"result of block {header.block!r} version {header.version}"
        if not header.block or not header.tenant:
            raise _bad(what, "block and tenant must be non-empty")
        if header.version < 0 or header.base_version < -1 or header.attempts < 0:
            raise _bad(what, "version >= 0, base_version >= -1 and attempts >= 0 are required")
        kind = kind_from_proto(header.kind, what=what)
        n = _check_n(header.n, self._max_matrix_n, what)
        announced = {
            "matrix": header.matrix if header.HasField("matrix") else None,
            "eigenvalues": header.eigenvalues if header.HasField("eigenvalues") else None,
            "permutation": header.permutation if header.HasField("permutation") else None,
            "rotation": header.rotation if header.HasField("rotation") else None,
        }
        if announced["matrix"] is None:
            raise _bad(what, "the matrix header is missing")
        slots = []
        for name in _RESULT_ARRAYS:
            array = announced[name]
            if array is None:
                continue
            dtype = _dtype_from_proto(array.dtype, (*_FLOATS, *_INT64), what, f"{name} dtype")
            slot = _result_slot(name, dtype, tuple(array.shape), n, kind, what)
            if array.num_bytes != slot.num_bytes:
                raise _bad(
                    what,
                    f"{name} announces {array.num_bytes} bytes but {slot.dtype} of shape "
                    f"{slot.shape} is {slot.num_bytes}",
                )
            slots.append(slot)
        self._assembler = _Assembler(what, slots, self._max_chunk_bytes)
        self._header, self._kind, self._what = header, kind, what
        self._names = [slot.name for slot in slots]
        self._slots = slots

    def _from_segment(self, header: pb.ResultHeader) -> SolveResult | None:
        """A result announced in shared memory: copied out by the reader (no chunks follow)."""
        ref = _ref_from_proto(header.shm, self._what)
        slots, self._header = self._slots, None
        if self._reader is None:
            raise _bad(self._what, "shared memory is not available on this connection")
        arrays = self._reader(ref, [slot.spec for slot in slots])
        return None if arrays is None else self._result(header, arrays)

    def _finish(self) -> SolveResult:
        assert self._header is not None and self._assembler is not None
        h, self._header = self._header, None
        return self._result(h, self._assembler.finish())

    def _result(self, h: pb.ResultHeader, values: list[np.ndarray]) -> SolveResult:
        arrays = dict(zip(self._names, values, strict=True))
        return SolveResult(
            tenant=h.tenant,
            block=h.block,
            version=h.version,
            kind=self._kind,
            matrix=arrays["matrix"],
            eigenvalues=arrays.get("eigenvalues"),
            permutation=arrays.get("permutation"),
            rotation=arrays.get("rotation"),
            base_version=h.base_version,
            epsilon_used=h.epsilon_used,
            solve_time_s=h.solve_time_s,
            attempts=h.attempts,
        )


def read_results(
    messages: Iterable[pb.StreamResultsResponse],
    *,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_matrix_n: int = DEFAULT_MAX_MATRIX_N,
) -> Iterator[SolveResult]:
    """The results a StreamResults stream carries, as each completes."""
    receiver = ResultReceiver(max_chunk_bytes=max_chunk_bytes, max_matrix_n=max_matrix_n)
    for message in messages:
        result = receiver.feed(message)
        if result is not None:
            yield result
    receiver.close()


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
    )


def status_from_proto(message: pb.StatusResponse) -> tuple[EngineStats, list[BlockStatus]]:
    """The engine-wide numbers and per-block records of a Status answer."""
    return (
        engine_stats_from_proto(message.engine),
        [block_status_from_proto(b) for b in message.blocks],
    )
