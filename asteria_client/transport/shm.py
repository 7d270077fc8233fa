"""The client's side of the shared-memory transport: its segments and the handover connection.

When the daemon is on this host (``unix://`` address) and offers a handover socket in its
``OpenSession`` answer, the daemon source gives every block two segments (``protocol.shm``):

- a **snapshot segment**, which ``submit`` fills straight from the factor tensor through a torch
  view of the mapping (one copy, no intermediate host buffer), under the seqlock;
- a **result segment**, which the daemon fills with the block's results; the client copies them
  out under the seqlock when the result's header arrives on the gRPC stream.

Segments belong to the client: they are created once per block, reserved and pre-faulted, and
reused for every snapshot; after a daemon restart the same segments are handed to the new
incarnation. Anything that goes wrong here (no memfd, not enough memory, a refused handover)
raises :class:`SharedMemoryUnavailableError`, and the caller sends that block over gRPC instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from asteria_server.protocol.shm import (
    ArraySpec,
    Segment,
    SegmentRef,
    SharedMemoryUnavailableError,
    create_segment,
    segment_bytes,
)
from asteria_server.types import SolveKind, SolveTask

#: The handover connection's timeout for each request.
HANDOVER_TIMEOUT_S = 10.0


def snapshot_capacity(n: int, kind: SolveKind, itemsize: int) -> list[ArraySpec]:
    """The largest snapshot of a block: the matrix, plus a basis for EIGENBASIS."""
    dtype = np.dtype(f"<f{itemsize}")
    count = 2 if kind is SolveKind.EIGENBASIS else 1
    return [ArraySpec(dtype, (n, n))] * count


def result_capacity(n: int, kind: SolveKind) -> list[ArraySpec]:
    """The largest result of a block: the matrix, and for EIGENBASIS the eigenvalues, the
    permutation and the rotation of a QR refresh (results are float32)."""
    f32 = np.dtype("<f4")
    if kind is not SolveKind.EIGENBASIS:
        return [ArraySpec(f32, (n, n))]
    return [
        ArraySpec(f32, (n, n)),
        ArraySpec(f32, (n,)),
        ArraySpec(np.dtype("<i8"), (n,)),
        ArraySpec(f32, (n, n)),
    ]


@dataclass(eq=False)
class ClientSegment:
    """A segment this client created: its id, descriptor, mapping and purpose."""

    segment_id: str
    fd: int
    segment: Segment
    role: str  # "snapshot" or "result"
    block: str  # the block's name on the daemon
    _views: dict[tuple[ArraySpec, ...], list[torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def create(cls, role: str, block: str, specs: Sequence[ArraySpec]) -> ClientSegment:
        fd, segment = create_segment(segment_bytes(specs), name=f"asteria-{role}")
        return cls(uuid.uuid4().hex, fd, segment, role, block)

    def fits(self, specs: Sequence[ArraySpec]) -> bool:
        return segment_bytes(specs) <= self.segment.size_bytes

    def write_tensors(self, specs: Sequence[ArraySpec], tensors: Sequence[torch.Tensor]) -> int:
        """Copy ``tensors`` (any device) into the segment through torch views of it, under the
        seqlock; returns the sequence that announces them."""
        key = tuple(specs)
        views = self._views.get(key)
        if views is None:  # made once per layout: a block's snapshots keep theirs
            views = self._views[key] = [torch.from_numpy(v) for v in self.segment.views(specs)]
        self.segment.begin_write()
        for view, tensor in zip(views, tensors, strict=True):
            if tensor.device.type == "cpu":  # NumPy's copy has less fixed cost than torch's
                np.copyto(view.numpy(), tensor.detach().numpy(), casting="no")
            else:  # one device-to-host copy straight into the segment
                view.copy_(tensor.detach())
        return self.segment.end_write()

    def read(self, specs: Sequence[ArraySpec], sequence: int) -> list[np.ndarray] | None:
        return self.segment.read(specs, sequence)

    def ref(self, sequence: int) -> SegmentRef:
        return SegmentRef(self.segment_id, sequence)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self._views.clear()
        self.segment.close()


def segments_for(task: SolveTask) -> tuple[ClientSegment, ClientSegment]:
    """A block's snapshot and result segments, sized for the largest snapshot (at the dtype of
    ``task``'s arrays) and the largest result of its kind. Raises
    SharedMemoryUnavailableError when they cannot be made here."""
    itemsize = max(a.dtype.itemsize for a in (task.matrix, task.basis) if a is not None)
    snapshot = snapshot_capacity(task.n, task.kind, itemsize)
    snap = ClientSegment.create("snapshot", task.block, snapshot)
    try:
        result = ClientSegment.create("result", task.block, result_capacity(task.n, task.kind))
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
        self._sock = sock
        try:
            self._request({"op": "hello", "session_id": session_id}, [])
        except BaseException:
            sock.close()
            raise

    def attach(self, seg: ClientSegment) -> None:
        """Hand ``seg`` over (again); raises SharedMemoryUnavailableError when refused."""
        message = {
            "op": "attach",
            "segment_id": seg.segment_id,
            "size_bytes": seg.segment.size_bytes,
            "role": seg.role,
            "block": seg.block,
        }
        self._request(message, [seg.fd])

    def detach(self, seg: ClientSegment) -> None:
        self._request({"op": "detach", "segment_id": seg.segment_id}, [])

    def _request(self, message: dict[str, object], fds: list[int]) -> None:
        try:
            socket.send_fds(self._sock, [json.dumps(message).encode()], fds)
            answer = json.loads(self._sock.recv(4096) or b"{}")
        except (OSError, ValueError) as exc:
            raise SharedMemoryUnavailableError(f"segment handover failed: {exc}") from None
        if not answer.get("ok"):
            error = answer.get("error", "the daemon closed the handover connection")
            raise SharedMemoryUnavailableError(f"the daemon refused the segment: {error}")

    def close(self) -> None:
        self._sock.close()
