"""The solver worker process: map the pool's segments, solve, write the result back.

:func:`worker_main` is the entry point the pool starts with ``spawn``/``forkserver``. Messages on
its pipe are small dicts (see ``WorkerPool._send``); the factor and the result travel through the
memfd segments the pool owns, whose fds follow a message marked ``"fds"`` (this side maps them,
see :mod:`asteria_server.engine.shm`). The layout of the output segment is fixed: the float32 n×n
matrix, then float32 eigenvalues, then the int64 permutation, then the float32 n×n rotation.

Replies: ``("ready", pid)`` once at start, then per task ``("done", job, meta)`` or
``("error", job, message)``. A worker exits when told (``None``) or when its parent's end of the
pipe closes, so it never outlives the engine by more than one solve.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from asteria_server.engine import faults
from asteria_server.engine.shm import (
    MappedSegment,
    eigenvalues_offset,
    permutation_offset,
    receive_segment_fds,
    release_segment,
    rotation_offset,
    segment_view,
)
from asteria_server.engine.solvers import EighSolver, SolverConfig
from asteria_server.errors import SolverError
from asteria_server.types import SolveKind, SolveTask


def _map_handed(conn: Connection, msg: dict[str, Any], cache: dict[str, MappedSegment]) -> None:
    """Map the segments whose fds follow ``msg`` (a new worker, or segments replaced)."""
    if not msg.get("fds"):
        return
    fds = receive_segment_fds(conn, 2)
    for role, fd in zip(("in", "out"), fds, strict=True):
        old = cache.pop(role, None)
        if old is not None:
            release_segment(old)
        cache[role] = MappedSegment(msg[role], fd)


def _run_job(
    msg: dict[str, Any], solver: EighSolver, cache: dict[str, MappedSegment]
) -> tuple[Any, ...]:
    fault = faults.Fault(msg["fault"]) if msg["fault"] else None
    faults.inject_before_solve(fault)
    n = msg["n"]
    inp, out = cache["in"], cache["out"]
    if (inp.name, out.name) != (msg["in"], msg["out"]):
        raise RuntimeError(f"segments {msg['in']}, {msg['out']} were never handed over")
    matrix = segment_view(inp, (n, n), msg["matrix_dtype"])
    basis = None
    if msg["basis_dtype"] is not None:
        basis = segment_view(inp, (n, n), msg["basis_dtype"], offset=matrix.nbytes)
    task = SolveTask(
        block=msg["block"],
        version=msg["version"],
        kind=SolveKind(msg["kind"]),
        matrix=matrix,
        exponent=msg["exponent"],
        epsilon=msg["epsilon"],
        basis=basis,
        base_version=msg["base_version"],
        tenant=msg["tenant"],
    )
    try:
        result = solver.solve(task)
    except SolverError as exc:
        return ("error", msg["job"], str(exc))
    out_matrix = segment_view(out, (n, n), np.float32)
    out_matrix[...] = result.matrix
    out_eigs = segment_view(out, (n,), np.float32, offset=eigenvalues_offset(n))
    if result.eigenvalues is not None:
        out_eigs[...] = result.eigenvalues
    if result.permutation is not None:
        segment_view(out, (n,), np.int64, offset=permutation_offset(n))[...] = result.permutation
    if result.rotation is not None:
        segment_view(out, (n, n), np.float32, offset=rotation_offset(n))[...] = result.rotation
    faults.corrupt_output(fault, out_matrix, out_eigs)
    meta = {
        "epsilon_used": result.epsilon_used,
        "solve_time_s": result.solve_time_s,
        "attempts": result.attempts,
        "has_eigenvalues": result.eigenvalues is not None,
        "has_permutation": result.permutation is not None,
        "has_rotation": result.rotation is not None,
    }
    return ("done", msg["job"], meta)


def worker_main(conn: Connection, blas_threads: int, solver_config: SolverConfig) -> None:
    """Entry point of a worker process: answer solve messages until told to stop or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threadpool_limits(limits=blas_threads, user_api="blas")
    solver = EighSolver(dataclasses.replace(solver_config, blas_threads=None))
    cache: dict[str, MappedSegment] = {}
    try:
        conn.send(("ready", os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            if msg is None:
                break
            try:
                _map_handed(conn, msg, cache)
            except (EOFError, OSError):
                break  # the parent is gone mid-handover
            try:
                reply = _run_job(msg, solver, cache)
            except Exception as exc:  # report, stay alive: one bad task must not kill the worker
                reply = ("error", msg.get("job"), f"worker error: {type(exc).__name__}: {exc}")
            try:
                conn.send(reply)
            except (BrokenPipeError, OSError):
                break
    finally:
        for shm in cache.values():
            release_segment(shm)
        conn.close()


def _main_from_fd(fd: int) -> None:
    """``python -m asteria_server.engine.worker_process FD``: the subprocess start method."""
    conn = Connection(fd)
    try:
        blas_threads, solver_config = conn.recv()
    except (EOFError, OSError):
        return
    worker_main(conn, blas_threads, solver_config)


if __name__ == "__main__":
    _main_from_fd(int(sys.argv[1]))
