"""The agent's analysis and export side, in process: CPU per tick and the memory it keeps.

    .venv/bin/python bench/bench_agent_loop.py --recording rec.jsonl.gz --ticks 600
    .venv/bin/python bench/bench_agent_loop.py --recording rec.jsonl.gz --ticks 900 --tracemalloc 60,300,600,900
    .venv/bin/python bench/bench_agent_loop.py --ticks 300 --profile /tmp/loop.prof     # synthetic fleet

What ``llmdiag agent`` does after the collectors, tick by tick, without the collectors: the
snapshots come from a recording (``llmdiag collect --record``; e.g. 16 fake engines with every
collector) replayed in a loop with its timestamps shifted so time keeps going forward (each
replay round starts one interval after the previous round's last snapshot; the counters of a
new round read as an engine restart), or, without ``--recording``, from the synthetic fleet of
``bench_analyzers.py`` (``--backends``). Per tick, as in the agent with the soak's readers:

* ``AgentLoop.observe`` (analyzers, balancer, the new :class:`AgentState`);
* ``--penalty-polls`` reads of ``/v1/penalties`` (the body the handler sends: the soak polls
  every 0.25 s, i.e. 4 a tick);
* every ``--scrape-every`` ticks a ``/metrics`` body and every ``--state-every`` ticks a
  ``/v1/state`` body.

The bodies are built the way the code under test builds them: with ``llmdiag.agent.http.PerState``
and ``llmdiag.exporters.prometheus.TickExposition`` where they exist (once per tick), else as the
handlers of 9de1729 did (every request). So the same script measures a checkout before and after
(``PYTHONPATH=/path/to/checkout``).

Reported: process CPU (``time.process_time``) per part, mean and p50 over the timed ticks (after
``--warm`` ticks), and the Python heap the analyzers keep (``tracemalloc``, only with
``--tracemalloc``: it slows everything, so CPU figures from such a run mean nothing). With
``--tracemalloc T1,T2,...`` the top growth by source line between those ticks is printed.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from llmdiag.agent.http import _dumps
from llmdiag.agent.loop import AgentLoop
from llmdiag.config import Config
from llmdiag.exporters.prometheus import AgentTelemetry, BackendInfo, StateCollector
from llmdiag.model import Backend, Snapshot, read_snapshots

try:  # the once-per-tick bodies (absent before they were introduced)
    from llmdiag.agent.http import PerState
    from llmdiag.exporters.prometheus import LiveCollector, TickExposition
except ImportError:
    PerState = TickExposition = LiveCollector = None  # type: ignore[assignment,misc]


def recorded(path: str) -> list[Snapshot]:
    return list(read_snapshots(path, on_cut_tail=lambda message: print(message, file=sys.stderr)))


def synthetic(backends: int, seconds: int) -> list[Snapshot]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_analyzers import build  # noqa: PLC0415

    return build(backends, seconds).snapshots


def replay(snaps: list[Snapshot], ticks: int, interval: float = 1.0) -> Iterator[Snapshot]:
    """``ticks`` snapshots: the recording over and over, its time shifted to keep moving forward."""
    first = snaps[0].ts
    shift = 0.0
    span = snaps[-1].ts - first + interval
    n = 0
    while True:
        for s in snaps:
            if n >= ticks:
                return
            yield dataclasses.replace(s, ts=s.ts + shift, collectors=dict(s.collectors))
            n += 1
        shift += span


def backends_of(snap: Snapshot) -> list[Backend]:
    out = []
    for name in sorted(snap.backends):
        url = f"http://{name}" if ":" in name else f"http://{name}:8000"
        try:
            out.append(Backend(name, url))
        except ValueError:
            out.append(Backend(name, "http://127.0.0.1:8000"))
    return out


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recording", help="a `llmdiag collect --record` file (default: the synthetic fleet)")
    ap.add_argument("--backends", type=int, default=16, help="synthetic fleet size (without --recording)")
    ap.add_argument("--ticks", type=int, default=600)
    ap.add_argument("--warm", type=int, default=300, help="ticks before the timed ones (default 300: full windows)")
    ap.add_argument("--penalty-polls", type=int, default=4, help="/v1/penalties reads per tick (default 4)")
    ap.add_argument("--scrape-every", type=int, default=10, help="ticks between /metrics renders (default 10)")
    ap.add_argument("--state-every", type=int, default=0, help="ticks between /v1/state documents (0: never)")
    ap.add_argument("--tracemalloc", metavar="T1,T2", help="trace the heap; print its growth between these ticks")
    ap.add_argument("--rss", metavar="T1,T2", help="print this process's RSS (VmRSS) at these ticks")
    ap.add_argument("--profile", metavar="FILE", help="cProfile the timed ticks into FILE")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()

    snaps = recorded(args.recording) if args.recording else synthetic(args.backends, 420)
    backends = backends_of(snaps[0])
    config = Config()
    loop = AgentLoop(config, backends, keep_closed=config.agent.keep_closed_diagnoses)
    telemetry = AgentTelemetry(backends=tuple(BackendInfo(b.name, b.address) for b in backends))
    ttl = config.agent.penalties_ttl_seconds
    if TickExposition is not None:
        live = CollectorRegistry(auto_describe=False)
        live.register(LiveCollector(lambda: AgentTelemetry()))
        exposition = TickExposition(lambda: (loop.state, telemetry), live)
        render_metrics = exposition.render
        penalties_body, state_body = PerState(lambda s: _dumps(s.penalties(ttl).to_json())), PerState(lambda s: _dumps(s.to_json()))
        penalties, state_doc = (lambda: penalties_body.get(loop.state)), (lambda: state_body.get(loop.state))
    else:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StateCollector(lambda: (loop.state, telemetry)))
        render_metrics = lambda: generate_latest(registry)  # noqa: E731
        penalties = lambda: _dumps(loop.state.penalties(ttl).to_json())  # noqa: E731
        state_doc = lambda: _dumps(loop.state.to_json())  # noqa: E731
    marks = sorted(int(t) for t in args.tracemalloc.split(",")) if args.tracemalloc else []
    rss_marks = {int(t) for t in args.rss.split(",")} if args.rss else set()
    traces: dict[int, tracemalloc.Snapshot] = {}
    if marks:
        tracemalloc.start(1)
    profiler = cProfile.Profile() if args.profile else None
    parts: dict[str, list[float]] = {"observe": [], "penalties": [], "metrics": [], "state": [], "total": []}
    metrics_bytes = 0
    gc.collect()
    for tick, snap in enumerate(replay(snaps, args.ticks), start=1):
        timed = tick > args.warm
        if timed and profiler is not None and tick == args.warm + 1:
            profiler.enable()
        c0 = time.process_time()
        loop.observe(snap)
        c1 = time.process_time()
        for _ in range(args.penalty_polls):
            penalties()
        c2 = time.process_time()
        if args.scrape_every and tick % args.scrape_every == 0:
            metrics_bytes = len(render_metrics())
        c3 = time.process_time()
        if args.state_every and tick % args.state_every == 0:
            state_doc()
        c4 = time.process_time()
        if timed:
            for name, seconds in (("observe", c1 - c0), ("penalties", c2 - c1), ("metrics", c3 - c2),
                                  ("state", c4 - c3), ("total", c4 - c0)):
                parts[name].append(seconds * 1e3)
        if tick in rss_marks:
            print(f"tick {tick}: VmRSS {rss_mb():.1f} MB", file=sys.stderr)
        if tick in marks:
            gc.collect()
            traces[tick] = tracemalloc.take_snapshot()
            current, _ = tracemalloc.get_traced_memory()
            print(f"tick {tick}: traced heap {current / 2**20:.1f} MiB, {len(loop.analyzer.windows)} series, "
                  f"{len(loop.analyzer.baselines)} baselines", file=sys.stderr)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    for a, b in zip(marks, marks[1:]):
        if a in traces and b in traces:
            print(f"\n-- heap growth, tick {a} -> {b} (top 12 lines)", file=sys.stderr)
            for stat in traces[b].compare_to(traces[a], "lineno")[:12]:
                print(f"  {stat}", file=sys.stderr)
    result = {
        "source": args.recording or f"synthetic, {args.backends} backends",
        "backends": len(backends),
        "ticks_timed": len(parts["total"]),
        "series": len(loop.analyzer.windows),
        "metrics_bytes": metrics_bytes,
        "cpu_ms_per_tick_mean": {k: round(statistics.fmean(v), 3) for k, v in parts.items() if v},
        "cpu_ms_per_tick_p50": {k: round(statistics.median(v), 3) for k, v in parts.items() if v},
        "load_average": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['source']}: {result['backends']} backends, {result['series']} series, "
              f"{result['ticks_timed']} timed ticks, load {result['load_average']}")
        for k in parts:
            if parts[k]:
                print(f"  {k:10s} mean {result['cpu_ms_per_tick_mean'][k]:7.3f} ms  p50 {result['cpu_ms_per_tick_p50'][k]:7.3f} ms CPU/tick")
    return 0


if __name__ == "__main__":
    sys.exit(main())
