"""One record per block on the client (runtime/blocks.py).

The runtime, its refresh log and the continuous scheduler keep their state of a block in the
same :class:`BlockRecord`: these tests check that they share it (not copies kept in step), that
what the status reports comes from it, and that a record never keeps a tile the optimizer
dropped alive.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from asteria_client import SOAP
from asteria_client.runtime.blocks import BlockRecord, BlockRecords, TileBlocks
from tests.unit.test_continuous import InstantSource, _model, _train


def _tiles(opt: Any) -> list[TileBlocks]:
    return [tile for _, tile in opt._block_tiles()]


def test_the_runtime_log_and_scheduler_share_one_record_per_block() -> None:
    model = _model()
    opt = SOAP(
        model.named_parameters(), source=InstantSource(), refresh="continuous", staleness_budget=1
    )
    _train(model, opt, 12)
    runtime = opt.runtime
    scheduler = runtime._continuous
    assert scheduler is not None
    blocks = {block for tile in _tiles(opt) for _, block in tile.preconditioned()}
    assert set(runtime.records) == blocks
    assert runtime.refresh_log.blocks is runtime.records
    for block in blocks:
        record = runtime.records[block]
        assert scheduler.candidates[block] is record
        assert isinstance(record, BlockRecord)
    rows = opt.refresh_stats()["blocks"]
    for row in opt.preconditioner_status():
        record = runtime.records[row["block"]]
        # what the status and the refresh stats say is read from the record and the tile
        assert row["version"] == record.version >= 0
        assert row["submitted_version"] == record.submitted
        assert row["lag_steps"] == record.lag_at_use
        assert rows[row["block"]]["installs"] == record.installs > 0
        assert rows[row["block"]]["pulls"] == record.pulls > 0
    opt.close()


def test_a_record_follows_the_tile_that_replaced_its_own_and_keeps_no_dropped_tile() -> None:
    records = BlockRecords()
    old = TileBlocks.named(["w/tile0/dim0", None])
    record = records.at(old, 0, "w/tile0/dim0")
    old.versions[0], old.submitted[0] = 3, 5
    assert (record.version, record.submitted) == (3, 5)
    record.installs = 2
    new = TileBlocks.named(["w/tile0/dim0", None])
    assert records.at(new, 0, "w/tile0/dim0") is record  # the same record, its history kept
    assert (record.version, record.submitted, record.installs) == (-1, -1, 2)
    dropped = weakref.ref(old)
    del old
    gc.collect()
    assert dropped() is None, "the record kept a tile the optimizer dropped alive"
    del new
    gc.collect()
    assert record.tile is None and (record.version, record.submitted) == (-1, -1)


def test_a_quiet_sync_allocates_no_per_block_reference() -> None:
    """The runtime used to store a fresh weakref and tuple for every block at every sync;
    the record is pointed at its tile once, and a later sync keeps the same reference."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4, bias=False) for _ in range(3)))
    opt = SOAP(model.named_parameters(), source=InstantSource(), staleness_budget=1)
    _train_linear(model, opt, 2)
    refs = {b: r.tile_ref for b, r in opt.runtime.records.items()}
    _train_linear(model, opt, 3)
    assert {b: r.tile_ref for b, r in opt.runtime.records.items()} == refs
    assert all(opt.runtime.records[b].tile_ref is ref for b, ref in refs.items())
    opt.close()


def _train_linear(model: torch.nn.Module, opt: Any, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
