"""Shared-memory segments between the engine and its worker processes, with explicit ownership.

**Ownership.** The engine process (the *owner*) creates every segment, reserves its space, and is
the only one that ever unlinks it: in :meth:`OwnedSegment.destroy`, when a segment is replaced by
a larger one, and when the pool closes. Workers only *map* segments by name
(:func:`attach_segment`) and close their mapping; they never unlink.

**The CPython resource-tracker trap.** Before Python 3.13, merely attaching to a segment with
``SharedMemory(name)`` registers it with the resource tracker, which unlinks every registered name
when it shuts down. Worker processes started with ``spawn``/``forkserver`` share the owner's
tracker, whose registry is a *set*: the worker's registration is a duplicate of the owner's and is
removed by the owner's unlink, so it is harmless. What would be harmful is the usual workaround
of unregistering in the worker: that would erase the *owner's* entry from the shared set (the
owner's crash would then leak the segment, and its unlink would make the tracker complain).
So on 3.11/3.12 workers attach and deliberately do not unregister; on 3.13+ they attach with
``track=False``. If the owner dies without closing, the tracker unlinks its segments.

**Space.** ``/dev/shm`` is a tmpfs that may be small (containers default to 64 MB). Writing to a
segment with no room behind it kills the writer with SIGBUS, so the owner reserves the space with
``posix_fallocate`` at creation and fails with a clear error instead.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import sys
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from asteria_server.errors import EngineUnavailableError

#: Segment names start with this, followed by the owner's pid, so leaks are attributable.
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


def _reserve(shm: shared_memory.SharedMemory, size: int) -> None:
    fd = getattr(shm, "_fd", -1)
    if fd < 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # the filesystem cannot reserve; proceed without the guarantee
        raise


class OwnedSegment:
    """A segment this process created and will unlink. Not thread-safe."""

    def __init__(self, size: int, *, prefix: str = SEGMENT_PREFIX) -> None:
        if size < 1:
            raise ValueError(f"OwnedSegment size must be >= 1 byte, got {size}")
        name = f"{prefix}{os.getpid()}_{secrets.token_hex(5)}"
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name=name, create=True, size=size
        )
        try:
            _reserve(self._shm, size)
        except OSError as exc:
            self.destroy()
            raise EngineUnavailableError(
                f"cannot reserve {size / 2**20:.1f} MiB of shared memory for a solver worker "
                f"({exc.strerror}); free space in /dev/shm or enlarge it (docker: --shm-size, "
                "Kubernetes: an emptyDir with medium Memory)"
            ) from exc
        self.name = self._shm.name
        self.size = size

    @property
    def alive(self) -> bool:
        return self._shm is not None

    def view(self, shape: tuple[int, ...], dtype: Any, offset: int = 0) -> np.ndarray:
        """A NumPy view into the segment (drop it before :meth:`destroy`)."""
        if self._shm is None:
            raise EngineUnavailableError(f"shared memory segment {self.name} was destroyed")
        return np.ndarray(shape, dtype=dtype, buffer=self._shm.buf, offset=offset)

    def destroy(self) -> None:
        """Unmap and unlink (idempotent)."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()  # first: the name must go even if a stray view keeps the mapping alive
        with contextlib.suppress(BufferError):  # a view still exists: unmapped when it dies
            shm.close()


def release_segment(shm: shared_memory.SharedMemory) -> None:
    """Unmap an attached segment (never unlink: the owner does). Tolerates live views."""
    with contextlib.suppress(BufferError):  # a view still exists: unmapped when it dies
        shm.close()


class MappedSegment:
    """An owner's segment mapped straight from ``/dev/shm`` (Linux), invisible to any resource
    tracker: what a worker started as a fresh interpreter uses, since it shares no tracker with
    the owner and ``SharedMemory(name)`` would start one of its own that unlinks at exit."""

    def __init__(self, name: str) -> None:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()  # BufferError while a NumPy view exists, as with SharedMemory
        self._mmap.close()


SHM_DIR = "/dev/shm"


def attach_segment(name: str, *, untracked: bool = False) -> Any:
    """Map an owner's segment in a worker. The caller closes it and never unlinks it.

    ``untracked``: the worker does not share the owner's resource tracker (a fresh interpreter);
    map the segment without registering it anywhere.
    """
    if untracked and os.path.isdir(SHM_DIR):
        return MappedSegment(name)
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg,unused-ignore]
    # 3.11/3.12: registers with the owner's (shared) tracker; deliberately NOT unregistered, see
    # the module docstring.
    return shared_memory.SharedMemory(name=name)


def segment_view(
    shm: shared_memory.SharedMemory, shape: tuple[int, ...], dtype: Any, offset: int = 0
) -> np.ndarray:
    """A NumPy view into an attached segment."""
    return np.ndarray(shape, dtype=dtype, buffer=shm.buf, offset=offset)
