"""``llmdiag`` command line: global options and subcommand dispatch.

Each subcommand lives in its own module under :mod:`llmdiag.cli` and exposes
``register(subparsers)``, which adds its parser and sets ``handler`` to a
function ``handler(args, config) -> int`` (the exit code). Only commands that
work are registered, so ``--help`` lists exactly what exists.

The global options (``--config``, ``--backend``, ``-v``) are accepted before
the command and after it (``llmdiag collect --backend URL --once``).

Exit codes shared by every command: 0 success, 64 (EX_USAGE) a usage
mistake, 130 interrupted (Ctrl-C or SIGTERM). ``diagnose`` and ``demo`` add
1 warning, 2 critical and 3 "the recording cannot be read".
"""

from __future__ import annotations

# Only the standard library is imported at module level: SIGINT/SIGTERM handlers go in
# before the command modules (bcc, aiohttp, rich, ...) are imported, so Ctrl-C or a
# SIGTERM during the first second exits 130 like at any other time, without a traceback.
import argparse
import importlib
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

#: Subcommand modules, in the order ``--help`` lists them.
COMMAND_MODULES = (
    "llmdiag.cli.doctor",
    "llmdiag.cli.collect",
    "llmdiag.cli.diagnose",
    "llmdiag.cli.scrape",
    "llmdiag.cli.bench",
    "llmdiag.cli.fake_engine",
    "llmdiag.cli.gateway",
    "llmdiag.cli.demo",
    "llmdiag.cli.picker",
    "llmdiag.cli.agent",
    "llmdiag.cli.config_cmd",
    "llmdiag.cli.top",
)


#: Exit code for a usage mistake (sysexits.h EX_USAGE). argparse's own 2 would read as
#: "critical" from `diagnose` and `demo`, whose 1 and 2 mean warning and critical.
EX_USAGE = 64
#: Exit code after Ctrl-C or SIGTERM (128 + SIGINT, the shell's convention for Ctrl-C).
EX_INTERRUPTED = 130


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


def name_list(text: str) -> list[str]:
    """argparse type: a comma-separated list of names, at least one (``--collectors a,b``)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"wants at least one name, got {text!r}")
    return names


_BACKEND_HELP = ("backend to watch, http://host:port or grpc://host:port (repeatable; "
                 "replaces [[backends]] from the config)")


def _add_global_options(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """``--config``, ``--backend``, ``-v``: before the command, or after it under other dests.

    After the command they go to ``sub_*`` dests with SUPPRESS defaults, because argparse
    parses a subcommand into a fresh namespace and copies every attribute over the top-level
    one: the same dest would drop ``--backend`` values given before the command."""
    prefix, default = ("sub_", argparse.SUPPRESS) if after_command else ("", None)
    group = parser.add_argument_group("global options (also accepted before the command)") if after_command else parser
    group.add_argument("--config", metavar="FILE", dest=f"{prefix}config", default=default,
                       help="TOML config file (every key has a default; `llmdiag config --default` prints them)")
    group.add_argument("--backend", metavar="URL", action="append", dest=f"{prefix}backend",
                       default=argparse.SUPPRESS if after_command else [], help=_BACKEND_HELP)
    group.add_argument("-v", "--verbose", action="count", dest=f"{prefix}verbose",
                       default=argparse.SUPPRESS if after_command else 0, help="more logging (-vv for debug)")


def _leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers that take options last: commands, and the subcommands of ``bench``."""
    leaves = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for child in dict.fromkeys(action.choices.values()):  # aliases share a parser
                nested = _leaf_parsers(child)
                leaves += nested or [child]
    return leaves


def build_parser() -> argparse.ArgumentParser:
    from llmdiag import __version__  # noqa: PLC0415 - see the import note at the top

    parser = _Parser(
        prog="llmdiag",
        description=(
            "Find hidden overload on LLM-inference GPU hosts (full KV cache, climbing TTFT, "
            "client cancels, TIME_WAIT pile-ups, GPU throttling/XIDs) and feed it back into routing."
        ),
        epilog="Exit codes: 0 ok, 64 usage mistake, 130 interrupted (Ctrl-C, SIGTERM); "
               "diagnose and demo: 1 warning, 2 critical, 3 recording unreadable.",
    )
    parser.add_argument("--version", action="version", version=f"llmdiag {__version__}")
    _add_global_options(parser, after_command=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(sub)
    for leaf in _leaf_parsers(parser):
        _add_global_options(leaf, after_command=True)
    return parser


def _merge_global_options(args: argparse.Namespace) -> None:
    """Fold the options given after the command into the top-level ones."""
    args.backend = list(args.backend) + list(getattr(args, "sub_backend", []))
    args.verbose += getattr(args, "sub_verbose", 0)
    if getattr(args, "sub_config", None) is not None:
        args.config = args.sub_config  # the later one wins, as with any repeated option
    for name in ("sub_backend", "sub_verbose", "sub_config"):
        if hasattr(args, name):
            delattr(args, name)


def _raise_interrupt(signum: int, frame: object) -> None:
    _last_interrupt[0] = signum
    raise KeyboardInterrupt


#: The signal behind the last KeyboardInterrupt raised by _raise_interrupt.
_last_interrupt = [int(signal.SIGINT)]


def _redeliver_dropped_interrupt(unraisable: Any) -> None:
    """``sys.unraisablehook`` while the handlers are in: Python prints and drops an exception raised
    in a weakref callback, a ``__del__`` or a gc callback (the import machinery runs a weakref
    callback, ``_get_module_lock``'s ``cb``, at every import). A signal handled there would be lost
    and a SIGTERM during start-up ignored, so the signal is delivered again once that code has
    returned. Anything else goes to the hook that was there before."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        threading.Timer(0.01, os.kill, (os.getpid(), _last_interrupt[0])).start()
        return
    _previous_unraisablehook(unraisable)


_previous_unraisablehook = sys.unraisablehook


def _install_interrupt_handlers() -> dict[int, object]:
    """SIGINT and SIGTERM (kubectl delete, timeout, systemd) both raise KeyboardInterrupt,
    so every command's ``finally`` runs (BPF programs detached, threads joined, terminal
    restored) and the exit code is 130. Returns the previous handlers."""
    global _previous_unraisablehook  # noqa: PLW0603 - one hook per process, put back by main()
    previous: dict[int, object] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, _raise_interrupt)
        except ValueError:  # not the main thread (main() called from a test thread)
            break
    if previous and sys.unraisablehook is not _redeliver_dropped_interrupt:
        _previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, _redeliver_dropped_interrupt
    return previous


def _restore_interrupt_handlers(previous: dict[int, object]) -> None:
    """Put back what :func:`_install_interrupt_handlers` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]
    if previous and sys.unraisablehook is _redeliver_dropped_interrupt:
        sys.unraisablehook = _previous_unraisablehook


def _stdout_to_devnull() -> None:
    """After EPIPE (``llmdiag collect --json | head -1``), point stdout at /dev/null so the
    interpreter's last flush does not fail again (the recipe in the Python docs, signal module)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a descriptor (captured in tests)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    previous = _install_interrupt_handlers()
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return EX_INTERRUPTED
    except BrokenPipeError:
        _stdout_to_devnull()
        return 0  # the reader stopped reading: what it read was complete
    finally:
        _restore_interrupt_handlers(previous)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _merge_global_options(args)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not getattr(args, "handler", None):
        parser.print_help()
        return EX_USAGE
    from llmdiag.config import ConfigError, load_config  # noqa: PLC0415 - see the import note at the top

    try:
        config = load_config(args.config).with_backends(args.backend)
    except ConfigError as exc:
        print(f"llmdiag: {exc}", file=sys.stderr)
        return EX_USAGE
    return int(args.handler(args, config) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
