"""`asteria bench defaults`: the evidence behind SOAP's and KL-Shampoo's default β1 and f.

Trains `asteria train`'s GPT with SOAP and KL-Shampoo at every β1 of ``--beta1s`` and every
precondition frequency f of ``--frequencies`` (β2 stays at the optimizer's own), native and
embedded (and continuous, where SOAP accepts ``refresh="continuous"``, with ``--modes``), over
several seeds, plus AdamW at its default lr for the target: AdamW's mean final validation loss.
For one seed every run starts from the same weights and sees the same batches.

The choice, per optimizer: the (β1, f) of lowest mean final validation loss over all modes and
seeds is the best; a setting is *within noise* of it when its mean paired difference (same mode,
same seed) is at most two standard errors of those differences; among the settings within noise
the pick is the one of largest f (the cheapest: a refresh every f steps), then of lowest mean
loss. Runs go one after the other in this process (losses, not step times, are compared here),
with subnormals flushed to zero unless --no-flush-denormal.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asteria_client.bench import convergence_summary as summary
from asteria_client.bench import output
from asteria_client.bench.arms import Arm, run_arms
from asteria_client.tables import markdown_table, text_table

logger = logging.getLogger(__name__)

OPTIMIZERS = ("soap", "kl-shampoo")
MODES = ("native", "embedded", "continuous")


@dataclass(frozen=True, kw_only=True)
class DefaultsConfig:
    steps: int = 300
    eval_interval: int = 25
    eval_batches: int = 16
    seeds: tuple[int, ...] = (0, 1, 2)
    optimizers: tuple[str, ...] = OPTIMIZERS
    modes: tuple[str, ...] = ("native", "embedded")
    beta1s: tuple[float, ...] = (0.9, 0.95)
    frequencies: tuple[int, ...] = (1, 2, 5, 10)
    staleness_budget: int = 1
    threads: int = 1
    engine_workers: int = 1
    flush_denormal: bool = True
    include_adamw: bool = True  # False: a part of a sweep split over processes (--jobs)
    quick: bool = False
    #: the model shape trained (a name in ``convergence.SHAPES``): a default chosen on one
    #: shape can lose on the next
    shape: str = "train"

    def __post_init__(self) -> None:
        for name in ("steps", "eval_interval", "eval_batches", "threads", "engine_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"seeds must be distinct integers >= 0, got {self.seeds}")
        for name, allowed in (("optimizers", OPTIMIZERS), ("modes", MODES)):
            bad = [v for v in getattr(self, name) if v not in allowed]
            empty = not getattr(self, name) and not (name == "optimizers" and self.include_adamw)
            if bad or empty:  # no optimizer at all: AdamW alone
                raise ValueError(f"{name}: {bad or 'none'}; choose from {', '.join(allowed)}")
        if not self.beta1s or not all(0 <= b < 1 for b in self.beta1s):
            raise ValueError(f"beta1s must be in [0, 1), got {self.beta1s}")
        if not self.frequencies or min(self.frequencies) < 1:
            raise ValueError(f"frequencies must be integers >= 1, got {self.frequencies}")
        if self.staleness_budget < 0:
            raise ValueError(f"staleness_budget must be >= 0, got {self.staleness_budget}")
        from asteria_client.bench.convergence import SHAPES

        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {self.shape!r}")


def setting_name(optimizer: str, mode: str, beta1: float, frequency: int) -> str:
    return f"{optimizer}-{mode}-b{beta1:g}-f{frequency}"


def _arm(
    cfg: DefaultsConfig,
    seed: int,
    optimizer: str,
    mode: str | None,
    beta1: float,
    frequency: int | None,
) -> Arm:
    from asteria_client.bench.convergence import SHAPES
    from asteria_client.optim.base import Mode
    from asteria_client.train.config import TrainConfig
    from asteria_client.train.optimizers import OptimizerKind, OptimizerSettings, build_optimizer

    engine_mode = "embedded" if mode == "continuous" else mode
    shape = SHAPES[cfg.shape]
    train = TrainConfig(
        n_layer=shape.n_layer,
        n_embd=shape.n_embd,
        n_head=shape.n_head,
        optimizer=OptimizerKind(optimizer),
        mode=None if engine_mode is None else Mode(engine_mode),
        steps=cfg.steps,
        seed=seed,
        device="cpu",
        num_threads=cfg.threads,
        eval_interval=cfg.eval_interval,
        eval_batches=cfg.eval_batches,
        log_interval=cfg.steps,
        precondition_frequency=frequency,
        staleness_budget=cfg.staleness_budget if engine_mode == "embedded" else None,
        engine_workers=cfg.engine_workers if engine_mode == "embedded" else None,
        flush_denormal=cfg.flush_denormal,
    )
    if mode is None:
        return Arm(name="adamw", label="adamw", train_config=train)
    from asteria_client.bench.peers_table import asteria_beta2, continuous_options

    kind = OptimizerKind(optimizer)
    settings = OptimizerSettings(
        kind=kind,
        lr=train.resolved_lr,
        weight_decay=train.weight_decay,
        mode=train.mode,
        precondition_frequency=frequency,
        betas=(beta1, asteria_beta2(kind)),
        staleness_budget=train.staleness_budget,
        engine_workers=train.engine_workers,
        options=continuous_options() if mode == "continuous" else (),
    )

    def factory(model: Any) -> Any:
        return build_optimizer(model, settings)

    assert frequency is not None
    name = setting_name(optimizer, mode, beta1, frequency)
    return Arm(
        name=name,
        label=f"{optimizer} {mode} β1={beta1:g} f={frequency}",
        train_config=train,
        factory=factory,
        info={"optimizer": optimizer, "mode": mode, "beta1": beta1, "frequency": frequency},
    )


def plan(cfg: DefaultsConfig) -> list[Arm]:
    arms = []
    for seed in cfg.seeds:
        if cfg.include_adamw:
            arms.append(_arm(cfg, seed, "adamw", None, 0.0, None))
        for optimizer in cfg.optimizers:
            for mode in cfg.modes:
                for beta1 in cfg.beta1s:
                    for frequency in cfg.frequencies:
                        arms.append(_arm(cfg, seed, optimizer, mode, beta1, frequency))
    return arms


def _paired_within_noise(
    best: dict[tuple[str, int], float], other: dict[tuple[str, int], float]
) -> tuple[float | None, float | None, bool]:
    """(mean difference other - best, its standard error, within noise) over shared pairs."""
    keys = sorted(set(best) & set(other))
    diffs = [other[k] - best[k] for k in keys]
    if not diffs:
        return None, None, False
    mean = statistics.fmean(diffs)
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) >= 2 else 0.0
    return mean, stderr, mean <= 2 * stderr


def summarize(cfg: DefaultsConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting: mean and std of the final val loss, steps to AdamW's target; the choice."""
    adamw = [r["final_val_loss"] for r in runs if r["config"] == "adamw" and r["ok"]]
    target = statistics.fmean(adamw) if adamw else None
    for record in runs:
        if target is not None:
            summary.add_time_to_target(record, target)
    rows = []
    choices = {}
    for optimizer in cfg.optimizers:
        per_setting: dict[tuple[float, int], dict[tuple[str, int], float]] = {}
        for beta1 in cfg.beta1s:
            for frequency in cfg.frequencies:
                losses: dict[tuple[str, int], float] = {}
                for mode in cfg.modes:
                    name = setting_name(optimizer, mode, beta1, frequency)
                    mine = [r for r in runs if r["config"] == name]
                    done = [r for r in mine if r["ok"]]
                    finals = [r["final_val_loss"] for r in done]
                    reached = [
                        r["steps_to_target"] for r in done if r.get("steps_to_target") is not None
                    ]
                    losses.update({(mode, r["seed"]): r["final_val_loss"] for r in done})
                    rows.append(
                        {
                            "optimizer": optimizer,
                            "mode": mode,
                            "beta1": beta1,
                            "frequency": frequency,
                            "num_runs": len(mine),
                            "num_failed": len(mine) - len(done),
                            "final_val_loss_mean": statistics.fmean(finals) if finals else None,
                            "final_val_loss_std": statistics.stdev(finals)
                            if len(finals) > 1
                            else None,
                            "num_reached": len(reached),
                            "steps_to_target_mean": statistics.fmean(reached) if reached else None,
                            "train_s_mean": statistics.fmean([r["train_s"] for r in done])
                            if done
                            else None,
                        }
                    )
                per_setting[(beta1, frequency)] = losses
        choices[optimizer] = _choose(per_setting)
    return {"target_val_loss": target, "rows": rows, "choices": choices}


def _choose(
    per_setting: dict[tuple[float, int], dict[tuple[str, int], float]],
) -> dict[str, Any] | None:
    """The rule of the module docstring, over settings with every pair finished."""
    complete = {k: v for k, v in per_setting.items() if v}
    if not complete:
        return None
    # Only the (mode, seed) pairs every setting has: a run missing from one would bias it.
    shared = set.intersection(*(set(v) for v in complete.values()))
    if not shared:
        return None
    complete = {k: {pair: v[pair] for pair in shared} for k, v in complete.items()}
    size = len(shared)
    means = {k: statistics.fmean(v.values()) for k, v in complete.items()}
    best = min(means, key=lambda k: means[k])
    candidates: list[dict[str, Any]] = []
    for key, losses in complete.items():
        diff, stderr, near = _paired_within_noise(complete[best], losses)
        candidates.append(
            {
                "beta1": key[0],
                "frequency": key[1],
                "mean": means[key],
                "diff_vs_best": diff,
                "diff_stderr": stderr,
                "within_noise": near,
            }
        )
    within = [c for c in candidates if c["within_noise"]]
    pick = max(within, key=lambda c: (c["frequency"], -c["mean"]))
    return {
        "best": {"beta1": best[0], "frequency": best[1], "mean": means[best]},
        "pick": {"beta1": pick["beta1"], "frequency": pick["frequency"], "mean": pick["mean"]},
        "pairs": size,
        "candidates": candidates,
    }


def run_defaults(cfg: DefaultsConfig, *, json_path: Path | None = None) -> dict[str, Any]:
    """Every run (seed by seed), then the summary; with ``json_path`` a partial report is
    written after each run, so a long sweep that is stopped keeps what it measured."""
    from asteria_client.train.corpus import load_corpus
    from asteria_client.train.cpu import flush_denormal

    started = time.time()
    arms = plan(cfg)
    runs: list[dict[str, Any]] = []
    done_s = time.perf_counter()

    def progress(record: dict[str, Any]) -> None:
        runs.append(record)
        elapsed = time.perf_counter() - done_s
        left_min = elapsed / len(runs) * (len(arms) - len(runs)) / 60
        outcome = (
            f"final val {record['final_val_loss']:.4f}"
            if record["ok"]
            else f"FAILED ({record['error']})"
        )
        logger.info(
            "defaults [%d/%d] %s seed %d: %s; about %.0f min left",
            len(runs),
            len(arms),
            record["label"],
            record["seed"],
            outcome,
            left_min,
        )
        if json_path is not None:
            partial = _report(cfg, runs, started, partial=True)
            output.write_report(json_path, partial, [])

    with flush_denormal(cfg.flush_denormal) as flushing:
        import torch

        threads_before = torch.get_num_threads()
        torch.set_num_threads(cfg.threads)
        try:
            run_arms(arms, interleave_steps=None, corpus=load_corpus(), progress=progress)
        finally:
            torch.set_num_threads(threads_before)
    report = _report(cfg, runs, started, partial=False)
    report["config"]["flush_denormal_in_effect"] = flushing
    return report


def _report(
    cfg: DefaultsConfig, runs: list[dict[str, Any]], started: float, *, partial: bool
) -> dict[str, Any]:
    slim = [{k: v for k, v in r.items() if k not in ("step_times_s", "train_losses")} for r in runs]
    return {
        "benchmark": "defaults",
        "quick": cfg.quick,
        "partial": partial,
        "config": {**asdict(cfg)},
        "started_unix_s": started,
        "wall_time_s": time.time() - started,
        "batch_streams_identical": summary.batch_streams_identical([r for r in runs if r["ok"]]),
        **summarize(cfg, slim),
        "runs": slim,
    }


# --- tables and figures -----------------------------------------------------------------------

_HEAD = ("optimizer", "mode", "β1", "f", "final val (mean ± std)", "steps→AdamW's final", "train s")


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else f"{value:{spec}}"


def table_rows(data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for row in data["rows"]:
        final = _fmt(row["final_val_loss_mean"], ".4f")
        if row["final_val_loss_std"] is not None:
            final += f" ± {row['final_val_loss_std']:.4f}"
        if row["num_failed"]:
            final += f" ({row['num_failed']} failed)"
        ok = row["num_runs"] - row["num_failed"]
        steps = (
            f"{row['steps_to_target_mean']:.0f} ({row['num_reached']}/{ok})"
            if row["num_reached"]
            else f"not reached (0/{ok})"
        )
        rows.append(
            [
                row["optimizer"],
                row["mode"],
                f"{row['beta1']:g}",
                str(row["frequency"]),
                final,
                steps,
                _fmt(row["train_s_mean"], ".1f"),
            ]
        )
    return rows


def choice_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    for optimizer, choice in data["choices"].items():
        if choice is None:
            lines.append(f"{optimizer}: no finished runs")
            continue
        best, pick = choice["best"], choice["pick"]
        within = [
            f"β1={c['beta1']:g} f={c['frequency']}"
            for c in choice["candidates"]
            if c["within_noise"]
        ]
        lines.append(
            f"{optimizer}: lowest mean final val loss at β1={best['beta1']:g} "
            f"f={best['frequency']} ({best['mean']:.4f}, over {choice['pairs']} mode×seed "
            f"pairs); within noise of it (paired difference <= 2 standard errors): "
            f"{', '.join(within)}; pick (largest f among those): β1={pick['beta1']:g} "
            f"f={pick['frequency']} ({pick['mean']:.4f})"
        )
    return lines


def _notes(data: dict[str, Any]) -> list[str]:
    cfg = data["config"]
    target = data["target_val_loss"]
    notes = [
        f"Model: `asteria train`'s GPT, shape {cfg.get('shape', 'train')}; "
        f"{cfg['steps']} steps, evaluation every {cfg['eval_interval']} steps on "
        f"{cfg['eval_batches']} fixed validation batches, seeds {cfg['seeds']}, modes "
        f"{', '.join(cfg['modes'])} (staleness budget {cfg['staleness_budget']}), "
        f"{cfg['threads']} trainer thread(s), {cfg['engine_workers']} engine worker(s); β2 and "
        "everything else at each optimizer's default, lr at `asteria train`'s default.",
        "Target: AdamW's mean final val loss at its default lr, "
        + ("—" if target is None else f"{target:.4f}")
        + "; steps to it are interpolated "
        "between evaluations, averaged over the runs that reached it (count in brackets).",
        "Identical batch streams per seed: "
        f"{'yes' if data['batch_streams_identical'] else 'NO'}."
        + (" PARTIAL: the sweep was stopped before its end." if data.get("partial") else ""),
    ]
    if data.get("merged_from"):
        notes.append(
            "Merged from "
            + "; ".join(
                f"`{m['command']}` on {(m.get('machine') or {}).get('cpu', '?')}"
                for m in data["merged_from"]
            )
            + " (losses compare across machines; training seconds only within one)."
        )
    if data.get("missing"):
        notes.append(f"Runs missing ({len(data['missing'])}): " + "; ".join(data["missing"]))
    return notes


def format_report(data: dict[str, Any]) -> str:
    lines = text_table([list(_HEAD), *table_rows(data)])
    return "\n".join([*lines, "", *choice_lines(data), "", *_notes(data)])


def report_section(data: dict[str, Any]) -> str:
    lines = [f"- {note}" for note in _notes(data)]
    lines += ["", *markdown_table(list(_HEAD), table_rows(data), align="<<<>>>>")]
    lines += ["", *[f"- {line}" for line in choice_lines(data)]]
    for figure in data.get("figures", []):
        lines += ["", f"![{Path(figure).stem}]({figure})"]
    return "\n".join(lines) + "\n"


def write_figures(data: dict[str, Any], json_path: Path) -> list[Path]:
    """Final val loss against f, one line per (optimizer, mode, β1), AdamW's target marked."""
    fig, ax = output.new_figure(7.0, 4.0)
    keys = sorted({(r["optimizer"], r["mode"], r["beta1"]) for r in data["rows"]})
    for optimizer, mode, beta1 in keys:
        points = [
            (r["frequency"], r["final_val_loss_mean"])
            for r in data["rows"]
            if (r["optimizer"], r["mode"], r["beta1"]) == (optimizer, mode, beta1)
            and r["final_val_loss_mean"] is not None
        ]
        if points:
            xs, ys = zip(*sorted(points), strict=True)
            style = "-" if mode == "native" else "--" if mode == "embedded" else ":"
            marker = "o" if beta1 == min(data["config"]["beta1s"]) else "s"
            ax.plot(xs, ys, style, marker=marker, label=f"{optimizer} {mode} β1={beta1:g}")
    if data["target_val_loss"] is not None:
        ax.axhline(data["target_val_loss"], color="grey", lw=0.8, ls="-.", label="AdamW")
    ax.set_xscale("log")
    ax.set_xticks(data["config"]["frequencies"])
    ax.set_xticklabels([str(f) for f in data["config"]["frequencies"]])
    ax.set_xlabel("precondition frequency f (steps between refreshes)")
    ax.set_ylabel("final validation loss (mean over seeds)")
    ax.set_title("β1 and precondition frequency: final validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return [output.save_figure(fig, output.figure_path(json_path, "grid"))]


# --- command line -----------------------------------------------------------------------------


def _csv(convert: Any, what: str) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(convert(item.strip()) for item in text.split(",") if item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None

    return parse


def register(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "defaults",
        help="defaults: SOAP's and KL-Shampoo's β1 × precondition frequency, over seeds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="30 steps, seed 0, SOAP native, f 5,10 (about a minute)",
    )
    parser.add_argument("--steps", type=int, help="steps per run (default 300; quick 30)")
    parser.add_argument(
        "--eval-interval",
        type=int,
        metavar="STEPS",
        help="steps between evaluations (default 25; quick 10)",
    )
    parser.add_argument(
        "--seeds", type=_csv(int, "integers like 0,1,2"), help="comma-separated (default 0,1,2)"
    )
    parser.add_argument(
        "--optimizers",
        type=_csv(str, "names"),
        help=f"subset of {','.join(OPTIMIZERS)} (default: both)",
    )
    parser.add_argument(
        "--modes",
        type=_csv(str, "names"),
        help=f"subset of {','.join(MODES)} (default native,embedded)",
    )
    parser.add_argument("--beta1s", type=_csv(float, "numbers"), help="default 0.9,0.95")
    parser.add_argument("--frequencies", type=_csv(int, "integers"), help="default 1,2,5,10")
    parser.add_argument(
        "--shape",
        default="train",
        help="the model shape: train (`asteria train`'s GPT), wide or deep, as `asteria bench "
        "convergence --shapes` names them (default train)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--engine-workers",
        type=int,
        default=1,
        help="solver processes of the embedded engine (default 1)",
    )
    parser.add_argument(
        "--no-adamw",
        dest="include_adamw",
        action="store_false",
        help="leave AdamW out (a part of a split sweep: its target comes from the other parts)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time, each its own process (default 1: one after the other in this "
        "process); for a machine with many cores",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        metavar="S",
        help="with --jobs: start no run after S seconds, stop those still running at 1.25 S; "
        "the report says which runs are missing",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: one report from these reports' runs (a sweep run in parts)",
    )
    output.add_flush_denormal_argument(parser, "the trainer")
    parser.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="write the report here (after every run too), with a figure",
    )
    return run_command


def config_from_args(args: argparse.Namespace) -> DefaultsConfig:
    quick = bool(args.quick)

    def pick(value: Any, full: Any, fast: Any) -> Any:
        return value if value is not None else (fast if quick else full)

    return DefaultsConfig(
        steps=pick(args.steps, 300, 30),
        eval_interval=pick(args.eval_interval, 25, 10),
        eval_batches=8 if quick else 16,
        seeds=pick(args.seeds, (0, 1, 2), (0,)),
        optimizers=pick(args.optimizers, OPTIMIZERS, ("soap",)),
        modes=pick(args.modes, ("native", "embedded"), ("native",)),
        beta1s=pick(args.beta1s, (0.9, 0.95), (0.9, 0.95)),
        frequencies=pick(args.frequencies, (1, 2, 5, 10), (5, 10)),
        threads=args.threads,
        engine_workers=args.engine_workers,
        flush_denormal=args.flush_denormal,
        include_adamw=args.include_adamw,
        quick=quick,
        shape=args.shape,
    )


def merge_reports(paths: list[Path]) -> dict[str, Any]:
    """One report from the runs of several (a sweep run in parts, on one machine or several):
    the grid is the union of theirs; a setting run twice for one seed keeps the first run."""
    parts = [json.loads(path.read_text()) for path in paths]
    first = parts[0]["config"]
    for path, part in zip(paths, parts, strict=True):
        if part.get("benchmark") != "defaults":
            raise ValueError(f"{path} is not a report of `asteria bench defaults`")
        for key in ("steps", "eval_interval", "eval_batches", "staleness_budget", "shape"):
            # a report from before --shape has no shape: it trained `asteria train`'s GPT
            theirs, ours = part["config"].get(key, "train"), first.get(key, "train")
            if theirs != ours:
                raise ValueError(f"{path}: {key} {theirs} != {ours}")
    union: dict[str, Any] = {}
    for key in ("seeds", "optimizers", "modes", "beta1s", "frequencies"):
        values = [v for part in parts for v in part["config"][key]]
        union[key] = tuple(dict.fromkeys(values))  # the first part's order, then new ones
    for key in ("seeds", "beta1s", "frequencies"):
        union[key] = tuple(sorted(union[key]))
    fields = {k: v for k, v in first.items() if k in DefaultsConfig.__dataclass_fields__}
    cfg = DefaultsConfig(**{**fields, **union})
    runs: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    for part in parts:
        for run in part["runs"]:
            if (run["config"], run["seed"]) not in seen:
                seen.add((run["config"], run["seed"]))
                runs.append(run)
    report = _report(cfg, runs, min(p["started_unix_s"] for p in parts), partial=False)
    report["merged_from"] = [
        {"path": str(path), "command": part.get("command"), "machine": part.get("machine")}
        for path, part in zip(paths, parts, strict=True)
    ]
    report["missing"] = [
        line
        for part in parts
        for line in part.get("missing", [])
        if not any(line.startswith(f"{r['label']} seed {r['seed']}") for r in runs)
    ]
    return report


def run_command(args: argparse.Namespace) -> int:
    if args.merge:
        report = merge_reports(args.merge)
        output.publish(report, format_report(report), args.json, write_figures)
        return 0
    cfg = config_from_args(args)
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.jobs > 1:
        report = run_parallel(cfg, jobs=args.jobs, deadline_s=args.deadline_s)
    else:
        report = run_defaults(cfg, json_path=args.json)
    output.publish(report, format_report(report), args.json, write_figures)
    return 0


# --- a sweep split over processes (--jobs) ------------------------------------------------------


def _single_run_command(cfg: DefaultsConfig, arm: Arm, json_path: Path) -> list[str]:
    cmd = [sys.executable, "-m", "asteria_client.cli", "bench", "defaults"]
    cmd += ["--steps", str(cfg.steps), "--eval-interval", str(cfg.eval_interval)]
    cmd += ["--seeds", str(arm.train_config.seed), "--threads", str(cfg.threads)]
    cmd += ["--engine-workers", str(cfg.engine_workers), "--json", str(json_path)]
    cmd += ["--shape", cfg.shape]
    cmd += ["--quick"] if cfg.quick else []
    if not cfg.flush_denormal:
        cmd += ["--no-flush-denormal"]
    if arm.info is None:  # AdamW alone
        return [*cmd, "--optimizers", ""]
    info = arm.info
    return [
        *cmd,
        "--no-adamw",
        "--optimizers",
        info["optimizer"],
        "--modes",
        info["mode"],
        "--beta1s",
        repr(info["beta1"]),
        "--frequencies",
        str(info["frequency"]),
    ]


def _expected_cost(arm: Arm) -> float:
    """Longest first (better packing): runs that refresh often cost most; AdamW, whose loss
    is every other run's target, before them all."""
    if arm.info is None:
        return math.inf
    return 1.0 + 4.0 / arm.info["frequency"]


def run_parallel(cfg: DefaultsConfig, *, jobs: int, deadline_s: float | None) -> dict[str, Any]:
    """Every run of :func:`plan` as its own process, ``jobs`` at a time; then one report over
    all of them, as if they had run in one process. Runs that did not finish by the deadline
    are listed in ``missing``."""
    import subprocess
    import tempfile

    started = time.time()
    arms = plan(cfg)
    # Seed by seed, the costliest first: a deadline then cuts whole settings of the last seed.
    queue = sorted(
        range(len(arms)),
        key=lambda i: (arms[i].train_config.seed, -_expected_cost(arms[i]), i),
    )
    running: dict[int, tuple[subprocess.Popen[bytes], Path]] = {}
    runs: list[dict[str, Any]] = []
    missing: list[str] = []
    with tempfile.TemporaryDirectory(prefix="asteria-defaults-") as tmp:
        while queue or running:
            elapsed = time.time() - started
            late = deadline_s is not None and elapsed > deadline_s
            while queue and len(running) < jobs and not late:
                index = queue.pop(0)
                path = Path(tmp) / f"run-{index}.json"
                cmd = _single_run_command(cfg, arms[index], path)
                log = (Path(tmp) / f"run-{index}.log").open("wb")
                running[index] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), path)
            if late and queue:
                missing += [arms[i].label + f" seed {arms[i].train_config.seed}" for i in queue]
                queue.clear()
            for index, (proc, path) in list(running.items()):
                if proc.poll() is None:
                    if deadline_s is not None and elapsed > 1.25 * deadline_s:
                        proc.kill()
                        proc.wait()
                    else:
                        continue
                del running[index]
                arm = arms[index]
                part = json.loads(path.read_text()) if path.exists() else None
                if part is None or proc.returncode != 0:
                    missing.append(
                        f"{arm.label} seed {arm.train_config.seed} (exit {proc.returncode})"
                    )
                    continue
                wanted = "adamw" if arm.info is None else arm.name
                runs += [r for r in part["runs"] if r["config"] == wanted]
                logger.info(
                    "defaults: %d/%d runs finished (%.0f s)",
                    len(runs),
                    len(arms),
                    time.time() - started,
                )
            time.sleep(0.2)
    report = _report(cfg, runs, started, partial=bool(missing))
    report["missing"] = missing
    report["jobs"] = jobs
    return report
