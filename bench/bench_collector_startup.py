"""How long the collectors take to start (BPF compile), built one after another or on threads.

    sudo .venv/bin/python bench/bench_collector_startup.py --runs 3
    sudo .venv/bin/python bench/bench_collector_startup.py --backend http://127.0.0.1:8000 --backend grpc://127.0.0.1:50051

Builds every collector of ``llmdiag.agent.wiring.COLLECTOR_FACTORIES`` (the set
``llmdiag collect --once`` starts) ``--runs`` times each way and prints the
median wall time per collector and in total: ``sequential`` is what
``build_collectors`` does; ``threads`` runs every factory on its own thread
at once. It also reports the time spent inside bcc's ``BPF()`` (clang
compile and load), which the loader runs under a process-wide lock (it
captures fd 2, the compiler's diagnostics, and fd 2 is per process), so
threads can only overlap the rest. Needs root for the BPF collectors.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from llmdiag.agent import wiring
from llmdiag.config import Config


def _timed_bpf() -> dict[str, float]:
    """Wrap bcc.BPF.__init__ to add its wall time per thread name into the returned dict."""
    import bcc

    spent: dict[str, float] = {}
    original = bcc.BPF.__init__
    lock = threading.Lock()

    def timed(self, *args, **kwargs):  # noqa: ANN001, ANN202
        start = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            with lock:
                key = threading.current_thread().name
                spent[key] = spent.get(key, 0.0) + time.monotonic() - start

    bcc.BPF.__init__ = timed
    return spent


def _build_one(name: str, config: Config, backends: list) -> tuple[str, float, object | None]:
    threading.current_thread().name = name
    start = time.monotonic()
    try:
        collector = wiring.COLLECTOR_FACTORIES[name](config, backends)
    except Exception:  # noqa: BLE001 - unavailable collectors count with their failed start
        collector = None
    return name, time.monotonic() - start, collector


def run_once(config: Config, backends: list, threaded: bool, spent: dict[str, float]) -> dict[str, float]:
    spent.clear()
    names = list(wiring.COLLECTOR_FACTORIES)
    start = time.monotonic()
    if threaded:
        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            results = list(pool.map(lambda n: _build_one(n, config, backends), names))
    else:
        results = [_build_one(n, config, backends) for n in names]
    total = time.monotonic() - start
    threading.current_thread().name = "MainThread"
    for _, _, collector in results:
        if collector is not None:
            collector.close()
    out = {name: seconds for name, seconds, _ in results}
    out["total"] = total
    out["in BPF()"] = sum(spent.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backend", action="append", default=[], metavar="URL")
    args = parser.parse_args()
    config = Config().with_backends(args.backend)
    backends = wiring.resolve_backends(config)
    spent = _timed_bpf()
    rows: dict[str, dict[str, list[float]]] = {"sequential": {}, "threads": {}}
    for _ in range(args.runs):
        for mode in rows:  # interleaved, so a change in machine load hits both alike
            for key, value in run_once(config, backends, mode == "threads", spent).items():
                rows[mode].setdefault(key, []).append(value)
    keys = list(rows["sequential"])
    print(f"{len(backends)} backend(s), {args.runs} run(s) each, medians in seconds")
    print(f"{'':12}" + "".join(f"{k:>10}" for k in keys))
    for mode, values in rows.items():
        print(f"{mode:12}" + "".join(f"{statistics.median(values[k]):10.2f}" for k in keys))


if __name__ == "__main__":
    main()
