"""The worker pool lets go of a segment grown for one big block once its task is done, so one
big snapshot does not pin its size in shared memory (and the daemon's RSS) for the daemon's life;
segments of the usual sizes stay and are reused."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from asteria_server.engine import SolveKind, SolveTask
from asteria_server.engine.shm import input_bytes
from asteria_server.engine.workers import KEEP_SEGMENT_BYTES, PoolConfig, WorkerPool
from tests.unit.engine.test_engine import WAIT_S, own_segments


def _task(version: int, n: int) -> SolveTask:
    a = np.random.default_rng(version).standard_normal((n, n))
    return SolveTask(
        block="p", version=version, kind=SolveKind.INVERSE_ROOT, matrix=a @ a.T / n + np.eye(n)
    )


def test_a_segment_grown_past_the_keep_size_is_released_after_its_task() -> None:
    big_n = 1300
    assert input_bytes(big_n) > KEEP_SEGMENT_BYTES >= input_bytes(64)
    pool = WorkerPool(PoolConfig(num_workers=1, solve_timeout_s=120.0))
    try:

        def run(job_id: int, task: SolveTask) -> Any:
            pool.submit(job_id, task)
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                events = pool.poll(0.5)
                if events:
                    return events[0]
            raise AssertionError("no result from the worker pool")

        assert run(1, _task(1, 64)).result is not None
        small = set(pool.segment_names())
        assert len(small) == 2  # input and output
        big = run(2, _task(2, big_n))
        assert big.result is not None and big.result.matrix.shape == (big_n, big_n)
        kept = set(pool.segment_names())
        assert len(kept) < 2  # the big input segment went with its task
        assert all(name in own_segments() for name in kept)
        assert run(3, _task(3, 64)).result is not None  # a segment is made again as needed
        assert len(pool.segment_names()) == 2
    finally:
        pool.close()
