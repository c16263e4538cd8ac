"""``llmdiag bench sim``: the cluster simulator over real traces (SPEC section 8).

``llmdiag bench sim --trace FILE_OR_NAME --scenario NAME [--policies a,b]
[--utilization 0.85] [--instances 8] [--seed N] [--duration S] [--json] [--plot DIR]``

Runs every policy on the same engines, trace and seed and prints a table per
scenario (or, with ``--json``, ``{"scenario", "trace", "utilization",
"results": {policy: {"ttft_p50", "ttft_p99", "e2e_p99", "goodput_rps",
"throughput_tokens_per_s", "rejected_429", "preemptions",
"oscillation_index", ...}}}``; a list of those for several scenarios).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from llmdiag.cli.main import EX_USAGE
from llmdiag.config import Config

__all__ = ["register"]


def register(bench_subparsers: Any) -> None:
    """Add the ``sim`` subparser to ``llmdiag bench``."""
    from llmdiag.sim.engine_model import PRESETS
    from llmdiag.sim.policies import POLICIES
    from llmdiag.sim.scenarios import DEFAULT_PRESET, SCENARIOS
    from llmdiag.sim.workload import NAMED_TRACES

    parser = bench_subparsers.add_parser(
        "sim",
        help="simulate a cluster on real traces and compare routing policies",
        description=(
            "Discrete-event simulation of N vLLM-like engines behind a gateway, replaying a real trace "
            "scaled to a target utilisation of the measured capacity, once per routing policy."
        ),
    )
    parser.add_argument(
        "--trace", default="azure2023_conv", metavar="FILE_OR_NAME",
        help=f"a CSV with arrival_s,input_tokens,output_tokens or one of {', '.join(NAMED_TRACES)} (default azure2023_conv)",
    )
    parser.add_argument(
        "--scenario", default="clean", metavar="NAME",
        help=f"comma-separated scenarios or 'all' ({', '.join(SCENARIOS)}; default clean)",
    )
    parser.add_argument(
        "--policies", default=",".join(POLICIES), metavar="A,B",
        help=f"comma-separated policies (default all: {', '.join(POLICIES)})",
    )
    parser.add_argument("--utilization", type=float, default=0.85, help="offered load / measured capacity (default 0.85)")
    parser.add_argument("--instances", type=int, default=8, help="engines in the cluster (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed, same numbers)")
    parser.add_argument(
        "--duration", type=float, default=None, metavar="S",
        help="virtual seconds of arrivals (tiles the scaled trace; default one pass of it)",
    )
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS), help=f"engine preset (default {DEFAULT_PRESET})")
    parser.add_argument(
        "--kv-tokens", "--kv-capacity", dest="kv_capacity", type=int, default=None, metavar="TOKENS",
        help="KV cache per engine in tokens (default: the preset's; e.g. 200000 makes long prompts KV-bound)",
    )
    parser.add_argument("--scrape-interval", type=float, default=0.1, metavar="S", help="metric scrape interval seen by metric-driven peers (default 0.1)")
    parser.add_argument(
        "--llmdiag-signal-interval", type=float, default=1.0, metavar="S",
        help="how often llmdiag's balancer gets engine signals (the node agent's tick; default 1.0)",
    )
    parser.add_argument("--client-timeout", type=float, default=60.0, metavar="S", help="clients cancel without a first token after this (default 60)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    parser.set_defaults(handler=_run)


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _run(args: argparse.Namespace, config: Config) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from llmdiag.sim.cluster import SimConfig
    from llmdiag.sim.policies import POLICIES
    from llmdiag.sim.scenarios import SCENARIOS, run_scenario
    from llmdiag.sim.workload import TraceError

    err = Console(stderr=True)
    scenarios = list(SCENARIOS) if args.scenario == "all" else _split(args.scenario)
    policies = _split(args.policies)
    for s in scenarios:
        if s not in SCENARIOS:
            err.print(f"llmdiag bench sim: unknown scenario {s!r} (known: {', '.join(SCENARIOS)}, all)")
            return EX_USAGE
    for p in policies:
        if p not in POLICIES:
            err.print(f"llmdiag bench sim: unknown policy {p!r} (known: {', '.join(POLICIES)})")
            return EX_USAGE
    if not policies or args.instances < 1 or not 0 < args.utilization <= 2:
        err.print("llmdiag bench sim: need at least one policy, --instances >= 1 and 0 < --utilization <= 2")
        return EX_USAGE
    if args.duration is not None and not args.duration > 0:
        err.print("llmdiag bench sim: --duration must be > 0")
        return EX_USAGE
    if args.kv_capacity is not None and args.kv_capacity < 1:
        err.print(f"llmdiag bench sim: --kv-tokens must be >= 1, got {args.kv_capacity}")
        return EX_USAGE
    if args.plot:
        problem = _unwritable_dir(Path(args.plot))
        if problem:  # found now, not after the whole simulation has run
            err.print(f"llmdiag bench sim: --plot {args.plot}: {problem}", markup=False, highlight=False)
            return EX_USAGE
    try:
        sim_config = SimConfig(
            scrape_interval_s=args.scrape_interval,
            client_timeout_s=args.client_timeout,
            llmdiag_signal_interval_s=args.llmdiag_signal_interval,
        )
    except ValueError as exc:
        err.print(f"llmdiag bench sim: {exc}")
        return EX_USAGE
    balancer_config = getattr(config, "balancer", None)
    policy_options = (
        {name: {"config": balancer_config} for name in ("llmdiag", "llmdiag_no_penalties")}
        if balancer_config is not None
        else None
    )

    outputs = []
    with Progress(
        TextColumn("{task.description:<34}"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TimeElapsedColumn(),
        console=err,
        transient=args.json,
        disable=not err.is_terminal,
    ) as progress:
        tasks: dict[str, Any] = {}

        def start(scenario: str) -> Any:
            def on_start(name: str, span: float) -> None:
                tasks[name] = progress.add_task(f"{scenario}: {name}", total=max(span, 1e-9))

            return on_start

        def on_progress(name: str, t: float) -> None:
            progress.update(tasks[name], completed=t)

        def on_done(name: str, result: Any) -> None:
            progress.update(tasks[name], completed=progress.tasks[tasks[name]].total)

        for scenario in scenarios:
            try:
                result = run_scenario(
                    scenario,
                    args.trace,
                    policies=policies,
                    utilization=args.utilization,
                    instances=args.instances,
                    seed=args.seed,
                    duration=args.duration,
                    preset=args.preset,
                    kv_capacity_tokens=args.kv_capacity,
                    config=sim_config,
                    policy_options=policy_options,
                    on_policy_start=start(scenario),
                    on_progress=on_progress,
                    on_policy_done=on_done,
                )
            except (TraceError, ValueError) as exc:
                err.print(f"llmdiag bench sim: {exc}")
                return EX_USAGE
            outputs.append(result)
            if not args.json:
                out = Console()
                _print_table(out if out.is_terminal else Console(width=160), result)
            if args.plot:
                from llmdiag.sim.plots import plot_scenario

                for path in plot_scenario(result, Path(args.plot)):
                    err.print(f"wrote {path}")
    if args.json:
        docs = [r.to_json() for r in outputs]
        json.dump(docs[0] if len(docs) == 1 else docs, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0


def _fmt(x: float | None, unit: str = "s") -> str:
    if x is None:
        return "-"
    return f"{x:.3f}{unit}" if x < 10 else f"{x:.1f}{unit}"


def _print_table(console: Any, result: Any) -> None:
    from rich.table import Table

    table = Table(
        title=(
            f"{result.scenario} / {result.trace}: {result.instances} engines, {result.utilization:.0%} of "
            f"{result.capacity_rps:.1f} req/s measured capacity, {result.requests} requests, seed {result.seed}"
        )
    )
    for col in ("policy", "TTFT p50", "TTFT p99", "E2E p99", "goodput req/s", "tokens/s", "429s", "preempt", "oscillation", "failed"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    best99 = min((r.ttft_p99 for r in result.results.values() if r.ttft_p99 is not None), default=None)
    for name, r in result.results.items():
        failed = sum(v for k, v in r.outcomes.items() if k not in ("ok", "rejected_429")) + r.unfinished
        p99 = _fmt(r.ttft_p99)
        if r.ttft_p99 is not None and r.ttft_p99 == best99:
            p99 = f"[bold green]{p99}[/]"
        table.add_row(
            name,
            _fmt(r.ttft_p50),
            p99,
            _fmt(r.e2e_p99),
            f"{r.goodput_rps:.2f}",
            f"{r.throughput_tokens_per_s:.0f}",
            str(r.rejected_429),
            str(r.preemptions),
            f"{r.oscillation_index:.3f}",
            str(failed),
        )
    console.print(table)


def _unwritable_dir(path: Path) -> str | None:
    """Why PNGs cannot be written into ``path`` (created if missing), or None when they can."""
    import tempfile  # noqa: PLC0415

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"cannot write there: {exc.strerror or exc}"
    return None
