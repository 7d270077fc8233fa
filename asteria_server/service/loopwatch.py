"""Notice when the daemon's event loop is blocked, and say where.

Every RPC of the daemon, health checks included, is answered on one asyncio event loop. Work
that blocks that loop (a lock held by another thread, disk I/O, a long copy) stops the whole
daemon for every tenant at once, and health cannot say so: its answer waits on the same loop.
So a thread beside the loop watches a heartbeat the loop writes every ``tick_s``; when the
loop has missed it for ``warn_after_s`` the thread logs one warning with the loop thread's
stack at that moment (what it is stuck in), and the stall's length once it ends. Operators get
``asteria_event_loop_stalls_total`` and ``asteria_event_loop_stall_seconds_max`` from the
metrics endpoint.

A loop blocked for ``DEGRADE_AFTER_S`` or more answered nobody for that long; such stalls come
in runs (an overloaded host, a tenant's flood), so after one the daemon's health says
NOT_SERVING until the loop has kept its heartbeat for ``RECOVER_AFTER_S`` (``on_health``):
a supervisor or load balancer then sees a daemon that cannot answer in time as not ready,
instead of a SERVING that the next call belies.

The decision is :class:`StallTally`, a plain object; :class:`LoopWatch` is its thread and the
loop's heartbeat task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

#: Seconds between two heartbeats of the loop (and two looks of the watching thread).
TICK_S = 0.1
#: A loop that missed its heartbeat this long is reported as blocked.
WARN_AFTER_S = 1.0
#: Frames of the loop thread's stack shown in the warning (innermost last).
STACK_FRAMES = 8
#: A stall this long turns health NOT_SERVING ...
DEGRADE_AFTER_S = 3.0
#: ... until the loop has kept its heartbeat this long.
RECOVER_AFTER_S = 15.0


class StallTally:
    """Stalls of a loop, from the times its heartbeats were seen (see the module)."""

    def __init__(self, warn_after_s: float = WARN_AFTER_S) -> None:
        self.warn_after_s = warn_after_s
        self.stalls = 0
        self.longest_s = 0.0
        self._in_stall = False
        self._stall_since = 0.0

    def look(self, now: float, last_beat: float, tick_s: float) -> str | None:
        """One look of the watcher. ``"began"`` when a stall has just been noticed, ``"ended"``
        when the one noticed before is over (the loop beat again), else None."""
        late = now - last_beat - tick_s
        if not self._in_stall and late >= self.warn_after_s:
            self._in_stall = True
            self._stall_since = last_beat + tick_s
            self.stalls += 1
            return "began"
        if self._in_stall and late < self.warn_after_s:
            self._in_stall = False
            self.longest_s = max(self.longest_s, last_beat - self._stall_since)
            return "ended"
        if self._in_stall:
            self.longest_s = max(self.longest_s, now - self._stall_since)
        return None

    @property
    def stall_since(self) -> float:
        return self._stall_since


class LoopWatch:
    """Watches the running loop from a thread of its own (start in the loop, stop at the end)."""

    def __init__(
        self,
        *,
        tick_s: float = TICK_S,
        warn_after_s: float = WARN_AFTER_S,
        on_health: Callable[[bool], Awaitable[None]] | None = None,
        degrade_after_s: float = DEGRADE_AFTER_S,
        recover_after_s: float = RECOVER_AFTER_S,
    ) -> None:
        self.tick_s = tick_s
        self.tally = StallTally(warn_after_s)
        self.degrade_after_s = degrade_after_s
        self.recover_after_s = recover_after_s
        self.degraded = False
        #: told False when a stall turns health NOT_SERVING, True when it may serve again
        self.on_health = on_health
        self._last_beat = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="asteria-loop-watch", daemon=True)
        self._beat: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Begin (called on the loop's thread, inside the running loop)."""
        self._loop_thread = threading.get_ident()
        self._last_beat = time.monotonic()
        self._beat = asyncio.ensure_future(self._heartbeat())
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
        await asyncio.to_thread(self._thread.join, 2.0)

    async def _heartbeat(self) -> None:
        last_stall = -math.inf
        while True:
            now = time.monotonic()
            if now - self._last_beat - self.tick_s >= self.degrade_after_s:
                last_stall = now
                if not self.degraded:
                    self.degraded = True
                    logger.error(
                        "the event loop was blocked for %.1f s: health NOT_SERVING until it "
                        "keeps time for %g s (the host is overloaded, or the log's stall "
                        "warning names what blocked it)",
                        now - self._last_beat - self.tick_s,
                        self.recover_after_s,
                    )
                    if self.on_health is not None:
                        await self.on_health(False)
            elif self.degraded and now - last_stall >= self.recover_after_s:
                self.degraded = False
                logger.warning(
                    "the event loop kept time for %g s: health SERVING", self.recover_after_s
                )
                if self.on_health is not None:
                    await self.on_health(True)
            self._last_beat = time.monotonic()
            await asyncio.sleep(self.tick_s)

    def _watch(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            change = self.tally.look(now, self._last_beat, self.tick_s)
            if change == "began":
                logger.warning(
                    "the event loop has been blocked for %.1f s: no RPC (health included) is "
                    "answered meanwhile; it is in:\n%s",
                    now - self.tally.stall_since,
                    self._loop_stack(),
                )
            elif change == "ended":
                logger.warning(
                    "the event loop ran again after %.1f s blocked",
                    self._last_beat - self.tally.stall_since,
                )

    def _loop_stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "  (the loop's thread is gone)"
        return "".join(traceback.format_stack(frame)[-STACK_FRAMES:]).rstrip()
