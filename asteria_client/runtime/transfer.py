"""The one transfer layer under every source: device <-> host copies off the main CUDA stream.

Snapshots (device -> host): the snapshots a step publishes are **packed** (:meth:`~DeviceTransfer
.pack`): concatenated into one flat device buffer on the main stream (one kernel, and the
snapshot: taken now, in stream order), then copied once, on a low-priority *side stream*, into
one new page-locked host buffer, of which each snapshot is a view. One device-to-host copy per
step and device, whatever the number of blocks; the copy's event says when the host bytes are
valid, and the main stream never waits for it. (A single tensor goes the same way through
:meth:`~DeviceTransfer.to_host`.)

Results (host -> device): the thread that receives a result **stages** it
(:meth:`~DeviceTransfer.stage`): its arrays are copied once into one page-locked byte buffer
— the only host copy of the result on the client. The training thread then issues one
host-to-device copy of that buffer on the side stream (:meth:`~DeviceTransfer.staged_to_device`)
and makes the main stream wait on its event (a device-side wait, not a host sync); the fields
are typed views of the device copy. An unstaged array (:meth:`~DeviceTransfer.to_device`) is
staged in a pinned buffer reused per key.

Events are created *blocking*: a host thread that waits for a copy (the daemon source's sender)
sleeps in the driver instead of spinning a core the solvers need.

On CPU the same calls run with no streams and no events: a pack is one host concatenation, a
result is used in place. The CUDA primitives are a handful of small methods (``on_device``,
``to_accelerator``, ``_host_empty``, ``_copy_async``, ``_copy_to_device``), so that the logic
around them — packing, staging, waiting for copies in flight — is tested on CPU with a
simulated, slowed device (tests/sim_device.py).

Host tensors this layer makes or copies into are *marked* (:func:`mark_host`): the host-sync
audit (:mod:`asteria_client.runtime.sync_audit`) reads a marked tensor's bytes as the host
reading host memory, which on a device costs no sync.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
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
    """Side streams (one per device), packed snapshots, staged results, pinned buffers."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._staging: dict[tuple[str, str], tuple[torch.Tensor, PendingCopy | None]] = {}
        #: D2H copies not known to be complete (what :meth:`drain` waits for), oldest first:
        #: one side stream completes them in order, so the done ones leave from the front
        self._in_flight: collections.deque[PendingCopy] = collections.deque()
        #: guards the dicts and the list above: the training thread and a source's own
        #: threads (an exchange, a session) both move data through one transfer layer
        self._lock = threading.Lock()
        self.copies_d2h = 0
        self.copies_h2d = 0
        self.tensors_to_host = 0  # tensors those D2H copies carried (a pack carries many)
        #: host copies of results on the client (staging, or the training thread's copy into
        #: a pinned buffer for an unstaged array)
        self.result_host_copies = 0

    # ------------------------------------------------------------------ device primitives
    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in device memory (its copies go on the side stream)."""
        return tensor.device.type == "cuda"

    def _host_empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A new page-locked host tensor."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def to_accelerator(self, device: torch.device) -> bool:
        """Whether results for ``device`` cross to device memory (else they are used in place)."""
        return device.type == "cuda"

    def _copy_async(self, tensor: torch.Tensor, host: torch.Tensor, *, owned: bool = False) -> Any:
        """Copy device ``tensor`` (as it is now, in main-stream order) into page-locked
        ``host`` on the side stream; returns the event that completes it. ``owned``: nothing
        else writes ``tensor`` (a packed buffer made for this copy), so it needs no clone."""
        # the clone runs on the main stream: the snapshot is taken now, in stream order
        snapshot = tensor.detach() if owned else tensor.detach().clone()
        main = torch.cuda.current_stream(tensor.device)
        stream = self._stream(tensor.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            host.copy_(snapshot, non_blocking=True)
            snapshot.record_stream(stream)
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        return event

    def _copy_to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """Copy pinned ``host`` to ``device`` on the side stream; the main stream waits for it
        on the device (no host wait), and the result is safe to use there. Returns the copy
        and its event (``host`` may be written again once the event is done)."""
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            out = host.to(device, non_blocking=True)
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        torch.cuda.current_stream(device).wait_event(event)
        out.record_stream(torch.cuda.current_stream(device))
        return out, event

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
        """Start a copy of ``tensor`` (as it is now) into the pinned host tensor ``host``."""
        self.copies_d2h += 1
        self.tensors_to_host += 1
        if not self.on_device(tensor):
            # non_blocking: a no-op on the host, and how the sync audit tells this copy from a
            # blocking device read
            host.copy_(tensor.detach(), non_blocking=True)
            return PendingCopy(host=host)
        pending = PendingCopy(host=host, event=self._copy_async(tensor, host))
        self._track(pending)
        return pending

    def _track(self, pending: PendingCopy) -> None:
        """Remember a copy in flight for :meth:`drain`."""
        with self._lock:
            while self._in_flight and self._in_flight[0].ready():  # amortized O(1) per copy
                self._in_flight.popleft()
            self._in_flight.append(pending)

    def pack(self, tensors: Sequence[torch.Tensor]) -> list[PendingCopy]:
        """Snapshot ``tensors`` (as they are now) into host memory with **one** copy per
        device and dtype, whatever their number: they are concatenated into one flat buffer
        on the device (one kernel on the main stream, which is the snapshot), copied on the
        side stream into one new pinned buffer, and each tensor's ``host`` is a view of it,
        valid once its copy (shared by the whole pack) is done. Host tensors are concatenated
        the same way, one host copy. How a step's snapshots leave the device."""
        out: list[PendingCopy | None] = [None] * len(tensors)
        kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for at, tensor in enumerate(tensors):
            kinds.setdefault((tensor.device, tensor.dtype), []).append(at)
        for (_, dtype), members in kinds.items():
            parts = [tensors[at].detach().reshape(-1) for at in members]
            self.copies_d2h += 1
            self.tensors_to_host += len(members)
            if self.on_device(tensors[members[0]]):
                flat = torch.cat(parts)
                host = mark_host(self._host_empty(flat.shape, dtype))
                whole = PendingCopy(host=host, event=self._copy_async(flat, host, owned=True))
                self._track(whole)
            else:
                # non_blocking: a no-op on the host, and how the sync audit tells this copy
                # from a blocking device read
                host = mark_host(torch.empty(sum(p.numel() for p in parts), dtype=dtype))
                torch.cat(parts, out=host)
                whole = PendingCopy(host=host)
            offset = 0
            for at in members:
                size = tensors[at].numel()
                view = mark_host(host[offset : offset + size].view(tensors[at].shape))
                out[at] = PendingCopy(host=view, event=whole.event)
                offset += size
        return [copy for copy in out if copy is not None]

    def drain(self) -> None:
        """Wait for every device-to-host copy this layer started (before a source lets go of
        the memory they write into)."""
        with self._lock:
            pending, self._in_flight = self._in_flight, collections.deque()
        for copy in pending:
            copy.wait()

    # ------------------------------------------------------------------ host -> device
    def stage(
        self,
        specs: Sequence[tuple[np.dtype, tuple[int, ...]]],
        device: torch.device,
        fill: Callable[[list[np.ndarray]], bool],
    ) -> StagedArrays | None:
        """Stage a result for ``device`` where it arrives: ``fill(outs)`` copies its arrays
        (of ``specs``) into ``outs`` — for a device, views of one new pinned byte buffer; for
        the host, plain arrays used in place later — and returns whether it could (False: e.g.
        a newer write replaced a segment's result; nothing is staged). This is the result's one
        host copy on the client, paid by the thread that received it."""
        buffer, outs = self._staging_buffers(specs, device)
        if not fill(outs):
            return None
        with self._lock:
            self.result_host_copies += 1
        return StagedArrays(buffer, list(outs))

    def stage_arrays(
        self, arrays: Sequence[np.ndarray | None], device: torch.device
    ) -> StagedArrays:
        """Stage arrays already in host memory (a result assembled from gRPC chunks, or an
        embedded engine's): one copy into a pinned buffer for a device, none for the host."""
        if not self.to_accelerator(device):
            return StagedArrays(None, list(arrays))
        present = [a for a in arrays if a is not None]
        buffer, outs = self._staging_buffers([(a.dtype, tuple(a.shape)) for a in present], device)
        for out, array in zip(outs, present, strict=True):
            np.copyto(out, array)
        with self._lock:
            self.result_host_copies += 1
        it = iter(outs)
        return StagedArrays(buffer, [None if a is None else next(it) for a in arrays])

    def _staging_buffers(
        self, specs: Sequence[tuple[np.dtype, tuple[int, ...]]], device: torch.device
    ) -> tuple[torch.Tensor | None, list[np.ndarray]]:
        if not self.to_accelerator(device):
            return None, [np.empty(shape, dtype) for dtype, shape in specs]
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for dtype, shape in specs]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // _ALIGN) * _ALIGN
        buffer = mark_host(self._host_empty(torch.Size([max(total, 1)]), torch.uint8))
        raw = buffer.numpy()
        outs = [
            raw[at : at + size].view(dtype).reshape(shape)
            for at, size, (dtype, shape) in zip(offsets, sizes, specs, strict=True)
        ]
        return buffer, outs

    def staged_to_device(
        self, staged: StagedArrays, device: torch.device, *, name: str = ""
    ) -> list[torch.Tensor | None]:
        """The fields of a staged result on ``device``: one host-to-device copy of its buffer
        (the main stream waits for it on the device); in place for the host. Arrays staged
        for the host (the block's device was not known yet) go one by one."""
        if not self.to_accelerator(device):
            return [None if a is None else _tensor_of(a) for a in staged.arrays]
        if staged.buffer is None:
            return [
                None if a is None else self.to_device(a, device, key=f"{name}/{at}")
                for at, a in enumerate(staged.arrays)
            ]
        self.copies_h2d += 1
        whole, _ = self._copy_to_device(staged.buffer, device)  # a new buffer: no reuse race
        start = staged.buffer.data_ptr()
        out: list[torch.Tensor | None] = []
        for array in staged.arrays:
            if array is None:
                out.append(None)
                continue
            at = array.ctypes.data - start
            piece = whole[at : at + array.nbytes].view(_TORCH_DTYPES[np.dtype(array.dtype)])
            out.append(piece.view(array.shape))
        return out

    def to_device(
        self, array: np.ndarray, device: torch.device, *, key: str | None = None
    ) -> torch.Tensor:
        """Copy an unstaged host array to ``device`` through a pinned buffer reused per
        ``key`` (a host copy on this thread); the main stream is made to wait for the copy.

        On CPU the result uses ``array``'s memory when it may (it is writable and contiguous).
        """
        host = _tensor_of(array)
        if not self.to_accelerator(device):
            return host if device.type == "cpu" else host.to(device)
        self.copies_h2d += 1
        staged = (
            self._pinned(("h2d", key), host)
            if key is not None
            else self._host_empty(host.shape, host.dtype)
        )
        staged.copy_(host)
        with self._lock:
            self.result_host_copies += 1
        out, event = self._copy_to_device(staged, device)
        if key is not None:  # reused for the key's next result once this copy is done
            with self._lock:
                self._staging[("h2d", key)] = (staged, PendingCopy(host=staged, event=event))
        return out

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "copies_d2h": self.copies_d2h,
                "copies_h2d": self.copies_h2d,
                "tensors_to_host": self.tensors_to_host,
                "result_host_copies": self.result_host_copies,
                "pinned_buffers": len(self._staging),
            }


#: Byte alignment of each field in a staged result's buffer (any dtype's view stays aligned).
_ALIGN = 64

_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
}


def _tensor_of(array: np.ndarray) -> torch.Tensor:
    """A torch tensor of ``array``'s memory where it may (writable and contiguous)."""
    if not array.flags.writeable:
        array = array.copy()  # torch tensors must not alias read-only memory
    return torch.from_numpy(np.ascontiguousarray(array))


@dataclass
class StagedArrays:
    """A result's arrays where :meth:`DeviceTransfer.stage` put them (None for a field the
    result lacks): views of ``buffer`` (pinned bytes) when the result goes to a device, plain
    host arrays (``buffer`` None) when it is used in place."""

    buffer: torch.Tensor | None
    arrays: list[np.ndarray | None]

    def holds(self, arrays: Sequence[np.ndarray | None]) -> bool:
        """Whether every array of ``arrays`` lies in ``buffer`` (a result built from them)."""
        if self.buffer is None:
            return False
        start = self.buffer.data_ptr()
        end = start + self.buffer.numel()
        return all(
            a is None or (start <= a.ctypes.data and a.ctypes.data + a.nbytes <= end)
            for a in arrays
        )
