"""`asteria-server`: the per-node preconditioner daemon: parse, load config, set up logging, run."""

from __future__ import annotations

import argparse
import logging
import sys

from asteria_server.config import LOG_LEVELS, default_listen, env_name, load_config

DESCRIPTION = """\
Asteria's per-node preconditioner daemon. Training processes on this node stream Kronecker factor
snapshots to it over gRPC; it computes inverse roots and eigenbases in solver worker processes and
streams the results back.

Settings are read from the --config TOML file, then from ASTERIA_* environment variables, then from
these flags (flags win). Every setting has the same name in all three: --chunk-bytes is TOML
`chunk_bytes` and env ASTERIA_CHUNK_BYTES. Tenant tokens come from a TOML [tenants] table
(tenant = "token") or ASTERIA_TOKENS="tenant1=tok1,tenant2=tok2"; without tokens only tenant
"local" with an empty token is accepted, and only on a Unix socket.

Once serving it prints one line: `asteria-server serving on ADDRESS incarnation=ID workers=N`.
SIGTERM or SIGINT shuts it down gracefully (exit status 0).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asteria-server",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--config", metavar="PATH", help="TOML config file (keys: the option names below with _)")
    add(
        "--listen",
        metavar="ADDR",
        help=(
            f"unix:///path/to.sock (default: {default_listen().replace('%', '%%')}; directory "
            "0700, socket 0600, a .lock file beside it) or HOST:PORT for TCP (needs tenant "
            "tokens; beyond loopback also --tls-cert and --tls-key; port 0 picks a free port)"
        ),
    )
    add("--workers", type=int, metavar="N", help="solver worker processes (default: CPUs - 1)")
    add("--blas-threads", type=int, metavar="N", help="BLAS threads per worker (default 1)")
    add("--max-message-bytes", type=int, metavar="B", help="largest gRPC message (default 4 MiB)")
    add("--chunk-bytes", type=int, metavar="B", help="array chunk size of streams (default 1 MiB)")
    add("--max-matrix-n", type=int, metavar="N", help="largest factor dimension (default 16384)")
    add(
        "--grace-period-s",
        type=float,
        metavar="S",
        help="seconds in-flight calls may finish at shutdown (default 10)",
    )
    add("--keepalive-time-s", type=float, metavar="S", help="keepalive ping interval (default 30)")
    add(
        "--keepalive-timeout-s",
        type=float,
        metavar="S",
        help="an unanswered keepalive ping closes the connection after this (default 10)",
    )
    add("--max-sessions", type=int, metavar="N", help="open sessions at most (default 4096)")
    add("--tls-cert", metavar="PEM", help="TLS certificate chain (TCP only)")
    add("--tls-key", metavar="PEM", help="TLS private key of --tls-cert")
    add("--log-level", type=str.upper, choices=LOG_LEVELS, help="log level (default INFO)")
    add("--ready-file", metavar="PATH", help="write the serving line here once ready")
    add(
        "--shared-memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "offer same-host clients the shared-memory transport: a segment-handover socket "
            "<socket>.shm next to a Unix --listen socket (default: on)"
        ),
    )
    add(
        "--max-upload-bytes",
        type=int,
        metavar="B",
        help=(
            "snapshot bytes received at once, all clients together; an upload waits for room, "
            "then fails RESOURCE_EXHAUSTED (default 2 GiB)"
        ),
    )
    add(
        "--upload-wait-s",
        type=float,
        metavar="S",
        help="how long an upload may wait for room in --max-upload-bytes (default 5)",
    )
    add(
        "--max-shm-segments",
        type=int,
        metavar="N",
        help="shared-memory segments one client may hand over (default 4096)",
    )
    parser.epilog = f"Environment: {env_name('<option>')} for any option, and {env_name('tokens')}."
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    config_file = args.pop("config")
    try:
        config = load_config(config_file=config_file, overrides=args)
    except ValueError as exc:
        print(f"asteria-server: invalid configuration: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Imported here so `--help` and config errors stay fast.
    from asteria_server.service.server import StartupError, run

    try:
        return run(config)
    except StartupError as exc:
        print(f"asteria-server: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
