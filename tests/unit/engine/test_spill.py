"""Spilling results to disk happens outside the engine's lock: a slow or full disk holds up no
call, and a result used, replaced or forgotten while its file is written stays as it was."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from asteria_server.engine import EngineConfig, PreconditionerEngine, SolveKind
from asteria_server.engine.tiers import ResultTiers, SpillEnd, read_spill_file, write_spill_file
from asteria_server.types import DEFAULT_TENANT, SolveResult

from .test_engine import WAIT_S, root_task


def _result(block: str, version: int = 1, n: int = 8) -> SolveResult:
    return SolveResult(
        block=block,
        version=version,
        kind=SolveKind.INVERSE_ROOT,
        matrix=np.eye(n, dtype=np.float32),
        eigenvalues=None,
        permutation=None,
        base_version=-1,
        epsilon_used=0.0,
        solve_time_s=0.0,
        attempts=1,
        tenant="t",
    )


def _tiers(tmp_path: Path, budget: int) -> ResultTiers:
    return ResultTiers(budget_bytes=budget, spill_dir=tmp_path, incarnation="inc")


def test_a_spilled_result_counts_in_memory_until_written_then_on_disk(tmp_path: Path) -> None:
    a, b = _result("a"), _result("b")
    tiers = _tiers(tmp_path, budget=300)
    tiers.held(("t", "a"), a)
    tiers.held(("t", "b"), b)
    assert tiers.victims() == [("t", "a")]  # never the newest
    path = tiers.begin_spill(("t", "a"), a)
    assert tiers.victims() == [] and tiers.memory_bytes == 2 * 256 and tiers.host_bytes == 256
    size = write_spill_file(path, a)
    assert tiers.end_spill(("t", "a"), a, size) is SpillEnd.SPILLED
    assert tiers.memory_bytes == 256 and tiers.spill_bytes == size
    assert tiers.tier(("t", "a"), None) == "spill"
    keys, held = [("t", "a"), ("t", "b"), ("t", "c")], [None, b, None]
    assert tiers.tiers(keys, held) == ["spill", "host", ""]  # a status read's, many at once
    assert tiers.tiers(keys, held) == list(map(tiers.tier, keys, held))
    np.testing.assert_array_equal(read_spill_file(path).matrix, a.matrix)


@pytest.mark.parametrize("meanwhile", ["used", "replaced", "forgotten"])
def test_a_result_used_replaced_or_forgotten_while_written_is_not_spilled(
    tmp_path: Path, meanwhile: str
) -> None:
    a = _result("a")
    tiers = _tiers(tmp_path, budget=300)
    tiers.held(("t", "a"), a)
    tiers.held(("t", "b"), _result("b"))
    tiers.begin_spill(("t", "a"), a)
    if meanwhile == "used":
        tiers.touch(("t", "a"))
    elif meanwhile == "replaced":
        tiers.held(("t", "a"), _result("a", version=2))
    else:
        tiers.forget(("t", "a"))
    assert tiers.end_spill(("t", "a"), a, 999) is SpillEnd.KEPT
    assert tiers.spill_bytes == 0 and tiers.num_spilled == 0
    assert tiers.tracks(("t", "a")) is (meanwhile != "forgotten")
    assert tiers.memory_bytes == (256 if meanwhile == "forgotten" else 512)


def test_a_failed_write_drops_the_result(tmp_path: Path) -> None:
    a = _result("a")
    tiers = _tiers(tmp_path, budget=300)
    tiers.held(("t", "a"), a)
    tiers.held(("t", "b"), _result("b"))
    tiers.begin_spill(("t", "a"), a)
    assert tiers.end_spill(("t", "a"), a, None) is SpillEnd.DROPPED
    assert tiers.dropped == 1 and tiers.memory_bytes == 256 and tiers.num_spilled == 0


def test_a_spill_write_that_blocks_holds_up_no_engine_call(tmp_path: Path) -> None:
    """The spill file's temporary path is a FIFO nobody reads: the write blocks in open(), as
    on a disk that does not answer. Meanwhile the engine answers (the old code wrote under the
    engine's lock: wait_result hung); once the write fails (a FIFO cannot be truncated) the
    result is dropped."""
    spill = tmp_path / "spill"
    config = EngineConfig(
        num_workers=1,
        calibrate=False,
        seconds_per_n3=1e-10,
        cache_memory_bytes=1500,  # one n = 16 result (1 KiB) fits, not two
        spill_dir=str(spill),
    )
    with PreconditionerEngine(config) as engine:
        fifo = spill / f".asteria-spill-{engine.incarnation_id}-1.res.tmp"
        os.mkfifo(fifo)
        try:
            answered: list[object] = []

            def calls() -> None:
                for block in ("a", "b"):  # b's result pushes a out: its spill write blocks
                    engine.submit(root_task(block, 1, n=16))
                    assert engine.wait_result(block, 1, WAIT_S) is not None
                answered.extend([engine.stats(), engine.status()])  # (using a would keep it)

            call = threading.Thread(target=calls, daemon=True)
            call.start()
            call.join(WAIT_S)
            assert not call.is_alive(), "an engine call waited for the spill file's write"
            stats, _ = answered
        finally:
            with open(fifo, "rb") as reader:  # let the write go on (and fail at truncate)
                while reader.read(1 << 16):
                    pass
        engine.submit(root_task("c", 1, n=16))  # a later spill, to a real file
        assert engine.wait_result("c", 1, WAIT_S) is not None
    assert stats.cache_host_bytes >= 2 * 16 * 16 * 4  # both in memory while a was written


def test_nothing_keeps_a_spilled_result_in_memory(tmp_path: Path) -> None:
    """Once its file is written, a spilled result's arrays are gone from the daemon's memory
    (the spill thread kept the last one it wrote alive until the next: 16 MB at n = 2048)."""
    config = EngineConfig(
        num_workers=1,
        calibrate=False,
        seconds_per_n3=1e-10,
        cache_memory_bytes=1500,
        spill_dir=str(tmp_path / "spill"),
    )
    with PreconditionerEngine(config) as engine:
        engine.submit(root_task("a", 1, n=16))
        assert engine.wait_result("a", 1, WAIT_S) is not None
        held = engine.latest_result("a")
        assert held is not None
        gone = weakref.ref(held)
        del held
        engine.submit(root_task("b", 1, n=16))  # pushes a out, to its spill file
        assert engine.wait_result("b", 1, WAIT_S) is not None
        deadline = time.monotonic() + WAIT_S
        while engine.stats().results_spilled < 1:
            assert time.monotonic() < deadline, "a was never spilled"
            time.sleep(0.05)
        gc.collect()
        assert gone() is None
        back = engine.latest_result("a")  # read back from its file
        assert back is not None and back.version == 1


def test_results_waiting_for_a_stuck_disk_are_bounded_and_a_forgotten_one_goes_at_once(
    tmp_path: Path,
) -> None:
    """While the first spill write hangs (a FIFO nobody reads), results keep leaving the host
    tier: those waiting for the disk hold the queue's backlog at most, the rest are dropped
    (their clients resubmit), and a waiting one whose job is forgotten is freed at once (the
    queue names blocks, not results)."""
    spill = tmp_path / "spill"
    config = EngineConfig(
        num_workers=1,
        calibrate=False,
        seconds_per_n3=1e-10,
        cache_memory_bytes=1500,
        spill_dir=str(spill),
    )
    with PreconditionerEngine(config) as engine:
        engine._spill_backlog_bytes = 2048  # two n = 16 results (the default is 64 MiB)
        fifo = spill / f".asteria-spill-{engine.incarnation_id}-1.res.tmp"
        os.mkfifo(fifo)
        try:
            engine.submit(root_task("a", 1, n=16), job="keep")
            assert engine.wait_result("a", 1, WAIT_S) is not None
            engine.submit(root_task("b", 1, n=16), job="gone")
            assert engine.wait_result("b", 1, WAIT_S) is not None  # a's write hangs
            held = engine.latest_result("b")
            assert held is not None
            waiting = weakref.ref(held)
            del held
            for block in ("c", "d", "e", "f"):
                engine.submit(root_task(block, 1, n=16), job="keep")
                assert engine.wait_result(block, 1, WAIT_S) is not None
            stats = engine.stats()
            assert stats.results_dropped >= 2  # d's and e's turn found the backlog full
            assert stats.cache_host_bytes <= 1500 + 2048 + 1024
            assert engine.forget(DEFAULT_TENANT, "gone") == ["b"]
            gc.collect()
            assert waiting() is None  # b waited for the disk: freed with its job
        finally:
            with open(fifo, "rb") as reader:
                while reader.read(1 << 16):
                    pass
