"""A daemon on TCP with TLS and tenant tokens, reached by the client with ``ASTERIA_TLS_CA``.

The certificate is a fresh self-signed one made by ``openssl`` for ``localhost``; a client that
does not trust it, or that speaks plaintext, gets no session and trains locally.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asteria_client.runtime.source import PreconditionerRequest
from asteria_client.transport import DaemonClientConfig, DaemonSource
from asteria_server.engine import SolveKind
from asteria_server.errors import InvalidInputError
from tests.integration.test_daemon import START_TIMEOUT_S, _clean_env

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
TOKEN = "s3cret-token-of-team-a"


def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(tmp)
    ready = tmp / "ready"
    env = _clean_env() | {"ASTERIA_TOKENS": f"team-a={TOKEN}"}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "asteria_server", "--listen", "127.0.0.1:0", "--workers", "1"),
            *("--tls-cert", str(cert), "--tls-key", str(key), "--ready-file", str(ready)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the TLS daemon did not start"
        time.sleep(0.05)
    port = ready.read_text().split("serving on ", 1)[1].split()[0].rsplit(":", 1)[1]
    yield f"localhost:{port}", cert
    proc.terminate()
    proc.communicate(timeout=30)


def root_request(version: int) -> PreconditionerRequest:
    x = torch.randn(16, 24)
    return PreconditionerRequest(
        block="w", version=version, kind=SolveKind.INVERSE_ROOT, matrix=x @ x.T / 24
    )


def test_a_client_trusting_the_ca_gets_results_over_tls(
    tls_daemon: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, cert = tls_daemon
    monkeypatch.setenv("ASTERIA_TLS_CA", str(cert))
    source = DaemonSource(address, tenant="team-a", token=TOKEN)
    try:
        assert source.wait_connected(30)
        source.submit(root_request(0))
        assert source.wait("w", 0, 60) is not None
        assert source.stats()["transport"] == "grpc"  # TCP: no shared memory
    finally:
        source.close()


def test_plaintext_or_an_untrusted_certificate_gets_no_session(
    tls_daemon: tuple[str, Path], tmp_path: Path
) -> None:
    address, _ = tls_daemon
    other_ca, _ = self_signed(tmp_path)
    for config in (
        DaemonClientConfig(connect_timeout_s=2.0),
        DaemonClientConfig(connect_timeout_s=2.0, tls_ca=str(other_ca)),
    ):
        source = DaemonSource(address, tenant="team-a", token=TOKEN, config=config)
        try:
            assert not source.connected  # it trains locally instead (see the staleness budget)
        finally:
            source.close()


def test_tls_on_a_unix_socket_is_a_clear_error(tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path)
    with pytest.raises(InvalidInputError, match="Unix socket is local"):
        DaemonSource(f"unix://{tmp_path}/a.sock", config=DaemonClientConfig(tls_ca=str(cert)))
