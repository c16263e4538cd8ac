"""The balancer's output: per-backend states, weights and reasons for exporters and the agent."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import BackendPenalty, BackendState, Reason, Severity
from llmdiag.router_feedback.breaker import BreakerState
from llmdiag.router_feedback.health import Health
from llmdiag.router_feedback.routing import Slot
from llmdiag.router_feedback.weights import AdaptiveWeights, WeightInput

__all__ = ["BackendDeadlines", "backend_deadlines", "backend_penalties", "own_reasons"]


@dataclass(frozen=True, slots=True)
class BackendDeadlines:
    """When a backend's cooling and ejection end, in the balancer's clock (``Balancer.clock``).

    ``None`` when the backend is not cooling (not ejected). ``ejected_until`` is
    when the circuit goes half-open at the earliest: good probes may end it sooner,
    and a failing probe pushes it one probe interval later. Cooling can outlast an
    ejection, so both may be set; the backend's state says which one rules now.
    """

    cooling_until: float | None = None
    ejected_until: float | None = None


def backend_deadlines(health: Mapping[str, Health], now: float) -> dict[str, BackendDeadlines]:
    """Every backend's :class:`BackendDeadlines` at ``now``."""
    out = {}
    for name, h in health.items():
        cooling = h.cooling_until if h.cooling_until > now else None
        ejected = h.breaker.open_until if h.breaker.state is BreakerState.OPEN else None
        out[name] = BackendDeadlines(cooling, ejected)
    return out


def own_reasons(h: Health, state: BackendState, cfg: BalancerConfig, now: float) -> tuple[Reason, ...]:
    """The reasons the balancer adds itself: an open circuit, or cooling."""
    if state is BackendState.EJECTED:
        left = max(0.0, h.breaker.open_until - now)
        why = "reported down by the node agent" if h.down_reported else "ejected after consecutive failures"
        probes = h.breaker.probes_needed()
        return (Reason("circuit_open", Severity.CRITICAL, 1.0,
                       f"{why}; retry in {left:.0f} s or after {probes} good probe{'s' if probes > 1 else ''}"),)
    if state is BackendState.COOLING:
        left = max(0.0, h.cooling_until - now)
        what = "all" if cfg.errors.cooling_blocks_all else "long-context"
        return (Reason("cooling", Severity.WARNING, 0.0,
                       f"saturation response ({h.cooling_why}); no {what} requests for {left:.1f} s"),)
    return ()


def backend_penalties(
    slots: Mapping[str, Slot],
    health: Mapping[str, Health],
    state_of: Callable[[Slot, Health, float], BackendState],
    weights: AdaptiveWeights,
    cfg: BalancerConfig,
    now: float,
) -> list[BackendPenalty]:
    """Per backend: score, penalty, state, ``weight_percent`` and reasons (the balancer's reasons last)."""
    states: dict[str, BackendState] = {}
    inputs: dict[str, WeightInput] = {}
    for name, slot in slots.items():
        h = health[name]
        states[name] = state_of(slot, h, now)
        inputs[name] = WeightInput(slot.view.value(now), h.engine_ttft_p99, excluded=states[name] is BackendState.EJECTED)
    percents = weights.update(inputs, now)
    out = []
    for name, slot in slots.items():
        h = health[name]
        out.append(
            BackendPenalty(
                name=name,
                address=slot.backend.address,
                score=round(min(100.0, max(0.0, inputs[name].score)), 2),
                penalty=h.penalty,
                weight_percent=percents[name],
                state=states[name],
                reasons=h.reasons + own_reasons(h, states[name], cfg, now),
            )
        )
    return out
