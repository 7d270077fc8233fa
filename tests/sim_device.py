"""A simulated, slowed device for the transfer layer, so that its CUDA-only paths run on CPU.

:class:`SimulatedDevice` is a :class:`DeviceTransfer` whose CPU tensors count as device
tensors: a device-to-host copy takes its snapshot at once (as the real layer's clone on the
main stream does), then lands in the destination on a thread of its own after ``delay_s``
(the side stream), and its event's ``synchronize`` waits for that thread. Only the CUDA
primitives are replaced; the logic under test (bounce buffers, waiting before unmapping, who
waits under which lock) is the real layer's.

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
    """See the module docstring. ``register_fails``: every host registration is refused."""

    def __init__(
        self,
        *,
        delay_s: float = 0.0,
        register_fails: bool = False,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.register_fails = register_fails
        self.on_wait = on_wait
        self.log: list[tuple[str, Any]] = []  # ("copied", data_ptr), ("unregistered", address)
        self.log_lock = threading.Lock()
        self._pinned_ptrs: set[int] = set()
        self.pageable_async_copies = 0  # async copies into pageable memory: a draining stream

    def on_device(self, tensor: torch.Tensor) -> bool:
        return True

    def _host_empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self._pinned_ptrs.add(tensor.data_ptr())
        return tensor

    def page_locked(self, host: torch.Tensor) -> bool:
        return host.data_ptr() in self._pinned_ptrs or self._in_registered(host)

    def _copy_async(self, tensor: torch.Tensor, host: torch.Tensor) -> SimulatedEvent:
        if not self.page_locked(host):
            self.pageable_async_copies += 1
        snapshot = tensor.detach().clone()
        event = SimulatedEvent(self.on_wait)

        def land() -> None:
            time.sleep(self.delay_s)
            host.copy_(snapshot)
            with self.log_lock:
                self.log.append(("copied", host.data_ptr()))
            event.done.set()

        threading.Thread(target=land, name="simulated-side-stream", daemon=True).start()
        return event

    def _register_host(self, address: int, size: int) -> str | None:
        return "simulated refusal" if self.register_fails else None

    def _unregister_host(self, address: int) -> None:
        with self.log_lock:
            self.log.append(("unregistered", address))
