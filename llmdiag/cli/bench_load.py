"""``llmdiag bench load``: replay a trace's request sizes open-loop against OpenAI-compatible endpoints.

    llmdiag bench load --target http://127.0.0.1:8080 --trace azure2023_conv --rate 4 --duration 60

The first rate x duration requests of the trace (tiled if it is shorter) are
time-scaled to span --duration seconds, so the run offers exactly --rate on
average with the trace's own burstiness; each request is a streamed completion with
the trace's prompt and output lengths. Several --target URLs share the load
in turn. Reports TTFT p50/p99, inter-token latency, E2E, errors by status,
goodput at the TTFT SLO, and which backend answered (x-llmdiag-backend).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from llmdiag.cli.main import EX_USAGE, positive_seconds
from llmdiag.config import Config


def register(sub: Any) -> None:
    parser = sub.add_parser("load", help="replay a trace open-loop against OpenAI-compatible endpoints (TTFT, ITL, goodput)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", metavar="URL", action="append", required=True,
                        help="base URL of a gateway or engine (repeatable: requests go to targets in turn)")
    parser.add_argument("--trace", required=True, metavar="NAME_OR_CSV",
                        help="azure2023_conv, azure2023_code, mooncake_synthetic, sharegpt_poisson, sharegpt_gamma, "
                             "or a CSV with arrival_s,input_tokens,output_tokens")
    parser.add_argument("--rate", type=positive_seconds, required=True, metavar="RPS", help="mean requests per second")
    parser.add_argument("--duration", type=positive_seconds, required=True, metavar="S", help="seconds of arrivals")
    parser.add_argument("--timeout", type=positive_seconds, default=60.0, metavar="S",
                        help="a client hangs up after this long without a token, the first included (default 60)")
    parser.add_argument("--no-pool", action="store_true", help="a new connection per request (no keep-alive)")
    parser.add_argument("--slo-ttft", type=positive_seconds, default=2.0, metavar="S",
                        help="TTFT SLO for goodput (default 2 s)")
    parser.add_argument("--model", help="model name to send (default: the first of the first target's /v1/models)")
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions instead of /v1/completions")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                        help="clip prompt lengths (the engine's context window)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(handler=handle)


def _schedule(args: argparse.Namespace) -> list[Any]:
    from llmdiag.gateway.loadgen import schedule_from_trace
    from llmdiag.sim.workload import load_trace

    trace = load_trace(args.trace)
    return schedule_from_trace(trace.arrivals, trace.inputs, trace.outputs, args.rate, args.duration,
                               max_prompt_tokens=args.max_prompt_tokens)


def handle(args: argparse.Namespace, config: Config) -> int:
    from llmdiag.gateway.loadgen import run_load
    from llmdiag.model import split_backend_url
    from llmdiag.sim.workload import TraceError

    for url in args.target:
        try:
            split_backend_url(url)
        except ValueError as exc:
            print(f"llmdiag bench load: --target: {exc}", file=sys.stderr)
            return EX_USAGE
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        print("llmdiag bench load: --max-prompt-tokens must be >= 1", file=sys.stderr)
        return EX_USAGE
    try:
        schedule = _schedule(args)
    except TraceError as exc:
        print(f"llmdiag bench load: {exc}", file=sys.stderr)
        return EX_USAGE
    if not schedule:
        print("llmdiag bench load: the schedule is empty (raise --rate or --duration)", file=sys.stderr)
        return EX_USAGE
    kwargs = dict(timeout=args.timeout, pool=not args.no_pool, model=args.model, chat=args.chat,
                  slo_ttft_s=args.slo_ttft, duration_s=args.duration)
    if args.json:
        report = asyncio.run(run_load(args.target, schedule, **kwargs))
        summary = report.summary()
        print(json.dumps(summary, indent=2))
        return 0 if report.ok else 1

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"{len(schedule)} requests at {args.rate:g}/s", total=len(schedule))
        report = asyncio.run(run_load(args.target, schedule, progress=lambda done, total: progress.update(task, completed=done),
                                      **kwargs))
    _print(console, report.summary())
    return 0 if report.ok else 1


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.1f}"


def _print(console: Any, s: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"bench load: {s['sent']} requests, {s['offered_rps']:g}/s offered over {s['duration_s']:g} s "
                        f"-> {', '.join(s['targets'])}")
    table.add_column("")
    table.add_column("p50 ms", justify="right")
    table.add_column("p99 ms", justify="right")
    for name, key in (("TTFT", "ttft_s"), ("inter-token", "itl_s"), ("E2E", "e2e_s")):
        table.add_row(name, _ms(s[key]["p50"]), _ms(s[key]["p99"]))
    console.print(table)
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"
    console.print(f"completed {s['completed']}/{s['sent']}; errors: {errors}")
    console.print(f"goodput (TTFT <= {s['slo_ttft_s']:g} s): {s['goodput_rps']:g} req/s "
                  f"({(s['goodput_ratio'] or 0) * 100:.1f} % of requests); {s['output_tokens_per_s']:g} output tokens/s")
    if s["backends"]:
        console.print("answered by: " + ", ".join(f"{k} {v}" for k, v in s["backends"].items()))
    lag = s["dispatch_lag_s"]
    if lag["max"] is not None and lag["max"] > 0.05:
        console.print(f"[yellow]dispatch fell behind the schedule by up to {lag['max'] * 1000:.0f} ms "
                      "(CPU-starved client): arrivals were not fully open-loop[/]")
