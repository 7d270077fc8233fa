"""Registry + scheduler together: the runtime's version rules under arbitrary event sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asteria_server.engine.coordinator import Coordinator
from asteria_server.engine.registry import BlockState, CoherenceRegistry
from asteria_server.engine.scheduler import CostModel
from asteria_server.types import SolveKind, SolveResult, SolveTask, SubmitOutcome

MAX_FAILS = 2
TENANTS = ("A", "B")
BLOCKS = ("x", "y")
_EYE = np.eye(2, dtype=np.float32)


def make_task(tenant: str, block: str, version: int) -> SolveTask:
    return SolveTask(
        block=block, version=version, kind=SolveKind.INVERSE_ROOT, matrix=_EYE, tenant=tenant
    )


def make_result(task: SolveTask, *, finite: bool = True) -> SolveResult:
    matrix = _EYE.copy() if finite else np.full((2, 2), np.nan, np.float32)
    return SolveResult(
        block=task.block,
        version=task.version,
        kind=task.kind,
        matrix=matrix,
        eigenvalues=None,
        permutation=None,
        base_version=-1,
        epsilon_used=task.epsilon,
        solve_time_s=0.01,
        attempts=1,
        tenant=task.tenant,
    )


@dataclass
class Model:
    """What the rules say should be true of one block."""

    submitted: int = -1
    queued: int = -1
    running: int = -1
    computed: int = -1
    delivered: int = -1
    consecutive: int = 0
    failed: bool = False
    popped: list[int] = field(default_factory=list)


class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.coord = Coordinator(
            cost_model=CostModel(seconds_per_n3=1e-9), max_consecutive_failures=MAX_FAILS
        )
        self.models = {(t, b): Model() for t in TENANTS for b in BLOCKS}
        self.running: list[SolveTask] = []

    @rule(tenant=st.sampled_from(TENANTS), block=st.sampled_from(BLOCKS), v=st.integers(0, 12))
    def submit(self, tenant: str, block: str, v: int) -> None:
        m = self.models[(tenant, block)]
        outcome = self.coord.submit(make_task(tenant, block, v))
        if v < m.submitted:
            assert outcome is SubmitOutcome.STALE_IGNORED
        elif v == m.submitted:
            assert outcome is SubmitOutcome.DUPLICATE
        elif m.queued >= 0:
            assert outcome is SubmitOutcome.SUPERSEDED_QUEUED
        else:
            assert outcome is SubmitOutcome.QUEUED
        if outcome.accepted:
            m.submitted = m.queued = v

    @rule()
    def dispatch(self) -> None:
        entry = self.coord.next_task()
        if entry is None:
            # nothing eligible: every queued block has its previous version running
            assert all(m.queued < 0 or m.running >= 0 for m in self.models.values())
            return
        task = entry.task
        m = self.models[task.key]
        assert task.version == m.queued and m.running < 0
        assert not m.popped or task.version > m.popped[-1]  # versions only go forward
        m.popped.append(task.version)
        m.queued, m.running = -1, task.version
        self.running.append(task)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), how=st.sampled_from(["ok", "fail", "nan"]))
    def finish(self, data: st.DataObject, how: str) -> None:
        task = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        m = self.models[task.key]
        m.running = -1
        if how == "ok":
            accepted = self.coord.complete(task, make_result(task))
            assert accepted == (task.version > m.computed)
            m.computed = max(m.computed, task.version)
            m.consecutive, m.failed = 0, False
            return
        if how == "fail":
            self.coord.fail(task, "solver said no")
        else:
            assert not self.coord.complete(task, make_result(task, finite=False))
        m.consecutive += 1
        m.failed = m.failed or m.consecutive >= MAX_FAILS

    @rule(tenant=st.sampled_from(TENANTS), block=st.sampled_from(BLOCKS))
    def take(self, tenant: str, block: str) -> None:
        m = self.models[(tenant, block)]
        result = self.coord.take(tenant, block)
        if m.computed > m.delivered:
            assert result is not None and result.version == m.computed
            assert result.is_finite() and result.key == (tenant, block)
            m.delivered = m.computed
        else:
            assert result is None

    @invariant()
    def registry_matches_model(self) -> None:
        reg = self.coord.registry
        positions = self.coord.scheduler.positions()
        statuses = {(s.tenant, s.block): s for s in self.coord.status()}
        for (tenant, block), m in self.models.items():
            assert reg.submitted_version(tenant, block) == m.submitted
            assert reg.computed_version(tenant, block) == m.computed
            assert reg.delivered_version(tenant, block) == m.delivered <= m.computed
            assert self.coord.scheduler.pending_version(tenant, block) == (
                m.queued if m.queued >= 0 else None
            )
            expected_in_flight = m.queued if m.queued >= 0 else m.running
            assert self.coord.in_flight_version(tenant, block) == (
                expected_in_flight if expected_in_flight >= 0 else None
            )
            if m.submitted < 0:
                continue
            s = statuses[(tenant, block)]
            assert s.version == m.computed and s.consecutive_failures == m.consecutive
            assert s.staleness_steps == m.submitted - m.computed
            assert (s.queue_position is not None) == (m.queued >= 0)
            if s.queue_position is not None:
                assert positions[(tenant, block)] == s.queue_position
            if m.failed:
                assert s.state is BlockState.FAILED
            elif m.running >= 0:
                assert s.state is BlockState.RUNNING
            elif m.queued >= 0:
                assert s.state is BlockState.QUEUED
            else:
                assert s.state is BlockState.IDLE
            latest = reg.latest_result(tenant, block)
            assert (latest is None) == (m.computed < 0)
            assert latest is None or (latest.version == m.computed and latest.is_finite())


TestCoordinatorRules = CoordinatorMachine.TestCase
TestCoordinatorRules.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, database=None
)


def test_status_dict_keys_and_definitions() -> None:
    clock = [100.0]
    coord = Coordinator(max_consecutive_failures=3, clock=lambda: clock[0])
    task = make_task("local", "w.L", 4)
    coord.submit(task)
    (status,) = coord.status()
    d = status.to_dict()
    for key in (
        "block",
        "tenant",
        "version",
        "submitted_version",
        "in_flight_version",
        "delivered_version",
        "staleness_steps",
        "age_s",
        "last_solve_s",
        "failures",
        "consecutive_failures",
        "state",
        "last_error",
        "queue_position",
    ):
        assert key in d
    assert d["version"] == -1 and d["staleness_steps"] == 5  # never computed: submitted + 1
    assert d["state"] == "queued" and d["queue_position"] == 0 and d["age_s"] is None
    entry = coord.next_task()
    assert entry is not None and coord.status()[0].state is BlockState.RUNNING
    clock[0] = 101.0
    coord.complete(entry.task, make_result(entry.task))
    clock[0] = 103.5
    (status,) = coord.status()
    assert status.version == 4 and status.staleness_steps == 0 and status.age_s == 2.5
    assert status.last_solve_s == 0.01 and status.queue_position is None


def test_failed_block_keeps_last_good_result_and_recovers() -> None:
    coord = Coordinator(max_consecutive_failures=2)
    for version, how in [(1, "ok"), (2, "nan"), (3, "fail"), (4, "fail"), (5, "ok")]:
        coord.submit(make_task("t", "b", version))
        entry = coord.next_task()
        assert entry is not None
        if how == "ok":
            coord.complete(entry.task, make_result(entry.task))
        elif how == "nan":
            coord.complete(entry.task, make_result(entry.task, finite=False))
        else:
            coord.fail(entry.task, f"boom {version}")
        (status,) = coord.status("t")
        if version == 1:
            assert coord.take("t", "b") is not None
        if version in (2, 3, 4):
            assert coord.take("t", "b") is None  # nothing new, garbage never delivered
            assert coord.registry.latest_result("t", "b").version == 1  # type: ignore[union-attr]
        if version == 3:
            assert status.state is BlockState.FAILED and status.consecutive_failures == 2
        if version == 4:
            assert status.state is BlockState.FAILED and status.last_error == "boom 4"
        if version == 5:
            assert status.state is BlockState.IDLE and status.failures == 3
            assert status.consecutive_failures == 0
            result = coord.take("t", "b")
            assert result is not None and result.version == 5
    assert coord.solves_done == 2 and coord.solves_failed == 3


def test_a_snapshot_overwritten_before_it_was_read_counts_as_superseded() -> None:
    # Every submitted version is solved, failed or counted as replaced by a newer one: one a
    # client overwrote in its segment before the worker read it is replaced too, as is one
    # whose timed-out run finds a newer snapshot waiting.
    coord = Coordinator()
    coord.submit(make_task("t", "b", 1))
    entry = coord.next_task()
    assert entry is not None
    coord.overwritten(entry.task)
    (status,) = coord.status("t")
    assert status.superseded == 1 and status.state is BlockState.IDLE and status.failures == 0
    coord.submit(make_task("t", "b", 2))
    entry = coord.next_task()
    assert entry is not None
    coord.submit(make_task("t", "b", 3))  # waits behind the running version 2
    assert not coord.requeue(entry.task)  # 2 timed out: 3 is newer, 2 is dropped
    (status,) = coord.status("t")
    assert status.superseded == 2 and status.queued_version == 3 and status.failures == 0


def test_mismatched_result_is_a_failure() -> None:
    coord = Coordinator()
    coord.submit(make_task("t", "b", 1))
    entry = coord.next_task()
    assert entry is not None
    wrong = make_result(make_task("t", "b", 2))
    assert not coord.complete(entry.task, wrong)
    assert coord.status()[0].failures == 1


def test_registry_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="max_consecutive_failures"):
        CoherenceRegistry(max_consecutive_failures=0)


@settings(max_examples=100, deadline=None, database=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["submit", "result", "take"]), st.integers(0, 10)), max_size=50
    )
)
def test_registry_versions_never_go_backwards(events: list[tuple[str, int]]) -> None:
    """Results may arrive in any order (e.g. from peer daemons); the registry keeps the newest."""
    reg = CoherenceRegistry()
    submitted = computed = delivered = -1
    for what, v in events:
        if what == "submit":
            outcome = reg.on_submit("t", "b", v)
            assert outcome.accepted == (v > submitted)
            submitted = max(submitted, v)
        elif what == "result":
            accepted = reg.on_result(make_result(make_task("t", "b", v)))
            assert accepted == (v > computed)
            computed = max(computed, v)
        else:
            result = reg.take("t", "b")
            assert (result is not None) == (computed > delivered)
            if result is not None:
                assert result.version == computed
                delivered = computed
        assert reg.submitted_version("t", "b") == submitted
        assert reg.computed_version("t", "b") == computed
        assert reg.delivered_version("t", "b") == delivered
