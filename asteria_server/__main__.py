"""`asteria-server`: the per-node preconditioner daemon.

The daemon (gRPC service over the engine) is not built yet; until it is, this entry point explains
what it will be and exits with a clear status instead of pretending to serve.
"""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Asteria's per-node preconditioner daemon. Training processes on this node stream Kronecker factor
snapshots to it; it computes inverse roots and eigenbases on host CPU cores and serves the results
back within each block's staleness budget.

NOT BUILT YET: the daemon service is tracked as its own issue. Until then, Asteria's optimizers run
their preconditioner work natively (mode="native") or in the embedded engine.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asteria-server",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--listen",
        metavar="ADDR",
        help="where to listen: unix:///path/to.sock (default) or HOST:PORT (not built yet)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    print(
        "asteria-server: the daemon is not built yet; run training with mode='native' "
        "or the embedded engine. See `asteria-server --help`.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
