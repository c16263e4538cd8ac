"""``[balancer]``: the health score (SPEC 6.1), error classification (6.2) and the scoring balancer (6.3).

One TOML section with sub-tables::

    [balancer]              # pick, load, circuit breaker, probes, retries
    choices = 2
    [balancer.score]        # 6.1 weights, thresholds, EWMA alpha, warm-up ramp
    [balancer.errors]       # 6.2 body patterns, cooling, Retry-After
    [balancer.weights]      # adaptive weights for weight-speaking exporters

Every key has a default; a bad range raises ``ValueError`` naming the key, which
the loader turns into a :class:`~llmdiag.config.ConfigError` with the section path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["BalancerConfig", "ErrorsConfig", "ScoreConfig", "WeightsConfig"]


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def _unit(name: str, value: float, *, open_low: bool = False) -> None:
    ok = (0 < value <= 1) if open_low else (0 <= value <= 1)
    if not ok:
        raise ValueError(f"{name} must be in {'(0' if open_low else '[0'}, 1], got {value!r}")


@dataclass(frozen=True)
class ScoreConfig:
    """SPEC 6.1 (seed 000): deductions for TTFT, errors and queue/KV, then the penalty multiplier."""

    weight_ttft: float = 0.35
    weight_errors: float = 0.40
    weight_queue: float = 0.25
    #: TTFT at which the TTFT factor saturates at 1 (the factor grows with the square of the ratio).
    ttft_threshold_seconds: float = 2.0
    #: EWMA alpha for TTFT observations (``on_first_token``): new = alpha * x + (1 - alpha) * old.
    ttft_ewma_alpha: float = 0.2
    #: Own TTFT observations older than this are ignored (the backend may have recovered unobserved).
    ttft_stale_seconds: float = 30.0
    #: error_factor = min(1, error_multiplier * error ratio): 20 % errors saturate the factor.
    error_multiplier: float = 5.0
    #: Errors and successes decay with this half-life ("the recent window").
    error_half_life_seconds: float = 10.0
    #: Waiting requests at which the queue factor saturates.
    max_queue: float = 30.0
    #: KV usage above this starts to deduct, linearly to 1 at full cache.
    kv_threshold: float = 0.80
    #: Warm-up ramp: a score rises at most this many points per second; it falls at once.
    recovery_points_per_second: float = 15.0
    #: Score a new or restarted backend starts from (state ``warming``) before ramping.
    warming_start_score: float = 10.0
    #: Below this score a backend is reported ``degraded``.
    degraded_below: float = 80.0

    def __post_init__(self) -> None:
        for name in ("weight_ttft", "weight_errors", "weight_queue"):
            _non_negative(name, getattr(self, name))
        total = self.weight_ttft + self.weight_errors + self.weight_queue
        if not 0 < total <= 1.0 + 1e-9:
            raise ValueError(f"weight_ttft + weight_errors + weight_queue must be in (0, 1], got {total:g}")
        _positive("ttft_threshold_seconds", self.ttft_threshold_seconds)
        _unit("ttft_ewma_alpha", self.ttft_ewma_alpha, open_low=True)
        _positive("ttft_stale_seconds", self.ttft_stale_seconds)
        _positive("error_multiplier", self.error_multiplier)
        _positive("error_half_life_seconds", self.error_half_life_seconds)
        _positive("max_queue", self.max_queue)
        if not 0 <= self.kv_threshold < 1:
            raise ValueError(f"kv_threshold must be in [0, 1), got {self.kv_threshold!r}")
        _positive("recovery_points_per_second", self.recovery_points_per_second)
        if not 0 <= self.warming_start_score <= 100:
            raise ValueError(f"warming_start_score must be in 0..100, got {self.warming_start_score!r}")
        if not 0 <= self.degraded_below <= 100:
            raise ValueError(f"degraded_below must be in 0..100, got {self.degraded_below!r}")


_SATURATION_PATTERNS = (
    r"kv[ _-]?cache (is )?(exhausted|full)",
    r"out of kv[ _-]?cache",
    r"no (free|available) (kv[ _-]?cache )?blocks",
    r"engine (is )?(saturated|overloaded)",
    r"server (is )?overloaded",
    r"queue (is )?full",
    r"too many (pending |waiting )?requests in (the )?queue",
    r"(waiting|pending) queue (limit|is full)",
    r"max(imum)? (number of )?(waiting|pending|queued) requests",
)

_CLIENT_QUOTA_PATTERNS = (
    r"rate limit (exceeded|reached) for (the )?(api[ _-]?key|key|user|tenant|organi[sz]ation|org|project|team)",
    r"(api[ _-]?key|user|tenant|organi[sz]ation|project|team)('s)? (rate[ _-]?limit|quota)",
    r"per[ _-](user|tenant|key|api[ _-]?key) (rate )?limit",
    r"insufficient[ _]quota",
    r"quota exceeded",
)

_CLIENT_QUOTA_HEADERS = (
    "x-ratelimit-scope",
    "x-api-key-ratelimit-limit",
    "x-ratelimit-api-key",
    "x-ratelimit-user",
    "x-ratelimit-tenant",
)


@dataclass(frozen=True)
class ErrorsConfig:
    """SPEC 6.2: which failed responses count against a backend, and cooling after saturation."""

    #: Regular expressions (case-insensitive) that mark a 429/503 body as engine saturation.
    saturation_patterns: tuple[str, ...] = _SATURATION_PATTERNS
    #: Regular expressions (case-insensitive) that mark a 429 body as a client's own quota (not counted).
    client_quota_patterns: tuple[str, ...] = _CLIENT_QUOTA_PATTERNS
    #: Response headers whose presence on a 429 names the client's key/user/tenant limit (not counted).
    client_quota_headers: tuple[str, ...] = _CLIENT_QUOTA_HEADERS
    #: Only this many leading bytes of a body are searched (bodies can be large or hostile).
    body_prefix_bytes: int = 2048
    #: A 429 whose body and headers match nothing: "saturated" (engine, the common case on
    #: inference servers per seed 000), "client" (not counted) or "error" (counted, no cooling).
    unknown_429: Literal["saturated", "client", "error"] = "saturated"
    #: Cooling after a saturation response lasts a uniformly jittered time in this range.
    cooling_min_seconds: float = 3.0
    cooling_max_seconds: float = 5.0
    #: While cooling, requests with at least this many estimated prompt tokens go elsewhere.
    long_context_tokens: int = 8192
    #: While cooling, send the backend no requests at all (not only long-context ones).
    cooling_blocks_all: bool = False
    #: ``Retry-After`` on a saturation 429/503 extends cooling up to this many seconds.
    retry_after_max_seconds: float = 60.0

    def __post_init__(self) -> None:
        for key in ("saturation_patterns", "client_quota_patterns"):
            for pattern in getattr(self, key):
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ValueError(f"{key}: bad regular expression {pattern!r}: {exc}") from None
        if self.body_prefix_bytes < 16:
            raise ValueError(f"body_prefix_bytes must be >= 16, got {self.body_prefix_bytes}")
        _positive("cooling_min_seconds", self.cooling_min_seconds)
        if self.cooling_max_seconds < self.cooling_min_seconds:
            raise ValueError(
                f"cooling_max_seconds ({self.cooling_max_seconds}) must be >= cooling_min_seconds ({self.cooling_min_seconds})"
            )
        _non_negative("long_context_tokens", self.long_context_tokens)
        _non_negative("retry_after_max_seconds", self.retry_after_max_seconds)


@dataclass(frozen=True)
class WeightsConfig:
    """Adaptive weights (integer ``weight_percent`` 0..100) for exporters that speak weights (HAProxy)."""

    #: ``score``: weight proportional to the score. ``p99_ratio`` (seed 002): base weight divided by
    #: (p99 TTFT / best p99 TTFT in the pool), times the score; falls back to ``score`` without p99.
    mode: Literal["score", "p99_ratio"] = "score"
    #: Recompute at most this often.
    update_interval_seconds: float = 1.0
    #: Smoothing of each update: new = old + smoothing * (target - old); 1 = no smoothing.
    smoothing: float = 0.5

    def __post_init__(self) -> None:
        _positive("update_interval_seconds", self.update_interval_seconds)
        _unit("smoothing", self.smoothing, open_low=True)


@dataclass(frozen=True)
class BalancerConfig:
    """SPEC 6.3: power of d choices over work-based load, passive and active health, retries."""

    #: d in "power of d choices"; 0 means all (a full scan). SPEC 6.3 says 2; 4 was measured
    #: better in the simulator sweep (bench/sweep_balancer.py, docs/simulator.md).
    choices: int = 4
    #: Sample candidates with replacement (Envoy's P2C) instead of d distinct ones.
    with_replacement: bool = False
    #: Pools of at most this many eligible backends are scanned in full instead of sampled (pick stays
    #: O(d) above it). 0 = always sample d. 8 = 2 d: where d choices would sample half the pool or more,
    #: a scan costs little more (~8 candidates, ~2 us) and never misses the best backend; measured in the
    #: simulator on long prompts (issue 14 point 3, docs/benchmarks.md).
    full_scan_up_to: int = 8
    #: effective = score / (1 + in_flight_penalty * load).
    in_flight_penalty: float = 0.1
    #: load = (pending prefill tokens + this prompt) * slowness ** prefill_slowness_exponent / tokens_per_slot
    #: + in-flight requests.
    #: 32 from the sweep (was 2048, at which the ~90 decoding requests of a busy engine drowned the
    #: prefill backlog that makes TTFT).
    tokens_per_slot: float = 32.0
    #: Weight of each drained request in a backend's measured prefill speed (busy seconds per prompt
    #: token of our own dispatches); the backend's slowness relative to the pool's mean scales its
    #: pending tokens in the load. 0 turns the measurement off (every backend's tokens count alike).
    prefill_speed_alpha: float = 0.05
    #: The measured slowness weighs pending tokens as ``slowness ** prefill_slowness_exponent``. 1 takes
    #: the measurement at face value; 0.5 (measured, issue 14 point 3) keeps most of its benefit on long
    #: prompts and in mixed pools, and stops it from starving a throttled replica on short prompts, where
    #: the measurement (busy time per drained token, queueing included) overstates the slowness.
    prefill_slowness_exponent: float = 0.5
    #: A drain counts as a speed sample only when the backend held at least this many pending
    #: prompt tokens (nearly idle engines are dominated by per-step overhead and would look slow).
    prefill_sample_min_tokens: int = 2048
    #: A backend's speed estimate with no new sample for this long is dropped (slowness 1 again), so a
    #: backend once judged slow gets work, a backlog and fresh samples.
    prefill_speed_stale_seconds: float = 30.0
    #: Passive health: this many consecutive failures eject (open the circuit).
    consecutive_failures: int = 3
    #: First ejection lasts this long; each repeated ejection doubles it up to ejection_max_seconds.
    ejection_base_seconds: float = 15.0
    ejection_max_seconds: float = 60.0
    #: Consecutive successes needed in half-open to close, and probe successes to leave ejection.
    half_open_successes: int = 2
    probe_successes: int = 2
    #: Requests admitted at once to a half-open backend: at least this many ...
    half_open_max_in_flight: int = 1
    #: ... or this share of the mean in-flight requests of the closed backends, whichever is more
    #: (a recovered engine in a busy pool must not take one request at a time; issue 14).
    half_open_share: float = 0.5
    #: Active probes: interval for healthy backends, interval while ejected/half-open, timeout.
    probe_interval_seconds: float = 30.0
    probe_ejected_interval_seconds: float = 5.0
    probe_timeout_seconds: float = 5.0
    #: Prompt of the 1-token probe completion.
    probe_prompt: str = "ping"
    #: Retries: at most this many, exponential backoff with full jitter, never the same backend.
    max_retries: int = 2
    retry_backoff_base_seconds: float = 0.05
    retry_backoff_max_seconds: float = 1.0
    #: Statuses retried on another backend when nothing was streamed yet (saturation 429s
    #: are retried too; client-quota 429s never are).
    retry_statuses: tuple[int, ...] = (502, 503, 504)
    #: Also retry timeouts that happened before the first byte.
    retry_timeouts: bool = True
    #: Diagnosis kinds whose penalty the balancer does not charge, because its own feedback already
    #: measures the same fact (docs/balancer.md "What a penalty may carry"): slowness (measured prefill
    #: speed, TTFT), KV and queue (the engine's metrics in the score), errors and timeouts (classified
    #: responses). Charging them too counts one fact twice; the reasons are still reported.
    self_observed_kinds: tuple[str, ...] = (
        "gpu_throttling",
        "kv_cache_saturation",
        "queue_avalanche",
        "false_healthy",
        "error_burst",
        "client_timeout_storm",
    )
    #: Diagnosis kinds that eject the backend (open its circuit) when reported, instead of scoring it;
    #: probes re-admit it (one good probe after a refused connection).
    eject_kinds: tuple[str, ...] = ("backend_down",)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    errors: ErrorsConfig = field(default_factory=ErrorsConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)

    def __post_init__(self) -> None:
        if self.choices < 0:
            raise ValueError(f"choices must be >= 0 (0 = all backends), got {self.choices}")
        if self.full_scan_up_to < 0:
            raise ValueError(f"full_scan_up_to must be >= 0, got {self.full_scan_up_to}")
        _non_negative("in_flight_penalty", self.in_flight_penalty)
        _positive("tokens_per_slot", self.tokens_per_slot)
        _unit("prefill_speed_alpha", self.prefill_speed_alpha)
        _unit("prefill_slowness_exponent", self.prefill_slowness_exponent)
        _non_negative("prefill_sample_min_tokens", self.prefill_sample_min_tokens)
        _positive("prefill_speed_stale_seconds", self.prefill_speed_stale_seconds)
        for key in ("consecutive_failures", "half_open_successes", "probe_successes", "half_open_max_in_flight"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        _unit("half_open_share", self.half_open_share)
        for key in ("self_observed_kinds", "eject_kinds"):
            for kind in getattr(self, key):
                if not isinstance(kind, str) or not kind:
                    raise ValueError(f"{key}: diagnosis kinds are non-empty strings, got {kind!r}")
        _positive("ejection_base_seconds", self.ejection_base_seconds)
        if self.ejection_max_seconds < self.ejection_base_seconds:
            raise ValueError(
                f"ejection_max_seconds ({self.ejection_max_seconds}) must be >= ejection_base_seconds ({self.ejection_base_seconds})"
            )
        _positive("probe_interval_seconds", self.probe_interval_seconds)
        _positive("probe_ejected_interval_seconds", self.probe_ejected_interval_seconds)
        _positive("probe_timeout_seconds", self.probe_timeout_seconds)
        if not 0 <= self.max_retries <= 10:
            raise ValueError(f"max_retries must be in 0..10, got {self.max_retries}")
        _non_negative("retry_backoff_base_seconds", self.retry_backoff_base_seconds)
        if self.retry_backoff_max_seconds < self.retry_backoff_base_seconds:
            raise ValueError("retry_backoff_max_seconds must be >= retry_backoff_base_seconds")
        for status in self.retry_statuses:
            if not 100 <= status <= 599:
                raise ValueError(f"retry_statuses: {status} is not an HTTP status")
