"""The balancer's pick (SPEC 6.3): exact picks under a scripted RNG, then selection probabilities."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import Backend
from llmdiag.router_feedback.balancer import Balancer, NoBackendAvailable

from balancer_support import ScriptedRandom, VirtualClock, make, set_score, warmed

# Queue-factor scores: 100 * (1 - 0.25 * waiting / 30).
# SPEC 6.3's P2C with the pre-sweep load constants, for the exact-pick and P2C-probability tests
# (the defaults are d = 4 and other constants since the simulator sweep; see docs/simulator.md).
# full_scan_up_to=0: these tests are about sampling, which small pools skip by default (issue 14).
P2C = BalancerConfig(full_scan_up_to=0, choices=2, in_flight_penalty=0.1, tokens_per_slot=2048, prefill_speed_alpha=0.0)
WAITING_FOR = {100.0: 0.0, 95.0: 6.0, 87.5: 15.0, 75.0: 30.0}


def scored(scores: list[float], config: BalancerConfig | None = None, rng=None) -> tuple[Balancer, VirtualClock]:
    balancer, clock = make(len(scores), config=config, rng=rng)
    for i, s in enumerate(scores):
        set_score(balancer, f"b{i}", WAITING_FOR[s])
        assert balancer.score(f"b{i}") == pytest.approx(s)
    return balancer, clock


# ----------------------------------------------------------------- exact picks


def test_exact_p2c_picks_under_a_scripted_rng() -> None:
    rng = ScriptedRandom()
    balancer, clock = scored([100.0, 75.0, 87.5, 95.0], P2C, rng=rng)
    # i = int(r1 * n); j = int(r2 * (n - 1)), shifted past i: two distinct indices from two draws.
    rng.script([0.1, 0.4, 0.3, 0.0, 0.55, 0.99, 0.3, 0.7])
    assert balancer.pick("m", 0).name == "b0"  # b0 (100) vs b2 (87.5)
    assert balancer.pick("m", 0).name == "b0"  # b1 (75) vs b0 (100 / (1 + 0.1 * 1) = 90.9)
    assert balancer.pick("m", 0).name == "b3"  # b2 (87.5) vs b3 (95)
    assert balancer.pick("m", 0).name == "b3"  # b1 (75) vs b3 (95 / 1.1 = 86.4)
    assert rng.calls == 8  # O(d): two draws per pick, no scan
    assert balancer.load("b0") == 2 and balancer.load("b3") == 2


def test_exact_tie_breaks_under_a_scripted_rng() -> None:
    # Three equal backends: the d = 2 path breaks a tie with one more draw, as every path does
    # (reservoir sampling: the second tied candidate wins when random() * 2 < 1).
    rng = ScriptedRandom()
    balancer, clock = scored([100.0, 100.0, 100.0], config=BalancerConfig(full_scan_up_to=0, choices=2, in_flight_penalty=0.0), rng=rng)
    rng.script([0.0, 0.0, 0.2, 0.0, 0.0, 0.7])
    assert balancer.pick("m", 0).name == "b1"
    assert balancer.pick("m", 0).name == "b0"
    # Two backends and d = 2 distinct is a full scan: the second tied candidate wins when random() * 2 < 1.
    rng = ScriptedRandom()
    balancer, clock = scored([100.0, 100.0], config=BalancerConfig(full_scan_up_to=0, choices=2, in_flight_penalty=0.0), rng=rng)
    rng.script([0.3, 0.7])
    assert balancer.pick("m", 0).name == "b1"
    assert balancer.pick("m", 0).name == "b0"


def test_pick_samples_o_of_d_at_a_thousand_backends() -> None:
    rng = ScriptedRandom()
    balancer, clock = make(1000, config=P2C, rng=rng)
    set_score(balancer, "b249", 30.0)
    rng.script([0.5, 0.25])  # indices 500 and int(0.25 * 999) = 249
    assert balancer.pick("m", 100).name == "b500"
    assert rng.calls == 2


def test_default_d_draws_four_distinct_backends_at_a_thousand() -> None:
    rng = ScriptedRandom()
    balancer, clock = make(1000, rng=rng)
    assert balancer.config.choices == 4
    set_score(balancer, "b100", 30.0)
    set_score(balancer, "b300", 6.0)  # 95 points
    set_score(balancer, "b900", 15.0)  # 87.5 points
    # Indices 100, 100 again (rejected: distinct), 700, 300, 900: five draws, four candidates.
    rng.script([0.1, 0.1, 0.7, 0.3, 0.9])
    assert balancer.pick("m", 100).name == "b700"
    assert rng.calls == 5  # O(d), no scan
    # Four of five (d > n / 2): partial Fisher-Yates, exactly d draws; the worst never wins
    # (load held out with in_flight_penalty = 0), since at least three others are always drawn.
    rng = ScriptedRandom(fallback=random.Random(7))
    balancer, clock = make(5, config=BalancerConfig(full_scan_up_to=0, in_flight_penalty=0.0), rng=rng)
    set_score(balancer, "b2", 30.0)
    assert Counter(balancer.pick("m", 0).name for _ in range(2000))["b2"] == 0
    set_score(balancer, "b1", 6.0)  # 95 points
    set_score(balancer, "b3", 15.0)  # 87.5 points: b0..b3 drawn, b0 (100) wins without a tie-break draw
    rng.script([0.0, 0.0, 0.0, 0.0])
    assert balancer.pick("m", 0).name == "b0"
    assert rng.calls == 4


# ---------------------------------------------------- selection probabilities
# 100k picks with a seeded RNG; in_flight_penalty = 0 isolates the sampling rule from load.
# Tolerance 0.01 absolute: the binomial standard error at N = 100k is <= 0.0016, so this is > 6 sigma.

N = 100_000
TOL = 0.01


def shares(balancer: Balancer, n: int = N, tokens: int = 0) -> dict[str, float]:
    counts = Counter(balancer.pick("m", tokens).name for _ in range(n))
    return {name: counts[name] / n for name in sorted({b.name for b in balancer.backends})}


def test_p2c_distinct_three_backends() -> None:
    # d = 2 distinct of 3: the pair is uniform over the 3 pairs {0,1}, {0,2}, {1,2}.
    # Best wins 2 of them -> 2/3; middle wins only {1,2} -> 1/3; worst never.
    balancer, _ = scored([100.0, 87.5, 75.0], BalancerConfig(full_scan_up_to=0, choices=2, in_flight_penalty=0.0), rng=random.Random(11))
    got = shares(balancer)
    assert got["b0"] == pytest.approx(2 / 3, abs=TOL)
    assert got["b1"] == pytest.approx(1 / 3, abs=TOL)
    assert got["b2"] == 0.0


def test_p2c_with_replacement_two_backends_picks_the_worse_a_quarter_of_the_time() -> None:
    # Envoy-style P2C samples with replacement: the worse one wins only when both draws hit it,
    # P = (1/2) * (1/2) = 1/4; the better one wins 3/4.
    cfg = BalancerConfig(full_scan_up_to=0, choices=2, in_flight_penalty=0.0, with_replacement=True)
    balancer, _ = scored([100.0, 75.0], cfg, rng=random.Random(12))
    got = shares(balancer)
    assert got["b1"] == pytest.approx(0.25, abs=TOL)
    assert got["b0"] == pytest.approx(0.75, abs=TOL)


def test_p2c_distinct_two_backends_always_compares_both() -> None:
    balancer, _ = scored([100.0, 75.0], BalancerConfig(full_scan_up_to=0, in_flight_penalty=0.0), rng=random.Random(13))
    assert shares(balancer, 10_000) == {"b0": 1.0, "b1": 0.0}


def test_ties_are_uniform() -> None:
    # Equal scores: every backend is equally likely, 1/3 each (both the pair and the tie-break are uniform).
    balancer, _ = scored([100.0, 100.0, 100.0], BalancerConfig(full_scan_up_to=0, in_flight_penalty=0.0), rng=random.Random(14))
    for share in shares(balancer).values():
        assert share == pytest.approx(1 / 3, abs=TOL)


def test_power_of_three_choices_over_five() -> None:
    # d = 3 distinct of 5, ranked scores: rank k wins when it is sampled and no better one is:
    # P(k) = C(5 - k, 2) / C(5, 3) -> 6/10, 3/10, 1/10, 0, 0.
    cfg = BalancerConfig(full_scan_up_to=0, in_flight_penalty=0.0, choices=3)
    balancer, _ = scored([100.0, 95.0, 87.5, 75.0, 75.0], cfg, rng=random.Random(15))
    set_score(balancer, "b4", 60.0)  # 50 -> strictly worst
    got = shares(balancer)
    assert got["b0"] == pytest.approx(0.6, abs=TOL)
    assert got["b1"] == pytest.approx(0.3, abs=TOL)
    assert got["b2"] == pytest.approx(0.1, abs=TOL)
    assert got["b3"] == 0.0 and got["b4"] == 0.0


def test_d_all_is_a_full_scan() -> None:
    cfg = BalancerConfig(full_scan_up_to=0, in_flight_penalty=0.0, choices=0)
    balancer, _ = scored([75.0, 87.5, 100.0, 95.0], cfg, rng=random.Random(16))
    assert shares(balancer, 1000) == {"b0": 0.0, "b1": 0.0, "b2": 1.0, "b3": 0.0}


def test_in_flight_penalty_equalises_effective_scores() -> None:
    # With load held (no finishes), picks settle where 100 / (1 + 0.1 a) = 75 / (1 + 0.1 b), a + b = N:
    # 100 + 10 b = 75 + 7.5 a  ->  a = (25 + 10 N) / 17.5 for large N: a / N -> 10 / 17.5 = 4/7.
    balancer, _ = scored([100.0, 75.0], rng=random.Random(17))
    got = shares(balancer, 7000)
    assert got["b0"] == pytest.approx(4 / 7, abs=TOL)


# -------------------------------------------------------------------- herding


def test_herding_100_simultaneous_picks_do_not_all_go_to_the_fresh_backend() -> None:
    # Seed 000's oscillation case: A just recovered to 98 points, B sits at 70, and 100 requests
    # arrive before any feedback. Picking by score alone sends all 100 to A; with the in-flight
    # term they split where 98 / (1 + 0.1 a) = 70 / (1 + 0.1 b), a + b = 100 -> a = 60, b = 40.
    def burst(in_flight_penalty: float) -> Counter:
        balancer, clock = make(2, config=BalancerConfig(full_scan_up_to=0, in_flight_penalty=in_flight_penalty), rng=random.Random(18))
        balancer.set_penalty("b0", 0.02)
        balancer.set_penalty("b1", 0.30)
        assert balancer.score("b0") == pytest.approx(98.0) and balancer.score("b1") == pytest.approx(70.0)
        return Counter(balancer.pick("m", 300).name for _ in range(100))

    herd = burst(0.0)
    assert herd == {"b0": 100}  # what the in-flight penalty prevents
    spread = burst(0.1)
    assert 55 <= spread["b0"] <= 65
    assert 35 <= spread["b1"] <= 45


def test_herding_with_many_backends_spreads_the_burst() -> None:
    balancer, clock = make(10, rng=random.Random(19))
    for i in range(1, 10):
        balancer.set_penalty(f"b{i}", 0.30)
    picks = Counter(balancer.pick("m", 300).name for _ in range(100))
    assert picks["b0"] < 50  # the 98-point backend gets a share, not the herd
    assert len(picks) == 10


# ------------------------------------------------------------ load in work


def test_two_pending_32k_prompts_make_a_backend_busy() -> None:
    balancer, clock = make(2, config=P2C, rng=random.Random(20))
    balancer.set_penalty("b1", 0.20)  # b1: 80 points, b0: 100
    assert balancer.pick("m", 100).name == "b0"
    balancer.on_finish("b0", 200)
    # b0 takes two 32k-token prompts that have not produced a first token yet.
    balancer.pick("m", 32_000, exclude=["b1"])
    balancer.pick("m", 32_000, exclude=["b1"])
    # load(b0) = 2 in flight + 64000 / 2048 = 33.25 -> 100 / 4.325 = 23 < 80: b0 is not idle.
    assert balancer.load("b0") == pytest.approx(2 + 64_000 / 2048)
    assert balancer.pick("m", 100).name == "b1"
    balancer.on_finish("b1", 200)
    # Prefill done (first tokens out): 2 decoding requests -> 100 / 1.2 = 83.3 > 80.
    balancer.on_first_token("b0", 0.4, prompt_tokens=32_000)
    balancer.on_first_token("b0", 0.4)
    assert balancer.load("b0") == pytest.approx(2.0)
    assert balancer.pick("m", 100).name == "b0"
    balancer.on_finish("b0", 200, first_token_seen=False)  # that one never started
    balancer.on_finish("b0", 200)
    balancer.on_finish("b0", 200)
    assert balancer.load("b0") == 0


def test_failure_before_first_token_leaves_prefill() -> None:
    balancer, clock = make(1)
    balancer.pick("m", 4096)
    balancer.pick("m", 1000)
    balancer.on_first_token("b0", 0.2, prompt_tokens=1000)
    balancer.on_finish("b0", 503, b"engine saturated")  # failure: the one still in prefill
    assert balancer.load("b0") == pytest.approx(1.0)
    balancer.on_finish("b0", 200)
    assert balancer.load("b0") == 0
    balancer.on_finish("b0", 200)  # one finish too many: clamped, never negative
    assert balancer.load("b0") == 0


# ---------------------------------------------------------------- pools etc.


def test_model_pools() -> None:
    backends = [
        Backend("llama-a", "http://10.0.0.1:8000", models=("llama",)),
        Backend("qwen-a", "http://10.0.0.2:8000", models=("qwen",)),
        Backend("both", "http://10.0.0.3:8000", models=("llama", "qwen")),
        Backend("any", "http://10.0.0.4:8000"),  # declares no models: serves whatever it is asked
    ]
    clock = VirtualClock()
    balancer = warmed(Balancer(backends, clock=clock, rng=random.Random(21)), clock)

    def names(model: str | None) -> set[str]:
        out = set()
        for _ in range(300):
            b = balancer.pick(model, 10)
            out.add(b.name)
            balancer.on_finish(b, 200)
        return out

    assert names("llama") == {"llama-a", "both", "any"}
    assert names("qwen") == {"qwen-a", "both", "any"}
    assert names("mistral") == {"any"}
    assert names(None) == {"llama-a", "qwen-a", "both", "any"}


def test_no_backend_for_a_model_is_a_clear_error() -> None:
    balancer, clock = make(2, models=("llama",))
    with pytest.raises(NoBackendAvailable, match="'qwen'"):
        balancer.pick("qwen", 10)
    empty = Balancer([], clock=clock)
    with pytest.raises(NoBackendAvailable):
        empty.pick("llama", 10)


def test_exclude_never_returns_a_tried_backend() -> None:
    balancer, clock = make(3, rng=random.Random(22))
    for _ in range(200):
        b = balancer.pick("m", 10, exclude=[Backend("b0", "http://10.0.0.1:8000"), "b2"])
        assert b.name == "b1"
        balancer.on_finish(b, 200)
    with pytest.raises(NoBackendAvailable):
        balancer.pick("m", 10, exclude=["b0", "b1", "b2"])


def test_backends_can_be_added_and_removed() -> None:
    balancer, clock = make(2)
    balancer.set_penalty("b0", 0.5)
    balancer.add_backend(Backend("b9", "http://10.0.0.9:8000", models=("m",)))
    assert balancer.score("b0") == pytest.approx(50.0)  # kept its state
    assert balancer.score("b9") == pytest.approx(10.0)  # warming
    balancer.remove_backend("b1")
    assert {b.name for b in balancer.backends} == {"b0", "b9"}
    with pytest.raises(ValueError, match="duplicate"):
        balancer.set_backends([Backend("x", "http://a:1"), Backend("x", "http://b:1")])


def test_pick_takes_no_lock() -> None:
    balancer, clock = make(3)
    picked: list[str] = []
    with balancer._lock:  # noqa: SLF001 - a feedback call in progress holds the writer lock
        worker = threading.Thread(target=lambda: picked.extend(balancer.pick("m", 10).name for _ in range(100)))
        worker.start()
        worker.join(timeout=5)
        assert not worker.is_alive()
    assert len(picked) == 100


def test_config_choices_validated() -> None:
    with pytest.raises(ValueError, match="choices"):
        BalancerConfig(choices=-1)
    with pytest.raises(ValueError, match="tokens_per_slot"):
        BalancerConfig(tokens_per_slot=0)


def test_small_pools_are_scanned_in_full_when_configured() -> None:
    # full_scan_up_to = 8: a pool of 5 is scanned (no draw without a tie, the best always wins); a pool of
    # 20 is sampled (d = 4 distinct: four draws).
    cfg = BalancerConfig(full_scan_up_to=8, in_flight_penalty=0.0)
    rng = ScriptedRandom([])  # any draw would fail
    balancer, clock = make(5, config=cfg, rng=rng)
    set_score(balancer, "b3", 0.0)
    for name, waiting in (("b0", 6.0), ("b1", 12.0), ("b2", 15.0), ("b4", 30.0)):
        set_score(balancer, name, waiting)  # 95, 90, 87.5, 75 points: b3 (100) is the best, no ties
    assert balancer.pick("m", 0).name == "b3"
    rng = ScriptedRandom()
    balancer, clock = make(20, config=cfg, rng=rng)
    set_score(balancer, "b0", 6.0)  # indices 0, 2, 4, 6 are drawn; b0 (95) is the one below 100
    set_score(balancer, "b2", 30.0)
    set_score(balancer, "b4", 15.0)
    set_score(balancer, "b6", 12.0)
    rng.script([0.0, 0.1, 0.2, 0.3])
    assert balancer.pick("m", 0).name == "b0"
    assert rng.calls == 4
    with pytest.raises(ValueError, match="full_scan_up_to"):
        BalancerConfig(full_scan_up_to=-1)
