"""The known traps of shared memory, each provoked for real against the shared-memory transport.

- torn reads: a writer process rewrites a segment while this process reads it;
- truncation: a client cannot shrink a segment the daemon maps, and the daemon refuses unsealed or
  wrongly sized ones;
- a full or small ``/dev/shm`` and memory limits: reservation fails up front with a clear
  message and the block goes over gRPC (never a SIGBUS); segments do not live in ``/dev/shm``;
- leaks: a client killed with SIGKILL leaves no mapping in the daemon; a daemon that exits (a
  Python 3.11 process that attached the segments) leaves the client's segments usable, and the
  restarted daemon gets the same segments.
"""

from __future__ import annotations

import json
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
import torch

from asteria_client.runtime.source import PreconditionerRequest
from asteria_client.transport import DaemonClientConfig, DaemonConnection, DaemonSource
from asteria_client.transport.shm import ClientSegment, HandoverChannel
from asteria_server.engine import SolveKind
from asteria_server.engine.shm import SEGMENT_PREFIX
from asteria_server.protocol.handover import Attach, SegmentRole, decode_reply
from asteria_server.protocol.shm import (
    ArraySpec,
    SharedMemoryUnavailableError,
    create_segment,
    segment_bytes,
)
from tests.integration.test_daemon import Daemon, _clean_env, start_daemon, stop_daemon

WAIT_S = 60.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path)
    yield d
    stop_daemon(d)


def spd(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n + 8, generator=g)
    return x @ x.T / n + 1e-3 * torch.eye(n)


def root_request(block: str, version: int, n: int, seed: int) -> PreconditionerRequest:
    return PreconditionerRequest(
        block=block, version=version, kind=SolveKind.INVERSE_ROOT, matrix=spd(n, seed)
    )


def memfd_maps(pid: int) -> list[str]:
    """The daemon's mappings of clients' segments (memfd names show in /proc/PID/maps); the
    daemon's own solver-worker segments (named after its pid) are not counted."""
    own = f"memfd:{SEGMENT_PREFIX}{pid}_"
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [line for line in lines if "memfd:" in line and own not in line]


# ---------------------------------------------------------------------------------- torn reads

WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from asteria_server.protocol.shm import ArraySpec, map_segment
    fd, size, n, seconds = (int(a) for a in sys.argv[1:5])
    seg = map_segment(fd, size)
    specs = [ArraySpec(np.dtype(np.float32), (n, n))]
    k, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        k += 1
        value = np.full((n, n), k, np.float32)
        seg.write(specs, [value])
        time.sleep(0.0005)  # a quiet spell after each write: a copy can also fit between two
    """
)


def test_the_seqlock_rejects_every_torn_copy() -> None:
    n = 1024  # 4 MiB: a copy takes long enough to overlap the writer's
    specs = [ArraySpec(np.dtype(np.float32), (n, n))]
    size = segment_bytes(specs)
    fd, seg = create_segment(size)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(fd), str(size), str(n), "20"],
        pass_fds=[fd],
        env=_clean_env(),
    )
    accepted = rejected = torn_unchecked = 0
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline and not (accepted > 20 and torn_unchecked > 0):
            sequence = seg.sequence
            if sequence % 2 or sequence == 0:  # mid-write, or the writer has not started yet
                continue
            raw = seg.views(specs)[0].copy()  # the same copy without the check: can be torn
            torn_unchecked += int(raw.min() != raw.max())
            copies = seg.read(specs, sequence)
            if copies is None:
                rejected += 1
                continue
            accepted += 1
            value = copies[0]
            assert value.min() == value.max(), "the seqlock accepted a torn copy"
    finally:
        writer.kill()
        writer.wait()
        os.close(fd)
    assert accepted > 20, f"only {accepted} consistent copies ({rejected} rejected)"
    # Without the seqlock some copies were torn: the check above was really exercised.
    assert torn_unchecked > 0


# ---------------------------------------------------------------------------------- seals, sizes


def test_the_daemon_maps_only_sealed_segments_of_the_announced_size(daemon: Daemon) -> None:
    conn = DaemonConnection(daemon.target)
    session = conn.open_session()
    channel = HandoverChannel(session.shm_socket, session.session_id)
    try:
        unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(unsealed, 8192)
        fake = ClientSegment("unsealed", unsealed, None, "snapshot", "b")  # type: ignore[arg-type]
        with pytest.raises(SharedMemoryUnavailableError, match="not sealed"):
            channel._request(Attach("x", 8192, SegmentRole.SNAPSHOT), [fake.fd])
        os.close(unsealed)
        fd, _ = create_segment(8192)
        with pytest.raises(SharedMemoryUnavailableError, match="announced 16384"):
            channel._request(Attach("y", 16384, SegmentRole.SNAPSHOT), [fd])
        os.close(fd)
        # A message of another version of the handover protocol is refused, saying so.
        channel._sock.send(b'{"v": 99, "op": "detach", "segment_id": "y"}')
        reply = decode_reply(channel._sock.recv(4096))
        assert not reply.ok and "version 99" in reply.error
    finally:
        channel.close()
        conn.close()
    assert daemon.proc.poll() is None


def test_a_client_cannot_truncate_a_segment_the_daemon_maps(daemon: Daemon) -> None:
    source = DaemonSource(daemon.target)
    try:
        assert source.wait_connected(WAIT_S)
        source.submit(root_request("t", 0, 64, 0))
        assert source.wait("t", 0, WAIT_S) is not None
        assert source.stats()["shm_snapshots"] == 1
        for seg in source.segments().values():
            with pytest.raises(PermissionError):
                os.ftruncate(seg.fd, 0)  # F_SEAL_SHRINK
            with pytest.raises(PermissionError):
                os.ftruncate(seg.fd, seg.segment.size_bytes * 2)  # F_SEAL_GROW
        source.submit(root_request("t", 1, 64, 1))
        assert source.wait("t", 1, WAIT_S) is not None
        assert source.stats()["shm_snapshots"] == 2
    finally:
        source.close()
    assert daemon.proc.poll() is None


def test_status_shows_the_segments_and_the_upload_budget(
    daemon: Daemon, capsys: pytest.CaptureFixture[str]
) -> None:
    from asteria_client.cli import main

    source = DaemonSource(daemon.target)
    try:
        assert source.wait_connected(WAIT_S)
        source.submit(root_request("st", 0, 64, 0))
        assert source.wait("st", 0, WAIT_S) is not None
        capsys.readouterr()
        assert main(["status", "--address", daemon.target, "--json"]) == 0
        transport = json.loads(capsys.readouterr().out)["transport"]
        # The block's snapshot and result segments are two slots of one arena: one mapping.
        assert len(source.segments()) == 2 and source.stats()["shm_mappings"] == 1
        assert transport["shm_connections"] == 1 and transport["shm_segments"] == 1
        assert transport["shm_mapped_bytes"] == sum(
            arena.segment.size_bytes for arena in source._segments.arenas()
        )
        assert transport["upload_budget_bytes"] == 2 << 30
        assert transport["upload_bytes_in_flight"] == 0 and transport["uploads_waiting"] == 0
        assert main(["status", "--address", daemon.target]) == 0
        assert "shared memory: 1 clients, 1 segments" in capsys.readouterr().out
    finally:
        source.close()


# ---------------------------------------------------------------------------------- space

CLIENT = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from asteria_client.runtime.source import PreconditionerRequest
    from asteria_client.transport import DaemonSource
    from asteria_server.engine import SolveKind
    address, n, fsize_limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if fsize_limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    source = DaemonSource(address)
    assert source.wait_connected(60)
    x = torch.randn(n, n + 8)
    source.submit(PreconditionerRequest(
        block="big", version=0, kind=SolveKind.INVERSE_ROOT, matrix=x @ x.T / n))
    result = source.wait("big", 0, 120)
    stats = source.stats()
    source.close()
    print(json.dumps({"result": result is not None, **stats}))
    """
)


def run_client(daemon: Daemon, n: int, *, fsize_limit: int = 0, prefix: list[str] | None = None):
    cmd = [*(prefix or []), sys.executable, "-c", CLIENT, daemon.target, str(n), str(fsize_limit)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=_clean_env(), timeout=240, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_a_segment_that_cannot_be_reserved_falls_back_to_grpc(daemon: Daemon) -> None:
    # 1 MiB file-size limit: reserving the 4 MiB segments fails (EFBIG) at creation, before any
    # byte is touched, so there is no SIGBUS; the block goes over gRPC and is computed.
    stats, stderr = run_client(daemon, 1024, fsize_limit=1 << 20)
    assert stats["result"]
    assert stats["shm_blocks_refused"] == 1 and stats["shm_snapshots"] == 0
    assert stats["chunked_snapshots"] == 1
    assert "file-size limit" in stderr and "goes over gRPC" in stderr


def _can_mount_private_tmpfs() -> bool:
    probe = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_mount_private_tmpfs(), reason="needs unshare -m and tmpfs mounts")
def test_a_tiny_dev_shm_does_not_limit_the_segments(daemon: Daemon) -> None:
    # The client runs in a mount namespace whose /dev/shm is a 1 MiB tmpfs: segments are memfds,
    # not /dev/shm files, so a 4 MiB matrix still goes through shared memory.
    script = 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"'
    prefix = ["unshare", "-m", "sh", "-c", script, "sh"]
    stats, _ = run_client(daemon, 1024, prefix=prefix)
    assert stats["result"] and stats["shm_snapshots"] == 1 and stats["shm_results"] == 1


# ---------------------------------------------------------------------------------- leaks

HOLDER = textwrap.dedent(
    """
    import sys, time
    import torch
    from asteria_client.runtime.source import PreconditionerRequest
    from asteria_client.transport import DaemonSource
    from asteria_server.engine import SolveKind
    source = DaemonSource(sys.argv[1])
    assert source.wait_connected(60)
    for block in range(4):
        source.submit(PreconditionerRequest(
            block=f"b{block}", version=0, kind=SolveKind.EIGENBASIS, matrix=torch.eye(64)))
    assert all(source.wait(f"b{block}", 0, 60) is not None for block in range(4))
    assert source.stats()["shm_snapshots"] == 4
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_a_client_killed_with_sigkill_leaves_no_mapping_in_the_daemon(daemon: Daemon) -> None:
    before = memfd_maps(daemon.proc.pid)
    shm_files = set(os.listdir("/dev/shm"))
    client = subprocess.Popen(
        [sys.executable, "-c", HOLDER, daemon.target],
        stdout=subprocess.PIPE,
        text=True,
        env=_clean_env(),
    )
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "ready"
        # 4 blocks x 2 segments, slots of the client's arenas (one per slot size): 2 mappings
        assert len(memfd_maps(daemon.proc.pid)) >= len(before) + 2
        client.send_signal(signal.SIGKILL)
        client.wait()
    finally:
        client.kill()
    deadline = time.monotonic() + 10
    while memfd_maps(daemon.proc.pid) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert memfd_maps(daemon.proc.pid) == before
    # Nothing of the client's is left in /dev/shm (its segments never were there).
    new_files = set(os.listdir("/dev/shm")) - shm_files
    assert not [f for f in new_files if f.startswith(f"asteria_{client.pid}_")]
    # And the daemon keeps serving.
    source = DaemonSource(daemon.target)
    try:
        assert source.wait_connected(WAIT_S)
        source.submit(root_request("after", 0, 32, 3))
        assert source.wait("after", 0, WAIT_S) is not None
    finally:
        source.close()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_the_segments_outlive_a_daemon_and_serve_its_successor(tmp_path: Path, how: str) -> None:
    first = start_daemon(tmp_path)
    config = DaemonClientConfig(backoff_initial_s=0.05, backoff_max_s=0.5)
    source = DaemonSource(first.target, config=config)
    try:
        assert source.wait_connected(WAIT_S)
        source.submit(root_request("s", 0, 64, 0))
        assert source.wait("s", 0, WAIT_S) is not None
        segments = source.segments()
        if how == "sigterm":
            stop_daemon(first)
        else:
            from tests.integration.test_daemon_client import _kill_9

            _kill_9(first)
        # The daemon (a Python 3.11 process that mapped the segments) is gone; they are intact.
        for seg in segments.values():
            assert seg.segment.capacity_bytes == seg.segment.size_bytes - 4096
        second = start_daemon(tmp_path)
        try:
            deadline = time.monotonic() + WAIT_S
            while (
                source.incarnation_id == ""
                or not source.connected
                or (source.stats()["daemon_incarnation"] in first.serving_line)
            ):
                assert time.monotonic() < deadline, "the client did not reconnect"
                time.sleep(0.05)
            source.submit(root_request("s", 1, 64, 1))
            assert source.wait("s", 1, WAIT_S) is not None
            stats = source.stats()
            assert stats["transport"] == "shm" and stats["shm_snapshots"] >= 2
            assert source.segments() == segments  # the same segments, handed over again
        finally:
            stop_daemon(second)
    finally:
        source.close()
