"""``asteria forget --job JOB``: drop a finished job's blocks from a daemon.

A daemon keeps every block's newest result after its trainer ends, so that a restarted trainer
warm-starts; a job that is done for good frees them with this command. It opens a session for
the job (as ``--tenant``/``--token`` or ``ASTERIA_TENANT``/``ASTERIA_TOKEN``) and closes it with
``forget_blocks``: the daemon forgets every block of that job in that tenant (versions, queued
snapshots, cached and spilled results). Other jobs and other tenants are untouched.
"""

from __future__ import annotations

import argparse
import sys

from asteria_client.cli.args import EXIT_FAILED, EXIT_OK, PROG, ArgumentParser, Handler, UsageError
from asteria_client.config import client_env, resolve_address
from asteria_client.transport.connection import DaemonConnection
from asteria_server.errors import AsteriaError, InvalidInputError

FORGET_DESCRIPTION = """\
Forget every block of one job on a daemon: their versions, queued snapshots and cached or
spilled results. Use it when a job is finished for good; a job that restarts later simply
submits again. Example:

  asteria forget --job my-run-17 --address unix:///run/user/1000/asteria/asteria.sock
"""


def register(subparsers: argparse._SubParsersAction[ArgumentParser]) -> Handler:
    parser = subparsers.add_parser(
        "forget",
        help="drop a job's blocks and results from a daemon",
        description=FORGET_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--job", required=True, help="the job whose blocks to forget")
    parser.add_argument(
        "--address",
        help="the daemon: unix:///path/asteria.sock or host:port (default: $ASTERIA_ADDRESS)",
    )
    parser.add_argument("--tenant", help="the job's tenant (default: $ASTERIA_TENANT, or none)")
    parser.add_argument(
        "--token", help="the tenant's token (default: $ASTERIA_TOKEN; prefer the variable)"
    )
    return run


def run(args: argparse.Namespace) -> int:
    env = client_env()
    if not args.job:
        raise UsageError(f"{PROG} forget: error: --job must name a job")
    try:
        address = resolve_address(args.address)
    except InvalidInputError:
        raise UsageError(
            f"{PROG} forget: error: no daemon address: pass --address or set ASTERIA_ADDRESS"
        ) from None
    connection = DaemonConnection(
        address,
        tenant=env.tenant if args.tenant is None else args.tenant,
        token=env.token if args.token is None else args.token,
        job=args.job,
    )
    try:
        session = connection.open_session()
        connection.close_session(session.session_id, forget_blocks=True)
    except AsteriaError as exc:
        print(
            f"{PROG} forget: the daemon at {address} did not forget job {args.job!r}: {exc}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    finally:
        connection.close()
    print(f"forgot job {args.job!r} on {address}")
    return EXIT_OK
