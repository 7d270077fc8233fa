"""`asteria bench peers`: Asteria's optimizers side by side with the libraries users would pick.

Trains `asteria train`'s GPT on the same batch streams and seeds with AdamW at its tuned default
lr, Asteria's SOAP, Shampoo and KL-Shampoo at their defaults (native, embedded, and continuous
where SOAP accepts ``refresh="continuous"``), and every peer optimizer of
:mod:`asteria_client.bench.peers_table` that is importable, each as its README recommends and at
Asteria's settings (lr and weight decay of Asteria's optimizer of the same family). A peer that
cannot run here is skipped with a line saying why.

For each seed all runs live in this one process and advance in turn, ``--interleave`` steps each
(see :mod:`asteria_client.bench.arms`), so their step times are comparable; the trainer runs on
one thread with subnormal floats flushed to zero, pinned to the first CPU while the embedded
engines' solver workers get the others (where there is more than one CPU).

Per configuration (mean over seeds): final validation loss; steps and training seconds (sum of
step times) to AdamW's mean final validation loss, interpolated between evaluations; the median
step time against AdamW's and p99/median; CPU seconds (the trainer's steps plus the solver
processes of its engine). Targets: Asteria's best schedule reaches AdamW's final loss in no more
steps than the best peer (within seed noise: the paired difference at most two standard
errors), and in at most 0.8x the best peer's training seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asteria_client.bench import convergence_summary, output
from asteria_client.bench.affinity import pinned, split_cpus, usable_cpus
from asteria_client.bench.arms import Arm, run_arms
from asteria_client.bench.peers_table import (
    PEERS,
    PeerOptimizer,
    continuous_options,
    continuous_unavailable_reason,
)
from asteria_client.tables import NAME_THEN_NUMBERS, markdown_table, text_table

logger = logging.getLogger(__name__)

ASTERIA_OPTIMIZERS = ("soap", "shampoo", "kl-shampoo")
ASTERIA_MODES = ("native", "embedded", "continuous")
#: Continuous refresh: optimizers that have a basis to refresh continuously.
CONTINUOUS_OPTIMIZERS = ("soap", "kl-shampoo")
WALL_CLOCK_TARGET = 0.8
QUICK_ASTERIA = ("soap-native", "soap-embedded")


@dataclass(frozen=True, kw_only=True)
class PeersConfig:
    steps: int = 300
    eval_interval: int = 25
    eval_batches: int = 16
    seeds: tuple[int, ...] = (0, 1, 2)
    interleave_steps: int = 10
    asteria: tuple[str, ...] = tuple(
        f"{o}-{m}"
        for o in ASTERIA_OPTIMIZERS
        for m in ASTERIA_MODES
        if m != "continuous" or o in CONTINUOUS_OPTIMIZERS
    )
    peers: tuple[str, ...] = tuple(p.name for p in PEERS)
    threads: int = 1
    engine_workers: int = 1
    flush_denormal: bool = True
    pin_solver: bool | None = None
    quick: bool = False

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "eval_interval",
            "eval_batches",
            "interleave_steps",
            "threads",
            "engine_workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"seeds must be distinct integers >= 0, got {self.seeds}")
        known = {f"{o}-{m}" for o in ASTERIA_OPTIMIZERS for m in ASTERIA_MODES}
        bad = [a for a in self.asteria if a not in known]
        if bad:
            raise ValueError(f"asteria: unknown {bad}; choose from {', '.join(sorted(known))}")
        bad = [p for p in self.peers if p not in {q.name for q in PEERS}]
        if bad:
            raise ValueError(
                f"peers: unknown {bad}; choose from {', '.join(p.name for p in PEERS)}"
            )
        if self.pin_solver is None:
            object.__setattr__(self, "pin_solver", len(usable_cpus()) > self.threads)


def _train_config(
    cfg: PeersConfig,
    seed: int,
    optimizer: str,
    mode: str | None,
    solver_cpus: tuple[int, ...] | None,
) -> Any:
    from asteria_client.optim.base import Mode
    from asteria_client.train.config import TrainConfig
    from asteria_client.train.optimizers import OptimizerKind

    embedded = mode in ("embedded", "continuous")
    return TrainConfig(
        optimizer=OptimizerKind(optimizer),
        mode=None if mode is None else Mode.EMBEDDED if embedded else Mode(mode),
        steps=cfg.steps,
        seed=seed,
        device="cpu",
        num_threads=cfg.threads,
        eval_interval=cfg.eval_interval,
        eval_batches=cfg.eval_batches,
        log_interval=cfg.steps,
        engine_workers=cfg.engine_workers if embedded else None,
        engine_cpu_affinity=solver_cpus if embedded else None,
        flush_denormal=cfg.flush_denormal,
    )


def _asteria_arm(
    cfg: PeersConfig, seed: int, name: str, solver_cpus: tuple[int, ...] | None
) -> Arm:
    optimizer, mode = name.rsplit("-", 1)
    train = _train_config(cfg, seed, optimizer, mode, solver_cpus)
    info = {"kind": "asteria", "optimizer": optimizer, "mode": mode}
    if mode != "continuous":
        return Arm(name=name, label=f"asteria {optimizer} {mode}", train_config=train, info=info)
    from asteria_client.train.optimizers import OptimizerSettings, build_optimizer

    settings = OptimizerSettings(
        kind=train.optimizer,
        lr=train.resolved_lr,
        weight_decay=train.weight_decay,
        mode=train.mode,
        engine_workers=train.engine_workers,
        engine_cpu_affinity=train.engine_cpu_affinity,
        options=continuous_options(),
    )
    return Arm(
        name=name,
        label=f"asteria {optimizer} continuous",
        train_config=train,
        factory=lambda model: build_optimizer(model, settings),
        info=info,
    )


def _peer_arms(cfg: PeersConfig, seed: int, peer: PeerOptimizer) -> list[Arm]:
    from asteria_client.train.optimizers import DEFAULT_LR

    train = _train_config(cfg, seed, "adamw", None, None)  # the optimizer comes from the factory
    own = peer.keywords()
    ours = peer.keywords(lr=DEFAULT_LR[peer.family], weight_decay=train.weight_decay)
    info = {
        "kind": "peer",
        "library": peer.library,
        "class": f"{peer.module}.{peer.class_name}",
        "written_for": peer.written_for,
        "installed": peer.installed_version(),
        "family": peer.family.value,
        "note": peer.note,
    }
    arms = [
        Arm(
            name=f"{peer.name}-readme",
            label=f"{peer.name} (README)",
            train_config=train,
            factory=peer.factory(own),
            info={**info, "keywords": _plain(own)},
        )
    ]
    arms.append(
        Arm(
            name=f"{peer.name}-asteria-settings",
            label=f"{peer.name} (Asteria's lr, wd)",
            train_config=train,
            factory=peer.factory(ours),
            info={**info, "keywords": _plain(ours)},
        )
    )
    return arms


def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, int | float | str | bool | tuple | None) else repr(v)
        for k, v in kwargs.items()
    }


def plan(
    cfg: PeersConfig, solver_cpus: tuple[int, ...] | None
) -> tuple[dict[int, list[Arm]], list[str]]:
    """The arms of each seed, and one line per configuration skipped (and why)."""
    skipped: list[str] = []
    asteria = list(cfg.asteria)
    if any(a.endswith("-continuous") for a in asteria):
        reason = continuous_unavailable_reason()
        if reason is not None:
            skipped += [f"{a}: skipped, {reason}" for a in asteria if a.endswith("-continuous")]
            asteria = [a for a in asteria if not a.endswith("-continuous")]
    peers = []
    for peer in PEERS:
        if peer.name not in cfg.peers:
            continue
        reason = peer.unavailable_reason()
        if reason is None:
            peers.append(peer)
        else:
            skipped.append(f"{peer.name}: skipped, {reason}")
    by_seed = {}
    for seed in cfg.seeds:
        arms = [
            Arm(
                name="adamw",
                label="adamw (tuned default lr)",
                train_config=_train_config(cfg, seed, "adamw", None, None),
                info={"kind": "baseline"},
            )
        ]
        arms += [_asteria_arm(cfg, seed, name, solver_cpus) for name in asteria]
        for peer in peers:
            arms += _peer_arms(cfg, seed, peer)
        by_seed[seed] = arms
    return by_seed, skipped


def run_peers(cfg: PeersConfig) -> dict[str, Any]:
    """Every seed's arms interleaved in this process (module doc), then the summary."""
    from asteria_client.train.cpu import flush_denormal

    with flush_denormal(cfg.flush_denormal) as flushing:  # before torch starts its threads
        report = _run_peers(cfg)
    report["config"]["flush_denormal_in_effect"] = flushing
    return report


def _run_peers(cfg: PeersConfig) -> dict[str, Any]:
    import torch

    from asteria_client.train.corpus import load_corpus

    started = time.time()
    load_before = os.getloadavg()[0]
    trainer_cpus, solver_cpus = split_cpus(cfg.threads) if cfg.pin_solver else (None, None)
    by_seed, skipped = plan(cfg, solver_cpus)
    for line in skipped:
        logger.info("peers: %s", line)
    total = sum(len(arms) for arms in by_seed.values())
    runs: list[dict[str, Any]] = []

    def progress(record: dict[str, Any]) -> None:
        runs.append(record)
        outcome = (
            f"final val {record['final_val_loss']:.4f}, median step "
            f"{record['median_step_time_s'] * 1e3:.1f} ms"
            if record["ok"]
            else f"FAILED ({record['error']})"
        )
        logger.info(
            "peers [%d/%d] %s seed %d: %s",
            len(runs),
            total,
            record["label"],
            record["seed"],
            outcome,
        )

    corpus = load_corpus()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    pinning = contextlib.ExitStack()
    try:
        if trainer_cpus is not None:
            pinning.enter_context(pinned(trainer_cpus))
        for seed in cfg.seeds:
            run_arms(
                by_seed[seed],
                interleave_steps=cfg.interleave_steps,
                corpus=corpus,
                progress=progress,
            )
    finally:
        pinning.close()
        torch.set_num_threads(threads_before)
    configs = [
        {"name": a.name, "label": a.label, "mode": (a.info or {}).get("mode"), **(a.info or {})}
        for a in by_seed[cfg.seeds[0]]
    ]
    adamw = [r["final_val_loss"] for r in runs if r["config"] == "adamw" and r["ok"]]
    target = statistics.fmean(adamw) if adamw else None
    for record in runs:
        if target is not None:
            convergence_summary.add_time_to_target(record, target)
    summaries = summarize(runs, configs)
    return {
        "benchmark": "peers",
        "quick": cfg.quick,
        "config": {**asdict(cfg), "seeds": list(cfg.seeds)},
        "affinity": {
            "trainer_cpus": None if trainer_cpus is None else list(trainer_cpus),
            "solver_cpus": None if solver_cpus is None else list(solver_cpus),
        },
        "started_unix_s": started,
        "wall_time_s": time.time() - started,
        # How busy the machine was (others' work too): the 1-minute load average, and CPUs.
        "load_average": {"start": load_before, "end": os.getloadavg()[0], "cpus": os.cpu_count()},
        "skipped": skipped,
        "target_val_loss": target,
        "batch_streams_identical": convergence_summary.batch_streams_identical(runs),
        "configs": configs,
        "summaries": summaries,
        "checks": checks(summaries, runs, cfg.seeds),
        "runs": runs,
    }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _std(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) >= 2 else None


def summarize(runs: list[dict[str, Any]], configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per configuration over its seeds (see the module doc for each figure)."""
    adamw_by_seed = {r["seed"]: r for r in runs if r["config"] == "adamw" and r["ok"]}
    out = []
    for config in configs:
        mine = [r for r in runs if r["config"] == config["name"]]
        done = [r for r in mine if r["ok"]]
        reached = [r for r in done if r.get("steps_to_target") is not None]
        vs_adamw = [
            r["median_step_time_s"] / adamw_by_seed[r["seed"]]["median_step_time_s"]
            for r in done
            if r["seed"] in adamw_by_seed
        ]
        out.append(
            {
                "config": config["name"],
                "label": config["label"],
                "kind": config.get("kind"),
                "lr": done[0]["lr"] if done and config.get("kind") != "peer" else None,
                "keywords": config.get("keywords"),
                "num_runs": len(mine),
                "num_failed": len(mine) - len(done),
                "errors": sorted({r["error"] for r in mine if r["error"]}),
                "final_val_loss_mean": _mean([r["final_val_loss"] for r in done]),
                "final_val_loss_std": _std([r["final_val_loss"] for r in done]),
                "num_reached": len(reached),
                "steps_to_target_mean": _mean([r["steps_to_target"] for r in reached]),
                "steps_to_target_std": _std([r["steps_to_target"] for r in reached]),
                "train_s_to_target_mean": _mean([r["train_s_to_target"] for r in reached]),
                "median_step_time_s": _mean([r["median_step_time_s"] for r in done]),
                "median_vs_adamw": _mean(vs_adamw),
                "p99_over_median": _mean(
                    [r["p99_step_time_s"] / r["median_step_time_s"] for r in done]
                ),
                "cpu_s_mean": _mean([r["cpu_s"] for r in done]),
                "train_s_mean": _mean([r["train_s"] for r in done]),
            }
        )
    return out


def _all_reached(summary: dict[str, Any], num_seeds: int) -> bool:
    return summary["num_reached"] == num_seeds


def checks(
    summaries: list[dict[str, Any]], runs: list[dict[str, Any]], seeds: tuple[int, ...]
) -> dict[str, Any]:
    """The issue's two targets; a configuration counts only if it reached the target on every
    seed."""

    def best(kind: str, key: str) -> dict[str, Any] | None:
        rows = [s for s in summaries if s["kind"] == kind and _all_reached(s, len(seeds))]
        return min(rows, key=lambda s: s[key]) if rows else None

    result: dict[str, Any] = {"wall_clock_target": WALL_CLOCK_TARGET}
    ours, theirs = best("asteria", "steps_to_target_mean"), best("peer", "steps_to_target_mean")
    result["steps"] = _steps_check(ours, theirs, runs)
    ours_s = best("asteria", "train_s_to_target_mean")
    theirs_s = best("peer", "train_s_to_target_mean")
    ratio = (
        ours_s["train_s_to_target_mean"] / theirs_s["train_s_to_target_mean"]
        if ours_s and theirs_s
        else None
    )
    result["wall_clock"] = {
        "asteria": None if ours_s is None else ours_s["config"],
        "peer": None if theirs_s is None else theirs_s["config"],
        "ratio": ratio,
        "met": (
            ours_s is not None
            and (theirs_s is None or (ratio is not None and ratio <= WALL_CLOCK_TARGET))
        ),
    }
    return result


def _steps_check(
    ours: dict[str, Any] | None, theirs: dict[str, Any] | None, runs: list[dict[str, Any]]
) -> dict[str, Any]:
    if ours is None or theirs is None:
        return {
            "asteria": ours and ours["config"],
            "peer": theirs and theirs["config"],
            "met": ours is not None,
            "mean_diff": None,
            "stderr": None,
        }
    steps = {}
    for r in runs:
        if r["config"] in (ours["config"], theirs["config"]) and r.get("steps_to_target"):
            steps[(r["config"], r["seed"])] = r["steps_to_target"]
    seeds = sorted({seed for _, seed in steps})
    diffs = [
        steps[(ours["config"], s)] - steps[(theirs["config"], s)]
        for s in seeds
        if (ours["config"], s) in steps and (theirs["config"], s) in steps
    ]
    mean = statistics.fmean(diffs)
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) >= 2 else 0.0
    return {
        "asteria": ours["config"],
        "peer": theirs["config"],
        "mean_diff": mean,
        "stderr": stderr,
        "met": mean <= 2 * stderr,
    }


# --- tables and figures -----------------------------------------------------------------------

_HEAD = (
    "configuration",
    "final val",
    "steps→AdamW",
    "train s→AdamW",
    "ms/step",
    "vs AdamW (median)",
    "p99/median",
    "CPU s",
)


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:{spec}}{suffix}"


def table_rows(data: dict[str, Any]) -> list[list[str]]:
    rows = []
    num_seeds = len(data["config"]["seeds"])
    for s in data["summaries"]:
        final = _fmt(s["final_val_loss_mean"], ".4f")
        if s["final_val_loss_std"] is not None:
            final += f" ± {s['final_val_loss_std']:.4f}"
        if s["num_failed"]:
            final += f" ({s['num_failed']} failed)"
        ok = s["num_runs"] - s["num_failed"]
        if s["num_reached"]:
            steps = _fmt(s["steps_to_target_mean"], ".0f")
            if s["steps_to_target_std"] is not None:
                steps += f" ± {s['steps_to_target_std']:.0f}"
            if s["num_reached"] < num_seeds:
                steps += f" ({s['num_reached']}/{ok})"
            seconds = _fmt(s["train_s_to_target_mean"], ".1f")
        else:
            steps = seconds = "not reached" if ok else "—"
        ms = None if s["median_step_time_s"] is None else s["median_step_time_s"] * 1e3
        rows.append(
            [
                s["label"],
                final,
                steps,
                seconds,
                _fmt(ms, ".1f"),
                _fmt(s["median_vs_adamw"], ".2f", "x"),
                _fmt(s["p99_over_median"], ".2f"),
                _fmt(s["cpu_s_mean"], ".1f"),
            ]
        )
    return rows


def check_lines(data: dict[str, Any]) -> list[str]:
    c = data["checks"]
    steps, wall = c["steps"], c["wall_clock"]
    label = {s["config"]: s["label"] for s in data["summaries"]}
    lines = []
    if steps["peer"] is None:
        lines.append(
            "Steps to AdamW's final loss: no peer reached it on every seed (or none "
            "ran); " + ("Asteria's best did: met." if steps["met"] else "nor did Asteria: MISSED.")
        )
    elif steps["asteria"] is None:
        lines.append(
            "Steps to AdamW's final loss: no Asteria configuration reached it on every "
            "seed: MISSED."
        )
    else:
        lines.append(
            f"Steps to AdamW's final loss: Asteria's best, {label[steps['asteria']]}, against "
            f"the best peer, {label[steps['peer']]}: paired difference "
            f"{steps['mean_diff']:+.1f} steps (standard error {steps['stderr']:.1f}); target "
            f"no more steps within seed noise: {'met' if steps['met'] else 'MISSED'}."
        )
    if wall["asteria"] is not None and wall["peer"] is not None:
        lines.append(
            f"Training seconds to AdamW's final loss: Asteria's best, {label[wall['asteria']]}, "
            f"{wall['ratio']:.2f}x the best peer's, {label[wall['peer']]} (target <= "
            f"{c['wall_clock_target']}x: {'met' if wall['met'] else 'MISSED'})."
        )
    elif wall["asteria"] is not None:
        lines.append("Training seconds to AdamW's final loss: no peer reached it on every seed.")
    return lines


def _notes(data: dict[str, Any]) -> list[str]:
    cfg = data["config"]
    target = data["target_val_loss"]
    affinity = data.get("affinity", {})
    pinning = (
        f"trainer pinned to CPU(s) {affinity['trainer_cpus']}, solver workers to "
        f"{affinity['solver_cpus']}"
        if affinity.get("trainer_cpus")
        else "no pinning"
    )
    flushing = (
        "subnormals flushed to zero"
        if cfg.get("flush_denormal_in_effect", cfg["flush_denormal"])
        else "subnormals kept"
    )
    notes = [
        f"{cfg['steps']} steps, evaluation every {cfg['eval_interval']} steps on "
        f"{cfg['eval_batches']} fixed validation batches, seeds {cfg['seeds']}; all runs of a "
        f"seed in one process, interleaved {cfg['interleave_steps']} steps at a time; "
        f"{cfg['threads']} trainer thread(s), {cfg['engine_workers']} engine worker(s); "
        f"{flushing}; {pinning}.",
        "Target: AdamW's mean final val loss at its tuned default lr, "
        + ("—" if target is None else f"{target:.4f}")
        + ". Steps and training seconds (sum "
        "of step times) to it are interpolated between evaluations, averaged over the seeds "
        "that reached it (count in brackets when not all).",
        "ms/step: median step time; vs AdamW: each seed's median over AdamW's, measured "
        "interleaved; CPU s: the trainer's steps plus its engine's solver processes.",
        "Identical batch streams per seed across configurations: "
        f"{'yes' if data['batch_streams_identical'] else 'NO'}.",
    ]
    load = data.get("load_average")
    if load is not None:
        notes.append(
            f"Machine load (1-minute load average, others' work included): {load['start']:.1f} "
            f"at the start, {load['end']:.1f} at the end, on {load['cpus']} CPUs."
        )
    notes += data["skipped"]
    return notes


def peer_table_lines(data: dict[str, Any]) -> list[str]:
    """Each peer row's keywords and versions, for the report."""
    lines = []
    for config in data["configs"]:
        if config.get("kind") != "peer":
            continue
        installed = config.get("installed") or "not from PyPI"
        lines.append(
            f"{config['label']}: {config['class']}({config['keywords']}), installed "
            f"{installed}, table written for {config['written_for']}"
            + (f"; {config['note']}" if config.get("note") else "")
        )
    return lines


def format_report(data: dict[str, Any]) -> str:
    lines = text_table([list(_HEAD), *table_rows(data)])
    return "\n".join(
        [*lines, "", *check_lines(data), "", *_notes(data), "", *peer_table_lines(data)]
    )


def report_section(data: dict[str, Any]) -> str:
    lines = [f"- {note}" for note in _notes(data)]
    lines += ["", *markdown_table(list(_HEAD), table_rows(data), align=NAME_THEN_NUMBERS)]
    lines += ["", *[f"- {line}" for line in check_lines(data)]]
    lines += ["", "Peer configurations:", "", *[f"- {line}" for line in peer_table_lines(data)]]
    for figure in data.get("figures", []):
        lines += ["", f"![{Path(figure).stem}]({figure})"]
    return "\n".join(lines) + "\n"


def write_figures(data: dict[str, Any], json_path: Path) -> list[Path]:
    """Validation loss against step and against training seconds (convergence's figures),
    and the median step time against AdamW's per configuration."""
    shaped = {**data, "target_val_loss": data["target_val_loss"]}
    paths = (
        convergence_summary.write_figures(shaped, json_path)
        if data["target_val_loss"] is not None
        else []
    )
    fig, ax = output.new_figure(7.0, 0.35 * len(data["summaries"]) + 1.2)
    rows = [s for s in data["summaries"] if s["median_vs_adamw"] is not None]
    ax.barh([s["label"] for s in rows], [s["median_vs_adamw"] for s in rows], color="0.55")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("median step time / AdamW's (interleaved in one process)")
    ax.set_title("Step time against AdamW")
    paths.append(output.save_figure(fig, output.figure_path(json_path, "step-time")))
    return paths


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
        "peers",
        help="peers: Asteria's SOAP/Shampoo/KL-Shampoo against HeavyBall, Emerging-Optimizers, "
        "distributed_shampoo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"40 steps, seed 0, {', '.join(QUICK_ASTERIA)} and the peers",
    )
    parser.add_argument("--steps", type=int, help="steps per run (default 300; quick 40)")
    parser.add_argument(
        "--eval-interval",
        type=int,
        metavar="STEPS",
        help="steps between evaluations (default 25; quick 10)",
    )
    parser.add_argument(
        "--seeds",
        type=_csv(int, "integers like 0,1,2"),
        help="comma-separated (default 0,1,2; quick 0)",
    )
    parser.add_argument(
        "--asteria",
        type=_csv(str, "names"),
        help="Asteria's configurations, OPTIMIZER-MODE (default: every "
        "optimizer native, embedded, and continuous for soap and kl-shampoo)",
    )
    parser.add_argument(
        "--peers",
        type=_csv(str, "names"),
        help=f"subset of {','.join(p.name for p in PEERS)} (default: all)",
    )
    parser.add_argument(
        "--interleave",
        type=int,
        default=10,
        metavar="STEPS",
        help="steps each run takes in turn (default 10)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--engine-workers",
        type=int,
        default=1,
        help="solver processes of each embedded engine (default 1)",
    )
    parser.add_argument(
        "--pin-solver",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin the trainer to the first --threads CPUs and the solver "
        "workers to the rest (default: on when there are more CPUs)",
    )
    output.add_flush_denormal_argument(parser, "the trainer")
    parser.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="write the report here, with PNG figures beside it",
    )
    return run_command


def config_from_args(args: argparse.Namespace) -> PeersConfig:
    quick = bool(args.quick)

    def pick(value: Any, full: Any, fast: Any) -> Any:
        return value if value is not None else (fast if quick else full)

    full_asteria = PeersConfig.__dataclass_fields__["asteria"].default
    return PeersConfig(
        steps=pick(args.steps, 300, 40),
        eval_interval=pick(args.eval_interval, 25, 10),
        eval_batches=8 if quick else 16,
        seeds=pick(args.seeds, (0, 1, 2), (0,)),
        asteria=pick(args.asteria, full_asteria, QUICK_ASTERIA),
        peers=pick(args.peers, tuple(p.name for p in PEERS), tuple(p.name for p in PEERS)),
        interleave_steps=args.interleave,
        threads=args.threads,
        engine_workers=args.engine_workers,
        flush_denormal=args.flush_denormal,
        pin_solver=args.pin_solver,
        quick=quick,
    )


def run_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    report = run_peers(cfg)
    output.publish(report, format_report(report), args.json, write_figures)
    return 0
