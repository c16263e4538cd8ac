"""Named scenarios and the runner behind ``llmdiag bench sim``.

Every scenario starts from N engines of one preset (``--preset``, default
``llama-70b-h100-tp4``) and the chosen trace scaled to ``utilization`` of the
cluster's measured capacity (:func:`llmdiag.sim.cluster.measure_capacity`,
summed over engines), then changes one thing:

==================  ===========================================================================
clean               nothing
heterogeneous       every other engine is the A100 counterpart of the preset (slower, other limits)
slow_replica        engine 0 runs at 0.4x speed from minute 2 on (thermal throttling)
kv_storm            from minute 2, a 20 s burst of 6 x N extra requests with 32k-token prompts
saturation_429      engines answer 429 (saturation body) when 8 requests are already waiting, and
                    from minute 2 a 60 s surge triples the offered load
crash_restart       engine 0 crashes at minute 2, is down 30 s, then warms up (3x slower, 30 s)
client_quota_429    10 % of requests come from a tenant over its own quota: every backend
                    answers them 429 "rate limit exceeded for api key" (not the backend's fault)
kv_bound            nothing fails, but each engine's KV cache holds only 200,000 tokens
                    (``KV_BOUND_TOKENS``): with long prompts (mooncake_synthetic) the cache binds
crash_restart_kv    crash_restart with the KV cache of kv_bound (issue 14: re-admission while the
                    other engines are KV-bound)
==================  ===========================================================================

``--kv-tokens`` overrides the KV capacity of every scenario, kv_bound's included.

Faults start at minute 2 (``FAULT_AT``); runs shorter than that see none.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from llmdiag.sim.cluster import ClusterSim, EngineSpec, SimConfig, measure_capacity
from llmdiag.sim.engine_model import PRESETS, EnginePreset
from llmdiag.sim.faults import Fault, FaultSchedule
from llmdiag.sim.metrics import RunResult
from llmdiag.sim.policies import POLICIES
from llmdiag.sim.workload import Trace, load_trace, scale_to_rate

__all__ = ["DEFAULT_PRESET", "KV_BOUND_TOKENS", "SCENARIOS", "ScenarioResult", "build_scenario", "run_scenario"]

SCENARIOS = (
    "clean", "heterogeneous", "slow_replica", "kv_storm", "saturation_429", "crash_restart", "client_quota_429",
    "kv_bound", "crash_restart_kv",
)
#: KV cache per engine (tokens) of the KV-bound scenarios, unless ``kv_capacity_tokens`` is given.
KV_BOUND_TOKENS = 200_000
DEFAULT_PRESET = "llama-70b-h100-tp4"
FAULT_AT = 120.0
_A100_OF = {
    "llama-70b-h100-tp4": "llama-70b-a100-tp8",
    "llama3-8b-h100": "llama3-8b-a100",
    "llama-70b-a100-tp8": "llama-70b-h100-tp4",
    "llama3-8b-a100": "llama3-8b-h100",
}
_capacity_cache: dict[tuple[Any, ...], float] = {}


@dataclass
class ScenarioResult:
    scenario: str
    trace: str
    utilization: float
    instances: int
    seed: int
    capacity_rps: float
    offered_rps: float
    requests: int
    results: dict[str, RunResult] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "trace": self.trace,
            "utilization": self.utilization,
            "instances": self.instances,
            "seed": self.seed,
            "capacity_rps": round(self.capacity_rps, 4),
            "offered_rps": round(self.offered_rps, 4),
            "requests": self.requests,
            "results": {name: r.summary() for name, r in self.results.items()},
        }


def _capacity(preset: EnginePreset, kv: int | None, trace: Trace) -> float:
    key = (preset, kv, trace.name, len(trace), trace.inputs[:64], trace.outputs[:64])
    if key not in _capacity_cache:
        _capacity_cache[key] = measure_capacity(preset, trace, kv_capacity_tokens=kv)
    return _capacity_cache[key]


def build_scenario(
    scenario: str,
    base: Trace,
    *,
    instances: int = 8,
    utilization: float = 0.85,
    preset: str = DEFAULT_PRESET,
    kv_capacity_tokens: int | None = None,
    duration: float | None = None,
    seed: int = 0,
) -> tuple[list[EngineSpec], Trace, SimConfig, float]:
    """Engines, the scaled trace and the simulator config of a scenario; also the measured capacity (req/s)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)})")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    if instances < 1:
        raise ValueError("instances must be >= 1")
    if not 0 < utilization <= 2:
        raise ValueError("utilization must be in (0, 2]")
    main = PRESETS[preset]
    presets = [main] * instances
    if scenario in ("kv_bound", "crash_restart_kv") and kv_capacity_tokens is None:
        kv_capacity_tokens = KV_BOUND_TOKENS
    if scenario == "heterogeneous":
        other = PRESETS[_A100_OF[preset]]
        presets = [main if i % 2 == 0 else other for i in range(instances)]
    specs = [EngineSpec(p, kv_capacity_tokens=kv_capacity_tokens, name=f"engine-{i}") for i, p in enumerate(presets)]
    config = SimConfig()
    if scenario == "slow_replica":
        specs[0] = replace(specs[0], faults=FaultSchedule((Fault("slowdown", FAULT_AT, speed=0.4),)))
    elif scenario in ("crash_restart", "crash_restart_kv"):
        specs[0] = replace(
            specs[0], faults=FaultSchedule((Fault("crash", FAULT_AT, duration=30.0, warmup_s=30.0, warmup_factor=3.0),))
        )
    elif scenario == "saturation_429":
        specs = [replace(s, queue_limit=8) for s in specs]
    elif scenario == "client_quota_429":
        config = replace(config, quota_share=0.10)
    capacity = sum(_capacity(s.preset, s.kv_capacity_tokens, base) for s in specs)
    trace = scale_to_rate(base, utilization * capacity, duration)
    if scenario == "kv_storm":
        trace = _with_storm(trace, instances, seed)
    elif scenario == "saturation_429":
        trace = _with_surge(trace, 2.0, seed)
    return specs, trace, config, capacity


def _with_storm(trace: Trace, instances: int, seed: int) -> Trace:
    """Add 6 x N requests of 32k prompt tokens over 20 s from FAULT_AT (if the trace reaches it)."""
    if not trace.arrivals or trace.arrivals[-1] < FAULT_AT:
        return trace
    rng = random.Random(seed + 32768)
    extra = sorted(FAULT_AT + rng.random() * 20.0 for _ in range(6 * instances))
    rows = list(zip(trace.arrivals, trace.inputs, trace.outputs))
    rows += [(t, 32768, rng.randint(100, 400)) for t in extra]
    rows.sort(key=lambda r: r[0])
    return Trace(trace.name + "+kv_storm", tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows))


def _with_surge(trace: Trace, extra_share: float, seed: int) -> Trace:
    """From FAULT_AT for 60 s, add ``extra_share`` more requests (drawn from the trace's own mix)."""
    if not trace.arrivals or trace.arrivals[-1] < FAULT_AT:
        return trace
    rng = random.Random(seed + 429)
    window = [i for i, t in enumerate(trace.arrivals) if FAULT_AT <= t < FAULT_AT + 60.0]
    rows = list(zip(trace.arrivals, trace.inputs, trace.outputs))
    for _ in range(int(len(window) * extra_share)):
        j = rng.choice(window)
        rows.append((FAULT_AT + rng.random() * 60.0, trace.inputs[j], trace.outputs[j]))
    rows.sort(key=lambda r: r[0])
    return Trace(trace.name + "+surge", tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows))


def run_scenario(
    scenario: str,
    trace_name: str,
    *,
    policies: Sequence[str] = POLICIES,
    utilization: float = 0.85,
    instances: int = 8,
    seed: int = 0,
    duration: float | None = None,
    preset: str = DEFAULT_PRESET,
    kv_capacity_tokens: int | None = None,
    config: SimConfig | None = None,
    policy_options: dict[str, dict[str, Any]] | None = None,
    on_policy_start: Callable[[str, float], None] | None = None,
    on_progress: Callable[[str, float], None] | None = None,
    on_policy_done: Callable[[str, RunResult], None] | None = None,
) -> ScenarioResult:
    """Run every policy on the same engines, trace and seed."""
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r} (known: {', '.join(POLICIES)})")
    base = load_trace(trace_name, seed=seed)
    specs, trace, scen_config, capacity = build_scenario(
        scenario,
        base,
        instances=instances,
        utilization=utilization,
        preset=preset,
        kv_capacity_tokens=kv_capacity_tokens,
        duration=duration,
        seed=seed,
    )
    if config is not None:
        config = replace(config, quota_share=scen_config.quota_share)
    else:
        config = scen_config
    span = trace.arrivals[-1] if trace.arrivals else 0.0
    out = ScenarioResult(
        scenario=scenario,
        trace=trace_name,
        utilization=utilization,
        instances=instances,
        seed=seed,
        capacity_rps=capacity,
        offered_rps=len(trace) / span if span > 0 else 0.0,
        requests=len(trace),
    )
    for name in policies:
        if on_policy_start:
            on_policy_start(name, span)
        progress = (lambda t, _n=name: on_progress(_n, t)) if on_progress else None
        options = (policy_options or {}).get(name)
        result = ClusterSim(
            specs, trace, name, config=config, seed=seed, policy_options=options, progress=progress
        ).run()
        out.results[name] = result
        if on_policy_done:
            on_policy_done(name, result)
    return out
