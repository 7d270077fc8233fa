"""`asteria bench peers` and `asteria bench defaults` run end to end on the train GPT and write
the documented JSON and figures; peers that are not installed are skipped with a line (CI installs
``.[dev]`` only, so there every peer is skipped; HeavyBall runs where it is installed)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from asteria_client.bench import report as bench_report
from asteria_client.bench.peers_table import PEERS
from asteria_client.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def _check_figures(out: Path, data: dict, count: int) -> None:  # type: ignore[type-arg]
    assert len(data["figures"]) == count
    for figure in data["figures"]:
        assert (out.parent / figure).read_bytes()[:8] == PNG


def test_quick_peers_trains_every_row_and_skips_what_is_missing(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "peers.json"
    args = ["bench", "peers", "--quick", "--steps", "6", "--eval-interval", "3"]
    args += ["--asteria", "soap-native,soap-embedded", "--json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "peers" and data["quick"] is True
    assert data["config"]["flush_denormal_in_effect"] in (True, False)
    assert data["batch_streams_identical"] is True

    runs = {r["config"]: r for r in data["runs"]}
    for name in ("adamw", "soap-native", "soap-embedded"):
        run = runs[name]
        assert run["ok"], run["error"]
        assert run["seed"] == 0 and len(run["step_times_s"]) == 6
        assert run["evals"][-1]["step"] == 6 and math.isfinite(run["final_val_loss"])
        assert run["cpu_s"] > 0 and run["median_step_time_s"] > 0
    assert runs["soap-embedded"]["runtime"]["mode"] == "embedded"
    assert runs["soap-embedded"]["solver_cpu_s"] > 0  # its engine's worker, attributed to it
    assert runs["soap-native"]["solver_cpu_s"] == 0

    # Every peer either ran (both of its rows) or is skipped with a line that names it.
    for peer in PEERS:
        rows = [c for c in runs if c.startswith(f"{peer.name}-")]
        skipped = [line for line in data["skipped"] if line.startswith(f"{peer.name}: skipped")]
        assert (len(rows) == 2) != bool(skipped), (peer.name, rows, skipped)
        for row in rows:
            assert runs[row]["ok"], runs[row]["error"]
    if sys.version_info < (3, 12):
        emerging = next(line for line in data["skipped"] if line.startswith("emerging-soap"))
        assert "Python >= 3.12" in emerging

    summaries = {s["config"]: s for s in data["summaries"]}
    assert summaries["adamw"]["median_vs_adamw"] == 1.0
    assert data["target_val_loss"] == runs["adamw"]["final_val_loss"]
    assert summaries["adamw"]["steps_to_target_mean"] == 6
    assert set(data["checks"]) == {"wall_clock_target", "steps", "wall_clock"}
    _check_figures(out, data, 3)
    printed = capsys.readouterr().out
    assert "asteria soap embedded" in printed and "Steps to AdamW's final loss" in printed

    page = bench_report.render(tmp_path, tmp_path / "docs" / "benchmarks.md")
    assert "| asteria soap native |" in page and "Not rendered" not in page


def test_heavyball_runs_as_its_readme_says_and_at_asterias_settings(tmp_path: Path) -> None:
    heavyball = pytest.importorskip("heavyball")
    out = tmp_path / "peers.json"
    args = ["bench", "peers", "--steps", "4", "--eval-interval", "2", "--seeds", "0"]
    args += ["--asteria", "soap-native", "--peers", "heavyball-soap", "--json", str(out)]
    assert main(args) == 0
    assert heavyball.utils.compile_mode is None  # eager on the CPU
    data = json.loads(out.read_text())
    runs = {r["config"]: r for r in data["runs"]}
    readme, ours = runs["heavyball-soap-readme"], runs["heavyball-soap-asteria-settings"]
    assert readme["ok"] and ours["ok"], (readme["error"], ours["error"])
    assert readme["info"]["keywords"] == {"lr": 3e-3}
    assert ours["info"]["keywords"] == {"lr": 3e-3, "weight_decay": 0.1}
    assert readme["train_batches_digest"] == runs["adamw"]["train_batches_digest"]


def test_quick_defaults_sweep_writes_the_grid_and_a_choice(tmp_path: Path) -> None:
    out = tmp_path / "defaults.json"
    args = ["bench", "defaults", "--quick", "--steps", "4", "--eval-interval", "2"]
    args += ["--frequencies", "2,4", "--json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "defaults" and data["partial"] is False
    names = sorted(r["config"] for r in data["runs"])
    assert names == sorted(
        ["adamw"] + [f"soap-native-b{b}-f{f}" for b in (0.9, 0.95) for f in (2, 4)]
    )
    assert all(r["ok"] for r in data["runs"])
    assert len(data["rows"]) == 4
    choice = data["choices"]["soap"]
    assert (choice["pick"]["beta1"], choice["pick"]["frequency"]) in {
        (b, f) for b in (0.9, 0.95) for f in (2, 4)
    }
    _check_figures(out, data, 1)

    # A second part (another frequency) merged with the first: one grid over both.
    more = tmp_path / "defaults-f8.json"
    args = ["bench", "defaults", "--quick", "--steps", "4", "--eval-interval", "2"]
    assert main([*args, "--frequencies", "8", "--beta1s", "0.9", "--json", str(more)]) == 0
    merged = tmp_path / "merged.json"
    assert main(["bench", "defaults", "--merge", str(out), str(more), "--json", str(merged)]) == 0
    data = json.loads(merged.read_text())
    assert data["config"]["frequencies"] == [2, 4, 8]
    assert sorted(r["config"] for r in data["runs"]).count("adamw") == 1  # the first part's
    assert len(data["merged_from"]) == 2 and "soap-native-b0.9-f8" in {
        r["config"] for r in data["runs"]
    }
    page = bench_report.render(tmp_path, tmp_path / "docs" / "benchmarks.md")
    assert "| soap | native | 0.9 | 8 |" in page and "Not rendered" not in page


@pytest.mark.slow
def test_a_sweep_split_over_processes_reports_like_one_process(tmp_path: Path) -> None:
    out = tmp_path / "defaults.json"
    args = ["bench", "defaults", "--quick", "--steps", "4", "--eval-interval", "2"]
    args += ["--frequencies", "4", "--beta1s", "0.9", "--jobs", "2", "--json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert sorted(r["config"] for r in data["runs"]) == ["adamw", "soap-native-b0.9-f4"]
    assert data["missing"] == [] and data["jobs"] == 2
