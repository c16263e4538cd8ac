"""Adaptive weights for exporters that speak weights (HAProxy agent-check ``ready up N%``).

HAProxy takes integer percentages of the configured server weight, so the
output is ``weight_percent`` in 0..100. Two modes:

* ``score``: ``target = score`` (weight proportional to the health score);
* ``p99_ratio`` (seed 002): ``target = score / (p99 / best_p99)``, the base
  weight divided by how much slower this backend's p99 TTFT is than the
  fastest backend's. A backend with p99 2 s next to one with 1 s gets half
  the weight at the same score. Backends without a known p99 use ``score``.

Weights change at most once per ``update_interval_seconds`` and move by
``smoothing`` of the way to their target, so a weight-based gateway does not
oscillate. An ejected backend drops to 0 at once (falls are not smoothed
when the backend must get no traffic).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from llmdiag.config.balancer import WeightsConfig

__all__ = ["AdaptiveWeights", "WeightInput", "target_weights"]


@dataclass(frozen=True, slots=True)
class WeightInput:
    score: float
    p99_seconds: float | None = None
    #: No traffic at all (ejected): weight 0 at once.
    excluded: bool = False


def target_weights(inputs: Mapping[str, WeightInput], mode: str) -> dict[str, float]:
    """Unsmoothed target weights (0..100 floats) for every backend."""
    best = None
    if mode == "p99_ratio":
        known = [w.p99_seconds for w in inputs.values() if not w.excluded and _valid(w.p99_seconds)]
        best = min(known) if known else None
    out: dict[str, float] = {}
    for name, w in inputs.items():
        if w.excluded:
            out[name] = 0.0
            continue
        score = min(100.0, max(0.0, w.score))
        if best is not None and _valid(w.p99_seconds):
            # base weight / (p99 / best p99); best <= p99 so the ratio is >= 1.
            score = score / (w.p99_seconds / best)  # type: ignore[operator]
        out[name] = score
    return out


def _valid(p99: float | None) -> bool:
    return p99 is not None and p99 == p99 and p99 > 0


class AdaptiveWeights:
    """Rate-limited, smoothed ``weight_percent`` per backend (not thread-safe; the balancer locks)."""

    def __init__(self, cfg: WeightsConfig) -> None:
        self._cfg = cfg
        self._smoothed: dict[str, float] = {}
        self._updated_at: float | None = None

    def update(self, inputs: Mapping[str, WeightInput], now: float) -> dict[str, int]:
        """Recompute if ``update_interval_seconds`` have passed since the last update, then return the weights."""
        due = self._updated_at is None or now - self._updated_at >= self._cfg.update_interval_seconds
        new_names = any(name not in self._smoothed for name in inputs)
        if due or new_names:
            targets = target_weights(inputs, self._cfg.mode)
            alpha = self._cfg.smoothing
            smoothed: dict[str, float] = {}
            for name, target in targets.items():
                old = self._smoothed.get(name)
                if old is None or inputs[name].excluded:
                    smoothed[name] = target
                elif due:
                    smoothed[name] = old + alpha * (target - old)
                else:
                    smoothed[name] = old
            self._smoothed = smoothed
            if due:
                self._updated_at = now
        return {name: self.percent(name, inputs) for name in inputs}

    def percent(self, name: str, inputs: Mapping[str, WeightInput] | None = None) -> int:
        if inputs is not None and name in inputs and inputs[name].excluded:
            return 0
        return int(round(min(100.0, max(0.0, self._smoothed.get(name, 0.0)))))
