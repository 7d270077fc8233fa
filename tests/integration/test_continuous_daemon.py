"""Continuous refresh against a real daemon: the daemon's Credit messages decide what is pulled.

A one-worker daemon process, real gRPC and shared memory. Blocks of job ``t`` named
``x<fault>...`` misbehave (the daemon's test-only fault prefix ``t:x``): ``xhang-once`` holds the
only worker until the solve timeout kills it, which is how these tests keep every worker busy.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from asteria_client import SOAP, KLShampoo
from asteria_client.runtime.source import PreconditionerRequest
from asteria_client.transport import DaemonClientConfig, DaemonSource
from asteria_client.transport.connection import DaemonConnection
from asteria_server.errors import AsteriaError, DaemonBusyError
from asteria_server.types import Credit, SolveKind
from tests.integration.test_continuous_embedded import (
    check_continuous_trains_within_its_budget,
    step_until_every_block_has_a_result,
)
from tests.integration.test_daemon import Daemon, start_daemon, stop_daemon

WAIT_S = 30.0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    config = tmp_path / "faults.toml"
    # test-only: blocks t:x<fault>... misbehave; a hung solve is killed after 3 s
    config.write_text(
        'test_fault_prefix = "t:x"\nsolve_timeout_s = 3.0\nsolve_timeout_floor_s = 3.0\n'
    )
    d = start_daemon(tmp_path, "--config", str(config))
    yield d
    stop_daemon(d)


def _until(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def _spd(n: int, seed: int) -> torch.Tensor:
    g = torch.randn(n, n, generator=torch.Generator().manual_seed(seed))
    return g @ g.T / n + torch.eye(n)


def _request(block: str, version: int) -> PreconditionerRequest:
    return PreconditionerRequest(
        block=block, version=version, kind=SolveKind.EIGENBASIS, matrix=_spd(8, version)
    )


def _sent(source: DaemonSource) -> int:
    stats = source.stats()
    return int(stats["shm_snapshots"] + stats["chunked_snapshots"])


def test_credit_follows_the_daemons_free_workers(daemon: Daemon) -> None:
    """A pulling source learns the daemon's capacity from its result stream: 1 idle worker + 1
    at first; 0 while a hung solve holds the worker (and a snapshot waits behind it); back
    once the worker is replaced and the queue drained. A source that does not pull gets no
    credit messages."""
    config = DaemonClientConfig(connect_timeout_s=WAIT_S)
    puller = DaemonSource(daemon.target, job="t", config=config, pulls=True)
    pusher = DaemonSource(daemon.target, job="t2", config=config)
    try:
        _until(lambda: puller.stats()["credit_messages"] > 0, "the first credit message")
        assert puller.credit() == 2
        puller.submit(_request("xhang-once:h", 1))
        # Pending, being sent or sent: 1 until the daemon's count of it is seen, then 0 once its
        # worker took it; never 2 (it counted from the moment the sender took it).
        assert puller.credit() <= 1
        _until(lambda: puller.credit() == 0, "the worker took the hung solve")
        puller.submit(_request("b", 1))  # queued behind the hung solve
        time.sleep(1.0)  # the worker is still hung (3 s timeout)
        assert puller.credit() == 0
        answer = puller.status()
        assert answer is not None and answer[0].workers_busy == 1 and answer[0].queue_depth == 1
        assert puller.wait("b", 1, WAIT_S) is not None  # after the hung one was killed
        assert puller.wait("xhang-once:h", 1, WAIT_S) is not None  # its retry succeeded
        _until(lambda: puller.credit() == 2, "the worker was free again")
        assert pusher.stats()["credit_messages"] == 0
    finally:
        puller.close()
        pusher.close()


def test_no_snapshot_is_sent_while_every_worker_is_busy(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SOAP in daemon mode, continuous: while the daemon's only worker is held by a hung solve,
    the steps send no snapshot, though the other blocks' factors move (no floor is due at
    f = 1000: every pull would be an extra one, by credit) — the embedded test's twin, counted
    at the client's transport. Once the worker is back, pulls resume and every block gets its
    basis."""
    monkeypatch.setenv("ASTERIA_JOB", "t")
    gen = torch.Generator().manual_seed(0)
    params = {
        "xhang-once:w": torch.nn.Parameter(torch.randn(6, 6, generator=gen)),
        "y": torch.nn.Parameter(torch.randn(6, 6, generator=gen)),
        "z": torch.nn.Parameter(torch.randn(6, 6, generator=gen)),
    }
    opt = SOAP(
        list(params.items()),
        mode="daemon",
        address=daemon.target,
        refresh="continuous",
        staleness_budget=1000,  # no barrier: this test is about what is sent
        precondition_frequency=1000,  # after a block's first snapshot, extra pulls alone
    )
    source = opt.source
    assert isinstance(source, DaemonSource)
    hang = {"on": False}

    def step() -> None:
        for name, p in params.items():
            # without a gradient a parameter takes no step: the hanging one starts later
            p.grad = torch.randn(6, 6, generator=gen) if hang["on"] or name[0] != "x" else None
        opt.step()

    def busy() -> bool:
        answer = source.status()
        return answer is not None and answer[0].workers_busy >= answer[0].num_workers

    try:
        _until(lambda: source.stats()["credit_messages"] > 0, "the first credit message")
        rows = step_until_every_block_has_a_result(opt, step, WAIT_S)  # y and z's 4 blocks
        assert len(rows) == 4 and all(r["version"] >= 0 for r in rows), rows
        hang["on"] = True
        before = _sent(source)
        step()  # the hanging parameter's first step: its 2 blocks by the floor; one hangs
        _until(lambda: _sent(source) >= before + 2, "the hanging parameter's snapshots were sent")
        busy_steps = 0
        for _ in range(60):
            before, busy_before = _sent(source), busy()
            step()
            time.sleep(0.02)  # what the sender would send, it has sent by now
            if busy_before and busy():
                busy_steps += 1
                assert _sent(source) == before, "a snapshot was sent while the worker was busy"
        assert busy_steps >= 10, f"only {busy_steps} steps saw the worker busy"
        rows = step_until_every_block_has_a_result(opt, step, WAIT_S)
    finally:
        opt.close()
    assert len(rows) == 6 and all(r["version"] >= 0 for r in rows), rows
    assert _sent(source) > 6


@pytest.mark.parametrize("optimizer", [SOAP, KLShampoo])
def test_daemon_continuous_trains_within_its_budget(daemon: Daemon, optimizer: type) -> None:
    """SOAP and KL-Shampoo, continuous at S=1 on the daemon, pulling by its Credit messages
    (see the embedded test's check)."""
    stats = check_continuous_trains_within_its_budget(
        optimizer, mode="daemon", address=daemon.target
    )
    assert stats["credit_messages"] > 0


def test_a_session_gets_credit_on_one_stream_only(daemon: Daemon) -> None:
    """Every solve wakes the streams that receive credit, so a tenant must not multiply them:
    a second credit stream of the same session is refused with a clear error, while a
    stream without credit and another session's credit stream are not."""
    conn = DaemonConnection(daemon.target)
    session, other = conn.open_session(), conn.open_session()
    credits: list[Credit] = []
    cancels: list[Callable[[], object]] = []

    def drain(stream: Iterator[object]) -> None:
        with contextlib.suppress(AsteriaError):
            for _ in stream:
                pass

    try:
        first = conn.results(session, {}, cancels.append, on_credit=credits.append)
        threading.Thread(target=drain, args=(first,), daemon=True).start()
        _until(lambda: len(credits) == 1, "the first stream's credit message")
        assert credits[0].workers_idle == 1 and credits[0].snapshots_answered == 0
        second = conn.results(session, {}, cancels.append, on_credit=credits.append)
        with pytest.raises(DaemonBusyError, match="already receives credit on another"):
            next(second)
        for extra in (
            conn.results(session, {}, cancels.append),
            conn.results(other, {}, cancels.append, on_credit=credits.append),
        ):
            threading.Thread(target=drain, args=(extra,), daemon=True).start()
        _until(lambda: len(credits) == 2, "the other session's credit message")
    finally:
        for cancel in cancels:
            cancel()
        conn.close()
