"""`asteria bench soak`: one daemon, many clients, some killed, one tenant misbehaving; for long.

One `asteria-server` (two solver workers, tenants ``good`` and ``bad``, a result cache budget and
a spill directory) serves for ``--duration`` seconds, in two halves side by side:

1. **alone**: ``--clients`` training clients of tenant ``good`` (each a process and a job of its
   own, through the real client, shared memory where it can), each with 8 blocks of mixed sizes
   (n from 16 to 512; 3 small ones with ``--quick``), submitting a new version of every block
   each ``--interval`` seconds;
2. **with the bad tenant**: the same clients again, while tenant ``bad`` stalls uploads
   mid-stream, spams OpenSession, opens result streams it never reads and sends bursts of big
   snapshots, and uses the newer doors: a 4,096-node job layout, stalled peer pushes, a flood
   of idle metrics connections and peer calls with guessed job tokens (see
   :mod:`asteria_client.bench.soak_actors`).

In each half one client is killed with SIGKILL a third of the way in and restarted at once (same
job, as a supervisor would). At the end the bad tenant stops, an operator forgets its job (as
``asteria forget --job`` does, on a session opened before the tenant filled its session quota),
and after a few seconds of rest the daemon is measured a last time.

It reports, for the daemon process (from ``/proc/<pid>``): resident memory, open descriptors,
threads and memfd mappings at start, after warm-up (a part of the first half), at their peak and
at the end; per well-behaved client run, the results it expected (each block's last version) and
those delivered (nothing may be lost); and the well-behaved tenant's result latency (submit to
arrival) p50/p99 in each half. Targets: end RSS and descriptors within 10% of their value after
warm-up, zero lost results, p99 with the bad tenant at most 2x its value without, and health
never SERVING while the daemon cannot serve (each sample asks health and makes a Status call:
SERVING with a failed Status call, or with fewer than 16 descriptors free, counts against it).

Every process shares the machine's cores (nothing pinned): on a 2-core host the clients, the
bad tenant and the solver workers compete, so read the latencies as "what one node delivers".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asteria_client.bench import output
from asteria_client.config import environ_without_asteria
from asteria_client.daemon_process import DaemonProcess
from asteria_client.tables import markdown_table, text_table
from asteria_client.transport.connection import DaemonConnection
from asteria_server.errors import AsteriaError

logger = logging.getLogger(__name__)

DEFAULT_DURATION_S = 600.0
QUICK_DURATION_S = 40.0
DEFAULT_SIZES = (16, 32, 64, 128, 256, 512, 64, 128)
QUICK_SIZES = (16, 64, 128)
#: The tokens of the benchmark's two tenants (a private daemon; they protect nothing).
TOKENS = {"good": "soak-good-token-0123", "bad": "soak-bad-token-0123"}


class SoakRunError(AsteriaError):
    """A process of the benchmark failed or hung."""


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    duration_s: float = DEFAULT_DURATION_S
    clients: int = 4
    sizes: tuple[int, ...] = DEFAULT_SIZES
    interval_s: float = 0.5
    daemon_workers: int = 2
    cache_memory_bytes: int = 256 << 20
    warmup_fraction: float = 0.6
    #: the daemon's rest before the end sample: longer than its 30 s reclaim round (the cyclic
    #: garbage collector and malloc_trim, see asteria_server.service.allocator)
    settle_s: float = 35.0
    drain_s: float = 30.0
    bad_big_n: int = 2048
    #: the bad tenant's attacks (comma-separated names of ``soak_actors.ATTACKS``; "" = all)
    bad_attacks: str = ""
    sample_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.duration_s >= 10:
            raise ValueError(f"duration must be at least 10 seconds, got {self.duration_s}")
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        if not self.sizes or any(n < 1 for n in self.sizes):
            raise ValueError(f"block sizes must be >= 1, got {list(self.sizes)}")
        if not self.interval_s > 0:
            raise ValueError(f"interval must be > 0 seconds, got {self.interval_s}")
        if self.daemon_workers < 1:
            raise ValueError(f"daemon workers must be >= 1, got {self.daemon_workers}")


# ---------------------------------------------------------------------------- /proc


def proc_sample(pid: int) -> dict[str, int]:
    """The daemon's resident bytes, open descriptors, threads and memfd mappings, and its
    children's (the solver workers') resident bytes, from ``/proc``."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(fields["VmRSS"].split()[0]) * 1024
    threads = int(fields["Threads"])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    memfd = sum(
        1 for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/memfd:" in line
    )
    workers_rss = 0
    for child in _children(pid):
        try:
            text = Path(f"/proc/{child}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                workers_rss += int(line.split()[1]) * 1024
    return {
        "rss_bytes": rss,
        # of which: anonymous (the heap), file-backed (code), shared memory (memfd segments)
        "rss_anon_bytes": int(fields["RssAnon"].split()[0]) * 1024,
        "rss_shmem_bytes": int(fields["RssShmem"].split()[0]) * 1024,
        "fds": fds,
        "threads": threads,
        "memfd_maps": memfd,
        "workers_rss_bytes": workers_rss,
    }


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for task in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return out


class Sampler:
    """Samples the daemon every ``interval_s`` on a thread; named marks on request."""

    def __init__(self, pid: int, interval_s: float, address: str = "") -> None:
        self.pid = pid
        self.interval_s = interval_s
        self._probe = _HealthProbe(address) if address else None
        self.serving_while_unable = 0
        self.samples: list[dict[str, Any]] = []
        self.marks: dict[str, dict[str, Any]] = {}
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._phase = "start"
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def phase(self, name: str) -> None:
        self._phase = name

    def mark(self, name: str) -> dict[str, Any]:
        sample = self._take()
        self.marks[name] = sample
        return sample

    def _take(self) -> dict[str, Any]:
        sample: dict[str, Any] = {"t_s": time.monotonic() - self._started, "phase": self._phase}
        sample.update(proc_sample(self.pid))
        if self._probe is not None:
            health, answered = self._probe.check()
            free = _nofile(self.pid) - int(sample["fds"])
            sample.update(health=health, status_answered=answered, fds_free=free)
            if health == "SERVING" and (not answered or free < 16):
                self.serving_while_unable += 1
        self.samples.append(sample)
        return sample

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._take()
            except (OSError, KeyError, ValueError):
                return  # the daemon is gone

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        if self._probe is not None:
            self._probe.close()

    def peak(self) -> dict[str, int]:
        keys = ("rss_bytes", "fds", "threads", "memfd_maps", "workers_rss_bytes")
        return {k: max(int(s[k]) for s in self.samples) for k in keys}


def _nofile(pid: int) -> int:
    """The soft descriptor limit of process ``pid``."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise ValueError("no descriptor limit")


class _HealthProbe:
    """What the daemon's health says, and whether it answers a Status call meanwhile."""

    def __init__(self, address: str) -> None:
        import grpc
        from grpc_health.v1 import health_pb2_grpc

        from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc

        self._channel = grpc.insecure_channel(address)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._stub = preconditioner_pb2_grpc.PreconditionerStub(self._channel)

    def check(self) -> tuple[str, bool]:
        import grpc
        from grpc_health.v1 import health_pb2

        from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb

        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
            health = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError:
            health = "NO_ANSWER"
        try:
            self._stub.Status(pb.StatusRequest(), timeout=5.0)
            answered = True
        except grpc.RpcError:
            answered = False
        return health, answered

    def close(self) -> None:
        self._channel.close()


# ---------------------------------------------------------------------------- processes


def _actor(role: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "asteria_client.bench.soak_actors", role, *args]


@dataclass
class _Client:
    index: int
    job: str
    proc: subprocess.Popen[bytes]
    out: Path
    log: Path
    killed: bool = False


def _start_client(
    cfg: SoakConfig,
    address: str,
    workdir: Path,
    phase: str,
    index: int,
    incarnation: int,
    duration_s: float,
    epoch: float,
) -> _Client:
    job = f"soak-{phase}-c{index}"
    out = workdir / f"{phase}-c{index}-i{incarnation}.json"
    log = workdir / f"{phase}-c{index}-i{incarnation}.log"
    env = environ_without_asteria() | {"OMP_NUM_THREADS": "1"}
    command = _actor(
        "client",
        "--address",
        address,
        "--tenant",
        "good",
        "--token",
        TOKENS["good"],
        "--out",
        str(out),
        "--job",
        job,
        "--sizes",
        ",".join(map(str, cfg.sizes)),
        "--duration-s",
        f"{duration_s:.3f}",
        "--interval-s",
        str(cfg.interval_s),
        "--drain-s",
        str(cfg.drain_s),
        "--epoch",
        repr(epoch),
        "--seed",
        str(index),
    )
    with log.open("wb") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env)
    return _Client(index, job, proc, out, log)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_phase(
    cfg: SoakConfig,
    address: str,
    workdir: Path,
    phase: str,
    duration_s: float,
    sampler: Sampler,
    *,
    with_bad: bool,
    warmup_mark: bool,
    metrics_address: str = "",
) -> dict[str, Any]:
    """One half: the clients (one killed and restarted), and the bad tenant if asked."""
    sampler.phase(phase)
    epoch = time.time()
    started = time.monotonic()
    clients = [
        _start_client(cfg, address, workdir, phase, i, 0, duration_s, epoch)
        for i in range(cfg.clients)
    ]
    all_runs = list(clients)
    bad: subprocess.Popen[bytes] | None = None
    operator = _Operator(address) if with_bad else None
    forget_error = ""
    bad_out = workdir / f"{phase}-bad.json"
    bad_log = workdir / f"{phase}-bad.log"
    if with_bad:
        env = environ_without_asteria() | {"OMP_NUM_THREADS": "1"}
        command = _actor(
            "bad",
            "--address",
            address,
            "--tenant",
            "bad",
            "--token",
            TOKENS["bad"],
            "--out",
            str(bad_out),
            "--big-n",
            str(cfg.bad_big_n),
            "--metrics-address",
            metrics_address,
            "--attacks",
            cfg.bad_attacks,
        )
        with bad_log.open("wb") as f:
            bad = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        kill_at = started + duration_s / 3
        warm_at = started + duration_s * cfg.warmup_fraction if warmup_mark else None
        killed = False
        while time.monotonic() < started + duration_s:
            now = time.monotonic()
            if warm_at is not None and now >= warm_at:
                sampler.mark("warm")
                warm_at = None
            if not killed and now >= kill_at:
                victim = clients[0]
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait()
                victim.killed = True
                remaining = max(1.0, started + duration_s - time.monotonic())
                restarted = _start_client(
                    cfg, address, workdir, phase, victim.index, 1, remaining, epoch
                )
                all_runs.append(restarted)
                clients[0] = restarted
                killed = True
                print(f"soak: {phase}: SIGKILLed client 0 and restarted it", file=sys.stderr)
            time.sleep(0.1)
        deadline = time.monotonic() + cfg.drain_s + 120.0
        for client in clients:
            try:
                code = client.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise SoakRunError(
                    f"soak client {client.index} of phase {phase} hung:\n{_tail(client.log)}"
                ) from None
            if code != 0:
                raise SoakRunError(
                    f"soak client {client.index} of phase {phase} exited {code}:\n"
                    f"{_tail(client.log)}"
                )
    finally:
        for client in all_runs:
            if client.proc.poll() is None:
                client.proc.kill()
                client.proc.wait()
        bad_counts: dict[str, int] = {}
        if bad is not None:
            bad.send_signal(signal.SIGTERM)
            try:
                bad.wait(timeout=30.0)
            except subprocess.TimeoutExpired:
                bad.kill()
                bad.wait()
            if bad_out.exists():
                bad_counts = json.loads(bad_out.read_text())["counts"]
            else:
                logger.warning("the bad tenant wrote no counts:\n%s", _tail(bad_log))
        if operator is not None:
            forget_error = operator.forget()
    runs = []
    for client in all_runs:
        if client.killed:
            runs.append({"client": client.index, "job": client.job, "killed": True})
            continue
        doc = json.loads(client.out.read_text())
        runs.append({"client": client.index, "killed": False, **doc})
    summary = summarize_phase(phase, runs, with_bad, bad_counts, time.monotonic() - started)
    summary["bad_job_forget_error"] = forget_error
    return summary


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values), q)) if values else None


def summarize_phase(
    phase: str,
    runs: list[dict[str, Any]],
    with_bad: bool,
    bad_counts: dict[str, int],
    wall_s: float,
) -> dict[str, Any]:
    finished = [r for r in runs if not r["killed"]]
    latencies = [x for r in finished for x in r["latencies_s"]]
    clients = []
    for r in runs:
        row = {"client": r["client"], "job": r["job"], "killed": r["killed"]}
        if not r["killed"]:
            row.update(
                expected=r["expected"],
                delivered=r["delivered_count"],
                lost=r["lost"],
                results=r["results"],
                snapshots_submitted=r["snapshots_submitted"],
                latency_p50_s=_percentile(r["latencies_s"], 50),
                latency_p99_s=_percentile(r["latencies_s"], 99),
                transport=r["source"].get("transport"),
                submits_dropped=r["source"].get("submits_dropped"),
                results_invalid=r["source"].get("results_invalid", 0),
            )
        clients.append(row)
    return {
        "phase": phase,
        "with_bad_tenant": with_bad,
        "wall_s": wall_s,
        "expected": sum(r["expected"] for r in finished),
        "delivered": sum(r["delivered_count"] for r in finished),
        "lost": sum(len(r["lost"]) for r in finished),
        "results": len(latencies),
        "latency_p50_s": _percentile(latencies, 50),
        "latency_p99_s": _percentile(latencies, 99),
        "clients": clients,
        "bad_tenant": bad_counts,
    }


class _Operator:
    """A session of tenant ``bad``'s job opened before it misbehaves (at its session cap it
    could not open one), kept alive by a Status call now and then, and closed at the end with
    ``forget_blocks``: what an operator does with ``asteria forget`` once the tenant is gone."""

    def __init__(self, address: str) -> None:
        self._connection = DaemonConnection(address, tenant="bad", token=TOKENS["bad"], job="bad")
        self._session = self._connection.open_session()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="soak-operator", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        while not self._stop.wait(10.0):
            try:
                self._connection.status(self._session.session_id, timeout_s=5.0)
            except AsteriaError as exc:
                logger.warning("the operator's session of tenant bad: %s", exc)

    def forget(self) -> str:
        """Forget the bad tenant's job; "" when done, else why not."""
        self._stop.set()
        self._thread.join(timeout=15.0)
        try:
            self._connection.close_session(self._session.session_id, forget_blocks=True)
            return ""
        except AsteriaError as exc:
            return str(exc)
        finally:
            self._connection.close()


def run_soak(cfg: SoakConfig, *, quick: bool = False) -> dict[str, Any]:
    started = time.time()
    half = cfg.duration_s / 2
    with tempfile.TemporaryDirectory(prefix="asteria-bench-soak-") as tmp:
        workdir = Path(tmp)
        config = workdir / "daemon.toml"
        config.write_text(
            "[tenants]\n" + "".join(f'{t} = "{token}"\n' for t, token in TOKENS.items())
        )
        spill = workdir / "spill"
        args = [
            "--config",
            str(config),
            "--cache-memory-bytes",
            str(cfg.cache_memory_bytes),
            "--spill-dir",
            str(spill),
            "--metrics-listen",
            "127.0.0.1:0",
        ]
        with DaemonProcess(workers=cfg.daemon_workers, extra_args=args) as daemon:
            url = daemon.serving_line.split("metrics=", 1)[1].split()[0]
            metrics_address = url.removeprefix("http://").split("/", 1)[0]
            sampler = Sampler(daemon.pid, cfg.sample_interval_s, daemon.address)
            sampler.mark("start")
            sampler.start()
            try:
                print(
                    f"soak: {cfg.clients} clients x {len(cfg.sizes)} blocks, {half:.0f} s alone, "
                    f"then {half:.0f} s beside the bad tenant",
                    file=sys.stderr,
                    flush=True,
                )
                alone = run_phase(
                    cfg, daemon.address, workdir, "alone", half, sampler,
                    with_bad=False, warmup_mark=True,
                )  # fmt: skip
                print(_phase_line(alone), file=sys.stderr, flush=True)
                with_bad = run_phase(
                    cfg, daemon.address, workdir, "with_bad", half, sampler,
                    with_bad=True, warmup_mark=False, metrics_address=metrics_address,
                )  # fmt: skip
                print(_phase_line(with_bad), file=sys.stderr, flush=True)
                sampler.phase("end")
                time.sleep(cfg.settle_s)
                sampler.mark("end")
            finally:
                sampler.stop()
            stalls = loop_stalls(daemon.output()[1])
            spill_files = len(list(spill.glob("*.res"))) if spill.exists() else 0
    marks = sampler.marks
    start, warm, end = marks["start"], marks.get("warm", marks["start"]), marks["end"]
    peak = sampler.peak()
    ratios = {
        "rss_end_over_warm": end["rss_bytes"] / warm["rss_bytes"],
        "fds_end_over_warm": end["fds"] / warm["fds"],
        "p99_with_bad_over_alone": _ratio(with_bad["latency_p99_s"], alone["latency_p99_s"]),
    }
    targets = {
        "rss_within_10pct": ratios["rss_end_over_warm"] <= 1.10,
        "fds_within_10pct": ratios["fds_end_over_warm"] <= 1.10,
        "nothing_lost": alone["lost"] == 0 and with_bad["lost"] == 0,
        "p99_at_most_2x": ratios["p99_with_bad_over_alone"] is not None
        and ratios["p99_with_bad_over_alone"] <= 2.0,
        "health_true": sampler.serving_while_unable == 0,
    }
    return {
        "benchmark": "soak",
        "quick": quick,
        "config": {**cfg.__dict__, "sizes": list(cfg.sizes)},
        "cpus": len(os.sched_getaffinity(0)),
        "started_unix_s": started,
        "wall_time_s": time.time() - started,
        "daemon": {"start": start, "warm": warm, "peak": peak, "end": end},
        "spill_files_at_end": spill_files,
        "phases": [alone, with_bad],
        "ratios": ratios,
        "serving_while_unable": sampler.serving_while_unable,
        "loop_stalls": stalls,
        "health_samples": {
            h: sum(1 for x in sampler.samples if x.get("health") == h)
            for h in sorted({str(x.get("health")) for x in sampler.samples if "health" in x})
        },
        "targets": targets,
        "samples": sampler.samples,
    }


def loop_stalls(log: str) -> list[dict[str, Any]]:
    """The daemon's event-loop stalls its log reports: the seconds it had been blocked when
    noticed and where (the innermost frame of the stack the warning shows), then the full
    length once it ran again."""
    out: list[dict[str, Any]] = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        began = re.search(r"the event loop has been blocked for ([0-9.]+) s", line)
        if began:
            stack = []
            for follow in lines[i + 1 :]:
                if not follow.startswith("  "):
                    break
                stack.append(follow.strip())
            frames = [f for f in stack if f.startswith("File ")]
            out.append(
                {"noticed_after_s": float(began.group(1)), "where": frames[-1] if frames else ""}
            )
        ended = re.search(r"the event loop ran again after ([0-9.]+) s blocked", line)
        if ended and out:
            out[-1]["blocked_s"] = float(ended.group(1))
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _phase_line(p: dict[str, Any]) -> str:
    return (
        f"soak: {p['phase']}: {p['delivered']}/{p['expected']} last versions delivered, "
        f"{p['lost']} lost, {p['results']} results, p50 {_fmt_ms(p['latency_p50_s'])}, "
        f"p99 {_fmt_ms(p['latency_p99_s'])}"
    )


DAEMON_COLUMNS = ("when", "RSS", "workers' RSS", "open fds", "threads", "memfd maps")
PHASE_COLUMNS = (
    "phase",
    "delivered / expected",
    "lost",
    "results",
    "latency p50",
    "latency p99",
)


def _daemon_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for when in ("start", "warm", "peak", "end"):
        s = report["daemon"][when]
        rows.append(
            [
                when,
                _mib(s["rss_bytes"]),
                _mib(s["workers_rss_bytes"]),
                str(s["fds"]),
                str(s["threads"]),
                str(s["memfd_maps"]),
            ]
        )
    return rows


def _phase_rows(report: dict[str, Any]) -> list[list[str]]:
    return [
        [
            p["phase"] + (" (bad tenant on)" if p["with_bad_tenant"] else ""),
            f"{p['delivered']} / {p['expected']}",
            str(p["lost"]),
            str(p["results"]),
            _fmt_ms(p["latency_p50_s"]),
            _fmt_ms(p["latency_p99_s"]),
        ]
        for p in report["phases"]
    ]


def _target_lines(report: dict[str, Any]) -> list[str]:
    r, t = report["ratios"], report["targets"]
    p99 = r["p99_with_bad_over_alone"]
    return [
        f"end RSS / warm-up RSS {r['rss_end_over_warm']:.3f} "
        f"({'met' if t['rss_within_10pct'] else 'MISSED'}: <= 1.10)",
        f"end fds / warm-up fds {r['fds_end_over_warm']:.3f} "
        f"({'met' if t['fds_within_10pct'] else 'MISSED'}: <= 1.10)",
        f"lost results: {sum(p['lost'] for p in report['phases'])} "
        f"({'met' if t['nothing_lost'] else 'MISSED'}: 0)",
        "well-behaved p99 with / without the bad tenant "
        + ("-" if p99 is None else f"{p99:.2f}")
        + f" ({'met' if t['p99_at_most_2x'] else 'MISSED'}: <= 2)",
        f"samples with health SERVING while the daemon could not serve: "
        f"{report.get('serving_while_unable', 0)} "
        f"({'met' if t.get('health_true', True) else 'MISSED'}: 0)",
        *_stall_lines(report.get("loop_stalls", [])),
    ]


def _stall_lines(stalls: list[dict[str, Any]]) -> list[str]:
    if not stalls:
        return ["daemon event-loop stalls over 1 s: none"]
    longest = max(stalls, key=lambda s: s.get("blocked_s", s["noticed_after_s"]))
    return [
        f"daemon event-loop stalls over 1 s: {len(stalls)}, the longest "
        f"{longest.get('blocked_s', longest['noticed_after_s']):.1f} s, in {longest['where']}"
    ]


def format_report(report: dict[str, Any]) -> str:
    lines = text_table([list(DAEMON_COLUMNS), *_daemon_rows(report)], align=">")
    lines.append("")
    lines += text_table([list(PHASE_COLUMNS), *_phase_rows(report)], align=">")
    lines.append("")
    lines += _target_lines(report)
    return "\n".join(lines)


def write_figures(report: dict[str, Any], json_path: Path) -> list[Path]:
    """The daemon's RSS and open descriptors over the run, the halves marked."""
    samples = report["samples"]
    t = [s["t_s"] for s in samples]
    fig, ax = output.new_figure(7.0, 3.8)
    ax.plot(t, [s["rss_bytes"] / (1 << 20) for s in samples], color="tab:blue", label="RSS (MiB)")
    ax.set_xlabel("seconds since the daemon started serving")
    ax.set_ylabel("daemon RSS (MiB)")
    other = ax.twinx()
    other.plot(t, [s["fds"] for s in samples], color="tab:orange", label="open fds")
    other.set_ylabel("open descriptors")
    bad = [s["t_s"] for s in samples if s["phase"] == "with_bad"]
    if bad:
        ax.axvspan(min(bad), max(bad), color="tab:red", alpha=0.08, label="bad tenant on")
    handles = ax.get_legend_handles_labels()
    more = other.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="lower right")
    ax.set_title("Soak: the daemon's memory and descriptors")
    return [output.save_figure(fig, output.figure_path(json_path, "daemon"))]


#: What each of the bad tenant's attacks does, for the report (``soak_actors.ATTACKS``).
ATTACK_TEXT = {
    "stalled_uploads": "stalled uploads",
    "silent_streams": "result streams never read",
    "big_snapshots": "bursts of n={big_n} fp64 snapshots",
    "wide_layouts": "4,096-node job layouts",
    "stalled_pushes": "stalled n=4096 peer pushes",
    "peer_guesses": "wrong-token peer calls",
    "session_spam": "OpenSession spam",
    "metrics_flood": "a metrics connection flood",
}


def _attacks_text(cfg: dict[str, Any]) -> str:
    names = [a for a in cfg.get("bad_attacks", "").split(",") if a] or list(ATTACK_TEXT)
    return ", ".join(ATTACK_TEXT.get(a, a).format(big_n=cfg["bad_big_n"]) for a in names)


def report_section(data: dict[str, Any]) -> str:
    """Markdown: the daemon's resources, the two halves, the targets, the bad tenant's tally."""
    cfg = data["config"]
    lines = [
        f"{cfg['clients']} well-behaved clients (tenant `good`, one job and process each, "
        f"{len(cfg['sizes'])} blocks of n in {sorted(set(cfg['sizes']))}, a new version of "
        f"every block each {cfg['interval_s']} s) on one daemon with {cfg['daemon_workers']} "
        f"solver workers, a {_mib(cfg['cache_memory_bytes'])} result cache and a spill "
        f"directory, for {cfg['duration_s']:.0f} s: the first half alone, the second beside "
        f"tenant `bad` ({_attacks_text(cfg)}). In each half one client is SIGKILLed a third "
        f"of the way in and restarted. {data.get('cpus', '?')} CPUs shared by everything.",
        "",
    ]
    lines += markdown_table(DAEMON_COLUMNS, _daemon_rows(data), align=">")
    lines += [
        "",
        "warm: after the first "
        f"{cfg['warmup_fraction']:.0%} of the first half; peak: the largest of the samples "
        f"taken every {cfg['sample_interval_s']} s; end: after the bad tenant stopped, its job "
        "was forgotten and the daemon rested "
        f"{cfg['settle_s']:.0f} s.",
        "",
    ]
    lines += markdown_table(PHASE_COLUMNS, _phase_rows(data), align=">")
    lines += [
        "",
        "delivered / expected: blocks whose last submitted version reached the client, over "
        "the blocks of every client run that ended normally (the SIGKILLed ones are not "
        "counted; their restarts are). Latency: submit to arrival, every result of the half.",
        "",
        *[f"- {line}" for line in _target_lines(data)],
        "",
    ]
    for figure in data.get("figures", []):
        lines.append(f"![{Path(figure).stem}]({figure})")
    counts = data["phases"][1].get("bad_tenant") or {}
    if counts:
        rows = [[k, str(v)] for k, v in sorted(counts.items())]
        lines += ["", "What the bad tenant's attempts got:", ""]
        lines += markdown_table(("attempt: outcome", "count"), rows, align=">")
    return "\n".join(lines) + "\n"


def register(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "soak",
        help="clients, kills and a misbehaving tenant on one daemon for a while: "
        "RSS, fds, lost results, latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_DURATION_S:.0f} s, 2 clients of {len(QUICK_SIZES)} small blocks, a small "
        "bad tenant (a smoke test)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help=f"seconds in all, half without and half with the bad tenant "
        f"(default {DEFAULT_DURATION_S:.0f})",
    )
    parser.add_argument("--clients", type=int, metavar="N", help="well-behaved clients (default 4)")
    parser.add_argument(
        "--interval",
        type=float,
        metavar="S",
        default=0.5,
        help="seconds between a client's rounds of snapshots (default 0.5)",
    )
    parser.add_argument(
        "--daemon-workers",
        type=int,
        default=2,
        metavar="N",
        help="solver processes of the daemon (default 2)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the full report here")
    return run_command


def run_command(args: argparse.Namespace) -> int:
    quick = bool(args.quick)
    cfg = SoakConfig(
        duration_s=args.duration or (QUICK_DURATION_S if quick else DEFAULT_DURATION_S),
        clients=args.clients or (2 if quick else 4),
        sizes=QUICK_SIZES if quick else DEFAULT_SIZES,
        interval_s=args.interval,
        daemon_workers=args.daemon_workers,
        bad_big_n=1024 if quick else 2048,
        settle_s=3.0 if quick else 35.0,
        drain_s=20.0 if quick else 30.0,
    )
    report = run_soak(cfg, quick=quick)
    output.publish(report, format_report(report), args.json, write_figures)
    return 0
