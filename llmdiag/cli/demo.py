"""``llmdiag demo``: watch llmdiag find every kind of hidden overload in a fleet of fake engines.

It starts the demo fleet (five fake vLLM engines on 127.0.0.1 behind a naive
round-robin load) and its fault script, from ``--fault-at`` seconds: a client
without connection pooling on vllm-1, KV cache loss plus a throttled GPU on
vllm-2, a slow vllm-3 whose impatient HTTP and gRPC clients cancel, and a
crash with a cold restart of vllm-4 (:mod:`llmdiag.sim.demo_fleet`). It runs
the real collectors and analyzers once a second, feeds the results into the
scoring balancer, and shows a live table. At the end, or on Ctrl-C, it prints
the diagnosis report of what it saw (exit code as ``llmdiag diagnose``: 0
healthy, 1 warning, 2 critical). ``--record FILE`` writes the snapshots for
``llmdiag diagnose --replay FILE`` and ``llmdiag top --replay FILE``.
Everything the demo starts is stopped on exit, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from llmdiag.agent.loop import AgentLoop, AgentState, analyze
from llmdiag.cli.main import EX_USAGE, positive_seconds
from llmdiag.cli.report import print_report
from llmdiag.cli.tui.demo_source import demo_snapshots
from llmdiag.config import Config
from llmdiag.model import Distribution, Snapshot, write_snapshots
from llmdiag.sim.demo_fleet import DemoFleet


def _fmt(value: Any, spec: str = ".2f", unit: str = "") -> str:
    if isinstance(value, Distribution):
        value = value.ewma
    if value is None or not isinstance(value, (int, float)):
        return "-"
    return f"{value:{spec}}{unit}"


def _table(state: AgentState, elapsed: float, fleet: DemoFleet) -> Group:
    snap = state.snapshot
    assert snap is not None
    open_by_backend: dict[str, list[str]] = {}
    for d in state.open:
        open_by_backend.setdefault(d.backend, []).append(f"{d.kind} ({d.severity.value})")
    table = Table(title=f"llmdiag demo: {elapsed:4.0f}s, {fleet.stats.sent} requests sent", expand=True)
    for col in ("backend", "up (/metrics)", "waiting", "running", "KV", "TTFT ewma", "penalty", "score", "weight", "diagnoses"):
        table.add_column(col, overflow="fold")
    for name in sorted(snap.backends):
        s = snap.backends[name]
        st = state.backends.get(name)
        diag = ", ".join(open_by_backend.get(name, [])) or "-"
        up = {1: "up", 0: "down"}.get(s.get("up"), "-")  # type: ignore[call-overload]
        table.add_row(
            name, up, _fmt(s.get("requests_waiting"), ".0f"),
            _fmt(s.get("requests_running"), ".0f"), _fmt(s.get("kv_cache_usage"), ".0%"),
            _fmt(s.get("ttft_seconds"), ".2f", " s"), f"{st.penalty:.2f}" if st else "-",
            f"{st.score:.0f}" if st else "-", f"{st.weight_percent}%" if st else "-",
            Text(diag, style="red" if diag != "-" else "green"),
        )
    statuses = ", ".join(f"{n}: {c.status.value}" for n, c in sorted(snap.collectors.items()))
    clients = ", ".join(f"{k}={v}" for k, v in sorted(fleet.stats.statuses.items())) or "none yet"
    return Group(table, Text(f"collectors: {statuses}\nclient results: {clients}", style="dim"))


def _watch(snapshots: Iterator[Snapshot], loop: AgentLoop, fleet: DemoFleet, live: Live | None,
           record: str | None) -> Iterator[Snapshot]:
    """Record each snapshot and update the table; Ctrl-C (or SIGTERM) ends the run, not the report.

    The caller's analyze() runs each snapshot through ``loop`` before asking for the next."""
    start = time.monotonic()
    try:
        for snap in snapshots:
            if record:
                write_snapshots(record, [snap], append=True)
            yield snap
            if live is not None:
                live.update(_table(loop.state, time.monotonic() - start, fleet))
    except KeyboardInterrupt:
        return  # the report of what was seen still prints


def handle(args: argparse.Namespace, config: Config) -> int:
    if args.fault_at is None:
        # Early enough that a short demo still shows the whole story.
        args.fault_at = min(15.0, args.duration / 4)
    if args.fault_at >= args.duration:
        print(f"llmdiag demo: --fault-at {args.fault_at:g} is not before the end of --duration {args.duration:g}: "
              "the fault would never happen", file=sys.stderr)
        return EX_USAGE
    if args.record:
        try:
            write_snapshots(args.record, [])  # fail now, not after the run; start the file empty
        except OSError as exc:
            print(f"llmdiag demo: cannot write {args.record}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    fleet = DemoFleet(fault_at=args.fault_at, rate_rps=args.rate)
    console = Console()
    console.print(f"starting the demo fleet: {fleet.describe()}; faults from {args.fault_at:g} s: "
                  "vllm-1 churns connections, vllm-2 loses KV and slows, vllm-3 slows and its clients cancel "
                  f"(HTTP and gRPC), vllm-4 crashes at {args.fault_at + 30:g} s")
    fleet.reserve_ports()  # demo_snapshots builds the collectors, then starts the fleet
    live = None
    try:
        loop = AgentLoop(config, fleet.backends())
        live = None if args.no_live or not console.is_terminal else Live(console=console, refresh_per_second=2)
        if live is not None:
            live.start()
        ticks = demo_snapshots(config, fleet, duration=args.duration)
        try:
            report = analyze(_watch(ticks, loop, fleet, live, args.record), loop,
                             source=f"demo fleet, {args.duration:g}s")
        finally:
            ticks.close()
    finally:
        if live is not None:
            live.stop()
        fleet.stop()
    print_report(report)
    final = loop.state.backends
    console.print("routing weights at the end: " + ", ".join(f"{n} {s.weight_percent}%" for n, s in sorted(final.items())))
    clients = "; ".join(f"{name}: " + ", ".join(f"{k}={v}" for k, v in sorted(st.statuses.items()))
                        for name, st in fleet.client_stats.items())
    if clients:
        console.print(f"scripted clients: {clients}")
    if args.record:
        console.print(f"recorded {report.snapshots} snapshots to {args.record} "
                      f"(llmdiag diagnose --replay {args.record}; llmdiag top --replay {args.record})")
    return report.exit_code()


def register(sub: Any) -> None:
    parser = sub.add_parser("demo", help="watch llmdiag catch an overloaded engine in a fleet of fake vLLM engines",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=positive_seconds, default=60.0, metavar="S", help="seconds to run (default 60)")
    parser.add_argument("--rate", type=positive_seconds, default=3.0, metavar="RPS",
                        help="requests per second over the fleet (default 3)")
    parser.add_argument("--fault-at", type=positive_seconds, default=None, metavar="S",
                        help="when the fault script starts (default 15 s, or a quarter of a shorter --duration)")
    parser.add_argument("--no-live", action="store_true", help="no live table, only the final report")
    parser.add_argument("--record", metavar="FILE", help="write the snapshots as JSONL (gzip if FILE ends in .gz)")
    parser.set_defaults(handler=handle)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
