"""Load in work (SPEC 6.3, extended): pending prefill scaled by each backend's measured prefill speed."""

from __future__ import annotations

import random

import pytest

from llmdiag.config.balancer import BalancerConfig
from llmdiag.router_feedback.balancer import Balancer

from balancer_support import VirtualClock, make


def drain(balancer: Balancer, clock: VirtualClock, name: str, others: list[str], prompts: list[int],
          seconds_per_token: float) -> None:
    """Dispatch ``prompts`` to ``name`` at once, then let them reach their first tokens one by one,
    each after its own prefill time (a backend working through a FIFO backlog)."""
    for p in prompts:
        assert balancer.pick("m", p, exclude=others).name == name
    start = clock.now
    for p in prompts:
        clock.advance(p * seconds_per_token)
        balancer.on_first_token(name, clock.now - start, prompt_tokens=p)
    for _ in prompts:
        balancer.on_finish(name, 200)


def test_measured_prefill_speed_scales_pending_tokens() -> None:
    cfg = BalancerConfig(tokens_per_slot=256, prefill_sample_min_tokens=2048, prefill_slowness_exponent=1.0)
    balancer, clock = make(2, config=cfg, rng=random.Random(1))
    for _ in range(20):
        drain(balancer, clock, "b0", ["b1"], [3000, 3000, 3000], 100e-6)  # 100 us per token
        drain(balancer, clock, "b1", ["b0"], [3000, 3000, 3000], 250e-6)  # 2.5x slower (throttled)
    slow0, slow1 = balancer.prefill_slowness("b0"), balancer.prefill_slowness("b1")
    # Slowness = seconds per token over the pool's mean; every drain here leaves a backlog of
    # >= 3000 tokens behind it, so each one is a sample.
    assert slow1 / slow0 == pytest.approx(2.5, rel=0.05)
    assert slow0 < 1.0 < slow1
    # Equal pending work: the slower backend carries 2.5x the load.
    balancer.pick("m", 4000, exclude=["b1"])
    balancer.pick("m", 4000, exclude=["b0"])
    assert balancer.load("b1") - 1 == pytest.approx(2.5 * (balancer.load("b0") - 1), rel=0.05)
    # And the next request, on equal in-flight counts and equal backlog, goes to the faster one.
    assert balancer.pick("m", 1000).name == "b0"


def test_slow_backend_gets_a_smaller_share_of_a_burst() -> None:
    cfg = BalancerConfig(tokens_per_slot=256, prefill_sample_min_tokens=0, prefill_slowness_exponent=1.0)
    balancer, clock = make(2, config=cfg, rng=random.Random(2))
    for _ in range(10):
        drain(balancer, clock, "b0", ["b1"], [2000, 2000], 100e-6)
        drain(balancer, clock, "b1", ["b0"], [2000, 2000], 300e-6)
    picks = [balancer.pick("m", 2000).name for _ in range(40)]
    # Equal work per prompt: the split follows the speeds (3:1), not the counts (1:1).
    assert picks.count("b0") == pytest.approx(30, abs=2)


def test_the_default_exponent_damps_the_measured_slowness() -> None:
    # Same measurement as above (2.5x slower), default prefill_slowness_exponent 0.5: the slower backend's
    # pending tokens weigh sqrt of its slowness ratio, 2.5 ** 0.5 = 1.58x (issue 14 point 3).
    cfg = BalancerConfig(tokens_per_slot=256, prefill_sample_min_tokens=2048)
    assert cfg.prefill_slowness_exponent == 0.5
    balancer, clock = make(2, config=cfg, rng=random.Random(1))
    for _ in range(20):
        drain(balancer, clock, "b0", ["b1"], [3000, 3000, 3000], 100e-6)
        drain(balancer, clock, "b1", ["b0"], [3000, 3000, 3000], 250e-6)
    slow0, slow1 = balancer.prefill_slowness("b0"), balancer.prefill_slowness("b1")
    assert slow1 / slow0 == pytest.approx(2.5, rel=0.05)  # the reading is the measurement itself
    balancer.pick("m", 4000, exclude=["b1"])
    balancer.pick("m", 4000, exclude=["b0"])
    ratio = (balancer.load("b1") - 1) / (balancer.load("b0") - 1)
    assert ratio == pytest.approx((slow1 / slow0) ** 0.5, rel=0.01)
    with pytest.raises(ValueError, match="prefill_slowness_exponent"):
        BalancerConfig(prefill_slowness_exponent=1.5)


def test_idle_time_between_bursts_is_not_prefill_time() -> None:
    cfg = BalancerConfig(prefill_sample_min_tokens=0)
    balancer, clock = make(2, config=cfg, rng=random.Random(3))
    for _ in range(5):
        drain(balancer, clock, "b0", ["b1"], [1000], 100e-6)
        drain(balancer, clock, "b1", ["b0"], [1000], 100e-6)
        clock.advance(100.0)  # both idle: no pending prefill, so no busy time
    assert balancer.prefill_slowness("b0") == pytest.approx(1.0, rel=1e-6)
    assert balancer.prefill_slowness("b1") == pytest.approx(1.0, rel=1e-6)


def test_small_backlogs_are_not_speed_samples() -> None:
    # A nearly idle engine spends its time in per-step overhead: with the default minimum backlog
    # (2048 tokens) lone 500-token requests that take long do not make a backend look slow.
    balancer, clock = make(2, rng=random.Random(4))
    for _ in range(10):
        drain(balancer, clock, "b0", ["b1"], [500], 100e-6)
        drain(balancer, clock, "b1", ["b0"], [500], 1000e-6)
    assert balancer.prefill_slowness("b0") == 1.0 and balancer.prefill_slowness("b1") == 1.0


def test_prefill_speed_can_be_turned_off() -> None:
    cfg = BalancerConfig(prefill_speed_alpha=0.0, tokens_per_slot=2048, prefill_sample_min_tokens=0)
    balancer, clock = make(2, config=cfg, rng=random.Random(5))
    for _ in range(5):
        drain(balancer, clock, "b0", ["b1"], [3000, 3000], 100e-6)
        drain(balancer, clock, "b1", ["b0"], [3000, 3000], 500e-6)
    assert balancer.prefill_slowness("b1") == 1.0
    balancer.pick("m", 4096, exclude=["b0"])
    assert balancer.load("b1") == pytest.approx(1 + 4096 / 2048)


def test_removing_a_measured_backend_keeps_the_mean_of_the_rest() -> None:
    cfg = BalancerConfig(prefill_sample_min_tokens=0)
    balancer, clock = make(3, config=cfg, rng=random.Random(6))
    for _ in range(5):
        drain(balancer, clock, "b0", ["b1", "b2"], [2000, 2000], 100e-6)
        drain(balancer, clock, "b1", ["b0", "b2"], [2000, 2000], 100e-6)
        drain(balancer, clock, "b2", ["b0", "b1"], [2000, 2000], 1000e-6)
    balancer.remove_backend("b2")
    # One more sample for b0 is now judged against b0 and b1 only (equal speeds): slowness 1.
    drain(balancer, clock, "b0", ["b1"], [2000, 2000], 100e-6)
    assert balancer.prefill_slowness("b0") == pytest.approx(1.0, rel=0.02)


def test_prefill_speed_config_is_validated() -> None:
    with pytest.raises(ValueError, match="prefill_speed_alpha"):
        BalancerConfig(prefill_speed_alpha=1.5)
    with pytest.raises(ValueError, match="prefill_sample_min_tokens"):
        BalancerConfig(prefill_sample_min_tokens=-1)
