"""``llmdiag diagnose [--duration S | --replay FILE] [--json]``: a one-shot diagnosis report.

Live, it runs the collectors of :data:`llmdiag.cli.wiring.COLLECTOR_FACTORIES`
(each wrapped in :class:`~llmdiag.collectors.base.GuardedCollector`; a
factory raising :class:`~llmdiag.cli.wiring.CollectorUnavailable` is reported
as an unavailable collector) for ``--duration`` seconds at
``agent.interval_seconds``; with ``--replay`` it feeds a recording made by
``llmdiag collect --record FILE`` (JSONL, optionally gzip) through the same
analyzer. Both report every diagnosis that opened during the run (still open
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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from llmdiag.analyzers import Analyzer, BackendHealth
from llmdiag.cli.main import EX_INTERRUPTED, EX_USAGE
from llmdiag.config import Config
from llmdiag.model import Backend, CollectorStatus, Diagnosis, Severity, Snapshot, SnapshotError, read_snapshots

__all__ = ["DiagnoseReport", "Episode", "analyze", "live_snapshots", "register"]


@dataclass(frozen=True, slots=True)
class Episode:
    """One diagnosis from opening to closing (or to the end of the run)."""

    diagnosis: Diagnosis
    closed_at: float | None
    enforced: bool

    def to_json(self) -> dict[str, Any]:
        return {**self.diagnosis.to_json(), "open": self.closed_at is None, "closed_at": self.closed_at, "enforced": self.enforced}


@dataclass
class DiagnoseReport:
    episodes: list[Episode] = field(default_factory=list)
    backends: dict[str, BackendHealth] = field(default_factory=dict)
    collectors: dict[str, CollectorStatus] = field(default_factory=dict)
    first_ts: float | None = None
    last_ts: float | None = None
    snapshots: int = 0
    source: str = ""

    @property
    def worst(self) -> Severity | None:
        sev = [e.diagnosis.severity for e in self.episodes]
        return max(sev, key=lambda s: s.rank) if sev else None

    def exit_code(self) -> int:
        worst = self.worst
        if worst is Severity.CRITICAL:
            return 2
        if worst is Severity.WARNING:
            return 1
        return 0

    def to_json(self) -> dict[str, Any]:
        return {
            "diagnoses": [e.to_json() for e in self.episodes],
            "backends": {name: h.to_json() for name, h in sorted(self.backends.items())},
        }


def analyze(snapshots: Iterable[Snapshot], analyzer: Analyzer, source: str = "") -> DiagnoseReport:
    """Run the analyzer over snapshots; collect every episode and the final backend health."""
    report = DiagnoseReport(source=source)
    current: dict[tuple[str, str, float], Diagnosis] = {}
    closed: list[Episode] = []
    for snap in snapshots:
        result = analyzer.observe(snap)
        report.snapshots += 1
        report.first_ts = snap.ts if report.first_ts is None else report.first_ts
        report.last_ts = snap.ts
        report.collectors.update(snap.collectors)
        report.backends = result.backends
        for d in result.closed:
            current.pop((d.kind, d.backend, d.since), None)
            closed.append(Episode(d, result.ts, analyzer.enforced.get(d.kind, True)))
        for d in result.open:
            current[(d.kind, d.backend, d.since)] = d
    episodes = closed + [Episode(d, None, analyzer.enforced.get(d.kind, True)) for d in current.values()]
    episodes.sort(key=lambda e: (e.diagnosis.backend == "host", e.diagnosis.backend, e.diagnosis.since, e.diagnosis.kind))
    report.episodes = episodes
    return report


def live_snapshots(
    config: Config,
    duration: float,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    backends: list[Backend] | None = None,
) -> Iterator[Snapshot]:
    """One snapshot per ``agent.interval_seconds`` for ``duration`` seconds (at least one).

    Collectors are built (and closed at the end) by :func:`llmdiag.cli.wiring.build_collectors`
    for ``backends`` (default: configured, else discovered); with no backends the host-level
    collectors still run. Raises ``ValueError`` for an unknown collector name."""
    from llmdiag.cli.wiring import resolve_backends, snapshot_ticks

    if backends is None:
        backends = resolve_backends(config)
    return snapshot_ticks(config, backends, duration=duration, clock=clock, sleep=sleep)


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
    analyzer = Analyzer(config)
    interrupted = False
    if args.replay:
        try:
            report = analyze(read_snapshots(args.replay), analyzer, source=f"replay of {args.replay}")
        except (OSError, SnapshotError, EOFError) as exc:
            print(f"llmdiag diagnose: cannot replay {args.replay}: {exc}", file=sys.stderr)
            return 3
    else:
        if not (math.isfinite(args.duration) and args.duration > 0):
            print("llmdiag diagnose: --duration must be a positive number of seconds", file=sys.stderr)
            return EX_USAGE
        from llmdiag.cli.wiring import resolve_backends

        backends = resolve_backends(config)
        analyzer = Analyzer(config, backends=backends)
        try:
            snapshots = _primed(live_snapshots(config, args.duration, backends=backends))
        except ValueError as exc:
            print(f"llmdiag diagnose: {exc}", file=sys.stderr)
            return EX_USAGE
        report, stopped_by = _watch(snapshots, analyzer, args.duration, spinner=not args.json and sys.stderr.isatty())
        interrupted = stopped_by is not None
    from llmdiag.cli.report import print_report, report_json

    if args.json:
        print(json.dumps(report_json(report, interrupted), indent=2, allow_nan=False))
    else:
        print_report(report, width=args.width)
    # Interrupted: the report of what was seen is out, and the exit code says it was cut short.
    return EX_INTERRUPTED if interrupted else report.exit_code()


def _watch(snapshots: Iterator[Snapshot], analyzer: Analyzer, duration: float,
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
        report = analyze(stop.until_stopped(snapshots), analyzer, source=f"live, {duration:g}s")
    if stop.signal is None:
        return report, None
    name = "Ctrl-C" if stop.signal == signal.SIGINT else signal.Signals(stop.signal).name
    report.source = f"live, stopped by {name} after {time.monotonic() - started:.3g}s of {duration:g}s"
    return report, name
