"""Checkpoints across world sizes with torch.distributed.checkpoint (DCP), on real gloo ranks:
saved by 2 DDP or FSDP2 ranks, resumed by 1 and by 4, compared with the run that never stopped."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from asteria_client import SOAP
from asteria_client.optim.checkpoint import OptimizerLoadPlanner

from . import spawn

SAVED_WORLD = 2
STEPS = 8  # before the checkpoint, and again after it
SAMPLES = 32  # the global batch, split over the ranks
RESHARD_WARNING = "saved with another shard geometry"


def _wrap(net: torch.nn.Module, strategy: str) -> torch.nn.Module:
    if strategy == "ddp":
        return torch.nn.parallel.DistributedDataParallel(net)
    return spawn.shard(net)


def _optimizer(net: torch.nn.Module) -> SOAP:
    # (24, 24) weights, tiles of 12 rows: 2 FSDP2 ranks hold one shard of 12 rows each
    return SOAP(
        net.named_parameters(),
        lr=1e-2,
        precondition_frequency=3,
        max_preconditioner_dim=12,
        mode="native",
    )


def _versions(opt: SOAP) -> dict[str, int]:
    return {row["block"]: row["version"] for row in opt.preconditioner_status()}


def _save_rank(rank: int, world: int, tmp: str, strategy: str) -> None:
    """Train STEPS, save, train STEPS more: the checkpoint and the uninterrupted run."""
    spawn.init(rank, world, tmp, "save")
    try:
        net = spawn.model()
        wrapped = _wrap(net, strategy)
        opt = _optimizer(net)
        data = spawn.batches(2 * STEPS, SAMPLES)
        spawn.train(wrapped, opt, data[:STEPS], rank, world)
        state = {"model": get_model_state_dict(net), "optim": opt.state_dict()}
        dcp.save(state, checkpoint_id=f"{tmp}/checkpoint")
        versions = _versions(opt)
        losses = spawn.train(wrapped, opt, data[STEPS:], rank, world)
        torch.save({"losses": losses, "versions": versions}, f"{tmp}/saved{rank}.pt")
        del wrapped, opt
    finally:
        spawn.finish()


def _resume_rank(rank: int, world: int, tmp: str, strategy: str) -> None:
    spawn.init(rank, world, tmp, f"resume{world}")
    try:
        net = spawn.model()
        with torch.no_grad():  # weights unlike the saved ones: all must come from the checkpoint
            for p in net.parameters():
                p.add_(0.5)
        wrapped = _wrap(net, strategy)
        opt = _optimizer(net)
        state = {"model": get_model_state_dict(net), "optim": opt.state_dict()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcp.load(state, checkpoint_id=f"{tmp}/checkpoint", planner=OptimizerLoadPlanner(opt))
            set_model_state_dict(net, state["model"])
            opt.load_state_dict(state["optim"])
        versions = _versions(opt)
        data = spawn.batches(2 * STEPS, SAMPLES)
        losses = spawn.train(wrapped, opt, data[STEPS:], rank, world)
        record = {
            "losses": losses,
            "versions": versions,
            "warnings": [str(w.message) for w in caught if RESHARD_WARNING in str(w.message)],
            "step": max(s["step"] for s in opt.state.values()),
        }
        torch.save(record, f"{tmp}/resumed{world}-{rank}.pt")
        del wrapped, opt
    finally:
        spawn.finish()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The folder of a checkpoint saved by 2 ranks of ``strategy`` (made once per strategy)."""
    made: dict[str, Path] = {}

    def get(strategy: str) -> Path:
        if strategy not in made:
            folder = tmp_path_factory.mktemp(f"dcp-{strategy}")
            spawn.spawn(_save_rank, SAVED_WORLD, str(folder), strategy)
            made[strategy] = folder
        return made[strategy]

    return get


def _resume(folder: Path, strategy: str, world: int) -> tuple[dict[str, Any], list[Any]]:
    spawn.spawn(_resume_rank, world, str(folder), strategy)
    saved = [torch.load(folder / f"saved{r}.pt") for r in range(SAVED_WORLD)]
    resumed = [torch.load(folder / f"resumed{world}-{r}.pt") for r in range(world)]
    return {"losses": saved[0]["losses"], "versions": saved}, resumed


@pytest.mark.slow  # 17-26 s each on a busy 2-core host (the first one also saves)
@pytest.mark.parametrize("world", [1, 4])
def test_ddp_checkpoint_resumes_at_another_world_size(
    checkpoint: Callable[[str], Path], world: int
) -> None:
    """Replicated state: every rank gets every block back as saved, installed results with
    their versions; training goes on as if it had never stopped."""
    saved, resumed = _resume(checkpoint("ddp"), "ddp", world)
    saved_versions = saved["versions"][0]["versions"]
    assert saved_versions and min(saved_versions.values()) >= 0
    for record in resumed:
        assert record["versions"] == saved_versions  # names, results and versions as saved
        assert record["warnings"] == []
        assert record["step"] == 2 * STEPS
        torch.testing.assert_close(record["losses"], saved["losses"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("world", [1, pytest.param(4, marks=pytest.mark.slow)])  # 4: 22-27 s
def test_fsdp2_checkpoint_resumes_at_another_world_size(
    checkpoint: Callable[[str], Path], world: int
) -> None:
    """Sharded state: each rank takes the saved shards that overlap its rows. At world size 1 a
    tile of 12 rows is a saved tile (kept: results and versions intact); at 4 the shards are 6
    rows, rebuilt from the saved factors and moments and recomputed at load. One warning per
    load says so, and the loss goes on where the uninterrupted run's does."""
    saved, resumed = _resume(checkpoint("fsdp"), "fsdp", world)
    saved_versions: dict[str, int] = {}
    for rank_record in saved["versions"]:
        saved_versions.update(rank_record["versions"])
    assert set(saved_versions) == {
        f"{w}.weight@rows{a}:{a + 12}/tile{t}/dim{d}"
        for w in (0, 2)
        for a in (0, 12)
        for t in (0, 1)
        for d in (0, 1)
    }
    rows = 24 // world
    for rank, record in enumerate(resumed):
        assert len(record["warnings"]) == 1, record["warnings"]  # once, not per block
        assert record["step"] == 2 * STEPS
        blocks = record["versions"]
        assert all(f"@rows{rank * rows}:{(rank + 1) * rows}/" in b for b in blocks)
        if world == 1:  # the same tiles under new names: the saved results, versions included
            # 2 weights x 4 tiles of 12 rows; the 2 biases' moments are joined ("rebuilt")
            assert "8 kept as saved" in record["warnings"][0]
            assert sorted(blocks.values()) == sorted(saved_versions.values())
        else:  # rebuilt and recomputed at load, from the saved step's factors
            # per rank: 2 weights x 2 tiles of 6 rows, and 2 biases (moments only)
            assert "6 rebuilt" in record["warnings"][0]
            # a rank loads only the saved shard that holds its rows
            other = "rows12:24" if rank < 2 else "rows0:12"
            assert other not in record["warnings"][0]
            assert set(blocks.values()) == {STEPS}
    losses, reference = resumed[0]["losses"], saved["losses"]
    # the first loss after resuming is the saved weights' own: equal
    assert losses[0] == pytest.approx(reference[0], rel=1e-5)
    if world == 1:
        torch.testing.assert_close(losses, reference, rtol=1e-4, atol=1e-6)
    # no spike: every later step within a few percent of the run that never stopped
    for step, (loss, ref) in enumerate(zip(losses, reference, strict=True)):
        assert loss < 1.05 * ref, (step, losses, reference)
    assert losses[-1] < losses[0]
