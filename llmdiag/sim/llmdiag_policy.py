"""llmdiag's real balancer as a simulator policy, fed as in production.

- ``pick``: :meth:`Balancer.pick` with the prompt size and the engines already
  tried (retries go elsewhere);
- gateway feedback: ``on_first_token`` with the gateway-observed TTFT and
  ``on_finish`` with the status, body and headers of every attempt;
- ``update_signals`` from the scraped engine metrics, at the node agent's
  snapshot interval (``signal_interval_s``, default 1 s: the agent tick), so
  they are as stale as in production;
- ``set_penalty`` from the node agents' penalties, delivered by the simulator
  with its detection delay;
- active probes: the real :class:`~llmdiag.router_feedback.probes.ProbeRunner`
  (30 s per healthy backend, 5 s while ejected or half-open) runs one round per
  agent tick on a private event loop, with a :class:`SimProbeClient` that
  answers from the engine: good when the engine is up and would give a
  1-token prompt its first token within the probe timeout (the probe itself is
  not queued in the engine: one tiny request every few seconds).

Clock and RNG are the simulator's (virtual time, seeded).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import Backend
from llmdiag.router_feedback.balancer import Balancer, NoBackendAvailable
from llmdiag.router_feedback.probes import ProbeResult, ProbeRunner
from llmdiag.sim.engine_model import SimRequest
from llmdiag.sim.policies import GatewayView, Outcome, Policy

__all__ = ["LlmdiagNoPenaltiesPolicy", "LlmdiagPolicy", "MODEL", "SimProbeClient"]

MODEL = "sim-model"


class SimProbeClient:
    """A :class:`~llmdiag.router_feedback.probes.ProbeClient` answered by the engine models."""

    def __init__(self, gw: GatewayView, index: dict[str, int], clock: Callable[[], float]) -> None:
        self._gw = gw
        self._index = index
        self._clock = clock

    async def probe(self, backend: Backend, model: str | None, timeout: float) -> ProbeResult:
        engine = self._gw.engines[self._index[backend.name]]
        if engine.down:
            return ProbeResult(False, None, None, "connection refused", refused=True)
        wait = engine.estimate_ttft(1, self._clock())
        if wait > timeout:
            return ProbeResult(False, None, None, f"timeout after {timeout:g} s")
        return ProbeResult(True, wait, 200)

    async def close(self) -> None:
        return None


class LlmdiagPolicy(Policy):
    name = "llmdiag"
    needs_scrape = True
    needs_penalties = True

    def __init__(
        self,
        gw: GatewayView,
        rng: random.Random,
        clock: Callable[[], float],
        config: BalancerConfig | None = None,
        signal_interval_s: float = 1.0,
    ) -> None:
        super().__init__(gw, rng, clock)
        self.backends = [
            Backend(name=name, url=f"http://10.0.{i // 250}.{i % 250 + 1}:8000", engine="vllm", models=(MODEL,))
            for i, name in enumerate(gw.names)
        ]
        self.index = {b.name: i for i, b in enumerate(self.backends)}
        self.balancer = Balancer(self.backends, config, clock=clock, rng=rng)
        self.signal_interval_s = signal_interval_s
        self._next_signals = 0.0
        self.probes = ProbeRunner(self.balancer, SimProbeClient(gw, self.index, clock), clock=clock)
        self._loop: asyncio.AbstractEventLoop | None = None

    def pick(self, req: SimRequest, now: float, exclude: frozenset[int]) -> int | None:
        try:
            backend = self.balancer.pick(
                MODEL, req.prompt, exclude=[self.backends[i] for i in exclude] if exclude else ()
            )
        except NoBackendAvailable:
            return None
        return self.index[backend.name]

    def on_first_token(self, i: int, req: SimRequest, ttft: float, now: float) -> None:
        self.balancer.on_first_token(self.backends[i], ttft, prompt_tokens=req.prompt)

    def on_finish(self, i: int, req: SimRequest, outcome: Outcome, first_token_seen: bool, now: float) -> None:
        self.balancer.on_finish(
            self.backends[i],
            outcome.status,
            outcome.body,
            outcome.headers,
            first_token_seen=first_token_seen,
            prompt_tokens=req.prompt,
        )

    def on_scrape(self, now: float) -> None:
        if now + 1e-9 < self._next_signals:
            return
        self._next_signals = now + self.signal_interval_s
        for i, s in enumerate(self.gw.scraped):
            signals: dict[str, Any] = {"up": float(s.up)}
            if s.up:
                signals.update(
                    requests_waiting=float(s.waiting),
                    requests_running=float(s.running),
                    kv_cache_usage=s.kv_usage,
                    kv_capacity_tokens=float(s.kv_capacity_tokens),
                    preemptions_total=float(s.preemptions_total),
                )
            else:
                signals.update(requests_waiting=None, requests_running=None, kv_cache_usage=None)
            self.balancer.update_signals(self.backends[i], signals)

    def on_penalty(self, i: int, penalty: float, reasons: tuple[Any, ...], now: float) -> None:
        self.balancer.set_penalty(self.backends[i], penalty, reasons)

    def on_probe_tick(self, now: float) -> None:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self.probes.run_once())

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None


class LlmdiagNoPenaltiesPolicy(LlmdiagPolicy):
    """The same balancer without the node agents' penalties: the gateway's own view and the engine metrics.

    Run next to ``llmdiag`` to see what the penalties add (issue 14: they must
    never make a fault the gateway can see for itself worse).
    """

    name = "llmdiag_no_penalties"
    needs_penalties = False
