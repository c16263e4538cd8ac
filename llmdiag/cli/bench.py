"""``llmdiag bench <what>``: benchmarks, one subcommand each.

``BENCH_SUBCOMMANDS`` maps a name to how its parser is registered: a
function ``register(bench_subparsers)`` or the dotted name of a module that
exposes one. Each registered parser sets ``handler(args, config) -> int``,
like the top-level commands. To add ``bench sim``, add
``"sim": "llmdiag.cli.bench_sim"`` here.

``llmdiag bench balancer [--json] [--iterations N]`` times ``pick`` at 10, 100
and 1,000 backends and the feedback calls; ``--json`` prints
``{"pick_ns": {"10": {"p50", "p99"}, "100": {...}, "1000": {...}}, "on_finish_ns": {"p50", "p99"}, ...}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from collections.abc import Callable
from typing import Any

from llmdiag.cli.main import EX_USAGE
from llmdiag.config import Config

__all__ = ["BENCH_SUBCOMMANDS", "register"]


def _register_balancer(sub: Any) -> None:
    parser = sub.add_parser(
        "balancer",
        help="time the balancer's pick and feedback calls at 10/100/1,000 backends",
        description="Time Balancer.pick (p50/p99 ns) at several backend counts, and on_finish/on_first_token.",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--iterations", type=int, default=20_000, metavar="N", help="picks per backend count (default 20000)")
    parser.add_argument(
        "--backends", default="10,100,1000", metavar="LIST", help="comma-separated backend counts, each >= 2 (default 10,100,1000)"
    )
    parser.set_defaults(handler=_run_balancer)


#: name -> register function or module name (see the module docstring).
BENCH_SUBCOMMANDS: dict[str, Callable[[Any], None] | str] = {
    "balancer": _register_balancer,
    "sim": "llmdiag.cli.bench_sim",
    "load": "llmdiag.cli.bench_load",
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="run benchmarks (balancer, ...)", description="Run benchmarks, one subcommand each; see docs/benchmarks.md for recorded results.")
    sub = parser.add_subparsers(dest="bench_command", metavar="WHAT")
    for name, how in BENCH_SUBCOMMANDS.items():
        if isinstance(how, str):
            importlib.import_module(how).register(sub)
        else:
            how(sub)
    parser.set_defaults(handler=lambda args, config: _no_subcommand(parser))


def _no_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EX_USAGE


def _run_balancer(args: argparse.Namespace, config: Config) -> int:
    from llmdiag.router_feedback.benchmark import bench_balancer

    try:
        counts = [int(x) for x in args.backends.split(",") if x.strip()]
    except ValueError:
        print(f"llmdiag bench balancer: --backends wants integers, got {args.backends!r}", file=sys.stderr)
        return EX_USAGE
    # The benchmark alternates two models over the fleet (half the backends serve each), so a
    # single backend would leave one model with nowhere to go.
    if not counts or min(counts) < 2 or args.iterations < 1:
        print("llmdiag bench balancer: need --iterations >= 1 and backend counts >= 2 "
              "(picks alternate between two models, each served by half the backends)", file=sys.stderr)
        return EX_USAGE
    if args.json:
        result = bench_balancer(args.iterations, counts, config.balancer)
        print(json.dumps(result, indent=2))
        return 0

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        tasks = {f"pick x {n} backends": progress.add_task(f"pick x {n} backends", total=args.iterations) for n in counts}

        def advance(task: str, amount: int) -> None:
            progress.advance(tasks[task], amount)

        result = bench_balancer(args.iterations, counts, config.balancer, progress=advance)

    table = Table(title=f"Balancer hot paths ({platform.python_implementation()} {platform.python_version()}, "
                        f"{args.iterations} picks per size)")
    table.add_column("call")
    table.add_column("p50 ns", justify="right")
    table.add_column("p99 ns", justify="right")
    table.add_column("vs 10 backends (p50)", justify="right")
    base = result["pick_ns"][str(counts[0])]["p50"] or 1
    for n in counts:
        cell = result["pick_ns"][str(n)]
        table.add_row(f"pick, {n} backends", f"{cell['p50']:,}", f"{cell['p99']:,}", f"{cell['p50'] / base:.2f}x")
    for name in ("on_first_token_ns", "on_finish_ns"):
        cell = result[name]
        table.add_row(name.removesuffix("_ns"), f"{cell['p50']:,}", f"{cell['p99']:,}", "")
    console.print(table)
    console.print(f"timer overhead subtracted: {result['timer_overhead_ns']} ns per call; targets: pick p50 <= 3,000 ns, "
                  "1,000 backends within 1.5x of 10, feedback <= 3,000 ns")
    return 0
