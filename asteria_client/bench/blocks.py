"""`asteria bench blocks`: what Asteria's bookkeeping costs per block, from 100 to 20,000 blocks.

A model's block inventory is drawn from a named model's weight shapes (``--model llama-7b`` or
``gpt2-xl``) blocked at ``--max-preconditioner-dim`` by the optimizers' own rule
(:func:`~asteria_client.optim.blocking.plan_blocking`): one block per preconditioned dim of each
tile, named as the optimizers name them. N blocks are the first N of that inventory, repeated
with a shard prefix where the model has fewer (FSDP2 shards multiply the names).

**Cheap solves.** Every snapshot is a ``--surrogate-n`` × ``--surrogate-n`` SPD matrix (4 by
default) instead of the block's real n × n factor, so that the bookkeeping, not LAPACK, is
measured: the report states the surrogate, and the real model's payload bytes beside it.

For each N, one measured client drives a real :class:`~asteria_client.runtime.FreshnessRuntime`
over a real source the way an optimizer does (every step ``sync`` of every tile; every f steps a
snapshot of every tile; 130 hook signals, ``pump``, as ``attach()`` gives a large model; the
install callback only records the version, so the optimizer's own math is excluded), first on
the embedded engine, then on one daemon (Unix socket, shared memory, one worker). It reports:

- the client's host time (the training thread, runtime + source) per step that refreshes
  nothing and receives nothing, and per refresh step; total and per block;
- open + register: the source's construction (session, stream) and the time until the daemon
  holds every block (RegisterBlocks);
- the daemon process's CPU per snapshot + result pair beyond the solve (its main process only:
  the solves run in worker processes) over one refresh of every block;
- the daemon's anonymous RSS per block beyond the payload bytes it holds: RssAnon of its main
  process after the measured client's blocks have all been solved and delivered once, less
  RssAnon after a first session of a few blocks (closed and forgotten again: the daemon's
  one-off costs are paid by then), less the results the daemon holds in its own memory (none
  over shared memory, where the payload is the client's memfd: RssShmem, reported beside it);
- with ``--clients`` C, C - 1 more clients (processes) then register as many blocks each and
  train: ``asteria status`` latency and JSON size over all pages of the C × N blocks, and the
  Status RPC's p99 while they train; and ``asteria status`` (the summary) and ``asteria status
  --json --blocks`` as a user runs them, each a process timed from start to exit.

A progress line goes to stderr per phase. On a 2-core host the clients and the daemon share the
cores: these are this host's times; the ratios between N in one run are what to read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from asteria_client.bench import output
from asteria_client.bench.stats import percentile
from asteria_client.daemon_process import DaemonProcess
from asteria_client.optim.blocking import plan_blocking
from asteria_client.runtime.freshness import FreshnessRuntime, Mode, TileBlocks
from asteria_client.runtime.source import (
    PreconditionerRequest,
    PreconditionerResult,
    PreconditionerSource,
)
from asteria_client.runtime.staleness import StalenessPolicy
from asteria_client.status import (
    StatusReader,
    summary_document,
    write_status_pages,
)
from asteria_client.tables import markdown_table, text_table
from asteria_server.types import SolveKind

#: Weight shapes of one transformer layer and the model's other matrices, per model.
MODELS: dict[str, dict[str, Any]] = {
    "llama-7b": {
        "layers": 32,
        "layer": {
            "self_attn.q_proj": (4096, 4096),
            "self_attn.k_proj": (4096, 4096),
            "self_attn.v_proj": (4096, 4096),
            "self_attn.o_proj": (4096, 4096),
            "mlp.gate_proj": (11008, 4096),
            "mlp.up_proj": (11008, 4096),
            "mlp.down_proj": (4096, 11008),
        },
        "other": {"embed_tokens": (32000, 4096), "lm_head": (32000, 4096)},
    },
    "gpt2-xl": {
        "layers": 48,
        "layer": {
            "attn.c_attn": (1600, 4800),
            "attn.c_proj": (1600, 1600),
            "mlp.c_fc": (1600, 6400),
            "mlp.c_proj": (6400, 1600),
        },
        "other": {"wte": (50257, 1600)},
    },
}
DEFAULT_BLOCKS = (100, 1000, 5000, 20000)
QUICK_BLOCKS = (100, 400)
DEFAULT_CLIENTS = 8
MODES = ("embedded", "daemon")
#: The daemon's default ``tenant_max_blocks``.
DEFAULT_TENANT_MAX_BLOCKS = 100_000
TENANT = "local"
#: Hook signals per step: ``attach()``'s forward and backward signals of a large model.
HOOK_SIGNALS = 2 * 65
#: Calls of the source's ``credit()`` timed per N (the continuous schedule's pulls ask it).
CREDIT_CALLS = 200
#: Blocks of the first session, which runs before the daemon's memory baseline is read.
WARMUP_BLOCKS = 4


@dataclass(frozen=True, kw_only=True)
class BlocksConfig:
    model: str = "llama-7b"
    max_preconditioner_dim: int = 2048
    blocks: tuple[int, ...] = DEFAULT_BLOCKS
    clients: int = DEFAULT_CLIENTS
    surrogate_n: int = 4
    idle_steps: int = 20
    precondition_frequency: int = 10
    staleness_budget: int = 1
    background_step_s: float = 0.2
    status_rpc_s: float = 5.0
    modes: tuple[str, ...] = ("embedded", "daemon")
    #: how long a round of results (or the other clients' registration) may take: 8 clients of
    #: 20,000 blocks on a busy 2-core host ran past 120 s
    result_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if not self.blocks or any(n < 2 for n in self.blocks):
            raise ValueError(f"blocks must be counts >= 2, got {list(self.blocks)}")
        if self.clients < 1 or self.surrogate_n < 1 or self.idle_steps < 1:
            raise ValueError("clients, surrogate_n and idle_steps must be >= 1")
        if self.max_preconditioner_dim < 1 or self.precondition_frequency < 1:
            raise ValueError("max_preconditioner_dim and precondition_frequency must be >= 1")
        unknown = set(self.modes) - {"embedded", "daemon"}
        if not self.modes or unknown:
            raise ValueError(f"modes must be among embedded, daemon, got {list(self.modes)}")


def inventory(model: str, max_dim: int) -> list[tuple[str, int]]:
    """(block name, n) of every block of ``model`` blocked at ``max_dim``, in model order."""
    spec = MODELS[model]
    params = [(name, shape) for name, shape in spec["other"].items()]
    for layer in range(spec["layers"]):
        params += [(f"layers.{layer}.{name}", shape) for name, shape in spec["layer"].items()]
    blocks = []
    for name, shape in params:
        plan = plan_blocking(shape, max_dim)
        for tile in plan.tiles:
            for dim, (size, pre) in enumerate(zip(tile.shape, tile.preconditioned, strict=True)):
                if pre:
                    blocks.append((f"{name}/tile{tile.index}/dim{dim}", size))
    return blocks


def first_blocks(model: str, max_dim: int, count: int) -> list[tuple[str, int]]:
    """The first ``count`` blocks of the inventory, repeated under ``shardK.`` prefixes."""
    blocks = inventory(model, max_dim)
    out = []
    for i in range(count):
        name, n = blocks[i % len(blocks)]
        shard = i // len(blocks)
        out.append((f"shard{shard}.{name}" if shard else name, n))
    return out


@dataclass(kw_only=True)
class _Tile(TileBlocks):
    """A tile of the synthetic model: its blocks' surrogate factor."""

    factor: torch.Tensor


def _tiles(blocks: list[tuple[str, int]], surrogate_n: int) -> list[_Tile]:
    """Tiles of two blocks each (an order-2 tile's L and R), the last possibly of one."""
    a = torch.randn(surrogate_n, 2 * surrogate_n, generator=torch.Generator().manual_seed(0))
    factor = a @ a.T / (2 * surrogate_n) + 1e-3 * torch.eye(surrogate_n)
    tiles = []
    for i in range(0, len(blocks), 2):
        names: list[str | None] = [name for name, _ in blocks[i : i + 2]]
        tiles.append(_Tile.named(names, factor=factor.clone()))
    return tiles


class SyntheticTrainer:
    """Drives a runtime the way an optimizer does, without the optimizer's math."""

    def __init__(self, source: PreconditionerSource, mode: Mode, cfg: BlocksConfig) -> None:
        self.cfg = cfg
        policy = StalenessPolicy(budget_intervals=cfg.staleness_budget)
        self.runtime = FreshnessRuntime(source, policy, mode=mode, needs_first_result=False)
        self.tiles: list[TileBlocks] = []
        self.requests: list[Callable[[int, int], PreconditionerRequest]] = []
        self.step_count = 0
        self._request_of: dict[int, Callable[[int, int], PreconditionerRequest]] = {}

    def load(self, blocks: list[tuple[str, int]]) -> None:
        tiles = _tiles(blocks, self.cfg.surrogate_n)
        self.tiles = list(tiles)
        self.requests = [self._request_fn(tile) for tile in tiles]
        self._request_of = {id(t): r for t, r in zip(tiles, self.requests, strict=True)}

    def request_of(self, tile: Any) -> Callable[[int, int], PreconditionerRequest]:
        return self._request_of[id(tile)]

    def _request_fn(self, tile: _Tile) -> Callable[[int, int], PreconditionerRequest]:
        runtime, frequency = self.runtime, self.cfg.precondition_frequency

        def request(dim: int, version: int) -> PreconditionerRequest:
            block = tile.blocks[dim]
            assert block is not None
            return PreconditionerRequest(
                block=block,
                version=version,
                kind=SolveKind.INVERSE_ROOT,
                matrix=tile.factor,
                deadline_step=runtime.deadline_step(version, frequency),
            )

        return request

    @staticmethod
    def install(tile: Any, dim: int, result: PreconditionerResult) -> None:
        tile.versions[dim] = result.version

    def step(self, *, refresh: bool) -> float:
        """One optimizer step's runtime calls; the training thread's seconds."""
        self.step_count += 1
        step, f = self.step_count, self.cfg.precondition_frequency
        start = time.perf_counter()
        runtime, install = self.runtime, self.install
        for _ in range(HOOK_SIGNALS):  # the model's forward and backward hooks
            runtime.pump(self._all_tiles, install)
        sync_tiles = getattr(runtime, "sync_tiles", None)
        if sync_tiles is not None:  # as the optimizers sync a tile group
            sync_tiles(self.tiles, step, f, self.request_of, install)
        else:  # a runtime from before sync_tiles: the optimizers synced tile by tile
            for tile, request in zip(self.tiles, self.requests, strict=True):
                runtime.sync(tile, step, f, request, install)
        if refresh:
            for tile, request in zip(self.tiles, self.requests, strict=True):
                runtime.submit(tile, step, f, request, install)
        return time.perf_counter() - start

    def _all_tiles(self) -> list[TileBlocks]:
        return self.tiles

    def all_installed(self, version: int) -> bool:
        return all(
            tile.versions[dim] >= version for tile in self.tiles for dim, _ in tile.preconditioned()
        )

    def receive_all(self, timeout_s: float) -> tuple[int, float]:
        """Steps (without refresh) until every block uses the newest snapshot's result."""
        version = max(max(t.submitted) for t in self.tiles)
        deadline = time.monotonic() + timeout_s
        steps, spent = 0, 0.0
        while not self.all_installed(version):
            if time.monotonic() > deadline:
                raise RuntimeError(f"results of version {version} did not all arrive")
            spent += self.step(refresh=False)
            steps += 1
            time.sleep(0.01)
        return steps, spent


def _progress(message: str) -> None:
    print(f"[bench blocks] {message}", file=sys.stderr, flush=True)


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _cpu_s(pid: int) -> float:
    """The process's own CPU seconds (not its children's: the solver workers)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle_steps(trainer: SyntheticTrainer, count: int) -> tuple[list[float], int]:
    """``count`` steps that refresh nothing; how many of them received something."""
    source = trainer.runtime.source
    times, receiving = [], 0
    for _ in range(count):
        epoch = source.results_epoch()
        times.append(trainer.step(refresh=False))
        receiving += source.results_epoch() != epoch
    return times, receiving


def _summary(times: list[float], n: int) -> dict[str, float]:
    median = percentile(times, 50)
    return {"median_s": median, "per_block_s": median / n, "p90_s": percentile(times, 90)}


def measure_embedded(cfg: BlocksConfig, n: int) -> dict[str, Any]:
    from asteria_client.runtime.embedded import EmbeddedSource, EngineConfig

    blocks = first_blocks(cfg.model, cfg.max_preconditioner_dim, n)
    start = time.perf_counter()
    source = EmbeddedSource(EngineConfig(num_workers=1))
    open_s = time.perf_counter() - start
    trainer = SyntheticTrainer(source, Mode.EMBEDDED, cfg)
    try:
        trainer.load(blocks)
        first = trainer.step(refresh=True)
        trainer.receive_all(cfg.result_timeout_s)
        idle, receiving = _idle_steps(trainer, cfg.idle_steps)
        refresh = [trainer.step(refresh=True)]
        trainer.receive_all(cfg.result_timeout_s)
        refresh.append(trainer.step(refresh=True))
        trainer.receive_all(cfg.result_timeout_s)
    finally:
        trainer.runtime.close()
    return {
        "open_s": open_s,
        "first_step_s": first,
        "idle_step": _summary(idle, n),
        "idle_steps_receiving": receiving,
        "refresh_step": _summary(refresh, n),
    }


def _background_client(
    address: str, cfg: BlocksConfig, n: int, index: int, go: Any, ready: Any, stop: Any
) -> None:
    """One more client (a process): once told to go, registers ``n`` blocks of its own job,
    then trains until told to stop."""
    from asteria_client.transport.daemon import DaemonSource

    torch.set_num_threads(1)
    ready.put(-index)  # started: the measured client runs on a quiet host from here
    go.wait()
    source = DaemonSource(address, tenant=TENANT, token="", job=f"client{index}")
    trainer = SyntheticTrainer(source, Mode.DAEMON, cfg)
    trainer.load(first_blocks(cfg.model, cfg.max_preconditioner_dim, n))
    try:
        trainer.step(refresh=True)
        deadline = time.monotonic() + cfg.result_timeout_s
        while source.registered_blocks() < n and time.monotonic() < deadline:
            time.sleep(0.05)
        ready.put(index)
        while not stop.is_set():
            started = time.perf_counter()
            trainer.step(refresh=trainer.step_count % cfg.precondition_frequency == 0)
            left = cfg.background_step_s - (time.perf_counter() - started)
            if left > 0:
                stop.wait(left)
    finally:
        trainer.runtime.close()


def _status_read(address: str) -> tuple[float, int, int]:
    """``asteria status --json --blocks`` in this process, as the CLI writes it (each page's
    rows from its columns while the daemon builds the next): seconds, bytes, blocks (all
    pages)."""
    start = time.perf_counter()
    reader = StatusReader(address, TENANT, "")
    sink = _ByteCount()
    try:
        rows = write_status_pages(sink, address, reader.read_pages())
    finally:
        reader.close()
    return time.perf_counter() - start, sink.bytes, rows


def _status_cli(address: str, *args: str) -> float:
    """``asteria status --tenant local ARGS`` as a user runs it, a process of its own from
    start to exit (its imports included: they once took longer than the read), its output to
    /dev/null: seconds. Raises RuntimeError if it fails."""
    command = [sys.executable, "-P", "-m", "asteria_client.cli", "status", "--address", address]
    # this process's import path, so the command is the asteria it measures, not the working
    # directory's (-P: none prepended)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    start = time.perf_counter()
    done = subprocess.run(
        [*command, "--tenant", TENANT, *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        check=False,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(
            f"asteria status {' '.join(args)} exited {done.returncode}: "
            f"{done.stderr.strip()[-300:]}"
        )
    return seconds


class _ByteCount:
    """A text sink that keeps only the UTF-8 size of what is written (stdout encodes it too)."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, text: str) -> int:
        self.bytes += len(text.encode())
        return len(text)


def _status_summary_read(address: str) -> tuple[float, int, int]:
    """``asteria status --json`` (its default, the summary) in this process: seconds, bytes,
    blocks counted. Raises RuntimeError against a daemon that predates summaries."""
    start = time.perf_counter()
    reader = StatusReader(address, TENANT, "")
    try:
        stats, summary, transport = reader.read_summary()
        if summary is None:
            raise RuntimeError("the daemon sends no status summary")
        text = json.dumps(summary_document(address, stats, summary, transport))
    finally:
        reader.close()
    return time.perf_counter() - start, len(text.encode()), summary.blocks


@contextlib.contextmanager
def _clients(address: str, cfg: BlocksConfig, n: int, count: int) -> Iterator[Callable[[], None]]:
    """``count`` more client processes, started now (before the measured client holds its
    descriptors); the function it yields tells them to register and returns once they have."""
    context = multiprocessing.get_context("spawn")
    go, ready, stop = context.Event(), context.Queue(), context.Event()
    procs = [
        context.Process(
            target=_background_client,
            args=(address, cfg, n, i + 1, go, ready, stop),
            daemon=True,
        )
        for i in range(count)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=cfg.result_timeout_s)

    def start() -> None:
        go.set()
        for _ in procs:
            ready.get(timeout=cfg.result_timeout_s)

    try:
        yield start
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _wait_for_blocks(source: Any, count: int, timeout_s: float) -> None:
    """Until the daemon's status counts ``count`` blocks (the clients' first snapshots are
    queued), or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = source.status()
        if answer is not None and len(answer[1]) >= count:
            return
        time.sleep(0.5)


def _status_rpcs(source: Any, seconds: float) -> list[float]:
    """Latencies of one Status RPC (the first page) called back to back for ``seconds``. A
    call past its deadline (the source's ``status_timeout_s``) counts as the time it took, so a
    daemon too busy to answer in time shows in the p99 instead of ending the run."""
    from asteria_server.errors import ResultTimeoutError

    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        with contextlib.suppress(ResultTimeoutError):
            source.status_page()
        latencies.append(time.perf_counter() - start)
    return latencies


def tenant_max_blocks(cfg: BlocksConfig, n: int) -> int:
    """The daemon's block quota for a run: the default (100,000), or what C clients of N
    blocks of one tenant need (said in the report)."""
    return max(DEFAULT_TENANT_MAX_BLOCKS, cfg.clients * n)


def _warm_up(cfg: BlocksConfig, address: str) -> None:
    """A first session of :data:`WARMUP_BLOCKS` blocks, closed again and its blocks forgotten
    (as ``asteria forget`` does, so the status figures count the measured clients' blocks
    only): what the daemon spends once, at its first session (imports, the solver worker's
    first task, threads and their stacks, gRPC's buffers, the handover's first mappings), is
    spent before the baseline of its memory, not charged to the measured blocks."""
    from asteria_client.transport import DaemonConnection
    from asteria_client.transport.daemon import DaemonSource

    job = "warmup"
    source = DaemonSource(address, tenant=TENANT, token="", job=job)
    trainer = SyntheticTrainer(source, Mode.DAEMON, cfg)
    try:
        trainer.load(first_blocks(cfg.model, cfg.max_preconditioner_dim, WARMUP_BLOCKS))
        trainer.step(refresh=True)
        trainer.receive_all(cfg.result_timeout_s)
    finally:
        trainer.runtime.close()
    connection = DaemonConnection(address, tenant=TENANT, token="", job=job)
    try:
        session = connection.open_session()
        connection.close_session(session.session_id, forget_blocks=True)
    finally:
        connection.close()


def _host_result_bytes(source: Any) -> int:
    """Bytes of results the daemon holds in its own memory (its result cache's host tier):
    the payload it holds. Over shared memory that is none: a snapshot lies in the client's
    memfd, and the solver worker writes the result into the client's result segment."""
    answer = source.status()
    if answer is None:
        raise RuntimeError("the daemon did not answer a Status call")
    return int(answer[0].cache_host_bytes)


def measure_daemon(cfg: BlocksConfig, n: int) -> dict[str, Any]:
    blocks = first_blocks(cfg.model, cfg.max_preconditioner_dim, n)
    daemon = DaemonProcess(
        workers=1, extra_args=("--tenant-max-blocks", str(tenant_max_blocks(cfg, n)))
    )
    daemon.start()
    with contextlib.ExitStack() as stack:
        stack.callback(daemon.stop)
        more = stack.enter_context(_clients(daemon.address, cfg, n, cfg.clients - 1))
        return _measure_daemon(cfg, n, blocks, daemon, more)
    raise AssertionError("unreachable")


def _measure_daemon(
    cfg: BlocksConfig,
    n: int,
    blocks: list[tuple[str, int]],
    daemon: DaemonProcess,
    more_clients: Callable[[], None],
) -> dict[str, Any]:
    from asteria_client.transport.daemon import DaemonSource

    _warm_up(cfg, daemon.address)
    time.sleep(0.5)
    base_mem = _proc_status(daemon.pid)
    start = time.perf_counter()
    source = DaemonSource(daemon.address, tenant=TENANT, token="", job="client0", pulls=True)
    open_s = time.perf_counter() - start
    trainer = SyntheticTrainer(source, Mode.DAEMON, cfg)
    try:
        trainer.load(blocks)
        start = time.perf_counter()
        first = trainer.step(refresh=True)
        deadline = time.monotonic() + cfg.result_timeout_s
        while source.registered_blocks() < n and time.monotonic() < deadline:
            time.sleep(0.005)
        register_s = time.perf_counter() - start
        trainer.receive_all(cfg.result_timeout_s)
        _progress(f"daemon N={n}: registered in {register_s:.2f} s; idle steps")
        idle, receiving = _idle_steps(trainer, cfg.idle_steps)
        start = time.perf_counter()
        for _ in range(CREDIT_CALLS):
            source.credit()
        credit_s = (time.perf_counter() - start) / CREDIT_CALLS
        cpu0 = _cpu_s(daemon.pid)
        refresh = [trainer.step(refresh=True)]
        trainer.receive_all(cfg.result_timeout_s)
        refresh.append(trainer.step(refresh=True))
        trainer.receive_all(cfg.result_timeout_s)
        daemon_cpu = (_cpu_s(daemon.pid) - cpu0) / (2 * n)
        time.sleep(0.2)
        mem = _proc_status(daemon.pid)
        # Only the payload the daemon holds in its anonymous memory: results it keeps itself
        # (blocks that went over gRPC). Shared-memory payload is the client's memfd, mapped by
        # the daemon (RssShmem), never in RssAnon: subtracting it hid ~2 x 64 bytes a block.
        payload = _host_result_bytes(source)
        rss_per_block = (mem["RssAnon"] - base_mem["RssAnon"] - payload) / n
        stats = source.stats()
        result: dict[str, Any] = {
            "open_s": open_s,
            "register_s": register_s,
            "first_step_s": first,
            "idle_step": _summary(idle, n),
            "idle_steps_receiving": receiving,
            "refresh_step": _summary(refresh, n),
            "credit_call_s": credit_s,
            "daemon_cpu_per_snapshot_and_result_s": daemon_cpu,
            "daemon_rss_anon_bytes": mem["RssAnon"] - base_mem["RssAnon"],
            "daemon_rss_per_block_bytes": rss_per_block,
            "payload_bytes": payload,
            "daemon_rss_shmem_bytes": mem["RssShmem"] - base_mem["RssShmem"],
            "shm_segments": stats.get("shm_segments"),
            "shm_blocks_refused": stats.get("shm_blocks_refused"),
            "chunked_snapshots": stats.get("chunked_snapshots"),
            "errors": [],
        }
        try:
            one_status = _status_read(daemon.address)
            result["status_1_client"] = {"s": one_status[0], "bytes": one_status[1]}
        except Exception as exc:  # e.g. no descriptor left for a connection: reported
            result["errors"].append(f"asteria status with one client: {exc!r}")
        if cfg.clients > 1:
            _progress(f"daemon N={n}: {cfg.clients - 1} more clients register and train")
            try:
                more_clients()
                _wait_for_blocks(source, cfg.clients * n, cfg.result_timeout_s)
                reads = [_status_read(daemon.address) for _ in range(3)]
                latencies = _status_rpcs(source, cfg.status_rpc_s)
                try:
                    summaries = [_status_summary_read(daemon.address) for _ in range(3)]
                except (RuntimeError, AttributeError) as exc:  # a tree without summaries
                    summaries = []
                    result["errors"].append(f"asteria status summary: {exc!r}")
                try:
                    cli = {
                        "summary_s": [_status_cli(daemon.address) for _ in range(3)],
                        "blocks_json_s": [
                            _status_cli(daemon.address, "--json", "--blocks") for _ in range(3)
                        ],
                    }
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    cli = {}
                    result["errors"].append(f"asteria status as a process: {exc!r}")
            except Exception as exc:  # reported with the figures that were measured
                result["errors"].append(f"{cfg.clients} clients: {exc!r}")
                _progress(f"daemon N={n}: {cfg.clients} clients failed: {exc!r}")
                return result
            result["status_all_clients"] = {
                "clients": cfg.clients,
                "blocks": reads[0][2],
                "median_s": percentile([r[0] for r in reads], 50),
                "bytes": reads[0][1],
            }
            if summaries:
                result["status_summary_all_clients"] = {
                    "blocks": summaries[0][2],
                    "median_s": percentile([r[0] for r in summaries], 50),
                    "bytes": summaries[0][1],
                }
            if cli:
                result["status_cli_all_clients"] = {
                    "summary_median_s": percentile(cli["summary_s"], 50),
                    "blocks_json_median_s": percentile(cli["blocks_json_s"], 50),
                }
            result["status_rpc"] = {
                "calls": len(latencies),
                "p50_s": percentile(latencies, 50),
                "p99_s": percentile(latencies, 99),
                "max_s": max(latencies),
            }
    finally:
        trainer.runtime.close()
    return result


def run_blocks(cfg: BlocksConfig) -> dict[str, Any]:
    torch.set_num_threads(1)
    runs = []
    for n in cfg.blocks:
        run: dict[str, Any] = {"blocks": n}
        for mode in cfg.modes:
            _progress(f"{mode} N={n}: start")
            try:
                measure = measure_embedded if mode == "embedded" else measure_daemon
                run[mode] = measure(cfg, n)
            except Exception as exc:  # one N failing (e.g. out of descriptors) is a figure too
                _progress(f"{mode} N={n}: failed: {exc!r}")
                run[f"{mode}_error"] = repr(exc)
                continue
            idle = run[mode]["idle_step"]["median_s"]
            _progress(f"{mode} N={n}: idle step {idle * 1e3:.2f} ms")
        runs.append(run)
    inv = inventory(cfg.model, cfg.max_preconditioner_dim)
    real_bytes = sum(4 * size * size for _, size in inv)
    return {
        "benchmark": "blocks",
        "quick": cfg.blocks == QUICK_BLOCKS,
        "config": {**asdict(cfg), "flush_denormal": False},
        "inventory": {
            "blocks_per_replica": len(inv),
            "factor_bytes_per_replica": real_bytes,
            "largest_n": max(size for _, size in inv),
        },
        "surrogate": f"every snapshot is a {cfg.surrogate_n}x{cfg.surrogate_n} SPD matrix "
        "(an inverse root, solved by the daemon's worker), not the block's real n x n factor: "
        "the bookkeeping is measured, not LAPACK",
        "runs": runs,
        "targets": targets(runs),
    }


def _ratio(runs: list[dict[str, Any]], mode: str, get: Callable[[dict[str, Any]], float]) -> Any:
    have = [r for r in runs if mode in r]
    if len(have) < 2:
        return None
    first, last = get(have[0][mode]), get(have[-1][mode])
    return last / first if first > 0 else None


def _span(runs: list[dict[str, Any]], mode: str) -> str:
    """The N range a mode's ratios span (a mode that failed at the largest N spans less)."""
    have = [r["blocks"] for r in runs if mode in r]
    return f"N = {have[0]} → {have[-1]}" if have else "no N"


def targets(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, as ratios between the smallest and the largest N of this run."""
    out: dict[str, Any] = {
        "first_n": runs[0]["blocks"],
        "last_n": runs[-1]["blocks"],
    }
    for mode in ("embedded", "daemon"):
        out[f"{mode}_idle_step_growth"] = _ratio(runs, mode, lambda m: m["idle_step"]["median_s"])
        out[f"{mode}_span"] = _span(runs, mode)
    out["daemon_cpu_per_snapshot_growth"] = _ratio(
        runs, "daemon", lambda m: m["daemon_cpu_per_snapshot_and_result_s"]
    )
    last = runs[-1].get("daemon")
    if last is not None:
        out["daemon_rss_per_block_bytes"] = last["daemon_rss_per_block_bytes"]
        if "status_all_clients" in last:
            out["status_all_clients_s"] = last["status_all_clients"]["median_s"]
            out["status_blocks_seen"] = last["status_all_clients"]["blocks"]
            out["status_rpc_p99_s"] = last["status_rpc"]["p99_s"]
        if "status_summary_all_clients" in last:
            out["status_summary_s"] = last["status_summary_all_clients"]["median_s"]
        if "status_cli_all_clients" in last:
            out["status_cli_summary_s"] = last["status_cli_all_clients"]["summary_median_s"]
            out["status_cli_blocks_json_s"] = last["status_cli_all_clients"]["blocks_json_median_s"]
    return out


def _ms(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value * 1e3:.{digits}f}"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e6:.1f}"


def _rows(report: dict[str, Any]) -> list[list[str]]:
    rows = [
        [
            "N",
            "mode",
            "idle step ms",
            "idle µs/block",
            "refresh step ms",
            "refresh µs/block",
            "open+register s",
            "credit() µs",
            "daemon CPU µs/snap+result",
            "daemon RSS B/block",
            "status s (blocks seen)",
            "status KiB",
            "CLI status s (summary / --json --blocks)",
            "Status p99 ms",
        ]
    ]
    for run in report["runs"]:
        for mode in ("embedded", "daemon"):
            m = run.get(mode)
            if m is None:
                if f"{mode}_error" in run:
                    rows.append([str(run["blocks"]), mode, *["fail"] * (len(rows[0]) - 2)])
                continue
            status = m.get("status_all_clients")
            rpc = m.get("status_rpc")
            cli = m.get("status_cli_all_clients")
            cpu = m.get("daemon_cpu_per_snapshot_and_result_s")
            rss = m.get("daemon_rss_per_block_bytes")
            opened = m["open_s"] + m.get("register_s", 0.0)
            rows.append(
                [
                    str(run["blocks"]),
                    mode,
                    _ms(m["idle_step"]["median_s"]),
                    f"{m['idle_step']['per_block_s'] * 1e6:.2f}",
                    _ms(m["refresh_step"]["median_s"], 1),
                    f"{m['refresh_step']['per_block_s'] * 1e6:.1f}",
                    f"{opened:.2f}",
                    _us(m.get("credit_call_s")),
                    "-" if cpu is None else f"{cpu * 1e6:.0f}",
                    "-" if rss is None else f"{rss:.0f}",
                    "-" if status is None else f"{status['median_s']:.2f} ({status['blocks']})",
                    "-" if status is None else f"{status['bytes'] / 1024:.0f}",
                    "-"
                    if cli is None
                    else f"{cli['summary_median_s']:.2f} / {cli['blocks_json_median_s']:.2f}",
                    "-" if rpc is None else _ms(rpc["p99_s"], 1),
                ]
            )
    return rows


def _targets_text(report: dict[str, Any]) -> list[str]:
    t = report["targets"]

    def fmt(value: Any, unit: str = "×") -> str:
        if value is None:
            return "-"
        return f"{value:.2f}{unit}" if unit == "×" else f"{value:.3g} {unit}"

    spans = {m: t.get(f"{m}_span", f"N = {t['first_n']} → {t['last_n']}") for m in MODES}
    return [
        f"- idle step growth: embedded {fmt(t['embedded_idle_step_growth'])} "
        f"({spans['embedded']}), daemon {fmt(t['daemon_idle_step_growth'])} "
        f"({spans['daemon']}) (target ≤ 1.5×)",
        f"- daemon CPU per snapshot + result growth, {spans['daemon']}: "
        f"{fmt(t['daemon_cpu_per_snapshot_growth'])} (target ≤ 1.2×)",
        f"- daemon RSS beyond payload at N = {t['last_n']}: "
        f"{fmt(t.get('daemon_rss_per_block_bytes'), 'B/block')} (target ≤ 2048 B/block; "
        f"RssAnon against its value after a first session of {WARMUP_BLOCKS} blocks, less the "
        "results the daemon holds itself: over shared memory the payload is the client's memfd)",
        f"- `asteria status` of all clients' blocks at N = {t['last_n']}: "
        f"{fmt(t.get('status_summary_s'), 's')} (its default, the summary); with --blocks "
        f"{fmt(t.get('status_all_clients_s'), 's')} over the {t.get('status_blocks_seen', '?')} "
        "blocks the daemon held then (target ≤ 2 s); Status RPC p99 while "
        f"they train: {fmt(t.get('status_rpc_p99_s'), 's')} (target ≤ 0.1 s)",
        "- the same as a user runs it, `asteria status` a process from start to exit: "
        f"{fmt(t.get('status_cli_summary_s'), 's')} (summary, text); --json --blocks "
        f"{fmt(t.get('status_cli_blocks_json_s'), 's')} (target ≤ 2 s)",
    ]


def _get(run: dict[str, Any] | None, mode: str, *path: str) -> Any:
    value: Any = None if run is None else run.get(mode)
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


#: The columns of the before/after table: the figure's path in a mode's report, its scale and
#: decimals, and whether only a daemon has it.
_COMPARED: tuple[tuple[tuple[str, ...], float, int, bool], ...] = (
    (("idle_step", "median_s"), 1e3, 2, False),
    (("refresh_step", "per_block_s"), 1e6, 1, False),
    (("daemon_cpu_per_snapshot_and_result_s",), 1e6, 0, True),
    (("daemon_rss_per_block_bytes",), 1, 0, True),
    (("status_all_clients", "median_s"), 1, 2, True),
    (("status_cli_all_clients", "summary_median_s"), 1, 2, True),
    (("status_cli_all_clients", "blocks_json_median_s"), 1, 2, True),
    (("status_rpc", "p99_s"), 1e3, 1, True),
)


def _comparison_rows(report: dict[str, Any]) -> list[list[str]]:
    """Before (``--before``) and after side by side, per N and mode."""
    before = {r["blocks"]: r for r in report["before"]["runs"]}
    rows = [
        [
            "N",
            "mode",
            "idle step ms before → after",
            "refresh µs/block before → after",
            "daemon CPU µs/snap+result",
            "daemon RSS B/block",
            "status C×N s",
            "CLI status s",
            "CLI status --json --blocks s",
            "Status p99 ms",
        ]
    ]

    def pair(old: Any, new: Any, scale: float, digits: int) -> str:
        def one(v: Any) -> str:
            return "n/a" if v is None else f"{v * scale:.{digits}f}"

        return f"{one(old)} → {one(new)}"

    for run in report["runs"]:
        n = run["blocks"]
        old = before.get(n)
        for mode in ("embedded", "daemon"):
            if mode not in run and (old is None or mode not in old):
                continue
            cells = [
                "-"
                if daemon_only and mode == "embedded"
                else pair(_get(old, mode, *path), _get(run, mode, *path), scale, digits)
                for path, scale, digits, daemon_only in _COMPARED
            ]
            rows.append([str(n), mode, *cells])
    return rows


def _errors(report: dict[str, Any]) -> list[str]:
    out = []
    for run in report["runs"]:
        for mode in ("embedded", "daemon"):
            if f"{mode}_error" in run:
                out.append(f"- N = {run['blocks']}, {mode}: failed: `{run[f'{mode}_error']}`")
            for error in _get(run, mode, "errors") or []:
                out.append(f"- N = {run['blocks']}, {mode}: `{error}`")
    return out


def format_report(report: dict[str, Any]) -> str:
    lines = [*text_table(_rows(report), align=">"), *_targets_text(report), *_errors(report)]
    if "before" in report:
        lines += ["", "before → after:", *text_table(_comparison_rows(report), align=">")]
    return "\n".join(lines)


def write_figures(report: dict[str, Any], json_path: Path) -> list[Path]:
    runs = report["runs"]
    figures = []
    panels: list[tuple[str, str, Callable[[dict[str, Any]], float | None]]] = [
        (
            "idle",
            "host ms, step that refreshes nothing",
            lambda m: m["idle_step"]["median_s"] * 1e3,
        ),
        ("refresh", "host µs per block, refresh step", _per_block("refresh_step")),
        (
            "daemon-cpu",
            "daemon CPU µs per snapshot + result",
            lambda m: _scaled(m.get("daemon_cpu_per_snapshot_and_result_s"), 1e6),
        ),
        ("daemon-rss", "daemon RSS bytes per block", lambda m: m.get("daemon_rss_per_block_bytes")),
    ]
    for suffix, label, get in panels:
        fig, ax = output.new_figure(6.0, 3.6)
        sets = [("", runs)]
        if "before" in report:
            sets.append((" before", report["before"]["runs"]))
        for tag, some in sets:
            for mode in ("embedded", "daemon"):
                points = [(r["blocks"], get(r[mode])) for r in some if mode in r]
                points = [(n, v) for n, v in points if v is not None]
                if points:
                    style = "--" if tag else "-"
                    ax.plot(*zip(*points, strict=True), style, marker="o", label=mode + tag)
        ax.set_xscale("log")
        ax.set_xlabel("blocks per client (N)")
        ax.set_ylabel(label)
        ax.legend()
        figures.append(output.save_figure(fig, output.figure_path(json_path, suffix)))
    return figures


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _per_block(key: str) -> Callable[[dict[str, Any]], float]:
    return lambda m: m[key]["per_block_s"] * 1e6


def report_section(report: dict[str, Any]) -> str:
    """The section of docs/benchmarks.md (``asteria bench report``)."""
    cfg, inv = report["config"], report["inventory"]
    rows = _rows(report)
    lines = [
        f"A synthetic block inventory from {cfg['model']}'s weight shapes at "
        f"max_preconditioner_dim {cfg['max_preconditioner_dim']} ({inv['blocks_per_replica']} "
        f"blocks per replica, {inv['factor_bytes_per_replica'] / 2**30:.1f} GiB of fp32 "
        "factors), the first N blocks (repeated as shards beyond that) driven through the real "
        "runtime and source as an optimizer drives them, the optimizer's math left out; "
        f"{report['surrogate']}. One measured client; for the status columns "
        f"{cfg['clients'] - 1} more client processes (one tenant) register N blocks each and "
        f"train; the daemon's tenant_max_blocks is raised to C × N where that passes the "
        f"default {DEFAULT_TENANT_MAX_BLOCKS:,}.",
        "",
        *markdown_table(rows[0], rows[1:], align=">"),
        "",
        "Targets, as ratios from this run:",
        "",
        *_targets_text(report),
        *_errors(report),
        "",
        "Columns: idle step: the training thread's time in the runtime and source for a step "
        "that refreshes nothing and receives nothing (median; with its 130 hook signals); "
        "refresh step: a step that "
        "snapshots every block; open+register: source construction and until the daemon "
        "holds every block; credit(): one call of the daemon source's credit (what the "
        "continuous schedule asks at every pull); daemon CPU: the daemon's main process (not "
        "its solver worker) per "
        "snapshot received and result delivered; daemon RSS: the daemon's anonymous memory "
        "(RssAnon) per block once every block was solved and delivered, against its RssAnon "
        f"after a first session of {WARMUP_BLOCKS} blocks (its one-off costs: imports, threads, "
        "gRPC buffers, first mappings), less the results it holds in its own memory (none over "
        "shared memory, where the payload is the client's memfd, RssShmem); status: "
        "`asteria status --json` over all pages of every client's blocks "
        "(seconds, the blocks the daemon held by then, size); Status p99: one Status RPC, "
        "called back to back while the clients train.",
    ]
    before = report.get("before")
    if before is not None:
        compared = _comparison_rows(report)
        lines += [
            "",
            f"**Before and after.** The same benchmark on the code before this change "
            f"(`{before.get('code', 'main')}`), run just before it on this host "
            f"({before['machine']['date']}):",
            "",
            *markdown_table(compared[0], compared[1:], align=">"),
            "",
            "Before, the targets stood at:",
            "",
            *_targets_text(before),
            *_errors(before),
        ]
    for figure in report.get("figures", []):
        lines += ["", f"![{Path(figure).stem}]({figure})"]
    return "\n".join(lines)


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def register(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "blocks",
        help="bookkeeping cost per block from 100 to 20,000 blocks (client, daemon, status)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-7b")
    parser.add_argument("--max-preconditioner-dim", type=int, default=2048, metavar="D")
    parser.add_argument(
        "--blocks",
        type=_counts,
        metavar="N,N,...",
        help=f"blocks per client (default {','.join(map(str, DEFAULT_BLOCKS))})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"N = {','.join(map(str, QUICK_BLOCKS))}, 2 clients, fewer steps",
    )
    parser.add_argument("--clients", type=int, metavar="C", help=f"default {DEFAULT_CLIENTS}")
    parser.add_argument(
        "--surrogate-n",
        type=int,
        default=4,
        metavar="S",
        help="solve an SxS surrogate instead of each block's real factor (cheap solves)",
    )
    parser.add_argument("--modes", default="embedded,daemon", help="embedded,daemon")
    parser.add_argument("--idle-steps", type=int, default=20, metavar="K")
    parser.add_argument(
        "--before",
        type=Path,
        metavar="PATH",
        help="a report of this benchmark on older code: shown side by side with this run",
    )
    parser.add_argument(
        "--code",
        default="",
        help="what code this run measures (a commit), written into the report",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the full report here")
    return run_command


def run_command(args: argparse.Namespace) -> int:
    cfg = BlocksConfig(
        model=args.model,
        max_preconditioner_dim=args.max_preconditioner_dim,
        blocks=args.blocks or (QUICK_BLOCKS if args.quick else DEFAULT_BLOCKS),
        clients=args.clients or (2 if args.quick else DEFAULT_CLIENTS),
        surrogate_n=args.surrogate_n,
        idle_steps=5 if args.quick else args.idle_steps,
        modes=tuple(args.modes.split(",")),
        status_rpc_s=1.0 if args.quick else 5.0,
    )
    report = run_blocks(cfg)
    if args.code:
        report["code"] = args.code
    if args.before is not None:
        report["before"] = json.loads(args.before.read_text())
    output.publish(report, format_report(report), args.json, write_figures)
    return 0
