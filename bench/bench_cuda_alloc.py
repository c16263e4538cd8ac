#!/usr/bin/env python3
"""Cost of the CUDA allocation tracer per traced call (needs root: real uprobes).

    .venv/bin/python bench/bench_cuda_alloc.py [--pairs 200000] [--rounds 5]

A small C loop (built here with gcc) dlopens the stand-in driver
tests/fixtures/fake_libcuda/fake_libcuda.c and times ``--pairs``
cuMemAlloc_v2 + cuMemFree_v2 pairs, first untraced, then with the ``cuda``
collector attached to its pid. Two views of the cost:

* wall: extra nanoseconds per call seen by the calling process (uprobe and
  uretprobe traps, the BPF programs, the return trampoline), median of rounds;
* bpf_stats: ``run_time_ns / run_cnt`` of each BPF program (kernel.bpf_stats_enabled
  is switched on for the run and restored afterwards): the programs alone.

The stand-in's calls take ~50 ns; a real cuMemAlloc takes microseconds to
milliseconds, so the same absolute overhead is a far smaller fraction there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmdiag.collectors.cuda_alloc import CudaAllocCollector  # noqa: E402
from llmdiag.config.cuda import CudaConfig  # noqa: E402
from llmdiag.model import Backend  # noqa: E402

LOOP_C = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <time.h>
typedef int (*alloc_fn)(unsigned long long *, size_t);
typedef int (*free_fn)(unsigned long long);
int main(int argc, char **argv) {
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    alloc_fn alloc = (alloc_fn)dlsym(lib, "cuMemAlloc_v2");
    free_fn release = (free_fn)dlsym(lib, "cuMemFree_v2");
    long pairs;
    printf("ready\n"); fflush(stdout);
    while (scanf("%ld", &pairs) == 1) {
        struct timespec a, b;
        unsigned long long p;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (long i = 0; i < pairs; i++) {
            if (alloc(&p, 4096) != 0 || release(p) != 0) { printf("fail\n"); return 1; }
        }
        clock_gettime(CLOCK_MONOTONIC, &b);
        printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / (2.0 * pairs));
        fflush(stdout);
    }
    return 0;
}
"""

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


def build(tmp: Path) -> tuple[Path, Path]:
    lib = tmp / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(lib),
                    str(REPO / "tests/fixtures/fake_libcuda/fake_libcuda.c"), "-lpthread"], check=True)
    (tmp / "loop.c").write_text(LOOP_C)
    loop = tmp / "loop"
    subprocess.run(["gcc", "-O2", "-o", str(loop), str(tmp / "loop.c"), "-ldl"], check=True)
    return lib, loop


def ns_per_call(proc: subprocess.Popen[str], pairs: int, rounds: int) -> float:
    assert proc.stdin is not None and proc.stdout is not None
    results = []
    for _ in range(rounds):
        proc.stdin.write(f"{pairs}\n")
        proc.stdin.flush()
        results.append(float(proc.stdout.readline()))
    return statistics.median(results)


def program_stats() -> dict[str, tuple[int, int]]:
    """name -> (run_cnt, run_time_ns) of our uprobe programs, from bpftool."""
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
    stats: dict[str, tuple[int, int]] = {}
    for prog in json.loads(out):
        name = prog.get("name", "")
        if name.startswith(("on_mem_", "ret_mem_")) and prog.get("run_cnt"):
            cnt, ns = stats.get(name, (0, 0))
            stats[name] = (cnt + prog["run_cnt"], ns + prog.get("run_time_ns", 0))
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (uprobes)", file=sys.stderr)
        return 2
    saved = STATS.read_text().strip()
    with tempfile.TemporaryDirectory() as tmpdir:
        lib, loop = build(Path(tmpdir))
        proc = subprocess.Popen([str(loop), str(lib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            untraced = ns_per_call(proc, args.pairs, args.rounds)
            collector = CudaAllocCollector(CudaConfig(), [Backend(name="bench", url="http://127.0.0.1:1", pid=proc.pid)])
            try:
                STATS.write_text("1")
                traced = ns_per_call(proc, args.pairs, args.rounds)
                stats = program_stats()
                samples = {s.name: s.value for s in collector.collect(0.0) if s.subject == "bench"}
            finally:
                STATS.write_text(saved)
                collector.close()
        finally:
            proc.kill()
            proc.wait()
    calls = 2 * args.pairs * args.rounds
    print(f"calls per phase: {calls} ({args.rounds} rounds of {args.pairs} alloc+free pairs)")
    print(f"untraced: {untraced:.1f} ns/call   traced: {traced:.1f} ns/call   overhead: {traced - untraced:.1f} ns/call")
    for name, (cnt, ns) in sorted(stats.items()):
        print(f"  bpf {name:<16} run_cnt {cnt:>9}  {ns / cnt:7.1f} ns/run")
    print(f"collector saw cuda_alloc_total={samples['cuda_alloc_total']} cuda_free_total={samples['cuda_free_total']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
