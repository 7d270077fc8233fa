"""A simulated, slowed device for the transfer layer, so that its CUDA-only paths run on CPU.

:class:`SimulatedDevice` is a :class:`DeviceTransfer` whose CPU tensors count as device
tensors: a device-to-host copy takes its snapshot at once (as the real layer's clone on the
main stream does), then lands in the destination on a thread of its own after ``delay_s``
(the side stream), and its event's ``synchronize`` waits for that thread. Only the CUDA
primitives are replaced; the logic under test (packing, staging, waiting for copies before
close, who waits under which lock) is the real layer's.

Results go the other way as if to a device too: a host-to-device copy is a clone of the pinned
buffer (counted, so a test sees one per result).

``on_wait`` (optional) is called on the waiting thread each time a copy's event is waited
for: a test uses it to look at what that thread holds while it waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from asteria_client.runtime.transfer import DeviceTransfer


class SimulatedEvent:
    """What the layer needs of a CUDA event: ``query`` and ``synchronize``."""

    def __init__(self, on_wait: Callable[[], None] | None) -> None:
        self.done = threading.Event()
        self._on_wait = on_wait

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        if self._on_wait is not None and not self.done.is_set():
            self._on_wait()
        self.done.wait()


class SimulatedDevice(DeviceTransfer):
    """See the module docstring. Results for any device count as crossing to a device: a
    host-to-device copy is a clone, complete at once (the main stream's wait is the device's
    business, not the host's)."""

    def __init__(
        self,
        *,
        delay_s: float = 0.0,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.on_wait = on_wait
        self.log: list[tuple[str, Any]] = []  # ("copied", data_ptr)
        self.log_lock = threading.Lock()
        self._pinned_ptrs: set[int] = set()
        self.pageable_async_copies = 0  # async copies into pageable memory: a draining stream
        self.pageable_device_copies = 0  # the same, host to device

    def on_device(self, tensor: torch.Tensor) -> bool:
        return True

    def to_accelerator(self, device: torch.device) -> bool:
        return True

    def _host_empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self._pinned_ptrs.add(tensor.data_ptr())
        return tensor

    def pinned(self, host: torch.Tensor) -> bool:
        """Whether ``host`` lies in a buffer this device's ``_host_empty`` made."""
        return host.data_ptr() in self._pinned_ptrs or (
            host._base is not None and host._base.data_ptr() in self._pinned_ptrs
        )

    def _copy_async(
        self, tensor: torch.Tensor, host: torch.Tensor, *, owned: bool = False
    ) -> SimulatedEvent:
        if not self.pinned(host):
            self.pageable_async_copies += 1
        snapshot = tensor.detach() if owned else tensor.detach().clone()
        event = SimulatedEvent(self.on_wait)

        def land() -> None:
            time.sleep(self.delay_s)
            host.copy_(snapshot)
            with self.log_lock:
                self.log.append(("copied", host.data_ptr()))
            event.done.set()

        threading.Thread(target=land, name="simulated-side-stream", daemon=True).start()
        return event

    def _copy_to_device(
        self, host: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, SimulatedEvent]:
        if not self.pinned(host):
            self.pageable_device_copies += 1
        event = SimulatedEvent(None)
        event.done.set()
        return host.clone(), event
