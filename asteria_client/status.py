"""`asteria status`: what a daemon is doing, as a table, one JSON document, or refreshed live.

It opens a session as the given tenant (``--tenant``/``--token`` or ``ASTERIA_TENANT``/
``ASTERIA_TOKEN``), so it shows that tenant's blocks, with the daemon-wide numbers: incarnation,
uptime, workers busy and idle, queue depth. An unreachable daemon is one line on stderr and exit
code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from asteria_client.argtypes import positive_seconds
from asteria_client.config import client_env, resolve_address
from asteria_client.transport.connection import DaemonClientConfig, DaemonConnection
from asteria_server.errors import AsteriaError, InvalidInputError
from asteria_server.types import BlockStatus, EngineStats, TransportStats

if TYPE_CHECKING:
    from asteria_client.cli import ArgumentParser, Handler

STATUS_DESCRIPTION = """\
Show a daemon's incarnation, uptime, workers and queue, and one row per block of your tenant:
versions submitted / computed / delivered, staleness in steps and seconds, queue position, last
solve time, failures and state.

example:
  asteria status --address unix:///run/user/1000/asteria/asteria.sock
  ASTERIA_ADDRESS=unix:///tmp/asteria.sock asteria status --watch 1
  asteria status --json | jq '.blocks[] | select(.state == "failed")'
"""

#: Seconds between refreshes of ``--watch`` without a value.
DEFAULT_WATCH_S = 2.0
#: Deadline of each call status makes.
CALL_TIMEOUT_S = 5.0
_JOB = "asteria-status"


def status_document(
    address: str,
    stats: EngineStats,
    blocks: list[BlockStatus],
    transport: TransportStats | None = None,
) -> dict[str, Any]:
    """The JSON document of ``asteria status --json``."""
    rows = []
    for block in sorted(blocks, key=lambda b: (b.tenant, b.block)):
        row = block.to_dict()
        row["staleness_s"] = block.age_s
        rows.append(row)
    return {
        "address": address,
        "incarnation_id": stats.incarnation_id,
        "uptime_s": stats.uptime_s,
        "workers": {
            "total": stats.num_workers,
            "busy": stats.workers_busy,
            "idle": stats.workers_idle,
            "restarts": stats.worker_restarts,
        },
        "queue_depth": stats.queue_depth,
        "solves_done": stats.solves_done,
        "solves_failed": stats.solves_failed,
        "results_discarded": stats.results_discarded,
        "closed": stats.closed,
        "broken_reason": stats.broken_reason,
        "transport": None if transport is None else transport.to_dict(),
        "blocks": rows,
    }


def _version(v: int) -> str:
    return "-" if v < 0 else str(v)


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f}ms" if s < 1 else f"{s:.1f}s"


_COLUMNS = (
    "BLOCK",
    "SUBMITTED",
    "COMPUTED",
    "DELIVERED",
    "STALE_STEPS",
    "STALE_S",
    "QUEUE",
    "LAST_SOLVE",
    "FAILURES",
    "STATE",
)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def format_table(
    address: str,
    stats: EngineStats,
    blocks: list[BlockStatus],
    transport: TransportStats | None = None,
) -> str:
    """The human-readable report: the summary lines, then one row per block."""
    lines = [
        f"daemon {address}  incarnation {stats.incarnation_id}  uptime {stats.uptime_s:.1f} s"
        + ("  (shutting down)" if stats.closed else ""),
        f"workers {stats.num_workers}: {stats.workers_busy} busy, {stats.workers_idle} idle, "
        f"{stats.worker_restarts} restarted; queue depth {stats.queue_depth}; "
        f"solves {stats.solves_done} done, {stats.solves_failed} failed",
    ]
    if transport is not None:
        t = transport
        lines.append(
            f"shared memory: {t.shm_connections} clients, {t.shm_segments} segments "
            f"({_mib(t.shm_mapped_bytes)}); uploads: {_mib(t.upload_bytes_in_flight)} of "
            f"{_mib(t.upload_budget_bytes)} in flight, {t.uploads_waiting} waiting"
        )
    if stats.broken_reason:
        lines.append(f"BROKEN: {stats.broken_reason}")
    if not blocks:
        lines.append("no blocks for this tenant")
        return "\n".join(lines)
    rows = [list(_COLUMNS)]
    for b in sorted(blocks, key=lambda b: (b.tenant, b.block)):
        rows.append(
            [
                b.block,
                _version(b.submitted_version),
                _version(b.version),
                _version(b.delivered_version),
                str(b.staleness_steps),
                _seconds(b.age_s),
                "-" if b.queue_position is None else str(b.queue_position),
                _seconds(b.last_solve_s),
                str(b.failures),
                b.state.value,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines.append("")
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


class StatusReader:
    """One connection and session, reopened when the daemon restarts."""

    def __init__(self, address: str, tenant: str, token: str) -> None:
        config = DaemonClientConfig(call_timeout_s=CALL_TIMEOUT_S, status_timeout_s=CALL_TIMEOUT_S)
        self.address = address
        self._conn = DaemonConnection(address, tenant=tenant, token=token, job=_JOB, config=config)
        self._session_id: str | None = None

    def read(self) -> tuple[EngineStats, list[BlockStatus], TransportStats | None]:
        """Raises an AsteriaError when the daemon cannot be reached or refuses the tenant."""
        for attempt in range(2):
            if self._session_id is None:
                self._session_id = self._conn.open_session().session_id
            try:
                return self._conn.status_report(self._session_id)
            except AsteriaError:
                self._session_id = None  # e.g. the daemon restarted: one new session, once
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._session_id is not None:
            with contextlib.suppress(AsteriaError):
                self._conn.close_session(self._session_id)
        self._conn.close()


def register_status(subparsers: argparse._SubParsersAction[ArgumentParser]) -> Handler:
    parser = subparsers.add_parser(
        "status",
        help="show a daemon's workers, queue and blocks",
        description=STATUS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--address",
        help="the daemon: unix:///path/asteria.sock or host:port (default: $ASTERIA_ADDRESS)",
    )
    parser.add_argument("--tenant", help="tenant to show (default: $ASTERIA_TENANT, or none)")
    parser.add_argument(
        "--token", help="the tenant's token (default: $ASTERIA_TOKEN; prefer the variable)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--watch",
        nargs="?",
        const=DEFAULT_WATCH_S,
        type=positive_seconds,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C",
    )
    return run_status


def run_status(args: argparse.Namespace) -> int:
    from asteria_client.cli import EXIT_FAILED, EXIT_OK, PROG, UsageError

    env = client_env()
    try:
        address = resolve_address(args.address)
    except InvalidInputError:
        raise UsageError(
            f"{PROG} status: error: no daemon address: pass --address or set ASTERIA_ADDRESS"
        ) from None
    tenant = env.tenant if args.tenant is None else args.tenant
    token = env.token if args.token is None else args.token
    reader = StatusReader(address, tenant, token)
    first = True
    try:
        while True:
            try:
                stats, blocks, transport = reader.read()
            except AsteriaError as exc:
                print(
                    f"{PROG} status: cannot reach the daemon at {address}: {exc}", file=sys.stderr
                )
                if first or args.watch is None:
                    return EXIT_FAILED
            else:
                if args.json:
                    document = status_document(address, stats, blocks, transport)
                    print(json.dumps(document), flush=True)
                else:
                    if args.watch is not None and sys.stdout.isatty():
                        print("\x1b[H\x1b[2J", end="")
                    print(format_table(address, stats, blocks, transport), flush=True)
            first = False
            if args.watch is None:
                return EXIT_OK
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return EXIT_OK  # Ctrl-C is how --watch ends
    finally:
        reader.close()
