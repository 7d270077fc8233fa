"""The client's side of the shared-memory transport: its segments and the handover connection.

When the daemon is on this host (``unix://`` address) and offers a handover socket in its
``OpenSession`` answer, the daemon source gives every block two segments (``protocol.shm``):

- a **snapshot segment**, which ``submit`` fills straight from the factor tensor through a torch
  view of the mapping (one copy, no intermediate host buffer), under the seqlock;
- a **result segment**, which the daemon's solver worker fills with the block's results; the
  client copies them out under the seqlock when the result's header arrives on the gRPC stream.

Their layout is ``protocol.shm``'s; the handover connection speaks ``protocol.handover``.

Segments belong to the client: they are created once per block, reserved and pre-faulted, and
reused for every snapshot; after a daemon restart the same segments are handed to the new
incarnation. Anything that goes wrong here (no memfd, not enough memory, a refused handover)
raises :class:`SharedMemoryUnavailableError`, and the caller sends that block over gRPC instead.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from asteria_client.runtime.transfer import DeviceTransfer, PendingCopy, mark_host
from asteria_client.transport.peer import UntrustedDaemonError, check_peer
from asteria_server.errors import InvalidInputError
from asteria_server.protocol.handover import (
    MAX_MESSAGE_BYTES,
    Attach,
    Detach,
    HandoverRequest,
    Hello,
    SegmentRole,
    decode_reply,
    encode_request,
)
from asteria_server.protocol.shm import (
    ArraySpec,
    Segment,
    SegmentRef,
    SharedMemoryUnavailableError,
    create_segment,
    result_layout,
    segment_bytes,
    snapshot_layout,
    snapshot_specs,
)
from asteria_server.types import SolveTask

#: The handover connection's timeout for each request.
HANDOVER_TIMEOUT_S = 10.0


@dataclass(eq=False)
class ClientSegment:
    """A segment this client created: its id, descriptor, mapping and purpose."""

    segment_id: str
    fd: int
    segment: Segment
    role: str  # "snapshot" or "result"
    block: str  # the block's name on the daemon
    _views: dict[tuple[ArraySpec, ...], list[torch.Tensor]] = field(default_factory=dict)
    #: the transfer layer that page-locked the mapping for CUDA copies (None: not registered)
    _registered: DeviceTransfer | None = None
    #: the registration was refused once: copies into the mapping go through a bounce buffer
    _register_refused: bool = False

    @classmethod
    def create(cls, role: str, block: str, specs: Sequence[ArraySpec]) -> ClientSegment:
        fd, segment = create_segment(segment_bytes(specs), name=f"asteria-{role}")
        return cls(uuid.uuid4().hex, fd, segment, role, block)

    def fits(self, specs: Sequence[ArraySpec]) -> bool:
        return segment_bytes(specs) <= self.segment.size_bytes

    def write_tensors(self, specs: Sequence[ArraySpec], tensors: Sequence[torch.Tensor]) -> int:
        """Copy ``tensors`` (any device) into the segment through torch views of it, under the
        seqlock; returns the sequence that announces them."""
        views = self._tensor_views(specs)  # made once per layout: a block's snapshots keep theirs
        self.segment.begin_write()
        for view, tensor in zip(views, tensors, strict=True):
            if tensor.device.type == "cpu":  # NumPy's copy has less fixed cost than torch's
                np.copyto(view.numpy(), tensor.detach().numpy(), casting="no")
            else:  # one device-to-host copy straight into the segment
                view.copy_(tensor.detach())
        return self.segment.end_write()

    def write_snapshot(
        self, task: SolveTask, tensors: Sequence[torch.Tensor] | None = None
    ) -> SegmentRef:
        """Write ``task``'s snapshot (the matrix, then the basis) into this snapshot segment
        under the seqlock, and return the ref that announces it in ``submit(..., shm=ref)``.
        With ``tensors`` (the same arrays as torch tensors, any device) they are copied through
        :meth:`write_tensors`, as the daemon source does; else ``task``'s NumPy arrays are."""
        specs = snapshot_specs(task)
        if tensors is not None:
            return self.ref(self.write_tensors(specs, tensors))
        arrays = [task.matrix] if task.basis is None else [task.matrix, task.basis]
        return self.ref(self.segment.write(specs, arrays))

    def start_write(
        self,
        specs: Sequence[ArraySpec],
        tensors: Sequence[torch.Tensor],
        transfer: DeviceTransfer,
    ) -> PendingWrite:
        """Begin writing ``tensors`` into the segment; device tensors are copied on the
        transfer layer's side stream, straight into the (CUDA-registered) mapping, so the
        training thread and the main stream do not wait. The seqlock stays odd — readers
        reject the bytes — until :meth:`PendingWrite.finish` closes it."""
        views = self._tensor_views(specs)
        if (
            self._registered is None
            and not self._register_refused
            and any(transfer.on_device(t) for t in tensors)
        ):
            if transfer.register(self._mapping_tensor()):
                self._registered = transfer
            else:  # the transfer layer bounces copies into pageable memory (it said so once)
                self._register_refused = True
        self.segment.begin_write()
        copies = [transfer.copy_into(t, view) for view, t in zip(views, tensors, strict=True)]
        return PendingWrite(self.segment, copies)

    def _tensor_views(self, specs: Sequence[ArraySpec]) -> list[torch.Tensor]:
        """Torch views of the arrays ``specs``, made once per layout (marked host memory)."""
        key = tuple(specs)
        views = self._views.get(key)
        if views is None:
            views = [mark_host(torch.from_numpy(v)) for v in self.segment.views(specs)]
            self._views[key] = views
        return views

    def _mapping_tensor(self) -> torch.Tensor:
        """The whole mapping as one byte tensor (what CUDA registers)."""
        whole = self.segment.views([ArraySpec(np.dtype(np.uint8), (self.segment.capacity_bytes,))])
        return torch.from_numpy(whole[0])

    def read(self, specs: Sequence[ArraySpec], sequence: int) -> list[np.ndarray] | None:
        return self.segment.read(specs, sequence)

    def ref(self, sequence: int) -> SegmentRef:
        return SegmentRef(self.segment_id, sequence)

    def close(self) -> None:
        if self._registered is not None:  # unregister before the mapping goes away
            self._registered.unregister(self._mapping_tensor())
            self._registered = None
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self._views.clear()
        self.segment.close()


class PendingWrite:
    """A snapshot being copied into its segment on the side stream; :meth:`finish` waits for
    the copies (this thread only) and closes the seqlock, once, whoever calls it first."""

    def __init__(self, segment: Segment, copies: list[PendingCopy]) -> None:
        self._segment = segment
        self._copies = copies
        self._lock = threading.Lock()
        self._sequence: int | None = None

    def ready(self) -> bool:
        return self._sequence is not None or all(c.ready() for c in self._copies)

    @property
    def finished(self) -> bool:
        """:meth:`finish` has run: it returns at once from now on."""
        return self._sequence is not None

    @property
    def on_host(self) -> bool:
        """Every copy was a plain host copy, complete already (no device involved)."""
        return all(c.event is None for c in self._copies)

    def finish(self) -> int:
        """The sequence that announces this write (waits for its copies the first time)."""
        with self._lock:
            if self._sequence is None:
                for copy in self._copies:
                    copy.wait()
                self._sequence = self._segment.end_write()
            return self._sequence


def segments_for(task: SolveTask) -> tuple[ClientSegment, ClientSegment]:
    """A block's snapshot and result segments, sized for the largest snapshot (at the dtype of
    ``task``'s arrays) and the largest result of its kind. Raises
    SharedMemoryUnavailableError when they cannot be made here."""
    itemsize = max(a.dtype.itemsize for a in (task.matrix, task.basis) if a is not None)
    snapshot = snapshot_layout(task.n, task.kind, itemsize)
    snap = ClientSegment.create("snapshot", task.block, snapshot)
    try:
        result = ClientSegment.create("result", task.block, result_layout(task.n, task.kind))
    except BaseException:
        snap.close()
        raise
    return snap, result


class HandoverChannel:
    """One connection to the daemon's handover socket, bound to one session."""

    def __init__(self, path: str, session_id: str, *, timeout_s: float = HANDOVER_TIMEOUT_S):
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise SharedMemoryUnavailableError(
                f"cannot connect to the daemon's handover socket {path}: {exc}"
            ) from None
        try:
            check_peer(sock, path)  # no segment goes to a process of an unexpected user
        except UntrustedDaemonError as exc:
            sock.close()
            raise SharedMemoryUnavailableError(str(exc)) from None
        self._sock = sock
        try:
            self._request(Hello(session_id), [])
        except BaseException:
            sock.close()
            raise

    def attach(self, seg: ClientSegment) -> None:
        """Hand ``seg`` over (again); raises SharedMemoryUnavailableError when refused."""
        request = Attach(seg.segment_id, seg.segment.size_bytes, SegmentRole(seg.role), seg.block)
        self._request(request, [seg.fd])

    def detach(self, seg: ClientSegment) -> None:
        self._request(Detach(seg.segment_id), [])

    def _request(self, request: HandoverRequest, fds: list[int]) -> None:
        try:
            socket.send_fds(self._sock, [encode_request(request)], fds)
            answer = decode_reply(self._sock.recv(MAX_MESSAGE_BYTES))
        except (OSError, InvalidInputError) as exc:
            raise SharedMemoryUnavailableError(f"segment handover failed: {exc}") from None
        if not answer.ok:
            raise SharedMemoryUnavailableError(f"the daemon refused the segment: {answer.error}")

    def alive(self) -> bool:
        """False once the daemon closed this connection (it then dropped its mappings)."""
        try:
            poller = select.poll()
            poller.register(self._sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            events = poller.poll(0)
            if not events:
                return True
            if events[0][1] & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                return False
            return self._sock.recv(1, socket.MSG_PEEK) != b""  # readable: data, or end of file
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self._sock.close()
