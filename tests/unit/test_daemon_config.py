"""DaemonConfig: validation and the TOML -> env -> flags loading order."""

from __future__ import annotations

from pathlib import Path

import pytest

from asteria_server.__main__ import main
from asteria_server.config import (
    DaemonConfig,
    TcpAddress,
    UnixAddress,
    load_config,
    parse_listen,
    parse_tokens,
)


def test_flags_beat_env_beat_toml(tmp_path: Path) -> None:
    toml = tmp_path / "a.toml"
    toml.write_text(
        "workers = 3\nblas_threads = 2\nchunk_bytes = 4096\n"
        '[tenants]\nann = "t1-0123456789abcdef"\n'
    )
    env = {"ASTERIA_WORKERS": "5", "ASTERIA_BLAS_THREADS": "4"}
    config = load_config(config_file=str(toml), environ=env, overrides={"workers": 7})
    assert (config.workers, config.blas_threads, config.chunk_bytes) == (7, 4, 4096)
    assert dict(config.tokens) == {"ann": "t1-0123456789abcdef"}
    env["ASTERIA_TOKENS"] = "ann=x123456789abcdef, bob=y123456789abcdef"
    assert dict(load_config(config_file=str(toml), environ=env).tokens) == {
        "ann": "x123456789abcdef",
        "bob": "y123456789abcdef",
    }
    assert "t1" not in repr(config)


def test_tokens_and_addresses_parse() -> None:
    assert parse_tokens("a=1,b=2,") == {"a": "1", "b": "2"}
    with pytest.raises(ValueError, match="ASTERIA_TOKENS"):
        parse_tokens("a=1,b")
    assert parse_listen("unix:///run/x.sock") == UnixAddress(Path("/run/x.sock"))
    assert parse_listen("127.0.0.1:0") == TcpAddress("127.0.0.1", 0)
    assert parse_listen("[::1]:5").is_loopback  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="listen"):
        parse_listen("unix://relative.sock")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workers": 0}, "workers must be an int >= 1, got 0"),
        ({"grace_period_s": float("nan")}, "grace_period_s"),
        ({"chunk_bytes": 1 << 20, "max_message_bytes": 1 << 20}, "max_message_bytes"),
        ({"listen": "127.0.0.1:0"}, "no tenant tokens"),
        ({"listen": "0.0.0.0:0", "tokens": {"a": "b" * 16}}, "needs TLS"),
        ({"tokens": {"a": ""}}, "empty token"),
        ({"log_level": "LOUD"}, "log_level"),
        ({"stop_with_pid": 0}, "stop_with_pid must be an int >= 1, got 0"),
    ],
)
def test_invalid_values_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DaemonConfig(**{"listen": "unix:///tmp/x.sock", **kwargs})  # type: ignore[arg-type]


def test_tcp_with_tokens_on_loopback_is_fine() -> None:
    config = DaemonConfig(listen="127.0.0.1:0", tokens={"a": "b" * 16}, workers=1)
    assert not config.allows_anonymous()
    assert DaemonConfig(listen="unix:///tmp/x.sock", workers=1).allows_anonymous()


def test_cli_reports_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("wrokers = 2\n")
    assert main(["--config", str(toml)]) == 2
    assert "unknown key 'wrokers'" in capsys.readouterr().err


PEER_TLS = {
    "peer_tls_cert": "/etc/asteria/tls/node.crt",
    "peer_tls_key": "/etc/asteria/tls/node.key",
    "peer_tls_ca": "/etc/asteria/tls/ca.crt",
}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"peer_listen": "0.0.0.0:29600", "tokens": {"t": "x" * 32}}, "needs peer_tls_cert"),
        ({"peer_listen": "0.0.0.0:29600", **PEER_TLS}, "needs tenant tokens"),
        ({"peer_listen": "unix:///tmp/p.sock", "tokens": {"t": "x" * 32}, **PEER_TLS}, "HOST:PORT"),
        ({"peer_tls_ca": "/etc/ca.crt"}, "peer_tls_ca is set but peer_listen is not"),
        (
            {
                "listen": "127.0.0.1:7000",
                "peer_listen": "127.0.0.1:7000",
                "tokens": {"t": "x" * 32},
                **PEER_TLS,
            },
            "port of its own",
        ),
        (
            {
                "peer_listen": "0.0.0.0:29600",
                "peer_advertise": "node-a:0",
                "tokens": {"t": "x" * 32},
                **PEER_TLS,
            },
            "must name a port",
        ),
    ],
)
def test_the_peer_listener_is_mutual_tls_with_tokens_or_nothing(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        DaemonConfig(**kwargs)  # type: ignore[arg-type]


def test_the_peer_listener_beside_a_unix_socket_is_valid_and_advertised() -> None:
    from asteria_server.service.server import advertised_peer_address

    config = DaemonConfig(
        listen="unix:///run/asteria/asteria.sock",
        peer_listen="0.0.0.0:29600",
        tokens={"t": "x" * 32},
        **PEER_TLS,  # type: ignore[arg-type]
    )
    assert config.peer_address is not None and config.peer_address.port == 29600
    # Every address bound: peers are told this host's name, with the port bound.
    assert advertised_peer_address(config, 29600).endswith(":29600")
    assert not advertised_peer_address(config, 29600).startswith("0.0.0.0")
    named = DaemonConfig(
        listen="unix:///run/asteria/asteria.sock",
        peer_listen="127.0.0.1:0",
        peer_advertise="10.0.0.7:29600",
        tokens={"t": "x" * 32},
        **PEER_TLS,  # type: ignore[arg-type]
    )
    assert advertised_peer_address(named, 41000) == "10.0.0.7:29600"
    loopback = DaemonConfig(
        listen="unix:///run/asteria/asteria.sock",
        peer_listen="127.0.0.1:0",
        tokens={"t": "x" * 32},
        **PEER_TLS,  # type: ignore[arg-type]
    )
    assert advertised_peer_address(loopback, 41000) == "127.0.0.1:41000"
