"""Adaptive weights, the exported per-backend state, and retry decisions."""

from __future__ import annotations

import json
import random

import pytest

from llmdiag.config import Config
from llmdiag.config.balancer import BalancerConfig, WeightsConfig
from llmdiag.exporters.penalties import penalties_document
from llmdiag.model import BackendState, Diagnosis, Evidence, PenaltiesDocument, Reason, Severity
from llmdiag.router_feedback.errors import Classification, ResponseClass
from llmdiag.router_feedback.retry import RetryPolicy
from llmdiag.router_feedback.weights import AdaptiveWeights, WeightInput, target_weights

from balancer_support import ScriptedRandom, make


def test_score_mode_is_proportional_to_score() -> None:
    got = target_weights({"a": WeightInput(100.0), "b": WeightInput(63.5), "c": WeightInput(40.0, excluded=True)}, "score")
    assert got == {"a": 100.0, "b": 63.5, "c": 0.0}


def test_p99_ratio_mode_divides_base_weight_by_latency_ratio() -> None:
    # Seed 002: p99 2 s vs 4 s -> weights 2:1.
    got = target_weights({"a": WeightInput(100.0, 2.0), "b": WeightInput(100.0, 4.0), "c": WeightInput(80.0, None)}, "p99_ratio")
    assert got["a"] == pytest.approx(100.0)
    assert got["b"] == pytest.approx(50.0)
    assert got["c"] == pytest.approx(80.0)  # no p99 known: score only


def test_weights_update_at_most_every_interval_and_are_smoothed() -> None:
    w = AdaptiveWeights(WeightsConfig(update_interval_seconds=1.0, smoothing=0.5))
    assert w.update({"a": WeightInput(100.0)}, 0.0) == {"a": 100}
    assert w.update({"a": WeightInput(20.0)}, 0.5) == {"a": 100}  # too soon
    assert w.update({"a": WeightInput(20.0)}, 1.0) == {"a": 60}  # halfway
    assert w.update({"a": WeightInput(20.0)}, 2.0) == {"a": 40}
    assert w.update({"a": WeightInput(20.0, excluded=True)}, 2.1) == {"a": 0}  # ejection is immediate


def test_snapshot_states_are_penalty_entries() -> None:
    balancer, clock = make(3)
    diagnosis = Diagnosis(
        kind="gpu_memory_pressure", backend="b1", severity=Severity.WARNING, confidence=0.9, since=0.0,
        summary="GPU memory 98 % used, allocator retrying", evidence=(Evidence("gpu_memory_used_ratio", 0.98, 0.97, 5.0),),
        remediation="restart the engine with a lower gpu_memory_utilization", penalty=0.31,
    )
    balancer.set_penalty("b1", 0.31, [diagnosis])
    balancer.on_finish("b2", 429, b"engine saturated")
    states = {s.name: s for s in balancer.snapshot_states()}
    assert states["b0"].state is BackendState.HEALTHY and states["b0"].weight_percent == 100
    assert states["b0"].address == "10.0.0.1:8000"
    assert states["b1"].score == pytest.approx(69.0)
    assert states["b1"].penalty == 0.31
    assert states["b1"].state is BackendState.DEGRADED
    assert states["b1"].reasons == (Reason("gpu_memory_pressure", Severity.WARNING, 0.31, "GPU memory 98 % used, allocator retrying"),)
    assert states["b2"].state is BackendState.COOLING
    assert states["b2"].reasons[-1].kind == "cooling"
    doc = penalties_document(1733140000.0, "gpu-node-7", balancer_states=balancer.snapshot_states())
    parsed = PenaltiesDocument.from_json(json.loads(doc.dumps()))
    assert [b.name for b in parsed.backends] == ["b0", "b1", "b2"]
    clock.advance(1.0)
    weights = {s.name: s.weight_percent for s in balancer.snapshot_states()}
    assert weights["b1"] == 69  # first sight is not smoothed
    with pytest.raises(ValueError, match="penalty"):
        balancer.set_penalty("b0", 1.5)


def test_retry_policy() -> None:
    policy = RetryPolicy(BalancerConfig(), ScriptedRandom([0.5, 1.0, 0.999]))
    saturated = Classification(ResponseClass.SATURATED)
    first = policy.decide(1, saturated, 429, first_byte_sent=False)
    assert first.retry and first.delay_seconds == pytest.approx(0.025)  # 0.5 * 0.05
    second = policy.decide(2, Classification(ResponseClass.CONNECT_ERROR), "connect_error", False)
    assert second.retry and second.delay_seconds == pytest.approx(0.1)  # 1.0 * 0.05 * 2
    assert policy.decide(3, saturated, 429, False).retry is False  # at most 2
    assert policy.decide(1, saturated, 429, first_byte_sent=True).retry is False
    assert policy.decide(1, Classification(ResponseClass.CLIENT_RATELIMIT), 429, False).retry is False
    assert policy.decide(1, Classification(ResponseClass.SERVER_5XX), 500, False).retry is False
    assert policy.decide(1, Classification(ResponseClass.SERVER_5XX), 503, False).retry is True
    assert policy.decide(1, Classification(ResponseClass.CLIENT_ERROR), 400, False).retry is False
    no_timeouts = RetryPolicy(BalancerConfig(retry_timeouts=False), random.Random(1))
    assert no_timeouts.decide(1, Classification(ResponseClass.TIMEOUT), "timeout", False).retry is False


def test_retry_goes_to_another_backend() -> None:
    balancer, clock = make(3, rng=random.Random(5))
    policy = RetryPolicy(balancer.config, random.Random(5))
    tried = [balancer.pick("m", 100)]
    attempt = 1
    while True:
        c = balancer.on_finish(tried[-1], 503, b"engine saturated")
        decision = policy.decide(attempt, c, 503, first_byte_sent=False)
        if not decision.retry:
            break
        tried.append(balancer.pick("m", 100, exclude=tried))
        attempt += 1
    assert len(tried) == 3 and len({b.name for b in tried}) == 3


def test_balancer_section_in_config_file() -> None:
    config = Config.from_toml(
        "[balancer]\nchoices = 0\nin_flight_penalty = 0.2\n"
        "[balancer.errors]\nlong_context_tokens = 4096\ncooling_blocks_all = true\n"
        "[balancer.score]\nmax_queue = 10\n[balancer.weights]\nmode = 'p99_ratio'\n"
    )
    assert config.balancer.choices == 0 and config.balancer.errors.cooling_blocks_all
    assert config.balancer.score.max_queue == 10 and config.balancer.weights.mode == "p99_ratio"
    from llmdiag.config import ConfigError

    with pytest.raises(ConfigError, match="balancer.choise"):
        Config.from_toml("[balancer]\nchoise = 3\n")
    with pytest.raises(ConfigError, match="weight_ttft"):
        Config.from_toml("[balancer.score]\nweight_ttft = 0.9\n")
    with pytest.raises(ConfigError, match="balancer.weights.mode"):
        Config.from_toml("[balancer.weights]\nmode = 'fastest'\n")
