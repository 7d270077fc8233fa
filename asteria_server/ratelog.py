"""Rate-limited log lines for refusals that can come in floods (guesses, a disk that is behind).

Shared by the service (refused authentications and calls) and the engine (results dropped
instead of spilled), which must not import the service.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable


class RefusalLog:
    """One log line per class of refused attempt (``"wrong job token"``, ...) and ``every_s``:
    the first refusal of a class is logged at once, later ones are counted and summed up in the
    next line, so a flood of guesses costs a few lines, never one per guess."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self.every_s = every_s
        self._clock = clock
        #: class -> (when last logged, refusals not logged since)
        self._classes: dict[str, tuple[float, int]] = {}

    def refused(self, what: str, detail: str) -> None:
        """One refusal of class ``what``; ``detail`` (never a token) names the latest one."""
        now = self._clock()
        logged_at, quiet = self._classes.get(what, (-math.inf, 0))
        if now - logged_at < self.every_s:
            self._classes[what] = (logged_at, quiet + 1)
            return
        more = f" (and {quiet} more since the last line)" if quiet else ""
        self._logger.warning("refused %s: %s%s", what, detail, more)
        self._classes[what] = (now, 0)
