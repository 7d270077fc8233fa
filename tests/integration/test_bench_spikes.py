"""`asteria bench spikes` runs end to end and writes the documented JSON (not its timings)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from asteria_client.bench.spikes import cpu_settings, refresh_steps, report_section
from asteria_client.cli import main


def test_refresh_schedule() -> None:
    assert sorted(refresh_steps("soap", 25, 10)) == [1, 11, 21]
    assert sorted(refresh_steps("shampoo", 25, 10)) == [1, 11, 21]


def test_spikes_writes_runs_with_step_time_statistics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "spikes.json"
    code = main(
        ["bench", "spikes", "--steps", "14", "--precondition-frequency", "4", "--json", str(out)]
    )
    assert code == 0
    report = json.loads(out.read_text())
    runs = {(r["optimizer"], r["mode"]): r for r in report["runs"]}
    assert set(runs) == {
        ("adamw", "n/a"),
        ("soap", "native"),
        ("soap", "embedded"),
        ("soap", "daemon"),
    }
    for run in runs.values():
        for key in ("step_time_median_s", "step_time_p99_s", "step_time_max_s"):
            assert math.isfinite(run[key]) and run[key] > 0
        assert run["step_time_median_s"] <= run["step_time_p99_s"] <= run["step_time_max_s"]
        assert len(run["step_times_s"]) == 14
        energy = run["energy"]  # CPU-seconds at least, always; no GPU here
        assert "cpu-seconds" in energy["sources"] and energy["cpu_s_per_step"] > 0
        assert energy["gpu_j"] is None and energy["gpu_j_per_step"] is None
    assert report["config"]["model"] == "tiny"
    for mode in ("embedded", "daemon"):
        run = runs[("soap", mode)]
        assert run["staleness"]["mode"] == mode
        assert run["staleness"]["max_lag_steps"] <= 4  # budget S=1 at f=4
    assert runs[("soap", "daemon")]["staleness"]["source"]["transport"] == "shm"
    printed = capsys.readouterr().out
    assert "embedded p99/median" in printed and "daemon p99/median" in printed
    assert "energy soap (daemon):" in printed and "CPU-s/step" in printed
    assert report["benchmark"] == "spikes" and report["quick"] is False
    assert report["command"] and report["machine"]["blas"] is not None
    assert report["figures"] == ["spikes-trace.png"]
    assert (tmp_path / "spikes-trace.png").read_bytes().startswith(b"\x89PNG")
    section = report_section({**report, "figures": ["figures/spikes-trace.png"]})
    assert "| soap (embedded) |" in section and "| soap (daemon) |" in section
    assert "](figures/spikes-trace.png)" in section

    # The defaults: subnormals flushed, and on a host of 2+ CPUs the solvers pinned off the
    # trainer's CPU: the daemon and the embedded engine's workers really ran on the others.
    assert report["config"]["flush_denormal"] is report["config"]["flush_denormal_in_effect"]
    assert report["config"]["flush_denormal"] is True
    cpus = sorted(os.sched_getaffinity(0))
    affinity = report["affinity"]
    assert affinity["usable_cpus"] == cpus
    if len(cpus) >= 2:
        assert report["config"]["pin_solver"] is True
        assert affinity["trainer_cpus"] == cpus[:1] and affinity["solver_cpus"] == cpus[1:]
        # the daemon and the embedded engine's worker
        assert affinity["observed_solver_process_cpus"] == [cpus[1:], cpus[1:]]
        assert f"solver pinned to CPU {cpus[1]}" in section
    assert "subnormals flushed to zero" in section and "subnormals flushed" in printed
    assert sorted(os.sched_getaffinity(0)) == cpus  # this process is unpinned again


def test_spikes_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "spikes", "--steps", "0"]) == 2
    assert "steps" in capsys.readouterr().err
    threads = str(len(os.sched_getaffinity(0)))  # no CPU left for the solvers
    assert main(["bench", "spikes", "--threads", threads, "--pin-solver"]) == 2
    assert "--no-pin-solver" in capsys.readouterr().err


def test_the_report_says_when_the_solver_was_not_pinned() -> None:
    data = {
        "config": {"flush_denormal": False},
        "affinity": {"trainer_cpus": None, "solver_cpus": None, "usable_cpus": [0, 1]},
    }
    assert cpu_settings(data) == (
        "CPU settings: subnormals kept; solver not pinned: it shares CPUs 0,1 with the trainer."
    )
    assert "not recorded" in cpu_settings({"config": {}})  # reports from before the settings
