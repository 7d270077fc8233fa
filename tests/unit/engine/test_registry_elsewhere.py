"""The registry's record of a version another daemon solves (the sync between node daemons)."""

from asteria_server.engine.registry import CoherenceRegistry
from asteria_server.types import SubmitOutcome


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
