"""Rule details the catalog scenarios do not pin down: correlation keys, fallbacks, gaps, attribution."""

from __future__ import annotations

import pytest

from llmdiag.analyzers import Analyzer
from llmdiag.analyzers.timelines import SCENARIOS, TimelineBuilder, dist
from llmdiag.config.analyzers import DiagnosisConfig
from llmdiag.exporters.penalties import penalties_document
from llmdiag.model import HOST, BackendPenalty, BackendState, Labelled


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


def _stalls_and_resets(joined: int) -> TimelineBuilder:
    # Three stalls, each followed a second later by a received CANCEL; the http2 collector
    # joined ``joined`` of them to a stall on the same connection (h2_stall_then_reset_total).
    t = TimelineBuilder().advance(40)
    b = t.backend("vllm-0")
    for i in range(3):
        b.bump("h2_flow_control_stalls_total", 1)
        t.advance(1)
        b.bump("h2_rst_stream_total", 1, code="CANCEL", direction="received")
        if i < joined:
            b.bump("h2_stall_then_reset_total", 1)
        t.advance(2)
    return t.advance(2)


def test_flow_control_stall_reads_the_collectors_per_connection_join() -> None:
    _, joined = _opened(_stalls_and_resets(joined=1))
    assert [d.kind for d in joined] == ["grpc_flow_control_stall"]
    assert joined[0].evidence[0].signal == "h2_stall_then_reset_total (increase)"
    # the same stalls and resets on different connections: no join, no diagnosis
    _, apart = _opened(_stalls_and_resets(joined=0))
    assert apart == []


def test_flow_control_stall_needs_the_http2_collector() -> None:
    t = TimelineBuilder().advance(40)
    t.backend("vllm-0").drop("h2_stall_then_reset_total").rate("tcp_sndbuf_full_total", 50.0)
    t.backend("vllm-0").rate("h2_rst_stream_total", 5.0, code="CANCEL", direction="received")
    _, opened = _opened(t.advance(10))
    assert "grpc_flow_control_stall" not in {d.kind for d in opened}


def test_client_timeout_storm_counts_only_cancels_received_from_clients() -> None:
    t = TimelineBuilder().advance(40)
    # the backend itself resets streams with CANCEL (sent) while slow: not the clients giving up
    t.backend("vllm-0").set(ttft_seconds=dist(6.0)).rate("h2_rst_stream_total", 9.0, code="CANCEL", direction="sent")
    _, opened = _opened(t.advance(10))
    assert "client_timeout_storm" not in {d.kind for d in opened}
    _, storm = _opened(SCENARIOS["client_timeout_storm"].build())
    assert "client_timeout_storm" in {d.kind for d in storm}


def test_client_timeout_storm_on_a_grpc_port_whose_first_cancel_comes_with_the_storm() -> None:
    # A gRPC port (no TCP peer-close counter) watched by the http2 collector, which labels only the
    # RST_STREAM codes it has seen: nothing until the storm. "No CANCEL yet" must count as 0 so the
    # baseline is learned while healthy; else the storm itself becomes the baseline and 3 cancels/s
    # (below the 4x-of-min_rate bar of an unwarmed baseline) never fire.
    t = TimelineBuilder()
    grpc = t.backend("vllm-0").drop("tcp_peer_closes_total", "h2_rst_stream_total").set(h2_rst_stream_total=Labelled())
    t.advance(40)
    grpc.drop("h2_rst_stream_total").set(ttft_seconds=dist(6.0)).rate(
        "h2_rst_stream_total", 3.0, code="CANCEL", direction="received")
    _, opened = _opened(t.advance(10))
    assert "client_timeout_storm" in {d.kind for d in opened if d.backend == "vllm-0"}, opened
    # the same port, slow but with no cancels at all: no storm
    quiet = TimelineBuilder()
    quiet.backend("vllm-0").drop("tcp_peer_closes_total", "h2_rst_stream_total").set(h2_rst_stream_total=Labelled())
    quiet.advance(40).backend("vllm-0").set(ttft_seconds=dist(6.0))
    _, calm = _opened(quiet.advance(10))
    assert "client_timeout_storm" not in {d.kind for d in calm}


def test_vllm_aborts_are_left_out_of_the_error_ratio() -> None:
    # 4 stop/s, 0.3 error/s (7 % of completed requests) and 20 client disconnects (abort)/s:
    # aborts neither count as errors nor dilute the errors below the 5 % bar.
    t = TimelineBuilder().advance(40)
    b = t.backend("vllm-0").drop("responses_total")
    b.rate("requests_finished_total", 20.0, reason="abort").rate("requests_finished_total", 0.3, reason="error")
    _, opened = _opened(t.advance(30))
    assert [(d.kind, d.backend) for d in opened] == [("error_burst", "vllm-0")]
    assert "(error)" in opened[0].summary


def test_cuda_alloc_failures_are_read_per_backend() -> None:
    _, opened = _opened(SCENARIOS["gpu_memory_pressure"].build())
    (d,) = opened
    assert (d.kind, d.backend) == ("gpu_memory_pressure", "vllm-0")
    assert {e.signal: e.value for e in d.evidence}["cuda_alloc_failures_total (increase)"] == 3


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
    b.absent = "timeout"  # scrapes fail: the open diagnosis must survive a short gap ...
    t.advance(20)
    n_gap = len(t.snapshots)
    t.advance(15)  # ... and close once data has been missing stale_seconds (30)
    a = Analyzer(backends=t.backends())
    results = [a.observe(s) for s in t.snapshots]
    # ... while the outage itself is a backend_down diagnosis of its own.
    assert sorted(d.kind for d in results[n_gap - 1].open) == ["backend_down", "kv_cache_saturation"]
    closed = [(r.ts, d.kind) for r in results for d in r.closed]
    assert closed and closed[0][1] == "kv_cache_saturation" and closed[0][0] - (t.start + 45) >= 30
    assert [d.kind for d in results[-1].open] == ["backend_down"]


def test_penalties_document_takes_balancer_states() -> None:
    t = SCENARIOS["kv_cache_saturation"].build()
    a = Analyzer(backends=t.backends())
    for s in t.snapshots:
        r = a.observe(s)
    cooling = BackendPenalty("vllm-0", "10.0.0.7:8000", 42.5, 0.5, 40, BackendState.COOLING)
    doc = penalties_document(r.ts, "n", r.backends, balancer_states=[cooling])
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


def test_a_diagnosis_held_by_hysteresis_shows_the_exit_threshold_and_says_holding() -> None:
    t = TimelineBuilder().advance(40)
    b = t.backend("vllm-0").set(kv_cache_usage=0.9, requests_waiting=2.0)
    t.advance(5)  # opens: 0.9 >= enter 0.85 for 3 s
    b.set(kv_cache_usage=0.8295)  # between exit 0.80 and enter 0.85: held open
    t.advance(3)
    a = Analyzer(backends=t.backends())
    results = [a.observe(s) for s in t.snapshots]
    (d,) = [d for d in results[-1].open if d.kind == "kv_cache_saturation"]
    kv = next(e for e in d.evidence if e.signal == "kv_cache_usage")
    assert kv.value == 0.8295 and kv.threshold == 0.8  # the exit threshold that keeps it open, not 0.85
    assert "holding" in d.summary
    waiting = next(e for e in d.evidence if e.signal == "requests_waiting")
    assert waiting.window_seconds is None and waiting.window_text == "now"  # a current value, not "0s"
    opened = next(r for r in results if r.opened)
    (first,) = opened.opened
    assert next(e for e in first.evidence if e.signal == "kv_cache_usage").threshold == 0.85
    assert "holding" not in first.summary
