"""How shared-memory segments reach the solver workers: memfds, handed over their pipe.

Every segment a worker reads or writes has the one layout of :mod:`asteria_server.protocol.shm`
(header, seqlock word, arrays). Two kinds reach a worker:

- the pool's **own** segments (one input, one output per worker slot), for tasks whose arrays
  are in this process (the embedded mode, and daemon clients that send chunks): created by
  :func:`pool_segment`;
- a daemon client's **snapshot and result segments** (the same-host path), which the daemon's
  handover mapped with a descriptor kept open: the worker reads the snapshot there and writes
  the result there, so the daemon process copies neither.

**Why memfd, not named ``/dev/shm`` segments.** A named POSIX segment outlives a process that is
killed (SIGKILL, OOM) and must be unlinked by somebody; CPython's resource tracker does that for
the creator and prints "leaked shared_memory objects" warnings when a training process is
interrupted, and attaching from another interpreter registers the name a second time (the
tracker trap). A memfd has no name in any filesystem: it lives while a process holds its fd or a
mapping, so nothing is left behind by any kind of exit, nothing needs unlinking, and no tracker
is involved. It is also not limited by the size of ``/dev/shm`` (containers default to 64 MB);
it is charged to the process's memory like any allocation.

**Handing over.** The pool sends a segment's descriptor over the worker's pipe (``SCM_RIGHTS``,
:func:`send_segment_fds`) the first time that worker uses it, named by the segment's ``token``;
the worker maps it (``protocol.shm.map_segment`` checks seals, size and header) and closes the
fd. The pool tells the worker to unmap a segment once nothing else holds it.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import secrets
from multiprocessing import reduction

from asteria_server.errors import EngineUnavailableError
from asteria_server.protocol.shm import (
    Segment,
    SharedMemoryUnavailableError,
    create_segment,
    result_layout,
    segment_bytes,
    snapshot_layout,
)
from asteria_server.types import SolveKind

#: Segment names (visible as ``/memfd:<name>`` in ``/proc/PID/fd``) start with this, then the
#: owner's pid, so a segment is attributable in diagnostics.
SEGMENT_PREFIX = "asteria_"


def input_bytes(n: int) -> int:
    """Segment size for any snapshot of size n: an fp64 matrix and an fp64 basis."""
    return segment_bytes(snapshot_layout(n, SolveKind.EIGENBASIS, 8))


def output_bytes(n: int) -> int:
    """Segment size for any result of size n."""
    return segment_bytes(result_layout(n, SolveKind.EIGENBASIS))


def pool_segment(size_bytes: int, *, prefix: str = SEGMENT_PREFIX) -> tuple[str, Segment]:
    """A new segment of the pool (its name, and the segment, which owns its descriptor)."""
    name = f"{prefix}{os.getpid()}_{secrets.token_hex(5)}"
    try:
        _, segment = create_segment(size_bytes, name=name, own_fd=True)
    except SharedMemoryUnavailableError as exc:
        raise EngineUnavailableError(
            f"cannot reserve {size_bytes / 2**20:.1f} MiB of memory for a solver worker "
            f"({exc}); free memory or lower the largest factor size (max_preconditioner_dim)"
        ) from None
    return name, segment


def send_segment_fds(conn: mpc.Connection, fds: list[int]) -> None:
    """Pass segment fds to the worker at the other end of ``conn`` (a Unix socket pair).

    Sent right after the message that announces them; the worker reads that message, then
    :func:`receive_segment_fds`. ``Connection`` reads exactly the bytes of each message, so the
    one byte that carries the fds is never consumed by an ordinary ``recv``.
    """
    for fd in fds:
        reduction.send_handle(conn, fd, 0)  # the pid is unused on Linux


def receive_segment_fds(conn: mpc.Connection, count: int) -> list[int]:
    return [reduction.recv_handle(conn) for _ in range(count)]
