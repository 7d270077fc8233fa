"""What the client knows about each block, kept in one place.

A tile (:class:`TileBlocks`) holds, per dim, its block's name, the version of the result in use
and the newest snapshot taken: the optimizer writes the version when it installs a result, the
runtime the snapshot when it takes one, and both travel in checkpoints as they always have.

Everything else the client keeps about a block is one :class:`BlockRecord`, owned by the
freshness runtime (:class:`BlockRecords`, by name): how to snapshot it, the interval its budget
counts, the lag it was last used with, whether its result in use came from the source, local
failures, its refresh log (installs, pulls, drift at install) and its continuous-schedule state
(priority, drift estimates, floor). The refresh log (:class:`~.refresh.RefreshLog`) and the
continuous scheduler (:class:`~.refresh.ContinuousScheduler`) read and write the same records:
there is no second table of a block's state to keep in step with the first, and a step touches a
block through one dict lookup.

The sources keep no copy of this: what a source holds per block is the state of its own
medium, touched by its own threads under its own lock (the daemon source's segments, the
snapshot waiting for its sender, the result staged for the device; the result exchange's
versions expected from and received over the side group). The runtime's record is the
training thread's, and is never shared with a source's thread.

A record refers to its tile weakly: the optimizer owns its tiles, and a tile it dropped (a
checkpoint load, a reshard, a regrouping) must not be kept alive by the runtime. A record whose
tile is gone reads as a block with nothing in use (version -1) and nothing taken.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from asteria_client.runtime.source import PreconditionerRequest

#: Builds the snapshot request of one block of a tile: ``(dim, version) -> request``.
RequestFn = Callable[[int, int], "PreconditionerRequest"]

#: Priority per step of age, in units of relative off-diagonal energy (see :mod:`.refresh`).
AGE_WEIGHT = 1e-4
#: A block's drift is estimated again once its factor is this many steps newer than the last
#: estimate (and only when a worker is free to refresh something).
DRIFT_INTERVAL_STEPS = 4


@dataclass(kw_only=True)
class TileBlocks:
    """The freshness bookkeeping of one tile: per dim, its block name (None: the dim is not
    preconditioned), the version in use (-1: none yet) and the newest snapshot submitted.

    Optimizers subclass it with their own per-tile state (factors, bases, moments).
    """

    blocks: list[str | None]
    versions: list[int]
    submitted: list[int]

    @classmethod
    def named(cls, blocks: list[str | None], **state: Any) -> Any:
        return cls(
            blocks=blocks, versions=[-1] * len(blocks), submitted=[-1] * len(blocks), **state
        )

    def preconditioned(self) -> Iterator[tuple[int, str]]:
        """(dim, block name) of every preconditioned dim."""
        for dim, block in enumerate(self.blocks):
            if block is not None:
                yield dim, block


def _no_tile() -> None:
    return None


@dataclass(eq=False, slots=True)
class BlockRecord:
    """One block, as the client sees it (see the module docstring)."""

    name: str
    dim: int
    #: the tile that holds it now (weakly: see the module docstring)
    tile_ref: Callable[[], Any] = _no_tile
    #: how to snapshot it (its factor and the basis in use, uncopied): drift at install,
    #: continuous pulls (None until the runtime has seen a request for it)
    request: RequestFn | None = None
    #: the steps its staleness budget counts (the amortized interval; 1 for a continuous
    #: extra snapshot)
    frequency: int = 1
    lag_at_use: int = 0  # the lag it was last used with
    #: the version of the result in use when it came from the source (-1: a local fallback,
    #: a checkpoint's basis, or none): a source that keeps its results refreshes from its own
    from_source: int = -1
    local_failures: int = 0
    local_error: str | None = None

    # -- refresh log (RefreshLog); drift values are device tensors until reported
    installs: int = 0
    first_step: int | None = None
    drift_sum: torch.Tensor | None = None
    drift_count: int = 0
    last_drift: torch.Tensor | None = None
    drift_step: int | None = None  # the step of the last drift sample
    pulls: int = 0
    floor_pulls: int = 0
    floor_installs: int = 0
    #: versions of floor snapshots not installed (nor passed by a newer install) yet
    floor_versions: list[int] = field(default_factory=list)

    # -- continuous schedule (ContinuousScheduler)
    offered: int = -1  # the version (step) of the factor its tile holds now (-1: not offered)
    cost_s: float = 0.0  # estimated solve seconds
    drift: float = math.inf  # unknown until measured
    drift_version: int = -1  # the factor's version when drift was measured
    drift_basis: int = -1  # the basis's version when drift was measured
    #: a drift computed on the device, not read yet (the next choice reads it with the rest)
    drift_unread: torch.Tensor | None = None
    #: the version of the snapshot in flight and its ‖L‖²_F (a device tensor)
    pulled_version: int = -1
    pulled_norm2: torch.Tensor | None = None
    #: a drift estimate of it is on its way to the host (with the factor's and the basis's
    #: versions it was measured at)
    drift_reading: bool = False
    drift_reading_versions: tuple[int, int] = (-1, -1)
    #: the floor: at most this many steps between snapshots (the group's
    #: precondition_frequency; None until the runtime has seen it)
    floor_steps: int | None = None
    floor_version: int = -1  # the version of the newest floor snapshot taken (-1: none)
    #: replicas (see :mod:`.agreement`): whether this rank chooses the block's extra pulls
    #: (its owner does; every rank for a block of its own)
    chooser: bool = True
    #: an extra snapshot this rank took of a replicated block, not registered yet: its
    #: version (-1: none), and whether a step start's round has reported it to the replicas
    claimed: int = -1
    claim_reported: bool = False
    #: the floor's phase: its floor snapshots fall on the steps t with (t - 1) % f == floor_phase
    #: (None: not assigned yet), for f = floor_phase_steps (see ContinuousScheduler.floor_due)
    floor_phase: int | None = None
    floor_phase_steps: int = 0
    size: int = 0  # n of the n x n factor (what the floor's phases balance: n³ per phase)

    @property
    def tile(self) -> Any:
        return self.tile_ref()

    @property
    def version(self) -> int:
        """The version of the result in use (-1: none)."""
        tile = self.tile_ref()
        return -1 if tile is None else tile.versions[self.dim]

    @property
    def submitted(self) -> int:
        """The newest snapshot taken (-1: none)."""
        tile = self.tile_ref()
        return -1 if tile is None else tile.submitted[self.dim]

    # -- the continuous schedule's questions
    def floor_due(self) -> bool:
        """Its factor is newer than its newest snapshot, and there is none yet, or the newest
        is ``f`` steps old or more (in flight or not: latest wins, as on the amortized
        schedule), or this is a step of its phase (``(offered - 1) % f == floor_phase``)
        unless its newest snapshot is a floor one still in flight. One step of its phase
        falls in every f consecutive steps, so a block is snapshotted at least every f steps,
        as on the amortized schedule, but not all blocks at the same step. The exception is
        for the first f steps: every block's step-1 snapshot is in one burst, and a block
        whose phase comes before its result would only replace it in the queue (a copy
        spent, and one install fewer); it is snapshotted f steps after, and at its phase's
        steps once a result is in."""
        last = self.submitted
        if self.offered <= last:
            return False
        if last < 0:
            return True
        frequency = self.floor_steps
        if frequency is None:
            return False
        if self.offered - last >= frequency:
            return True
        phase = (self.offered - 1) % frequency
        if self.floor_phase_steps != frequency or phase != self.floor_phase:
            return False
        floor_in_flight = self.floor_version == last and self.version < last
        return not floor_in_flight

    def drift_stale(self) -> bool:
        """The estimate is of another basis, or DRIFT_INTERVAL_STEPS old."""
        return (
            self.drift_basis != self.version
            or self.offered - self.drift_version >= DRIFT_INTERVAL_STEPS
        )

    def pullable(self) -> bool:
        """This rank chooses its pulls, it is not in flight (a claimed snapshot counts), and
        its factor is newer than every snapshot taken of it."""
        tile = self.tile_ref()
        if tile is None or not self.chooser:
            return False
        taken = max(tile.submitted[self.dim], self.claimed)
        return taken <= tile.versions[self.dim] and self.offered > taken

    def priority(self) -> float:
        installed = self.version
        if installed < 0:
            return math.inf
        age = self.offered - installed
        return (self.drift + AGE_WEIGHT * age) / max(self.cost_s, 1e-12)


class BlockRecords(dict[str, BlockRecord]):
    """The runtime's records, by block name."""

    def at(self, tile: Any, dim: int, block: str) -> BlockRecord:
        """``block``'s record, pointed at ``tile`` (created on first sight; a tile that
        replaced the one it knew takes its place, the record and its history stay)."""
        record = self.get(block)
        if record is None:
            record = self[block] = BlockRecord(block, dim, weakref.ref(tile))
        elif record.tile_ref() is not tile:
            record.tile_ref = weakref.ref(tile)
            record.dim = dim
        return record
