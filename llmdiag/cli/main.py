"""``llmdiag`` command line: global options and subcommand dispatch.

Each subcommand lives in its own module under :mod:`llmdiag.cli` and exposes
``register(subparsers)``, which adds its parser and sets ``handler`` to a
function ``handler(args, config) -> int`` (the exit code). Only commands that
work are registered, so ``--help`` lists exactly what exists.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from llmdiag import __version__
from llmdiag.config import ConfigError, load_config

#: Subcommand modules, in the order ``--help`` lists them.
COMMAND_MODULES = (
    "llmdiag.cli.doctor",
    "llmdiag.cli.collect",
    "llmdiag.cli.diagnose",
    "llmdiag.cli.scrape",
    "llmdiag.cli.bench",
    "llmdiag.cli.fake_engine",
    "llmdiag.cli.demo",
    "llmdiag.cli.top",
)


#: Exit code for a usage mistake (sysexits.h EX_USAGE). argparse's own 2 would read as
#: "critical" from `diagnose` and `demo`, whose 1 and 2 mean warning and critical.
EX_USAGE = 64


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EX_USAGE, f"{self.prog}: error: {message}\n")


def positive_seconds(text: str) -> float:
    """argparse type: a finite number > 0 (durations, intervals, rates)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="llmdiag",
        description=(
            "Find hidden overload on LLM-inference GPU hosts (full KV cache, climbing TTFT, "
            "client cancels, TIME_WAIT pile-ups, GPU throttling/XIDs) and feed it back into routing."
        ),
    )
    parser.add_argument("--version", action="version", version=f"llmdiag {__version__}")
    parser.add_argument("--config", metavar="FILE", help="TOML config file (every key has a default)")
    parser.add_argument(
        "--backend",
        metavar="URL",
        action="append",
        default=[],
        help="backend to watch, http://host:port or grpc://host:port (repeatable; replaces [[backends]] from the config)",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(sub)
    return parser


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not getattr(args, "handler", None):
        parser.print_help()
        return EX_USAGE
    try:
        config = load_config(args.config).with_backends(args.backend)
    except ConfigError as exc:
        print(f"llmdiag: {exc}", file=sys.stderr)
        return EX_USAGE
    # SIGTERM (kubectl delete, timeout, systemd) stops like Ctrl-C, so every command's
    # `finally` runs: BPF programs detached, threads joined, the terminal restored.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return int(args.handler(args, config) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
