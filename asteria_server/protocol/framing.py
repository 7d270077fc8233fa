"""The stream framing of arrays: how a task's and a result's bytes follow their header.

Arrays travel as raw little-endian C-order bytes, in chunks of at most ``chunk_bytes``, after a
header that announces them (``protocol.convert`` builds and checks headers). Senders are
generators of messages. Receivers are fed one message at a time, so a grpc.aio servicer drives
them from ``async for`` and a synchronous client from ``for``. A receiver checks a header before
it allocates anything, then every chunk, and raises :class:`InvalidInputError` naming the block
for a stream that is short, too long or out of order.

On the same host the arrays may lie in a shared-memory segment instead (``protocol.shm``): the
header then carries a ``shm`` reference and no chunks follow. A snapshot receiver then only
reports where the arrays lie (the daemon's solver worker reads them from there itself); a result
receiver hands the reference and the announced specs to a *reader* the transport supplies, which
copies them out of the segment (or reports that a newer write replaced them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from asteria_server.errors import InvalidInputError
from asteria_server.protocol import convert
from asteria_server.protocol.convert import AnnouncedArray
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.shm import RESULT_FIELDS, ArraySpec, SegmentRef
from asteria_server.types import Credit, SharedArrays, SolveResult, SolveTask

#: Copies announced arrays out of a shared-memory segment: ``reader(ref, specs)`` returns them,
#: or None when a newer write replaced them (the announcement is then skipped).
SegmentReader = Callable[[SegmentRef, list[ArraySpec]], list[np.ndarray] | None]
#: Where a result's chunks are assembled: ``allocate(block, specs)`` returns writable arrays of
#: those specs (a client stages them in pinned memory, so the assembly is the result's one host
#: copy); without one they are new NumPy arrays.
ArrayAllocator = Callable[[str, list[ArraySpec]], list[np.ndarray]]

#: Chunk size of array streams (gRPC moved 2.3-3 GB/s on loopback in 1 MiB chunks).
DEFAULT_CHUNK_BYTES = 1 << 20
#: Largest factor dimension a receiver accepts unless told otherwise (n x n fp64: 2 GiB).
DEFAULT_MAX_MATRIX_N = 16384


def _bad(what: str, problem: str) -> InvalidInputError:
    return InvalidInputError(f"{what}: {problem}")


def check_limit(name: str, value: int) -> int:
    """``value`` if it is an int >= 1, else a ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def array_chunks(array: np.ndarray, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """``array``'s bytes, C order and little-endian, in pieces of at most ``chunk_bytes``."""
    check_limit("chunk_bytes", chunk_bytes)
    wire = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    data = wire.reshape(-1).view(np.uint8)
    for start in range(0, data.size, chunk_bytes):
        yield data[start : start + chunk_bytes].tobytes()


class _Assembler:
    """Fills announced arrays, in order, from the chunks of a stream."""

    def __init__(
        self,
        what: str,
        slots: Sequence[AnnouncedArray],
        max_chunk_bytes: int,
        allocate: Callable[[list[ArraySpec]], list[np.ndarray]] | None = None,
    ) -> None:
        self._what = what
        self._slots = list(slots)
        self._allocate = allocate
        self._max_chunk_bytes = max_chunk_bytes
        #: allocated at the first chunk, not at the header: a header alone (of an unknown
        #: session, or refused by a budget) never reserves memory
        self._arrays: list[np.ndarray] | None = None
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
        if self._arrays is None:
            self._arrays = self._new_arrays()
        flat = self._arrays[self._index].reshape(-1).view(np.uint8)
        flat[self._offset : self._offset + size] = np.frombuffer(chunk, dtype=np.uint8)
        self._offset += size
        self.received_bytes += size
        if self._offset == slot.num_bytes:
            self._index += 1
            self._offset = 0

    def _new_arrays(self) -> list[np.ndarray]:
        """The arrays the chunks fill: the allocator's when it gives the announced specs, else
        new ones (little-endian, as on the wire)."""
        specs = [ArraySpec(s.spec.dtype.newbyteorder("<"), s.spec.shape) for s in self._slots]
        if self._allocate is not None:
            given = self._allocate(specs)
            if len(given) == len(specs) and all(
                a.shape == spec.shape
                and a.dtype == spec.dtype
                and a.flags.c_contiguous
                and a.flags.writeable
                for a, spec in zip(given, specs, strict=True)
            ):
                return given
        return [np.empty(spec.shape, spec.dtype) for spec in specs]

    def finish(self) -> list[np.ndarray]:
        """The filled arrays (native byte order); raises if the stream stopped short."""
        if not self.complete:
            slot = self._slots[self._index]
            raise _bad(
                self._what,
                f"stream ended early: {self.received_bytes} of {self.total_bytes} bytes "
                f"arrived ({slot.name}: {self._offset} of {slot.num_bytes})",
            )
        if self._arrays is None:  # nothing announced (a result in shared memory)
            self._arrays = [
                np.empty(s.spec.shape, s.spec.dtype.newbyteorder("<")) for s in self._slots
            ]
        return [a.astype(a.dtype.newbyteorder("="), copy=False) for a in self._arrays]


# --------------------------------------------------------------------------------- snapshots


def snapshot_messages(
    task: SolveTask,
    *,
    session_id: str = "",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shm: SegmentRef | None = None,
) -> Iterator[pb.SubmitSnapshotRequest]:
    """The whole SubmitSnapshot stream of ``task``: its header, then matrix and basis chunks
    (none when ``shm`` says where they were written; ``task``'s arrays then only give shapes)."""
    check_limit("chunk_bytes", chunk_bytes)
    header = convert.snapshot_header(task, session_id=session_id, shm=shm)
    yield pb.SubmitSnapshotRequest(header=header)
    if shm is not None:
        return
    for array in (task.matrix, task.basis):
        if array is not None:
            for chunk in array_chunks(array, chunk_bytes):
                yield pb.SubmitSnapshotRequest(chunk=chunk)


class SnapshotReceiver:
    """Rebuilds a :class:`SolveTask` from a SubmitSnapshot stream, one message at a time.

    Construct it from the stream's first message (the header is checked there, before anything
    is allocated), look up ``session_id``, ``feed`` it every later message, then ``finish``; or,
    for a snapshot announced in shared memory (``shm`` is set), build the task from the segment
    with :meth:`task_from`.
    """

    def __init__(
        self,
        first: pb.SubmitSnapshotRequest,
        *,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_matrix_n: int = DEFAULT_MAX_MATRIX_N,
    ) -> None:
        check_limit("max_chunk_bytes", max_chunk_bytes)
        check_limit("max_matrix_n", max_matrix_n)
        if first.WhichOneof("part") != "header":
            raise _bad("SubmitSnapshot stream", "the first message must be a header")
        header = first.header
        self._what = convert.snapshot_what(header)
        arrays = convert.snapshot_arrays(header, max_matrix_n=max_matrix_n)
        self.header = header
        #: Where the arrays lie when they come through shared memory (no chunks then).
        self.shm = (
            convert.ref_from_proto(header.shm, self._what) if header.HasField("shm") else None
        )
        #: The announced arrays: the matrix, then the basis.
        self.specs = [array.spec for array in arrays]
        self._assembler = None if self.shm else _Assembler(self._what, arrays, max_chunk_bytes)

    @property
    def session_id(self) -> str:
        """The session the header names (the caller resolves it to a tenant)."""
        return self.header.session_id

    def feed(self, message: pb.SubmitSnapshotRequest) -> None:
        """Take the next message of the stream; it must be a chunk."""
        part = message.WhichOneof("part")
        if self._assembler is None:
            raise _bad(self._what, "no chunks may follow a snapshot announced in shared memory")
        if part != "chunk":
            raise _bad(self._what, f"expected a chunk, got {part or 'an empty message'}")
        self._assembler.add(message.chunk)

    def finish(self, *, tenant: str) -> SolveTask:
        """The task, once the stream of chunks ended; raises if bytes are missing."""
        if self._assembler is None:
            raise _bad(self._what, "the snapshot lies in shared memory: build it with task_from")
        arrays = self._assembler.finish()
        basis = arrays[1] if self.header.has_basis else None
        return convert.task_from_header(self.header, arrays[0], basis, tenant=tenant)

    def task_from(
        self,
        views: Sequence[np.ndarray],
        *,
        tenant: str,
        shm_source: SharedArrays | None = None,
        shm_result: SharedArrays | None = None,
    ) -> SolveTask:
        """The task of a snapshot in shared memory, its arrays given as ``views`` of the
        segment or stand-ins of them (in :attr:`specs` order; ``shm_source`` and
        ``shm_result``: see :class:`SolveTask`). Nothing is copied: whoever reads the arrays
        must do so in the segment, under its seqlock, at :attr:`shm`'s sequence."""
        basis = views[1] if self.header.has_basis else None
        return convert.task_from_header(
            self.header,
            views[0],
            basis,
            tenant=tenant,
            shm_source=shm_source,
            shm_result=shm_result,
        )


# ----------------------------------------------------------------------------------- results


def result_messages(
    result: SolveResult, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, shm: SegmentRef | None = None
) -> Iterator[pb.StreamResultsResponse]:
    """``result``'s part of a StreamResults stream: its header, then its arrays' chunks (none
    when ``shm`` says where the arrays were written)."""
    check_limit("chunk_bytes", chunk_bytes)
    yield pb.StreamResultsResponse(header=convert.result_header(result, shm=shm))
    if shm is not None:
        return
    for name in RESULT_FIELDS:
        array = getattr(result, name)
        if array is not None:
            for chunk in array_chunks(array, chunk_bytes):
                yield pb.StreamResultsResponse(chunk=chunk)


def batched_result(
    result: SolveResult, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, shm: SegmentRef | None = None
) -> pb.BatchedResult:
    """``result`` as one entry of a StreamResults batch: its header and, unless ``shm`` says
    where the arrays were written, each array whole (so each must fit in ``chunk_bytes``)."""
    check_limit("chunk_bytes", chunk_bytes)
    header = convert.result_header(result, shm=shm)
    if shm is not None:
        return pb.BatchedResult(header=header)
    arrays = []
    for name in RESULT_FIELDS:
        array = getattr(result, name)
        if array is not None:
            if array.nbytes > chunk_bytes:
                raise ValueError(
                    f"{convert.result_what(header)}: {name} is {array.nbytes} bytes, more than "
                    f"a chunk ({chunk_bytes}): send it in chunks, not in a batch"
                )
            (data,) = array_chunks(array, chunk_bytes)
            arrays.append(data)
    return pb.BatchedResult(header=header, arrays=arrays)


class ResultReceiver:
    """Rebuilds :class:`SolveResult` values from a StreamResults stream, one message at a time."""

    def __init__(
        self,
        *,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_matrix_n: int = DEFAULT_MAX_MATRIX_N,
        reader: SegmentReader | None = None,
        on_credit: Callable[[Credit], None] | None = None,
        allocate: ArrayAllocator | None = None,
    ) -> None:
        self._allocate = allocate
        self._max_chunk_bytes = check_limit("max_chunk_bytes", max_chunk_bytes)
        self._max_matrix_n = check_limit("max_matrix_n", max_matrix_n)
        self._reader = reader
        self._on_credit = on_credit
        self._header: pb.ResultHeader | None = None
        self._what = ""
        self._arrays: list[AnnouncedArray] = []
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
            header = message.header
            arrays = convert.result_arrays_announced(header, max_matrix_n=self._max_matrix_n)
            self._what, self._arrays = convert.result_what(header), arrays
            if header.HasField("shm"):  # nothing follows: a chunk now is one too many
                self._assembler = _Assembler(self._what, [], self._max_chunk_bytes)
                return self._from_segment(header)
            self._header = header
            allocate = self._allocate
            self._assembler = _Assembler(
                self._what,
                arrays,
                self._max_chunk_bytes,
                None if allocate is None else lambda specs: allocate(header.block, specs),
            )
        elif part == "chunk":
            if self._assembler is None:
                raise _bad("StreamResults stream", "a chunk arrived before any result header")
            self._assembler.add(message.chunk)
        elif part == "credit":
            if self._header is not None:
                raise _bad(self._what, "a credit message arrived inside this result")
            if self._on_credit is not None:  # else not asked for: ignored
                self._on_credit(convert.credit_from_proto(message.credit))
            return None
        elif part == "batch":
            raise _bad("StreamResults stream", "a batch of results: read it with feed_all")
        else:
            raise _bad(self._what or "StreamResults stream", "an empty message arrived")
        assert self._assembler is not None
        return self._finish() if self._assembler.complete else None

    def feed_all(self, message: pb.StreamResultsResponse) -> Iterator[SolveResult]:
        """Take the next message, a batch (``batch_results``) or any other part; yields the
        results it completed, in order, each before the next one of a batch is read (a reader
        that stages a result for whoever takes it next relies on that). A batched result whose
        segment was already overwritten gives nothing, as :meth:`feed` gives None."""
        if message.WhichOneof("part") != "batch":
            result = self.feed(message)
            if result is not None:
                yield result
            return
        if self._header is not None:
            raise _bad(self._what, "a batch of results arrived inside this result")
        for batched in message.batch.results:
            result = self._batched(batched)
            if result is not None:
                yield result
        # nothing follows a batch: a chunk now is one too many
        self._assembler = _Assembler(
            self._what or "StreamResults stream", [], self._max_chunk_bytes
        )

    def _batched(self, batched: pb.BatchedResult) -> SolveResult | None:
        header = batched.header
        what = convert.result_what(header)
        arrays = convert.result_arrays_announced(header, max_matrix_n=self._max_matrix_n)
        self._what, self._arrays = what, arrays
        if header.HasField("shm"):
            if batched.arrays:
                raise _bad(what, "a batched result announced in a segment also carries arrays")
            return self._from_segment(header)
        if len(batched.arrays) != len(arrays):
            raise _bad(
                what,
                f"a batched result carries {len(batched.arrays)} arrays, its header announces "
                f"{len(arrays)} (and names no result segment)",
            )
        allocate = self._allocate
        assembler = _Assembler(
            what,
            arrays,
            self._max_chunk_bytes,
            None if allocate is None else lambda specs: allocate(header.block, specs),
        )
        for data in batched.arrays:
            assembler.add(data)
        return self._result(header, assembler.finish())

    def close(self) -> None:
        """The stream ended; raises if it ended inside a result."""
        if self._header is not None and self._assembler is not None:
            self._assembler.finish()

    def _from_segment(self, header: pb.ResultHeader) -> SolveResult | None:
        """A result announced in shared memory: copied out by the reader (no chunks follow)."""
        ref = convert.ref_from_proto(header.shm, self._what)
        if self._reader is None:
            raise _bad(self._what, "shared memory is not available on this connection")
        values = self._reader(ref, [array.spec for array in self._arrays])
        return None if values is None else self._result(header, values)

    def _finish(self) -> SolveResult:
        assert self._header is not None and self._assembler is not None
        header, self._header = self._header, None
        return self._result(header, self._assembler.finish())

    def _result(self, header: pb.ResultHeader, values: list[np.ndarray]) -> SolveResult:
        names = [array.name for array in self._arrays]
        return convert.result_from_header(header, dict(zip(names, values, strict=True)))
