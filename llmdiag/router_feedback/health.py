"""What the balancer's writer side knows about each backend, and the rules that move it.

A backend's :class:`Health` holds its circuit breaker, the TTFT and engine
signals behind its score, the decayed error window, the analyzers' penalty,
cooling (saturation, Retry-After) and warm-up. :class:`HealthRules` applies
feedback to it: rescoring (the formula is in
:func:`llmdiag.router_feedback.score.health_score`), the warm-up ramp, cooling,
and what a circuit transition implies. Everything here runs under the
balancer's writer lock; ``pick`` never reads it (it reads the routing table
and each slot's score view, which these rules swap).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import BackendState, Reason
from llmdiag.router_feedback.breaker import Breaker, BreakerState
from llmdiag.router_feedback.errors import Classification
from llmdiag.router_feedback.routing import Slot
from llmdiag.router_feedback.score import ScoreFactors, ScoreView, scorer

__all__ = ["Health", "HealthRules"]

log = logging.getLogger("llmdiag.router_feedback.balancer")


class Health:
    """What the writer side knows about one backend (touched only under the writer lock)."""

    __slots__ = (
        "breaker", "ttft_ewma", "ttft_ts", "engine_ttft", "engine_ttft_p99", "waiting", "kv", "up",
        "errors", "successes", "window_ts", "penalty", "charged", "reasons", "down_reported", "cooling_until",
        "cooling_why", "warming", "factors",
    )

    def __init__(self, cfg: BalancerConfig, now: float) -> None:
        self.breaker = Breaker(cfg, closed_since=now)
        self.ttft_ewma: float | None = None
        self.ttft_ts = -math.inf
        self.engine_ttft: float | None = None
        self.engine_ttft_p99: float | None = None
        self.waiting: float | None = None
        self.kv: float | None = None
        self.up: float | None = None
        self.errors = 0.0
        self.successes = 0.0
        self.window_ts = now
        self.penalty = 0.0  # the analyzers' combined penalty, as reported
        self.charged = 0.0  # the part of it the score charges (HealthRules.charge)
        self.reasons: tuple[Reason, ...] = ()
        self.down_reported = False  # an eject kind (backend_down) is among the reasons
        self.cooling_until = -math.inf
        self.cooling_why = ""
        self.warming = True
        self.factors: ScoreFactors | None = None


class HealthRules:
    """Feedback rules over :class:`Health` and the slot's score view; counts what they enforce in ``counters``."""

    def __init__(self, cfg: BalancerConfig, counters: dict[str, int]) -> None:
        self.cfg = cfg
        self.counters = counters
        self._scorer = scorer(cfg.score)
        self._self_observed = frozenset(cfg.self_observed_kinds)
        self._eject = frozenset(cfg.eject_kinds)

    def charge(self, h: Health, penalty: float, reasons: tuple[Reason, ...]) -> bool:
        """Take the analyzers' penalty; return True when it newly reports an eject kind (the circuit must open).

        The rule (docs/balancer.md "What a penalty may carry"): a penalty
        carries only what the balancer cannot see for itself. The reasons of a
        ``self_observed_kinds`` kind (slowness, KV, queue, errors: already in
        the score through the balancer's own feedback and the engine's
        metrics) and of an ``eject_kinds`` kind (acted on by ejection instead)
        are divided out of the combined penalty: ``charged = 1 - (1 - penalty)
        / prod(1 - p_seen)``. Without reasons the penalty is charged whole
        (nothing says what it is made of).
        """
        h.penalty = penalty
        h.reasons = reasons
        keep_seen = 1.0
        other_keep = 1.0
        down = False
        for r in reasons:
            if r.kind in self._eject:
                down = True
            elif r.kind not in self._self_observed:
                other_keep *= 1.0 - min(1.0, max(0.0, r.penalty))
                continue
            keep_seen *= 1.0 - min(1.0, max(0.0, r.penalty))
        if keep_seen >= 1.0:
            h.charged = penalty
        else:
            if keep_seen > 0.0:
                charged = 1.0 - (1.0 - penalty) / keep_seen
            else:  # a seen reason at penalty 1: what is left is the other reasons' product
                charged = 1.0 - other_keep
            h.charged = min(penalty, max(0.0, charged))
            self.counters["penalty_self_observed_total"] += 1
        newly_down = down and not h.down_reported
        h.down_reported = down
        return newly_down

    def decay(self, h: Health, now: float) -> None:
        """Age the error window: errors and successes halve every ``error_half_life_seconds``."""
        dt = now - h.window_ts
        if dt > 0:
            keep = 0.5 ** (dt / self.cfg.score.error_half_life_seconds)
            h.errors *= keep
            h.successes *= keep
            h.window_ts = now

    def rescore(self, slot: Slot, h: Health, now: float) -> None:
        """Recompute the score from what is known and swap the slot's view (falls at once, rises ramp)."""
        cfg = self.cfg.score
        self.decay(h, now)
        # The worse of the gateway's own view and the engine's: either can see a slow backend first.
        ttft = h.ttft_ewma if now - h.ttft_ts <= cfg.ttft_stale_seconds else None
        engine = h.engine_ttft
        if engine is not None and (ttft is None or engine > ttft):
            ttft = engine
        factors = self._scorer(ttft, h.errors, h.successes, h.waiting, h.kv, h.charged)
        h.factors = factors
        slot.view = slot.view.retarget(factors.score, now)
        if h.warming and not slot.view.ramping(now):
            h.warming = False

    def forget_errors(self, h: Health, now: float) -> None:
        """A new engine process: the errors of the one that died say nothing about it.

        Kept, they would hold its error factor (a ratio, so decay alone does
        not clear it) near 1 until enough new successes came in, and it would
        get little traffic for many seconds after a restart (issue 14 point 2).
        """
        h.errors = 0.0
        h.successes = 0.0
        h.window_ts = now

    def start_warming(self, slot: Slot, h: Health, now: float, *, unless_warming: bool = False) -> None:
        """(Re)start the warm-up ramp from ``warming_start_score`` (or lower, if the score is already lower).

        ``unless_warming``: keep a ramp already under way (a restart seen in the
        metrics and the half-open that follows must not ramp twice; issue 14).
        """
        if unless_warming and h.warming and slot.view.ramping(now):
            return
        cfg = self.cfg.score
        h.warming = True
        current = slot.view.value(now)
        start = min(cfg.warming_start_score, current) if current > 0 else cfg.warming_start_score
        slot.view = ScoreView.fixed(start, now, cfg.recovery_points_per_second)
        self.rescore(slot, h, now)
        h.warming = slot.view.ramping(now)

    def cool(self, h: Health, now: float, classification: Classification, random_: Callable[[], float]) -> bool:
        """Start or extend cooling; True when the backend was not cooling before (table must change)."""
        cfg = self.cfg.errors
        until = now
        if classification.cools:
            until = now + cfg.cooling_min_seconds + (cfg.cooling_max_seconds - cfg.cooling_min_seconds) * random_()
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

    def tick(self, slot: Slot, h: Health, now: float) -> bool:
        """Let an ejection whose time is over go half-open; True when it did."""
        if h.breaker.tick(now):
            self.note_transition(slot, h, now)
            return True
        return False

    def note_transition(self, slot: Slot, h: Health, now: float) -> None:
        """The circuit just changed state: count it, and warm up a backend coming back from an ejection."""
        state = h.breaker.state
        if state is BreakerState.OPEN:
            self.counters["ejections_total"] += 1
            log.info("backend %s ejected for %.0f s", slot.name, h.breaker.ejection_seconds())
        elif state is BreakerState.HALF_OPEN:
            self.counters["half_open_total"] += 1
            if h.breaker.refused:
                self.forget_errors(h, now)
            # Back from an ejection: ramp up like a restarted backend (slow start), once.
            self.start_warming(slot, h, now, unless_warming=True)
        else:
            self.counters["circuit_closed_total"] += 1

    def state_of(self, slot: Slot, h: Health, now: float) -> BackendState:
        """The backend's state as exporters and the agent show it."""
        br = h.breaker
        if br.state is BreakerState.OPEN:
            return BackendState.EJECTED
        if br.state is BreakerState.HALF_OPEN:
            return BackendState.HALF_OPEN
        if h.cooling_until > now:
            return BackendState.COOLING
        if h.warming and slot.view.ramping(now):
            return BackendState.WARMING
        if slot.view.value(now) < self.cfg.score.degraded_below:
            return BackendState.DEGRADED
        return BackendState.HEALTHY
