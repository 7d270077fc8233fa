"""The solver processes' allocator settings (``asteria_server.malloc``), in fresh interpreters.

With them, the arrays a solve frees stay on the heap for the next solve (no page faults and
zeroing again); :func:`~asteria_server.malloc.trim`, which an idle worker calls, hands them back.
Without them, glibc gives a freed array of this size back at once. Skipped off glibc.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the settings are glibc's mallopt"
)

_SCRIPT = """
import os, sys
import numpy as np
from asteria_server.malloc import trim, tune_solver_allocator

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

if sys.argv[1] == "tuned":
    assert tune_solver_allocator()
base = rss_mib()
for _ in range(3):  # a solve's worth of 8 MiB arrays (n = 1024, float64), written and freed
    arrays = [np.ones((1024, 1024)) for _ in range(6)]
    del arrays
kept = rss_mib() - base
trim()
print(kept, rss_mib() - base)
"""


def _run(mode: str) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    return float(out[0]), float(out[1])


def test_tuned_process_keeps_freed_arrays_until_trimmed() -> None:
    kept, after_trim = _run("tuned")
    assert kept > 30.0, f"only {kept:.1f} MiB of the freed 48 MiB stayed on the heap"
    assert after_trim < kept - 30.0, f"trim left {after_trim:.1f} of {kept:.1f} MiB"


def test_untuned_process_gives_freed_arrays_back_at_once() -> None:
    """The default the worker setting changes (so the test above is not vacuous)."""
    kept, _ = _run("default")
    assert kept < 20.0, f"{kept:.1f} MiB stayed without the solver settings"
