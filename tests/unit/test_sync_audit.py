"""HostSyncAudit on CPU: what it counts as a host sync on a device, and what it does not."""

from __future__ import annotations

import threading

import torch

from asteria_client.runtime.sync_audit import HostSyncAudit
from asteria_client.runtime.transfer import DeviceTransfer, mark_host


def test_it_counts_every_kind_of_host_sync_on_a_device_tensor() -> None:
    t = torch.arange(6.0)
    one = torch.ones(1)
    audit = HostSyncAudit("cpu")
    with audit:
        t.sum().item()
        bool(one)
        int(one)
        float(one)
        t.tolist()
        t.numpy()
        t.cpu()
        t.to("cpu")
        t.to(device="cpu")
        t.nonzero()
        torch.masked_select(t, t > 2)
        t[t > 2]
        torch.where(t > 2)
        torch.unique(t)
        torch.equal(t, t)
        mark_host(torch.empty(6)).copy_(t)  # a blocking copy into host memory
        square = torch.eye(3, dtype=torch.float64)
        torch.linalg.eigh(square)  # ATen reads the solver's info on the host
        torch.linalg.eigvalsh(square)
        torch.linalg.qr(square)  # no info read (but in debug builds): not counted
    assert audit.counts == {
        "item": 1,
        "__bool__": 1,
        "__int__": 1,
        "__float__": 1,
        "tolist": 1,
        "numpy": 1,
        "cpu": 1,
        "to": 2,
        "nonzero": 1,
        "masked_select": 1,
        "__getitem__": 1,
        "where": 1,
        "unique": 1,
        "equal": 1,
        "copy_": 1,
        "linalg_eigh": 1,
        "linalg_eigvalsh": 1,
    }, audit.counts
    assert "test_sync_audit.py" in audit.report()


def test_it_does_not_count_device_work_host_memory_or_the_transfer_layer() -> None:
    t = torch.arange(6.0)
    audit = HostSyncAudit("cpu")
    with audit:
        (t * 2).sum()
        t.to(t.device)  # the tensor's own device: on a GPU, the GPU
        t.to(torch.float64)
        t[torch.tensor([0, 2])]  # integer indexing: no size to learn
        torch.where(t > 2, t, -t)
        t.to("cpu", non_blocking=True)
        pending = DeviceTransfer().to_host(t)  # the transfer layer's copy
        pending.host.numpy()  # host memory it made: the host reading host memory
        pending.host.tolist()
        mark_host(torch.empty(6)).copy_(t, non_blocking=True)
    assert audit.total == 0, audit.report()


def test_it_counts_on_the_thread_that_entered_it_only() -> None:
    audit = HostSyncAudit("cpu")
    with audit:
        worker = threading.Thread(target=lambda: torch.ones(1).item())
        worker.start()
        worker.join()
    assert audit.total == 0
