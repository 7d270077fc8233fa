"""The descriptors the daemon holds, as the process holds them, and health that says so.

The segment handover counts its own descriptors (two per segment: the one it keeps and the
one ``mmap`` duplicates), but gRPC connections, the metrics endpoint's and the workers' pipes
are not the handover's to count, and any of them can fill the table: then the next worker
cannot be started and the daemon breaks. So the daemon also looks at the table itself
(``/proc/self/fd``) every ``DESCRIPTOR_CHECK_S``: when fewer than ``low_water`` descriptors are
left it turns health NOT_SERVING (load balancers and supervisors stop sending work) and says
so in one log line; SERVING again once twice that many are free. The decision is
:class:`DescriptorWatch`, a plain object; the loop around it is :func:`watch_descriptors`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

#: Seconds between two looks at the descriptor table.
DESCRIPTOR_CHECK_S = 0.5
#: Descriptors each handed-over segment costs: the one kept and the one ``mmap`` duplicates.
SEGMENT_FDS = 2


def open_descriptors() -> int | None:
    """Descriptors this process holds now (None: the table is too full to look)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir opened
    except OSError:
        return None


class DescriptorWatch:
    """Whether the daemon can serve, judged by its free descriptors (see the module)."""

    def __init__(self, limit: int, low_water: int | None = None) -> None:
        self.limit = limit
        self.low_water = low_water if low_water is not None else max(16, limit // 16)
        self.serving = True
        self.lowest_free = limit

    def update(self, used: int | None) -> bool | None:
        """Take a count (None: too full to count); the new serving state when it changed."""
        free = 0 if used is None else self.limit - used
        self.lowest_free = min(self.lowest_free, free)
        if self.serving and free < self.low_water:
            self.serving = False
            return False
        if not self.serving and free >= 2 * self.low_water:
            self.serving = True
            return True
        return None


async def watch_descriptors(
    watch: DescriptorWatch,
    set_serving: Callable[[bool], Awaitable[None]],
    *,
    every_s: float = DESCRIPTOR_CHECK_S,
) -> None:
    """Look at the table every ``every_s`` and tell ``set_serving`` each change (a task)."""
    while True:
        used = await asyncio.to_thread(open_descriptors)  # never on the loop serving calls
        change = watch.update(used)
        if change is False:
            logger.error(
                "only %d of %d descriptors are free (under %d): health NOT_SERVING until %d "
                "are free again; close connections or raise the limit (ulimit -n, LimitNOFILE=)",
                max(0, watch.limit - (used or watch.limit)),
                watch.limit,
                watch.low_water,
                2 * watch.low_water,
            )
            await set_serving(False)
        elif change is True:
            logger.warning("descriptors free again (%d in use): health SERVING", used)
            await set_serving(True)
        await asyncio.sleep(every_s)
