"""`asteria bench scale`: one job on K simulated nodes, each with its own daemon, synced.

For each K (default 1, 2, 4) the benchmark starts K `asteria-server` processes on loopback TCP
(tenant tokens, one worker each) and one simulated rank per node: a thread with a daemon client
of that node's daemon. The ranks register the job's layout (every node's daemon), then run the
same fixed job: blocks of mixed sizes (SOAP eigenbases), a snapshot of every block every f
steps, identical on every node (data-parallel replicas), and at each step the staleness
barrier (S·f steps) a real optimizer applies. It reports, per daemon: solves, the CPU-seconds
of its process and workers, the estimated CPU-seconds of its solves (the calibrated cost model
times n³), bytes pushed to and received from its peers; and overall:

- duplicate solves: (block, version) pairs solved more than once in the cluster, whether the
  result was kept or thrown away (must be 0);
- claims: versions a daemon solved for a block another daemon owns because the owner's push
  would have come too late and the owner granted it (the owner then does not solve them: not
  duplicates), and local fallbacks (a daemon solved a block whose owner was down or not yet
  agreed: these may be duplicates, and are counted as such when they are);
- the balance ratio: the largest daemon's estimated solve CPU-seconds over the mean, of the
  owner map (what each daemon owns, per version) and of the solves actually done (a snapshot
  replaced by a newer one before its solve is not solved: latest wins), the latter also
  weighed by n³ alone (each daemon's calibrated cost per n³ differs on a loaded host);
- bytes between daemons per refresh against the minimum (each result once to each peer that
  needs it: K-1 copies of every result solved; a result overtaken by a newer one of its block
  before its push is not sent, so the ratio can be a little under 1);
- the staleness observed: the largest lag, in steps, of a block a rank used (the budget is
  S·f), and the barrier waits and local fallbacks.

The **HSDP rows** run the same blocks as the blocks of parameter shards (names with the shard
mark ``@``): two shards, each held by its own simulated rank on every node (two ranks per
node, the shard dimension within a node, replicas across nodes). Each shard's replicas register
a job of their own, as the client names a group smaller than the world (``distributed/layout.py``),
so each daemon syncs one job per shard. Every shard block has one owner among the nodes that
hold a replica of it, and each (block, version) must still be solved once in the cluster.

On a host with few cores the K daemons, their workers and the ranks share the same cores, so
these are counts and bytes, not speed: the time columns say what this host did, not what K real
nodes would.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asteria_client.bench import output
from asteria_client.daemon_process import DaemonProcess
from asteria_client.distributed.layout import group_job
from asteria_client.peers_status import peers_document
from asteria_client.runtime.source import PreconditionerRequest
from asteria_client.status import StatusReader
from asteria_client.tables import markdown_table, text_table
from asteria_client.transport.connection import JobNodeInfo, RegisteredJob
from asteria_client.transport.daemon import DaemonSource
from asteria_server.types import SolveKind

DEFAULT_NODES = (1, 2, 4)
#: The meshes a run can simulate: data-parallel replicas (one rank per node) or HSDP.
LAYOUTS = ("dp", "hsdp")
#: HSDP: shards per replica (ranks per node).
HSDP_SHARDS = 2
#: The fixed job: block dimensions (two of most sizes, like the two factors of a weight).
BLOCK_SIZES = (96, 96, 80, 80, 64, 64, 64, 48, 48, 40, 32, 32, 24, 16)
DEFAULT_REFRESHES = 8
QUICK_REFRESHES = 3
TENANT = "bench"
TOKEN = "bench-scale-token"
JOB = "scale"


@dataclass(frozen=True, kw_only=True)
class ScaleConfig:
    nodes: tuple[int, ...] = DEFAULT_NODES
    layouts: tuple[str, ...] = LAYOUTS
    refreshes: int = DEFAULT_REFRESHES
    precondition_frequency: int = 5
    staleness_budget: int = 1
    step_s: float = 0.02
    barrier_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.nodes or any(k < 1 for k in self.nodes):
            raise ValueError(f"nodes must be counts >= 1, got {list(self.nodes)}")
        if self.refreshes < 1 or self.precondition_frequency < 1:
            raise ValueError("refreshes and precondition_frequency must be >= 1")
        if not self.layouts or any(m not in LAYOUTS for m in self.layouts):
            raise ValueError(f"layouts must be among {list(LAYOUTS)}, got {list(self.layouts)}")
        if self.staleness_budget < 0 or self.step_s < 0:
            raise ValueError("staleness_budget and step_s must be >= 0")


def _factor(n: int, block: int, version: int) -> torch.Tensor:
    """The block's factor at ``version``: SPD, the same on every node (replicas)."""
    rng = np.random.default_rng(1000 * block + version)
    a = rng.standard_normal((n, 2 * n)).astype(np.float32)
    return torch.from_numpy(a @ a.T / (2 * n) + 1e-3 * np.eye(n, dtype=np.float32))


def job_blocks(layout: str, shard: int = 0) -> dict[int, str]:
    """The blocks one rank submits (index into BLOCK_SIZES -> name): every block for a
    data-parallel rank; under HSDP the blocks of its shard, named as a shard's blocks. FSDP2
    shards every parameter, so each shard holds a block of every size (the shards' own names);
    a shard's job has as many blocks to balance over the nodes as a data-parallel job."""
    if layout == "dp":
        return {i: f"b{i}" for i in range(len(BLOCK_SIZES))}
    return {i: f"b{i}@shard{shard}" for i in range(len(BLOCK_SIZES))}


class _Rank(threading.Thread):
    """One simulated rank of one node: snapshots every f steps, the staleness barrier."""

    def __init__(
        self,
        cfg: ScaleConfig,
        source: DaemonSource,
        go: threading.Barrier,
        blocks: dict[int, str],
    ) -> None:
        super().__init__(name="asteria-bench-scale-rank", daemon=True)
        self.cfg = cfg
        self.blocks = blocks
        self.source = source
        self.go = go
        self.max_lag = 0
        self.waits = 0
        self.wait_s = 0.0
        self.fallbacks = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._train()
        except BaseException as exc:  # reported by the benchmark, never swallowed
            self.error = exc

    def _train(self) -> None:
        cfg = self.cfg
        f, budget = cfg.precondition_frequency, cfg.staleness_budget * cfg.precondition_frequency
        installed = dict.fromkeys(self.blocks, -1)
        newest = -1
        self.go.wait()
        for step in range(cfg.refreshes * f):
            if step % f == 0:
                newest = step
                for i, name in self.blocks.items():
                    self.source.submit(
                        PreconditionerRequest(
                            block=name,
                            version=step,
                            kind=SolveKind.EIGENBASIS,
                            matrix=_factor(BLOCK_SIZES[i], i, step),
                            deadline_step=step + budget,
                        )
                    )
            for i, name in self.blocks.items():
                result = self.source.take(name)
                if result is not None:
                    installed[i] = max(installed[i], result.version)
                required = newest - budget  # the staleness barrier, as the optimizer's
                if required >= 0 and installed[i] < required:
                    started = time.perf_counter()
                    got = self.source.wait(name, required, cfg.barrier_timeout_s)
                    self.waits += 1
                    self.wait_s += time.perf_counter() - started
                    if got is None:
                        self.fallbacks += 1  # a real optimizer would solve it itself
                        installed[i] = newest
                    else:
                        installed[i] = max(installed[i], got.version)
                if installed[i] >= 0:  # the lag of the version in use, in steps
                    self.max_lag = max(self.max_lag, newest - installed[i])
            time.sleep(cfg.step_s)


def _result_bytes(n: int) -> int:
    """A SOAP eigenbasis result's arrays: the n x n float32 basis and n float32 eigenvalues."""
    return 4 * n * n + 4 * n


def shard_jobs(layout: str, k: int) -> list[str]:
    """The job each shard's replicas form on the daemons, in shard order: the whole world's
    under data parallelism; under HSDP one per shard, named as the client names a group smaller
    than the world (``asteria_client.distributed.layout.group_job``), the shard's replicas
    being rank ``shard`` of every node."""
    if layout == "dp":
        return [JOB]
    return [group_job(JOB, [i * HSDP_SHARDS + s for i in range(k)]) for s in range(HSDP_SHARDS)]


def run_k(cfg: ScaleConfig, k: int, layout: str = "dp") -> dict[str, Any]:
    """One run of the job on ``k`` simulated nodes (``layout``: see :data:`LAYOUTS`)."""
    env = {"ASTERIA_TOKENS": f"{TENANT}={TOKEN}"}
    daemons = [DaemonProcess(workers=1, listen="127.0.0.1:0", env=env) for _ in range(k)]
    per_node = 1 if layout == "dp" else HSDP_SHARDS
    jobs = shard_jobs(layout, k)
    sources: list[DaemonSource] = []
    try:
        for d in daemons:
            d.start()
        # rank r = node i, shard j: its job is its shard's (the world's under dp), in which it
        # is rank i (each node holds one replica of every shard)
        sources = [
            DaemonSource(
                d.address,
                tenant=TENANT,
                token=TOKEN,
                job=jobs[j],
                rank=i,
            )
            for i, d in enumerate(daemons)
            for j in range(per_node)
        ]
        for j, job in enumerate(jobs):  # each job's node leaders register its layout
            members = sources[j :: len(jobs)]  # the job's rank on every node: rank i on node i
            nodes = tuple(
                JobNodeInfo(
                    host=f"node{i}",
                    ranks=(i,),
                    daemon_address=d.address,
                    daemon_incarnation=s.incarnation_id,
                )
                for i, (d, s) in enumerate(zip(daemons, members, strict=True))
            )
            for i, s in enumerate(members):
                s.register_job(RegisteredJob(job=job, world_size=k, nodes=nodes, node_rank=i))
        go = threading.Barrier(len(sources))
        ranks = [_Rank(cfg, s, go, job_blocks(layout, r % per_node)) for r, s in enumerate(sources)]
        started = time.perf_counter()
        for r in ranks:
            r.start()
        for r in ranks:
            r.join()
        wall_s = time.perf_counter() - started
        for r in ranks:
            if r.error is not None:
                raise RuntimeError(f"a simulated rank failed: {r.error!r}") from r.error
        time.sleep(0.5)  # the last pushes land
        views = []
        for d in daemons:
            reader = StatusReader(d.address, TENANT, TOKEN)
            try:
                stats, _, _ = reader.read()
                groups = peers_document(reader.peers())
            finally:
                reader.close()
            views.append((stats, groups))
    finally:
        for s in sources:
            s.close()
        for d in daemons:
            if d.exit is None:
                d.stop()

    sizes = {
        f"{jobs[shard]}:{name}": BLOCK_SIZES[i]
        for shard in range(per_node)
        for i, name in job_blocks(layout, shard).items()
    }
    per_daemon = []
    solved: dict[str, list[int]] = {}
    planned = [0.0] * k  # each daemon's owned cost in the owner maps, over every job
    for i, ((stats, groups), d) in enumerate(zip(views, daemons, strict=True)):
        solves = stats.solves_done
        est = work = 0.0
        for group in groups:
            for b in group["blocks"]:
                versions = b["solved_versions"] + b["discarded_versions"]
                solved.setdefault(b["block"], []).extend(versions)  # "job:name"
                est += stats.seconds_per_n3 * b["n"] ** 3 * len(versions)
                work += float(b["n"]) ** 3 * len(versions)
            if i == 0:  # every daemon holds the same owner maps: read them once
                for p in group["peers"]:
                    planned[p["node"]] += p["owned_cost_s"]
        peers = [p for g in groups for p in g["peers"] if p["state"] != "self"]

        def total(key: str, groups: list[dict[str, Any]] = groups) -> int:
            return sum(g[key] for g in groups)

        reasons = sum((Counter(g["fallback_reasons"]) for g in groups), Counter[str]())
        per_daemon.append(
            {
                "node": i,
                "solves": solves,
                "cpu_s": d.cpu_s,
                "solve_cpu_s_estimated": est,
                # the same without each daemon's own calibration (which a loaded host skews)
                "solve_work_n3": work,
                "bytes_pushed": sum(p["bytes_sent"] for p in peers),
                "bytes_received": sum(p["bytes_received"] for p in peers),
                "results_pushed": sum(p["results_sent"] for p in peers),
                "fallbacks": total("fallbacks"),
                "fallback_reasons": dict(reasons),
                "claims_sent": total("claims_sent"),
                "claims_granted": total("claims_granted"),
                "claims_handed_over": total("claims_handed_over"),
                "solves_withdrawn": total("solves_withdrawn"),
                "results_discarded": stats.results_discarded,
            }
        )
    duplicates = sum(len(v) - len(set(v)) for v in solved.values())
    distinct = {b: set(v) for b, v in solved.items()}
    minimum = (k - 1) * sum(_result_bytes(sizes[b]) * len(v) for b, v in distinct.items())
    pushed = sum(p["bytes_pushed"] for p in per_daemon)
    planned_mean = sum(planned) / len(planned) if k > 1 else 0.0
    loads = [float(p["solve_cpu_s_estimated"]) for p in per_daemon]
    mean = sum(loads) / len(loads)
    works = [float(p["solve_work_n3"]) for p in per_daemon]
    mean_work = sum(works) / len(works)
    return {
        "nodes": k,
        "layout": layout,
        "blocks_solved": sorted(solved),
        "wall_s": wall_s,
        "daemons": per_daemon,
        "solves": sum(p["solves"] for p in per_daemon),
        "duplicate_solves": duplicates,
        "claims_granted": sum(p["claims_granted"] for p in per_daemon),
        "daemon_fallbacks": sum(p["fallbacks"] for p in per_daemon),
        "balance": max(loads) / mean if mean > 0 else 1.0,
        "balance_of_solves_n3": max(works) / mean_work if mean_work > 0 else 1.0,
        "balance_of_owner_map": max(planned) / planned_mean if planned_mean > 0 else 1.0,
        "bytes_between_daemons": pushed,
        "bytes_minimum": minimum,
        "bytes_over_minimum": pushed / minimum if minimum else None,
        "bytes_per_refresh": pushed / cfg.refreshes,
        "max_lag_steps": max(r.max_lag for r in ranks),
        "budget_steps": cfg.staleness_budget * cfg.precondition_frequency,
        "barrier_waits": sum(r.waits for r in ranks),
        "barrier_wait_s": sum(r.wait_s for r in ranks),
        "rank_fallbacks": sum(r.fallbacks for r in ranks),
    }


def run_scale(cfg: ScaleConfig) -> dict[str, Any]:
    runs = [run_k(cfg, k, layout) for layout in cfg.layouts for k in cfg.nodes]
    return {
        "benchmark": "scale",
        "config": {**asdict(cfg), "block_sizes": list(BLOCK_SIZES)},
        "note": "counts and bytes; K daemons and ranks share this host's cores, so times are "
        "this host's, not K real nodes'",
        "runs": runs,
    }


def _rows(report: dict[str, Any]) -> list[list[str]]:
    rows = [
        [
            "mesh",
            "K",
            "solves/daemon",
            "dup",
            "balance map/done/n³",
            "est. solve CPU-s/daemon",
            "CPU-s/daemon",
            "KiB pushed/daemon",
            "bytes/min",
            "max lag/budget",
            "claims",
            "fallbacks",
        ]
    ]
    for run in report["runs"]:
        daemons = run["daemons"]
        over = run["bytes_over_minimum"]
        rows.append(
            [
                run.get("layout", "dp"),
                str(run["nodes"]),
                " ".join(str(d["solves"]) for d in daemons),
                str(run["duplicate_solves"]),
                f"{run['balance_of_owner_map']:.2f}/{run['balance']:.2f}/"
                f"{run.get('balance_of_solves_n3', run['balance']):.2f}",
                " ".join(f"{d['solve_cpu_s_estimated']:.3f}" for d in daemons),
                " ".join("-" if d["cpu_s"] is None else f"{d['cpu_s']:.1f}" for d in daemons),
                " ".join(f"{d['bytes_pushed'] / 1024:.0f}" for d in daemons),
                "-" if over is None else f"{over:.3f}",
                f"{run['max_lag_steps']}/{run['budget_steps']}",
                str(sum(d.get("claims_granted", 0) for d in daemons)),
                str(run["rank_fallbacks"] + sum(d["fallbacks"] for d in daemons)),
            ]
        )
    return rows


def format_report(report: dict[str, Any]) -> str:
    return "\n".join([*text_table(_rows(report), align=">"), report["note"]])


def markdown(report: dict[str, Any]) -> str:
    rows = _rows(report)
    return "\n".join(markdown_table(rows[0], rows[1:], align=">"))


def write_figures(report: dict[str, Any], json_path: Path) -> list[Path]:
    return []  # a table says it all: counts and bytes per K


def report_section(report: dict[str, Any]) -> str:
    """The section of docs/benchmarks.md (``asteria bench report``)."""
    cfg = report["config"]
    sizes = ", ".join(str(n) for n in cfg["block_sizes"])
    lines = [
        f"One job of {len(cfg['block_sizes'])} SOAP blocks (n = {sizes}), a snapshot of every "
        f"block every {cfg['precondition_frequency']} steps for {cfg['refreshes']} refreshes, "
        f"staleness budget S = {cfg['staleness_budget']}, on K simulated nodes: one daemon each "
        "(loopback TCP, tenant token, one solver worker) and one simulated rank each (a daemon "
        "client with the staleness barrier). "
        + report["note"][:1].upper()
        + report["note"][1:]
        + ".",
        "",
        markdown(report),
        "",
        "Columns: mesh: `dp`, one data-parallel rank per node holding every block, or "
        f"`hsdp`, {HSDP_SHARDS} ranks per node each holding one shard's blocks (names with "
        "`@`; a block of every size per shard), the shards replicated across nodes, each "
        "shard's replicas a job of their own; solves per daemon; `dup`: (block, "
        "version) pairs solved more than once in the cluster (a result kept or thrown "
        "away); balance: largest over mean estimated "
        "solve CPU-seconds, of the owner map and of the solves done (a snapshot replaced by "
        "a newer one before its solve is skipped, latest wins, so the done balance also "
        "reflects which versions each owner skipped; `n³`: the solves done weighed by n³ "
        "alone, without each daemon's own calibration, which a loaded host skews); "
        "CPU-s: each daemon process with its worker, start to stop; bytes/min: bytes pushed "
        "between daemons over K-1 copies of every result solved; max lag: the largest lag "
        "of a version in use, in steps, against the budget S·f; claims: versions a daemon "
        "solved for a block another daemon owns, granted by that owner because its push would "
        "have come too late (the owner does not solve them); fallbacks: ranks and daemons that "
        "computed a block themselves without such a grant (its owner down or not agreed yet).",
    ]
    return "\n".join(lines)


def register(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "scale",
        help="one job on K simulated nodes: solves, duplicates, balance, bytes between daemons",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_REFRESHES} refreshes instead of {DEFAULT_REFRESHES}",
    )
    parser.add_argument(
        "--nodes",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        metavar="K,K,...",
        help=f"simulated node counts (default {','.join(map(str, DEFAULT_NODES))})",
    )
    parser.add_argument(
        "--layouts",
        type=lambda text: tuple(text.split(",")),
        metavar="dp,hsdp",
        help=f"meshes to simulate (default {','.join(LAYOUTS)})",
    )
    parser.add_argument("--precondition-frequency", type=int, default=5, metavar="F")
    parser.add_argument("--staleness-budget", type=int, default=1, metavar="S")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the full report here")
    return run_command


def run_command(args: argparse.Namespace) -> int:
    cfg = ScaleConfig(
        nodes=args.nodes or DEFAULT_NODES,
        layouts=args.layouts or LAYOUTS,
        refreshes=QUICK_REFRESHES if args.quick else DEFAULT_REFRESHES,
        precondition_frequency=args.precondition_frequency,
        staleness_budget=args.staleness_budget,
    )
    report = run_scale(cfg)
    output.publish(report, format_report(report), args.json, write_figures)
    return 0
