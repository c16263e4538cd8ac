"""Health score (SPEC 6.1), warm-up ramp and warming state."""

from __future__ import annotations

import pytest

from llmdiag.config.balancer import ScoreConfig
from llmdiag.model import NA, BackendState, Distribution
from llmdiag.router_feedback.score import ScoreInputs, ScoreView, health_score

from balancer_support import VirtualClock, make

CFG = ScoreConfig()


def score(**kw) -> float:
    return health_score(ScoreInputs(**kw), CFG).score


def test_unknown_everything_is_full_health() -> None:
    assert score() == 100.0
    assert score(ttft_seconds=None, requests_waiting=None, kv_cache_usage=None) == 100.0
    assert score(ttft_seconds=float("nan")) == 100.0


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        # ttft 1 s of 2 s -> (0.5)^2 = 0.25 -> 0.35 * 0.25 = 0.0875
        ({"ttft_seconds": 1.0}, 91.25),
        ({"ttft_seconds": 2.0}, 65.0),
        ({"ttft_seconds": 20.0}, 65.0),  # saturates at 1
        # 1 error in 10 -> 5 * 0.1 = 0.5 -> 0.40 * 0.5 = 0.2
        ({"errors": 1.0, "successes": 9.0}, 80.0),
        ({"errors": 2.0, "successes": 8.0}, 60.0),  # 20 % errors -> factor 1
        ({"errors": 9.0, "successes": 1.0}, 60.0),
        # waiting 15 of 30 -> 0.5 -> 0.25 * 0.5
        ({"requests_waiting": 15.0}, 87.5),
        ({"requests_waiting": 300.0}, 75.0),
        ({"kv_cache_usage": 0.80}, 100.0),  # at the threshold: nothing yet
        ({"kv_cache_usage": 0.90}, 87.5),  # (0.9 - 0.8) / 0.2 = 0.5
        ({"kv_cache_usage": 0.90, "requests_waiting": 3.0}, 87.5),  # max(0.1, 0.5)
        ({"kv_cache_usage": 1.0}, 75.0),
        ({"ttft_seconds": 5.0, "errors": 5.0, "successes": 0.0, "requests_waiting": 40.0}, 0.0),
    ],
)
def test_seed_000_formula(inputs: dict, expected: float) -> None:
    assert score(**inputs) == pytest.approx(expected)


def test_penalty_multiplies_the_score() -> None:
    f = health_score(ScoreInputs(requests_waiting=15.0, penalty=0.31), CFG)
    assert f.health == pytest.approx(87.5)
    assert f.score == pytest.approx(87.5 * 0.69)
    assert health_score(ScoreInputs(penalty=1.0), CFG).score == 0.0


def test_weights_come_from_config() -> None:
    cfg = ScoreConfig(weight_ttft=0.0, weight_errors=0.0, weight_queue=1.0, max_queue=10.0)
    assert health_score(ScoreInputs(ttft_seconds=10.0, requests_waiting=5.0), cfg).score == pytest.approx(50.0)


def test_score_view_ramps_at_most_the_rate_and_falls_at_once() -> None:
    view = ScoreView.fixed(40.0, 0.0, 15.0).retarget(100.0, 0.0)
    assert view.value(0.0) == 40.0
    assert view.value(1.0) == pytest.approx(55.0)
    assert view.value(2.0) == pytest.approx(70.0)
    assert view.value(4.0) == pytest.approx(100.0)
    assert view.value(10.0) == 100.0
    fallen = view.retarget(30.0, 1.0)  # while still ramping at 55
    assert fallen.value(1.0) == 30.0
    # Rising again mid-ramp continues from the current value, not from the target.
    again = view.retarget(90.0, 2.0)
    assert again.value(2.0) == pytest.approx(70.0)
    assert again.value(3.0) == pytest.approx(85.0)


def test_balancer_score_rises_at_most_15_points_per_second() -> None:
    balancer, clock = make(1)
    balancer.update_signals("b0", {"requests_waiting": 30.0, "kv_cache_usage": 1.0, "ttft_seconds": Distribution(ewma=4.0)})
    low = balancer.score("b0")
    assert low == pytest.approx(100 * (1 - 0.35 - 0.25))  # fell at once
    balancer.update_signals("b0", {"requests_waiting": 0.0, "kv_cache_usage": 0.1, "ttft_seconds": Distribution(ewma=0.2)})
    previous = balancer.score("b0")
    assert previous == pytest.approx(low)  # no jump
    seen = [previous]
    for _ in range(40):
        clock.advance(0.1)
        current = balancer.score("b0")
        assert current - previous <= 15.0 * 0.1 + 1e-9
        seen.append(current)
        previous = current
    assert seen[-1] == pytest.approx(100 * (1 - 0.35 * 0.01))
    assert seen[10] == pytest.approx(low + 15.0)


def test_new_backend_starts_warming_and_ramps() -> None:
    import random

    from llmdiag.router_feedback.balancer import Balancer

    from balancer_support import fleet

    clock = VirtualClock()
    balancer = Balancer(fleet(1), clock=clock, rng=random.Random(0))
    assert balancer.state("b0") is BackendState.WARMING
    assert balancer.score("b0") == pytest.approx(CFG.warming_start_score)
    clock.advance(3.0)
    assert balancer.score("b0") == pytest.approx(CFG.warming_start_score + 45.0)
    assert balancer.state("b0") is BackendState.WARMING
    clock.advance(3.0)
    assert balancer.score("b0") == pytest.approx(100.0)
    assert balancer.state("b0") is BackendState.HEALTHY


def test_restart_warms_again_via_up_transition_and_explicitly() -> None:
    balancer, clock = make(2)
    balancer.update_signals("b0", {"up": 1})
    assert balancer.state("b0") is BackendState.HEALTHY
    balancer.update_signals("b0", {"up": 0})
    balancer.update_signals("b0", {"up": 1})
    assert balancer.state("b0") is BackendState.WARMING
    assert balancer.score("b0") == pytest.approx(CFG.warming_start_score)
    balancer.mark_restarted("b1")
    assert balancer.state("b1") is BackendState.WARMING


def test_na_and_missing_signals_mean_unknown_not_zero() -> None:
    balancer, clock = make(1)
    balancer.update_signals("b0", {"requests_waiting": 15.0})
    assert balancer.score("b0") == pytest.approx(87.5)
    balancer.update_signals("b0", {"kv_cache_usage": 0.5})  # waiting absent: still known
    assert balancer.score("b0") == pytest.approx(87.5)
    balancer.update_signals("b0", {"requests_waiting": NA})  # the source cannot tell now
    clock.advance(10)
    assert balancer.score("b0") == pytest.approx(100.0)
    assert balancer.factors("b0").queue == 0.0
    balancer.update_signals("b0", {"ttft_seconds": {"p50": None, "p99": None, "ewma": None, "count": 0}})
    assert balancer.score("b0") == pytest.approx(100.0)


def test_bad_signal_values_degrade_and_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    balancer, clock = make(1)
    balancer.update_signals("b0", {"requests_waiting": "lots", "kv_cache_usage": True})
    balancer.update_signals("b0", {"requests_waiting": "lots"})
    assert balancer.score("b0") == pytest.approx(100.0)
    assert balancer.counters["bad_signal_total"] == 3
    assert sum("requests_waiting is not a number" in r.getMessage() for r in caplog.records) == 1  # once per cause
    balancer.update_signals("b0", ["not", "a", "mapping"])  # type: ignore[arg-type]
    assert balancer.counters["bad_signal_total"] == 4


def test_ttft_uses_own_ewma_and_the_worse_of_gateway_and_engine() -> None:
    balancer, clock = make(1)
    balancer.on_first_token("b0", 2.0)
    assert balancer.factors("b0").ttft == pytest.approx(1.0)
    balancer.on_first_token("b0", 0.0)  # EWMA alpha 0.2: 0.8 * 2.0 = 1.6
    assert balancer.factors("b0").ttft == pytest.approx((1.6 / 2.0) ** 2)
    balancer.update_signals("b0", {"ttft_seconds": Distribution(p50=1.0, p99=3.0, ewma=1.8, count=5)})
    assert balancer.factors("b0").ttft == pytest.approx((1.8 / 2.0) ** 2)
    clock.advance(CFG.ttft_stale_seconds + 1)  # own observations go stale; the engine's remains
    balancer.update_signals("b0", {"ttft_seconds": Distribution(ewma=0.2)})
    assert balancer.factors("b0").ttft == pytest.approx(0.01)


def test_non_finite_and_huge_signals_are_unknown_not_a_crash() -> None:
    from llmdiag.model import Backend
    from llmdiag.router_feedback.balancer import Balancer

    balancer = Balancer([Backend.from_url("http://127.0.0.1:1", name="a")])
    before = balancer.score("a")
    balancer.update_signals("a", {"requests_waiting": 10**400, "kv_cache_usage": float("inf")})
    assert balancer.counters["bad_signal_total"] == 2
    assert balancer.score("a") >= before  # unknown, not "infinitely overloaded"
