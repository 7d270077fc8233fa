"""Arenas: many blocks' shared-memory segments in few memfds, against a real daemon.

Before arenas every block had two memfds of its own (two mappings and four descriptors in the
daemon, as many in the client), and past the daemon's ``max_shm_segments`` per connection (or
half the client's descriptor limit) the remaining blocks went over gRPC in chunks. These tests
hold the daemon to a small ``--max-shm-segments`` and check that hundreds of blocks still all
go over shared memory, with the descriptors bounded; that a bad arena or slot is refused with
an error that says what is wrong; and that a client killed in the middle of a write into its
arena loses nothing the daemon had computed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from asteria_client.transport import DaemonConnection, DaemonSource
from asteria_client.transport.shm import HandoverChannel
from asteria_server.protocol.handover import Attach, Bind, BlockSlots, SegmentRole, SlotBinding
from asteria_server.protocol.shm import (
    HEADER_BYTES,
    ArraySpec,
    SharedMemoryUnavailableError,
    create_arena,
    create_segment,
    slot_base,
)
from tests.integration.test_daemon import Daemon, _clean_env, start_daemon, stop_daemon
from tests.integration.test_shm_traps import memfd_maps, root_request

WAIT_S = 120.0
#: The daemon maps at most this many segments (arenas count one each) per connection.
MAX_SEGMENTS = 8
NUM_BLOCKS = 300


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path, "--max-shm-segments", str(MAX_SEGMENTS))
    yield d
    stop_daemon(d)


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_hundreds_of_blocks_go_over_shared_memory_through_a_few_arenas(daemon: Daemon) -> None:
    """300 blocks, a daemon that maps 8 segments per connection: with a segment pair per block
    only 4 blocks would go over shared memory; with arenas every one does, through at most 8
    mappings, and the daemon's descriptors grow by two per mapping, not per block."""
    fds_before = _descriptors(daemon.proc.pid)
    source = DaemonSource(daemon.target)
    try:
        assert source.wait_connected(WAIT_S)
        for i in range(NUM_BLOCKS):
            source.submit(root_request(f"b{i}", 0, 8, i))
        for i in range(NUM_BLOCKS):
            assert source.wait(f"b{i}", 0, WAIT_S) is not None, f"b{i} lost"
        stats = source.stats()
        assert stats["shm_refusals"] == 0 and stats["shm_blocks_refused"] == 0
        assert stats["shm_snapshots"] == NUM_BLOCKS and stats["chunked_snapshots"] == 0
        assert stats["shm_results"] == NUM_BLOCKS
        assert stats["shm_segments"] == 2 * NUM_BLOCKS  # every block's pair, as slots
        mappings = stats["shm_mappings"]
        assert 1 <= mappings <= MAX_SEGMENTS
        assert len(memfd_maps(daemon.proc.pid)) == mappings
        # Two descriptors per mapping (the one kept and mmap's own), plus the client's two
        # connections (gRPC and handover) and a little slack for the daemon's own.
        assert _descriptors(daemon.proc.pid) - fds_before <= 2 * mappings + 8
        # The second round reuses the same slots: nothing new is mapped.
        for i in range(NUM_BLOCKS):
            source.submit(root_request(f"b{i}", 1, 8, NUM_BLOCKS + i))
        for i in range(NUM_BLOCKS):
            assert source.wait(f"b{i}", 1, WAIT_S) is not None, f"b{i} v1 lost"
        again = source.stats()
        assert again["shm_snapshots"] == 2 * NUM_BLOCKS and again["chunked_snapshots"] == 0
        assert again["shm_mappings"] == mappings
    finally:
        source.close()
    assert daemon.proc.poll() is None


def _refusal(channel: HandoverChannel, request: Attach | Bind, fds: list[int]) -> str:
    with pytest.raises(SharedMemoryUnavailableError) as caught:
        channel._request(request, fds)
    return str(caught.value)


def test_a_bad_arena_or_slot_is_refused_with_a_clear_error(daemon: Daemon) -> None:
    conn = DaemonConnection(daemon.target)
    session = conn.open_session()
    channel = HandoverChannel(session.shm_socket, session.session_id)
    slot_bytes = 2 * HEADER_BYTES
    try:
        # A size that is not whole slots after the arena's header.
        fd, arena = create_arena(slot_bytes, 4)
        short = arena.size_bytes - HEADER_BYTES
        error = _refusal(
            channel, Attach("a", short, SegmentRole.ARENA, slot_bytes=slot_bytes), [fd]
        )
        assert "cannot hold whole slots" in error
        # A plain segment handed over as an arena: its header says what it is.
        plain_fd, plain = create_segment(arena.size_bytes)
        error = _refusal(
            channel,
            Attach("p", plain.size_bytes, SegmentRole.ARENA, slot_bytes=slot_bytes),
            [plain_fd],
        )
        assert "does not hold an Asteria arena header" in error
        os.close(plain_fd)
        # The arena itself is taken; then a slot past its end, a slot whose header the client
        # broke and an arena never handed over are each refused, naming the block.
        channel._request(
            Attach("a", arena.size_bytes, SegmentRole.ARENA, slot_bytes=slot_bytes), [fd]
        )
        past = Bind((BlockSlots("blk", (SlotBinding("s9", "a", 4, SegmentRole.SNAPSHOT),)),))
        error = _refusal(channel, past, [])
        assert "'blk'" in error and "slot 4" in error and "does not lie in the arena" in error
        words = np.frombuffer(arena._mmap, dtype="<u8")
        words[slot_base(2, slot_bytes) // 8] = 0  # slot 2's magic
        broken = Bind((BlockSlots("blk", (SlotBinding("s2", "a", 2, SegmentRole.RESULT),)),))
        error = _refusal(channel, broken, [])
        assert "slot 2 of the arena does not hold an Asteria segment header" in error
        unknown = Bind((BlockSlots("blk", (SlotBinding("s0", "nope", 0, SegmentRole.SNAPSHOT),)),))
        assert "arena 'nope' was not handed over" in _refusal(channel, unknown, [])
        del words
        # A good slot binds; a bad request never broke the connection.
        channel._request(
            Bind((BlockSlots("blk", (SlotBinding("s1", "a", 1, SegmentRole.SNAPSHOT),)),)), []
        )
        assert channel.alive()
        os.close(fd)
    finally:
        channel.close()
        conn.close()
    assert daemon.proc.poll() is None


def test_a_slot_is_bounded_by_its_own_size_whatever_its_header_says() -> None:
    """A slot's views never reach its neighbour's bytes: its size is what bounds them."""
    fd, arena = create_arena(2 * HEADER_BYTES, 3)
    try:
        slot = arena.slot(1, 2 * HEADER_BYTES)
        neighbour = arena.slot(2, 2 * HEADER_BYTES)
        spec = [ArraySpec(np.dtype("<f4"), (32, 32))]  # 4096 bytes: exactly the slot's payload
        sequence = neighbour.write(spec, [np.full((32, 32), 7, np.float32)])
        words = np.frombuffer(arena._mmap, dtype="<u8")
        words[slot_base(1, 2 * HEADER_BYTES) // 8 + 2] = 1 << 40  # slot 1's capacity word
        with pytest.raises(Exception, match="holds 4096"):
            slot.views([ArraySpec(np.dtype("<f4"), (64, 64))])
        slot.write(spec, [np.zeros((32, 32), np.float32)])
        copied = neighbour.read(spec, sequence)
        assert copied is not None and float(copied[0].min()) == 7.0
        del words
    finally:
        os.close(fd)


WRITER = textwrap.dedent(
    """
    import sys, time
    import torch
    from asteria_client.runtime.source import PreconditionerRequest
    from asteria_client.transport import DaemonSource
    from asteria_server.engine import SolveKind
    blocks = int(sys.argv[2])
    source = DaemonSource(sys.argv[1], job="killed")
    assert source.wait_connected(60)
    for block in range(blocks):
        source.submit(PreconditionerRequest(
            block=f"k{block}", version=0, kind=SolveKind.EIGENBASIS,
            matrix=torch.eye(16) * (block + 1)))
    assert all(source.wait(f"k{block}", 0, 60) is not None for block in range(blocks))
    stats = source.stats()
    assert stats["shm_snapshots"] == blocks and stats["shm_mappings"] <= 2, stats
    # A write into block k0's snapshot slot begins, and never ends: the process is killed.
    slot = source.segments()[[s for s, seg in source.segments().items()
                              if seg.block.endswith("k0") and seg.role == "snapshot"][0]]
    slot.segment.begin_write()
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_a_client_killed_mid_write_into_its_arena_loses_nothing_at_the_daemon(
    daemon: Daemon,
) -> None:
    """Its results lie in its arenas' slots: when the client dies, the daemon copies them into
    its own memory (nothing of the dead process stays mapped) and keeps every one, and it goes on
    serving the next client."""
    blocks = 12
    before = memfd_maps(daemon.proc.pid)
    client = subprocess.Popen(
        [sys.executable, "-c", WRITER, daemon.target, str(blocks)],
        stdout=subprocess.PIPE,
        text=True,
        env=_clean_env(),
    )
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "ready"
        assert 1 <= len(memfd_maps(daemon.proc.pid)) - len(before) <= 2
        client.send_signal(signal.SIGKILL)
        client.wait()
    finally:
        client.kill()
    deadline = time.monotonic() + 30
    while memfd_maps(daemon.proc.pid) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert memfd_maps(daemon.proc.pid) == before  # the dead client's arenas are unmapped
    conn = DaemonConnection(daemon.target)
    try:
        _, table = conn.status(conn.open_session().session_id)
        held = {row.block.split(":", 1)[-1]: row for row in table}  # less the job's prefix
        assert len(held) == blocks, [row.block for row in table]
        for block in range(blocks):
            row = held[f"k{block}"]
            assert row.version == 0 and row.failures == 0, row
            assert row.tier == "host", row  # copied out of the gone client's slot
    finally:
        conn.close()
    source = DaemonSource(daemon.target)
    try:
        source.submit(root_request("after", 0, 16, 3))
        assert source.wait("after", 0, WAIT_S) is not None
        assert source.stats()["shm_snapshots"] == 1
    finally:
        source.close()
    assert daemon.proc.poll() is None
