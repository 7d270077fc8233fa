"""The one transfer layer under every source: device <-> host copies off the main CUDA stream.

Snapshots (device -> host): the factor is cloned on the main stream (device memory, cheap, and
taken *now*, in stream order), then copied on a low-priority *side stream* into pinned host
memory — a buffer reused per key (block), or a destination the caller owns, such as a
shared-memory segment registered with CUDA (:meth:`DeviceTransfer.register`), so a D2H copy
lands straight where the daemon reads it. The copy's event says when the host bytes are valid;
the main stream never waits for it.

Results (host -> device): the host array is staged in a pinned buffer reused per key and
copied on the side stream; the main stream is made to wait on the copy's event (a device-side
wait, not a host sync) before the result is used.

On CPU the same calls run with no streams and no events: a snapshot is a plain copy, a result
is used in place. Every source (embedded, daemon) uses this; nothing else in the client talks
to CUDA streams.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


@dataclass
class PendingCopy:
    """A copy in flight: ``host`` (or the caller's destination) is valid once ``ready()``."""

    host: torch.Tensor
    event: Any = None

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        """Block this host thread (never a CUDA stream) until the copy is done."""
        if self.event is not None:
            self.event.synchronize()


class DeviceTransfer:
    """Side streams (one per device), reusable pinned buffers, registered host memory."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._staging: dict[tuple[str, str], tuple[torch.Tensor, PendingCopy | None]] = {}
        self._registered: dict[int, int] = {}  # host address -> bytes registered with CUDA
        self.copies_d2h = 0
        self.copies_h2d = 0

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            # CUDA's lowest stream priority is 0 (negative numbers are higher): the side stream
            # never outranks compute streams that ask for more.
            stream = torch.cuda.Stream(device=device, priority=0)
            self._streams[device] = stream
        return stream

    # ------------------------------------------------------------------ host memory
    def register(self, host: torch.Tensor) -> bool:
        """Page-lock ``host``'s memory for CUDA (a shared-memory segment's mapping), so copies
        into it run asynchronously; False when CUDA is absent or refuses (copies still work,
        through the driver's staging)."""
        if not torch.cuda.is_available() or host.device.type != "cpu":
            return False
        address, size = host.data_ptr(), host.numel() * host.element_size()
        if self._registered.get(address, 0) >= size:
            return True
        try:
            err = torch.cuda.cudart().cudaHostRegister(address, size, 0)
        except RuntimeError as exc:  # pragma: no cover - depends on the driver
            logger.info("cudaHostRegister of %d bytes failed: %s", size, exc)
            return False
        if int(err) != 0:
            return False
        self._registered[address] = size
        return True

    def unregister(self, host: torch.Tensor) -> None:
        address = host.data_ptr()
        if self._registered.pop(address, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(address)

    def _pinned(self, key: tuple[str, str], like: torch.Tensor) -> torch.Tensor:
        """A pinned buffer shaped like ``like`` reused for ``key``, once its last copy is done."""
        held = self._staging.get(key)
        if held is not None:
            buffer, last = held
            if buffer.shape == like.shape and buffer.dtype == like.dtype:
                if last is not None:
                    last.wait()  # rarely waits: the previous copy of this key is long done
                return buffer
        buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        self._staging[key] = (buffer, None)
        return buffer

    # ------------------------------------------------------------------ device -> host
    def to_host(self, tensor: torch.Tensor, *, key: str | None = None) -> PendingCopy:
        """Start a copy of ``tensor`` (as it is now) into host memory the caller may keep until
        the next ``to_host`` of the same ``key`` (a new buffer each call without a key)."""
        if tensor.device.type != "cuda":
            self.copies_d2h += 1
            return PendingCopy(host=tensor.detach().to("cpu", copy=True))
        if key is None:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        else:
            host = self._pinned(("d2h", key), tensor)
        pending = self.copy_into(tensor, host)
        if key is not None:
            self._staging[("d2h", key)] = (host, pending)
        return pending

    def copy_into(self, tensor: torch.Tensor, host: torch.Tensor) -> PendingCopy:
        """Start a copy of ``tensor`` (as it is now) into the host tensor ``host``."""
        self.copies_d2h += 1
        if tensor.device.type != "cuda":
            host.copy_(tensor.detach())
            return PendingCopy(host=host)
        snapshot = tensor.detach().clone()  # on the main stream: taken now, in stream order
        main = torch.cuda.current_stream(tensor.device)
        stream = self._stream(tensor.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            host.copy_(snapshot, non_blocking=True)
            snapshot.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return PendingCopy(host=host, event=event)

    # ------------------------------------------------------------------ host -> device
    def to_device(
        self, array: np.ndarray, device: torch.device, *, key: str | None = None
    ) -> torch.Tensor:
        """Copy a host array to ``device``; the main stream is made to wait for the copy.

        On CPU the result uses ``array``'s memory when it may (it is writable and contiguous).
        """
        if not array.flags.writeable:
            array = array.copy()  # torch tensors must not alias read-only memory
        host = torch.from_numpy(np.ascontiguousarray(array))
        if device.type != "cuda":
            return host.to(device)
        self.copies_h2d += 1
        staged = self._pinned(("h2d", key), host) if key is not None else host.pin_memory()
        if staged is not host:
            staged.copy_(host)
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            out = staged.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        torch.cuda.current_stream(device).wait_event(event)
        out.record_stream(torch.cuda.current_stream(device))
        if key is not None:
            self._staging[("h2d", key)] = (staged, PendingCopy(host=staged, event=event))
        return out

    def stats(self) -> dict[str, int]:
        return {
            "copies_d2h": self.copies_d2h,
            "copies_h2d": self.copies_h2d,
            "pinned_buffers": len(self._staging),
            "registered_regions": len(self._registered),
        }
