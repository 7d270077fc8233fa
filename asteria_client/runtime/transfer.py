"""The one transfer layer under every source: device <-> host copies off the main CUDA stream.

Snapshots (device -> host): the factor is cloned on the main stream (device memory, cheap, and
taken *now*, in stream order), then copied on a low-priority *side stream* into page-locked host
memory — a pinned buffer reused per key (block), or a destination the caller owns, such as a
shared-memory segment registered with CUDA (:meth:`DeviceTransfer.register`), so a D2H copy
lands straight where the daemon reads it. The copy's event says when the host bytes are valid;
the main stream never waits for it. A destination that is *not* page-locked (its registration
failed) gets the copy through a pinned **bounce buffer**, moved into the destination by the
thread that waits for the copy: a non-blocking copy into pageable memory would silently
drain the stream instead. The first such fallback is logged once, at WARNING.

Results (host -> device): the host array is staged in a pinned buffer reused per key and
copied on the side stream; the main stream is made to wait on the copy's event (a device-side
wait, not a host sync) before the result is used.

Events are created *blocking*: a host thread that waits for a copy (the daemon source's sender)
sleeps in the driver instead of spinning a core the solvers need.

On CPU the same calls run with no streams and no events: a snapshot is a plain copy, a result
is used in place. The CUDA primitives are a handful of small methods (``on_device``,
``_host_empty``, ``_copy_async``, ``page_locked``, ``_register_host``, ``_unregister_host``),
so that the logic around them — reuse, bounce buffers, waiting for copies in flight — is
tested on CPU with a simulated, slowed device (tests/sim_device.py).

Host tensors this layer makes or copies into are *marked* (:func:`mark_host`): the host-sync
audit (:mod:`asteria_client.runtime.sync_audit`) reads a marked tensor's bytes as the host
reading host memory, which on a device costs no sync.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: The attribute :func:`mark_host` sets on a host tensor.
HOST_MARK = "_asteria_host"


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as host memory the runtime made (a staging buffer, a segment view)."""
    setattr(tensor, HOST_MARK, True)
    return tensor


def is_marked_host(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, HOST_MARK, False))


@dataclass
class PendingCopy:
    """A copy in flight: ``host`` (or the caller's destination) is valid once :meth:`wait`
    returned. ``then`` is host work that completes it (a bounce buffer's move), run once by
    the first thread that waits."""

    host: torch.Tensor
    event: Any = None
    then: Callable[[], object] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def ready(self) -> bool:
        """Whether :meth:`wait` would return without waiting for the device."""
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        """Block this host thread (never a CUDA stream) until the copy is done."""
        if self.event is not None:
            self.event.synchronize()
        if self.then is not None:
            with self._lock:
                then, self.then = self.then, None
                if then is not None:
                    then()


class DeviceTransfer:
    """Side streams (one per device), reusable pinned buffers, registered host memory."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._staging: dict[tuple[str, str], tuple[torch.Tensor, PendingCopy | None]] = {}
        self._registered: dict[int, int] = {}  # host address -> bytes registered with CUDA
        self._registered_starts: list[int] = []  # its keys, sorted
        #: D2H copies not known to be complete (what :meth:`drain` waits for), oldest first:
        #: one side stream completes them in order, so the done ones leave from the front
        self._in_flight: collections.deque[PendingCopy] = collections.deque()
        #: guards the dicts and the list above: the training thread and a source's own
        #: threads (an exchange, a session) both move data through one transfer layer
        self._lock = threading.Lock()
        self._register_warned = False
        self.copies_d2h = 0
        self.copies_h2d = 0
        self.bounce_copies = 0

    # ------------------------------------------------------------------ device primitives
    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in device memory (its copies go on the side stream)."""
        return tensor.device.type == "cuda"

    def _host_empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A new page-locked host tensor."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def page_locked(self, host: torch.Tensor) -> bool:
        """Whether an asynchronous copy into ``host`` stays asynchronous (pinned, or inside
        memory registered with CUDA)."""
        return host.is_pinned() or self._in_registered(host)

    def _copy_async(self, tensor: torch.Tensor, host: torch.Tensor) -> Any:
        """Copy device ``tensor`` (as it is now, in main-stream order) into page-locked
        ``host`` on the side stream; returns the event that completes it."""
        snapshot = tensor.detach().clone()  # on the main stream: taken now, in stream order
        main = torch.cuda.current_stream(tensor.device)
        stream = self._stream(tensor.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            host.copy_(snapshot, non_blocking=True)
            snapshot.record_stream(stream)
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        return event

    def _register_host(self, address: int, size: int) -> str | None:
        """Page-lock ``size`` bytes at ``address`` for CUDA; None on success, else why not."""
        if not torch.cuda.is_available():
            return "CUDA is not available"
        try:
            err = torch.cuda.cudart().cudaHostRegister(address, size, 0)
        except RuntimeError as exc:  # pragma: no cover - depends on the driver
            return str(exc)
        return None if int(err) == 0 else f"CUDA error {int(err)}"

    def _unregister_host(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)

    def _stream(self, device: torch.device) -> Any:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                # CUDA's lowest stream priority is 0 (negative numbers are higher): the side
                # stream never outranks compute streams that ask for more.
                stream = torch.cuda.Stream(device=device, priority=0)
                self._streams[device] = stream
            return stream

    # ------------------------------------------------------------------ host memory
    def _in_registered(self, host: torch.Tensor) -> bool:
        """Whether ``host`` lies inside one registered region (a bisection: no scan of every
        block's segment per copy)."""
        start = host.data_ptr()
        end = start + host.numel() * host.element_size()
        with self._lock:
            at = bisect.bisect_right(self._registered_starts, start) - 1
            if at < 0:
                return False
            address = self._registered_starts[at]
            return end <= address + self._registered[address]

    def register(self, host: torch.Tensor) -> bool:
        """Page-lock ``host``'s memory for CUDA (a shared-memory segment's mapping), so copies
        into it run asynchronously. False when refused: copies into it then go through a
        pinned bounce buffer (logged once, at WARNING)."""
        if host.device.type != "cpu":
            return False
        address, size = host.data_ptr(), host.numel() * host.element_size()
        with self._lock:
            if self._registered.get(address, 0) >= size:
                return True
        why = self._register_host(address, size)
        if why is not None:
            if not self._register_warned:
                self._register_warned = True
                logger.warning(
                    "cudaHostRegister of %d bytes of shared memory failed (%s): snapshots into "
                    "it go through a pinned bounce buffer, one more host copy each",
                    size,
                    why,
                )
            return False
        with self._lock:
            if address not in self._registered:
                bisect.insort(self._registered_starts, address)
            self._registered[address] = size
        return True

    def unregister(self, host: torch.Tensor) -> None:
        """Undo :meth:`register`; call only once no copy into ``host`` is in flight."""
        address = host.data_ptr()
        with self._lock:
            registered = self._registered.pop(address, None) is not None
            if registered:
                self._registered_starts.remove(address)
        if registered:
            self._unregister_host(address)

    def _pinned(self, key: tuple[str, str], like: torch.Tensor) -> torch.Tensor:
        """A pinned buffer shaped like ``like`` reused for ``key``, once its last copy is done."""
        with self._lock:
            held = self._staging.get(key)
        if held is not None:
            buffer, last = held
            if buffer.shape == like.shape and buffer.dtype == like.dtype:
                if last is not None:
                    last.wait()  # rarely waits: the previous copy of this key is long done
                return buffer
        buffer = mark_host(self._host_empty(like.shape, like.dtype))
        with self._lock:
            self._staging[key] = (buffer, None)
        return buffer

    # ------------------------------------------------------------------ device -> host
    def to_host(self, tensor: torch.Tensor, *, key: str | None = None) -> PendingCopy:
        """Start a copy of ``tensor`` (as it is now) into host memory the caller may keep until
        the next ``to_host`` of the same ``key`` (a new buffer each call without a key)."""
        if not self.on_device(tensor):
            host = mark_host(torch.empty(tensor.shape, dtype=tensor.dtype))
            return self.copy_into(tensor, host)
        if key is None:
            host = mark_host(self._host_empty(tensor.shape, tensor.dtype))
        else:
            host = self._pinned(("d2h", key), tensor)
        pending = self.copy_into(tensor, host)
        if key is not None:
            with self._lock:
                self._staging[("d2h", key)] = (host, pending)
        return pending

    def copy_into(self, tensor: torch.Tensor, host: torch.Tensor) -> PendingCopy:
        """Start a copy of ``tensor`` (as it is now) into the host tensor ``host``."""
        self.copies_d2h += 1
        if not self.on_device(tensor):
            # non_blocking: a no-op on the host, and how the sync audit tells this copy from a
            # blocking device read
            host.copy_(tensor.detach(), non_blocking=True)
            return PendingCopy(host=host)
        if self.page_locked(host):
            pending = PendingCopy(host=host, event=self._copy_async(tensor, host))
        else:  # pageable memory (a refused registration): through a pinned bounce buffer
            bounce = self._pinned(("bounce", f"{host.data_ptr()}"), host)
            self.bounce_copies += 1
            event = self._copy_async(tensor, bounce)
            pending = PendingCopy(host=host, event=event, then=lambda: host.copy_(bounce))
            with self._lock:
                self._staging[("bounce", f"{host.data_ptr()}")] = (bounce, pending)
        with self._lock:
            while self._in_flight and self._in_flight[0].ready():  # amortized O(1) per copy
                self._in_flight.popleft()
            self._in_flight.append(pending)
        return pending

    def drain(self) -> None:
        """Wait for every device-to-host copy this layer started (before the memory they
        write into is unmapped or unregistered)."""
        with self._lock:
            pending, self._in_flight = self._in_flight, collections.deque()
        for copy in pending:
            copy.wait()

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
            return host if device.type == "cpu" else host.to(device)
        self.copies_h2d += 1
        staged = self._pinned(("h2d", key), host) if key is not None else host.pin_memory()
        if staged is not host:
            staged.copy_(host)
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            out = staged.to(device, non_blocking=True)
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        torch.cuda.current_stream(device).wait_event(event)
        out.record_stream(torch.cuda.current_stream(device))
        if key is not None:
            with self._lock:
                self._staging[("h2d", key)] = (staged, PendingCopy(host=staged, event=event))
        return out

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "copies_d2h": self.copies_d2h,
                "copies_h2d": self.copies_h2d,
                "bounce_copies": self.bounce_copies,
                "pinned_buffers": len(self._staging),
                "registered_regions": len(self._registered),
            }
