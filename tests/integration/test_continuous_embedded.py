"""Continuous refresh on the real embedded engine: real worker processes, real copies."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from asteria_client import SOAP, KLShampoo
from asteria_server.engine import EngineConfig


def _copies(opt: SOAP) -> int:
    """Tensors copied to the host (a step's snapshots leave in one pack: count what it holds)."""
    return int(opt.source.stats()["transfer"]["tensors_to_host"])  # type: ignore[attr-defined]


def _busy(opt: SOAP) -> bool:
    stats = opt.source.engine.stats()  # type: ignore[attr-defined]
    return bool(stats.workers_busy >= stats.num_workers)


def test_no_snapshot_is_copied_while_every_worker_is_busy() -> None:
    """One worker stuck on a solve (a real hang in the worker, killed at its timeout): the steps
    taken meanwhile copy no factor, though the other blocks' factors move (no floor is due at
    f = 1000, so every pull would be an extra one, by credit). Once the worker is back, pulls
    resume and every block gets its basis."""
    gen = torch.Generator().manual_seed(0)
    params = {
        "ahang-once:w": torch.nn.Parameter(torch.randn(6, 6, generator=gen)),
        "b": torch.nn.Parameter(torch.randn(6, 6, generator=gen)),
        "c": torch.nn.Parameter(torch.randn(6, 6, generator=gen)),
    }
    config = EngineConfig(
        num_workers=1,
        calibrate=False,
        test_fault_prefix="a",
        solve_timeout_s=4.0,
        max_worker_attempts=2,
    )
    opt = SOAP(
        list(params.items()),
        mode="embedded",
        refresh="continuous",
        staleness_budget=1000,  # no barrier: this test is about copies
        precondition_frequency=1000,  # after a block's first snapshot, extra pulls alone
        engine_config=config,
    )
    hang = {"on": False}

    def step() -> None:
        for name, p in params.items():
            # without a gradient a parameter takes no step: the hanging one starts later
            p.grad = torch.randn(6, 6, generator=gen) if hang["on"] or name[0] != "a" else None
        opt.step()

    try:
        rows = step_until_every_block_has_a_result(opt, step, 60.0)  # b and c's 4 blocks
        assert len(rows) == 4 and all(r["version"] >= 0 for r in rows), rows
        hang["on"] = True
        before = _copies(opt)
        step()  # the hanging parameter's first step: its 2 blocks by the floor; one hangs
        assert _copies(opt) >= before + 2
        busy_steps = 0
        for _ in range(40):
            before = _copies(opt)
            busy_before = _busy(opt)
            step()
            if busy_before and _busy(opt):
                busy_steps += 1
                assert _copies(opt) == before, "a snapshot was copied while the worker was busy"
            time.sleep(0.02)
        assert busy_steps >= 10, f"only {busy_steps} steps saw the worker busy"
        extra = opt.refresh_stats()["extra_limited_steps"]
        assert extra["credit"] >= 10, extra  # b and c waited for the worker
        rows = step_until_every_block_has_a_result(opt, step, 60.0)
    finally:
        opt.close()
    assert len(rows) == 6 and all(r["version"] >= 0 for r in rows), rows
    assert _copies(opt) > 6


def step_until_every_block_has_a_result(
    opt: Any, step: Callable[[], None], timeout_s: float
) -> list[dict[str, Any]]:
    """Train with ``step`` until every block has a result (or ``timeout_s`` passes); returns
    the optimizer's status rows."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        step()
        if all(r["version"] >= 0 for r in opt.preconditioner_status()):
            break
        time.sleep(0.05)
    rows: list[dict[str, Any]] = opt.preconditioner_status()
    return rows


def check_continuous_trains_within_its_budget(optimizer: type, **mode: Any) -> dict[str, Any]:
    """Train a small MLP 40 steps with ``optimizer`` continuous at S=1 in ``mode`` (the
    optimizer's mode arguments): every block is refreshed more than once, no block is used with
    a snapshot in flight for more than its budget (1 step; 5 for a floor snapshot at f = 5),
    versions only grow, the loss falls. Returns the source's stats."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    opt = optimizer(
        model.named_parameters(), refresh="continuous", staleness_budget=1, lr=1e-2, **mode
    )
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=gen), torch.randn(64, 8, generator=gen)
    versions: dict[str, list[int]] = {}
    losses = []
    try:
        if mode.get("mode") == "daemon":
            assert opt.source.wait_connected(30.0)
        for _ in range(40):
            opt.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            for row in opt.preconditioner_status():
                versions.setdefault(row["block"], []).append(row["version"])
        stats = opt.runtime_stats()
        source_stats: dict[str, Any] = opt.source.stats()
    finally:
        opt.close()
    assert stats["refresh"] == "continuous"
    # S = 1 step for an extra snapshot, S * f = 5 for a floor one (the amortized budget)
    assert stats["max_lag_steps"] <= 5
    for block, seen in versions.items():
        assert seen == sorted(seen), f"{block}: version went back: {seen}"
        assert seen[-1] > 1, f"{block} never refreshed after its first basis: {seen}"
    refreshes = stats["refreshes"]
    assert refreshes["refreshes_per_100_steps_mean"] > 0
    assert all(r["installs"] >= 2 for r in refreshes["blocks"].values())
    assert losses[-1] < 0.9 * losses[0], (optimizer.__name__, losses[0], losses[-1])
    return source_stats


def test_embedded_continuous_trains_within_its_budget() -> None:
    """SOAP and KL-Shampoo, continuous at S=1 on the engine (see the check)."""
    for optimizer in (SOAP, KLShampoo):
        check_continuous_trains_within_its_budget(
            optimizer,
            mode="embedded",
            engine_config=EngineConfig(num_workers=1, calibrate=False),
        )
