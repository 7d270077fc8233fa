"""The daemon's C allocator settings: memory it frees goes back to the system.

glibc's malloc, left alone, keeps what a long-lived multi-threaded server frees: each thread that
allocates may get an arena of its own (up to 8 per core), and its mmap threshold *rises* to the
size of any large block freed, so that later megabyte-sized buffers (1 MiB stream chunks, a
received snapshot) come from those arenas, whose memory is rarely handed back. A soak run showed
the daemon's RSS stay ~3x above its resting size after one tenant's burst of large snapshots
had long been freed. So, before any thread starts, the daemon pins the threshold (buffers of
256 KiB and more are mapped on their own and unmapped when freed), trims free heap top memory
above 1 MiB, and uses at most two arenas. Nothing changes where the C library is not glibc.

While it serves, every ``RECLAIM_INTERVAL_S`` it also runs Python's cyclic garbage collector and
then ``malloc_trim`` (:func:`reclaim_periodically`; a few milliseconds). The soak found why: a
call that fails leaves an exception whose traceback holds the failed handler's frame, and with
it whatever that frame held (a 32 MiB snapshot being received, a result's serialized frames),
in a reference cycle that only the cyclic collector frees; a daemon that allocates few Python
containers runs that collector rarely, so after one tenant's burst of failed uploads hundreds of
megabytes of garbage stayed resident for as long as the daemon stayed quiet.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging

logger = logging.getLogger(__name__)

#: mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 256 << 10
RECLAIM_INTERVAL_S = 30.0
TRIM_THRESHOLD_BYTES = 1 << 20
ARENA_MAX = 2


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
    libc = _libc()
    function = getattr(libc, "malloc_trim", None)
    if function is None:
        return False
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return bool(function(0))


def reclaim() -> int:
    """Collect cyclic garbage, then :func:`trim`; returns the objects collected."""
    collected = gc.collect()
    trim()
    return collected


async def reclaim_periodically(interval_s: float = RECLAIM_INTERVAL_S) -> None:
    """:func:`reclaim` every ``interval_s`` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(reclaim)


def tune_allocator() -> bool:
    """Apply the settings above (call before threads start); False where it cannot."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
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
