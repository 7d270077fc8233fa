"""The daemon source's session and segment set heal what can break under a running trainer."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asteria_client.transport import DaemonClientConfig, DaemonSource
from tests.integration.test_daemon import Daemon, start_daemon, stop_daemon
from tests.integration.test_shm_traps import memfd_maps, root_request

WAIT_S = 30.0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path)
    yield d
    stop_daemon(d)


def test_a_lost_handover_connection_is_noticed_and_the_segments_handed_over_again(
    daemon: Daemon,
) -> None:
    """The daemon drops every mapping of a handover connection that closes. A client that kept
    announcing those segments would have every later snapshot refused; this one notices,
    reconnects the handover socket, hands the segments over again and keeps using them."""
    source = DaemonSource(daemon.target, config=DaemonClientConfig(connect_timeout_s=WAIT_S))
    try:
        source.submit(root_request("b", 1, 32, 1))
        assert source.wait("b", 1, WAIT_S) is not None
        before = source.stats()
        assert before["transport"] == "shm" and before["shm_snapshots"] == 1
        mapped = len(memfd_maps(daemon.proc.pid))
        assert mapped >= 1  # the block's two segments: slots of one arena

        # Break the connection under the client (as a daemon-side close or a reset would).
        channel = source._segments._channel  # the one place this test reaches inside
        assert channel is not None
        channel._sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + WAIT_S
        while len(memfd_maps(daemon.proc.pid)) >= mapped:  # the daemon let go of them
            assert time.monotonic() < deadline, "the daemon kept the segments of a closed socket"
            time.sleep(0.05)

        for version in range(2, 4):  # the loss is found and healed on the way (no version lost)
            source.submit(root_request("b", version, 32, version))
            assert source.wait("b", version, WAIT_S) is not None, f"version {version} lost"
        healed = source.stats()
        assert healed["submits_rejected"] == 0 and healed["shm_rehandovers"] == 1
        for version in range(4, 6):  # and then every snapshot goes over shared memory again
            source.submit(root_request("b", version, 32, version))
            assert source.wait("b", version, WAIT_S) is not None, f"version {version} lost"
        after = source.stats()
        assert after["shm_snapshots"] == healed["shm_snapshots"] + 2
        assert after["chunked_snapshots"] == healed["chunked_snapshots"]
        assert after["submits_rejected"] == 0 and after["shm_rehandovers"] == 1
        assert len(memfd_maps(daemon.proc.pid)) == mapped
    finally:
        source.close()


def test_results_since_names_the_blocks_whose_results_arrived(daemon: Daemon) -> None:
    """What lets a hook install one arrival's tile instead of asking for every block."""
    source = DaemonSource(daemon.target, config=DaemonClientConfig(connect_timeout_s=WAIT_S))
    try:
        for block in ("a", "b"):
            source.submit(root_request(block, 1, 16, 1))
            assert source.wait(block, 1, WAIT_S) is not None
        epoch = source.results_epoch()
        assert epoch is not None
        assert source.results_since(epoch) == []
        assert sorted(source.results_since(0) or []) == ["a", "b"]
        source.submit(root_request("b", 2, 16, 2))
        assert source.wait("b", 2, WAIT_S) is not None
        assert source.results_since(epoch) == ["b"]
    finally:
        source.close()
