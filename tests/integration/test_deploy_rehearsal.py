"""A deploy rehearsal: each shipped topology run on one machine as its files set it up, with a
real daemon, a real training client, and the one number that says the daemon was used: **0
local fallbacks**.

- **Kubernetes** (``deploy/kubernetes``): the DaemonSet's daemon (its ConfigMap, its image's
  environment, its args) run as the DaemonSet's uid/gid with ``setpriv``, the socket directory
  made as its init container makes it; the training Job's exact environment (parsed from the
  YAML, the hostPath mapped into a temporary directory) for ``asteria train`` run as the Job's
  uid, gid and supplementary groups. Without the Job's ``ASTERIA_DAEMON_UID`` the same client
  refuses the daemon (one WARNING naming the fix) and falls back locally: the control that
  shows the rehearsal can fail.
- **Slurm, shared node daemon** (``train-with-node-daemon.sbatch``): the systemd unit's
  ``ExecStart`` with ``dropins/group-access.conf`` run as a daemon user with ``setpriv``; the
  sbatch script itself, with ``srun``, ``scontrol``, ``id`` and ``torchrun`` standing in for
  the cluster's (``torchrun`` runs ``asteria train`` as a training user in the daemon's group).
- **Multi-node** (``train-with-job-daemons.sbatch`` / ``asteria-job-daemon.sh``): two node
  daemons started by the shipped node script, each with its ranks' Unix socket and a peer
  listener on loopback TCP with mutual TLS (certificates made by
  ``deploy/tls/make-cluster-certs.sh``); two gloo ranks with ``ASTERIA_NODE`` on different
  nodes. Peers alive, ``asteria_sync_fallbacks_total`` 0, each (block, version) solved once.

The uid tests need root and ``setpriv`` (util-linux); without them they skip saying which.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from asteria_client.status import StatusReader

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
START_TIMEOUT_S = 60.0
TRAIN_TIMEOUT_S = 240.0
#: The smallest `asteria train` that makes blocks (14 SOAP blocks in 8 steps, a few seconds).
TINY_TRAIN = [
    "--optimizer", "soap", "--steps", "8", "--eval-interval", "1000",
    "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
    "--batch-size", "8", "--eval-batches", "2", "--device", "cpu",
]  # fmt: skip
#: The training user of the Slurm rehearsal, and the shared daemon's user (`asteria`).
SLURM_USER_UID = 1000
SLURM_DAEMON_UID = 10002


# ---------------------------------------------------------------------------- helpers


def _yaml_docs(path: Path) -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(path.read_text())}


def _kustomize_base() -> dict[str, dict[str, Any]]:
    """``kind/name`` -> manifest over the daemon's base, the training-job overlay and the
    example Secret (read as files: their rendering is test_deploy's)."""
    from tests.integration.test_deploy import k8s_docs

    return k8s_docs()


def _readable_by_others(path: Path) -> str | None:
    """Why another user cannot run code from ``path`` (a directory not searchable or a file
    not readable by others), or None."""
    for parent in [path, *path.parents][1:] if path.is_file() else [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            return f"{parent} is not searchable by other users (mode {stat.filemode(mode)})"
    return None


#: Added to setpriv's arguments when the checkout or its interpreter cannot be read by other
#: users (a checkout in a 0700 directory, an interpreter under /root): CAP_DAC_READ_SEARCH lets
#: the daemon's and the client's users read and traverse them, nothing more. The uids are the
#: manifests' (what SO_PEERCRED reports and the client checks), and connecting to the socket
#: still needs write permission on it, which that capability does not give.
READ_CAPS = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]


def _need_setpriv() -> list[str]:
    """setpriv and the arguments every user switch here takes; skips without root or setpriv."""
    if os.getuid() != 0:
        pytest.skip("the rehearsal runs the daemon and the client as other users: needs root")
    found = shutil.which("setpriv")
    if found is None:
        pytest.skip("setpriv is not installed (Debian: apt-get install util-linux)")
    unreadable = [
        why
        for path in (ROOT, Path(sys.executable).parent, Path(os.path.realpath(sys.executable)))
        if (why := _readable_by_others(path)) is not None
    ]
    return [found, *(READ_CAPS if unreadable else [])]


def _as(setpriv: list[str], uid: int, gid: int, groups: str = "") -> list[str]:
    return [
        *setpriv,
        f"--reuid={uid}",
        f"--regid={gid}",
        f"--groups={groups}" if groups else "--clear-groups",
    ]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTERIA_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    return {**env, **extra}


@pytest.fixture
def node_root() -> Iterator[Path]:
    """A directory the daemon's and the client's users can reach (pytest's tmp_path is in a
    0700 directory of root's): the node's file system for one test, removed after it."""
    root = Path(tempfile.mkdtemp(prefix="asteria-rehearsal-"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _owned_dir(path: Path, uid: int, gid: int, mode: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, gid)
    os.chmod(path, mode)
    return path


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    log: Path
    ready: Path
    address: str = ""
    serving_line: str = ""

    def wait_ready(self) -> Daemon:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                self.process.wait()
                pytest.fail(f"the daemon did not serve: {self.log.read_text()[-4000:]}")
            time.sleep(0.05)
        self.serving_line = self.ready.read_text().strip()
        self.address = self.serving_line.split("serving on ", 1)[1].split()[0]
        return self

    @property
    def metrics_url(self) -> str:
        return self.serving_line.split(" metrics=", 1)[1].split()[0]

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.log.read_text()


def _start(argv: list[str], env: Mapping[str, str], files: Path, ready: Path) -> Daemon:
    log = files / "daemon.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=dict(env), stdout=out, stderr=subprocess.STDOUT)
    return Daemon(proc, log, ready).wait_ready()


@pytest.fixture
def stopper() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for d in started:
        d.stop()


def _train(argv_prefix: list[str], env: Mapping[str, str], out: Path) -> tuple[dict[str, Any], str]:
    """Run ``asteria train`` (the shipped client) and return its optimizer report and stderr."""
    argv = [*argv_prefix, sys.executable, "-m", "asteria_client.cli", "train", *TINY_TRAIN]
    argv += ["--json", str(out)]
    done = subprocess.run(argv, env=dict(env), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return json.loads(out.read_text())["optimizer"], done.stderr


def _solves(address: str, tenant: str, token: str, daemon_uid: int) -> int:
    """The daemon's solves, asked from this process (which trusts the daemon's uid too)."""
    os.environ["ASTERIA_DAEMON_UID"] = str(daemon_uid)  # conftest clears ASTERIA_* per test
    reader = StatusReader(address, tenant, token)
    try:
        stats, _, _ = reader.read()
        return int(stats.solves_done)
    finally:
        reader.close()
        del os.environ["ASTERIA_DAEMON_UID"]


# ---------------------------------------------------------------------------- Kubernetes


def _secret_tokens(docs: Mapping[str, dict[str, Any]]) -> dict[str, str]:
    """The daemon's tenant Secret with a real random token for each of its tenants (the
    shipped file holds placeholders, which the daemon refuses)."""
    text = docs["Secret/asteria-tenants"]["stringData"]["tokens"]
    tenants = [item.split("=", 1)[0].strip() for item in text.split(",") if item.strip()]
    return {t: secrets.token_hex(16) for t in tenants}


def _containerfile_env() -> dict[str, str]:
    text = (DEPLOY / "container" / "Containerfile").read_text().replace("\\\n", " ")
    return dict(re.findall(r"(ASTERIA_\w+)=(\S+)", text))


def _kubernetes_env(entries: list[dict[str, Any]], secret_values: Mapping[str, str]) -> dict:  # type: ignore[type-arg]
    """A container's ``env`` as the kubelet gives it: values, and secretKeyRef from
    ``secret_values`` (keyed ``secret-name/key``)."""
    env = {}
    for entry in entries:
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secret_values[f"{ref['name']}/{ref['key']}"]
    return env


def test_kubernetes_job_uses_the_daemonsets_daemon_with_no_local_fallback(
    node_root: Path, stopper: list[Daemon]
) -> None:
    setpriv = _need_setpriv()
    docs = _kustomize_base()
    daemon_pod = docs["DaemonSet/asteria-server"]["spec"]["template"]["spec"]
    (container,) = daemon_pod["containers"]
    job_pod = docs["Job/soap-train"]["spec"]["template"]["spec"]
    (train,) = job_pod["containers"]
    d_ctx, j_ctx = daemon_pod["securityContext"], job_pod["securityContext"]
    uid, gid = d_ctx["runAsUser"], d_ctx["runAsGroup"]
    # The node: its /run/asteria (a hostPath both pods mount) lives in a temporary directory.
    root = node_root
    (host_path,) = {v["hostPath"]["path"] for v in daemon_pod["volumes"] if "hostPath" in v}
    run_dir = _owned_dir(root / host_path.lstrip("/"), uid, gid, 0o750)  # the init container

    def on_node(text: str) -> str:
        return text.replace(host_path, str(run_dir))

    tokens = _secret_tokens(docs)
    config = tomllib.loads(docs["ConfigMap/asteria-config"]["data"]["asteria.toml"])
    config["metrics_listen"] = "127.0.0.1:0"  # the pod IP's port 9464, here a free one
    config_file = root / "asteria.toml"
    config_file.write_text(
        "\n".join(
            f"{k} = {json.dumps(on_node(v) if isinstance(v, str) else v)}"
            for k, v in config.items()
        )
    )
    os.chmod(config_file, 0o644)
    ready = _owned_dir(root / "daemon-files", uid, gid, 0o755) / "ready"
    image_env = {k: on_node(v) for k, v in _containerfile_env().items()}
    image_env["ASTERIA_METRICS_LISTEN"] = "127.0.0.1:0"
    daemon_env = _clean_env(
        **image_env,
        **_kubernetes_env(
            container["env"],
            {"asteria-tenants/tokens": ",".join(f"{t}={k}" for t, k in tokens.items())},
        ),
        ASTERIA_WORKERS="1",  # the ConfigMap's 4, on a 2-core machine
        ASTERIA_READY_FILE=str(ready),
        ASTERIA_STOP_WITH_PID=str(os.getpid()),
    )
    args = [str(config_file) if a == "/etc/asteria/asteria.toml" else a for a in container["args"]]
    as_daemon = _as(setpriv, uid, gid)
    daemon = _start(
        [*as_daemon, sys.executable, "-m", "asteria_server", *args], daemon_env, root, ready
    )
    stopper.append(daemon)
    assert daemon.address == f"unix://{run_dir}/asteria.sock"
    assert (run_dir / "asteria.sock").stat().st_uid == uid

    # The Job's container: its env with its tenant's token, as its uid, gid and groups.
    tenant_of_job = next(e["value"] for e in train["env"] if e["name"] == "ASTERIA_TENANT")
    job_env = _kubernetes_env(train["env"], {"asteria-token-team-a/token": tokens[tenant_of_job]})
    job_env = {k: on_node(v) for k, v in job_env.items()}
    home = _owned_dir(root / "home", j_ctx["runAsUser"], j_ctx["runAsGroup"], 0o700)
    groups = ",".join(str(g) for g in j_ctx.get("supplementalGroups", []))
    as_job = _as(setpriv, j_ctx["runAsUser"], j_ctx["runAsGroup"], groups)
    client_env = _clean_env(HOME=str(home), TMPDIR=str(home), **job_env)
    report, _ = _train(as_job, client_env, home / "run.json")
    assert report["mode"] == "daemon" and report["num_blocks"] > 0, report
    assert report["local_fallbacks"] == 0, (
        f"{report['local_fallbacks']} local fallbacks "
        f"({report['local_fallbacks_daemon_refused']} with the daemon refused)"
    )
    assert report["source"]["daemon_refused"] is False, report["source"]
    assert _solves(daemon.address, tenant_of_job, tokens[tenant_of_job], uid) > 0

    # The control: the same Job without ASTERIA_DAEMON_UID (the shipped file before issue 29)
    # trusts only its own uid and root, refuses the daemon, says so once and falls back.
    del client_env["ASTERIA_DAEMON_UID"]
    report, stderr = _train(as_job, client_env, home / "control.json")
    assert report["local_fallbacks"] > 0
    assert report["local_fallbacks_daemon_refused"] == report["local_fallbacks"], report
    (warning,) = [line for line in stderr.splitlines() if "logged once per process" in line]
    assert f"uid {uid}" in warning and f"Set ASTERIA_DAEMON_UID={uid}" in warning, warning


# ---------------------------------------------------------------------------- Slurm, node daemon

#: Stand-ins for the cluster's commands, run by the sbatch script on "every node" (this one).
SRUN = """#!/usr/bin/env bash
# srun: drop the options, run the command here (one node).
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
echo localhost
"""
ID = """#!/usr/bin/env bash
if [[ "$*" == "-u asteria" ]]; then echo {daemon_uid}; else exec /usr/bin/id "$@"; fi
"""
TORCHRUN = """#!/usr/bin/env bash
# torchrun: one rank, `asteria train` as the training user (the script's train.py).
exec {as_user} {python} -m asteria_client.cli train {train} --json {out}
"""


def test_slurm_node_daemon_script_uses_the_shared_daemon_with_no_local_fallback(
    node_root: Path, stopper: list[Daemon]
) -> None:
    setpriv = _need_setpriv()
    uid = gid = SLURM_DAEMON_UID
    root = node_root
    # The systemd unit with group-access.conf: RuntimeDirectory /run/asteria, mode 0750.
    unit = (DEPLOY / "systemd" / "asteria-server.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(.*)$", unit, re.M)
    dropin = (DEPLOY / "systemd" / "dropins" / "group-access.conf").read_text()
    (mode,) = re.findall(r"^RuntimeDirectoryMode=(\d+)$", dropin, re.M)
    dropin_env = dict(e.split("=", 1) for e in re.findall(r"^Environment=(.*)$", dropin, re.M))
    run_dir = _owned_dir(root / "run" / "asteria", uid, gid, int(mode, 8))
    config_file = root / "asteria.toml"
    config_file.write_text(
        (DEPLOY / "asteria.toml").read_text().replace("127.0.0.1:9464", "127.0.0.1:0")
    )
    os.chmod(config_file, 0o644)
    argv = shlex.split(exec_start.replace("%t", str(root / "run")))
    assert argv[0] == "/usr/local/bin/asteria-server"
    argv = [sys.executable, "-m", "asteria_server"] + [
        str(config_file) if a == "/etc/asteria/asteria.toml" else a for a in argv[1:]
    ]
    token = secrets.token_hex(16)
    tenant = "trainee"
    ready = _owned_dir(root / "daemon-files", uid, gid, 0o755) / "ready"
    daemon_env = _clean_env(
        **dropin_env,
        ASTERIA_TOKENS=f"{tenant}={token}",  # /etc/asteria/tokens.env
        ASTERIA_WORKERS="1",
        ASTERIA_READY_FILE=str(ready),
        ASTERIA_STOP_WITH_PID=str(os.getpid()),
    )
    daemon = _start([*_as(setpriv, uid, gid), *argv], daemon_env, root, ready)
    stopper.append(daemon)
    assert daemon.address == f"unix://{run_dir}/asteria.sock"

    # The user's side: ~/.asteria/token, and the cluster's commands as stand-ins.
    home = _owned_dir(root / "home", SLURM_USER_UID, SLURM_USER_UID, 0o755)
    _owned_dir(home / ".asteria", SLURM_USER_UID, SLURM_USER_UID, 0o700)
    (home / ".asteria" / "token").write_text(token + "\n")
    out = home / "run.json"
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, text in {
        "srun": SRUN,
        "scontrol": SCONTROL,
        "id": ID.format(daemon_uid=uid),
        "torchrun": TORCHRUN.format(
            as_user=shlex.join(_as(setpriv, SLURM_USER_UID, SLURM_USER_UID, str(gid))),
            python=sys.executable,
            train=shlex.join(TINY_TRAIN),
            out=out,
        ),
    }.items():
        (bin_dir / name).write_text(text)
        os.chmod(bin_dir / name, 0o755)
    # The script as shipped, its node paths (the unit's /run) mapped into root/ as above.
    shipped = (DEPLOY / "slurm" / "train-with-node-daemon.sbatch").read_text()
    assert shipped.count("unix:///run/asteria/asteria.sock") == 1
    script = root / "train-with-node-daemon.sbatch"
    script.write_text(shipped.replace("unix:///run/asteria/asteria.sock", daemon.address))
    env = _clean_env(
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
        HOME=str(home),
        USER=tenant,
        SLURM_JOB_NAME="soap-train",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_NODELIST="localhost",
        SLURM_SUBMIT_DIR=str(ROOT),
    )
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=300, cwd=home
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "is serving" in done.stdout  # asteria-wait-healthy.sh answered first
    report = json.loads(out.read_text())["optimizer"]
    assert report["mode"] == "daemon" and report["num_blocks"] > 0, report
    assert report["local_fallbacks"] == 0, (
        f"{report['local_fallbacks']} local fallbacks "
        f"({report['local_fallbacks_daemon_refused']} with the daemon refused): "
        + done.stderr[-3000:]
    )
    assert _solves(daemon.address, tenant, token, uid) > 0


# ---------------------------------------------------------------------------- multi-node


def _peer_group(address: str, tenant: str, token: str, job: str) -> dict[str, Any]:
    from asteria_client.peers_status import peers_document

    reader = StatusReader(address, tenant, token)
    try:
        (group,) = [g for g in peers_document(reader.peers()) if g["job"] == job]
        return group
    finally:
        reader.close()


def _slurm_node_daemon(i: int, files: Path, tls: Path, tokens: str) -> Daemon:
    """Node ``i``'s daemon as train-with-job-daemons.sbatch starts it: asteria-job-daemon.sh."""
    ready = files / "ready"
    env = _clean_env(
        ASTERIA_ADDRESS=f"unix://{files}/run/asteria.sock",
        ASTERIA_WORKERS="1",
        ASTERIA_TLS_DIR=str(tls),
        ASTERIA_PEER_LISTEN="127.0.0.1:0",  # the script's 0.0.0.0:29600, on loopback
        ASTERIA_NODE_CERT=f"node{i}",
        ASTERIA_TOKENS=tokens,
        ASTERIA_METRICS_LISTEN="127.0.0.1:0",
        ASTERIA_READY_FILE=str(ready),
        ASTERIA_STOP_WITH_PID=str(os.getpid()),
        ASTERIA_LOG_LEVEL="INFO",
    )
    script = DEPLOY / "slurm" / "asteria-job-daemon.sh"
    return _start(["bash", str(script)], env, files, ready)


def _kubernetes_node_daemon(i: int, files: Path, tls: Path, tokens: str) -> Daemon:
    """Node ``i``'s daemon as the multi-node-tls overlay renders the DaemonSet: its ConfigMap,
    the image's ENV and the container's env, the node's /run/asteria and the Secret's files
    (ca.crt, tls.crt, tls.key) mapped into ``files``, the pod IP 127.0.0.1."""
    from tests.integration.test_deploy import KUSTOMIZATIONS, kustomize

    (overlay,) = [k for k in KUSTOMIZATIONS if k.name == "multi-node-tls"]
    docs = {d["kind"]: d for d in kustomize(overlay)}
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (tls_mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "peer-tls"]
    secret_dir = files / "secret"
    secret_dir.mkdir()
    for key, made in (
        ("ca.crt", "ca.crt"),
        ("tls.crt", f"node{i}.crt"),
        ("tls.key", f"node{i}.key"),
    ):
        shutil.copy(tls / made, secret_dir / key)
    (host_path,) = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    run_dir = files / "run"
    run_dir.mkdir(mode=0o750)
    os.chmod(run_dir, 0o750)  # the init container's chmod

    def on_node(text: str) -> str:
        return text.replace(host_path, str(run_dir)).replace(tls_mount, str(secret_dir))

    config = tomllib.loads(docs["ConfigMap"]["data"]["asteria.toml"])
    config["metrics_listen"] = "127.0.0.1:0"
    config_file = files / "asteria.toml"
    config_file.write_text(
        "\n".join(
            f"{k} = {json.dumps(on_node(v) if isinstance(v, str) else v)}"
            for k, v in config.items()
        )
    )
    env = {k: on_node(v) for k, v in _containerfile_env().items()}
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = on_node(entry["value"].replace("$(POD_IP)", "127.0.0.1"))
        elif "secretKeyRef" in entry["valueFrom"]:
            env[entry["name"]] = tokens
        else:
            env[entry["name"]] = "127.0.0.1"  # POD_IP from the downward API
    assert env["ASTERIA_PEER_LISTEN"] == "0.0.0.0:9465"
    env["ASTERIA_PEER_LISTEN"] = "127.0.0.1:0"  # two "nodes" on one host: a free port each
    del env["ASTERIA_PEER_ADVERTISE"]  # and the bound one advertised
    ready = files / "ready"
    env["ASTERIA_METRICS_LISTEN"] = "127.0.0.1:0"  # the pod IP's 9464, here a free port
    env = _clean_env(
        **env,
        ASTERIA_WORKERS="1",
        ASTERIA_READY_FILE=str(ready),
        ASTERIA_STOP_WITH_PID=str(os.getpid()),
        ASTERIA_LOG_LEVEL="INFO",
    )
    args = [str(config_file) if a == "/etc/asteria/asteria.toml" else a for a in container["args"]]
    return _start([sys.executable, "-m", "asteria_server", *args], env, files, ready)


@pytest.mark.parametrize("topology", ["slurm", "kubernetes"])
def test_multi_node_daemons_sync_over_tls_with_no_fallback(
    tmp_path: Path, stopper: list[Daemon], topology: str
) -> None:
    from tests.distributed import sync_cluster as sc
    from tests.distributed.test_daemon_sync import _solved_once
    from tests.integration.test_metrics import scrape, value

    tls = tmp_path / "tls"
    made = subprocess.run(
        ["bash", str(DEPLOY / "tls" / "make-cluster-certs.sh"), str(tls), "node0", "node1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    start = _slurm_node_daemon if topology == "slurm" else _kubernetes_node_daemon
    daemons = []
    for i in range(2):
        files = tmp_path / f"node{i}"
        files.mkdir()
        daemons.append(start(i, files, tls, f"{sc.TENANT}={sc.TOKEN}"))
        stopper.append(daemons[-1])
    assert all(d.address.startswith("unix://") for d in daemons)  # the ranks' side

    spec = sc.RunSpec(addresses=[d.address for d in daemons], node_of_rank=[0, 1], steps=12)
    ranks = sc.run_ranks(tmp_path / "ranks", spec)
    assert all(r["local_fallbacks"] == 0 for r in ranks), [r["local_fallbacks"] for r in ranks]
    last = spec.steps - 1
    deadline = time.monotonic() + 15
    while True:  # the last pushes may still be on their way
        views = [sc.view(d.address) for d in daemons]
        groups = [v.group for v in views]
        if {b["version"] for g in groups for b in g["blocks"]} == {last}:
            break
        assert time.monotonic() < deadline, [g["blocks"] for g in groups]
        time.sleep(0.2)
    scraped = [scrape(d.metrics_url) for d in daemons]
    logs = [d.stop() for d in daemons]

    for i, (group, metrics) in enumerate(zip(groups, scraped, strict=True)):
        states = [p["state"] for p in group["peers"]]
        assert states.count("self") == 1 and states.count("alive") == 1, group["peers"]
        # The peers know each other by their TLS listeners, not by the ranks' sockets.
        assert all(not p["address"].startswith("unix:") for p in group["peers"]), group["peers"]
        assert value(metrics, "asteria_peers", tenant=sc.TENANT, state="alive") == 1
        assert value(metrics, "asteria_peers", tenant=sc.TENANT, state="dead") == 0
        assert value(metrics, "asteria_sync_fallbacks_total", tenant=sc.TENANT) == 0
        assert group["fallbacks"] == 0 and group["agreed"], group
        assert "peer listener on 127.0.0.1:" in logs[i] and "mutual TLS" in logs[i]
    solved = _solved_once(groups, views)
    assert len(solved) == sc.NUM_BLOCKS
    owners = {b["block"]: {b["owner"]} for b in groups[0]["blocks"]}
    for g in groups[1:]:
        for b in g["blocks"]:
            owners[b["block"]].add(b["owner"])
    assert all(len(o) == 1 for o in owners.values()), owners  # one owner each, agreed
    assert {next(iter(o)) for o in owners.values()} == {0, 1}  # both daemons own blocks


def test_the_peer_listener_refuses_a_client_without_the_clusters_certificate(
    tmp_path: Path, stopper: list[Daemon]
) -> None:
    """Mutual TLS: a caller that trusts the CA but shows no certificate of it (any local user,
    or another cluster's daemon) fails the handshake; one with a node certificate gets in."""
    import grpc

    from asteria_client.transport.connection import DaemonConnection
    from asteria_server.protocol.generated.asteria.v1 import peer_pb2, peer_pb2_grpc

    tls = tmp_path / "tls"
    other = tmp_path / "other"
    for out, nodes in ((tls, ["node0"]), (other, ["intruder"])):
        made = subprocess.run(
            ["bash", str(DEPLOY / "tls" / "make-cluster-certs.sh"), str(out), *nodes],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stderr
    ready = tmp_path / "ready"
    env = _clean_env(
        ASTERIA_ADDRESS=f"unix://{tmp_path}/run/asteria.sock",
        ASTERIA_WORKERS="1",
        ASTERIA_TLS_DIR=str(tls),
        ASTERIA_PEER_LISTEN="127.0.0.1:0",
        ASTERIA_NODE_CERT="node0",
        ASTERIA_TOKENS="t=" + "s" * 32,
        ASTERIA_READY_FILE=str(ready),
        ASTERIA_STOP_WITH_PID=str(os.getpid()),
    )
    daemon = _start(["bash", str(DEPLOY / "slurm" / "asteria-job-daemon.sh")], env, tmp_path, ready)
    stopper.append(daemon)
    conn = DaemonConnection(daemon.address, tenant="t", token="s" * 32)
    try:
        peer_address = conn.open_session().peer_address
    finally:
        conn.close()
    assert re.fullmatch(r"127\.0\.0\.1:\d+", peer_address), peer_address
    ca = (tls / "ca.crt").read_bytes()
    option = [("grpc.ssl_target_name_override", "asteria-peer")]

    def health(creds: grpc.ChannelCredentials) -> grpc.StatusCode | None:
        with grpc.secure_channel(peer_address, creds, options=option) as channel:
            try:
                peer_pb2_grpc.PeerStub(channel).Heartbeat(peer_pb2.HeartbeatRequest(), timeout=5)
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]
            return None

    no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
    foreign = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(other / "intruder.key").read_bytes(),
        certificate_chain=(other / "intruder.crt").read_bytes(),
    )
    member = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(tls / "node0.key").read_bytes(),
        certificate_chain=(tls / "node0.crt").read_bytes(),
    )
    assert health(no_cert) is grpc.StatusCode.UNAVAILABLE  # the handshake failed
    assert health(foreign) is grpc.StatusCode.UNAVAILABLE
    # A cluster member completes the handshake; the call itself then answers (its job token is
    # checked per call), whatever it says, it is not a transport failure.
    assert health(member) is not grpc.StatusCode.UNAVAILABLE
