"""One fake engine on the wall clock against the same engine model on the simulator's virtual clock.

    .venv/bin/python bench/bench_fake_engine_fidelity.py                 # ~80 s; bench/results/fake_engine_fidelity.json
    .venv/bin/python bench/bench_fake_engine_fidelity.py --offset 0 --speed 1 --out /tmp/fid

The controlled experiment behind the routing benchmark's gap to the simulator
(docs/benchmarks.md, "Routing on live engines"): the schedule that
``bench/bench_gateway_routing.py`` offers to its ``--engines`` engines, of which
one engine's round-robin share (every ``--engines``-th request from
``--offset``) is sent straight to one ``llmdiag fake-engine`` process, slowed to
``--speed`` at ``--fault-at`` seconds of load time. The fault is lined up with
the load through the engine's ``process_start_time_seconds`` (the origin of its
fault clock). The same requests then go through the engine model on a virtual
clock, driven the way :class:`llmdiag.sim.cluster.ClusterSim` drives it (a step
starts when the engine is idle and a request arrives, or when the previous step
ends; clients hang up after ``--timeout`` seconds without a first token).

Compared: the waiting queue over time (the live one scraped from ``/metrics``
every ``--sample`` seconds, the simulated one at the same instants), served
output tokens per second, engine steps, and the TTFT distribution, also paired
request by request.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_common import MODEL, Fleet, free_port  # noqa: E402

from llmdiag.gateway.loadgen import LoadRequest, percentile, run_load, schedule_from_trace  # noqa: E402
from llmdiag.sim.cluster import measure_capacity  # noqa: E402
from llmdiag.sim.engine_model import DECODE, PRESETS, EngineModel, SimRequest  # noqa: E402
from llmdiag.sim.faults import Fault, FaultSchedule  # noqa: E402
from llmdiag.sim.workload import load_trace  # noqa: E402

#: Series scraped from the live engine (gauges and counters of its /metrics).
SCRAPED = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:generation_tokens_total",
           "vllm:iteration_tokens_total_count", "process_start_time_seconds")


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=2.0) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SCRAPED:
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def simulate(schedule: list[LoadRequest], preset: str, faults: FaultSchedule, timeout: float,
             sample_at: list[float]) -> dict:
    """The engine model alone on a virtual clock, as ClusterSim drives one engine."""
    eng = EngineModel(PRESETS[preset])
    reqs = [SimRequest(i, r.prompt_tokens, r.output_tokens, r.at) for i, r in enumerate(schedule)]
    events: list[tuple[float, int, int, object]] = []  # (t, order, kind, payload); kinds below
    ARRIVE, FAULT, STEP, TIMEOUT, SAMPLE = 0, 1, 2, 3, 4
    seq = 0

    def push(t: float, kind: int, payload: object = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    for r in reqs:
        push(r.arrival, ARRIVE, r)
    for t in faults.transitions():
        push(t, FAULT)
    for t in sample_at:
        push(t, SAMPLE)
    stepping = False
    samples: list[dict[str, float]] = []

    def start_step(now: float) -> None:
        nonlocal stepping
        dur = eng.plan_step(now)
        eng.take_failed()
        stepping = dur is not None
        if dur is not None:
            push(now + dur, STEP)

    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == ARRIVE:
            eng.submit(payload, t)  # type: ignore[arg-type]
            push(t + timeout, TIMEOUT, payload)
            if not stepping:
                start_step(t)
        elif kind == FAULT:
            faults.apply(eng, t)
        elif kind == STEP:
            eng.commit_step(t)
            start_step(t)
        elif kind == TIMEOUT:
            req: SimRequest = payload  # type: ignore[assignment]
            if req.first_token_at is None:
                eng.abort(req)
                if not stepping:
                    start_step(t)
        else:
            samples.append({"t": t, "waiting": eng.num_waiting, "running": eng.num_running,
                            "generation_tokens": _tokens_out(eng), "steps": eng.steps_total})
    ttft = [None if r.first_token_at is None else r.first_token_at - r.arrival for r in reqs]
    return {"ttft": ttft, "samples": samples, "steps": eng.steps_total,
            "generation_tokens": eng.generation_tokens_total, "busy_s": eng.busy_seconds_total}


def _tokens_out(eng: EngineModel) -> int:
    """Output tokens produced so far, as the fake engine counts them (per token streamed,
    not per finished request as the model's own counter does)."""
    done = eng.generation_tokens_total
    for req in eng.running.values():
        if req.state == DECODE:
            done += min(req.output, req.gen + eng.decode_steps - req.doff)
    return done


class CpuLimit:
    """Caps one process at a fraction of a CPU with a cgroup (v1 ``cpu`` controller or v2 ``cpu.max``),
    to see what a CPU-starved wall-clock driver does. Root only; removed on exit."""

    def __init__(self, pid: int, fraction: float) -> None:
        period = 100_000
        quota = max(1000, int(fraction * period))
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        if (v1 / "cpu.cfs_quota_us").exists():
            self.path = v1 / f"llmdiag-fidelity-{pid}"
            self.path.mkdir()
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            self.parent = v1
        elif (v2 / "cgroup.controllers").exists():
            self.path = v2 / f"llmdiag-fidelity-{pid}"
            self.path.mkdir()
            (self.path / "cpu.max").write_text(f"{quota} {period}")
            self.parent = v2
        else:
            raise SystemExit("--cpu-limit needs a writable cgroup cpu controller (v1 or v2)")
        (self.path / "cgroup.procs").write_text(str(pid))
        self.pid = pid

    def throttling(self) -> dict[str, float]:
        """The cgroup's ``cpu.stat`` (periods, throttled periods, throttled time): did the cap bite?"""
        try:
            text = (self.path / "cpu.stat").read_text()
        except OSError:
            return {}
        return {k: float(v) for k, v in (line.split() for line in text.splitlines() if len(line.split()) == 2)}

    def close(self) -> None:
        try:
            (self.parent / "cgroup.procs").write_text(str(self.pid))  # back to the root group, if still alive
        except OSError:
            pass
        try:
            self.path.rmdir()
        except OSError as exc:
            print(f"could not remove {self.path}: {exc}", file=sys.stderr)


def live(schedule: list[LoadRequest], args: argparse.Namespace, sample_at: list[float]) -> dict:
    lead = args.lead
    limit: CpuLimit | None = None
    try:
        with Fleet() as fleet:
            url = fleet.engine(free_port(), profile=args.preset,
                               faults=f"slowdown:start={args.fault_at + lead},speed={args.speed}", label="slow")
            if args.cpu_limit:
                limit = CpuLimit(fleet.procs[-1].pid, args.cpu_limit)
            run = _load(url, schedule, args, sample_at)
            if limit is not None:
                run["cpu_stat"] = limit.throttling()
            return run
    finally:
        if limit is not None:
            limit.close()


def _load(url: str, schedule: list[LoadRequest], args: argparse.Namespace, sample_at: list[float]) -> dict:
    """Run the schedule against the engine at ``url``, starting ``--lead`` seconds into its clock."""
    lead = args.lead
    start = scrape(url)["process_start_time_seconds"]
    # Start the load exactly ``lead`` seconds into the engine's clock: its fault then falls at
    # --fault-at seconds of load time, as in the simulated run.
    wait = start + lead - time.time()
    if wait < 0:
        raise SystemExit(f"the engine took longer than --lead {lead:g} s to come up; raise --lead")
    time.sleep(wait)
    t0 = time.monotonic()
    samples: list[dict[str, float]] = []
    done = threading.Event()

    def watch() -> None:
        for at in sample_at:
            if done.wait(max(0.0, t0 + at - time.monotonic())):
                return
            try:
                m = scrape(url)
            except OSError:
                continue
            samples.append({"t": round(time.monotonic() - t0, 3), "waiting": m["vllm:num_requests_waiting"],
                            "running": m["vllm:num_requests_running"],
                            "generation_tokens": m["vllm:generation_tokens_total"],
                            "steps": m["vllm:iteration_tokens_total_count"]})

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    report = asyncio.run(run_load([url], schedule, timeout=args.timeout, model=MODEL, duration_s=args.duration))
    done.set()
    watcher.join(5)
    final = scrape(url)
    return {"ttft": [r.ttft if r.status == "200" else None for r in report.results],
            "status": [r.status for r in report.results], "lag": [r.lag for r in report.results],
            "samples": samples, "steps": final["vllm:iteration_tokens_total_count"],
            "generation_tokens": final["vllm:generation_tokens_total"], "load": report.summary()}


def digest(run: dict, window: tuple[float, float]) -> dict:
    ttfts = [t for t in run["ttft"] if t is not None]
    lo, hi = window
    inside = [s for s in run["samples"] if lo <= s["t"] <= hi]
    served = ((inside[-1]["generation_tokens"] - inside[0]["generation_tokens"]) / (inside[-1]["t"] - inside[0]["t"])
              if len(inside) > 1 else None)
    steps = ((inside[-1]["steps"] - inside[0]["steps"]) / (inside[-1]["t"] - inside[0]["t"]) if len(inside) > 1 else None)
    waiting = [s["waiting"] for s in run["samples"]]
    return {"ttft_p50": _r(percentile(ttfts, 50)), "ttft_p90": _r(percentile(ttfts, 90)),
            "ttft_p99": _r(percentile(ttfts, 99)), "ttft_max": _r(max(ttfts) if ttfts else None),
            "no_first_token": sum(1 for t in run["ttft"] if t is None),
            "waiting_peak": max(waiting) if waiting else None,
            "waiting_mean": _r(sum(waiting) / len(waiting)) if waiting else None,
            "served_tokens_per_s": _r(served), "steps_per_s": _r(steps)}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4, help="engines the routing bench spreads the schedule over")
    parser.add_argument("--offset", type=int, default=3, help="which round-robin share: requests offset, offset+engines, ...")
    parser.add_argument("--preset", default="llama-70b-a100-tp8", choices=sorted(PRESETS))
    parser.add_argument("--trace", default="azure2023_conv")
    parser.add_argument("--utilization", type=float, default=0.8)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--fault-at", type=float, default=20.0, help="slowdown start, seconds of load time")
    parser.add_argument("--speed", type=float, default=0.4)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--lead", type=float, default=6.0, help="seconds of engine clock before the load starts")
    parser.add_argument("--sample", type=float, default=0.5, help="queue sampling interval (s)")
    parser.add_argument("--cpu-limit", type=float, default=None, metavar="CPUS",
                        help="cap the fake engine at this many CPUs (cgroup; root): a CPU-starved driver")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "fake_engine_fidelity"))
    args = parser.parse_args()

    trace = load_trace(args.trace, seed=args.seed)
    capacity = args.engines * measure_capacity(PRESETS[args.preset], trace, seconds=300, warmup=60)
    full = schedule_from_trace(trace.arrivals, trace.inputs, trace.outputs, args.utilization * capacity, args.duration)
    schedule = full[args.offset::args.engines]
    span = args.duration + 60.0
    sample_at = [round(k * args.sample, 3) for k in range(1, int(span / args.sample) + 1)]
    faults = FaultSchedule((Fault("slowdown", args.fault_at, speed=args.speed),))
    print(f"{len(schedule)} requests over {args.duration:g} s to one {args.preset} engine at {args.speed:g}x from "
          f"{args.fault_at:g} s (load average {os.getloadavg()[0]:.2f})", flush=True)
    sim = simulate(schedule, args.preset, faults, args.timeout, sample_at)
    liv = live(schedule, args, sample_at)
    window = (args.fault_at + 5.0, args.duration)
    result = {"set_up": vars(args), "requests": len(schedule), "load_average_after": os.getloadavg(),
              "live": digest(liv, window), "sim": digest(sim, window),
              "paired_ttft_live_minus_sim": None, "live_runs": liv, "sim_run": sim}
    pairs = [a - b for a, b in zip(liv["ttft"], sim["ttft"]) if a is not None and b is not None]
    result["paired_ttft_live_minus_sim"] = {"p50": _r(percentile(pairs, 50)), "p10": _r(percentile(pairs, 10)),
                                            "p90": _r(percentile(pairs, 90))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'':22}{'live':>10}{'sim':>10}")
    for key in result["live"]:
        print(f"{key:22}{_s(result['live'][key]):>10}{_s(result['sim'][key]):>10}")
    if "cpu_stat" in liv:
        print(f"engine cgroup cpu.stat: {liv['cpu_stat']}")
    print(f"paired TTFT live - sim: {result['paired_ttft_live_minus_sim']}; dispatch lag max "
          f"{liv['load']['dispatch_lag_s']['max']} s; load average {os.getloadavg()[0]:.2f}")


def _s(v: object) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
