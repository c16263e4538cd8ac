#!/usr/bin/env python3
"""Simulator speed on one core: engine-model steps per second, and the wall
time of a one-hour, 8-engine, all-policy run.

    .venv/bin/python bench/sim_speed.py [--duration 3600] [--instances 8] [--trace azure2023_conv]

(1) one saturated engine stepped in a tight loop (plan + commit, with new
requests topping up the waiting queue): steps/s of the engine model alone;
(2) ``run_scenario("clean", ...)`` with every policy: total engine steps over
total wall time (the whole simulator: events, gateway, policies, metrics).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmdiag.sim.engine_model import PRESETS, EngineModel, SimRequest  # noqa: E402
from llmdiag.sim.scenarios import DEFAULT_PRESET, run_scenario  # noqa: E402
from llmdiag.sim.workload import load_trace  # noqa: E402


def engine_steps_per_second(trace_name: str, steps: int = 200_000) -> float:
    trace = load_trace(trace_name)
    eng = EngineModel(PRESETS[DEFAULT_PRESET])
    now = 0.0
    k = 0
    n = len(trace)
    start = time.perf_counter()
    for _ in range(steps):
        while eng.num_waiting < 64:
            eng.submit(SimRequest(k, trace.inputs[k % n], trace.outputs[k % n], now), now)
            k += 1
        dur = eng.plan_step(now)
        now += dur
        eng.commit_step(now)
    return steps / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--trace", default="azure2023_conv")
    ap.add_argument("--scenario", default="clean")
    args = ap.parse_args()
    eng_rate = engine_steps_per_second(args.trace)
    start = time.perf_counter()
    res = run_scenario(args.scenario, args.trace, instances=args.instances, duration=args.duration)
    wall = time.perf_counter() - start
    steps = sum(r.engine_steps for r in res.results.values())
    requests = res.requests * len(res.results)
    print(json.dumps({
        "engine_model_steps_per_s": round(eng_rate),
        "scenario": args.scenario,
        "trace": args.trace,
        "duration_s": args.duration,
        "instances": args.instances,
        "policies": list(res.results),
        "requests_per_policy": res.requests,
        "wall_seconds_all_policies": round(wall, 2),
        "cluster_engine_steps_per_s": round(steps / wall),
        "simulated_requests_per_s": round(requests / wall),
        "per_policy_wall_s": {k: round(r.wall_seconds, 2) for k, r in res.results.items()},
        "ttft_p99": {k: r.ttft_p99 for k, r in res.results.items()},
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
