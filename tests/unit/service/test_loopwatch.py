"""The event-loop watch: a blocked loop is noticed, with the frame it is stuck in."""

from __future__ import annotations

import asyncio
import io
import logging
import time

import pytest

from asteria_server.service.loopwatch import LoopWatch, StallTally


def test_a_stall_is_counted_once_and_its_length_kept() -> None:
    tally = StallTally(warn_after_s=1.0)
    assert tally.look(now=10.5, last_beat=10.0, tick_s=0.1) is None  # 0.4 s late: fine
    assert tally.look(now=11.2, last_beat=10.0, tick_s=0.1) == "began"
    assert tally.look(now=12.0, last_beat=10.0, tick_s=0.1) is None  # the same stall
    assert tally.stalls == 1
    assert tally.look(now=13.05, last_beat=13.0, tick_s=0.1) == "ended"
    assert tally.stalls == 1
    assert tally.longest_s == pytest.approx(2.9)  # from 10.1 to the beat at 13.0
    assert tally.look(now=15.0, last_beat=13.0, tick_s=0.1) == "began"  # a second one
    assert tally.stalls == 2


def _stuck_in_a_blocking_call() -> None:
    time.sleep(2.0)  # what a disk write under a held lock looks like to the loop


def test_a_blocked_loop_is_logged_with_the_frame_it_is_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> LoopWatch:
        watch = LoopWatch(tick_s=0.05, warn_after_s=0.3)
        watch.start()
        await asyncio.sleep(0.2)
        _stuck_in_a_blocking_call()
        await asyncio.sleep(0.3)  # the loop beats again: the stall ends
        await watch.stop()
        return watch

    with caplog.at_level(logging.WARNING, logger="asteria_server.service.loopwatch"):
        watch = asyncio.run(main())
    began = [r.getMessage() for r in caplog.records if "has been blocked" in r.getMessage()]
    assert len(began) == 1, caplog.text
    assert "_stuck_in_a_blocking_call" in began[0]
    assert any("ran again after" in r.getMessage() for r in caplog.records), caplog.text
    assert watch.tally.stalls == 1
    assert watch.tally.longest_s >= 1.0


def test_the_soak_bench_reads_the_stall_and_its_frame_from_the_daemons_log() -> None:
    from asteria_client.bench.soak import loop_stalls

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    watched = logging.getLogger("asteria_server.service.loopwatch")
    watched.addHandler(handler)

    async def main() -> None:
        watch = LoopWatch(tick_s=0.05, warn_after_s=0.3)
        watch.start()
        await asyncio.sleep(0.2)
        _stuck_in_a_blocking_call()
        await asyncio.sleep(0.3)
        await watch.stop()

    try:
        asyncio.run(main())
    finally:
        watched.removeHandler(handler)
    (stall,) = loop_stalls("daemon started\n" + stream.getvalue() + "later line\n")
    assert "test_loopwatch.py" in stall["where"] and "_stuck_in_a_blocking_call" in stall["where"]
    assert stall["noticed_after_s"] >= 0.3
    assert stall["blocked_s"] >= 1.0


def test_a_long_stall_turns_health_not_serving_until_the_loop_keeps_time_again() -> None:
    told: list[bool] = []

    async def on_health(ok: bool) -> None:
        told.append(ok)

    async def main() -> dict[str, list[bool]]:
        watch = LoopWatch(
            tick_s=0.05, warn_after_s=0.3, on_health=on_health, degrade_after_s=1.0,
            recover_after_s=0.8,
        )  # fmt: skip
        watch.start()
        seen = {}
        await asyncio.sleep(0.2)
        time.sleep(0.5)  # shorter than degrade_after_s: health stays as it is
        await asyncio.sleep(0.3)
        seen["after a short stall"] = list(told)
        _stuck_in_a_blocking_call()
        await asyncio.sleep(0.2)
        seen["after a long one"] = list(told)
        while watch.degraded:
            await asyncio.sleep(0.05)
        seen["once it kept time"] = list(told)
        await watch.stop()
        return seen

    assert asyncio.run(main()) == {
        "after a short stall": [],
        "after a long one": [False],
        "once it kept time": [False, True],
    }
