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
import gc
import logging

from asteria_server.malloc import M_ARENA_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, mallopt, trim

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 256 << 10
RECLAIM_INTERVAL_S = 30.0
TRIM_THRESHOLD_BYTES = 1 << 20
ARENA_MAX = 2

__all__ = ["reclaim", "reclaim_periodically", "trim", "tune_allocator"]


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
    ok = mallopt(
        {
            M_MMAP_THRESHOLD: MMAP_THRESHOLD_BYTES,
            M_TRIM_THRESHOLD: TRIM_THRESHOLD_BYTES,
            M_ARENA_MAX: ARENA_MAX,
        }
    )
    if not ok:
        logger.warning("could not tune the C allocator (mallopt refused a setting)")
    return ok
