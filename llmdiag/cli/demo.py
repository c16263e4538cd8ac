"""``llmdiag demo``: watch llmdiag find a drowning engine that /health calls healthy.

It starts the demo fleet (three fake vLLM engines on 127.0.0.1 behind a naive
round-robin load; at ``--fault-at`` seconds ``vllm-2`` loses most of its KV
cache and slows down as a throttled GPU would), runs the real collectors and analyzers on it once
a second, feeds the results into the scoring balancer, and shows a live table:
queue, KV usage, TTFT, the penalty, the routing score and weight, and the open
diagnoses. At the end it prints the diagnosis report (exit code as
``llmdiag diagnose``: 0 healthy, 1 warning, 2 critical).
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
from llmdiag.agent.ticker import snapshot_ticks
from llmdiag.cli.main import EX_USAGE, positive_seconds
from llmdiag.cli.report import print_report
from llmdiag.config import Config
from llmdiag.model import Backend, Distribution, Snapshot
from llmdiag.sim.demo_fleet import DemoFleet, default_fleet

#: Collectors the demo runs; the kernel ones report "unavailable" where BPF cannot load.
DEMO_COLLECTORS = ("engine", "proc", "tcp", "timewait")


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
        table.add_row(
            name, "up" if s.get("up") == 1 else "down", _fmt(s.get("requests_waiting"), ".0f"),
            _fmt(s.get("requests_running"), ".0f"), _fmt(s.get("kv_cache_usage"), ".0%"),
            _fmt(s.get("ttft_seconds"), ".2f", " s"), f"{st.penalty:.2f}" if st else "-",
            f"{st.score:.0f}" if st else "-", f"{st.weight_percent}%" if st else "-",
            Text(diag, style="red" if diag != "-" else "green"),
        )
    statuses = ", ".join(f"{n}: {c.status.value}" for n, c in sorted(snap.collectors.items()))
    clients = ", ".join(f"{k}={v}" for k, v in sorted(fleet.stats.statuses.items())) or "none yet"
    return Group(table, Text(f"collectors: {statuses}\nclient results: {clients}", style="dim"))


def _watch(config: Config, fleet: DemoFleet, backends: list[Backend], duration: float, loop: AgentLoop,
           live: Live | None) -> Iterator[Snapshot]:
    """The demo's ticks; the caller's analyze() runs each one through ``loop`` before asking for the next."""
    start = time.monotonic()
    for snap in snapshot_ticks(config, backends, list(DEMO_COLLECTORS), duration=duration):
        yield snap
        if live is not None:
            live.update(_table(loop.state, time.monotonic() - start, fleet))


def handle(args: argparse.Namespace, config: Config) -> int:
    if args.fault_at is None:
        # Early enough that a short demo still shows the whole story.
        args.fault_at = min(15.0, args.duration / 4)
    if args.fault_at >= args.duration:
        print(f"llmdiag demo: --fault-at {args.fault_at:g} is not before the end of --duration {args.duration:g}: "
              "the fault would never happen", file=sys.stderr)
        return EX_USAGE
    fleet = DemoFleet(default_fleet(fault_at=args.fault_at), rate_rps=args.rate)
    console = Console()
    console.print(f"starting the demo fleet: 3 fake vLLM engines on 127.0.0.1, {args.rate:g} req/s round robin; "
                  f"vllm-2 loses 75 % of its KV cache and slows to 0.35x at {args.fault_at:g} s")
    fleet.start()
    try:
        backends = [Backend.from_url(url, name=name, engine="vllm", models=(fleet.model,))
                    for name, url in fleet.urls.items()]
        loop = AgentLoop(config, backends)
        live = None if args.no_live or not console.is_terminal else Live(console=console, refresh_per_second=2)
        if live is not None:
            live.start()
        try:
            report = analyze(_watch(config, fleet, backends, args.duration, loop, live), loop,
                             source=f"demo fleet, {args.duration:g}s")
        finally:
            if live is not None:
                live.stop()
    finally:
        fleet.stop()
    print_report(report)
    final = loop.state.backends
    console.print("routing weights at the end: " + ", ".join(f"{n} {s.weight_percent}%" for n, s in sorted(final.items())))
    return report.exit_code()


def register(sub: Any) -> None:
    parser = sub.add_parser("demo", help="watch llmdiag catch an overloaded engine in a fleet of fake vLLM engines",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=positive_seconds, default=60.0, metavar="S", help="seconds to run (default 60)")
    parser.add_argument("--rate", type=positive_seconds, default=3.0, metavar="RPS",
                        help="requests per second over the fleet (default 3)")
    parser.add_argument("--fault-at", type=positive_seconds, default=None, metavar="S",
                        help="when vllm-2 goes bad (default 15 s, or a quarter of a shorter --duration)")
    parser.add_argument("--no-live", action="store_true", help="no live table, only the final report")
    parser.set_defaults(handler=handle)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
