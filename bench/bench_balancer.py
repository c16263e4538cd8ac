"""Balancer hot paths across backend counts, as JSON and a plot (``llmdiag bench balancer`` measures the same).

    .venv/bin/python bench/bench_balancer.py                       # 10..3000 backends, 20k picks each
    .venv/bin/python bench/bench_balancer.py --iterations 5000 --out /tmp/balancer

Writes ``<out>.json`` (the ``llmdiag bench balancer --json`` document) and, when
matplotlib is installed, ``<out>.png``: pick p50/p99 against the backend count,
with the 3 us target, so "flat in the backend count" can be seen at a glance.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmdiag.router_feedback.benchmark import bench_balancer

COUNTS = (10, 30, 100, 300, 1000, 3000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "balancer"))
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = bench_balancer(args.iterations, COUNTS)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    for n in COUNTS:
        cell = result["pick_ns"][str(n)]
        print(f"pick {n:>5} backends: p50 {cell['p50']:>6} ns  p99 {cell['p99']:>6} ns")
    print(f"on_finish: p50 {result['on_finish_ns']['p50']} ns  p99 {result['on_finish_ns']['p99']} ns")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(COUNTS, [result["pick_ns"][str(n)]["p50"] for n in COUNTS], marker="o", label="pick p50")
    ax.plot(COUNTS, [result["pick_ns"][str(n)]["p99"] for n in COUNTS], marker="s", label="pick p99")
    ax.axhline(3000, color="grey", linestyle="--", label="target p50 3 us")
    ax.set_xscale("log")
    ax.set_xlabel("backends")
    ax.set_ylabel("ns per pick")
    ax.set_ylim(bottom=0)
    ax.set_title("Balancer.pick cost vs backend count")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
