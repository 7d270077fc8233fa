"""The transfer layer's device paths, run on CPU through a simulated, slowed device
(tests/sim_device.py): a refused host registration, blocking events, copies into host memory."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from asteria_client.runtime.transfer import DeviceTransfer, is_marked_host
from asteria_client.transport.shm import ClientSegment
from asteria_server.protocol.shm import ArraySpec
from tests.sim_device import SimulatedDevice

CLIENT = Path(__file__).resolve().parents[2] / "asteria_client"


def test_every_cuda_event_the_client_creates_is_blocking() -> None:
    """A non-blocking event makes ``synchronize()`` spin a core: with 8 ranks, 8 cores the
    solvers lose. Every ``torch.cuda.Event(...)`` in the client must pass ``blocking=True``."""
    found = []
    for path in sorted(CLIENT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.cuda.Event"):
                continue
            blocking = [k for k in node.keywords if k.arg == "blocking"]
            ok = bool(blocking) and ast.unparse(blocking[0].value) == "True"
            found.append((f"{path.relative_to(CLIENT)}:{node.lineno}", ok))
    assert found, "no torch.cuda.Event found: the scan is broken"
    assert [where for where, ok in found if not ok] == []


def _segment(spec: ArraySpec) -> ClientSegment:
    return ClientSegment.create("snapshot", "blk", [spec])


def test_a_refused_registration_bounces_copies_through_pinned_memory_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """When ``cudaHostRegister`` of a segment fails, an async copy straight into the pageable
    mapping would drain the stream; the layer copies into a pinned bounce buffer instead, moves
    the bytes in when the copy is waited for, and says so once."""
    device = SimulatedDevice(delay_s=0.02, register_fails=True)
    spec = ArraySpec(np.dtype(np.float32), (16, 16))
    segment = _segment(spec)
    try:
        with caplog.at_level(logging.WARNING, logger="asteria_client.runtime.transfer"):
            for value in (1.0, 2.0):
                tensor = torch.full((16, 16), value)
                write = segment.start_write([spec], [tensor], device)
                assert segment.read([spec], segment.segment.sequence) is None  # being written
                sequence = write.finish()
                (copy,) = segment.read([spec], sequence) or [None]
                assert copy is not None and np.all(copy == value)
        warnings = [r for r in caplog.records if "cudaHostRegister" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert "bounce" in warnings[0].getMessage()
        assert device.pageable_async_copies == 0
        assert device.stats()["bounce_copies"] == 2
    finally:
        segment.close()


def test_a_registered_segment_takes_the_copy_directly() -> None:
    device = SimulatedDevice(delay_s=0.01)
    spec = ArraySpec(np.dtype(np.float32), (8, 8))
    segment = _segment(spec)
    try:
        write = segment.start_write([spec], [torch.ones(8, 8)], device)
        sequence = write.finish()
        (copy,) = segment.read([spec], sequence) or [None]
        assert copy is not None and np.all(copy == 1.0)
        assert device.stats()["bounce_copies"] == 0 and device.pageable_async_copies == 0
        assert device.stats()["registered_regions"] == 1
    finally:
        segment.close()
    assert device.stats()["registered_regions"] == 0


def test_a_snapshot_is_taken_when_asked_and_lands_in_marked_host_memory() -> None:
    for transfer in (DeviceTransfer(), SimulatedDevice(delay_s=0.02)):
        tensor = torch.arange(12.0).reshape(3, 4)
        pending = transfer.to_host(tensor, key="b")
        tensor.add_(100.0)  # after the snapshot: must not reach it
        pending.wait()
        assert is_marked_host(pending.host)
        assert torch.equal(pending.host, torch.arange(12.0).reshape(3, 4))


def test_drain_waits_for_every_copy_in_flight() -> None:
    device = SimulatedDevice(delay_s=0.05)
    copies = [device.to_host(torch.full((4,), float(i))) for i in range(3)]
    device.drain()
    assert all(c.ready() for c in copies)
    assert [float(c.host[0]) for c in copies] == [0.0, 1.0, 2.0]


def test_registered_regions_are_found_by_address() -> None:
    device = SimulatedDevice()
    buffers = [torch.empty(1024, dtype=torch.uint8) for _ in range(5)]
    for buffer in buffers[:4]:
        assert device.register(buffer)
    for buffer in buffers[:4]:
        assert device.page_locked(buffer[100:200]) and device.page_locked(buffer)
    assert not device.page_locked(buffers[4])
    device.unregister(buffers[1])
    assert not device.page_locked(buffers[1][10:20]) and device.page_locked(buffers[2])
