"""`asteria bench convergence`: does the asynchrony cost convergence, and what does it buy?

Trains the `asteria train` model on the Shakespeare corpus with AdamW, native Shampoo, SOAP and
KL-Shampoo, and SOAP with its bases computed asynchronously (staleness budget S = 1, 2, 5) in the
embedded engine and in a daemon, over several seeds. For one seed every run sees the same
initial weights and batch stream; all are scored on the same fixed validation batches.

AdamW first gets a small learning-rate sweep on the first seed; the best final validation loss
picks its lr for every seed, and tuned AdamW's mean final validation loss is the *target*. The
second-order optimizers use their default lr. Per configuration it reports the final validation
loss (mean ± std over seeds), steps and training seconds to the target (the first evaluation at
or below it, interpolated), CPU seconds of the whole run including the engine's worker processes
(and the daemon's, for daemon runs: asynchrony is not free), the median step time, and the
staleness observed (max lag, barrier waits, local fallbacks).

With ``--schedules`` it compares refresh schedules of SOAP instead (the report is then a
``schedules`` benchmark), on several model shapes (``--shapes``; default: the `asteria train`
GPT, a wider one and a deeper one, see :data:`SHAPES`), each with its own AdamW sweep and
target: native at f = 1 (a synchronous refresh every step) and f = 5 (SOAP's default), the
embedded engine at f = 5 (S = 1 interval: the amortized schedule), and the embedded engine and
a daemon refreshing continuously at S = 1 step (the daemon's client pulls by its Credit
messages), each with and without the optimizer's hooks on the model (``--no-attach``: as a
user who leaves ``attach(model)`` out). f = 10 and continuous S = 2, 4 can be named too.
Besides the columns above it reports refreshes per block per 100 steps (floor + extra on the
continuous schedule), the drift of the bases at install, steps to target against native f = 1
and against amortized embedded, and the median step time against amortized embedded's and
against the median of native f = 5's steps that refresh nothing (the step time continuous
refresh aims at).

Each run is its own `asteria train` process, one at a time, with the same torch thread count;
the engine (embedded, or a fresh daemon per run) gets --engine-workers solver processes. Every
training process flushes subnormal floats to zero unless --no-flush-denormal (see
:mod:`asteria_client.train.cpu`); nothing is pinned.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asteria_client.bench import convergence_summary as summary
from asteria_client.bench import output, run_records
from asteria_client.bench.run_records import RunRecords
from asteria_client.config import environ_without_asteria
from asteria_client.daemon_process import DaemonProcess
from asteria_server.errors import AsteriaError

logger = logging.getLogger(__name__)

#: Peak learning rates AdamW's sweep tries (the default is 6e-3; see train/optimizers.py).
ADAMW_LRS = (3e-3, 6e-3, 1e-2)
#: A run taking longer than this (or RUN_TIMEOUT_S_PER_STEP per step, if more) is killed.
RUN_TIMEOUT_S = 600.0
RUN_TIMEOUT_S_PER_STEP = 5.0


class ConvergenceBenchError(AsteriaError):
    """The benchmark could not produce its target (every AdamW run failed)."""


@dataclass(frozen=True)
class ModelShape:
    """A GPT shape the benchmark trains (`asteria train`'s --n-layer, --n-embd, --n-head;
    the context and batch are `asteria train`'s defaults)."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int

    @property
    def label(self) -> str:
        return f"{self.name} ({self.n_layer} layers, d {self.n_embd}, {self.n_head} heads)"


def _shapes() -> dict[str, ModelShape]:
    from asteria_client.train.config import TrainConfig

    train = TrainConfig()
    shapes = [
        ModelShape("train", train.n_layer, train.n_embd, train.n_head),
        ModelShape("wide", train.n_layer, 256, train.n_head),
        ModelShape("deep", 6, train.n_embd, train.n_head),
    ]
    return {shape.name: shape for shape in shapes}


#: Model shapes `--schedules` compares on: a setting tuned on one model can lose on the next.
SHAPES = _shapes()


@dataclass(frozen=True)
class RunConfig:
    """One configuration compared: an optimizer, where its solves run, its staleness budget."""

    name: str
    optimizer: str
    mode: str | None = None  # None for AdamW
    staleness_budget: int | None = None  # async modes only
    precondition_frequency: int | None = None  # None: the optimizer's own (10)
    refresh: str | None = None  # None: amortized; "continuous"
    attach: bool = True  # False: trained without the optimizer's hooks (--no-attach)

    @property
    def label(self) -> str:
        if self.mode is None:
            return self.optimizer
        if self.refresh == "continuous":
            hooks = "" if self.attach else " no attach"
            return f"{self.optimizer} {self.mode} continuous S={self.staleness_budget}{hooks}"
        freq = (
            f" f={self.precondition_frequency}" if self.precondition_frequency is not None else ""
        )
        budget = f" S={self.staleness_budget}" if self.staleness_budget is not None else ""
        return f"{self.optimizer} {self.mode}{freq}{budget}"

    @property
    def amortized_frequency(self) -> int | None:
        """Steps between refreshes on the amortized schedule (None: AdamW, continuous)."""
        if self.mode is None or self.refresh == "continuous":
            return None
        return self.precondition_frequency or default_frequency(self.optimizer)


def default_frequency(optimizer: str) -> int:
    """The precondition frequency ``optimizer`` (an `asteria train --optimizer` name) runs
    with when none is given: its class's default, read from its signature."""
    from asteria_client import SOAP, KLShampoo, Shampoo

    classes = {"soap": SOAP, "shampoo": Shampoo, "kl-shampoo": KLShampoo}
    parameters = inspect.signature(classes[optimizer]).parameters
    return int(parameters["precondition_frequency"].default)


def _all_configs() -> dict[str, RunConfig]:
    configs = [RunConfig("adamw", "adamw")]
    configs += [RunConfig(f"{o}-native", o, "native") for o in ("shampoo", "soap", "kl-shampoo")]
    for mode in ("embedded", "daemon"):
        configs += [RunConfig(f"soap-{mode}-s{s}", "soap", mode, s) for s in (1, 2, 5)]
    return {c.name: c for c in configs}


def _schedule_configs() -> dict[str, RunConfig]:
    configs = [
        RunConfig("adamw", "adamw"),
        RunConfig("soap-native-f1", "soap", "native", precondition_frequency=1),
        RunConfig("soap-native-f5", "soap", "native", precondition_frequency=5),
        RunConfig("soap-embedded-f5-s1", "soap", "embedded", 1, precondition_frequency=5),
        RunConfig("soap-native-f10", "soap", "native", precondition_frequency=10),
        RunConfig("soap-embedded-f10-s1", "soap", "embedded", 1, precondition_frequency=10),
    ]
    configs += [
        RunConfig(f"soap-continuous-s{s}", "soap", "embedded", s, refresh="continuous")
        for s in (1, 2, 4)
    ]
    configs.append(
        RunConfig(
            "soap-continuous-s1-noattach", "soap", "embedded", 1, refresh="continuous", attach=False
        )
    )
    configs.append(
        RunConfig("soap-daemon-continuous-s1", "soap", "daemon", 1, refresh="continuous")
    )
    configs.append(
        RunConfig(
            "soap-daemon-continuous-s1-noattach",
            "soap",
            "daemon",
            1,
            refresh="continuous",
            attach=False,
        )
    )
    return {c.name: c for c in configs}


#: ``--schedules``: refresh schedules of SOAP compared on the same batches.
SCHEDULES = _schedule_configs()
#: What ``--schedules`` runs when given without names: issue 30's comparison (continuous with
#: and without hooks, embedded and daemon, against amortized embedded at SOAP's default f and
#: native f = 1).
DEFAULT_SCHEDULES = (
    "adamw",
    "soap-native-f1",
    "soap-native-f5",
    "soap-embedded-f5-s1",
    "soap-continuous-s1",
    "soap-continuous-s1-noattach",
    "soap-daemon-continuous-s1",
    "soap-daemon-continuous-s1-noattach",
)
CONFIGS = {**_all_configs(), **SCHEDULES}
QUICK_CONFIGS = ("adamw", "soap-native", "soap-embedded-s1", "soap-daemon-s1")


@dataclass(frozen=True, kw_only=True)
class ConvergenceConfig:
    """The whole benchmark. ``configs`` are names in ``CONFIGS``; AdamW always runs."""

    steps: int = 300
    eval_interval: int = 25
    eval_batches: int = 16
    seeds: tuple[int, ...] = (0, 1, 2)
    configs: tuple[str, ...] = tuple(_all_configs())
    adamw_lrs: tuple[float, ...] = ADAMW_LRS
    threads: int = 1
    engine_workers: int = 1
    device: str = "cpu"
    flush_denormal: bool = True
    quick: bool = False
    schedules: bool = False  # the report compares refresh schedules (a "schedules" benchmark)
    #: model shapes (names in SHAPES), each with its own AdamW sweep, target and table
    shapes: tuple[str, ...] = ("train",)
    #: the continuous schedule's overhead budget (None: the optimizer's default)
    refresh_overhead: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.flush_denormal, bool):
            raise ValueError(f"flush_denormal must be True or False, got {self.flush_denormal!r}")
        for name in ("steps", "eval_interval", "eval_batches", "threads", "engine_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"seeds must be distinct integers >= 0, got {self.seeds}")
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown:
            raise ValueError(f"configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
        if "adamw" not in self.configs:  # its final loss is the target
            object.__setattr__(self, "configs", ("adamw", *self.configs))
        if not self.adamw_lrs or not all(0 < lr < math.inf for lr in self.adamw_lrs):
            raise ValueError(f"adamw_lrs must be positive finite numbers, got {self.adamw_lrs}")
        overhead = self.refresh_overhead
        if overhead is not None and not 0.0 < overhead <= 1.0:
            raise ValueError(f"refresh_overhead must be in (0, 1], got {overhead}")
        unknown = [s for s in self.shapes if s not in SHAPES]
        if not self.shapes or unknown or len(set(self.shapes)) != len(self.shapes):
            raise ValueError(
                f"shapes must be distinct names from {', '.join(SHAPES)}, got {self.shapes}"
            )


@dataclass
class _Process:
    """What one finished `asteria train` process left: exit code, times, its JSON."""

    returncode: int
    wall_s: float
    cpu_s: float
    result: dict[str, Any] | None
    log_tail: str = ""


def _train_command(
    cfg: ConvergenceConfig,
    run: RunConfig,
    seed: int,
    lr: float | None,
    shape: ModelShape | None = None,
) -> list[str]:
    cmd = [sys.executable, "-m", "asteria_client.cli", "train", "--optimizer", run.optimizer]
    if shape is not None:
        cmd += ["--n-layer", str(shape.n_layer), "--n-embd", str(shape.n_embd)]
        cmd += ["--n-head", str(shape.n_head)]
    cmd += ["--steps", str(cfg.steps), "--seed", str(seed), "--device", cfg.device]
    cmd += ["--threads", str(cfg.threads), "--eval-interval", str(cfg.eval_interval)]
    cmd += ["--eval-batches", str(cfg.eval_batches), "--log-interval", str(cfg.steps)]
    if lr is not None:
        cmd += ["--lr", repr(lr)]
    if not cfg.flush_denormal:
        cmd += ["--no-flush-denormal"]
    if run.mode is not None:
        cmd += ["--mode", run.mode]
    if run.mode == "embedded":
        cmd += ["--engine-workers", str(cfg.engine_workers)]
    if run.staleness_budget is not None:
        cmd += ["--staleness-budget", str(run.staleness_budget)]
    if run.precondition_frequency is not None:
        cmd += ["--precondition-frequency", str(run.precondition_frequency)]
    if run.refresh is not None:
        cmd += ["--refresh", run.refresh]
    if run.refresh == "continuous" and cfg.refresh_overhead is not None:
        cmd += ["--refresh-overhead", repr(cfg.refresh_overhead)]
    if not run.attach:
        cmd += ["--no-attach"]
    return cmd


def _run_process(cmd: list[str], env: dict[str, str], workdir: Path, timeout_s: float) -> _Process:
    """Run ``cmd --json ...`` to the end; its CPU time comes from ``wait4``, so it includes the
    engine workers the trainer reaped."""
    json_path, log_path = workdir / "run.json", workdir / "run.log"
    json_path.unlink(missing_ok=True)
    start = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*cmd, "--json", str(json_path)], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    timed_out, reaped = False, False
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                reaped = True
                break
            if time.perf_counter() - start > timeout_s:
                timed_out = True
                proc.send_signal(signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
                reaped = True
                break
            time.sleep(0.05)
    finally:
        if not reaped:  # interrupted: do not leave a trainer running
            proc.send_signal(signal.SIGKILL)
            os.wait4(proc.pid, 0)
            proc.returncode = -signal.SIGKILL
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall_s = time.perf_counter() - start
    result = json.loads(json_path.read_text()) if json_path.exists() else None
    tail = log_path.read_text(errors="replace")[-2000:] if proc.returncode != 0 else ""
    if timed_out:
        tail = f"killed after {timeout_s:.0f} s\n{tail}"
    return _Process(proc.returncode, wall_s, usage.ru_utime + usage.ru_stime, result, tail)


def _child_env() -> dict[str, str]:
    """This environment without ASTERIA_* (a user's ASTERIA_ADDRESS must not pick the mode)."""
    return environ_without_asteria()


def run_one(
    cfg: ConvergenceConfig,
    run: RunConfig,
    seed: int,
    lr: float | None,
    workdir: Path,
    shape: ModelShape | None = None,
) -> dict[str, Any]:
    """Train one configuration on one seed and return its measurements (see the module doc)."""
    cmd = _train_command(cfg, run, seed, lr, shape)
    timeout_s = max(RUN_TIMEOUT_S, RUN_TIMEOUT_S_PER_STEP * cfg.steps)
    env = _child_env()
    daemon_cpu_s = None
    if run.mode == "daemon":
        with DaemonProcess(workers=cfg.engine_workers) as daemon:
            proc = _run_process(cmd, {**env, "ASTERIA_ADDRESS": daemon.address}, workdir, timeout_s)
        daemon_cpu_s = daemon.cpu_s
    else:
        proc = _run_process(cmd, env, workdir, timeout_s)
    record: dict[str, Any] = {
        "config": run.name,
        "label": run.label,
        "optimizer": run.optimizer,
        "mode": run.mode,
        "staleness_budget": run.staleness_budget,
        "precondition_frequency": run.precondition_frequency,
        "refresh": run.refresh,
        "attach": run.attach,
        "shape": None if shape is None else shape.name,
        "seed": seed,
        "lr": lr,
        "ok": proc.returncode == 0 and proc.result is not None,
        "error": None,
        "returncode": proc.returncode,
        "process_wall_s": proc.wall_s,
        "trainer_cpu_s": proc.cpu_s,
        "daemon_cpu_s": daemon_cpu_s,
        "cpu_s": proc.cpu_s + (daemon_cpu_s or 0.0),
    }
    if not record["ok"] or proc.result is None:
        record["error"] = proc.log_tail or f"exit code {proc.returncode}, no JSON written"
        return record
    result = proc.result
    steps = result["steps"]
    refreshes = (result.get("optimizer") or {}).get("refreshes") or {}
    step_times = [s["step_time_s"] for s in steps]
    record.update(
        lr=result["config"]["resolved"]["lr"],
        flush_denormal=result["config"]["resolved"].get("flush_denormal"),
        final_val_loss=result["final"]["val_loss"],
        final_train_loss=result["final"]["train_loss"],
        median_step_time_s=result["final"]["median_step_time_s"],
        train_s=sum(s["step_time_s"] for s in steps),
        evals=result["evals"],
        train_losses=[s["loss"] for s in steps],
        step_times_s=step_times,
        median_quiet_step_time_s=summary.median_quiet_step_time(
            step_times, run.amortized_frequency
        ),
        refreshes_per_100_steps=refreshes.get("refreshes_per_100_steps_mean"),
        floor_per_100_steps=refreshes.get("floor_per_100_steps_mean"),
        extra_per_100_steps=refreshes.get("extra_per_100_steps_mean"),
        extra_limited_steps=refreshes.get("extra_limited_steps"),
        drift_at_install=refreshes.get("drift_at_install_mean"),
        runtime=result["optimizer"],
        train_batches_digest=result["data"]["train_batches_digest"],
        val_batches_digest=result["data"]["val_batches_digest"],
    )
    return record


class _Progress:
    """One log line per finished run, with an estimate of the time left."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def __call__(self, record: dict[str, Any]) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        left_s = elapsed / self.done * (self.total - self.done)
        outcome = (
            f"final val {record['final_val_loss']:.4f}"
            if record["ok"]
            else f"FAILED ({record['error'].strip().splitlines()[-1] if record['error'] else ''})"
        )
        if record.get("reused_from"):
            outcome += f", kept in {record['reused_from']}"
        lr = f" lr {record['lr']:g}" if record["lr"] is not None else ""
        shape = f" [{record['shape']}]" if record.get("shape") else ""
        logger.info(
            "convergence [%d/%d] %s%s seed %d%s: %s, %.0f s, %.0f CPU-s; about %.0f min left",
            self.done,
            self.total,
            record["label"],
            shape,
            record["seed"],
            lr,
            outcome,
            record["process_wall_s"],
            record["cpu_s"],
            left_s / 60,
        )


def plan_size(cfg: ConvergenceConfig) -> int:
    """How many training runs the benchmark makes (the sweep's best run doubles as a seed)."""
    return len(cfg.shapes) * (len(cfg.adamw_lrs) + len(cfg.seeds) * len(cfg.configs) - 1)


def run_convergence(
    cfg: ConvergenceConfig,
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
    runs_dir: Path | None = None,
) -> dict[str, Any]:
    """Per model shape: sweep AdamW's lr, then run every configuration on every seed (seed by
    seed, so slow machine drifts spread over all configurations), then summarize. One shape
    (the default without ``--schedules``) reports at the top level as before; several report
    one block each under ``"shapes"``. With ``runs_dir``, every finished run is kept there and
    runs already kept there are taken instead of trained (:mod:`.run_records`)."""
    started = time.time()
    records = None
    if runs_dir is not None:
        records = RunRecords(runs_dir, {name: getattr(cfg, name) for name in run_records.SETTINGS})
    configs = [CONFIGS[name] for name in cfg.configs]
    report_progress = progress if progress is not None else _Progress(plan_size(cfg))
    logger.info(
        "convergence: %d runs of %d steps (%s; seeds %s; shapes %s)",
        plan_size(cfg),
        cfg.steps,
        ", ".join(c.name for c in configs),
        ",".join(map(str, cfg.seeds)),
        ",".join(cfg.shapes),
    )
    several = len(cfg.shapes) > 1
    blocks = []
    with tempfile.TemporaryDirectory(prefix="asteria-convergence-") as tmp:
        for name in cfg.shapes:
            shape = SHAPES[name] if several or name != "train" else None
            block = _run_shape(cfg, configs, shape, Path(tmp), report_progress, records)
            blocks.append({"shape": asdict(SHAPES[name]), **block})
    config_dicts = [{**asdict(c), "label": c.label} for c in configs]
    report: dict[str, Any] = {
        "benchmark": "schedules" if cfg.schedules else "convergence",
        "quick": cfg.quick,
        "config": {
            **asdict(cfg),
            "seeds": list(cfg.seeds),
            "configs": list(cfg.configs),
            "shapes": list(cfg.shapes),
        },
        "started_unix_s": started,
        "configs": config_dicts,
    }
    if records is not None:
        report["runs_dir"] = str(runs_dir)
        report["runs_reused"] = records.reused
    if several:
        report["shapes"] = blocks
    else:
        report.update(blocks[0])
    report["wall_time_s"] = time.time() - started
    return report


def _run_shape(
    cfg: ConvergenceConfig,
    configs: list[RunConfig],
    shape: ModelShape | None,
    workdir: Path,
    report_progress: Callable[[dict[str, Any]], None],
    records: RunRecords | None = None,
) -> dict[str, Any]:
    """One shape's sweep, runs and summaries (``shape`` None: `asteria train`'s own model)."""
    shape_name = None if shape is None else shape.name

    def run(config: RunConfig, seed: int, lr: float | None) -> dict[str, Any]:
        name = config.name  # as kept in the runs dir: with the budget that changes its run
        if config.refresh == "continuous" and cfg.refresh_overhead is not None:
            name += f"-overhead{cfg.refresh_overhead:g}"
        record = None if records is None else records.load(shape_name, name, seed, lr)
        if record is None:
            record = run_one(cfg, config, seed, lr, workdir, shape)
            if records is not None and record["ok"]:
                records.save(shape_name, name, seed, lr, record)
        report_progress(record)
        return record

    runs: list[dict[str, Any]] = []
    sweep = [run(CONFIGS["adamw"], cfg.seeds[0], lr) for lr in cfg.adamw_lrs]
    finished = [r for r in sweep if r["ok"]]
    if not finished:
        raise ConvergenceBenchError(
            "every AdamW run of the lr sweep failed, so there is no target; first error:\n"
            + str(sweep[0]["error"])
        )
    best = min(finished, key=lambda r: r["final_val_loss"])
    adamw_lr = best["lr"]
    for seed in cfg.seeds:
        for config in configs:
            if config.name == "adamw" and seed == cfg.seeds[0]:
                runs.append(best)
            else:
                runs.append(run(config, seed, adamw_lr if config.name == "adamw" else None))

    tuned = [r["final_val_loss"] for r in runs if r["config"] == "adamw" and r["ok"]]
    target = sum(tuned) / len(tuned)
    for record in runs:
        summary.add_time_to_target(record, target)
    config_dicts = [{**asdict(c), "label": c.label} for c in configs]
    return {
        "adamw_sweep": [
            {"lr": r["lr"], "ok": r["ok"], "final_val_loss": r.get("final_val_loss")} for r in sweep
        ],
        "adamw_lr": adamw_lr,
        "target_val_loss": target,
        "batch_streams_identical": summary.batch_streams_identical([*sweep, *runs]),
        "summaries": summary.summarize_configs(runs, config_dicts),
        "runs": runs,
        "adamw_sweep_runs": [r for r in sweep if r is not best],
    }


# --- command line -----------------------------------------------------------------------------


def _csv(convert: Callable[[str], Any], what: str) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(convert(item.strip()) for item in text.split(",") if item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None

    return parse


def register(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "convergence",
        help="convergence: AdamW vs native vs async second-order, to a common target",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"40 steps, seed 0, AdamW lr 6e-3 only, configs {','.join(QUICK_CONFIGS)} "
        "(under 2 minutes on 2 cores)",
    )
    parser.add_argument("--steps", type=int, help="steps per run (default 300; quick 40)")
    parser.add_argument(
        "--eval-interval", type=int, metavar="STEPS", help="steps between evaluations (default 25)"
    )
    parser.add_argument(
        "--eval-batches", type=int, help="fixed validation batches per evaluation (default 16)"
    )
    parser.add_argument(
        "--seeds", type=_csv(int, "integers like 0,1,2"), help="comma-separated (default 0,1,2)"
    )
    parser.add_argument(
        "--configs",
        type=_csv(str, "names"),
        help=f"comma-separated subset of {','.join(CONFIGS)} (default: all; adamw always runs)",
    )
    parser.add_argument(
        "--adamw-lrs",
        type=_csv(float, "numbers like 3e-3,6e-3"),
        metavar="LRS",
        help="AdamW's lr sweep (default 3e-3,6e-3,1e-2; quick 6e-3)",
    )
    parser.add_argument(
        "--schedules",
        nargs="?",
        const=",".join(DEFAULT_SCHEDULES),
        type=_csv(str, "names"),
        metavar="NAMES",
        help="compare SOAP's refresh schedules instead: a comma-separated subset of "
        f"{','.join(SCHEDULES)} (default when given without names: "
        f"{','.join(DEFAULT_SCHEDULES)}; adamw always runs)",
    )
    parser.add_argument(
        "--shapes",
        type=_csv(str, "names"),
        metavar="NAMES",
        help="model shapes, each with its own AdamW sweep, target and table: a comma-separated "
        f"subset of {', '.join(s.label for s in SHAPES.values())} "
        "(default: all with --schedules, else train)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument(
        "--engine-workers",
        type=int,
        default=1,
        help="solver processes of the embedded engine and of each daemon (default 1)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--refresh-overhead",
        type=float,
        metavar="SHARE",
        help="the continuous schedule's overhead budget, a share of the step time in (0, 1] "
        "(default: the optimizer's own)",
    )
    output.add_flush_denormal_argument(parser, "every training process")
    parser.add_argument(
        "--runs-dir",
        type=Path,
        metavar="DIR",
        help="keep every finished run here (a JSON file each) and take the runs already kept "
        "there, made with the same steps, evaluation, threads, workers and device, instead of "
        "training them again: an interrupted benchmark resumes, and one report can be made "
        "from runs trained at different times (the code is not compared: clear DIR after "
        "changing it)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="write the report here, with PNG plots beside it"
    )
    return run_command


def config_from_args(args: argparse.Namespace) -> ConvergenceConfig:
    quick = bool(args.quick)

    def pick(value: Any, full: Any, fast: Any) -> Any:
        return value if value is not None else (fast if quick else full)

    schedules = getattr(args, "schedules", None)
    if isinstance(schedules, str):  # the flag's default names, not yet split
        schedules = tuple(schedules.split(","))
    if schedules is not None:
        unknown = [name for name in schedules if name not in SCHEDULES]
        if unknown:
            raise ValueError(f"--schedules: unknown {unknown}; choose from {', '.join(SCHEDULES)}")
        configs = tuple(dict.fromkeys([*(args.configs or ()), *schedules]))
        quick_configs = configs
    else:
        configs = args.configs
        quick_configs = QUICK_CONFIGS
    shapes = getattr(args, "shapes", None)
    if shapes is None:
        shapes = tuple(SHAPES) if schedules is not None else ("train",)
    return ConvergenceConfig(
        shapes=tuple(shapes),
        steps=pick(args.steps, 300, 40),
        eval_interval=pick(args.eval_interval, 25, 10),
        eval_batches=pick(args.eval_batches, 16, 8),
        seeds=pick(args.seeds, (0, 1, 2), (0,)),
        configs=pick(configs, tuple(_all_configs()), quick_configs),
        adamw_lrs=pick(args.adamw_lrs, ADAMW_LRS, (6e-3,)),
        threads=args.threads,
        engine_workers=args.engine_workers,
        device=args.device,
        flush_denormal=args.flush_denormal,
        refresh_overhead=getattr(args, "refresh_overhead", None),
        quick=quick,
        schedules=schedules is not None,
    )


def report_section(data: dict[str, Any]) -> str:
    """Markdown for ``asteria bench report``: notes, the summary table, the figures."""
    return summary.report_section(data)


def run_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    report = run_convergence(cfg, runs_dir=args.runs_dir)
    output.publish(report, summary.format_report(report), args.json, summary.write_figures)
    return 0
