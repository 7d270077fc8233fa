"""The registry's record of a version another daemon solves (the sync between node daemons)."""

import numpy as np

from asteria_server.engine.coordinator import Coordinator
from asteria_server.engine.registry import CoherenceRegistry
from asteria_server.types import SolveKind, SolveResult, SolveTask, SubmitOutcome


def test_a_version_solved_elsewhere_counts_as_submitted_and_may_fall_back_once() -> None:
    registry = CoherenceRegistry()
    registry.on_elsewhere("t", "b", 4, "job")
    assert registry.submitted_version("t", "b") == 4
    assert registry.in_flight_version("t", "b") is None  # nothing queued here
    assert registry.blocks_of_job("t", "job") == ["b"]  # forget(job) finds it
    assert registry.on_submit("t", "b", 4) is SubmitOutcome.QUEUED  # the local fallback
    assert registry.on_submit("t", "b", 4) is SubmitOutcome.DUPLICATE  # only once
    assert registry.on_submit("t", "b", 2) is SubmitOutcome.STALE_IGNORED
    registry.on_elsewhere("t", "b", 3)  # older than what was submitted: no change
    assert registry.submitted_version("t", "b") == 4


def _task(version: int) -> SolveTask:
    a = np.eye(4, dtype=np.float32) * (1 + version)
    return SolveTask(block="b", version=version, kind=SolveKind.EIGENBASIS, matrix=a, tenant="t")


def test_a_withdrawn_version_leaves_the_queue_and_may_be_solved_here_once_after_all() -> None:
    """A claim granted to another daemon (or a peer's result that came first) takes the queued
    snapshot out; should its winner never push it, it can still be submitted here once."""
    coord = Coordinator()
    assert coord.submit(_task(3), "job") is SubmitOutcome.QUEUED
    assert coord.withdraw("t", "b", 2) is None  # only versions up to the one claimed
    task = coord.withdraw("t", "b", 3)
    assert task is not None and task.version == 3
    assert coord.queue_depth() == 0 and coord.in_flight_version("t", "b") is None
    assert coord.held_bytes_of("t") == 0
    assert coord.withdraw("t", "b", 3) is None  # nothing queued any more
    assert coord.submit(_task(3), "job") is SubmitOutcome.QUEUED  # solved here after all
    assert coord.submit(_task(3), "job") is SubmitOutcome.DUPLICATE  # once
    entry = coord.next_task()
    assert entry is not None and coord.withdraw("t", "b", 3) is None  # running: not withdrawn


def _result(version: int) -> SolveResult:
    return SolveResult(
        block="b",
        version=version,
        kind=SolveKind.EIGENBASIS,
        matrix=np.eye(4, dtype=np.float32),
        eigenvalues=np.ones(4, dtype=np.float32),
        permutation=None,
        base_version=-1,
        epsilon_used=0.0,
        solve_time_s=0.0,
        attempts=1,
        tenant="t",
    )


def test_discarded_versions_are_kept_per_block() -> None:
    """A solve whose result is not newer than the block's (a peer's push of that version, or of
    a later one, came while it ran) is thrown away; its version is kept, so that the sync can
    show a version solved twice, not only count it."""
    coord = Coordinator()
    for version, pushed in ((5, 5), (7, 9)):
        coord.submit(_task(version), "job")
        entry = coord.next_task()
        assert entry is not None
        assert coord.registry.on_result(_result(pushed))  # the peer's result is installed
        assert not coord.complete(entry.task, _result(version))
    assert list(coord.discarded_versions[("t", "b")]) == [5, 7]
    assert coord.results_discarded == 2 and coord.solves_done == 2
    coord.forget("t", "b")
    assert ("t", "b") not in coord.discarded_versions
