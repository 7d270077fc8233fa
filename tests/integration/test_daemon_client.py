"""The daemon mode end to end: optimizers with ``mode="daemon"`` against a real `asteria-server`
subprocess on a ``tmp_path`` Unix socket, including a kill -9 and a restart of the daemon."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asteria_client import SOAP, KLShampoo, Shampoo
from asteria_client.cli import main
from asteria_client.transport import DaemonClientConfig, DaemonConnection, DaemonSource
from asteria_server.engine.shm import SEGMENT_PREFIX
from tests.integration.test_daemon import Daemon, _children, start_daemon, stop_daemon

OPTIMIZERS = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}
FREQ = 3
RECONNECT_TIMEOUT_S = 30.0


def incarnation(daemon: Daemon) -> str:
    """The incarnation id in the daemon's serving line."""
    return daemon.serving_line.split("incarnation=", 1)[1].split()[0]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("client"))
    yield d
    stop_daemon(d)


def small_model() -> torch.nn.Module:
    """Square layers (see test_embedded_runtime.small_model: rectangular factors have an
    arbitrary null-space basis, so native and daemon would legitimately diverge)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 8, generator=g), torch.randn(256, 8, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_results_come_from_the_daemon(daemon: Daemon, name: str) -> None:
    model = small_model()
    with OPTIMIZERS[name](
        model.named_parameters(),
        lr=1e-2,
        precondition_frequency=FREQ,
        mode="daemon",
        address=daemon.target,
        staleness_budget=1,
    ) as opt:
        opt.attach(model)
        train(model, opt, 15)
        rows = opt.preconditioner_status()
        stats = opt.runtime_stats()
    assert stats["local_fallbacks"] == 0 and stats["submit_errors"] == 0
    assert len(rows) == 4  # two square weights, two factors each
    for row in rows:
        assert row["version"] >= 0 and row["mode"] == "daemon", row
        assert row["connected"] and row["daemon_incarnation"] == incarnation(daemon)
        assert row["lag_steps"] <= FREQ and row["failures"] == 0
    assert finite(model)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_budget_zero_matches_native(daemon: Daemon, name: str) -> None:
    cls = OPTIMIZERS[name]
    native_model, daemon_model = small_model(), small_model()
    native = cls(
        native_model.named_parameters(), lr=1e-2, precondition_frequency=FREQ, mode="native"
    )
    with cls(
        daemon_model.named_parameters(),
        lr=1e-2,
        precondition_frequency=FREQ,
        mode="daemon",
        address=daemon.target,
        staleness_budget=0,
    ) as remote:
        train(native_model, native, 8)
        train(daemon_model, remote, 8)
        stats = remote.runtime_stats()
    assert stats["local_fallbacks"] == 0 and stats["max_lag_steps"] == 0
    moved = False
    for p, q, p0 in zip(
        native_model.parameters(),
        daemon_model.parameters(),
        small_model().parameters(),
        strict=True,
    ):
        # The daemon computes in float64 with LAPACK and ships float32; torch uses its own driver.
        torch.testing.assert_close(q, p, rtol=1e-4, atol=2e-5)
        moved |= not torch.allclose(p, p0)
    assert moved


def test_missing_address_names_both_ways_to_give_it() -> None:
    with pytest.raises(ValueError, match=r"address=.*ASTERIA_ADDRESS"):
        SOAP(small_model().named_parameters(), mode="daemon")


def test_an_absent_daemon_means_local_computation_not_a_crash(tmp_path: Path) -> None:
    source = DaemonSource(
        f"unix://{tmp_path}/absent.sock", config=DaemonClientConfig(connect_timeout_s=0.2)
    )
    model = small_model()
    with SOAP(model.named_parameters(), lr=1e-2, precondition_frequency=FREQ, source=source) as opt:
        # Past the budget (S * f steps after the first snapshot) the blocks are computed here.
        train(model, opt, 3 * FREQ)
        rows = opt.preconditioner_status()
        stats = opt.runtime_stats()
    assert stats["local_fallbacks"] > 0 and stats["submit_errors"] == 0 and finite(model)
    assert all(row["version"] >= 0 and not row["connected"] for row in rows)
    assert source.stats()["submits_dropped"] > 0


def _wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _kill_9(daemon: Daemon) -> None:
    """SIGKILL the daemon, then its orphaned workers and shared memory (it cannot clean up)."""
    workers = _children(daemon.proc.pid)
    daemon.proc.kill()
    daemon.proc.wait()
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"{SEGMENT_PREFIX}{daemon.proc.pid}_"):
            os.unlink(f"/dev/shm/{name}")


def test_kill_9_falls_back_locally_then_a_restarted_daemon_takes_over(tmp_path: Path) -> None:
    first = start_daemon(tmp_path)
    model = small_model()
    opt = SOAP(
        model.named_parameters(),
        lr=1e-2,
        precondition_frequency=FREQ,
        mode="daemon",
        address=first.target,
        staleness_budget=1,
        barrier_timeout_s=5.0,
    )
    second: Daemon | None = None
    try:
        source = opt.source
        assert isinstance(source, DaemonSource)
        train(model, opt, 6)
        assert opt.runtime_stats()["local_fallbacks"] == 0
        assert source.incarnation_id == incarnation(first)

        _kill_9(first)
        train(model, opt, 9)  # the daemon is gone: training goes on, computing locally
        stats = opt.runtime_stats()
        assert stats["local_fallbacks"] > 0 and finite(model)
        rows = opt.preconditioner_status()
        assert not any(row["connected"] for row in rows)
        assert sum(row["submits_dropped"] for row in rows) > 0

        # The same socket path; the launcher waits on a fresh ready file of its own, so the
        # killed daemon's leftover cannot pass for the new one's.
        second = start_daemon(tmp_path)
        assert incarnation(second) != incarnation(first)
        _wait_for(
            lambda: source.connected and source.incarnation_id == incarnation(second),
            RECONNECT_TIMEOUT_S,
            "the client to reconnect to the restarted daemon",
        )
        step_before = max(row["submitted_version"] for row in opt.preconditioner_status())
        train(model, opt, 6)
        _wait_for(
            lambda: all(r.computed_version > step_before for r in source.records().values()),
            RECONNECT_TIMEOUT_S,
            "results from the restarted daemon",
        )
        rows = opt.preconditioner_status()
        assert all(row["daemon_incarnation"] == incarnation(second) for row in rows)
        assert all(row["connected"] and row["state"] != "unknown" for row in rows)
        assert finite(model)
    finally:
        opt.close()
        if second is not None:
            stop_daemon(second)
        if first.proc.poll() is None:
            _kill_9(first)


def test_status_command_reports_a_training_client(
    daemon: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = small_model()
    with SOAP(
        model.named_parameters(),
        lr=1e-2,
        precondition_frequency=FREQ,
        mode="daemon",
        address=daemon.target,
    ) as opt:
        train(model, opt, 4)
        source = opt.source
        assert isinstance(source, DaemonSource)
        # Steps never wait for the first bases (S >= 1): let the sender declare every block and
        # the daemon's one worker solve each once (under load the 4 steps outrun it).
        _wait_for(
            lambda: all(
                r.extra["state"] != "unknown" and r.computed_version >= 0
                for r in source.records().values()
            ),
            30.0,
            "the daemon to know and solve all four blocks",
        )
        capsys.readouterr()
        assert main(["status", "--address", daemon.target, "--json", "--blocks"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert main(["status", "--address", daemon.target, "--blocks"]) == 0
        table = capsys.readouterr().out
        assert main(["status", "--address", daemon.target, "--json"]) == 0
        summary_doc = json.loads(capsys.readouterr().out)
        assert main(["status", "--address", daemon.target]) == 0
        summary_text = capsys.readouterr().out
    # Without --blocks: what the blocks add up to, the worst of them, no row per block.
    assert "blocks" not in summary_doc and summary_doc["incarnation_id"] == incarnation(daemon)
    summary = summary_doc["summary"]
    assert summary["blocks"] == len(doc["blocks"]) >= 4
    states = ("idle", "queued", "running", "failed")
    assert sum(summary[s] for s in states) == summary["blocks"]
    # (training goes on between the two reads: versions may move, the blocks stay)
    assert 0 <= summary["never_computed"] <= summary["blocks"]
    assert summary["staleness_steps_p50"] <= summary["staleness_steps_max"]
    assert {b["block"] for b in summary["worst"]} <= {b["block"] for b in doc["blocks"]}
    assert f"blocks {summary['blocks']}:" in summary_text and "--blocks" in summary_text
    assert doc["incarnation_id"] == incarnation(daemon) and doc["uptime_s"] > 0
    assert doc["workers"]["total"] == 1 and doc["queue_depth"] >= 0
    ours = {b["block"]: b for b in doc["blocks"] if b["block"].startswith(source.namespace)}
    assert len(ours) == 4
    for block in ours.values():
        assert block["version"] >= 0 and block["staleness_steps"] >= 0
        assert {"submitted_version", "delivered_version", "queue_position", "state"} <= set(block)
    assert incarnation(daemon) in table and next(iter(ours)) in table

    missing = f"unix://{tmp_path}/no-daemon.sock"
    assert main(["status", "--address", missing]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot reach the daemon" in err and missing in err


def test_status_connection_reads_without_a_session(daemon: Daemon) -> None:
    conn = DaemonConnection(daemon.target)
    try:
        stats, blocks = conn.status()
    finally:
        conn.close()
    assert stats.incarnation_id == incarnation(daemon) and list(blocks) == []


def test_status_and_forget_run_without_torch(daemon: Daemon) -> None:
    """``asteria status`` (every form) and ``asteria forget`` against a real daemon, in a fresh
    interpreter, never import torch: it cost them ~3 s of a 2-core host and 190 MB before their
    first call (this interpreter has torch already, so it runs in another)."""
    code = (
        "import sys\n"
        "from asteria_client.cli import main\n"
        "address = sys.argv[1]\n"
        "for extra in ([], ['--json'], ['--blocks'], ['--json', '--blocks']):\n"
        "    assert main(['status', '--address', address, *extra]) == 0, extra\n"
        "assert main(['forget', '--address', address, '--job', 'nobody']) == 0\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, daemon.target], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert '"incarnation_id"' in done.stdout
