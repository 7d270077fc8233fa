"""Scheduler: dedupe, latest wins, EDF within a tenant, fairness by CPU-seconds across tenants."""

from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria_server.engine.scheduler import CostModel, Scheduler
from asteria_server.types import SolveKind, SolveTask, SubmitOutcome

COST = CostModel(seconds_per_n3=2.0**-30, refresh_ratio=0.5)  # exact binary sums
_EYES: dict[int, np.ndarray] = {}


def make(
    block: str,
    version: int,
    *,
    n: int = 4,
    deadline: float = math.inf,
    tenant: str = "local",
    refresh: bool = False,
) -> SolveTask:
    eye = _EYES.setdefault(n, np.eye(n, dtype=np.float32))
    return SolveTask(
        block=block,
        version=version,
        kind=SolveKind.EIGENBASIS if refresh else SolveKind.INVERSE_ROOT,
        matrix=eye,
        basis=eye if refresh else None,
        deadline=deadline,
        tenant=tenant,
    )


def drain(s: Scheduler) -> list[tuple[str, str, int]]:
    out = []
    while (entry := s.pop()) is not None:
        out.append((entry.task.tenant, entry.task.block, entry.task.version))
        s.finish(entry.task.tenant, entry.task.block)
    return out


def test_outcomes_dedupe_and_latest_wins() -> None:
    s = Scheduler(COST)
    assert s.push(make("a", 5)) is SubmitOutcome.QUEUED
    assert s.push(make("a", 5)) is SubmitOutcome.DUPLICATE
    assert s.push(make("a", 4)) is SubmitOutcome.STALE_IGNORED
    assert s.push(make("a", 9)) is SubmitOutcome.SUPERSEDED_QUEUED
    assert s.pending_version("local", "a") == 9 and len(s) == 1
    entry = s.pop()
    assert entry is not None and entry.task.version == 9
    assert s.is_running("local", "a")
    # after the pop, older or equal versions stay rejected: no version regression
    assert s.push(make("a", 9)) is SubmitOutcome.DUPLICATE
    assert s.push(make("a", 8)) is SubmitOutcome.STALE_IGNORED
    assert s.push(make("a", 10)) is SubmitOutcome.QUEUED
    assert s.latest_version("local", "a") == 10
    # same block name in another tenant is another block
    assert s.push(make("a", 1, tenant="other")) is SubmitOutcome.QUEUED


def test_a_running_block_is_not_popped_again_until_finished() -> None:
    s = Scheduler(COST)
    s.push(make("a", 1))
    first = s.pop()
    assert first is not None
    s.push(make("a", 2))
    s.push(make("b", 1))
    second = s.pop()
    assert second is not None and second.task.block == "b"
    assert s.pop() is None  # a@2 waits for a@1
    s.finish("local", "a")
    third = s.pop()
    assert third is not None and (third.task.block, third.task.version) == ("a", 2)


def test_earliest_deadline_first_then_cost_then_fifo() -> None:
    s = Scheduler(COST)
    s.push(make("late", 1, deadline=50))
    s.push(make("never", 1))
    s.push(make("big", 1, deadline=10, n=32))
    s.push(make("urgent", 1, deadline=5))
    s.push(make("small", 1, deadline=10, n=8))
    s.push(make("small2", 1, deadline=10, n=8))
    s.push(make("refresh", 1, deadline=10, n=32, refresh=True))  # cheaper than a full n=32
    assert [b for _, b, _ in drain(s)] == [
        "urgent",
        "small",
        "small2",
        "refresh",
        "big",
        "late",
        "never",
    ]


def test_superseding_task_takes_the_new_deadline() -> None:
    s = Scheduler(COST)
    s.push(make("a", 1, deadline=100))
    s.push(make("b", 1, deadline=50))
    s.push(make("a", 2, deadline=10))
    assert [(b, v) for _, b, v in drain(s)] == [("a", 2), ("b", 1)]


def test_equal_tenants_alternate() -> None:
    s = Scheduler(COST)
    for i in range(4):
        s.push(make(f"x{i}", 1, tenant="A", deadline=i))
        s.push(make(f"y{i}", 1, tenant="B", deadline=i))
    tenants = [t for t, _, _ in drain(s)]
    assert tenants == ["A", "B"] * 4


def test_fairness_is_by_cost_not_by_count() -> None:
    s = Scheduler(COST)
    for i in range(4):
        s.push(make(f"big{i}", 1, tenant="A", n=16))  # cost 8x of n=8
    for i in range(40):
        s.push(make(f"small{i}", 1, tenant="B", n=8))
    order = [t for t, _, _ in drain(s)]
    # A's first big task goes first (FIFO tie at zero), then B catches up with 8 small ones
    assert order[:10] == ["A"] + ["B"] * 8 + ["A"]
    assert order[10:18] == ["B"] * 8


def test_returning_tenant_does_not_bank_idle_time() -> None:
    s = Scheduler(COST)
    for i in range(10):
        s.push(make(f"a{i}", 1, tenant="A"))
    for _ in range(6):
        entry = s.pop()
        assert entry is not None
        s.finish("A", entry.task.block)
    for i in range(4):
        s.push(make(f"b{i}", 1, tenant="B"))
    # B starts at A's counter instead of 0, so it does not get 6 solves in a row
    assert [t for t, _, _ in drain(s)] == ["A", "B"] * 4


def test_measured_time_corrects_the_estimate() -> None:
    s = Scheduler(COST)
    s.push(make("a", 1, tenant="A"))
    entry = s.pop()
    assert entry is not None
    assert s.consumed_s("A") == pytest.approx(entry.cost_s)
    s.finish("A", "a", actual_s=2.5)
    assert s.consumed_s("A") == pytest.approx(2.5)


def test_cost_model() -> None:
    c = CostModel(seconds_per_n3=2e-10, refresh_ratio=0.25)
    assert c.estimate_s(100) == pytest.approx(2e-4)
    assert c.estimate_s(200) == pytest.approx(8 * c.estimate_s(100))
    assert c.estimate_s(100, refresh=True) == pytest.approx(0.25 * c.estimate_s(100))
    calibrated = CostModel.calibrate(n=32, repeats=1)
    assert 0 < calibrated.seconds_per_n3 < 1.0 and 0 < calibrated.refresh_ratio <= 2.0
    with pytest.raises(ValueError, match="seconds_per_n3"):
        CostModel(seconds_per_n3=0.0)
    with pytest.raises(ValueError, match="refresh_ratio"):
        CostModel(refresh_ratio=math.inf)


ops = st.lists(
    st.tuples(
        st.sampled_from(["A", "B", "C"]),
        st.sampled_from(["x", "y", "z"]),
        st.integers(0, 8),
        st.sampled_from([4, 8, 12]),
        st.one_of(st.just(math.inf), st.integers(0, 20).map(float)),
    ),
    max_size=40,
)


@settings(max_examples=80, deadline=None, database=None)
@given(ops)
def test_order_predicts_pops_and_backlogged_tenants_stay_within_one_task(
    items: list[tuple[str, str, int, int, float]],
) -> None:
    s = Scheduler(COST)
    for tenant, block, version, n, deadline in items:
        s.push(make(block, version, tenant=tenant, n=n, deadline=deadline))
    predicted = s.order()
    assert s.positions() == {k: i for i, k in enumerate(predicted)}
    popped = []
    max_cost = COST.estimate_s(12)
    while (entry := s.pop()) is not None:
        popped.append(entry.task.key)
        s.finish(*entry.task.key)
        pending = {queued.task.tenant for queued in s}
        if len(pending) >= 2:  # every tenant still backlogged is within one task of the others
            counters = [s.consumed_s(t) for t in pending]
            assert max(counters) - min(counters) <= max_cost + 1e-12
    assert popped == predicted
    assert len(popped) == len(set(popped))  # one task per block: latest wins


def _reference_pop(s: Scheduler) -> tuple[str, str] | None:
    """The rule the heaps implement, read off the queues the slow way: per tenant the
    smallest priority among blocks not running, the tenant by (consumed, candidate's seq)."""
    best: tuple[tuple[float, int], tuple[str, str]] | None = None
    tenants = {entry.task.tenant for entry in s}
    for tenant in tenants:
        eligible = [
            e for e in s if e.task.tenant == tenant and not s.is_running(tenant, e.task.block)
        ]
        if eligible:
            head = min(eligible, key=lambda e: e.priority)
            rank = (s.consumed_s(tenant), head.seq)
            if best is None or rank < best[0]:
                best = (rank, head.task.key)
    return None if best is None else best[1]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["push", "push", "push", "pop", "pop", "finish", "forget", "requeue"]),
            st.sampled_from(["t1", "t2"]),
            st.sampled_from(["a", "b", "c", "d", "e"]),
            st.sampled_from([0.0, 1.0, 2.0, math.inf]),
            st.sampled_from([4, 8]),
        ),
        max_size=120,
    )
)
def test_pop_follows_the_rules_through_replacements_forgets_and_requeues(
    ops: list[tuple[str, str, str, float, int]],
) -> None:
    """Every pop is the task the rules name (checked against a scan of all queued tasks), while
    blocks are replaced, forgotten, popped, finished and queued again in any order."""
    s = Scheduler(COST)
    versions: dict[tuple[str, str], int] = {}
    running: list[SolveTask] = []
    for op, tenant, block, deadline, n in ops:
        key = (tenant, block)
        if op == "push":
            versions[key] = versions.get(key, 0) + 1
            s.push(make(block, versions[key], n=n, deadline=deadline, tenant=tenant))
        elif op == "pop":
            expected = _reference_pop(s)
            entry = s.pop()
            assert (None if entry is None else entry.task.key) == expected
            if entry is not None:
                running.append(entry.task)
        elif op == "finish" and running:
            task = running.pop(0)
            s.finish(task.tenant, task.block, 0.5)
        elif op == "forget":
            s.forget(tenant, block)
        elif op == "requeue" and running:
            task = running.pop()
            s.requeue(task)
    while (expected := _reference_pop(s)) is not None:
        entry = s.pop()
        assert entry is not None and entry.task.key == expected
        s.finish(entry.task.tenant, entry.task.block)
    assert s.pop() is None


def test_a_replaced_or_forgotten_snapshot_is_not_kept_alive() -> None:
    """The daemon counts a replaced snapshot's bytes as freed: nothing of the scheduler (its
    priority heaps included) may still hold the arrays."""
    s = Scheduler(COST)
    s.push(make("other", 1, deadline=0.0))  # keeps the tenant's queue (and heap) alive
    gone = []
    for version in (1, 2):
        matrix = np.eye(64, dtype=np.float32)
        gone.append(weakref.ref(matrix))
        task = SolveTask(block="big", version=version, kind=SolveKind.INVERSE_ROOT, matrix=matrix)
        s.push(task)
        del matrix, task
    gc.collect()
    assert gone[0]() is None  # replaced by version 2
    assert gone[1]() is not None  # queued
    s.forget("local", "big")
    gc.collect()
    assert gone[1]() is None
    assert [key for *key, _ in drain(s)] == [["local", "other"]]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_no_tenant_takes_the_last_worker_while_another_is_active() -> None:
    """Rule 5: solves are not preempted, so a tenant's burst of big solves must not hold every
    worker while another tenant is active (the soak's well-behaved p99 waited for them)."""
    clock = _Clock()
    s = Scheduler(COST, clock=clock)
    for i in range(4):
        s.push(make(f"big{i}", 1, tenant="bad", n=64))
    s.push(make("small", 1, tenant="good"))
    first = s.pop(workers=2)
    assert first is not None and first.task.tenant == "bad"  # FIFO tie at zero consumed
    assert s.free_workers_for("bad", 2) == 0 and s.free_workers_for("good", 2) == 1
    second = s.pop(workers=2)
    assert second is not None and second.task.tenant == "good"
    # good's solve ends; it has nothing queued but submitted just now: bad still gets 1 worker
    s.finish("good", "small")
    assert s.pop(workers=2) is None
    # without a pool size (or with one worker) nothing is held back
    third = s.pop()
    assert third is not None and third.task.tenant == "bad"
    s.finish("bad", third.task.block)
    # once good has been quiet for the share window, bad may take both workers
    clock.now += s.share_window_s
    fourth = s.pop(workers=2)
    assert fourth is not None and fourth.task.tenant == "bad"
    assert s.num_running() == 2


def test_a_lone_tenant_keeps_every_worker() -> None:
    s = Scheduler(COST)
    for i in range(3):
        s.push(make(f"x{i}", 1, tenant="A"))
    assert [s.pop(workers=3) is not None for _ in range(3)] == [True, True, True]
