"""Device <-> host copies off the main CUDA stream (the *shadow* stream); no-ops on CPU.

Snapshots: the factor is cloned on the main stream (cheap, device memory), then copied to pinned
host memory on a low-priority stream; the snapshot is handed to the engine once its copy event
has completed, so the main stream never waits for it.

Results: host arrays are copied to the device on the low-priority stream; before a result is
used, the main stream waits on the copy's event (a device-side wait, not a host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class PendingCopy:
    """A device-to-host copy in flight: ``host`` is valid once ``ready()`` is True."""

    host: torch.Tensor
    event: Any = None

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class ShadowStream:
    """One low-priority CUDA stream per device, or nothing at all on CPU."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            # CUDA's lowest stream priority is 0 (negative numbers are higher): the shadow stream
            # never outranks compute streams that ask for more.
            stream = torch.cuda.Stream(device=device, priority=0)
            self._streams[device] = stream
        return stream

    def to_host(self, tensor: torch.Tensor) -> PendingCopy:
        """Start a copy of ``tensor`` (as it is now) into new host memory."""
        if tensor.device.type != "cuda":
            return PendingCopy(host=tensor.detach().to("cpu", copy=True))
        snapshot = tensor.detach().clone()  # on the main stream: taken now, in stream order
        main = torch.cuda.current_stream(tensor.device)
        stream = self._stream(tensor.device)
        stream.wait_stream(main)
        host = torch.empty(snapshot.shape, dtype=snapshot.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(snapshot, non_blocking=True)
            snapshot.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return PendingCopy(host=host, event=event)

    def to_device(self, array: np.ndarray, device: torch.device) -> torch.Tensor:
        """Copy a host array to ``device``; the main stream is made to wait for the copy."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if device.type != "cuda":
            return host.to(device)
        host = host.pin_memory()
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            out = host.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        torch.cuda.current_stream(device).wait_event(event)
        out.record_stream(torch.cuda.current_stream(device))
        return out
