"""The daemon's configuration: one frozen dataclass, loaded from TOML, then env, then flags.

:class:`DaemonConfig` holds every setting of ``asteria-server``. :func:`load_config` builds it in
this order, later sources winning: the TOML file (``--config PATH``), ``ASTERIA_*`` environment
variables (read here and nowhere else), then command-line flags. Every field has one name in all
three: ``chunk_bytes`` is TOML ``chunk_bytes``, env ``ASTERIA_CHUNK_BYTES`` and flag
``--chunk-bytes``. Tenant tokens come from a TOML ``[tenants]`` table (``name = "token"``) or
``ASTERIA_TOKENS="tenant1=tok1,tenant2=tok2"``; they are never printed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asteria_server.engine.workers import default_num_workers

ENV_PREFIX = "ASTERIA_"
#: Level names ``--log-level`` accepts.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def default_listen() -> str:
    """``unix://$XDG_RUNTIME_DIR/asteria/asteria.sock``, else ``/tmp/asteria-$UID/asteria.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "asteria" if runtime else Path(f"/tmp/asteria-{os.getuid()}")
    return f"unix://{base / 'asteria.sock'}"


@dataclass(frozen=True)
class UnixAddress:
    """A Unix socket path (absolute)."""

    path: Path

    @property
    def target(self) -> str:
        return f"unix://{self.path}"

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")


@dataclass(frozen=True)
class TcpAddress:
    """A TCP host and port (port 0: any free port)."""

    host: str
    port: int

    @property
    def target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_listen(listen: str) -> UnixAddress | TcpAddress:
    """``unix:///abs/path.sock`` or ``HOST:PORT`` (``[::1]:PORT`` for IPv6)."""
    if listen.startswith("unix:"):
        path = listen.removeprefix("unix:")
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/"):
            raise ValueError(
                f"DaemonConfig.listen must name an absolute socket path "
                f"(unix:///path/to.sock), got {listen!r}"
            )
        return UnixAddress(Path(path))
    host, sep, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(
            f"DaemonConfig.listen must be unix:///path/to.sock or HOST:PORT, got {listen!r}"
        )
    return TcpAddress(host, int(port))


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Configuration of ``asteria-server``.

    Attributes:
        listen: ``unix:///path/to.sock`` (default; see :func:`default_listen`) or ``HOST:PORT``.
        workers: solver worker processes (default: usable CPUs - 1, at least 1).
        blas_threads: BLAS threads per worker.
        tokens: tenant -> token. Empty: only tenant ``local`` with an empty token, Unix socket only.
        max_message_bytes: largest gRPC message sent or received.
        chunk_bytes: array chunk size of snapshot and result streams.
        max_matrix_n: largest factor dimension accepted.
        grace_period_s: how long in-flight calls may finish at shutdown.
        keepalive_time_s: seconds between keepalive pings on idle connections.
        keepalive_timeout_s: a ping unanswered this long closes the connection.
        max_sessions: open sessions at most (the oldest is dropped beyond it).
        tls_cert: PEM certificate chain for TCP (required beyond loopback), with ``tls_key``.
        tls_key: PEM private key of ``tls_cert``.
        log_level: one of ``LOG_LEVELS``.
        ready_file: written (address, incarnation, workers) once serving; removed at exit.
        shared_memory: offer same-host clients the shared-memory transport (Unix socket only):
            a segment-handover socket ``<socket>.shm`` next to the gRPC socket.
        max_shm_segments: shared-memory segments one client connection may hand over.
        max_upload_bytes: snapshot bytes the daemon receives at once, all clients together (in
            chunks, or copied out of shared memory); an upload waits for room up to
            ``upload_wait_s``, then fails RESOURCE_EXHAUSTED, and one larger than this fails.
        upload_wait_s: how long an upload may wait for room in ``max_upload_bytes``.
    """

    listen: str = field(default_factory=default_listen)
    workers: int = field(default_factory=default_num_workers)
    blas_threads: int = 1
    tokens: Mapping[str, str] = field(default_factory=dict, repr=False)
    max_message_bytes: int = 4 << 20
    chunk_bytes: int = 1 << 20
    max_matrix_n: int = 16384
    grace_period_s: float = 10.0
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    max_sessions: int = 4096
    tls_cert: str | None = None
    tls_key: str | None = None
    log_level: str = "INFO"
    ready_file: str | None = None
    shared_memory: bool = True
    max_shm_segments: int = 4096
    max_upload_bytes: int = 2 << 30
    upload_wait_s: float = 5.0

    def __post_init__(self) -> None:
        address = parse_listen(self.listen)
        for name in ("workers", "blas_threads", "max_message_bytes", "chunk_bytes"):
            _check_int(name, getattr(self, name), 1)
        _check_int("max_matrix_n", self.max_matrix_n, 1)
        _check_int("max_sessions", self.max_sessions, 1)
        _check_int("max_shm_segments", self.max_shm_segments, 1)
        if not isinstance(self.shared_memory, bool):
            raise ValueError(
                f"DaemonConfig.shared_memory must be true or false, got {self.shared_memory!r}"
            )
        if self.max_message_bytes < self.chunk_bytes + 4096:
            raise ValueError(
                f"DaemonConfig.max_message_bytes must be >= chunk_bytes + 4096 "
                f"({self.chunk_bytes + 4096}) so a chunk and its framing fit, "
                f"got {self.max_message_bytes}"
            )
        _check_int("max_upload_bytes", self.max_upload_bytes, 1)
        for name in ("grace_period_s", "keepalive_time_s", "keepalive_timeout_s", "upload_wait_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"DaemonConfig.{name} must be a number, got {value!r}")
            if not (0 < value < math.inf):
                raise ValueError(f"DaemonConfig.{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.tokens, Mapping):
            raise ValueError("DaemonConfig.tokens must be a mapping tenant -> token")
        for tenant, token in self.tokens.items():
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(
                    f"DaemonConfig.tokens: tenant must be a non-empty string, got {tenant!r}"
                )
            if not isinstance(token, str) or not token:
                # The token itself is never echoed.
                raise ValueError(f"DaemonConfig.tokens: tenant {tenant!r} has an empty token")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"DaemonConfig.log_level must be one of {LOG_LEVELS}, got {self.log_level!r}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("DaemonConfig.tls_cert and tls_key must be given together")
        if isinstance(address, UnixAddress) and self.tls_cert is not None:
            raise ValueError("DaemonConfig.tls_cert applies to TCP only; a Unix socket is local")
        if isinstance(address, TcpAddress):
            if not self.tokens:
                raise ValueError(
                    f"DaemonConfig.listen is TCP ({self.listen!r}) but no tenant tokens are "
                    "configured: a TCP port is reachable by every local user. Add a [tenants] "
                    "table to the config file or set ASTERIA_TOKENS='tenant=token', or listen on "
                    "a Unix socket (unix:///path/to.sock)"
                )
            if not address.is_loopback and self.tls_cert is None:
                raise ValueError(
                    f"DaemonConfig.listen {self.listen!r} is not a loopback address: serving "
                    "beyond this host needs TLS (--tls-cert and --tls-key)"
                )

    @property
    def address(self) -> UnixAddress | TcpAddress:
        return parse_listen(self.listen)

    def allows_anonymous(self) -> bool:
        """True when tenant ``local`` may connect with an empty token (no tokens, Unix socket)."""
        return not self.tokens and isinstance(self.address, UnixAddress)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"DaemonConfig.{name} must be an int >= {minimum}, got {value!r}")


def parse_tokens(text: str) -> dict[str, str]:
    """``"tenant1=tok1,tenant2=tok2"`` as a mapping (the form of ``ASTERIA_TOKENS``)."""
    tokens: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        tenant, sep, token = item.partition("=")
        if not sep or not tenant.strip() or not token.strip():
            raise ValueError(
                "ASTERIA_TOKENS must look like 'tenant1=token1,tenant2=token2' "
                f"(an entry for tenant {tenant.strip()!r} is malformed)"
            )
        tokens[tenant.strip()] = token.strip()
    return tokens


def _as_float(text: str) -> float:
    return float(text)


def _as_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


#: Fields settable from env and flags, with how to read their text. ``tokens`` is separate.
_PARSERS: dict[str, Callable[[str], Any]] = {
    "listen": str,
    "workers": int,
    "blas_threads": int,
    "max_message_bytes": int,
    "chunk_bytes": int,
    "max_matrix_n": int,
    "grace_period_s": _as_float,
    "keepalive_time_s": _as_float,
    "keepalive_timeout_s": _as_float,
    "max_sessions": int,
    "tls_cert": str,
    "tls_key": str,
    "log_level": str.upper,
    "ready_file": str,
    "shared_memory": _as_bool,
    "max_shm_segments": int,
    "max_upload_bytes": int,
    "upload_wait_s": _as_float,
}
_FIELDS = {f.name for f in dataclasses.fields(DaemonConfig)}
assert set(_PARSERS) | {"tokens"} == _FIELDS, "every DaemonConfig field needs a parser"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _from_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read config file {path!r}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path!r} is not valid TOML: {exc}") from exc
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "tenants":
            if not isinstance(value, dict):
                raise ValueError(f"config file {path!r}: [tenants] must be a table tenant = token")
            values["tokens"] = {str(t): v for t, v in value.items()}
        elif key in _PARSERS:
            values[key] = value
        else:
            raise ValueError(
                f"config file {path!r}: unknown key {key!r}; known: {sorted(_PARSERS)} "
                "and the [tenants] table"
            )
    return values


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, parse in _PARSERS.items():
        text = environ.get(env_name(name))
        if text is None or text == "":
            continue
        try:
            values[name] = parse(text)
        except ValueError as exc:
            raise ValueError(f"{env_name(name)}={text!r} is not valid: {exc}") from exc
    tokens = environ.get(env_name("tokens"))
    if tokens:
        values["tokens"] = parse_tokens(tokens)
    return values


def load_config(
    *,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> DaemonConfig:
    """TOML file, then ``ASTERIA_*`` env, then ``overrides`` (flags; None values are unset)."""
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(_from_toml(config_file))
    values.update(_from_env(os.environ if environ is None else environ))
    for key, value in (overrides or {}).items():
        if value is not None:
            if key not in _FIELDS:
                raise ValueError(f"unknown DaemonConfig field {key!r}")
            values[key] = value
    return DaemonConfig(**values)
