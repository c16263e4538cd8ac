"""CPU of one backend's changed scrape at light traffic: parse, map, window step and samples.

    .venv/bin/python bench/bench_engine_light.py                 # 5 rounds of 400 scrapes, µs per scrape

The body is a recorded idle ``llmdiag fake-engine`` scrape (tests/fixtures/engine_scrapes, backend b,
tick 28). Each scrape moves two gauges (running requests, KV usage); every fourth one a request
finished too (every ``_count``/``_sum``/``*_total`` line and two buckets grow by one), as at 0.25
requests/s per engine scraped every second. Thread CPU time of ``_BackendTracker.update_body`` plus the
samples the collector builds, per scrape, after 5 warm-up scrapes; min and median of the rounds
(the median moves with the machine's load, the min much less).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import statistics
import time
from pathlib import Path

from llmdiag.collectors.engine import EngineCollector, _BackendTracker
from llmdiag.model import Backend

RECORDING = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "engine_scrapes" / "fleet.jsonl.gz"


def bodies(count: int) -> list[str]:
    rows = [json.loads(line) for line in gzip.open(RECORDING, "rt")]
    lines = next(r["body"] for r in rows if r["backend"] == "b" and r["tick"] == 28).split("\n")
    out = []
    for k in range(count):
        now = list(lines)
        for i, line in enumerate(now):
            if line.startswith(("vllm:kv_cache_usage_perc", "vllm:num_requests_running")):
                now[i] = line.rpartition(" ")[0] + f" {(k % 7) / 10}"
            elif not line.startswith("#") and ("_count{" in line or "_sum{" in line or "_total{" in line
                                               or 'le="+Inf"' in line or 'le="10.0"' in line):
                head, _, value = line.rpartition(" ")
                try:
                    now[i] = f"{head} {float(value) + k // 4!r}"
                except ValueError:
                    pass
        out.append("\n".join(now))
    return out


def one_round(scrapes: list[str]) -> float:
    tracker = _BackendTracker(Backend.from_url("http://127.0.0.1:1", name="b"))
    samples = getattr(EngineCollector, "_reused_samples", None)
    for body in scrapes[:5]:
        tracker.update_body(body, 0.0, 0.3)
    start = time.thread_time()
    for k, body in enumerate(scrapes[5:]):
        scrape = tracker.update_body(body, float(k), 0.3)
        scrape.signals["up"] = 1
        if samples is not None:
            samples(tracker, scrape)
        else:  # before the samples were reused (an older checkout running this script)
            EngineCollector._samples(scrape)
    return (time.thread_time() - start) / (len(scrapes) - 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scrapes", type=int, default=400)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    scrapes = bodies(args.scrapes + 5)
    results = [1e6 * one_round(scrapes) for _ in range(args.rounds)]
    print(f"µs per changed scrape: min {min(results):.1f}, median {statistics.median(results):.1f} "
          f"({' '.join(f'{r:.1f}' for r in results)})")


if __name__ == "__main__":
    main()
