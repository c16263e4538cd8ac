"""What ``llmdiag agent`` costs per tick: 16 fake-engine backends, every collector, light traffic.

    PYTHONPATH=. .venv/bin/python bench/bench_agent_cost.py --backends 16 --seconds 60    # as root, ~2 min

Set-up: ``--backends`` fake engines (``llama3-8b-h100`` preset) on 127.0.0.1 with a light
Poisson load over them (``--rate`` requests/s in all, streamed completions), and one
``llmdiag agent`` with its defaults (1 s ticks, every collector that can run here: engine,
proc, tcp, timewait, http2, cuda; gpu is unavailable without NVML) watching all of them, as
a user runs it. After the BPF programs are attached and 5 s of warm-up, for ``--seconds``:

* CPU: the agent process's utime + stime (``/proc/PID/stat``) over wall time, in % of one core;
* RSS: ``VmRSS`` at the end and ``VmHWM`` (peak) from ``/proc/PID/status``, split into ``RssAnon``
  (the agent's own memory) and ``RssFile`` (mapped libraries: bcc's LLVM when BPF runs), and how
  many *other* processes map libLLVM at the end (their shared pages stay in the agent's RSS: the
  agent's ``MADV_PAGEOUT`` after compiling skips pages another process maps, see llmdiag.bpf.memory);
* tick duration (collection + analysis): the agent's own ``llmdiag_tick_duration_seconds``
  histogram over the window (mean, share of ticks <= 50 ms, the bucket holding p99), and
  ``llmdiag_ticks_missed_total``; each collector's median ``llmdiag_collector_duration_seconds``
  (read every 5 s).

``--collectors engine,proc,timewait`` measures the same without the BPF collectors.

``--profile FILE`` also samples the agent with py-spy (``pip install py-spy``) over the measured
window (100 Hz, samples holding the GIL only, i.e. the agent's Python CPU; time inside a syscall
such as the sock_diag walk is not in it), writes py-spy's raw collapsed stacks to ``FILE`` and a
flat profile next to it (``FILE.flat.txt``: inclusive and self shares of the samples per llmdiag
function, and self shares per file). py-spy pauses the agent for each sample, so the CPU and tick
figures of a profiled run are not comparable with an unprofiled one.

Results: ``bench/results/agent_cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from agent_support import AgentProcess, fake_engines, http  # noqa: E402

RESULTS = REPO / "bench" / "results" / "agent_cost.json"


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid`` (``utime``, ``stime`` in ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def processes_mapping(fragment: str, but: int) -> int:
    """Processes other than ``but`` with a mapping whose path contains ``fragment``."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == but:
            continue
        try:
            if fragment in (entry / "maps").read_text():
                count += 1
        except OSError:
            continue
    return count


def histogram(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http(url + "/metrics")
    assert status == 200, status
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == "llmdiag_tick_duration_seconds_bucket":
                out[f"le={s.labels['le']}"] = s.value
            elif s.name in ("llmdiag_tick_duration_seconds_sum", "llmdiag_tick_duration_seconds_count",
                            "llmdiag_ticks_missed_total"):
                out[s.name] = s.value
            elif s.name == "llmdiag_collector_duration_seconds":
                out[f"collector={s.labels['collector']}"] = s.value
    return out


def start_profiler(pid: int, seconds: float, raw: Path) -> subprocess.Popen[bytes]:
    """py-spy on ``pid`` for ``seconds``: collapsed stacks of the samples that hold the GIL."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    return subprocess.Popen([spy, "record", "-p", str(pid), "-o", str(raw), "-f", "raw", "-r", "100",
                             "-d", str(max(1, int(seconds))), "--gil"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _frame_key(frame: str) -> tuple[str, str]:
    """``"collect (llmdiag/collectors/engine.py:270)"`` -> ``("collect", "llmdiag/collectors/engine.py")``."""
    name, _, where = frame.rpartition(" (")
    return (name or frame), where.rstrip(")").rsplit(":", 1)[0]


def flat_profile(raw: Path, top: int = 40) -> str:
    """Inclusive and self shares of py-spy's collapsed stacks ("f1;f2;...;fn COUNT" per line)."""
    total = 0
    inclusive: dict[tuple[str, str], int] = {}
    self_fn: dict[tuple[str, str], int] = {}
    self_file: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_frame_key(f) for f in stack.split(";")]
        for key in set(frames):
            if "llmdiag" in key[1]:
                inclusive[key] = inclusive.get(key, 0) + count
        leaf = frames[-1]
        self_fn[leaf] = self_fn.get(leaf, 0) + count
        self_file[leaf[1]] = self_file.get(leaf[1], 0) + count
    if not total:
        return "no samples (was py-spy allowed to attach? run as root)\n"

    def table(title: str, counts: dict, label) -> list[str]:
        rows = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        return [title] + [f"{100 * n / total:6.1f} %  {label(k)}" for k, n in rows] + [""]

    out = [f"{total} samples holding the GIL", ""]
    out += table("inclusive, llmdiag functions:", inclusive, lambda k: f"{k[0]} ({k[1]})")
    out += table("self, functions:", self_fn, lambda k: f"{k[0]} ({k[1]})")
    out += table("self, files:", self_file, lambda k: k)
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s over all backends (default 4)")
    parser.add_argument("--collectors", default="", metavar="A,B",
                        help="[agent] collectors (default: all; e.g. engine,proc,timewait to see the cost without BPF)")
    parser.add_argument("--profile", metavar="FILE", default=None,
                        help="also sample the agent with py-spy; raw stacks to FILE, flat profile to FILE.flat.txt")
    parser.add_argument("--out", default=str(RESULTS), help=f"results file (default {RESULTS.relative_to(REPO)})")
    args = parser.parse_args()
    # SIGTERM (timeout, Ctrl-C elsewhere) unwinds through the finally blocks: no orphaned servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="llmdiag-bench-cost-"))
    with fake_engines([[] for _ in range(args.backends)]) as urls:
        names = [n.strip() for n in args.collectors.split(",") if n.strip()]
        config = f"[agent]\ncollectors = {json.dumps(names)}\n" if names else ""
        agent = AgentProcess([a for u in urls for a in ("--backend", u)], tmp, config=config, agent_check=False)
        stop_load = threading.Event()

        def load() -> None:
            from llmdiag.sim.demo_fleet import run_load

            async def go() -> None:
                done = asyncio.Event()
                asyncio.get_running_loop().run_in_executor(None, lambda: (stop_load.wait(), done.set()))
                await run_load(urls, "fake/llama3-8b", args.rate, 3600, client_timeout_s=30, stop=done)

            asyncio.run(go())

        try:
            agent.wait_ready(ticks=3, timeout=300)
            threading.Thread(target=load, daemon=True).start()
            time.sleep(5)
            state = agent.state()
            pid = agent.proc.pid
            h0, c0, t0 = histogram(agent.url), cpu_times(pid), time.monotonic()
            profiler = start_profiler(pid, args.seconds, Path(args.profile)) if args.profile else None
            per_collector: dict[str, list[float]] = {}
            while time.monotonic() - t0 < args.seconds:
                time.sleep(min(5.0, max(0.0, args.seconds - (time.monotonic() - t0))))
                for key, value in histogram(agent.url).items():
                    if key.startswith("collector="):
                        per_collector.setdefault(key[len("collector="):], []).append(value)
            h1, c1, t1 = histogram(agent.url), cpu_times(pid), time.monotonic()
            rss, hwm = status_kib(pid, "VmRSS"), status_kib(pid, "VmHWM")
            anon, file_backed = status_kib(pid, "RssAnon"), status_kib(pid, "RssFile")
            llvm_sharers = processes_mapping("/libLLVM", pid)
            if profiler is not None:
                _, err = profiler.communicate(timeout=60)
                if profiler.returncode != 0:
                    print(f"py-spy failed: {err.decode(errors='replace')[-500:]}", file=sys.stderr)
        finally:
            stop_load.set()
            code, log, took = agent.stop()
    count = h1["llmdiag_tick_duration_seconds_count"] - h0["llmdiag_tick_duration_seconds_count"]
    buckets = sorted(((float(k[3:]), h1[k] - h0.get(k, 0.0)) for k in h1 if k.startswith("le=")),
                     key=lambda kv: kv[0])
    p99_bucket = next(le for le, n in buckets if n >= 0.99 * count)
    result = {
        "backends": args.backends,
        "seconds": round(t1 - t0, 1),
        "collectors": {name: c["status"] for name, c in sorted(state["collectors"].items())},
        "cpu_percent_of_one_core": round(100 * (sum(c1) - sum(c0)) / (t1 - t0), 2),
        # user: the agent's Python and libraries; system: the kernel working for it (/proc files,
        # sock_diag walks, bpf() map reads, socket I/O, thread wake-ups)
        "cpu_user_percent": round(100 * (c1[0] - c0[0]) / (t1 - t0), 2),
        "cpu_system_percent": round(100 * (c1[1] - c0[1]) / (t1 - t0), 2),
        "rss_mib": round(rss / 1024, 1),
        "peak_rss_mib": round(hwm / 1024, 1),
        "rss_anon_mib": round(anon / 1024, 1),  # the agent's own heap
        "rss_file_mib": round(file_backed / 1024, 1),  # mapped libraries (bcc's LLVM when BPF is on), shared
        "other_processes_mapping_libllvm": llvm_sharers,
        "load_average": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "ticks": int(count),
        "tick_mean_ms": round(1000 * (h1["llmdiag_tick_duration_seconds_sum"] - h0["llmdiag_tick_duration_seconds_sum"])
                              / max(count, 1), 2),
        "ticks_within_50ms_percent": round(100 * dict(buckets)[0.05] / max(count, 1), 1),
        "tick_p99_at_most_ms": p99_bucket * 1000 if p99_bucket != float("inf") else None,
        "ticks_missed": int(h1["llmdiag_ticks_missed_total"] - h0["llmdiag_ticks_missed_total"]),
        "collector_ms_median": {name: round(1000 * statistics.median(v), 1) for name, v in sorted(per_collector.items())},
        "agent_exit": code,
        "agent_stop_seconds": round(took, 2),
        "machine": f"{os.cpu_count()} CPUs, shared with other jobs",
    }
    if args.profile and Path(args.profile).exists():
        flat = Path(args.profile + ".flat.txt")
        flat.write_text(flat_profile(Path(args.profile)))
        result["profile"] = {"raw": args.profile, "flat": str(flat)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
