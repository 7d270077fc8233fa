"""What the daemon's Python objects hold per block over shared memory, measured with tracemalloc.

The daemon side of the same-host path, in one process and without gRPC: a real
:class:`SegmentHandover` on a Unix socket (its own thread), a real :class:`PreconditionerEngine`
(one solver worker), and a client that hands over two arenas and binds every block's snapshot
and result slot there (``asteria_client.transport.shm``, as ``DaemonSource`` does). Each block's
snapshot is then submitted the way the servicer's ``AnnounceSnapshots`` builds it (stand-ins of
the handed-over slot's arrays, block and segment names decoded afresh as protobuf gives them)
and solved into the block's result slot; the engine keeps the result, which lies in the client's
slot.

Measured: the Python memory (``tracemalloc``) that stays allocated once ``blocks`` more blocks
went through, divided by ``blocks``. A first small session runs before the baseline so that
one-off costs (a worker's first task, caches of layouts) are not charged to the blocks; memory
the client's own code allocated (its slot objects) is left out, and so are the arenas' bytes,
which are mappings of the client's memfds, not Python allocations.

Run ``python -m tests.shm_block_memory --blocks 3000`` for the figure and the largest per-block
allocations (``tests/unit/test_shm_block_memory.py`` holds the figure to a bound).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asteria_client.transport.shm import ClientArena, ClientSegment, HandoverChannel
from asteria_server.engine.engine import EngineConfig, PreconditionerEngine
from asteria_server.protocol import convert
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.shm import result_layout, segment_bytes, snapshot_layout
from asteria_server.service.handover import SegmentHandover
from asteria_server.types import SharedArrays, SolveKind

SESSION = "memory-session"
TENANT = "local"
N = 4  # the bench's surrogate: the bookkeeping is measured, not the payload
KIND = SolveKind.INVERSE_ROOT
WAIT_S = 120.0
#: Frames kept per allocation: enough to tell the client's allocations (left out) from the
#: daemon's.
FRAMES = 8
#: A name as long as the bench's llama-7b blocks (``shardK.`` prefix included).
NAME = "shard{shard}.model.layers.{layer}.mlp.gate_proj.weight/tile{tile}/dim{dim}"


@dataclass(frozen=True)
class Measurement:
    blocks: int
    bytes_per_block: float
    top: list[tuple[str, float]]  # source line -> bytes per block, largest first
    #: the height while the blocks went through (every snapshot queued at once, at most): what
    #: the daemon's RSS keeps, as freed small objects leave their arenas mapped
    peak_bytes_per_block: float = 0.0


def block_names(count: int, offset: int = 0) -> list[str]:
    return [
        NAME.format(shard=i // 640, layer=(i // 20) % 32, tile=(i // 2) % 10, dim=i % 2)
        for i in range(offset, offset + count)
    ]


def _fresh(text: str) -> str:
    """A new string equal to ``text``, as a protobuf or JSON decode gives one."""
    return text.encode().decode()


@contextlib.contextmanager
def daemon_side(tmp: Path) -> Iterator[tuple[PreconditionerEngine, SegmentHandover]]:
    engine = PreconditionerEngine(
        EngineConfig(num_workers=1, calibrate=False, seconds_per_n3=1e-9, worker_niceness=0)
    )
    handover = SegmentHandover(
        tmp / "asteria.sock.shm", is_session=lambda _: True, on_release=engine.release_shared
    )
    handover.start()
    try:
        yield engine, handover
    finally:
        handover.stop()
        engine.close()


class Client:
    """One client's handover connection; each :meth:`session` hands over an arena pair."""

    def __init__(self, handover: SegmentHandover) -> None:
        self.channel = HandoverChannel(str(handover.path), SESSION)
        self.arenas: list[ClientArena] = []
        snap = snapshot_layout(N, KIND, 4)
        self.snap_specs = snap[:1]
        self.slot_bytes = (segment_bytes(snap), segment_bytes(result_layout(N, KIND)))

    def bind(self, names: list[str]) -> list[tuple[ClientSegment, ClientSegment]]:
        """Each block's snapshot and result slot, bound, its first snapshot written."""
        arenas = [ClientArena.create(size, len(names)) for size in self.slot_bytes]
        for arena in arenas:
            self.channel.attach_arena(arena)
        self.arenas += arenas
        pairs = []
        for name in names:
            snap, result = (
                arena.take(role, name)
                for arena, role in zip(arenas, ("snapshot", "result"), strict=True)
            )
            assert snap is not None and result is not None
            pairs.append((snap, result))
        bound, errors = self.channel.bind(pairs)
        assert not errors and len(bound) == len(names), errors
        matrix = np.eye(N, dtype=np.float32)
        for snap, _ in pairs:
            snap.segment.write(self.snap_specs, [matrix])
        return pairs

    def close(self) -> None:
        self.channel.close()
        for arena in self.arenas:
            arena.close()


def announce(
    engine: PreconditionerEngine,
    handover: SegmentHandover,
    pairs: list[tuple[ClientSegment, ClientSegment]],
    specs: list,
) -> None:
    """Each block's snapshot as the servicer's ``_from_segment`` makes it, submitted; returns
    once every block's result is in."""
    for snap, _ in pairs:
        block, segment_id = _fresh(snap.block), _fresh(snap.segment_id)
        segment = handover.segment(SESSION, segment_id)
        views = segment.stand_ins(specs)
        found = handover.result_segment(SESSION, block)
        assert found is not None
        header = pb.SnapshotHeader(
            block=block,
            version=0,
            kind=convert._KINDS[KIND],
            n=N,
            exponent=0.25,
            epsilon=1e-12,
            base_version=-1,
        )
        task = convert.task_from_header(
            header,
            views[0],
            None,
            tenant=TENANT,
            shm_source=SharedArrays(segment, sequence=segment.sequence),
            shm_result=SharedArrays(found[1], found[0]),
        )
        engine.submit(task, job="job0")
        del task, header, views, segment, found
    deadline = time.monotonic() + WAIT_S
    for snap, _ in pairs:
        while engine.peek_result(snap.block, TENANT) is None:
            assert time.monotonic() < deadline, f"no result for {snap.block}"
            time.sleep(0.01)


def _daemon_only(snapshot: tracemalloc.Snapshot) -> tracemalloc.Snapshot:
    """``snapshot`` without what the client's code (or tracemalloc) allocated."""
    return snapshot.filter_traces(
        [
            tracemalloc.Filter(False, "*/asteria_client/*", all_frames=True),
            tracemalloc.Filter(False, tracemalloc.__file__),
        ]
    )


def measure(blocks: int, *, top: int = 0, warmup: int = 4) -> Measurement:
    """Python memory per block the daemon side keeps for ``blocks`` shared-memory blocks."""
    with tempfile.TemporaryDirectory() as tmp, daemon_side(Path(tmp)) as (engine, handover):
        client = Client(handover)
        try:
            first = client.bind(block_names(warmup, offset=10**6))
            announce(engine, handover, first, client.snap_specs)
            del first
            gc.collect()
            tracemalloc.start(FRAMES)
            try:
                before = _daemon_only(tracemalloc.take_snapshot())
                pairs = client.bind(block_names(blocks))
                base, _ = tracemalloc.get_traced_memory()
                tracemalloc.reset_peak()
                announce(engine, handover, pairs, client.snap_specs)
                _, peak = tracemalloc.get_traced_memory()
                del pairs  # the client's slots: not the daemon's
                gc.collect()
                after = _daemon_only(tracemalloc.take_snapshot())
            finally:
                tracemalloc.stop()
        finally:
            client.close()
    stats = after.compare_to(before, "lineno")
    total = sum(stat.size_diff for stat in stats)
    lines = [
        (f"{stat.traceback[0].filename}:{stat.traceback[0].lineno}", stat.size_diff / blocks)
        for stat in stats[:top]
    ]
    return Measurement(blocks, total / blocks, lines, (peak - base) / blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=3000)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    result = measure(args.blocks, top=args.top)
    print(f"daemon Python memory per shm block ({result.blocks} blocks): ", end="")
    print(
        f"{result.bytes_per_block:.0f} B kept, "
        f"{result.peak_bytes_per_block:.0f} B more at the height"
    )
    for where, size in result.top:
        print(f"  {size:8.1f} B/block  {where}")


if __name__ == "__main__":
    main()
