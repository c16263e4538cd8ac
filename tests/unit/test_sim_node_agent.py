"""The node agent model: what it sees, hysteresis, and what it must not see."""

from __future__ import annotations

import pytest

from llmdiag.sim.engine_model import EngineModel, EnginePreset, SimRequest, StepTimeModel
from llmdiag.sim.node_agent import RULE_PENALTIES, NodeAgentModel

PRESET = EnginePreset("t", StepTimeModel(0.01, 1e-4, 1e-4, 0.0), 10_000, 64, 4096)


def engines(n: int = 2) -> list[EngineModel]:
    return [EngineModel(PRESET, name=f"e{i}") for i in range(n)]


def kinds(changes, i):
    for j, penalty, reasons in changes:
        if j == i:
            return penalty, sorted(r.kind for r in reasons)
    return None


def test_quiet_engines_get_no_penalty() -> None:
    agent = NodeAgentModel(engines())
    for t in range(10):
        assert agent.tick(float(t)) == []


def test_throttling_only_while_busy_and_held_after() -> None:
    es = engines()
    agent = NodeAgentModel(es, hold_s=5.0)
    es[0].slowdown = 2.5
    assert agent.tick(0.0) == []  # throttled but idle: NVML reports no slowdown under no load
    es[0].submit(SimRequest(1, 100, 100), 0.0)
    es[0].plan_step(0.0)
    es[0].commit_step(0.1)
    penalty, names = kinds(agent.tick(1.0), 0)
    assert names == ["gpu_throttling"] and penalty == pytest.approx(RULE_PENALTIES["gpu_throttling"])
    es[0].slowdown = 1.0
    assert agent.tick(2.0) == []  # unchanged: held
    penalty, names = kinds(agent.tick(6.5), 0)  # 5 s after it last held
    assert penalty == 0.0 and names == []


def test_kv_saturation_needs_three_seconds_or_preemptions() -> None:
    es = engines(1)
    agent = NodeAgentModel(es)
    es[0].kv_used = 9_000  # 90 % (set directly: the agent only reads it)
    es[0].running[1] = SimRequest(1, 10, 10)
    assert agent.tick(0.0) == []
    assert agent.tick(2.0) == []
    penalty, names = kinds(agent.tick(3.0), 0)
    assert names == ["kv_cache_saturation"]
    es2 = engines(1)
    agent2 = NodeAgentModel(es2)
    agent2.tick(0.0)
    es2[0].preemptions_total = 3
    assert kinds(agent2.tick(1.0), 0)[1] == ["kv_cache_saturation"]


def test_queue_growth_and_client_cancels_combine() -> None:
    es = engines(1)
    agent = NodeAgentModel(es)
    for t in range(4):
        for k in range(3):
            es[0].waiting.append(SimRequest(100 * t + k, 10, 10))
        changes = agent.tick(float(t))
    penalty, names = kinds(changes, 0)
    assert names == ["queue_avalanche"]
    for t in (4.0, 4.5, 5.0):
        agent.client_cancel(0, t)
    penalty, names = kinds(agent.tick(5.0), 0)
    assert names == ["client_timeout_storm", "queue_avalanche"]
    expected = 1 - (1 - RULE_PENALTIES["queue_avalanche"]) * (1 - RULE_PENALTIES["client_timeout_storm"])
    assert penalty == pytest.approx(expected)


def test_crashed_engine_is_not_a_node_diagnosis() -> None:
    es = engines(1)
    agent = NodeAgentModel(es)
    es[0].crash(0.0)
    assert agent.tick(1.0) == []
