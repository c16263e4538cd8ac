"""Analyzer tick time with 64 backends and a full 5-minute window (target: <= 20 ms per tick).

    .venv/bin/python bench/bench_analyzers.py                 # 64 backends, 300 s warm, 120 timed ticks
    .venv/bin/python bench/bench_analyzers.py --backends 128 --ticks 200

Builds a synthetic fleet (llmdiag.analyzers.timelines: every backend with its
GPU and ~45 signals incl. labelled counters and distributions, the first four
backends in trouble: KV saturation, queue avalanche, cancels, 5xx), feeds
``window`` seconds of 1 s snapshots so every ring buffer is full, then times
``Analyzer.observe`` per tick. Snapshot construction is outside the timing.
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.progress import track
from rich.table import Table

from llmdiag.analyzers import Analyzer
from llmdiag.analyzers.timelines import TimelineBuilder, dist
from llmdiag.config.analyzers import DiagnosisConfig


def build(backends: int, seconds: int) -> TimelineBuilder:
    names = [f"vllm-{i}" for i in range(backends)]
    t = TimelineBuilder(names)
    t.advance(seconds - 60)
    t.backend("vllm-0").set(kv_cache_usage=0.97, requests_waiting=4.0).rate("preemptions_total", 0.5)
    t.backend("vllm-1").set(requests_waiting=40.0, ttft_seconds=dist(3.0))
    t.backend("vllm-2").set(ttft_seconds=dist(6.0)).rate("h2_rst_stream_total", 6.0, code="CANCEL", direction="received")
    t.backend("vllm-3").rate("responses_total", 2.0, **{"class": "server_5xx"})
    return t.advance(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", type=int, default=64)
    ap.add_argument("--window", type=int, default=300, help="seconds of history (the [diagnosis] window)")
    ap.add_argument("--ticks", type=int, default=120, help="timed ticks after the window is full")
    args = ap.parse_args()
    console = Console(stderr=True)
    with console.status("building the synthetic fleet ..."):
        t = build(args.backends, args.window + args.ticks)
    snaps = t.snapshots
    analyzer = Analyzer(DiagnosisConfig(window_seconds=float(args.window)), backends=t.backends())
    warm, timed = snaps[: args.window], snaps[args.window :]
    for s in track(warm, description="filling the window", console=console):
        analyzer.observe(s)
    samples = []
    for s in track(timed, description="timing ticks", console=console):
        t0 = time.perf_counter()
        analyzer.observe(s)
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    n_signals = sum(len(v) for v in snaps[-1].backends.values()) + sum(len(v) for v in snaps[-1].gpus.values())
    table = Table(title=f"Analyzer.observe, {args.backends} backends, {args.window} s window, {len(samples)} ticks")
    for col in ("p50 ms", "p99 ms", "max ms", "mean ms", "series", "signals/tick", "open diagnoses"):
        table.add_column(col, justify="right")
    table.add_row(
        f"{statistics.median(samples):.2f}",
        f"{samples[min(len(samples) - 1, int(0.99 * len(samples)))]:.2f}",
        f"{samples[-1]:.2f}",
        f"{statistics.fmean(samples):.2f}",
        str(len(analyzer.windows)),
        str(n_signals),
        str(len(analyzer.open_diagnoses())),
    )
    Console().print(table)


if __name__ == "__main__":
    main()
