"""`asteria bench`: the benchmarks, each a subcommand that its own module registers."""

from __future__ import annotations

import argparse
import sys

from asteria_client.cli.args import EXIT_USAGE, PROG, ArgumentParser, Handler, UsageError

BENCH_DESCRIPTION = """\
Benchmarks that measure Asteria's claims. Every figure is a ratio of runs taken side by side in
one invocation (shared machines are noisy), never an absolute time to compare across machines.
"""


#: The one line ``asteria --help`` shows for the command.
HELP = (
    "benchmarks (convergence, peers, defaults, spikes, step, transport, throughput, "
    "sharing, soak, scale, blocks) and their report"
)


def register(subparsers: argparse._SubParsersAction[ArgumentParser]) -> Handler:
    from asteria_client.bench import (
        blocks,
        convergence,
        defaults,
        peers,
        report,
        scale,
        sharing,
        soak,
        spikes,
        step,
        throughput,
        transport,
    )

    parser = subparsers.add_parser(
        "bench",
        help=HELP,
        description=BENCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    benches = parser.add_subparsers(dest="bench", metavar="BENCHMARK", parser_class=ArgumentParser)
    handlers: dict[str, Handler] = {
        "convergence": convergence.register(benches),
        "peers": peers.register(benches),
        "defaults": defaults.register(benches),
        "spikes": spikes.register(benches),
        "step": step.register(benches),
        "sharing": sharing.register(benches),
        "scale": scale.register(benches),
        "blocks": blocks.register(benches),
        "soak": soak.register(benches),
        "throughput": throughput.register(benches),
        "transport": transport.register(benches),
        "report": report.register(benches),
    }

    def run(args: argparse.Namespace) -> int:
        if args.bench is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        try:
            return handlers[args.bench](args)
        except ValueError as exc:
            raise UsageError(f"{PROG} bench {args.bench}: error: {exc}") from None

    return run
