"""Parse + normalise time of one engine scrape (target: <= 5 ms for the 500-line real vLLM scrape).

    .venv/bin/python bench/bench_engine_parse.py            # plain timeit, prints a table
    .venv/bin/python bench/bench_engine_parse.py --repeat 20 --number 50

Measures what the engine collector does per backend per tick after the
HTTP answer arrived: prometheus_client's text parser over the wanted lines,
the dialect mapping, and the window step (deltas, quantiles, EWMA). "cached parse" is the
same parse with the backend's ExpositionCache primed by an earlier scrape of the same structure
(what every scrape after the first costs while the engine's series stay the same).
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from pathlib import Path

from llmdiag.collectors.engine import _BackendTracker
from llmdiag.collectors.engine_names import detect_dialect
from llmdiag.collectors.engine_parse import ExpositionCache, parse_exposition, read_engines
from llmdiag.model import Backend

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "engines"
FILES = [
    "vllm_v1_real_scrape_0.9era.prom",
    "vllm_SYNTHETIC_current_v1_names_text0.0.4.prom",
    "vllm_SYNTHETIC_current_v1_names_openmetrics.txt",
]


def parse_and_normalise(text: str, tracker: _BackendTracker) -> None:
    parsed = parse_exposition(text)
    tracker.update(parsed, 0.0, 0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--number", type=int, default=40)
    args = ap.parse_args()
    print(f"{'scrape':52} {'lines':>6} {'parse ms':>9} {'cached parse ms':>16} {'parse+normalise ms (median / best)':>36}")
    for name in FILES:
        text = (SHARED / name).read_text()
        tracker = _BackendTracker(Backend.from_url("http://127.0.0.1:8000"))
        parse_only = min(timeit.repeat(lambda: parse_exposition(text), repeat=args.repeat, number=args.number))
        cache = ExpositionCache()
        parse_exposition(text, cache)
        assert cache.state is not None
        cached = min(timeit.repeat(lambda: parse_exposition(text, cache), repeat=args.repeat, number=args.number))
        runs = timeit.repeat(lambda: parse_and_normalise(text, tracker), repeat=args.repeat, number=args.number)
        per_call = [r / args.number * 1e3 for r in runs]
        parsed = parse_exposition(text)
        assert detect_dialect(parsed.names()) is not None and read_engines(parsed, detect_dialect(parsed.names())).engines
        print(f"{name:52} {text.count(chr(10)):6d} {parse_only / args.number * 1e3:9.2f} "
              f"{cached / args.number * 1e3:16.2f} {statistics.median(per_call):17.2f} / {min(per_call):.2f}")


if __name__ == "__main__":
    main()
