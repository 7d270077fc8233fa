"""In-process cost of a status read with a long queue (issue 27): one Status page of columns
(``PreconditionerEngine.status_table``, the engine's own code on a coordinator holding Q queued
snapshots), the summary of them all (``status_summary``, ``asteria status``'s default) and the
writing of ``asteria status --json --blocks`` for R rows.

Runs against whichever asteria is importable (``PYTHONPATH=<old checkout>`` for a before
figure), so it calls only what both versions have. No daemon, no workers: the queue stays full.

    python scripts/status_cost.py --queued 160000 --tenants 1 --rows 160000
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from asteria_client import status as status_module
from asteria_server.engine.coordinator import Coordinator
from asteria_server.engine.engine import PreconditionerEngine
from asteria_server.engine.scheduler import CostModel
from asteria_server.protocol import convert
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.types import (
    BlockState,
    BlockStatus,
    BlockTable,
    EngineStats,
    SolveKind,
    SolveTask,
    TransportStats,
)


class TimedLock:
    """A lock that keeps how long each hold lasted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holds: list[float] = []
        self._since = 0.0

    def __enter__(self) -> None:
        self._lock.acquire()
        self._since = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.holds.append(time.perf_counter() - self._since)
        self._lock.release()


def queued_engine(queued: int, tenants: int) -> tuple[Any, TimedLock]:
    """The parts of an engine ``status_table`` reads, with ``queued`` snapshots waiting."""
    coord = Coordinator(cost_model=CostModel())
    rng = np.random.default_rng(0)
    eyes = [np.eye(n, dtype=np.float32) for n in (2, 3, 4)]
    for i in range(queued):
        tenant = f"t{i % tenants}"
        task = SolveTask(
            block=f"model.layers.{i // 7}.proj{i % 7}.weight.L",
            version=int(rng.integers(1, 100)),
            kind=SolveKind.INVERSE_ROOT,
            matrix=eyes[i % 3],
            tenant=tenant,
            deadline=float(rng.integers(0, 1000)),
        )
        coord.submit(task, f"job{i % 8}")
    lock = TimedLock()
    # an old engine reads tier, a newer one tiers, and one with a tally the spilled blocks
    tiers = SimpleNamespace(tier=None, tiers=None, spilled_keys=tuple)
    return SimpleNamespace(_cond=lock, _coord=coord, _tiers=tiers), lock


def time_pages(engine: Any, lock: TimedLock, repeats: int) -> dict[str, float]:
    seconds = []
    for _ in range(repeats):
        lock.holds.clear()
        t0 = time.perf_counter()
        out = PreconditionerEngine.status_table(engine, "t0", "", 5001)
        seconds.append(time.perf_counter() - t0)
        assert out[0].columns["queue_position"][0] is not None
    return {
        "page_s_median": statistics.median(seconds),
        "page_s_max": max(seconds),
        "lock_hold_s_max": max(lock.holds),
        "lock_holds_per_page": len(lock.holds),
    }


def time_full_read(engine: Any, page: int = 5000) -> dict[str, float]:
    """Every page of tenant t0 as the servicer builds it and the client reads it (columns to
    protobuf bytes and back, into one table): ``asteria status --blocks`` but for gRPC. An old
    engine's later pages reuse its first page's queue order, as its servicer did."""
    t0 = time.perf_counter()
    after, kept, table, pages = "", None, BlockTable("t0"), 0
    while True:
        args = (engine, "t0", after, page + 1) + ((kept,) if kept is not None else ())
        out = PreconditionerEngine.status_table(*args)
        if len(out) == 3:
            kept = out[2]
        shown = out[0].head(page) if len(out[0]) > page else out[0]
        wire = convert.block_table_to_proto(shown).SerializeToString()
        table.extend(convert.block_table_from_proto(pb.BlockColumns.FromString(wire)))
        pages += 1
        if len(out[0]) <= page:
            break
        after = shown.columns["block"][-1]
    return {"read_all_pages_s": time.perf_counter() - t0, "pages": pages, "blocks": len(table)}


def time_summary(engine: Any, lock: TimedLock, repeats: int) -> dict[str, float]:
    """``asteria status``'s default read: the daemon adding up every block of tenant t0."""
    seconds = []
    for _ in range(repeats):
        lock.holds.clear()
        t0 = time.perf_counter()
        summary = PreconditionerEngine.status_summary(engine, "t0")
        seconds.append(time.perf_counter() - t0)
        assert summary.blocks > 0
    return {
        "summary_s_median": statistics.median(seconds),
        "summary_s_max": max(seconds),
        "lock_hold_s_max": max(lock.holds),
        "lock_holds": len(lock.holds),
    }


def rows_table(rows: int) -> BlockTable:
    blocks = [
        BlockStatus(
            tenant="local",
            block=f"model.layers.{i // 7}.mlp.proj{i % 7}.weight.L",
            version=i % 90,
            submitted_version=i % 90 + 2,
            in_flight_version=i % 90 + 2,
            queued_version=i % 90 + 2,
            running_version=-1,
            delivered_version=i % 90,
            staleness_steps=2,
            age_s=0.001 * i,
            submitted_age_s=0.0003 * i,
            delivered_age_s=0.002 * i,
            last_solve_s=1.7e-4,
            failures=0,
            consecutive_failures=0,
            duplicates=i % 3,
            stale_ignored=0,
            superseded=i % 5,
            state=BlockState.QUEUED,
            last_error=None,
            queue_position=i,
            tier="shm",
        )
        for i in range(rows)
    ]
    return BlockTable.of("local", blocks)


def time_json(rows: int, repeats: int) -> dict[str, float]:
    table = rows_table(rows)
    stats = EngineStats(
        incarnation_id="x", uptime_s=1.0, num_workers=1, workers_busy=0, workers_idle=1,
        worker_restarts=0, queue_depth=0, blocks=rows, solves_done=0, solves_failed=0,
        results_discarded=0, seconds_per_n3=1e-10, closed=False, broken_reason=None,
    )  # fmt: skip
    out: dict[str, float] = {}
    with open(os.devnull, "w") as sink:
        seconds = []
        for _ in range(repeats):  # the old way: a dict per row, one json.dumps, one print
            t0 = time.perf_counter()
            document = status_module.status_document("a", stats, table, TransportStats(), [])
            document["peer_groups"] = []
            print(json.dumps(document), file=sink, flush=True)
            seconds.append(time.perf_counter() - t0)
        out["dict_per_row_s"] = statistics.median(seconds)
        out["bytes"] = len(json.dumps(document))
        writer = getattr(status_module, "write_status_json", None)
        if writer is not None:
            seconds = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                head = status_module.status_document("a", stats, [], TransportStats(), [])
                head["peer_groups"] = []
                writer(sink, head, table)
                print(file=sink, flush=True)
                seconds.append(time.perf_counter() - t0)
            out["columns_writer_s"] = statistics.median(seconds)
            text = io.StringIO()
            writer(text, head, table)
            assert text.getvalue() == json.dumps(document), "the writer's text differs"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=160_000)
    parser.add_argument("--tenants", type=int, default=1)
    parser.add_argument("--rows", type=int, default=160_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    report: dict[str, Any] = {"queued": args.queued, "tenants": args.tenants, "rows": args.rows}
    if args.queued:
        engine, lock = queued_engine(args.queued, args.tenants)
        report["page"] = time_pages(engine, lock, args.repeats)
        report["full_read"] = time_full_read(engine)
        report["summary"] = time_summary(engine, lock, args.repeats)
    if args.rows:
        report["json"] = time_json(args.rows, args.repeats)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
