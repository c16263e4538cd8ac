"""Routing on live engines: ``llmdiag gateway`` vs HAProxy with one engine slowed part-way, and what the simulator predicts.

    .venv/bin/python bench/bench_gateway_routing.py                  # ~14 min: 5 live runs of 60 s + the simulator
    .venv/bin/python bench/bench_gateway_routing.py --duration 20 --fault-at 8 --policies gateway,haproxy_rr --out /tmp/r
    .venv/bin/python bench/bench_gateway_routing.py --policies haproxy_rr --keep bench/results/gateway_routing.json

Set-up (the simulator's ``slow_replica`` scenario, shortened): ``--engines``
fake engines (``--preset``, the simulator's engine model on the wall clock,
each its own process); the Azure LLM conversation trace's request sizes and
arrival shape, offered open-loop with ``llmdiag bench load``'s generator at
``--utilization`` of the engines' measured capacity; the last engine slows to
``--speed`` (a throttled GPU) ``--fault-at`` seconds into the load and stays
slow. The load starts ``--lead`` seconds into that engine's fault clock (read
from its ``process_start_time_seconds``), so the fault falls at ``--fault-at``
of load time; the time it actually fell at is recorded (``fault_at_load_s``).

Live policies, each on fresh engines with the same schedule:

- ``gateway``: ``llmdiag gateway`` (balancer fed by its own TTFT/status
  feedback and the engines' ``/metrics``);
- ``gateway_agent``: the same plus node penalties from ``llmdiag agent``
  (engine collector only: the fake engines have no GPU, and no BPF compile);
- ``haproxy_rr``, ``haproxy_leastconn``: HAProxy 2.6 roundrobin / leastconn;
- ``haproxy_agentcheck``: HAProxy roundrobin whose server weights ``llmdiag
  agent`` sets over the agent-check protocol (``agent-inter 1s``).

HAProxy names the server that answered in ``x-llmdiag-backend``, as the
gateway does, so every run records which requests the slowed engine got.

The simulator (:class:`llmdiag.sim.cluster.ClusterSim`) then runs the same
schedule, engines and fault time as each live run with its ``llmdiag``,
``round_robin`` and ``least_conn`` policies, and again over ``--sim-seeds``
seeds (round robin: with the slowed engine at each position, i.e. each quarter
of the requests) to show how much one run's P99 depends on chance. Writes
``<out>.json``, ``<out>.md`` (both tables, with the gateway's margins live and
predicted) and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_common import MODEL, Fleet, engine_clock_start, free_port  # noqa: E402

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


def run_live(policy: str, args: argparse.Namespace, schedule: list) -> dict:
    with Fleet() as fleet:
        engines = []
        for i in range(args.engines):
            faults = f"slowdown:start={args.fault_at + args.lead},speed={args.speed}" if i == args.engines - 1 else ""
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
        # The slowed engine's fault clock starts at its own start (engine i starts after engine
        # i-1 is up): start the load --lead seconds into that clock, so that the fault falls at
        # --fault-at seconds of load time, as in the simulator. A set-up slower than --lead
        # starts the load at once, and the fault time actually reached is what the simulator gets.
        fault_epoch = engine_clock_start(engines[-1]) + args.lead + args.fault_at
        wait = fault_epoch - args.fault_at - time.time()
        if wait > 0:
            time.sleep(wait)
        fault_at_load = fault_epoch - time.time()
        waiting: list[list[float]] = []
        done = threading.Event()
        watcher = threading.Thread(target=_watch_waiting, args=(engines, waiting, done), daemon=True)
        watcher.start()
        # model given: no /v1/models probe through the proxy, which would take a round-robin turn
        # and shift which requests reach the slowed engine against the simulator's round robin.
        report = asyncio.run(run_load([target], schedule, timeout=args.timeout, slo_ttft_s=args.slo,
                                      duration_s=args.duration, model=MODEL))
        done.set()
        watcher.join(5)
    s = report.summary()
    s["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    s["fault_at_load_s"] = round(fault_at_load, 3)
    s["before_fault"] = window(report, 5.0, fault_at_load, args.slo)
    s["after_fault"] = window(report, fault_at_load + 5.0, args.duration, args.slo)
    s["engines_waiting"] = waiting  # [t since load start, waiting per engine...] every 2 s
    s["slow_engine_waiting_peak"] = max((row[-1] for row in waiting), default=None)
    s["requests_detail"] = [[round(r.sent_at, 3), None if r.ttft is None else round(r.ttft, 4), r.status, r.backend]
                            for r in report.results]
    slow = f"127.0.0.1:{engines[-1].rsplit(':', 1)[1]}"
    if s["backends"]:
        after = [r.backend for r in report.results if r.sent_at >= fault_at_load + 5.0 and r.backend]
        s["slow_engine_share_after_fault"] = round(after.count(slow) / len(after), 4) if after else None
        # Which requests the slowed engine got, by index modulo the engine count: one value under
        # round robin, and then the simulator's round robin must give it the same quarter.
        offsets = Counter(i % args.engines for i, r in enumerate(report.results) if r.backend == slow)
        s["slow_engine_request_offsets"] = {str(k): v for k, v in sorted(offsets.items())}
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


def run_sim(policy: str, args: argparse.Namespace, schedule: list, fault_at: float, *, slow: int | None = None,
            seed: int | None = None) -> dict:
    """The simulator on the live run's schedule, engines and fault time; ``slow``: which engine slows (default the
    last, as live); ``seed``: the policy's tie-breaking RNG (default --seed)."""
    trace = Trace("schedule", tuple(r.at for r in schedule), tuple(r.prompt_tokens for r in schedule),
                  tuple(r.output_tokens for r in schedule))
    preset = PRESETS[args.preset]
    slow = args.engines - 1 if slow is None else slow
    specs = [EngineSpec(preset, name=f"engine-{i}") for i in range(args.engines)]
    specs[slow] = EngineSpec(preset, name=f"engine-{slow}",
                             faults=FaultSchedule((Fault("slowdown", fault_at, speed=args.speed),)))
    config = SimConfig(client_timeout_s=args.timeout, ttft_slo_s=args.slo)
    result = ClusterSim(specs, trace, policy, config=config, seed=args.seed if seed is None else seed).run()
    out = result.summary()
    series = result.series
    out["fault_at_s"] = round(fault_at, 3)
    out["engines_waiting"] = [[round(t, 1), *(w[k] for w in series["waiting"])]
                              for k, t in enumerate(series["t"]) if k % 2 == 0]
    out["slow_engine_waiting_peak"] = max(series["waiting"][slow], default=None)
    out["dispatch_share"] = [round(x, 4) for x in result.dispatch_share]
    return out


def sim_spread(policy: str, args: argparse.Namespace, schedule: list, fault_at: float) -> dict:
    """How much the simulator's P99 moves with what a single run fixes by chance: for round robin, which
    quarter of the requests reaches the slowed engine (the slowed engine at each position); for the
    others, the tie-breaking seed (``--sim-seeds`` of them)."""
    if policy == "round_robin":
        runs = [run_sim(policy, args, schedule, fault_at, slow=i) for i in range(args.engines)]
    else:
        runs = [run_sim(policy, args, schedule, fault_at, seed=k) for k in range(args.sim_seeds)]
    p99 = sorted(r["ttft_p99"] for r in runs if r["ttft_p99"] is not None)
    return {"ttft_p99": [r["ttft_p99"] for r in runs], "min": p99[0] if p99 else None,
            "median": statistics.median(p99) if p99 else None, "max": p99[-1] if p99 else None}


def margins(result: dict) -> list[dict]:
    """The gateway's P99 TTFT lead over each HAProxy mode: live, as the simulator predicts for the same runs, and the
    range the simulator gives over its seeds (round robin has no randomness once the slowed engine's quarter of the
    requests is fixed, as it is live: its same-run value stands for its range)."""
    rows = []
    live, sim = result["live"], result["sim"]

    def bounds(policy: str) -> tuple[float | None, float | None]:
        if sim[policy]["policy"] == "round_robin":
            return sim[policy]["same"]["ttft_p99"], sim[policy]["same"]["ttft_p99"]
        return sim[policy]["spread"]["min"], sim[policy]["spread"]["max"]

    for gw in ("gateway", "gateway_agent"):
        for hp in ("haproxy_rr", "haproxy_leastconn", "haproxy_agentcheck"):
            if gw not in live or hp not in live:
                continue
            lv = _ratio(live[hp]["ttft_s"]["p99"], live[gw]["ttft_s"]["p99"])
            both = hp in sim and gw in sim
            pred = _ratio(sim[hp]["same"]["ttft_p99"], sim[gw]["same"]["ttft_p99"]) if both else None
            lo = hi = None
            if both:
                (hp_lo, hp_hi), (gw_lo, gw_hi) = bounds(hp), bounds(gw)
                lo, hi = _ratio(hp_lo, gw_hi), _ratio(hp_hi, gw_lo)
            rows.append({"gateway": gw, "haproxy": hp, "live_margin": lv, "sim_margin": pred,
                         "sim_margin_range": [lo, hi], "live_over_sim": _ratio(lv, pred),
                         "within_20pct": None if lv is None or pred is None else abs(lv / pred - 1.0) <= 0.2,
                         "inside_sim_range": None if lv is None or lo is None or hi is None else lo <= lv <= hi})
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--preset", default="llama-70b-a100-tp8", choices=sorted(PRESETS))
    parser.add_argument("--trace", default="azure2023_conv")
    parser.add_argument("--utilization", type=float, default=0.8)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--fault-at", type=float, default=20.0, help="seconds of load time at which the engine slows")
    parser.add_argument("--speed", type=float, default=0.4)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--slo", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lead", type=float, default=8.0,
                        help="seconds of the slowed engine's clock before the load starts (covers the set-up)")
    parser.add_argument("--sim-seeds", type=int, default=8, help="simulator seeds for the spread of each policy")
    parser.add_argument("--policies", default=",".join(LIVE), help="live policies to run (comma-separated)")
    parser.add_argument("--keep", metavar="JSON",
                        help="start from this earlier result's live runs (same set-up), rerunning only --policies")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gateway_routing"))
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in LIVE]
    if unknown:
        parser.error(f"unknown policies {unknown} (known: {', '.join(LIVE)})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    trace = load_trace(args.trace, seed=args.seed)
    capacity = args.engines * measure_capacity(PRESETS[args.preset], trace, seconds=300, warmup=60)
    rate = args.utilization * capacity
    schedule = schedule_from_trace(trace.arrivals, trace.inputs, trace.outputs, rate, args.duration)
    set_up = {k: getattr(args, k) for k in ("engines", "preset", "trace", "utilization", "duration", "fault_at", "speed",
                                            "timeout", "slo", "seed", "lead")}
    result = {"set_up": set_up, "capacity_rps": round(capacity, 3), "offered_rps": round(rate, 3),
              "requests": len(schedule), "live": {}, "sim": {}}
    if args.keep:
        kept = json.loads(Path(args.keep).read_text())
        differs = {k: (kept["set_up"].get(k), v) for k, v in set_up.items() if k != "lead" and kept["set_up"].get(k) != v}
        if differs:
            parser.error(f"--keep {args.keep} has another set-up: {differs}")
        result["live"] = {p: v for p, v in kept["live"].items() if p not in policies}
    print(f"{len(schedule)} requests at {rate:.2f}/s ({args.utilization:g} x {capacity:.2f} req/s capacity); "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for policy in policies:
        print(f"live: {policy} ...", flush=True)
        result["live"][policy] = live = run_live(policy, args, schedule)
        print(f"  TTFT p99 {live['ttft_s']['p99']} s, goodput {live['goodput_rps']} req/s, errors {live['errors']}, "
              f"fault at {live['fault_at_load_s']} s of load, load average {live['load_average_after']}", flush=True)
    result["live"] = {p: result["live"][p] for p in LIVE if p in result["live"]}
    for policy, live in result["live"].items():
        if SIM[policy]:
            # Each live run gets the simulator at its own fault time (the same by design, unless a
            # set-up outran --lead), with its own spread.
            result["sim"][policy] = {"policy": SIM[policy],
                                     "same": run_sim(SIM[policy], args, schedule, live["fault_at_load_s"]),
                                     "spread": sim_spread(SIM[policy], args, schedule, live["fault_at_load_s"])}
    result["margins"] = margins(result)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    lines = table(result)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(result, args, out.with_suffix(".png"))


def table(result: dict) -> list[str]:
    lines = ["| policy | fault at (s of load) | live P99 TTFT (s) | live goodput (req/s) | live errors | "
             "slow engine's share after | slow engine's peak queue, live / sim | sim policy | sim P99 TTFT (s) | "
             "sim P99 spread min-median-max (s) | sim goodput (req/s) |",
             "|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|"]
    for policy, live in result["live"].items():
        sim = result["sim"].get(policy)
        share = live.get("slow_engine_share_after_fault")
        same = sim["same"] if sim else {}
        spread = sim["spread"] if sim else {}
        peaks = f"{_n(live.get('slow_engine_waiting_peak'))} / {_n(same.get('slow_engine_waiting_peak'))}"
        lines.append(f"| {policy} | {live['fault_at_load_s']} | {_f(live['ttft_s']['p99'])} | {live['goodput_rps']} | "
                     f"{live['errors'] or '-'} | {'-' if share is None else share} | {peaks} | "
                     f"{sim['policy'] if sim else '-'} | {_f(same.get('ttft_p99'))} | "
                     + (f"{_f(spread['min'])}-{_f(spread['median'])}-{_f(spread['max'])}" if sim else "-")
                     + f" | {same.get('goodput_rps', '-')} |")
    lines += ["", "| gateway | vs | live margin (P99 ratio) | simulator's margin, same runs | live / sim | "
              "within 20 % | simulator's range over seeds | live inside it |", "|---|---|---:|---:|---:|---|---:|---|"]
    for m in result["margins"]:
        lo, hi = m["sim_margin_range"]
        lines.append(f"| {m['gateway']} | {m['haproxy']} | {_n(m['live_margin'])} | {_n(m['sim_margin'])} | "
                     f"{_n(m['live_over_sim'])} | {_yes(m['within_20pct'])} | "
                     f"{'-' if lo is None else f'{lo:g}-{hi:g}'} | {_yes(m['inside_sim_range'])} |")
    return lines


def plot(result: dict, args: argparse.Namespace, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    policies = list(result["live"])
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(policies))
    ax.bar([x - 0.2 for x in xs], [result["live"][p]["ttft_s"]["p99"] or 0 for p in policies], 0.4, label="live")
    # Simulator bars only where a policy has a counterpart (nothing models HAProxy's agent-check weights).
    sim_x = [x for x, p in zip(xs, policies) if p in result["sim"]]
    sims = [result["sim"][p] for p in policies if p in result["sim"]]
    heights = [s["same"]["ttft_p99"] or 0 for s in sims]
    lo = [max(0, h - s["spread"]["min"]) if s["spread"]["min"] is not None else 0 for h, s in zip(heights, sims)]
    hi = [max(0, s["spread"]["max"] - h) if s["spread"]["max"] is not None else 0 for h, s in zip(heights, sims)]
    ax.bar([x + 0.2 for x in sim_x], heights, 0.4, yerr=[lo, hi], capsize=4,
           label="simulator, same run (bar: spread over seeds / round-robin quarter)")
    top = max([result["live"][p]["ttft_s"]["p99"] or 0 for p in policies] + [h + e for h, e in zip(heights, hi)] + [1])
    ax.set_ylim(0, top * 1.3)  # room for the legend
    ax.set_xticks(list(xs), policies, fontsize=8)
    ax.set_ylabel("P99 TTFT (s)")
    ax.set_title(f"{args.engines} fake engines, one at {args.speed:g}x speed from t={args.fault_at:g} s of load")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _yes(v: bool | None) -> str:
    return "-" if v is None else "yes" if v else "no"


def _n(v: object) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
