"""Continuous refresh across data-parallel replicas (issue 26, item 4): real gloo ranks under
DDP, each with its own slice of every batch, SOAP with ``refresh="continuous"`` and the model's
hooks attached, the embedded engine or one node daemon shared by the ranks, S = 1 and 2.

On the continuous schedule a rank pulls a block when a solver worker of its own is free and the
block's priority says so: its own timing. Each block's owner alone chooses those extra pulls,
and the step-start agreement round tells the other replicas which versions it took, so every
replica registers them (and their deadlines) at the same step and installs their results at
the same agreed step. The floor pulls (every f steps) follow the registered snapshots, so they
are equal on every replica too. Before, continuous refresh was refused in a torch.distributed
job (these tests failed at the optimizer's construction); each rank choosing by its own
credit would part the replicas at the first refresh they pulled at different steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asteria_client import SOAP
from asteria_server.engine import EngineConfig
from tests.distributed import test_replicas_agree as agree
from tests.distributed.spawn import spawn
from tests.integration.test_daemon import LaunchedDaemon, start_daemon, stop_daemon

FREQUENCY = 5  # floors every 5 steps: room for extra pulls between them
#: the share of the step the extra refreshes may take: this toy's steps last milliseconds,
#: and at the default 4% a snapshot's copy alone would use the budget up (few extra pulls)
OVERHEAD = 0.5


def _optimizer(
    model: torch.nn.Module, mode: str, budget: int, address: str, refresh: str = "continuous"
) -> Any:
    kwargs: dict[str, Any] = {"mode": mode, "precondition_frequency": FREQUENCY}
    if mode == "embedded":
        kwargs["engine_config"] = EngineConfig(num_workers=1, calibrate=False)
    if mode == "daemon":
        kwargs["address"] = address
    if mode != "native":
        kwargs["staleness_budget"] = budget
        kwargs["refresh"] = refresh
        if refresh == "continuous":
            kwargs["refresh_overhead"] = OVERHEAD
    return SOAP(model.named_parameters(), lr=1e-2, **kwargs)


@pytest.fixture(scope="module")
def node_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedDaemon]:
    daemon = start_daemon(tmp_path_factory.mktemp("node"))
    yield daemon
    stop_daemon(daemon)


def _check(tmp_path: Path, world: int, budget: int, mode: str, address: str = "") -> None:
    """test_replicas_agree's checks (bitwise equal, agreement, budget, loss within noise of
    one process), then the continuous schedule's: every replica registered the same pulls."""
    runs = agree._check(tmp_path, world, budget, mode, address, _optimizer, FREQUENCY)
    pulls = []
    for run in runs:
        blocks = run["stats"]["refreshes"]["blocks"]
        pulls.append({b: (r["floor_pulls"], r["extra_pulls"]) for b, r in blocks.items()})
        versions = {r["block"]: (r["version"], r["submitted_version"]) for r in run["status"]}
        assert versions == {
            row["block"]: (row["version"], row["submitted_version"]) for row in runs[0]["status"]
        }  # every replica: the same version in use and the same newest snapshot
    # every replica registered the same pulls (the chooser's extras included) ...
    assert all(p == pulls[0] for p in pulls), pulls
    # ... and the schedule did pull extra refreshes, on more than one chooser's blocks
    extra = [b for b, (_, e) in pulls[0].items() if e > 0]
    assert len(extra) >= 2, pulls[0]
    owners = {row["block"]: row.get("owner_rank") for row in runs[0]["status"]}
    if mode == "embedded":
        assert len({owners[b] for b in extra}) >= 2, (owners, extra)
    stats = runs[0]["stats"]
    print(
        f"pulls (floor, extra) per block: {pulls[0]}; owners {owners}; pulls registered "
        f"{stats['agreement_pulls']}, of them held by all when reported "
        f"{stats['agreement_pulls_held_by_all']}; forced rounds "
        f"{stats['agreement_forced_rounds']}; held steps {stats['agreement_held_steps']}"
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("budget", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_embedded_ddp_replicas_stay_bitwise_identical_on_the_continuous_schedule(
    tmp_path: Path, world: int, budget: int
) -> None:
    spawn(agree._replica, world, str(tmp_path), "embedded", budget, "", _optimizer, True)
    _check(tmp_path, world, budget, "embedded")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("budget", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_daemon_ddp_replicas_stay_bitwise_identical_on_the_continuous_schedule(
    tmp_path: Path, world: int, budget: int, node_daemon: LaunchedDaemon
) -> None:
    spawn(
        agree._replica, world, str(tmp_path), "daemon", budget, node_daemon.target, _optimizer, True
    )
    _check(tmp_path, world, budget, "daemon", node_daemon.target)
    for rank in range(world):  # each rank uploads the blocks it chooses, expects the others
        source = torch.load(tmp_path / f"replica{rank}.pt", weights_only=False)["stats"]["source"]
        assert source["snapshots_uploaded"] > 0 and source["snapshots_left_to_peers"] > 0


# --------------------------------------------------------------------------- HSDP


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("budget", [1, 2])
@pytest.mark.parametrize("mode", ["embedded", "daemon"])
def test_hsdp_shard_replicas_stay_bitwise_identical_on_the_continuous_schedule(
    tmp_path: Path, mode: str, budget: int, request: pytest.FixtureRequest
) -> None:
    """HSDP 2 x 2, embedded or one node daemon, S = 1 and 2: each shard block's owner among
    its two replicas chooses its extra pulls, and both replicas of a shard register and install
    them together."""
    address = request.getfixturevalue("node_daemon").target if mode == "daemon" else ""
    spawn(agree._hsdp_replica, 4, str(tmp_path), mode, budget, address, _optimizer, True)
    runs = [torch.load(tmp_path / f"replica{r}.pt", weights_only=False) for r in range(4)]
    for a, b in ((0, 2), (1, 3)):  # the replicas of one shard
        for key, value in runs[a]["params"].items():
            other = runs[b]["params"][key]
            assert torch.equal(value, other), (
                f"ranks {a} and {b} hold the same shard of {key}; they differ by "
                f"{(value - other).abs().max().item():.3g} (continuous)"
            )
        pulls = [
            {k: r["extra_pulls"] for k, r in runs[i]["stats"]["refreshes"]["blocks"].items()}
            for i in (a, b)
        ]
        assert pulls[0] == pulls[1] and sum(pulls[0].values()) > 0, pulls
    for run in runs:
        assert run["stats"]["agreement_failed"] == "" and run["stats"]["agreement_rounds"] > 0
        assert run["stats"]["max_lag_steps"] <= budget * FREQUENCY
    losses = runs[0]["losses"]
    assert losses[-1] < 0.7 * losses[0]
