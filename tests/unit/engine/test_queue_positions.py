"""Queue positions read from the scheduler's ordered queues: they equal a full sort of the queue
(the pop order) through any sequence of changes, and a status page reads its own blocks' only,
without a look at the rest of the queue."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from asteria_server.engine import ranked as ranked_module
from asteria_server.engine import scheduler as scheduler_module
from asteria_server.engine.coordinator import Coordinator
from asteria_server.engine.ranked import RankedQueue, rank_key
from asteria_server.engine.scheduler import CostModel, Scheduler
from asteria_server.types import SolveKind, SolveTask

COST = CostModel(seconds_per_n3=2.0**-30, refresh_ratio=0.5)  # exact binary sums
TENANTS = ("A", "B", "C")
BLOCKS = [f"b{i:02d}" for i in range(40)]
_EYES = {n: np.eye(n, dtype=np.float32) for n in (2, 4, 8)}


def _task(rng: random.Random, tenant: str, block: str, version: int) -> SolveTask:
    deadline = rng.choice([math.inf, float(rng.randrange(12))])
    return SolveTask(
        block=block,
        version=version,
        kind=SolveKind.INVERSE_ROOT,
        matrix=_EYES[rng.choice((2, 4, 8))],
        tenant=tenant,
        deadline=deadline,
    )


def _change(s: Scheduler, rng: random.Random, versions: dict[tuple[str, str], int]) -> None:
    """One random change: a new snapshot (a new priority for a queued block), a pop, a finish
    with a measured time, a lost worker's requeue, a forget or a withdraw."""
    tenant, block = rng.choice(TENANTS), rng.choice(BLOCKS)
    op = rng.random()
    if op < 0.55:
        versions[(tenant, block)] = versions.get((tenant, block), 0) + 1
        s.push(_task(rng, tenant, block, versions[(tenant, block)]))
    elif op < 0.75:
        entry = s.pop(workers=rng.choice((0, 3)))
        if entry is not None:
            if rng.random() < 0.1:
                s.requeue(entry.task)
            else:
                measured = rng.choice([None, rng.randrange(8) * 2.0**-24])
                s.finish(*entry.task.key, actual_s=measured)
    elif op < 0.88:
        s.forget(tenant, block)
    else:
        s.withdraw(tenant, block)


def _check_against_a_full_sort(s: Scheduler) -> None:
    expected = s.positions()  # queue_order: every tenant's queue sorted, then interleaved
    for tenant in TENANTS:
        got = s.positions_of(tenant, BLOCKS)
        assert got == [expected.get((tenant, b)) for b in BLOCKS], tenant


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_positions_equal_a_full_sort_through_random_changes(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ranked_module, "LOAD", 4)  # buckets split and merge every few changes
    rng = random.Random(seed)
    s = Scheduler(COST)
    versions: dict[tuple[str, str], int] = {}
    for step in range(1500):
        _change(s, rng, versions)
        if step % 25 == 0:
            _check_against_a_full_sort(s)
    _check_against_a_full_sort(s)
    popped = []  # and the positions are the pops that follow
    expected = s.order()
    while (entry := s.pop()) is not None:
        popped.append(entry.task.key)
        s.finish(*entry.task.key)
    assert popped == expected


def test_a_ranked_queue_is_a_sorted_list_with_its_cost_prefixes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ranked_module, "LOAD", 3)
    rng = random.Random(7)
    q = RankedQueue()
    held: dict[tuple[float, float, int], str] = {}
    for seq in range(600):
        if held and rng.random() < 0.45:
            gone = rng.choice(sorted(held))
            q.remove(rank_key(*gone))
            del held[gone]
        else:
            deadline = rng.choice([-math.inf, -2.5, -0.0, 0.0, 1.0, 3.0, math.inf])
            entry = (deadline, rng.randrange(1, 9) * 0.25, seq)
            q.add(rank_key(*entry), entry[1], f"b{seq}")
            held[entry] = f"b{seq}"
        order = sorted(held)
        assert list(q) == [held[e] for e in order] and len(q) == len(order)
        if order:
            i = rng.randrange(len(order))
            assert q.rank(rank_key(*order[i])) == (i, sum(e[1] for e in order[:i]))
            spent = rng.randrange(0, 40) * 0.25
            count = sum(1 for j in range(len(order)) if sum(e[1] for e in order[:j]) < spent)
            assert q.count_before(spent, -1, 0.0) == count
            # many keys at once, in any order: each the one-key answer
            some = rng.sample(order, min(len(order), 9))
            keys = [rank_key(*e) for e in some]
            one = [q.rank(k) for k in keys]
            assert q.ranks(keys) == [r for r, _ in one]
            assert q.ranks_and_costs(keys) == ([r for r, _ in one], [c for _, c in one])
            for gone in ((0.0, 1.0, 10_000), (math.inf, 99.0, 10_001), (-math.inf, 0.0, 0)):
                with pytest.raises(KeyError):
                    q.ranks([*keys, rank_key(*gone)])
    with pytest.raises(KeyError):
        q.remove(rank_key(0.0, 1.0, 10_000))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_page_of_positions_equals_a_full_sort_with_one_tenant_queued_or_more(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One tenant queued: its page is looked up in C loops, without the per-block count of
    other tenants' entries before it; a block not queued, or never seen, is None."""
    monkeypatch.setattr(ranked_module, "LOAD", 4)
    rng = random.Random(seed)
    s = Scheduler(COST)
    page = [*BLOCKS, "never-queued"]
    for i, block in enumerate(BLOCKS):
        s.push(_task(rng, "A", block, i + 1))
    for _ in range(5):
        entry = s.pop()
        assert entry is not None
        s.finish(*entry.task.key)
    s.withdraw("A", BLOCKS[7])
    expected = s.positions()
    assert {t for t, _ in expected} == {"A"}
    for names in (page, rng.sample(page, len(page)), page[:1], []):  # any names, any order
        assert s.positions_of("A", names) == [expected.get(("A", b)) for b in names]
    queued = [b for b in BLOCKS if ("A", b) in expected]  # every one queued
    assert s.positions_of("A", queued) == [expected[("A", b)] for b in queued]
    for i, block in enumerate(BLOCKS[:20]):  # a second tenant: each block counts its entries
        s.push(_task(rng, "B", block, i + 1))
    expected = s.positions()
    for tenant in ("A", "B"):
        assert s.positions_of(tenant, page) == [expected.get((tenant, b)) for b in page]


def _queued_coordinator(count: int) -> Coordinator:
    coord = Coordinator(cost_model=COST)
    eye = _EYES[2]
    for i in range(count):
        tenant = TENANTS[i % 2]
        task = SolveTask(
            block=f"b{i:06d}",
            version=1,
            kind=SolveKind.INVERSE_ROOT,
            matrix=eye,
            tenant=tenant,
            deadline=float(i % 97),
        )
        coord.submit(task)
    return coord


def _count_entry_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count attribute reads of queued entries (a sort of the queue reads each one's priority)."""
    reads = [0]
    real = object.__getattribute__

    def counting(self: Any, name: str) -> Any:
        reads[0] += 1
        return real(self, name)

    monkeypatch.setattr(scheduler_module.ScheduledTask, "__getattribute__", counting)
    return reads


def test_a_status_page_reads_its_own_blocks_not_the_whole_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small, large = _queued_coordinator(1_000), _queued_coordinator(10_000)
    reads = _count_entry_reads(monkeypatch)
    work = []
    for coord in (small, large):
        before = reads[0]
        page = coord.status_page("A", "b000100", 50)[0]
        work.append(reads[0] - before)
        assert len(page) == 50 and all(b.queue_position is not None for b in page)
    # The old page sorted the queue: 1,000 and 10,000 entries' priorities read (6,000 and
    # 60,000 attributes); a page's own 50 blocks are read whatever the queue's length.
    assert work[0] == work[1] <= 50 * 8, work
