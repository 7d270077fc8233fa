"""The freshness runtime: the one object an optimizer holds to get roots and bases in time.

The optimizer (``optim/``) is math only. What it needs from the outside world is: *submit a
snapshot of this block's factor*, *install whatever is ready*, and *make sure the block meets
its staleness budget before I use it*. :class:`FreshnessRuntime` does those, over any
:class:`~asteria_client.runtime.source.PreconditionerSource` (native, embedded, daemon), with
the rules of DESIGN.md "The runtime":

- **versions, latest wins** — a result is installed only when newer than the one in use;
- **bounded staleness** — before a step uses a block, its result may lag the newest snapshot by
  at most ``S * f`` steps; beyond that the runtime waits for the result in flight (the
  *barrier*, bounded by ``barrier_timeout_s``), then computes the block locally;
- **degrade, never crash** — a source that raises costs results, not the training run;
- **hooks** — forward/backward hooks pump results into place while the model computes;
- **continuous refresh** — with ``refresh="continuous"`` the optimizer *offers* its tiles after
  each step instead of submitting them every f steps, and the runtime *pulls* at each step end
  every block whose floor is due (at its phase of the amortized f), then the blocks that need a new
  basis most, as many as the source has credit for (see :mod:`.refresh`).

The optimizer describes each block through two callbacks, so the runtime never knows the math:
``request(dim, version)`` builds the snapshot request of one block of a tile, and
``install(tile, dim, result)`` puts a newer result into use (once per installed version).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from asteria_client.runtime.agreement import InstallAgreement
from asteria_client.runtime.blocks import BlockRecord, BlockRecords, RequestFn, TileBlocks
from asteria_client.runtime.refresh import ContinuousScheduler, RefreshLog
from asteria_client.runtime.source import (
    NativeSource,
    PreconditionerRequest,
    PreconditionerResult,
    PreconditionerSource,
    compute_locally,
)
from asteria_client.runtime.staleness import BarrierStats, StalenessPolicy, freshness
from asteria_client.runtime.transfer import DeviceTransfer, PendingCopy
from asteria_server.errors import AsteriaError, InvalidInputError, SolverError
from asteria_server.types import SolveKind

if TYPE_CHECKING:
    from asteria_client.runtime.embedded import EngineConfig

logger = logging.getLogger(__name__)


class Mode(enum.Enum):
    """Where roots and eigenbases are computed."""

    NATIVE = "native"  # synchronously, in step(), on the parameter's device
    EMBEDDED = "embedded"  # an engine in this process, solver worker processes
    DAEMON = "daemon"  # the node's asteria-server


def parse_enum(enum_type: type[enum.Enum], value: Any, field_name: str) -> Any:
    """Accept an enum member or its string value; name the field on failure."""
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_type)
        raise InvalidInputError(f"{field_name}={value!r} is not one of {allowed}") from None


def resolve_mode(mode: Mode | str | None, address: str | None = None) -> Mode:
    """``None`` means: the daemon when an address is configured, else the embedded engine."""
    if mode is None:
        from asteria_client.config import client_env

        return Mode.DAEMON if (address or client_env().address) else Mode.EMBEDDED
    return parse_enum(Mode, mode, "mode")


def make_source(
    mode: Mode,
    engine_config: EngineConfig | None = None,
    *,
    address: str | None = None,
    pulls: bool = False,
) -> PreconditionerSource:
    """The source of ``mode``; the daemon's ``address`` defaults to ``ASTERIA_ADDRESS``.
    ``pulls``: the continuous schedule will pull snapshots by the source's credit (a daemon
    source then asks for the daemon's Credit messages).

    The embedded and daemon sources are imported here, on demand: ``import asteria_client``
    loads neither the engine (SciPy) nor gRPC.
    """
    if mode is Mode.NATIVE:
        return NativeSource()
    if mode is Mode.EMBEDDED:
        from asteria_client.runtime.embedded import EmbeddedSource

        return EmbeddedSource(engine_config)
    from asteria_client.config import resolve_address
    from asteria_client.transport.daemon import DaemonSource

    return DaemonSource(address=resolve_address(address), pulls=pulls)


#: Puts a newer result into use: ``(tile, dim, result) -> None``.
InstallFn = Callable[[Any, int, PreconditionerResult], None]


#: Modules of a model, besides the model itself, whose forward and backward signal the runtime.
MAX_SIGNAL_MODULES = 64


def signal_modules(
    model: torch.nn.Module, limit: int = MAX_SIGNAL_MODULES
) -> list[torch.nn.Module]:
    """The modules of ``model`` that hold parameters themselves (``nn.Linear``, not a
    container), in registration order, thinned evenly to ``limit``: where its forward and
    backward spend their time, and a bounded cost per step for a model of thousands."""
    owners = [
        module
        for module in model.modules()
        if module is not model and next(module.parameters(recurse=False), None) is not None
    ]
    if len(owners) <= limit:
        return owners
    return [owners[(i * len(owners)) // limit] for i in range(limit)]


@dataclass(eq=False)
class _SyncGroup:
    """What :meth:`FreshnessRuntime.sync_tiles` keeps about one list of tiles: the tiles to
    look at next time (by id), the lags each tile's blocks were used with at its last look,
    and how many of the list's blocks have each lag (counted for every step not looked at)."""

    tiles: list[Any]
    size: int
    frequency: int
    last_step: int = -1
    dirty: dict[int, Any] = dataclasses.field(default_factory=dict)
    lags: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    tally: dict[int, int] = dataclasses.field(default_factory=dict)


class FreshnessRuntime:
    """Submits snapshots, installs results, enforces the budget; see the module docstring."""

    def __init__(
        self,
        source: PreconditionerSource,
        policy: StalenessPolicy,
        *,
        mode: Mode,
        needs_first_result: bool,
        agreement: InstallAgreement | None = None,
    ) -> None:
        self.source = source
        self.policy = policy
        #: data-parallel replicas: installs of replicated blocks agreed across ranks (see
        #: :mod:`.agreement`); None: a result goes into use when it arrives
        self.agreement = agreement
        self._step_now = 0  # the step being taken (what held results are stamped with)
        self._transfer: DeviceTransfer | None = None  # the optimizer's own small host copies
        self.mode = mode
        #: a SOAP / KL-Shampoo basis: the block cannot be used before its first result at S = 0
        self.needs_first_result = needs_first_result
        self.barrier_stats = BarrierStats()
        #: every block's record (see :mod:`.blocks`): the refresh log and the continuous
        #: schedule keep their state of a block in it too
        self.records = BlockRecords()
        self._pumped_epoch: int | None = None
        #: id(tile) -> (the tile, the results epoch of its last scan)
        self._scanned: dict[int, tuple[weakref.ref[TileBlocks], int]] = {}
        #: :meth:`sync_tiles`: the tile lists it synced (by id), each with its tiles that need
        #: a look; id(tile) -> its list's record, to mark a tile when something changes it
        self._sync_groups: dict[int, _SyncGroup] = {}
        self._group_of: dict[int, _SyncGroup] = {}
        self._sync_epoch: int | None = None
        #: calls into the per-block sync code (a test counts them: a step that receives
        #: nothing must not touch every block)
        self.block_syncs = 0
        self._hooks: list[Any] = []
        self._warned: set[str] = set()
        self.refresh_log = RefreshLog(continuous=policy.continuous, blocks=self.records)
        #: continuous schedule: seconds of the overhead budget spent since the step began
        #: (extra snapshots, their installs and solves on shared cores, and what earlier steps
        #: overspent), when it began, the step period and the cost of one snapshot (moving
        #: averages)
        self._overhead_s = 0.0
        self._step_began: float | None = None
        self._step_period_s: float | None = None
        self._snapshot_cost_s: float | None = None
        self.overhead_pauses = 0  # steps whose pulls paused for the overhead budget
        #: what stopped extra pulls in the step now running (each counted once a step)
        self._step_limits: set[str] = set()
        self._pulling = False
        #: the source's transfer layer when snapshots are packed for it (None: handed over
        #: one by one, as they are), the snapshots requested and not handed over yet, how deep
        #: :meth:`publishing` is, and the tiles whose ready results wait for that hand-over
        self._packer = source.snapshot_transfer()
        self._unsent: list[PreconditionerRequest] = []
        self._publishing = 0
        self._install_after: dict[int, tuple[TileBlocks, InstallFn]] = {}
        self._reuses_bases = source.reuses_bases()
        self.bases_left_home = 0  # eigenbasis requests sent without their basis
        self._continuous = (
            ContinuousScheduler(
                seconds_per_n3=source.seconds_per_n3(), records=self.records, chooses=self._chooses
            )
            if policy.continuous
            else None
        )
        #: continuous schedule, replicas: the blocks with an extra snapshot this rank took
        #: and the replicas have not registered yet (see :meth:`begin_step`)
        self._claims: dict[str, BlockRecord] = {}
        # The source is released when the runtime is collected, even without close(): the
        # finalizer holds the source, never the runtime or the optimizer.
        self._finalizer = weakref.finalize(self, source.close)

    @property
    def synchronous(self) -> bool:
        return self.source.synchronous

    def copy_to_host(self, tensor: torch.Tensor) -> PendingCopy:
        """Start a copy of a (small) device tensor into host memory, on the side stream: its
        ``host`` is valid once ``ready()`` (or after ``wait()``). How the optimizer's
        device-side checks reach the host without a sync in the step."""
        if self._transfer is None:
            self._transfer = DeviceTransfer()
        return self._transfer.to_host(tensor)

    def seconds_per_n3(self) -> float:
        return self.source.seconds_per_n3()

    @property
    def continuous(self) -> bool:
        """Whether blocks are pulled when a worker is free (else submitted every f steps)."""
        return self._continuous is not None

    def deadline_step(self, version: int, frequency: int) -> int:
        """The step at which a snapshot of ``version`` would exceed the budget (on the
        continuous schedule: an extra snapshot's; a floor snapshot gets S*f when pulled)."""
        return version + self.policy.budget_steps(1 if self.continuous else frequency)

    def needs_first(self) -> bool:
        """Whether a block must wait for its first result before the tile can step.

        Only at S = 0 (and in native mode): there the optimizer must equal native mode, which
        starts from the first eigenbasis. With a budget S >= 1 a SOAP / KL-Shampoo tile starts
        in the identity basis (plain Adam in the parameter's coordinates; the moments are
        rotated into the first basis when it arrives), and the budget bounds how long that may
        last, as for any other result: the first steps never stall on a solve.
        """
        return self.needs_first_result and (
            self.source.synchronous or self.policy.budget_intervals == 0
        )

    # ------------------------------------------------------------------ snapshots and results
    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        """Collect the snapshots requested inside (an optimizer step) and hand them to the
        source together when it ends: one device-to-host copy for all of them. Anything that
        installs a result or waits for one (:meth:`sync`, :meth:`install_ready`, a pull)
        hands the collected snapshots over first, so a request never sees a basis installed
        after it was made."""
        self._publishing += 1
        try:
            yield
        finally:
            self._publishing -= 1
            if not self._publishing:
                self.flush()

    def flush(self) -> None:
        """Hand every collected snapshot to the source — packed into one copy per device —
        then install what is ready for the tiles that waited for it."""
        unsent, self._unsent = self._unsent, []
        if unsent:
            assert self._packer is not None
            held = [self._basis_held(r) for r in unsent]
            tensors = [
                t
                for r, own in zip(unsent, held, strict=True)
                for t in (r.matrix, None if own else r.basis)
                if t is not None
            ]
            copies = iter(self._packer.pack(tensors))
            for request, own in zip(unsent, held, strict=True):
                matrix = next(copies)
                basis = None if request.basis is None or own else next(copies)
                self.bases_left_home += own
                self._hand_over(
                    dataclasses.replace(
                        request,
                        matrix=matrix.host,
                        basis=None if basis is None else basis.host,
                        staged=(matrix,) if basis is None else (matrix, basis),
                        device=request.matrix.device,
                    )
                )
        waiting, self._install_after = self._install_after, {}
        for tile, install in waiting.values():
            self.install_ready(tile, install)

    def _basis_held(self, request: PreconditionerRequest) -> bool:
        """Whether ``request``'s basis is exactly a result its source keeps (so it stays
        home): the result in use came from the source, not a local fallback, and was
        installed unrounded (float32, the results' dtype)."""
        return (
            self._reuses_bases
            and request.kind is SolveKind.EIGENBASIS
            and request.basis is not None
            and request.basis.dtype == torch.float32
            and request.base_version >= 0
            and (record := self.records.get(request.block)) is not None
            and record.from_source == request.base_version
        )

    def bases_replaced(self) -> None:
        """The optimizer's bases were replaced (a checkpoint loaded): none is the source's."""
        for record in self.records.values():
            record.from_source = -1

    def _hand_over(self, snapshot: PreconditionerRequest) -> None:
        try:
            self.source.submit(snapshot)
        except AsteriaError as exc:  # a source must not take training down
            self.barrier_stats.submit_errors += 1
            self._warn_once("submit", f"could not submit snapshots ({exc}); computing locally")

    def submit(
        self,
        tile: TileBlocks,
        version: int,
        frequency: int,
        request: RequestFn,
        install: InstallFn,
    ) -> None:
        """Snapshot every factor of the tile, then install whatever is ready already."""
        for dim, block in tile.preconditioned():
            record = self.records.at(tile, dim, block)
            record.frequency = frequency
            record.request = request
            self._submit_block(tile, dim, version, request)
        self._install_after[id(tile)] = (tile, install)
        if not self._publishing:
            self.flush()

    def _submit_block(
        self,
        tile: TileBlocks,
        dim: int,
        version: int,
        request: RequestFn,
        *,
        deadline_step: int | None = None,
        register: bool = True,
    ) -> PreconditionerRequest:
        """Snapshot one block and hand it over (packed at the next flush); ``register``:
        the tile's newest snapshot becomes ``version`` now (a replicated block's extra pull
        is registered later, on every replica at once: :meth:`begin_step`)."""
        snapshot = request(dim, version)
        if deadline_step is not None:
            snapshot = dataclasses.replace(snapshot, deadline_step=deadline_step)
        if register:
            tile.submitted[dim] = version
            self._changed(tile)
        if self._packer is None:  # native: solved now, on the factor's device
            self._hand_over(snapshot)
        else:
            self._unsent.append(snapshot)  # handed over by flush(): together, in one copy
        return snapshot

    def offer(self, tile: TileBlocks, version: int, request: RequestFn) -> None:
        """Continuous schedule: the tile's factors now hold step ``version``; its blocks may be
        pulled (by :meth:`pull`) when the source has credit."""
        assert self._continuous is not None, "offer() is for refresh='continuous'"
        self._continuous.offer(tile, version, request)
        for dim, block in tile.preconditioned():
            self.records.at(tile, dim, block).frequency = 1

    def pull(self, install: InstallFn, *, step_end: bool = False) -> int:
        """Continuous schedule: snapshot the blocks that need it; returns how many were copied.

        ``step_end``: a step just ended (the optimizer's call): a new overhead budget begins,
        and every block whose floor is due is snapshotted, whatever the credit and the budget
        (the amortized schedule would publish it now). Then, here and at the hooks' pulls,
        *extra* snapshots of the blocks that need it most: as many as the source has credit
        for (none while every worker is busy) and the step's overhead budget still covers.
        Each refresh costs the training thread a copy, a drift estimate and a rotation of the
        moments, and a free worker alone must not decide how many of them a step pays; the
        floor's are the amortized schedule's own cost, not charged to the budget."""
        if self._continuous is None:
            return 0
        self._pulling = True
        try:
            with torch.no_grad():
                floor = 0
                if step_end:
                    self._new_step()
                    floor = self._pull_floor(install)
                start = time.perf_counter()
                extra = self._pull_extra(install, step_end=step_end)
                self._overhead_s += time.perf_counter() - start
                return floor + extra
        finally:
            self._pulling = False

    def _new_step(self) -> None:
        now = time.perf_counter()
        if self._step_began is not None:
            period = now - self._step_began
            last = self._step_period_s
            self._step_period_s = period if last is None else last + 0.2 * (period - last)
            self.refresh_log.extra_limits.steps += 1
            # What a step spent beyond its budget is owed by the next ones: a solve charged
            # at its install can cost several steps' budgets, and the budget is a share of
            # the training time over many steps, not a fresh allowance every step.
            owed = self._overhead_s - self.policy.refresh_overhead * self._step_period_s
            self._overhead_s = max(0.0, owed)
        else:
            self._overhead_s = 0.0
        self._step_began = now
        self._step_limits.clear()
        scheduler = self._continuous
        assert scheduler is not None
        if not self._hooks:  # the step end is the only pull point
            credit = self.source.credit()
            if credit is not None and credit > 0 and scheduler.pullable():
                self._limited("no_pull_point")

    def _limited(self, reason: str) -> None:
        """Extra pulls of this step were stopped by ``reason`` (counted once a step)."""
        if reason in self._step_limits:
            return
        self._step_limits.add(reason)
        limits = self.refresh_log.extra_limits
        setattr(limits, reason, getattr(limits, reason) + 1)
        if reason == "overhead_budget":
            self.overhead_pauses += 1

    def _note_snapshot_cost(self, seconds: float, count: int) -> None:
        """``count`` snapshots were taken in ``seconds`` (their copies and hand-over: the
        choice and the installs around them are charged to the budget, not to this
        estimate of what one more snapshot costs)."""
        per = seconds / count
        last = self._snapshot_cost_s
        self._snapshot_cost_s = per if last is None else last + 0.2 * (per - last)

    def _affordable(self) -> int | None:
        """How many more extra snapshots this step's overhead budget covers (None: no
        estimate yet, no limit)."""
        period, cost = self._step_period_s, self._snapshot_cost_s
        if period is None or cost is None:
            return None
        left = self.policy.refresh_overhead * period - self._overhead_s
        return max(0, math.floor(left / max(cost, 1e-9)))

    def _pull_floor(self, install: InstallFn) -> int:
        """Snapshot every block whose floor is due (see :mod:`.refresh`); their snapshots
        may be in flight S*f steps, the amortized budget."""
        scheduler = self._continuous
        assert scheduler is not None
        due = scheduler.floor_due()
        if not due:
            return 0
        start = time.perf_counter()
        tiles = {}
        for entry in due:
            frequency = entry.floor_steps or 1
            tile = entry.tile
            assert entry.request is not None and tile is not None  # offered: floor_due()
            snapshot = self._submit_block(
                tile,
                entry.dim,
                entry.offered,
                entry.request,
                deadline_step=entry.offered + self.policy.budget_steps(frequency),
            )
            entry.frequency = frequency  # its budget counts intervals (as in _sync_tile)
            scheduler.pulled(entry, snapshot, floor=True)
            self.refresh_log.record_pull(entry, entry.offered, floor=True)
            tiles[id(tile)] = tile
        self.flush()
        self._note_snapshot_cost(time.perf_counter() - start, len(due))
        for tile in tiles.values():
            self.install_ready(tile, install)
        return len(due)

    def _pull_extra(self, install: InstallFn, *, step_end: bool) -> int:
        """Extra snapshots by credit, priority and the overhead budget; a source without a
        credit limit gets every block at a step end (native: every block, every step)."""
        scheduler = self._continuous
        assert scheduler is not None
        pulled = 0
        while True:
            credit = self.source.credit()
            allowed = credit
            affordable = None if credit is None and step_end else self._affordable()
            if affordable is not None:
                allowed = affordable if credit is None else min(credit, affordable)
            chosen = scheduler.choose(allowed)
            if not chosen:
                if scheduler.pullable():
                    if credit is not None and credit <= 0:
                        self._limited("credit")
                    elif affordable is not None and affordable <= 0:
                        self._limited("overhead_budget")
                return pulled
            tiles = {}
            start = time.perf_counter()
            for entry in chosen:
                tile = entry.tile
                assert entry.request is not None and tile is not None  # offered: pullable()
                if self._agreed(entry.name):  # replicas: registered by all of them at once
                    snapshot = self._submit_block(
                        tile, entry.dim, entry.offered, entry.request, register=False
                    )
                    entry.claimed, entry.claim_reported = entry.offered, False
                    self._claims[entry.name] = entry
                else:
                    snapshot = self._submit_block(tile, entry.dim, entry.offered, entry.request)
                    self.refresh_log.record_pull(entry, entry.offered)
                scheduler.pulled(entry, snapshot)
                tiles[id(tile)] = tile
            self.flush()  # handed over before the source's credit is read again
            self._note_snapshot_cost(time.perf_counter() - start, len(chosen))
            pulled += len(chosen)
            for tile in tiles.values():
                self.install_ready(tile, install)

    def _install(
        self,
        tile: TileBlocks,
        dim: int,
        result: PreconditionerResult,
        install: InstallFn,
        *,
        local: bool = False,
    ) -> None:
        """Put ``result`` into use, and log the refresh with the drift of the basis it
        replaces (its factor now against the basis in use)."""
        start = time.perf_counter()
        block = tile.blocks[dim]
        assert block is not None
        record = self.records.at(tile, dim, block)
        request = None
        if record.request is not None and self.refresh_log.wants_drift(record):
            request = record.request(dim, tile.versions[dim])
        floor = self.refresh_log.record_install(record, request, result.version)
        if self._continuous is not None:
            self._continuous.installed(record, result)
        install(tile, dim, result)
        record.from_source = -1 if local else result.version
        self._changed(tile)
        # A pull counts its installs (a synchronous source's) itself; a floor result's install
        # is the amortized schedule's own cost, not the extra refreshes' budget.
        if not self._pulling and not floor:
            self._overhead_s += time.perf_counter() - start
        if self._continuous is not None and not floor and not local:
            self._overhead_s += self._solve_charge(result)

    def _solve_charge(self, result: PreconditionerResult) -> float:
        """What an extra refresh's solve cost the step: its solve time where the solver shares
        the training's cores (a model trained on this host's CPU, solved on this host), else 0.
        On a 2-core host, 30 extra refreshes per block per 100 steps of a 6-layer model made
        its median step 1.18x the amortized schedule's while the budget, which counted only
        the training thread's copies and installs, saw 4% (issue 30)."""
        if result.matrix.device.type != "cpu" or not self.source.solves_on_this_host():
            return 0.0
        return result.solve_time_s

    def install_ready(self, tile: TileBlocks, install: InstallFn) -> None:
        """Install every ready result of the tile's blocks. When the source counts arriving
        results, a tile already scanned since the last arrival is not scanned again: a step
        then costs one counter read per tile, not one source round trip per block."""
        if self._unsent:
            self.flush()  # collected snapshots go before any basis they were taken with changes
        epoch = self.source.results_epoch()  # read before the scan: an arrival during it counts
        if epoch is not None:
            seen = self._scanned.get(id(tile))
            if seen is not None and seen[0]() is tile and seen[1] == epoch:
                return
            self._scanned[id(tile)] = (weakref.ref(tile), epoch)
        in_dim_order = self.policy.budget_intervals == 0 and not self.continuous
        for dim, block in tile.preconditioned():
            if self._agreed(block):  # held until the replicas agree (begin_step, sync)
                self._hold(block)
                continue
            result = self._take_newer(block, tile.versions[dim])
            if result is not None:
                self._install(tile, dim, result, install)
            elif in_dim_order and tile.submitted[dim] > tile.versions[dim]:
                # S = 0: a tile's results go into use in dim order, whichever arrived first.
                # Each install rotates the moments along its dim; in float32 the order of two
                # such rotations changes the rounding, so the arrival order (a race between
                # solver workers, or between owner daemons) would otherwise make two identical
                # runs differ. The later dims stay in the source; sync() installs them in
                # order once this one is in.
                break

    def _agreed(self, block: str) -> bool:
        return self.agreement is not None and self.agreement.covers(block)

    def _hold(self, block: str) -> int:
        """Take ``block``'s ready result into the agreement's hold; the version held."""
        assert self.agreement is not None
        self.agreement.hold(self.source.take(block), self._step_now)
        return self.agreement.held_version(block)

    def begin_step(self, tiles: Iterable[TileBlocks], step: int, install: InstallFn) -> None:
        """A step starts (every replica calls it, with the same tiles in the same order):
        finish the agreement round of the step before and install, on every replica, the
        results that all of them held, and register the continuous pulls it reported; then
        start this step's round over the replicated blocks with a snapshot pending and the
        pulls taken since (none when there is neither); see :mod:`.agreement`. A no-op
        without an agreement; at S = 0 each block's barrier installs its newest version, so
        the round carries only the continuous pulls."""
        agreement = self.agreement
        self._step_now = step
        if agreement is None:
            return
        if agreement.failed:
            self._claims_lost()
            return
        if self.policy.budget_intervals == 0 and self._continuous is None:
            return
        self.source.pump()
        with torch.no_grad():
            agreed, pulled = agreement.finish_round()
            for (tile, dim, block), version in agreed:
                if version > tile.versions[dim] and agreement.covers(block):
                    self._install(tile, dim, agreement.release(block, version, step), install)
            for (tile, dim, block), version, held in pulled:
                self._register_pull(tile, dim, block, version)
                # every replica held its result when the round started: into use now
                if held >= version and held > tile.versions[dim] and agreement.holds(block, held):
                    self._install(tile, dim, agreement.release(block, held, step), install)
            if agreement.failed:
                self._claims_lost()
                return
            pending = []
            if self.policy.budget_intervals > 0:
                self._agree_due(tiles, step, install)
                pending = [
                    (tile, dim, block)
                    for tile in tiles
                    for dim, block in tile.preconditioned()
                    if tile.submitted[dim] > tile.versions[dim] and agreement.covers(block)
                ]
                for tile, dim, block in pending:
                    self._hold(block)
                    agreement.drop_older(block, tile.versions[dim])
            reports, claims = self._pull_reports(tiles)
            agreement.start_round(
                pending,
                [agreement.held_version(b) for _, _, b in pending],
                reports,
                claims,
                [self._hold(b) for _, _, b in reports],
            )

    def _chooses(self, block: str, n: int) -> bool:
        """Whether this rank chooses ``block``'s extra pulls: its own block, or one whose
        replicas follow this rank (the source's owner of it)."""
        return not self._agreed(block) or self.source.chooses(block, n)

    def _pull_reports(self, tiles: Iterable[TileBlocks]) -> tuple[list[Any], list[int]]:
        """The continuous blocks this step start's round reports on, the same on every
        replica (the replicated ones offered to the schedule and not in flight: only those
        can have been pulled since the last report), and for each the version this rank
        pulled since (-1: none; see :mod:`.agreement`)."""
        scheduler = self._continuous
        if scheduler is None:
            return [], []
        agreement = self.agreement
        assert agreement is not None
        reports: list[Any] = []
        claims: list[int] = []
        for tile in tiles:
            for dim, block in tile.preconditioned():
                entry = scheduler.candidates.get(block)
                if (
                    entry is None
                    or entry.tile is not tile
                    or tile.submitted[dim] > tile.versions[dim]
                    or not agreement.covers(block)
                ):
                    continue
                reports.append((tile, dim, block))
                claim = entry.claimed if not entry.claim_reported else -1
                claims.append(claim)
                if claim >= 0:
                    entry.claim_reported = True
        for entry in list(self._claims.values()):
            if not entry.claim_reported:  # not reportable (its tile was replaced): dropped
                self._drop_claim(entry)
        return reports, claims

    def _drop_claim(self, entry: BlockRecord) -> None:
        entry.claimed, entry.claim_reported = -1, False
        self._claims.pop(entry.name, None)

    def _register_pull(self, tile: TileBlocks, dim: int, block: str, version: int) -> None:
        """A replicated block's extra pull at ``version``, reported by its chooser: every
        replica now takes it as the block's newest snapshot (unless a newer snapshot or
        result came first: latest wins); the others than the chooser expect its result."""
        record = self.records.at(tile, dim, block)
        mine = record.claimed == version
        if 0 <= record.claimed <= version:
            self._drop_claim(record)
        if version <= max(tile.submitted[dim], tile.versions[dim]):
            return
        tile.submitted[dim] = version
        record.frequency = 1  # an extra snapshot: the budget counts steps
        self._changed(tile)
        self.refresh_log.record_pull(record, version)
        if not mine:
            assert record.request is not None  # offered before it was pulled
            self.source.expect(record.request(dim, version))

    def _claims_lost(self) -> None:
        """The agreement stopped: this rank's unregistered pulls are its newest snapshots
        (each rank installs on arrival from now on)."""
        for entry in list(self._claims.values()):
            tile = entry.tile
            if tile is not None and entry.claimed > tile.submitted[entry.dim]:
                tile.submitted[entry.dim] = entry.claimed
                entry.frequency = 1
                self._changed(tile)
                self.refresh_log.record_pull(entry, entry.claimed)
            self._drop_claim(entry)

    def _agree_due(self, tiles: Iterable[TileBlocks], step: int, install: InstallFn) -> None:
        """The replicated blocks that reach their deadline at this step (as the tiles stand
        now): every replica waits (bounded) for each, then one collective for all of them
        installs those whose newest held version every replica shares; the rest go through
        :meth:`_agreed_barrier` when the step uses them (one collective each)."""
        agreement = self.agreement
        assert agreement is not None
        due = []
        for tile in tiles:
            for dim, block in tile.preconditioned():
                frequency = self.records.at(tile, dim, block).frequency
                required = self.policy.required_version(
                    tile.submitted[dim], frequency, self.needs_first(), step=step
                )
                if tile.versions[dim] < required and agreement.covers(block):
                    due.append((tile, dim, block, required))
        if not due:
            return
        give_up_at = time.monotonic() + self.policy.barrier_timeout_s
        haves = []
        for _, _, block, required in due:
            have = self._hold(block)
            left = give_up_at - time.monotonic()
            if have < required and left > 0:
                start = time.perf_counter()
                result = self.source.wait(block, required, left)
                self.barrier_stats.record_wait(time.perf_counter() - start, result is not None)
                agreement.hold(result, step)
                have = agreement.held_version(block)
            haves.append(have)
        for (tile, dim, block, required), version in zip(
            due, agreement.agree_all(haves), strict=True
        ):
            if version >= required:
                self._install(tile, dim, agreement.release(block, version, step), install)

    def _agreed_barrier(
        self,
        tile: TileBlocks,
        dim: int,
        block: str,
        required: int,
        step: int,
        request: RequestFn,
        install: InstallFn,
    ) -> None:
        """A replicated block at its deadline: every replica waits (bounded) for a result of
        at least ``required``, then they agree on one (the newest any holds) or, if any could
        not get one, all compute it locally (see :mod:`.agreement`)."""
        agreement = self.agreement
        assert agreement is not None
        give_up_at = time.monotonic() + self.policy.barrier_timeout_s
        target = required
        while True:
            have = self._hold(block)
            left = give_up_at - time.monotonic()
            if have < target and not self.source.synchronous and left > 0:
                start = time.perf_counter()
                result = self.source.wait(block, target, left)
                self.barrier_stats.record_wait(time.perf_counter() - start, result is not None)
                agreement.hold(result, step)
                have = agreement.held_version(block)
            decision = agreement.agree_forced(have, have < target)
            if decision is None:  # the agreement failed: this rank alone, as without one
                if have >= required:
                    self._install(tile, dim, agreement.release(block, have, step), install)
                    return
                break
            low, high, missing = decision
            if low == high and low >= required:
                self._install(tile, dim, agreement.release(block, low, step), install)
                return
            if missing:
                agreement.agreed_fallbacks += 1
                break
            target = high  # all have one, not the same: the older ones wait for the newest
        result = self._compute_locally(tile, dim, block, step, request)
        if result is not None and result.version > tile.versions[dim]:
            self._install(tile, dim, result, install)
            agreement.drop_older(block, tile.versions[dim])

    def _take_newer(self, block: str, installed_version: int) -> PreconditionerResult | None:
        """A ready result for ``block`` newer than ``installed_version``; older ones are dropped."""
        result = self.source.take(block)
        held = self.agreement  # results held before the agreement failed go into use now
        newest = -1 if held is None else held.held_version(block)
        if result is None and held is not None and newest > installed_version:
            result = held.release(block, newest, self._step_now)
        if result is None or result.version <= installed_version:
            return None
        return result

    def sync(
        self,
        tile: TileBlocks,
        step: int,
        frequency: int,
        request: RequestFn,
        install: InstallFn,
    ) -> None:
        """Install ready results, then make every block of the tile meet the staleness budget:
        wait (bounded) for a result in flight, else compute the block locally."""
        if self._unsent:
            self.flush()  # what is waited for below must have been handed over
        self.source.pump()  # finished transfers move on even when nothing is taken
        self._step_now = step
        self._sync_tile(tile, step, frequency, request, install)

    def sync_tiles(
        self,
        tiles: list[Any],
        step: int,
        frequency: int,
        request_for: Callable[[Any], RequestFn],
        install: InstallFn,
    ) -> None:
        """:meth:`sync` of every tile of ``tiles`` (one list the caller keeps from step to
        step, e.g. a tile group's), at a cost that follows what changed, not what is held.

        A tile whose blocks all met the budget at its last sync, with nothing changed since
        (no snapshot submitted, no result arrived or installed), would meet it again with
        the same lags: it is not looked at again, and its blocks' lags are counted from the
        list's running tally. So a step in which nothing arrived costs a counter read, not a
        pass over every block. Sources that cannot say which results arrived, and the
        continuous schedule's in-flight blocks (their lag grows every step), are synced
        every step as :meth:`sync` does. ``request_for(tile)`` builds a tile's request
        function, only for the tiles looked at."""
        if self._unsent:
            self.flush()  # what is waited for below must have been handed over
        self.source.pump()
        self._step_now = step
        group = self._sync_groups.get(id(tiles))
        if (
            group is None
            or group.tiles is not tiles
            or group.size != len(tiles)
            or group.frequency != frequency
        ):
            group = self._new_sync_group(tiles, frequency, step)
        group.last_step = step
        self._note_arrivals()
        if self._sync_epoch is None:  # the source cannot tell: every tile, every step
            group.dirty.update((id(t), t) for t in tiles)
        dirty, group.dirty = group.dirty, {}
        for key, tile in dirty.items():
            before = group.lags.pop(key, ())
            for lag in before:
                group.tally[lag] -= 1
            lags, settled = self._sync_tile(tile, step, frequency, request_for(tile), install)
            for lag in lags:
                group.tally[lag] = group.tally.get(lag, 0) + 1
            group.lags[key] = lags
            if settled:  # its own installs just now are seen: nothing left to look at
                group.dirty.pop(key, None)
            else:
                group.dirty[key] = tile
        self._count_settled(group, dirty)
        self.refresh_log.step = max(self.refresh_log.step, step)

    def _count_settled(self, group: _SyncGroup, synced: dict[int, Any]) -> None:
        """The lags of the blocks not looked at this step, counted as :meth:`_record_lag`
        would have (the looked-at ones were counted by their sync)."""
        stats = self.barrier_stats
        for key in synced:
            for lag in group.lags.get(key, ()):
                group.tally[lag] -= 1
        for lag, count in group.tally.items():
            if count > 0:
                stats.max_lag_steps = max(stats.max_lag_steps, lag)
                stats.lag_histogram[lag] = stats.lag_histogram.get(lag, 0) + count
        for key in synced:
            for lag in group.lags.get(key, ()):
                group.tally[lag] += 1

    def _new_sync_group(self, tiles: list[Any], frequency: int, step: int) -> _SyncGroup:
        """The record of a tile list seen for the first time (or changed): every tile of it
        is looked at in this sync. Records of lists not synced in the last step (the
        optimizer regrouped its tiles) are dropped, so regrouping never accumulates them."""
        old = self._sync_groups.pop(id(tiles), None)
        stale = [old] if old is not None else []
        for key, other in list(self._sync_groups.items()):
            if other.last_step < step - 1:
                stale.append(other)
                del self._sync_groups[key]
        for dropped in stale:
            for tile in dropped.tiles:
                if self._group_of.get(id(tile)) is dropped:
                    del self._group_of[id(tile)]
        group = _SyncGroup(tiles=tiles, size=len(tiles), frequency=frequency)
        group.dirty = {id(t): t for t in tiles}
        self._sync_groups[id(tiles)] = group
        for tile in tiles:
            self._group_of[id(tile)] = group
        return group

    def _note_arrivals(self) -> None:
        """Mark the tiles whose blocks got a result since the last look (all tiles when the
        source cannot name them)."""
        epoch = self.source.results_epoch()
        since, self._sync_epoch = self._sync_epoch, epoch
        if epoch is None or epoch == since:
            return
        blocks = None if since is None else self.source.results_since(since)
        if blocks is not None:
            for block in blocks:
                tile = self._tile_of(block)
                if tile is None:
                    break
                self._changed(tile)
            else:
                return
        for group in self._sync_groups.values():
            group.dirty.update((id(t), t) for t in group.tiles)

    def _tile_of(self, block: str) -> TileBlocks | None:
        """The tile that holds ``block`` now (None: not known here, or dropped)."""
        record = self.records.get(block)
        return None if record is None else record.tile

    def _changed(self, tile: TileBlocks) -> None:
        """Something about ``tile`` changed: :meth:`sync_tiles` looks at it again."""
        group = self._group_of.get(id(tile))
        if group is not None:
            group.dirty[id(tile)] = tile

    def _sync_tile(
        self,
        tile: TileBlocks,
        step: int,
        frequency: int,
        request: RequestFn,
        install: InstallFn,
    ) -> tuple[tuple[int, ...], bool]:
        """The body of :meth:`sync`: the lags its blocks are used with, and whether they
        stay so until something changes (each met the budget, and none is a continuous
        block in flight, whose lag grows with the step)."""
        records = [self.records.at(tile, dim, block) for dim, block in tile.preconditioned()]
        for record in records:
            record.request = request
            self.refresh_log.record_step(record, step)
        self.install_ready(tile, install)
        scheduler = self._continuous
        lags: list[int] = []
        settled = True
        for record in records:
            dim, block = record.dim, record.name
            self.block_syncs += 1
            newest = tile.submitted[dim]
            interval, floor = frequency, False
            if scheduler is not None:  # the budget counts steps; the amortized one for a floor
                if block in scheduler.candidates:
                    record.floor_steps = frequency
                floor = scheduler.floor_snapshot(record, newest)
                interval = frequency if floor else 1
            record.frequency = interval
            required = self.policy.required_version(
                newest, interval, self.needs_first(), step=step, floor=floor
            )
            installed = tile.versions[dim]
            if installed >= required:
                lag = self.policy.lag_steps(newest, installed, step)
                lags.append(self._record_lag(record, lag))
                settled = settled and not (scheduler is not None and newest > installed)
                continue
            if self._agreed(block):
                self._agreed_barrier(tile, dim, block, required, step, request, install)
                lag = self.policy.lag_steps(newest, tile.versions[dim], step)
                lags.append(self._record_lag(record, lag))
                settled = False  # looked at again next step, as any block that waited
                continue
            result = None
            if not self.source.synchronous:
                # Returns at once when nothing >= required is computed, queued or running.
                start = time.perf_counter()
                result = self.source.wait(block, required, self.policy.barrier_timeout_s)
                self.barrier_stats.record_wait(time.perf_counter() - start, result is not None)
            local = result is None or result.version <= installed
            if local:
                result = self._compute_locally(tile, dim, block, step, request)
            if result is not None and result.version > tile.versions[dim]:
                self._install(tile, dim, result, install, local=local)
            lags.append(
                self._record_lag(record, self.policy.lag_steps(newest, tile.versions[dim], step))
            )
            settled = False  # looked at again next step (it may still be short of the budget)
        return tuple(lags), settled

    def _record_lag(self, record: BlockRecord, lag_steps: int) -> int:
        """The lag a block was *used* with: what the staleness budget bounds."""
        record.lag_at_use = lag_steps
        self.barrier_stats.record_lag(lag_steps)
        return lag_steps

    def _compute_locally(
        self, tile: TileBlocks, dim: int, block: str, step: int, request: RequestFn
    ) -> PreconditionerResult | None:
        """The last-resort native computation of one block (the source was late or failed)."""
        if not self.source.synchronous:
            self.barrier_stats.local_fallbacks += 1
            refused = self.source.refused_reason()
            if refused is not None:
                self.barrier_stats.local_fallbacks_daemon_refused += 1
                self._warn_once(
                    "fallback-refused",
                    f"block {block}: computing it locally because the daemon was refused: "
                    f"{refused}. Further fallbacks are counted in runtime_stats() "
                    "(local_fallbacks_daemon_refused), not logged.",
                )
            else:
                self._warn_once(
                    "fallback",
                    f"block {block}: no result within the staleness budget "
                    f"(S={self.policy.budget_intervals}, barrier "
                    f"{self.policy.barrier_timeout_s} s); computing it locally. Further "
                    "fallbacks are counted in preconditioner_status(), not logged.",
                )
        elif tile.versions[dim] >= 0 or not self.needs_first():
            return None  # native: the failure was recorded at submit; keep the last good result
        try:
            return compute_locally(request(dim, step))
        except SolverError as exc:
            record = self.records.at(tile, dim, block)
            record.local_failures += 1
            record.local_error = str(exc)
            return None

    def pump(self, tiles: Callable[[], Iterable[TileBlocks]], install: InstallFn) -> None:
        """Move transfers along and install every ready result (cheap; called by hooks).

        ``tiles`` is called only when a result arrived since the last pump."""
        with torch.no_grad():
            if self._unsent:
                self.flush()
            self.source.pump()
            epoch = self.source.results_epoch()
            if epoch is not None and epoch == self._pumped_epoch:
                return  # nothing arrived since the last scan: hooks stay cheap
            since, self._pumped_epoch = self._pumped_epoch, epoch
            for tile in self._tiles_with_results(since, tiles):
                self.install_ready(tile, install)
            self.pull(install)  # a result arrived: a worker is free

    def _tiles_with_results(
        self, since: int | None, tiles: Callable[[], Iterable[TileBlocks]]
    ) -> Iterable[TileBlocks]:
        """The tiles of the blocks whose results arrived after epoch ``since``; every tile
        when the source cannot tell or names a block whose tile is not known here."""
        blocks = None if since is None else self.source.results_since(since)
        if blocks is None:
            return tiles()
        found: dict[int, TileBlocks] = {}
        for block in blocks:
            tile = self._tile_of(block)
            if tile is None:
                return tiles()
            found[id(tile)] = tile
        return found.values()

    # ------------------------------------------------------------------ hooks
    def attach(self, model: torch.nn.Module, pump: Callable[[], None]) -> None:
        """Register hooks on ``model`` that call ``pump`` while it computes.

        Signal points (:func:`signal_modules`): the model and up to :data:`MAX_SIGNAL_MODULES`
        of the modules that hold parameters, spread evenly in registration order. Each signals
        when its forward returns and again when the backward pass reaches its output (a
        gradient hook on the output, registered by the forward hook: it fires where a full
        backward hook would, without that hook's warning for inputs that need no gradient).
        Signals spread through the whole forward *and* backward pass keep a free solver
        worker fed: the continuous schedule pulls a snapshot at the first signal after a
        result arrives, and a GPT's forward hooks on its top-level children alone left the
        whole backward pass without one. A signal with nothing arrived costs a counter read.
        ``pump`` is held weakly when it is a bound method: a model must not keep a dropped
        optimizer (and its worker processes) alive. Under ``torch.compile`` the hooks do
        nothing (``torch.compiler.is_compiling()``): they would break the graph at every signal
        point.
        """
        self.detach()
        target: Callable[[], Callable[[], None] | None] = (
            weakref.WeakMethod(pump) if hasattr(pump, "__self__") else (lambda: pump)
        )

        def signal() -> None:
            call = target()
            if call is not None:
                call()

        def on_forward(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if torch.compiler.is_compiling():
                # Inside torch.compile the weakref, the source's locks and the tensor hook
                # would each break the model's graph: a compiled region signals nothing (the
                # step's own pull remains), so attach() leaves the graph count as it was.
                return
            signal()
            if not torch.is_grad_enabled():
                return
            outputs = output if isinstance(output, tuple | list) else (output,)
            for tensor in outputs:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad: signal())
                    break

        for module in [model, *signal_modules(model)]:
            self._hooks.append(module.register_forward_hook(on_forward))

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ status
    def status_rows(self, tiles: Iterable[tuple[int, TileBlocks]]) -> list[dict[str, Any]]:
        """One dict per block of ``(step, tile)`` pairs; see ``preconditioner_status()``."""
        records = self.source.records()
        rows = []
        for step, tile in tiles:
            for dim, block in tile.preconditioned():
                version = int(tile.versions[dim])
                newest = int(tile.submitted[dim])
                record = records.get(block) or self.source.record(block)
                mine = self.records.get(block) or BlockRecord(block, dim)
                row = {
                    "block": block,
                    "version": version,
                    "staleness_steps": step - version if version >= 0 else step,
                    "lag_steps": mine.lag_at_use,
                    "freshness": freshness(version, newest).value,
                    "submitted_version": newest,
                    "failures": record.failures + mine.local_failures,
                    "consecutive_failures": record.consecutive_failures,
                    "last_solve_s": record.last_solve_s,
                    "last_error": mine.local_error or record.last_error,
                    "mode": self.mode.value,
                    "budget_steps": self.policy.budget_steps(mine.frequency),
                }
                row.update(record.extra)
                rows.append(row)
        return rows

    def stats(self) -> dict[str, Any]:
        """Barrier waits, timeouts, local fallbacks and the observed lag, for benchmarks."""
        stats = self.barrier_stats
        return {
            "mode": self.mode.value,
            "refresh": self.policy.refresh.value,
            "staleness_budget": self.policy.budget_intervals,
            "barrier_waits": stats.waits,
            "barrier_wait_s": stats.wait_s,
            "barrier_max_wait_s": stats.max_wait_s,
            "barrier_timeouts": stats.timeouts,
            "local_fallbacks": stats.local_fallbacks,
            "local_fallbacks_daemon_refused": stats.local_fallbacks_daemon_refused,
            "submit_errors": stats.submit_errors,
            "bases_left_home": self.bases_left_home,
            "max_lag_steps": stats.max_lag_steps,
            "lag_histogram": dict(sorted(stats.lag_histogram.items())),
            "refreshes": self.refresh_stats(),
            "source": self.source.stats(),
            **({} if self.agreement is None else self.agreement.stats()),
        }

    def refresh_stats(self) -> dict[str, Any]:
        """Per block: installs, refreshes per 100 steps, drift at install (and their means);
        on the continuous schedule also, per block, floor and extra pulls and installs, the
        steps in which credit, the overhead budget or the lack of a pull point (no hooks)
        stopped extra pulls (``extra_limited_steps``), whether hooks are attached, the
        overhead budget and the steps whose pulls it paused."""
        summary = self.refresh_log.summary()
        if self._continuous is not None:
            summary["hooks_attached"] = bool(self._hooks)
            summary["refresh_overhead"] = self.policy.refresh_overhead
            summary["overhead_pauses"] = self.overhead_pauses
        return summary

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    def close(self) -> None:
        """Remove the hooks and release the source (worker processes, connections). Idempotent."""
        self.detach()
        self._finalizer()
