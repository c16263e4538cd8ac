#!/usr/bin/env python3
"""One full tick of the gpu and proc collectors: 8 replayed GPUs and 16 live backend processes.

    .venv/bin/python bench/bench_gpu_proc.py [--ticks 200] [--threads 64] [--json OUT]

The GPU side runs the real collector on the SYNTHETIC 8 x H200 replay
(tests/fixtures/nvml/h200x8.json, first tick held steady, XID thread on, PCIe
inline every 10 s so most ticks skip it; one tick with PCIe is timed
separately). The proc side reads the real /proc of 16 child processes with
``--threads`` threads each (an inference server has tens to hundreds).
Target (SPEC 10 share of the 50 ms tick): <= 20 ms per tick for both together.
Replayed NVML calls cost Python only; a real driver adds its own latency
(~20 ms per PCIe call, which is why PCIe runs on its own cadence).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmdiag.collectors.gpu import GpuCollector  # noqa: E402
from llmdiag.collectors.procfs import ProcCollector  # noqa: E402
from llmdiag.model import Backend  # noqa: E402

CHILD = """
import sys, threading
stop = threading.Event()
for _ in range(int(sys.argv[1]) - 1):
    threading.Thread(target=stop.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=200)
    ap.add_argument("--backends", type=int, default=16)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    doc = json.loads((REPO / "tests/fixtures/nvml/h200x8.json").read_text())
    doc["ticks"] = doc["ticks"][:1]
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(args.threads)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for _ in range(args.backends)]
    try:
        for child in children:
            child.stdout.readline()
        backends = [Backend(f"vllm-{i}", f"http://127.0.0.1:{8000 + i}", pid=c.pid) for i, c in enumerate(children)]
        with tempfile.NamedTemporaryFile("w", suffix=".json") as fh:
            json.dump(doc, fh)
            fh.flush()
            gpu = GpuCollector.from_replay(fh.name, backends, pcie_interval_seconds=10.0)
            proc = ProcCollector(backends)
            try:
                gpu.collect(0.0)  # first tick: init, event thread, first PCIe sample
                proc.collect(0.0)
                t0 = time.perf_counter()
                gpu._sample_pcie()
                pcie_ms = (time.perf_counter() - t0) * 1e3
                gpu_ms, proc_ms, total_ms, nsamples = [], [], [], 0
                for n in range(args.ticks):
                    now = 1.0 + n * 0.001  # PCIe stays not due
                    t0 = time.perf_counter()
                    a = gpu.collect(now)
                    t1 = time.perf_counter()
                    b = proc.collect(now)
                    t2 = time.perf_counter()
                    gpu_ms.append((t1 - t0) * 1e3)
                    proc_ms.append((t2 - t1) * 1e3)
                    total_ms.append((t2 - t0) * 1e3)
                    nsamples = len(a) + len(b)
                    if (n + 1) % 50 == 0:
                        print(f"  tick {n + 1}/{args.ticks}", file=sys.stderr)
            finally:
                gpu.close()
    finally:
        for child in children:
            child.stdin.close()
            child.wait(timeout=10)
    result = {
        "gpus": 8, "backends": args.backends, "threads_per_backend": args.threads, "ticks": args.ticks,
        "samples_per_tick": nsamples,
        "gpu_ms_p50": statistics.median(gpu_ms), "gpu_ms_p99": pct(gpu_ms, 0.99),
        "proc_ms_p50": statistics.median(proc_ms), "proc_ms_p99": pct(proc_ms, 0.99),
        "tick_ms_p50": statistics.median(total_ms), "tick_ms_p99": pct(total_ms, 0.99),
        "pcie_sample_ms_replayed": pcie_ms,
    }
    for k, v in result.items():
        print(f"{k:26} {v:.2f}" if isinstance(v, float) else f"{k:26} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
