"""State saved by shards, loaded with another geometry: the tiles are matched by global rows, kept
when they are the same rows, otherwise rebuilt from the saved factors and moments (here: two
row shards' optimizers, as two FSDP2 ranks run them, loaded into one whole parameter). And the
DCP load planner in one process."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asteria_client.optim.checkpoint import OptimizerLoadPlanner
from asteria_client.optim.sharding import ShardGeometry
from asteria_client.optim.tensor_ops import project

from .native import SOAP, KLShampoo, Shampoo

FACTORIES = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}
ROWS, COLS = 24, 12


def _gradients(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(ROWS, COLS, generator=g, dtype=torch.float64) for _ in range(steps)]


def _sharded_checkpoint(name: str, max_dim: int, steps: int = 5) -> tuple[dict[str, Any], list]:
    """What two FSDP2 ranks holding rows 0:12 and 12:24 of ``w`` save: one entry per shard."""
    torch.manual_seed(0)
    full = torch.randn(ROWS, COLS, dtype=torch.float64)
    shards, checkpoint = [], None
    for start in (0, 12):
        weight = torch.nn.Parameter(full[start : start + 12].clone())
        opt = FACTORIES[name](
            [("w", weight)], lr=1e-2, precondition_frequency=2, max_preconditioner_dim=max_dim
        )
        for grad in _gradients(steps):
            weight.grad = grad[start : start + 12].clone()
            opt.step()
        sd = opt.state_dict()
        entry = sd["state"].pop("w")
        entry["shard"] = ShardGeometry((ROWS, COLS), (start, 0), (12, COLS), (0,)).to_dict()
        if checkpoint is None:
            checkpoint = sd
        checkpoint["state"][f"w@rows{start}:{start + 12}"] = entry
        shards.append(opt)
    assert checkpoint is not None
    return checkpoint, shards


def _load_whole(name: str, checkpoint: dict[str, Any]) -> tuple[Any, list[str]]:
    weight = torch.nn.Parameter(torch.zeros(ROWS, COLS, dtype=torch.float64))
    opt = FACTORIES[name]([("w", weight)], lr=1e-2, precondition_frequency=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(checkpoint)
    messages = [str(w.message) for w in caught if "shard geometry" in str(w.message)]
    return opt, messages


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_tiles_with_the_same_rows_are_kept_with_their_results(name: str) -> None:
    checkpoint, shards = _sharded_checkpoint(name, max_dim=12)
    opt, messages = _load_whole(name, checkpoint)
    assert len(messages) == 1 and "2 kept as saved" in messages[0]
    tiles = next(iter(opt.state.values()))["tiles"]
    for index, shard in enumerate(shards):
        saved = next(iter(shard.state.values()))["tiles"][0]
        assert tiles[index].blocks == [f"w/tile{index}/dim0", f"w/tile{index}/dim1"]
        assert tiles[index].versions == saved.versions and min(saved.versions) >= 0
        for field in ("exp_avg", "factors"):
            value, expected = getattr(tiles[index], field), getattr(saved, field)
            if isinstance(value, list):
                for v, e in zip(value, expected, strict=True):
                    assert torch.equal(v, e)
            else:
                assert torch.equal(value, expected)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_tile_over_two_saved_shards_is_rebuilt_from_their_statistics(name: str) -> None:
    """One (24, 12) tile from two (12, 12) tiles: the row factor is their block-diagonal, the
    column factor their sum (a mean for KL-Shampoo), the moments are stacked; the tile is then
    recomputed at once (a result of its own factors, with the saved step as its version)."""
    checkpoint, shards = _sharded_checkpoint(name, max_dim=24)
    opt, messages = _load_whole(name, checkpoint)
    assert len(messages) == 1 and "1 rebuilt" in messages[0], messages
    state = next(iter(opt.state.values()))
    (tile,) = state["tiles"]
    a, b = (next(iter(s.state.values()))["tiles"][0] for s in shards)
    assert state["step"] == 5 and tile.versions == [5, 5]  # recomputed at load
    torch.testing.assert_close(tile.factors[0], torch.block_diag(a.factors[0], b.factors[0]))
    column = (a.factors[1] + b.factors[1]) / (2 if name == "kl_shampoo" else 1)
    torch.testing.assert_close(tile.factors[1], column)
    if name == "soap":  # the moments left their eigenbases: compare in the parameter's coordinates

        def back(t: Any) -> torch.Tensor:
            return project(t.exp_avg, t.bases, back=True)

        torch.testing.assert_close(back(tile), torch.cat([back(a), back(b)]))
    else:
        torch.testing.assert_close(tile.exp_avg, torch.cat([a.exp_avg, b.exp_avg]))
    weight = opt.param_groups[0]["params"][0]
    weight.grad = _gradients(6)[-1]
    opt.step()  # and it trains on
    assert torch.isfinite(weight).all() and weight.abs().sum() > 0


def test_a_checkpoint_without_the_rows_restarts_that_tile_and_says_so() -> None:
    checkpoint, _ = _sharded_checkpoint("shampoo", max_dim=24)
    del checkpoint["state"]["w@rows12:24"]  # rows 12:24 were never saved
    opt, messages = _load_whole("shampoo", checkpoint)
    assert len(messages) == 1 and "1 restarted from zero" in messages[0]
    (tile,) = next(iter(opt.state.values()))["tiles"]
    assert float(tile.exp_avg.abs().sum()) == 0


def test_entries_a_parameter_needs() -> None:
    weight = torch.nn.Parameter(torch.zeros(ROWS, COLS))
    opt = SOAP([("w", weight)])
    saved = {"w@rows0:12", "w@rows12:24", "ghost"}
    assert opt.checkpoint_entries(saved) == saved  # a whole parameter overlaps every shard
    assert opt.checkpoint_entries({"w", "w@rows0:12"}) == {"w"}  # its own entry when saved


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_load_planner_restores_a_fresh_optimizer(tmp_path: Path) -> None:
    """One process, no process group: dcp.save of state_dict(), then a fresh optimizer (no
    state yet) loads it through OptimizerLoadPlanner and continues bit-identically."""
    grads = _gradients(10)
    torch.manual_seed(0)
    start = torch.randn(ROWS, COLS, dtype=torch.float64)

    def make() -> tuple[torch.nn.Parameter, Any]:
        weight = torch.nn.Parameter(start.clone())
        return weight, SOAP(
            [("w", weight)], lr=1e-2, precondition_frequency=2, max_preconditioner_dim=12
        )

    weight, opt = make()
    for grad in grads[:5]:
        weight.grad = grad
        opt.step()
    dcp.save({"w": weight.detach(), "optim": opt.state_dict()}, checkpoint_id=tmp_path / "c")
    for grad in grads[5:]:
        weight.grad = grad
        opt.step()

    resumed, opt2 = make()
    state = {"w": resumed.detach(), "optim": opt2.state_dict()}
    assert state["optim"]["state"] == {}
    dcp.load(state, checkpoint_id=tmp_path / "c", planner=OptimizerLoadPlanner(opt2))
    opt2.load_state_dict(state["optim"])
    for grad in grads[5:]:
        resumed.grad = grad
        opt2.step()
    assert torch.equal(resumed, weight)
