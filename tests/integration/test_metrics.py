"""The daemon as systemd starts it, a 20-step training run against it, then its /metrics.

The command line is the unit's own ``ExecStart=`` (deploy/systemd/asteria-server.service) with
its paths moved into ``tmp_path``: ``%t`` (``/run``), ``/etc/asteria/asteria.toml`` (a copy of
deploy/asteria.toml) and the installed ``asteria-server`` (this interpreter). Like systemd, the
test creates the RuntimeDirectory (0700) and passes the tokens file's variables in the
environment; two settings that cannot be the shipped ones on a 2-core test machine, the worker
count and the metrics port (a free one, never a fixed port), come as ``ASTERIA_*`` variables,
the way a drop-in's ``Environment=`` would set them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asteria_client import SOAP
from asteria_server.engine import SolveKind, SolveTask, SubmitOutcome
from asteria_server.protocol import convert
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from tests.integration.test_daemon import (
    CALL_TIMEOUT_S,
    Daemon,
    block_status,
    open_session,
    spd,
    stop_daemon,
    submit,
)
from tests.integration.test_daemon_client import finite, small_model, train

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "systemd" / "asteria-server.service"
START_TIMEOUT_S = 60.0
TOKENS = {"team-a": "token-a-0123456789", "team-b": "token-b-0123456789"}
FREQ = 3


def unit_directives(path: Path) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file (comments and sections dropped), by key."""
    found: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


def exec_start_argv(root: Path) -> list[str]:
    """The unit's ExecStart with its paths under ``root`` and this Python as the daemon."""
    (command,) = unit_directives(UNIT)["ExecStart"]
    argv = shlex.split(command.replace("%t", str(root / "run")))
    assert argv[0] == "/usr/local/bin/asteria-server", argv
    config = root / "etc" / "asteria" / "asteria.toml"
    return [sys.executable, "-m", "asteria_server"] + [
        str(config) if arg == "/etc/asteria/asteria.toml" else arg for arg in argv[1:]
    ]


@dataclass
class UnitDaemon(Daemon):
    metrics_url: str


def start_like_systemd(
    root: Path, confine: list[str] | None = None, user: tuple[int, int] | None = None
) -> UnitDaemon:
    """The unit's ExecStart under ``root``; ``confine`` is a command that execs the rest (the
    unit's sandbox, see unit_sandbox.py), ``user`` the uid/gid that owns the RuntimeDirectory."""
    config = root / "etc" / "asteria" / "asteria.toml"
    config.parent.mkdir(parents=True)
    config.write_text((DEPLOY / "asteria.toml").read_text())
    runtime = root / "run" / "asteria"  # RuntimeDirectory=asteria, RuntimeDirectoryMode=0700
    runtime.mkdir(parents=True, mode=0o700)
    os.chmod(runtime, 0o700)
    if user is not None:
        os.chown(runtime, *user)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTERIA_")}
    env["ASTERIA_TOKENS"] = ",".join(f"{t}={tok}" for t, tok in TOKENS.items())
    env["ASTERIA_WORKERS"] = "1"
    env["ASTERIA_METRICS_LISTEN"] = "127.0.0.1:0"
    argv = (confine or []) + exec_start_argv(root)
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/"
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    line = proc.stdout.readline().strip()  # the serving line, or "" if it exited
    if not line.startswith("asteria-server serving on") or time.monotonic() > deadline:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"daemon did not start ({shlex.join(argv)}):\n{line}\n{out}\n{err}")
    sock = runtime / "asteria.sock"
    url = line.split(" metrics=", 1)[1].split()[0]
    return UnitDaemon(proc, sock, f"unix://{sock}", line, url)


@pytest.fixture
def unit_daemon(tmp_path: Path) -> Iterator[UnitDaemon]:
    daemon = start_like_systemd(tmp_path)
    yield daemon
    if daemon.proc.poll() is None:
        stop_daemon(daemon)


def scrape(url: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """family name -> [(sample name, labels, value)]."""
    with urllib.request.urlopen(url, timeout=CALL_TIMEOUT_S) as reply:
        text = reply.read().decode()
    return {
        family.name: [(s.name, dict(s.labels), s.value) for s in family.samples]
        for family in text_string_to_metric_families(text)
    }


def value(metrics: dict, sample: str, **labels: str) -> float:  # type: ignore[type-arg]
    """The sum of ``sample`` over the series whose labels include ``labels``."""
    return sum(
        v
        for family in metrics.values()
        for name, have, v in family
        if name == sample and labels.items() <= have.items()
    )


def wait_idle(daemon: UnitDaemon, solves_at_least: int) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while True:
        metrics = scrape(daemon.metrics_url)
        done = value(metrics, "asteria_solves_total") + value(
            metrics, "asteria_solve_failures_total"
        )
        idle = value(metrics, "asteria_queue_depth") == 0
        idle &= value(metrics, "asteria_workers", state="busy") == 0
        if idle and done >= solves_at_least:
            return metrics
        if time.monotonic() > deadline:
            pytest.fail(f"the daemon did not go idle: {metrics}")
        time.sleep(0.1)


def test_unit_daemon_trains_and_its_metrics_tell_solves_queue_and_staleness(
    unit_daemon: UnitDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert unit_daemon.metrics_url.startswith("http://127.0.0.1:")
    # The unit's socket: 0600 (no group-access drop-in) in the 0700 RuntimeDirectory.
    assert unit_daemon.sock.stat().st_mode & 0o777 == 0o600

    # Tenant team-a trains 20 steps in daemon mode, through shared memory.
    monkeypatch.setenv("ASTERIA_TENANT", "team-a")
    monkeypatch.setenv("ASTERIA_TOKEN", TOKENS["team-a"])
    monkeypatch.setenv("ASTERIA_JOB", "metrics-test")
    model = small_model()
    with SOAP(
        model.named_parameters(),
        lr=1e-2,
        precondition_frequency=FREQ,
        mode="daemon",
        address=unit_daemon.target,
        staleness_budget=1,
    ) as opt:
        opt.attach(model)
        train(model, opt, 20)
        stats = opt.runtime_stats()
    assert finite(model) and stats["local_fallbacks"] == 0 and stats["submit_errors"] == 0

    # Tenant team-b leaves one block behind: version 1 solved, version 5 (NaN) failed, so its
    # lag is 4 steps and its newest snapshot keeps waiting.
    stub = unit_daemon.stub()
    session_b = open_session(stub, "team-b", TOKENS["team-b"])
    good = SolveTask(block="w.L", version=1, kind=SolveKind.INVERSE_ROOT, matrix=spd(16, 0))
    assert submit(stub, session_b, good) is SubmitOutcome.QUEUED
    wait_idle(unit_daemon, 1)
    nan = spd(16, 1)
    nan[0, 0] = np.nan
    bad = SolveTask(block="w.L", version=5, kind=SolveKind.INVERSE_ROOT, matrix=nan)
    assert submit(stub, session_b, bad) is SubmitOutcome.QUEUED

    session_a = open_session(stub, "team-a", TOKENS["team-a"])
    metrics = wait_idle(unit_daemon, 2)
    engine, _ = convert.status_from_proto(stub.Status(pb.StatusRequest(), timeout=CALL_TIMEOUT_S))
    blocks_a = block_status(stub, session_a)
    blocks_b = block_status(stub, session_b)
    assert len(blocks_a) == 4 and set(blocks_b) == {"w.L"}

    # Solves and failures, by kind and size; their durations.
    solves = value(metrics, "asteria_solves_total")
    failures = value(metrics, "asteria_solve_failures_total")
    assert solves == engine.solves_done >= 5 and failures == engine.solves_failed == 1
    eigen = value(metrics, "asteria_solves_total", kind="eigenbasis", size="<=128")
    refresh = value(metrics, "asteria_solves_total", kind="refresh", size="<=128")
    assert eigen >= 4 and refresh >= 1  # SOAP: a first eigh per factor, then QR refreshes
    assert value(metrics, "asteria_solves_total", kind="inverse_root") == 1  # team-b's good one
    assert value(metrics, "asteria_solve_failures_total", kind="inverse_root", size="<=128") == 1
    assert value(metrics, "asteria_solve_duration_seconds_count") == solves
    assert value(metrics, "asteria_solve_duration_seconds_sum") > 0

    # The queue: empty now; every dispatched snapshot's wait, per tenant.
    assert value(metrics, "asteria_queue_depth") == 0
    waits_a = value(metrics, "asteria_queue_wait_seconds_count", tenant="team-a")
    waits_b = value(metrics, "asteria_queue_wait_seconds_count", tenant="team-b")
    assert waits_a + waits_b == solves + failures and waits_b == 2
    assert value(metrics, "asteria_tenant_cpu_seconds_total", tenant="team-a") > 0

    # Staleness per tenant, as distributions over the tenant's blocks (no per-block series).
    lag_a = [b.submitted_version - b.version for b in blocks_a.values()]
    assert value(metrics, "asteria_block_lag_steps_bucket", tenant="team-a", le="+Inf") == 4
    assert value(metrics, "asteria_block_lag_steps_bucket", tenant="team-a", le="0.0") == sum(
        lag == 0 for lag in lag_a
    )
    assert value(metrics, "asteria_block_lag_steps_gsum", tenant="team-a") == sum(lag_a)
    assert value(metrics, "asteria_block_lag_steps_bucket", tenant="team-b", le="3.0") == 0
    assert value(metrics, "asteria_block_lag_steps_bucket", tenant="team-b", le="5.0") == 1
    assert value(metrics, "asteria_block_lag_steps_gsum", tenant="team-b") == 4
    assert value(metrics, "asteria_block_lag_seconds_bucket", tenant="team-b", le="0.0") == 0
    assert value(metrics, "asteria_block_lag_seconds_gsum", tenant="team-b") > 0
    assert not any("block" in labels for _, labels, _ in metrics["asteria_block_lag_steps"])

    # Blocks, sessions, the data path and the engine.
    assert value(metrics, "asteria_blocks", tenant="team-a") == 4
    assert value(metrics, "asteria_blocks", tenant="team-b", state="idle") == 1
    assert value(metrics, "asteria_sessions", tenant="team-b") >= 1
    assert value(metrics, "asteria_upload_budget_bytes") == 1 << 30  # deploy/asteria.toml
    assert value(metrics, "asteria_upload_bytes_in_flight") == 0
    assert "asteria_shm_segments" in metrics and "asteria_shm_mapped_bytes" in metrics
    assert value(metrics, "asteria_workers") == 1 and value(metrics, "asteria_engine_broken") == 0
    assert value(metrics, "asteria_worker_restarts_total") == 0
    assert value(metrics, "asteria_event_loop_stalls_total") >= 0  # the loop watch is bound
    assert value(metrics, "asteria_event_loop_stall_seconds_max") >= 0
    incarnation = unit_daemon.serving_line.split("incarnation=", 1)[1].split()[0]
    assert value(metrics, "asteria_daemon_info", incarnation=incarnation) == 1

    # Every family the daemon exports is in the README's metric table.
    readme = (DEPLOY.parent / "README.md").read_text()
    documented = set(re.findall(r"`(asteria_\w+)`", readme))
    # (_gsum/_gcount of gauge histograms and the client's _created parse as families of their own)
    exported = {re.sub(r"_(gsum|gcount|created)$", "", n) for n in metrics if "asteria_" in n}
    assert len(exported) >= 20, exported
    missing = {n for n in exported if n not in documented and f"{n}_total" not in documented}
    assert not missing, f"metrics missing from the README's Operate table: {sorted(missing)}"

    # deploy/asteria.toml asks for JSON logs: one object a line, sessions named by tenant.
    code, err = stop_daemon(unit_daemon)
    assert code == 0, err
    records = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert {"time", "level", "logger", "event"} <= set(records[0])
    opened = [r for r in records if r["event"].startswith("session opened")]
    assert {(r.get("tenant"), r.get("job")) for r in opened} >= {("team-a", "metrics-test")}
