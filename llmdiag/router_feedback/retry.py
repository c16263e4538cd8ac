"""Retry decisions (SPEC 6.3): at most ``max_retries``, exponential backoff with
full jitter, always on another backend, and only while nothing has been
streamed to the client (a completion is not idempotent once tokens flowed).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmdiag.config.balancer import BalancerConfig
from llmdiag.router_feedback.errors import Classification, ResponseClass

__all__ = ["RetryDecision", "RetryPolicy"]


@dataclass(frozen=True, slots=True)
class RetryDecision:
    retry: bool
    #: Seconds to wait before the next attempt.
    delay_seconds: float = 0.0
    why: str = ""


class RetryPolicy:
    """``decide(attempt, classification, status, first_byte_sent)``; the caller picks with ``exclude=tried``.

    ``attempt`` counts the attempts already made (1 after the first failure).
    ``rng`` is a ``random.Random``-like object (only ``random()`` is used).
    """

    def __init__(self, cfg: BalancerConfig, rng) -> None:
        self._cfg = cfg
        self._rng = rng
        self._statuses = frozenset(cfg.retry_statuses)

    def decide(self, attempt: int, classification: Classification, status: int | str, first_byte_sent: bool) -> RetryDecision:
        cfg = self._cfg
        if first_byte_sent:
            return RetryDecision(False, why="bytes already streamed to the client")
        if attempt > cfg.max_retries:
            return RetryDecision(False, why=f"{cfg.max_retries} retries used")
        cls = classification.response_class
        if cls is ResponseClass.CONNECT_ERROR or cls is ResponseClass.SATURATED:
            pass  # nothing reached the engine's batch: safe to send elsewhere
        elif cls is ResponseClass.TIMEOUT:
            if not cfg.retry_timeouts:
                return RetryDecision(False, why="timeouts are not retried (retry_timeouts = false)")
        elif not (isinstance(status, int) and status in self._statuses):
            return RetryDecision(False, why=f"{cls.value} is not retried")
        return RetryDecision(True, self.backoff(attempt), why=cls.value)

    def backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(max, base * 2 ** (attempt - 1))]."""
        cap = min(self._cfg.retry_backoff_max_seconds, self._cfg.retry_backoff_base_seconds * 2.0 ** max(0, min(attempt - 1, 30)))
        return cap * self._rng.random()
