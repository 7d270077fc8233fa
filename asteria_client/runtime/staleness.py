"""The staleness budget: how far a block's result may lag behind what native mode would use.

Every ``f`` steps a block's factor is snapshotted (version = step). Native mode installs the
result of snapshot v at step v. With a budget of S refresh intervals, the result in use may lag
the newest snapshot by at most S*f steps: the optimizer may use a result of version
``>= newest_snapshot - S * f``. S = 0 is synchronous and equals native mode.

The staleness of a block at step t (DESIGN.md) is ``t - version in use``; under a budget S it
never exceeds ``(S + 1) * f - 1`` (``f - 1`` of which native mode has as well). The *lag*,
``newest_snapshot - version in use``, is what the budget bounds: ``lag <= S * f``.

When a block would exceed its budget, the optimizer waits (a bounded *barrier*) for the result
in flight; if that times out or nothing useful is in flight, it computes the block locally
(native path) and warns once. These counters make the cost of freshness visible.

On the **continuous** schedule (:class:`Refresh`) there is no interval: a block is snapshotted
when a solver worker is free to take it, and S counts steps. A snapshot taken at the end of step
v may be in flight while steps v+1 .. v+S run; step v+S+1 must use it (or a newer result). The
*lag* at a step t is then ``t - v`` while snapshot v is in flight (0 once it is installed), and
the budget bounds it the same way: ``lag <= S``. With one snapshot a step this is exactly the
amortized rule at f = 1. A *floor* snapshot of the continuous schedule (one the amortized
schedule would have taken, see :mod:`.refresh`) follows the amortized rule instead (the callers
say so with ``floor=True`` and ``frequency`` = f): the result in use may lag it by S*f steps,
so it may be in flight S*f steps while no newer floor snapshot is taken, and a block whose
results do not come is waited for, as on the amortized schedule, however often it is
snapshotted again (a rule by time alone would restart its clock at each new snapshot).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

#: The continuous schedule's default ``refresh_overhead``: 4% of the step time.
DEFAULT_REFRESH_OVERHEAD = 0.04


class Freshness(enum.Enum):
    """A block's staleness as a value (never an exception)."""

    FRESH = "fresh"  # the newest snapshot's result is in use
    STALE = "stale"  # an older result is in use, within or beyond the budget
    MISSING = "missing"  # no result yet


class Refresh(enum.Enum):
    """When a block's factor is snapshotted for a new root or basis."""

    AMORTIZED = "amortized"  # every ``precondition_frequency`` steps, every block
    CONTINUOUS = "continuous"  # whenever a solver worker is free, the block that needs it most


@dataclass(frozen=True, kw_only=True)
class StalenessPolicy:
    """``budget_intervals`` = S (refresh intervals; steps on the continuous schedule);
    ``barrier_timeout_s`` bounds each wait before local fallback; ``refresh_overhead``
    (continuous schedule): the share of the step time the training thread may spend taking
    snapshots and installing results (see :mod:`.refresh`)."""

    budget_intervals: int = 1
    barrier_timeout_s: float = 30.0
    refresh: Refresh = Refresh.AMORTIZED
    refresh_overhead: float = DEFAULT_REFRESH_OVERHEAD

    def __post_init__(self) -> None:
        if not isinstance(self.budget_intervals, int) or self.budget_intervals < 0:
            raise ValueError(
                f"staleness_budget must be an int >= 0 (refresh intervals), "
                f"got {self.budget_intervals!r}"
            )
        if not self.barrier_timeout_s > 0:
            raise ValueError(f"barrier_timeout_s must be > 0, got {self.barrier_timeout_s!r}")
        if not isinstance(self.refresh, Refresh):
            raise ValueError(f"refresh must be a Refresh, got {self.refresh!r}")
        if (
            isinstance(self.refresh_overhead, bool)
            or not isinstance(self.refresh_overhead, int | float)
            or not 0.0 < self.refresh_overhead <= 1.0
        ):
            raise ValueError(
                f"refresh_overhead must be a share of the step time in (0, 1], "
                f"got {self.refresh_overhead!r}"
            )

    @property
    def continuous(self) -> bool:
        return self.refresh is Refresh.CONTINUOUS

    def required_version(
        self,
        newest_snapshot: int,
        frequency: int,
        needs_first: bool,
        *,
        step: int = 0,
        floor: bool = False,
    ) -> int:
        """The oldest version the optimizer may use at ``step``; below 0 means "none is fine
        too".

        ``needs_first``: the block cannot be used without some result (a SOAP or KL-Shampoo
        basis), so at least version 0 is required even inside the budget. On the continuous
        schedule the newest snapshot is required once it has been in flight for more than S
        steps (``step`` is then needed), else nothing newer than what is in use; unless it is
        a ``floor`` snapshot, which follows the amortized rule (``frequency`` = f).
        """
        if newest_snapshot < 0:
            return -1
        if self.continuous and not floor:
            late = step - newest_snapshot > self.budget_intervals * frequency
            required = newest_snapshot if late else -1
        else:
            required = newest_snapshot - self.budget_intervals * frequency
        return max(required, 0) if needs_first else required

    def lag_steps(self, newest_snapshot: int, installed: int, step: int) -> int:
        """The lag a block is used with at ``step``: what ``budget_steps`` bounds."""
        if newest_snapshot <= installed:
            return 0
        if self.continuous:
            return max(0, step - newest_snapshot)
        return newest_snapshot - installed

    def budget_steps(self, frequency: int) -> int:
        """The largest lag the budget allows, in steps: S * ``frequency`` (on the continuous
        schedule ``frequency`` is 1 but for a floor snapshot)."""
        return self.budget_intervals * frequency


def freshness(installed: int, newest_snapshot: int) -> Freshness:
    if installed < 0:
        return Freshness.MISSING
    return Freshness.FRESH if installed >= newest_snapshot else Freshness.STALE


@dataclass
class BarrierStats:
    """Counters of the freshness machinery, reported by ``preconditioner_status()``."""

    waits: int = 0
    wait_s: float = 0.0
    max_wait_s: float = 0.0
    timeouts: int = 0
    local_fallbacks: int = 0
    #: of ``local_fallbacks``: while the source refused its daemon (an untrusted uid)
    local_fallbacks_daemon_refused: int = 0
    submit_errors: int = 0
    max_lag_steps: int = 0
    lag_histogram: dict[int, int] = field(default_factory=dict)

    def record_wait(self, seconds: float, satisfied: bool) -> None:
        self.waits += 1
        self.wait_s += seconds
        self.max_wait_s = max(self.max_wait_s, seconds)
        if not satisfied:
            self.timeouts += 1

    def record_lag(self, lag_steps: int) -> None:
        self.max_lag_steps = max(self.max_lag_steps, lag_steps)
        self.lag_histogram[lag_steps] = self.lag_histogram.get(lag_steps, 0) + 1
