"""``llmdiag diagnose [--duration S | --replay FILE] [--json]``: a one-shot diagnosis report.

Live, it runs the agent's tick loop (:mod:`llmdiag.agent`: the collectors of
:data:`llmdiag.agent.wiring.COLLECTOR_FACTORIES`, an unavailable one reported as
such) for ``--duration`` seconds at ``agent.interval_seconds``; with ``--replay``
it feeds a recording made by ``llmdiag collect --record FILE`` (JSONL,
optionally gzip) through the same analysis loop. Both report every diagnosis that opened during the run (still open
or closed again), and each backend's penalty and state at the end.

``--json`` prints ``{"verdict", "diagnoses": [...], "backends": {name: {"penalty", "state"}},
"collectors": {name: status}, "first_ts", "last_ts", "snapshots", "source", "interrupted"}``;
each diagnosis is the SPEC 3.3 object plus ``open`` and ``closed_at``. Ctrl-C (or SIGTERM)
during a live run stops it and reports what was seen, then exits 130.
Exit code: 0 healthy (nothing above info), 1 warning, 2 critical; 3 when the
recording cannot be read or holds no snapshot; 64 (EX_USAGE) for a bad option value, so that a
mistake is never read as "critical".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator

from llmdiag.agent import wiring
from llmdiag.agent.wiring import BuildProgress
from llmdiag.agent.loop import AgentLoop, DiagnoseReport, Episode, analyze
from llmdiag.agent.ticker import snapshot_ticks
from llmdiag.cli.main import EX_INTERRUPTED, EX_USAGE
from llmdiag.cli.progress import CollectorProgress
from llmdiag.config import Config
from llmdiag.model import Backend, Snapshot, SnapshotError, read_snapshots

__all__ = ["DiagnoseReport", "Episode", "analyze", "live_snapshots", "register"]


def live_snapshots(
    config: Config,
    duration: float,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    backends: list[Backend] | None = None,
    progress: BuildProgress | None = None,
) -> Iterator[Snapshot]:
    """One snapshot per ``agent.interval_seconds`` for ``duration`` seconds (at least one).

    Collectors are built (and closed at the end) by :func:`llmdiag.agent.wiring.build_collectors`
    for ``backends`` (default: configured, else discovered); with no backends the host-level
    collectors still run. Raises ``ValueError`` for an unknown collector name."""
    if backends is None:
        backends = wiring.resolve_backends(config)
    return snapshot_ticks(config, backends, duration=duration, clock=clock, sleep=sleep, progress=progress)


def _primed(snapshots: Iterator[Snapshot]) -> Iterator[Snapshot]:
    """Start the generator now, so collector set-up errors surface before the report begins."""
    first = next(snapshots)

    def chain() -> Iterator[Snapshot]:
        yield first
        yield from snapshots

    return chain()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diagnose",
        help="diagnose overload on this host (live or from a recording); exit 0 healthy, 1 warning, 2 critical",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="exit codes: 0 healthy (nothing above info), 1 warning, 2 critical, 3 the recording cannot "
               "be read or holds no snapshot, 64 usage mistake, 130 interrupted",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--duration", type=float, default=10.0, metavar="S", help="seconds to watch live (default 10)")
    source.add_argument("--replay", metavar="FILE", help="analyze a recording from `llmdiag collect --record FILE`")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    parser.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace, config: Config) -> int:
    interrupted = False
    if args.replay:
        try:
            report = analyze(read_snapshots(args.replay), AgentLoop(config, config.backend_list()), source=f"replay of {args.replay}")
        except (OSError, SnapshotError, EOFError) as exc:
            print(f"llmdiag diagnose: cannot replay {args.replay}: {exc}", file=sys.stderr)
            return 3
    else:
        if not (math.isfinite(args.duration) and args.duration > 0):
            print("llmdiag diagnose: --duration must be a positive number of seconds", file=sys.stderr)
            return EX_USAGE
        backends = wiring.resolve_backends(config)
        loop = AgentLoop(config, backends)
        try:
            # A spinner per collector on a terminal while they start (BPF compiles take seconds).
            with CollectorProgress() as progress:
                snapshots = _primed(live_snapshots(config, args.duration, backends=backends, progress=progress))
        except ValueError as exc:
            print(f"llmdiag diagnose: {exc}", file=sys.stderr)
            return EX_USAGE
        report, stopped_by = _watch(snapshots, loop, args.duration, spinner=not args.json and sys.stderr.isatty())
        interrupted = stopped_by is not None
    from llmdiag.cli.report import print_report, report_json

    if args.json:
        print(json.dumps(report_json(report, interrupted), indent=2, allow_nan=False))
    else:
        print_report(report, width=args.width)
    # Interrupted: the report of what was seen is out, and the exit code says it was cut short.
    return EX_INTERRUPTED if interrupted else report.exit_code()


def _watch(snapshots: Iterator[Snapshot], loop: AgentLoop, duration: float,
           spinner: bool) -> tuple[DiagnoseReport, str | None]:
    """Analyze live snapshots; the first Ctrl-C/SIGTERM ends the watch early (see
    :mod:`llmdiag.cli.interrupt`). Returns the report and what stopped it (None: the duration)."""
    import contextlib
    import signal

    from llmdiag.cli.interrupt import StopRequest

    started = time.monotonic()
    with StopRequest() as stop, contextlib.ExitStack() as stack:
        if spinner:
            from rich.console import Console

            stack.enter_context(Console(stderr=True).status(f"watching for {duration:g}s (Ctrl-C: stop and report) ..."))
        report = analyze(stop.until_stopped(snapshots), loop, source=f"live, {duration:g}s")
    if stop.signal is None:
        return report, None
    name = "Ctrl-C" if stop.signal == signal.SIGINT else signal.Signals(stop.signal).name
    report.source = f"live, stopped by {name} after {time.monotonic() - started:.3g}s of {duration:g}s"
    return report, name
