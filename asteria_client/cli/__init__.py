"""`asteria`: the command line of Asteria's client, one module per command.

- :mod:`~asteria_client.cli.train`: ``asteria train``, a measured training run;
- :mod:`~asteria_client.cli.bench`: ``asteria bench ...``, the benchmarks and their report;
- :mod:`~asteria_client.cli.status`: ``asteria status``, a daemon's workers and blocks;
- :mod:`~asteria_client.cli.forget`: ``asteria forget --job``, drop a finished job's blocks;
- :mod:`~asteria_client.cli.args`: the parser class, exit codes and argument types they share.

Each command module has ``register(subparsers)``, which adds its parser and returns the function
that runs it; ``SUBCOMMANDS`` lists them.

Exit codes: 0 success, 1 the run failed (for example an optimizer missing from this build, or a
diverged loss), 2 bad input (arguments, config values, an unavailable device), 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from asteria_client.cli import bench, forget, status, train
from asteria_client.cli.args import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    ArgumentParser,
    Handler,
    UsageError,
)
from asteria_server import __version__
from asteria_server.errors import AsteriaError

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "SUBCOMMANDS",
    "ArgumentParser",
    "Handler",
    "UsageError",
    "build_parser",
    "main",
]

Registrar = Callable[["argparse._SubParsersAction[ArgumentParser]"], Handler]

HELPS = {"train": train.HELP, "bench": bench.HELP, "status": status.HELP, "forget": forget.HELP}

SUBCOMMANDS: dict[str, Registrar] = {
    "train": train.register,
    "bench": bench.register,
    "status": status.register,
    "forget": forget.register,
}


def build_parser(command: str | None = None) -> tuple[ArgumentParser, dict[str, Handler]]:
    """The parser of every command and each command's handler. With ``command`` (the one a
    command line names, or "" for none) only that command's parser gets its arguments, the
    others their name and help line: ``train``'s and ``bench``'s import torch to build theirs,
    and ``asteria status`` took ~3 s of a 2-core host before its first call."""
    parser = ArgumentParser(
        prog=PROG,
        description="Asteria: second-order optimizers with their matrix work off the training "
        "step.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=ArgumentParser
    )
    handlers = {
        name: (
            register(subparsers)
            if command in (None, name)
            else _unparsed(subparsers, name, HELPS[name])
        )
        for name, register in SUBCOMMANDS.items()
    }
    return parser, handlers


def _setup_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    logging.getLogger("asteria_client").setLevel(logging.INFO)


def _unparsed(
    subparsers: argparse._SubParsersAction[ArgumentParser], name: str, help: str
) -> Handler:
    """A command listed by ``asteria --help`` whose arguments this command line never reads."""
    parser = subparsers.add_parser(name, help=help)
    return lambda args: _print_usage(parser)


def _print_usage(parser: ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def _command_of(argv: Sequence[str]) -> str:
    """The command ``argv`` names: its first word that is not an option ("" if none; the
    top-level options take no value)."""
    return next((word for word in argv if not word.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    parser, handlers = build_parser(_command_of(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        _setup_logging()
        return handlers[args.command](args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    except AsteriaError as exc:
        code = EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILED
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return code
    except OSError as exc:  # e.g. --json PATH cannot be written
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
