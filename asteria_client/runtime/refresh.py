"""Which block to refresh next, and how often each block was refreshed.

The continuous schedule (``refresh="continuous"``) has no refresh interval. After each step, and
whenever a hook pumps results (the model's hooks fire through the forward *and* the backward
pass, see ``FreshnessRuntime.attach``), the runtime asks the source for its *credit* — how many
snapshots it would start promptly: its free solver workers plus one for the worker that frees
next, and none at all while every worker is busy — and copies that many factors, no more. So a
factor is copied only when a worker will take it, and nothing queues behind a busy pool.

**The floor.** Those pulls alone can starve: without the model's hooks (``attach``) the only pull
point is the step end, where the credit lets one worker take two snapshots, so a model of 38
blocks had each refreshed every ~19 steps where the amortized schedule at f = 5 refreshes every
5 (issue 30). So every block also has a floor, the amortized schedule's rate: at the step end,
each block is snapshotted whatever the credit when it has no snapshot yet (step 1: every block,
as the amortized schedule's first step) and then at every step of its *phase* ``p`` — the steps
t with ``(t - 1) % f == p``, f its ``precondition_frequency`` (phase 0: the amortized
schedule's own steps 1, 1 + f, …) — or whenever its newest snapshot is f steps old. One step of
a phase falls in every f consecutive steps, so each block is snapshotted at least every f
steps. Unlike the amortized schedule's, the floor's blocks do not all come due at once: their
phases spread its solve work evenly over the f steps (the largest blocks first, each to the
phase with the least work so far: :func:`assign_floor_phases`). A burst of every block every f
steps kept one worker busy for several steps, the burst's last results came late, and extra
refreshes found no credit in ~90% of the steps (issue 30's train-shape runs); spread, a step's
share of the floor is meant to be solved within about a step, leaving the worker free for
extras between. Such a *floor* snapshot may be in flight S*f steps, the amortized budget; an
*extra* one (by credit and priority, as above) S steps. Floor snapshots come first and take
the credit they use; extra ones get what is left, so continuous refresh never refreshes a
block less often than amortized at the same f, and extra refreshes come on top (an extra does
not move the block's phase: its next floor snapshot comes at its phase's next step).

Each refresh costs the training thread a snapshot copy and, when its result is installed, a
rotation of the moments; where the solver shares the training's cores (a model trained on this
host's CPU, solved in the process or by a daemon on this host), its solve costs the step too. A
fast worker would otherwise let refreshes eat the step it was meant to spare, so the runtime
keeps an *overhead budget*: extra refreshes may take ``refresh_overhead`` of the training time
(4% by default). Their snapshots and installs are charged to it as they happen, and such a
solve's seconds when its result is installed; once a step has spent its share (the step period
times ``refresh_overhead``), the hooks pull nothing more until the step ends, and what a step
spent beyond it is owed by the steps after it. The budget is for extra refreshes only: floor
snapshots, their solves and installs are the amortized schedule's own cost, never refused and
not charged to it; an extra pull is made only while the budget left covers the measured cost of
a snapshot, at the step end too. A source without a credit limit (native: it solves at once)
refreshes every block at every step end, whatever the budget: deterministic on every rank.

Which factors: the blocks whose basis fits their current factor worst, per CPU-second of solve.
The fit is the off-diagonal energy of QᵀLQ relative to ‖L‖²_F, for the basis Q in use and the
factor L. A new basis brings it along: its result's eigenvalue estimates are diag(QᵀLQ) of the
snapshot it was computed from, and ‖QᵀLQ‖_F = ‖L‖_F, so its fit is ``‖L‖²_F - Σ diag²`` (no
product; ``ContinuousScheduler.installed``). From then on it is estimated on the factor's device
every :data:`DRIFT_INTERVAL_STEPS` steps, when a choice is to be made: column j of QᵀLQ off its
diagonal has the norm of the residual ``L q_j - (q_jᵀ L q_j) q_j``; a few columns drawn at random
(:data:`DRIFT_PROBES`) estimate the sum over all columns without bias at O(n²) per probe, and
‖L‖_F costs O(n²) too. A block without a basis yet comes first; a block in flight is not pulled
again.

    priority = (drift + AGE_WEIGHT * age_steps) / estimated solve seconds

(the estimate: the engine's calibrated seconds per n³, plus :data:`SOLVE_OVERHEAD_S`).

``age_steps`` is how many steps the factor has moved since the snapshot of the basis in use: a
block whose estimate reads zero still gets refreshed, eventually. Blocks whose factor barely moves
are refreshed rarely, blocks that move fast often.

:class:`RefreshLog` counts, in every mode, each block's installs and the drift of the basis an
install replaced (measured against the current factor just before the install, on at most one
install per block every :data:`DRIFT_INTERVAL_STEPS` steps) — what ``refresh_stats()`` and the
benchmarks report as refreshes per 100 steps and drift at install. Drift values stay on the
device until a report asks for them: no step waits on them. On the continuous schedule it also
splits each block's pulls and installs into floor and extra ones, and counts the steps in which
something stopped extra pulls (:class:`ExtraLimits`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from asteria_client.runtime.blocks import (
    DRIFT_INTERVAL_STEPS,
    BlockRecord,
    BlockRecords,
    RequestFn,
)
from asteria_client.runtime.source import PreconditionerRequest, PreconditionerResult
from asteria_client.runtime.transfer import DeviceTransfer, PendingCopy
from asteria_server.types import SolveKind

#: Random columns of the basis each drift estimate looks at.
DRIFT_PROBES = 4
#: Seconds a solve costs besides its n³ work (hand-over, result, install): `asteria bench
#: throughput` measured 3-6 ms of result overhead per solve at n = 256-512. Without it a tiny
#: block would look hundreds of times cheaper than it is and crowd out the large ones.
SOLVE_OVERHEAD_S = 3e-3
#: The floor's phases weigh a block's work as n³ plus this, SOLVE_OVERHEAD_S in units of n³
#: (an n = 512 eigh took ~30 ms on these machines, so 3 ms is the n³ of n ≈ 240): without it
#: a phase would take dozens of small blocks for each large one, and their copies and hand-overs.
FLOOR_BASE_N3 = 240.0**3


class DeviceGenerators:
    """One random generator per device, each seeded with ``seed``: a draw for a device tensor
    is made on that device (a draw on the CPU copied over would make the host wait)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._by_device: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        generator = self._by_device.get(device)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            self._by_device[device] = generator
        return generator


def estimate_drift(
    factor: torch.Tensor,
    basis: torch.Tensor | None,
    generator: torch.Generator,
    probes: int = DRIFT_PROBES,
) -> torch.Tensor:
    """The off-diagonal energy of ``QᵀLQ`` over ``‖L‖²_F`` (0: Q diagonalizes L), estimated
    from ``probes`` random columns of Q (the identity when ``basis`` is None). A 0-d tensor on
    the factor's device, in [0, 1] like the exact value (a sample can overshoot: it is cut).

    ``generator`` is on the factor's device (:class:`DeviceGenerators`): the columns are the
    ``k`` largest of ``n`` uniform keys drawn there — a uniform ``k``-subset, as the first
    ``k`` of a random permutation are, with no host involved."""
    n = factor.shape[0]
    k = min(probes, n)
    keys = torch.rand(n, generator=generator, device=factor.device)
    index = keys.topk(k, sorted=False).indices
    if basis is None:  # the columns of the identity: L's own columns, no product
        lq = factor.index_select(1, index)
        rayleigh = lq[index, torch.arange(k, device=factor.device)]
        off_diagonal = lq.square().sum() - rayleigh.square().sum()
    else:
        columns = basis.index_select(1, index).to(factor.dtype)
        lq = factor @ columns
        rayleigh = (columns * lq).sum(dim=0)
        off_diagonal = (lq - columns * rayleigh).square().sum()
    # ‖L‖²_F without an n x n temporary (a new one per estimate cost page faults at n >= 512)
    total = torch.linalg.vector_norm(factor).square()
    # total = 0 means L = 0, whose off-diagonal energy is 0: the clamp keeps 0 / tiny = 0.
    return (off_diagonal * (n / k) / total.clamp_min(1e-30)).clamp(0.0, 1.0)


@dataclass
class ExtraLimits:
    """Steps of the continuous schedule in which something stopped extra pulls while a block
    could have been pulled: ``credit`` (every worker busy or spoken for), ``overhead_budget``
    (the step's refresh budget was spent), ``no_pull_point`` (no hooks attached, and the step
    end found a worker free: it may have waited since its last result for the step end, the
    only pull point). A step may count under several."""

    credit: int = 0
    overhead_budget: int = 0
    no_pull_point: int = 0
    steps: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "credit": self.credit,
            "overhead_budget": self.overhead_budget,
            "no_pull_point": self.no_pull_point,
            "steps": self.steps,
        }


class RefreshLog:
    """Installs and drift at install per block, kept in the blocks' records (``blocks``:
    the runtime's :class:`~.blocks.BlockRecords`); see the module docstring."""

    def __init__(
        self, seed: int = 0, *, continuous: bool = False, blocks: BlockRecords | None = None
    ) -> None:
        self.blocks = BlockRecords() if blocks is None else blocks
        self.generators = DeviceGenerators(seed)
        self.step = 0
        self.continuous = continuous
        self.extra_limits = ExtraLimits()

    def record_step(self, entry: BlockRecord, step: int) -> None:
        if entry.first_step is None:
            entry.first_step = step
        if step > self.step:
            self.step = step

    def record_install(
        self, entry: BlockRecord, request: PreconditionerRequest | None, version: int | None = None
    ) -> bool:
        """Count an install; ``request`` (the block's factor and the basis about to be
        replaced, uncopied) gives the drift at install, for a computed basis only (not the
        identity a tile starts in), sampled: at most one install per block every
        :data:`DRIFT_INTERVAL_STEPS` steps is measured (measuring each of the 15 installs a
        step of continuous refresh makes cost 3% of the step), so the reported drift at
        install is the mean over the sampled installs. Returns whether the installed
        ``version`` was a floor snapshot's."""
        entry.installs += 1
        floor = False
        if version is not None and entry.floor_versions:
            floor = version in entry.floor_versions
            entry.floor_installs += floor
            entry.floor_versions = [v for v in entry.floor_versions if v > version]
        if request is None or request.kind is not SolveKind.EIGENBASIS or request.basis is None:
            return floor
        if not self.wants_drift(entry):
            return floor
        entry.drift_step = self.step
        with torch.no_grad():
            generator = self.generators.on(request.matrix.device)
            drift = estimate_drift(request.matrix, request.basis, generator)
        entry.drift_sum = drift if entry.drift_sum is None else entry.drift_sum + drift
        entry.drift_count += 1
        entry.last_drift = drift
        return floor

    def wants_drift(self, entry: BlockRecord) -> bool:
        """Whether the next install of the block is one whose drift is sampled (the caller
        need not build its request otherwise)."""
        return entry.drift_step is None or self.step - entry.drift_step >= DRIFT_INTERVAL_STEPS

    def record_pull(self, entry: BlockRecord, version: int, *, floor: bool = False) -> None:
        entry.pulls += 1
        if floor:
            entry.floor_pulls += 1
            entry.floor_versions.append(version)

    def rows(self) -> dict[str, dict[str, Any]]:
        """Per block that stepped or was pulled: installs, refreshes per 100 steps, mean and
        last drift at install."""
        out = {}
        for block, entry in sorted(self.blocks.items()):
            if entry.first_step is None and not (entry.installs or entry.pulls):
                continue
            steps = self.step - (entry.first_step or 0) + 1 if entry.first_step else 0
            mean = last = None
            if entry.drift_count and entry.drift_sum is not None and entry.last_drift is not None:
                mean = float(entry.drift_sum) / entry.drift_count
                last = float(entry.last_drift)
            row = {
                "installs": entry.installs,
                "pulls": entry.pulls,
                "steps": steps,
                "refreshes_per_100_steps": 100.0 * entry.installs / steps if steps else 0.0,
                "drift_at_install_mean": mean,
                "drift_at_install_last": last,
            }
            if self.continuous:
                extra = entry.installs - entry.floor_installs
                row.update(
                    floor_pulls=entry.floor_pulls,
                    extra_pulls=entry.pulls - entry.floor_pulls,
                    floor_installs=entry.floor_installs,
                    extra_installs=extra,
                    floor_per_100_steps=100.0 * entry.floor_installs / steps if steps else 0.0,
                    extra_per_100_steps=100.0 * extra / steps if steps else 0.0,
                )
            out[block] = row
        return out

    def summary(self) -> dict[str, Any]:
        rows = self.rows()
        rates = [r["refreshes_per_100_steps"] for r in rows.values()]
        drifts = [r["drift_at_install_mean"] for r in rows.values()]
        drifts = [d for d in drifts if d is not None]
        out: dict[str, Any] = {
            "refreshes_per_100_steps_mean": _mean(rates),
            "refreshes_per_100_steps_min": min(rates) if rates else None,
            "refreshes_per_100_steps_max": max(rates) if rates else None,
            "drift_at_install_mean": _mean(drifts),
        }
        if self.continuous:
            out["floor_per_100_steps_mean"] = _mean(
                [r["floor_per_100_steps"] for r in rows.values()]
            )
            out["extra_per_100_steps_mean"] = _mean(
                [r["extra_per_100_steps"] for r in rows.values()]
            )
            out["floor_installs_mean"] = _mean([r["floor_installs"] for r in rows.values()])
            out["extra_installs_mean"] = _mean([r["extra_installs"] for r in rows.values()])
            out["extra_limited_steps"] = self.extra_limits.as_dict()
        out["blocks"] = rows
        return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def assign_floor_phases(new: list[BlockRecord], every: Iterable[BlockRecord]) -> None:
    """Give each of ``new`` a floor phase in ``[0, f)`` (f: its ``floor_steps``), so that the
    solve work of the floor's snapshots is spread evenly over the f steps: each block, largest
    first (ties by name), goes to the phase of its f with the least work assigned so far
    (:func:`_lightest_phase`). A block's work is ``n³ + FLOOR_BASE_N3``: a fixed stand-in for
    the solve's cost that every rank computes alike (the calibrated cost is measured, so it
    differs between ranks). The blocks of ``every`` already phased for that f count too.

    What it depends on — the blocks' names, sizes and f, and which blocks came at which step
    — is the same on every replica of a model, so every rank picks the same phases (nothing
    here is timed, calibrated or hashed by Python's randomized ``hash``)."""
    loads: dict[int, list[float]] = {}
    for entry in every:
        frequency = entry.floor_steps
        if frequency is None or entry.floor_phase is None or entry.floor_phase_steps != frequency:
            continue
        load = loads.setdefault(frequency, [0.0] * frequency)
        load[entry.floor_phase] += _floor_weight(entry)
    for entry in sorted(new, key=lambda e: (-e.size, e.name)):
        frequency = entry.floor_steps
        assert frequency is not None and frequency >= 1
        load = loads.setdefault(frequency, [0.0] * frequency)
        phase = _lightest_phase(load)
        load[phase] += _floor_weight(entry)
        entry.floor_phase, entry.floor_phase_steps = phase, frequency


def _floor_weight(entry: BlockRecord) -> float:
    return float(entry.size) ** 3 + FLOOR_BASE_N3


def _lightest_phase(load: list[float]) -> int:
    """The phase with the least load; among several, the one farthest (around the cycle) from
    every phase loaded more, then the lowest: phase 0 (the amortized schedule's steps) first,
    then f/2, f/4, 3f/4, …, so a few blocks of a large f are spread over it, not crowded into
    its first steps."""
    frequency = len(load)
    least = min(load)
    ties = [p for p in range(frequency) if load[p] == least]
    above = [p for p in range(frequency) if load[p] > least]
    if not above:
        return ties[0]

    def distance(p: int) -> int:
        return min(min((p - q) % frequency, (q - p) % frequency) for q in above)

    return min(ties, key=lambda p: (-distance(p), p))


@dataclass
class ContinuousScheduler:
    """Picks the blocks to snapshot when the source has credit (see the module docstring).
    Its state of each block is in the block's record (``records``: the runtime's; its own
    when used alone); ``candidates`` are the records of the blocks offered so far."""

    seconds_per_n3: float
    records: BlockRecords = field(default_factory=BlockRecords)
    generators: DeviceGenerators = field(default_factory=lambda: DeviceGenerators(1))
    candidates: dict[str, BlockRecord] = field(default_factory=dict)
    #: candidates whose drift_unread is set, each once (a source without a credit limit never
    #: measures, so nothing else would bound this list)
    unread: list[BlockRecord] = field(default_factory=list)
    #: drift estimates on their way to the host: the candidates, how many of them came with
    #: an installed result, and the copy (read by the first choice after it landed)
    reading: list[tuple[list[BlockRecord], int, PendingCopy]] = field(default_factory=list)
    transfer: DeviceTransfer = field(default_factory=DeviceTransfer)
    #: ``(block, n) -> whether this rank chooses the block's extra pulls`` (replicas: its
    #: owner alone; asked once per block, when first offered)
    chooses: Callable[[str, int], bool] = field(default=lambda block, n: True)

    def offer(self, tile: Any, version: int, request: RequestFn) -> None:
        """The tile's factors now hold step ``version``: its blocks may be pulled."""
        for dim, block in tile.preconditioned():
            entry = self.candidates.get(block)
            if entry is None or entry.tile is not tile:
                # a block new to the schedule, or a new tile in its place (a checkpoint
                # load): what was known of the old tile's basis and factor does not hold
                entry = self.records.at(tile, dim, block)
                n = request(dim, version).matrix.shape[0]
                entry.cost_s = SOLVE_OVERHEAD_S + self.seconds_per_n3 * n**3
                entry.drift, entry.drift_version, entry.drift_basis = math.inf, -1, -1
                entry.drift_unread, entry.drift_reading = None, False
                entry.pulled_version, entry.pulled_norm2 = -1, None
                entry.floor_steps, entry.floor_version = None, -1
                entry.chooser = self.chooses(block, n)
                entry.claimed, entry.claim_reported = -1, False
                entry.floor_phase, entry.floor_phase_steps, entry.size = None, 0, n
                self.candidates[block] = entry
            entry.request = request
            entry.offered = version

    def floor_snapshot(self, entry: BlockRecord, version: int) -> bool:
        """Whether the block's snapshot at ``version`` was a floor snapshot."""
        return version >= 0 and entry.floor_version == version

    def floor_due(self) -> list[BlockRecord]:
        """The blocks whose floor is due (see :meth:`BlockRecord.floor_due`), by name; blocks
        without a phase for their f get one first (:func:`assign_floor_phases`)."""
        unphased = [
            c
            for c in self.candidates.values()
            if c.floor_steps is not None and c.floor_phase_steps != c.floor_steps
        ]
        if unphased:
            assign_floor_phases(unphased, self.candidates.values())
        return sorted((c for c in self.candidates.values() if c.floor_due()), key=lambda c: c.name)

    def pullable(self) -> int:
        """How many blocks an extra pull could take now."""
        return sum(1 for c in self.candidates.values() if c.pullable())

    def pulled(
        self, entry: BlockRecord, request: PreconditionerRequest, *, floor: bool = False
    ) -> None:
        """A snapshot of the block was taken (a floor one: ``floor``): keep its ‖L‖²_F (no
        host read) for :meth:`installed`."""
        if floor:
            entry.floor_version = request.version
        if request.kind is not SolveKind.EIGENBASIS:
            return
        entry.pulled_version = request.version
        entry.pulled_norm2 = torch.linalg.vector_norm(request.matrix).square()

    def installed(self, entry: BlockRecord, result: PreconditionerResult) -> None:
        """``result`` goes into use: its drift against the snapshot it was computed from
        comes with it. The result's eigenvalue estimates are ``diag(QᵀLQ)`` of that snapshot
        (exact eigenvalues for a full eigh), and ``‖QᵀLQ‖_F = ‖L‖_F`` for an orthonormal Q,
        so its off-diagonal energy is ``‖L‖²_F - Σ diag²`` — no probe, no product. The next
        estimate is due :data:`DRIFT_INTERVAL_STEPS` steps later, when the factor has moved."""
        norm2, entry.pulled_norm2 = entry.pulled_norm2, None
        if norm2 is None or result.version != entry.pulled_version or result.eigenvalues is None:
            return
        estimates = result.eigenvalues.to(norm2.device, norm2.dtype)
        off_diagonal = norm2 - estimates.square().sum()
        if entry.drift_unread is None:  # listed once until read: bounded by the blocks
            self.unread.append(entry)
        entry.drift_unread = (off_diagonal / norm2.clamp_min(1e-30)).clamp(0.0, 1.0)
        entry.drift_version = result.version
        entry.drift_basis = result.version

    def choose(self, credit: int | None) -> list[BlockRecord]:
        """The blocks to pull now, best first: all pullable ones when ``credit`` is None
        (a source without limit), else at most ``credit``."""
        if credit is not None and credit <= 0:
            return []
        ready = [c for c in self.candidates.values() if c.pullable()]
        if credit is None or len(ready) <= credit:
            return sorted(ready, key=lambda c: c.name)
        self._read_landed()
        self._measure([c for c in ready if c.drift_stale() and not c.drift_reading])
        ready.sort(key=lambda c: (-c.priority(), c.name))
        return ready[:credit]

    def _read_landed(self) -> None:
        """Take in the drift estimates whose copy to the host has landed (never waits: one
        still in flight is read by a later choice; on CPU the copy is done at once)."""
        still = []
        for measured, unread, copy in self.reading:
            if not copy.ready():
                still.append((measured, unread, copy))
                continue
            copy.wait()  # returns at once: only completes a bounce, if any
            read = copy.host.numpy().tolist()  # host memory: no device read here
            for entry, value in zip(measured[:unread], read[:unread], strict=True):
                entry.drift = float(value)  # versions set when the result was installed
                entry.drift_reading = False
            for entry, value in zip(measured[unread:], read[unread:], strict=True):
                entry.drift = float(value)
                entry.drift_version, entry.drift_basis = entry.drift_reading_versions
                entry.drift_reading = False
        self.reading = still

    def _measure(self, stale: list[BlockRecord]) -> None:
        """New drift estimates for ``stale``, sent to the host with those that came with
        installed results (:meth:`installed`): one copy on the transfer layer's side stream,
        read by :meth:`_read_landed` (at once on CPU; on a device by the first choice after
        the copy landed, so no choice waits for the device)."""
        measured, values = [], []
        for entry in self.unread:
            if entry.drift_unread is not None:
                measured.append(entry)
                values.append(entry.drift_unread)
                entry.drift_unread = None
        self.unread.clear()
        unread = len(measured)
        with torch.no_grad():
            for entry in stale:
                installed = entry.version
                if installed < 0 or entry.request is None:
                    continue  # no basis yet: first in line anyway
                request = entry.request(entry.dim, entry.offered)
                if request.kind is not SolveKind.EIGENBASIS:
                    continue
                measured.append(entry)
                generator = self.generators.on(request.matrix.device)
                values.append(estimate_drift(request.matrix, request.basis, generator))
                entry.drift_reading_versions = (entry.offered, installed)
        if not measured:
            return
        for entry in measured:
            entry.drift_reading = True
        device = values[0].device
        stacked = torch.stack([v.to(device) for v in values])
        self.reading.append((measured, unread, self.transfer.to_host(stacked)))
        self._read_landed()
