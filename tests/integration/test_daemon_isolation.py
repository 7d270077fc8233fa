"""Who may stand behind the daemon's socket, and what a client accepts from it (issue 10, item 6).

- The daemon refuses a socket directory that is a symbolic link (its owner could swap it after
  the start and receive clients' tokens) or that another user owns.
- The client checks, with SO_PEERCRED, that the process serving the socket runs as the expected
  user (``ASTERIA_DAEMON_UID``, else its own or root) and refuses otherwise, with a clear error.
- The client checks every result it receives (shape, kind, finite); a bad one (here: a real
  worker told to write NaN after its own check, as a faulty daemon would) is dropped and
  counted, the block keeps nothing bad and nobody waits for it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from asteria_client.daemon_process import DaemonProcess, DaemonStartError
from asteria_client.runtime.source import PreconditionerRequest
from asteria_client.transport.connection import DaemonClientConfig, DaemonConnection
from asteria_client.transport.daemon import DaemonSource
from asteria_server.errors import AuthenticationError
from asteria_server.types import SolveKind
from tests.integration.test_daemon import start_daemon, stop_daemon


def test_a_symlinked_socket_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    launcher = DaemonProcess(workers=1, socket_dir=link, start_timeout_s=30.0)
    with pytest.raises(DaemonStartError, match="symbolic link"):
        launcher.start()
    assert not (real / "asteria.sock").exists()


def test_a_socket_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    launcher = DaemonProcess(workers=1, socket_dir=foreign, start_timeout_s=30.0)
    with pytest.raises(DaemonStartError, match="owned by uid 65534"):
        launcher.start()


def test_the_client_refuses_a_daemon_of_an_unexpected_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = start_daemon(tmp_path)
    try:
        config = DaemonClientConfig(call_timeout_s=10.0)
        trusted = DaemonConnection(daemon.target, config=config)
        assert trusted.open_session().session_id  # our own uid: accepted
        trusted.close()
        monkeypatch.setenv("ASTERIA_DAEMON_UID", str(os.getuid() + 4242))
        wary = DaemonConnection(daemon.target, config=config)
        with pytest.raises(AuthenticationError, match="ASTERIA_DAEMON_UID") as info:
            wary.open_session()
        assert f"uid {os.getuid()}" in str(info.value)
        wary.close()
    finally:
        stop_daemon(daemon)


def _spd(n: int, seed: int) -> torch.Tensor:
    g = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (g @ g.T / n + torch.eye(n, dtype=torch.float64)).float()


def test_a_nan_result_from_the_daemon_is_dropped_counted_and_not_waited_for(
    tmp_path: Path,
) -> None:
    config = tmp_path / "faults.toml"
    config.write_text('test_fault_prefix = "t:x"\n')  # test-only: blocks t:x<fault>... misbehave
    daemon = start_daemon(tmp_path, "--config", str(config))
    source = DaemonSource(daemon.target, job="t", config=DaemonClientConfig(connect_timeout_s=30))
    try:
        for name in ("good", "xpoison:bad"):
            source.submit(
                PreconditionerRequest(
                    block=name, version=1, kind=SolveKind.EIGENBASIS, matrix=_spd(16, 1)
                )
            )
        good = source.wait("good", 1, timeout_s=30.0)
        assert good is not None and torch.isfinite(good.matrix).all()
        deadline = time.monotonic() + 30.0
        while source.stats()["results_invalid"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert source.stats()["results_invalid"] >= 1
        assert source.stats()["transport"] == "shm"  # the NaN came through its result segment
        assert source.take("xpoison:bad") is None  # never installed
        started = time.monotonic()
        assert source.wait("xpoison:bad", 1, timeout_s=20.0) is None
        assert time.monotonic() - started < 10.0  # nothing is in flight for it: no waiting
        assert "NaN" in source.records()["xpoison:bad"].last_error
    finally:
        source.close()
        stop_daemon(daemon)


def test_a_refused_daemon_is_logged_once_with_the_fix_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The deployment mistake of issue 29: a job whose daemon runs as another user, without
    ASTERIA_DAEMON_UID. Training goes on locally, but not silently: one WARNING for the
    process naming the uid seen, the uid expected and the variable to set, and counters in
    runtime_stats() that say why the blocks were computed locally."""
    from asteria_client import SOAP
    from asteria_client.transport import peer

    daemon = start_daemon(tmp_path)
    wrong = os.getuid() + 4242
    monkeypatch.setenv("ASTERIA_DAEMON_UID", str(wrong))
    before = peer.refusals()
    try:
        stats = []
        with caplog.at_level("WARNING"):
            for _ in range(2):  # two optimizers in one process: still one warning
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
                with SOAP(
                    model.named_parameters(),
                    lr=1e-2,
                    precondition_frequency=2,
                    mode="daemon",
                    address=daemon.target,
                    staleness_budget=1,
                    barrier_timeout_s=0.2,
                ) as opt:
                    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
                    for _ in range(6):
                        opt.zero_grad()
                        model(x).square().mean().backward()
                        opt.step()
                    stats.append(opt.runtime_stats())
    finally:
        stop_daemon(daemon)
    refusal_lines = [
        r for r in caplog.records if r.name == "asteria_client.transport.peer" and r.levelno >= 30
    ]
    if before == 0:  # the first refusal of this test process: its one warning is here
        assert len(refusal_lines) == 1, [r.getMessage() for r in refusal_lines]
        text = refusal_lines[0].getMessage()
        assert f"uid {os.getuid()}" in text and f"uid(s) {wrong}" in text, text
        assert f"correct it to {os.getuid()}" in text and "ASTERIA_DAEMON_UID" in text, text
    else:
        assert refusal_lines == []
    for s in stats:
        assert s["local_fallbacks"] > 0
        assert s["local_fallbacks_daemon_refused"] == s["local_fallbacks"], s
        assert s["source"]["daemon_refused"] is True
    assert peer.refusals() >= before + 2
    # The runtime's fallback line says why, once per optimizer, instead of "no result in time".
    fallback_lines = [
        r.getMessage() for r in caplog.records if "daemon was refused" in r.getMessage()
    ]
    assert len(fallback_lines) == 2, fallback_lines
