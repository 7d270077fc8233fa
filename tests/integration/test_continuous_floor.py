"""The continuous schedule's floor on the real embedded engine: real worker processes, no hooks.

Without ``attach(model)`` the continuous schedule's only pull point is the step end, where the
credit (free workers + 1) let one worker take two snapshots a step: a model of 38 blocks was
refreshed far less often than the amortized schedule at the same f (issue 30). The floor
snapshots every block at least every f steps, as the amortized schedule does (spread over the f
steps: each block at the steps of its own phase); these tests count what was snapshotted and
installed, per block, on a model of 24 blocks and one solver worker.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from asteria_client import SOAP
from asteria_client.runtime.source import PreconditionerResult
from asteria_server.engine import EngineConfig

FREQUENCY = 5
BUDGET = 1  # S: refresh intervals on the amortized schedule (and for floor snapshots)
STEPS = 41
LAYERS = 12  # Linear(6, 6) each: 2 blocks a layer
#: The rest of a training step (a model's forward and backward), so that one worker solves a
#: round of 24 tiny blocks well within f steps, as it does beside a real model: without it the
#: steps take a millisecond, and on either schedule a snapshot is replaced by the next before
#: it is solved. No assertion is on time.
STEP_REST_S = 0.05


class CountingSOAP(SOAP):
    """SOAP that records, per block, the step of each install and the version in use after
    each step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_count = 0
        self.installs: dict[str, list[tuple[int, int]]] = {}  # block -> [(step, version)]
        self.in_use: dict[str, list[int]] = {}  # block -> version in use after each step
        #: block -> the steps at which the floor snapshotted it (continuous schedule)
        self.floor_steps: dict[str, list[int]] = {}
        self._floor_pulls: dict[str, int] = {}

    def _install(self, tile: Any, dim: int, result: PreconditionerResult) -> None:  # type: ignore[override]
        self.installs.setdefault(tile.blocks[dim], []).append((self.step_count, result.version))
        SOAP._install(tile, dim, result)

    def step(self, closure: Any = None) -> Any:
        self.step_count += 1
        loss = super().step(closure)
        for row in self.preconditioner_status():
            self.in_use.setdefault(row["block"], []).append(row["version"])
        if self.runtime.continuous:
            for block, row in self.refresh_stats()["blocks"].items():
                if row["floor_pulls"] > self._floor_pulls.get(block, 0):
                    self.floor_steps.setdefault(block, []).append(self.step_count)
                self._floor_pulls[block] = row["floor_pulls"]
        return loss


def _wait_for_workers(opt: SOAP, timeout_s: float = 60.0) -> None:
    """Until the engine's worker process has started: the first snapshots of both schedules
    are then solved alike, not replaced while a process starts."""
    engine = opt.source.engine  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    while any(w.state == "starting" for w in engine.stats().workers):
        assert time.monotonic() < deadline, "the engine's worker did not start"
        time.sleep(0.02)


def _train(**options: Any) -> CountingSOAP:
    """STEPS steps of a 12-layer MLP (24 blocks of 6 x 6) on one solver worker, no hooks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(LAYERS)))
    opt = CountingSOAP(
        model.named_parameters(),
        mode="embedded",
        engine_config=EngineConfig(num_workers=1, calibrate=False),
        precondition_frequency=FREQUENCY,
        staleness_budget=BUDGET,
        lr=1e-3,
        **options,
    )
    gen = torch.Generator().manual_seed(1)
    try:
        _wait_for_workers(opt)
        for _ in range(STEPS):
            x = torch.randn(16, 6, generator=gen)
            opt.zero_grad()
            model(x).square().mean().backward()
            time.sleep(STEP_REST_S)
            opt.step()
    finally:
        opt.close()
    return opt


def test_floor_refreshes_every_block_every_f_steps_without_hooks_or_budget() -> None:
    """A refresh budget too small for any extra pull, no hooks: every block is still
    snapshotted every f steps and used with a basis no older than the amortized schedule's
    bound (a snapshot at most f - 1 steps before the step's start, lagging by at most S*f: a
    version at least step - (S + 1) * f), so it installs at least the amortized schedule's
    count; none of it is an extra refresh."""
    opt = _train(refresh="continuous", refresh_overhead=1e-6)
    blocks = opt.in_use
    assert len(blocks) == 2 * LAYERS
    bound = (BUDGET + 1) * FREQUENCY
    for block, versions in blocks.items():
        for step, version in enumerate(versions, start=1):
            if step > bound:
                assert step - version <= bound, (block, step, versions)
    # floor snapshots at step 1, then at each step of the block's phase (one in every f
    # steps); each but the last is solved before the next one
    for block, installs in opt.installs.items():
        floor = opt.floor_steps[block]
        gaps = [b - a for a, b in itertools.pairwise(floor)]
        assert floor[0] == 1 and max(gaps) <= FREQUENCY, (block, floor)
        assert STEPS - floor[-1] < FREQUENCY, (block, floor)
        versions = {version for _, version in installs}
        assert versions >= set(floor[:-1]), (block, floor, installs)
    # spread: after the first f + 1 steps no step takes more than its share of the floor (in
    # steps 2 to f + 1 a block whose step-1 result was not in yet at its phase's step is
    # snapshotted at step f + 1 instead, beside phase 0's blocks)
    per_step = [sum(step in f for f in opt.floor_steps.values()) for step in range(1, STEPS + 1)]
    share = -(-2 * LAYERS // FREQUENCY)
    assert per_step[0] == 2 * LAYERS and max(per_step[FREQUENCY + 1 :]) <= share, per_step
    stats = opt.refresh_stats()
    rows = stats["blocks"]
    slots = len(range(1, STEPS + 1, FREQUENCY))  # 1 + one step of each phase in steps 2-41
    assert all(r["floor_pulls"] == slots for r in rows.values()), rows
    assert all(r["extra_pulls"] == 0 for r in rows.values()), rows
    assert all(r["floor_installs"] == r["installs"] for r in rows.values()), rows
    limits = stats["extra_limited_steps"]
    # what stopped the extras: the step end's floor share queued ahead of them (credit) or
    # the tiny budget, and the lack of any other pull point
    assert limits["credit"] + limits["overhead_budget"] > 0, limits
    assert limits["no_pull_point"] > 0, limits
    assert not stats["hooks_attached"]


def test_continuous_without_attach_installs_at_least_what_amortized_does() -> None:
    """The same model, batches and f, no hooks: continuous refresh (its default overhead
    budget) installs at least as many results per block as the amortized schedule.

    Results snapshotted at the last step are not counted on either side: one is installed only
    if its solve beats that same step's apply, a race between two runs that says nothing about
    the schedule (in CI one amortized block once won it and its continuous twin did not)."""
    amortized = _train()
    continuous = _train(refresh="continuous")
    assert set(continuous.installs) == set(amortized.installs)
    assert len(amortized.installs) == 2 * LAYERS

    def counted(installs: list[tuple[int, int]]) -> int:
        return sum(version < STEPS for _, version in installs)

    # the amortized schedule snapshots at steps 1, 1 + f, ...; its budget brings in every one
    # taken (S + 1) * f steps or more before the end
    guaranteed = len(range(1, STEPS - (BUDGET + 1) * FREQUENCY + 1, FREQUENCY))
    assert all(counted(i) >= guaranteed for i in amortized.installs.values()), amortized.installs
    short = {
        block: (counted(continuous.installs[block]), counted(installs))
        for block, installs in amortized.installs.items()
        if counted(continuous.installs[block]) < counted(installs)
    }
    assert not short, f"continuous installed fewer results than amortized: {short}"
