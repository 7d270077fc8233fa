"""Time to target, summaries and the report section of `asteria bench convergence`, by hand."""

from __future__ import annotations

import math
import os
import signal
import sys
from typing import Any

import pytest

from asteria_client.bench.convergence import CONFIGS, ConvergenceConfig, _run_process, plan_size
from asteria_client.bench.convergence_summary import (
    add_time_to_target,
    batch_streams_identical,
    interpolated_crossing,
    mean_curve,
    report_section,
    summarize_configs,
)


def test_crossing_interpolates_between_the_evaluations_around_the_target() -> None:
    # 3.0 at step 10, 2.0 at step 20: 2.5 is half way.
    assert interpolated_crossing([0, 10, 20], [4.0, 3.0, 2.0], 2.5) == pytest.approx(15.0)
    # Seconds need not be evenly spaced: 2.5 -> 2.0 over 1.5 s .. 4.0 s, 2.2 is 60% of the way.
    assert interpolated_crossing([0.0, 1.5, 4.0], [3.0, 2.5, 2.0], 2.2) == pytest.approx(3.0)


def test_crossing_at_exactly_the_target_is_that_evaluation() -> None:
    assert interpolated_crossing([0, 10, 20], [4.0, 3.0, 2.0], 3.0) == pytest.approx(10.0)


def test_crossing_takes_the_first_evaluation_at_or_below_even_if_the_loss_rises_again() -> None:
    # 4.0 -> 3.0 crosses 3.2 at 80% of the interval; the later 3.5 does not matter.
    assert interpolated_crossing([0, 10, 20, 30], [4.0, 3.0, 3.5, 2.0], 3.2) == pytest.approx(8.0)


def test_crossing_at_the_first_point_and_never() -> None:
    assert interpolated_crossing([5, 10], [2.0, 1.0], 3.0) == 5.0
    assert interpolated_crossing([0, 10, 20], [4.0, 3.0, 2.0], 1.0) is None
    with pytest.raises(ValueError, match="length"):
        interpolated_crossing([0, 10], [1.0], 1.0)


def _run(config: str, seed: int, losses: list[float], **extra: Any) -> dict[str, Any]:
    evals = [
        {"step": 10 * i, "val_loss": loss, "elapsed_s": 2.0 * i, "wall_s": 2.5 * i}
        for i, loss in enumerate(losses)
    ]
    run = {
        "config": config,
        "seed": seed,
        "ok": True,
        "lr": 1e-3,
        "evals": evals,
        "final_val_loss": losses[-1],
        "train_s": evals[-1]["elapsed_s"],
        "process_wall_s": 10.0,
        "cpu_s": 12.0,
        "median_step_time_s": 0.2,
        "runtime": {},
        "train_batches_digest": f"train-{seed}",
        "val_batches_digest": "val",
    }
    return {**run, **extra}


def _configs(*names: str) -> list[dict[str, Any]]:
    return [
        {
            "name": n,
            "label": CONFIGS[n].label,
            "optimizer": CONFIGS[n].optimizer,
            "mode": CONFIGS[n].mode,
            "staleness_budget": CONFIGS[n].staleness_budget,
        }
        for n in names
    ]


def test_summaries_average_reached_seeds_and_take_ratios() -> None:
    stats = {"max_lag_steps": 10, "barrier_waits": 3, "barrier_wait_s": 0.1, "local_fallbacks": 1}
    runs = [
        _run("adamw", 0, [4.0, 3.0, 2.0]),  # target 2.1: crosses at step 19, 3.8 s
        _run("adamw", 1, [4.0, 3.0, 2.2]),  # never reaches 2.1
        _run("soap-native", 0, [4.0, 2.0, 1.8]),  # 4.0 -> 2.0 crosses 2.1 at step 9.5
        _run("soap-native", 1, [4.0, 2.0, 1.8]),
        _run("soap-embedded-s1", 0, [4.0, 3.0, 1.6], runtime=stats),  # step 16.43, 3.29 s
        {"config": "soap-embedded-s1", "seed": 1, "ok": False, "error": "diverged"},
    ]
    target = (2.0 + 2.2) / 2
    for run in runs:
        add_time_to_target(run, target)
    summaries = {
        s["config"]: s for s in summarize_configs(runs, _configs(*{r["config"]: 0 for r in runs}))
    }

    adamw, native, embedded = (
        summaries["adamw"],
        summaries["soap-native"],
        summaries["soap-embedded-s1"],
    )
    assert adamw["num_reached"] == 1 and adamw["steps_to_target_mean"] == pytest.approx(19.0)
    assert adamw["final_val_loss_mean"] == pytest.approx(2.1)
    assert adamw["final_val_loss_std"] == pytest.approx(math.sqrt(0.02))
    assert native["steps_to_target_mean"] == pytest.approx(9.5)
    assert native["train_s_to_target_mean"] == pytest.approx(1.9)
    assert native["steps_to_target_vs_adamw"] == pytest.approx(9.5 / 19.0)
    assert native["train_s_to_target_vs_native"] is None  # native is the reference
    assert embedded["num_failed"] == 1 and embedded["final_val_loss_std"] is None
    assert embedded["steps_to_target_mean"] == pytest.approx(10 + 0.9 / 1.4 * 10)
    assert embedded["train_s_to_target_vs_native"] == pytest.approx((2 + 0.9 / 1.4 * 2) / 1.9)
    assert embedded["max_lag_steps"] == 10 and embedded["local_fallbacks_total"] == 1
    assert adamw["max_lag_steps"] is None  # AdamW has no preconditioner


def test_mean_curve_averages_evaluations_over_seeds() -> None:
    runs = [_run("adamw", 0, [4.0, 3.0]), _run("adamw", 1, [4.2, 2.0, 1.0])]
    assert mean_curve(runs, "step") == ([0.0, 10.0], [pytest.approx(4.1), pytest.approx(2.5)])


def test_batch_streams_must_match_per_seed() -> None:
    same = [_run("adamw", 0, [1.0]), _run("soap-native", 0, [1.0]), _run("adamw", 1, [1.0])]
    assert batch_streams_identical(same)
    assert not batch_streams_identical(
        [*same, _run("soap-native", 1, [1.0], train_batches_digest="x")]
    )
    assert not batch_streams_identical(
        [*same, _run("soap-native", 1, [1.0], val_batches_digest="y")]
    )


def test_report_section_lists_every_configuration_and_figure() -> None:
    runs = [_run("adamw", 0, [4.0, 2.0]), _run("soap-native", 0, [4.0, 1.5])]
    for run in runs:
        add_time_to_target(run, 2.0)
    configs = _configs("adamw", "soap-native")
    data = {
        "config": {
            "steps": 10,
            "eval_interval": 10,
            "eval_batches": 2,
            "seeds": [0],
            "threads": 1,
            "engine_workers": 1,
            "device": "cpu",
        },
        "adamw_sweep": [
            {"lr": 6e-3, "ok": True, "final_val_loss": 2.0},
            {"lr": 1e-2, "ok": False, "final_val_loss": None},
        ],
        "adamw_lr": 6e-3,
        "target_val_loss": 2.0,
        "batch_streams_identical": True,
        "summaries": summarize_configs(runs, configs),
        "figures": ["figures/convergence-loss-step.png"],
    }
    text = report_section(data)
    assert "| adamw |" in text and "| soap native |" in text
    assert "![convergence-loss-step](figures/convergence-loss-step.png)" in text
    assert "1e-02: failed" not in text and "0.01: failed" in text


def test_config_validation_and_plan() -> None:
    cfg = ConvergenceConfig(configs=("soap-native",), seeds=(0, 1), adamw_lrs=(1e-3, 2e-3))
    assert cfg.configs == ("adamw", "soap-native")  # adamw always runs: it sets the target
    assert plan_size(cfg) == 2 + 2 * 2 - 1  # the sweep's best run is seed 0's AdamW run
    with pytest.raises(ValueError, match="unknown"):
        ConvergenceConfig(configs=("soap-turbo",))
    with pytest.raises(ValueError, match="seeds"):
        ConvergenceConfig(seeds=(0, 0))
    with pytest.raises(ValueError, match="steps"):
        ConvergenceConfig(steps=0)


def test_a_failing_run_reports_its_exit_code_and_log(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = "import sys; print('the trainer broke'); sys.exit(3)"
    proc = _run_process([sys.executable, "-c", code], dict(os.environ), tmp_path, timeout_s=60)
    assert proc.returncode == 3 and proc.result is None
    assert "the trainer broke" in proc.log_tail and proc.cpu_s >= 0


def test_a_hung_run_is_killed_at_its_timeout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = "import time; time.sleep(60)"
    proc = _run_process([sys.executable, "-c", code], dict(os.environ), tmp_path, timeout_s=0.5)
    assert proc.returncode == -signal.SIGKILL and "killed after" in proc.log_tail
