"""`asteria bench report`: one Markdown page from every benchmark JSON in a results folder.

Reads each ``*.json`` in ``--results`` (default ``runs/bench``) that is a benchmark report (the
contract in :mod:`asteria_client.bench.output`), and writes ``--out`` (default
``docs/benchmarks.md``): the machine, library versions and BLAS kernel the runs used, the date, the
command that reproduces each section, then one section per report in a fixed order (convergence,
schedules, peers, defaults, spikes, step, transport, throughput, sharing, soak, then any other).
Each section's body comes from its benchmark module's ``report_section(data)``; before calling it,
the report copies the run's figures into ``figures/`` next to the page and rewrites
``data["figures"]`` to links relative to the page, so a section links ``data["figures"]`` as
given. A figure the section does not link is appended after it. A benchmark whose module or
``report_section`` does not exist (yet) gets a note
instead of a body.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from asteria_client.tables import markdown_table

logger = logging.getLogger(__name__)

#: Sections in this order; other benchmarks follow in name order.
SECTION_ORDER = (
    "convergence",
    "schedules",
    "peers",
    "defaults",
    "spikes",
    "step",
    "transport",
    "throughput",
    "sharing",
    "scale",
    "blocks",
    "soak",
)
TITLES = {
    "convergence": "Convergence: validation loss against steps and wall-clock time",
    "peers": "Peers: Asteria against HeavyBall, Emerging-Optimizers and distributed_shampoo",
    "defaults": "Defaults: SOAP's and KL-Shampoo's β1 × precondition frequency",
    "schedules": "Refresh schedules: every step, every f steps, and continuous, per model shape",
    "spikes": "Step-time spikes: AdamW vs native, embedded and daemon second-order",
    "step": "Step: host time and dispatched operations of one optimizer.step()",
    "transport": "Transport: moving snapshots and results",
    "throughput": "Throughput: daemon solves/s against a bare LAPACK loop",
    "sharing": "Sharing: N training processes on one daemon",
    "scale": "Scale: one job on K simulated nodes, daemons synced",
    "blocks": "Blocks: bookkeeping cost per block from 100 to 20,000 blocks",
    "soak": "Soak: clients, kills and a misbehaving tenant on one daemon",
}
DEFAULT_RESULTS = Path("runs/bench")
DEFAULT_OUT = Path("docs/benchmarks.md")
FIGURES_DIR = "figures"
_MODULE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_NOT_BENCHMARKS = frozenset({"report", "output", "daemon", "stats", "affinity", "soak_actors"})


def load_results(results_dir: Path) -> tuple[list[tuple[Path, dict[str, Any]]], list[str]]:
    """The benchmark reports in ``results_dir`` (sorted by file name), and notes on skipped
    files (not JSON, or without a ``benchmark`` key)."""
    docs: list[tuple[Path, dict[str, Any]]] = []
    notes: list[str] = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            notes.append(f"`{path.name}`: skipped, not readable JSON ({exc})")
            continue
        if not isinstance(data, dict) or not isinstance(data.get("benchmark"), str):
            notes.append(f'`{path.name}`: skipped, no "benchmark" key')
            continue
        docs.append((path, data))
    return docs, notes


def section_rank(name: str) -> tuple[int, str]:
    return (SECTION_ORDER.index(name), "") if name in SECTION_ORDER else (len(SECTION_ORDER), name)


def _section_function(name: str) -> tuple[Any, str]:
    """``report_section`` of benchmark ``name``'s module, or None and why not."""
    if not _MODULE_NAME.match(name) or name in _NOT_BENCHMARKS:
        return None, f"`{name}` is not a benchmark of `asteria bench`"
    module_name = f"asteria_client.bench.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        return None, f"no module `{module_name}` in this version of Asteria"
    function = getattr(module, "report_section", None)
    if not callable(function):
        return None, f"`{module_name}` has no `report_section` yet"
    return function, ""


def _copy_figures(path: Path, data: dict[str, Any], out: Path) -> tuple[list[str], list[str]]:
    """Copy the run's figures into ``figures/`` beside ``out``: their links, and notes."""
    links, notes = [], []
    target_dir = out.parent / FIGURES_DIR
    for figure in data.get("figures", []) or []:
        source = (path.parent / figure).resolve()
        if not source.is_file():
            notes.append(f"figure `{figure}` of `{path.name}` is missing")
            continue
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / source.name
        if source != target.resolve():
            shutil.copyfile(source, target)
        links.append(Path(os.path.relpath(target, out.parent)).as_posix())
    return links, notes


def _fmt(value: Any, unit: str = "") -> str:
    return "?" if value is None else f"{value}{unit}"


def _machine_lines(docs: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    machines: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for path, data in docs:
        machine = data.get("machine") or {}
        key = json.dumps(
            {k: machine.get(k) for k in ("cpu", "cpus", "memory_gib", "platform", "packages")},
            sort_keys=True,
            default=str,
        )
        machines.setdefault(key, (machine, []))[1].append(path.name)
    lines = []
    for machine, files in machines.values():
        if len(machines) > 1:
            lines.append(f"Runs {', '.join(f'`{f}`' for f in files)}:")
            lines.append("")
        lines += [
            f"- CPU: {_fmt(machine.get('cpu', machine.get('processor')))}, "
            f"{_fmt(machine.get('cpus'))} cores, {_fmt(machine.get('memory_gib'), ' GiB')} memory",
            f"- Platform: {_fmt(machine.get('platform'))}, Python {_fmt(machine.get('python'))}",
        ]
        packages = machine.get("packages") or {}
        if packages:
            versions = ", ".join(
                f"{name} {version or 'absent'}" for name, version in packages.items()
            )
            lines.append(f"- Libraries: {versions}")
        for blas in machine.get("blas") or []:
            lines.append(
                f"- BLAS: {_fmt(blas.get('internal_api'))} {_fmt(blas.get('version'))} "
                f"(kernel {_fmt(blas.get('architecture'))}, threading "
                f"{_fmt(blas.get('threading_layer'))}, {_fmt(blas.get('num_threads'))} threads)"
            )
        lines.append("")
    return lines


def render(results_dir: Path, out: Path, *, now: datetime.datetime | None = None) -> str:
    """The page for the reports in ``results_dir``; copies their figures beside ``out``."""
    docs, notes = load_results(results_dir)
    if not docs:
        raise ValueError(f"--results {results_dir}: no benchmark JSON (*.json) in it")
    docs.sort(key=lambda item: (section_rank(item[1]["benchmark"]), item[0].name))
    now = now or datetime.datetime.now(datetime.UTC)
    lines = [
        "# Asteria benchmarks",
        "",
        f"Generated {now.isoformat(timespec='seconds')} by `asteria bench report --results "
        f"{results_dir.as_posix()} --out {out.as_posix()}` from {len(docs)} result file(s). "
        "Every figure compares runs taken side by side on one machine; compare ratios, not "
        "absolute times, across machines.",
        "",
        "## Machine",
        "",
        *_machine_lines(docs),
        "## Reproduce",
        "",
    ]
    reproduce = []
    for path, data in docs:
        date = str((data.get("machine") or {}).get("date", "?"))
        quick = " (quick)" if data.get("quick") else ""
        command = str(data.get("command", "?"))
        reproduce.append([f"{data['benchmark']}{quick}", f"`{path.name}`", date, f"`{command}`"])
    lines += markdown_table(["section", "result file", "run at", "command"], reproduce)
    lines.append("")
    for path, data in docs:
        name = data["benchmark"]
        lines += [f"## {TITLES.get(name, name)}", ""]
        quick = "a quick run, " if data.get("quick") else ""
        lines += [f"_From `{path.name}` ({quick}command above)._", ""]
        links, figure_notes = _copy_figures(path, data, out)
        function, why = _section_function(name)
        body = ""
        if function is None:
            lines += [f"> Not rendered: {why}.", ""]
        else:
            try:
                body = function({**data, "figures": links})
            except Exception as exc:  # one run of another layout must not cost the page
                logger.warning("the %s section of %s failed: %r", name, path.name, exc)
                lines += [
                    f"> Not rendered: `{path.name}` does not have the layout "
                    f"`report_section` expects ({type(exc).__name__}: {exc}).",
                    "",
                ]
            else:
                lines += [body.rstrip("\n"), ""]
        for link in links:
            if link not in body:
                lines += [f"![{Path(link).stem}]({link})", ""]
        lines += [f"> {note}." for note in figure_notes]
        if figure_notes:
            lines.append("")
    if notes:
        lines += ["## Skipped files", "", *[f"- {note}" for note in notes], ""]
    return "\n".join(lines)


def register(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "report",
        help="write docs/benchmarks.md from the benchmarks' JSON results",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=DEFAULT_RESULTS,
        metavar="DIR",
        help=f"folder of benchmark JSON files (default {DEFAULT_RESULTS})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="PATH",
        help=f"Markdown file to write; figures go to figures/ beside it (default {DEFAULT_OUT})",
    )
    return run_command


def run_command(args: argparse.Namespace) -> int:
    if not args.results.is_dir():
        raise ValueError(f"--results {args.results} is not a folder")
    text = render(args.results, args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
