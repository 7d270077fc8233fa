"""``asteria forget --job JOB``: drop a finished job's blocks from a daemon.

A daemon keeps every block's newest result after its trainer ends, so that a restarted trainer
warm-starts; a job that is done for good frees them with this command. It opens a session for
the job (as ``--tenant``/``--token`` or ``ASTERIA_TENANT``/``ASTERIA_TOKEN``) and closes it with
``forget_blocks``: the daemon forgets every block of that job in that tenant (versions, queued
snapshots, cached and spilled results). Other jobs and other tenants are untouched.

For a Slurm epilog (``deploy/slurm/asteria-epilog.sh``) or a Kubernetes ``preStop`` hook:
``--if-running`` makes a daemon that is not there (no socket, nothing answering) a success with
nothing to forget, and ``--timeout-s`` bounds each call, so a hook never hangs or fails a node
for a daemon that is down (the daemon's ``job_ttl_s`` expiry frees the blocks later anyway).
"""

from __future__ import annotations

import argparse
import sys

from asteria_client.cli.args import EXIT_FAILED, EXIT_OK, PROG, ArgumentParser, Handler, UsageError
from asteria_client.config import client_env, resolve_address
from asteria_client.transport.connection import DaemonClientConfig, DaemonConnection
from asteria_server.errors import (
    AsteriaError,
    EngineUnavailableError,
    InvalidInputError,
    ResultTimeoutError,
)

FORGET_DESCRIPTION = """\
Forget every block of one job on a daemon: their versions, queued snapshots and cached or
spilled results. Use it when a job is finished for good; a job that restarts later simply
submits again. Example:

  asteria forget --job my-run-17 --address unix:///run/user/1000/asteria/asteria.sock

In a job epilog, where the daemon may be down: --if-running --timeout-s 10.
"""


#: The one line ``asteria --help`` shows for the command.
HELP = "drop a job's blocks and results from a daemon"


def register(subparsers: argparse._SubParsersAction[ArgumentParser]) -> Handler:
    parser = subparsers.add_parser(
        "forget",
        help=HELP,
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
    parser.add_argument(
        "--if-running",
        action="store_true",
        help="a daemon that is not running (or not answering) is not an error: exit 0",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=10.0,
        metavar="S",
        help="deadline of each call to the daemon (default 10)",
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
    if not args.timeout_s > 0:
        raise UsageError(f"{PROG} forget: error: --timeout-s must be > 0, got {args.timeout_s}")
    connection = DaemonConnection(
        address,
        tenant=env.tenant if args.tenant is None else args.tenant,
        token=env.token if args.token is None else args.token,
        job=args.job,
        config=DaemonClientConfig(call_timeout_s=args.timeout_s),
    )
    try:
        session = connection.open_session()
        connection.close_session(session.session_id, forget_blocks=True)
    except (EngineUnavailableError, ResultTimeoutError) as exc:  # down, or not answering
        if not args.if_running:
            print(
                f"{PROG} forget: the daemon at {address} did not forget job {args.job!r}: {exc}",
                file=sys.stderr,
            )
            return EXIT_FAILED
        print(f"no daemon serves at {address} ({exc}); nothing to forget for job {args.job!r}")
        return EXIT_OK
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
