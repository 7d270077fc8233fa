"""The transfer layer's device paths, run on CPU through a simulated, slowed device
(tests/sim_device.py): blocking events, packed snapshots, staged results."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import torch

from asteria_client.runtime.transfer import DeviceTransfer, is_marked_host
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


def test_a_pack_is_one_copy_per_device_and_dtype_taken_when_asked() -> None:
    """A step's snapshots leave the device in one copy (per dtype), whatever their number;
    each is a view of the one pinned buffer, holding the value it had when packed."""
    for transfer in (DeviceTransfer(), SimulatedDevice(delay_s=0.02)):
        tensors = [torch.full((n, n), float(n)) for n in (3, 5, 8, 8, 2)]
        tensors.append(torch.arange(6, dtype=torch.float64).reshape(2, 3))
        copies = transfer.pack(tensors)
        for tensor in tensors:
            tensor.add_(100.0)  # after the pack: must not reach it
        assert transfer.stats()["copies_d2h"] == 2  # float32 and float64
        for copy, tensor in zip(copies, tensors, strict=True):
            copy.wait()
            assert is_marked_host(copy.host)
            assert copy.host.shape == tensor.shape and copy.host.dtype == tensor.dtype
            assert torch.equal(copy.host, tensor - 100.0)
        floats = [c.host for c in copies[:5]]
        assert len({t.untyped_storage().data_ptr() for t in floats}) == 1  # one buffer


def test_a_staged_result_is_one_host_copy_and_one_device_copy() -> None:
    """A result's arrays go into one pinned buffer where they arrive (one host copy), and
    cross to the device in one copy, as typed views with their shapes."""
    device = SimulatedDevice()
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((5, 5)).astype(np.float32)
    eigenvalues = rng.standard_normal(5).astype(np.float32)
    permutation = np.array([4, 0, 3, 1, 2], dtype=np.int64)
    arrays = [matrix, eigenvalues, permutation, None]
    specs = [(a.dtype, a.shape) for a in arrays if a is not None]

    def fill(outs: list[np.ndarray]) -> bool:
        for out, array in zip(outs, [a for a in arrays if a is not None], strict=True):
            np.copyto(out, array)
        return True

    staged = device.stage(specs, torch.device("cpu"), fill)
    assert staged is not None and staged.buffer is not None and device.pinned(staged.buffer)
    staged.arrays.append(None)  # the rotation this result lacks
    out = device.staged_to_device(staged, torch.device("cpu"))
    assert out[3] is None
    for got, want in zip(out[:3], arrays[:3], strict=True):
        assert got is not None and want is not None
        assert got.dtype == torch.from_numpy(want).dtype and tuple(got.shape) == want.shape
        assert np.array_equal(got.numpy(), want)
    stats = device.stats()
    assert stats["result_host_copies"] == 1 and stats["copies_h2d"] == 1
    assert device.pageable_device_copies == 0
    assert device.stage(specs, torch.device("cpu"), lambda outs: False) is None  # overwritten
    assert device.stats()["result_host_copies"] == 1


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
