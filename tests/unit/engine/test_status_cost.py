"""What a status read costs the engine: a page of columns is built without a record object per
block, holding the engine's lock a chunk of blocks at a time to copy their records and read
their queue positions (by rank: no sort of the queue); a summary reads the counts the registry
keeps as blocks change, in one hold, and copies only its worst blocks' records.

A real engine (one solver worker) runs under these tests; its lock is swapped for one that
knows its owner, so "held by this thread" is exact even while the dispatcher thread takes it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import pytest

from asteria_server.engine import engine as engine_module
from asteria_server.engine import registry as registry_module
from asteria_server.engine import scheduler as scheduler_module
from asteria_server.engine.engine import EngineConfig, PreconditionerEngine
from asteria_server.engine.registry import CoherenceRegistry
from asteria_server.types import BlockState, BlockStatus, SolveKind, SolveResult, SolveTask

from .test_spill import _result as spill_result

TENANT = "t"


class OwnedLock:
    """A lock that says which thread holds it and counts each thread's acquisitions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None
        self.acquired: dict[int, int] = {}

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        me = threading.get_ident()
        self.owner = me
        self.acquired[me] = self.acquired.get(me, 0) + 1
        return True

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def held_here(self) -> bool:
        return self.owner == threading.get_ident()

    def mine(self) -> int:
        return self.acquired.get(threading.get_ident(), 0)


def _matrix(n: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed).standard_normal((n, n))
    return ((g @ g.T) / n + 0.1 * np.eye(n)).astype(np.float32)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[PreconditionerEngine, OwnedLock]]:
    lock = OwnedLock()
    real = threading.Condition
    made: list[OwnedLock] = []

    def condition(other: Any = None) -> threading.Condition:
        if made:  # the engine's own condition is its first (an Event's must not share it)
            return real(other)
        made.append(lock)
        return real(lock)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module.threading, "Condition", condition)
    config = EngineConfig(
        num_workers=1, calibrate=False, seconds_per_n3=1e-10, max_consecutive_failures=1
    )
    eng = PreconditionerEngine(config)
    monkeypatch.setattr(engine_module.threading, "Condition", real)
    assert eng._cond._lock is lock  # type: ignore[attr-defined]
    try:
        yield eng, lock
    finally:
        eng.close()


def _submit(eng: PreconditionerEngine, count: int, n: int = 192) -> list[str]:
    names = [f"layer{i:03d}.weight.L" for i in range(count)]
    for i, name in enumerate(reversed(names)):
        task = SolveTask(
            block=name, version=1, kind=SolveKind.INVERSE_ROOT, matrix=_matrix(n, i), tenant=TENANT
        )
        eng.submit(task)
    return names


def _record_lock(
    monkeypatch: pytest.MonkeyPatch, module: Any, name: str, lock: OwnedLock
) -> list[bool]:
    """Replace ``module.name`` by a wrapper that notes, per call, whether the lock was held."""
    held: list[bool] = []
    original: Callable[..., Any] = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        held.append(lock.held_here())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return held


def _count_status_records(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made = [0]
    init = BlockStatus.__init__

    def counting(self: BlockStatus, **kwargs: Any) -> None:
        made[0] += 1
        init(self, **kwargs)

    monkeypatch.setattr(BlockStatus, "__init__", counting)
    return made


def test_a_status_page_is_columns_built_outside_the_lock_with_no_record_per_block(
    engine: tuple[PreconditionerEngine, OwnedLock], monkeypatch: pytest.MonkeyPatch
) -> None:
    eng, lock = engine
    names = _submit(eng, 40)  # solves of n=192 keep most of them queued for a while
    monkeypatch.setattr(engine_module, "STATUS_CHUNK_BLOCKS", 16)
    monkeypatch.setattr(engine_module, "STATUS_CHUNK_BLOCKS_ALONE", 16)
    table_held = _record_lock(monkeypatch, engine_module, "block_table", lock)
    made = _count_status_records(monkeypatch)
    asked: list[int] = []
    positions_of = scheduler_module.Scheduler.positions_of

    def chunk(self: Any, tenant: str, blocks: list[str]) -> Any:
        asked.append(len(blocks))
        assert lock.held_here()
        return positions_of(self, tenant, blocks)

    monkeypatch.setattr(scheduler_module.Scheduler, "positions_of", chunk)
    before = lock.mine()

    table, total = eng.status_table(TENANT, "", 100)
    assert made[0] == 0, "a status page of columns made a BlockStatus per block"
    assert table_held == [False], "the table was built under the engine's lock"
    # 40 blocks, 16 a hold: 3 holds, each copying its chunk's records and queue positions.
    assert lock.mine() - before == 3 and asked == [16, 16, 8]
    assert total == 40 and table.columns["block"] == names

    # The same numbers as the record-per-block page (the old path, which does make them).
    old, _ = eng.status_page(TENANT, "", 100)
    assert made[0] == 40
    ages = ("age_s", "submitted_age_s", "delivered_age_s", "queue_position", "state")
    ages += ("running_version", "queued_version", "in_flight_version", "version", "tier")
    ages += ("staleness_steps", "last_solve_s", "delivered_version")  # may move in between
    rows = [{k: v for k, v in r.items() if k not in ages} for r in table.to_dicts()]
    assert rows == [{k: v for k, v in b.to_dict().items() if k not in ages} for b in old]

    # Pages of columns cover every block once, in name order.
    first, _ = eng.status_table(TENANT, "", 15)
    second, _ = eng.status_table(TENANT, first.columns["block"][-1], 100)
    assert first.columns["block"] + second.columns["block"] == names
    assert eng.wait_idle(60.0)
    settled, _ = eng.status_table(TENANT, "", 100)
    (dicts,) = [settled.to_dicts()]
    assert [b.to_dict() for b in settled] == dicts  # a table's rows are its records'
    assert all(b.state is BlockState.IDLE and b.version == 1 for b in settled)


def test_a_summary_reads_counts_in_one_hold_and_copies_only_its_worst_blocks(
    engine: tuple[PreconditionerEngine, OwnedLock], monkeypatch: pytest.MonkeyPatch
) -> None:
    eng, lock = engine
    names = _submit(eng, 30, n=8)
    bad = np.full((8, 8), np.nan, dtype=np.float32)
    eng.submit(
        SolveTask(block="zz.bad", version=3, kind=SolveKind.INVERSE_ROOT, matrix=bad, tenant=TENANT)
    )
    assert eng.wait_idle(60.0)
    copied: list[int] = []
    columns_of = registry_module.CoherenceRegistry._columns

    def counting(self: Any, tenant: str, names: list[str], *args: Any) -> Any:
        copied.append(len(names))
        return columns_of(self, tenant, names, *args)

    monkeypatch.setattr(registry_module.CoherenceRegistry, "_columns", counting)
    made = _count_status_records(monkeypatch)
    before = lock.mine()

    summary = eng.status_summary(TENANT, worst=3)
    assert lock.mine() - before == 1, "a summary held the engine's lock more than once"
    assert copied == [3], "a summary copied more records than its worst blocks'"
    assert made[0] == 0
    assert summary.blocks == 31 and summary.failed == 1 and summary.idle == 30
    assert summary.never_computed == 1 and summary.failures == 1
    assert summary.staleness_steps_max == 4  # the failed block: submitted 3, computed -1
    assert summary.staleness_steps_p50 == 0 and summary.tier_none == 1
    assert summary.tier_host + summary.tier_shm + summary.tier_spill == 30
    assert summary.oldest_result_age_s is not None and summary.oldest_result_age_s >= 0
    worst = summary.worst.columns["block"]
    assert len(worst) == 3 and worst[0] == "zz.bad" and set(worst[1:]) <= set(names)
    assert summary.worst[0].state is BlockState.FAILED and summary.worst[0].last_error


def _reference_summary(columns: dict[str, list[Any]], now: float, count: int) -> Any:
    """The summary as its first version added it up, a Python expression per block (kept
    here to check the tally against)."""
    c = columns
    stale = [s - v for s, v in zip(c["submitted_version"], c["computed_version"], strict=True)]
    states = Counter(
        "failed" if f else "running" if r >= 0 else "queued" if q >= 0 else "idle"
        for f, r, q in zip(c["failed"], c["running_version"], c["queued_version"], strict=True)
    )
    tiers = Counter(c["tier"])
    ordered, n = sorted(stale), len(stale)
    times = [t for t in c["computed_at"] if t is not None]
    numbers = {
        **{state: states[state] for state in ("idle", "queued", "running", "failed")},
        **{f"tier_{t or 'none'}": tiers[t] for t in ("host", "shm", "spill", "")},
        "never_computed": n - len(times),
        "staleness_steps_p50": ordered[n // 2],
        "staleness_steps_p99": ordered[min(n - 1, (99 * n) // 100)],
        "staleness_steps_max": ordered[-1],
        "oldest_result_age_s": max(0.0, now - min(times)) if times else None,
        "failures": sum(c["failures"]),
    }
    older = [math.inf if t is None else -t for t in c["computed_at"]]
    keyed = zip(c["failed"], stale, older, c["block"], strict=True)
    return numbers, [row[3] for row in heapq.nlargest(count, keyed)]


def _result(tenant: str, block: str, version: int, shm: bool) -> SolveResult:
    # with shm: a result in a client's segment (only whether it has one counts here)
    segment = cast(Any, "segment") if shm else None
    return dataclasses.replace(spill_result(block, version, 2), tenant=tenant, shm=segment)


def _random_event(
    registry: CoherenceRegistry, rng: np.random.Generator, blocks: int, clock: list[float]
) -> None:
    """One event of any kind on a random block of two tenants, as the engine would send it
    (a dispatch of the queued version, a result of the running one or of any other)."""
    clock[0] += float(rng.random() < 0.1)  # many equal times: the name decides among them
    tenant = ("t", "u")[int(rng.integers(2))]
    block = f"b{int(rng.integers(blocks)):03d}"
    rec = registry._records.get((tenant, block))
    submitted = -1 if rec is None else rec.submitted_version
    running = -1 if rec is None else rec.running_version
    kind = int(rng.integers(12))
    if kind <= 2:
        registry.on_submit(tenant, block, max(0, submitted + int(rng.integers(-1, 3))))
    elif kind == 3 and rec is not None and rec.queued_version >= 0 and running < 0:
        registry.on_dispatch(tenant, block, rec.queued_version)
    elif kind == 4:
        version = running if running >= 0 else int(rng.integers(-1, submitted + 2))
        registry.on_result(_result(tenant, block, version, bool(rng.integers(2))))
    elif kind == 5:
        registry.on_failure(tenant, block, running, "no good")
    elif kind == 6 and running >= 0:
        registry.on_requeue(tenant, block, running)
    elif kind == 7:
        registry.on_overwritten(tenant, block, running)
    elif kind == 8 and rec is not None:
        registry.on_withdrawn(tenant, block, rec.queued_version)
    elif kind == 9:
        registry.on_elsewhere(tenant, block, submitted + 1)
    elif kind == 10:
        (registry.drop if rng.integers(2) else registry.forget)(tenant, block)
    elif kind == 11 and rec is not None and rec.result is not None:
        registry.hold(tenant, block, None)  # spilled


@pytest.mark.parametrize("seed", range(6))
def test_the_tally_gives_the_summary_of_every_record(seed: int) -> None:
    """Random events of every kind on two tenants' blocks: at each check the summary read from
    the tally is what adding up every record gives (the reference, a Python expression per
    block), numbers and worst blocks alike."""
    rng = np.random.default_rng(seed)
    clock = [0.0]
    registry = CoherenceRegistry(max_consecutive_failures=2, clock=lambda: clock[0])
    blocks = (5, 40, 200)[seed % 3]

    def tiers(keys: list[Any], results: list[SolveResult | None]) -> list[str]:
        return ["" if r is None else "host" if r.shm is None else "shm" for r in results]

    for _ in range(60):
        for _ in range(int(rng.integers(1, 3 * blocks))):
            _random_event(registry, rng, blocks, clock)
        for tenant in ("t", "u"):
            columns, total, _ = registry.status_columns(tenant, "", 10**6, tiers)
            count = int(rng.integers(0, 12))
            numbers, worst = registry.summary(tenant, count)
            if not total:
                assert (numbers, worst) == ({}, [])
                continue
            # the engine splits the blocks without a result into spilled and none
            reference = _reference_summary(columns, clock[0], count)
            assert ({**numbers, "tier_spill": 0}, worst) == reference


def _reference_order(queues: dict[str, list[Any]], consumed: dict[str, float]) -> list[Any]:
    """The pop order as the scheduler's first ``order()`` computed it (a Python min over the
    tenants per entry), kept here to check the faster one against."""
    left = {t: sorted(q, key=lambda e: e.priority, reverse=True) for t, q in queues.items() if q}
    used = {t: consumed.get(t, 0.0) for t in left}
    out = []
    while left:
        tenant = min(left, key=lambda t: (used[t], left[t][-1].seq))
        entry = left[tenant].pop()
        out.append(entry.task.key)
        used[tenant] += entry.cost_s
        if not left[tenant]:
            del left[tenant]
    return out


def test_the_queue_order_is_the_schedulers_pop_order() -> None:
    from asteria_server.engine.scheduler import Scheduler, queue_order

    rng = np.random.default_rng(3)
    scheduler = Scheduler()
    m = np.eye(2, dtype=np.float32)
    for i in range(300):
        tenant = f"t{rng.integers(3)}"
        deadline = float(rng.integers(5))
        task = SolveTask(
            block=f"b{i}",
            version=1,
            kind=SolveKind.INVERSE_ROOT,
            matrix=np.eye(int(rng.integers(2, 6)), dtype=np.float32) if i % 2 else m,
            tenant=tenant,
            deadline=deadline,
        )
        scheduler.push(task)
    for _ in range(40):
        popped = scheduler.pop()
        assert popped is not None
        scheduler.finish(*popped.task.key)
    queues, consumed = scheduler.queue_snapshot()
    expected = _reference_order(queues, consumed)
    assert queue_order(queues, consumed) == expected == scheduler.order()
    popped_order = []
    while (entry := scheduler.pop()) is not None:
        popped_order.append(entry.task.key)
        scheduler.finish(*entry.task.key)
    assert popped_order == expected


def test_a_block_has_one_key_tuple_in_every_engine_table(
    engine: tuple[PreconditionerEngine, OwnedLock],
) -> None:
    """The registry, the scheduler and the host tier key a block by one shared tuple: a copy
    per table cost each held block about 56 bytes more (daemon RSS per block)."""
    eng, _ = engine
    names = _submit(eng, 12, n=8)
    assert eng.wait_idle(60.0)
    coord = eng._coord
    records = {k: k for k in coord.registry._records}
    latest = {k: k for k in coord.scheduler._latest}
    host = {k: k for k in eng._tiers._host}
    for name in names:
        key = records[(TENANT, name)]
        assert latest[key] is key, f"the scheduler holds its own key of {name}"
        assert host[key] is key, f"the host tier holds its own key of {name}"
        assert coord.registry.key(TENANT, name) is key
