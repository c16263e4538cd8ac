"""The scoring balancer (SPEC 6.3): power of d choices over work-based load.

Contract
--------
``pick(model, est_prompt_tokens) -> Backend``
    Choose a backend for one request and count the dispatch (one more request
    in flight, ``est_prompt_tokens`` more pending prefill). Raises
    :class:`NoBackendAvailable` when no eligible backend serves ``model``.
``on_first_token(backend, ttft)``
    The request's first token arrived after ``ttft`` seconds: its prompt
    tokens leave pending prefill; ``ttft`` feeds the TTFT EWMA.
``on_finish(backend, status, body, headers)``
    The request ended (every picked request must end with exactly one call).
    ``status`` is the HTTP status, or ``"timeout"`` / ``"connect_error"``.
    The response is classified (SPEC 6.2) and feeds score, cooling and breaker.
``update_signals(backend, snapshot_signals)``
    One backend's signals from a snapshot (``requests_waiting``,
    ``kv_cache_usage``, ``ttft_seconds``). NA, ``None`` or a missing key is
    "unknown", never zero.
``set_penalty(backend, penalty, reasons)``
    The analyzers' combined penalty (0..1) and the reasons behind it.

``backend`` arguments take a :class:`~llmdiag.model.Backend` or its name.

Concurrency
-----------
Decisions read immutable objects swapped by reference, so ``pick`` takes no
lock: the :class:`RoutingTable` (per-model eligible tuples, precomputed so
sampling is O(d), not O(n)) is rebuilt and swapped when eligibility changes
(ejection, cooling, half-open, backends added or removed, a deadline passed),
and each backend's :class:`~llmdiag.router_feedback.score.ScoreView` is
rebuilt and swapped by every feedback call. Feedback calls serialise on one
writer lock. The per-backend load counters (in-flight requests, pending
prefill tokens) are plain integers bumped by ``pick`` and the feedback calls;
they are exact on one event loop (the gateway) and approximate under free
threading, which is fine for a load estimate.

Clock and RNG are injected: ``clock()`` returns seconds (wall or virtual);
``rng`` is ``random.Random``-like and only its ``random()`` is used.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import (
    NA,
    Backend,
    BackendPenalty,
    BackendState,
    Diagnosis,
    Distribution,
    Reason,
    Severity,
)
from llmdiag.router_feedback.breaker import Breaker, BreakerState
from llmdiag.router_feedback.errors import Classification, ErrorClassifier, ResponseClass
from llmdiag.router_feedback.score import ScoreFactors, ScoreView, scorer
from llmdiag.router_feedback.weights import AdaptiveWeights, WeightInput

__all__ = ["Balancer", "NoBackendAvailable", "RoutingTable"]

log = logging.getLogger(__name__)

_INF = math.inf


class NoBackendAvailable(LookupError):
    """No eligible backend serves the model (all ejected or cooling, or none holds it)."""


class _Slot:
    """One backend's stable routing cell: its current score view and load counters."""

    __slots__ = (
        "backend", "name", "view", "in_flight", "pending_tokens", "pending", "decoding", "token_weight",
        "busy_from", "prefill_seconds", "prefill_tokens", "seconds_per_token", "sampled_at",
    )

    def __init__(self, backend: Backend, view: ScoreView, token_weight: float) -> None:
        self.backend = backend
        self.name = backend.name
        self.view = view
        self.in_flight = 0  # picked, not finished
        self.pending_tokens = 0  # prompt tokens of requests without a first token yet
        self.pending = 0  # how many requests those are
        self.decoding = 0  # requests past their first token, not finished
        # Load units per pending prompt token: slowness / tokens_per_slot (slowness 1 until measured).
        self.token_weight = token_weight
        # Prefill speed, from our own dispatches: since when the backend has held pending prefill
        # without a first token coming back, and the decayed sums of busy seconds and drained tokens.
        self.busy_from = 0.0
        self.prefill_seconds = 0.0
        self.prefill_tokens = 0.0
        self.seconds_per_token = 0.0  # 0 = not measured yet
        self.sampled_at = 0.0

    def __repr__(self) -> str:
        return f"<slot {self.name} in_flight={self.in_flight} pending_tokens={self.pending_tokens}>"


class _Health:
    """What the writer side knows about one backend (touched only under the writer lock)."""

    __slots__ = (
        "breaker", "ttft_ewma", "ttft_ts", "engine_ttft", "engine_ttft_p99", "waiting", "kv", "up",
        "errors", "successes", "window_ts", "penalty", "reasons", "cooling_until", "cooling_why",
        "warming", "factors",
    )

    def __init__(self, cfg: BalancerConfig, now: float) -> None:
        self.breaker = Breaker(cfg, closed_since=now)
        self.ttft_ewma: float | None = None
        self.ttft_ts = -_INF
        self.engine_ttft: float | None = None
        self.engine_ttft_p99: float | None = None
        self.waiting: float | None = None
        self.kv: float | None = None
        self.up: float | None = None
        self.errors = 0.0
        self.successes = 0.0
        self.window_ts = now
        self.penalty = 0.0
        self.reasons: tuple[Reason, ...] = ()
        self.cooling_until = -_INF
        self.cooling_why = ""
        self.warming = True
        self.factors: ScoreFactors | None = None


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """Immutable eligibility: model -> tuple of slots, for ordinary and for long-context requests.

    ``None`` as a model means "any model"; a model no backend declares goes to
    the backends that declare no models (``wildcard``). ``limits`` caps the
    in-flight requests of half-open backends. After ``expires_at`` (the next
    cooling or ejection deadline) the table must be rebuilt.
    """

    pools: Mapping[str | None, tuple[_Slot, ...]]
    long_pools: Mapping[str | None, tuple[_Slot, ...]]
    wildcard: tuple[_Slot, ...]
    long_wildcard: tuple[_Slot, ...]
    limits: Mapping[_Slot, int]
    expires_at: float


_EMPTY_TABLE = RoutingTable({}, {}, (), (), {}, _INF)


class Balancer:
    """Power of d choices over ``effective = score / (1 + in_flight_penalty * load)``.

    See the module docstring for the API contract and the concurrency model.
    """

    def __init__(
        self,
        backends: Iterable[Backend] = (),
        config: BalancerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: Any = None,
    ) -> None:
        self.config = cfg = config or BalancerConfig()
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._classifier = ErrorClassifier(cfg.errors)
        self._scorer = scorer(cfg.score)
        self._weights = AdaptiveWeights(cfg.weights)
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._health: dict[str, _Health] = {}
        self._table = _EMPTY_TABLE
        # Hot-path constants.
        self._d = cfg.choices
        self._with_replacement = cfg.with_replacement
        self._in_flight_penalty = cfg.in_flight_penalty
        self._inv_tokens_per_slot = 1.0 / cfg.tokens_per_slot
        self._speed_alpha = cfg.prefill_speed_alpha
        self._speed_min_tokens = cfg.prefill_sample_min_tokens
        self._spt_sum = 0.0  # sum of the measured seconds per prefill token over the backends that have one
        self._spt_count = 0
        self._speed_stale = cfg.prefill_speed_stale_seconds
        self._speeds_refresh_at = -_INF
        self._long_tokens = cfg.errors.long_context_tokens
        self._warned: set[str] = set()
        #: Counters for exporters: "detected" and "enforced" are kept apart.
        self.counters: dict[str, int] = {
            "responses_ok_total": 0,
            "responses_saturated_total": 0,  # detected saturation (429/503 saturation body)
            "responses_client_ratelimit_total": 0,  # not counted against the backend
            "responses_server_error_total": 0,
            "responses_timeout_total": 0,
            "responses_connect_error_total": 0,
            "responses_client_error_total": 0,
            "cooling_enforced_total": 0,  # saturation/Retry-After that put a backend in cooling
            "ejections_total": 0,
            "half_open_total": 0,
            "circuit_closed_total": 0,
            "no_backend_total": 0,
            "unknown_backend_feedback_total": 0,
            "bad_signal_total": 0,
        }
        self.set_backends(backends)

    # ------------------------------------------------------------------ pick

    def pick(self, model: str | None, est_prompt_tokens: int = 0, exclude: Iterable[Backend | str] = ()) -> Backend:
        """Choose a backend for a request of ``est_prompt_tokens`` prompt tokens and count the dispatch.

        ``exclude`` names backends already tried (retries go elsewhere).
        """
        now = self._clock()
        table = self._table
        if now >= table.expires_at:
            table = self._advance(now)
        if est_prompt_tokens >= self._long_tokens:
            pool = table.long_pools.get(model, table.long_wildcard)
        else:
            pool = table.pools.get(model, table.wildcard)
        if exclude:
            names = {b if isinstance(b, str) else b.name for b in exclude}
            pool = tuple(s for s in pool if s.name not in names)
        n = len(pool)
        if n == 0:
            return self._none_available(model, est_prompt_tokens)
        slot = pool[0] if n == 1 else self._choose(pool, n, now, est_prompt_tokens)
        limits = table.limits
        if limits and slot in limits and slot.in_flight >= limits[slot]:
            # A half-open backend already has its share: choose among the others that have room.
            pool = tuple(s for s in pool if s not in limits or s.in_flight < limits[s])
            n = len(pool)
            if n == 0:
                return self._none_available(model, est_prompt_tokens)
            slot = pool[0] if n == 1 else self._choose(pool, n, now, est_prompt_tokens)
        if not slot.pending:
            slot.busy_from = now  # the backend starts holding prefill work of ours: its busy time starts
        slot.in_flight += 1
        slot.pending += 1
        if est_prompt_tokens > 0:
            slot.pending_tokens += est_prompt_tokens
        return slot.backend

    def _choose(self, pool: tuple[_Slot, ...], n: int, now: float, tokens: int) -> _Slot:
        # effective = score / (1 + in_flight_penalty * load), load = (pending_tokens + this prompt)
        # * token_weight + in_flight, token_weight = the backend's measured prefill slowness / tokens_per_slot.
        # The local load term is in every comparison, so a stale high score cannot herd traffic.
        random_ = self._rng.random
        d = self._d
        penalty = self._in_flight_penalty
        if tokens < 0:
            tokens = 0
        if d == 2 and (n > 2 or self._with_replacement):
            i = int(random_() * n)
            if self._with_replacement:
                j = int(random_() * n)
            else:
                j = int(random_() * (n - 1))
                if j >= i:
                    j += 1
            a = pool[i]
            b = pool[j]
            v = a.view
            sa = v.target if now >= v.ramp_end_ts else v.start + v.rate * (now - v.start_ts)
            ea = sa / (1.0 + penalty * ((a.pending_tokens + tokens) * a.token_weight + a.in_flight))
            v = b.view
            sb = v.target if now >= v.ramp_end_ts else v.start + v.rate * (now - v.start_ts)
            eb = sb / (1.0 + penalty * ((b.pending_tokens + tokens) * b.token_weight + b.in_flight))
            if ea > eb:
                return a
            if eb > ea:
                return b
            return a if random_() < 0.5 else b
        if d == 0 or (d >= n and not self._with_replacement):
            candidates: Iterable[_Slot] = pool
        elif self._with_replacement:
            candidates = [pool[int(random_() * n)] for _ in range(d)]
        elif 2 * d <= n:
            # d distinct by rejection (few redraws while d <= n / 2), each scored as it is drawn.
            drawn: list[int] = []
            best_s: _Slot | None = None
            best_e = -1.0
            tied = 0
            while len(drawn) < d:
                i = int(random_() * n)
                if i in drawn:
                    continue
                drawn.append(i)
                s = pool[i]
                v = s.view
                score = v.target if now >= v.ramp_end_ts else v.start + v.rate * (now - v.start_ts)
                effective = score / (1.0 + penalty * ((s.pending_tokens + tokens) * s.token_weight + s.in_flight))
                if effective > best_e:
                    best_s, best_e, tied = s, effective, 1
                elif effective == best_e:
                    tied += 1
                    if random_() * tied < 1.0:
                        best_s = s
            assert best_s is not None
            return best_s
        else:
            # Partial Fisher-Yates over a copy of the pool: d distinct without rejection when d is a
            # large share of n, each scored as it is drawn.
            order = list(pool)
            best_s = None
            best_e = -1.0
            tied = 0
            for k in range(d):
                m = k + int(random_() * (n - k))
                s = order[m]
                order[m] = order[k]
                v = s.view
                score = v.target if now >= v.ramp_end_ts else v.start + v.rate * (now - v.start_ts)
                effective = score / (1.0 + penalty * ((s.pending_tokens + tokens) * s.token_weight + s.in_flight))
                if effective > best_e:
                    best_s, best_e, tied = s, effective, 1
                elif effective == best_e:
                    tied += 1
                    if random_() * tied < 1.0:
                        best_s = s
            assert best_s is not None
            return best_s
        best: _Slot | None = None
        best_effective = -1.0
        ties = 0
        for s in candidates:
            v = s.view
            score = v.target if now >= v.ramp_end_ts else v.start + v.rate * (now - v.start_ts)
            effective = score / (1.0 + penalty * ((s.pending_tokens + tokens) * s.token_weight + s.in_flight))
            if effective > best_effective:
                best, best_effective, ties = s, effective, 1
            elif effective == best_effective:
                ties += 1  # reservoir sampling: each tied candidate wins with probability 1/ties
                if random_() * ties < 1.0:
                    best = s
        assert best is not None
        return best

    def _prefill_sample(self, slot: _Slot, backlog: int, drained: int, now: float) -> None:
        """One request left prefill: update the backend's measured seconds per prefill token.

        Between two first tokens (or since the backend started holding our
        prefill work) the engine was busy with it; the ratio of the decayed sums
        of those busy seconds and of the drained prompt tokens is its effective
        prefill speed under its current decode load, queueing and throttling
        included. Only drains from a backlog of at least
        ``prefill_sample_min_tokens`` count: a nearly idle engine spends most of
        a request's time in per-step overhead and would look slow, which would
        push work away from exactly the backends that have room. The backend's
        slowness (its seconds per token over the pool's mean, clamped to
        0.1..10) scales its pending tokens in the load.
        """
        elapsed = now - slot.busy_from
        slot.busy_from = now
        if backlog < self._speed_min_tokens or drained <= 0 or elapsed < 0:
            return
        keep = 1.0 - self._speed_alpha
        if slot.prefill_tokens > 0:
            slot.prefill_seconds = slot.prefill_seconds * keep + elapsed
            slot.prefill_tokens = slot.prefill_tokens * keep + drained
        else:
            slot.prefill_seconds, slot.prefill_tokens = float(elapsed), float(drained)
        spt = slot.prefill_seconds / slot.prefill_tokens
        if not spt > 0:
            return  # first tokens in the same instant: no time measured yet
        if slot.seconds_per_token > 0:
            self._spt_sum += spt - slot.seconds_per_token
        else:
            self._spt_sum += spt
            self._spt_count += 1
        slot.seconds_per_token = spt
        slot.sampled_at = now
        if now >= self._speeds_refresh_at:
            self._refresh_speeds(now)
        else:
            slot.token_weight = self._token_weight(spt)

    def _token_weight(self, spt: float) -> float:
        mean = self._spt_sum / self._spt_count if self._spt_count else 0.0
        slowness = spt / mean if spt > 0 and mean > 0 else 1.0
        return min(10.0, max(0.1, slowness)) * self._inv_tokens_per_slot

    def _refresh_speeds(self, now: float) -> None:
        """Once a second (O(n)): forget stale speed estimates and re-weigh every backend against the mean.

        Between refreshes only the sampled backend is re-weighed, so feedback stays
        O(1). An estimate with no sample for ``prefill_speed_stale_seconds`` is
        dropped (slowness 1): a backend judged slow gets little work, hence no
        backlog and no new samples, and would otherwise stay "slow" for good.
        """
        self._speeds_refresh_at = now + 1.0
        stale_before = now - self._speed_stale
        total, count = 0.0, 0
        for s in self._slots.values():
            if s.seconds_per_token > 0 and s.sampled_at < stale_before:
                s.seconds_per_token = s.prefill_seconds = s.prefill_tokens = 0.0
            if s.seconds_per_token > 0:
                total += s.seconds_per_token
                count += 1
        self._spt_sum, self._spt_count = total, count
        for s in self._slots.values():
            s.token_weight = self._token_weight(s.seconds_per_token)

    def _none_available(self, model: str | None, est_prompt_tokens: int) -> Backend:
        self.counters["no_backend_total"] += 1
        self._warn_once(f"no-backend:{model}", "no eligible backend for model %r (all ejected, cooling or absent)", model)
        kind = "long-context " if est_prompt_tokens >= self._long_tokens else ""
        raise NoBackendAvailable(f"no eligible backend for {kind}model {model!r} (ejected, cooling or not serving it)")

    # ------------------------------------------------------------- feedback

    def on_first_token(self, backend: Backend | str, ttft: float, prompt_tokens: int | None = None) -> None:
        """The first token arrived ``ttft`` seconds after dispatch.

        The request leaves pending prefill: ``prompt_tokens`` of them when given
        (pass the size given to ``pick`` for exact accounting), else the mean
        pending request (the balancer does not track requests one by one).
        """
        slot = self._slot(backend, "on_first_token")
        if slot is None:
            return
        backlog, pending = slot.pending_tokens, slot.pending
        if prompt_tokens is not None and prompt_tokens >= 0:
            drained = prompt_tokens
        else:
            drained = backlog // pending if pending > 0 else 0
        _leave_prefill(slot, prompt_tokens)
        slot.decoding += 1
        if not (isinstance(ttft, (int, float)) and ttft >= 0 and math.isfinite(ttft)):
            self._bad_signal(f"ttft:{slot.name}", "ignoring bad TTFT %r for backend %s", ttft, slot.name)
            return
        with self._lock:
            now = self._clock()
            if pending > 0 and self._speed_alpha > 0.0:
                self._prefill_sample(slot, backlog, drained, now)
            h = self._health[slot.name]
            alpha = self.config.score.ttft_ewma_alpha
            fresh = h.ttft_ewma is not None and now - h.ttft_ts <= self.config.score.ttft_stale_seconds
            h.ttft_ewma = alpha * ttft + (1.0 - alpha) * h.ttft_ewma if fresh else float(ttft)  # type: ignore[operator]
            h.ttft_ts = now
            self._rescore(slot, h, now)

    def on_finish(
        self,
        backend: Backend | str,
        status: int | str,
        body: bytes | str | None = None,
        headers: Mapping[str, Any] | None = None,
        *,
        first_token_seen: bool | None = None,
        prompt_tokens: int | None = None,
    ) -> Classification:
        """The request ended; returns how the response was classified (for retry decisions and metrics).

        ``first_token_seen`` says whether ``on_first_token`` was called for this
        request; when omitted, a success is taken to have streamed (if any
        request is decoding) and a failure to have died in prefill.
        """
        slot = self._slot(backend, "on_finish")
        try:
            classification = self._classifier.classify(status, body, headers)
        except ValueError as exc:
            self._bad_signal(f"status:{status!r}", "on_finish: %s", exc)
            classification = Classification(ResponseClass.SERVER_5XX, matched="bad status")
        if slot is None:
            return classification
        cls = classification.response_class
        if slot.in_flight > 0:
            slot.in_flight -= 1
        if first_token_seen is None:
            first_token_seen = slot.decoding > 0 and (cls is ResponseClass.OK or not slot.pending)
        if first_token_seen and slot.decoding > 0:
            slot.decoding -= 1
        else:
            _leave_prefill(slot, prompt_tokens)
        with self._lock:
            now = self._clock()
            h = self._health.get(slot.name)
            if h is None:
                return classification
            self.counters[_COUNTER[cls]] += 1
            rebuild = False
            if cls is ResponseClass.OK:
                self._decay(h, now)
                h.successes += 1.0
                rebuild = h.breaker.on_success(now)
            elif cls.counts_as_error:
                self._decay(h, now)
                h.errors += 1.0
                if cls is not ResponseClass.SATURATED:
                    # Saturation means busy, not broken: cooling handles it; the breaker counts faults.
                    rebuild = h.breaker.on_failure(now)
                cooling = classification.cools or classification.retry_after is not None
                if cooling and self._cool(h, now, classification):
                    rebuild = True
            if rebuild:
                self._note_transition(slot, h, now)
            self._rescore(slot, h, now)
            if rebuild:
                self._rebuild(now)
        return classification

    def on_probe(self, backend: Backend | str, ok: bool) -> None:
        """An active probe result (see :mod:`llmdiag.router_feedback.probes`)."""
        slot = self._slot(backend, "on_probe")
        if slot is None:
            return
        with self._lock:
            now = self._clock()
            h = self._health.get(slot.name)
            if h is None:
                return
            if h.breaker.on_probe(bool(ok), now):
                self._note_transition(slot, h, now)
                self._rescore(slot, h, now)
                self._rebuild(now)

    def update_signals(self, backend: Backend | str, snapshot_signals: Mapping[str, Any]) -> None:
        """Take ``requests_waiting``, ``kv_cache_usage`` and ``ttft_seconds`` (ewma, p99) from one backend's signals.

        A key that is absent keeps what was known; ``None``/NA means the source
        cannot tell now (unknown, no deduction), never zero. ``up`` going from
        0 to 1 means the engine restarted: the backend warms up again.
        """
        slot = self._slot(backend, "update_signals")
        if slot is None:
            return
        if not isinstance(snapshot_signals, Mapping):
            self._bad_signal(f"signals:{slot.name}", "update_signals(%s): not a mapping: %r", slot.name, type(snapshot_signals))
            return
        with self._lock:
            now = self._clock()
            h = self._health.get(slot.name)
            if h is None:
                return
            if "requests_waiting" in snapshot_signals:
                h.waiting = self._number(snapshot_signals["requests_waiting"], "requests_waiting", slot.name)
            if "kv_cache_usage" in snapshot_signals:
                h.kv = self._number(snapshot_signals["kv_cache_usage"], "kv_cache_usage", slot.name)
            if "ttft_seconds" in snapshot_signals:
                h.engine_ttft, h.engine_ttft_p99 = self._ttft(snapshot_signals["ttft_seconds"], slot.name)
            if "up" in snapshot_signals:
                up = self._number(snapshot_signals["up"], "up", slot.name)
                if up is not None:
                    if h.up is not None and h.up < 0.5 <= up:
                        self._start_warming(slot, h, now)
                    h.up = up
            self._rescore(slot, h, now)

    def set_penalty(self, backend: Backend | str, penalty: float, reasons: Iterable[Reason | Diagnosis] = ()) -> None:
        """The analyzers' combined penalty for the backend (0..1) and the reasons behind it."""
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0.0 <= penalty <= 1.0:
            raise ValueError(f"penalty must be a number in 0..1, got {penalty!r}")
        converted = tuple(r if isinstance(r, Reason) else Reason.from_diagnosis(r) for r in reasons)
        slot = self._slot(backend, "set_penalty")
        if slot is None:
            return
        with self._lock:
            now = self._clock()
            h = self._health.get(slot.name)
            if h is None:
                return
            h.penalty = float(penalty)
            h.reasons = converted
            self._rescore(slot, h, now)

    # ------------------------------------------------------------ backends

    def set_backends(self, backends: Iterable[Backend]) -> None:
        """Replace the backend set: known names keep their state, new ones start ``warming``."""
        backends = list(backends)
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate backend names: {sorted({n for n in names if names.count(n) > 1})}")
        with self._lock:
            now = self._clock()
            slots: dict[str, _Slot] = {}
            health: dict[str, _Health] = {}
            for b in backends:
                old = self._slots.get(b.name)
                if old is not None:
                    old.backend = b
                    slots[b.name] = old
                    health[b.name] = self._health[b.name]
                else:
                    slot = _Slot(b, ScoreView.fixed(0.0, now, self.config.score.recovery_points_per_second),
                                 self._inv_tokens_per_slot)
                    h = _Health(self.config, now)
                    slots[b.name] = slot
                    health[b.name] = h
                    self._start_warming(slot, h, now)
            self._slots = slots
            self._health = health
            measured = [s.seconds_per_token for s in slots.values() if s.seconds_per_token > 0]
            self._spt_sum, self._spt_count = sum(measured), len(measured)
            self._rebuild(now)

    def add_backend(self, backend: Backend) -> None:
        self.set_backends([*(s.backend for s in self._slots.values() if s.name != backend.name), backend])

    def remove_backend(self, backend: Backend | str) -> None:
        name = backend if isinstance(backend, str) else backend.name
        self.set_backends([s.backend for s in self._slots.values() if s.name != name])

    def mark_restarted(self, backend: Backend | str) -> None:
        """The engine restarted: score ramps up again from the warming start."""
        slot = self._slot(backend, "mark_restarted")
        if slot is None:
            return
        with self._lock:
            now = self._clock()
            self._start_warming(slot, self._health[slot.name], now)

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    @property
    def backends(self) -> list[Backend]:
        return [s.backend for s in self._slots.values()]

    # ------------------------------------------------------------- reading

    def score(self, backend: Backend | str) -> float:
        """The score a pick would use now (after the ramp and the penalty)."""
        slot = self._slots[backend if isinstance(backend, str) else backend.name]
        return slot.view.value(self._clock())

    def load(self, backend: Backend | str) -> float:
        """``pending_tokens * slowness / tokens_per_slot + in_flight`` (slowness 1 until measured)."""
        slot = self._slots[backend if isinstance(backend, str) else backend.name]
        return slot.pending_tokens * slot.token_weight + slot.in_flight

    def prefill_slowness(self, backend: Backend | str) -> float:
        """The backend's measured prefill seconds per token over the pool's mean (1.0 until measured)."""
        slot = self._slots[backend if isinstance(backend, str) else backend.name]
        return slot.token_weight / self._inv_tokens_per_slot

    def state(self, backend: Backend | str) -> BackendState:
        name = backend if isinstance(backend, str) else backend.name
        with self._lock:
            now = self._clock()
            if now >= self._table.expires_at:
                self._rebuild(now)
            return self._state_of(self._slots[name], self._health[name], now)

    def factors(self, backend: Backend | str) -> ScoreFactors | None:
        """The score factors last computed for the backend (None before any)."""
        name = backend if isinstance(backend, str) else backend.name
        return self._health[name].factors

    def snapshot_states(self) -> list[BackendPenalty]:
        """Per backend: score, penalty, state, ``weight_percent`` and reasons (for exporters and the agent)."""
        with self._lock:
            now = self._clock()
            if now >= self._table.expires_at:
                self._rebuild(now)
            states: dict[str, BackendState] = {}
            inputs: dict[str, WeightInput] = {}
            for name, slot in self._slots.items():
                h = self._health[name]
                states[name] = self._state_of(slot, h, now)
                inputs[name] = WeightInput(
                    slot.view.value(now), h.engine_ttft_p99, excluded=states[name] is BackendState.EJECTED
                )
            weights = self._weights.update(inputs, now)
            out = []
            for name, slot in self._slots.items():
                h = self._health[name]
                out.append(
                    BackendPenalty(
                        name=name,
                        address=slot.backend.address,
                        score=round(min(100.0, max(0.0, inputs[name].score)), 2),
                        penalty=h.penalty,
                        weight_percent=weights[name],
                        state=states[name],
                        reasons=h.reasons + self._own_reasons(h, states[name], now),
                    )
                )
            return out

    def probe_targets(self) -> list[tuple[Backend, BreakerState]]:
        """Backends with their circuit state, for the active prober."""
        with self._lock:
            now = self._clock()
            if any(self._tick(self._slots[n], h, now) for n, h in list(self._health.items())):
                self._rebuild(now)
            return [(s.backend, self._health[n].breaker.state) for n, s in self._slots.items()]

    # ------------------------------------------------------------- internals

    def _slot(self, backend: Backend | str, where: str) -> _Slot | None:
        name = backend if isinstance(backend, str) else getattr(backend, "name", None)
        slot = self._slots.get(name) if isinstance(name, str) else None
        if slot is None:
            # Feedback for a backend removed meanwhile (or a caller bug): degrade, count, warn once.
            self.counters["unknown_backend_feedback_total"] += 1
            self._warn_once(f"unknown:{where}:{name}", "%s: unknown backend %r ignored", where, name)
        return slot

    def _advance(self, now: float) -> RoutingTable:
        with self._lock:
            if now >= self._table.expires_at:
                self._rebuild(now)
            return self._table

    def _rebuild(self, now: float) -> None:
        """Build and swap a new routing table (under the writer lock)."""
        cfg = self.config
        blocks_all = cfg.errors.cooling_blocks_all
        expires = _INF
        short: list[_Slot] = []
        long: list[_Slot] = []
        limits: dict[_Slot, int] = {}
        for name, slot in self._slots.items():
            h = self._health[name]
            br = h.breaker
            self._tick(slot, h, now)
            if br.state is BreakerState.OPEN:
                expires = min(expires, br.open_until)
                continue
            if br.state is BreakerState.HALF_OPEN:
                limits[slot] = cfg.half_open_max_in_flight
            cooling = h.cooling_until > now
            if cooling:
                expires = min(expires, h.cooling_until)
            if not (cooling and blocks_all):
                short.append(slot)
            if not cooling:
                long.append(slot)
        models = sorted({m for s in self._slots.values() for m in s.backend.models})

        def pools(slots: list[_Slot]) -> tuple[dict[str | None, tuple[_Slot, ...]], tuple[_Slot, ...]]:
            wildcard = tuple(s for s in slots if not s.backend.models)
            out: dict[str | None, tuple[_Slot, ...]] = {None: tuple(slots)}
            for m in models:
                out[m] = tuple(s for s in slots if not s.backend.models or m in s.backend.models)
            return out, wildcard

        short_pools, short_wild = pools(short)
        long_pools, long_wild = pools(long)
        self._table = RoutingTable(short_pools, long_pools, short_wild, long_wild, limits, expires)

    def _decay(self, h: _Health, now: float) -> None:
        dt = now - h.window_ts
        if dt > 0:
            keep = 0.5 ** (dt / self.config.score.error_half_life_seconds)
            h.errors *= keep
            h.successes *= keep
            h.window_ts = now

    def _rescore(self, slot: _Slot, h: _Health, now: float) -> None:
        cfg = self.config.score
        self._decay(h, now)
        # The worse of the gateway's own view and the engine's: either can see a slow backend first.
        ttft = h.ttft_ewma if now - h.ttft_ts <= cfg.ttft_stale_seconds else None
        engine = h.engine_ttft
        if engine is not None and (ttft is None or engine > ttft):
            ttft = engine
        factors = self._scorer(ttft, h.errors, h.successes, h.waiting, h.kv, h.penalty)
        h.factors = factors
        slot.view = slot.view.retarget(factors.score, now)
        if h.warming and not slot.view.ramping(now):
            h.warming = False

    def _start_warming(self, slot: _Slot, h: _Health, now: float) -> None:
        cfg = self.config.score
        h.warming = True
        current = slot.view.value(now)
        start = min(cfg.warming_start_score, current) if current > 0 else cfg.warming_start_score
        slot.view = ScoreView.fixed(start, now, cfg.recovery_points_per_second)
        self._rescore(slot, h, now)
        h.warming = slot.view.ramping(now)

    def _cool(self, h: _Health, now: float, classification: Classification) -> bool:
        """Start or extend cooling; True when the backend was not cooling before (table must change)."""
        cfg = self.config.errors
        until = now
        if classification.cools:
            until = now + cfg.cooling_min_seconds + (cfg.cooling_max_seconds - cfg.cooling_min_seconds) * self._rng.random()
        if classification.retry_after is not None:
            until = max(until, now + min(classification.retry_after, cfg.retry_after_max_seconds))
        if until <= now:
            return False
        was_cooling = h.cooling_until > now
        if until > h.cooling_until:
            h.cooling_until = until
            h.cooling_why = classification.matched or classification.response_class.value
        if not was_cooling:
            self.counters["cooling_enforced_total"] += 1
        return not was_cooling

    def _tick(self, slot: _Slot, h: _Health, now: float) -> bool:
        """Let an ejection whose time is over go half-open; True when it did."""
        if h.breaker.tick(now):
            self._note_transition(slot, h, now)
            return True
        return False

    def _note_transition(self, slot: _Slot, h: _Health, now: float) -> None:
        state = h.breaker.state
        if state is BreakerState.OPEN:
            self.counters["ejections_total"] += 1
            log.info("backend %s ejected for %.0f s", slot.name, h.breaker.ejection_seconds())
        elif state is BreakerState.HALF_OPEN:
            self.counters["half_open_total"] += 1
            # Back from an ejection: ramp up like a restarted backend (slow start).
            self._start_warming(slot, h, now)
        else:
            self.counters["circuit_closed_total"] += 1

    def _state_of(self, slot: _Slot, h: _Health, now: float) -> BackendState:
        br = h.breaker
        if br.state is BreakerState.OPEN:
            return BackendState.EJECTED
        if br.state is BreakerState.HALF_OPEN:
            return BackendState.HALF_OPEN
        if h.cooling_until > now:
            return BackendState.COOLING
        if h.warming and slot.view.ramping(now):
            return BackendState.WARMING
        if slot.view.value(now) < self.config.score.degraded_below:
            return BackendState.DEGRADED
        return BackendState.HEALTHY

    def _own_reasons(self, h: _Health, state: BackendState, now: float) -> tuple[Reason, ...]:
        if state is BackendState.EJECTED:
            left = max(0.0, h.breaker.open_until - now)
            return (Reason("circuit_open", Severity.CRITICAL, 1.0,
                           f"ejected after consecutive failures; retry in {left:.0f} s or after {self.config.probe_successes} good probes"),)
        if state is BackendState.COOLING:
            left = max(0.0, h.cooling_until - now)
            what = "all" if self.config.errors.cooling_blocks_all else "long-context"
            return (Reason("cooling", Severity.WARNING, 0.0,
                           f"saturation response ({h.cooling_why}); no {what} requests for {left:.1f} s"),)
        return ()

    def _number(self, value: Any, key: str, name: str) -> float | None:
        if value is None or value is NA:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            if not (isinstance(value, float) and value != value):
                self._bad_signal(f"{key}:{name}", "update_signals(%s): %s is not a number: %r", name, key, value)
            return None
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float is not a measurement
            number = math.inf
        if not math.isfinite(number):
            self._bad_signal(f"{key}:{name}", "update_signals(%s): %s is not finite: %r", name, key, value)
            return None
        return number

    def _ttft(self, value: Any, name: str) -> tuple[float | None, float | None]:
        if isinstance(value, Distribution):
            ewma, p99 = value.ewma, value.p99
        elif isinstance(value, Mapping):
            ewma, p99 = value.get("ewma"), value.get("p99")
        elif value is None or value is NA:
            return None, None
        else:
            ewma, p99 = value, None  # a bare number: the engine gave one summary value
        return self._number(ewma, "ttft_seconds.ewma", name), self._number(p99, "ttft_seconds.p99", name)

    def _bad_signal(self, cause: str, msg: str, *args: Any) -> None:
        self.counters["bad_signal_total"] += 1
        self._warn_once(cause, msg, *args)

    def _warn_once(self, cause: str, msg: str, *args: Any) -> None:
        if cause not in self._warned and len(self._warned) < 10_000:
            self._warned.add(cause)
            log.warning(msg, *args)


_COUNTER = {
    ResponseClass.OK: "responses_ok_total",
    ResponseClass.SATURATED: "responses_saturated_total",
    ResponseClass.CLIENT_RATELIMIT: "responses_client_ratelimit_total",
    ResponseClass.SERVER_5XX: "responses_server_error_total",
    ResponseClass.TIMEOUT: "responses_timeout_total",
    ResponseClass.CONNECT_ERROR: "responses_connect_error_total",
    ResponseClass.CLIENT_ERROR: "responses_client_error_total",
}


def _leave_prefill(slot: _Slot, prompt_tokens: int | None) -> None:
    """Take one request out of pending prefill: ``prompt_tokens`` of them, else the mean pending request."""
    pending = slot.pending
    if pending <= 0:
        return
    if prompt_tokens is None or prompt_tokens < 0:
        prompt_tokens = slot.pending_tokens // pending
    slot.pending = pending - 1
    slot.pending_tokens = 0 if pending == 1 else max(0, slot.pending_tokens - prompt_tokens)
