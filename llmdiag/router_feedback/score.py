"""The health score of one backend (SPEC 6.1) and its warm-up ramp.

:func:`health_score` is a pure function of what is known about a backend;
:class:`ScoreView` is the immutable, time-dependent score the balancer reads
on every pick: it may rise by at most ``recovery_points_per_second`` (the
warm-up ramp of seed 000) but falls at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from llmdiag.config.balancer import ScoreConfig

__all__ = ["ScoreFactors", "ScoreInputs", "ScoreView", "health_score", "scorer"]


class ScoreInputs(NamedTuple):
    """What the score is computed from. ``None`` means unknown (no evidence), never zero."""

    ttft_seconds: float | None = None
    errors: float = 0.0
    successes: float = 0.0
    requests_waiting: float | None = None
    kv_cache_usage: float | None = None
    penalty: float = 0.0


class ScoreFactors(NamedTuple):
    """The factors behind a score, each 0 (best) .. 1 (worst), for explanations and tests."""

    ttft: float
    error: float
    queue: float
    kv: float
    deduction: float
    health: float  # 0..100 before the penalty multiplier
    score: float  # 0..100 after it


def health_score(inputs: ScoreInputs, cfg: ScoreConfig) -> ScoreFactors:
    """Seed 000's score, with the diagnosis penalty as a multiplier::

        ttft_factor  = min(1, ttft_ewma / ttft_threshold) ** 2
        error_factor = min(1, error_multiplier * errors / (errors + successes))   # 5x: >= 20 % -> 1
        kv_factor    = 0 if kv <= kv_threshold else (kv - kv_threshold) / (1 - kv_threshold)
        queue_factor = max(min(1, waiting / max_queue), kv_factor)
        deduction    = w_ttft * ttft_factor + w_errors * error_factor + w_queue * queue_factor
        score        = clamp(100 * (1 - deduction), 0, 100) * (1 - penalty)

    An unknown input (``None`` or NaN) contributes no deduction: a missing
    signal is not evidence of trouble, and it is never read as a made-up zero.
    """
    return scorer(cfg)(*inputs)


@functools.lru_cache(maxsize=16)
def scorer(cfg: ScoreConfig) -> Callable[..., ScoreFactors]:
    """:func:`health_score` as ``fn(ttft, errors, successes, waiting, kv, penalty)`` with ``cfg`` bound.

    The balancer calls this on every feedback call; binding the constants as
    locals keeps it well under a microsecond in CPython.
    """
    w_ttft, w_errors, w_queue = cfg.weight_ttft, cfg.weight_errors, cfg.weight_queue
    inv_ttft = 1.0 / cfg.ttft_threshold_seconds
    multiplier = cfg.error_multiplier
    inv_queue = 1.0 / cfg.max_queue
    kv_threshold = cfg.kv_threshold
    inv_kv_span = 1.0 / (1.0 - cfg.kv_threshold)
    factors = ScoreFactors

    def score(ttft: float | None, errors: float, successes: float, waiting: float | None, kv: float | None,
              penalty: float = 0.0) -> ScoreFactors:
        # The formula is in health_score's docstring; NaN fails every comparison, so it reads as unknown.
        ttft_factor = 0.0
        if ttft is not None and ttft > 0:
            ratio = ttft * inv_ttft
            ttft_factor = 1.0 if ratio >= 1.0 else ratio * ratio
        error_factor = 0.0
        total = errors + successes
        if total > 0:
            error_factor = multiplier * errors / total
            if error_factor > 1.0:
                error_factor = 1.0
        kv_factor = 0.0
        if kv is not None and kv > kv_threshold:
            kv_factor = (kv - kv_threshold) * inv_kv_span
            if kv_factor > 1.0:
                kv_factor = 1.0
        queue_factor = kv_factor
        if waiting is not None and waiting > 0:
            queue_ratio = waiting * inv_queue
            if queue_ratio > 1.0:
                queue_ratio = 1.0
            if queue_ratio > queue_factor:
                queue_factor = queue_ratio
        deduction = w_ttft * ttft_factor + w_errors * error_factor + w_queue * queue_factor
        health = 100.0 * (1.0 - deduction)
        if health < 0.0:
            health = 0.0
        elif health > 100.0:
            health = 100.0
        if penalty > 1.0:
            penalty = 1.0
        elif not penalty > 0.0:
            penalty = 0.0
        return factors(ttft_factor, error_factor, queue_factor, kv_factor, deduction, health, health * (1.0 - penalty))

    return score


class ScoreView:
    """A score that ramps linearly from ``start`` (at ``start_ts``) up to ``target`` (at ``ramp_end_ts``).

    Immutable by contract (a plain slotted class because it is built on every
    feedback call and a frozen dataclass costs several times more): feedback
    builds a new view and swaps the reference, so a pick holding the old one
    still reads a consistent value.
    """

    __slots__ = ("target", "start", "start_ts", "ramp_end_ts", "rate")

    def __init__(self, target: float, start: float, start_ts: float, ramp_end_ts: float, rate: float) -> None:
        self.target = target
        self.start = start
        self.start_ts = start_ts
        self.ramp_end_ts = ramp_end_ts
        self.rate = rate

    def __repr__(self) -> str:
        return (f"ScoreView(target={self.target:.2f}, start={self.start:.2f}, start_ts={self.start_ts}, "
                f"ramp_end_ts={self.ramp_end_ts}, rate={self.rate})")

    @classmethod
    def fixed(cls, score: float, now: float, rate: float) -> ScoreView:
        return cls(score, score, now, now, rate)

    @classmethod
    def warming(cls, start: float, target: float, now: float, rate: float) -> ScoreView:
        """A new or restarted backend: start low and ramp to the target."""
        return cls.fixed(target, now, rate) if target <= start else cls(target, start, now, now + (target - start) / rate, rate)

    def value(self, now: float) -> float:
        if now >= self.ramp_end_ts:
            return self.target
        return self.start + self.rate * (now - self.start_ts)

    def ramping(self, now: float) -> bool:
        return now < self.ramp_end_ts

    def retarget(self, target: float, now: float) -> ScoreView:
        """Falls apply at once; rises ramp from the current value at ``rate`` points per second."""
        current = self.value(now)
        if target <= current:
            return ScoreView(target, target, now, now, self.rate)
        if self.target == target and self.ramp_end_ts > now:
            return self  # same ramp still under way
        return ScoreView(target, current, now, now + (target - current) / self.rate, self.rate)
