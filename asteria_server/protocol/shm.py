"""Shared-memory segments: their layout, creation and checks. Defined here once.

The same layout serves both shared-memory paths of the system: the same-host transport between
a training process and its node's daemon, and the engine's own segments to its solver workers
(the embedded mode). A solver worker reads a snapshot out of a segment and writes its result
into one the same way whichever process created them (``engine.worker_process``).

A training process and its node's daemon exchange snapshots and results through *segments*:
anonymous ``memfd`` files the client creates and hands to the daemon over a Unix socket
(``SCM_RIGHTS``, see ``service.handover`` and ``asteria_client.transport.shm``). The gRPC call
that announces a snapshot or a result then carries only its header and a :class:`SegmentRef`;
the bytes never cross the socket.

How the known traps of shared memory are avoided:

- **No names, nothing to leak or unlink.** A memfd has no path in ``/dev/shm``; its memory is
  freed when the last descriptor and mapping go, so a ``kill -9`` of either side leaks nothing,
  and no resource tracker of any Python process can unlink it.
- **No SIGBUS from a full tmpfs.** The creator reserves every byte up front with
  ``posix_fallocate``; when memory (or a size limit) runs out that call fails with a clear
  :class:`SharedMemoryUnavailableError`, and the client falls back to gRPC. Nothing is touched
  that was not reserved. The mapping is pre-faulted (``MAP_POPULATE``) and reused for every
  snapshot of the block.
- **No SIGBUS from truncation.** The creator seals the size (``F_SEAL_SHRINK | F_SEAL_GROW``)
  before handing the segment over; the daemon maps only segments that carry both seals and
  have the announced size, so a client cannot shrink a segment under the daemon's mapping.
- **No torn reads.** Every segment starts with a *sequence* word (a seqlock): a writer makes it
  odd, writes, then makes it even. The announcement carries the even sequence it ended with; a
  reader copies the bytes out and accepts them only if the sequence was that value both before
  and after the copy. Otherwise a newer write replaced them, and that write's own announcement
  follows.

Layout (little-endian): ``magic u64 | sequence u64 | capacity u64``, padding to
:data:`HEADER_BYTES`, then the arrays back to back in the order the announcement lists them, each
starting at a multiple of :data:`ARRAY_ALIGN` bytes. A snapshot holds the matrix, then the basis
of a QR refresh (:func:`snapshot_specs`); a result holds :data:`RESULT_FIELDS` in that order,
those it has (:func:`result_specs`). :func:`snapshot_layout` and :func:`result_layout` give the
largest of each for a block, which is what a segment is sized for. The capacity word is checked
when a segment is mapped; afterwards the mapping's own size is what bounds every view, so a
writer that rewrites the header cannot make a reader look past the mapping. The sequence is read
and written as an aligned 8-byte word, which x86-64 and AArch64 load and store atomically; the
copies around it are separate calls into C, so neither compiler nor CPU (x86's total store order)
moves them across.

**Arenas: many blocks, one descriptor.** A segment per block costs descriptors (a memfd and its
mapping's duplicate, on both sides) and a mapping, so a training process of 20,000 blocks could not
give every block its own pair: the descriptor limits sent most of them over gRPC. An *arena* is one
memfd that holds many *slots* of one size: ``arena header | slot 0 | slot 1 | ...``, where the arena
header (one page, :data:`ARENA_MAGIC`, the capacity after it and the slot size) is followed by
equal slots, and every slot has exactly the layout of a segment above (its own magic, capacity and
seqlock word, then its arrays). :meth:`Segment.slot` gives slot ``i`` as a :class:`Segment` that
views only its own bytes of the arena's one mapping: everything that reads or writes a segment works
on a slot unchanged, and a slot's views are bounded by its own size (checked against the mapping
when the slot is made), so a slot never reaches into its neighbour's bytes. Slots of one arena
share its mapping, its descriptor and its :attr:`Segment.token`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import itertools
import math
import mmap
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from asteria_server.errors import AsteriaError, InvalidInputError
from asteria_server.types import SolveKind, SolveResult, SolveTask

#: "ASTSHM01" as a little-endian u64: the first word of every segment (and of every arena slot).
MAGIC = int.from_bytes(b"ASTSHM01", "little")
#: "ASTARN01": the first word of an arena (a segment of many slots).
ARENA_MAGIC = int.from_bytes(b"ASTARN01", "little")
#: Bytes before the first array: one page, so the arrays start page-aligned.
HEADER_BYTES = 4096
#: Every array starts at a multiple of this many bytes.
ARRAY_ALIGN = 64
#: The seals a segment must carry before the daemon maps it.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_MAGIC_AT, _SEQUENCE_AT, _CAPACITY_AT = 0, 1, 2  # u64 word indices in the header
_SLOT_BYTES_AT = 3  # an arena's header: the size of each of its slots
T = TypeVar("T")


class SharedMemoryUnavailableError(AsteriaError, OSError):
    """A segment could not be created or reserved here; the caller should use gRPC instead."""


@dataclass(frozen=True)
class ArraySpec:
    """One array in a segment: its dtype and shape."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize  # np.prod: 60x the time


@dataclass(frozen=True)
class SegmentRef:
    """Where an announced snapshot or result lies: a segment of the session and its sequence."""

    segment_id: str
    sequence: int


_TOKENS = itertools.count(1)


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _aligned(offset: int) -> int:
    return -(-offset // ARRAY_ALIGN) * ARRAY_ALIGN


@functools.lru_cache(maxsize=256)
def _placement(specs: tuple[ArraySpec, ...]) -> tuple[int, tuple[tuple[int, int], ...]]:
    """The payload bytes of ``specs`` (alignment included) and each array's offset from the
    segment's start and element count: worked out once per layout, not per solve (a daemon
    places every block's snapshot and result several times a solve, all of a few layouts)."""
    end, places = 0, []
    for spec in specs:
        start = _aligned(end)
        places.append((HEADER_BYTES + start, spec.num_bytes // spec.dtype.itemsize))
        end = start + spec.num_bytes
    return end, tuple(places)


@functools.lru_cache(maxsize=256)
def stand_in(spec: ArraySpec) -> np.ndarray:
    """A read-only array of ``spec``'s dtype and shape that holds one element (zero strides):
    it stands for arrays that lie elsewhere, to code that looks only at their dtype and shape.
    Every read of it gives 0.0, so only a task whose arrays a worker reads from a segment
    may carry it (:attr:`SolveTask.shm_source`); one is shared by every such task of a shape."""
    one = np.zeros(1, dtype=spec.dtype)
    held = np.lib.stride_tricks.as_strided(one, shape=spec.shape, strides=(0,) * len(spec.shape))
    held.flags.writeable = False
    return held


def payload_bytes(specs: Sequence[ArraySpec]) -> int:
    """Bytes the arrays ``specs`` take after the header, alignment included."""
    return _placement(tuple(specs))[0]


def segment_bytes(specs: Sequence[ArraySpec]) -> int:
    """The size of a segment that holds ``specs``, rounded up to whole pages."""
    size = HEADER_BYTES + payload_bytes(specs)
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


#: A result's arrays in segment (and stream) order; the matrix is always there, the others only
#: in EIGENBASIS results (the permutation and rotation only from a QR refresh).
RESULT_FIELDS = ("matrix", "eigenvalues", "permutation", "rotation")
_F32, _I64 = np.dtype("<f4"), np.dtype("<i8")


def snapshot_specs(task: SolveTask) -> list[ArraySpec]:
    """The arrays of ``task``'s snapshot in segment order: the matrix, then the basis."""
    arrays = [task.matrix] if task.basis is None else [task.matrix, task.basis]
    return [ArraySpec(a.dtype, a.shape) for a in arrays]


def snapshot_layout(n: int, kind: SolveKind, itemsize: int) -> list[ArraySpec]:
    """The largest snapshot of a block: the matrix, plus a basis for EIGENBASIS."""
    dtype = np.dtype(f"<f{itemsize}")
    count = 2 if kind is SolveKind.EIGENBASIS else 1
    return [ArraySpec(dtype, (n, n))] * count


@functools.lru_cache(maxsize=256)
def result_field_spec(name: str, n: int) -> ArraySpec:
    """The spec of result field ``name`` (one of :data:`RESULT_FIELDS`) for a block of size n."""
    if name == "permutation":
        return ArraySpec(_I64, (n,))
    return ArraySpec(_F32, (n,) if name == "eigenvalues" else (n, n))


def result_layout(n: int, kind: SolveKind) -> list[ArraySpec]:
    """The largest result of a block: the matrix, and for EIGENBASIS the eigenvalues, the
    permutation and the rotation of a QR refresh (results are float32)."""
    names = RESULT_FIELDS if kind is SolveKind.EIGENBASIS else RESULT_FIELDS[:1]
    return [result_field_spec(name, n) for name in names]


def result_arrays(result: SolveResult) -> list[np.ndarray]:
    """The arrays of ``result`` in segment (and stream) order."""
    present = [getattr(result, name) for name in RESULT_FIELDS]
    return [array for array in present if array is not None]


def result_specs(result: SolveResult) -> list[ArraySpec]:
    """The specs of :func:`result_arrays`."""
    return [ArraySpec(a.dtype, a.shape) for a in result_arrays(result)]


def private_result(result: SolveResult) -> SolveResult | None:
    """``result`` with private copies of the arrays it holds in a client's segment
    (``result.shm``), read under that segment's seqlock; None when they were overwritten since.
    A result not in a segment is returned as it is."""
    if result.shm is None:
        return result
    copies = result.shm.segment.read(result_specs(result), result.shm.sequence)
    if copies is None:
        return None
    names = [name for name in RESULT_FIELDS if getattr(result, name) is not None]
    arrays: dict[str, Any] = dict(zip(names, copies, strict=True))
    return dataclasses.replace(result, shm=None, **arrays)


class _Mapping:
    """What a mapped segment and all the slots cut from it share: the mapping, its byte and word
    views (made once: each view is a buffer export of ~420 bytes), its token and descriptor."""

    __slots__ = ("buffer", "bytes", "fd", "fd_closer", "is_arena", "token", "words")

    def __init__(self, buffer: mmap.mmap, fd: int | None, owner: Segment) -> None:
        self.buffer = buffer
        # They hold the buffer exported: it cannot be unmapped under a view cut from them.
        self.bytes = np.frombuffer(buffer, dtype=np.uint8)
        self.words = self.bytes[: len(self.bytes) // 8 * 8].view("<u8")
        #: Unique in this process while the mapping lives: how a solver worker's cache of
        #: mappings names it (a descriptor number can be reused, this cannot).
        self.token = next(_TOKENS)
        self.is_arena = False
        self.fd = fd
        if fd is not None:  # closed with the segment, or when its last reference goes
            self.fd_closer = weakref.finalize(owner, _close_fd, fd)

    def closed(self) -> _Mapping:
        """What a closed segment keeps: its token, descriptor number and kind, no views."""
        kept = object.__new__(_Mapping)
        kept.token, kept.is_arena, kept.fd = self.token, self.is_arena, self.fd
        return kept


class Segment:
    """A mapped segment, or one slot of a mapped arena: its sequence word and views of its arrays.

    Create one with :func:`create_segment` / :func:`create_arena` (client) or
    :func:`map_segment` (daemon), and an arena's slots with :meth:`slot`. Closing the descriptor
    or the mapping never frees the memory while the other side still maps it.
    """

    # A daemon holds one per arena slot, two per block: no __dict__ each, and all a slot shares
    # with its arena in one _Mapping (its index is worked out from its base). A slot was ~700
    # bytes with its own header view and copies of the mapping's fields, ~80 now.
    __slots__ = ("__weakref__", "_arena", "_map", "base", "size_bytes")

    def __init__(
        self,
        buffer: mmap.mmap,
        size_bytes: int,
        fd: int | None = None,
        *,
        base: int = 0,
        arena: Segment | None = None,
    ) -> None:
        #: This segment's bytes (a slot's own, never its arena's): what bounds every view.
        self.size_bytes = size_bytes
        #: Where this segment starts in its mapping (0, or a slot's offset in its arena).
        self.base = base
        self._arena = arena  # a slot keeps its arena (and so the mapping) alive
        self._map: _Mapping = _Mapping(buffer, fd, self) if arena is None else arena._map

    @property
    def _mmap(self) -> mmap.mmap:
        return self._map.buffer

    @property
    def _bytes(self) -> np.ndarray:
        return self._map.bytes

    @property
    def _words(self) -> np.ndarray:
        return self._map.words

    @property
    def token(self) -> int:
        """Unique in this process while the mapping lives; slots share their arena's."""
        return self._map.token

    @property
    def is_arena(self) -> bool:
        """Whether this is an arena (a mapping of slots), not a segment or one slot."""
        return self._arena is None and self._map.is_arena

    @is_arena.setter
    def is_arena(self, value: bool) -> None:
        self._map.is_arena = value

    @property
    def slot_index(self) -> int:
        """The slot's index in its arena; -1 for a whole segment (or an arena itself)."""
        return -1 if self.base == 0 else (self.base - HEADER_BYTES) // self.size_bytes

    def _word(self, index: int) -> int:
        """Header word ``index`` of this segment (or slot)."""
        return int(self._words[(self.base >> 3) + index])

    def _set_word(self, index: int, value: int) -> None:
        self._words[(self.base >> 3) + index] = value

    @property
    def mapping(self) -> Segment:
        """The segment whose mapping this one views: its arena for a slot, else itself."""
        return self if self._arena is None else self._arena

    @property
    def map_bytes(self) -> int:
        """The size of the whole mapping (an arena's for a slot)."""
        return self.mapping.size_bytes

    def slot(self, index: int, slot_bytes: int) -> Segment:
        """Slot ``index`` of this arena, whose slots are ``slot_bytes`` each, as a segment of its
        own; InvalidInputError (the client's fault) when this is no arena of such slots, the slot
        lies outside it, or it holds no segment header."""
        if not self.is_arena:
            raise InvalidInputError("a slot was named in a segment that is not an arena")
        base = slot_base(index, slot_bytes)
        if (
            index < 0
            or slot_bytes < HEADER_BYTES
            or slot_bytes % mmap.PAGESIZE
            or base + slot_bytes > self.size_bytes
        ):
            raise InvalidInputError(
                f"slot {index} of {slot_bytes} bytes does not lie in the arena of "
                f"{self.size_bytes} bytes"
            )
        slot = Segment(self._mmap, slot_bytes, base=base, arena=self)
        if slot._word(_MAGIC_AT) != MAGIC or slot._word(_CAPACITY_AT) != (
            slot_bytes - HEADER_BYTES
        ):
            raise InvalidInputError(
                f"slot {index} of the arena does not hold an Asteria segment header (magic and "
                f"capacity {slot_bytes - HEADER_BYTES})"
            )
        return slot

    def fileno(self) -> int:
        """A descriptor of the segment this object holds open (to pass it to a solver worker);
        a slot's is its arena's."""
        if self._arena is not None:
            return self._arena.fileno()
        if self._map.fd is None:
            raise ValueError("this segment was mapped without keeping a descriptor")
        return self._map.fd

    @property
    def capacity_bytes(self) -> int:
        """Bytes after the header: from the mapping's size, never from the (writable) header."""
        return self.size_bytes - HEADER_BYTES

    @property
    def sequence(self) -> int:
        return self._word(_SEQUENCE_AT)

    def views(self, specs: Sequence[ArraySpec]) -> list[np.ndarray]:
        """Writable NumPy views of the arrays ``specs`` (they must fit the capacity)."""
        specs = tuple(specs)
        places = self._places(specs)
        base, whole = self.base, self._bytes
        # Cut from the mapping's one byte view (a ~130-byte array each, its base that view),
        # not np.frombuffer: that is a new buffer export each, ~550 bytes a view, and an engine
        # keeps every shared-memory result's views.
        return [
            whole[base + offset : base + offset + count * spec.dtype.itemsize]
            .view(spec.dtype)
            .reshape(spec.shape)
            for spec, (offset, count) in zip(specs, places, strict=True)
        ]

    def stand_ins(self, specs: Sequence[ArraySpec]) -> list[np.ndarray]:
        """Arrays of ``specs``' dtypes and shapes that hold nothing, for a task whose arrays
        only a solver worker reads, there, under the seqlock (a queued shared-memory snapshot):
        the daemon keeps no view per queued snapshot (~130 bytes each at the height of a
        refresh round). Checked to fit the capacity as :meth:`views` is; see :func:`stand_in`."""
        specs = tuple(specs)
        self._places(specs)
        return [stand_in(spec) for spec in specs]

    def _places(self, specs: tuple[ArraySpec, ...]) -> tuple[tuple[int, int], ...]:
        needed, places = _placement(specs)
        if needed > self.capacity_bytes:
            raise InvalidInputError(
                f"the arrays need {needed} bytes but the shared-memory segment holds "
                f"{self.capacity_bytes}; the client must hand over a larger segment"
            )
        return places

    # ------------------------------------------------------------------ the seqlock
    def begin_write(self) -> None:
        """Make the sequence odd: readers that overlap this write will reject what they copied."""
        sequence = self.sequence
        self._set_word(_SEQUENCE_AT, sequence + 1 if sequence % 2 == 0 else sequence + 2)

    def end_write(self) -> int:
        """Make the sequence even again; returns the value that announces this write."""
        sequence = self.sequence
        self._set_word(_SEQUENCE_AT, sequence + 1 if sequence % 2 else sequence + 2)
        return sequence + 1 if sequence % 2 else sequence + 2

    def write(self, specs: Sequence[ArraySpec], arrays: Sequence[np.ndarray]) -> int:
        """Copy ``arrays`` in under the seqlock; returns the sequence to announce."""
        views = self.views(specs)
        self.begin_write()
        for view, array in zip(views, arrays, strict=True):
            np.copyto(view, array, casting="no")
        return self.end_write()

    def read(self, specs: Sequence[ArraySpec], sequence: int) -> list[np.ndarray] | None:
        """Private copies of the arrays written with ``sequence``, or None when a newer write
        replaced (or is replacing) them: the copy would be torn or newer than announced."""
        return self.read_into(specs, sequence, [np.empty(s.shape, s.dtype) for s in specs])

    def read_into(
        self, specs: Sequence[ArraySpec], sequence: int, outs: Sequence[np.ndarray]
    ) -> list[np.ndarray] | None:
        """Copy the arrays written with ``sequence`` into ``outs`` (converting to their dtype,
        e.g. float32 to the float64 a solver works in), or None when a newer write replaced them.
        ``outs`` must have the specs' shapes."""

        def copy(views: list[np.ndarray]) -> list[np.ndarray]:
            for view, out in zip(views, outs, strict=True):
                np.copyto(out, view, casting="same_kind")
            return list(outs)

        return self.read_with(specs, sequence, copy)

    def read_with(
        self, specs: Sequence[ArraySpec], sequence: int, reader: Callable[[list[np.ndarray]], T]
    ) -> T | None:
        """``reader(views)`` of the arrays written with ``sequence``, under the seqlock: None
        when a newer write replaced (or is replacing) them. ``reader`` must copy what it keeps
        (the views' contents may change right after). An exception it raises stands only if the
        arrays were intact while it read: one raised on a torn read is a newer write's doing,
        and the answer is None."""
        if sequence % 2 or self.sequence != sequence:
            return None
        try:
            value = reader(self.views(specs))
        except Exception:
            if self.sequence != sequence:
                return None
            raise
        if self.sequence != sequence:
            return None
        return value

    def close(self) -> None:
        """Drop this side's mapping once no view of it is left (NumPy views keep it alive). A
        slot drops only its hold on its arena, which goes with its last slot and owner."""
        shared = self._map
        self._map = shared.closed()
        if self._arena is not None:
            self._arena = None
            return
        if shared.fd is not None:
            shared.fd_closer()
        buffer = shared.buffer
        del shared  # its views go with it, unless a slot still holds them
        with contextlib.suppress(BufferError):  # a view still uses it: it goes with the last one
            buffer.close()


def slot_base(index: int, slot_bytes: int) -> int:
    """Where slot ``index`` of an arena of ``slot_bytes`` slots starts: after the arena's header."""
    return HEADER_BYTES + index * slot_bytes


def arena_bytes(slot_bytes: int, num_slots: int) -> int:
    """The size of an arena of ``num_slots`` slots of ``slot_bytes`` (whole pages) each."""
    return slot_base(num_slots, slot_bytes)


def _memfd(size_bytes: int, name: str) -> tuple[int, mmap.mmap]:
    """A sealed, reserved, pre-faulted memfd of ``size_bytes`` and its mapping."""
    if size_bytes < HEADER_BYTES or size_bytes % mmap.PAGESIZE:
        raise InvalidInputError(
            f"a segment must be whole pages of at least {HEADER_BYTES} bytes, got {size_bytes}"
        )
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError) as exc:
        raise SharedMemoryUnavailableError(
            f"cannot create a shared-memory segment (memfd_create): {exc}"
        ) from None
    try:
        try:
            os.posix_fallocate(fd, 0, size_bytes)  # reserve now: never a SIGBUS later
        except OSError as exc:
            reason = {
                errno.ENOSPC: "not enough shared memory left",
                errno.ENOMEM: "out of memory",
                errno.EFBIG: "over this process's file-size limit (ulimit -f)",
            }.get(exc.errno or 0, os.strerror(exc.errno or 0))
            raise SharedMemoryUnavailableError(
                f"cannot reserve a {size_bytes / (1 << 20):.1f} MiB shared-memory segment: {reason}"
            ) from None
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        buffer = mmap.mmap(fd, size_bytes, flags=flags)
    except BaseException:
        os.close(fd)
        raise
    return fd, buffer


def create_segment(
    size_bytes: int, *, name: str = "asteria", own_fd: bool = False
) -> tuple[int, Segment]:
    """A new sealed, reserved, pre-faulted segment of ``size_bytes`` (whole pages) and its fd.
    With ``own_fd`` the segment closes the fd when it is closed or collected (its
    :meth:`Segment.fileno`); else the caller owns it.

    Raises :class:`SharedMemoryUnavailableError` with the reason when this host cannot provide
    it (no memfd, out of memory, a file-size limit, ...): the caller should fall back to gRPC.
    """
    fd, buffer = _memfd(size_bytes, name)
    segment = Segment(buffer, size_bytes, fd if own_fd else None)
    segment._words[_CAPACITY_AT] = size_bytes - HEADER_BYTES
    segment._words[_MAGIC_AT] = MAGIC
    return fd, segment


def create_arena(
    slot_bytes: int, num_slots: int, *, name: str = "asteria-arena"
) -> tuple[int, Segment]:
    """A new arena of ``num_slots`` slots of ``slot_bytes`` (whole pages) each, sealed, reserved
    and pre-faulted, every slot's header written; and its fd, which the caller owns. Raises
    :class:`SharedMemoryUnavailableError` as :func:`create_segment` does."""
    if num_slots < 1 or slot_bytes < HEADER_BYTES or slot_bytes % mmap.PAGESIZE:
        raise InvalidInputError(
            f"an arena needs at least one slot of whole pages >= {HEADER_BYTES} bytes, got "
            f"{num_slots} of {slot_bytes}"
        )
    size_bytes = arena_bytes(slot_bytes, num_slots)
    fd, buffer = _memfd(size_bytes, name)
    words = np.frombuffer(buffer, dtype="<u8")
    stride = slot_bytes // 8
    first = HEADER_BYTES // 8
    words[first + _CAPACITY_AT :: stride] = slot_bytes - HEADER_BYTES  # every slot's header
    words[first + _MAGIC_AT :: stride] = MAGIC
    del words
    arena = Segment(buffer, size_bytes)
    arena.is_arena = True
    arena._words[_SLOT_BYTES_AT] = slot_bytes
    arena._words[_CAPACITY_AT] = size_bytes - HEADER_BYTES
    arena._words[_MAGIC_AT] = ARENA_MAGIC
    return fd, arena


def map_segment(
    fd: int, size_bytes: int, *, keep_fd: bool = False, arena: bool | None = False
) -> Segment:
    """Map a segment received from a client, after checking it cannot be resized under us.

    ``arena``: False maps a segment, True an arena (:func:`create_arena`), None either (what its
    header says). Raises InvalidInputError (the client's fault) when the descriptor is not a
    sealed memfd of ``size_bytes`` bytes holding such a header. Does not close ``fd``; with
    ``keep_fd`` the segment holds a duplicate of it (:meth:`Segment.fileno`) until it is closed
    or collected.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidInputError(
            "the handed-over descriptor is not a sealable memfd; segments must come from "
            "memfd_create(MFD_ALLOW_SEALING)"
        ) from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise InvalidInputError(
            "the handed-over segment is not sealed against resizing (F_SEAL_SHRINK and "
            "F_SEAL_GROW); the daemon maps only segments that cannot be truncated under it"
        )
    actual = os.fstat(fd).st_size
    if actual != size_bytes or size_bytes < HEADER_BYTES:
        raise InvalidInputError(
            f"the handed-over segment has {actual} bytes, announced {size_bytes}"
        )
    buffer = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED)
    segment = Segment(buffer, size_bytes, os.dup(fd) if keep_fd else None)
    magic = int(segment._words[_MAGIC_AT])
    wanted = {False: (MAGIC,), True: (ARENA_MAGIC,), None: (MAGIC, ARENA_MAGIC)}[arena]
    if magic not in wanted or int(segment._words[_CAPACITY_AT]) != (size_bytes - HEADER_BYTES):
        segment.close()
        what = "an Asteria arena" if arena else "an Asteria segment"
        raise InvalidInputError(f"the handed-over segment does not hold {what} header")
    segment.is_arena = magic == ARENA_MAGIC
    return segment
