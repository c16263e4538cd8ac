"""Each policy's pick on scripted gateway/engine states."""

from __future__ import annotations

import random

import pytest

from llmdiag.sim.engine_model import PRESETS, EngineModel, SimRequest
from llmdiag.sim.policies import POLICIES, GatewayView, Outcome, make_policy


class ScriptedRng(random.Random):
    """``random()`` returns the scripted values in order (then repeats the last)."""

    def __init__(self, values: list[float]) -> None:
        super().__init__(0)
        self.values = list(values)

    def random(self) -> float:  # noqa: D401 - Random API
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


def view(n: int = 4) -> GatewayView:
    engines = [EngineModel(PRESETS["llama3-8b-h100"], name=f"e{i}") for i in range(n)]
    return GatewayView(engines)


def policy(name: str, gw: GatewayView, rng: random.Random | None = None, now: list[float] | None = None):
    clock = now or [0.0]
    return make_policy(name, gw, rng or random.Random(1), lambda: clock[0])


REQ = SimRequest(1, prompt=1000, output=10)
NONE: frozenset[int] = frozenset()


def test_round_robin_cycles_and_skips_tried() -> None:
    p = policy("round_robin", view(3))
    assert [p.pick(REQ, 0, NONE) for _ in range(4)] == [0, 1, 2, 0]
    assert p.pick(REQ, 0, frozenset({1})) == 2
    assert p.pick(REQ, 0, frozenset({0, 1, 2})) is None


def test_least_conn_picks_fewest_in_flight() -> None:
    gw = view(3)
    gw.in_flight[:] = [5, 2, 7]
    p = policy("least_conn", gw)
    assert p.pick(REQ, 0, NONE) == 1
    assert p.pick(REQ, 0, frozenset({1})) == 0


def test_envoy_lr_two_choices_with_replacement() -> None:
    gw = view(4)
    gw.in_flight[:] = [9, 1, 5, 0]
    # draws 0.3 -> host 1, 0.6 -> host 2: host 1 has fewer active requests
    assert policy("envoy_lr", gw, ScriptedRng([0.3, 0.6])).pick(REQ, 0, NONE) == 1
    # both draws on host 0 (with replacement): host 0 even though 3 is idle
    assert policy("envoy_lr", gw, ScriptedRng([0.1, 0.1])).pick(REQ, 0, NONE) == 0


def test_peak_ewma_cost_uses_peak_latency_and_active() -> None:
    gw = view(2)
    p = policy("peak_ewma", gw, ScriptedRng([0.1, 0.9]))
    p.on_first_token(0, REQ, 2.0, 0.0)
    p.on_first_token(1, REQ, 0.5, 0.0)
    assert p.pick(REQ, 0.0, NONE) == 1
    gw.in_flight[:] = [0, 5]  # 2.0*1 < 0.5*6
    p.rng = ScriptedRng([0.1, 0.9])
    assert p.pick(REQ, 0.0, NONE) == 0
    # a higher sample replaces the average at once (peak)
    p.on_first_token(0, REQ, 9.0, 1.0)
    assert p.rtt[0] == 9.0
    # a lower one blends with weight exp(-dt/10 s)
    p.on_first_token(0, REQ, 1.0, 11.0)
    assert 1.0 < p.rtt[0] < 9.0


def test_gie_filter_and_scores() -> None:
    gw = view(3)
    s = gw.scraped
    s[0].waiting, s[0].kv_usage = 0, 0.95  # fails the KV filter
    s[1].waiting, s[1].kv_usage = 3, 0.50
    s[2].waiting, s[2].kv_usage = 1, 0.70
    p = policy("gie", gw)
    # among 1 and 2: queue score 0 vs 1 (x2), kv score 0.5 vs 0.3 (x2) -> 1.0 vs 2.6
    assert p.pick(REQ, 0, NONE) == 2
    # nobody passes the filter: all stay, lowest queue + kv wins
    for x in s:
        x.waiting = 10
    s[0].kv_usage = 0.1
    assert p.pick(REQ, 0, NONE) == 0
    s[0].up = 0
    assert p.pick(REQ, 0, NONE) in (1, 2)


def _done(rid: int, dispatched: float, first: float, output: int) -> SimRequest:
    r = SimRequest(rid, prompt=100, output=output)
    r.dispatched_at = dispatched
    r.first_token_at = first
    return r


def test_litellm_per_token_ttft_lists_and_cooldown() -> None:
    gw = view(3)
    p = policy("litellm", gw)
    ok = Outcome(200, "", None, "ok")
    # unmeasured deployments score 0 and come first
    p.on_finish(0, _done(1, 0.0, 1.0, 10), ok, True, 5.0)  # ttft/token 0.1
    assert p.pick(REQ, 5.0, NONE) in (1, 2)
    p.on_finish(1, _done(2, 0.0, 0.5, 10), ok, True, 5.0)  # 0.05
    p.on_finish(2, _done(3, 0.0, 3.0, 10), ok, True, 5.0)  # 0.3
    assert p.pick(REQ, 5.0, NONE) == 1
    # full list: LiteLLM keeps the first 9 entries and overwrites the 10th
    for k in range(12):
        p.on_finish(1, _done(10 + k, 0.0, 0.5 + k, 10), ok, True, 6.0)
    assert len(p.ttfts[1]) == 10 and p.ttfts[1][:9] == [0.05] + [(0.5 + k) / 10 for k in range(8)]
    # a timeout logs 1000 s into the latency list only
    p.on_finish(2, REQ, Outcome("timeout", "", None, "timeout"), False, 7.0)
    assert p.latencies[2][-1] == 1000.0 and len(p.ttfts[2]) == 1
    # 429s: one failure out of one request this minute does not cool ...
    sat = Outcome(429, "queue full", None, "saturated_429")
    p.on_finish(0, REQ, sat, False, 61.0)
    assert p.cool_until[0] == 0.0
    # ... more than half failing (2 of 2) does, for 5 s
    p.on_finish(0, REQ, sat, False, 62.0)
    assert p.cool_until[0] == pytest.approx(67.0)
    assert p.pick(REQ, 63.0, frozenset({1, 2})) is None and p.all_cooling
    assert p.pick(REQ, 68.0, frozenset({1, 2})) == 0


def test_oracle_reads_true_state() -> None:
    gw = view(2)
    busy = gw.engines[0]
    for i in range(20):
        busy.submit(SimRequest(100 + i, 4000, 10), 0.0)
    p = policy("oracle", gw)
    assert p.pick(REQ, 0.0, NONE) == 1
    gw.engines[1].down = True
    assert p.pick(REQ, 0.0, NONE) == 0


def test_least_pending_prefill_then_in_flight() -> None:
    gw = view(3)
    gw.pending_prefill[:] = [5000, 100, 100]
    gw.in_flight[:] = [0, 9, 3]
    p = policy("least_pending_prefill", gw)
    assert p.pick(REQ, 0, NONE) == 2


def test_llmdiag_uses_the_real_balancer_and_its_feedback() -> None:
    from llmdiag.router_feedback.balancer import Balancer

    gw = view(2)
    clock = [0.0]
    p = policy("llmdiag", gw, random.Random(3), clock)
    assert isinstance(p.balancer, Balancer)
    clock[0] = 100.0  # past the warm-up ramp
    p.on_penalty(0, 0.9, (), 100.0)
    picks = []
    for _ in range(20):  # one request at a time: no queued work tips the balance
        picks.append(p.pick(REQ, 100.0, NONE))
        p.on_finish(picks[-1], REQ, Outcome(200, "", None, "ok"), False, 100.0)
    assert picks.count(1) == 20  # two backends: P2C compares both every time
    assert p.pick(REQ, 100.0, frozenset({1})) == 0


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("magic", view(1), random.Random(0), lambda: 0.0)
    assert set(POLICIES) >= {"round_robin", "least_conn", "envoy_lr", "peak_ewma", "gie", "litellm", "llmdiag"}
