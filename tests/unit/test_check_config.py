"""The daemon's operator-facing settings: --check-config, metrics address, JSON logs, the
group-accessible socket, and the metrics that the engine's observer feeds."""

from __future__ import annotations

import json
import logging
import sys
import tomllib
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asteria_server.__main__ import JsonLogFormatter, main
from asteria_server.config import (
    DaemonConfig,
    LogFormat,
    TcpAddress,
    load_config,
    memory_estimate_bytes,
    parse_metrics_listen,
)
from asteria_server.engine import SolveKind
from asteria_server.engine.engine import FinishedSolve
from asteria_server.service.metrics import DaemonMetrics, size_bucket

SOCK = "unix:///tmp/asteria-test/asteria.sock"


def test_check_config_prints_effective_settings_without_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "a.toml"
    toml.write_text(
        'workers = 2\nmetrics_listen = ":9464"\n[tenants]\nann = "s3cret-0123456789abc"\n'
    )
    monkeypatch.setenv("ASTERIA_LOG_FORMAT", "JSON")
    assert main(["--config", str(toml), "--listen", SOCK, "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out
    settings = tomllib.loads(out)
    assert settings["workers"] == 2 and settings["listen"] == SOCK
    assert settings["metrics_listen"] == "127.0.0.1:9464"  # ":PORT" means loopback
    assert settings["log_format"] == "json" and settings["tenants"] == {"ann": "<redacted>"}
    assert "# memory: at most" in out

    assert main(["--listen", SOCK, "--metrics-listen", "unix:///x", "--check-config"]) == 2
    assert "metrics_listen" in capsys.readouterr().err


def test_metrics_listen_forms() -> None:
    assert parse_metrics_listen(":9464") == TcpAddress("127.0.0.1", 9464)
    assert parse_metrics_listen("0.0.0.0:0") == TcpAddress("0.0.0.0", 0)
    assert parse_metrics_listen("[::1]:9") == TcpAddress("::1", 9)
    for bad in ("9464", "host:", "unix:///m.sock", ":99999"):
        with pytest.raises(ValueError, match="metrics_listen"):
            parse_metrics_listen(bad)
    assert DaemonConfig(listen=SOCK).metrics_address is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_format": "yaml"}, "log_format"),
        ({"socket_group_access": True}, "no tenant tokens"),
        ({"socket_group_access": "yes", "tokens": {"a": "b" * 16}}, "socket_group_access"),
        (
            {"socket_group_access": True, "tokens": {"a": "b" * 16}, "listen": "127.0.0.1:0"},
            "applies to a Unix socket",
        ),
    ],
)
def test_invalid_operator_settings_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DaemonConfig(**{"listen": SOCK, **kwargs})  # type: ignore[arg-type]


def test_group_access_socket_mode_and_memory_estimate() -> None:
    config = DaemonConfig(listen=SOCK, socket_group_access=True, tokens={"a": "b" * 16})
    assert config.socket_mode == 0o660 and DaemonConfig(listen=SOCK).socket_mode == 0o600
    assert load_config(environ={"ASTERIA_LOG_FORMAT": "json"}).log_format is LogFormat.JSON
    small = DaemonConfig(listen=SOCK, workers=1, max_matrix_n=1024, max_upload_bytes=1 << 20)
    bigger = DaemonConfig(listen=SOCK, workers=2, max_matrix_n=1024, max_upload_bytes=1 << 20)
    per_worker = memory_estimate_bytes(bigger) - memory_estimate_bytes(small)
    assert per_worker > 40 * 1024**2  # a worker holds at least one solve of n = max_matrix_n


def test_json_log_lines_carry_tenant_job_and_block() -> None:
    formatter = JsonLogFormatter()
    record = logging.LogRecord(
        "asteria_server.x", logging.WARNING, __file__, 1, "a %s", ("b",), None
    )
    record.tenant, record.block = "team-a", "w.L"
    doc = json.loads(formatter.format(record))
    assert (
        doc["event"] == "a b" and doc["level"] == "WARNING" and doc["logger"] == "asteria_server.x"
    )
    assert doc["tenant"] == "team-a" and doc["block"] == "w.L" and "job" not in doc
    assert doc["time"].endswith("Z")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "oops", (), sys.exc_info())
    line = formatter.format(failed)
    assert "\n" not in line and "boom" in json.loads(line)["exception"]


def test_observer_counts_by_kind_size_and_tenant() -> None:
    metrics = DaemonMetrics(blas_threads=2)

    def finished(kind: SolveKind, n: int, ok: bool, refresh: bool = False) -> FinishedSolve:
        return FinishedSolve(
            tenant="t", kind=kind, refresh=refresh, n=n, ok=ok,
            solve_s=0.5 if ok else None, wait_s=0.01, run_s=1.0,
        )  # fmt: skip

    metrics.observe(finished(SolveKind.EIGENBASIS, 100, True))
    metrics.observe(finished(SolveKind.EIGENBASIS, 100, True, refresh=True))
    metrics.observe(finished(SolveKind.INVERSE_ROOT, 5000, False))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }
    assert samples[("asteria_solves_total", (("kind", "eigenbasis"), ("size", "<=128")))] == 1
    assert samples[("asteria_solves_total", (("kind", "refresh"), ("size", "<=128")))] == 1
    failed = ("asteria_solve_failures_total", (("kind", "inverse_root"), ("size", "<=8192")))
    assert samples[failed] == 1
    assert samples[("asteria_queue_wait_seconds_count", (("tenant", "t"),))] == 3
    # Two successes of 0.5 s and a failure that ran 1 s, at 2 BLAS threads each.
    assert samples[("asteria_tenant_cpu_seconds_total", (("tenant", "t"),))] == 4.0
    assert size_bucket(128) == "<=128" and size_bucket(129) == "<=256"
    assert size_bucket(10000) == ">8192"
