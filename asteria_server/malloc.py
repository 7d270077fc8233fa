"""glibc's malloc, set per process: the daemon's and the solver processes' settings differ.

A leaf (it imports nothing of the project), so the daemon (``service.allocator``), the solver
workers (``engine.worker_process``) and the throughput benchmark's bare LAPACK processes share
it. Everything here is a no-op returning False where the C library is not glibc.

**Solver processes** allocate and free several n x n float64 arrays per solve (the snapshot's
working copy, the symmetrized factor, LAPACK's input and workspace, the eigenvectors). Left
alone, glibc maps each array of more than its (dynamic) threshold on its own and unmaps it when
freed, or trims the heap top when a solve's arrays go, so the next solve faults every page of
them in again and the kernel zeroes them: at n = 256 that cost about as much CPU as a fifth of
the eigendecomposition itself. :func:`tune_solver_allocator` keeps arrays up to 32 MiB (n = 2048
in float64 is mapped on its own) on the heap and keeps up to :data:`SOLVER_TRIM_THRESHOLD_BYTES`
of freed heap while solves follow each other; a worker calls :func:`trim` once it has been idle
for a moment, so a quiet worker does not keep a big block's memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

#: mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

#: glibc's largest mmap threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``).
SOLVER_MMAP_THRESHOLD_BYTES = 32 << 20
#: Freed heap a busy solver process keeps for its next solve.
SOLVER_TRIM_THRESHOLD_BYTES = 512 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def trim() -> bool:
    """Hand the free pages of every malloc arena back to the system (glibc ``malloc_trim``)."""
    function = getattr(_libc(), "malloc_trim", None)
    if function is None:
        return False
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return bool(function(0))


def mallopt(settings: dict[int, int]) -> bool:
    """Apply ``{parameter: value}`` with glibc's ``mallopt``; False when one was refused (or
    there is no glibc). Call before threads start."""
    function = getattr(_libc(), "mallopt", None)
    if function is None:
        return False
    function.argtypes = [ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    return all(function(param, value) == 1 for param, value in settings.items())


def tune_solver_allocator() -> bool:
    """The solver processes' settings (see the module docstring)."""
    return mallopt(
        {
            M_MMAP_THRESHOLD: SOLVER_MMAP_THRESHOLD_BYTES,
            M_TRIM_THRESHOLD: SOLVER_TRIM_THRESHOLD_BYTES,
        }
    )
