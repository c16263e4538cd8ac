"""AgentPenalties.apply: matching, ttl, fail-open and counters (documents injected, no network)."""

from __future__ import annotations

import logging

import pytest

from llmdiag.model import Backend, BackendPenalty, BackendState, PenaltiesDocument, Reason, Severity
from llmdiag.router_feedback.agent_penalties import AgentPenalties
from llmdiag.router_feedback.balancer import Balancer

AGENT = "http://10.0.0.7:9090"
OTHER = "http://10.0.0.8:9090"


def _balancer() -> Balancer:
    return Balancer(
        [
            Backend("gw-a", "http://10.0.0.7:8000", models=("m",)),
            Backend("gw-b", "http://10.0.0.7:8001", models=("m",)),
            Backend("vllm-c", "http://10.0.0.8:8000", models=("m",)),
        ],
        clock=lambda: 100.0,
    )


def _entry(name: str, address: str, penalty: float, kind: str = "kv_cache_saturation") -> BackendPenalty:
    reasons = (Reason(kind, Severity.WARNING, penalty, f"{kind} on {name}"),) if penalty else ()
    return BackendPenalty(name, address, 100 * (1 - penalty), penalty, 50, BackendState.DEGRADED, reasons)


def _doc(ts: float, *entries: BackendPenalty, ttl: float = 5) -> PenaltiesDocument:
    return PenaltiesDocument(ts=ts, host="node", ttl_seconds=ttl, backends=entries)


def _penalties(balancer: Balancer) -> dict[str, float]:
    return {s.name: s.penalty for s in balancer.snapshot_states()}


def test_matches_by_address_first_then_name() -> None:
    balancer = _balancer()
    poller = AgentPenalties([AGENT])
    # The agent names engines after their sockets; the gateway after its config.
    poller.agents[AGENT].document = _doc(
        1000.0,
        _entry("vllm-8000", "10.0.0.7:8000", 0.3),
        _entry("vllm-c", "10.9.9.9:1", 0.5),  # unknown address, known name
        _entry("stranger", "10.1.1.1:80", 0.9),  # neither
    )
    applied = poller.apply(balancer, now=1001.0)
    assert applied == {"gw-a": 0.3, "vllm-c": 0.5}
    assert _penalties(balancer) == {"gw-a": 0.3, "gw-b": 0.0, "vllm-c": 0.5}
    reasons = next(s for s in balancer.snapshot_states() if s.name == "gw-a").reasons
    assert [r.kind for r in reasons][:1] == ["kv_cache_saturation"]
    assert poller.unmatched_backends_total == 1


def test_address_beats_a_name_that_points_elsewhere() -> None:
    balancer = _balancer()
    poller = AgentPenalties([AGENT])
    # Name says gw-b but the socket is gw-a's: the socket is what the agent measured.
    poller.agents[AGENT].document = _doc(1000.0, _entry("gw-b", "10.0.0.7:8000", 0.4))
    assert poller.apply(balancer, now=1000.0) == {"gw-a": 0.4}


def test_stale_document_fails_open_warns_once_and_counts_once(caplog: pytest.LogCaptureFixture) -> None:
    balancer = _balancer()
    poller = AgentPenalties([AGENT])
    poller.agents[AGENT].document = _doc(1000.0, _entry("x", "10.0.0.7:8001", 0.6), ttl=5)
    assert poller.apply(balancer, now=1005.0) == {"gw-b": 0.6}  # exactly ttl old: still applies
    with caplog.at_level(logging.WARNING, logger="llmdiag.router_feedback.agent_penalties"):
        for now in (1005.5, 1006.0, 1010.0):
            assert poller.apply(balancer, now=now) == {}
    assert _penalties(balancer)["gw-b"] == 0.0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "past their 5 s ttl" in warnings[0].getMessage()
    assert poller.stale_documents_total == 1
    # A fresh document brings the penalty back; a later stale one counts again.
    poller.agents[AGENT].document = _doc(1020.0, _entry("x", "10.0.0.7:8001", 0.2))
    assert poller.apply(balancer, now=1021.0) == {"gw-b": 0.2}
    assert poller.apply(balancer, now=1030.0) == {}
    assert poller.stale_documents_total == 2


def test_no_document_yet_is_fail_open() -> None:
    balancer = _balancer()
    poller = AgentPenalties([AGENT])
    assert poller.apply(balancer, now=1.0) == {}
    assert set(_penalties(balancer).values()) == {0.0}
    assert poller.stale_documents_total == 0


def test_two_agents_worse_penalty_wins_and_dropped_entries_reset() -> None:
    balancer = _balancer()
    poller = AgentPenalties([AGENT, OTHER])
    poller.agents[AGENT].document = _doc(1000.0, _entry("a", "10.0.0.7:8000", 0.2))
    poller.agents[OTHER].document = _doc(1000.0, _entry("a", "10.0.0.7:8000", 0.7), _entry("c", "10.0.0.8:8000", 0.1))
    assert poller.apply(balancer, now=1000.0) == {"gw-a": 0.7, "vllm-c": 0.1}
    # The second agent's next document says c is healthy and a is gone from it.
    poller.agents[OTHER].document = _doc(1001.0, _entry("c", "10.0.0.8:8000", 0.0))
    assert poller.apply(balancer, now=1001.0) == {"gw-a": 0.2}
    assert _penalties(balancer) == {"gw-a": 0.2, "gw-b": 0.0, "vllm-c": 0.0}


def test_unchanged_penalties_do_not_touch_the_balancer() -> None:
    balancer = _balancer()
    calls: list[tuple] = []
    real = balancer.set_penalty
    balancer.set_penalty = lambda *a: (calls.append(a), real(*a))  # type: ignore[method-assign]
    poller = AgentPenalties([AGENT])
    poller.agents[AGENT].document = _doc(1000.0, _entry("a", "10.0.0.7:8000", 0.3))
    for now in (1000.0, 1001.0, 1002.0):
        poller.apply(balancer, now=now)
    assert len(calls) == 1


def test_release_takes_back_our_penalties_only() -> None:
    balancer = _balancer()
    balancer.set_penalty("gw-b", 0.5)  # someone else's (e.g. a local analyzer)
    poller = AgentPenalties([AGENT])
    poller.agents[AGENT].document = _doc(1000.0, _entry("a", "10.0.0.7:8000", 0.3))
    poller.apply(balancer, now=1000.0)
    poller.release(balancer)
    assert _penalties(balancer) == {"gw-a": 0.0, "gw-b": 0.5, "vllm-c": 0.0}


def test_removed_backend_is_forgotten() -> None:
    balancer = _balancer()
    poller = AgentPenalties([AGENT])
    poller.agents[AGENT].document = _doc(1000.0, _entry("a", "10.0.0.7:8000", 0.3))
    poller.apply(balancer, now=1000.0)
    balancer.remove_backend("gw-a")
    assert poller.apply(balancer, now=1001.0) == {}
    assert balancer.counters["unknown_backend_feedback_total"] == 0


@pytest.mark.parametrize("kwargs", [{"interval": 0}, {"timeout": -1}])
def test_bad_settings_fail_loudly(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        AgentPenalties([AGENT], **kwargs)
    with pytest.raises(ValueError, match="duplicate"):
        AgentPenalties([AGENT, AGENT + "/"])
