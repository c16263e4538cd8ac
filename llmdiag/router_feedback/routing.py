"""The balancer's hot path: routing cells, the immutable routing table and the d-choices pick.

Everything :meth:`Balancer.pick <llmdiag.router_feedback.balancer.Balancer.pick>`
touches lives here. ``pick`` takes no lock: it reads a :class:`RoutingTable`
(rebuilt and swapped by the writer side when eligibility changes) and each
candidate's :class:`Slot` (whose ``view`` is swapped by every feedback call and
whose load counters are plain integers). ``bench/bench_balancer.py`` and
``llmdiag bench balancer`` guard the cost of the ``choose`` that :func:`chooser` builds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmdiag.model import Backend
from llmdiag.router_feedback.score import ScoreView

__all__ = ["EMPTY_TABLE", "RoutingTable", "Slot", "build_table", "chooser", "leave_prefill"]


class Slot:
    """One backend's stable routing cell: its current score view and load counters.

    The prefill-speed fields are written by
    :class:`~llmdiag.router_feedback.prefill_speed.PrefillSpeed` (under the
    writer lock); ``pick`` reads only ``view``, ``pending_tokens``,
    ``token_weight`` and ``in_flight``.
    """

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


def leave_prefill(slot: Slot, prompt_tokens: int | None) -> None:
    """Take one request out of pending prefill: ``prompt_tokens`` of them, else the mean pending request."""
    pending = slot.pending
    if pending <= 0:
        return
    if prompt_tokens is None or prompt_tokens < 0:
        prompt_tokens = slot.pending_tokens // pending
    slot.pending = pending - 1
    slot.pending_tokens = 0 if pending == 1 else max(0, slot.pending_tokens - prompt_tokens)


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """Immutable eligibility: model -> tuple of slots, for ordinary and for long-context requests.

    ``None`` as a model means "any model"; a model no backend declares goes to
    the backends that declare no models (``wildcard``). ``limits`` caps the
    in-flight requests of half-open backends. After ``expires_at`` (the next
    cooling or ejection deadline) the table must be rebuilt.
    """

    pools: Mapping[str | None, tuple[Slot, ...]]
    long_pools: Mapping[str | None, tuple[Slot, ...]]
    wildcard: tuple[Slot, ...]
    long_wildcard: tuple[Slot, ...]
    limits: Mapping[Slot, int]
    expires_at: float


EMPTY_TABLE = RoutingTable({}, {}, (), (), {}, math.inf)


def build_table(short: Sequence[Slot], long: Sequence[Slot], limits: Mapping[Slot, int], expires_at: float) -> RoutingTable:
    """The table for these eligible slots: ``short`` take ordinary requests, ``long`` long-context ones."""
    models = sorted({m for s in (*short, *long) for m in s.backend.models})

    def pools(slots: Sequence[Slot]) -> tuple[dict[str | None, tuple[Slot, ...]], tuple[Slot, ...]]:
        wildcard = tuple(s for s in slots if not s.backend.models)
        out: dict[str | None, tuple[Slot, ...]] = {None: tuple(slots)}
        for m in models:
            out[m] = tuple(s for s in slots if not s.backend.models or m in s.backend.models)
        return out, wildcard

    short_pools, short_wild = pools(short)
    long_pools, long_wild = pools(long)
    return RoutingTable(short_pools, long_pools, short_wild, long_wild, dict(limits), expires_at)


def chooser(d: int, with_replacement: bool, in_flight_penalty: float, scan_up_to: int = 0) -> Callable[..., Slot]:
    """``choose(pool, n, now, tokens, random_) -> Slot`` with the balancer's constants bound.

    ``choose`` returns the best of ``d`` candidates sampled from ``pool``
    (``n = len(pool) >= 2``) for a ``tokens``-token prompt, drawing from
    ``random_()``. The scoring formula (the only copy; SPEC 6.3)::

        effective    = score / (1 + in_flight_penalty * load)
        load         = (pending_tokens + tokens) * token_weight + in_flight
        token_weight = clamp(measured prefill slowness, 0.1, 10) ** prefill_slowness_exponent / tokens_per_slot
                       (slowness 1 until measured; exponent 0.5)

    ``score`` is the backend's health score as its :class:`ScoreView` gives it
    now (warm-up ramp and penalty included). The local load term is in every
    comparison, so a stale high score cannot herd traffic. Candidates:
    ``d == 0``, ``d >= n`` (without replacement) or ``n <= scan_up_to`` is a
    full scan (a small pool costs little to scan, and sampling half of it
    misses the best backend often; issue 14 point 3); otherwise
    ``d`` are drawn, distinct unless ``with_replacement``: by rejection while
    ``d <= n / 2`` (few redraws), else by a partial Fisher-Yates shuffle of a
    copy. Ties are broken uniformly (reservoir sampling: the k-th tied
    candidate wins with probability 1/k). Cost O(d), not O(n); the constants
    are bound as closure cells because this runs on every request
    (``llmdiag bench balancer`` guards it).
    """
    penalty = in_flight_penalty
    two = d == 2
    rejection_up_to = 2 * d

    def choose(pool: tuple[Slot, ...], n: int, now: float, tokens: int, random_: Callable[[], float]) -> Slot:
        if tokens < 0:
            tokens = 0
        candidates: Iterable[Slot]
        if n <= scan_up_to:
            candidates = pool
        elif two and (n > 2 or with_replacement):
            i = int(random_() * n)
            if with_replacement:
                j = int(random_() * n)
            else:
                j = int(random_() * (n - 1))
                if j >= i:
                    j += 1
            candidates = (pool[i], pool[j])
        elif d == 0 or (d >= n and not with_replacement):
            candidates = pool
        elif with_replacement:
            candidates = [pool[int(random_() * n)] for _ in range(d)]
        elif rejection_up_to <= n:
            drawn: list[Slot] = []
            while len(drawn) < d:
                s = pool[int(random_() * n)]
                if s not in drawn:  # slots compare by identity
                    drawn.append(s)
            candidates = drawn
        else:
            order = list(pool)
            for k in range(d):
                m = k + int(random_() * (n - k))
                order[k], order[m] = order[m], order[k]
            candidates = order[:d]
        best: Slot | None = None
        best_effective = -1.0
        ties = 0
        for s in candidates:
            # The formula of the docstring above.
            v = s.view
            score = v.target if now >= v.ramp_end_ts else v.start + v.rate * (now - v.start_ts)
            effective = score / (1.0 + penalty * ((s.pending_tokens + tokens) * s.token_weight + s.in_flight))
            if effective > best_effective:
                best, best_effective, ties = s, effective, 1
            elif effective == best_effective:
                ties += 1
                if random_() * ties < 1.0:
                    best = s
        assert best is not None
        return best

    return choose
