"""Pure output formats: agent-check replies, the agent-send lookup, the Prometheus collector."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmdiag.agent import AgentLoop
from llmdiag.analyzers.timelines import SCENARIOS
from llmdiag.config import Config
from llmdiag.exporters.agent_check import UNKNOWN_REPLY, agent_check_reply, find_backend
from llmdiag.exporters.prometheus import TICK_BUCKETS, AgentTelemetry, BackendInfo, StateCollector
from llmdiag.model import BackendPenalty, BackendState, Reason, Severity


def _entry(state: BackendState, weight: int = 64, reasons: tuple[Reason, ...] = ()) -> BackendPenalty:
    return BackendPenalty("vllm-0", "10.0.0.7:8000", float(weight), 0.3, weight, state, reasons)


@pytest.mark.parametrize(("state", "reply"), [
    (BackendState.HEALTHY, "ready up 64%\n"),
    (BackendState.DEGRADED, "ready up 64%\n"),
    (BackendState.WARMING, "ready up 64%\n"),
    (BackendState.HALF_OPEN, "ready up 64%\n"),
    (BackendState.COOLING, "drain up\n"),
])
def test_reply_states_the_full_state_every_time(state: BackendState, reply: str) -> None:
    assert agent_check_reply(_entry(state)) == reply


def test_ejected_reply_carries_the_reason_on_one_line() -> None:
    why = Reason("circuit_open", Severity.CRITICAL, 1.0, "ejected after failures;\nretry in 15 s\x00")
    reply = agent_check_reply(_entry(BackendState.EJECTED, reasons=(why,)), maxconn=8)
    assert reply == "ready down maxconn:8 #ejected after failures; retry in 15 s\n"
    assert reply.count("\n") == 1
    assert agent_check_reply(_entry(BackendState.EJECTED)) == "ready down #ejected\n"


def test_maxconn_and_unknown() -> None:
    assert agent_check_reply(_entry(BackendState.HEALTHY, 0), maxconn=32) == "ready up maxconn:32 0%\n"
    assert agent_check_reply(None, maxconn=32) == UNKNOWN_REPLY == "ready up 100%\n"


def test_agent_send_lookup() -> None:
    entries = {"vllm-0": _entry(BackendState.HEALTHY), "be/odd": _entry(BackendState.COOLING)}
    assert find_backend("llm/vllm-0\n", entries) is entries["vllm-0"]
    assert find_backend("vllm-0", entries) is entries["vllm-0"]
    assert find_backend("10.0.0.7:8000", entries) is entries["vllm-0"]
    assert find_backend("be/odd", entries) is entries["be/odd"]
    for unknown in ("", "llm/vllm-9", "10.0.0.7:9000", "vllm-0/", "/"):
        assert find_backend(unknown, entries) is None, unknown


def _scrape(scenario: str, telemetry: AgentTelemetry | None = None) -> dict[str, list]:
    t = SCENARIOS[scenario].build()
    loop = AgentLoop(Config(), t.backends())
    for s in t.snapshots:
        loop.observe(s)
    registry = CollectorRegistry()
    registry.register(StateCollector(lambda: (loop.state, telemetry or AgentTelemetry())))
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_carry_the_agreed_names_and_values() -> None:
    tel = AgentTelemetry(ticks_total=3, tick_bucket_counts=(1, 2) + (3,) * (len(TICK_BUCKETS) - 1), tick_seconds_sum=0.02,
                         last_tick_timestamp=1.5, backends=(BackendInfo("vllm-0", "127.0.0.1:8000", "vllm", pod="p0"),),
                         diagnoses_opened={("gpu_fault", "critical"): 1}, agent_check_requests={"ok": 5},
                         agent_check_unknown_server_total=2)
    fams = _scrape("gpu_fault", tel)

    def value(name: str, **labels: str) -> float:
        hits = [s.value for s in fams[name] if all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(hits) == 1, (name, labels, fams.get(name))
        return hits[0]

    assert value("llmdiag_backend_info", backend="vllm-0", engine="vllm", pod="p0", namespace="") == 1
    assert value("llmdiag_backend_info", backend="vllm-1") == 1  # known only from the state
    assert 0 <= value("llmdiag_backend_score", backend="vllm-0") <= 100
    assert value("llmdiag_backend_penalty", backend="vllm-0") > 0
    states = [s for s in fams["llmdiag_backend_state"] if s.labels["backend"] == "vllm-0"]
    assert sorted(s.labels["state"] for s in states) == sorted(s.value for s in BackendState)
    assert sum(s.value for s in states) == 1
    assert value("llmdiag_diagnosis_open", backend="vllm-0", kind="gpu_fault", severity="critical") == 1
    assert value("llmdiag_diagnoses_opened", kind="gpu_fault", severity="critical") == 1
    assert value("llmdiag_backend_requests_waiting", backend="vllm-0") >= 0
    assert value("llmdiag_backend_ttft_seconds", backend="vllm-0", stat="p99") > 0
    assert value("llmdiag_gpu_xid_errors", gpu="0", xid="79") >= 1  # a labelled counter keeps its labels
    assert "llmdiag_gpu_utilization" in fams and "llmdiag_gpu_gpu_utilization" not in fams
    assert value("llmdiag_collector_up", collector="engine") == 1
    assert value("llmdiag_tick_duration_seconds", le="0.005") == 1
    assert value("llmdiag_tick_duration_seconds", le="+Inf") == 3
    assert value("llmdiag_ticks") == 3
    assert value("llmdiag_agent_check_requests", result="ok") == 5
    assert value("llmdiag_agent_check_unknown_server") == 2
    assert value("llmdiag_last_tick_timestamp_seconds") == 1.5


def test_a_signal_never_breaks_the_exposition() -> None:
    """NA, strings and odd label keys are left out; the rest of the scrape stands."""
    t = SCENARIOS["healthy"].build()
    loop = AgentLoop(Config(), t.backends())
    snap = t.snapshots[-1]
    snap.backends["vllm-0"].update({"weird-name": 1.0, "note": "text", "na_signal": None, "inf_signal": float("inf"),
                                    "score": 5.0, "labelled_total": {"bad label key": 3.0}})
    loop.observe(snap)
    registry = CollectorRegistry()
    registry.register(StateCollector(lambda: (loop.state, AgentTelemetry())))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert "llmdiag_backend_weird-name" not in fams and "llmdiag_backend_note" not in fams
    assert "llmdiag_backend_na_signal" not in fams
    scores = [s for s in fams["llmdiag_backend_score"].samples if s.labels["backend"] == "vllm-0"]
    assert len(scores) == 1 and scores[0].value != 5.0  # the balancer's score, not a signal named score
