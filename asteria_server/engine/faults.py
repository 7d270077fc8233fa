"""TEST-ONLY fault injection for the worker pool. Off unless a prefix is configured.

Fault tests must inject *real* faults (a worker killed by a signal, a solve that never returns,
a worker that sends back NaN) into real worker processes. The pool enables this only when its
config sets ``test_fault_prefix`` (default None, i.e. never in production). Then a task whose
block name is ``<prefix><fault>[-once][:anything]`` makes the worker misbehave:

- ``crash``: the worker SIGKILLs itself before solving;
- ``exit``:  the worker calls ``os._exit(3)`` before solving;
- ``hang``:  the worker sleeps "forever" instead of solving (the pool's timeout must kill it);
- ``nan``:   the worker solves, then overwrites its output with NaN and reports success (the
  parent's result check must catch it);
- ``error``: the worker raises an unexpected exception;
- ``slow``:  the worker sleeps ``SLOW_S`` before solving (a solve that takes a while: a daemon
  draining at shutdown has work to finish);
- ``poison``: the worker solves, checks, then writes NaN over its output (a faulty or hostile
  daemon, as its clients see it): a result written into a client's segment then reaches the
  client, whose own check must drop it.

With ``-once`` the fault fires on the task's first worker run only, so a retry can succeed.
"""

from __future__ import annotations

import enum
import os
import signal
import time

import numpy as np


class Fault(enum.Enum):
    """A misbehaviour a worker can be told to show (tests only)."""

    CRASH = "crash"
    EXIT = "exit"
    HANG = "hang"
    NAN = "nan"
    ERROR = "error"
    POISON = "poison"
    SLOW = "slow"


#: Seconds the ``slow`` fault adds to a solve.
SLOW_S = 1.0


def fault_for(block: str, prefix: str | None, attempt: int) -> Fault | None:
    """The fault to inject into worker run ``attempt`` (1-based) of ``block``, if any."""
    if not prefix or not block.startswith(prefix):
        return None
    spec = block[len(prefix) :].split(":", 1)[0]
    once = spec.endswith("-once")
    if once:
        spec = spec[: -len("-once")]
    try:
        fault = Fault(spec)
    except ValueError:
        return None
    if once and attempt > 1:
        return None
    return fault


def inject_before_solve(fault: Fault | None) -> None:
    """Misbehave in the worker before the solve (crash, exit, hang, error)."""
    if fault is Fault.CRASH:
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault is Fault.EXIT:
        os._exit(3)
    elif fault is Fault.HANG:
        time.sleep(3600.0)
    elif fault is Fault.ERROR:
        raise RuntimeError("injected worker error (test-only fault)")
    elif fault is Fault.SLOW:
        time.sleep(SLOW_S)


def corrupt_output(fault: Fault | None, *arrays: np.ndarray) -> None:
    """Overwrite the worker's output with NaN (the ``nan`` fault)."""
    if fault is Fault.NAN:
        for array in arrays:
            array[...] = np.nan


def poison_output(fault: Fault | None, *arrays: np.ndarray) -> None:
    """Overwrite the worker's checked output with NaN (the ``poison`` fault)."""
    if fault is Fault.POISON:
        for array in arrays:
            array[...] = np.nan
