"""`asteria bench convergence --schedules`: its configurations, commands and table, by hand."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from asteria_client import SOAP
from asteria_client.bench.convergence import (
    CONFIGS,
    DEFAULT_SCHEDULES,
    SCHEDULES,
    SHAPES,
    ConvergenceConfig,
    _train_command,
    config_from_args,
    register,
)
from asteria_client.bench.convergence_summary import (
    add_time_to_target,
    median_quiet_step_time,
    report_section,
    summarize_configs,
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["convergence", *argv])


def test_schedules_flag_picks_the_schedule_rows() -> None:
    cfg = config_from_args(_args("--schedules"))
    assert cfg.schedules and cfg.configs == DEFAULT_SCHEDULES
    assert cfg.shapes == ("train", "wide", "deep")  # every shape unless --shapes says
    assert "soap-continuous-s1-noattach" in cfg.configs and "soap-embedded-f5-s1" in cfg.configs
    assert config_from_args(_args("--schedules", "--shapes", "wide")).shapes == ("wide",)
    assert config_from_args(_args()).shapes == ("train",)
    with pytest.raises(ValueError, match="shapes"):
        config_from_args(_args("--schedules", "--shapes", "tall"))
    cfg = config_from_args(_args("--schedules", "soap-continuous-s2"))
    assert cfg.configs == ("adamw", "soap-continuous-s2")
    cfg = config_from_args(_args())
    assert not cfg.schedules and "soap-continuous-s1" not in cfg.configs
    with pytest.raises(ValueError, match="unknown"):
        config_from_args(_args("--schedules", "soap-native-f3"))


def test_schedule_commands_set_frequency_and_refresh() -> None:
    cfg = ConvergenceConfig(configs=tuple(SCHEDULES))
    f1 = _train_command(cfg, SCHEDULES["soap-native-f1"], 0, None)
    assert f1[f1.index("--precondition-frequency") + 1] == "1" and "--refresh" not in f1
    cont = _train_command(cfg, SCHEDULES["soap-continuous-s4"], 0, None)
    assert cont[cont.index("--refresh") + 1] == "continuous"
    assert cont[cont.index("--staleness-budget") + 1] == "4"
    assert cont[cont.index("--mode") + 1] == "embedded"
    assert SCHEDULES["soap-continuous-s4"].amortized_frequency is None
    assert SCHEDULES["soap-native-f10"].amortized_frequency == 10
    # without an explicit f, the optimizer's own default (read from its signature)
    soap = SOAP([("w", torch.nn.Parameter(torch.zeros(2, 2)))], mode="native")
    assert CONFIGS["soap-native"].amortized_frequency == soap.defaults["precondition_frequency"]
    assert SCHEDULES["soap-embedded-f10-s1"].label == "soap embedded f=10 S=1"
    daemon = _train_command(cfg, SCHEDULES["soap-daemon-continuous-s1"], 0, None)
    assert daemon[daemon.index("--mode") + 1] == "daemon"
    assert daemon[daemon.index("--refresh") + 1] == "continuous"


def test_quiet_steps_are_the_ones_that_refresh_nothing() -> None:
    # f = 3: step 1 initializes, steps 1, 4, 7 (indices 0, 3, 6) refresh.
    times = [9.0, 1.0, 2.0, 8.0, 3.0, 4.0, 7.0]
    assert median_quiet_step_time(times, 3) == pytest.approx(2.5)
    assert median_quiet_step_time(times, None) is None
    assert median_quiet_step_time([5.0], 10) is None


def _run(config: str, losses: list[float], step_s: float, **extra: Any) -> dict[str, Any]:
    evals = [
        {"step": 10 * i, "val_loss": loss, "elapsed_s": step_s * 10 * i, "wall_s": 0.0}
        for i, loss in enumerate(losses)
    ]
    run = {
        "config": config,
        "seed": 0,
        "ok": True,
        "lr": 1e-3,
        "evals": evals,
        "final_val_loss": losses[-1],
        "train_s": evals[-1]["elapsed_s"],
        "process_wall_s": 1.0,
        "cpu_s": 2.0,
        "median_step_time_s": step_s,
        "runtime": {"max_lag_steps": 1, "barrier_waits": 2, "barrier_wait_s": 0.5}
        | {"local_fallbacks": 0},
        "train_batches_digest": "t",
        "val_batches_digest": "v",
    }
    return {**run, **extra}


def test_schedule_summary_takes_the_two_target_ratios() -> None:
    runs = [
        _run("adamw", [4.0, 3.0, 2.0], 0.1),
        _run("soap-native-f1", [4.0, 2.0, 1.5], 0.5, refreshes_per_100_steps=100.0),
        _run(
            "soap-native-f10",
            [4.0, 2.5, 1.8],
            0.12,
            median_quiet_step_time_s=0.1,
            refreshes_per_100_steps=10.0,
        ),
        _run(
            "soap-continuous-s1",
            [4.0, 2.0, 1.6],
            0.105,
            refreshes_per_100_steps=30.0,
            drift_at_install=1e-3,
        ),
    ]
    for run in runs:
        add_time_to_target(run, 2.0)
    configs = [{"name": n, **asdict(SCHEDULES[n]), "label": SCHEDULES[n].label} for n in SCHEDULES]
    configs = [c for c in configs if c["name"] in {r["config"] for r in runs}]
    summaries = {s["config"]: s for s in summarize_configs(runs, configs)}
    cont = summaries["soap-continuous-s1"]
    assert cont["steps_to_target_vs_native_f1"] == pytest.approx(10.0 / 10.0)
    assert cont["step_time_vs_native_f10_quiet"] == pytest.approx(1.05)
    assert cont["refreshes_per_100_steps"] == pytest.approx(30.0)
    assert summaries["adamw"]["steps_to_target_vs_native_f1"] is None
    data = {
        "benchmark": "schedules",
        "config": {
            "steps": 20,
            "eval_interval": 10,
            "eval_batches": 2,
            "seeds": [0],
            "threads": 1,
            "engine_workers": 1,
            "device": "cpu",
        },
        "adamw_sweep": [{"lr": 6e-3, "ok": True, "final_val_loss": 2.0}],
        "adamw_lr": 6e-3,
        "target_val_loss": 2.0,
        "batch_streams_identical": True,
        "summaries": list(summaries.values()),
        "figures": [str(Path("figures/schedules-loss-step.png"))],
    }
    text = report_section(data)
    assert "| soap embedded continuous S=1 |" in text
    assert "refreshes/100" in text and "1.05x" in text and "30.0" in text


def test_shapes_and_attach_reach_the_training_commands() -> None:
    cfg = ConvergenceConfig(configs=DEFAULT_SCHEDULES, shapes=tuple(SHAPES))
    wide = _train_command(cfg, SCHEDULES["soap-continuous-s1"], 0, None, SHAPES["wide"])
    assert wide[wide.index("--n-embd") + 1] == "256" and "--no-attach" not in wide
    deep = _train_command(cfg, SCHEDULES["soap-continuous-s1-noattach"], 0, None, SHAPES["deep"])
    assert int(deep[deep.index("--n-layer") + 1]) >= 6 and "--no-attach" in deep
    assert SHAPES["wide"].n_embd >= 256 and SHAPES["deep"].n_layer >= 6
    plain = _train_command(cfg, SCHEDULES["soap-daemon-continuous-s1-noattach"], 0, None)
    assert "--n-layer" not in plain and "--no-attach" in plain  # train's own model
    assert SCHEDULES["soap-daemon-continuous-s1-noattach"].label.endswith("no attach")
    embedded = _train_command(cfg, SCHEDULES["soap-embedded-f5-s1"], 0, None)
    assert embedded[embedded.index("--precondition-frequency") + 1] == "5"
    assert "--refresh-overhead" not in plain  # the optimizer's default unless given
    tight = dataclasses.replace(cfg, refresh_overhead=0.02)
    cont = _train_command(tight, SCHEDULES["soap-continuous-s1"], 0, None)
    assert cont[cont.index("--refresh-overhead") + 1] == "0.02"
    assert "--refresh-overhead" not in _train_command(
        tight, SCHEDULES["soap-embedded-f5-s1"], 0, None
    )
    assert (
        config_from_args(_args("--schedules", "--refresh-overhead", "0.02")).refresh_overhead
        == 0.02
    )
    with pytest.raises(ValueError, match="refresh_overhead"):
        ConvergenceConfig(refresh_overhead=1.5)


def test_several_shapes_report_every_row_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_convergence over three shapes (its training runs replaced by made-up records):
    one block per shape with its own sweep, target and summaries, and the report and the
    terminal table give every configuration's row under each shape's heading."""
    from asteria_client.bench import convergence

    calls: list[tuple[str, str | None]] = []
    loss_of_shape = {None: 2.0, "train": 2.0, "wide": 1.8, "deep": 1.9}

    def fake_run_one(cfg: Any, run: Any, seed: int, lr: Any, workdir: Any, shape: Any) -> Any:
        name = None if shape is None else shape.name
        calls.append((run.name, name))
        base = loss_of_shape[name]
        record = _run(run.name, [base + 2, base + 1, base], 0.1, seed=seed, lr=lr or 1e-3)
        record.update(label=run.label, shape=name)
        if run.refresh == "continuous":
            record.update(
                floor_per_100_steps=20.0,
                extra_per_100_steps=5.0,
                refreshes_per_100_steps=25.0,
                extra_limited_steps={
                    "credit": 3,
                    "overhead_budget": 1,
                    "no_pull_point": 0 if run.attach else 9,
                    "steps": 9,
                },
            )
        return record

    monkeypatch.setattr(convergence, "run_one", fake_run_one)
    cfg = ConvergenceConfig(
        configs=DEFAULT_SCHEDULES,
        shapes=("train", "wide", "deep"),
        seeds=(0,),
        adamw_lrs=(1e-3,),
        schedules=True,
    )
    data = convergence.run_convergence(cfg, progress=lambda record: None)
    assert [b["shape"]["name"] for b in data["shapes"]] == ["train", "wide", "deep"]
    assert {shape for _, shape in calls} == {"train", "wide", "deep"}
    assert len(calls) == convergence.plan_size(cfg) == 3 * len(DEFAULT_SCHEDULES)
    for block in data["shapes"]:
        assert [s["config"] for s in block["summaries"]] == list(DEFAULT_SCHEDULES)
    assert data["shapes"][1]["target_val_loss"] == pytest.approx(1.8)
    text = report_section(data)
    assert text.count("### Shape ") == 3 and "### Shape wide: 2 layers, d 256" in text
    for label in ("soap embedded continuous S=1 no attach", "soap daemon continuous S=1"):
        assert text.count(f"| {label} |") == 3, label
    assert "25.0 (20.0+5.0)" in text and "3/1/9 of 9" in text
    terminal = convergence.summary.format_report(data)
    assert terminal.count("Shape deep: 6 layers") == 1


def test_a_runs_dir_keeps_finished_runs_and_resumes_from_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a runs dir, a second invocation trains only what the first did not finish: the
    kept runs are taken as they were, a failed run and an unreadable file train again, and a
    change of settings (steps) trains everything again."""
    from asteria_client.bench import convergence

    calls: list[tuple[str, int]] = []
    failing = {"soap-continuous-s1"}

    def fake_run_one(cfg: Any, run: Any, seed: int, lr: Any, workdir: Any, shape: Any) -> Any:
        calls.append((run.name, seed))
        record = _run(run.name, [3.0, 2.5, 2.0], 0.1, seed=seed, lr=lr or 1e-3)
        record.update(label=run.label, shape=None if shape is None else shape.name)
        if run.name in failing:
            record.update(ok=False, error="exit code 1")
        return record

    monkeypatch.setattr(convergence, "run_one", fake_run_one)
    names = ("adamw", "soap-embedded-f5-s1", "soap-continuous-s1")
    cfg = ConvergenceConfig(
        configs=names, shapes=("deep",), seeds=(0, 1), adamw_lrs=(1e-3, 2e-3), schedules=True
    )
    runs_dir = tmp_path / "runs"
    first = convergence.run_convergence(cfg, progress=lambda r: None, runs_dir=runs_dir)
    assert len(calls) == convergence.plan_size(cfg) == 2 + 2 * 3 - 1
    assert first["runs_reused"] == 0
    kept = sorted(p.name for p in runs_dir.glob("*.json"))
    assert "deep-adamw-seed0-lr0.002.json" in kept and len(kept) == 5  # not the 2 failed runs

    calls.clear()
    failing.clear()
    (runs_dir / "deep-soap-embedded-f5-s1-seed1.json").write_text("{cut short")
    second = convergence.run_convergence(cfg, progress=lambda r: None, runs_dir=runs_dir)
    retrained = [("soap-continuous-s1", 0), ("soap-continuous-s1", 1), ("soap-embedded-f5-s1", 1)]
    assert sorted(calls) == retrained
    assert second["runs_reused"] == 4
    block = second  # one shape: reported at the top level
    kept_run = next(r for r in block["runs"] if r["config"] == "soap-embedded-f5-s1")
    assert kept_run["reused_from"].endswith("deep-soap-embedded-f5-s1-seed0.json")
    continuous = next(s for s in block["summaries"] if s["config"] == "soap-continuous-s1")
    assert continuous["num_runs"] == 2 and continuous["num_failed"] == 0

    calls.clear()
    tight = dataclasses.replace(cfg, refresh_overhead=0.02)  # only the continuous rows differ
    convergence.run_convergence(tight, progress=lambda r: None, runs_dir=runs_dir)
    assert sorted(calls) == [("soap-continuous-s1", 0), ("soap-continuous-s1", 1)]
    assert (runs_dir / "deep-soap-continuous-s1-overhead0.02-seed1.json").exists()

    calls.clear()
    longer = dataclasses.replace(cfg, steps=cfg.steps + 100)
    third = convergence.run_convergence(longer, progress=lambda r: None, runs_dir=runs_dir)
    assert len(calls) == convergence.plan_size(cfg) and third["runs_reused"] == 0
