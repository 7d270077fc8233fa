"""How many blocks a Status page of columns holds (issue 27): the default page for a call that
asks for nothing in particular, up to the larger cap for a full read that asks for more."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.service import servicer as servicer_module
from asteria_server.service.servicer import (
    MAX_STATUS_COLUMN_PAGE_BLOCKS,
    STATUS_COLUMN_PAGE_BLOCKS,
    PreconditionerServicer,
)
from asteria_server.types import BLOCK_COLUMNS, BlockTable

BLOCKS = MAX_STATUS_COLUMN_PAGE_BLOCKS + 500


class _Engine:
    """``status_table`` of BLOCKS blocks named by number, in name order."""

    def __init__(self) -> None:
        names = [f"b{i:06d}" for i in range(BLOCKS)]
        columns: dict[str, list[Any]] = {
            name: [0] * BLOCKS for name in BLOCK_COLUMNS
        }  # only names are read
        columns["block"] = names
        self.table = BlockTable("t0", columns)

    def status_table(self, tenant: str, after: str, limit: int) -> tuple[BlockTable, int]:
        start = sum(1 for b in self.table.columns["block"] if b <= after)
        rows = {k: v[start : start + limit] for k, v in self.table.columns.items()}
        return BlockTable(tenant, rows), BLOCKS


def _page(max_blocks: int, monkeypatch: pytest.MonkeyPatch) -> pb.StatusResponse:
    servicer = object.__new__(PreconditionerServicer)
    servicer._engine = _Engine()  # type: ignore[assignment]
    servicer._limits = SimpleNamespace(max_message_bytes=64 << 20)  # type: ignore[assignment]
    # the page's columns as names only: what is counted is the page's length
    monkeypatch.setattr(
        servicer_module.convert,
        "block_table_to_proto",
        lambda table: pb.BlockColumns(tenant=table.tenant, block=table.columns["block"]),
    )
    request = pb.StatusRequest(session_id="s", columns=True, max_blocks=max_blocks)
    reply = pb.StatusResponse()
    return asyncio.run(servicer._status_columns(request, "t0", reply))


@pytest.mark.parametrize(
    ("max_blocks", "shown"),
    [
        (0, STATUS_COLUMN_PAGE_BLOCKS),
        (100, 100),
        (MAX_STATUS_COLUMN_PAGE_BLOCKS, MAX_STATUS_COLUMN_PAGE_BLOCKS),
        (10 * MAX_STATUS_COLUMN_PAGE_BLOCKS, MAX_STATUS_COLUMN_PAGE_BLOCKS),
    ],
)
def test_a_columns_page_holds_the_default_or_what_is_asked_up_to_the_cap(
    max_blocks: int, shown: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reply = _page(max_blocks, monkeypatch)
    assert len(reply.columns.block) == shown
    assert reply.next_after_block == f"b{shown - 1:06d}"
    assert reply.total_blocks == BLOCKS
