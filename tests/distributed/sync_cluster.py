"""K simulated nodes on one host for the sync tests: K real daemons on loopback TCP (tenant
tokens, each with its own socket directory) and real gloo ranks, spawned, whose node is named by
``ASTERIA_NODE`` and whose daemon is that node's.

A rank trains a small model (blocks of mixed sizes: 48, 40, 32, 24, 16) under DDP with SOAP in
daemon mode and writes its parameters and runtime stats to ``tmp/rank{r}.json``."""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asteria_client.daemon_process import DaemonProcess
from asteria_client.peers_status import peers_document
from asteria_client.status import StatusReader
from tests.distributed.spawn import leave

TENANT = "t"
TOKEN = "secret-0123456789abcdef"
JOB = "sync-job"


def model() -> torch.nn.Module:
    """SOAP blocks 48, 32, 40, 48, 24, 40, 16, 24 (two per weight): LPT balances them within
    1.05 on 2 or 3 daemons."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 48),
        torch.nn.Tanh(),
        torch.nn.Linear(48, 40),
        torch.nn.Tanh(),
        torch.nn.Linear(40, 24),
        torch.nn.Linear(24, 16),
    )


NUM_BLOCKS = 8


@dataclass
class RunSpec:
    """One training run of the job: which daemon each node uses, how ranks sit on nodes."""

    addresses: list[str]  # by node
    node_of_rank: list[int]
    steps: int = 20
    frequency: int = 2
    budget: int = 1
    step_sleep_s: float = 0.0
    barrier_timeout_s: float = 30.0
    #: the rank that writes ``tmp/at_step`` (its step number) as it trains, for the test
    report_rank: int = 0
    #: False: no DDP, every rank trains on the whole batch (replicas hold the same factors
    #: without a collective per step, so a stalled rank does not stall the others)
    ddp: bool = True
    #: seconds a rank waits after its last step before it closes its optimizer, so that its
    #: last snapshots reach its daemon (a closing client drops what it has not sent)
    drain_s: float = 1.0
    #: the optimizer's schedule; "continuous" attaches it to the model (pulls in forward and
    #: backward too) with ``refresh_overhead``
    refresh: str = "amortized"
    refresh_overhead: float = 0.5
    env: dict[str, str] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return len(self.node_of_rank)


def enter_node(node: int, env: dict[str, str] | None = None) -> None:
    """Make this rank's process one of simulated node ``node``'s, a rank of the job's tenant."""
    os.environ.update(
        {
            "ASTERIA_NODE": f"node{node}",
            "ASTERIA_TENANT": TENANT,
            "ASTERIA_TOKEN": TOKEN,
            "ASTERIA_JOB": JOB,
            **(env or {}),
        }
    )


def _rank(rank: int, world: int, tmp: str, spec_json: str) -> None:
    spec = RunSpec(**json.loads(spec_json))
    node = spec.node_of_rank[rank]
    enter_node(node, spec.env)
    from asteria_client import SOAP

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        net = model()
        ddp = torch.nn.parallel.DistributedDataParallel(net) if spec.ddp else net
        g = torch.Generator().manual_seed(7)
        data = [torch.randn(16 * world, 32, generator=g) for _ in range(spec.steps)]
        continuous: dict[str, Any] = (
            {"refresh_overhead": spec.refresh_overhead} if spec.refresh != "amortized" else {}
        )
        opt = SOAP(
            net.named_parameters(),
            lr=1e-2,
            mode="daemon",
            address=spec.addresses[node],
            staleness_budget=spec.budget,
            precondition_frequency=spec.frequency,
            barrier_timeout_s=spec.barrier_timeout_s,
            refresh=spec.refresh,
            **continuous,
        )
        if continuous:
            opt.attach(net)
        try:
            for step, batch in enumerate(data):
                x = batch[rank * 16 : (rank + 1) * 16] if spec.ddp else batch
                opt.zero_grad()
                ddp(x).square().mean().backward()
                opt.step()
                if rank == spec.report_rank:
                    (Path(tmp) / "at_step.tmp").write_text(str(step))
                    os.replace(Path(tmp) / "at_step.tmp", Path(tmp) / "at_step")
                if spec.step_sleep_s:
                    time.sleep(spec.step_sleep_s)
            time.sleep(spec.drain_s)
            stats = opt.runtime_stats()
        finally:
            opt.close()
        out = {
            "params": {k: v.detach().tolist() for k, v in net.state_dict().items()},
            "local_fallbacks": stats["local_fallbacks"],
            "max_lag_steps": stats["max_lag_steps"],
            "barrier_max_wait_s": stats["barrier_max_wait_s"],
            "source": {k: v for k, v in stats["source"].items() if isinstance(v, int | float)},
            "pulls": {
                b: [r.get("floor_pulls", 0), r.get("extra_pulls", 0)]
                for b, r in stats["refreshes"]["blocks"].items()
            },
            "agreement": {k: v for k, v in stats.items() if k.startswith("agreement_")},
        }
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(out))
        del ddp, opt
        leave()
    finally:
        dist.destroy_process_group()


def start_ranks(tmp: Path, spec: RunSpec) -> Any:
    """Spawn the ranks (not joined): the caller joins ``ctx`` (``ctx.join(timeout)``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    return mp.start_processes(
        _rank,
        args=(spec.world, str(tmp), json.dumps(asdict(spec))),
        nprocs=spec.world,
        start_method="spawn",
        join=False,
    )


def join(ctx: Any, timeout_s: float, during: Callable[[], None] | None = None) -> None:
    """Join every rank within ``timeout_s`` (a rank's failure raises), calling ``during``
    between looks."""
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.2):
            if during is not None:
                during()
            if time.monotonic() > deadline:
                raise AssertionError(f"the ranks did not finish within {timeout_s} s")
    except BaseException:
        for p in ctx.processes:  # no rank outlives a failed test
            if p.is_alive():
                p.kill()
        raise


def run_ranks(tmp: Path, spec: RunSpec, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    join(start_ranks(tmp, spec), timeout_s)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(spec.world)]


def worker_pids(daemon_pid: int) -> list[int]:
    """The daemon's solver worker processes (its children), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == daemon_pid:
            out.append(int(stat.parent.name))
    return out


class Throttle(threading.Thread):
    """A slowed daemon: its solver workers (spares included) are SIGSTOPped for ``stop_s`` of
    every ``stop_s + run_s`` seconds, as a host too loaded to give them the CPU would, while
    the daemon itself answers its peers and ranks at once. ``stop()`` resumes them for good."""

    def __init__(self, daemon_pid: int, stop_s: float, run_s: float) -> None:
        super().__init__(name="throttle", daemon=True)
        self.daemon_pid, self.stop_s, self.run_s = daemon_pid, stop_s, run_s
        self.halt = threading.Event()
        self.stopped: set[int] = set()
        self.cycles = 0

    def _signal(self, pids: set[int], sig: signal.Signals) -> None:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                self.stopped = set()
                self.cycles += 1
                until = time.monotonic() + self.stop_s
                # The pool replaces an idle worker it finds stopped, so the workers that start
                # meanwhile are stopped too (as a loaded host would hold them back as well).
                while not self.halt.is_set() and time.monotonic() < until:
                    new = set(worker_pids(self.daemon_pid)) - self.stopped
                    self._signal(new, signal.SIGSTOP)
                    self.stopped |= new
                    self.halt.wait(min(0.05, max(0.0, until - time.monotonic())))
                self._signal(self.stopped, signal.SIGCONT)
                self.halt.wait(self.run_s)
        finally:
            self._signal(self.stopped, signal.SIGCONT)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)
        self._signal(self.stopped | set(worker_pids(self.daemon_pid)), signal.SIGCONT)


def sync_env(**timings: float) -> dict[str, str]:
    return {f"ASTERIA_SYNC_{k.upper()}": str(v) for k, v in timings.items()}


def daemon(
    tmp: Path, index: int, port: int = 0, env: dict[str, str] | None = None
) -> DaemonProcess:
    return DaemonProcess(
        workers=1,
        listen=f"127.0.0.1:{port}",
        socket_dir=tmp / f"daemon{index}",
        env={"ASTERIA_TOKENS": f"{TENANT}={TOKEN}", **(env or {})},
    )


@contextmanager
def daemons(tmp: Path, k: int, env: dict[str, str] | None = None) -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    try:
        for i in range(k):
            started.append(daemon(tmp, i, env=env).start())
        yield started
    finally:
        for d in started:
            if d.exit is None:
                if d.process.poll() is None:
                    d.stop()
                else:
                    d.stop()


@dataclass
class DaemonView:
    solves_done: int
    groups: list[dict[str, Any]]
    #: solves whose result was older than the block's newest when it came (overtaken)
    results_discarded: int = 0
    #: block -> snapshots its engine replaced in the queue by a newer one (latest wins)
    superseded: dict[str, int] = field(default_factory=dict)

    @property
    def group(self) -> dict[str, Any]:
        (found,) = [g for g in self.groups if g["job"] == JOB]
        return found


def view(address: str) -> DaemonView:
    reader = StatusReader(address, TENANT, TOKEN)
    try:
        stats, blocks, _ = reader.read()
        superseded = {b.block: b.superseded for b in blocks}
        return DaemonView(
            stats.solves_done, peers_document(reader.peers()), stats.results_discarded, superseded
        )
    finally:
        reader.close()
