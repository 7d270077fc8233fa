"""The daemon's C allocator settings: memory it frees goes back to the system.

glibc's malloc, left alone, keeps what a long-lived multi-threaded server frees: each thread that
allocates may get an arena of its own (up to 8 per core), and its mmap threshold *rises* to the
size of any large block freed, so that later megabyte-sized buffers (1 MiB stream chunks, a
received snapshot) come from those arenas, whose memory is rarely handed back. A soak run showed
the daemon's RSS stay ~3x above its resting size after one tenant's burst of large snapshots
had long been freed. So, before any thread starts, the daemon pins the threshold (buffers of
256 KiB and more are mapped on their own and unmapped when freed), trims free heap top memory
above 1 MiB, and uses at most two arenas. Nothing changes where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

#: mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 256 << 10
TRIM_THRESHOLD_BYTES = 1 << 20
ARENA_MAX = 2


def tune_allocator() -> bool:
    """Apply the settings above (call before threads start); False where it cannot."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (_M_ARENA_MAX, ARENA_MAX),
        )
    )
    if not ok:
        logger.warning("could not tune the C allocator (mallopt refused a setting)")
    return ok
