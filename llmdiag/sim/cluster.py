"""Discrete-event cluster simulator: N engine models behind a gateway.

Virtual time only; one heap of events plus the (sorted) arrival list merged in.
Per run:

- each arrival is offered to the policy (``pick``), then submitted to the
  engine; a refusal before the first byte (connect error, 429) is retried up to
  ``max_retries`` times on another engine, for every policy alike;
- engines step on their own: a step is planned when it starts and committed
  when it ends (:mod:`llmdiag.sim.engine_model`);
- the gateway sees the first token (TTFT from dispatch) and the end of every
  attempt, and tells the policy;
- metrics are scraped every ``scrape_interval_s`` into ``GatewayView.scraped``
  (only when a policy reads them);
- the node agent (the real analyzers on simulated snapshots,
  :mod:`llmdiag.sim.node_agent`) ticks every ``agent_tick_s`` and its
  penalties reach the policy ``penalty_delay_s`` later (only for policies that
  take them: llmdiag);
- clients cancel requests that had no first token after ``client_timeout_s``;
- faults change engines at their scheduled instants.

Determinism: everything random comes from ``random.Random`` seeded from the
run seed; ties in the event heap break on a sequence number.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmdiag.sim.engine_model import EngineModel, EnginePreset, SimRequest
from llmdiag.sim.faults import FaultSchedule
from llmdiag.sim.metrics import RunMetrics, RunResult
from llmdiag.sim.node_agent import NodeAgentModel
from llmdiag.sim.policies import LLMDIAG, NO_DEPLOYMENTS_BODY, GatewayView, LiteLLMLatency, Outcome, Policy, make_policy
from llmdiag.sim.workload import Trace

__all__ = ["EngineSpec", "SimConfig", "ClusterSim", "measure_capacity", "CLIENT_QUOTA_BODY"]

CLIENT_QUOTA_BODY = '{"error":{"message":"Rate limit exceeded for api key sk-...7f3a: 60 requests per minute","type":"rate_limit_error","code":429}}'
CLIENT_QUOTA_HEADERS = {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "0"}
NO_BACKEND_BODY = '{"error":{"message":"no healthy upstream","code":503}}'

# Event kinds (ints: cheap to compare in the heap tuples).
_STEP, _SCRAPE, _TICK, _PENALTY, _TIMEOUT, _FAULT = range(6)


@dataclass(frozen=True)
class EngineSpec:
    """One engine of the cluster."""

    preset: EnginePreset
    kv_capacity_tokens: int | None = None
    queue_limit: int | None = None
    faults: FaultSchedule = field(default_factory=FaultSchedule)
    name: str = ""


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the simulated world (not of the policies)."""

    scrape_interval_s: float = 0.1
    agent_tick_s: float = 1.0
    penalty_delay_s: float = 1.0
    client_timeout_s: float | None = 60.0
    ttft_slo_s: float = 2.0
    max_retries: int = 2
    quota_share: float = 0.0  # share of requests from a tenant over its own quota
    llmdiag_signal_interval_s: float = 1.0
    drain_limit_s: float = 900.0  # after the last arrival, give up on what is left
    sample_interval_s: float = 1.0  # time series for plots and the oscillation index

    def __post_init__(self) -> None:
        for key in ("scrape_interval_s", "agent_tick_s", "ttft_slo_s", "llmdiag_signal_interval_s", "sample_interval_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0")
        if self.penalty_delay_s < 0:
            raise ValueError("penalty_delay_s must be >= 0")
        if self.client_timeout_s is not None and not self.client_timeout_s > 0:
            raise ValueError("client_timeout_s must be > 0")
        if not 0 <= self.quota_share <= 1:
            raise ValueError("quota_share must be in 0..1")
        if not 0 <= self.max_retries <= 10:
            raise ValueError("max_retries must be in 0..10")


class ClusterSim:
    """One run: one policy, one trace, one set of engines."""

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        trace: Trace,
        policy: str,
        *,
        config: SimConfig | None = None,
        seed: int = 0,
        policy_options: dict[str, Any] | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        if not specs:
            raise ValueError("a cluster needs at least one engine")
        self.config = cfg = config or SimConfig()
        self.specs = list(specs)
        self.trace = trace
        self.seed = seed
        self.now = 0.0
        self.engines = [
            EngineModel(
                s.preset,
                kv_capacity_tokens=s.kv_capacity_tokens,
                queue_limit=s.queue_limit,
                seed=seed * 1000 + i,
                name=s.name or f"engine-{i}",
            )
            for i, s in enumerate(self.specs)
        ]
        self.gw = GatewayView(self.engines)
        options = dict(policy_options or {})
        if policy in LLMDIAG:
            options.setdefault("signal_interval_s", cfg.llmdiag_signal_interval_s)
        self.policy: Policy = make_policy(policy, self.gw, random.Random(seed * 7919 + 1), self._clock, **options)
        self.agent = NodeAgentModel(self.engines, tick_s=cfg.agent_tick_s) if self.policy.needs_penalties else None
        self._quota_rng = random.Random(seed * 104729 + 3)
        self._progress = progress
        n = len(self.engines)
        self._step_token = [0] * n  # invalidates a pending step event after a crash
        self._stepping = [False] * n
        self.metrics = RunMetrics(n, cfg.ttft_slo_s, cfg.sample_interval_s)

    def _clock(self) -> float:
        return self.now

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        cfg = self.config
        heap: list[tuple[float, int, int, Any]] = []
        seq = 0
        push = heapq.heappush
        pop = heapq.heappop
        policy = self.policy
        engines = self.engines
        trace = self.trace
        arrivals, inputs, outputs = trace.arrivals, trace.inputs, trace.outputs
        n_req = len(arrivals)
        last_arrival = arrivals[-1] if n_req else 0.0
        end_limit = last_arrival + cfg.drain_limit_s
        metrics = self.metrics
        wall_start = time.perf_counter()

        def schedule(t: float, kind: int, payload: Any) -> None:
            nonlocal seq
            seq += 1
            push(heap, (t, seq, kind, payload))

        self._schedule = schedule
        if policy.needs_scrape:
            schedule(0.0, _SCRAPE, None)
        schedule(0.0, _TICK, None)
        for i, spec in enumerate(self.specs):
            for t in spec.faults.transitions():
                schedule(t, _FAULT, i)

        k = 0
        self._outstanding = 0
        timeout = cfg.client_timeout_s
        quota = cfg.quota_share
        quota_rng = self._quota_rng.random
        next_progress = 0.0
        inf = math.inf
        while True:
            t_arr = arrivals[k] if k < n_req else inf
            if heap and heap[0][0] <= t_arr:
                t, _, kind, payload = pop(heap)
                if t > end_limit:
                    break
                self.now = t
                if kind == _STEP:
                    i, token = payload
                    if token == self._step_token[i]:
                        self._on_step_end(i, t)
                elif kind == _TIMEOUT:
                    self._on_timeout(payload, t)
                elif kind == _SCRAPE:
                    if k >= n_req and self._outstanding == 0:
                        continue
                    self._scrape(t)
                    policy.on_scrape(t)
                    schedule(t + cfg.scrape_interval_s, _SCRAPE, None)
                elif kind == _TICK:
                    if k >= n_req and self._outstanding == 0:
                        continue
                    self._tick(t)
                    schedule(t + cfg.agent_tick_s, _TICK, None)
                elif kind == _PENALTY:
                    i, penalty, reasons = payload
                    policy.on_penalty(i, penalty, reasons, t)
                elif kind == _FAULT:
                    self._on_fault(payload, t)
            elif k < n_req:
                self.now = t_arr
                req = SimRequest(k, inputs[k], outputs[k], t_arr)
                if quota and quota_rng() < quota:
                    req.tenant = "over-quota"
                k += 1
                self._outstanding += 1
                metrics.arrived += 1
                self._dispatch(req, t_arr, frozenset())
                if timeout is not None and req.status == "":
                    schedule(t_arr + timeout, _TIMEOUT, req)
                if self._progress is not None and t_arr >= next_progress:
                    self._progress(t_arr)
                    next_progress = t_arr + 10.0
            else:
                break
            if k >= n_req and self._outstanding == 0:
                break
        policy.close()
        metrics.unfinished = self._outstanding
        metrics.sim_end = max(self.now, last_arrival)
        metrics.wall_seconds = time.perf_counter() - wall_start
        metrics.engine_steps = sum(e.steps_total for e in engines)
        metrics.preemptions = sum(e.preemptions_total for e in engines)
        if self._progress is not None:
            self._progress(last_arrival)
        return metrics.result(policy.name, duration=last_arrival if last_arrival > 0 else self.now)

    # --------------------------------------------------------------- gateway
    def _dispatch(self, req: SimRequest, now: float, tried: frozenset[int]) -> None:
        """Pick, submit, retry refusals before the first byte on another engine."""
        policy = self.policy
        gw = self.gw
        max_attempts = self.config.max_retries + 1
        while True:
            i = policy.pick(req, now, tried)
            if i is None:
                if isinstance(policy, LiteLLMLatency) and policy.all_cooling:
                    self._final(req, now, "rejected_429", -1)
                else:
                    self._final(req, now, "no_backend", -1)
                return
            req.attempts += 1
            req.engine = i
            req.dispatched_at = now
            policy.on_dispatch(i, req, now)
            if req.tenant:
                outcome = Outcome(429, CLIENT_QUOTA_BODY, CLIENT_QUOTA_HEADERS, "client_429")
                accepted = False
            else:
                answer = self.engines[i].submit(req, now)
                accepted = answer.accepted
                if not accepted:
                    if answer.status == 0:
                        outcome = Outcome("connect_error", answer.body, None, "connect_error")
                    elif answer.status == 429:
                        outcome = Outcome(429, answer.body, None, "saturated_429")
                    elif answer.status < 500:
                        outcome = Outcome(answer.status, answer.body, None, "client_error")
                    else:
                        outcome = Outcome(answer.status, answer.body, None, "server_5xx")
            if accepted:
                gw.in_flight[i] += 1
                gw.pending_prefill[i] += req.prompt
                self.metrics.dispatched(i, now)
                if not self._stepping[i]:
                    self._start_step(i, now)
                return
            policy.on_finish(i, req, outcome, False, now)
            retryable = outcome.kind in ("connect_error", "saturated_429", "client_429")
            if retryable and req.attempts < max_attempts:
                tried = tried | {i}
                continue
            kind = {"saturated_429": "rejected_429", "client_429": "rejected_429"}.get(outcome.kind, outcome.kind)
            self._final(req, now, kind, i)
            return

    def _final(self, req: SimRequest, now: float, kind: str, i: int) -> None:
        if req.status:
            return
        req.status = kind
        self._outstanding -= 1
        self.metrics.final(req, kind, now)

    # --------------------------------------------------------------- engines
    def _start_step(self, i: int, now: float) -> None:
        eng = self.engines[i]
        dur = eng.plan_step(now)
        failed = eng.take_failed() if eng._pending_failed else ()
        for req in failed:
            self._fail_inflight(i, req, now, Outcome(500, "KV cache too small for this request", None, "server_5xx"))
        if dur is None:
            self._stepping[i] = False
            return
        self._stepping[i] = True
        self._schedule(now + dur, _STEP, (i, self._step_token[i]))

    def _on_step_end(self, i: int, now: float) -> None:
        eng = self.engines[i]
        first, finished = eng.commit_step(now)
        if first:
            gw_pending = self.gw.pending_prefill
            on_first = self.policy.on_first_token
            mfirst = self.metrics.first_token
            agent = self.agent
            for req in first:
                if req.status:
                    continue
                gw_pending[i] -= req.prompt
                on_first(i, req, now - req.dispatched_at, now)
                if agent is not None:
                    agent.first_token(i, now - req.dispatched_at)
                mfirst(req, now)
        if finished:
            ok = _OK
            on_finish = self.policy.on_finish
            in_flight = self.gw.in_flight
            for req in finished:
                if req.status:
                    continue
                in_flight[i] -= 1
                on_finish(i, req, ok, True, now)
                self._final(req, now, "ok", i)
        self._stepping[i] = False
        self._start_step(i, now)

    def _fail_inflight(self, i: int, req: SimRequest, now: float, outcome: Outcome) -> None:
        if req.status:
            return
        seen = req.first_token_at is not None
        self.gw.in_flight[i] -= 1
        if not seen:
            self.gw.pending_prefill[i] -= req.prompt
        self.policy.on_finish(i, req, outcome, seen, now)
        self._final(req, now, outcome.kind, i)

    def _on_timeout(self, req: SimRequest, now: float) -> None:
        if req.status or req.first_token_at is not None or req.engine < 0:
            return
        i = req.engine
        self.engines[i].abort(req)
        if self.agent is not None:
            self.agent.client_cancel(i, now)
        self._fail_inflight(i, req, now, Outcome("timeout", "", None, "timeout"))
        if not self._stepping[i]:
            self._start_step(i, now)

    def _on_fault(self, i: int, now: float) -> None:
        eng = self.engines[i]
        was_down = eng.down
        lost = self.specs[i].faults.apply(eng, now)
        if lost:
            self._step_token[i] += 1
            self._stepping[i] = False
            outcome = Outcome(502, "upstream connect error or disconnect/reset before headers", None, "lost")
            for req in lost:
                self._fail_inflight(i, req, now, outcome)
        if was_down and not eng.down:
            self.metrics.note(now, f"{eng.name} restarted")
        if not eng.down and not self._stepping[i]:
            self._start_step(i, now)

    # ----------------------------------------------------------- observation
    def _scrape(self, now: float) -> None:
        for eng, s in zip(self.engines, self.gw.scraped):
            if eng.down:
                s.up = 0
            else:
                s.up = 1
                s.waiting = len(eng.waiting)
                s.running = len(eng.running)
                s.kv_usage = eng.kv_usage
                s.kv_capacity_tokens = eng.kv_capacity
                s.preemptions_total = eng.preemptions_total
            s.ts = now

    def _tick(self, now: float) -> None:
        self.metrics.sample(now, self.engines)
        if self.agent is not None:
            delay = self.config.penalty_delay_s
            for i, penalty, reasons in self.agent.tick(now):
                self._schedule(now + delay, _PENALTY, (i, penalty, reasons))
        self.policy.on_probe_tick(now)


_OK = Outcome(200, "", None, "ok")


def measure_capacity(
    preset: EnginePreset,
    trace: Trace,
    *,
    kv_capacity_tokens: int | None = None,
    seconds: float = 600.0,
    warmup: float = 120.0,
    backlog: int | None = None,
) -> float:
    """Saturated throughput of one engine on ``trace``'s request mix, in requests/s.

    Closed loop: the waiting queue is kept topped up (``backlog``, default
    ``max_num_seqs / 4`` but at least 32) with the trace's requests in trace
    order, so the engine always has work and admits as much as its token
    budget, ``max_num_seqs`` and KV cache allow; completions between
    ``warmup`` and ``seconds`` of virtual time, divided by the window, are the
    capacity. A cluster's capacity is the sum over its engines.
    """
    eng = EngineModel(preset, kv_capacity_tokens=kv_capacity_tokens)
    backlog = backlog or max(32, preset.max_num_seqs // 4)
    n = len(trace)
    k = 0
    now = 0.0
    done = 0
    rid = 0
    while now < seconds:
        while eng.num_waiting < backlog:
            idx = k % n
            rid += 1
            eng.submit(SimRequest(rid, trace.inputs[idx], trace.outputs[idx], now), now)
            k += 1
        dur = eng.plan_step(now)
        eng.take_failed()
        if dur is None:
            break
        now += dur
        _, fin = eng.commit_step(now)
        if now >= warmup:
            done += len(fin)
    window = max(1e-9, now - warmup)
    return done / window
