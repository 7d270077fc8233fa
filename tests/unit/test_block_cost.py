"""A step that receives nothing must not touch every block.

The bookkeeping of a step follows the blocks that changed (a snapshot submitted, a result
arrived or installed), not the blocks held: with nothing new, the runtime's per-block code is
not entered at all, whatever the number of blocks. Counted here with real optimizers on the
real embedded engine (solver worker processes), at two model sizes: the calls into the
per-block code in a step that refreshes and receives nothing must not grow with the blocks.
(Speed itself is measured by ``asteria bench blocks``, not here.)
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
import torch

from asteria_client import SOAP, KLShampoo, Shampoo
from asteria_client.runtime.embedded import EngineConfig
from asteria_client.runtime.freshness import TileBlocks
from asteria_client.runtime.staleness import StalenessPolicy

OPTIMIZERS = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}
SMALL, LARGE = 4, 16  # parameters (two blocks each)


def _count_calls(monkeypatch: pytest.MonkeyPatch, counts: Counter[str]) -> None:
    """Count the calls into the runtime's per-block code: the walk over a tile's blocks and
    the staleness check of one block (the real methods still run)."""
    walk, check = TileBlocks.preconditioned, StalenessPolicy.required_version

    def preconditioned(self: TileBlocks) -> Any:
        counts["walk"] += 1
        return walk(self)

    def required_version(self: StalenessPolicy, *args: Any, **kwargs: Any) -> int:
        counts["check"] += 1
        return check(self, *args, **kwargs)

    monkeypatch.setattr(TileBlocks, "preconditioned", preconditioned)
    monkeypatch.setattr(StalenessPolicy, "required_version", required_version)


def _calls_in_a_quiet_step(name: str, num_params: int, monkeypatch: pytest.MonkeyPatch) -> int:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 5)) for _ in range(num_params)]
    counts: Counter[str] = Counter()
    with OPTIMIZERS[name](
        [(f"w{i}", p) for i, p in enumerate(params)],
        lr=1e-3,
        precondition_frequency=1000,  # the first snapshot only: later steps refresh nothing
        mode="embedded",
        staleness_budget=1,
        engine_config=EngineConfig(num_workers=1),
    ) as opt:

        def step() -> None:
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()

        def installed() -> bool:
            return all(
                tile.versions[dim] >= 0
                for _, tile in opt._block_tiles()
                for dim, block in enumerate(tile.blocks)
                if block is not None
            )

        step()  # factors and the first snapshots
        deadline = time.monotonic() + 60
        while not installed():
            assert time.monotonic() < deadline, "the first results did not arrive"
            time.sleep(0.02)
            step()
        for _ in range(3):
            step()  # the installs settle
        source = opt.source
        for _ in range(20):  # a step in which no result arrives
            epoch = source.results_epoch()
            with monkeypatch.context() as patch:
                counts.clear()
                _count_calls(patch, counts)
                step()
            if source.results_epoch() == epoch:
                return counts["walk"] + counts["check"]
        raise AssertionError("every step received a result")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_that_receives_nothing_does_not_touch_every_block(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = _calls_in_a_quiet_step(name, SMALL, monkeypatch)
    large = _calls_in_a_quiet_step(name, LARGE, monkeypatch)
    assert large <= small, (
        f"{name}: a step that received nothing made {small} calls into per-block code with "
        f"{2 * SMALL} blocks and {large} with {2 * LARGE}: its cost grows with the blocks held"
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_results_that_arrive_after_quiet_steps_are_still_installed(name: str) -> None:
    """The other side of skipping quiet tiles: a result that arrives after steps that looked
    at nothing marks its tile, and the next step installs it (every block catches up)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 5)) for _ in range(SMALL)]
    with OPTIMIZERS[name](
        [(f"w{i}", p) for i, p in enumerate(params)],
        lr=1e-3,
        precondition_frequency=4,
        mode="embedded",
        staleness_budget=2,
        engine_config=EngineConfig(num_workers=1),
    ) as opt:
        for _ in range(13):  # snapshots at steps 1, 5, 9 and 13
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        for p in params:  # step 14 at once: it looks at the tiles step 13 snapshotted
            p.grad = torch.zeros_like(p)
        opt.step()
        tiles = [tile for _, tile in opt._block_tiles()]
        blocks = [b for tile in tiles for b in tile.blocks if b is not None]
        deadline = time.monotonic() + 60
        while any(opt.source.in_flight_version(b) is not None for b in blocks):
            assert time.monotonic() < deadline, "the engine did not finish step 13's solves"
            time.sleep(0.05)  # no step meanwhile: the results wait in the source
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()  # step 15: nothing due, so only the arrivals can make it look at a tile
        late = [
            (block, tile.versions[dim])
            for tile in tiles
            for dim, block in enumerate(tile.blocks)
            if block is not None and tile.versions[dim] < 13
        ]
        assert not late, f"results that arrived between steps were not installed: {late}"
        assert opt.runtime_stats()["max_lag_steps"] <= 2 * 4
