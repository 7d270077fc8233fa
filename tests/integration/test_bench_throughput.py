"""`asteria bench throughput --quick` runs end to end and writes a complete report (not timings)."""

from __future__ import annotations

import json
import math

import numpy as np

from asteria_client.bench.throughput import make_factor, report_section
from asteria_client.cli import main


def test_factors_are_symmetric_positive_definite_and_reproducible() -> None:
    a = make_factor(32, 0, 3)
    assert a.dtype == np.float32 and np.array_equal(a, a.T)
    assert np.linalg.eigvalsh(a.astype(np.float64)).min() > 0
    assert np.array_equal(a, make_factor(32, 0, 3))
    assert not np.array_equal(a, make_factor(32, 0, 4))


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_quick_run_writes_a_complete_report(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--quick", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["flush_denormal"] is True
    report = json.loads(out.read_text())
    assert report["benchmark"] == "throughput" and report["quick"] is True
    for key in ("command", "machine", "config", "ratio_target", "daemon_cpu_s", "wall_time_s"):
        assert key in report
    results = report["results"]
    cfg = report["config"]
    assert {(e["n"], e["kind"]) for e in results} == {
        (n, kind) for n in cfg["sizes"] for kind in ("eigenbasis", "inverse_root")
    }
    for entry in results:
        assert entry["batch"] >= 1
        assert len(entry["daemon_round_s"]) == len(entry["bare_round_s"]) == cfg["rounds"]
        for key in (
            "daemon_median_s",
            "bare_median_s",
            "daemon_solves_per_s",
            "bare_solves_per_s",
            "ratio",
            "paired_ratio_median",
            *entry["daemon_round_s"],
            *entry["bare_round_s"],
        ):
            value = entry[key] if isinstance(key, str) else key
            assert _positive(value), (key, value)
        assert math.isclose(
            entry["ratio"], entry["daemon_solves_per_s"] / entry["bare_solves_per_s"]
        )
        assert entry["target_met"] == (entry["ratio"] >= report["ratio_target"])
        # The CPU split: the workers solved and the bare loop ran; the daemon and the client
        # may round to 0 clock ticks in a quick run, never below.
        split = entry["cpu_ms_per_solve"]
        assert _positive(split["workers"]) and _positive(split["bare"])
        assert split["daemon"] >= 0 and split["client"] >= 0
        assert _positive(entry["cpu_s_per_solve_vs_bare"])
        # The engine's solver alone does the bare loop's LAPACK work and its checks on top.
        assert _positive(entry["solver_cpu_vs_bare"])
    assert len(report["figures"]) == 1
    png = out.parent / report["figures"][0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "daemon solves/s" in capsys.readouterr().out
    section = report_section(report)
    assert section.startswith("Daemon solves/s") and report["figures"][0] in section


def test_throughput_rejects_bad_arguments(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "throughput", "--workers", "0"]) == 2
    assert "workers" in capsys.readouterr().err
