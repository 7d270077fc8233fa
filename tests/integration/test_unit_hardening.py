"""The systemd unit's hardening holds: the daemon serves training inside it.

deploy/systemd/asteria-server.service confines the daemon (read-only file system, private /tmp
and /dev, no home, a dedicated user without capabilities, no new privileges, no writable and
executable memory, the @system-service system calls, Unix and IP sockets only). The daemon
needs memfds passed over SCM_RIGHTS and mapped, worker processes, Unix and TCP sockets. These
tests build that confinement with the kernel interfaces systemd uses (unit_sandbox.py: systemd
is not PID 1 here), check that it really confines (a probe is refused what the unit forbids),
then start the unit's ExecStart inside it and train against it over shared memory.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from asteria_client import SOAP
from tests.integration import unit_sandbox
from tests.integration.test_daemon import stop_daemon
from tests.integration.test_daemon_client import finite, small_model, train
from tests.integration.test_metrics import (
    TOKENS,
    UNIT,
    UnitDaemon,
    scrape,
    start_like_systemd,
    unit_directives,
    value,
    wait_idle,
)

ROOT = Path(__file__).resolve().parents[2]
NOBODY = (65534, 65534)  # User=asteria on a node; any unprivileged uid here
SANDBOX = Path(unit_sandbox.__file__)

pytestmark = pytest.mark.skipif(
    unit_sandbox.missing_requirements() is not None,
    reason=f"cannot build the unit's confinement: {unit_sandbox.missing_requirements()}",
)


def test_the_sandbox_covers_every_hardening_option_of_the_unit() -> None:
    """unit_sandbox.py builds what the unit asks for (a new option there must be added there)."""
    built = {
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "ProtectKernelTunables=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "MemoryDenyWriteExecute=yes",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallErrorNumber=EPERM",
        "UMask=0077",
    }
    # Options that only take something the daemon never uses (module loading, kernel logs,
    # cgroup writes, the clock, the host name, namespaces, realtime, set-uid files, personality,
    # other users' processes): not rebuilt here, and nothing of the daemon's path goes near them.
    not_rebuilt = {
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
    }
    directives = unit_directives(UNIT)
    hardening = {
        f"{key}={value}"
        for key, values in directives.items()
        for value in values
        if key.startswith(("Protect", "Private", "Restrict", "No", "Capability", "Ambient"))
        or key.startswith(("MemoryDeny", "SystemCall", "UMask", "LockPersonality"))
    }
    assert hardening == built | not_rebuilt


@functools.cache
def unit_user() -> tuple[int, int]:
    """The uid/gid the confined daemon runs as: an unprivileged one (``User=``) where it can
    read this checkout and interpreter (a node installs them world-readable under /usr), else
    root without any capability, which can still read a checkout in a 0700 directory (a CI
    clone in ``mktemp -d``): every other option of the unit is built the same either way."""
    root = Path(tempfile.mkdtemp(prefix="asteria-unit-", dir="/run"))
    try:
        os.chmod(root, 0o755)
        (root / "run" / "asteria").mkdir(parents=True)
        os.chown(root / "run" / "asteria", *NOBODY)
        argv = [*confinement(root, NOBODY), sys.executable, "-c", "import asteria_server"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return NOBODY if done.returncode == 0 else (0, 0)


@pytest.fixture
def runtime_root() -> Iterator[Path]:
    """A directory in /run (the unit's %t), traversable by the daemon's user like /run."""
    root = Path(tempfile.mkdtemp(prefix="asteria-unit-", dir="/run"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def confinement(root: Path, user: tuple[int, int]) -> list[str]:
    exposed = {sys.prefix, sys.base_prefix, str(ROOT)}
    return (
        [sys.executable, str(SANDBOX), "--runtime-dir", str(root / "run" / "asteria")]
        + ["--user", f"{user[0]}:{user[1]}"]
        + [arg for path in sorted(exposed) for arg in ("--expose", path)]
        + ["--"]
    )


PROBE = """
import mmap, os, socket, sys
status = {l.split(':')[0]: l.split(':')[1].strip() for l in open('/proc/self/status')}
print('uid', status['Uid'].split()[0], 'nnp', status['NoNewPrivs'], 'seccomp', status['Seccomp'])
print('capbnd', status['CapBnd'])
ro = lambda path: os.statvfs(path).f_flag & os.ST_RDONLY
print('ro_root', ro('/'), 'ro_repo', ro(sys.argv[1]))
print('rw_runtime', ro(sys.argv[2]))
print('dev', ','.join(sorted(os.listdir('/dev'))))
print('tmp', ','.join(sorted(os.listdir('/tmp'))))
for family in (socket.AF_NETLINK, socket.AF_PACKET):
    try:
        socket.socket(family, socket.SOCK_RAW, 0)
        print('socket', family, 'allowed')
    except OSError as exc:
        print('socket', family, 'errno', exc.errno)
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    print('wx allowed')
except OSError as exc:
    print('wx errno', exc.errno)
fd = os.memfd_create('probe')  # what the daemon needs: memfds, mapped read-write
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
m[:4] = b'ok!!'
print('memfd', m[:4].decode())
"""


def test_the_confinement_refuses_what_the_unit_forbids(runtime_root: Path) -> None:
    user = unit_user()
    runtime = runtime_root / "run" / "asteria"
    runtime.mkdir(parents=True, mode=0o700)
    os.chown(runtime, *user)
    marker = Path(tempfile.mkdtemp(prefix="asteria-visible-"))  # in the host's /tmp
    try:
        argv = [*confinement(runtime_root, user), sys.executable, "-c", PROBE, str(ROOT)]
        argv.append(str(runtime))
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        marker.rmdir()
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["uid"] == f"{user[0]} nnp 1 seccomp 2"  # User=, NoNewPrivileges, a filter
    assert int(lines["capbnd"], 16) == 0  # CapabilityBoundingSet= (empty)
    assert lines["ro_root"] == "1 ro_repo 1"  # ProtectSystem=strict
    assert lines["rw_runtime"] == "0"  # the RuntimeDirectory stays writable
    assert set(lines["dev"].split(",")) <= {*unit_sandbox.DEVICES, "shm", "fd", "stdin"} | {
        "stdout",
        "stderr",
    }  # PrivateDevices: no disks, no /dev/mem
    assert marker.name not in lines["tmp"]  # PrivateTmp: the host's /tmp is not seen
    # RestrictAddressFamilies: EPERM for the others (netlink is otherwise open to any user)
    sockets = [line for line in done.stdout.splitlines() if line.startswith("socket ")]
    assert sockets == [f"socket {socket.AF_NETLINK} errno 1", f"socket {socket.AF_PACKET} errno 1"]
    assert lines["wx"] == "errno 13"  # MemoryDenyWriteExecute
    assert lines["memfd"] == "ok!!"


@pytest.fixture
def confined_daemon(runtime_root: Path) -> Iterator[UnitDaemon]:
    user = unit_user()
    daemon = start_like_systemd(runtime_root, confine=confinement(runtime_root, user), user=user)
    yield daemon
    if daemon.proc.poll() is None:
        stop_daemon(daemon)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_the_unit_daemon_trains_a_client_over_shared_memory_inside_the_confinement(
    confined_daemon: UnitDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = unit_user()
    daemon_status = _status(confined_daemon.proc.pid)
    assert daemon_status["Uid"].split()[0] == str(user[0])
    assert int(daemon_status["CapBnd"], 16) == 0 and int(daemon_status["CapEff"], 16) == 0
    assert daemon_status["Seccomp"] == "2" and daemon_status["NoNewPrivs"] == "1"
    assert confined_daemon.sock.stat().st_uid == user[0]

    monkeypatch.setenv("ASTERIA_TENANT", "team-a")
    monkeypatch.setenv("ASTERIA_TOKEN", TOKENS["team-a"])
    # The client sends tokens and memory only to a daemon of a uid it expects: the unit's user.
    monkeypatch.setenv("ASTERIA_DAEMON_UID", str(user[0]))
    model = small_model()
    with SOAP(
        model.named_parameters(),
        lr=1e-2,
        precondition_frequency=3,
        mode="daemon",
        address=confined_daemon.target,
        staleness_budget=1,
    ) as opt:
        opt.attach(model)
        train(model, opt, 20)
        stats = opt.runtime_stats()
        rows = opt.preconditioner_status()
        # The snapshots travelled in the client's memfds, handed over and mapped by the daemon.
        during = scrape(confined_daemon.metrics_url)
        assert value(during, "asteria_shm_segments") > 0, during.get("asteria_shm_segments")
        # The solver worker is the daemon's child, under the same filter and user.
        tasks = Path(f"/proc/{confined_daemon.proc.pid}/task").glob("*/children")
        workers = [int(pid) for task in tasks for pid in task.read_text().split()]
        assert workers, "the daemon started no worker"
        for pid in workers:
            worker = _status(pid)
            assert worker["Seccomp"] == "2" and worker["Uid"].split()[0] == str(user[0])
    assert finite(model) and stats["local_fallbacks"] == 0 and stats["submit_errors"] == 0
    assert len(rows) == 4 and all(r["version"] >= 0 and r["connected"] for r in rows), rows

    metrics = wait_idle(confined_daemon, 4)
    assert value(metrics, "asteria_solves_total") >= 4
    assert value(metrics, "asteria_solve_failures_total") == 0
    assert value(metrics, "asteria_worker_restarts_total") == 0

    code, err = stop_daemon(confined_daemon)
    assert code == 0, err
    assert "Operation not permitted" not in err and "EPERM" not in err, err
