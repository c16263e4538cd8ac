"""Error classification and cooling (SPEC 6.2)."""

from __future__ import annotations

import random
from email.utils import formatdate

import pytest

from llmdiag.config.balancer import BalancerConfig, ErrorsConfig
from llmdiag.model import BackendState
from llmdiag.router_feedback.balancer import NoBackendAvailable
from llmdiag.router_feedback.errors import CONNECT_ERROR, TIMEOUT, ErrorClassifier, ResponseClass, parse_retry_after

from balancer_support import ScriptedRandom, make

C = ErrorClassifier(ErrorsConfig())


@pytest.mark.parametrize(
    ("status", "body"),
    [
        # Seed 000: the engine's own refusals.
        (429, b'{"error": {"message": "KV cache exhausted, retry later", "type": "server_busy"}}'),
        (429, "Engine saturated: 128 running, 400 waiting"),
        (503, b"The engine is overloaded"),
        (429, b'{"detail": "Queue full"}'),
        (429, "too many requests in queue (max_waiting=256)"),
        (503, b"Service Unavailable: out of KV cache blocks"),
        (429, b"kv-cache is full"),
    ],
)
def test_saturation_bodies(status: int, body: bytes | str) -> None:
    c = C.classify(status, body, {})
    assert c.response_class is ResponseClass.SATURATED
    assert c.response_class.counts_as_error and c.cools


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (b'{"error": {"message": "Rate limit exceeded for API key sk-...abcd", "type": "rate_limit"}}', {}),
        (b"Rate limit reached for organization org-123 on requests per min", {}),
        (b"user quota exhausted for today", {}),
        (b"per-tenant rate limit: 100 rpm", {}),
        (b'{"error": {"code": "insufficient_quota"}}', {}),
        (b"Too Many Requests", {"X-RateLimit-Scope": "api_key"}),
    ],
)
def test_client_quota_429s_are_not_counted(body: bytes, headers: dict) -> None:
    c = C.classify(429, body, headers)
    assert c.response_class is ResponseClass.CLIENT_RATELIMIT
    assert not c.response_class.counts_as_error and not c.cools


def test_saturation_body_wins_over_proxy_ratelimit_headers() -> None:
    # LiteLLM-style proxies add x-ratelimit headers to every response: the body decides.
    c = C.classify(429, b"KV cache exhausted", {"x-ratelimit-scope": "key"})
    assert c.response_class is ResponseClass.SATURATED


def test_other_statuses() -> None:
    assert C.classify(200).response_class is ResponseClass.OK
    assert C.classify(500, b"CUDA error: out of memory").response_class is ResponseClass.SERVER_5XX
    assert C.classify(502).response_class is ResponseClass.SERVER_5XX
    assert C.classify(503, b"maintenance").response_class is ResponseClass.SERVER_5XX
    assert C.classify(400, b"prompt too long").response_class is ResponseClass.CLIENT_ERROR
    assert not ResponseClass.CLIENT_ERROR.counts_as_error
    assert C.classify(TIMEOUT).response_class is ResponseClass.TIMEOUT
    assert C.classify(CONNECT_ERROR).response_class is ResponseClass.CONNECT_ERROR
    with pytest.raises(ValueError, match="HTTP status"):
        C.classify(999)
    with pytest.raises(ValueError, match="HTTP status"):
        C.classify("teapot")


def test_unknown_429_policy_is_configurable() -> None:
    assert C.classify(429, b"slow down").response_class is ResponseClass.SATURATED
    client = ErrorClassifier(ErrorsConfig(unknown_429="client"))
    assert client.classify(429, b"slow down").response_class is ResponseClass.CLIENT_RATELIMIT
    error = ErrorClassifier(ErrorsConfig(unknown_429="error"))
    assert error.classify(429, b"slow down").response_class is ResponseClass.SERVER_5XX


def test_only_a_bounded_prefix_of_the_body_is_searched() -> None:
    classifier = ErrorClassifier(ErrorsConfig(body_prefix_bytes=64, unknown_429="client"))
    late = b"x" * 100 + b"KV cache exhausted"
    assert classifier.classify(429, late).response_class is ResponseClass.CLIENT_RATELIMIT
    assert classifier.classify(429, late[90:]).response_class is ResponseClass.SATURATED
    assert C.classify(429, b"\xff\xfe KV CACHE EXHAUSTED \x00").response_class is ResponseClass.SATURATED


def test_patterns_come_from_config_and_bad_ones_fail_loudly() -> None:
    custom = ErrorClassifier(ErrorsConfig(saturation_patterns=(r"batch budget spent",), unknown_429="client"))
    assert custom.classify(429, b"Batch Budget Spent").response_class is ResponseClass.SATURATED
    assert custom.classify(429, b"KV cache exhausted").response_class is ResponseClass.CLIENT_RATELIMIT
    with pytest.raises(ValueError, match="saturation_patterns"):
        ErrorsConfig(saturation_patterns=("(unclosed",))


def test_retry_after_parsing() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(b" 2.5 ") == 2.5
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after("nan") is None
    assert parse_retry_after(None) is None
    now = 1_700_000_000.0
    assert parse_retry_after(formatdate(now + 30, usegmt=True), now) == pytest.approx(30.0)
    c = C.classify(429, b"engine saturated", {"Retry-After": "12"})
    assert c.retry_after == 12.0


def _saturate(balancer, name: str, **headers) -> None:
    balancer.pick("m", 100)
    balancer.on_finish(name, 429, b'{"error": "KV cache exhausted"}', headers)


def test_saturation_cools_for_jittered_3_to_5_seconds_long_context_only() -> None:
    # The cooling jitter draws one random(): 0.5 -> 3 + 0.5 * 2 = 4 s.
    rng = ScriptedRandom(fallback=random.Random(3))
    balancer, clock = make(2, rng=rng)
    rng.script([0.5])  # pin the jitter draw; later draws come from random.Random(3)
    balancer.on_finish("b0", 429, b"KV cache exhausted", {})
    assert balancer.state("b0") is BackendState.COOLING
    assert balancer.counters["responses_saturated_total"] == 1
    assert balancer.counters["cooling_enforced_total"] == 1
    long_picks = set()
    for _ in range(50):
        long_picks.add(balancer.pick("m", 32_000).name)
        balancer.on_finish("b1", 200)
    assert long_picks == {"b1"}
    # b0 scores 60 now (one error): the in-flight penalty sends it short requests once b1 holds > 6.
    short_picks = {balancer.pick("m", 100).name for _ in range(200)}
    assert short_picks == {"b0", "b1"}  # short requests still reach it
    clock.advance(3.99)
    assert balancer.state("b0") is BackendState.COOLING
    clock.advance(0.02)  # cooling over after 4 s
    assert balancer.state("b0") is not BackendState.COOLING
    assert "b0" in {balancer.pick("m", 32_000).name for _ in range(200)}


@pytest.mark.parametrize(("draw", "seconds"), [(0.0, 3.0), (0.999, 4.998)])
def test_cooling_range_bounds(draw: float, seconds: float) -> None:
    rng = ScriptedRandom()
    balancer, clock = make(1, rng=rng)
    rng.script([draw])
    balancer.on_finish("b0", 503, b"engine saturated", {})
    clock.advance(seconds - 0.01)
    assert balancer.state("b0") is BackendState.COOLING
    clock.advance(0.02)
    assert balancer.state("b0") is not BackendState.COOLING


def test_cooling_can_block_all_requests() -> None:
    cfg = BalancerConfig(errors=ErrorsConfig(cooling_blocks_all=True))
    balancer, clock = make(2, config=cfg)
    balancer.on_finish("b0", 429, b"queue full", {})
    assert {balancer.pick("m", 10).name for _ in range(50)} == {"b1"}
    balancer.on_finish("b1", 429, b"queue full", {})
    with pytest.raises(NoBackendAvailable, match="'m'"):
        balancer.pick("m", 10)
    assert balancer.counters["no_backend_total"] == 1
    clock.advance(5.01)
    assert balancer.pick("m", 10).name in {"b0", "b1"}


def test_retry_after_extends_cooling() -> None:
    balancer, clock = make(2)
    balancer.on_finish("b0", 429, b"KV cache exhausted", {"Retry-After": "20"})
    clock.advance(10)
    assert balancer.state("b0") is BackendState.COOLING
    clock.advance(10.01)
    assert balancer.state("b0") is not BackendState.COOLING
    # A plain 503 with Retry-After is a server error, and the backend is left alone until then.
    balancer.on_finish("b1", 503, b"maintenance", {"retry-after": "8"})
    assert balancer.state("b1") is BackendState.COOLING
    clock.advance(8.01)
    assert balancer.state("b1") is not BackendState.COOLING


def test_retry_after_is_capped() -> None:
    balancer, clock = make(1)
    balancer.on_finish("b0", 429, b"KV cache exhausted", {"Retry-After": "86400"})
    clock.advance(60.01)
    assert balancer.state("b0") is not BackendState.COOLING


def test_client_quota_429_does_not_touch_the_backend() -> None:
    balancer, clock = make(1)
    for _ in range(20):
        balancer.pick("m", 10)
        balancer.on_finish("b0", 429, b"Rate limit exceeded for api key sk-123", {"Retry-After": "30"})
    assert balancer.score("b0") == pytest.approx(100.0)
    assert balancer.state("b0") is BackendState.HEALTHY
    assert balancer.counters["responses_client_ratelimit_total"] == 20
    assert balancer.load("b0") == 0


def test_saturation_counts_at_full_weight_in_the_score() -> None:
    balancer, clock = make(1)
    for _ in range(9):
        balancer.on_finish("b0", 200)
    balancer.on_finish("b0", 429, b"KV cache exhausted", {})
    # 1 error in 10 -> error factor 0.5 -> 100 * (1 - 0.4 * 0.5)
    assert balancer.score("b0") == pytest.approx(80.0)


@pytest.mark.parametrize("status", [500, 502, TIMEOUT, CONNECT_ERROR])
def test_faults_count_as_errors(status) -> None:
    balancer, clock = make(1)
    balancer.on_finish("b0", 200)
    balancer.on_finish("b0", status)
    assert balancer.score("b0") == pytest.approx(60.0)  # 50 % errors -> factor 1


def test_errors_decay_over_the_recent_window() -> None:
    balancer, clock = make(1)
    balancer.on_finish("b0", 500)
    for _ in range(3):
        balancer.on_finish("b0", 200)
    assert balancer.score("b0") == pytest.approx(60.0)
    clock.advance(100.0)  # ten half-lives: the old error is nearly forgotten
    balancer.on_finish("b0", 200)
    assert balancer.score("b0") == pytest.approx(60.0)  # the rise ramps ...
    clock.advance(3.0)
    assert balancer.score("b0") > 99.0  # ... at 15 points/s


def test_feedback_for_unknown_backends_is_ignored_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    balancer, clock = make(1)
    balancer.on_finish("gone", 500)
    balancer.on_finish("gone", 500)
    balancer.on_first_token("gone", 0.1)
    assert balancer.counters["unknown_backend_feedback_total"] == 3
    assert sum("unknown backend 'gone'" in r.getMessage() for r in caplog.records) == 2  # once per call site
    assert balancer.on_finish("b0", "bogus").response_class is ResponseClass.SERVER_5XX
    assert balancer.counters["bad_signal_total"] == 1
