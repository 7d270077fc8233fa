"""The CUDA paths: the transfer layer's side stream, registered segments, and the optimizers on a
GPU in every mode. Marked ``gpu``: skipped (by tests/conftest.py) where CUDA is absent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from asteria_client import SOAP, Shampoo
from asteria_client.runtime.transfer import DeviceTransfer
from asteria_client.transport import DaemonSource
from asteria_client.transport.shm import ClientSegment
from asteria_server.engine import EngineConfig
from asteria_server.protocol.shm import ArraySpec

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def test_to_host_takes_the_tensor_as_it_was_when_called() -> None:
    transfer = DeviceTransfer()
    tensor = torch.randn(512, 512, device=CUDA)
    expected = tensor.cpu()
    pending = transfer.to_host(tensor, key="b")
    tensor.add_(1.0)  # on the main stream, right after: must not reach the snapshot
    pending.wait()
    assert pending.event is not None and pending.host.is_pinned()
    assert torch.equal(pending.host, expected)
    again = transfer.to_host(tensor, key="b")  # the pinned buffer is reused for the key
    again.wait()
    assert again.host.data_ptr() == pending.host.data_ptr()
    assert torch.equal(again.host, expected + 1.0)


def test_to_device_results_are_ready_for_the_main_stream() -> None:
    transfer = DeviceTransfer()
    for value in (1.0, 2.0, 3.0):  # one staging buffer, reused
        array = np.full((256, 256), value, dtype=np.float32)
        out = transfer.to_device(array, CUDA, key="blk/matrix")
        doubled = out * 2  # the main stream waits on the copy's event, not the host
        assert doubled.device.type == "cuda"
        assert torch.equal(doubled.cpu(), torch.full((256, 256), 2 * value))
    assert transfer.stats()["copies_h2d"] == 3 and transfer.stats()["pinned_buffers"] == 1


def test_a_device_snapshot_lands_in_a_registered_segment_under_the_seqlock() -> None:
    transfer = DeviceTransfer()
    spec = ArraySpec(np.dtype(np.float32), (300, 300))
    segment = ClientSegment.create("snapshot", "blk", [spec])
    try:
        tensor = torch.randn(300, 300, device=CUDA)
        write = segment.start_write([spec], [tensor], transfer)
        assert segment.read([spec], segment.segment.sequence) is None  # odd: being written
        sequence = write.finish()
        assert write.finish() == sequence  # once, whoever asks
        copies = segment.read([spec], sequence)
        assert copies is not None and np.array_equal(copies[0], tensor.cpu().numpy())
        assert transfer.stats()["registered_regions"] == 1
    finally:
        segment.close()


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32)
    ).to(device)


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 8, batch: int = 16
) -> None:
    g = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randn(batch, 32, generator=g).to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("optimizer", [SOAP, Shampoo])
def test_native_on_cuda_matches_native_on_cpu(optimizer: type) -> None:
    """Across devices the gradients differ by rounding, which a rank-deficient factor (batch <
    dim) turns into arbitrary rotations of its null space: full-rank factors here (batch 256),
    so that the eigenbases are defined and the runs comparable."""
    gpu, cpu = _model(CUDA), _model(torch.device("cpu"))
    opt_gpu = optimizer(gpu.named_parameters(), mode="native", precondition_frequency=2)
    opt_cpu = optimizer(cpu.named_parameters(), mode="native", precondition_frequency=2)
    _train(gpu, opt_gpu, batch=256)
    _train(cpu, opt_cpu, batch=256)
    # On the H200: SOAP's largest difference after 8 steps was 2.1e-4 (14 of 1024 weights above
    # 1e-4), from float32 rounding of different kernels; a wrong path is off by far more.
    for a, b in zip(gpu.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-3, atol=1e-3)


def test_embedded_on_cuda_at_budget_zero_matches_native() -> None:
    native, embedded = _model(CUDA), _model(CUDA)
    _train(native, SOAP(native.named_parameters(), mode="native", precondition_frequency=2))
    opt = SOAP(
        embedded.named_parameters(),
        mode="embedded",
        staleness_budget=0,
        precondition_frequency=2,
        engine_config=EngineConfig(num_workers=1),
    )
    opt.attach(embedded)
    try:
        _train(embedded, opt)
        assert opt.source.stats()["transfer"]["copies_d2h"] > 0
    finally:
        opt.close()
    for a, b in zip(native.parameters(), embedded.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[object]:
    from tests.integration.test_daemon import start_daemon, stop_daemon

    d = start_daemon(tmp_path)
    yield d
    stop_daemon(d)


def test_daemon_on_cuda_over_shared_memory_matches_native(daemon: object) -> None:
    native, remote = _model(CUDA), _model(CUDA)
    _train(native, SOAP(native.named_parameters(), mode="native", precondition_frequency=2))
    source = DaemonSource(daemon.target)  # type: ignore[attr-defined]
    opt = SOAP(
        remote.named_parameters(), source=source, staleness_budget=0, precondition_frequency=2
    )
    try:
        _train(remote, opt)
        stats = source.stats()
        assert stats["transport"] == "shm" and stats["shm_snapshots"] > 0
        assert stats["submits_rejected"] == 0
    finally:
        opt.close()
    for a, b in zip(native.parameters(), remote.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
