"""What every ``asteria bench`` writes: one JSON document per run, PNG figures next to it.

The JSON document is a dict with at least these keys, which ``asteria bench report`` relies on:

- ``benchmark``: the benchmark's name (``spikes``, ``transport``, ...);
- ``command``: the command line that produced it, to reproduce it;
- ``quick``: whether it was a ``--quick`` run;
- ``machine``: :func:`machine_info` of the machine it ran on;
- ``figures``: paths of the PNG figures, relative to the JSON file's folder;
- ``config``: the benchmark's settings, among them ``flush_denormal``: whether its torch
  processes (the benchmark's own, and the training processes it starts) flushed subnormal floats
  to zero (on unless ``--no-flush-denormal``; see :mod:`asteria_client.train.cpu`);
- whatever results the benchmark has (its own keys).

Figures are written with matplotlib's non-interactive Agg backend, so no display is needed.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

#: Packages whose versions a report lists.
_PACKAGES = ("torch", "numpy", "scipy", "grpcio", "protobuf", "asteria")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def _blas() -> list[dict[str, Any]]:
    """The BLAS/LAPACK libraries loaded in this process (after NumPy and SciPy are imported)."""
    import numpy  # noqa: F401  (load the libraries threadpoolctl inspects)
    import scipy.linalg  # noqa: F401
    from threadpoolctl import threadpool_info

    keys = ("internal_api", "version", "architecture", "threading_layer", "num_threads")
    return [
        {k: info.get(k) for k in keys}
        for info in threadpool_info()
        if info.get("user_api") == "blas"
    ]


def machine_info() -> dict[str, Any]:
    """The machine, library versions, BLAS kernel in use and the date, for a report."""
    versions: dict[str, str | None] = {}
    for package in _PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "packages": versions,
        "blas": _blas(),
    }


def command_line() -> str:
    """This process's command line as a user would type it (``asteria bench ...``)."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("asteria", "__main__.py"):
        argv[0] = "asteria"
    return shlex.join(argv)


def figure_path(json_path: Path, suffix: str) -> Path:
    """Where a figure of the run written to ``json_path`` goes: ``<stem>-<suffix>.png``."""
    return json_path.with_name(f"{json_path.stem}-{suffix}.png")


def add_flush_denormal_argument(parser: Any, scope: str) -> None:
    """``--no-flush-denormal`` (``args.flush_denormal``, True unless given); ``scope`` says
    which processes it reaches, for the help."""
    parser.add_argument(
        "--no-flush-denormal",
        dest="flush_denormal",
        action="store_false",
        help=f"keep subnormal floats instead of flushing them to zero in {scope} (the default "
        "flushes them: arithmetic on them is many times slower on a CPU)",
    )


def new_figure(width: float = 7.0, height: float = 4.0) -> Any:
    """A matplotlib figure and axes on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height), layout="constrained")


def save_figure(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(path: Path, report: dict[str, Any], figures: list[Path]) -> None:
    """Write ``report`` as JSON to ``path``, with the common keys filled in (module docstring)."""
    report.setdefault("command", command_line())
    report.setdefault("machine", machine_info())
    report["figures"] = [os.path.relpath(f, path.parent) for f in figures]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")


def plain_log_ticks(ax: Any) -> None:
    """Label a log y-axis at 1, 2, 5 x 10^k in plain numbers."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def publish(
    report: dict[str, Any],
    text: str,
    json_path: Path | None,
    figures: Callable[[dict[str, Any], Path], list[Path]],
) -> None:
    """The end of every benchmark: print its table; with ``--json``, draw its figures beside the
    JSON file and write the report (:func:`write_report`)."""
    print(text)
    if json_path is None:
        return
    paths = figures(report, json_path)
    write_report(json_path, report, paths)
    print(f"wrote {json_path} and {len(paths)} figure(s)")
