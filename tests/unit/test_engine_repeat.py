"""A scrape that repeats the previous body byte for byte is not parsed again (an idle engine).

The reuse must give exactly what the full parse, mapping and window step give, and must
never hide a change: one value moved in the body is read at once. Expected values are
worked out by hand from the bodies below.
"""

from __future__ import annotations

import math

import pytest

from llmdiag.collectors.engine import EngineCollector, _BackendTracker
from llmdiag.collectors.engine_parse import parse_exposition
from llmdiag.collectors.http_fetch import FetchResult
from llmdiag.model import Backend, Distribution, Labelled, Snapshot


def vllm_body(waiting: float, preemptions: float, stop: float, buckets: tuple[float, float, float], total: float) -> str:
    """A small vLLM scrape: one gauge, one counter, one labelled counter, one TTFT histogram
    (``buckets`` cumulative at le 0.1, 1.0, +Inf; ``total`` its _sum)."""
    lines = [
        "# TYPE vllm:num_requests_waiting gauge",
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}',
        "# TYPE vllm:num_preemptions counter",
        f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {preemptions}',
        "# TYPE vllm:request_success counter",
        f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} {stop}',
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    lines += [f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",model_name="m"}} {v}'
              for le, v in zip(("0.1", "1.0", "+Inf"), buckets, strict=True)]
    lines += [
        f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {buckets[-1]}',
        f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} {total}',
    ]
    return "\n".join(lines) + "\n"


A = vllm_body(0, 10, 100, (4, 8, 10), 5.0)
B = vllm_body(0, 10, 101, (4, 10, 12), 6.0)  # two more TTFT observations in (0.1, 1.0], mean 0.5; one more stop
C = vllm_body(3, 11, 101, (4, 10, 12), 6.0)  # three requests now wait; one preemption


def scripted(bodies: list[str]):
    answers = iter(bodies)

    def fetch(url: str, timeout: float, max_bytes: int, accept: str) -> FetchResult:
        return FetchResult(url=url, status=200, body=next(answers))

    return fetch


def collect_all(bodies: list[str]) -> tuple[list[Snapshot], EngineCollector]:
    collector = EngineCollector([Backend.from_url("http://127.0.0.1:8000", name="b0")], fetch=scripted(bodies))
    snaps = []
    try:
        for i in range(len(bodies)):
            snap = Snapshot(ts=float(i))
            snap.extend(collector.collect(float(i)))
            snaps.append(snap)
    finally:
        collector.close()
    return snaps, collector


def without_timing(signals: dict) -> dict:
    return {k: v for k, v in signals.items() if k not in ("scrape_duration_seconds", "scrape_age_seconds")}


def test_repeats_are_reused_and_give_what_a_full_parse_gives():
    bodies = [A, B, B, B, B, C, C]
    snaps, collector = collect_all(bodies)
    tracker = collector._trackers["b0"]
    # B arrives (parsed), repeats once (stepped with the kept parse: the windows settle), then
    # twice more, both answered from the settled result; C is parsed, its one repeat stepped.
    assert tracker.repeats_total == 2

    reference = _BackendTracker(Backend.from_url("http://127.0.0.1:8000", name="b0"))
    for body, snap in zip(bodies, snaps, strict=True):
        full = reference.update(parse_exposition(body), 0.0, collector.config.ewma_alpha)
        assert without_timing(snap.backends["b0"]) == {**full.signals, "up": 1}
        assert snap.engines["b0"] == full.engines

    ttft = [s.backends["b0"]["ttft_seconds"] for s in snaps]
    assert ttft[0] == Distribution(None, None, None, None)  # first scrape: no window yet
    assert ttft[1].count == 2 and ttft[1].ewma == pytest.approx(0.5)  # 2 observations, 1.0 s in all
    for repeat in ttft[2:5]:  # the engine idles: no observation, the EWMA stays
        assert repeat == Distribution(None, None, pytest.approx(0.5), 0)
    stops = [s.backends["b0"]["requests_finished_total"]["reason=stop"] for s in snaps]
    assert stops == [100, 101, 101, 101, 101, 101, 101]


def test_a_value_changed_after_repeats_is_read_at_once():
    snaps, collector = collect_all([A, A, A, A, C])
    assert collector._trackers["b0"].repeats_total == 2  # the 3rd and 4th A
    last = snaps[-1].backends["b0"]
    assert last["requests_waiting"] == 3  # was 0 in every A
    assert last["preemptions_total"] == 11  # was 10
    assert last["requests_finished_total"] == Labelled({"reason=stop": 101})
    # C's histogram has two more observations than A's: the window shows them, not the idle repeats
    assert last["ttft_seconds"].count == 2


def test_a_reused_scrape_is_a_copy():
    collector = EngineCollector([Backend.from_url("http://127.0.0.1:8000", name="b0")], fetch=scripted([A, A, A, A]))
    try:
        collector.collect(0.0)
        collector.collect(1.0)
        third = {s.name: s.value for s in collector.collect(2.0) if s.engine is None}
        third["requests_finished_total"]["reason=stop"] = -1.0  # a consumer changing what it got
        fourth = {s.name: s.value for s in collector.collect(3.0) if s.engine is None}
    finally:
        collector.close()
    assert collector._trackers["b0"].repeats_total == 2
    assert fourth["requests_finished_total"] == Labelled({"reason=stop": 100})
    assert fourth["scrape_age_seconds"] == pytest.approx(0.0, abs=1.0)


def test_a_failed_scrape_between_repeats_does_not_lose_the_change():
    """A body, a refused scrape, then a different body: the new body is parsed, never a stale reuse."""
    answers = iter([("ok", A), ("ok", A), ("ok", A), ("down", ""), ("ok", C)])

    def fetch(url: str, timeout: float, max_bytes: int, accept: str) -> FetchResult:
        kind, body = next(answers)
        if kind == "down":
            return FetchResult(url=url, error="connection refused", failure="connection_refused")
        return FetchResult(url=url, status=200, body=body)

    collector = EngineCollector([Backend.from_url("http://127.0.0.1:8000", name="b0")], fetch=fetch)
    try:
        signals = [{s.name: s.value for s in collector.collect(float(i)) if s.engine is None} for i in range(5)]
    finally:
        collector.close()
    assert [s["up"] for s in signals] == [1, 1, 1, 0, 1]
    assert signals[4]["requests_waiting"] == 3 and signals[4]["preemptions_total"] == 11


def test_one_engines_backend_signals_are_what_the_general_merge_gives():
    """The one-engine shortcut of the backend aggregate against the general merge, on every kind of value."""
    from llmdiag.collectors import engine as engine_module
    from llmdiag.collectors.histogram import HistogramDelta

    window = HistogramDelta(((0.1, 1.0), (1.0, 3.0), (math.inf, 4.0)), 4.0, 1.2)
    signals = {
        "requests_waiting": 3.0, "kv_cache_usage": -0.0, "requests_running": -0.0, "preemptions_total": 12.0,
        "counter_resets_total": 0, "itl_seconds": Distribution(None, None, 0.05, 0),
        "ttft_seconds": Distribution(*window.median_and_p99(), 0.3, 4), "nothing": None,
        "requests_finished_total": Labelled({"reason=stop": 5.0, "reason=length": 2}),
    }
    deltas = {"0": {"ttft_seconds": window}}
    single = engine_module._aggregate({"0": signals}, deltas)
    # The general path, forced with a second engine that has none of these signals.
    general = engine_module._aggregate({"0": signals, "1": {}}, {**deltas, "1": {}})
    assert single == general and list(single) == list(general)
    assert repr(single["requests_running"]) == repr(general["requests_running"]) == "0.0"
    assert type(single["preemptions_total"]) is int and single["requests_finished_total"] is not signals["requests_finished_total"]
    # And the one-engine distribution against the general histogram merge (an extra NA value
    # adds nothing to it but forces that path).
    na = Distribution(None, None, None, None)
    for name, window_of in (("ttft_seconds", [window]), ("itl_seconds", [])):
        shortcut = engine_module._merge_distributions(name, [signals[name]], window_of)
        assert shortcut == engine_module._merge_distributions(name, [signals[name], na], window_of)
    assert single["ttft_seconds"].p50 == pytest.approx(0.1 + 0.9 * (2.0 - 1.0) / 2.0)  # rank 2 of 4 in (0.1, 1.0]


def test_a_reused_scrape_gives_the_samples_of_a_full_one_in_the_same_order():
    bodies = [A, B, B, B, B]
    reused = EngineCollector([Backend.from_url("http://127.0.0.1:8000", name="b0")], fetch=scripted(bodies))
    try:
        got = [reused.collect(float(i)) for i in range(len(bodies))]
    finally:
        reused.close()
    assert reused._trackers["b0"].repeats_total == 2
    reference = _BackendTracker(Backend.from_url("http://127.0.0.1:8000", name="b0"))
    for body, samples in zip(bodies, got, strict=True):
        full = reference.update(parse_exposition(body), 0.0, reused.config.ewma_alpha)
        full.signals.update({"up": 1, "scrape_duration_seconds": 0.0, "scrape_age_seconds": 0.0})
        expected = EngineCollector._samples(full)
        timing = ("scrape_duration_seconds", "scrape_age_seconds")
        assert [(s.scope, s.subject, s.name, s.engine) for s in samples] == [(s.scope, s.subject, s.name, s.engine) for s in expected]
        assert [s.value for s in samples if s.name not in timing] == [s.value for s in expected if s.name not in timing]
    # Labelled values are the caller's own on every tick, the built-once samples notwithstanding.
    third, fourth = ({s.name: s for s in samples if s.engine is None} for samples in got[3:5])
    assert third["requests_finished_total"].value is not fourth["requests_finished_total"].value
