"""Starting a solver worker process, by default as a fresh interpreter (``python -m``).

Why not ``multiprocessing`` spawn/forkserver by default: both re-import the parent's ``__main__``
in every worker, so a training script without an ``if __name__ == "__main__":`` guard would start
training again inside each solver worker (and then fail). Users swap an optimizer into scripts
they already have; the engine must not impose that idiom. A ``python -m
asteria_server.engine.worker_process`` child imports only Asteria's solver modules.

The child's end of a socket pair is passed as an inherited file descriptor and wrapped in a
:class:`multiprocessing.connection.Connection`, so the message protocol is the same for every
start method. The parent watches the child through a pidfd, which ``connection.wait`` can poll
next to the pipes, exactly like a ``multiprocessing.Process.sentinel``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection as mpc
import os
import socket
import subprocess
import sys
from typing import Any, Protocol

from asteria_server.engine.solvers import SolverConfig

logger = logging.getLogger(__name__)

#: how workers can be started; "subprocess" is the default (see the module docstring).
START_METHODS = ("subprocess", "spawn", "forkserver")


class WorkerHandle(Protocol):
    """What the pool needs of a worker process (a subset of ``multiprocessing.Process``)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


class SubprocessWorker:
    """A ``subprocess.Popen`` child with the ``multiprocessing.Process`` surface the pool uses."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self._pidfd = os.pidfd_open(popen.pid)

    @property
    def pid(self) -> int | None:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    @property
    def sentinel(self) -> int:
        return self._pidfd

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=timeout)

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


def _lower_priority(pid: int | None, niceness: int) -> None:
    """Make a worker yield to the training process when the cores are oversubscribed."""
    if pid is None or niceness <= 0:
        return
    with contextlib.suppress(OSError):  # not permitted somewhere: run at normal priority
        os.setpriority(os.PRIO_PROCESS, pid, niceness)


def _pin(pid: int | None, cpus: tuple[int, ...] | None) -> None:
    """Restrict a worker to ``cpus`` (e.g. the cores a pinned trainer leaves free).

    Set from the parent right after the start, while the child is still importing: the solving
    (main) thread, and any thread the child starts later, inherit the mask.
    """
    if pid is None or cpus is None:
        return
    try:
        os.sched_setaffinity(pid, cpus)
    except OSError as exc:  # a CPU went offline, or the cpuset shrank since the config
        logger.warning("could not pin solver worker %d to CPUs %s: %s", pid, list(cpus), exc)


def start_worker(
    method: str,
    blas_threads: int,
    solver: SolverConfig,
    name: str,
    niceness: int = 0,
    cpu_affinity: tuple[int, ...] | None = None,
) -> tuple[Any, mpc.Connection]:
    """Start one worker; returns its handle and the parent's end of its pipe.

    ``niceness`` > 0 lowers the worker's CPU priority: on a host whose cores are all busy, the
    scheduler then runs the training step first and the solve in what is left. ``cpu_affinity``
    (None: the parent's CPUs) confines the worker to those CPUs.
    """
    if method == "subprocess":
        parent_sock, child_sock = socket.socketpair()
        try:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "asteria_server.engine.worker_process",
                    str(child_sock.fileno()),
                ],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "ASTERIA_WORKER_NAME": name},
            )
        finally:
            child_sock.close()
        conn = mpc.Connection(parent_sock.detach())
        _lower_priority(popen.pid, niceness)
        _pin(popen.pid, cpu_affinity)
        conn.send((blas_threads, solver))  # the worker's configuration, before any task
        return SubprocessWorker(popen), conn

    from asteria_server.engine.worker_process import worker_main

    ctx = multiprocessing.get_context(method)
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    process = ctx.Process(  # type: ignore[attr-defined]
        target=worker_main, args=(child_conn, blas_threads, solver), name=name, daemon=True
    )
    process.start()
    child_conn.close()
    _lower_priority(process.pid, niceness)
    _pin(process.pid, cpu_affinity)
    return process, parent_conn
