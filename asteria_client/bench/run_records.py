"""Finished training runs of `asteria bench convergence`, kept on disk so that a long benchmark
survives its own interruption and can be assembled from parts.

The full schedules comparison (three shapes, three seeds, eight configurations, 600 steps) is
hours of training on a 2-core host, in one process that kept everything in memory until its
end: a lost terminal or a killed job lost every run. With ``--runs-dir DIR`` each run's record
is written to ``DIR`` the moment it finishes (a file per shape, configuration, seed and lr,
written to a temporary name and renamed, so a file there is always whole), and a later
invocation with the same directory takes the runs it finds there instead of training them
again. Rows that do not depend on the host's timing (native and AdamW runs are synchronous:
their steps to target are the same on a busy host) can so be run at another time than the
timed rows and the report made once from all of them.

A record is reused only when it was made with the same settings (steps, evaluation, threads,
engine workers, device, subnormal flushing) and finished (a continuous row's overhead budget,
when one is given, is part of its name: the other rows stand for every budget); otherwise
that run trains again and its file is replaced. The code is not compared: whoever changes the
code between two invocations decides whether the old runs still stand (each record carries the
``code`` it ran, when the package lies in a git checkout, and the report says how many runs
were reused).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: ConvergenceConfig fields a run's outcome depends on: a record is reused only where they match.
SETTINGS = (
    "steps",
    "eval_interval",
    "eval_batches",
    "threads",
    "engine_workers",
    "device",
    "flush_denormal",
)


class RunRecords:
    """The directory of finished runs (see the module doc). ``settings`` come from the
    benchmark's config; a record made under others is not reused."""

    def __init__(self, directory: Path, settings: dict[str, Any]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.settings = dict(settings)
        self.code = _code_version()
        self.reused = 0

    def path(self, shape: str | None, config: str, seed: int, lr: float | None) -> Path:
        rate = "" if lr is None else f"-lr{lr:g}"
        return self.directory / f"{shape or 'train'}-{config}-seed{seed}{rate}.json"

    def load(
        self, shape: str | None, config: str, seed: int, lr: float | None
    ) -> dict[str, Any] | None:
        """The finished record of this run made under the same settings, or None (absent,
        failed, made under other settings, or unreadable: that run trains again)."""
        path = self.path(shape, config, seed, lr)
        try:
            stored = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("run record %s is unreadable (%s): training that run again", path, exc)
            return None
        if not isinstance(stored, dict) or stored.get("settings") != self.settings:
            logger.info("run record %s was made with other settings: training it again", path)
            return None
        record = stored.get("record")
        if not isinstance(record, dict) or not record.get("ok"):
            return None
        self.reused += 1
        return {**record, "reused_from": str(path)}

    def save(
        self, shape: str | None, config: str, seed: int, lr: float | None, record: dict[str, Any]
    ) -> None:
        """Write ``record`` whole (a temporary file renamed over the old one). A failure to
        write is logged, not raised: the run's result is still in the report."""
        path = self.path(shape, config, seed, lr)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        document = {"settings": self.settings, "code": self.code, "record": record}
        try:
            tmp.write_text(json.dumps(document))
            tmp.replace(path)
        except OSError as exc:
            logger.warning("could not keep the run record %s: %s", path, exc)
            tmp.unlink(missing_ok=True)


def _code_version() -> str | None:
    """The git commit of the checkout this package runs from (with ``-dirty`` when tracked
    files changed), or None outside a checkout."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head
