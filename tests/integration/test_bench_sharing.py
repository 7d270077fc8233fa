"""`asteria bench sharing --quick` runs training processes on one daemon and writes the
documented JSON and figures (never checks timings)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from asteria_client.bench import report
from asteria_client.cli import main


def test_quick_sharing_writes_runs_per_client_count_and_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results" / "sharing.json"
    argv = ["bench", "sharing", "--quick", "--steps", "12", "--no-flush-denormal"]
    assert main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["flush_denormal"] is False
    assert doc["benchmark"] == "sharing" and doc["quick"] is True
    assert doc["command"] and doc["machine"]["cpus"] >= 1
    assert [r["num_clients"] for r in doc["runs"]] == [1, 2]
    for run in doc["runs"]:
        n = run["num_clients"]
        clients = run["clients"]
        assert len(clients) == n
        assert len({c["job"] for c in clients}) == n  # one job each
        assert 0 < run["fairness_jain"] <= 1 + 1e-12
        assert run["aggregate_solves_per_s"] == pytest.approx(
            sum(c["solves_per_s"] for c in clients)
        )
        for c in clients:
            assert c["steps"] == 12
            assert c["results"] > 0 and c["solves_per_s"] > 0
            assert 0 < c["latency_p50_s"] <= c["latency_p99_s"]
            assert math.isfinite(c["steps_per_s"]) and c["steps_per_s"] > 0
            assert c["local_fallbacks"] >= 0 and c["barrier_waits"] >= 0
            assert c["flush_denormal"] is False  # the setting reached every trainer
        assert run["daemon_cpu_s"] > 0
    assert len(doc["figures"]) == 2
    for figure in doc["figures"]:
        assert (out.parent / figure).read_bytes().startswith(b"\x89PNG")
    assert "fairness" in capsys.readouterr().out

    # The report renders this real run, with its figures beside the page.
    page = tmp_path / "docs" / "benchmarks.md"
    assert main(["bench", "report", "--results", str(out.parent), "--out", str(page)]) == 0
    text = page.read_text()
    assert f"## {report.TITLES['sharing']}" in text and "Not rendered" not in text
    assert "subnormals kept" in text
    for figure in doc["figures"]:
        assert (page.parent / "figures" / Path(figure).name).is_file()
        assert f"](figures/{Path(figure).name})" in text


def test_sharing_rejects_bad_client_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sharing", "--clients", "1,0"]) == 2
    assert "--clients" in capsys.readouterr().err
