"""`asteria bench sharing`: how one daemon's solves are shared among N training processes.

For each N (default 1, 2, 4) the benchmark starts a fresh `asteria-server` with two solver
workers on a private socket, then N `asteria train --optimizer soap --mode daemon` processes at
once, each a job of its own (``ASTERIA_JOB``), and waits for all of them. From each run's JSON
(the optimizer's runtime stats, whose ``source`` holds the daemon client's counters) it reports:

- solves/s delivered to each client: results received (``results_timed``) over that client's
  run time (``final.total_time_s``), and their sum over clients (the aggregate);
- each client's result latency, submit to arrival, p50 and p99;
- Jain's fairness index over the clients' solves/s, (sum x)^2 / (N sum x^2): 1 when equal, 1/N
  when one client gets everything;
- each client's steps/s (over the sum of its step times), barrier waits and local fallbacks;
- how much the clients' training windows overlapped (they start at slightly different times),
  and the CPU seconds of the daemon and its workers.

The training processes flush subnormal floats to zero unless --no-flush-denormal (see
:mod:`asteria_client.train.cpu`). They, the daemon and its workers all share the machine's cores
(nothing is pinned), so at larger N
the trainers compete with each other and with the solver workers: read the numbers as "what one
node delivers", not as the daemon's capacity alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asteria_client.bench import output
from asteria_client.config import environ_without_asteria
from asteria_client.daemon_process import DaemonProcess
from asteria_client.tables import markdown_table, text_table
from asteria_server.errors import AsteriaError

logger = logging.getLogger(__name__)

DEFAULT_CLIENTS = (1, 2, 4)
QUICK_CLIENTS = (1, 2)
DEFAULT_STEPS = 60
QUICK_STEPS = 16


class SharingRunError(AsteriaError):
    """A training process of the benchmark failed or hung."""


@dataclass(frozen=True, kw_only=True)
class SharingConfig:
    clients: tuple[int, ...] = DEFAULT_CLIENTS
    steps: int = DEFAULT_STEPS
    optimizer: str = "soap"
    precondition_frequency: int = 5
    staleness_budget: int = 1
    daemon_workers: int = 2
    client_timeout_s: float = 900.0
    flush_denormal: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.flush_denormal, bool):
            raise ValueError(f"flush_denormal must be True or False, got {self.flush_denormal!r}")
        if not self.clients or any(n < 1 for n in self.clients):
            raise ValueError(f"clients must be counts >= 1, got {list(self.clients)}")
        if self.optimizer not in ("soap", "shampoo", "kl-shampoo"):
            raise ValueError(f"optimizer={self.optimizer!r}: pick soap, shampoo or kl-shampoo")
        for name in ("steps", "precondition_frequency", "daemon_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.staleness_budget < 0:
            raise ValueError(f"staleness_budget must be >= 0, got {self.staleness_budget}")
        if self.client_timeout_s <= 0:
            raise ValueError(f"client_timeout_s must be > 0, got {self.client_timeout_s}")


def jain_index(values: list[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2), in [1/n, 1]; NaN when all are zero."""
    square_sum = sum(x * x for x in values)
    if not values or square_sum == 0:
        return math.nan
    return sum(values) ** 2 / (len(values) * square_sum)


def _train_command(cfg: SharingConfig, json_path: Path, seed: int) -> list[str]:
    flush = [] if cfg.flush_denormal else ["--no-flush-denormal"]
    return [
        sys.executable,
        "-m",
        "asteria_client.cli",
        "train",
        "--optimizer",
        cfg.optimizer,
        "--mode",
        "daemon",
        "--steps",
        str(cfg.steps),
        "--precondition-frequency",
        str(cfg.precondition_frequency),
        "--staleness-budget",
        str(cfg.staleness_budget),
        "--seed",
        str(seed),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--eval-interval",
        str(cfg.steps),
        "--eval-batches",
        "1",
        "--log-interval",
        str(cfg.steps),
        "--json",
        str(json_path),
        *flush,
    ]


def client_summary(doc: dict[str, Any], *, ended_unix_s: float) -> dict[str, Any]:
    """One training process's figures, from its `asteria train --json` document."""
    stats = doc["optimizer"]
    source = stats.get("source", {})
    total_s = float(doc["final"]["total_time_s"])
    step_times = [float(s["step_time_s"]) for s in doc["steps"]]
    results = int(source.get("results_timed", 0))
    return {
        "steps": len(step_times),
        "run_time_s": total_s,
        "train_time_s": sum(step_times),
        "steps_per_s": len(step_times) / sum(step_times),
        "median_step_time_s": float(doc["final"]["median_step_time_s"]),
        "results": results,
        "solves_per_s": results / total_s,
        "latency_p50_s": source.get("result_latency_p50_s"),
        "latency_p99_s": source.get("result_latency_p99_s"),
        "barrier_waits": stats["barrier_waits"],
        "barrier_wait_s": stats["barrier_wait_s"],
        "barrier_timeouts": stats["barrier_timeouts"],
        "local_fallbacks": stats["local_fallbacks"],
        "submits_dropped": source.get("submits_dropped", 0),
        "max_lag_steps": stats["max_lag_steps"],
        "num_blocks": stats.get("num_blocks"),
        "final_val_loss": float(doc["final"]["val_loss"]),
        "flush_denormal": doc.get("config", {}).get("resolved", {}).get("flush_denormal"),
        "started_unix_s": ended_unix_s - total_s,
        "ended_unix_s": ended_unix_s,
    }


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_clients(cfg: SharingConfig, num_clients: int, workdir: Path) -> dict[str, Any]:
    """N training processes at once on a fresh daemon; their summaries and the aggregates."""
    procs: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    started = time.time()
    with DaemonProcess(workers=cfg.daemon_workers) as daemon:
        env = environ_without_asteria()
        env.update(OMP_NUM_THREADS="1", ASTERIA_ADDRESS=daemon.address)
        try:
            for index in range(num_clients):
                json_path = workdir / f"n{num_clients}-client{index}.json"
                log_path = workdir / f"n{num_clients}-client{index}.log"
                child_env = {**env, "ASTERIA_JOB": f"bench-sharing-n{num_clients}-c{index}"}
                with log_path.open("wb") as log:
                    proc = subprocess.Popen(
                        _train_command(cfg, json_path, seed=index),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=child_env,
                    )
                procs.append((proc, json_path, log_path))
            deadline = time.monotonic() + cfg.client_timeout_s
            for index, (proc, _, log_path) in enumerate(procs):
                try:
                    code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    raise SharingRunError(
                        f"training process {index} of N={num_clients} ran past "
                        f"{cfg.client_timeout_s:.0f} s:\n{_tail(log_path)}"
                    ) from None
                if code != 0:
                    raise SharingRunError(
                        f"training process {index} of N={num_clients} exited {code}:\n"
                        f"{_tail(log_path)}"
                    )
        finally:
            for proc, _, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    clients = []
    for index, (_, json_path, _) in enumerate(procs):
        doc = json.loads(json_path.read_text())
        summary = client_summary(doc, ended_unix_s=json_path.stat().st_mtime)
        clients.append(
            {"client": index, "job": f"bench-sharing-n{num_clients}-c{index}", **summary}
        )
    return aggregate(num_clients, clients, daemon.cpu_s, time.time() - started)


def aggregate(
    num_clients: int, clients: list[dict[str, Any]], daemon_cpu_s: float | None, wall_s: float
) -> dict[str, Any]:
    rates = [c["solves_per_s"] for c in clients]
    first_start = min(c["started_unix_s"] for c in clients)
    last_start = max(c["started_unix_s"] for c in clients)
    first_end = min(c["ended_unix_s"] for c in clients)
    last_end = max(c["ended_unix_s"] for c in clients)
    p50s = [c["latency_p50_s"] for c in clients if c["latency_p50_s"] is not None]
    p99s = [c["latency_p99_s"] for c in clients if c["latency_p99_s"] is not None]
    return {
        "num_clients": num_clients,
        "aggregate_solves_per_s": sum(rates),
        # Conservative: every result over the span from the first start to the last end.
        "aggregate_solves_per_s_span": sum(c["results"] for c in clients)
        / (last_end - first_start),
        "results": sum(c["results"] for c in clients),
        "fairness_jain": jain_index(rates),
        "latency_p50_median_s": _median(p50s),
        "latency_p99_max_s": max(p99s) if p99s else None,
        "steps_per_s_mean": sum(c["steps_per_s"] for c in clients) / num_clients,
        "barrier_waits": sum(c["barrier_waits"] for c in clients),
        "barrier_wait_s": sum(c["barrier_wait_s"] for c in clients),
        "local_fallbacks": sum(c["local_fallbacks"] for c in clients),
        # The time all N trained at once, over the longest run: 1 when they ran side by side.
        "overlap_fraction": max(0.0, first_end - last_start)
        / max(c["run_time_s"] for c in clients),
        "daemon_cpu_s": daemon_cpu_s,
        "wall_time_s": wall_s,
        "clients": clients,
    }


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def run_sharing(cfg: SharingConfig, *, quick: bool = False) -> dict[str, Any]:
    started = time.time()
    runs = []
    with tempfile.TemporaryDirectory(prefix="asteria-bench-sharing-") as tmp:
        for n in cfg.clients:
            print(
                f"sharing: N={n}: {n} {cfg.optimizer} training process(es), {cfg.steps} steps, "
                f"on one daemon with {cfg.daemon_workers} workers",
                file=sys.stderr,
                flush=True,
            )
            run = run_clients(cfg, n, Path(tmp))
            print(
                f"sharing: N={n}: {run['aggregate_solves_per_s']:.1f} solves/s, "
                f"fairness {run['fairness_jain']:.3f}, {run['wall_time_s']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            runs.append(run)
    return {
        "benchmark": "sharing",
        "quick": quick,
        "config": {**cfg.__dict__, "clients": list(cfg.clients)},
        "cpus": len(os.sched_getaffinity(0)),
        "started_unix_s": started,
        "wall_time_s": time.time() - started,
        "runs": runs,
    }


#: Columns of the report's table of runs (one row per number of clients N).
RUN_COLUMNS = (
    "N",
    "solves/s (sum)",
    "solves/s (span)",
    "Jain fairness",
    "latency p50",
    "latency p99 (worst)",
    "steps/s per client",
    "barrier waits",
    "fallbacks",
    "overlap",
    "daemon CPU s",
)
#: Columns of the report's table of clients (one row per client of each run).
CLIENT_COLUMNS = (
    "N",
    "client",
    "solves/s",
    "latency p50",
    "latency p99",
    "steps/s",
    "barrier waits (s)",
    "fallbacks",
)


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def _run_cells(run: dict[str, Any]) -> list[str]:
    """One N's row of the terminal table and the report's (which adds the daemon's CPU)."""
    return [
        str(run["num_clients"]),
        f"{run['aggregate_solves_per_s']:.1f}",
        f"{run['aggregate_solves_per_s_span']:.1f}",
        f"{run['fairness_jain']:.3f}",
        _fmt_ms(run["latency_p50_median_s"]),
        _fmt_ms(run["latency_p99_max_s"]),
        f"{run['steps_per_s_mean']:.2f}",
        str(run["barrier_waits"]),
        str(run["local_fallbacks"]),
        f"{run['overlap_fraction']:.0%}",
    ]


def format_report(report: dict[str, Any]) -> str:
    head = ["N", "solves/s", "span", "fairness", "p50", "p99 max", "steps/s", "waits"]
    head += ["fallbk", "overlap"]
    rows = [_run_cells(run) for run in report["runs"]]
    lines = text_table([head, *rows], align=">")
    lines.append(
        "solves/s: sum of each client's results / its run time; span: all results / first start "
        "to last end; p50: median of the clients' p50; steps/s: mean per client"
    )
    return "\n".join(lines)


def write_figures(report: dict[str, Any], json_path: Path) -> list[Path]:
    """Bars of aggregate solves/s per N, and of result latency p50/p99 per N."""
    runs = report["runs"]
    labels = [str(r["num_clients"]) for r in runs]
    xs = list(range(len(runs)))

    fig, ax = output.new_figure(6.0, 3.6)
    ax.bar(xs, [r["aggregate_solves_per_s"] for r in runs], color="tab:blue", label="aggregate")
    for x, run in zip(xs, runs, strict=True):
        bottom = 0.0
        for client in run["clients"]:  # each client's share, stacked as outlines
            ax.bar(x, client["solves_per_s"], bottom=bottom, fill=False, edgecolor="white")
            bottom += client["solves_per_s"]
    ax.set_xticks(xs, labels)
    ax.set_xlabel("training processes on one daemon (N)")
    ax.set_ylabel("solves delivered / s")
    ax.set_title("Aggregate solves/s (segments: each client's share)")
    throughput = output.save_figure(fig, output.figure_path(json_path, "throughput"))

    fig, ax = output.new_figure(6.0, 3.6)
    width = 0.38
    p50 = [r["latency_p50_median_s"] or 0.0 for r in runs]
    p99 = [r["latency_p99_max_s"] or 0.0 for r in runs]
    ax.bar([x - width / 2 for x in xs], [v * 1e3 for v in p50], width, label="p50 (median client)")
    ax.bar([x + width / 2 for x in xs], [v * 1e3 for v in p99], width, label="p99 (worst client)")
    for x, run in zip(xs, runs, strict=True):
        for client in run["clients"]:
            if client["latency_p50_s"] is not None:
                ax.plot(x - width / 2, client["latency_p50_s"] * 1e3, "k.", markersize=4)
            if client["latency_p99_s"] is not None:
                ax.plot(x + width / 2, client["latency_p99_s"] * 1e3, "k.", markersize=4)
    ax.set_xticks(xs, labels)
    ax.set_xlabel("training processes on one daemon (N)")
    ax.set_yscale("log")
    output.plain_log_ticks(ax)
    positive = [v * 1e3 for v in p50 + p99 if v > 0]
    if positive:  # bars on a log axis start where the axis does: start below the smallest
        ax.set_ylim(bottom=min(positive) / 3)
    ax.set_ylabel("submit → result (ms, log scale)")
    ax.set_title("Result latency per N (dots: each client)")
    ax.legend()
    latency = output.save_figure(fig, output.figure_path(json_path, "latency"))
    return [throughput, latency]


def report_section(data: dict[str, Any]) -> str:
    """Markdown: the per-N table, the figures, and the per-client rows."""
    cfg = data["config"]
    lines = [
        f"{cfg['optimizer']} training processes (`asteria train --mode daemon`, {cfg['steps']} "
        f"steps, precondition frequency {cfg['precondition_frequency']}, staleness budget "
        f"{cfg['staleness_budget']}) on one daemon with {cfg['daemon_workers']} solver workers, "
        f"{data.get('cpus', '?')} CPUs shared by everything (nothing pinned); subnormals "
        + {True: "flushed to zero", False: "kept", None: "(flush-denormal not recorded)"}[
            cfg.get("flush_denormal")
        ]
        + ".",
        "",
    ]
    runs = []
    for run in data["runs"]:
        cpu = run.get("daemon_cpu_s")
        runs.append([*_run_cells(run), "-" if cpu is None else f"{cpu:.1f}"])
    lines += markdown_table(RUN_COLUMNS, runs, align=">")
    lines += [
        "",
        "solves/s (sum): each client's results over its own run time, summed; (span): all "
        "results over the time from the first client's start to the last one's end. Overlap: "
        "the time all N trained at once over the longest run.",
        "",
    ]
    for figure in data.get("figures", []):
        lines.append(f"![{Path(figure).stem}]({figure})")
    clients = [
        [
            str(run["num_clients"]),
            str(c["client"]),
            f"{c['solves_per_s']:.1f}",
            _fmt_ms(c["latency_p50_s"]),
            _fmt_ms(c["latency_p99_s"]),
            f"{c['steps_per_s']:.2f}",
            f"{c['barrier_waits']} ({c['barrier_wait_s']:.2f})",
            str(c["local_fallbacks"]),
        ]
        for run in data["runs"]
        for c in run["clients"]
    ]
    lines += ["", *markdown_table(CLIENT_COLUMNS, clients, align=">")]
    return "\n".join(lines) + "\n"


def _client_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients {text!r}: use counts like 1,2,4") from None
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"--clients {text!r}: counts must be >= 1")
    return counts


def register(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "sharing",
        help="N training processes on one daemon: solves/s, latency, fairness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"N={','.join(map(str, QUICK_CLIENTS))}, {QUICK_STEPS} steps (under 2 minutes)",
    )
    parser.add_argument(
        "--clients",
        type=_client_counts,
        metavar="N,N,...",
        help="numbers of training processes to run at once "
        f"(default {','.join(map(str, DEFAULT_CLIENTS))})",
    )
    parser.add_argument(
        "--steps", type=int, help=f"training steps per process (default {DEFAULT_STEPS})"
    )
    parser.add_argument("--optimizer", choices=["soap", "shampoo", "kl-shampoo"], default="soap")
    parser.add_argument("--precondition-frequency", type=int, default=5, metavar="F")
    parser.add_argument("--staleness-budget", type=int, default=1, metavar="S")
    parser.add_argument(
        "--daemon-workers", type=int, default=2, help="solver processes of the daemon (default 2)"
    )
    output.add_flush_denormal_argument(parser, "the training processes")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the full report here")
    return run_command


def run_command(args: argparse.Namespace) -> int:
    default_clients = QUICK_CLIENTS if args.quick else DEFAULT_CLIENTS
    cfg = SharingConfig(
        clients=args.clients if args.clients is not None else default_clients,
        steps=args.steps
        if args.steps is not None
        else (QUICK_STEPS if args.quick else DEFAULT_STEPS),
        optimizer=args.optimizer,
        precondition_frequency=args.precondition_frequency,
        staleness_budget=args.staleness_budget,
        daemon_workers=args.daemon_workers,
        flush_denormal=args.flush_denormal,
    )
    report = run_sharing(cfg, quick=args.quick)
    output.publish(report, format_report(report), args.json, write_figures)
    return 0
