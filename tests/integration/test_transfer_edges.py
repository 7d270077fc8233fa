"""The edges of the device transfers, on CPU with a simulated, slowed device (tests/sim_device.py)
and real parts around it: a real daemon (shared memory and gRPC), a real embedded engine.

- ``close()`` waits for every copy in flight before it returns (and lets buffers go);
- a block's snapshot segment has one writer, the sender: a snapshot submitted while the sender
  writes the block's first one into its new segment is solved, not hidden;
- the embedded source's pending snapshots, which the exchange thread and the training thread
  both move along, are handed to the engine once each;
- the daemon source's threads never wait for the device, nor check a result's n² values,
  while they hold the lock the training thread takes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asteria_client.runtime.embedded import EmbeddedSource, EngineConfig
from asteria_client.runtime.source import PreconditionerRequest
from asteria_client.transport import DaemonClientConfig, DaemonSource
from asteria_client.transport import daemon as daemon_module
from asteria_server.protocol.shm import Segment
from asteria_server.types import SolveKind
from tests.integration.test_daemon import Daemon, start_daemon, stop_daemon
from tests.sim_device import SimulatedDevice

WAIT_S = 30.0
N = 24


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path)
    yield d
    stop_daemon(d)


def _spd(seed: int, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g)
    return a @ a.T + n * torch.eye(n)


def _request(version: int, block: str = "blk", seed: int | None = None) -> PreconditionerRequest:
    return PreconditionerRequest(
        block=block,
        version=version,
        kind=SolveKind.INVERSE_ROOT,
        matrix=_spd(version if seed is None else seed),
    )


def _until(check: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def _source(daemon: Daemon, transfer: Any, **config: Any) -> DaemonSource:
    source = DaemonSource(daemon.target, config=DaemonClientConfig(**config), transfer=transfer)
    assert source.wait_connected(WAIT_S)
    return source


def _with_segments(source: DaemonSource) -> None:
    """Submit a first snapshot and wait until the block's segments exist (sender thread)."""
    source.submit(_request(1))
    assert source.wait("blk", 1, WAIT_S) is not None
    _until(lambda: len(source.segments()) == 2, "the block's segments")


def test_close_waits_for_a_copy_in_flight_before_it_returns(tmp_path: Path) -> None:
    """A snapshot copy still landing in host memory (the daemon went away, so nothing else
    waits for it) must be complete before ``close()`` returns and the source lets its buffers
    and segments go: on a GPU the DMA would write into freed memory."""
    daemon = start_daemon(tmp_path)
    device = SimulatedDevice()
    source = _source(daemon, device, connect_timeout_s=5.0, backoff_max_s=0.2)
    try:
        _with_segments(source)
        stop_daemon(daemon)
        _until(lambda: not source.connected, "the source to notice the daemon left")
        device.delay_s = 0.5
        before = len(device.log)
        source.submit(_request(2))  # lands in 0.5 s; no sender waits for it
    finally:
        source.close()
        stop_daemon(daemon)
    assert [kind for kind, _ in device.log[before:]] == ["copied"]


def test_a_new_segment_is_published_only_after_its_first_snapshot_is_written(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender writes a block's first snapshot into the block's new segment. A snapshot the
    training thread takes meanwhile must not go into that segment too (two writers on one
    seqlock: the sender's write hides it, and the newer version is never solved). Here the
    training thread submits version 2 exactly while the sender writes version 1."""
    source = _source(daemon, None)
    original = Segment.write
    raced = threading.Event()
    submitted = threading.Event()  # version 2 was submitted (during the sender's write)

    def write_with_a_submit_inside(self: Segment, specs: Any, arrays: Any) -> int:
        if not raced.is_set() and threading.current_thread().name == "asteria-daemon-sender":
            raced.set()
            other = threading.Thread(target=source.submit, args=(_request(2),))
            other.start()
            other.join()
            submitted.set()
        return original(self, specs, arrays)

    monkeypatch.setattr(Segment, "write", write_with_a_submit_inside)
    try:
        source.submit(_request(1))
        _until(submitted.is_set, "the submit during the sender's first segment write")
        result = source.wait("blk", 2, 10.0)
        assert result is not None and result.version == 2
        expected = torch.linalg.eigh(_spd(2).double())
        root = expected.eigenvectors @ torch.diag(expected.eigenvalues**-0.25)
        root = root @ expected.eigenvectors.T
        np.testing.assert_allclose(result.matrix.double().numpy(), root.numpy(), rtol=1e-3)
    finally:
        source.close()


def test_the_daemon_sources_threads_check_results_without_the_training_threads_lock(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session thread checks every result (finite values: an n² pass) before keeping it;
    the training thread's ``take``/``submit`` need the same lock, so it must be free then."""
    source = _source(daemon, None)
    held = []
    original = daemon_module._result_problem

    def checked(*args: Any) -> str | None:
        held.append(not _free(source._lock))
        return original(*args)

    monkeypatch.setattr(daemon_module, "_result_problem", checked)
    try:
        for version in (1, 2, 3):
            source.submit(_request(version))
            assert source.wait("blk", version, WAIT_S) is not None
    finally:
        source.close()
    assert held and not any(held), held


def test_the_sender_waits_for_device_copies_without_the_training_threads_lock(
    daemon: Daemon,
) -> None:
    """Every wait for a snapshot's device copy (the event's ``synchronize``) happens with the
    lock free that ``submit``, ``take`` and ``wait`` need. The trap: the sender waits (unlocked)
    for the copies it saw, block a's slow one first; meanwhile a newer copy of block b
    replaces the one it saw, and that one must not be waited for under the lock."""
    holds: list[bool] = []
    source: DaemonSource | None = None

    def on_wait() -> None:
        if source is not None and threading.current_thread().name == "asteria-daemon-sender":
            holds.append(not _free(source._lock))

    device = SimulatedDevice(on_wait=on_wait)
    source = _source(daemon, device)
    try:
        for block in ("a", "b"):
            source.submit(_request(1, block=block))
            assert source.wait(block, 1, WAIT_S) is not None
        _until(lambda: len(source.segments()) == 4, "both blocks' segments")
        device.delay_s = 0.4
        source.submit(_request(2, block="a"))  # slow
        device.delay_s = 0.0
        source.submit(_request(2, block="b"))  # fast: done when the sender looks
        time.sleep(0.1)  # the sender waits for a's copy now
        device.delay_s = 0.4
        source.submit(_request(3, block="b"))  # replaces b's copy the sender saw
        assert source.wait("a", 2, WAIT_S) is not None
        assert source.wait("b", 3, WAIT_S) is not None
    finally:
        source.close()
    assert holds and not any(holds), f"{sum(holds)} of {len(holds)} waits held the lock"


def _free(lock: Any) -> bool:
    """Whether another thread could take ``lock`` now."""
    answer = []
    probe = threading.Thread(target=lambda: answer.append(_try(lock)))
    probe.start()
    probe.join()
    return answer[0]


def _try(lock: Any) -> bool:
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False


def test_pending_snapshots_are_handed_to_the_engine_once_under_concurrent_take_and_submit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The DDP exchange thread calls ``take`` (which moves pending snapshots on) while the
    training thread submits: each snapshot must reach the engine exactly once. The exchange's
    hand-over of version 1 is held open while the training thread submits version 2."""
    device = SimulatedDevice(delay_s=0.05)
    source = EmbeddedSource(EngineConfig(num_workers=1, calibrate=False), transfer=device)
    handed: Counter[tuple[str, int]] = Counter()
    release = threading.Event()
    original = source.engine.submit

    def submit(task: Any, **kwargs: Any) -> Any:
        handed[(task.block, task.version)] += 1
        if threading.current_thread().name == "exchange":
            release.wait(WAIT_S)
        return original(task, **kwargs)

    monkeypatch.setattr(source.engine, "submit", submit)
    try:
        source.submit(_request(1, block="a"))
        _until(lambda: len(device.log) >= 1, "a's copy")  # landed: the next pump hands it over
        exchange = threading.Thread(target=source.take, args=("a",), name="exchange")
        exchange.start()
        _until(lambda: handed[("a", 1)] >= 1, "the exchange's hand-over")
        source.submit(_request(2, block="b"))  # the training thread, meanwhile
        time.sleep(0.2)
        source.pump()
        release.set()
        exchange.join(WAIT_S)
        source.pump()
        assert source.wait("b", 2, WAIT_S) is not None
    finally:
        release.set()
        source.close()
    assert handed == {("a", 1): 1, ("b", 2): 1}
