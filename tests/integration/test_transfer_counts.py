"""The transfer layer's counters over real training steps, on CPU with a simulated device
(tests/sim_device.py: every tensor counts as device memory, so the device paths run) and real
sources around it: an embedded engine, and a real daemon over shared memory and over gRPC.

- **per refresh, one device-to-host copy** (per device and dtype), not one per block: a step
  that publishes snapshots packs them all (``DeviceTransfer.pack``), at 4 blocks as at 12;
- **per install, one host copy per result**: the thread that receives a result stages it once
  into pinned memory (a segment read, or the assembly of its gRPC chunks, lands there), and
  the training thread issues one host-to-device copy for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asteria_client import SOAP, Shampoo
from asteria_client.optim.base import AsteriaOptimizer
from asteria_client.runtime.embedded import EmbeddedSource, EngineConfig
from asteria_client.runtime.source import PreconditionerRequest
from asteria_client.transport import DaemonClientConfig, DaemonSource
from asteria_server.types import SolveKind
from tests.integration.test_daemon import Daemon, start_daemon, stop_daemon
from tests.sim_device import SimulatedDevice

MODES = ("embedded", "daemon-shm", "daemon-grpc")
LAYERS = (2, 6)  # 4 and 12 preconditioned blocks
STEPS = 9
FREQUENCY = 2
WAIT_S = 30.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("counts"))
    yield d
    stop_daemon(d)


def _source(mode: str, daemon: Daemon, device: SimulatedDevice) -> Any:
    if mode == "embedded":
        return EmbeddedSource(EngineConfig(num_workers=1, calibrate=False), transfer=device)
    config = DaemonClientConfig(shared_memory=mode == "daemon-shm")
    source = DaemonSource(daemon.target, config=config, transfer=device)
    assert source.wait_connected(WAIT_S)
    return source


def _installs(opt: AsteriaOptimizer) -> int:
    return sum(e.installs for e in opt.runtime.refresh_log.blocks.values())


def _settle(opt: AsteriaOptimizer) -> None:
    """Let every result in flight arrive (so each is installed, none replaced unread)."""
    deadline = time.monotonic() + WAIT_S
    rows = opt.preconditioner_status()
    while any(opt.source.in_flight_version(r["block"]) is not None for r in rows):
        assert time.monotonic() < deadline, "results did not arrive"
        opt.source.pump()  # hands snapshots whose (simulated) copies landed to the engine
        time.sleep(0.01)


def _run(
    name: str, mode: str, layers: int, daemon: Daemon
) -> tuple[list[dict[str, int]], dict[str, int]]:
    """Per step: D2H copies made in it, whether it published, results installed in it; and
    the device's counters at the end (results are staged where they arrive, which may be
    between steps)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(layers)])
    device = SimulatedDevice()
    optimizer = {"SOAP": SOAP, "Shampoo": Shampoo}[name]
    opt = optimizer(
        model.named_parameters(),
        mode="embedded" if mode == "embedded" else "daemon",
        source=_source(mode, daemon, device),
        precondition_frequency=FREQUENCY,
        staleness_budget=4,
    )
    gen = torch.Generator().manual_seed(1)
    out = []
    try:
        for _ in range(STEPS):
            before, installs = device.stats(), _installs(opt)
            published = sum(max(0, r["submitted_version"]) for r in opt.preconditioner_status())
            model(torch.randn(16, 8, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            after = device.stats()
            out.append(
                {
                    "d2h": after["copies_d2h"] - before["copies_d2h"],
                    "published": sum(
                        max(0, r["submitted_version"]) for r in opt.preconditioner_status()
                    )
                    != published,
                    "installs": _installs(opt) - installs,
                }
            )
            _settle(opt)
        opt.pump()  # the last refresh's results: installed as a hook would
        # every result that arrived was staged once: the daemon may deliver one twice (a
        # resumed stream), the copy is paid and the result dropped; embedded stages at take
        stats = opt.source.stats()
        arrived = stats.get("results_received", _installs(opt))
        return out, {**device.stats(), "installed": _installs(opt), "arrived": arrived}
    finally:
        opt.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["SOAP", "Shampoo"])
def test_a_refresh_is_one_device_to_host_copy_and_an_install_one_host_copy(
    name: str, mode: str, daemon: Daemon
) -> None:
    for layers in LAYERS:
        steps, totals = _run(name, mode, layers, daemon)
        publishing = [s for s in steps if s["published"]]
        assert len(publishing) >= 3, steps  # the run refreshed: the counts below say something
        # one pack per publishing step (SOAP's matrices and bases share a dtype: one copy)
        assert [s["d2h"] for s in publishing] == [1] * len(publishing), (layers, steps)
        assert all(s["d2h"] == 0 for s in steps if not s["published"]), (layers, steps)
        installed = totals["installed"]
        assert installed >= 4 * layers, (layers, steps)  # every block installed several times
        # one host copy per result that arrived, one host-to-device copy per install
        assert totals["arrived"] >= installed, (layers, totals)
        assert totals["result_host_copies"] == totals["arrived"], (layers, totals, steps)
        assert totals["copies_h2d"] == installed, (layers, totals, steps)


def test_the_embedded_engines_results_are_staged_off_the_training_thread() -> None:
    """The engine tells the embedded source of each new result; a thread of the source copies
    it into pinned staging then, so ``take`` (the training thread) only issues the
    host-to-device copy."""
    device = SimulatedDevice()
    threads: list[str] = []
    stage_arrays = device.stage_arrays

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return stage_arrays(*args, **kwargs)

    device.stage_arrays = recording  # type: ignore[method-assign]
    source = EmbeddedSource(EngineConfig(num_workers=1, calibrate=False), transfer=device)
    try:
        a = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
        source.submit(
            PreconditionerRequest(
                block="b", version=1, kind=SolveKind.INVERSE_ROOT, matrix=a @ a.T + torch.eye(8)
            )
        )
        deadline = time.monotonic() + WAIT_S
        while device.stats()["result_host_copies"] < 1:
            assert time.monotonic() < deadline, "the result was never staged"
            source.pump()  # the snapshot's (simulated) copy landed: to the engine
            time.sleep(0.01)
        result = source.take("b")
        assert result is not None and result.version == 1
        assert threads == ["asteria-embedded-staging"], threads
        stats = device.stats()
        assert stats["result_host_copies"] == 1 and stats["copies_h2d"] == 1, stats
    finally:
        source.close()
