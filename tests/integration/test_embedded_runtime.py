"""The embedded mode end to end: a real engine with real worker processes in the test process."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from asteria_client import SOAP, KLShampoo, Shampoo
from asteria_server.engine import EngineConfig

OPTIMIZERS = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}
FREQ = 3


def engine_config(**overrides) -> EngineConfig:  # type: ignore[no-untyped-def]
    return EngineConfig(num_workers=1, calibrate=False, **overrides)


def small_model() -> torch.nn.Module:
    """Square layers: a rectangular gradient leaves one factor rank-deficient, and the basis of
    its null space is arbitrary (LAPACK drivers pick different ones), so native and engine would
    legitimately diverge there."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(256, 8, generator=g), torch.randn(256, 8, generator=g)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, check=None) -> None:  # type: ignore[no-untyped-def]
    x, y = data()
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        if check is not None:
            check(opt)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_budget_zero_matches_native(name: str) -> None:
    cls = OPTIMIZERS[name]
    native_model, embedded_model = small_model(), small_model()
    native = cls(
        native_model.named_parameters(), lr=1e-2, precondition_frequency=FREQ, mode="native"
    )
    with cls(
        embedded_model.named_parameters(),
        lr=1e-2,
        precondition_frequency=FREQ,
        mode="embedded",
        staleness_budget=0,
        engine_config=engine_config(),
    ) as embedded:
        train(native_model, native, 8)
        train(embedded_model, embedded, 8)
        stats = embedded.runtime_stats()
    assert stats["local_fallbacks"] == 0 and stats["max_lag_steps"] == 0
    moved = False
    for p, q, p0 in zip(
        native_model.parameters(),
        embedded_model.parameters(),
        small_model().parameters(),
        strict=True,
    ):
        # Solver outputs agree to float32 rounding (LAPACK drivers differ); trajectories stay close.
        torch.testing.assert_close(q, p, rtol=1e-4, atol=2e-5)
        moved |= not torch.allclose(p, p0)
    assert moved


@pytest.mark.parametrize("budget", [1, 2])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_lag_never_exceeds_budget(name: str, budget: int) -> None:
    model = small_model()
    seen_lags: list[int] = []

    def check(opt) -> None:  # type: ignore[no-untyped-def]
        for row in opt.preconditioner_status():
            assert row["lag_steps"] <= budget * FREQ, row
            assert row["budget_steps"] == budget * FREQ
            seen_lags.append(row["lag_steps"])
        assert all(torch.isfinite(p).all() for p in model.parameters())

    with OPTIMIZERS[name](
        model.named_parameters(),
        lr=1e-2,
        precondition_frequency=FREQ,
        mode="embedded",
        staleness_budget=budget,
        engine_config=engine_config(),
    ) as opt:
        opt.attach(model)
        train(model, opt, 12, check)
        stats = opt.runtime_stats()
    assert stats["max_lag_steps"] <= budget * FREQ
    assert seen_lags, "no block was ever reported"


def test_injected_crash_hang_and_nan_never_reach_the_weights() -> None:
    """Real faults in real workers: a crash and a hang (each once: the retry succeeds) and a
    solver that always returns NaN (never delivered: the block falls back to local solves)."""
    params = {
        "ok": torch.nn.Parameter(torch.randn(6, 5)),
        "xcrash-once:a": torch.nn.Parameter(torch.randn(6, 5)),
        "xhang-once:b": torch.nn.Parameter(torch.randn(6, 5)),
        "xnan:c": torch.nn.Parameter(torch.randn(6, 5)),
    }
    config = engine_config(test_fault_prefix="x", solve_timeout_s=1.5, max_worker_attempts=2)
    opt = SOAP(
        list(params.items()),
        lr=1e-2,
        precondition_frequency=2,
        mode="embedded",
        staleness_budget=1,
        barrier_timeout_s=20.0,
        engine_config=config,
    )
    try:
        g = torch.Generator().manual_seed(3)
        for _ in range(8):
            for p in params.values():
                p.grad = torch.randn(6, 5, generator=g)
            opt.step()
            assert all(torch.isfinite(p).all() for p in params.values())
        rows = {r["block"]: r for r in opt.preconditioner_status()}
        engine_stats = opt.source.stats()  # type: ignore[attr-defined]
    finally:
        opt.close()
    assert engine_stats["worker_restarts"] >= 2  # the crash and the hang each cost a worker
    for block in ("ok/tile0/dim0", "xcrash-once:a/tile0/dim0", "xhang-once:b/tile0/dim0"):
        assert rows[block]["version"] >= 0, rows[block]
    nan_row = rows["xnan:c/tile0/dim0"]
    assert nan_row["failures"] >= 1, nan_row
    assert nan_row["version"] >= 0  # served by local fallback, never by the NaN result
    assert opt.runtime_stats()["local_fallbacks"] >= 1
    assert rows["ok/tile0/dim0"]["failures"] == 0


def test_hooks_install_results_before_step() -> None:
    model = small_model()
    x, y = data()
    with SOAP(
        model.named_parameters(),
        precondition_frequency=1,
        mode="embedded",
        staleness_budget=5,
        engine_config=engine_config(),
    ) as opt:
        opt.attach(model)
        for _ in range(3):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        engine = opt.source.engine  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while any(s.in_flight_version >= 0 for s in engine.status()):
            assert time.monotonic() < deadline, "the engine did not finish its solves"
            time.sleep(0.02)
        before = {r["block"]: r["version"] for r in opt.preconditioner_status()}
        model(x)  # the forward hook pumps finished results into place
        after = {r["block"]: r["version"] for r in opt.preconditioner_status()}
    assert all(after[b] == 3 for b in after), after
    assert any(before[b] < after[b] for b in after), (before, after)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_native_checkpoint_resumes_in_embedded_mode(name: str) -> None:
    cls = OPTIMIZERS[name]
    model = small_model()
    opt = cls(model.named_parameters(), lr=1e-2, precondition_frequency=FREQ, mode="native")
    train(model, opt, 4)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    train(model, opt, 4)

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed = small_model()
    resumed.load_state_dict(checkpoint["model"])
    with cls(
        resumed.named_parameters(),
        lr=1e-2,
        precondition_frequency=FREQ,
        mode="embedded",
        staleness_budget=0,
        engine_config=engine_config(),
    ) as opt2:
        opt2.load_state_dict(checkpoint["optim"])
        train(resumed, opt2, 4)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=2e-5)


def test_close_leaves_no_processes_or_segments() -> None:
    model = small_model()
    opt = SOAP(model.named_parameters(), mode="embedded", engine_config=engine_config())
    train(model, opt, 3)
    pids = opt.source.engine.worker_pids()  # type: ignore[attr-defined]
    assert pids
    opt.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"asteria_{os.getpid()}_")]
    assert leftovers == []


def test_training_script_without_main_guard_runs_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Worker processes must not re-import the user's script (multiprocessing spawn would)."""
    script = tmp_path / "train_unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from asteria_client import SOAP
            print("script body ran", flush=True)
            model = torch.nn.Linear(4, 3)
            opt = SOAP(model.named_parameters(), precondition_frequency=1, staleness_budget=0)
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(16, 4)).square().mean().backward()
                opt.step()
            assert all(r["version"] >= 2 for r in opt.preconditioner_status())
            print("trained", opt.mode.value, flush=True)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "ASTERIA_ADDRESS"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("script body ran") == 1
    assert "trained embedded" in done.stdout
