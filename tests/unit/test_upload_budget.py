"""The daemon's upload budget: room is held while an upload is received and given back after."""

from __future__ import annotations

import asyncio

import pytest

from asteria_server.errors import DaemonBusyError, InvalidInputError
from asteria_server.service.budget import UploadBudget


def test_an_upload_larger_than_the_budget_is_refused_at_once() -> None:
    async def main() -> None:
        budget = UploadBudget(100)
        with pytest.raises(InvalidInputError, match="max_upload_bytes"):
            async with budget.hold(101, wait_s=10.0, what="block 'w'"):
                pass
        assert budget.in_use_bytes == 0

    asyncio.run(main())


def test_an_upload_waits_for_room_and_gets_it_when_another_ends() -> None:
    async def main() -> list[str]:
        budget = UploadBudget(100)
        events: list[str] = []

        async def upload(name: str, size: int, seconds: float) -> None:
            async with budget.hold(size, wait_s=5.0, what=name):
                events.append(f"{name} in ({budget.in_use_bytes})")
                await asyncio.sleep(seconds)
            events.append(f"{name} out")

        first = asyncio.create_task(upload("a", 70, 0.2))
        await asyncio.sleep(0.05)
        await asyncio.gather(first, upload("b", 50, 0.0))
        assert budget.in_use_bytes == 0 and budget.waiting == 0
        return events

    assert asyncio.run(main()) == ["a in (70)", "a out", "b in (50)", "b out"]


def test_an_upload_that_finds_no_room_in_time_is_busy_not_lost() -> None:
    async def main() -> None:
        budget = UploadBudget(100)
        async with budget.hold(80, wait_s=1.0, what="a"):
            with pytest.raises(DaemonBusyError, match=r"no room within 0\.1 s"):
                async with budget.hold(30, wait_s=0.1, what="b"):
                    pass
            assert budget.in_use_bytes == 80 and budget.waiting == 0
        async with budget.hold(100, wait_s=0.1, what="c"):  # all of it, now free
            assert budget.in_use_bytes == 100

    asyncio.run(main())
