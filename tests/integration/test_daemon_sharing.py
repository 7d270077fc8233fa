"""One daemon, many clients: two training processes of different tenants share a real
`asteria-server` subprocess, and a client killed in the middle of a snapshot upload leaves the
daemon serving and, once it stops, nothing behind (no workers, no shared memory)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asteria_client.cli import main
from asteria_server.engine import SolveKind, SolveTask, SubmitOutcome
from asteria_server.engine.shm import SEGMENT_PREFIX
from tests.integration.test_daemon import (
    CALL_TIMEOUT_S,
    Daemon,
    _children,
    _running,
    block_status,
    open_session,
    receive,
    spd,
    start_daemon,
    stop_daemon,
    submit,
)

TENANTS = {"alice": "a-secret-0123456789", "bob": "b-secret-0123456789"}
STEPS, FREQ = 12, 2
CHILD_TIMEOUT_S = 180.0  # generous: two torch imports and trainings on a small shared machine

TRAIN_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from asteria_client import SOAP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
    with SOAP(
        model.named_parameters(),
        lr=1e-2,
        mode="daemon",
        address=sys.argv[1],
        staleness_budget=1,
        precondition_frequency={freq},
    ) as opt:
        opt.attach(model)
        for _ in range({steps}):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        rows = opt.preconditioner_status()
        stats = opt.runtime_stats()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(json.dumps({{"rows": rows, "stats": stats, "finite": finite}}, default=str), flush=True)
    """
).format(freq=FREQ, steps=STEPS)

# Uploads part of an 8 MiB snapshot in 1 MiB chunks, says so on stdout, then hangs mid-stream.
HALF_UPLOAD_SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import grpc
    import numpy as np
    from asteria_server.engine import SolveKind, SolveTask
    from asteria_server.protocol import framing
    from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
    from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc

    stub = pb_grpc.PreconditionerStub(grpc.insecure_channel(sys.argv[1]))
    session = stub.OpenSession(pb.OpenSessionRequest(job="killed"), timeout=30).session_id
    task = SolveTask(
        block="killed.L", version=1, kind=SolveKind.INVERSE_ROOT, matrix=np.eye(1024)
    )
    messages = list(framing.snapshot_messages(task, session_id=session, chunk_bytes=1 << 20))
    assert len(messages) == 9, len(messages)  # the header and eight 1 MiB chunks

    def partial():
        yield from messages[:4]  # the header and three chunks
        print("sent", flush=True)
        threading.Event().wait()  # never send the rest

    stub.SubmitSnapshot(partial())
    """
)


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTERIA_")}
    env.update(OMP_NUM_THREADS="1", ASTERIA_LOG_LEVEL="WARNING", **extra)
    return env


def _tenant_config(tmp_path: Path) -> Path:
    config = tmp_path / "asteria.toml"
    table = "".join(f'{name} = "{token}"\n' for name, token in TENANTS.items())
    config.write_text(f"grace_period_s = 2.0\n[tenants]\n{table}")
    return config


def _assert_stops_cleanly(daemon: Daemon) -> None:
    """SIGTERM the daemon; then no worker of it may run and none of its segments may remain."""
    workers = _children(daemon.proc.pid)
    code, err = stop_daemon(daemon)
    assert code == 0, err
    deadline = time.monotonic() + 10.0  # an orphaned worker exits when its pipe closes
    while [pid for pid in workers if _running(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _running(pid)], "solver workers outlived the daemon"
    prefix = f"{SEGMENT_PREFIX}{daemon.proc.pid}_"
    assert [p for p in os.listdir("/dev/shm") if p.startswith(prefix)] == []


def _status_json(
    daemon: Daemon, tenant: str, token: str, capsys: pytest.CaptureFixture[str]
) -> dict[str, object]:
    capsys.readouterr()
    argv = [
        "status",
        "--address",
        daemon.target,
        "--tenant",
        tenant,
        "--token",
        token,
        "--json",
        "--blocks",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    doc: dict[str, object] = json.loads(capsys.readouterr().out)
    return doc


def test_two_training_processes_of_different_tenants_share_one_daemon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("ASTERIA_"):
            monkeypatch.delenv(name)
    d = start_daemon(tmp_path, "--config", str(_tenant_config(tmp_path)))
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for tenant, token in TENANTS.items():
            env = _child_env(
                ASTERIA_TENANT=tenant, ASTERIA_TOKEN=token, ASTERIA_JOB=f"{tenant}-job"
            )
            procs[tenant] = subprocess.Popen(
                [sys.executable, "-c", TRAIN_SCRIPT, d.target],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        reports = {}
        for tenant, proc in procs.items():
            out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
            assert proc.returncode == 0, f"{tenant}'s training exited {proc.returncode}:\n{err}"
            reports[tenant] = json.loads(out.strip().splitlines()[-1])

        for tenant, report in reports.items():
            stats, rows = report["stats"], report["rows"]
            assert report["finite"], tenant
            assert stats["local_fallbacks"] == 0 and stats["submit_errors"] == 0, (tenant, stats)
            assert len(rows) == 4, rows  # two square weights, two factors each
            for row in rows:
                assert row["version"] >= 0 and row["mode"] == "daemon", (tenant, row)
                assert row["failures"] == 0, (tenant, row)

        seen: dict[str, set[str]] = {}
        for tenant, token in TENANTS.items():
            doc = _status_json(d, tenant, token, capsys)
            blocks = doc["blocks"]
            assert isinstance(blocks, list)
            assert {b["tenant"] for b in blocks} == {tenant}, blocks
            # Only this tenant's job's blocks: the other tenant's never show.
            assert all(b["block"].startswith(f"{tenant}-job:") for b in blocks), blocks
            assert len(blocks) == 4 and all(b["version"] >= 0 for b in blocks), blocks
            seen[tenant] = {b["block"] for b in blocks}
        assert seen["alice"].isdisjoint(seen["bob"])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        _assert_stops_cleanly(d)


def test_client_killed_mid_transfer_leaves_daemon_serving(tmp_path: Path) -> None:
    config = tmp_path / "asteria.toml"
    config.write_text("grace_period_s = 2.0\n")
    d = start_daemon(tmp_path, "--config", str(config))
    child: subprocess.Popen[str] | None = None
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", HALF_UPLOAD_SCRIPT, d.target],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
        assert child.stdout is not None
        line = child.stdout.readline()  # blocks until the child has sent part of the stream
        if line.strip() != "sent":
            child.kill()
            _, err = child.communicate()
            pytest.fail(f"the uploading client did not start its stream: {line!r}\n{err}")
        os.kill(child.pid, signal.SIGKILL)
        child.communicate(timeout=CALL_TIMEOUT_S)
        assert child.returncode == -signal.SIGKILL

        assert d.proc.poll() is None, "the daemon died with its client"
        stub = d.stub()
        session = open_session(stub)
        task = SolveTask(block="fresh.L", version=1, kind=SolveKind.INVERSE_ROOT, matrix=spd(8, 0))
        assert submit(stub, session, task) is SubmitOutcome.QUEUED
        assert receive(stub, session, ["fresh.L"])["fresh.L"].version == 1

        status = block_status(stub, session)
        assert status["fresh.L"].version == 1
        half = status.get("killed.L")
        assert half is None or (half.version < 0 and half.submitted_version < 0), half
        assert d.proc.poll() is None
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.communicate()
    _assert_stops_cleanly(d)
