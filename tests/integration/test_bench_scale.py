"""`asteria bench scale` on real daemons (loopback TCP): two simulated nodes, two refreshes."""

from __future__ import annotations

import json
from pathlib import Path

from asteria_client.bench.scale import BLOCK_SIZES, HSDP_SHARDS, report_section, shard_jobs
from asteria_client.cli import main


def test_bench_scale_counts_no_duplicates_and_near_minimal_bytes(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--quick", "--nodes", "1,2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    one, two, hsdp_one, hsdp_two = report["runs"]
    assert [r["layout"] for r in report["runs"]] == ["dp", "dp", "hsdp", "hsdp"]
    assert one["nodes"] == 1 and two["nodes"] == 2
    assert one["bytes_between_daemons"] == 0 and one["duplicate_solves"] == 0
    # Two daemons: every solve on one daemon only, each result pushed once to the other one.
    assert two["duplicate_solves"] == 0 and two["daemon_fallbacks"] == 0
    # A claim (the owner's push would have been late) moves a solve, it does not repeat it.
    assert two["claims_granted"] == sum(d["claims_handed_over"] for d in two["daemons"])
    assert 0 < two["solves"] <= len(BLOCK_SIZES) * report["config"]["refreshes"]
    # Under 1 only by results overtaken before their push (a newer version of the block was
    # in by then: not sent); a result sent twice puts it over.
    assert 0.9 <= two["bytes_over_minimum"] < 1.05
    assert two["balance_of_owner_map"] <= 1.25
    assert two["max_lag_steps"] <= two["budget_steps"] and two["rank_fallbacks"] == 0
    assert all(d["bytes_pushed"] > 0 and d["bytes_received"] > 0 for d in two["daemons"])
    assert "counts and bytes" in report["note"]
    section = report_section(report)  # what `asteria bench report` puts in docs/benchmarks.md
    # HSDP: the shard blocks (names with "@") of both shards, each held on both nodes, are
    # synced like replicated ones: one owner per shard block, each version solved once.
    assert all("@shard" in b for b in hsdp_two["blocks_solved"])
    # each shard's replicas are a job of their own, as the client makes them
    assert {b.split(":")[0] for b in hsdp_two["blocks_solved"]} == set(shard_jobs("hsdp", 2))
    assert len(hsdp_two["blocks_solved"]) == HSDP_SHARDS * len(BLOCK_SIZES)
    assert hsdp_one["duplicate_solves"] == 0 and hsdp_two["duplicate_solves"] == 0
    assert hsdp_two["daemon_fallbacks"] == 0 and hsdp_two["rank_fallbacks"] == 0
    assert 0 < hsdp_two["solves"] <= HSDP_SHARDS * len(BLOCK_SIZES) * report["config"]["refreshes"]
    assert hsdp_two["balance_of_owner_map"] <= 1.25
    assert all(d["solves"] > 0 and d["bytes_pushed"] > 0 for d in hsdp_two["daemons"])
    assert 0.9 <= hsdp_two["bytes_over_minimum"] < 1.05
    assert hsdp_two["max_lag_steps"] <= hsdp_two["budget_steps"]
    assert "| mesh | K |" in section and "bytes/min" in section and "claims" in section
