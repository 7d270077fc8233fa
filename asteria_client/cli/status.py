"""`asteria status`: what a daemon is doing, as a table, one JSON document, or refreshed live.

It opens a session as the given tenant (``--tenant``/``--token`` or ``ASTERIA_TENANT``/
``ASTERIA_TOKEN``), so it shows that tenant's blocks, with the daemon-wide numbers: incarnation,
uptime, workers busy and idle, queue depth. An unreachable daemon is one line on stderr and exit
code 1. What it reads and how it is shown live in :mod:`asteria_client.status`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

from asteria_client.cli.args import (
    EXIT_FAILED,
    EXIT_OK,
    PROG,
    ArgumentParser,
    Handler,
    UsageError,
    positive_seconds,
)
from asteria_client.config import client_env, resolve_address
from asteria_client.peers_status import format_peers, peers_document
from asteria_client.status import (
    StatusReader,
    format_summary,
    format_table,
    status_document,
    summary_document,
    write_status_json,
    write_status_pages,
)
from asteria_client.transport.connection import RegisteredJob
from asteria_server.errors import AsteriaError, InvalidInputError
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.types import BlockSummary, BlockTable, EngineStats, TransportStats

STATUS_DESCRIPTION = """\
Show a daemon's incarnation, uptime, workers and queue, and what your tenant's blocks add up to:
counts by state and tier, staleness in steps (median, p99, max), failures, and the blocks most
behind. With --blocks, one row per block: versions submitted / computed / delivered, staleness
in steps and seconds, queue position, last solve time, failures and state.

example:
  asteria status --address unix:///run/user/1000/asteria/asteria.sock
  ASTERIA_ADDRESS=unix:///tmp/asteria.sock asteria status --watch 1
  asteria status --json --blocks | jq '.blocks[] | select(.state == "failed")'
"""

#: Seconds between refreshes of ``--watch`` without a value.
DEFAULT_WATCH_S = 2.0


#: The one line ``asteria --help`` shows for the command.
HELP = "show a daemon's workers, queue and blocks"


def register(subparsers: argparse._SubParsersAction[ArgumentParser]) -> Handler:
    parser = subparsers.add_parser(
        "status",
        help=HELP,
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
        "--blocks",
        action="store_true",
        help="every block's row, not the summary (a daemon with 100,000s of blocks: seconds)",
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        const=DEFAULT_WATCH_S,
        type=positive_seconds,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C",
    )
    return run


def run(args: argparse.Namespace) -> int:
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
            if args.json and args.blocks:  # every row: written as the pages arrive
                if not _stream_json(reader, address) and (first or args.watch is None):
                    return EXIT_FAILED
                first = False
                if args.watch is None:
                    return EXIT_OK
                time.sleep(args.watch)
                continue
            try:
                summary, blocks = None, None
                if not args.blocks:
                    stats, summary, transport = reader.read_summary()
                if summary is None:  # asked for, or a daemon that predates summaries
                    stats, blocks, transport = reader.read()
                jobs = reader.jobs()
                peers = reader.peers()
            except AsteriaError as exc:
                print(
                    f"{PROG} status: cannot reach the daemon at {address}: {exc}", file=sys.stderr
                )
                if first or args.watch is None:
                    return EXIT_FAILED
            else:
                if args.json:
                    _print_json(address, stats, summary, blocks, transport, jobs, peers)
                else:
                    if args.watch is not None and sys.stdout.isatty():
                        print("\x1b[H\x1b[2J", end="")
                    if summary is not None:
                        text = format_summary(address, stats, summary, transport, jobs)
                    else:
                        assert blocks is not None  # read() when there is no summary
                        text = format_table(address, stats, blocks, transport, jobs)
                    print(text, flush=True)
                    table = format_peers(peers)
                    if table:
                        print(table, flush=True)
            first = False
            if args.watch is None:
                return EXIT_OK
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return EXIT_OK  # Ctrl-C is how --watch ends
    finally:
        reader.close()


def _stream_json(reader: StatusReader, address: str) -> bool:
    """``--json --blocks``: the document written page by page as the daemon answers (the jobs
    and peer groups are asked for while the second page is built). False, with a line on
    stderr, when the daemon could not be read: before the first page nothing is written; a
    failure after it ends the truncated document with a newline, so a reader sees it fail."""
    pages = reader.read_pages()
    try:
        first_page = next(pages)
    except AsteriaError as exc:
        print(f"{PROG} status: cannot reach the daemon at {address}: {exc}", file=sys.stderr)
        return False
    jobs, peers = reader.jobs(), reader.peers()
    try:
        write_status_pages(
            sys.stdout,
            address,
            itertools.chain([first_page], pages),
            jobs,
            {"peer_groups": peers_document(peers)},
        )
    except AsteriaError as exc:
        print(flush=True)
        print(
            f"{PROG} status: the daemon at {address} stopped answering in the middle of the "
            f"blocks; the document above is cut short: {exc}",
            file=sys.stderr,
        )
        return False
    finally:
        pages.close()
    print(flush=True)
    return True


def _print_json(
    address: str,
    stats: EngineStats,
    summary: BlockSummary | None,
    blocks: BlockTable | None,
    transport: TransportStats | None,
    jobs: list[RegisteredJob],
    peers: ppb.PeerStatusResponse | None,
) -> None:
    """One JSON document on stdout; every block's rows are written from the table's columns, a
    chunk at a time (160,000 blocks: 85 MB that need not be one dict per row first)."""
    if summary is not None:
        document = summary_document(address, stats, summary, transport, jobs)
    else:
        document = status_document(address, stats, [], transport, jobs)
    document["peer_groups"] = peers_document(peers)
    if blocks is None:
        print(json.dumps(document), flush=True)
        return
    write_status_json(sys.stdout, document, blocks)
    print(flush=True)
