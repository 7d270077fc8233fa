"""The solver worker process: read a snapshot from a segment, solve, write the result to one.

:func:`worker_main` is the entry point the pool starts. Messages on its pipe are small dicts (see
``WorkerPool._send``). Every array travels through shared-memory segments of the one layout of
:mod:`asteria_server.protocol.shm`: the pool's own, or, on the daemon's same-host path, the
client's snapshot and result segments themselves. Their descriptors follow a message that lists
them under ``"map"``; ``"release"`` names segments to unmap.

The worker does not trust a segment. ``map_segment`` maps only a sealed memfd of the announced
size with a segment header; views never reach past the mapping; the snapshot is read once, under
the seqlock, by the solver's input check, which checks it finite and symmetric and makes its
float64 working copy on the way (``EighSolver.checked_input``; an error on a torn read counts as
overwritten, not as bad input); the solver rejects an indefinite factor; its last pass, the
conversion of the n x n results to float32, writes them straight into the result segment under
its seqlock (:class:`_ResultTarget`), and they are checked finite before the write is
announced; a write that does not finish is closed under a sequence nobody announces. Whatever
goes wrong is a per-task ``error`` reply.

Replies: ``("ready", pid)`` once at start, then per task ``("done", job, meta)`` (``meta`` holds
the result's fields and the sequence its write ended with), ``("overwritten", job)`` (a newer
snapshot replaced this one before it was read) or ``("error", job, message)``. A worker exits when
told (``None``) or when its parent's end of the pipe closes, so it never outlives the engine by
more than one solve.
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
from asteria_server.engine.shm import receive_segment_fds
from asteria_server.engine.solvers import CheckedInput, EighSolver, SolverConfig
from asteria_server.errors import InvalidInputError, SolverError
from asteria_server.malloc import trim, tune_solver_allocator
from asteria_server.protocol.shm import (
    RESULT_FIELDS,
    ArraySpec,
    Segment,
    map_segment,
    result_arrays,
    result_field_spec,
)
from asteria_server.types import ACCEPTED_DTYPES, SolveKind, SolveResult, SolveTask

#: A worker idle this long hands the heap its solves kept back to the system
#: (:mod:`asteria_server.malloc`): as long as the daemon's own reclaim interval, so a worker
#: between two optimizer steps' bursts of solves keeps it (faulting it in again for every burst
#: cost about 0.3 ms per solve at n=512), and an idle one gives it back.
IDLE_TRIM_S = 30.0


def _map_handed(conn: Connection, msg: dict[str, Any], cache: dict[int, Segment]) -> None:
    """Unmap the segments ``msg`` releases; map those whose fds follow it."""
    for token in msg["release"]:
        old = cache.pop(token, None)
        if old is not None:
            old.close()
    entries = msg["map"]
    fds = receive_segment_fds(conn, len(entries))
    for (token, size), fd in zip(entries, fds, strict=True):
        try:
            cache[token] = map_segment(fd, size, arena=None)  # checks seals, size and header
        except Exception:
            cache.pop(token, None)  # the task that needs it reports the error
        finally:
            os.close(fd)


def _segment(cache: dict[int, Segment], where: tuple[int, int, int]) -> Segment:
    """The segment ``where`` names: a whole mapping, or a slot of a mapped arena."""
    token, index, size = where
    segment = cache.get(token)
    if segment is None:
        raise SolverError("its shared-memory segment could not be mapped (not a sealed segment)")
    if index < 0:
        if segment.is_arena:
            raise SolverError("its shared-memory segment is an arena, but no slot was named")
        return segment
    try:
        return segment.slot(index, size)
    except InvalidInputError as exc:
        raise SolverError(str(exc)) from None


def _snapshot_specs(msg: dict[str, Any]) -> list[ArraySpec]:
    n = msg["n"]
    specs = [ArraySpec(np.dtype(dtype), tuple(shape)) for dtype, shape in msg["snapshot"][2]]
    if not 1 <= len(specs) <= 2 or any(
        s.dtype not in ACCEPTED_DTYPES or s.shape != (n, n) for s in specs
    ):
        raise SolverError(f"the snapshot must be one or two float {n}x{n} matrices")
    return specs


class _ResultTarget:
    """The client's result segment as the solver's output: the solver converts its n x n
    float32 results straight into the segment's views (no separate copy into shared memory),
    under the segment's seqlock, begun at the first such write.

    Readers never see a partial or failed result: while the write is open the sequence is odd,
    and a write that does not finish (the solve failed) is closed under a sequence nobody
    announces, so a reader holding the old one rejects what it would copy (the block's
    previous result there is gone; its client copied it out when it was announced)."""

    def __init__(self, segment: Segment, task: SolveTask) -> None:
        self._segment = segment
        names = [RESULT_FIELDS[0]]
        if task.kind is SolveKind.EIGENBASIS:
            names = list(RESULT_FIELDS) if task.basis is not None else list(RESULT_FIELDS[:2])
        self._names = names
        self._specs = [result_field_spec(name, task.n) for name in names]
        try:
            self._views = dict(zip(names, segment.views(self._specs), strict=True))
        except InvalidInputError as exc:
            raise SolverError(str(exc)) from None
        self._open = False

    def array(self, name: str) -> np.ndarray:
        """The view of result field ``name``, the write begun."""
        if not self._open:
            self._segment.begin_write()
            self._open = True
        return self._views[name]

    def finish(self, result: SolveResult) -> int:
        """Copy the fields the solver did not write in place (the small ones) and end the
        write; returns the sequence that announces it."""
        present = [name for name in RESULT_FIELDS if getattr(result, name) is not None]
        if present != self._names:
            raise SolverError(f"the solver returned {present}, expected {self._names}")
        for name, spec in zip(self._names, self._specs, strict=True):
            array = getattr(result, name)
            view = self.array(name)
            if array is not view:
                if array.dtype != spec.dtype or array.shape != spec.shape:
                    raise SolverError(f"result field {name} is {array.dtype}{array.shape}")
                np.copyto(view, array, casting="no")
        self._open = False
        return self._segment.end_write()

    def abandon(self) -> None:
        """End a write that did not finish (see the class docstring)."""
        if self._open:
            self._open = False
            self._segment.end_write()


def _basis_from(msg: dict[str, Any], cache: dict[int, Segment]) -> tuple[np.ndarray | None, int]:
    """The basis a refresh names in a client's result segment (``basis_from``: the block's
    previous result there), copied, and the base version; (None, -1) where that result was
    overwritten since: the task becomes a full eigendecomposition. Read before the new result
    is written, which may go to the same segment."""
    if msg.get("basis_from") is None:
        return None, msg["base_version"]
    where, sequence, (dtype, shape) = msg["basis_from"]
    copies = _segment(cache, where).read([ArraySpec(np.dtype(dtype), tuple(shape))], sequence)
    if copies is None:
        return None, -1
    return copies[0], msg["base_version"]


def _run_job(msg: dict[str, Any], solver: EighSolver, cache: dict[int, Segment]) -> tuple[Any, ...]:
    fault = faults.Fault(msg["fault"]) if msg["fault"] else None
    faults.inject_before_solve(fault)
    job = msg["job"]
    try:
        where, sequence, _ = msg["snapshot"]
        specs = _snapshot_specs(msg)
        segment = _segment(cache, where)
        basis, base_version = _basis_from(msg, cache)

        def read(views: list[np.ndarray]) -> tuple[SolveTask, CheckedInput]:
            # The task names the segment's views; the solver reads them once, here, into its
            # float64 working copies (checked and symmetrized on the way), and not after.
            task = SolveTask(
                block=msg["block"],
                version=msg["version"],
                kind=SolveKind(msg["kind"]),
                matrix=views[0],
                exponent=msg["exponent"],
                epsilon=msg["epsilon"],
                basis=views[1] if len(views) > 1 else basis,
                base_version=base_version,
                tenant=msg["tenant"],
            )
            return task, solver.checked_input(task)

        read_back = segment.read_with(specs, sequence, read)
        if read_back is None:
            return ("overwritten", job)
        task, checked = read_back
        target = _ResultTarget(_segment(cache, msg["result"]), task)
        try:
            result = solver.solve(task, outputs=target.array, checked=checked)
            out = result_arrays(result)
            faults.corrupt_output(fault, *[a for a in out if a.dtype.kind == "f"])
            if not all(bool(np.isfinite(a).all()) for a in out):
                raise SolverError("result holds NaN or Inf")
            faults.poison_output(fault, *[a for a in out if a.dtype.kind == "f"])
            written = target.finish(result)
        finally:
            target.abandon()
    except SolverError as exc:
        return ("error", job, str(exc))
    meta = {
        "epsilon_used": result.epsilon_used,
        "solve_time_s": result.solve_time_s,
        "attempts": result.attempts,
        "fields": [
            name
            for name in ("matrix", "eigenvalues", "permutation", "rotation")
            if getattr(result, name) is not None
        ],
        "sequence": written,
        "base_version": task.base_version,
    }
    return ("done", job, meta)


def worker_main(conn: Connection, blas_threads: int, solver_config: SolverConfig) -> None:
    """Entry point of a worker process: answer solve messages until told to stop or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    tune_solver_allocator()  # a solve's arrays stay on the heap for the next one
    threadpool_limits(limits=blas_threads, user_api="blas")
    solver = EighSolver(dataclasses.replace(solver_config, blas_threads=None))
    cache: dict[int, Segment] = {}
    try:
        conn.send(("ready", os.getpid()))
        trimmed = True
        while True:
            try:
                if not trimmed and not conn.poll(IDLE_TRIM_S):
                    trim()  # idle: what the last solves kept goes back to the system
                trimmed = True
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            if msg is None:
                break
            try:
                _map_handed(conn, msg, cache)
            except (EOFError, OSError):
                break  # the parent is gone mid-handover
            trimmed = False
            try:
                reply = _run_job(msg, solver, cache)
            except Exception as exc:  # report, stay alive: one bad task must not kill the worker
                reply = ("error", msg.get("job"), f"worker error: {type(exc).__name__}: {exc}")
            try:
                conn.send(reply)
            except (BrokenPipeError, OSError):
                break
    finally:
        for segment in cache.values():
            segment.close()
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
