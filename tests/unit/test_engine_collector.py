"""The engine collector against real and documented scrapes served over real HTTP on 127.0.0.1.

Expected values are worked out by hand from the fixture lines (quoted in
comments), never read back from the code under test.
"""

from __future__ import annotations

import re

import pytest
from engine_http import FIXTURES, SHARED_ENGINES, ScriptedServer, metrics_server

from llmdiag.collectors.engine import EngineCollector
from llmdiag.config.engine import EngineConfig
from llmdiag.model import Backend, CollectorState, Distribution, Scope, Snapshot

SYNTH_TEXT = (SHARED_ENGINES / "vllm_SYNTHETIC_current_v1_names_text0.0.4.prom").read_text()
SYNTH_OM = (SHARED_ENGINES / "vllm_SYNTHETIC_current_v1_names_openmetrics.txt").read_text()
REAL = (SHARED_ENGINES / "vllm_v1_real_scrape_0.9era.prom").read_text()


def bump_histogram(text: str, metric: str, engine: str, from_le: float, n: int, added_sum: float) -> str:
    """``n`` more observations (summing to ``added_sum``) in the bucket whose lower edge is ``from_le``'s predecessor:
    every cumulative bucket with ``le >= from_le`` grows by ``n``; _count by ``n``; _sum by ``added_sum``."""
    out = []
    for line in text.split("\n"):
        name = line.split("{", 1)[0]
        if name.replace(":", "_").startswith(metric.replace(":", "_")) and f'engine="{engine}"' in line:
            head, value = line.rsplit(" ", 1)
            if name.endswith("_bucket"):
                le = float(re.search(r'le="([^"]+)"', line).group(1))
                if le >= from_le:
                    line = f"{head} {float(value) + n}"
            elif name.endswith("_count"):
                line = f"{head} {float(value) + n}"
            elif name.endswith("_sum"):
                line = f"{head} {float(value) + added_sum}"
        out.append(line)
    return "\n".join(out)


def snapshot_of(collector: EngineCollector, now: float) -> Snapshot:
    snap = Snapshot(ts=now)
    snap.extend(collector.collect(now))
    return snap


def run_sequence(*bodies: str, backend_engine: str | None = None) -> tuple[list[Snapshot], EngineCollector]:
    with metrics_server(*bodies) as server:
        collector = EngineCollector([Backend.from_url(server.url, name="b0", engine=backend_engine)])
        try:
            snaps = [snapshot_of(collector, float(i)) for i in range(len(bodies))]
        finally:
            collector.close()
    return snaps, collector


def test_synthetic_vllm_first_scrape_shows_the_overloaded_engine_and_backend_saturation():
    (snap,), collector = run_sequence(SYNTH_TEXT)
    e0, e1, backend = snap.engines["b0"]["0"], snap.engines["b0"]["1"], snap.backends["b0"]
    # vllm:num_requests_waiting{engine="1"} 87.0 / {engine="0"} 0.0
    assert e1["requests_waiting"] == 87 and e0["requests_waiting"] == 0
    # vllm:kv_cache_usage_perc{engine="1"} 0.987 / {engine="0"} 0.412
    assert e1["kv_cache_usage"] == pytest.approx(0.987) and e0["kv_cache_usage"] == pytest.approx(0.412)
    # Backend: max for saturation (0.987, not the 0.6995 average), sums for queues.
    assert backend["kv_cache_usage"] == pytest.approx(0.987)
    assert backend["requests_waiting"] == 87
    assert backend["requests_running"] == 41 + 256
    assert e1["requests_waiting_by_reason"] == {"reason=capacity": 85.0, "reason=deferred": 2.0}
    # cache_config_info num_gpu_blocks="48312" x block_size="16" per engine, summed for the backend.
    assert e1["kv_capacity_tokens"] == 48312 * 16 and backend["kv_capacity_tokens"] == 2 * 48312 * 16
    assert e1["preemptions_total"] == 1312 and backend["preemptions_total"] == 1312
    assert e1["requests_finished_total"]["reason=abort"] == 57
    assert backend["requests_finished_total"]["reason=abort"] == 57 + 3
    assert backend["prompt_tokens_total"] == 2 * 5712512
    assert backend["up"] == 1 and backend["scrape_age_seconds"] >= 0
    # First scrape: no window yet, so every distribution is NA (documented).
    assert e1["ttft_seconds"] == Distribution(None, None, None, None)
    assert backend["ttft_seconds"] == Distribution(None, None, None, None)
    assert collector.status().status is CollectorState.OK


def test_second_scrape_gives_window_quantiles_from_bucket_deltas_not_cumulative_buckets():
    # 10 new TTFTs on engine 1, all in (5.0, 7.5], summing to 60 s.
    second = bump_histogram(SYNTH_TEXT, "vllm:time_to_first_token_seconds", "1", 7.5, 10, 60.0)
    # Then 10 more in (1.0, 2.5], summing to 20 s.
    third = bump_histogram(second, "vllm:time_to_first_token_seconds", "1", 2.5, 10, 20.0)
    snaps, _ = run_sequence(SYNTH_TEXT, second, third)
    ttft = snaps[1].engines["b0"]["1"]["ttft_seconds"]
    # rank 5 of 10 in (5.0, 7.5]: 5.0 + 2.5 * 5/10; rank 9.9: 5.0 + 2.5 * 0.99. (The cumulative
    # buckets, 400 observations mostly under 5 s, would give ~3 s: the window is what matters.)
    assert ttft.p50 == pytest.approx(6.25) and ttft.p99 == pytest.approx(7.475)
    assert ttft.count == 10 and ttft.ewma == pytest.approx(6.0)
    idle = snaps[1].engines["b0"]["0"]["ttft_seconds"]
    assert idle.count == 0 and idle.p50 is None and idle.p99 is None
    backend = snaps[1].backends["b0"]["ttft_seconds"]
    assert backend.p50 == pytest.approx(6.25) and backend.count == 10 and backend.ewma == pytest.approx(6.0)
    later = snaps[2].engines["b0"]["1"]["ttft_seconds"]
    # rank 5 in (1.0, 2.5]: 1.0 + 1.5 * 0.5; EWMA 0.2 * 2.0 + 0.8 * 6.0.
    assert later.p50 == pytest.approx(1.75) and later.ewma == pytest.approx(5.2) and later.count == 10


def test_openmetrics_spelling_gives_the_same_signals():
    (text_snap,), _ = run_sequence(SYNTH_TEXT)
    (om_snap,), _ = run_sequence(SYNTH_OM)
    assert om_snap.backends["b0"]["kv_cache_usage"] == pytest.approx(0.987)
    assert om_snap.engines["b0"]["1"]["requests_waiting"] == 87
    assert om_snap.engines == text_snap.engines
    assert {k: v for k, v in om_snap.backends["b0"].items() if "scrape" not in k} == {
        k: v for k, v in text_snap.backends["b0"].items() if "scrape" not in k
    }


def test_real_vllm_scrape_prefers_the_new_kv_name_and_reads_capacity():
    (snap,), collector = run_sequence(REAL)
    b = snap.backends["b0"]
    # vllm:kv_cache_usage_perc{engine="0",...} 1.3798051715085968e-05 (gpu_cache_usage_perc is also there)
    assert b["kv_cache_usage"] == pytest.approx(1.3798051715085968e-05)
    assert b["kv_capacity_tokens"] == 72474 * 128  # num_gpu_blocks="72474", block_size="128"
    assert b["requests_finished_total"] == {"reason=abort": 0.0, "reason=length": 2.0, "reason=stop": 1.0}
    assert b["prompt_tokens_total"] == 39 and b["generation_tokens_total"] == 26
    assert collector.results["b0"].models == ("/job/model/Qwen2.5-0.5B-Instruct",)


def test_old_generation_names_are_read_when_the_new_ones_are_absent():
    old = "\n".join(
        line.replace("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
        for line in SYNTH_TEXT.split("\n")
        if "kv_cache_usage_perc" not in line
    )
    old += '\n# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    (snap,), _ = run_sequence(old)
    assert snap.engines["b0"]["0"]["kv_cache_usage"] == 0.5
    assert "itl_seconds" in snap.engines["b0"]["1"]


def tiny_vllm(preemptions: float, buckets: list[tuple[str, float]], total: float, stop: float) -> str:
    lines = [
        "# TYPE vllm:num_preemptions counter",
        f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {preemptions}',
        "# TYPE vllm:request_success counter",
        f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} {stop}',
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    lines += [f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",model_name="m"}} {v}' for le, v in buckets]
    lines += [
        f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {buckets[-1][1]}',
        f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} {total}',
    ]
    return "\n".join(lines) + "\n"


def test_counter_reset_is_detected_and_totals_never_go_backwards():
    before = tiny_vllm(1312, [("0.1", 5), ("1.0", 8), ("+Inf", 10)], 4.0, 900)
    restarted = tiny_vllm(5, [("0.1", 1), ("1.0", 2), ("+Inf", 2)], 0.6, 2)
    after = tiny_vllm(8, [("0.1", 1), ("1.0", 2), ("+Inf", 4)], 5.6, 6)
    snaps, collector = run_sequence(before, restarted, after)
    totals = [s.backends["b0"]["preemptions_total"] for s in snaps]
    assert totals == [1312, 1312 + 5, 1312 + 8]  # increase() semantics across the restart
    stops = [s.backends["b0"]["requests_finished_total"]["reason=stop"] for s in snaps]
    assert stops == [900, 902, 906]
    assert snaps[0].backends["b0"]["counter_resets_total"] == 0
    # the restart resets the counter, the labelled counter and the histogram: 3 resets
    assert snaps[1].backends["b0"]["counter_resets_total"] == 3
    assert snaps[2].backends["b0"]["counter_resets_total"] == 3
    ttft = snaps[1].backends["b0"]["ttft_seconds"]
    # after a reset the whole new histogram is the window: 2 observations, rank 1 in (0, 0.1]
    assert ttft.count == 2 and ttft.p50 == pytest.approx(0.1) and ttft.ewma == pytest.approx(0.3)
    third = snaps[2].backends["b0"]["ttft_seconds"]
    # 2 more, both above 1.0 (+Inf bucket): quantile is the highest finite bound; mean 5.0/2
    assert third.count == 2 and third.p50 == pytest.approx(1.0)
    assert third.ewma == pytest.approx(0.2 * 2.5 + 0.8 * 0.3)


def test_documented_sglang_scrape():
    text = (FIXTURES / "sglang_documented_text0.0.4.prom").read_text()
    more = text.replace(
        'sglang:time_to_first_token_seconds_bucket{model_name="meta-llama/Llama-3.1-8B-Instruct",le="2.5"} 60.0',
        'sglang:time_to_first_token_seconds_bucket{model_name="meta-llama/Llama-3.1-8B-Instruct",le="2.5"} 64.0',
    ).replace(
        'sglang:time_to_first_token_seconds_bucket{model_name="meta-llama/Llama-3.1-8B-Instruct",le="+Inf"} 64.0',
        'sglang:time_to_first_token_seconds_bucket{model_name="meta-llama/Llama-3.1-8B-Instruct",le="+Inf"} 68.0',
    ).replace(
        'sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 64.0',
        'sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 68.0',
    ).replace(
        'sglang:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.5',
        'sglang:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 48.5',
    )
    snaps, collector = run_sequence(text, more)
    b = snaps[0].backends["b0"]
    assert collector.results["b0"].engine == "sglang"
    assert (b["requests_waiting"], b["requests_running"], b["kv_cache_usage"]) == (12, 37, 0.91)
    assert b["kv_capacity_tokens"] == 161721 and b["preemptions_total"] == 4
    assert b["requests_finished_total"] == {"reason=abort": 3.0}
    ttft = snaps[1].backends["b0"]["ttft_seconds"]
    # 4 new observations in (1.0, 2.5] summing to 8 s: p50 = 1.0 + 1.5 * 2/4
    assert ttft.count == 4 and ttft.p50 == pytest.approx(1.75) and ttft.ewma == pytest.approx(2.0)


def test_documented_trtllm_serve_scrape():
    (snap,), collector = run_sequence((FIXTURES / "trtllm_serve_documented_text0.0.4.prom").read_text())
    b = snap.backends["b0"]
    assert collector.results["b0"].engine == "trtllm"
    assert (b["requests_waiting"], b["requests_running"], b["kv_cache_usage"]) == (4, 16, 0.93)
    assert b["kv_capacity_tokens"] == 4096 * 32 and b["requests_paused"] == 1
    assert b["requests_finished_total"] == {"reason=length": 20.0, "reason=stop": 180.0}


def test_documented_trtllm_in_triton_scrape_keeps_models_apart():
    text = (FIXTURES / "trtllm_triton_documented.prom").read_text()
    later = text.replace(
        'nv_inference_request_duration_us{model="tensorrt_llm",version="1"} 1.25e+09',
        'nv_inference_request_duration_us{model="tensorrt_llm",version="1"} 1.28e+09',
    ).replace(
        'nv_inference_request_success{model="tensorrt_llm",version="1"} 500',
        'nv_inference_request_success{model="tensorrt_llm",version="1"} 510',
    )
    snaps, collector = run_sequence(text, later)
    trt = snaps[0].engines["b0"]["tensorrt_llm"]
    assert collector.results["b0"].engine == "trtllm"
    # used 3900 / max 8000 blocks; max 8000 x tokens_per 64
    assert trt["kv_cache_usage"] == pytest.approx(3900 / 8000) and trt["kv_capacity_tokens"] == 8000 * 64
    assert trt["requests_waiting"] == 9 and trt["requests_running"] == 24 and trt["requests_paused"] == 2
    assert trt["requests_finished_total"] == {"reason=backend": 1.0, "reason=ok": 500.0, "reason=rejected": 7.0}
    e2e = snaps[1].engines["b0"]["tensorrt_llm"]["e2e_seconds"]
    # (1.28e9 - 1.25e9) us over 10 requests = 3.0 s each; no buckets, so no quantiles
    assert e2e.ewma == pytest.approx(3.0) and e2e.count == 10 and e2e.p50 is None


def test_documented_triton_core_scrape_scales_milliseconds():
    text = (FIXTURES / "triton_core_documented.prom").read_text()
    later = text.replace('le="500",model="llama3",version="1"} 600', 'le="500",model="llama3",version="1"} 610') \
        .replace('le="1000",model="llama3",version="1"} 900', 'le="1000",model="llama3",version="1"} 910') \
        .replace('le="5000",model="llama3",version="1"} 1000', 'le="5000",model="llama3",version="1"} 1010') \
        .replace('le="+Inf",model="llama3",version="1"} 1000', 'le="+Inf",model="llama3",version="1"} 1010') \
        .replace('histogram_ms_count{model="llama3",version="1"} 1000', 'histogram_ms_count{model="llama3",version="1"} 1010') \
        .replace('histogram_ms_sum{model="llama3",version="1"} 650000', 'histogram_ms_sum{model="llama3",version="1"} 653000')
    snaps, collector = run_sequence(text, later)
    assert collector.results["b0"].engine == "triton"
    m = snaps[0].engines["b0"]["llama3"]
    assert m["requests_waiting"] == 7
    assert m["requests_finished_total"] == {"reason=canceled": 2.0, "reason=ok": 1000.0, "reason=rejected": 3.0}
    ttft = snaps[1].engines["b0"]["llama3"]["ttft_seconds"]
    # 10 first responses in (100, 500] ms: p50 = 0.1 + 0.4 * 5/10 s; mean 3000 ms / 10 = 0.3 s
    assert ttft.p50 == pytest.approx(0.3) and ttft.ewma == pytest.approx(0.3) and ttft.count == 10


def test_documented_tgi_scrape():
    (snap,), collector = run_sequence((FIXTURES / "tgi_documented.prom").read_text())
    b = snap.backends["b0"]
    assert collector.results["b0"].engine == "tgi"
    assert (b["requests_waiting"], b["requests_running"]) == (3, 8)
    assert b["requests_finished_total"] == {"reason=ok": 120.0, "reason=overloaded": 5.0, "reason=validation": 2.0}
    assert b["prompt_tokens_total"] == 24000 and b["generation_tokens_total"] == 18000
    assert "kv_cache_usage" not in b  # TGI does not say: absent, not a made-up zero


def test_scrape_sends_the_text_format_accept_header():
    with metrics_server(SYNTH_TEXT) as server:
        collector = EngineCollector([Backend.from_url(server.url)])
        collector.collect(0.0)
        collector.close()
        assert server.requests[0][0] == "/metrics"
        assert server.requests[0][1]["Accept"] == "text/plain; version=0.0.4"


def test_connection_refused_is_up_zero_with_a_reason():
    with metrics_server("unused") as server:
        url = server.url
    collector = EngineCollector([Backend.from_url(url, name="gone")])
    snap = snapshot_of(collector, 0.0)
    assert snap.backends["gone"]["up"] == 0
    assert snap.backends["gone"]["scrape_age_seconds"] is None  # never scraped: NA, not 0
    status = collector.status()
    assert status.status is CollectorState.DEGRADED and "connection refused" in status.reason


def test_timeout_oversize_and_http_errors_are_down_not_exceptions():
    routes = ScriptedServer({"/metrics": [(200, SYNTH_TEXT, 2.0)]})
    big = ScriptedServer({"/metrics": ["x" * 5000]})
    err = ScriptedServer({"/metrics": [(503, "engine saturated")]})
    with routes as slow, big as large, err as failing:
        backends = [Backend.from_url(s.url, name=n) for s, n in ((slow, "slow"), (large, "large"), (failing, "failing"))]
        collector = EngineCollector(backends, EngineConfig(timeout_seconds=0.3, max_response_bytes=1024))
        snap = snapshot_of(collector, 0.0)
        collector.close()
    assert all(snap.backends[n]["up"] == 0 for n in ("slow", "large", "failing"))
    assert "timed out" in collector.results["slow"].error
    assert "larger than 1024 bytes" in collector.results["large"].error
    assert "HTTP 503" in collector.results["failing"].error


def test_slow_backends_are_scraped_concurrently():
    servers = [ScriptedServer({"/metrics": [(200, SYNTH_TEXT, 0.4)]}) for _ in range(4)]
    for s in servers:
        s.__enter__()
    try:
        collector = EngineCollector([Backend.from_url(s.url) for s in servers], EngineConfig(timeout_seconds=1.0))
        samples = collector.collect(0.0)
        collector.close()
    finally:
        for s in servers:
            s.__exit__(None, None, None)
    # 4 backends that each take 0.4 s all answered within the 1 s deadline: they ran in parallel
    ups = [s.value for s in samples if s.name == "up" and s.scope is Scope.BACKEND]
    assert ups == [1, 1, 1, 1]


def test_malformed_line_degrades_with_its_line_number_and_keeps_the_rest():
    lines = SYNTH_TEXT.split("\n")
    bad_at = next(i for i, line in enumerate(lines) if line.startswith("vllm:num_requests_running"))
    lines[bad_at] = 'vllm:num_requests_running{engine="0",model_name="m" 41.0'  # missing '}'
    (snap,), collector = run_sequence("\n".join(lines))
    assert snap.backends["b0"]["up"] == 1
    assert snap.engines["b0"]["1"]["kv_cache_usage"] == pytest.approx(0.987)
    status = collector.status()
    assert status.status is CollectorState.DEGRADED and f"line {bad_at + 1}" in status.reason


def test_a_scrape_without_engine_metrics_is_not_an_engine_and_down():
    (snap,), collector = run_sequence("# TYPE python_info gauge\npython_info 1.0\n")
    assert snap.backends["b0"]["up"] == 0
    assert snap.backends["b0"]["scrape_failure"] == {"reason=not_an_engine": 1}
    assert "no known engine metrics" in collector.status().reason


def test_an_html_page_and_a_404_are_not_an_engine():
    html = "<!doctype html><html><body><h1>It works!</h1></body></html>"
    with ScriptedServer({"/metrics": [html]}) as web, ScriptedServer({}) as nothing:
        collector = EngineCollector([Backend.from_url(web.url, name="web"), Backend.from_url(nothing.url, name="404")])
        snap = snapshot_of(collector, 0.0)
        collector.close()
    for name in ("web", "404"):
        assert snap.backends[name]["up"] == 0
        assert snap.backends[name]["scrape_failure"] == {"reason=not_an_engine": 1}
    assert "HTTP 404" in collector.results["404"].error


def test_an_openai_backend_without_engine_metrics_is_up():
    (snap,), _ = run_sequence("# TYPE python_info gauge\npython_info 1.0\n", backend_engine="openai")
    assert snap.backends["b0"]["up"] == 1 and "scrape_failure" not in snap.backends["b0"]


def test_each_failure_has_its_reason():
    with metrics_server("unused") as server:
        closed_port = server.url
    slow = ScriptedServer({"/metrics": [(200, SYNTH_TEXT, 2.0)]})
    failing = ScriptedServer({"/metrics": [(503, "engine saturated")]})
    with slow, failing:
        backends = [
            Backend.from_url(closed_port, name="refused"),
            Backend.from_url(slow.url, name="slow"),
            Backend.from_url(failing.url, name="failing"),
            Backend.from_url("http://no-such-host.invalid:8000", name="unresolved"),
        ]
        collector = EngineCollector(backends, EngineConfig(timeout_seconds=0.3))
        snap = snapshot_of(collector, 0.0)
        collector.close()
    reasons = {n: snap.backends[n]["scrape_failure"] for n in ("refused", "slow", "failing", "unresolved")}
    assert reasons == {
        "refused": {"reason=connection_refused": 1},
        "slow": {"reason=timeout": 1},
        "failing": {"reason=http_error": 1},
        "unresolved": {"reason=name_not_resolved": 1},
    }
    assert "does not resolve" in collector.results["unresolved"].error


def test_grpc_backends_are_skipped_not_down():
    with metrics_server(SYNTH_TEXT) as server:
        grpc = Backend.from_url("grpc://127.0.0.1:9", name="trt-grpc")
        collector = EngineCollector([Backend.from_url(server.url, name="http"), grpc])
        snap = snapshot_of(collector, 0.0)
        collector.close()
    assert "trt-grpc" not in snap.backends and snap.backends["http"]["up"] == 1
    status = collector.status()
    assert status.status is CollectorState.OK and "trt-grpc" in status.reason and "gRPC" in status.reason
    only_grpc = EngineCollector([grpc])
    assert only_grpc.collect(0.0) == [] and only_grpc.status().status is CollectorState.UNAVAILABLE
    assert "trt-grpc" in only_grpc.status().reason


def test_grpc_backend_with_a_metrics_url_is_scraped_there_like_any_other():
    # Triton-style: gRPC on one port, Prometheus metrics on another path and port.
    with ScriptedServer({"/engine/metrics": [SYNTH_TEXT]}) as server:
        grpc = Backend.from_url("grpc://127.0.0.1:9", name="triton-grpc", metrics_url=server.url + "/engine/metrics")
        collector = EngineCollector([grpc])
        snap = snapshot_of(collector, 0.0)
        status = collector.status()
        collector.close()
    assert server.requests[0][0] == "/engine/metrics"
    assert snap.backends["triton-grpc"]["up"] == 1
    assert isinstance(snap.backends["triton-grpc"]["ttft_seconds"], Distribution)
    assert collector.skipped == [] and status.status is CollectorState.OK and status.reason is None


def test_a_metrics_url_without_a_path_gets_the_metrics_path():
    with ScriptedServer({"/stats": [SYNTH_TEXT]}) as server:
        backend = Backend.from_url("http://127.0.0.1:9", name="b", metrics_url=server.url)
        collector = EngineCollector([backend], EngineConfig(metrics_path="/stats"))
        snap = snapshot_of(collector, 0.0)
        collector.close()
    assert server.requests[0][0] == "/stats" and snap.backends["b"]["up"] == 1


def test_a_dead_metrics_url_makes_the_grpc_backend_down_with_a_reason():
    with metrics_server("unused") as server:
        url = server.url
    grpc = Backend.from_url("grpc://127.0.0.1:9", name="g", metrics_url=url + "/metrics")
    collector = EngineCollector([grpc])
    snap = snapshot_of(collector, 0.0)
    collector.close()
    assert snap.backends["g"]["up"] == 0
    assert snap.backends["g"]["scrape_failure"] == {"reason=connection_refused": 1}
    status = collector.status()
    assert status.status is CollectorState.DEGRADED and "g: down" in status.reason


def test_factory_is_registered():
    from llmdiag.agent.wiring import COLLECTOR_FACTORIES
    from llmdiag.config import Config

    collector = COLLECTOR_FACTORIES["engine"](Config(), [Backend.from_url("http://127.0.0.1:9")])
    assert collector.name == "engine"
    collector.close()


@pytest.mark.parametrize(("toml", "deadline"), [
    ("", 0.8),  # defaults: 1 s deadline, 1 s ticks -> capped, so a hung engine cannot stretch a tick past 1 s
    ("[agent]\ninterval_seconds = 5\n", 1.0),  # slower ticks leave the configured deadline alone
    ("[engine]\ntimeout_seconds = 0.3\n", 0.3),
    ("[agent]\ninterval_seconds = 0.5\n[engine]\ntimeout_seconds = 2\n", 0.4),
])
def test_the_scrape_deadline_fits_in_a_tick(toml: str, deadline: float):
    from llmdiag.agent.wiring import COLLECTOR_FACTORIES
    from llmdiag.config import Config

    collector = COLLECTOR_FACTORIES["engine"](Config.from_toml(toml), [Backend.from_url("http://127.0.0.1:9")])
    assert collector.config.timeout_seconds == pytest.approx(deadline)
    collector.close()


HTTP_COUNTS = """# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{{handler="/v1/completions",method="POST",status="2xx"}} {ok}
http_requests_total{{handler="/v1/chat/completions",method="POST",status="5xx"}} {err}
http_requests_total{{handler="/v1/chat/completions",method="POST",status="4xx"}} 3.0
http_requests_total{{handler="/v1/completions",method="POST",status="429"}} {sat}
http_requests_total{{handler="/v1/models",method="GET",status="2xx"}} 500.0
"""


def test_real_scrape_http_requests_become_responses_by_class():
    (snap,), _ = run_sequence(REAL)
    # http_requests_total{handler="/v1/completions",...,status="2xx"} 2.0 and chat 1.0
    assert snap.backends["b0"]["responses_total"] == {"class=ok": 3}


def test_5xx_and_429_from_the_engine_http_counter():
    first = SYNTH_TEXT + HTTP_COUNTS.format(ok=100.0, err=0.0, sat=0.0)
    second = SYNTH_TEXT + HTTP_COUNTS.format(ok=150.0, err=40.0, sat=5.0)
    (_, snap), _ = run_sequence(first, second)
    # 4xx other than 429 is the client's (client_4xx); /v1/models polls are not inference answers.
    assert snap.backends["b0"]["responses_total"] == {
        "class=ok": 150, "class=server_5xx": 40, "class=saturated_429": 5, "class=client_4xx": 3}
