"""`asteria bench blocks` on a real daemon and the embedded engine, at two small N."""

from __future__ import annotations

import json
from pathlib import Path

from asteria_client.bench.blocks import first_blocks, inventory, report_section
from asteria_client.cli import main


def test_the_inventory_follows_the_blocking_rule() -> None:
    blocks = inventory("llama-7b", 2048)
    # q/k/v/o 4096x4096: 2x2 tiles of 2048, two blocks each; gate/up/down: 6x2 tiles each
    assert len(blocks) == 32 * (4 * 8 + 3 * 24) + 2 * 64
    assert max(n for _, n in blocks) == 2048
    many = first_blocks("gpt2-xl", 2048, 3000)
    assert len({name for name, _ in many}) == 3000  # repeated as shards, never the same name


def test_bench_blocks_reports_every_figure_per_n(tmp_path: Path) -> None:
    out = tmp_path / "blocks.json"
    args = ["bench", "blocks", "--blocks", "20,60", "--clients", "2", "--idle-steps", "3"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["blocks"] for r in report["runs"]] == [20, 60]
    for run in report["runs"]:
        embedded, daemon = run["embedded"], run["daemon"]
        assert embedded["idle_steps_receiving"] == 0 and daemon["idle_steps_receiving"] == 0
        assert daemon["register_s"] > 0 and daemon["daemon_cpu_per_snapshot_and_result_s"] > 0
        assert daemon["status_all_clients"]["blocks"] == 2 * run["blocks"]
        assert daemon["status_summary_all_clients"]["blocks"] == 2 * run["blocks"]
        assert daemon["status_rpc"]["calls"] > 0 and not daemon["errors"]
        cli = daemon["status_cli_all_clients"]  # the command as a process, start to exit
        assert cli["summary_median_s"] > 0 and cli["blocks_json_median_s"] > 0
    assert report["targets"]["daemon_idle_step_growth"] is not None
    assert "surrogate" in report["surrogate"] or "SPD" in report["surrogate"]
    section = report_section({**report, "before": report})
    assert "Before and after" in section and "idle step" in section
    assert "CLI status --json --blocks s" in section
    assert len(report["figures"]) == 4
