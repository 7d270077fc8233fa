"""`asteria bench soak --quick` runs its clients (one SIGKILLed and restarted per half), the bad
tenant and the /proc sampling against a real daemon, and writes the documented JSON, figure and
report section. It never checks the targets' timings: that is the full run's business."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asteria_client.bench import report
from asteria_client.cli import main


@pytest.mark.slow
def test_quick_soak_writes_resources_phases_and_a_report_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results" / "soak.json"
    assert main(["bench", "soak", "--quick", "--duration", "20", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "soak" and doc["quick"] is True and doc["command"]
    for when in ("start", "warm", "peak", "end"):
        sample = doc["daemon"][when]
        assert sample["rss_bytes"] > 0 and sample["fds"] > 0 and sample["threads"] > 0
        assert sample["memfd_maps"] >= 0
    assert doc["daemon"]["peak"]["rss_bytes"] >= doc["daemon"]["end"]["rss_bytes"]
    assert len(doc["samples"]) >= 10
    alone, with_bad = doc["phases"]
    assert not alone["with_bad_tenant"] and with_bad["with_bad_tenant"]
    for phase in (alone, with_bad):
        runs = phase["clients"]
        assert sum(r["killed"] for r in runs) == 1  # client 0, then its restart
        assert len([r for r in runs if not r["killed"]]) == 2
        assert phase["expected"] == 2 * 3 and phase["results"] > 0
        assert phase["delivered"] + phase["lost"] == phase["expected"]
        assert 0 < phase["latency_p50_s"] <= phase["latency_p99_s"]
    counts = with_bad["bad_tenant"]
    assert counts.get("open_session:OK", 0) > 0 and counts.get("silent_stream:opened", 0) > 0
    assert any(k.startswith("big_snapshot:") for k in counts)
    assert any(k.startswith("stalled_upload:") for k in counts)
    for door in ("wide_layout", "stalled_push", "peer_guess", "metrics_connection"):
        assert any(k.startswith(f"{door}:") for k in counts), (door, counts)
    assert counts.get("wide_layout:OK", 0) == 0  # a 4,096-node layout is always refused
    assert counts.get("peer_guess:OK", 0) == 0
    assert with_bad["bad_job_forget_error"] == ""
    assert set(doc["targets"]) == {
        "rss_within_10pct",
        "fds_within_10pct",
        "nothing_lost",
        "p99_at_most_2x",
        "health_true",
    }
    assert doc["health_samples"] and "serving_while_unable" in doc
    assert (out.parent / doc["figures"][0]).read_bytes().startswith(b"\x89PNG")
    assert "lost results" in capsys.readouterr().out

    page = tmp_path / "docs" / "benchmarks.md"
    assert main(["bench", "report", "--results", str(out.parent), "--out", str(page)]) == 0
    text = page.read_text()
    assert f"## {report.TITLES['soak']}" in text and "Not rendered" not in text
    assert "What the bad tenant's attempts got" in text
