#!/usr/bin/env python3
"""Soak: the llmdiag agent for a long run against 16 fake engines under changing load and scripted faults.

    .venv/bin/python bench/soak_agent.py --duration 1860          # the recorded run (31 minutes)
    .venv/bin/python bench/soak_agent.py --duration 120 --out /tmp/soak.json --plots /tmp   # a quick try

Three processes, so the agent is measured alone:

* the **fleet** (this script with ``fleet``): 16 fake vLLM engines (``llmdiag.sim.fake_engine``)
  on 127.0.0.1 and a Poisson load over them that changes every few minutes (light 1 req/s,
  busy 4 req/s, burst 8 req/s, in a 10-minute cycle), with keep-alive connections;
* the **agent**: ``llmdiag agent --backend URL x16 --interval 1`` with every collector it can run
  here (BPF ones included, as root), exactly as a user starts it;
* this **driver**: every ``--sample`` seconds it reads the agent's RSS, CPU time and open
  descriptors from /proc, its ``/metrics`` (tick duration histogram -> p50/p99 per interval from
  bucket deltas, ticks, missed ticks), and every 60 s the entries of the agent's BPF maps
  (``bpftool map show/dump``, maps whose owner pid is the agent); every 0.25 s it polls
  ``/v1/penalties`` over one kept-alive connection, as a gateway does, to time the detection of
  each scripted fault (fault start -> the faulted backend's penalty > 0 or state not
  healthy/warming) and to count penalties on healthy backends.

Faults (seconds from the fleet's start): every 150 s from 180 s a different engine loses its KV
cache and slows down, stalls, crashes and restarts cold, or is throttled hard (``FAULTS``). Output: a JSON file with every sample
and a summary, and PNG plots (``soak_resources.png``, ``soak_ticks.png``, ``soak_detection.png``).
Exit 64 on a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EX_USAGE = 64
REPO = Path(__file__).resolve().parents[1]

# Faults, one every 150 s from 180 s on, each on its own engine and lasting 90 s, cycling through
# what an engine does when it goes bad: KV cache lost + throttled, a hung step loop, a crash with a
# cold restart, a hard throttle. (engine index, fault text for parse_faults, start s from t0)
_KINDS = [
    "kv_shrink:start={t},duration=90,factor=0.1;slowdown:start={t},duration=90,speed=0.3",
    "stall:start={t},duration=90",
    "crash:start={t},down=30",
    "slowdown:start={t},duration=90,speed=0.05",
]
FAULTS = [((1 + 5 * k) % 16, _KINDS[k % len(_KINDS)], 180.0 + 150.0 * k) for k in range(11)]
# 10-minute load cycle: (seconds into the cycle where the phase starts, requests per second, name)
LOAD_CYCLE = [(0, 1.0, "light"), (300, 4.0, "busy"), (420, 8.0, "burst"), (480, 1.0, "light")]
CYCLE_S = 600


def scaled_faults(scale: float) -> list[tuple[int, str, float]]:
    """FAULTS with start times multiplied by ``scale`` (a quick try compresses the schedule)."""
    return [(i, text, round(start * scale, 1)) for i, text, start in FAULTS]


def load_phase(elapsed: float, scale: float = 1.0) -> tuple[float, str]:
    into = (elapsed / scale) % CYCLE_S
    rate, name = LOAD_CYCLE[0][1], LOAD_CYCLE[0][2]
    for start, r, n in LOAD_CYCLE:
        if into >= start:
            rate, name = r, n
    return rate, name


# -- the fleet process --------------------------------------------------------------------------


async def _fleet_main(engines: int, ready_file: Path, duration: float, seed: int, scale: float) -> None:
    import aiohttp  # noqa: PLC0415

    from llmdiag.sim.demo_fleet import sample_lengths  # noqa: PLC0415
    from llmdiag.sim.fake_engine import FakeEngine, FakeEngineOptions  # noqa: PLC0415
    from llmdiag.sim.faults import parse_faults  # noqa: PLC0415

    faults = {index: text.format(t=start) for index, text, start in scaled_faults(scale) if index < engines}
    fleet = []
    for i in range(engines):
        engine = FakeEngine(FakeEngineOptions(port=0, model="fake/llama-8b", profile="llama3-8b-a100",
                                              kv_capacity_tokens=16_000, faults=parse_faults(faults.get(i, "")),
                                              seed=seed + i))
        await engine.start()
        fleet.append(engine)
    t0 = time.time()
    ready_file.write_text(json.dumps({"t0": t0, "urls": [e.url for e in fleet]}))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    tasks: set[asyncio.Task[None]] = set()

    async def one(session: aiohttp.ClientSession, url: str) -> None:
        prompt, output = sample_lengths(rng)
        body = {"model": "fake/llama-8b", "prompt_tokens": prompt, "max_tokens": min(output, 256), "stream": False}
        try:
            async with asyncio.timeout(30):
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    await resp.read()
                    key = str(resp.status)
        except TimeoutError:
            key = "timeout"
        except aiohttp.ClientError:
            key = "connect_error"
        counts[key] = counts.get(key, 0) + 1

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.monotonic()
        i = 0
        while not stop.is_set() and time.monotonic() - start < duration:
            rate, _ = load_phase(time.time() - t0, scale)
            task = asyncio.create_task(one(session, fleet[i % engines].url))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            try:
                await asyncio.wait_for(stop.wait(), timeout=rng.expovariate(rate))
            except TimeoutError:
                pass
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for engine in fleet:
        await engine.stop()
    ready_file.with_suffix(".counts.json").write_text(json.dumps(counts))


# -- the driver ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback only
        return resp.read()


def proc_stats(pid: int) -> dict[str, float]:
    """RSS, peak RSS, CPU seconds (user+system) and open descriptors of ``pid`` from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = {line.split(":")[0]: line.split(":")[1].strip() for line in status.splitlines() if ":" in line}
    stat = Path(f"/proc/{pid}/stat").read_text()
    after = stat[stat.rfind(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
        "rss_peak_bytes": int(fields["VmHWM"].split()[0]) * 1024,
        "cpu_seconds": (int(after[11]) + int(after[12])) / ticks,
        "open_fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
    }


def parse_metrics(text: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    out: dict[str, Any] = {"tick_buckets": {}, "series": 0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out["series"] += 1
            if sample.name == "llmdiag_tick_duration_seconds_bucket":
                out["tick_buckets"][float(sample.labels["le"])] = sample.value
            elif sample.name in ("llmdiag_ticks_total", "llmdiag_ticks_missed_total", "llmdiag_last_tick_timestamp_seconds"):
                out[sample.name] = sample.value
    return out


def bucket_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile over cumulative ``le -> count`` buckets (linear within a bucket)."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in items:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return items[-1][0]


def agent_map_ids(pid: int) -> dict[int, dict[str, str]]:
    """BPF maps held open by ``pid``: map id -> its fdinfo (``map_type``, ``max_entries``...).

    /proc/PID/fdinfo of an ``anon_inode:bpf-map`` descriptor names the map id; Debian's bpftool is
    built without the "pids" column that would say the same."""
    out: dict[int, dict[str, str]] = {}
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(fd_dir / fd) != "anon_inode:bpf-map":
                continue
            info = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        info = {k.strip(): v.strip() for k, v in info.items()}
        if "map_id" in info:
            out[int(info["map_id"])] = info
    return out


def bpf_maps(pid: int) -> dict[str, int] | None:
    """Entries per hash-like BPF map of ``pid`` (-1 for arrays and buffers, whose size is fixed); None without bpftool."""
    try:
        shown = json.loads(subprocess.run(["bpftool", "-j", "map", "show"], capture_output=True, text=True,
                                          timeout=20, check=True).stdout or "[]")
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
        return None
    ids = agent_map_ids(pid)
    out: dict[str, int] = {}
    for m in shown:
        if m["id"] not in ids:
            continue
        name = f"{m.get('name', '?')}#{m['id']}"
        if "array" in m.get("type", "") or "perf" in m.get("type", "") or "ringbuf" in m.get("type", ""):
            out[name] = -1
            continue
        try:
            dump = subprocess.run(["bpftool", "-j", "map", "dump", "id", str(m["id"])], capture_output=True, text=True,
                                  timeout=30, check=True).stdout
            out[name] = len(json.loads(dump or "[]"))
        except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
            out[name] = -2
    return out


@dataclass
class FaultWatch:
    engine: int
    text: str
    start: float  # seconds from the fleet's t0
    backend: str = ""
    detected_after: float | None = None


def penalty_poller(url: str, token: str, t0: float, watches: list[FaultWatch], stop: threading.Event,
                   out: dict[str, Any]) -> None:
    """Times each fault's detection; counts penalised backend-polls with no fault active on them."""
    active_until = {w.backend: (w.start, w.start + _fault_span(w.text)) for w in watches}
    false_polls = polls = 0
    # One kept-alive connection, as a gateway polls (a new one after any failure): a connection
    # per poll would add the agent's accept and set-up work four times a second to what is measured.
    parts = urllib.parse.urlsplit(url)
    conn: http.client.HTTPConnection | None = None
    while not stop.wait(0.25):
        try:
            if conn is None:
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=2)
            conn.request("GET", parts.path, headers={"Authorization": f"Bearer {token}"})
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                continue
            doc = json.loads(body)
        except (OSError, ValueError, http.client.HTTPException):
            if conn is not None:
                conn.close()
            conn = None
            continue
        now = time.time() - t0
        for entry in doc.get("backends", []):
            bad = entry.get("penalty", 0) > 0 or entry.get("state") not in ("healthy", "warming")
            polls += 1
            span = active_until.get(entry["name"])
            # a fault's effects outlive it (queues drain, a restarted engine warms up): 120 s of grace
            in_fault = span is not None and span[0] <= now <= span[1] + 120
            if bad and not in_fault:
                false_polls += 1
            for w in watches:
                if w.backend == entry["name"] and w.detected_after is None and now >= w.start and bad:
                    w.detected_after = now - w.start
    if conn is not None:
        conn.close()
    out["penalised_outside_faults"] = false_polls
    out["backend_polls"] = polls


def _fault_span(text: str) -> float:
    from llmdiag.sim.faults import parse_faults  # noqa: PLC0415

    schedule = parse_faults(text)
    return max((f.duration if math.isfinite(f.duration) else 0.0) for f in schedule.faults)


def run(args: argparse.Namespace) -> int:
    token = "soak-" + os.urandom(8).hex()
    work = Path(args.workdir or f"/tmp/llmdiag-soak-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    (work / "token").write_text(token + "\n")
    ready = work / "fleet.json"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": args.pythonpath or str(REPO)}
    fleet = subprocess.Popen([sys.executable, __file__, "fleet", "--engines", str(args.engines), "--ready", str(ready),
                              "--duration", str(args.duration + 120), "--seed", str(args.seed),
                              "--time-scale", str(args.time_scale)],
                             env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=open(work / "fleet.log", "w"))  # noqa: SIM115
    agent = None
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if fleet.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not start: {(work / 'fleet.log').read_text()[-2000:]}")
            time.sleep(0.2)
        time.sleep(0.2)
        info = json.loads(ready.read_text())
        t0, urls = info["t0"], info["urls"]
        http_port, check_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "llmdiag.cli", "agent", "--listen", f"127.0.0.1:{http_port}",
               "--agent-check", f"127.0.0.1:{check_port}", "--token-file", str(work / "token"), "--interval", "1"]
        for url in urls:
            cmd += ["--backend", url]
        agent_started = time.time()
        # cwd=work: `python -m` puts the working directory first on sys.path, before PYTHONPATH.
        agent = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=open(work / "agent.log", "w"))  # noqa: SIM115
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 180
        while True:
            if agent.poll() is not None:
                raise RuntimeError(f"the agent exited ({agent.returncode}): {(work / 'agent.log').read_text()[-3000:]}")
            try:
                http_get(f"{base}/healthz")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the agent never answered /healthz") from None
                time.sleep(0.5)
        ready_after = time.time() - agent_started
        names = {url: url.split("//", 1)[1] for url in urls}  # --backend URL names the backend host:port
        watches = [FaultWatch(i, text.format(t=start), start, names[urls[i]]) for i, text, start in scaled_faults(args.time_scale)
                   if i < len(urls)]
        stop = threading.Event()
        poll_out: dict[str, Any] = {}
        poller = threading.Thread(target=penalty_poller, args=(f"{base}/v1/penalties", token, t0, watches, stop, poll_out),
                                  daemon=True)
        poller.start()
        samples: list[dict[str, Any]] = []
        maps: list[dict[str, Any]] = []
        prev: dict[str, Any] | None = None
        end = time.monotonic() + args.duration
        next_maps = 0.0
        print(f"soak: agent pid {agent.pid} ready after {ready_after:.1f} s; {len(urls)} engines; "
              f"{args.duration:.0f} s", file=sys.stderr, flush=True)
        while time.monotonic() < end:
            if agent.poll() is not None:
                raise RuntimeError(f"the agent died ({agent.returncode}): {(work / 'agent.log').read_text()[-3000:]}")
            now = time.time()
            stats = proc_stats(agent.pid)
            req = urllib.request.Request(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:  # noqa: S310
                    metrics = parse_metrics(resp.read().decode())
            except OSError as exc:
                metrics = {"error": str(exc), "tick_buckets": {}}
            sample: dict[str, Any] = {"t": now - t0, "phase": load_phase(now - t0, args.time_scale)[1], **stats,
                                      "series": metrics.get("series"),
                                      "ticks_total": metrics.get("llmdiag_ticks_total"),
                                      "ticks_missed_total": metrics.get("llmdiag_ticks_missed_total")}
            if prev is not None:
                dt = now - prev["wall"]
                sample["cpu_percent"] = 100.0 * (stats["cpu_seconds"] - prev["cpu_seconds"]) / dt
                delta = {le: c - prev["buckets"].get(le, 0.0) for le, c in metrics["tick_buckets"].items()}
                sample["tick_p50_s"] = bucket_quantile(0.5, delta)
                sample["tick_p99_s"] = bucket_quantile(0.99, delta)
            samples.append(sample)
            prev = {"wall": now, "cpu_seconds": stats["cpu_seconds"], "buckets": metrics["tick_buckets"]}
            if time.monotonic() >= next_maps:
                entries = bpf_maps(agent.pid)
                if entries is not None:
                    maps.append({"t": now - t0, "entries": entries})
                next_maps = time.monotonic() + 60
            time.sleep(max(0.0, args.sample - (time.time() - now)))
        stop.set()
        poller.join(timeout=5)
        stop_started = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        try:
            agent_rc = agent.wait(timeout=15)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent_rc = None
        stop_seconds = time.monotonic() - stop_started
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
        fleet.send_signal(signal.SIGTERM)
        try:
            fleet.wait(timeout=30)
        except subprocess.TimeoutExpired:
            fleet.kill()
    counts_file = ready.with_suffix(".counts.json")
    load_counts = json.loads(counts_file.read_text()) if counts_file.exists() else {}
    result = {
        "command": " ".join(["bench/soak_agent.py", *sys.argv[1:]]),
        "engines": len(urls), "duration_s": args.duration, "sample_interval_s": args.sample, "time_scale": args.time_scale,
        "agent_ready_after_s": ready_after, "agent_exit_code_on_sigterm": agent_rc, "agent_stop_seconds": stop_seconds,
        "load_responses": load_counts, "faults": [w.__dict__ for w in watches], **poll_out,
        "samples": samples, "bpf_maps": maps, "summary": summarise(samples, maps, watches),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    if args.plots:
        plot(result, Path(args.plots))
    return 0


def summarise(samples: list[dict[str, Any]], maps: list[dict[str, Any]], watches: list[FaultWatch]) -> dict[str, Any]:
    def pct(values: list[float], q: float) -> float | None:
        values = sorted(v for v in values if v is not None)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    # after the first 2 minutes (compile, warm-up, first scrapes)
    steady = [s for s in samples if s["t"] >= samples[0]["t"] + 120] or samples
    rss = [s["rss_bytes"] for s in steady]
    fds = [s["open_fds"] for s in steady]
    light = [s["cpu_percent"] for s in steady if s.get("cpu_percent") is not None and s["phase"] == "light"]
    allcpu = [s["cpu_percent"] for s in steady if s.get("cpu_percent") is not None]
    half = len(steady) // 2
    first_half, second_half = steady[:half] or steady, steady[half:] or steady
    hash_maps: dict[str, list[int]] = {}
    for m in maps:
        for name, n in m["entries"].items():
            if n >= 0:
                hash_maps.setdefault(name, []).append(n)
    last = samples[-1]
    return {
        "rss_mb": {"min": min(rss) / 1e6, "max": max(rss) / 1e6, "first_half_mean": statistics.mean(s["rss_bytes"] for s in first_half) / 1e6,
                   "second_half_mean": statistics.mean(s["rss_bytes"] for s in second_half) / 1e6,
                   "peak_incl_start_mb": max(s["rss_peak_bytes"] for s in samples) / 1e6},
        "open_fds": {"min": min(fds), "max": max(fds)},
        "cpu_percent_of_a_core": {"light_mean": statistics.mean(light) if light else None, "light_p50": pct(light, 0.5),
                                  "all_mean": statistics.mean(allcpu) if allcpu else None, "all_p99": pct(allcpu, 0.99)},
        "tick_seconds": {"p50_median": pct([s.get("tick_p50_s") for s in steady], 0.5),
                         "p99_median": pct([s.get("tick_p99_s") for s in steady], 0.5),
                         "p99_max": max((s.get("tick_p99_s") or 0.0) for s in steady)},
        "ticks_total": last.get("ticks_total"), "ticks_missed_total": last.get("ticks_missed_total"),
        "bpf_map_entries": {name: {"first": v[0], "last": v[-1], "max": max(v)} for name, v in hash_maps.items()},
        "detection_s": {f"{w.text.split(':')[0]}@{w.start:.0f}s": w.detected_after for w in watches},
    }


def plot(result: dict[str, Any], folder: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    folder.mkdir(parents=True, exist_ok=True)
    s = result["samples"]
    t = [x["t"] / 60 for x in s]
    fault_lines = [(w["start"] / 60, w["text"].split(":")[0]) for w in result["faults"]]

    def mark_faults(ax: Any) -> None:
        for x, label in fault_lines:
            ax.axvline(x, color="tab:red", alpha=0.3, linestyle="--")
            ax.text(x, ax.get_ylim()[1], label, rotation=90, va="top", ha="right", fontsize=7, color="tab:red")

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    axes[0].plot(t, [x["rss_bytes"] / 1e6 for x in s], label="RSS")
    axes[0].axhline(150, color="gray", linestyle=":", label="target 150 MB")
    axes[0].set_ylabel("MB")
    axes[0].legend(loc="lower right")
    axes[1].plot(t, [x.get("cpu_percent") for x in s], label="agent CPU", color="tab:orange")
    axes[1].axhline(2, color="gray", linestyle=":", label="target 2 % (light traffic)")
    axes[1].set_ylabel("% of one core")
    axes[1].legend(loc="upper right")
    axes[2].plot(t, [x["open_fds"] for x in s], label="open fds", color="tab:green")
    axes[2].plot(t, [x["threads"] for x in s], label="threads", color="tab:olive")
    axes[2].set_ylabel("count")
    axes[2].legend(loc="lower right")
    for name in sorted({n for m in result["bpf_maps"] for n, v in m["entries"].items() if v >= 0}):
        axes[3].plot([m["t"] / 60 for m in result["bpf_maps"]], [m["entries"].get(name) for m in result["bpf_maps"]],
                     marker=".", label=name)
    axes[3].set_ylabel("BPF map entries")
    axes[3].set_xlabel("minutes")
    if result["bpf_maps"]:
        axes[3].legend(loc="upper left", fontsize=7, ncol=2)
    for ax in axes:
        mark_faults(ax)
    fig.suptitle(f"llmdiag agent soak: {result['engines']} fake engines, {result['duration_s'] / 60:.0f} min")
    fig.tight_layout()
    fig.savefig(folder / "soak_resources.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(t, [(x.get("tick_p50_s") or float("nan")) * 1000 for x in s], label="tick p50")
    ax.plot(t, [(x.get("tick_p99_s") or float("nan")) * 1000 for x in s], label="tick p99")
    ax.axhline(50, color="gray", linestyle=":", label="target 50 ms")
    ax.set_ylabel("ms per tick (per sample interval)")
    ax.set_xlabel("minutes")
    ax.legend(loc="upper right")
    mark_faults(ax)
    fig.tight_layout()
    fig.savefig(folder / "soak_ticks.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{w['text'].split(':')[0]}\n@{w['start'] / 60:.0f} min" for w in result["faults"]]
    values = [w["detected_after"] if w["detected_after"] is not None else float("nan") for w in result["faults"]]
    ax.bar(labels, values, color="tab:purple")
    ax.axhline(2, color="gray", linestyle=":", label="target 2 s")
    for i, v in enumerate(values):
        ax.text(i, 0 if math.isnan(v) else v, "missed" if math.isnan(v) else f"{v:.1f} s", ha="center", va="bottom")
    ax.set_ylabel("fault -> penalty in /v1/penalties (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "soak_detection.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fleet"]:
        p = argparse.ArgumentParser(prog="soak_agent.py fleet")
        p.add_argument("--engines", type=int, required=True)
        p.add_argument("--ready", type=Path, required=True)
        p.add_argument("--duration", type=float, required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--time-scale", type=float, default=1.0)
        a = p.parse_args(argv[1:])
        asyncio.run(_fleet_main(a.engines, a.ready, a.duration, a.seed, a.time_scale))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=1860.0, help="seconds of soak after the agent is ready (default 1860)")
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between resource samples (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply fault times and the load cycle by this (0.1 for a quick try; default 1)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "soak_agent.json"))
    parser.add_argument("--plots", default=str(REPO / "docs"), help="folder for the PNG plots ('' for none)")
    parser.add_argument("--workdir", help="folder for logs and the token (default /tmp/llmdiag-soak-PID)")
    parser.add_argument("--pythonpath", help="PYTHONPATH for the agent and the fleet (default: this checkout)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EX_USAGE if exc.code not in (0, None) else 0
    if not (args.duration > 0 and args.sample > 0 and args.time_scale > 0 and 1 <= args.engines <= 64):
        print("soak_agent.py: --duration, --sample and --time-scale must be > 0, --engines 1..64", file=sys.stderr)
        return EX_USAGE
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
