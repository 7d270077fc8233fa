"""Shared-memory segments of the same-host transport: their layout, creation and checks.

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
starting at a multiple of :data:`ARRAY_ALIGN` bytes. The sequence is read and written as an
aligned 8-byte word, which x86-64 and AArch64 load and store atomically; the copies around it are
separate calls into C, so neither compiler nor CPU (x86's total store order) moves them across.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from asteria_server.errors import AsteriaError, InvalidInputError

#: "ASTSHM01" as a little-endian u64: the first word of every segment.
MAGIC = int.from_bytes(b"ASTSHM01", "little")
#: Bytes before the first array: one page, so the arrays start page-aligned.
HEADER_BYTES = 4096
#: Every array starts at a multiple of this many bytes.
ARRAY_ALIGN = 64
#: The seals a segment must carry before the daemon maps it.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_MAGIC_AT, _SEQUENCE_AT, _CAPACITY_AT = 0, 1, 2  # u64 word indices in the header


class SharedMemoryUnavailableError(AsteriaError, OSError):
    """A segment could not be created or reserved here; the caller should use gRPC instead."""


@dataclass(frozen=True)
class ArraySpec:
    """One array in a segment: its dtype and shape."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class SegmentRef:
    """Where an announced snapshot or result lies: a segment of the session and its sequence."""

    segment_id: str
    sequence: int


def _aligned(offset: int) -> int:
    return -(-offset // ARRAY_ALIGN) * ARRAY_ALIGN


def payload_bytes(specs: Sequence[ArraySpec]) -> int:
    """Bytes the arrays ``specs`` take after the header, alignment included."""
    end = 0
    for spec in specs:
        end = _aligned(end) + spec.num_bytes
    return end


def segment_bytes(specs: Sequence[ArraySpec]) -> int:
    """The size of a segment that holds ``specs``, rounded up to whole pages."""
    size = HEADER_BYTES + payload_bytes(specs)
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


class Segment:
    """A mapped segment: its sequence word and views of its arrays.

    Create one with :func:`create_segment` (client) or :func:`map_segment` (daemon). Closing the
    descriptor or the mapping never frees the memory while the other side still maps it.
    """

    def __init__(self, buffer: mmap.mmap, size_bytes: int) -> None:
        self._mmap = buffer
        self.size_bytes = size_bytes
        self._words = np.frombuffer(buffer, dtype="<u8", count=3)

    @property
    def capacity_bytes(self) -> int:
        return int(self._words[_CAPACITY_AT])

    @property
    def sequence(self) -> int:
        return int(self._words[_SEQUENCE_AT])

    def views(self, specs: Sequence[ArraySpec]) -> list[np.ndarray]:
        """Writable NumPy views of the arrays ``specs`` (they must fit the capacity)."""
        needed = payload_bytes(specs)
        if needed > self.capacity_bytes:
            raise InvalidInputError(
                f"the arrays need {needed} bytes but the shared-memory segment holds "
                f"{self.capacity_bytes}; the client must hand over a larger segment"
            )
        out, offset = [], HEADER_BYTES
        for spec in specs:
            offset = HEADER_BYTES + _aligned(offset - HEADER_BYTES)
            count = spec.num_bytes // spec.dtype.itemsize
            view = np.frombuffer(self._mmap, dtype=spec.dtype, count=count, offset=offset)
            out.append(view.reshape(spec.shape))
            offset += spec.num_bytes
        return out

    # ------------------------------------------------------------------ the seqlock
    def begin_write(self) -> None:
        """Make the sequence odd: readers that overlap this write will reject what they copied."""
        sequence = self.sequence
        self._words[_SEQUENCE_AT] = sequence + 1 if sequence % 2 == 0 else sequence + 2

    def end_write(self) -> int:
        """Make the sequence even again; returns the value that announces this write."""
        sequence = self.sequence
        self._words[_SEQUENCE_AT] = sequence + 1 if sequence % 2 else sequence + 2
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
        if sequence % 2 or self.sequence != sequence:
            return None
        copies = [view.copy() for view in self.views(specs)]
        if self.sequence != sequence:
            return None
        return copies

    def close(self) -> None:
        """Drop this side's mapping once no view of it is left (NumPy views keep it alive)."""
        del self._words
        with contextlib.suppress(BufferError):  # a view still uses it: it goes with the last one
            self._mmap.close()


def create_segment(size_bytes: int, *, name: str = "asteria") -> tuple[int, Segment]:
    """A new sealed, reserved, pre-faulted segment of ``size_bytes`` (whole pages) and its fd.

    Raises :class:`SharedMemoryUnavailableError` with the reason when this host cannot provide
    it (no memfd, out of memory, a file-size limit, ...): the caller should fall back to gRPC.
    """
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
    segment = Segment(buffer, size_bytes)
    segment._words[_CAPACITY_AT] = size_bytes - HEADER_BYTES
    segment._words[_MAGIC_AT] = MAGIC
    return fd, segment


def map_segment(fd: int, size_bytes: int) -> Segment:
    """Map a segment received from a client, after checking it cannot be resized under us.

    Raises InvalidInputError (the client's fault) when the descriptor is not a sealed memfd of
    ``size_bytes`` bytes holding a segment. Does not close ``fd``.
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
    segment = Segment(mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED), size_bytes)
    if int(segment._words[_MAGIC_AT]) != MAGIC or segment.capacity_bytes != (
        size_bytes - HEADER_BYTES
    ):
        segment.close()
        raise InvalidInputError("the handed-over segment does not hold an Asteria segment header")
    return segment
