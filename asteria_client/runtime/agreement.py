"""Replicas agree on the step at which each result goes into use (DESIGN.md, "Replicas agree").

Data-parallel replicas hold the same factors and receive the same results (one owner solves a
block, every replica gets its result), but not at the same moment: the exchange or the daemon
hands a result to each rank in its own time, and a rank that installs it "in the step it
arrives" may install it one step before its peer. From then on the two replicas' parameters
differ, and nothing brings them back (DDP never re-synchronizes parameters).

So a replicated block's result is never installed where it arrives. It is *held* (the runtime
takes it from the source and keeps it), and installs are decided by the replicas together, at
two points that every replica reaches in the same order because their steps are the same:

- **at each step's start** (:meth:`InstallAgreement.agree`): one small collective (an all-reduce
  MIN over the held versions of every block with a newer snapshot pending, and over their
  negatives) says which version every replica holds; those are installed now, on every
  replica, in the tiles' order. One collective per step, and none in a step with nothing
  pending;
- **at a block's staleness deadline** (:meth:`InstallAgreement.agree_forced`, from the barrier):
  every replica waits for a result new enough, and the collective says whether all of them got
  the same one; if any could not (a timeout, a lost owner), every replica computes the block
  locally from its (identical) factor: the same fallback on every replica at the same step.

Whether a block is pending, its version in use and its deadline follow from what was installed
before, so they are equal on every replica by induction, and so is the sequence of collectives.
A failed collective (a lost peer) ends the agreement with one warning: each rank installs on
arrival from then on (drift is better than a stopped run).

The freshness it costs is the step between a result's arrival at the first replica and the next
step start after the last replica has it: :attr:`InstallAgreement.delays` counts, per installed
result, how many steps it was held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from asteria_client.runtime.source import PreconditionerResult

logger = logging.getLogger(__name__)


class Collective(Protocol):
    """What the agreement needs of the replicas' group: an element-wise MIN all-reduce."""

    def all_min(self, values: Sequence[int]) -> list[int]: ...


class InstallAgreement:
    """The held results of replicated blocks and the collectives that release them (module
    docstring). ``shared(block)``: whether the block has replicas on other ranks of the group."""

    def __init__(self, collective: Collective, shared: Callable[[str], bool]) -> None:
        self._collective = collective
        self._shared = shared
        #: block -> (newest result taken from the source and not installed, step it was taken)
        self._held: dict[str, tuple[PreconditionerResult, int]] = {}
        self.failed = ""  # why the agreement stopped ("" while it holds)
        self.rounds = 0  # collectives at step starts
        self.forced_rounds = 0  # collectives at deadlines
        self.agreed_fallbacks = 0  # blocks every replica computed locally together
        #: steps a result was held before it went into use -> how many results
        self.delays: dict[int, int] = {}

    def covers(self, block: str) -> bool:
        """Whether ``block``'s installs are agreed (replicated, and the agreement holds)."""
        return not self.failed and self._shared(block)

    # ------------------------------------------------------------------ held results
    def hold(self, result: PreconditionerResult | None, step: int) -> None:
        """Keep ``result`` (taken from the source at ``step``) if newer than the one held."""
        if result is None:
            return
        held = self._held.get(result.block)
        if held is None or result.version > held[0].version:
            self._held[result.block] = (result, step)

    def held_version(self, block: str) -> int:
        held = self._held.get(block)
        return -1 if held is None else held[0].version

    def release(self, block: str, step: int) -> PreconditionerResult:
        """The held result of ``block``, to install at ``step``."""
        result, since = self._held.pop(block)
        delay = max(0, step - since)
        self.delays[delay] = self.delays.get(delay, 0) + 1
        return result

    def drop_older(self, block: str, version: int) -> None:
        """Forget a held result of ``block`` not newer than ``version`` (the one in use)."""
        held = self._held.get(block)
        if held is not None and held[0].version <= version:
            del self._held[block]

    # ------------------------------------------------------------------ collectives
    def _min(self, values: list[int]) -> list[int] | None:
        try:
            return self._collective.all_min(values)
        except Exception as exc:  # a lost peer: drift is better than a stopped run
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "replicas could not agree on install steps (%s); each rank installs results "
                "as they arrive from now on, so data-parallel replicas may drift apart",
                self.failed,
            )
            return None

    def agree(self, versions: list[int]) -> list[int]:
        """Collective (every replica, the same blocks in the same order): per block, the
        version every replica holds, or -1 where they differ. When the agreement fails, each
        replica's own ``versions``."""
        self.rounds += 1
        reduced = self._min(versions + [-v for v in versions])
        if reduced is None:
            return versions
        count = len(versions)
        lows, negated_highs = reduced[:count], reduced[count:]
        return [lo if lo == -neg else -1 for lo, neg in zip(lows, negated_highs, strict=True)]

    def agree_forced(self, have: int, missing: bool) -> tuple[int, int, bool] | None:
        """Collective at a block's deadline: the lowest and highest version held by the
        replicas and whether any could not get one in time (None: the agreement failed)."""
        self.forced_rounds += 1
        reduced = self._min([have, -have, -int(missing)])
        if reduced is None:
            return None
        return reduced[0], -reduced[1], reduced[2] < 0

    def stats(self) -> dict[str, object]:
        return {
            "agreement_failed": self.failed,
            "agreement_rounds": self.rounds,
            "agreement_forced_rounds": self.forced_rounds,
            "agreement_fallbacks": self.agreed_fallbacks,
            "agreement_held_steps": dict(sorted(self.delays.items())),
        }
