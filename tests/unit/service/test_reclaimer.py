"""The daemon's reclaim rounds (``service.allocator.Reclaimer``): young generations every round,
a full collection only when memory grew, time passed, or memory cannot be read."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref

from asteria_server.service.allocator import (
    NO_AUTOMATIC_FULL_COLLECTION,
    Reclaimer,
    anon_rss_bytes,
    reclaim_periodically,
)

MIB = 1 << 20


class _Node:
    """A reference cycle (``other`` points back) holding a payload."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def _old_cycle() -> weakref.ref[_Node]:
    """A cycle that survived full collections (it lives in the oldest generation), then lost
    its last outside reference: only a full collection frees it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gc.collect()  # survives: moved to the oldest generation
    return weakref.ref(a)


def test_only_growth_or_time_make_a_round_full() -> None:
    memory: list[int | None] = [100 * MIB]
    now = [0.0]
    rounds = Reclaimer(
        growth_bytes=64 * MIB,
        max_interval_s=3600.0,
        memory=lambda: memory[0],
        clock=lambda: now[0],
    )
    rounds()
    assert (rounds.full_rounds, rounds.young_rounds) == (1, 0)  # the first round is full
    now[0] = 30.0
    memory[0] = 150 * MIB
    rounds()
    assert (rounds.full_rounds, rounds.young_rounds) == (1, 1)  # grew by 50 MiB < 64
    memory[0] = 170 * MIB
    rounds()
    assert rounds.full_rounds == 2  # 70 MiB above the last full round's 100
    now[0] = 60.0
    rounds()
    assert (rounds.full_rounds, rounds.young_rounds) == (2, 2)  # measured anew after it: 170
    now[0] = 3700.0
    rounds()
    assert rounds.full_rounds == 3  # an hour since the last full round
    memory[0] = None
    rounds()
    assert rounds.full_rounds == 4  # cannot tell: collect everything


def test_a_young_round_leaves_an_old_cycle_and_a_full_round_frees_it() -> None:
    """The trap is real: an old generation's garbage survives young rounds (so a daemon that
    only ever collected them would keep what the soak found), and the full round frees it."""
    gc.disable()  # no automatic collection in between
    try:
        now = [0.0]
        memory = [10 * MIB]
        rounds = Reclaimer(growth_bytes=64 * MIB, memory=lambda: memory[0], clock=lambda: now[0])
        rounds()  # the first, full round
        cycle = _old_cycle()
        now[0] = 30.0
        rounds()  # young: the old cycle stays
        assert cycle() is not None and rounds.young_rounds == 1
        memory[0] = 100 * MIB  # its payload, say, was large
        rounds()
        assert cycle() is None and rounds.full_rounds == 2
    finally:
        gc.enable()


def test_anonymous_memory_is_read_from_proc() -> None:
    rss = anon_rss_bytes()
    assert rss is not None and rss > MIB


def test_while_the_reclaimer_runs_only_its_rounds_collect_the_oldest_generation() -> None:
    """CPython's own full collections (every few seconds while 160,000 blocks registered,
    up to 1.1 s each, in any thread) are off while ``reclaim_periodically`` runs: the oldest
    generation's threshold is out of reach, the young ones' are as they were, and a round
    still frees an old cycle. Cancelled, it puts the thresholds back."""
    before = gc.get_threshold()
    seen: list[tuple[int, int, int]] = []
    rounds = Reclaimer(growth_bytes=0)  # every round full

    async def main() -> None:
        task = asyncio.ensure_future(reclaim_periodically(0.01, rounds))
        await asyncio.sleep(0)  # it started: the thresholds are set
        seen.append(gc.get_threshold())
        while rounds.full_rounds < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    cycle = _old_cycle()
    asyncio.run(main())
    assert seen == [(before[0], before[1], NO_AUTOMATIC_FULL_COLLECTION)]
    assert cycle() is None  # a round's full collection freed it
    assert gc.get_threshold() == before
