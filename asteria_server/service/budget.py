"""A byte budget for the snapshots the daemon is receiving at once.

Every upload holds its announced size (matrix and basis bytes) from the moment its header is
checked until its task is built, so many clients uploading large factors at the same time cannot
make the daemon allocate without bound. An upload that finds no room waits, first come first
served, up to a bounded time and then fails with :class:`DaemonBusyError` (the client skips that
snapshot and sends the block's next one); one larger than the whole budget fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from asteria_server.errors import DaemonBusyError, InvalidInputError


class UploadBudget:
    """At most ``limit_bytes`` of uploads at once; used from one event loop."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"UploadBudget.limit_bytes must be >= 1, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.in_use_bytes = 0
        self._room = asyncio.Condition()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Uploads waiting for room now."""
        return self._waiting

    @contextlib.asynccontextmanager
    async def hold(self, num_bytes: int, *, wait_s: float, what: str) -> AsyncIterator[None]:
        """Hold ``num_bytes`` for the body of the ``async with``."""
        if num_bytes > self.limit_bytes:
            raise InvalidInputError(
                f"{what}: {num_bytes} bytes exceed the daemon's max_upload_bytes "
                f"({self.limit_bytes}); raise it or use smaller blocks (max_preconditioner_dim)"
            )
        async with self._room:
            self._waiting += 1
            try:
                await asyncio.wait_for(
                    self._room.wait_for(lambda: self.in_use_bytes + num_bytes <= self.limit_bytes),
                    wait_s,
                )
            except TimeoutError:
                raise DaemonBusyError(
                    f"{what}: the daemon is receiving {self.in_use_bytes} of its "
                    f"{self.limit_bytes} upload bytes and found no room within {wait_s:.1f} s; "
                    "send the next snapshot"
                ) from None
            finally:
                self._waiting -= 1
            self.in_use_bytes += num_bytes
        try:
            yield
        finally:
            async with self._room:
                self.in_use_bytes -= num_bytes
                self._room.notify_all()
