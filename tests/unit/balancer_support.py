"""Helpers for the balancer tests: a virtual clock, a scripted RNG and small fleets."""

from __future__ import annotations

import random
from collections.abc import Iterable

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import Backend
from llmdiag.router_feedback.balancer import Balancer


class VirtualClock:
    """``clock()`` returns seconds; tests move time with ``advance``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ScriptedRandom:
    """A ``random.Random`` stand-in that returns scripted ``random()`` values in order.

    Inject it through the constructor (``Balancer(..., rng=scripted)``), then call
    :meth:`script` right before the calls it should steer; ``calls`` counts the draws
    since. Past the script, draws come from ``fallback`` when one is given, and are an
    error otherwise (so an unexpected draw fails the test instead of passing silently)."""

    def __init__(self, values: Iterable[float] = (), fallback: random.Random | None = None) -> None:
        self.values = list(values)
        self.fallback = fallback
        self.calls = 0

    def script(self, values: Iterable[float]) -> None:
        """Queue ``values`` for the next draws and restart the ``calls`` count."""
        self.values = list(values)
        self.calls = 0

    def random(self) -> float:
        self.calls += 1
        if self.values:
            return self.values.pop(0)
        if self.fallback is not None:
            return self.fallback.random()
        raise AssertionError(f"scripted RNG ran out after {self.calls - 1} calls")


def fleet(n: int, models: tuple[str, ...] = ("m",)) -> list[Backend]:
    return [Backend(name=f"b{i}", url=f"http://10.0.0.{i + 1}:8000", engine="vllm", models=models) for i in range(n)]


def warmed(balancer: Balancer, clock: VirtualClock) -> Balancer:
    """Let every backend's warm-up ramp finish (10 -> 100 at 15 points/s takes 6 s)."""
    clock.advance(60.0)
    return balancer


def make(n: int = 2, config: BalancerConfig | None = None, rng=None, clock: VirtualClock | None = None,
         models: tuple[str, ...] = ("m",)) -> tuple[Balancer, VirtualClock]:
    clock = clock or VirtualClock()
    balancer = Balancer(fleet(n, models), config=config, clock=clock, rng=rng if rng is not None else random.Random(0))
    warmed(balancer, clock)
    return balancer, clock


def set_score(balancer: Balancer, name: str, waiting: float) -> None:
    """Lower a backend's score through the queue factor: score = 100 * (1 - 0.25 * waiting / 30)."""
    balancer.update_signals(name, {"requests_waiting": waiting})
