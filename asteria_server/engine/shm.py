"""Memory segments between the engine and its solver worker processes: anonymous memfds.

**Why memfd, not named ``/dev/shm`` segments.** A named POSIX segment outlives a process that is
killed (SIGKILL, OOM) and must be unlinked by somebody; CPython's resource tracker does that for
the creator and prints "leaked shared_memory objects" warnings when a training process is
interrupted, and attaching from another interpreter registers the name a second time (the
tracker trap). A memfd has no name in any filesystem: it lives while a process holds its fd or a
mapping, so nothing is left behind by any kind of exit, nothing needs unlinking, and no tracker
is involved. It is also not limited by the size of ``/dev/shm`` (containers default to 64 MB);
it is charged to the process's memory like any allocation.

**Ownership.** The engine process (the *owner*) creates every segment and reserves its space;
the worker receives the fd over its pipe (``SCM_RIGHTS``, see :func:`send_segment_fds`), maps it
and closes the fd. Either side's mapping keeps the memory alive; it is freed when both are gone.

**Space.** Writing to a memfd page that cannot be backed kills the writer with SIGBUS, so the
owner reserves the space with ``posix_fallocate`` at creation and fails with a clear error
instead.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import multiprocessing.connection as mpc
import os
import secrets
from multiprocessing import reduction
from typing import Any

import numpy as np

from asteria_server.errors import EngineUnavailableError

#: Segment names (visible as ``/memfd:<name>`` in ``/proc/PID/fd``) start with this, then the
#: owner's pid, so a segment is attributable in diagnostics.
SEGMENT_PREFIX = "asteria_"


def input_capacity_bytes(n: int) -> int:
    """Bytes for any task of size n: an fp64 matrix and an fp64 basis."""
    return 2 * 8 * n * n


def output_capacity_bytes(n: int) -> int:
    """Bytes for any result of size n: fp32 matrix, fp32 eigenvalues, int64 permutation, fp32
    rotation."""
    return 4 * n * n + 4 * n + 8 * n + 4 * n * n


def eigenvalues_offset(n: int) -> int:
    """Byte offset of the fp32 eigenvalues in an output segment (after the fp32 n×n matrix)."""
    return 4 * n * n


def rotation_offset(n: int) -> int:
    """Byte offset of the fp32 n×n rotation in an output segment (after the permutation)."""
    return 4 * n * n + 4 * n + 8 * n


def permutation_offset(n: int) -> int:
    """Byte offset of the int64 permutation in an output segment (after the eigenvalues)."""
    return 4 * n * n + 4 * n


def _reserve(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # the kernel cannot reserve; proceed without the guarantee
        raise


class OwnedSegment:
    """A memfd segment this process created and maps. Not thread-safe."""

    def __init__(self, size: int, *, prefix: str = SEGMENT_PREFIX) -> None:
        if size < 1:
            raise ValueError(f"OwnedSegment size must be >= 1 byte, got {size}")
        self.name = f"{prefix}{os.getpid()}_{secrets.token_hex(5)}"
        self.size = size
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            _reserve(fd, size)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            raise EngineUnavailableError(
                f"cannot reserve {size / 2**20:.1f} MiB of memory for a solver worker "
                f"({exc.strerror}); free memory or lower the largest factor size "
                "(max_preconditioner_dim)"
            ) from exc
        self._fd = fd

    @property
    def alive(self) -> bool:
        return self._mmap is not None

    @property
    def fd(self) -> int:
        """The memfd, to hand to a worker (:func:`send_segment_fds`)."""
        if self._mmap is None:
            raise EngineUnavailableError(f"shared memory segment {self.name} was destroyed")
        return self._fd

    def view(self, shape: tuple[int, ...], dtype: Any, offset: int = 0) -> np.ndarray:
        """A NumPy view into the segment (drop it before :meth:`destroy`)."""
        if self._mmap is None:
            raise EngineUnavailableError(f"shared memory segment {self.name} was destroyed")
        return np.ndarray(shape, dtype=dtype, buffer=self._mmap, offset=offset)

    def destroy(self) -> None:
        """Close the fd and unmap (idempotent); the memory goes with the workers' mappings."""
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(BufferError):  # a view still exists: unmapped when it dies
            mapping.close()


def send_segment_fds(conn: mpc.Connection, fds: list[int]) -> None:
    """Pass segment fds to the worker at the other end of ``conn`` (a Unix socket pair).

    Sent right after the message that announces them; the worker reads that message, then
    :func:`receive_segment_fds`. ``Connection`` reads exactly the bytes of each message, so the
    one byte that carries the fds is never consumed by an ordinary ``recv``.
    """
    for fd in fds:
        reduction.send_handle(conn, fd, 0)  # the pid is unused on Linux


def receive_segment_fds(conn: mpc.Connection, count: int) -> list[int]:
    return [reduction.recv_handle(conn) for _ in range(count)]


class MappedSegment:
    """A worker's mapping of a segment received as an fd (the fd is closed once mapped)."""

    def __init__(self, name: str, fd: int) -> None:
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()  # BufferError while a NumPy view exists
        self._mmap.close()


def release_segment(shm: MappedSegment) -> None:
    """Unmap a worker's mapping. Tolerates live views."""
    with contextlib.suppress(BufferError):  # a view still exists: unmapped when it dies
        shm.close()


def segment_view(
    shm: MappedSegment, shape: tuple[int, ...], dtype: Any, offset: int = 0
) -> np.ndarray:
    """A NumPy view into a worker's mapping."""
    return np.ndarray(shape, dtype=dtype, buffer=shm.buf, offset=offset)
