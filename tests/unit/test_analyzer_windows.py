"""Rolling windows, baselines and the correlation helper."""

from __future__ import annotations

import pytest

from llmdiag.analyzers import Analyzer
from llmdiag.analyzers.baseline import Baselines
from llmdiag.analyzers.correlate import Event, coincide, follows
from llmdiag.analyzers.windows import WindowStore, is_counter
from llmdiag.config.analyzers import DiagnosisConfig
from llmdiag.model import Distribution, Labelled, Snapshot


def _feed(store: WindowStore, key: str, points: list[tuple[float, float]]) -> None:
    for ts, v in points:
        store.append(key, ts, v)
        store.advance(ts)


def test_counter_rate_from_deltas() -> None:
    w = WindowStore(300)
    _feed(w, "b/x/requests_total", [(t, 10.0 * t) for t in range(0, 11)])
    assert w.rate("b/x/requests_total", 5) == pytest.approx(10.0)
    assert w.increase("b/x/requests_total", 5) == pytest.approx(50.0)


def test_counter_reset_is_a_restart_never_negative() -> None:
    w = WindowStore(300)
    # 100, 110, 120, then the process restarts and counts 5, 15, 25.
    _feed(w, "b/x/preemptions_total", [(0, 100.0), (1, 110.0), (2, 120.0), (3, 5.0), (4, 15.0), (5, 25.0)])
    assert w.increase("b/x/preemptions_total", 3) == pytest.approx(25.0)  # 5 (since restart) + 10 + 10
    assert w.rate("b/x/preemptions_total", 5) == pytest.approx((20 + 5 + 20) / 5)
    assert min(v for _, v in w.increments("b/x/preemptions_total", 10)) > 0


def test_gauge_is_not_reset_adjusted() -> None:
    w = WindowStore(300)
    _feed(w, "b/x/requests_waiting", [(0, 30.0), (1, 2.0)])
    assert w.latest("b/x/requests_waiting") == 2.0
    assert w.value_ago("b/x/requests_waiting", 1) == 30.0


def test_rate_across_a_scrape_gap_uses_real_elapsed_time() -> None:
    w = WindowStore(300)
    _feed(w, "b/x/c_total", [(0, 0.0), (1, 10.0), (9, 90.0)])  # 2..8 missing
    assert w.rate("b/x/c_total", 10) == pytest.approx(10.0)


def test_memory_is_bounded_by_window_and_idle_series_are_forgotten() -> None:
    w = WindowStore(60, max_points=100)
    for t in range(1000):
        w.append("b/x/kv_cache_usage", float(t), 0.5)
        if t < 10:
            w.append("g/0/process_memory_bytes{pid=123}", float(t), 1.0)
        w.advance(float(t))
    s = w.series("b/x/kv_cache_usage")
    assert s is not None and len(s) <= 62 and len(s.ts) <= 2 * 62 + 64
    assert w.series("g/0/process_memory_bytes{pid=123}") is None


def test_a_signal_back_after_its_series_was_forgotten_is_recorded_again() -> None:
    # The analyzer keeps its Series objects from tick to tick; when the store forgets an idle
    # series, the signal's next points must land in the store again, not in the forgotten object.
    a = Analyzer(DiagnosisConfig(window_seconds=60))
    for t in range(200):
        signals: dict[str, object] = {"requests_waiting": 1.0}
        if t < 10 or t >= 150:  # gone for 140 s: more than two windows
            signals["kv_cache_usage"] = 0.5 if t < 10 else 0.9
            signals["ttft_seconds"] = Distribution(p50=0.2, p99=0.6, ewma=0.25 if t < 10 else 0.3)
            signals["h2_rst_stream_total"] = Labelled({"code=CANCEL": float(t)})
        a.observe(Snapshot(ts=float(t), backends={"vllm-0": signals}))  # type: ignore[dict-item]
    assert a.windows.sweeps >= 1
    for key, latest in (("b/vllm-0/kv_cache_usage", 0.9), ("b/vllm-0/ttft_seconds.ewma", 0.3),
                        ("b/vllm-0/h2_rst_stream_total{code=CANCEL}", 199.0), ("b/vllm-0/h2_rst_stream_total", 199.0)):
        series = a.windows.series(key)
        assert series is not None and series.latest() == latest, key
        assert len(series) == 50, key  # 150..199, nothing from before the gap
    assert a.windows.increase("b/vllm-0/h2_rst_stream_total{code=CANCEL}", 60) == pytest.approx(49.0)


def test_out_of_order_points_are_ignored() -> None:
    w = WindowStore(300)
    _feed(w, "h//x", [(5, 1.0)])
    w.append("h//x", 3.0, 9.0)
    assert w.latest("h//x") == 1.0


def test_is_counter() -> None:
    assert is_counter("b/x/h2_rst_stream_total{code=CANCEL}")
    assert not is_counter("b/x/kv_cache_usage")


def test_baseline_warms_up_then_tracks_slowly() -> None:
    b = Baselines(tau_seconds=60, warmup_seconds=20)
    for t in range(10):
        b.update("vllm-0/ttft", float(t), 0.3)
    assert b.get("vllm-0/ttft") is None  # still warming up
    for t in range(10, 40):
        b.update("vllm-0/ttft", float(t), 0.3)
    assert b.get("vllm-0/ttft") == pytest.approx(0.3)
    b.update("vllm-0/ttft", 41.0, 3.0)  # one spike moves a 60 s EWMA by ~1/60 of the jump
    assert 0.3 < b.get("vllm-0/ttft") < 0.4  # type: ignore[operator]


def test_follows_joins_on_key_within_window() -> None:
    stalls = [Event(10, "b/1", "stall"), Event(20, "b/2", "stall"), Event(30, "b/1", "stall")]
    resets = [Event(11.5, "b/1", "rst"), Event(20.5, "b/3", "rst"), Event(33, "b/1", "rst")]
    m = follows(stalls, resets, 2.0)
    assert [(x.first.ts, x.second.ts) for x in m] == [(10, 11.5)]  # other key and too late do not join


def test_coincide_matches_either_side() -> None:
    cancels = [Event(10, "b", "cancel"), Event(50, "b", "cancel")]
    slow = [Event(8, "b", "ttft_high"), Event(100, "b", "ttft_high")]
    assert [(x.first.ts, x.second.ts) for x in coincide(cancels, slow, 5)] == [(10, 8)]
