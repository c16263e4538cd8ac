"""The engine model: step times by hand, chunked prefill, preemption, faults."""

from __future__ import annotations

import math

import pytest

from llmdiag.sim.engine_model import (
    PRESETS,
    SATURATION_BODY,
    EngineModel,
    EnginePreset,
    SimRequest,
    StepTimeModel,
)
from llmdiag.sim.faults import Fault, FaultSchedule, parse_faults

# Round numbers so every step time below is computed by hand.
STEP = StepTimeModel(t0=0.010, a=0.001, b=0.002, c=0.0001)


def preset(kv: int = 10_000, seqs: int = 8, batched: int = 100) -> EnginePreset:
    return EnginePreset("test", STEP, kv, seqs, batched)


def run_step(eng: EngineModel, now: float) -> tuple[float, list[SimRequest], list[SimRequest]]:
    dur = eng.plan_step(now)
    assert dur is not None
    first, finished = eng.commit_step(now + dur)
    return dur, first, finished


def test_single_request_step_times_by_hand() -> None:
    eng = EngineModel(preset())
    req = SimRequest(1, prompt=50, output=3)
    assert eng.submit(req, 0.0).accepted
    # step 1: prefill 50 tokens, no decodes: 0.010 + 0.001*50 = 0.060
    dur, first, finished = run_step(eng, 0.0)
    assert dur == pytest.approx(0.060)
    assert first == [req] and finished == []
    assert req.first_token_at == pytest.approx(0.060)
    assert eng.kv_used == 50
    # step 2: one decode of context 50: 0.010 + 0.002 + 0.0001*50 = 0.017
    dur, first, finished = run_step(eng, 0.060)
    assert dur == pytest.approx(0.017)
    assert eng.kv_used == 51
    # step 3: context 51: 0.010 + 0.002 + 0.0051 = 0.0171; third token -> finished
    dur, first, finished = run_step(eng, 0.077)
    assert dur == pytest.approx(0.0171)
    assert finished == [req]
    assert eng.kv_used == 0 and eng.idle
    assert eng.plan_step(1.0) is None
    assert eng.generation_tokens_total == 3


def test_chunked_prefill_splits_long_prompt_and_mixes_with_decode() -> None:
    eng = EngineModel(preset(batched=100))
    short = SimRequest(1, prompt=20, output=10)
    eng.submit(short, 0.0)
    run_step(eng, 0.0)  # short prefilled: 0.010 + 0.020
    long = SimRequest(2, prompt=250, output=2)
    eng.submit(long, 1.0)
    # budget 100 - 1 decode = 99 prefill tokens: 0.010 + 0.099 + 0.002 + 0.0001*20
    dur, first, _ = run_step(eng, 1.0)
    assert dur == pytest.approx(0.010 + 0.099 + 0.002 + 0.0020)
    assert first == [] and long.computed == 99
    dur, first, _ = run_step(eng, 2.0)
    assert long.computed == 198 and first == []
    dur, first, _ = run_step(eng, 3.0)  # the last 52 tokens
    assert dur == pytest.approx(0.010 + 0.052 + 0.002 + 0.0001 * 22)  # context 20 + 2 decoded
    assert first == [long]
    assert eng.pending_prefill_tokens == 0


def test_max_num_seqs_bounds_the_batch() -> None:
    eng = EngineModel(preset(seqs=2))
    reqs = [SimRequest(i, prompt=10, output=50) for i in range(4)]
    for r in reqs:
        eng.submit(r, 0.0)
    run_step(eng, 0.0)
    assert eng.num_running == 2 and eng.num_waiting == 2


def test_recompute_preemption_of_most_recently_admitted() -> None:
    # KV 100 tokens: two requests of 45 prompt fit (90), their decodes then grow past 100.
    eng = EngineModel(preset(kv=100, batched=200))
    a = SimRequest(1, prompt=45, output=20)
    b = SimRequest(2, prompt=45, output=20)
    eng.submit(a, 0.0)
    eng.submit(b, 0.0)
    now = 0.0
    dur, first, _ = run_step(eng, now)
    assert first == [a, b] and eng.kv_used == 90
    preempted_at = None
    for _ in range(10):
        now += 1.0
        run_step(eng, now)
        if eng.preemptions_total and preempted_at is None:
            preempted_at = now
    assert eng.preemptions_total >= 1
    # b was admitted last: it is the victim, back at the front of the waiting queue,
    # and will re-prefill prompt + tokens already generated.
    assert b.state in (0, 1)  # WAITING or re-admitted PREFILL
    assert a.state == 2  # a kept decoding
    assert b.target > b.prompt
    assert eng.kv_used <= eng.kv_capacity


def test_preempted_request_still_finishes_with_all_tokens() -> None:
    eng = EngineModel(preset(kv=120, batched=200))
    reqs = [SimRequest(i, prompt=40, output=30) for i in range(3)]
    for r in reqs:
        eng.submit(r, 0.0)
    now = 0.0
    done: list[SimRequest] = []
    for _ in range(500):
        dur = eng.plan_step(now)
        if dur is None:
            break
        now += dur
        _, fin = eng.commit_step(now)
        done += fin
    assert sorted(r.rid for r in done) == [0, 1, 2]
    assert eng.preemptions_total > 0
    assert eng.kv_used == 0 and eng.decode_ctx_sum == 0 and eng.n_decoding == 0
    assert eng.generation_tokens_total == 90


def test_queue_limit_answers_429_with_saturation_body() -> None:
    eng = EngineModel(preset(), queue_limit=2)
    assert eng.submit(SimRequest(1, 10, 1), 0.0).accepted
    assert eng.submit(SimRequest(2, 10, 1), 0.0).accepted
    ans = eng.submit(SimRequest(3, 10, 1), 0.0)
    assert not ans.accepted and ans.status == 429 and ans.body == SATURATION_BODY
    assert "queue full" in ans.body


def test_prompt_larger_than_kv_is_refused() -> None:
    eng = EngineModel(preset(kv=100))
    ans = eng.submit(SimRequest(1, 500, 1), 0.0)
    assert not ans.accepted and ans.status == 400


def test_abort_frees_kv_mid_step() -> None:
    eng = EngineModel(preset())
    r = SimRequest(1, prompt=30, output=100)
    eng.submit(r, 0.0)
    run_step(eng, 0.0)
    eng.plan_step(1.0)
    eng.abort(r)  # during the step: applied at its end
    eng.commit_step(1.1)
    assert eng.kv_used == 0 and eng.idle and eng.n_decoding == 0


def test_slowdown_fault_scales_step_time() -> None:
    eng = EngineModel(preset())
    sched = FaultSchedule((Fault("slowdown", start=5.0, speed=0.4),))
    eng.submit(SimRequest(1, 50, 5), 0.0)
    assert eng.plan_step(0.0) == pytest.approx(0.060)
    eng.commit_step(0.06)
    sched.apply(eng, 5.0)
    assert eng.plan_step(5.0) == pytest.approx((0.010 + 0.002 + 0.005) / 0.4)


def test_stall_delays_the_step_until_it_ends() -> None:
    eng = EngineModel(preset())
    sched = FaultSchedule((Fault("stall", start=1.0, duration=2.0),))
    sched.apply(eng, 1.0)
    eng.submit(SimRequest(1, 50, 5), 1.5)
    assert eng.plan_step(1.5) == pytest.approx(1.5 + 0.060)


def test_crash_loses_requests_refuses_then_restarts_cold() -> None:
    eng = EngineModel(preset())
    sched = FaultSchedule((Fault("crash", start=1.0, duration=10.0, warmup_s=20.0, warmup_factor=3.0),))
    r = SimRequest(1, 50, 5)
    eng.submit(r, 0.0)
    run_step(eng, 0.0)
    lost = sched.apply(eng, 1.0)
    assert lost == [r] and eng.down and eng.idle
    assert eng.submit(SimRequest(2, 50, 5), 2.0).status == 0  # connection refused
    assert sched.apply(eng, 11.0) == [] and not eng.down
    eng.submit(SimRequest(3, 50, 5), 11.0)
    # right after the restart: 3x slower; half way through the warm-up: 2x
    assert eng.plan_step(11.0) == pytest.approx(0.060 * 3.0)
    assert eng.current_slowdown(21.0) == pytest.approx(2.0)
    assert eng.current_slowdown(40.0) == pytest.approx(1.0)


def test_error_ratio_answers_500() -> None:
    eng = EngineModel(preset(), seed=3)
    FaultSchedule((Fault("error_5xx", start=0.0, ratio=0.5),)).apply(eng, 0.0)
    answers = [eng.submit(SimRequest(i, 10, 1), 0.0) for i in range(400)]
    errors = sum(1 for a in answers if a.status == 500)
    # Binomial(400, 0.5): mean 200, sd 10; 5 sd either side.
    assert 150 < errors < 250


def test_kv_shrink_preempts_what_no_longer_fits() -> None:
    eng = EngineModel(preset(kv=1000, batched=1000))
    for i in range(4):
        eng.submit(SimRequest(i, 200, 500), 0.0)
    run_step(eng, 0.0)
    assert eng.kv_used == 800
    FaultSchedule((Fault("kv_shrink", start=1.0, factor=0.5),)).apply(eng, 1.0)
    assert eng.kv_capacity == 500
    run_step(eng, 1.0)
    assert eng.kv_used <= 500 and eng.preemptions_total >= 2


def test_parse_faults_text_form_and_errors() -> None:
    sched = parse_faults("slowdown:start=120,speed=0.4; crash:start=300,down=20")
    assert [f.kind for f in sched.faults] == ["slowdown", "crash"]
    assert sched.faults[1].duration == 20
    assert math.isinf(sched.faults[0].duration)
    assert sched.transitions() == [120.0, 300.0, 320.0]
    for bad in ("melt:start=1", "slowdown:speed=2", "crash:start=1", "slowdown:start", "stall:start=x"):
        with pytest.raises(ValueError):
            parse_faults(bad)


def test_presets_match_the_shared_table() -> None:
    h100 = PRESETS["llama-70b-h100-tp4"]
    assert h100.step.t0 == pytest.approx(0.028) and h100.step.b == pytest.approx(350e-6)
    assert h100.kv_capacity_tokens == 460_000 and h100.max_num_batched_tokens == 8192
    with pytest.raises(ValueError):
        StepTimeModel(-1, 0, 0, 0)


def test_estimate_ttft_by_hand_and_kv_wait() -> None:
    eng = EngineModel(preset(kv=1000, batched=100))
    # idle: one step of t0 + a*P
    assert eng.estimate_ttft(50, 0.0) == pytest.approx(0.010 + 0.050)
    a = SimRequest(1, prompt=100, output=11)
    eng.submit(a, 0.0)
    run_step(eng, 0.0)  # 100 prompt tokens prefilled -> decoding, context 100, 10 tokens to go
    # backlog 150 in chunks of 99 next to 1 decode: 2 steps of (t0 + b + c*100) + a*150
    base = 0.010 + 0.002 + 0.0001 * 100
    assert eng.estimate_ttft(150, 1.0) == pytest.approx(2 * base + 0.150)
    # 950 tokens do not fit next to the 100 held: the 50-token overflow waits for
    # the decode to free its context over its remaining 10 steps: 10 * 50/100 steps
    steps = -(-950 // 99)
    assert eng.estimate_ttft(950, 1.0) == pytest.approx(steps * base + 0.950 + base * 10 * 0.5)
    eng.down = True
    assert eng.estimate_ttft(1, 1.0) == math.inf
