"""`asteria bench report` builds one page from synthetic benchmark JSON documents."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from asteria_client.bench import report, sharing
from asteria_client.cli import main

MACHINE = {
    "date": "2025-01-02T03:04:05+00:00",
    "platform": "Linux-test",
    "cpu": "Test CPU 9000",
    "cpus": 2,
    "memory_gib": 7.5,
    "python": "3.11.0",
    "packages": {"torch": "2.9.0", "numpy": "2.1.0"},
    "blas": [
        {
            "internal_api": "openblas",
            "version": "0.3.28",
            "architecture": "Haswell",
            "threading_layer": "pthreads",
            "num_threads": 2,
        }
    ],
}
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16  # enough to be copied; never decoded


def _train_doc(results: int, total_s: float, p50: float, p99: float) -> dict[str, Any]:
    """The parts of an `asteria train --json` document the sharing benchmark reads."""
    return {
        "steps": [{"step": i, "step_time_s": 0.2} for i in range(1, 11)],
        "final": {"total_time_s": total_s, "median_step_time_s": 0.2, "val_loss": 3.0},
        "optimizer": {
            "barrier_waits": 1,
            "barrier_wait_s": 0.1,
            "barrier_timeouts": 0,
            "local_fallbacks": 0,
            "max_lag_steps": 5,
            "num_blocks": 22,
            "source": {
                "results_timed": results,
                "result_latency_p50_s": p50,
                "result_latency_p99_s": p99,
                "submits_dropped": 0,
            },
        },
    }


def _sharing_doc() -> dict[str, Any]:
    runs = []
    for n, results in ((1, [40]), (2, [30, 10])):
        clients = [
            {"client": i, **sharing.client_summary(_train_doc(r, 4.0, 0.3, 0.9), ended_unix_s=100)}
            for i, r in enumerate(results)
        ]
        runs.append(sharing.aggregate(n, clients, 12.0, 20.0))
    config = {**sharing.SharingConfig(clients=(1, 2)).__dict__, "clients": [1, 2]}
    return {"benchmark": "sharing", "quick": True, "config": config, "cpus": 2, "runs": runs}


def _write(folder: Path, name: str, doc: dict[str, Any], figures: Sequence[str] = ()) -> None:
    for figure in figures:
        (folder / figure).write_bytes(PNG)
    doc = {
        **doc,
        "command": f"asteria bench {doc['benchmark']} --json {name}",
        "machine": MACHINE,
        "figures": list(figures),
    }
    (folder / name).write_text(json.dumps(doc))


def test_sharing_aggregates_from_train_documents() -> None:
    doc = _sharing_doc()
    one, two = doc["runs"]
    assert one["aggregate_solves_per_s"] == pytest.approx(10.0)
    assert one["fairness_jain"] == pytest.approx(1.0)
    assert two["aggregate_solves_per_s"] == pytest.approx(10.0)
    # rates 7.5 and 2.5: (10)^2 / (2 * (56.25 + 6.25)) = 0.8
    assert two["fairness_jain"] == pytest.approx(0.8)
    assert two["overlap_fraction"] == pytest.approx(1.0)  # same start and end
    assert sharing.jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert math.isnan(sharing.jain_index([0.0, 0.0]))


def test_report_orders_sections_copies_figures_and_notes_the_missing(tmp_path: Path) -> None:
    results, out = tmp_path / "results", tmp_path / "docs" / "benchmarks.md"
    results.mkdir()
    _write(results, "sharing.json", _sharing_doc(), ["sharing-throughput.png"])
    _write(results, "zzz.json", {"benchmark": "nosuchbench"})
    _write(results, "aaa.json", {"benchmark": "convergence"}, ["aaa-curves.png"])
    (results / "notes.json").write_text(json.dumps({"hello": 1}))
    (results / "broken.json").write_text("{not json")

    assert main(["bench", "report", "--results", str(results), "--out", str(out)]) == 0
    text = out.read_text()

    assert "Test CPU 9000, 2 cores, 7.5 GiB memory" in text
    assert "torch 2.9.0" in text and "openblas 0.3.28 (kernel Haswell" in text
    for name in ("sharing.json", "zzz.json", "aaa.json"):
        assert f"`asteria bench {json.loads((results / name).read_text())['benchmark']} " in text
    # Fixed order: convergence before sharing, unknown benchmarks last.
    convergence = text.index(f"## {report.TITLES['convergence']}")
    shared = text.index(f"## {report.TITLES['sharing']}")
    unknown = text.index("## nosuchbench")
    assert convergence < shared < unknown
    assert "no module `asteria_client.bench.nosuchbench`" in text
    # The sharing section is rendered, with its figure copied beside the page and linked.
    assert (out.parent / "figures" / "sharing-throughput.png").read_bytes() == PNG
    assert "](figures/sharing-throughput.png)" in text
    assert "| 2 | 10.0 |" in text  # N=2: 10 solves/s in all
    # Whatever becomes of the convergence module, its figure is linked.
    assert "](figures/aaa-curves.png)" in text
    assert "`notes.json`: skipped" in text and "`broken.json`: skipped" in text


def test_report_of_a_spikes_document(tmp_path: Path) -> None:
    run = {
        "label": "adamw",
        "step_time_median_s": 0.1,
        "step_time_p90_s": 0.11,
        "step_time_p99_s": 0.12,
        "step_time_max_s": 0.13,
        "p99_over_median": 1.2,
        "p99_over_chunk_median": 1.1,
        "overhead_vs_adamw_median": 0.0,
        "staleness": {},
    }
    checks = {
        "native_refresh_over_quiet": 3.0,
        "embedded_p99_over_median": 1.2,
        "embedded_p99_over_median_target": 1.3,
        "embedded_p99_over_median_met": True,
        "adamw_p99_over_median": 1.1,
        "embedded_median_over_native_quiet": 1.05,
        "embedded_median_over_native_quiet_target": 1.1,
        "embedded_median_over_native_quiet_met": False,
    }
    config = {
        "steps": 20,
        "precondition_frequency": 4,
        "staleness_budget": 1,
        "threads": 1,
        "engine_workers": 1,
        "warmup_steps": 5,
    }
    results = tmp_path / "r"
    results.mkdir()
    doc = {"benchmark": "spikes", "config": config, "runs": [run], "checks": checks}
    _write(results, "spikes.json", doc, ["spikes-trace.png"])
    out = tmp_path / "bench.md"
    out.write_text(report.render(results, out))
    text = out.read_text()
    assert "| adamw | 100.0 ms |" in text
    assert "target <= 1.1: **missed**" in text
    assert text.count("](figures/spikes-trace.png)") == 1  # linked by the section, not twice


def test_report_without_results_is_a_usage_error(tmp_path: Path) -> None:
    assert main(["bench", "report", "--results", str(tmp_path), "--out", "x.md"]) == 2
    assert main(["bench", "report", "--results", str(tmp_path / "nope")]) == 2
