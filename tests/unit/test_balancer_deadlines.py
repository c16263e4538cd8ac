"""``Balancer.deadlines()``: when cooling and ejection end, in the balancer's clock (virtual here)."""

from __future__ import annotations

import pytest

from llmdiag.model import BackendState
from llmdiag.router_feedback.balancer import Balancer, BackendDeadlines

from balancer_support import ScriptedRandom, VirtualClock, fleet, warmed

KV_EXHAUSTED = b'{"error": {"message": "KV cache exhausted, retry later", "type": "server_busy"}}'


def _balancer() -> tuple[Balancer, VirtualClock, ScriptedRandom]:
    clock = VirtualClock(1000.0)
    rng = ScriptedRandom(fallback=None)
    return warmed(Balancer(fleet(2), clock=clock, rng=rng), clock), clock, rng


def test_healthy_backends_have_no_deadlines() -> None:
    balancer, _, _ = _balancer()
    assert balancer.deadlines() == {"b0": BackendDeadlines(None, None), "b1": BackendDeadlines(None, None)}
    assert all(s.state is BackendState.HEALTHY for s in balancer.snapshot_states())


def test_a_kv_exhausted_429_sets_cooling_until_and_it_clears_when_over() -> None:
    balancer, clock, rng = _balancer()
    now = clock.now
    rng.script([0.5])  # cooling lasts min + (max - min) * draw = 3 + 2 * 0.5 = 4 s
    balancer.on_finish("b0", 429, KV_EXHAUSTED)
    assert rng.calls == 1
    assert balancer.state("b0") is BackendState.COOLING
    d = balancer.deadlines()
    assert d["b0"] == BackendDeadlines(cooling_until=pytest.approx(now + 4.0), ejected_until=None)
    assert d["b1"] == BackendDeadlines(None, None)
    clock.advance(3.9)
    assert balancer.deadlines()["b0"].cooling_until == pytest.approx(now + 4.0)
    clock.advance(0.2)
    assert balancer.deadlines()["b0"] == BackendDeadlines(None, None)
    assert balancer.state("b0") is not BackendState.COOLING


def test_retry_after_sets_the_cooling_deadline_exactly() -> None:
    balancer, clock, rng = _balancer()
    rng.script([0.0])
    balancer.on_finish("b1", 429, KV_EXHAUSTED, {"Retry-After": "7"})
    assert balancer.deadlines()["b1"].cooling_until == pytest.approx(clock.now + 7.0)


def test_three_failures_eject_with_a_deadline_that_goes_when_half_open() -> None:
    balancer, clock, _ = _balancer()
    now = clock.now
    for _ in range(3):  # BalancerConfig: 3 consecutive failures, first ejection 15 s
        balancer.on_finish("b0", 500, b"internal error")
    assert balancer.state("b0") is BackendState.EJECTED
    assert balancer.deadlines()["b0"] == BackendDeadlines(cooling_until=None, ejected_until=pytest.approx(now + 15.0))
    clock.advance(14.0)
    assert balancer.deadlines()["b0"].ejected_until == pytest.approx(now + 15.0)
    clock.advance(1.0)  # the ejection is over: half-open, no deadline any more
    assert balancer.deadlines()["b0"] == BackendDeadlines(None, None)
    assert balancer.state("b0") is BackendState.HALF_OPEN
