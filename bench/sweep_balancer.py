#!/usr/bin/env python3
"""Choose the balancer's defaults with the cluster simulator, and show why a config loses.

    .venv/bin/python bench/sweep_balancer.py [--duration 1200] [--seeds 0,1] [--scenarios all]
                                             [--trace azure2023_conv] [--out bench/results]
    .venv/bin/python bench/sweep_balancer.py --diagnose [--scenarios clean,heterogeneous]

Sweep: a staged grid (coordinate descent; a full factorial is hundreds of
configs x 7 scenarios x seeds), each stage keeping the best config of the one
before:

1. choice count ``d`` x ``tokens_per_slot`` (what load is made of); ``d`` = 0
   (all, a full scan) is run for reference but cannot be chosen: ``pick`` must
   stay O(d) at 1,000 backends;
2. ``in_flight_penalty`` x ``prefill_speed_alpha`` x ``score.weight_ttft``
   (how load and score trade off; the measured prefill speed; the SPEC 6.1
   TTFT weight);
3. ``ttft_ewma_alpha``, ejection base and cooling times (failure handling).

Every config runs every scenario and seed on the same engines, trace and seed
as the references and peers (run once per scenario and seed). A config's
objective is its worst scenario's ratio of P99 TTFT to the oracle's (the
issue's "within 1.15x of the oracle" target), seeds averaged; ties go to the
geometric mean of the ratios. Results go to ``<out>/sweep_balancer.json`` and
``<out>/sweep_balancer.md``.

Diagnose: for the SPEC's old defaults and the chosen ones, every llmdiag pick
is compared with what the oracle would have picked at that instant (the
engines' true state is read here for the diagnosis only, never by the
balancer): agreement, the TTFT regret of the pick, and what the load term was
made of (pending prefill vs in-flight requests).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmdiag.config.balancer import BalancerConfig, ErrorsConfig, ScoreConfig  # noqa: E402
from llmdiag.sim.cluster import ClusterSim  # noqa: E402
from llmdiag.sim.scenarios import SCENARIOS, build_scenario  # noqa: E402
from llmdiag.sim.workload import load_trace  # noqa: E402

PEERS = ("oracle", "least_pending_prefill", "round_robin", "least_conn", "gie")
SLO_S = 2.0

# The SPEC 6.3 / pre-sweep defaults, for the diagnosis and the "before" column.
OLD = {"choices": 2, "in_flight_penalty": 0.1, "tokens_per_slot": 2048.0, "prefill_speed_alpha": 0.0}


def make_config(p: dict[str, Any]) -> BalancerConfig:
    """A BalancerConfig from a flat dict of levers (``weight_ttft``, ``ttft_ewma_alpha``, ``cooling_min`` ...)."""
    top = {k: v for k, v in p.items() if k in BalancerConfig.__dataclass_fields__}
    score = {k: v for k, v in p.items() if k in ("weight_ttft", "ttft_ewma_alpha")}
    errors = {}
    if "cooling_min" in p:
        errors = {"cooling_min_seconds": p["cooling_min"], "cooling_max_seconds": p["cooling_max"]}
    if "ejection_base_seconds" in top:
        top["ejection_max_seconds"] = max(60.0, 4 * top["ejection_base_seconds"])
    return BalancerConfig(**top, score=replace(ScoreConfig(), **score), errors=replace(ErrorsConfig(), **errors))


class Runner:
    def __init__(self, trace: str, scenarios: list[str], seeds: list[int], duration: float) -> None:
        self.trace, self.scenarios, self.seeds, self.duration = trace, scenarios, seeds, duration
        self._built: dict[tuple[str, int], Any] = {}
        self.peers: dict[tuple[str, int], dict[str, tuple[float, float]]] = {}

    def built(self, scenario: str, seed: int) -> Any:
        key = (scenario, seed)
        if key not in self._built:
            base = load_trace(self.trace, seed=seed)
            self._built[key] = build_scenario(scenario, base, duration=self.duration, seed=seed)
        return self._built[key]

    def run(self, scenario: str, seed: int, policy: str, config: BalancerConfig | None = None,
            hook: Any = None) -> tuple[float, float]:
        specs, trace, sim_config, _ = self.built(scenario, seed)
        options = {"config": config} if config is not None else None
        sim = ClusterSim(specs, trace, policy, config=sim_config, seed=seed, policy_options=options)
        if hook is not None:
            hook(sim)
        r = sim.run()
        return float(r.ttft_p99 or 0.0), float(r.goodput_rps)

    def references(self) -> None:
        for scenario in self.scenarios:
            for seed in self.seeds:
                self.peers[(scenario, seed)] = {p: self.run(scenario, seed, p) for p in PEERS}

    def evaluate(self, params: dict[str, Any]) -> dict[str, Any]:
        config = make_config(params)
        per: dict[str, Any] = {}
        for scenario in self.scenarios:
            p99s, goods, ratios = [], [], []
            for seed in self.seeds:
                p99, good = self.run(scenario, seed, "llmdiag", config)
                oracle = self.peers[(scenario, seed)]["oracle"][0]
                p99s.append(p99)
                goods.append(good)
                ratios.append(p99 / oracle if oracle > 0 else math.inf)
            per[scenario] = {"p99": statistics.mean(p99s), "goodput": statistics.mean(goods),
                             "vs_oracle": statistics.mean(ratios)}
        worst = max(v["vs_oracle"] for v in per.values())
        gmean = math.exp(statistics.mean(math.log(v["vs_oracle"]) for v in per.values()))
        return {"params": params, "worst_vs_oracle": worst, "gmean_vs_oracle": gmean, "scenarios": per}


# Differences smaller than these are noise between seeds (measured: the same config moves by ~0.02).
WORST_MARGIN = 0.02
GMEAN_MARGIN = 0.01


def _better(row: dict[str, Any], best: dict[str, Any]) -> bool:
    """Better beyond noise: a lower worst-scenario ratio, or the same worst and a lower geometric mean.

    The grid's order breaks near-ties: the first config (the SPEC's value where the
    grid starts with it) stays unless another is better by more than the margins.
    """
    dw = row["worst_vs_oracle"] - best["worst_vs_oracle"]
    if dw < -WORST_MARGIN:
        return True
    return abs(dw) <= WORST_MARGIN and row["gmean_vs_oracle"] < best["gmean_vs_oracle"] - GMEAN_MARGIN


def sweep(runner: Runner, log: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    seen: dict[str, dict[str, Any]] = {}

    def stage(name: str, base: dict[str, Any], grid: list[dict[str, Any]]) -> dict[str, Any]:
        best = None
        for change in grid:
            params = {**base, **change}
            key = json.dumps(params, sort_keys=True)
            if key not in seen:
                t = time.perf_counter()
                row = runner.evaluate(params)
                row["stage"] = name
                seen[key] = row
                rows.append(row)
                log(f"[{name}] {params}: worst {row['worst_vs_oracle']:.2f}x, gmean {row['gmean_vs_oracle']:.2f}x "
                    f"({time.perf_counter() - t:.0f} s)")
            row = seen[key]
            if params.get("choices") == 0:
                continue  # d = all is a full scan, O(n): shown for reference, not eligible as a default
            if best is None or _better(row, best):
                best = row
        assert best is not None
        return best["params"]

    base = {**OLD, "prefill_speed_alpha": 0.05}
    base = stage("1: d x tokens_per_slot", base,
                 [{"choices": d, "tokens_per_slot": t} for d in (2, 3, 4, 0) for t in (2048.0, 256.0, 64.0, 32.0, 16.0)])
    base = stage("2: in_flight_penalty x prefill_speed_alpha x weight_ttft", base,
                 [{"in_flight_penalty": f, "prefill_speed_alpha": a, "weight_ttft": w}
                  for f in (0.1, 0.02, 0.5) for a in (0.0, 0.05, 0.2) for w in (0.35, 0.0)])
    base = stage("3: ttft alpha, ejection, cooling", base,
                 [{}, {"ttft_ewma_alpha": 0.5}, {"ttft_ewma_alpha": 0.05},
                  {"ejection_base_seconds": 5.0}, {"ejection_base_seconds": 30.0},
                  {"cooling_min": 1.0, "cooling_max": 2.0}, {"cooling_min": 5.0, "cooling_max": 10.0}])
    return rows, base


# ------------------------------------------------------------------ diagnose


def diagnose(runner: Runner, params: dict[str, Any], scenario: str, seed: int) -> dict[str, Any]:
    """Compare every llmdiag pick with the oracle's choice at the same instant (true state read here only)."""
    stats = {"picks": 0, "agree": 0, "regret": [], "pending_share": [], "in_flight": [], "pending_tokens": []}

    def hook(sim: ClusterSim) -> None:
        policy = sim.policy
        inner = policy.pick
        engines = sim.engines
        balancer = policy.balancer  # type: ignore[attr-defined]
        slots = balancer._slots  # noqa: SLF001 - diagnosis only

        def pick(req: Any, now: float, exclude: frozenset[int]) -> int | None:
            i = inner(req, now, exclude)
            if i is None or exclude:
                return i
            est = [e.estimate_ttft(req.prompt, now) for e in engines]
            best = min(est)
            stats["picks"] += 1
            stats["agree"] += est[i] <= best + 1e-9
            stats["regret"].append(est[i] - best if math.isfinite(est[i]) else 60.0)
            s = slots[policy.backends[i].name]  # type: ignore[attr-defined]
            pend = (s.pending_tokens - req.prompt) * s.token_weight
            load = pend + s.in_flight - 1
            stats["pending_share"].append(pend / load if load > 0 else 0.0)
            stats["in_flight"].append(s.in_flight - 1)
            stats["pending_tokens"].append(s.pending_tokens - req.prompt)
            return i

        policy.pick = pick  # type: ignore[method-assign]

    p99, good = runner.run(scenario, seed, "llmdiag", make_config(params), hook=hook)
    regret = sorted(stats["regret"])
    n = len(regret) or 1
    return {
        "scenario": scenario, "params": params, "ttft_p99": p99, "goodput": good,
        "agree_with_oracle": stats["agree"] / n,
        "regret_mean_s": statistics.mean(regret) if regret else 0.0,
        "regret_p99_s": regret[int(0.99 * (n - 1))] if regret else 0.0,
        "load_share_pending_prefill": statistics.mean(stats["pending_share"]) if stats["pending_share"] else 0.0,
        "mean_in_flight_at_pick": statistics.mean(stats["in_flight"]) if stats["in_flight"] else 0.0,
        "mean_pending_tokens_at_pick": statistics.mean(stats["pending_tokens"]) if stats["pending_tokens"] else 0.0,
    }


# ------------------------------------------------------------------ output


def markdown(rows: list[dict[str, Any]], best: dict[str, Any], runner: Runner, args: argparse.Namespace) -> str:
    scen = runner.scenarios
    out = [f"# Balancer sweep ({args.trace}, {args.duration:.0f} s of trace, seeds {args.seeds}, 8 engines, 85 %)", "",
           "P99 TTFT / oracle P99 TTFT per scenario, seeds averaged; `worst` is the objective.", "",
           "| stage | params | worst | gmean | " + " | ".join(scen) + " |",
           "|---|---|---:|---:|" + "---:|" * len(scen)]
    for r in rows:
        changed = {k: v for k, v in r["params"].items()}
        out.append(f"| {r['stage'].split(':')[0]} | `{json.dumps(changed, sort_keys=True)}` | {r['worst_vs_oracle']:.2f} | "
                   f"{r['gmean_vs_oracle']:.2f} | " + " | ".join(f"{r['scenarios'][s]['vs_oracle']:.2f}" for s in scen) + " |")
    out += ["", f"Chosen: `{json.dumps(best, sort_keys=True)}`", "", "References and peers (P99 TTFT s, seeds averaged):", "",
            "| scenario | " + " | ".join(PEERS) + " |", "|---|" + "---:|" * len(PEERS)]
    for s in scen:
        vals = [statistics.mean(runner.peers[(s, seed)][p][0] for seed in runner.seeds) for p in PEERS]
        out.append(f"| {s} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="azure2023_conv")
    ap.add_argument("--scenarios", default="all")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--duration", type=float, default=1200.0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--diagnose", action="store_true", help="oracle agreement and regret of old vs chosen defaults")
    args = ap.parse_args()
    scenarios = list(SCENARIOS) if args.scenarios == "all" else args.scenarios.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    runner = Runner(args.trace, scenarios, seeds, args.duration)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.diagnose:
        chosen = {f: getattr(BalancerConfig(), f) for f in OLD}
        result = [diagnose(runner, p, s, seeds[0]) for s in scenarios for p in (OLD, chosen)]
        for r in result:
            print(json.dumps(r))
        (out / "sweep_balancer_diagnose.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0
    t = time.perf_counter()
    runner.references()
    print(f"references and peers: {time.perf_counter() - t:.0f} s", flush=True)
    rows, best = sweep(runner, lambda m: print(m, flush=True))
    (out / "sweep_balancer.json").write_text(json.dumps({
        "trace": args.trace, "duration_s": args.duration, "seeds": seeds, "scenarios": scenarios,
        "peers": {f"{s}/{seed}": v for (s, seed), v in runner.peers.items()}, "rows": rows, "chosen": best,
    }, indent=1) + "\n")
    (out / "sweep_balancer.md").write_text(markdown(rows, best, runner, args))
    print(f"chosen: {best}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
