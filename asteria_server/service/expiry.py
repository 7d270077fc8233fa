"""When a finished job's blocks leave the daemon (``job_ttl_s``), decided apart from the timer.

A daemon keeps a job's blocks and results after its trainers end, so that a restarted trainer
warm-starts; a job that is done for good would otherwise hold them for the daemon's life (the
tenant's block quota and memory with them). :class:`JobExpiry` remembers when each job's last
session here ended and says which jobs are due: those with no session for ``ttl_s``. A job whose
session opens again is no longer idle. The servicer owns the one timer (armed for
:meth:`JobExpiry.next_due`) and forgets the due jobs' blocks; ``asteria forget`` and a Slurm
epilog do it at once instead.
"""

from __future__ import annotations

from collections import OrderedDict

#: (tenant, job)
JobKey = tuple[str, str]


class JobExpiry:
    """Idle jobs in the order their last session ended (one clock, the caller's)."""

    def __init__(self, ttl_s: float) -> None:
        #: 0: jobs never expire
        self.ttl_s = ttl_s
        self._idle: OrderedDict[JobKey, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._idle)

    def idle(self, key: JobKey, now: float) -> None:
        """The job's last session here ended at ``now``."""
        if self.ttl_s <= 0:
            return
        self._idle.pop(key, None)
        self._idle[key] = now

    def active(self, key: JobKey) -> None:
        """A session of the job opened: it is not idle any more."""
        self._idle.pop(key, None)

    def next_due(self) -> float | None:
        """When the earliest idle job falls due (None: none is idle, or expiry is off)."""
        if self.ttl_s <= 0 or not self._idle:
            return None
        return next(iter(self._idle.values())) + self.ttl_s

    def due(self, now: float) -> list[JobKey]:
        """The jobs idle for ``ttl_s`` by ``now``, removed from the idle set (all of them are
        dropped, none due, when expiry was turned off meanwhile)."""
        if self.ttl_s <= 0:
            self._idle.clear()
            return []
        found = []
        while self._idle:
            key, ended_at = next(iter(self._idle.items()))
            if now - ended_at < self.ttl_s:
                break
            del self._idle[key]
            found.append(key)
        return found
