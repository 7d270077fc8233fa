"""`asteria bench transport`: how fast do snapshots and results move, next to a plain memcpy?

For each matrix size (float32, 1024² to 4096² by default) it measures, interleaved round by
round in one process so drifts of a shared machine fall on all cases alike:

- ``memcpy``: ``numpy.copyto`` of the same bytes into a pre-faulted buffer, the reference;
- ``shm write``: what ``submit`` costs the training thread over shared memory: the copy from the
  factor tensor into the block's segment through a torch view, under the seqlock;
- ``shm submit``: that write plus the announcement (an AnnounceSnapshots call with its header,
  as the daemon source sends it) until the daemon has taken the snapshot and answered;
- ``gRPC submit``: the whole snapshot streamed in 1 MiB chunks until the daemon answered, over
  the Unix socket and over TCP loopback;
- ``shm fetch`` / ``gRPC fetch``: a result of the same size from a new StreamResults call until
  it is in this process's memory (over shared memory: the daemon writes the segment, the client
  copies it out);
- ``gRPC bare bytes (tcp)``: the same bytes in the same 1 MiB chunks to a bare Python gRPC sink
  (``bench.grpc_sink``) with no protobuf: the ceiling of any Python gRPC transport here.

Two real daemons serve it: one on a private Unix socket (shared memory and gRPC), one on
``127.0.0.1`` TCP with a token. Re-submissions repeat version 0 of each block, which the daemon
receives in full and then answers DUPLICATE, so no solve runs while timing. Each block is solved
once before timing so that there is a result to fetch.

Targets (issue: the daemon): shared-memory submit >= 0.8x memcpy (the training thread's cost);
gRPC >= 2 GB/s on loopback.

This process flushes subnormal floats to zero unless --no-flush-denormal, like every benchmark
(the copies timed here do no arithmetic, so it changes nothing measured; it is recorded).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asteria_client.bench import grpc_sink, output
from asteria_client.bench.stats import percentile
from asteria_client.daemon_process import DaemonProcess
from asteria_client.tables import markdown_table
from asteria_client.transport.connection import DaemonConnection, SessionInfo
from asteria_client.transport.shm import HandoverChannel, segments_for
from asteria_server.types import SolveKind, SolveResult, SolveTask

#: What reads a result out of its segment (``DaemonConnection.results(reader=...)``).
ResultReader = Callable[[Any, Any], "list[np.ndarray] | None"]

logger = logging.getLogger(__name__)

SIZES = (1024, 2048, 4096)
QUICK_SIZES = (512, 1024)
SHM_SUBMIT_TARGET = 0.8  # x memcpy
GRPC_TARGET_GBPS = 2.0
SOLVE_TIMEOUT_S = 900.0
CASES = (
    "memcpy",
    "shm write",
    "shm submit",
    "gRPC submit (unix)",
    "gRPC submit (tcp)",
    "shm fetch",
    "gRPC fetch (unix)",
    "gRPC fetch (tcp)",
    "gRPC bare bytes (tcp)",
)


def _progress(message: str) -> None:
    print(f"[bench transport] {message}", file=sys.stderr, flush=True)


def _wait_solved(conn: DaemonConnection, session: SessionInfo, block: str) -> None:
    deadline = time.monotonic() + SOLVE_TIMEOUT_S
    while True:
        _, blocks = conn.status(session.session_id)
        if any(b.block == block and b.version >= 0 for b in blocks):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon did not solve {block} in {SOLVE_TIMEOUT_S:.0f} s")
        time.sleep(0.2)


def _fetch(
    conn: DaemonConnection,
    session: SessionInfo,
    held: dict[str, int],
    reader: ResultReader | None,
) -> SolveResult:
    """One result from a new StreamResults call (the one block not in ``held``)."""
    stream = conn.results(session, held, lambda cancel: None, reader=reader)
    try:
        return next(stream)
    finally:
        stream.close()  # type: ignore[attr-defined]  # a generator: closing cancels the call


def _measure(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each case, the cases interleaved round by round (after a warm-up)."""
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


@dataclass
class _Endpoints:
    """The two daemons' connections and sessions, the handover channel and the bare sink."""

    unix: DaemonConnection
    s_unix: SessionInfo
    tcp: DaemonConnection
    s_tcp: SessionInfo
    channel: HandoverChannel
    bare_upload: Callable[[list[bytes]], object]


def _measure_size(ends: _Endpoints, n: int, repeats: int, held: dict[str, int]) -> dict[str, Any]:
    """All cases for one n x n float32 matrix (its block is solved once first)."""
    _progress(f"n={n}: preparing {n * n * 4 / 2**20:.0f} MiB and one solve per daemon")
    x = np.random.default_rng(n).standard_normal((n, n), dtype=np.float32)
    matrix = (x @ x.T) / np.float32(n) + np.eye(n, dtype=np.float32)
    block = f"bench-transport-{n}"
    task = SolveTask(block=block, version=0, kind=SolveKind.INVERSE_ROOT, matrix=matrix)
    snap, result_seg = segments_for(task)
    ends.channel.attach(snap)
    ends.channel.attach(result_seg)
    dst = np.zeros_like(matrix)
    raw, size = matrix.reshape(-1).view(np.uint8), ends.s_tcp.max_chunk_bytes
    chunks = [raw[i : i + size].tobytes() for i in range(0, raw.size, size)]  # as gRPC sends it

    def shm_submit() -> None:
        ref = snap.write_snapshot(task)
        (answer,) = ends.unix.announce(ends.s_unix, [(task, ref)])
        if isinstance(answer, Exception):
            raise answer

    def shm_read(ref: Any, want: Any) -> list[np.ndarray] | None:
        return result_seg.read(want, ref.sequence)

    try:
        shm_submit()
        ends.tcp.submit(ends.s_tcp, task)
        _wait_solved(ends.unix, ends.s_unix, block)
        _wait_solved(ends.tcp, ends.s_tcp, block)
        cases: dict[str, Callable[[], object]] = {
            "memcpy": lambda: np.copyto(dst, matrix),
            "shm write": lambda: snap.write_snapshot(task),
            "shm submit": shm_submit,
            "gRPC submit (unix)": lambda: ends.unix.submit(ends.s_unix, task),
            "gRPC submit (tcp)": lambda: ends.tcp.submit(ends.s_tcp, task),
            "shm fetch": lambda: _fetch(ends.unix, ends.s_unix, held, shm_read),
            "gRPC fetch (unix)": lambda: _fetch(ends.unix, ends.s_unix, held, None),
            "gRPC fetch (tcp)": lambda: _fetch(ends.tcp, ends.s_tcp, held, None),
            "gRPC bare bytes (tcp)": lambda: ends.bare_upload(chunks),
        }
        _progress(f"n={n}: timing {len(cases)} cases x {repeats} rounds")
        times = _measure(cases, repeats)
    finally:
        for seg in (snap, result_seg):
            ends.channel.detach(seg)
            seg.close()
    medians = {name: percentile(t, 50) for name, t in times.items()}
    row: dict[str, Any] = {
        "n": n,
        "bytes": matrix.nbytes,
        "median_s": medians,
        "gb_per_s": {k: matrix.nbytes / v / 1e9 for k, v in medians.items()},
        "vs_memcpy": {k: medians["memcpy"] / v for k, v in medians.items()},
        "samples_s": times,
    }
    _progress(
        f"n={n}: shm write {row['vs_memcpy']['shm write']:.2f}x memcpy, "
        f"gRPC tcp {row['gb_per_s']['gRPC submit (tcp)']:.2f} GB/s"
    )
    return row


def run_transport(
    sizes: tuple[int, ...], repeats: int, *, flush_denormal: bool = True
) -> dict[str, Any]:
    from asteria_client.train.cpu import flush_denormal as flushing

    with flushing(flush_denormal):
        return _run_transport(sizes, repeats, flush_denormal)


def _run_transport(sizes: tuple[int, ...], repeats: int, flush_denormal: bool) -> dict[str, Any]:
    token = secrets.token_hex(16)
    tcp_env = {"ASTERIA_TOKENS": f"bench={token}"}
    rows: list[dict[str, Any]] = []
    with (
        DaemonProcess(workers=1) as local,
        DaemonProcess(workers=1, listen="127.0.0.1:0", env=tcp_env) as remote,
        grpc_sink.sink() as bare_upload,
    ):
        unix = DaemonConnection(local.address)
        tcp = DaemonConnection(remote.address, tenant="bench", token=token)
        s_unix, s_tcp = unix.open_session(), tcp.open_session()
        channel = HandoverChannel(s_unix.shm_socket, s_unix.session_id)
        ends = _Endpoints(unix, s_unix, tcp, s_tcp, channel, bare_upload)
        held: dict[str, int] = {}  # blocks measured before: a fetch skips their results
        try:
            for n in sizes:
                rows.append(_measure_size(ends, n, repeats, dict(held)))
                held[f"bench-transport-{n}"] = 0
        finally:
            channel.close()
            unix.close()
            tcp.close()
    worst_shm = min(r["vs_memcpy"]["shm write"] for r in rows)
    worst_grpc = min(r["gb_per_s"]["gRPC submit (tcp)"] for r in rows)
    return {
        "benchmark": "transport",
        "config": {"sizes": list(sizes), "repeats": repeats, "flush_denormal": flush_denormal},
        "sizes": list(sizes),
        "repeats": repeats,
        "rows": rows,
        "targets": {
            "shm_write_vs_memcpy": {"target": SHM_SUBMIT_TARGET, "worst": worst_shm},
            "grpc_tcp_submit_gb_per_s": {"target": GRPC_TARGET_GBPS, "worst": worst_grpc},
        },
    }


def format_table(report: dict[str, Any]) -> str:
    """The markdown table of one report: GB/s and the ratio to memcpy per case and size."""
    runs = report["rows"]
    head = ["case", *(f"{r['n']}² GB/s (× memcpy)" for r in runs)]
    rows = [
        [
            case,
            *(f"{r['gb_per_s'][case]:.2f} ({r['vs_memcpy'][case]:.2f}×)" for r in report["rows"]),
        ]
        for case in CASES
    ]
    return "\n".join(markdown_table(head, rows))


def _verdicts(report: dict[str, Any]) -> list[str]:
    shm = report["targets"]["shm_write_vs_memcpy"]
    grpc = report["targets"]["grpc_tcp_submit_gb_per_s"]
    return [
        f"shared-memory submit (training thread): worst {shm['worst']:.2f}× memcpy, target "
        f"≥ {shm['target']} — {'met' if shm['worst'] >= shm['target'] else 'missed'}",
        f"gRPC submit over TCP loopback: worst {grpc['worst']:.2f} GB/s, target "
        f"≥ {grpc['target']} GB/s — {'met' if grpc['worst'] >= grpc['target'] else 'missed'}",
    ]


def _figure(report: dict[str, Any], path: Path) -> Path:
    fig, ax = output.new_figure(8.0, 4.0)
    rows = report["rows"]
    width = 0.8 / len(rows)
    positions = np.arange(len(CASES))
    for i, row in enumerate(rows):
        values = [row["gb_per_s"][case] for case in CASES]
        ax.bar(positions + i * width, values, width, label=f"{row['n']}²")
    ax.set_xticks(positions + width * (len(rows) - 1) / 2, CASES, rotation=25, ha="right")
    ax.set_ylabel("GB/s (higher is better)")
    ax.set_title("Snapshot submit and result fetch vs memcpy (float32)")
    ax.legend(title="matrix")
    return output.save_figure(fig, path)


def report_section(data: dict[str, Any]) -> str:
    lines = [
        "Median of interleaved rounds; bytes per second of one float32 matrix, and in "
        "parentheses the ratio to a memcpy of the same bytes in the same run.",
        "",
        format_table(data),
        "",
        *(f"- {line}" for line in _verdicts(data)),
    ]
    for figure in data.get("figures", []):
        lines += ["", f"![transport]({figure})"]
    return "\n".join(lines) + "\n"


def register(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "transport",
        help="snapshot submit and result fetch over shared memory and gRPC, vs memcpy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="512² and 1024², 3 rounds")
    parser.add_argument("--sizes", help=f"comma-separated n (default {','.join(map(str, SIZES))})")
    parser.add_argument("--repeats", type=int, help="timed rounds per case (default 7)")
    output.add_flush_denormal_argument(parser, "this process")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the report here")
    return run_command


def run_command(args: argparse.Namespace) -> int:
    if args.sizes:
        try:
            sizes = tuple(int(s) for s in args.sizes.split(","))
        except ValueError:
            raise ValueError(
                f"--sizes must be comma-separated integers, got {args.sizes!r}"
            ) from None
        if any(n < 1 or n > 16384 for n in sizes):
            raise ValueError(f"--sizes must be between 1 and 16384, got {args.sizes!r}")
    else:
        sizes = QUICK_SIZES if args.quick else SIZES
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    report = run_transport(sizes, repeats, flush_denormal=args.flush_denormal)
    report["quick"] = bool(args.quick)
    output.publish(
        report,
        "\n".join([format_table(report), *_verdicts(report)]),
        args.json,
        lambda r, path: [_figure(r, output.figure_path(path, "bars"))],
    )
    return 0
