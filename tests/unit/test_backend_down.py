"""backend_down: a dead engine is a critical diagnosis with penalty 1, never "healthy"."""

from __future__ import annotations

import json

import pytest

from llmdiag.analyzers import Analyzer
from llmdiag.analyzers.timelines import SCENARIOS, TimelineBuilder
from llmdiag.model import BackendState, Diagnosis, Severity


def _run(t: TimelineBuilder):
    a = Analyzer(backends=t.backends())
    return [a.observe(s) for s in t.snapshots]


def _episode(results, kind="backend_down", backend="vllm-0"):
    opened = [(r.ts, d) for r in results for d in r.opened if (d.kind, d.backend) == (kind, backend)]
    closed = [(r.ts, d) for r in results for d in r.closed if (d.kind, d.backend) == (kind, backend)]
    return opened, closed


def test_crash_opens_at_the_first_refusal_critical_with_penalty_one_and_what_was_last_seen() -> None:
    t = SCENARIOS["backend_down"].build()
    results = _run(t)
    (opened_at, d), = _episode(results)[0]
    crash = t.start + 40 + 3 + 1  # warm-up 40 s, 3 s of failures building, first refused scrape
    assert d.since == crash and opened_at == crash  # nothing listens: no second scrape needed
    assert d.severity is Severity.CRITICAL and d.penalty == 1.0
    evidence = {e.signal: e for e in d.evidence}
    assert evidence["scrape_failure"].value == "connection_refused"
    assert evidence["scrape_failure"].window_seconds is None  # a current value, not "0s"
    assert evidence["up"].value == 0.0 and evidence["up"].window_seconds is None  # first failure: no "0s"
    assert evidence["unanswered_seconds"].value == 1.0 and evidence["unanswered_seconds"].threshold == "refused"
    # What it looked like the last time it answered (1 s before the crash).
    assert evidence["kv_cache_usage (last seen)"].value == 0.83
    assert evidence["requests_waiting (last seen)"].value == 3.0
    assert evidence["ttft_seconds.ewma (last seen)"].value == 1.8
    assert evidence["cuda_alloc_failures_total (increase)"].value == 2.0
    assert evidence["gpus[0].memory_used_bytes / memory_total_bytes (last seen)"].value == 0.9
    assert "refuses connections" in d.summary and "KV 83%" in d.summary and "2 allocation failures" in d.summary
    at_open = next(r for r in results if r.ts == opened_at)
    assert at_open.backends["vllm-0"].penalty == 1.0 and at_open.backends["vllm-0"].state is BackendState.DEGRADED
    assert [r.kind for r in at_open.backends["vllm-0"].reasons][0] == "backend_down"
    assert at_open.backends["vllm-1"].penalty == 0.0


def test_closes_with_hysteresis_once_it_answers_again() -> None:
    t = SCENARIOS["backend_down"].build()
    results = _run(t)
    back = t.start + 40 + 3 + 12 + 1  # first answered scrape after the restart
    (closed_at, last), = _episode(results)[1]
    # Open at the first good scrape (holding), closed recover_seconds (3) after the last failure.
    at_back = next(r for r in results if r.ts == back)
    (held,) = [d for d in at_back.open if d.kind == "backend_down"]
    assert "holding" in held.summary and held.penalty == 1.0
    assert closed_at == back - 1 + 3
    assert "backend_down" not in {r.kind for r in results[-1].backends["vllm-0"].reasons}


def test_one_answer_in_an_outage_keeps_it_open() -> None:
    t = TimelineBuilder().advance(40)
    b = t.backend("vllm-0")
    b.absent = "timeout"
    t.advance(6)
    b.absent = None  # one scrape gets through ...
    t.advance(1)
    b.absent = "timeout"  # ... and it hangs again
    t.advance(6)
    results = _run(t)
    opened, closed = _episode(results)
    assert len(opened) == 1 and closed == []
    assert "does not answer its scrape in time" in results[-1].open[0].summary


def test_never_answered_says_so() -> None:
    t = TimelineBuilder()
    t.backend("vllm-0").absent = "name_not_resolved"
    t.advance(3)
    results = _run(t)
    (_, d), = _episode(results)[0]
    assert "never answered" in d.summary and "does not resolve" in d.summary
    assert not any(e.signal.endswith("(last seen)") for e in d.evidence)


def test_backend_without_an_up_signal_is_not_judged() -> None:
    t = TimelineBuilder().advance(5)
    for s in t.snapshots:
        del s.backends["vllm-0"]["up"]  # a gRPC backend: only the http2 collector sees it
    assert _episode(_run(t))[0] == []


def test_json_round_trip_keeps_kind_penalty_and_null_windows() -> None:
    results = _run(SCENARIOS["backend_down"].build())
    (_, d), = _episode(results)[0]
    text = json.dumps(d.to_json(), allow_nan=False)
    obj = json.loads(text)
    assert obj["kind"] == "backend_down" and obj["severity"] == "critical" and obj["penalty"] == 1.0
    failure = next(e for e in obj["evidence"] if e["signal"] == "scrape_failure")
    assert failure == {"signal": "scrape_failure", "value": "connection_refused", "threshold": None, "window_seconds": None}
    assert Diagnosis.from_json(obj) == d


@pytest.mark.parametrize("reason", ["connection_refused", "timeout", "name_not_resolved", "not_an_engine"])
def test_every_failure_kind_opens_it(reason: str) -> None:
    t = TimelineBuilder().advance(30)
    t.backend("vllm-0").absent = reason
    t.advance(2)
    assert len(_episode(_run(t))[0]) == 1


def _down_after_warmup(reason: str, ages: list[float | None], **config) -> list:
    """A healthy warm-up, then one failed scrape per entry of ``ages`` (the engine collector's
    ``scrape_age_seconds`` on it; ``None``: not recorded). Returns the analyzer's results."""
    from dataclasses import replace

    from llmdiag.config.analyzers import BackendDownConfig, DiagnosisConfig

    t = TimelineBuilder().advance(30)
    b = t.backend("vllm-0")
    b.absent = reason
    t.advance(len(ages))
    for snap, age in zip(t.snapshots[-len(ages):], ages, strict=True):
        if age is not None:
            snap.backends["vllm-0"]["scrape_age_seconds"] = age
    a = Analyzer(config=replace(DiagnosisConfig(), backend_down=BackendDownConfig(**config)), backends=t.backends())
    return [a.observe(s) for s in t.snapshots]


def test_a_hung_scrape_opens_at_once_when_its_deadline_made_the_engine_unanswered_long_enough() -> None:
    # The collector's age on a timed-out scrape includes the 1 s deadline: 1 s since the
    # previous tick's good scrape + 1 s waiting = 2 s unanswered >= 1.5 s.
    results = _down_after_warmup("timeout", [2.0])
    (opened_at, d), = _episode(results)[0]
    assert opened_at == results[-1].ts
    evidence = {e.signal: e for e in d.evidence}
    assert evidence["unanswered_seconds"].value == 2.0 and evidence["unanswered_seconds"].threshold == 1.5
    assert "unanswered for 2s" in d.summary


def test_one_quick_failure_is_not_an_outage_but_the_second_is() -> None:
    results = _down_after_warmup("timeout", [1.0])  # answered 1 s ago; this one failed fast
    assert _episode(results)[0] == []
    results = _down_after_warmup("timeout", [1.0, 2.0])
    (opened_at, _), = _episode(results)[0]
    assert opened_at == results[-1].ts


def test_without_the_collectors_age_the_window_says_how_long_it_went_unanswered() -> None:
    results = _down_after_warmup("http_error", [None, None])  # a recording without scrape_age_seconds
    (opened_at, d), = _episode(results)[0]
    assert opened_at == results[-1].ts  # 2 s since the last answered scrape
    assert {e.signal: e.value for e in d.evidence}["unanswered_seconds"] == 2.0


def test_refusals_can_be_made_to_wait_like_other_failures() -> None:
    results = _down_after_warmup("connection_refused", [1.0], open_on_refused=False)
    assert _episode(results)[0] == []
    results = _down_after_warmup("connection_refused", [1.0, 2.0], open_on_refused=False)
    assert len(_episode(results)[0]) == 1
