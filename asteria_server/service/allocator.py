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
then ``malloc_trim`` (:class:`Reclaimer`, :func:`reclaim_periodically`). The soak found why: a
call that fails leaves an exception whose traceback holds the failed handler's frame, and with
it whatever that frame held (a 32 MiB snapshot being received, a result's serialized frames),
in a reference cycle that only the cyclic collector frees; a daemon that allocates few Python
containers runs that collector rarely, so after one tenant's burst of failed uploads hundreds of
megabytes of garbage stayed resident for as long as the daemon stayed quiet.

A *full* collection, though, walks every object the daemon holds, with the GIL held all along:
a few milliseconds for a small daemon, but hundreds of them for one that holds 160,000 blocks
(eight clients of a 7B model's inventory: the scheduler's queue of them alone is 670,000
objects, a full collection 320-380 ms here), and every RPC waits that long (a Status call took
0.58 s where its median was 55 ms, issue 27). So each round collects the young generations
only (what was allocated since the last rounds: cheap whatever the daemon holds), and the full
collection runs when the anonymous memory grew by :data:`FULL_COLLECT_GROWTH_BYTES` since the
last one — the case the soak found, where garbage in old cycles holds real memory — or when it
has not run for :data:`FULL_COLLECT_MAX_INTERVAL_S`.

CPython also runs full collections by itself, whenever the objects promoted into the oldest
generation since the last one reach a quarter of those it holds: when 8 clients register
160,000 blocks that happened every few seconds, 0.4-1.1 s each (collecting 0-5 objects), in
whichever thread allocated — the loop's, or a thread holding the handover's or the engine's
lock that the loop then waited for — and the loop watch logged stalls of 1-5 s (issue 27).
While :func:`reclaim_periodically` runs, full collections are the reclaimer's alone: the
collector's threshold for the oldest generation is set out of reach, and the young
generations are collected automatically as before.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

from asteria_server.malloc import M_ARENA_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, mallopt, trim

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 256 << 10
RECLAIM_INTERVAL_S = 30.0
TRIM_THRESHOLD_BYTES = 1 << 20
ARENA_MAX = 2

#: Anonymous memory grown since the last full collection that makes the next round a full one.
FULL_COLLECT_GROWTH_BYTES = 64 << 20
#: The longest a daemon goes without a full collection.
FULL_COLLECT_MAX_INTERVAL_S = 3600.0
#: The oldest generation's collection threshold while the reclaimer runs: never reached.
NO_AUTOMATIC_FULL_COLLECTION = 1 << 30

__all__ = ["Reclaimer", "reclaim_periodically", "trim", "tune_allocator"]


def anon_rss_bytes() -> int | None:
    """This process's anonymous resident memory (``RssAnon``: not the clients' shared-memory
    segments it maps), None where /proc does not say."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Reclaimer:
    """One reclaim round per call (see the module doc): the young generations always, every
    generation when memory grew by ``growth_bytes`` since the last full collection (or /proc
    cannot say), or ``max_interval_s`` passed; then :func:`trim`. The first round is full."""

    def __init__(
        self,
        growth_bytes: int = FULL_COLLECT_GROWTH_BYTES,
        max_interval_s: float = FULL_COLLECT_MAX_INTERVAL_S,
        memory: Callable[[], int | None] = anon_rss_bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.growth_bytes = growth_bytes
        self.max_interval_s = max_interval_s
        self._memory, self._clock = memory, clock
        self._full_at: float | None = None
        self._full_memory: int | None = None
        self.full_rounds = 0
        self.young_rounds = 0

    def __call__(self) -> int:
        """Collect, then trim; returns the objects collected."""
        memory = self._memory()
        full = (
            self._full_at is None
            or memory is None
            or self._full_memory is None
            or memory - self._full_memory >= self.growth_bytes
            or self._clock() - self._full_at >= self.max_interval_s
        )
        if full:
            collected = gc.collect()
            self.full_rounds += 1
        else:
            collected = gc.collect(1)
            self.young_rounds += 1
        trim()
        if full:
            self._full_at, self._full_memory = self._clock(), self._memory()
        return collected


async def reclaim_periodically(
    interval_s: float = RECLAIM_INTERVAL_S, reclaimer: Reclaimer | None = None
) -> None:
    """A :class:`Reclaimer` round every ``interval_s`` until cancelled; meanwhile CPython
    collects the oldest generation only when a round does (the module doc says why)."""
    rounds = Reclaimer() if reclaimer is None else reclaimer
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], NO_AUTOMATIC_FULL_COLLECTION)
    try:
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(rounds)
    finally:
        gc.set_threshold(*thresholds)


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
