"""`asteria bench spikes`: does moving the O(n^3) work off the step remove the refresh spikes?

Trains the `asteria train` model with AdamW and with a second-order optimizer in three modes:
native (every root or basis computed inside ``step()``), embedded (computed by the engine's
worker processes) and daemon (computed by a node daemon this benchmark starts, over shared
memory). The four runs are interleaved in chunks of 2f steps within one process, with identical
batches. The trainer runs on one thread; the solver workers get the other core(s): with
--pin-solver (the default where there are more CPUs than trainer threads) the trainer is pinned
to the first CPU(s) and the solver workers, embedded and the daemon's, to the rest, so a solve
never takes the step's core; --no-pin-solver leaves both to the scheduler (the workers only run
at a lower priority), which shows what an unpinned user sees. Subnormal floats are flushed to
zero unless --no-flush-denormal. Both settings are in the report.

For each run it reports the median, p90, p99 and max step time (after a short warm-up that
covers the engine's start), p99/median, the overhead against AdamW, the median of refresh and
non-refresh steps, and the staleness observed; and the energy of its steps where the machine
exposes it (NVML for the GPU, RAPL for the CPU; CPU-seconds of the process tree always, see
``bench.energy``): per step, and to reach AdamW's final training loss (the mean of AdamW's last
10 losses, reached by a run's trailing 10-step mean; per-step energy times the steps it took).

``--model`` picks the model shape (``tiny``, the CPU default, or ``gpt2-small``: 12 layers,
width 768, context 256, for a GPU).

Targets (issue: the engine and the embedded runtime): embedded p99/median <= 1.3 while native
shows its spikes, and the embedded median within 10% of native's non-refresh median; the same
is reported for the daemon run.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asteria_client.bench import output
from asteria_client.bench.affinity import asteria_children_cpus, pinned, split_cpus, usable_cpus
from asteria_client.bench.energy import EnergyMeter
from asteria_client.bench.stats import summarize
from asteria_client.daemon_process import DaemonProcess
from asteria_client.optim.base import Mode
from asteria_client.tables import NAME_THEN_NUMBERS, markdown_table, text_table

logger = logging.getLogger(__name__)

P99_OVER_MEDIAN_TARGET = 1.3
#: Second-order runs whose solves are asynchronous: in-process engine, and the node daemon.
ASYNC_MODES = ("embedded", "daemon")
MEDIAN_VS_NATIVE_QUIET_TARGET = 1.10


@dataclass(frozen=True, kw_only=True)
class SpikesConfig:
    """``pin_solver=None`` pins when this process may use more CPUs than ``threads``."""

    optimizer: str = "soap"
    steps: int = 300
    warmup_steps: int = 10
    precondition_frequency: int = 10
    staleness_budget: int = 1
    threads: int = 1
    engine_workers: int = 1
    seed: int = 0
    device: str = "cpu"
    model: str = "tiny"
    flush_denormal: bool = True
    pin_solver: bool | None = None

    def __post_init__(self) -> None:
        if self.pin_solver is None:
            object.__setattr__(self, "pin_solver", len(usable_cpus()) > self.threads)
        elif self.pin_solver and len(usable_cpus()) <= self.threads:
            raise ValueError(
                f"pin_solver=True needs more usable CPUs than threads ({self.threads}), this "
                f"process may use {list(usable_cpus())}: pass --no-pin-solver"
            )
        from asteria_client.train.config import model_preset

        model_preset(self.model)  # ValueError naming the presets
        if self.optimizer not in ("soap", "shampoo", "kl-shampoo"):
            raise ValueError(f"optimizer={self.optimizer!r}: pick soap, shampoo or kl-shampoo")
        for name in ("steps", "precondition_frequency", "threads", "engine_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps), got {self.warmup_steps}")
        if self.staleness_budget < 0:
            raise ValueError(f"staleness_budget must be >= 0, got {self.staleness_budget}")


def refresh_steps(optimizer: str, steps: int, frequency: int) -> set[int]:
    """Steps (1-based) whose ``step()`` computes roots/bases in native mode."""
    if optimizer == "shampoo":
        return {s for s in range(1, steps + 1) if (s - 1) % frequency == 0}
    # SOAP and KL-Shampoo: the initial eigh at step 1, then a refresh after every f-th update.
    return {1} | {s for s in range(2, steps + 1) if (s - 1) % frequency == 0}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the body, then restore what was there."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _train_config(
    cfg: SpikesConfig, optimizer: str, mode: str | None, solver_cpus: tuple[int, ...] | None
) -> Any:
    from asteria_client.train.config import TrainConfig, model_preset
    from asteria_client.train.optimizers import OptimizerKind

    second_order = optimizer != "adamw"
    preset = model_preset(cfg.model)
    return TrainConfig(
        optimizer=OptimizerKind(optimizer),
        mode=None if mode is None else Mode(mode),
        steps=cfg.steps,
        seed=cfg.seed,
        device=cfg.device,
        num_threads=cfg.threads,
        eval_interval=cfg.steps,
        log_interval=max(cfg.steps // 4, 1),
        precondition_frequency=cfg.precondition_frequency if second_order else None,
        staleness_budget=cfg.staleness_budget if mode in ASYNC_MODES else None,
        engine_workers=cfg.engine_workers if mode == "embedded" else None,
        engine_cpu_affinity=solver_cpus if mode == "embedded" else None,
        flush_denormal=cfg.flush_denormal,
        n_layer=preset["n_layer"],
        n_head=preset["n_head"],
        n_embd=preset["n_embd"],
        block_size=preset["block_size"],
    )


def local_ratios(times: list[float], chunk: int, skip: int) -> list[float]:
    """Each step's time over the median of its own chunk (steps run back to back).

    Interleaving spreads slow machine drifts over all runs, but within one run consecutive
    chunks still see different machine states; this ratio isolates spikes *within* a chunk,
    which is what a refresh causes, from drift between chunks."""
    ratios = []
    for start in range(0, len(times), chunk):
        window = times[start : start + chunk]
        median = summarize(window)["median"]
        for offset, value in enumerate(window):
            if start + offset >= skip:
                ratios.append(value / median)
    return ratios


#: Steps of the trailing mean that compares training losses with AdamW's final one.
LOSS_WINDOW = 10


def _trailing_means(losses: list[float], window: int = LOSS_WINDOW) -> list[float]:
    out, total = [], 0.0
    for i, loss in enumerate(losses):
        total += loss
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


def energy_summary(
    reading: dict[str, Any], losses: list[float], target_loss: float | None
) -> dict[str, Any]:
    """Energy per step, and to the first step whose trailing mean loss is <= ``target_loss``
    (None: never reached, or no target)."""
    steps = max(len(losses), 1)
    out = dict(reading)
    reached = None
    if target_loss is not None:
        means = _trailing_means(losses)
        reached = next((i + 1 for i, m in enumerate(means) if m <= target_loss), None)
    out["steps_to_adamw_final_loss"] = reached
    for key in ("gpu_j", "cpu_j", "cpu_s"):
        value = reading.get(key)
        per_step = None if value is None else value / steps
        out[f"{key}_per_step"] = per_step
        out[f"{key}_to_adamw_final_loss"] = (
            None if per_step is None or reached is None else per_step * reached
        )
    return out


def _summarize(cfg: SpikesConfig, trainer: Any, label: str) -> dict[str, Any]:
    result = trainer.result()
    times = [r.step_time_s for r in result.steps]
    summary = summarize(times[cfg.warmup_steps :])
    optimizer = result.config.optimizer.value
    run: dict[str, Any] = {
        "optimizer": optimizer,
        "mode": "n/a" if result.config.mode is None else result.config.mode.value,
        "label": label,
        "steps": cfg.steps,
        "step_time_median_s": summary["median"],
        "step_time_p90_s": summary["p90"],
        "step_time_p99_s": summary["p99"],
        "step_time_max_s": summary["max"],
        "step_time_mean_s": summary["mean"],
        "p99_over_median": summary["p99"] / summary["median"],
        "p99_over_chunk_median": summarize(
            local_ratios(times, 2 * cfg.precondition_frequency, cfg.warmup_steps)
        )["p99"],
        "final_val_loss": result.final_val_loss,
        "step_times_s": times,
        "staleness": result.optimizer,
    }
    if optimizer != "adamw":
        refresh = refresh_steps(optimizer, cfg.steps, cfg.precondition_frequency)
        first = cfg.warmup_steps + 1
        on = [t for s, t in enumerate(times, 1) if s >= first and s in refresh]
        off = [t for s, t in enumerate(times, 1) if s >= first and s not in refresh]
        run["refresh_step_median_s"] = summarize(on)["median"]
        run["non_refresh_step_median_s"] = summarize(off)["median"]
    return run


def run_spikes(cfg: SpikesConfig) -> dict[str, Any]:
    """Run the four trainings interleaved in chunks of ``2 f`` steps, rotating their order, so
    slow drifts of a shared machine fall on all of them alike (sequential runs here differed by
    15% with nothing changed)."""
    from asteria_client.train.cpu import flush_denormal

    # First, before torch starts its threads: they copy the mode (see train.cpu).
    with flush_denormal(cfg.flush_denormal) as flushing:
        report = _run_spikes(cfg)
    report["config"]["flush_denormal_in_effect"] = flushing
    return report


def _run_spikes(cfg: SpikesConfig) -> dict[str, Any]:
    from asteria_client.train.corpus import load_corpus
    from asteria_client.train.loop import Trainer

    started = time.time()
    all_cpus = usable_cpus()
    trainer_cpus, solver_cpus = split_cpus(cfg.threads) if cfg.pin_solver else (None, None)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    corpus = load_corpus()
    modes = [None, "native", *ASYNC_MODES]
    labels = ["adamw", *(f"{cfg.optimizer} ({mode})" for mode in modes[1:])]
    configs = [_train_config(cfg, cfg.optimizer if m else "adamw", m, solver_cpus) for m in modes]
    trainers: list[Any] = []
    gpu = torch.device(cfg.device)
    meters = [EnergyMeter(gpu.index or 0 if gpu.type == "cuda" else None) for _ in configs]
    daemon = DaemonProcess(workers=cfg.engine_workers, cpu_affinity=solver_cpus)
    pinning = contextlib.ExitStack()
    try:
        daemon.start()  # on the solver CPUs: it and its workers stay there
        if trainer_cpus is not None:
            pinning.enter_context(pinned(trainer_cpus))
        for train_cfg in configs:
            # The daemon run reaches the benchmark's own daemon through the client's env.
            env = {"ASTERIA_ADDRESS": daemon.address, "ASTERIA_JOB": "bench-spikes"}
            with _environment(env if train_cfg.mode is Mode.DAEMON else {}):
                trainers.append(Trainer(train_cfg, corpus=corpus))
        chunk = 2 * cfg.precondition_frequency
        order = list(range(len(trainers)))
        while not all(t.done for t in trainers):
            for index in order:
                trainer = trainers[index]
                meters[index].start()  # each step ends synchronized with the device
                for _ in range(chunk):
                    if trainer.done:
                        break
                    trainer.step()
                meters[index].stop()
            order = order[1:] + order[:1]
        runs = [_summarize(cfg, t, label) for t, label in zip(trainers, labels, strict=True)]
        adamw_losses = [r.loss for r in trainers[0].result().steps]
        target = _trailing_means(adamw_losses)[-1] if adamw_losses else None
        for run, trainer, meter in zip(runs, trainers, meters, strict=True):
            losses = [r.loss for r in trainer.result().steps]
            run["energy"] = energy_summary(meter.reading.to_dict(), losses, target)
        affinity = {
            "trainer_cpus": None if trainer_cpus is None else list(trainer_cpus),
            "solver_cpus": None if solver_cpus is None else list(solver_cpus),
            "usable_cpus": list(all_cpus),
            # what the daemon and the embedded engine's workers really ran on
            "observed_solver_process_cpus": asteria_children_cpus(),
        }
    finally:
        for trainer in trainers:
            trainer.close()
        daemon.stop()
        pinning.close()
        for meter in meters:
            meter.close()
        torch.set_num_threads(threads_before)
    adamw, native, embedded, in_daemon = runs
    for run in runs:
        run["overhead_vs_adamw_median"] = (
            run["step_time_median_s"] / adamw["step_time_median_s"] - 1.0
        )
        run["overhead_vs_adamw_mean"] = run["step_time_mean_s"] / adamw["step_time_mean_s"] - 1.0
    quiet = native["non_refresh_step_median_s"]
    checks = {
        "embedded_p99_over_median": embedded["p99_over_median"],
        "embedded_p99_over_median_target": P99_OVER_MEDIAN_TARGET,
        "embedded_p99_over_median_met": embedded["p99_over_median"] <= P99_OVER_MEDIAN_TARGET,
        "native_p99_over_median": native["p99_over_median"],
        "adamw_p99_over_median": adamw["p99_over_median"],
        "p99_over_chunk_median": {r["label"]: r["p99_over_chunk_median"] for r in runs},
        "native_refresh_over_quiet": native["refresh_step_median_s"] / quiet,
        "embedded_median_over_native_quiet": embedded["step_time_median_s"] / quiet,
        "embedded_median_over_native_quiet_target": MEDIAN_VS_NATIVE_QUIET_TARGET,
        "embedded_median_over_native_quiet_met": embedded["step_time_median_s"] / quiet
        <= MEDIAN_VS_NATIVE_QUIET_TARGET,
        "daemon_p99_over_median": in_daemon["p99_over_median"],
        "daemon_p99_over_median_met": in_daemon["p99_over_median"] <= P99_OVER_MEDIAN_TARGET,
        "daemon_median_over_native_quiet": in_daemon["step_time_median_s"] / quiet,
        "daemon_median_over_native_quiet_met": in_daemon["step_time_median_s"] / quiet
        <= MEDIAN_VS_NATIVE_QUIET_TARGET,
    }
    return {
        "benchmark": "spikes",
        "config": dict(cfg.__dict__),
        "schedule": f"interleaved in chunks of {2 * cfg.precondition_frequency} steps",
        "affinity": affinity,
        "started_unix_s": started,
        "wall_time_s": time.time() - started,
        "machine": {
            "processor": platform.processor(),
            "torch": torch.__version__,
            **output.machine_info(),
            "cpus": len(os.sched_getaffinity(0)),
        },
        "runs": runs,
        "checks": checks,
    }


def _cpus(cpus: list[int]) -> str:
    return f"CPU{'s' if len(cpus) > 1 else ''} {','.join(map(str, cpus))}"


def pinning_note(data: dict[str, Any]) -> str:
    """Where the solvers ran relative to the trainer, in a few words (for the ratio lines)."""
    affinity = data.get("affinity")
    if affinity is None:
        return "pinning not recorded"
    if affinity["solver_cpus"] is None:
        return f"solver not pinned: it shares {_cpus(affinity['usable_cpus'])} with the trainer"
    return (
        f"solver pinned to {_cpus(affinity['solver_cpus'])}, trainer to "
        f"{_cpus(affinity['trainer_cpus'])}"
    )


def cpu_settings(data: dict[str, Any]) -> str:
    """One sentence: flush-denormal and pinning, as the run used them."""
    flush = data["config"].get("flush_denormal")
    if flush is None:
        flushing = "flush-denormal not recorded (a report from before the setting)"
    else:
        in_effect = data["config"].get("flush_denormal_in_effect", flush)
        flushing = "subnormals flushed to zero" if in_effect else "subnormals kept"
        if flush and not in_effect:
            flushing += " (flushing asked, but this CPU cannot)"
    return f"CPU settings: {flushing}; {pinning_note(data)}."


def _run_cells(run: dict[str, Any], *, unit: str) -> list[str]:
    """One run's row of the step-time tables (times in ms, ``unit`` after each)."""
    times = [run[f"step_time_{q}_s"] * 1e3 for q in ("median", "p90", "p99", "max")]
    return [
        run["label"],
        *(f"{t:.1f}{unit}" for t in times),
        f"{run['p99_over_median']:.2f}",
        f"{run['p99_over_chunk_median']:.2f}",
        f"{run['overhead_vs_adamw_median'] * 100:+.1f}%",
        str(run["staleness"].get("max_lag_steps", "")),
    ]


def format_report(report: dict[str, Any]) -> str:
    head = ["run", "median", "p90", "p99", "max", "p99/med", "local", "vs AdamW", "max lag"]
    lines = text_table([head, *(_run_cells(run, unit="ms") for run in report["runs"])])
    c = report["checks"]
    native = report["runs"][1]
    lines += [
        "",
        f"native refresh steps: median {native['refresh_step_median_s'] * 1e3:.1f} ms vs "
        f"{native['non_refresh_step_median_s'] * 1e3:.1f} ms otherwise "
        f"({c['native_refresh_over_quiet']:.2f}x)",
        f"embedded p99/median {c['embedded_p99_over_median']:.2f} "
        f"(target <= {c['embedded_p99_over_median_target']}: "
        f"{'met' if c['embedded_p99_over_median_met'] else 'MISSED'}; AdamW's own p99/median in "
        f"this run: {c['adamw_p99_over_median']:.2f}; 'local' = p99 of step / its chunk's median)",
        f"embedded median / native non-refresh median {c['embedded_median_over_native_quiet']:.3f} "
        f"(target <= {c['embedded_median_over_native_quiet_target']}: "
        f"{'met' if c['embedded_median_over_native_quiet_met'] else 'MISSED'}; "
        f"{pinning_note(report)})",
        f"daemon p99/median {c['daemon_p99_over_median']:.2f} "
        f"({'met' if c['daemon_p99_over_median_met'] else 'MISSED'}); daemon median / native "
        f"non-refresh median {c['daemon_median_over_native_quiet']:.3f} "
        f"({'met' if c['daemon_median_over_native_quiet_met'] else 'MISSED'})",
        cpu_settings(report),
        *energy_lines(report),
    ]
    return "\n".join(lines)


def energy_lines(report: dict[str, Any]) -> list[str]:
    """One line per run: energy per step and to AdamW's final loss, by source."""
    lines = []
    for run in report["runs"]:
        e = run.get("energy")
        if not e:
            continue
        parts = []
        for key, unit in (("gpu_j", "J GPU"), ("cpu_j", "J CPU"), ("cpu_s", "CPU-s")):
            per_step = e.get(f"{key}_per_step")
            if per_step is None:
                continue
            to_target = e.get(f"{key}_to_adamw_final_loss")
            reach = "not reached" if to_target is None else f"{to_target:.3g}"
            parts.append(f"{per_step:.3g} {unit}/step (to AdamW's final loss: {reach})")
        lines.append(f"energy {run['label']}: " + "; ".join(parts))
    return lines


def write_trace_figure(report: dict[str, Any], path: Path) -> Path:
    """Step time against step for every run, refresh steps of native mode marked."""
    cfg = report["config"]
    fig, ax = output.new_figure(8.0, 4.0)
    for run in report["runs"]:
        times_ms = [t * 1e3 for t in run["step_times_s"]]
        ax.plot(range(1, len(times_ms) + 1), times_ms, linewidth=0.9, label=run["label"])
    refresh = sorted(refresh_steps(cfg["optimizer"], cfg["steps"], cfg["precondition_frequency"]))
    for index, step in enumerate(refresh):
        label = "refresh step (native)" if index == 0 else None
        ax.axvline(step, color="0.8", linewidth=0.6, zorder=0, label=label)
    if cfg["warmup_steps"]:
        ax.axvspan(0.5, cfg["warmup_steps"] + 0.5, color="0.93", zorder=0, label="warm-up")
    ax.set_yscale("log")
    output.plain_log_ticks(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms, log scale)")
    ax.set_title(
        f"Step time per step: {cfg['optimizer']}, f={cfg['precondition_frequency']}, "
        f"staleness budget {cfg['staleness_budget']}"
    )
    ax.legend(fontsize="small")
    return output.save_figure(fig, path)


def report_section(data: dict[str, Any]) -> str:
    """Markdown: the step-time table, the targets and the trace figure."""
    cfg, checks = data["config"], data["checks"]
    lines = [
        f"{cfg['steps']} steps per run ({data.get('schedule', 'interleaved')}), precondition "
        f"frequency {cfg['precondition_frequency']}, staleness budget {cfg['staleness_budget']}, "
        f"{cfg['threads']} trainer thread(s), {cfg['engine_workers']} engine worker(s), "
        f"device {cfg.get('device', 'cpu')}; statistics after {cfg['warmup_steps']} warm-up "
        "steps.",
        "",
        cpu_settings(data),
        "",
    ]
    head = ["run", "median", "p90", "p99", "max", "p99/median", "local p99"]
    head += ["vs AdamW (median)", "max lag"]
    rows = [_run_cells(run, unit=" ms") for run in data["runs"]]
    lines += markdown_table(head, rows, align=NAME_THEN_NUMBERS)

    def met(key: str) -> str:
        return "met" if checks[f"{key}_met"] else "**missed**"

    lines += [
        "",
        f"- Native refresh steps take {checks['native_refresh_over_quiet']:.2f}x the median of "
        "its other steps.",
        f"- Embedded p99/median {checks['embedded_p99_over_median']:.2f} (target <= "
        f"{checks['embedded_p99_over_median_target']}: {met('embedded_p99_over_median')}; "
        f"AdamW's own: {checks['adamw_p99_over_median']:.2f}).",
        f"- Embedded median / native non-refresh median "
        f"{checks['embedded_median_over_native_quiet']:.3f} (target <= "
        f"{checks['embedded_median_over_native_quiet_target']}: "
        f"{met('embedded_median_over_native_quiet')}; {pinning_note(data)}).",
        "",
        "Local p99: the p99 of each step's time over the median of its own chunk of steps.",
        "",
    ]
    if "daemon_p99_over_median" in checks:  # reports from before the daemon run lack it
        lines.insert(
            -3,
            f"- Daemon p99/median {checks['daemon_p99_over_median']:.2f} "
            f"({met('daemon_p99_over_median')}); daemon median / native non-refresh median "
            f"{checks['daemon_median_over_native_quiet']:.3f} "
            f"({met('daemon_median_over_native_quiet')}).",
        )
    lines += [f"![{Path(figure).stem}]({figure})" for figure in data.get("figures", [])]
    return "\n".join(lines) + "\n"


def register(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "spikes",
        help="step-time spikes: AdamW vs native vs embedded second-order",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="120 steps (about 1 minute here)")
    parser.add_argument("--steps", type=int, help="training steps per run (default 300)")
    parser.add_argument(
        "--optimizer",
        choices=["soap", "shampoo", "kl-shampoo"],
        default="soap",
        help="the second-order optimizer to compare (default: soap)",
    )
    parser.add_argument("--precondition-frequency", type=int, default=10, metavar="F")
    parser.add_argument("--staleness-budget", type=int, default=1, metavar="S")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of the trainer (default 1)"
    )
    parser.add_argument(
        "--engine-workers", type=int, default=1, help="solver processes of the embedded engine"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--model",
        choices=["tiny", "gpt2-small"],
        default="tiny",
        help="model shape: tiny (default, CPU) or gpt2-small (12 layers, width 768, context 256)",
    )
    parser.add_argument(
        "--pin-solver",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin the trainer to the first --threads CPUs and the solver workers (embedded "
        "and the daemon's) to the rest (default: on when there are more CPUs than --threads)",
    )
    output.add_flush_denormal_argument(parser, "the trainer")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the full report here")
    return run_command


def run_command(args: argparse.Namespace) -> int:
    steps = args.steps if args.steps is not None else (120 if args.quick else 300)
    cfg = SpikesConfig(
        optimizer=args.optimizer,
        steps=steps,
        warmup_steps=min(10, steps // 4),
        precondition_frequency=args.precondition_frequency,
        staleness_budget=args.staleness_budget,
        threads=args.threads,
        engine_workers=args.engine_workers,
        seed=args.seed,
        device=args.device,
        model=args.model,
        flush_denormal=args.flush_denormal,
        pin_solver=args.pin_solver,
    )
    report = run_spikes(cfg)
    report["quick"] = bool(args.quick)
    output.publish(
        report,
        format_report(report),
        args.json,
        lambda r, path: [write_trace_figure(r, output.figure_path(path, "trace"))],
    )
    return 0
