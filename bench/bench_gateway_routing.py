"""Routing on live engines: ``llmdiag gateway`` vs HAProxy with one engine slowed part-way, and what the simulator predicts.

    .venv/bin/python bench/bench_gateway_routing.py                  # ~7 min: 4 live runs of 60 s + the simulator
    .venv/bin/python bench/bench_gateway_routing.py --duration 20 --policies gateway,haproxy_rr --out /tmp/r

Set-up (the simulator's ``slow_replica`` scenario, shortened): ``--engines``
fake engines (``--preset``, the simulator's engine model on the wall clock,
each its own process); the Azure LLM conversation trace's request sizes and
arrival shape, offered open-loop with ``llmdiag bench load``'s generator at
``--utilization`` of the engines' measured capacity; the last engine slows to
``--speed`` (a throttled GPU) ``--fault-at`` seconds into the load and stays slow.

Live policies, each on fresh engines with the same schedule:

- ``gateway``: ``llmdiag gateway`` (balancer fed by its own TTFT/status
  feedback and the engines' ``/metrics``);
- ``gateway_agent``: the same plus node penalties from ``llmdiag agent``
  (engine collector only: the fake engines have no GPU, and no BPF compile);
- ``haproxy_rr``, ``haproxy_leastconn``: HAProxy 2.6 roundrobin / leastconn;
- ``haproxy_agentcheck``: HAProxy roundrobin whose server weights ``llmdiag
  agent`` sets over the agent-check protocol (``agent-inter 1s``).

The simulator (:class:`llmdiag.sim.cluster.ClusterSim`) then runs the same
schedule, engines and fault with its ``llmdiag``, ``round_robin`` and
``least_conn`` policies. Writes ``<out>.json``, ``<out>.md`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_common import Fleet, free_port  # noqa: E402

from llmdiag.gateway.loadgen import LoadReport, percentile, run_load, schedule_from_trace  # noqa: E402
from llmdiag.sim.cluster import ClusterSim, EngineSpec, SimConfig, measure_capacity  # noqa: E402
from llmdiag.sim.engine_model import PRESETS  # noqa: E402
from llmdiag.sim.faults import Fault, FaultSchedule  # noqa: E402
from llmdiag.sim.workload import Trace, load_trace  # noqa: E402

LIVE = ("gateway", "gateway_agent", "haproxy_rr", "haproxy_leastconn", "haproxy_agentcheck")
#: The simulator's nearest policy (none models HAProxy weights set by agent-check).
SIM = {"gateway": "llmdiag", "gateway_agent": "llmdiag", "haproxy_rr": "round_robin", "haproxy_leastconn": "least_conn",
       "haproxy_agentcheck": None}


def window(report: LoadReport, lo: float, hi: float, slo: float) -> dict:
    rs = [r for r in report.results if lo <= r.sent_at < hi]
    ok = [r for r in rs if r.status == "200" and r.ttft is not None]
    ttfts = [r.ttft for r in ok]
    return {"requests": len(rs), "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "goodput_ratio": round(sum(1 for t in ttfts if t <= slo) / len(rs), 4) if rs else None}


def run_live(policy: str, args: argparse.Namespace, schedule: list, fault_at: float) -> dict:
    with Fleet() as fleet:
        t_engines = time.monotonic()
        # The fault is given in engine time; the load starts a little later: shift it by the start-up.
        lead = 3.0
        engines = []
        for i in range(args.engines):
            faults = f"slowdown:start={fault_at + lead},speed={args.speed}" if i == args.engines - 1 else ""
            engines.append(fleet.engine(free_port(), profile=args.preset, faults=faults, label=str(i)))
        if policy == "gateway":
            target = fleet.gateway(free_port(), engines)
        elif policy == "gateway_agent":
            agent = fleet.llmdiag_agent(free_port(), free_port(), engines)
            target = fleet.gateway(free_port(), engines, agents=[agent])
        elif policy == "haproxy_agentcheck":
            check_port = free_port()
            fleet.llmdiag_agent(free_port(), check_port, engines)
            target = fleet.haproxy(free_port(), engines, "roundrobin", agent_port=check_port)
        elif policy == "haproxy_rr":
            target = fleet.haproxy(free_port(), engines, "roundrobin")
        elif policy == "haproxy_leastconn":
            target = fleet.haproxy(free_port(), engines, "leastconn")
        else:
            raise ValueError(policy)
        wait = lead - (time.monotonic() - t_engines)
        if wait > 0:
            time.sleep(wait)
        offset = time.monotonic() - t_engines - lead  # how late the load started against the fault clock
        waiting: list[list[float]] = []
        done = threading.Event()
        watcher = threading.Thread(target=_watch_waiting, args=(engines, waiting, done), daemon=True)
        watcher.start()
        report = asyncio.run(run_load([target], schedule, timeout=args.timeout, slo_ttft_s=args.slo,
                                      duration_s=args.duration))
        done.set()
        watcher.join(5)
    s = report.summary()
    s["fault_at_load_s"] = round(fault_at - offset, 2)
    s["before_fault"] = window(report, 5.0, fault_at - offset, args.slo)
    s["after_fault"] = window(report, fault_at - offset + 5.0, args.duration, args.slo)
    s["engines_waiting"] = waiting  # [t since load start, waiting per engine...] every 2 s
    s["requests_detail"] = [[round(r.sent_at, 3), None if r.ttft is None else round(r.ttft, 4), r.status, r.backend]
                            for r in report.results]
    slow = f"127.0.0.1:{engines[-1].rsplit(':', 1)[1]}"
    if s["backends"]:
        after = [r.backend for r in report.results if r.sent_at >= fault_at - offset + 5.0 and r.backend]
        s["slow_engine_share_after_fault"] = round(after.count(slow) / len(after), 4) if after else None
    return s


def _watch_waiting(engines: list[str], out: list[list[float]], done: threading.Event) -> None:
    """Every 2 s, each engine's ``vllm:num_requests_waiting`` (to set the live queue beside the simulator's)."""
    t0 = time.monotonic()
    while not done.wait(2.0):
        row = [round(time.monotonic() - t0, 1)]
        for url in engines:
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=1.0) as resp:
                    text = resp.read().decode()
                row.append(next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                 if line.startswith("vllm:num_requests_waiting{")), -1.0))
            except OSError:
                row.append(-1.0)
        out.append(row)


def run_sim(policy: str, args: argparse.Namespace, schedule: list, fault_at: float) -> dict:
    trace = Trace("schedule", tuple(r.at for r in schedule), tuple(r.prompt_tokens for r in schedule),
                  tuple(r.output_tokens for r in schedule))
    preset = PRESETS[args.preset]
    specs = [EngineSpec(preset, name=f"engine-{i}") for i in range(args.engines)]
    specs[-1] = EngineSpec(preset, name=f"engine-{args.engines - 1}",
                           faults=FaultSchedule((Fault("slowdown", fault_at, speed=args.speed),)))
    config = SimConfig(client_timeout_s=args.timeout, ttft_slo_s=args.slo)
    result = ClusterSim(specs, trace, policy, config=config, seed=args.seed).run()
    out = result.summary()
    series = result.series
    out["engines_waiting"] = [[round(t, 1), *(w[k] for w in series["waiting"])]
                              for k, t in enumerate(series["t"]) if k % 2 == 0]
    out["dispatch_share"] = [round(x, 4) for x in result.dispatch_share]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--preset", default="llama-70b-a100-tp8", choices=sorted(PRESETS))
    parser.add_argument("--trace", default="azure2023_conv")
    parser.add_argument("--utilization", type=float, default=0.8)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--fault-at", type=float, default=20.0)
    parser.add_argument("--speed", type=float, default=0.4)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--slo", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(LIVE))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gateway_routing"))
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    trace = load_trace(args.trace, seed=args.seed)
    capacity = args.engines * measure_capacity(PRESETS[args.preset], trace, seconds=300, warmup=60)
    rate = args.utilization * capacity
    schedule = schedule_from_trace(trace.arrivals, trace.inputs, trace.outputs, rate, args.duration)
    result = {"set_up": {k: getattr(args, k) for k in ("engines", "preset", "trace", "utilization", "duration",
                                                        "fault_at", "speed", "timeout", "slo", "seed")},
              "capacity_rps": round(capacity, 3), "offered_rps": round(rate, 3), "requests": len(schedule),
              "live": {}, "sim": {}}
    print(f"{len(schedule)} requests at {rate:.2f}/s ({args.utilization:g} x {capacity:.2f} req/s capacity)", flush=True)
    for policy in policies:
        print(f"live: {policy} ...", flush=True)
        result["live"][policy] = run_live(policy, args, schedule, args.fault_at)
        live = result["live"][policy]
        print(f"  TTFT p99 {live['ttft_s']['p99']} s, goodput {live['goodput_rps']} req/s, errors {live['errors']}", flush=True)
    for name in sorted({SIM[p] for p in policies if SIM[p]}):
        print(f"sim: {name} ...", flush=True)
        result["sim"][name] = run_sim(name, args, schedule, args.fault_at)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    lines = ["| policy | live P99 TTFT (s) | live goodput (req/s) | live errors | P99 TTFT after the fault | slow engine's share after | sim policy | sim P99 TTFT (s) | sim goodput (req/s) |",
             "|---|---:|---:|---|---:|---:|---|---:|---:|"]
    for policy in policies:
        live, sim = result["live"][policy], result["sim"].get(SIM[policy] or "", {"ttft_p99": None, "goodput_rps": "-"})
        share = live.get("slow_engine_share_after_fault")
        lines.append(f"| {policy} | {_f(live['ttft_s']['p99'])} | {live['goodput_rps']} | {live['errors'] or '-'} | "
                     f"{_f(live['after_fault']['ttft_p99'])} | {'-' if share is None else share} | {SIM[policy] or '-'} | "
                     f"{_f(sim['ttft_p99'])} | {sim['goodput_rps']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(policies))
    ax.bar([x - 0.2 for x in xs], [result["live"][p]["ttft_s"]["p99"] or 0 for p in policies], 0.4, label="live")
    ax.bar([x + 0.2 for x in xs], [result["sim"][SIM[p]]["ttft_p99"] or 0 if SIM[p] else 0 for p in policies], 0.4,
           label="simulator")
    ax.set_xticks(list(xs), policies)
    ax.set_ylabel("P99 TTFT (s)")
    ax.set_title(f"{args.engines} fake engines, one at {args.speed:g}x speed from t={args.fault_at:g} s")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    main()
