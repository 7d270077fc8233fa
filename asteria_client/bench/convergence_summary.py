"""What `asteria bench convergence` makes of its runs: time to target, tables and figures.

Pure functions over the report's plain dicts, so they can be tested by hand and reused by
``asteria bench report``. A run is a dict with ``config``, ``seed``, ``ok`` and, when ``ok``,
``evals`` (``[{"step", "val_loss", "elapsed_s", "wall_s"}, ...]``, step 0 first) and the
measurements listed in :mod:`asteria_client.bench.convergence`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asteria_client.bench import output
from asteria_client.tables import NAME_THEN_NUMBERS, markdown_table, text_table


def interpolated_crossing(
    xs: Sequence[float], losses: Sequence[float], target: float
) -> float | None:
    """Where the loss curve first reaches ``target``: the x of the first point at or below it,
    moved back by linear interpolation towards the point before (``None``: never reached).

    ``xs`` are increasing (steps, or training seconds) and pair with ``losses``. If the very
    first point is already at or below the target, its x is the answer.
    """
    if len(xs) != len(losses):
        raise ValueError(f"xs and losses differ in length: {len(xs)} != {len(losses)}")
    for index, loss in enumerate(losses):
        if loss <= target:
            if index == 0:
                return float(xs[0])
            x0, x1 = xs[index - 1], xs[index]
            l0 = losses[index - 1]  # > target, > loss
            return float(x0 + (l0 - target) / (l0 - loss) * (x1 - x0))
    return None


def add_time_to_target(run: dict[str, Any], target: float) -> None:
    """Set ``steps_to_target`` and ``train_s_to_target`` of a finished run (``None``: not
    reached). The time is training time (``elapsed_s``: the sum of step times)."""
    if not run["ok"]:
        run["steps_to_target"] = run["train_s_to_target"] = None
        return
    losses = [e["val_loss"] for e in run["evals"]]
    steps = [e["step"] for e in run["evals"]]
    seconds = [e["elapsed_s"] for e in run["evals"]]
    run["steps_to_target"] = interpolated_crossing(steps, losses, target)
    run["train_s_to_target"] = interpolated_crossing(seconds, losses, target)


def median_quiet_step_time(step_times_s: Sequence[float], frequency: int | None) -> float | None:
    """The median time of the steps that refresh nothing on the amortized schedule of
    ``frequency`` (None: not amortized). Step ``i + 1`` takes ``step_times_s[i]``; the first
    step only initializes, and step ``t + 1`` refreshes when ``t % frequency == 0``."""
    if frequency is None:
        return None
    quiet = [s for i, s in enumerate(step_times_s) if i % frequency != 0]
    return statistics.median(quiet) if quiet else None


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _std(values: Sequence[float]) -> float | None:
    return statistics.stdev(values) if len(values) >= 2 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def batch_streams_identical(runs: Sequence[dict[str, Any]]) -> bool:
    """Whether every finished run of a seed drew the same training batches, and every run the
    same validation batches (from the digests `asteria train` records)."""
    done = [r for r in runs if r["ok"]]
    by_seed: dict[int, set[str]] = {}
    for r in done:
        by_seed.setdefault(r["seed"], set()).add(r["train_batches_digest"])
    same_val = len({r["val_batches_digest"] for r in done}) <= 1
    return same_val and all(len(digests) == 1 for digests in by_seed.values())


#: The amortized runs whose quiet steps (no refresh) continuous refresh's step time is held
#: to, and the amortized embedded runs it must not lose to in steps: the first present.
QUIET_REFERENCES = ("soap-native-f5", "soap-native-f10")
AMORTIZED_REFERENCES = ("soap-embedded-f5-s1", "soap-embedded-f10-s1")


def _sum_limits(runs: Sequence[dict[str, Any]]) -> dict[str, int] | None:
    """The continuous schedule's ``extra_limited_steps`` added over runs (None: none has)."""
    found = [r["extra_limited_steps"] for r in runs if r.get("extra_limited_steps")]
    if not found:
        return None
    return {key: sum(limits.get(key, 0) for limits in found) for key in found[0]}


def summarize_configs(
    runs: Sequence[dict[str, Any]], configs: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One summary per configuration (in ``configs`` order) over its seeds' runs.

    Means of steps/time to target are over the seeds that reached it (``num_reached`` says how
    many). Ratios: ``steps_to_target_vs_adamw`` against AdamW's mean, and, for an async mode,
    ``train_s_to_target_vs_native`` against the same optimizer in native mode.
    """
    summaries: dict[str, dict[str, Any]] = {}
    for config in configs:
        mine = [r for r in runs if r["config"] == config["name"]]
        done = [r for r in mine if r["ok"]]
        finals = [r["final_val_loss"] for r in done]
        reached = [r for r in done if r["steps_to_target"] is not None]
        lags = [r["runtime"].get("max_lag_steps", 0) for r in done if r["runtime"]]
        summaries[config["name"]] = {
            "config": config["name"],
            "label": config["label"],
            "optimizer": config["optimizer"],
            "mode": config["mode"],
            "staleness_budget": config["staleness_budget"],
            "lr": done[0]["lr"] if done else None,
            "num_runs": len(mine),
            "num_failed": len(mine) - len(done),
            "final_val_loss_mean": _mean(finals),
            "final_val_loss_std": _std(finals),
            "num_reached": len(reached),
            "steps_to_target_mean": _mean([r["steps_to_target"] for r in reached]),
            "train_s_to_target_mean": _mean([r["train_s_to_target"] for r in reached]),
            "train_s_mean": _mean([r["train_s"] for r in done]),
            "process_wall_s_mean": _mean([r["process_wall_s"] for r in done]),
            "cpu_s_mean": _mean([r["cpu_s"] for r in done]),
            "median_step_time_s": _mean([r["median_step_time_s"] for r in done]),
            "median_quiet_step_time_s": _mean(
                [q for r in done if (q := r.get("median_quiet_step_time_s")) is not None]
            ),
            "refreshes_per_100_steps": _mean(
                [x for r in done if (x := r.get("refreshes_per_100_steps")) is not None]
            ),
            "floor_per_100_steps": _mean(
                [x for r in done if (x := r.get("floor_per_100_steps")) is not None]
            ),
            "extra_per_100_steps": _mean(
                [x for r in done if (x := r.get("extra_per_100_steps")) is not None]
            ),
            "extra_limited_steps": _sum_limits(done),
            "drift_at_install": _mean(
                [x for r in done if (x := r.get("drift_at_install")) is not None]
            ),
            "max_lag_steps": max(lags) if lags else None,
            "barrier_waits_mean": _mean(
                [r["runtime"]["barrier_waits"] for r in done if r["runtime"]]
            ),
            "barrier_wait_s_mean": _mean(
                [r["runtime"]["barrier_wait_s"] for r in done if r["runtime"]]
            ),
            "local_fallbacks_total": sum(
                r["runtime"]["local_fallbacks"] for r in done if r["runtime"]
            )
            if any(r["runtime"] for r in done)
            else None,
        }
    adamw = summaries.get("adamw", {}).get("steps_to_target_mean")
    every_step = summaries.get("soap-native-f1", {}).get("steps_to_target_mean")
    quiet_name = next((n for n in QUIET_REFERENCES if n in summaries), None)
    quiet = summaries[quiet_name]["median_quiet_step_time_s"] if quiet_name else None
    amortized_name = next((n for n in AMORTIZED_REFERENCES if n in summaries), None)
    amortized = summaries[amortized_name] if amortized_name else {}
    for summary in summaries.values():
        second_order = summary["mode"] is not None
        summary["steps_to_target_vs_native_f1"] = (
            _ratio(summary["steps_to_target_mean"], every_step) if second_order else None
        )
        summary["quiet_reference"] = quiet_name
        summary["step_time_vs_native_f10_quiet"] = (
            _ratio(summary["median_step_time_s"], quiet) if second_order else None
        )
        summary["amortized_reference"] = amortized_name
        summary["steps_to_target_vs_amortized"] = (
            _ratio(summary["steps_to_target_mean"], amortized.get("steps_to_target_mean"))
            if second_order
            else None
        )
        summary["step_time_vs_amortized"] = (
            _ratio(summary["median_step_time_s"], amortized.get("median_step_time_s"))
            if second_order
            else None
        )
        summary["steps_to_target_vs_adamw"] = _ratio(summary["steps_to_target_mean"], adamw)
        native = summaries.get(f"{summary['optimizer']}-native")
        async_mode = summary["mode"] in ("embedded", "daemon")
        summary["train_s_to_target_vs_native"] = (
            _ratio(summary["train_s_to_target_mean"], native["train_s_to_target_mean"])
            if async_mode and native is not None
            else None
        )
    return list(summaries.values())


# --- tables -----------------------------------------------------------------------------------

_COLUMNS = (
    "configuration",
    "final val",
    "steps→target",
    "train s→target",
    "vs AdamW (steps)",
    "vs native (s)",
    "train s",
    "CPU s",
    "ms/step",
    "max lag",
    "waits",
    "fallbacks",
)


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:{spec}}{suffix}"


_SCHEDULE_COLUMNS = (
    "configuration",
    "final val",
    "steps→target",
    "train s→target",
    "steps vs f=1",
    "steps vs amortized",
    "ms/step",
    "vs amortized",
    "vs quiet",
    "refreshes/100 (floor+extra)",
    "extras stopped: credit/budget/no hook",
    "drift@install",
    "CPU s",
    "max lag",
    "waits (s)",
    "fallbacks",
)


def schedule_rows(summaries: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The ``--schedules`` table: steps to target against native f=1, the median step time
    against native f=10's median quiet step (no refresh in it), refreshes per block per 100
    steps and the mean drift of the bases replaced at install."""
    rows = []
    for s in summaries:
        base = table_rows([s])[0]
        ms = None if s["median_step_time_s"] is None else s["median_step_time_s"] * 1e3
        waits = _fmt(s["barrier_waits_mean"], ".1f")
        if s["barrier_wait_s_mean"] is not None:
            waits += f" ({s['barrier_wait_s_mean']:.2f})"
        refreshes = _fmt(s.get("refreshes_per_100_steps"), ".1f")
        if s.get("floor_per_100_steps") is not None and s.get("extra_per_100_steps") is not None:
            refreshes += f" ({s['floor_per_100_steps']:.1f}+{s['extra_per_100_steps']:.1f})"
        limits = s.get("extra_limited_steps")
        stopped = (
            "—"
            if not limits
            else f"{limits['credit']}/{limits['overhead_budget']}/{limits['no_pull_point']}"
            f" of {limits['steps']}"
        )
        rows.append(
            [
                base[0],
                base[1],
                base[2],
                base[3],
                _fmt(s.get("steps_to_target_vs_native_f1"), ".2f", "x"),
                _fmt(s.get("steps_to_target_vs_amortized"), ".2f", "x"),
                _fmt(ms, ".1f"),
                _fmt(s.get("step_time_vs_amortized"), ".2f", "x"),
                _fmt(s.get("step_time_vs_native_f10_quiet"), ".2f", "x"),
                refreshes,
                stopped,
                _fmt(s.get("drift_at_install"), ".1e"),
                base[7],
                base[9],
                waits if s["mode"] is not None else "—",
                base[11],
            ]
        )
    return rows


def _columns_and_rows(data: dict[str, Any]) -> tuple[tuple[str, ...], list[list[str]]]:
    if data.get("benchmark") == "schedules":
        return _SCHEDULE_COLUMNS, schedule_rows(data["summaries"])
    return _COLUMNS, table_rows(data["summaries"])


def table_rows(summaries: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The summary table's cells, one row per configuration (header not included)."""
    rows = []
    for s in summaries:
        n_ok = s["num_runs"] - s["num_failed"]
        final = _fmt(s["final_val_loss_mean"], ".4f")
        if s["final_val_loss_std"] is not None:
            final += f" ± {s['final_val_loss_std']:.4f}"
        if s["num_failed"]:
            final += f" ({s['num_failed']} failed)"
        reached = f" ({s['num_reached']}/{n_ok})" if n_ok else ""
        steps = _fmt(s["steps_to_target_mean"], ".0f") if s["num_reached"] else "not reached"
        seconds = _fmt(s["train_s_to_target_mean"], ".1f") if s["num_reached"] else "not reached"
        rows.append(
            [
                s["label"],
                final,
                steps + reached,
                seconds,
                _fmt(s["steps_to_target_vs_adamw"], ".2f", "x"),
                _fmt(s["train_s_to_target_vs_native"], ".2f", "x"),
                _fmt(s["train_s_mean"], ".1f"),
                _fmt(s["cpu_s_mean"], ".1f"),
                _fmt(
                    None if s["median_step_time_s"] is None else s["median_step_time_s"] * 1e3,
                    ".1f",
                ),
                _fmt(s["max_lag_steps"], "d") if s["max_lag_steps"] is not None else "—",
                _fmt(s["barrier_waits_mean"], ".1f"),
                _fmt(s["local_fallbacks_total"], "d")
                if s["local_fallbacks_total"] is not None
                else "—",
            ]
        )
    return rows


def format_table(summaries: Sequence[dict[str, Any]], *, schedules: bool = False) -> str:
    """The summary as aligned plain text, for the terminal."""
    columns, rows = _columns_and_rows(
        {"benchmark": "schedules" if schedules else "convergence", "summaries": summaries}
    )
    return "\n".join(text_table([list(columns), *rows]))


def _notes(data: dict[str, Any]) -> list[str]:
    cfg = data["config"]
    sweep = ", ".join(
        f"{r['lr']:g}: " + (f"{r['final_val_loss']:.4f}" if r["ok"] else "failed")
        for r in data["adamw_sweep"]
    )
    return [
        f"{cfg['steps']} steps, evaluation every {cfg['eval_interval']} steps on "
        f"{cfg['eval_batches']} fixed validation batches, seeds {cfg['seeds']}, "
        f"{cfg['threads']} trainer thread(s), {cfg['engine_workers']} engine worker(s), "
        f"device {cfg['device']}.",
        f"AdamW lr sweep on seed {cfg['seeds'][0]} (final val loss): {sweep}; "
        f"picked {data['adamw_lr']:g}.",
        f"Target: tuned AdamW's mean final val loss, {data['target_val_loss']:.4f}. "
        "Steps and training seconds to target are interpolated at the first evaluation at or "
        "below it, averaged over the seeds that reached it (count in brackets).",
        "Training seconds are the sum of step times (no evaluation, no process start); CPU "
        "seconds are the whole training process with its reaped engine workers, plus the "
        "daemon and its workers for daemon runs.",
        "ms/step: median step time; max lag: the largest staleness observed, in steps; waits: "
        "barrier waits per run; fallbacks: local fallbacks in all runs; — means not applicable.",
        "Identical batch streams per seed across configurations: "
        f"{'yes' if data['batch_streams_identical'] else 'NO'}.",
        cpu_note(data),
        *(_schedule_notes() if data.get("benchmark") == "schedules" else []),
    ]


def _schedule_notes() -> list[str]:
    return [
        "Schedules: native f=k refreshes every basis synchronously every k steps; embedded "
        "f=k S=1 is the amortized schedule; continuous S=k snapshots every block at least every "
        "f steps (the floor, f = SOAP's default 5) and, whenever the engine's worker is free, "
        "the blocks whose basis drifted most from their factor (per solve-second), an extra "
        "snapshot in flight for at most k steps; 'no attach': trained without the optimizer's "
        "hooks on the model, so step ends are the only pull points.",
        "steps vs f=1 / vs amortized: steps to target over native f=1's / amortized embedded's "
        "(f=5, else f=10); ms/step vs amortized: median step time over amortized embedded's; "
        "vs quiet: over the median of native f=5's (else f=10's) steps that refresh nothing; "
        "refreshes/100: installs per block per 100 steps (mean over blocks; floor + extra on "
        "the continuous schedule); extras stopped: steps (all seeds) in which credit, the "
        "overhead budget or the lack of a pull point (no hooks) stopped extra pulls; "
        "drift@install: the replaced basis's off-diagonal energy of QᵀLQ over ‖L‖², mean over "
        "installs sampled at most one per block every 4 steps; waits (s): barrier waits per "
        "run (seconds).",
    ]


def cpu_note(data: dict[str, Any]) -> str:
    """Flush-denormal and pinning, as the training processes ran."""
    flush = data["config"].get("flush_denormal")
    if flush is None:
        return "CPU settings not recorded (a report from before flush-denormal)."
    ran = [r for r in data["runs"] if r["ok"]]
    unable = sum(1 for r in ran if flush and r.get("flush_denormal") is False)
    flushing = "subnormals flushed to zero" if flush else "subnormals kept (--no-flush-denormal)"
    if unable:
        flushing += f" (but {unable} of {len(ran)} runs' CPUs could not flush)"
    return (
        f"CPU settings: {flushing} in every training process; no pinning: a run's trainer and "
        "its solver workers (embedded, or the daemon's) share the CPUs, the workers at a lower "
        "priority."
    )


def shape_blocks(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The report once per model shape: a report of several shapes (``"shapes"``) gives each
    shape's block merged into the report's common fields; a report of one, itself."""
    if "shapes" not in data:
        return [data]
    common = {k: v for k, v in data.items() if k != "shapes"}
    blocks = []
    for block in data["shapes"]:
        mark = f"-{block['shape']['name']}-loss-"
        figures = [f for f in data.get("figures", []) if mark in Path(f).name]
        blocks.append({**common, **block, "figures": figures})
    return blocks


def _shape_title(block: dict[str, Any]) -> str:
    shape = block["shape"]
    return (
        f"Shape {shape['name']}: {shape['n_layer']} layers, d {shape['n_embd']}, "
        f"{shape['n_head']} heads"
    )


def report_section(data: dict[str, Any]) -> str:
    """The body of the convergence section of ``asteria bench report`` (which adds the
    heading): notes, the summary table, the figures; per model shape when there are
    several."""
    if "shapes" in data:
        parts = [
            f"### {_shape_title(block)}\n\n{_one_report_section(block)}"
            for block in shape_blocks(data)
        ]
        return "\n".join(parts)
    return _one_report_section(data)


def _one_report_section(data: dict[str, Any]) -> str:
    columns, rows = _columns_and_rows(data)
    lines = [f"- {note}" for note in _notes(data)]
    lines += ["", *markdown_table(columns, rows, align=NAME_THEN_NUMBERS)]
    for figure in data.get("figures", []):
        lines += ["", f"![{Path(figure).stem}]({figure})"]
    return "\n".join(lines) + "\n"


def format_report(data: dict[str, Any]) -> str:
    """The terminal summary: the table, then the notes (per model shape when several)."""
    if "shapes" in data:
        return "\n\n".join(
            f"{_shape_title(block)}\n{_one_format_report(block)}" for block in shape_blocks(data)
        )
    return _one_format_report(data)


def _one_format_report(data: dict[str, Any]) -> str:
    schedules = data.get("benchmark") == "schedules"
    table = format_table(data["summaries"], schedules=schedules)
    return "\n".join([table, "", *_notes(data)])


# --- figures ----------------------------------------------------------------------------------


def mean_curve(runs: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(mean of ``key``, mean val loss) at each evaluation, over runs (cut to the shortest)."""
    done = [r for r in runs if r["ok"]]
    if not done:
        return [], []
    length = min(len(r["evals"]) for r in done)
    xs = [statistics.fmean(r["evals"][i][key] for r in done) for i in range(length)]
    ys = [statistics.fmean(r["evals"][i]["val_loss"] for r in done) for i in range(length)]
    return xs, ys


_LINESTYLE = {None: "-", "native": "-", "embedded": "--", "daemon": ":"}


def write_figures(data: dict[str, Any], json_path: Path) -> list[Path]:
    """Loss vs step and loss vs training seconds, mean over seeds per configuration (per
    model shape when there are several)."""
    if "shapes" not in data:
        return _write_figures(data, json_path, "")
    paths = []
    for block in shape_blocks(data):
        paths += _write_figures(block, json_path, f"{block['shape']['name']}-")
    return paths


def _write_figures(data: dict[str, Any], json_path: Path, prefix: str) -> list[Path]:
    target = data["target_val_loss"]
    paths = []
    for key, suffix, xlabel in (
        ("step", f"{prefix}loss-step", "step"),
        ("elapsed_s", f"{prefix}loss-time", "training time (s, sum of step times)"),
    ):
        fig, ax = output.new_figure()
        lowest, highest = math.inf, -math.inf
        for config in data["configs"]:
            runs = [r for r in data["runs"] if r["config"] == config["name"]]
            xs, ys = mean_curve(runs, key)
            if not xs:
                continue
            style = "-." if config.get("refresh") == "continuous" else None
            style = style or _LINESTYLE.get(config["mode"], "-")
            ax.plot(xs, ys, style, label=config["label"], lw=1.4)
            lowest, highest = min(lowest, min(ys)), max(highest, max(ys))
        ax.axhline(target, color="grey", lw=0.8, ls="-.", label="target (tuned AdamW)")
        if math.isfinite(lowest):
            ax.set_ylim(lowest - 0.05, min(highest, target + 1.0) + 0.05)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/char)")
        ax.set_title(
            f"validation loss vs {'step' if key == 'step' else 'training time'}, mean over seeds"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        paths.append(output.save_figure(fig, output.figure_path(json_path, suffix)))
    return paths
