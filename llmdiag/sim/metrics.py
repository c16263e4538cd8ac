"""What a simulator run measured, and how the numbers are defined.

- TTFT is client-observed: from the request's arrival at the gateway to its
  first token (retries included). A request the client cancelled before its
  first token (``client_timeout_s``) counts with the time it waited, a lower
  bound: leaving it out would reward a policy for starving requests.
- E2E: arrival to last token, successful requests only.
- goodput: successful requests whose TTFT met the SLO (default 2 s), per
  second of the arrival span.
- throughput: generated tokens of successful requests per second of the
  arrival span.
- rejected_429: requests whose final answer was a 429 (after retries).
- oscillation index: the mean total-variation distance between the shares of
  dispatches each engine got in consecutive 1 s windows (0 = the split never
  changes, 1 = all traffic flips to other engines every window). Herding on
  stale metrics shows as high values; a random split of a few dozen requests
  per window has some baseline noise, so compare policies with each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmdiag.sim.engine_model import EngineModel, SimRequest

__all__ = ["RunMetrics", "RunResult", "percentile"]


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile of already sorted values (None when empty)."""
    n = len(sorted_values)
    if n == 0:
        return None
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_values[lo] * (1.0 - frac) + sorted_values[hi] * frac


@dataclass
class RunResult:
    policy: str
    requests: int
    outcomes: dict[str, int]
    ttft_p50: float | None
    ttft_p99: float | None
    e2e_p99: float | None
    goodput_rps: float
    throughput_tokens_per_s: float
    rejected_429: int
    preemptions: int
    oscillation_index: float
    duration_s: float
    engine_steps: int
    wall_seconds: float
    unfinished: int
    dispatch_share: list[float]
    series: dict[str, Any] = field(default_factory=dict, repr=False)
    notes: list[tuple[float, str]] = field(default_factory=list, repr=False)
    #: The TTFT distribution as (quantile, seconds) points, 0..1 in steps of 0.005 (for the CDF plot).
    ttft_quantiles: list[tuple[float, float]] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """The JSON fields of ``llmdiag bench sim --json`` for one policy."""
        return {
            "ttft_p50": self.ttft_p50,
            "ttft_p99": self.ttft_p99,
            "e2e_p99": self.e2e_p99,
            "goodput_rps": round(self.goodput_rps, 4),
            "throughput_tokens_per_s": round(self.throughput_tokens_per_s, 2),
            "rejected_429": self.rejected_429,
            "preemptions": self.preemptions,
            "oscillation_index": round(self.oscillation_index, 4),
            "requests": self.requests,
            "outcomes": dict(sorted(self.outcomes.items())),
            "unfinished": self.unfinished,
            "engine_steps": self.engine_steps,
            "wall_seconds": round(self.wall_seconds, 3),
        }


class RunMetrics:
    def __init__(self, n_engines: int, ttft_slo_s: float, sample_interval_s: float) -> None:
        self.n = n_engines
        self.slo = ttft_slo_s
        self.sample_interval_s = sample_interval_s
        self.arrived = 0
        self.outcomes: dict[str, int] = {}
        self.ttfts: list[float] = []
        self.e2es: list[float] = []
        self.tokens = 0
        self.good = 0
        self.unfinished = 0
        self.sim_end = 0.0
        self.wall_seconds = 0.0
        self.engine_steps = 0
        self.preemptions = 0
        self._window = [0] * n_engines
        self._total_dispatch = [0] * n_engines
        self._prev_share: list[float] | None = None
        self._tv_sum = 0.0
        self._tv_count = 0
        self.series: dict[str, Any] = {
            "t": [],
            "waiting": [[] for _ in range(n_engines)],
            "kv_usage": [[] for _ in range(n_engines)],
            "dispatch_rate": [[] for _ in range(n_engines)],
        }
        self.notes: list[tuple[float, str]] = []

    def dispatched(self, i: int, now: float) -> None:
        self._window[i] += 1

    def first_token(self, req: SimRequest, now: float) -> None:
        req.ttft = now - req.arrival

    def final(self, req: SimRequest, kind: str, now: float) -> None:
        self.outcomes[kind] = self.outcomes.get(kind, 0) + 1
        if kind == "ok":
            ttft = req.ttft if req.ttft is not None else now - req.arrival
            self.ttfts.append(ttft)
            self.e2es.append(now - req.arrival)
            self.tokens += req.output
            if ttft <= self.slo:
                self.good += 1
        elif kind == "timeout":
            self.ttfts.append(now - req.arrival)  # censored: it waited at least this long
        elif req.ttft is not None:
            self.ttfts.append(req.ttft)  # failed after its first token (crash mid-stream)

    def note(self, now: float, text: str) -> None:
        self.notes.append((now, text))

    def sample(self, now: float, engines: Sequence[EngineModel]) -> None:
        s = self.series
        s["t"].append(now)
        window = self._window
        total = sum(window)
        for i, eng in enumerate(engines):
            s["waiting"][i].append(len(eng.waiting))
            s["kv_usage"][i].append(round(eng.kv_usage, 4))
            s["dispatch_rate"][i].append(window[i] / self.sample_interval_s)
            self._total_dispatch[i] += window[i]
        if total > 0:
            share = [c / total for c in window]
            if self._prev_share is not None:
                self._tv_sum += 0.5 * sum(abs(a - b) for a, b in zip(share, self._prev_share))
                self._tv_count += 1
            self._prev_share = share
        self._window = [0] * self.n

    def result(self, policy: str, duration: float) -> RunResult:
        ttfts = sorted(self.ttfts)
        e2es = sorted(self.e2es)
        duration = max(duration, 1e-9)
        total = sum(self._total_dispatch) + sum(self._window)
        shares = [(a + b) / total if total else 0.0 for a, b in zip(self._total_dispatch, self._window)]
        rejected = self.outcomes.get("rejected_429", 0)
        return RunResult(
            policy=policy,
            requests=self.arrived,
            outcomes=dict(self.outcomes),
            ttft_p50=_round(percentile(ttfts, 50)),
            ttft_p99=_round(percentile(ttfts, 99)),
            e2e_p99=_round(percentile(e2es, 99)),
            goodput_rps=self.good / duration,
            throughput_tokens_per_s=self.tokens / duration,
            rejected_429=rejected,
            preemptions=self.preemptions,
            oscillation_index=self._tv_sum / self._tv_count if self._tv_count else 0.0,
            duration_s=duration,
            engine_steps=self.engine_steps,
            wall_seconds=self.wall_seconds,
            unfinished=self.unfinished,
            dispatch_share=[round(x, 4) for x in shares],
            series=self.series,
            notes=self.notes,
            ttft_quantiles=[(q / 200, ttfts[min(len(ttfts) - 1, round(q / 200 * (len(ttfts) - 1)))])
                            for q in range(201)] if ttfts else [],
        )


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
