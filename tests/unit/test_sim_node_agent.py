"""The simulated node agent runs the real analyzers: what it sees, and that it cannot drift from the product."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmdiag.config.analyzers import DiagnosisConfig, GpuThrottlingConfig
from llmdiag.sim.engine_model import EngineModel, EnginePreset, SimRequest, StepTimeModel
from llmdiag.sim.node_agent import NodeAgentModel

PRESET = EnginePreset("t", StepTimeModel(0.01, 1e-4, 1e-4, 0.0), 10_000, 64, 4096)
DEFAULTS = DiagnosisConfig()


def engines(n: int = 2) -> list[EngineModel]:
    return [EngineModel(PRESET, name=f"e{i}") for i in range(n)]


def last(agent: NodeAgentModel, i: int) -> tuple[float, list[str]]:
    penalty, reasons = agent.last[i]
    return penalty, sorted(r.kind for r in reasons)


def busy(eng: EngineModel) -> None:
    eng.running[1] = SimRequest(1, 10, 10)


def run(agent: NodeAgentModel, start: float, end: float) -> None:
    t = start
    while t <= end:
        agent.tick(t)
        t += 1.0


def test_quiet_engines_get_no_penalty() -> None:
    agent = NodeAgentModel(engines())
    for t in range(10):
        assert agent.tick(float(t)) == []


def test_throttling_while_busy_opens_after_the_real_rules_for_seconds_with_its_penalty() -> None:
    es = engines()
    agent = NodeAgentModel(es)
    es[0].slowdown = 2.5
    run(agent, 0.0, 10.0)
    assert last(agent, 0) == (0.0, [])  # throttled but idle: NVML reports the GPU idle
    busy(es[0])
    run(agent, 11.0, 11.0 + DEFAULTS.gpu_throttling.for_seconds - 1)
    assert last(agent, 0) == (0.0, [])  # not yet for_seconds
    run(agent, 11.0 + DEFAULTS.gpu_throttling.for_seconds, 20.0)
    assert last(agent, 0) == (pytest.approx(DEFAULTS.gpu_throttling.penalty), ["gpu_throttling"])
    assert last(agent, 1) == (0.0, [])


def test_kv_saturation_follows_the_catalog_severities() -> None:
    es = engines(1)
    agent = NodeAgentModel(es)
    busy(es[0])
    es[0].kv_used = 9_000  # 90 % (set directly: the agent only reads it)
    run(agent, 0.0, 5.0)
    # Full but nothing waits and nothing is preempted: info, with the rule's small penalty.
    assert last(agent, 0) == (pytest.approx(DEFAULTS.kv_cache_saturation.info_penalty), ["kv_cache_saturation"])
    es[0].waiting.append(SimRequest(2, 10, 10))
    run(agent, 6.0, 7.0)
    assert last(agent, 0) == (pytest.approx(DEFAULTS.kv_cache_saturation.penalty), ["kv_cache_saturation"])


def test_the_simulated_agent_follows_the_configuration_it_is_given() -> None:
    # The drift guard of issue 14: the simulator used to hard-code penalties (0.30 for gpu_throttling where
    # the product says 0.2). It now has no numbers of its own: change the configuration, the sim follows.
    config = replace(DEFAULTS, gpu_throttling=GpuThrottlingConfig(penalty=0.33, for_seconds=1.0))
    es = engines(1)
    agent = NodeAgentModel(es, config=config)
    es[0].slowdown = 2.0
    busy(es[0])
    run(agent, 0.0, 3.0)
    assert last(agent, 0) == (pytest.approx(0.33), ["gpu_throttling"])
    assert agent.analyzer.config is config


def test_queue_avalanche_at_the_real_threshold() -> None:
    es = engines(1)
    agent = NodeAgentModel(es)
    busy(es[0])
    for k in range(int(DEFAULTS.queue_avalanche.waiting_enter)):
        es[0].waiting.append(SimRequest(100 + k, 10, 10))
    run(agent, 0.0, DEFAULTS.queue_avalanche.for_seconds + 1.0)
    penalty, names = last(agent, 0)
    assert "queue_avalanche" in names
    assert penalty >= DEFAULTS.queue_avalanche.penalty - 1e-9


def test_what_the_snapshot_holds() -> None:
    es = engines(2)
    agent = NodeAgentModel(es)
    busy(es[0])
    agent.first_token(0, 0.5)
    agent.first_token(0, 1.5)
    agent.client_cancel(0, 1.0)
    es[1].crash(0.0)
    snap = agent.snapshot(2.0)
    b0, b1 = snap.backends["e0"], snap.backends["e1"]
    assert b0["up"] == 1.0 and b0["requests_running"] == 1.0 and b0["tcp_peer_closes_total"] == 1.0
    assert b0["ttft_seconds"].ewma == pytest.approx(0.2 * 1.5 + 0.8 * 0.5)
    assert snap.gpus["0"]["gpu_utilization"] == 1.0
    # A crashed engine answers no scrape: up 0, no engine metrics (the catalog's backend_down reads this).
    assert b1["up"] == 0.0 and "kv_cache_usage" not in b1


def test_a_crashed_engine_is_reported_down_by_the_real_catalog() -> None:
    es = engines(2)
    agent = NodeAgentModel(es)
    es[1].crash(0.0)
    run(agent, 0.0, 3.0)
    penalty, names = last(agent, 1)
    assert names == ["backend_down"] and penalty == pytest.approx(DEFAULTS.backend_down.critical_penalty)
    assert "refuses connections" in agent.last[1][1][0].summary
    assert last(agent, 0) == (0.0, [])

