"""What a penalty may carry (issue 14 point 1), backend_down as an ejection, and fast re-admission (point 2)."""

from __future__ import annotations

import random

import pytest

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import BackendState, Reason, Severity
from llmdiag.router_feedback.breaker import Breaker, BreakerState

from balancer_support import make

DOWN = Reason("backend_down", Severity.CRITICAL, 1.0, "connection refused on 10.0.0.1:8000; last seen KV 97 %")


def reason(kind: str, penalty: float) -> Reason:
    return Reason(kind, Severity.WARNING, penalty, f"{kind} by hand")


# ------------------------------------------------------------- the penalty rule


def test_self_observed_kinds_are_reported_but_not_charged() -> None:
    balancer, clock = make(2)
    balancer.set_penalty("b0", 0.2, [reason("gpu_throttling", 0.2)])
    assert balancer.score("b0") == pytest.approx(100.0)  # slowness is in its measured prefill speed already
    state = {s.name: s for s in balancer.snapshot_states()}["b0"]
    assert state.penalty == 0.2 and state.reasons[0].kind == "gpu_throttling"  # still reported as given
    assert balancer.counters["penalty_self_observed_total"] == 1
    balancer.set_penalty("b0", 0.25, [reason("kv_cache_saturation", 0.25)])
    assert balancer.score("b0") == pytest.approx(100.0)


def test_what_the_balancer_cannot_see_is_charged_and_the_seen_part_divided_out() -> None:
    balancer, clock = make(2)
    # timewait_exhaustion 0.1 and gpu_throttling 0.2 combine to 1 - 0.9 * 0.8 = 0.28; only 0.1 is charged.
    balancer.set_penalty("b0", 0.28, [reason("timewait_exhaustion", 0.1), reason("gpu_throttling", 0.2)])
    assert balancer.score("b0") == pytest.approx(90.0)
    # A penalty without reasons says nothing about what it is made of: charged whole.
    balancer.set_penalty("b1", 0.3)
    assert balancer.score("b1") == pytest.approx(70.0)


def test_charging_everything_is_a_config_choice() -> None:
    balancer, clock = make(2, config=BalancerConfig(self_observed_kinds=()))
    balancer.set_penalty("b0", 0.2, [reason("gpu_throttling", 0.2)])
    assert balancer.score("b0") == pytest.approx(80.0)


def test_config_rejects_empty_kind_names() -> None:
    with pytest.raises(ValueError, match="self_observed_kinds"):
        BalancerConfig(self_observed_kinds=("",))


# ------------------------------------------------------- backend_down ejects


def test_backend_down_ejects_at_once_and_counts_the_enforcement() -> None:
    balancer, clock = make(2)
    balancer.set_penalty("b0", 1.0, [DOWN])
    assert balancer.state("b0") is BackendState.EJECTED
    assert balancer.counters["down_ejections_total"] == 1 and balancer.counters["ejections_total"] == 1
    assert {balancer.pick("m", 10).name for _ in range(30)} == {"b1"}
    state = {s.name: s for s in balancer.snapshot_states()}["b0"]
    assert [r.kind for r in state.reasons] == ["backend_down", "circuit_open"]
    assert "reported down" in state.reasons[-1].summary and "1 good probe" in state.reasons[-1].summary
    # The same report again (the diagnosis is held open) ejects nothing new.
    balancer.set_penalty("b0", 1.0, [DOWN])
    assert balancer.counters["down_ejections_total"] == 1


def test_backend_down_readmits_on_one_good_probe_and_its_held_report_does_not_re_eject() -> None:
    balancer, clock = make(2)
    balancer.set_penalty("b0", 1.0, [DOWN])
    balancer.on_probe("b0", False, refused=True)
    clock.advance(5.0)
    balancer.on_probe("b0", True)
    assert balancer.state("b0") is BackendState.HALF_OPEN
    # The analyzer still holds the diagnosis for a while: not charged (ejection is how it acted) ...
    balancer.set_penalty("b0", 1.0, [DOWN])
    assert balancer.state("b0") is BackendState.HALF_OPEN
    assert balancer.score("b0") > 0
    assert balancer.pick("m", 10, exclude=["b1"]).name == "b0"
    # ... and once it closes and opens again, that is a new report: ejected again.
    balancer.set_penalty("b0", 0.0, [])
    balancer.set_penalty("b0", 1.0, [DOWN])
    assert balancer.state("b0") is BackendState.EJECTED


def test_backend_down_with_a_not_seen_reason_keeps_charging_the_other() -> None:
    balancer, clock = make(2)
    balancer.set_penalty("b0", 1.0, [DOWN, reason("gpu_fault", 0.9)])
    assert balancer.factors("b0").score == pytest.approx(10.0)  # 100 * (1 - 0.9): the XID is charged


# ------------------------------------------------------------ re-admission


CFG = BalancerConfig()


def test_one_probe_after_a_refused_connection_goes_half_open_unless_flapping() -> None:
    b = Breaker(CFG)
    b.on_refused()
    for _ in range(3):
        b.on_failure(0.0)
    assert b.probes_needed() == 1
    assert b.on_probe(True, 5.0) and b.state is BreakerState.HALF_OPEN
    # It fails again in half-open: the second ejection in the window is flapping, two probes again.
    assert b.on_failure(6.0) and b.state is BreakerState.OPEN
    assert b.open_until == pytest.approx(36.0)  # the backoff doubled
    assert b.probes_needed() == 2
    assert not b.on_probe(True, 10.0)
    assert b.on_probe(True, 15.0)


def test_a_server_fault_still_needs_two_probes() -> None:
    b = Breaker(CFG)
    for _ in range(3):
        b.on_failure(0.0)
    assert b.probes_needed() == 2
    assert not b.on_probe(True, 5.0)


def test_the_timer_sends_no_trial_while_the_latest_probe_failed() -> None:
    b = Breaker(CFG)
    for _ in range(3):
        b.on_failure(0.0)
    b.on_probe(False, 12.0, refused=True)
    assert not b.tick(15.0)  # the engine was down 3 s ago: stay open, look again in 5 s
    assert b.state is BreakerState.OPEN and b.open_until == pytest.approx(20.0)
    assert b.ejections == 1  # not a new ejection: no doubling
    assert b.tick(30.0)  # no probe for 18 s (the prober stopped): the timer works as before
    assert b.state is BreakerState.HALF_OPEN


def test_a_first_token_counts_in_half_open_and_the_ramp_runs_once() -> None:
    balancer, clock = make(2, rng=random.Random(1))
    for _ in range(3):
        balancer.on_finish("b0", "connect_error")
    for _ in range(4):
        balancer.pick("m", 10)  # b1 holds 4 in flight: half-open b0 may hold 2
    # The engine comes back: its metrics say up again (warming starts), then a probe re-admits it.
    balancer.update_signals("b0", {"up": 0.0})
    clock.advance(3.0)
    balancer.update_signals("b0", {"up": 1.0})
    ramp_started = balancer.score("b0")
    clock.advance(2.0)
    balancer.on_probe("b0", True)
    assert balancer.state("b0") is BackendState.HALF_OPEN
    assert balancer.score("b0") > ramp_started  # half-open did not restart the ramp
    for _ in range(2):
        balancer.pick("m", 10, exclude=["b1"])
        balancer.on_first_token("b0", 0.2, prompt_tokens=10)
    assert balancer.state("b0") is BackendState.WARMING  # closed by two first tokens, still ramping
    assert balancer.counters["circuit_closed_total"] == 1


def test_half_open_admits_in_proportion_to_the_pool() -> None:
    balancer, clock = make(3, rng=random.Random(2))
    for _ in range(3):
        balancer.on_finish("b0", 502)
    for _ in range(40):  # 20 in flight on each of the other two
        balancer.pick("m", 100, exclude=["b0"])
    balancer.set_penalty("b1", 0.95)
    balancer.set_penalty("b2", 0.95)
    clock.advance(15.0)
    assert balancer.state("b0") is BackendState.HALF_OPEN
    # Half-open may hold ceil(0.5 * 20) = 10: b0 is much the best, so it takes exactly that many.
    picks = [balancer.pick("m", 100).name for _ in range(30)]
    assert picks.count("b0") == 10
