"""A vLLM-like engine model (SPEC section 8), clock-agnostic.

The model never sleeps and never reads a clock: the driver (the cluster
simulator's virtual clock, or the fake engine's wall clock) calls
:meth:`EngineModel.plan_step` at the time a step starts, which schedules the
batch and returns how long the step takes, then :meth:`EngineModel.commit_step`
at the time it ends, which applies the progress and returns the requests that
got their first token or finished in that step.

What it models, after vLLM V1's scheduler:

- continuous batching: running requests are scheduled first (decodes take one
  token of the budget each, prefills in progress take a chunk), then waiting
  requests are admitted in FIFO order while the token budget
  (``max_num_batched_tokens``), ``max_num_seqs`` and the KV cache allow;
- chunked prefill: a prompt longer than the remaining budget is prefilled over
  several steps;
- a paged KV cache counted in tokens (block rounding, at most 15 tokens a
  sequence, is ignored);
- recompute preemption: when the step's KV demand does not fit, the most
  recently admitted running request loses its KV and goes back to the front of
  the waiting queue; later it prefills prompt + tokens already generated again;
  no new request is admitted in a step that preempted (as vLLM V1);
- step time ``t0 + a*P + b*D + c*sum_ctx`` (P prefill tokens in the step, D
  decode sequences, sum_ctx their context tokens), times a fault slowdown;
- an optional waiting-queue limit answering 429 with a saturation body;
- faults through :class:`~llmdiag.sim.faults.FaultState`: slowdown, stall,
  crash and restart with a cold warm-up, 5xx ratio, KV shrink.

Everything a step touches is O(1) per step plus O(requests that change state):
decode progress is one shared counter, finishing is a heap keyed by the decode
step at which each request ends. That is what lets the simulator run tens of
thousands of steps a second in CPython.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

__all__ = [
    "CRASH_BODY",
    "DECODE",
    "DONE",
    "ERROR_BODY",
    "PREFILL",
    "PRESETS",
    "TOO_LONG_BODY",
    "WAITING",
    "EngineModel",
    "EnginePreset",
    "SATURATION_BODY",
    "SimRequest",
    "StepTimeModel",
    "Submit",
]

#: Body of the 429 the queue limit answers (matches the saturation patterns of
#: llmdiag's error classifier: "queue full", "engine saturated").
SATURATION_BODY = (
    '{"object":"error","type":"server_overloaded","code":429,'
    '"message":"queue full: too many requests in queue, engine saturated"}'
)
CRASH_BODY = '{"object":"error","type":"internal_error","code":500,"message":"engine core died"}'
ERROR_BODY = '{"object":"error","type":"internal_error","code":500,"message":"internal server error"}'
TOO_LONG_BODY = '{"object":"error","type":"BadRequestError","code":400,"message":"prompt longer than the KV cache"}'


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """``t_step = t0 + a*P + b*D + c*sum_ctx`` in seconds."""

    t0: float
    a: float  # per prefill token
    b: float  # per decode sequence
    c: float  # per context token of the decode sequences

    def __post_init__(self) -> None:
        for name in ("t0", "a", "b", "c"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"step model {name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class EnginePreset:
    """A GPU + model combination: its step model and its scheduler limits."""

    name: str
    step: StepTimeModel
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"preset {self.name!r}: capacities must be >= 1")


#: Fitted presets from ../shared/data/README.md (bench/fit_step_model.py refits
#: them from the calibration data; docs/simulator.md has the residuals).
PRESETS: dict[str, EnginePreset] = {
    "llama3-8b-h100": EnginePreset("llama3-8b-h100", StepTimeModel(0.006, 19e-6, 6e-6, 0.04e-6), 450_000, 1024, 8192),
    "llama3-8b-a100": EnginePreset("llama3-8b-a100", StepTimeModel(0.012, 55e-6, 17e-6, 0.065e-6), 440_000, 256, 2048),
    "llama-70b-h100-tp4": EnginePreset(
        "llama-70b-h100-tp4", StepTimeModel(0.028, 115e-6, 350e-6, 0.03e-6), 460_000, 1024, 8192
    ),
    "llama-70b-a100-tp8": EnginePreset(
        "llama-70b-a100-tp8", StepTimeModel(0.043, 185e-6, 410e-6, 0.02e-6), 1_300_000, 256, 2048
    ),
}

# Request states.
WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3


class SimRequest:
    """One request as the engine sees it. The driver may hang its own fields
    (``arrival``, ``dispatched_at``...) on the same object."""

    __slots__ = (
        "rid", "prompt", "output", "arrival", "dispatched_at", "engine", "attempts", "tenant",
        "state", "target", "computed", "gen", "doff", "epoch", "first_token_at", "finished_at",
        "status", "admit_seq", "aborted", "ttft",
    )

    def __init__(self, rid: int, prompt: int, output: int, arrival: float = 0.0, tenant: str = "") -> None:
        self.rid = rid
        self.prompt = max(1, int(prompt))
        self.output = max(1, int(output))
        self.arrival = arrival
        self.dispatched_at = arrival
        self.engine = -1
        self.attempts = 0
        self.tenant = tenant
        self.state = WAITING
        self.target = self.prompt  # tokens to prefill: prompt (+ output so far after a preemption)
        self.computed = 0  # prefill tokens in the KV cache
        self.gen = 0  # tokens generated when the request last entered decode
        self.doff = 0  # the engine's decode-step counter at that moment
        self.epoch = 0  # bumped on preemption: invalidates the finish-heap entry
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.status = ""  # the gateway's final verdict (the engine never sets it)
        self.admit_seq = 0
        self.aborted = False
        self.ttft: float | None = None


@dataclass(frozen=True, slots=True)
class Submit:
    """Answer to a submission: ``accepted`` or an HTTP-like failure before the first byte."""

    accepted: bool
    status: int = 200  # 429, 500, 400, or 0 for a refused connection
    body: str = ""


ACCEPTED = Submit(True)


class EngineModel:
    """One engine: waiting queue, running batch, KV cache, step-time model and fault state."""

    def __init__(
        self,
        preset: EnginePreset,
        *,
        kv_capacity_tokens: int | None = None,
        queue_limit: int | None = None,
        seed: int = 0,
        name: str = "engine",
    ) -> None:
        if queue_limit is not None and queue_limit < 0:
            raise ValueError("queue_limit must be >= 0")
        self.name = name
        self.preset = preset
        st = preset.step
        self._t0, self._a, self._b, self._c = st.t0, st.a, st.b, st.c
        self.kv_capacity_nominal = int(kv_capacity_tokens or preset.kv_capacity_tokens)
        if self.kv_capacity_nominal < 1:
            raise ValueError("kv_capacity_tokens must be >= 1")
        self.kv_capacity = self.kv_capacity_nominal
        self.max_num_seqs = preset.max_num_seqs
        self.max_num_batched_tokens = preset.max_num_batched_tokens
        self.queue_limit = queue_limit
        self._rng = random.Random(seed)
        # Fault state (set by the driver from the fault schedule).
        self.slowdown = 1.0  # multiplies step time (a throttled GPU has slowdown > 1)
        self.stall_until = 0.0
        self.error_ratio = 0.0
        self.down = False
        self.warmup_until = 0.0
        self.warmup_s = 0.0
        self.warmup_factor = 1.0
        self._reset_state()
        # Counters, as vLLM exposes them. They survive crash() so a run's totals
        # stay whole; a driver serving /metrics from a restarted process (the
        # fake engine) zeroes them itself, as a new process would.
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished_total = 0
        self.requests_rejected_total = 0
        self.steps_total = 0
        self.busy_seconds_total = 0.0

    def _reset_state(self) -> None:
        self.waiting: deque[SimRequest] = deque()
        self.running: dict[int, SimRequest] = {}  # insertion order = admission order
        self.prefilling: list[SimRequest] = []
        self.n_decoding = 0
        self.decode_end_sum = 0  # sum over decoders of the decode step at which each ends
        self.decode_steps = 0
        self.decode_ctx_sum = 0
        self.kv_used = 0
        self.pending_prefill_tokens = 0  # prefill tokens still to compute (waiting + prefilling)
        self._finish_heap: list[tuple[int, int, int, SimRequest]] = []
        self._admit_seq = 0
        self._planned_chunks: list[tuple[SimRequest, int]] = []
        self._planned_decode = False
        self._planned_prefill = 0
        self.in_step = False
        self._pending_aborts: list[SimRequest] = []
        self._pending_failed: list[SimRequest] = []

    # ------------------------------------------------------------------ views
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_usage(self) -> float:
        """KV cache usage 0..1 of the current (possibly shrunk) capacity."""
        return min(1.0, self.kv_used / self.kv_capacity) if self.kv_capacity else 1.0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def current_slowdown(self, now: float) -> float:
        """Step-time multiplier at ``now``: the fault slowdown times the cold warm-up ramp."""
        s = self.slowdown
        if now < self.warmup_until and self.warmup_s > 0:
            left = (self.warmup_until - now) / self.warmup_s
            s *= 1.0 + (self.warmup_factor - 1.0) * left
        return s

    # ------------------------------------------------------------- submission
    def submit(self, req: SimRequest, now: float) -> Submit:
        """Offer a request. Refusals happen before the first byte (retryable
        for connect errors and 429s)."""
        if self.down:
            return Submit(False, 0, "connection refused")
        if self.error_ratio > 0.0 and self._rng.random() < self.error_ratio:
            self.requests_rejected_total += 1
            return Submit(False, 500, ERROR_BODY)
        if req.prompt + 1 > self.kv_capacity_nominal:
            return Submit(False, 400, TOO_LONG_BODY)
        if self.queue_limit is not None and len(self.waiting) >= self.queue_limit:
            self.requests_rejected_total += 1
            return Submit(False, 429, SATURATION_BODY)
        req.state = WAITING
        req.target = req.prompt
        req.computed = 0
        req.gen = 0
        self.waiting.append(req)
        self.pending_prefill_tokens += req.prompt
        self.prompt_tokens_total += req.prompt
        return ACCEPTED

    def abort(self, req: SimRequest) -> None:
        """The client went away: free the request (at the end of the step in flight, if any)."""
        if req.state == DONE or req.aborted:
            return
        req.aborted = True
        if req.state == WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                return
            self.pending_prefill_tokens -= req.target - req.computed
            req.state = DONE
        elif self.in_step:
            self._pending_aborts.append(req)
        else:
            self._remove_running(req)
            req.state = DONE

    def _remove_running(self, req: SimRequest) -> None:
        """Drop a running request and its KV (finish, abort or crash)."""
        self.running.pop(req.rid, None)
        if req.state == PREFILL:
            self.kv_used -= req.computed
            self.pending_prefill_tokens -= req.target - req.computed
            self.prefilling.remove(req)
        elif req.state == DECODE:
            ctx = req.target + self.decode_steps - req.doff
            self.kv_used -= ctx
            self.decode_ctx_sum -= ctx
            self.n_decoding -= 1
            self.decode_end_sum -= req.doff + req.output - req.gen
            req.epoch += 1

    def _preempt_last(self) -> SimRequest:
        """Recompute preemption of the most recently admitted running request."""
        _, victim = self.running.popitem()
        if victim.state == PREFILL:
            self.kv_used -= victim.computed
            self.pending_prefill_tokens += victim.computed  # its done work must be redone
            self.prefilling.remove(victim)
        else:
            steps = self.decode_steps - victim.doff
            ctx = victim.target + steps
            self.kv_used -= ctx
            self.decode_ctx_sum -= ctx
            self.n_decoding -= 1
            self.decode_end_sum -= victim.doff + victim.output - victim.gen
            victim.epoch += 1
            victim.gen += steps
            victim.target = victim.prompt + victim.gen
            self.pending_prefill_tokens += victim.target
        victim.computed = 0
        victim.state = WAITING
        self.waiting.appendleft(victim)
        self.preemptions_total += 1
        return victim

    # ------------------------------------------------------------------ steps
    def plan_step(self, now: float) -> float | None:
        """Schedule the next batch at ``now``; return its duration in seconds,
        or ``None`` when there is nothing to run (or the engine is down)."""
        if self.down or self.in_step:
            return None
        if self._pending_aborts:
            self._apply_aborts()
        if not self.running and not self.waiting:
            return None
        n_dec = self.n_decoding
        budget = self.max_num_batched_tokens - n_dec
        need = n_dec
        chunks: list[tuple[SimRequest, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            ch = req.target - req.computed
            if ch > budget:
                ch = budget
            chunks.append((req, ch))
            budget -= ch
            need += ch
        cap = self.kv_capacity
        preempted = False
        while self.kv_used + need > cap and self.running:
            decoding_before = self.n_decoding
            victim = self._preempt_last()
            preempted = True
            if self.n_decoding < decoding_before:
                n_dec -= 1
                need -= 1
                budget += 1
            else:
                for k, (r, ch) in enumerate(chunks):
                    if r is victim:
                        need -= ch
                        budget += ch
                        del chunks[k]
                        break
        if not preempted:
            max_seqs = self.max_num_seqs
            waiting = self.waiting
            while waiting and budget > 0 and len(self.running) < max_seqs:
                req = waiting[0]
                if req.target + 1 > cap:
                    # Can never fit (the KV cache shrank under it): fail it.
                    waiting.popleft()
                    self.pending_prefill_tokens -= req.target
                    req.state = DONE
                    self._pending_failed.append(req)
                    continue
                ch = req.target if req.target < budget else budget
                if self.kv_used + need + ch > cap:
                    break
                waiting.popleft()
                req.state = PREFILL
                self._admit_seq += 1
                req.admit_seq = self._admit_seq
                self.running[req.rid] = req
                self.prefilling.append(req)
                chunks.append((req, ch))
                budget -= ch
                need += ch
        prefill_tokens = need - n_dec
        if not chunks and n_dec == 0:
            return None
        self._planned_chunks = chunks
        self._planned_decode = n_dec > 0
        self._planned_prefill = prefill_tokens
        self.in_step = True
        dur = self._t0 + self._a * prefill_tokens + self._b * n_dec + self._c * self.decode_ctx_sum
        slow = self.slowdown
        if now < self.warmup_until:
            slow = self.current_slowdown(now)
        dur *= slow
        if now < self.stall_until:
            dur += self.stall_until - now
        self.steps_total += 1
        self.busy_seconds_total += dur
        return dur

    def take_failed(self) -> list[SimRequest]:
        """Requests the scheduler gave up on (KV cache shrank below their size)."""
        failed = self._pending_failed
        self._pending_failed = []
        return failed

    def _apply_aborts(self) -> None:
        for req in self._pending_aborts:
            if req.state in (PREFILL, DECODE):
                self._remove_running(req)
            elif req.state == WAITING:  # preempted back to waiting meanwhile
                try:
                    self.waiting.remove(req)
                    self.pending_prefill_tokens -= req.target
                except ValueError:
                    pass
            req.state = DONE
        self._pending_aborts = []

    def commit_step(self, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """Apply the planned step at its end time ``now``.

        Returns ``(first_token, finished)``: requests whose first token came out
        in this step, and requests that completed (a one-token request is in both).
        """
        if not self.in_step:
            return [], []
        self.in_step = False
        if self._pending_aborts:
            self._apply_aborts()
        first: list[SimRequest] = []
        finished: list[SimRequest] = []
        if self._planned_decode and self.n_decoding:
            self.decode_steps += 1
            d = self.n_decoding
            self.decode_ctx_sum += d
            self.kv_used += d
            steps = self.decode_steps
            heap = self._finish_heap
            while heap and heap[0][0] <= steps:
                _, _, epoch, req = heapq.heappop(heap)
                if req.epoch != epoch or req.state != DECODE:
                    continue
                self._finish(req, now)
                finished.append(req)
        for req, ch in self._planned_chunks:
            if req.state != PREFILL:
                continue  # aborted or preempted meanwhile
            req.computed += ch
            self.kv_used += ch
            self.pending_prefill_tokens -= ch
            if req.computed >= req.target:
                self.prefilling.remove(req)
                req.state = DECODE
                req.gen += 1
                req.doff = self.decode_steps
                self.decode_ctx_sum += req.target
                self.n_decoding += 1
                self.decode_end_sum += req.doff + req.output - req.gen
                if req.first_token_at is None:
                    req.first_token_at = now
                    first.append(req)
                if req.gen >= req.output:
                    self._finish(req, now)
                    finished.append(req)
                else:
                    heapq.heappush(
                        self._finish_heap, (req.doff + req.output - req.gen, req.admit_seq, req.epoch, req)
                    )
        self._planned_chunks = []
        return first, finished

    def _finish(self, req: SimRequest, now: float) -> None:
        self.running.pop(req.rid, None)
        ctx = req.target + self.decode_steps - req.doff
        self.kv_used -= ctx
        self.decode_ctx_sum -= ctx
        self.n_decoding -= 1
        self.decode_end_sum -= req.doff + req.output - req.gen
        req.state = DONE
        req.finished_at = now
        self.generation_tokens_total += req.output
        self.requests_finished_total += 1

    # ----------------------------------------------------------------- faults
    def crash(self, now: float) -> list[SimRequest]:
        """The engine process dies: every request in it is lost. Returns them."""
        lost = list(self.waiting) + list(self.running.values()) + [r for r in self._pending_aborts]
        for req in lost:
            req.state = DONE
        self._reset_state()
        self.down = True
        return [r for r in lost if not r.aborted]

    def restart(self, now: float, warmup_s: float = 30.0, warmup_factor: float = 3.0) -> None:
        """Back up with an empty cache; steps run ``warmup_factor`` times slower at
        first (cold CUDA graphs, allocator, page cache), easing to 1x over ``warmup_s``."""
        self.down = False
        self.warmup_s = warmup_s
        self.warmup_factor = warmup_factor
        self.warmup_until = now + warmup_s

    def set_kv_capacity_factor(self, factor: float) -> None:
        """Shrink (or restore) the usable KV cache to ``factor`` of nominal; the
        next step preempts what no longer fits."""
        self.kv_capacity = max(1, int(self.kv_capacity_nominal * factor))

    def estimate_ttft(self, prompt_tokens: int, now: float) -> float:
        """True-state estimate of the time to first token for a new request of
        ``prompt_tokens`` (used by the ``oracle`` reference policy and the
        simulated probes).

        The prefill backlog B (pending prefill tokens + this prompt) is processed
        in chunks of ``max_num_batched_tokens - D`` next to the D decodes; each
        step costs ``t0 + b*D + c*sum_ctx`` plus ``a`` per prefill token. When B
        does not fit in the free KV cache, the overflow waits for decodes to
        finish: the running decodes end, on average, in R steps (their mean
        remaining output) and free their ``sum_ctx`` tokens over that time, so
        freeing the overflow takes about ``R * overflow / sum_ctx`` steps.
        """
        if self.down:
            return math.inf
        d = self.n_decoding
        backlog = self.pending_prefill_tokens + prompt_tokens
        per_step = max(1, self.max_num_batched_tokens - d)
        steps = -(-backlog // per_step)
        base = self._t0 + self._b * d + self._c * self.decode_ctx_sum
        est = steps * base + self._a * backlog
        over = self.kv_used + backlog - self.kv_capacity
        if over > 0:
            if d > 0 and self.decode_ctx_sum > 0:
                remaining_steps = max(1.0, (self.decode_end_sum - d * self.decode_steps) / d)
                est += base * remaining_steps * min(1.0, over / self.decode_ctx_sum)
            else:
                est += base * over / per_step  # only prefills hold the cache: they turn into decodes first
        if self.queue_limit is not None and len(self.waiting) >= self.queue_limit:
            est += 1e3  # it would be answered 429
        est *= self.current_slowdown(now)
        if now < self.stall_until:
            est += self.stall_until - now
        return est
