"""Issue 14's matrix: where the balancer lost, per scenario, trace and seed, against the oracle and the peers.

    .venv/bin/python bench/sweep_issue14.py                                   # the full matrix (docs/benchmarks.md)
    .venv/bin/python bench/sweep_issue14.py --scenarios kv_bound --traces mooncake_synthetic \\
        --seeds 0 --duration 900 --policies oracle,least_pending_prefill --variants default,scan

Every (scenario, trace, seed) cell runs the named policies once each, then
llmdiag once per *variant*: a named set of ``BalancerConfig`` overrides (see
``VARIANTS``), e.g. ``charge_all`` (the node penalties charged whole, as before
issue 14), ``d4`` (d = 4 sampled even in small pools, as before issue 14) or
``scan`` (a full scan at every pool size). ``default`` is the
shipped configuration. Results (P99 TTFT, goodput at the 2 s TTFT SLO) go to
``<out>.json`` after every cell, so a long run can be read while it goes, and
a summary table (means over seeds, ratios per seed) to ``<out>.md``.
``--report FILE.json...`` prints the issue 14 table of docs/benchmarks.md from
finished runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from llmdiag.config.balancer import BalancerConfig
from llmdiag.sim.scenarios import run_scenario

#: llmdiag configurations compared in each cell (BalancerConfig keyword overrides).
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "charge_all": {"self_observed_kinds": ()},
    "scan": {"choices": 0},
    "tps16": {"tokens_per_slot": 16.0},
    "tps8": {"tokens_per_slot": 8.0},
    "scan_tps8": {"choices": 0, "tokens_per_slot": 8.0},
    "d4": {"full_scan_up_to": 0},  # d = 4 sampled at every pool size, as before issue 14
    "slowness1": {"prefill_slowness_exponent": 1.0},  # the measured slowness at face value, as before issue 14
}
SCENARIOS = ("slow_replica", "kv_bound", "crash_restart_kv")
TRACES = ("azure2023_conv", "mooncake_synthetic")
POLICIES = (
    "llmdiag_no_penalties", "oracle", "least_pending_prefill",
    "round_robin", "least_conn", "envoy_lr", "peak_ewma", "gie",
)
PEERS = ("round_robin", "least_conn", "envoy_lr", "peak_ewma", "gie", "litellm")


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--report":
        cells = [c for path in sys.argv[2:] for c in json.loads(Path(path).read_text())["cells"]]
        print(report(cells), end="")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--utilization", type=float, default=0.85)
    parser.add_argument("--policies", default=",".join(POLICIES), help="policies besides the llmdiag variants")
    parser.add_argument("--variants", default="default,charge_all,d4,slowness1", help=f"llmdiag variants ({', '.join(VARIANTS)})")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "issue14"))
    args = parser.parse_args()
    variants = _split(args.variants)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown} (known: {', '.join(VARIANTS)})", file=sys.stderr)
        return 64
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cells: list[dict[str, Any]] = []
    for trace in _split(args.traces):
        for scenario in _split(args.scenarios):
            for seed in (int(s) for s in _split(args.seeds)):
                started = time.perf_counter()
                cell: dict[str, Any] = {"scenario": scenario, "trace": trace, "seed": seed, "results": {}}
                res = run_scenario(scenario, trace, policies=_split(args.policies), duration=args.duration,
                                   seed=seed, utilization=args.utilization)
                for name, r in res.results.items():
                    cell["results"][name] = _cell(r.summary())
                for v in variants:
                    cfg = BalancerConfig(**VARIANTS[v])
                    res = run_scenario(scenario, trace, policies=["llmdiag"], duration=args.duration, seed=seed,
                                       utilization=args.utilization, policy_options={"llmdiag": {"config": cfg}})
                    cell["results"]["llmdiag" if v == "default" else f"llmdiag[{v}]"] = _cell(res.results["llmdiag"].summary())
                cell["wall_seconds"] = round(time.perf_counter() - started, 1)
                cells.append(cell)
                doc = {"duration": args.duration, "utilization": args.utilization, "variants": {v: VARIANTS[v] for v in variants},
                       "cells": cells}
                out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=list) + "\n")
                print(f"{trace} {scenario} seed {seed}: {cell['wall_seconds']} s", flush=True)
    out.with_suffix(".md").write_text(summary(cells))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


def _cell(summary: dict[str, Any]) -> dict[str, float]:
    return {"ttft_p99": summary["ttft_p99"], "goodput_rps": summary["goodput_rps"]}


def summary(cells: list[dict[str, Any]]) -> str:
    """Per (trace, scenario): mean P99 / goodput over seeds per policy, and llmdiag's ratios."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["trace"], c["scenario"]), []).append(c)
    lines = ["| trace | scenario | policy | P99 TTFT s (mean of seeds) | goodput req/s | P99 / oracle (per seed) |",
             "|---|---|---|---:|---:|---|"]
    for (trace, scenario), cs in groups.items():
        names = list(cs[0]["results"])
        for name in names:
            p99 = [c["results"][name]["ttft_p99"] for c in cs]
            good = [c["results"][name]["goodput_rps"] for c in cs]
            ratio = ", ".join(f"{c['results'][name]['ttft_p99'] / c['results']['oracle']['ttft_p99']:.2f}"
                              for c in cs if "oracle" in c["results"])
            lines.append(f"| {trace} | {scenario} | {name} | {statistics.mean(p99):.2f} | {statistics.mean(good):.3f} | {ratio} |")
    return "\n".join(lines) + "\n"



def report(cells: list[dict[str, Any]]) -> str:
    """Issue 14's table: per trace and scenario, llmdiag against the oracle, the best peer and least_pending_prefill.

    P99 TTFT (s) and goodput at the 2 s TTFT SLO (req/s) are means over the seeds; ratios are per seed
    (min-max), so a reader sees whether a difference is larger than the seed-to-seed spread.
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["trace"], c["scenario"]), []).append(c)

    def mean(cs: list[dict[str, Any]], name: str, key: str) -> float:
        return statistics.mean(c["results"][name][key] for c in cs)

    def ratios(cs: list[dict[str, Any]], a: str, b: str, key: str = "ttft_p99") -> str:
        rs = [c["results"][a][key] / c["results"][b][key] for c in cs]
        low, high = f"{min(rs):.2f}", f"{max(rs):.2f}"
        return low if low == high else f"{low}-{high}"

    lines = [
        "| trace / scenario | llmdiag | no penalties | penalties charged whole | d 4 in small pools "
        "| slowness exponent 1 | oracle "
        "| least_pending_prefill | best peer (P99) | llmdiag / oracle P99 | best peer / llmdiag P99 "
        "| lpp / llmdiag P99 | llmdiag / no penalties P99 | goodput llmdiag / oracle |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (trace, scenario), cs in sorted(groups.items()):
        names = cs[0]["results"]
        peers = [p for p in PEERS if p in names]
        best = min(peers, key=lambda p: mean(cs, p, "ttft_p99")) if peers else None

        def cell(name: str) -> str:
            if name not in names:
                return "-"
            return f"{mean(cs, name, 'ttft_p99'):.2f} / {mean(cs, name, 'goodput_rps'):.3f}"

        row = [
            f"{trace} / {scenario}", cell("llmdiag"), cell("llmdiag_no_penalties"), cell("llmdiag[charge_all]"),
            cell("llmdiag[d4]"), cell("llmdiag[slowness1]"), cell("oracle"), cell("least_pending_prefill"),
            f"{cell(best)} {best}" if best else "-",
            ratios(cs, "llmdiag", "oracle"),
            ratios(cs, best, "llmdiag") if best else "-",
            ratios(cs, "least_pending_prefill", "llmdiag") if "least_pending_prefill" in names else "-",
            ratios(cs, "llmdiag", "llmdiag_no_penalties") if "llmdiag_no_penalties" in names else "-",
            ratios(cs, "llmdiag", "oracle", "goodput_rps"),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
