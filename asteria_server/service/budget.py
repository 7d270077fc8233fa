"""A byte budget for the snapshots the daemon is receiving at once.

Every upload holds its announced size (matrix and basis bytes) from the moment its header is
checked until its task is built, so many clients uploading large factors at the same time cannot
make the daemon allocate without bound. One tenant's uploads hold at most its share of the budget
(``tenant_limit_bytes``), so a tenant whose uploads stall never starves another. An upload that
finds no room waits, first come first served, up to a bounded time and then fails with
:class:`DaemonBusyError` (the client skips that snapshot and sends the block's next one); one
larger than the whole budget or than a tenant's share fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from asteria_server.errors import DaemonBusyError, InvalidInputError


class UploadBudget:
    """At most ``limit_bytes`` of uploads at once, ``tenant_limit_bytes`` of them one tenant's;
    used from one event loop."""

    def __init__(self, limit_bytes: int, tenant_limit_bytes: int | None = None) -> None:
        if limit_bytes < 1:
            raise ValueError(f"UploadBudget.limit_bytes must be >= 1, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.tenant_limit_bytes = min(limit_bytes, tenant_limit_bytes or limit_bytes)
        if self.tenant_limit_bytes < 1:
            raise ValueError(
                f"UploadBudget.tenant_limit_bytes must be >= 1, got {tenant_limit_bytes}"
            )
        self.in_use_bytes = 0
        self._by_tenant: dict[str, int] = {}
        self._room = asyncio.Condition()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Uploads waiting for room now."""
        return self._waiting

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes ``tenant``'s uploads hold now."""
        return self._by_tenant.get(tenant, 0)

    def _fits(self, tenant: str, num_bytes: int) -> bool:
        return (
            self.in_use_bytes + num_bytes <= self.limit_bytes
            and self.tenant_bytes(tenant) + num_bytes <= self.tenant_limit_bytes
        )

    @contextlib.asynccontextmanager
    async def hold(
        self, num_bytes: int, *, wait_s: float, what: str, tenant: str = ""
    ) -> AsyncIterator[None]:
        """Hold ``num_bytes`` for ``tenant`` for the body of the ``async with``."""
        if num_bytes > self.limit_bytes:
            raise InvalidInputError(
                f"{what}: {num_bytes} bytes exceed the daemon's max_upload_bytes "
                f"({self.limit_bytes}); raise it or use smaller blocks (max_preconditioner_dim)"
            )
        if num_bytes > self.tenant_limit_bytes:
            raise InvalidInputError(
                f"{what}: {num_bytes} bytes exceed one tenant's share of the upload budget "
                f"({self.tenant_limit_bytes} bytes: tenant_upload_share of max_upload_bytes); "
                "raise them or use smaller blocks"
            )
        async with self._room:
            self._waiting += 1
            try:
                await asyncio.wait_for(
                    self._room.wait_for(lambda: self._fits(tenant, num_bytes)), wait_s
                )
            except TimeoutError:
                mine = self.tenant_bytes(tenant)
                raise DaemonBusyError(
                    f"{what}: found no room within {wait_s:.1f} s in the upload budget: the "
                    f"daemon is receiving {self.in_use_bytes} of its {self.limit_bytes} upload "
                    f"bytes (max_upload_bytes), {mine} of them this tenant's, whose share is "
                    f"{self.tenant_limit_bytes} (tenant_upload_share); send the next snapshot"
                ) from None
            finally:
                self._waiting -= 1
            self.in_use_bytes += num_bytes
            self._by_tenant[tenant] = self.tenant_bytes(tenant) + num_bytes
        try:
            yield
        finally:
            async with self._room:
                self.in_use_bytes -= num_bytes
                left = self._by_tenant[tenant] - num_bytes
                if left:
                    self._by_tenant[tenant] = left
                else:
                    del self._by_tenant[tenant]
                self._room.notify_all()
