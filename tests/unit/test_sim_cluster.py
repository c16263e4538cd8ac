"""The cluster simulator end to end: determinism, every scenario's sanity, traces, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmdiag.sim.cluster import ClusterSim, EngineSpec, SimConfig, measure_capacity
from llmdiag.sim.engine_model import PRESETS
from llmdiag.sim.policies import POLICIES
from llmdiag.sim.scenarios import SCENARIOS, build_scenario, run_scenario
from llmdiag.sim.workload import Trace, TraceError, load_trace, scale_to_rate

H100 = PRESETS["llama-70b-h100-tp4"]


@pytest.fixture(scope="module")
def conv(shared_dir: Path) -> Trace:
    return load_trace("azure2023_conv", data_dir=shared_dir / "data")


def test_named_traces_load(shared_dir: Path) -> None:
    data = shared_dir / "data"
    conv = load_trace("azure2023_conv", data_dir=data)
    assert len(conv) == 19366 and conv.arrivals[0] == 0.0
    assert 5.0 < conv.mean_rate < 6.0
    gamma = load_trace("sharegpt_gamma", data_dir=data, seed=1)
    assert len(gamma) == 30731 and list(gamma.arrivals) == sorted(gamma.arrivals)
    assert load_trace("sharegpt_gamma", data_dir=data, seed=1) == gamma


def test_bad_traces_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_trace(str(tmp_path / "missing.csv"))
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,input_tokens\n0,1\n")
    with pytest.raises(TraceError, match="missing column"):
        load_trace(str(bad))
    bad.write_text("arrival_s,input_tokens,output_tokens\n0,ten,1\n")
    with pytest.raises(TraceError, match="not a number"):
        load_trace(str(bad))
    ok = tmp_path / "ok.csv"
    ok.write_text("arrival_s,input_tokens,output_tokens,extra\n5,100,10,x\n2,50,5,y\n")
    tr = load_trace(str(ok))
    assert tr.arrivals == (0.0, 3.0) and tr.inputs == (50, 100)


def test_scaling_hits_the_rate_and_tiles(conv: Trace) -> None:
    scaled = scale_to_rate(conv, 20.0)
    assert len(scaled) == len(conv)
    assert scaled.mean_rate == pytest.approx(20.0, rel=1e-6)
    tiled = scale_to_rate(conv, 2.0, duration=2 * conv.span * conv.mean_rate / 2.0 * 0.75)
    assert len(tiled) > len(conv)  # longer than one pass: tiled
    assert list(tiled.arrivals) == sorted(tiled.arrivals)


def test_capacity_is_measured_by_saturation(conv: Trace) -> None:
    cap = measure_capacity(H100, conv, seconds=300, warmup=60)
    # one 70B H100 engine on the conversation mix: a few requests per second
    assert 1.0 < cap < 20.0
    small_kv = measure_capacity(H100, conv, kv_capacity_tokens=60_000, seconds=300, warmup=60)
    assert small_kv < cap  # less KV, smaller batches, less throughput


def _run(conv: Trace, policy: str, seed: int) -> dict:
    specs, trace, config, _ = build_scenario("slow_replica", conv, instances=3, duration=150.0, seed=seed)
    return ClusterSim(specs, trace, policy, config=config, seed=seed).run().summary()


@pytest.mark.parametrize("policy", ["llmdiag", "envoy_lr", "oracle"])
def test_same_seed_same_numbers(conv: Trace, policy: str) -> None:
    a = _run(conv, policy, seed=7)
    b = _run(conv, policy, seed=7)
    a.pop("wall_seconds")
    b.pop("wall_seconds")
    assert a == b
    c = _run(conv, policy, seed=8)
    c.pop("wall_seconds")
    assert c != a


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_runs_sane(conv: Trace, scenario: str) -> None:
    specs, trace, config, capacity = build_scenario(scenario, conv, instances=4, duration=180.0, seed=1)
    assert capacity > 0
    rejected = {}
    for policy in POLICIES:
        sim = ClusterSim(specs, trace, policy, config=config, seed=1)
        result = sim.run()
        m = sim.metrics
        # every request accounted for, exactly once
        assert sum(result.outcomes.values()) + result.unfinished == len(trace) == result.requests
        assert result.unfinished == 0
        assert min(m.ttfts) >= 0 and min(m.e2es) >= 0
        assert all(e2e >= 0 for e2e in m.e2es)
        assert result.ttft_p50 is not None and result.ttft_p50 <= result.ttft_p99
        # the CDF behind the plot: 0..1 quantiles, non-decreasing, ending at the slowest request
        qs = result.ttft_quantiles
        assert [q for q, _ in qs] == [i / 200 for i in range(201)]
        assert all(a[1] <= b[1] for a, b in zip(qs, qs[1:]))
        assert qs[0][1] == min(m.ttfts) and qs[-1][1] == max(m.ttfts)
        # gateway counters return to zero when everything ended
        assert sim.gw.in_flight == [0] * 4 and sim.gw.pending_prefill == [0] * 4
        for eng in sim.engines:
            assert eng.kv_used == 0 and eng.n_decoding == 0 and eng.decode_ctx_sum == 0 and eng.decode_end_sum == 0
        rejected[policy] = result.rejected_429
        if scenario in ("crash_restart", "crash_restart_kv"):
            assert result.outcomes.get("lost", 0) > 0  # in-flight requests died with the engine
        if scenario == "kv_storm":
            assert max(trace.inputs) == 32768
    if scenario in ("saturation_429", "client_quota_429"):
        assert any(rejected.values())
    else:
        assert not any(rejected.values()), rejected


def test_client_quota_429s_do_not_penalise_backends(conv: Trace) -> None:
    specs, trace, config, _ = build_scenario("client_quota_429", conv, instances=4, duration=90.0, seed=2)
    sim = ClusterSim(specs, trace, "llmdiag", config=config, seed=2)
    result = sim.run()
    counters = sim.policy.balancer.counters
    assert result.rejected_429 > 0
    assert counters["responses_client_ratelimit_total"] >= result.rejected_429
    assert counters["cooling_enforced_total"] == 0 and counters["ejections_total"] == 0


def test_penalties_reach_llmdiag_after_a_delay(conv: Trace) -> None:
    specs, trace, config, _ = build_scenario("slow_replica", conv, instances=4, duration=200.0, seed=3)
    config = SimConfig(penalty_delay_s=1.5)
    sim = ClusterSim(specs, trace, "llmdiag", config=config, seed=3)
    seen: list[tuple[float, int, float]] = []
    original = sim.policy.on_penalty

    def spy(i, penalty, reasons, now):
        seen.append((now, i, penalty))
        original(i, penalty, reasons, now)

    sim.policy.on_penalty = spy
    sim.run()
    throttled = [(t, p) for t, i, p in seen if i == 0 and p > 0]
    assert throttled, "the throttled engine got no penalty"
    # the slowdown starts at 120 s; the agent ticks each second and delivery takes 1.5 s
    assert throttled[0][0] >= 120.0 + 1.5


def test_run_scenario_json_shape(shared_dir: Path) -> None:
    out = run_scenario("clean", "azure2023_conv", policies=["round_robin", "llmdiag"], instances=2, duration=30.0)
    doc = out.to_json()
    assert set(doc) >= {"scenario", "trace", "utilization", "results"}
    for res in doc["results"].values():
        assert set(res) >= {
            "ttft_p50", "ttft_p99", "e2e_p99", "goodput_rps", "throughput_tokens_per_s",
            "rejected_429", "preemptions", "oscillation_index",
        }


def test_cli_bench_sim_json(capsys: pytest.CaptureFixture[str]) -> None:
    from llmdiag.cli.main import main

    rc = main(["bench", "sim", "--scenario", "clean", "--policies", "round_robin,oracle", "--instances", "2",
               "--duration", "20", "--json", "--seed", "3"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["scenario"] == "clean" and set(doc["results"]) == {"round_robin", "oracle"}
    rc = main(["bench", "sim", "--scenario", "nope"])
    assert rc == 64
    assert "unknown scenario" in capsys.readouterr().err
    rc = main(["bench", "sim", "--scenario", "kv_bound", "--kv-tokens", "0", "--policies", "oracle"])
    assert rc == 64
    assert "--kv-tokens must be >= 1" in capsys.readouterr().err


def test_cli_bench_sim_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib  # noqa: F401 - a dependency: its absence must fail, not skip
    from llmdiag.cli.main import main

    rc = main(["bench", "sim", "--policies", "round_robin", "--instances", "2", "--duration", "15",
               "--plot", str(tmp_path)])
    assert rc == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["clean_round_robin_load.png", "clean_ttft.png"]
    assert (tmp_path / "clean_ttft.png").read_bytes()[:4] == b"\x89PNG"
    assert "round_robin" in capsys.readouterr().out


def test_engine_spec_needs_engines(conv: Trace) -> None:
    with pytest.raises(ValueError):
        ClusterSim([], conv, "round_robin")
    with pytest.raises(ValueError):
        SimConfig(scrape_interval_s=0)
    with pytest.raises(ValueError):
        ClusterSim([EngineSpec(H100)], conv, "nope")


def test_llmdiag_recovers_a_crashed_engine_through_real_probes(conv: Trace) -> None:
    specs, trace, config, _ = build_scenario("crash_restart", conv, instances=4, duration=400.0, seed=4)
    sim = ClusterSim(specs, trace, "llmdiag", config=config, seed=4)
    result = sim.run()
    balancer = sim.policy.balancer
    assert sim.policy.probes.probes_total > 0
    # the requests lost in the crash (502s) or refused connections opened its circuit
    assert balancer.counters["ejections_total"] > 0
    assert result.outcomes.get("connect_error", 0) == 0  # ... and every refusal was retried elsewhere
    t = result.series["t"]
    rate0 = result.series["dispatch_rate"][0]
    down = [r for ts, r in zip(t, rate0) if 125 <= ts < 150]
    after = [r for ts, r in zip(t, rate0) if ts >= 300]
    assert sum(down) == 0  # nothing reached it while it was down
    # Re-admitted within seconds of the restart at 150 s (issue 14: it used to wait 10-15 s and more):
    # one good probe after the refused connections goes half-open, first tokens close the circuit.
    early = [r for ts, r in zip(t, rate0) if 150 <= ts < 158]
    assert sum(early) > 0
    assert sum(after) > 0.5 * sum(sum(r for ts, r in zip(t, s) if ts >= 300) for s in result.series["dispatch_rate"]) / 4
    assert balancer.state(sim.policy.backends[0]).value in ("healthy", "degraded", "warming")


def test_same_numbers_across_processes() -> None:
    """String hashing differs between processes; results must not depend on it."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "llmdiag.cli.main", "bench", "sim", "--scenario", "kv_storm", "--instances", "3",
           "--duration", "150", "--seed", "5", "--policies", "llmdiag,gie,litellm", "--json"]
    outs = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=True)
        doc = json.loads(proc.stdout)
        for res in doc["results"].values():
            res.pop("wall_seconds")
        outs.append(doc)
    assert outs[0] == outs[1]


def test_kv_bound_scenarios_bind_the_cache_unless_told_otherwise(conv: Trace) -> None:
    from llmdiag.sim.scenarios import KV_BOUND_TOKENS

    for scenario in ("kv_bound", "crash_restart_kv"):
        specs, _, _, _ = build_scenario(scenario, conv, instances=2, duration=30.0)
        assert [s.kv_capacity_tokens for s in specs] == [KV_BOUND_TOKENS] * 2
        specs, _, _, _ = build_scenario(scenario, conv, instances=2, duration=30.0, kv_capacity_tokens=300_000)
        assert [s.kv_capacity_tokens for s in specs] == [300_000] * 2
    specs, _, _, _ = build_scenario("crash_restart_kv", conv, instances=2, duration=30.0)
    assert [f.kind for f in specs[0].faults.faults] == ["crash"]

