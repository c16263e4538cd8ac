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
``snapshot_states() -> list[BackendPenalty]`` and ``deadlines() -> dict[str, BackendDeadlines]``
    What exporters and the agent show: per backend the score, penalty, state,
    weight and reasons; and when its cooling and ejection end, in the
    balancer's clock (``clock``: ``time.monotonic`` unless one is injected, so
    not epoch seconds unless the caller made it so).

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

Modules
-------
This module holds the public API and the locking. The concerns behind it:
:mod:`~llmdiag.router_feedback.routing` (the hot path: slots, routing table,
the d-choices pick and the only copy of the scoring formula),
:mod:`~llmdiag.router_feedback.prefill_speed` (measured prefill slowness),
:mod:`~llmdiag.router_feedback.health` (score, warm-up, cooling, circuit),
:mod:`~llmdiag.router_feedback.signals` (checking fed values) and
:mod:`~llmdiag.router_feedback.report` (states and reasons for exporters).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import Backend, BackendPenalty, BackendState, Diagnosis, Reason
from llmdiag.router_feedback.breaker import BreakerState
from llmdiag.router_feedback.errors import Classification, ErrorClassifier, ResponseClass
from llmdiag.router_feedback.health import Health, HealthRules
from llmdiag.router_feedback.prefill_speed import PrefillSpeed
from llmdiag.router_feedback.report import BackendDeadlines, backend_deadlines, backend_penalties
from llmdiag.router_feedback.routing import EMPTY_TABLE, RoutingTable, Slot, build_table, chooser, leave_prefill
from llmdiag.router_feedback.score import ScoreFactors, ScoreView
from llmdiag.router_feedback.signals import SignalChecker
from llmdiag.router_feedback.weights import AdaptiveWeights

__all__ = ["BackendDeadlines", "Balancer", "NoBackendAvailable", "RoutingTable"]


class NoBackendAvailable(LookupError):
    """No eligible backend serves the model (all ejected or cooling, or none holds it)."""


class Balancer:
    """Power of d choices over ``effective = score / (1 + in_flight_penalty * load)``.

    See the module docstring for the API contract and the concurrency model,
    and :func:`llmdiag.router_feedback.routing.chooser` for the formula.
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
        #: The RNG ``pick`` and cooling draw from (``rng``; a fresh ``random.Random()`` when not given).
        self._rng = rng if rng is not None else random.Random()
        self._classifier = ErrorClassifier(cfg.errors)
        self._weights = AdaptiveWeights(cfg.weights)
        self._lock = threading.Lock()
        self._slots: dict[str, Slot] = {}
        self._health: dict[str, Health] = {}
        self._table = EMPTY_TABLE
        self._choose = chooser(cfg.choices, cfg.with_replacement, cfg.in_flight_penalty, cfg.full_scan_up_to)
        self._long_tokens = cfg.errors.long_context_tokens
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
            "penalty_self_observed_total": 0,  # penalties with a self-observed part not charged again
            "down_ejections_total": 0,  # ejections enforced for a backend_down report
        }
        self._speed = PrefillSpeed(cfg)
        self._rules = HealthRules(cfg, self.counters)
        self._signals = SignalChecker(self.counters)
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
        if n == 1:
            slot = pool[0]
        else:
            slot = self._choose(pool, n, now, est_prompt_tokens, self._rng.random)
        limits = table.limits
        if limits and slot in limits and slot.in_flight >= limits[slot]:
            # A half-open backend already has its share: choose among the others that have room.
            pool = tuple(s for s in pool if s not in limits or s.in_flight < limits[s])
            n = len(pool)
            if n == 0:
                return self._none_available(model, est_prompt_tokens)
            if n == 1:
                slot = pool[0]
            else:
                slot = self._choose(pool, n, now, est_prompt_tokens, self._rng.random)
        if not slot.pending:
            slot.busy_from = now  # the backend starts holding prefill work of ours: its busy time starts
        slot.in_flight += 1
        slot.pending += 1
        if est_prompt_tokens > 0:
            slot.pending_tokens += est_prompt_tokens
        return slot.backend

    def _none_available(self, model: str | None, est_prompt_tokens: int) -> Backend:
        self.counters["no_backend_total"] += 1
        self._signals.warn_once(f"no-backend:{model}", "no eligible backend for model %r (all ejected, cooling or absent)", model)
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
        leave_prefill(slot, prompt_tokens)
        slot.decoding += 1
        if not (isinstance(ttft, (int, float)) and ttft >= 0 and math.isfinite(ttft)):
            self._signals.bad_signal(f"ttft:{slot.name}", "ignoring bad TTFT %r for backend %s", ttft, slot.name)
            return
        with self._lock:
            now = self._clock()
            if pending > 0 and self._speed.enabled:
                self._speed.sample(slot, backlog, drained, now, self._slots)
            h = self._health[slot.name]
            alpha = self.config.score.ttft_ewma_alpha
            fresh = h.ttft_ewma is not None and now - h.ttft_ts <= self.config.score.ttft_stale_seconds
            h.ttft_ewma = alpha * ttft + (1.0 - alpha) * h.ttft_ewma if fresh else float(ttft)  # type: ignore[operator]
            h.ttft_ts = now
            if h.breaker.state is BreakerState.HALF_OPEN and h.breaker.on_success(now):
                # A first token proves the engine serves: half-open need not wait for whole requests.
                self._rules.note_transition(slot, h, now)
                self._rules.rescore(slot, h, now)
                self._rebuild(now)
                return
            self._rules.rescore(slot, h, now)

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
            self._signals.bad_signal(f"status:{status!r}", "on_finish: %s", exc)
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
            leave_prefill(slot, prompt_tokens)
        with self._lock:
            now = self._clock()
            h = self._health.get(slot.name)
            if h is None:
                return classification
            self.counters[_COUNTER[cls]] += 1
            rules = self._rules
            rebuild = False
            if cls is ResponseClass.OK:
                rules.decay(h, now)
                h.successes += 1.0
                rebuild = h.breaker.on_success(now)
            elif cls.counts_as_error:
                rules.decay(h, now)
                h.errors += 1.0
                if cls is not ResponseClass.SATURATED:
                    # Saturation means busy, not broken: cooling handles it; the breaker counts faults.
                    if cls is ResponseClass.CONNECT_ERROR:
                        h.breaker.on_refused()
                    rebuild = h.breaker.on_failure(now)
                cooling = classification.cools or classification.retry_after is not None
                if cooling and rules.cool(h, now, classification, self._rng.random):
                    rebuild = True
            if rebuild:
                rules.note_transition(slot, h, now)
            rules.rescore(slot, h, now)
            if rebuild:
                self._rebuild(now)
        return classification

    def on_probe(self, backend: Backend | str, ok: bool, refused: bool = False) -> None:
        """An active probe result (see :mod:`llmdiag.router_feedback.probes`).

        ``refused``: the probe's connection was refused (the process is gone);
        then the first good probe re-admits (half-open) unless the backend flaps.
        """
        slot = self._slot(backend, "on_probe")
        if slot is None:
            return
        with self._lock:
            now = self._clock()
            h = self._health.get(slot.name)
            if h is None:
                return
            if h.breaker.on_probe(bool(ok), now, refused=bool(refused)):
                self._rules.note_transition(slot, h, now)
                self._rules.rescore(slot, h, now)
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
        signals = self._signals
        if not isinstance(snapshot_signals, Mapping):
            signals.bad_signal(f"signals:{slot.name}", "update_signals(%s): not a mapping: %r", slot.name, type(snapshot_signals))
            return
        with self._lock:
            now = self._clock()
            h = self._health.get(slot.name)
            if h is None:
                return
            if "requests_waiting" in snapshot_signals:
                h.waiting = signals.number(snapshot_signals["requests_waiting"], "requests_waiting", slot.name)
            if "kv_cache_usage" in snapshot_signals:
                h.kv = signals.number(snapshot_signals["kv_cache_usage"], "kv_cache_usage", slot.name)
            if "ttft_seconds" in snapshot_signals:
                h.engine_ttft, h.engine_ttft_p99 = signals.ttft(snapshot_signals["ttft_seconds"], slot.name)
            if "up" in snapshot_signals:
                up = signals.number(snapshot_signals["up"], "up", slot.name)
                if up is not None:
                    if h.up is not None and h.up < 0.5 <= up:
                        # The engine restarted: a new process, a fresh error window, one warm-up ramp.
                        self._rules.forget_errors(h, now)
                        self._rules.start_warming(slot, h, now, unless_warming=True)
                    h.up = up
            self._rules.rescore(slot, h, now)

    def set_penalty(self, backend: Backend | str, penalty: float, reasons: Iterable[Reason | Diagnosis] = ()) -> None:
        """The analyzers' combined penalty for the backend (0..1) and the reasons behind it.

        The score charges only what the balancer cannot see for itself: reasons
        of a ``self_observed_kinds`` kind are divided out (still reported). A
        reason of an ``eject_kinds`` kind (``backend_down``) ejects the backend
        (circuit open) when it first appears; probes re-admit it.
        """
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
            rules = self._rules
            if rules.charge(h, float(penalty), converted) and h.breaker.eject(now):
                self.counters["down_ejections_total"] += 1
                rules.note_transition(slot, h, now)
                rules.rescore(slot, h, now)
                self._rebuild(now)
                return
            rules.rescore(slot, h, now)

    # ------------------------------------------------------------ backends

    def set_backends(self, backends: Iterable[Backend]) -> None:
        """Replace the backend set: known names keep their state, new ones start ``warming``."""
        backends = list(backends)
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate backend names: {sorted({n for n in names if names.count(n) > 1})}")
        with self._lock:
            now = self._clock()
            slots: dict[str, Slot] = {}
            health: dict[str, Health] = {}
            for b in backends:
                old = self._slots.get(b.name)
                if old is not None:
                    old.backend = b
                    slots[b.name] = old
                    health[b.name] = self._health[b.name]
                else:
                    slot = Slot(b, ScoreView.fixed(0.0, now, self.config.score.recovery_points_per_second),
                                self._speed.inv_tokens_per_slot)
                    h = Health(self.config, now)
                    slots[b.name] = slot
                    health[b.name] = h
                    self._rules.start_warming(slot, h, now)
            self._slots = slots
            self._health = health
            self._speed.recount(slots.values())
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
            self._rules.start_warming(slot, self._health[slot.name], now)

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
        """``pending_tokens * slowness ** prefill_slowness_exponent / tokens_per_slot + in_flight`` (slowness 1 until measured)."""
        slot = self._slots[backend if isinstance(backend, str) else backend.name]
        return slot.pending_tokens * slot.token_weight + slot.in_flight

    def prefill_slowness(self, backend: Backend | str) -> float:
        """The backend's measured prefill seconds per token over the pool's mean (1.0 until measured)."""
        return self._speed.slowness(self._slots[backend if isinstance(backend, str) else backend.name])

    def state(self, backend: Backend | str) -> BackendState:
        name = backend if isinstance(backend, str) else backend.name
        with self._lock:
            now = self._clock()
            if now >= self._table.expires_at:
                self._rebuild(now)
            return self._rules.state_of(self._slots[name], self._health[name], now)

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
            return backend_penalties(self._slots, self._health, self._rules.state_of, self._weights, self.config, now)

    def deadlines(self) -> dict[str, BackendDeadlines]:
        """Per backend: when its cooling and its ejection end, in this balancer's clock (``None``: not in force).

        The clock is the one given to the constructor (``time.monotonic`` by
        default): a caller that shows the deadlines as wall time converts them
        with the offset between the two clocks read together.
        """
        with self._lock:
            now = self._clock()
            if now >= self._table.expires_at:
                self._rebuild(now)  # an ejection whose time is over goes half-open first
            return backend_deadlines(self._health, now)

    def probe_targets(self) -> list[tuple[Backend, BreakerState]]:
        """Backends with their circuit state, for the active prober."""
        with self._lock:
            now = self._clock()
            tick = self._rules.tick
            if any(tick(self._slots[n], h, now) for n, h in list(self._health.items())):
                self._rebuild(now)
            return [(s.backend, self._health[n].breaker.state) for n, s in self._slots.items()]

    # ------------------------------------------------------------- internals

    def _slot(self, backend: Backend | str, where: str) -> Slot | None:
        name = backend if isinstance(backend, str) else getattr(backend, "name", None)
        slot = self._slots.get(name) if isinstance(name, str) else None
        if slot is None:
            # Feedback for a backend removed meanwhile (or a caller bug): degrade, count, warn once.
            self.counters["unknown_backend_feedback_total"] += 1
            self._signals.warn_once(f"unknown:{where}:{name}", "%s: unknown backend %r ignored", where, name)
        return slot

    def _advance(self, now: float) -> RoutingTable:
        with self._lock:
            if now >= self._table.expires_at:
                self._rebuild(now)
            return self._table

    def _rebuild(self, now: float) -> None:
        """Build and swap a new routing table (under the writer lock).

        Ejected backends are out; half-open ones are capped at
        ``max(half_open_max_in_flight, ceil(half_open_share * mean in-flight of the closed ones))``; cooling ones take no long-context requests
        (no requests at all with ``cooling_blocks_all``). The table expires at
        the next ejection or cooling deadline.
        """
        cfg = self.config
        blocks_all = cfg.errors.cooling_blocks_all
        expires = math.inf
        short: list[Slot] = []
        long: list[Slot] = []
        half_open: list[Slot] = []
        closed_in_flight = closed = 0
        for name, slot in self._slots.items():
            h = self._health[name]
            br = h.breaker
            self._rules.tick(slot, h, now)
            if br.state is BreakerState.OPEN:
                expires = min(expires, br.open_until)
                continue
            if br.state is BreakerState.HALF_OPEN:
                half_open.append(slot)
            else:
                closed += 1
                closed_in_flight += slot.in_flight
            cooling = h.cooling_until > now
            if cooling:
                expires = min(expires, h.cooling_until)
            if not (cooling and blocks_all):
                short.append(slot)
            if not cooling:
                long.append(slot)
        # Half-open admits in proportion to the pool: a share of a closed backend's mean in-flight.
        mean = closed_in_flight / closed if closed else 0.0
        limit = max(cfg.half_open_max_in_flight, math.ceil(cfg.half_open_share * mean))
        self._table = build_table(short, long, {slot: limit for slot in half_open}, expires)


_COUNTER = {
    ResponseClass.OK: "responses_ok_total",
    ResponseClass.SATURATED: "responses_saturated_total",
    ResponseClass.CLIENT_RATELIMIT: "responses_client_ratelimit_total",
    ResponseClass.SERVER_5XX: "responses_server_error_total",
    ResponseClass.TIMEOUT: "responses_timeout_total",
    ResponseClass.CONNECT_ERROR: "responses_connect_error_total",
    ResponseClass.CLIENT_ERROR: "responses_client_error_total",
}
