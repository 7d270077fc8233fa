"""`asteria bench convergence --quick` runs end to end and writes the documented JSON and plots
(its losses and timings are checked for sanity, never for speed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from asteria_client.bench import report as bench_report
from asteria_client.bench.convergence import QUICK_CONFIGS
from asteria_client.cli import main


def test_quick_convergence_writes_every_configuration(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "convergence.json"
    assert main(["bench", "convergence", "--quick", "--no-flush-denormal", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["flush_denormal"] is False

    assert data["benchmark"] == "convergence" and data["quick"] is True
    assert data["batch_streams_identical"] is True
    assert [s["config"] for s in data["summaries"]] == list(QUICK_CONFIGS)
    assert {r["config"] for r in data["runs"]} == set(QUICK_CONFIGS)
    steps = data["config"]["steps"]
    for run in data["runs"]:
        assert run["ok"], run["error"]
        assert run["seed"] == 0 and run["cpu_s"] > 0 and run["process_wall_s"] > 0
        assert len(run["train_losses"]) == steps == run["evals"][-1]["step"]
        losses = [e["val_loss"] for e in run["evals"]]
        assert all(math.isfinite(loss) for loss in losses)
        assert losses[-1] < losses[0]  # it learned something
        assert run["lr"] > 0
        assert run["flush_denormal"] is False  # passed down to every `asteria train`
    runs = {r["config"]: r for r in data["runs"]}
    assert runs["adamw"]["runtime"] == {} and runs["adamw"]["lr"] == data["adamw_lr"]
    assert runs["soap-native"]["runtime"]["mode"] == "native"
    assert runs["soap-native"]["runtime"]["max_lag_steps"] == 0
    assert runs["soap-embedded-s1"]["runtime"]["mode"] == "embedded"
    daemon = runs["soap-daemon-s1"]
    assert daemon["runtime"]["mode"] == "daemon" and daemon["daemon_cpu_s"] > 0
    assert daemon["cpu_s"] == daemon["trainer_cpu_s"] + daemon["daemon_cpu_s"]

    # With one seed the target is AdamW's own final loss, which it reaches at its last step.
    summaries = {s["config"]: s for s in data["summaries"]}
    assert data["target_val_loss"] == runs["adamw"]["final_val_loss"]
    assert summaries["adamw"]["steps_to_target_mean"] == steps
    assert summaries["adamw"]["steps_to_target_vs_adamw"] == 1.0
    for summary in summaries.values():
        assert math.isfinite(summary["final_val_loss_mean"]) and summary["cpu_s_mean"] > 0

    assert len(data["figures"]) == 2
    for figure in data["figures"]:
        assert (out.parent / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "soap daemon S=1" in capsys.readouterr().out

    page = bench_report.render(tmp_path, tmp_path / "docs" / "benchmarks.md")
    assert "| soap embedded S=1 |" in page and "Not rendered" not in page
    assert "subnormals kept (--no-flush-denormal)" in page


def test_convergence_rejects_unknown_configurations(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "convergence", "--configs", "adamw,soap-turbo"]) == 2
    assert "soap-turbo" in capsys.readouterr().err
