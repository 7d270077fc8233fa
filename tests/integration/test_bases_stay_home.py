"""A basis never travels back to the engine that produced it (embedded mode, a real engine;
and a real daemon, over shared memory and over gRPC).

SOAP's refresh is one QR step from the basis in use. That basis is a result the engine
delivered and still holds (its newest good result per block), so the request names it by
version instead of copying it from the device: only the factor leaves the device. Where the
engine no longer holds that version (a local fallback, a checkpoint loaded) the basis goes
with the request, as before. A daemon over shared memory does not even read it itself: its
solver worker reads the basis from the client's result segment, where the daemon's previous
result of the block lies (``SolveTask.shm_basis``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asteria_client import SOAP
from asteria_client.runtime.embedded import EngineConfig
from asteria_client.transport import DaemonClientConfig, DaemonSource
from tests.integration.test_daemon import Daemon, start_daemon, stop_daemon

STEPS = 12


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(3)])


def _train(
    *, reuse: bool, steps: int = STEPS, daemon: DaemonSource | None = None
) -> tuple[torch.nn.Module, SOAP, list[int]]:
    """Train at S = 0 (deterministic: each refresh is installed in the step it is due);
    returns the model, the optimizer (open) and the tensors copied to the host per step.
    ``daemon``: the source (a daemon's), else embedded."""
    model = _model()
    where: dict[str, Any] = {"mode": "embedded"}
    if daemon is not None:
        where = {"mode": "daemon", "source": daemon}
    opt = SOAP(
        model.named_parameters(),
        precondition_frequency=2,
        staleness_budget=0,
        engine_config=EngineConfig(num_workers=1, calibrate=False),
        **where,
    )
    if not reuse:
        opt.runtime._reuses_bases = False  # the control: every request carries its basis
    gen = torch.Generator().manual_seed(1)
    copied = []
    for _ in range(steps):
        before = _to_host(opt)
        model(torch.randn(16, 8, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        copied.append(_to_host(opt) - before)
    return model, opt, copied


def _to_host(opt: SOAP) -> int:
    source: Any = opt.source
    if isinstance(source, DaemonSource):
        return int(source._transfer.stats()["tensors_to_host"])
    return int(source.stats()["transfer"]["tensors_to_host"])


def test_a_refresh_sends_the_factor_alone_and_trains_exactly_as_with_the_basis() -> None:
    kept, opt, copied = _train(reuse=True)
    try:
        left_home = opt.runtime.stats()["bases_left_home"]
        engine: Any = opt.source.engine  # type: ignore[attr-defined]
        reused = engine.bases_reused
    finally:
        opt.close()
    sent, control, control_copied = _train(reuse=False)
    control.close()
    # 6 blocks (3 layers, 2 dims each), refreshed at steps 1, 3, 5, ...: all but the first
    # refresh of each block leave the basis home
    assert left_home > 0 and reused == left_home, (left_home, reused)
    assert sum(copied) + left_home == sum(control_copied), (copied, control_copied)
    for a, b in zip(kept.parameters(), sent.parameters(), strict=True):
        assert torch.equal(a, b)  # the engine's copy of the basis is the client's, bit for bit


def test_after_a_checkpoint_is_loaded_the_basis_travels_again() -> None:
    model, opt, _ = _train(reuse=True, steps=6)
    try:
        state = opt.state_dict()
        opt.load_state_dict(state)
        left_home = opt.runtime.stats()["bases_left_home"]
        gen = torch.Generator().manual_seed(2)
        for _ in range(2):  # one refresh: every basis in use came from the checkpoint
            model(torch.randn(16, 8, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt.runtime.stats()["bases_left_home"] == left_home
        for _ in range(4):  # installed from the engine again: they stay home once more
            model(torch.randn(16, 8, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt.runtime.stats()["bases_left_home"] > left_home
    finally:
        opt.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(Path(tmp_path_factory.mktemp("bases")))
    yield d
    stop_daemon(d)


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_daemon_refreshes_from_its_own_result_and_trains_exactly_as_with_the_basis(
    daemon: Daemon, transport: str
) -> None:
    """Daemon SOAP: every refresh after a block's first leaves its basis on the device (one
    tensor fewer per block and refresh), and the run is the one that sends every basis, bit
    for bit, so the daemon refreshed from the very basis in use (a full eigendecomposition
    instead would not be the same numbers)."""
    config = DaemonClientConfig(shared_memory=transport == "shm")
    kept, opt, copied = _train(reuse=True, daemon=DaemonSource(daemon.target, config=config))
    try:
        left_home = opt.runtime.stats()["bases_left_home"]
    finally:
        opt.close()
    control_source = DaemonSource(daemon.target, config=config)
    sent, control, control_copied = _train(reuse=False, daemon=control_source)
    control.close()
    assert left_home > 0, left_home
    assert sum(copied) + left_home == sum(control_copied), (copied, control_copied)
    for a, b in zip(kept.parameters(), sent.parameters(), strict=True):
        assert torch.equal(a, b)
