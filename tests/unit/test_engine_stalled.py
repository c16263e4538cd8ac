"""engine_stalled: work in the engine, /metrics answering, and nothing produced."""

from __future__ import annotations

from llmdiag.analyzers import Analyzer
from llmdiag.analyzers.timelines import SCENARIOS, WARMUP, TimelineBuilder
from llmdiag.model import Severity


def _run(t: TimelineBuilder):
    a = Analyzer(backends=t.backends())
    return [a.observe(s) for s in t.snapshots]


def _episodes(results, backend="vllm-0"):
    opened = [(r.ts, d) for r in results for d in r.opened if (d.kind, d.backend) == ("engine_stalled", backend)]
    closed = [(r.ts, d) for r in results for d in r.closed if (d.kind, d.backend) == ("engine_stalled", backend)]
    return opened, closed


def test_a_hung_batch_opens_after_stalled_seconds_critical_and_closes_when_tokens_flow() -> None:
    t = SCENARIOS["engine_stalled"].build()
    results = _run(t)
    (opened_at, d), = _episodes(results)[0]
    stall = t.start + WARMUP  # the first tick whose counters did not move
    assert stall + 4 <= opened_at <= stall + 5  # 5 s without progress since the last change
    assert d.severity is Severity.CRITICAL and d.penalty == 1.0
    evidence = {e.signal: e for e in d.evidence}
    assert evidence["requests_running"].value == 8.0 and evidence["requests_waiting"].value == 2.0
    assert evidence["stalled_seconds"].value >= 5.0 and evidence["stalled_seconds"].threshold == 5.0
    assert "no engine step and no token" in d.summary and "8 running" in d.summary
    at_open = next(r for r in results if r.ts == opened_at)
    assert at_open.backends["vllm-0"].penalty == 1.0 and at_open.backends["vllm-1"].penalty == 0.0
    (closed_at, _), = _episodes(results)[1]
    recovered = stall + 12
    assert recovered <= closed_at <= recovered + 2  # the first tick with progress, hold (5 s) long past


def test_one_stalled_data_parallel_engine_is_found_behind_a_moving_backend_sum() -> None:
    t = TimelineBuilder().advance(30)
    e0, e1 = t.engine("vllm-0", "0"), t.engine("vllm-0", "1")
    for e in (e0, e1):
        e.set(requests_running=4.0, requests_waiting=0.0).rate("generation_tokens_total", 400.0).rate("prompt_tokens_total", 900.0)
        e.rate("engine_steps_total", 20.0)
    t.advance(5)
    e1.rate("generation_tokens_total", 0.0).rate("prompt_tokens_total", 0.0).rate("engine_steps_total", 0.0)
    t.advance(8)
    (_, d), = _episodes(_run(t))[0]
    assert d.summary.startswith("engine 1: ")
    assert "engines[1].requests_running" in {e.signal for e in d.evidence}


def test_an_idle_engine_is_not_stalled() -> None:
    t = TimelineBuilder().advance(30)
    b = t.backend("vllm-0").set(requests_running=0.0, requests_waiting=0.0)
    b.rate("prompt_tokens_total", 0.0).rate("generation_tokens_total", 0.0).rate("engine_steps_total", 0.0)
    b.rate("requests_finished_total", 0.0, reason="stop")
    t.advance(30)
    assert _episodes(_run(t))[0] == []


def test_work_that_arrives_on_an_idle_engine_counts_from_its_arrival() -> None:
    t = TimelineBuilder().advance(30)
    b = t.backend("vllm-0").set(requests_running=0.0, requests_waiting=0.0)
    b.rate("prompt_tokens_total", 0.0).rate("generation_tokens_total", 0.0).rate("engine_steps_total", 0.0)
    b.rate("requests_finished_total", 0.0, reason="stop")
    t.advance(20)  # idle for 20 s: counters flat, and rightly so
    b.set(requests_running=1.0)
    t.advance(3)  # a request arrived and has produced nothing for 3 s: not yet a stall
    assert _episodes(_run(t))[0] == []
    t.advance(3)
    assert len(_episodes(_run(t))[0]) == 1


def test_an_engine_that_does_not_count_its_steps_is_not_judged() -> None:
    t = TimelineBuilder().advance(30)
    b = t.backend("vllm-0")
    b.rate("prompt_tokens_total", 0.0).rate("generation_tokens_total", 0.0).rate("engine_steps_total", 0.0)
    t.advance(10)
    assert len(_episodes(_run(t))[0]) == 1  # with its step counter, this engine is stalled
    for s in t.snapshots:  # SGLang, TGI: tokens counted only when a request ends; no step counter
        del s.backends["vllm-0"]["engine_steps_total"]
    assert _episodes(_run(t))[0] == []


def test_steps_without_tokens_are_progress() -> None:
    t = TimelineBuilder().advance(30)
    b = t.backend("vllm-0").set(requests_running=1.0, requests_waiting=0.0)
    b.rate("prompt_tokens_total", 0.0).rate("generation_tokens_total", 0.0)  # a long chunked prefill,
    t.advance(12)  # its chunks counted as steps (engine_steps_total still at 25/s)
    assert _episodes(_run(t))[0] == []
