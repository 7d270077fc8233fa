"""CPU pinning for benchmarks: the trainer on its own cores, the solvers on the others.

On a small host the embedded engine's solver workers (and a daemon's) compete with the trainer for
the same cores, so a step-time comparison measures the scheduler as much as the engine. Pinning
separates them: the trainer runs on the first CPUs it may use, every solver on the rest.

Linux keeps an affinity mask per *thread*: ``os.sched_setaffinity(0, ...)`` changes only the
calling thread, a new thread copies its creator's mask, and a forked child copies the mask of the
thread that forked it. Hence :func:`pinned` sets every thread of this process, and the daemon
launcher (``asteria_client.daemon_process``, ``cpu_affinity=``) confines only the calling thread,
for the moment it starts the daemon (which keeps the mask; its workers then inherit it in turn).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on, in order."""
    return tuple(sorted(os.sched_getaffinity(0)))


def split_cpus(trainer_threads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(trainer CPUs, solver CPUs): the first ``trainer_threads`` usable CPUs, and the rest.

    ValueError when no CPU would be left for the solvers.
    """
    cpus = usable_cpus()
    if len(cpus) <= trainer_threads:
        raise ValueError(
            f"pinning needs more usable CPUs than trainer threads ({trainer_threads}), this "
            f"process may use {list(cpus)}: pass --no-pin-solver, or fewer --threads"
        )
    return cpus[:trainer_threads], cpus[trainer_threads:]


def _thread_ids() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def _set_all_threads(cpus: Sequence[int]) -> None:
    for tid in _thread_ids():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def pinned(cpus: Sequence[int]) -> Iterator[None]:
    """Every thread of this process (and those started in the body) on ``cpus``; the calling
    thread's previous mask for all of them afterwards."""
    before = os.sched_getaffinity(0)
    _set_all_threads(cpus)
    try:
        yield
    finally:
        _set_all_threads(sorted(before))


def asteria_children_cpus() -> list[list[int]]:
    """The CPU masks of this process's Asteria children (solver workers, daemons), to record
    that pinning took effect; helpers such as multiprocessing's resource tracker are left out."""
    me = str(os.getpid())
    masks = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses.
            ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            if ppid != me or b"asteria_server" not in (entry / "cmdline").read_bytes():
                continue
            masks.append(sorted(os.sched_getaffinity(int(entry.name))))
        except (OSError, IndexError):  # it exited meanwhile
            continue
    return sorted(masks)
