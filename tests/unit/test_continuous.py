"""The continuous refresh schedule: budget, versions, credit, priority, and equality with native.

The sources here are real native sources (torch.linalg in the test process) that release each
result only after a chosen number of steps and model a pool of solver workers, so the schedule
meets random solve delays without a clock; tests/integration/test_continuous_embedded.py runs
the same schedule on the real embedded engine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria_client import SOAP, KLShampoo, Shampoo
from asteria_client.optim.tensor_ops import project
from asteria_client.runtime import TileBlocks
from asteria_client.runtime.refresh import ContinuousScheduler, estimate_drift
from asteria_client.runtime.source import (
    NativeSource,
    PreconditionerRequest,
    PreconditionerResult,
    compute_locally,
)
from asteria_client.runtime.staleness import Refresh, StalenessPolicy
from asteria_server.errors import InvalidInputError
from asteria_server.types import SolveKind


class InstantSource(NativeSource):
    """Solves in ``submit`` (instantaneous solves), but is treated as asynchronous."""

    synchronous = False


@dataclass
class _Job:
    request: PreconditionerRequest
    result: PreconditionerResult
    steps_left: int  # steps of work left; starts when a worker takes it
    running: bool = False


class DelayedSource(NativeSource):
    """``num_workers`` simulated solver workers: a job takes the next delay from ``delays`` (in
    steps; the test calls :meth:`tick` once a step), queued jobs wait for a free worker, and a
    result is ready only when its job is done. Like the engine's dispatcher, workers take jobs
    between steps (at a tick), not inside ``submit``. The math is the real native solve.
    ``wait`` (the barrier) finishes the job it waits for at once. Logs each block's snapshot
    versions, and the (block, version) of each submit made without credit."""

    synchronous = False

    def __init__(self, num_workers: int, delays: list[int]) -> None:
        super().__init__()
        self.num_workers = num_workers
        self.delays = delays or [0]
        self.jobs: list[_Job] = []
        self.submits = 0
        self.submits_without_credit = 0
        self.without_credit: list[tuple[str, int]] = []
        self.snapshots: dict[str, list[int]] = {}
        self.waits = 0

    def _busy(self) -> int:
        return sum(1 for j in self.jobs if j.running)

    def _queued(self) -> int:
        return sum(1 for j in self.jobs if not j.running)

    def credit(self) -> int | None:
        free = self.num_workers - self._busy()
        return 0 if free <= 0 else max(0, free + 1 - self._queued())

    def submit(self, request: PreconditionerRequest) -> None:
        credit = self.credit()
        if credit is not None and credit <= 0:
            self.submits_without_credit += 1
            self.without_credit.append((request.block, request.version))
        self.snapshots.setdefault(request.block, []).append(request.version)
        delay = self.delays[self.submits % len(self.delays)]
        self.submits += 1
        result = compute_locally(request)
        self.jobs.append(_Job(request, result, delay))  # a worker takes it at the next tick

    def _start(self) -> None:
        for job in self.jobs:
            if not job.running and self._busy() < self.num_workers:
                job.running = True

    def _finish(self, done: Any) -> None:
        while True:
            finished = [j for j in self.jobs if done(j)]
            if not finished:
                return
            for job in finished:
                self.jobs.remove(job)
                current = self._ready.get(job.request.block)
                if current is None or job.result.version > current.version:
                    self._ready[job.request.block] = job.result
            self._start()

    def tick(self) -> None:
        """One step of solver time passes: running jobs advance, free workers take queued
        jobs (a job of delay 0 is then done at once)."""
        for job in self.jobs:
            if job.running:
                job.steps_left -= 1
        self._start()
        self._finish(lambda job: job.steps_left <= 0 and job.running)

    def wait(self, block: str, min_version: int, timeout_s: float) -> PreconditionerResult | None:
        self.waits += 1
        mine = [j for j in self.jobs if j.request.block == block]
        if not any(j.request.version >= min_version for j in mine):
            return self.take(block)
        for job in mine:
            job.running = True  # the barrier waits for it: it is done now
        self._finish(lambda job: job in mine)
        result = self.take(block)
        return result if result is not None and result.version >= min_version else None

    def in_flight_version(self, block: str) -> int | None:
        versions = [j.request.version for j in self.jobs if j.request.block == block]
        return max(versions) if versions else None


def is_floor_snapshot(
    snapshots: list[int], version: int, frequency: int, phase: int | None
) -> bool:
    """Whether the snapshot at ``version`` in a block's ``snapshots`` (versions in order) is
    one the floor at ``frequency`` takes: the block's first, one at a step of its ``phase``
    (``(version - 1) % frequency == phase``), or one ``frequency`` steps or more after the one
    before (an extra pull never takes one such: the step end's floor comes first). Worked
    out here from the source's log, apart from the runtime's record of which were floor."""
    index = snapshots.index(version)
    if index == 0 or version - snapshots[index - 1] >= frequency:
        return True
    return phase is not None and (version - 1) % frequency == phase


def floor_phase(opt: Any, block: str, frequency: int) -> int | None:
    """The block's floor phase for ``frequency`` as the runtime assigned it (None: none)."""
    record = opt.runtime.records[block]
    return record.floor_phase if record.floor_phase_steps == frequency else None


class CheckedSOAP(SOAP):
    """SOAP that checks, at every use of a block, the budget and the version order: a floor
    snapshot (see :func:`is_floor_snapshot`, from the source's log) may be in flight S*f steps,
    an extra one S."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.installs: dict[str, list[int]] = {}
        self.violations: list[str] = []

    def _install(self, tile: Any, dim: int, result: PreconditionerResult) -> None:  # type: ignore[override]
        self.installs.setdefault(tile.blocks[dim], []).append(result.version)
        SOAP._install(tile, dim, result)

    def _sync_tile(self, tile: Any, step: int, group: dict[str, Any]) -> None:
        super()._sync_tile(tile, step, group)
        budget = self.staleness.budget_intervals
        frequency = int(group["precondition_frequency"])
        log = self.source.snapshots  # type: ignore[attr-defined]
        for dim, block in tile.preconditioned():
            newest, used = tile.submitted[dim], tile.versions[dim]
            phase = floor_phase(self, block, frequency)
            if newest > used and is_floor_snapshot(log[block], newest, frequency, phase):
                budget = self.staleness.budget_intervals * frequency
            if newest > used and step - newest > budget:
                self.violations.append(
                    f"step {step}: {block} uses v{used}, snapshot v{newest} in flight "
                    f"{step - newest} steps > S={budget}"
                )


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))


def _batches(n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(123)
    for _ in range(n):
        yield torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, tick: Any = None
) -> None:
    for x, y in _batches(steps):
        if tick is not None:
            tick()
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()


# --------------------------------------------------------------------------- equality with native
@pytest.mark.parametrize("optimizer", [SOAP, KLShampoo])
def test_instantaneous_solves_equal_native_every_step(optimizer: type) -> None:
    """With solves that finish at once, continuous refresh refreshes every block every step:
    the same trajectory as native mode at precondition_frequency=1."""
    native_model, cont_model = _model(), _model()
    native = optimizer(native_model.named_parameters(), mode="native", precondition_frequency=1)
    cont = optimizer(
        cont_model.named_parameters(),
        source=InstantSource(),
        refresh="continuous",
        staleness_budget=1,
    )
    _train(native_model, native, 25)
    _train(cont_model, cont, 25)
    for (name, a), (_, b) in zip(
        native_model.named_parameters(), cont_model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"parameter {name}")
    rows = cont.refresh_stats()["blocks"]
    assert rows and all(r["installs"] == 25 for r in rows.values())  # every step, every block


def test_instantaneous_continuous_differs_from_native_f10() -> None:
    """The equality above is not vacuous: amortized f=10 gives another trajectory."""
    native_model, cont_model = _model(), _model()
    native = SOAP(native_model.named_parameters(), mode="native", precondition_frequency=10)
    cont = SOAP(cont_model.named_parameters(), source=InstantSource(), refresh="continuous")
    _train(native_model, native, 25)
    _train(cont_model, cont, 25)
    diff = max(
        float((a - b).detach().abs().max())
        for a, b in zip(native_model.parameters(), cont_model.parameters(), strict=True)
    )
    assert diff > 1e-4


# ------------------------------------------------------------------ budget, versions, credit
@settings(max_examples=40, deadline=None)
@given(
    budget=st.integers(min_value=0, max_value=4),
    num_workers=st.integers(min_value=1, max_value=3),
    delays=st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=12),
    frequency=st.integers(min_value=1, max_value=6),
)
def test_continuous_keeps_budget_versions_credit_and_floor(
    budget: int, num_workers: int, delays: list[int], frequency: int
) -> None:
    """Over random solve delays and precondition frequencies f: a snapshot in flight is never
    used past its budget (S steps; S*f for a floor snapshot), versions only grow, only floor
    snapshots are copied without credit, and every block is snapshotted at step 1 and then at
    least every f steps (the floor)."""
    steps = 16
    model = _model()
    source = DelayedSource(num_workers, delays)
    opt = CheckedSOAP(
        model.named_parameters(),
        source=source,
        refresh="continuous",
        staleness_budget=budget,
        precondition_frequency=frequency,
    )
    _train(model, opt, steps, tick=source.tick)
    assert not opt.violations, opt.violations[:3]
    for block, versions in opt.installs.items():
        assert versions == sorted(set(versions)), f"{block}: installs {versions}"
    assert source.submits > 0
    for block, version in source.without_credit:
        phase = floor_phase(opt, block, frequency)
        assert is_floor_snapshot(source.snapshots[block], version, frequency, phase), (
            block,
            version,
        )
    assert len(source.snapshots) == 4
    for block, versions in source.snapshots.items():
        gaps = [b - a for a, b in itertools.pairwise(versions)]
        assert versions[0] == 1 and max(gaps, default=0) <= frequency, (block, versions)
        assert steps - versions[-1] < frequency, (block, versions)
    stats = opt.runtime_stats()
    assert stats["max_lag_steps"] <= budget * frequency
    assert stats["local_fallbacks"] == 0  # the barrier always had the job


def test_no_extra_snapshot_is_taken_while_every_worker_is_busy() -> None:
    """One worker on a 50-step solve: after the first step's floor (every block, as the
    amortized schedule's first step), the steps copy nothing while no floor is due (f = 1000);
    at f = 5 the floor keeps snapshotting every 5 steps, busy workers or not (latest wins)."""
    for frequency, submits in ((1000, 4), (5, 4 * 5)):
        model = _model()
        source = DelayedSource(1, [50])
        opt = SOAP(
            model.named_parameters(),
            source=source,
            refresh="continuous",
            staleness_budget=100,
            precondition_frequency=frequency,
        )
        _train(model, opt, 1, tick=source.tick)
        assert source.submits == 4  # the floor: every block at step 1, whatever the credit
        _train(model, opt, 20, tick=source.tick)  # steps 2-21: floor at 6, 11, 16, 21 (f=5)
        assert source.submits == submits, frequency
        stats = opt.refresh_stats()
        assert all(r["extra_pulls"] == 0 for r in stats["blocks"].values())


def test_floor_snapshots_are_spread_over_the_f_steps() -> None:
    """24 blocks of one size at f = 5 on one worker that keeps up (each solve done by the next
    step): after step 1 (every block, the first basis) no step end takes more floor snapshots
    than its share, ceil(24 / 5) = 5 (the amortized schedule's rule took all 24 every 5th
    step and none between), and each block is still snapshotted by the floor at least every
    f steps, to the last step."""
    frequency, steps, layers = 5, 31, 12
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(layers)))
    source = DelayedSource(1, [0])
    opt = SOAP(
        model.named_parameters(),
        source=source,
        refresh="continuous",
        staleness_budget=1,
        precondition_frequency=frequency,
        refresh_overhead=1e-6,
    )
    gen = torch.Generator().manual_seed(3)
    counts: list[int] = []  # floor snapshots per step
    floor_steps: dict[str, list[int]] = {}  # block -> the steps its floor snapshotted it
    before: dict[str, int] = {}
    for step in range(1, steps + 1):
        source.tick()
        opt.zero_grad()
        model(torch.randn(8, 6, generator=gen)).square().mean().backward()
        opt.step()
        rows = opt.refresh_stats()["blocks"]
        taken = 0
        for block, row in rows.items():
            new = row["floor_pulls"] - before.get(block, 0)
            before[block] = row["floor_pulls"]
            taken += new
            if new:
                floor_steps.setdefault(block, []).append(step)
        counts.append(taken)
    blocks = 2 * layers
    assert len(floor_steps) == blocks
    assert counts[0] == blocks, counts
    share = -(-blocks // frequency)
    assert max(counts[1:]) <= share, counts
    assert sum(counts[1 : 1 + frequency]) == blocks, counts  # each block once in steps 2-6
    for block, taken_at in floor_steps.items():
        gaps = [b - a for a, b in itertools.pairwise(taken_at)]
        assert taken_at[0] == 1 and max(gaps) <= frequency, (block, taken_at)
        assert steps - taken_at[-1] < frequency, (block, taken_at)


def test_unchecked_source_would_have_copied() -> None:
    """The credit check is what stops the copies: the same run on a source without a limit
    copies every block every step."""
    model = _model()
    source = InstantSource()
    opt = SOAP(model.named_parameters(), source=source, refresh="continuous")
    _train(model, opt, 5)
    rows = opt.refresh_stats()["blocks"]
    assert all(r["pulls"] == 5 for r in rows.values())


# --------------------------------------------------------------------------- priority
def test_fast_moving_blocks_are_refreshed_more_often() -> None:
    """Two equal-sized parameters, one worker that takes one block a step: the one whose
    gradient keeps turning is refreshed far more often than the one whose gradient is fixed
    (its factor keeps its eigenvectors; only its age raises it)."""
    torch.manual_seed(0)
    still = torch.nn.Parameter(torch.randn(6, 6))
    moving = torch.nn.Parameter(torch.randn(6, 6))
    source = DelayedSource(1, [1])
    opt = SOAP(
        [("still", still), ("moving", moving)],
        source=source,
        refresh="continuous",
        staleness_budget=4,
        lr=1e-3,
        precondition_frequency=1000,  # no floor after the first step: priority alone
        refresh_overhead=1.0,  # this source solves in submit: a step's worth of budget
    )
    fixed = torch.randn(6, 6)
    gen = torch.Generator().manual_seed(1)
    for _ in range(80):
        source.tick()
        still.grad = fixed.clone()
        moving.grad = torch.randn(6, 6, generator=gen)
        opt.step()
    rows = opt.refresh_stats()["blocks"]
    still_rate = sum(r["installs"] for b, r in rows.items() if b.startswith("still"))
    moving_rate = sum(r["installs"] for b, r in rows.items() if b.startswith("moving"))
    assert moving_rate > 3 * still_rate, rows


def test_drift_estimate_is_zero_for_the_eigenbasis_and_grows_with_rotation() -> None:
    torch.manual_seed(0)
    a = torch.randn(32, 32, dtype=torch.float64)
    factor = a @ a.T
    _, vectors = torch.linalg.eigh(factor)
    gen = torch.Generator().manual_seed(0)
    assert float(estimate_drift(factor, vectors, gen)) < 1e-20
    rotation, _ = torch.linalg.qr(torch.eye(32, dtype=torch.float64) + 0.05 * torch.randn(32, 32))
    small = float(estimate_drift(factor, vectors @ rotation, gen, probes=32))
    rotation2, _ = torch.linalg.qr(torch.eye(32, dtype=torch.float64) + 0.5 * torch.randn(32, 32))
    large = float(estimate_drift(factor, vectors @ rotation2, gen, probes=32))
    assert 0 < small < large <= 1.0
    # All n probes: the exact off-diagonal energy of Q^T L Q over ||L||^2.
    q = vectors @ rotation
    m = q.T @ factor @ q
    exact = float((m - torch.diag(m.diagonal())).square().sum() / factor.square().sum())
    assert small == pytest.approx(exact, rel=1e-9)
    # No basis: the identity's columns, read off L itself.
    identity = torch.eye(32, dtype=torch.float64)
    plain = float(estimate_drift(factor, None, torch.Generator().manual_seed(3), probes=5))
    eye = float(estimate_drift(factor, identity, torch.Generator().manual_seed(3), probes=5))
    assert 0 < plain == pytest.approx(eye, rel=1e-9)


# --------------------------------------------------------------------------- consistency, input
def test_kl_shampoo_takes_the_eigenvalues_of_the_basis_snapshot() -> None:
    """A KL-Shampoo basis installs with the eigenvalues of the factor snapshot it came from,
    not the factor's value when it arrives."""
    model = _model()
    source = DelayedSource(1, [3])
    opt = KLShampoo(
        model.named_parameters(), source=source, refresh="continuous", staleness_budget=5
    )
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = KLShampoo._install

    def install(tile: Any, dim: int, result: PreconditionerResult) -> None:
        original(tile, dim, result)
        assert result.eigenvalues is not None
        seen.append((tile.eigenvalues[dim].clone(), result.eigenvalues.clamp_min(0)))

    opt._install = install  # type: ignore[method-assign]
    _train(model, opt, 12, tick=source.tick)
    assert seen
    for installed, from_snapshot in seen:
        torch.testing.assert_close(installed, from_snapshot)


def test_soap_moments_are_rotated_in_the_step_a_basis_is_installed() -> None:
    """Each install moves SOAP's first moment into the new basis at once: expressed in the
    parameter's coordinates it is the same before and after (a basis installed without its
    rotation, or half-way, would change it)."""
    model = _model()
    source = DelayedSource(1, [2, 0, 3])
    opt = SOAP(model.named_parameters(), source=source, refresh="continuous", staleness_budget=3)
    checked = []
    original = SOAP._install

    def install(tile: Any, dim: int, result: PreconditionerResult) -> None:
        # a copy: an install writes the moments in place (into the tile group's storage), and
        # with no basis yet ``project`` returns the moment itself
        before = project(tile.exp_avg, tile.bases, back=True).clone()
        original(tile, dim, result)
        after = project(tile.exp_avg, tile.bases, back=True)
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-6)
        checked.append(tile.blocks[dim])

    opt._install = install  # type: ignore[method-assign]
    _train(model, opt, 20, tick=source.tick)
    assert len(checked) >= 8


def test_refresh_argument_is_checked() -> None:
    model = _model()
    with pytest.raises(InvalidInputError, match="refresh"):
        SOAP(model.named_parameters(), mode="native", refresh="sometimes")
    with pytest.raises(InvalidInputError, match="continuous"):
        Shampoo(model.named_parameters(), mode="native", refresh="continuous")


def test_continuous_runs_in_a_distributed_job(tmp_path: Any) -> None:
    """No longer refused in a torch.distributed job: each replicated block's owner chooses
    its extra pulls and the replicas register them together (the gloo tests in
    tests/distributed/test_continuous_replicas.py check that they stay bitwise equal)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = _model()
        opt = SOAP(model.named_parameters(), mode="embedded", refresh="continuous")
        try:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, model[0].in_features)).square().mean().backward()
                opt.step()
        finally:
            opt.close()
        SOAP(_model().named_parameters(), mode="native", refresh="continuous").close()
    finally:
        dist.destroy_process_group()


def test_continuous_budget_is_in_steps() -> None:
    policy = StalenessPolicy(budget_intervals=2, refresh=Refresh.CONTINUOUS)
    # extra snapshot of step 10 in flight: usable without it at steps 11 and 12, required at 13
    assert policy.required_version(10, 1, False, step=12) == -1
    assert policy.required_version(10, 1, False, step=13) == 10
    assert policy.lag_steps(10, 4, step=12) == 2
    assert policy.lag_steps(10, 10, step=12) == 0
    assert policy.budget_steps(1) == 2
    # a floor snapshot at f = 5 follows the amortized rule: a lag of S*f = 10 versions
    assert policy.required_version(10, 5, False, step=11, floor=True) == 0
    assert policy.required_version(15, 5, False, step=16, floor=True) == 5
    assert policy.budget_steps(5) == 10


# --------------------------------------------------------------------------- drift from results
def test_an_installed_result_brings_its_drift_against_its_snapshot() -> None:
    """A QR refresh's eigenvalue estimates are diag(Q^T L Q) of the snapshot it came from, so
    the scheduler takes the new basis's drift from them (‖L‖² - Σ diag²) instead of probing:
    it equals the exact off-diagonal energy of Q^T L Q over ‖L‖², and an install costs no
    drift estimate."""
    torch.manual_seed(0)
    a = torch.randn(12, 40, dtype=torch.float64)
    factor = a @ a.T
    _, vectors = torch.linalg.eigh(factor)
    turn, _ = torch.linalg.qr(torch.eye(12, dtype=torch.float64) + 0.3 * torch.randn(12, 12))
    basis = vectors @ turn  # a stale basis: a QR refresh improves it, not to exact
    request = PreconditionerRequest(
        block="w/tile0/dim0",
        version=7,
        kind=SolveKind.EIGENBASIS,
        matrix=factor,
        basis=basis,
        base_version=3,
    )
    result = compute_locally(request)
    assert result.eigenvalues is not None
    scheduler = ContinuousScheduler(seconds_per_n3=1e-9)
    tile = TileBlocks(blocks=["w/tile0/dim0"], versions=[3], submitted=[7])
    scheduler.offer(tile, 7, lambda dim, version: request)
    entry = scheduler.candidates["w/tile0/dim0"]
    scheduler.pulled(entry, request)
    scheduler.installed(entry, result)
    tile.versions[0] = 7
    assert not entry.drift_stale()  # known for the new basis: nothing to probe
    scheduler._measure([])
    q = result.matrix.to(torch.float64)
    m = q.T @ factor @ q
    exact = float((m - torch.diag(m.diagonal())).square().sum() / factor.square().sum())
    assert exact > 1e-6  # one power step does not diagonalize it: a real figure to match
    assert entry.drift == pytest.approx(exact, rel=1e-3, abs=1e-6)


# --------------------------------------------------------------------------- overhead budget
class SlowInstallSOAP(SOAP):
    """SOAP whose installs take 2 ms of the training thread (a large block's rotation)."""

    def _install(self, tile: Any, dim: int, result: PreconditionerResult) -> None:  # type: ignore[override]
        time.sleep(0.002)
        SOAP._install(tile, dim, result)


class HostSolvesSource(DelayedSource):
    """A :class:`DelayedSource` whose solver runs on this host (as an embedded engine's does),
    each of its solves reported as taking ``solve_s``."""

    def __init__(self, solve_s: float, *, on_this_host: bool = True) -> None:
        super().__init__(1, [0])
        self.solve_s = solve_s
        self.on_this_host = on_this_host

    def solves_on_this_host(self) -> bool:
        return self.on_this_host

    def take(self, block: str) -> PreconditionerResult | None:
        result = super().take(block)
        return None if result is None else replace(result, solve_time_s=self.solve_s)


def _hook_pulls(
    overhead: float, source: DelayedSource | None = None
) -> tuple[int, int, dict[str, Any]]:
    """Pulls made by hooks and by step ends in steps 3-12 (two step ends measure the step
    period first) of a model with four Linear layers, whose one (simulated) worker finishes
    every job by the next hook, with 2 ms installs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(4)))
    source = DelayedSource(1, [0]) if source is None else source
    opt = SlowInstallSOAP(
        model.named_parameters(),
        source=source,
        refresh="continuous",
        staleness_budget=2,
        refresh_overhead=overhead,
    )
    opt.attach(model)
    runtime = opt.runtime
    pulls = {"hook": 0, "step": 0, "steps_done": 0}
    real_pull = runtime.pull

    def counting_pull(install: Any, *, step_end: bool = False) -> int:
        n = real_pull(install, step_end=step_end)
        if pulls["steps_done"] >= 2:
            pulls["step" if step_end else "hook"] += n
        pulls["steps_done"] += step_end
        return n

    runtime.pull = counting_pull  # type: ignore[method-assign]
    real_pump = runtime.pump

    def ticking_pump(tiles: Any, install: Any) -> None:
        source.tick()  # the worker finished its job since the last signal
        real_pump(tiles, install)

    runtime.pump = ticking_pump  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(5)
    for _ in range(12):
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        time.sleep(0.01)  # the rest of a step: the budget is a share of the step period
        opt.step()
    return pulls["hook"], pulls["step"], opt.refresh_stats()


def test_hooks_pull_while_the_overhead_budget_lasts() -> None:
    """With the whole step as budget the hooks keep the free worker fed between steps; with
    a budget below one install they pull nothing, and the step ends pull the floor alone."""
    hook_free, step_free, _ = _hook_pulls(1.0)
    hook_tight, step_tight, stats = _hook_pulls(1e-6)
    assert hook_free >= 20, (hook_free, step_free)
    assert hook_tight == 0, (hook_tight, step_tight)
    # the step ends pulled the floor alone (steps 6 and 11 of 3-12 at f = 5: 8 blocks each)
    assert step_tight == 16, stats
    assert stats["extra_limited_steps"]["overhead_budget"] >= 9, stats


def test_solves_on_the_training_cores_are_charged_to_the_overhead_budget() -> None:
    """A CPU model whose solver shares its host: each extra refresh's solve (100 ms here, ten
    steps' budget) is charged when it is installed, and the steps after it owe it, so the hooks
    pull a few extras where a solver elsewhere lets them pull one at every signal. The floor
    is pulled all the same."""
    hook_elsewhere, step_elsewhere, _ = _hook_pulls(1.0, HostSolvesSource(0.1, on_this_host=False))
    hook_here, step_here, stats = _hook_pulls(1.0, HostSolvesSource(0.1))
    assert hook_elsewhere >= 20, (hook_elsewhere, step_elsewhere)
    assert hook_here <= 4, (hook_here, step_here, stats)
    assert step_here >= 16, stats  # the floor: steps 6 and 11 of 3-12 at f = 5, 8 blocks each
    assert stats["extra_limited_steps"]["overhead_budget"] >= 6, stats


def test_refresh_overhead_is_checked() -> None:
    model = _model()
    for bad in (0.0, -0.1, 1.5, True, "x"):
        with pytest.raises(InvalidInputError, match="refresh_overhead"):
            SOAP(model.named_parameters(), refresh="continuous", refresh_overhead=bad)


def test_unread_drifts_stay_bounded_without_a_credit_limit() -> None:
    """A source without a credit limit never needs a choice, so nothing reads the drifts that
    installed results bring: they are kept once per block, not once per install."""
    model = _model()
    opt = SOAP(model.named_parameters(), source=InstantSource(), refresh="continuous")
    _train(model, opt, 30)
    scheduler = opt.runtime._continuous
    assert scheduler is not None
    assert 0 < len(scheduler.unread) <= len(scheduler.candidates)
