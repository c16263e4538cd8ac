"""Rule details the catalog scenarios do not pin down: correlation keys, fallbacks, gaps, attribution."""

from __future__ import annotations

import pytest

from llmdiag.analyzers import Analyzer, penalties_document
from llmdiag.analyzers.timelines import SCENARIOS, TimelineBuilder
from llmdiag.config.analyzers import DiagnosisConfig
from llmdiag.model import HOST, BackendState


def _opened(t: TimelineBuilder, config: DiagnosisConfig | None = None):
    a = Analyzer(config or DiagnosisConfig(), backends=t.backends())
    out = []
    for s in t.snapshots:
        out.extend(a.observe(s).opened)
    return a, out


def test_dp_engine_evidence_names_the_engine() -> None:
    _, opened = _opened(SCENARIOS["dp_engine_overloaded"].build())
    (d,) = opened
    assert d.evidence[0].signal == "engines[1].requests_waiting" and d.evidence[0].value == 36


def _stall_then_reset(stall_conn: str, reset_conn: str) -> TimelineBuilder:
    t = TimelineBuilder().advance(40)
    b = t.backend("vllm-0")
    b.rate("h2_rst_stream_total", 0.0, code="CANCEL", conn=reset_conn, direction="received")
    b.drop("h2_flow_control_stalls_total").rate("h2_flow_control_stalls_total", 0.0, conn=stall_conn)
    t.advance(5)
    b.bump("h2_flow_control_stalls_total", 1, conn=stall_conn)
    t.advance(1)
    b.bump("h2_rst_stream_total", 1, code="CANCEL", conn=reset_conn, direction="received")
    return t.advance(3)


def test_flow_control_stall_joins_on_the_same_connection_only() -> None:
    _, same = _opened(_stall_then_reset("7", "7"))
    assert [d.kind for d in same] == ["grpc_flow_control_stall"]
    assert any("vllm-0/7" in e.signal for e in same[0].evidence)
    _, other = _opened(_stall_then_reset("7", "8"))
    assert other == []


def test_error_burst_falls_back_to_engine_finished_reasons() -> None:
    t = TimelineBuilder().advance(40)
    b = t.backend("vllm-0").drop("responses_total")
    b.rate("requests_finished_total", 2.0, reason="error")
    _, opened = _opened(t.advance(20))
    assert [(d.kind, d.evidence[0].signal) for d in opened] == [("error_burst", "requests_finished_total error ratio")]


def test_timewait_to_an_unknown_destination_is_a_host_diagnosis() -> None:
    t = TimelineBuilder().advance(40)
    t.destination("10.9.9.9:443").set(timewait_sockets=25000.0, ephemeral_ports_available=3000.0)
    _, opened = _opened(t.advance(3))
    assert [(d.kind, d.backend) for d in opened] == [("timewait_exhaustion", HOST)]
    assert "10.9.9.9:443" in opened[0].summary


def test_scrape_gap_neither_closes_nor_opens_and_stale_data_closes() -> None:
    t = TimelineBuilder().advance(40)
    b = t.backend("vllm-0").set(kv_cache_usage=0.95)
    t.advance(5)
    b.absent = True  # scrapes fail: the open diagnosis must survive a short gap ...
    t.advance(20)
    n_gap = len(t.snapshots)
    t.advance(15)  # ... and close once data has been missing stale_seconds (30)
    a = Analyzer(backends=t.backends())
    results = [a.observe(s) for s in t.snapshots]
    assert [d.kind for d in results[n_gap - 1].open] == ["kv_cache_saturation"]
    closed = [r.ts for r in results if r.closed]
    assert closed and closed[0] - (t.start + 45) >= 30


def test_penalties_document_takes_balancer_scores() -> None:
    t = SCENARIOS["kv_cache_saturation"].build()
    a = Analyzer(backends=t.backends())
    for s in t.snapshots:
        r = a.observe(s)
    doc = penalties_document(r.ts, "n", r.backends, scores={"vllm-0": (42.5, 40, BackendState.COOLING)})
    entries = {b.name: b for b in doc.backends}
    assert (entries["vllm-0"].score, entries["vllm-0"].weight_percent, entries["vllm-0"].state) == (42.5, 40, BackendState.COOLING)
    assert entries["vllm-0"].penalty == pytest.approx(0.5)
    assert entries["vllm-1"].score == 100.0


def test_enter_threshold_is_configurable() -> None:
    t = TimelineBuilder().advance(40)
    t.backend("vllm-0").set(kv_cache_usage=0.9)
    t.advance(10)
    from llmdiag.config import Config

    cfg = Config.from_toml("[diagnosis.kv_cache_saturation]\nenter = 0.95\nexit = 0.9\n").diagnosis
    _, opened = _opened(t, cfg)
    assert opened == []
