"""Replicas agree on the step at which each result goes into use (DESIGN.md, "Replicas agree").

Data-parallel replicas hold the same factors and receive the same results (one owner solves a
block, every replica gets its result), but not at the same moment: the exchange or the daemon
hands a result to each rank in its own time, and a rank that installs it "in the step it
arrives" may install it one step before its peer. From then on the two replicas' parameters
differ, and nothing brings them back (DDP never re-synchronizes parameters).

So a replicated block's result is never installed where it arrives. It is *held* (the runtime
takes it from the source and keeps it, every version not yet in use), and installs are decided
by the replicas together, at points that every replica reaches in the same order because their
steps are the same:

- **rounds at step starts** (:meth:`InstallAgreement.start_round`): at each step's start a
  replica starts one small collective on gloo's threads (an all-reduce MIN over the newest
  held version of every block with a newer snapshot pending, and over their negatives), and
  finishes the round started one step before, which by then has long completed: every
  version that all replicas held goes into use now, on every replica, in the tiles' order. The
  training thread does not wait for the collective (a replica's peers start theirs in the same
  step), and a step with nothing pending starts none;
- **at a block's staleness deadline** (:meth:`InstallAgreement.agree_forced`, from the barrier):
  every replica waits for a result new enough, and a collective says whether all of them got
  the same one; if any could not (a timeout, a lost owner), every replica computes the block
  locally from its (identical) factor: the same fallback on every replica at the same step.

- **continuous pulls** (``refresh="continuous"``): the schedule's extra pulls follow each
  rank's own workers and hooks, so one replica alone chooses them for a block (its owner in
  the source, :meth:`PreconditionerSource.chooses`). It snapshots and hands the block over but
  does not register the version yet; the next step start's round carries, next to the held
  versions, a MAX over every reportable block's pull (the chooser's version, -1 elsewhere),
  and when it finishes every replica registers the pulled version as the block's newest
  snapshot, at the same step (the others expect its result from the source); the round also
  carries the versions each replica held of those blocks, so a result that every replica had
  by then goes into use at once. Floor pulls
  follow from the registered snapshots, so they are taken alike everywhere. An extra pull
  taken after step t is registered at the start of step t + 2.

Whether a block is pending, its version in use and its deadline follow from what was installed
and registered before, so they are equal on every replica by induction, and so is the sequence
of collectives.
A failed collective (a lost peer) ends the agreement with one warning: each rank installs on
arrival from then on (drift is better than a stopped run).

The freshness it costs: a result goes into use at the step start after the one at which the
last replica held it (one step later than on arrival at best), or at its deadline.
:attr:`InstallAgreement.delays` counts, per installed result, how many steps it was held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from asteria_client.runtime.source import PreconditionerResult

logger = logging.getLogger(__name__)


class Collective(Protocol):
    """What the agreement needs of the replicas' group: an element-wise MIN all-reduce, now or
    started (the returned call waits for it)."""

    def all_min(self, values: Sequence[int]) -> list[int]: ...

    def start_min(self, values: Sequence[int]) -> Callable[[], list[int]]: ...


class InstallAgreement:
    """The held results of replicated blocks and the collectives that release them (module
    docstring). ``shared(block)``: whether the block has replicas on other ranks of the group."""

    def __init__(self, collective: Collective, shared: Callable[[str], bool]) -> None:
        self._collective = collective
        self._shared = shared
        #: block -> version -> (a result taken from the source and not in use, step taken)
        self._held: dict[str, dict[int, tuple[PreconditionerResult, int]]] = {}
        #: the round started at the last step start: its blocks, the blocks whose continuous
        #: pulls it reports, and the call that finishes it
        self._round: tuple[list[Any], list[Any], Callable[[], list[int]]] | None = None
        self.failed = ""  # why the agreement stopped ("" while it holds)
        self.rounds = 0  # collectives at step starts
        self.forced_rounds = 0  # collectives at deadlines
        self.agreed_fallbacks = 0  # blocks every replica computed locally together
        self.collective_s = 0.0  # training-thread seconds in the collectives (waits included)
        self.pulls = 0  # continuous pulls reported by a chooser and registered by all
        self.pulls_held = 0  # of those: held by every replica already when reported
        #: steps a result was held before it went into use -> how many results
        self.delays: dict[int, int] = {}

    def covers(self, block: str) -> bool:
        """Whether ``block``'s installs are agreed (replicated, and the agreement holds)."""
        return not self.failed and self._shared(block)

    # ------------------------------------------------------------------ held results
    def hold(self, result: PreconditionerResult | None, step: int) -> None:
        """Keep ``result`` (taken from the source at ``step``)."""
        if result is not None:
            self._held.setdefault(result.block, {}).setdefault(result.version, (result, step))

    def held_version(self, block: str) -> int:
        """The newest version held for ``block`` (-1: none)."""
        held = self._held.get(block)
        return max(held) if held else -1

    def holds(self, block: str, version: int) -> bool:
        return version in self._held.get(block, {})

    def release(self, block: str, version: int, step: int) -> PreconditionerResult:
        """The held ``version`` of ``block``, to install at ``step``; older ones are dropped."""
        held = self._held[block]
        result, since = held.pop(version)
        self.drop_older(block, version)
        delay = max(0, step - since)
        self.delays[delay] = self.delays.get(delay, 0) + 1
        return result

    def drop_older(self, block: str, version: int) -> None:
        """Forget the held results of ``block`` not newer than ``version`` (the one in use)."""
        held = self._held.get(block)
        if held is None:
            return
        for old in [v for v in held if v <= version]:
            del held[old]
        if not held:
            del self._held[block]

    # ------------------------------------------------------------------ collectives
    def _failed(self, exc: Exception) -> None:
        self.failed = f"{type(exc).__name__}: {exc}"
        logger.warning(
            "replicas could not agree on install steps (%s); each rank installs results "
            "as they arrive from now on, so data-parallel replicas may drift apart",
            self.failed,
        )

    def _min(self, values: list[int]) -> list[int] | None:
        start = time.perf_counter()
        try:
            return self._collective.all_min(values)
        except Exception as exc:  # a lost peer: drift is better than a stopped run
            self._failed(exc)
            return None
        finally:
            self.collective_s += time.perf_counter() - start

    def finish_round(self) -> tuple[list[tuple[Any, int]], list[tuple[Any, int, int]]]:
        """The round started at the last step start, finished (a wait only if a peer has not
        started it yet): ``(item, version)`` for each of its items whose newest held version was
        the same on every replica, and ``(report, version, held)`` for each reported block that
        one replica (its chooser) pulled at ``version``, with the version every replica held
        of it then (-1: not the same everywhere; see :meth:`start_round`). Collective in
        effect; both empty when no round is open."""
        if self._round is None:
            return [], []
        items, reports, finish = self._round
        self._round = None
        start = time.perf_counter()
        try:
            reduced = finish()
        except Exception as exc:  # a lost peer: drift is better than a stopped run
            self._failed(exc)
            return [], []
        finally:
            self.collective_s += time.perf_counter() - start
        count, reported = len(items), len(reports)
        lows, negated_highs = reduced[:count], reduced[count : 2 * count]
        agreed = [
            (item, low)
            for item, low, neg in zip(items, lows, negated_highs, strict=True)
            if low == -neg and low >= 0
        ]
        rest = reduced[2 * count :]
        pulls, held_lows, held_negated = (
            rest[:reported],
            rest[reported : 2 * reported],
            rest[2 * reported :],
        )
        pulled = [
            (report, -low, held if held == -neg else -1)
            for report, low, held, neg in zip(reports, pulls, held_lows, held_negated, strict=True)
            if -low >= 0
        ]
        self.pulls += len(pulled)
        self.pulls_held += sum(held >= version for _, version, held in pulled)
        return agreed, pulled

    def start_round(
        self,
        items: list[Any],
        versions: list[int],
        reports: Sequence[Any] = (),
        pulled: Sequence[int] = (),
        held: Sequence[int] = (),
    ) -> None:
        """Start the round of this step start over ``items`` (every replica: the same items in
        the same order) with the newest version held for each; :meth:`finish_round` at the next
        step start says which every replica held.

        ``reports`` (the same on every replica too) are blocks of the continuous schedule,
        ``pulled`` this replica's pull of each since its last report (-1: none) and ``held``
        the newest version it holds of each: one replica alone chooses a block's extra pulls,
        and the round's MAX over them tells every replica which version it took, so all of
        them register it at the same step (and install it then, if all held its result)."""
        if not (items or reports) or self.failed:
            return
        self.rounds += 1
        start = time.perf_counter()
        values = [
            *versions,
            *(-v for v in versions),
            *(-v for v in pulled),
            *held,
            *(-v for v in held),
        ]
        try:
            self._round = (items, list(reports), self._collective.start_min(values))
        except Exception as exc:  # a lost peer: drift is better than a stopped run
            self._failed(exc)
        finally:
            self.collective_s += time.perf_counter() - start

    def agree_all(self, versions: list[int]) -> list[int]:
        """Collective now (every replica, the same blocks in the same order): per block, the
        newest version held if every replica holds that one, else -1 (also when the agreement
        fails)."""
        self.forced_rounds += 1
        reduced = self._min(versions + [-v for v in versions])
        if reduced is None:
            return [-1] * len(versions)
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
            "agreement_pulls": self.pulls,
            "agreement_pulls_held_by_all": self.pulls_held,
            "agreement_collective_s": self.collective_s,
            "agreement_held_steps": dict(sorted(self.delays.items())),
        }
