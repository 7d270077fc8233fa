"""`asteria bench convergence --schedules`: its configurations, commands and table, by hand."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from asteria_client import SOAP
from asteria_client.bench.convergence import (
    CONFIGS,
    SCHEDULES,
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
    assert cfg.schedules and cfg.configs == tuple(SCHEDULES)
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
