"""Passive health: circuit breaker transitions (SPEC 6.3, seed 002)."""

from __future__ import annotations

import random

import pytest

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import BackendState
from llmdiag.router_feedback.balancer import NoBackendAvailable
from llmdiag.router_feedback.breaker import Breaker, BreakerState

from balancer_support import make

CFG = BalancerConfig()  # 3 failures, 15 s doubling to 60 s, 2 successes, 2 probe successes


def test_three_consecutive_failures_open_the_circuit() -> None:
    b = Breaker(CFG)
    assert not b.on_failure(0.0)
    assert not b.on_failure(0.1)
    assert b.on_failure(0.2)
    assert b.state is BreakerState.OPEN
    assert b.open_until == pytest.approx(15.2)


def test_a_success_resets_the_count() -> None:
    b = Breaker(CFG)
    b.on_failure(0.0)
    b.on_failure(0.1)
    b.on_success(0.2)
    b.on_failure(0.3)
    b.on_failure(0.4)
    assert b.state is BreakerState.CLOSED


def test_open_goes_half_open_when_the_time_is_over() -> None:
    b = Breaker(CFG)
    for t in (0.0, 0.0, 0.0):
        b.on_failure(t)
    assert not b.tick(14.9)
    assert b.tick(15.0)
    assert b.state is BreakerState.HALF_OPEN


def test_two_probe_successes_go_half_open_at_once() -> None:
    b = Breaker(CFG)
    for _ in range(3):
        b.on_failure(0.0)
    assert not b.on_probe(True, 1.0)
    assert not b.on_probe(False, 2.0)  # a failure in between starts the count over
    assert not b.on_probe(True, 3.0)
    assert b.on_probe(True, 4.0)
    assert b.state is BreakerState.HALF_OPEN


def test_passive_results_while_open_do_not_move_it() -> None:
    b = Breaker(CFG)
    for _ in range(3):
        b.on_failure(0.0)
    assert not b.on_success(1.0)
    assert not b.on_success(1.1)
    assert not b.on_failure(1.2)
    assert b.state is BreakerState.OPEN and b.open_until == pytest.approx(15.0)


def test_half_open_closes_after_two_successes_and_reopens_with_backoff() -> None:
    b = Breaker(CFG)
    for _ in range(3):
        b.on_failure(0.0)
    b.tick(15.0)
    assert not b.on_success(15.1)
    assert b.on_success(15.2)
    assert b.state is BreakerState.CLOSED
    # Fail again soon: the next ejection is twice as long, then 60 s at most.
    for expected in (30.0, 60.0, 60.0):
        now = b.open_until if b.state is BreakerState.OPEN else 16.0
        if b.state is BreakerState.OPEN:
            b.tick(now)
            assert b.on_failure(now)  # any failure in half-open reopens
        else:
            for _ in range(3):
                b.on_failure(now)
        assert b.state is BreakerState.OPEN
        assert b.open_until - now == pytest.approx(expected)


def test_backoff_is_forgotten_after_a_long_healthy_spell() -> None:
    b = Breaker(CFG)
    for t in (0.0, 0.0, 0.0):
        b.on_failure(t)
    b.tick(15.0)
    b.on_success(15.0)
    b.on_success(15.0)
    for _ in range(3):
        b.on_failure(100.0)  # 85 s closed > ejection_max_seconds
    assert b.open_until - 100.0 == pytest.approx(15.0)


def test_balancer_ejects_and_recovers_through_half_open() -> None:
    balancer, clock = make(2, rng=random.Random(3))
    for _ in range(3):
        balancer.pick("m", 10, exclude=["b1"])
        balancer.on_finish("b0", 502)
    assert balancer.state("b0") is BackendState.EJECTED
    assert balancer.counters["ejections_total"] == 1
    assert {balancer.pick("m", 10).name for _ in range(50)} == {"b1"}
    for _ in range(50):
        balancer.on_finish("b1", 200)  # an idle pool: half-open admits its minimum
    states = {s.name: s for s in balancer.snapshot_states()}
    assert states["b0"].state is BackendState.EJECTED
    assert states["b0"].weight_percent == 0
    assert states["b0"].reasons[-1].kind == "circuit_open"
    clock.advance(15.0)
    assert balancer.state("b0") is BackendState.HALF_OPEN
    assert balancer.counters["half_open_total"] == 1
    # Half-open admits one request at a time in an idle pool (half_open_max_in_flight = 1), however good it looks.
    balancer.set_penalty("b1", 0.9)
    picks = [balancer.pick("m", 10).name for _ in range(20)]
    assert picks.count("b0") == 1
    balancer.on_finish("b0", 200)
    assert balancer.state("b0") is BackendState.HALF_OPEN
    balancer.pick("m", 10, exclude=["b1"])
    balancer.on_finish("b0", 200)
    assert balancer.state("b0") is not BackendState.HALF_OPEN
    assert balancer.state("b0") in (BackendState.WARMING, BackendState.DEGRADED)  # ramps back, no herd
    assert balancer.counters["circuit_closed_total"] == 1


def test_failure_in_half_open_reopens_for_longer() -> None:
    balancer, clock = make(1)
    for _ in range(3):
        balancer.on_finish("b0", "connect_error")
    clock.advance(15.0)
    assert balancer.state("b0") is BackendState.HALF_OPEN
    balancer.on_finish("b0", "timeout")
    assert balancer.state("b0") is BackendState.EJECTED
    with pytest.raises(NoBackendAvailable):
        balancer.pick("m", 10)
    clock.advance(29.9)
    assert balancer.state("b0") is BackendState.EJECTED
    clock.advance(0.2)
    assert balancer.state("b0") is BackendState.HALF_OPEN
    assert balancer.pick("m", 10).name == "b0"  # picking notices the expiry itself


def test_saturation_does_not_trip_the_breaker() -> None:
    # Saturation means busy, not broken: cooling handles it.
    balancer, clock = make(1)
    for _ in range(10):
        balancer.on_finish("b0", 429, b"KV cache exhausted")
    assert balancer.state("b0") is BackendState.COOLING
    assert balancer.counters["ejections_total"] == 0


def test_client_errors_neither_trip_nor_reset() -> None:
    balancer, clock = make(1)
    balancer.on_finish("b0", 500)
    balancer.on_finish("b0", 500)
    balancer.on_finish("b0", 400)
    balancer.on_finish("b0", 429, b"rate limit exceeded for api key")
    balancer.on_finish("b0", 500)
    assert balancer.state("b0") is BackendState.EJECTED


def test_breaker_config_validation() -> None:
    with pytest.raises(ValueError, match="ejection_max_seconds"):
        BalancerConfig(ejection_base_seconds=30, ejection_max_seconds=10)
    with pytest.raises(ValueError, match="consecutive_failures"):
        BalancerConfig(consecutive_failures=0)
