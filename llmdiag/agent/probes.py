"""Active probes from the agent: the only requests the node agent makes to its engines itself.

Gateways see every response; the agent sees none, so without probes its balancer could
never cool or eject a backend. Every ``[balancer] probe_interval_seconds`` (and every
``probe_ejected_interval_seconds`` while ejected or half-open) each backend gets a 1-token
completion (:class:`llmdiag.router_feedback.probes.AiohttpProbeClient`):

* 200 with choices -> ``Balancer.on_probe(ok=True)`` (leaves ejection after ``probe_successes``);
* 429 or 503 -> ``Balancer.on_finish(status, body)``: the error classifier decides (a saturation
  body cools the backend: agent-check ``drain``; a client quota is not held against it);
* anything else (refused, timeout, 5xx, garbage) -> ``on_probe(ok=False)`` (``refused`` said, so that
  one good probe re-admits a restarted engine); ``consecutive_failures`` in a row eject the backend
  (agent-check ``down``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from llmdiag.model import Backend
from llmdiag.router_feedback.balancer import Balancer
from llmdiag.router_feedback.breaker import BreakerState
from llmdiag.router_feedback.probes import AiohttpProbeClient, ProbeClient, ProbeResult

__all__ = ["AgentProber"]

log = logging.getLogger("llmdiag.agent")


class AgentProber:
    def __init__(self, balancer: Callable[[], Balancer], client: ProbeClient | None = None,
                 clock: Callable[[], float] | None = None, tick_seconds: float = 0.5) -> None:
        self._balancer = balancer
        self._client = client
        self._clock = clock
        self._tick = tick_seconds
        self._last_at: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self.probes_total = 0
        self.failures_total = 0

    def start(self) -> None:
        if self._client is None:
            balancer = self._balancer()
            self._client = AiohttpProbeClient(prompt=balancer.config.probe_prompt)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="llmdiag-agent-probes")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()

    async def run_once(self) -> dict[str, ProbeResult]:
        balancer = self._balancer()
        cfg = balancer.config
        now = (self._clock or balancer.clock)()
        due: list[Backend] = []
        for backend, state in balancer.probe_targets():
            interval = cfg.probe_interval_seconds if state is BreakerState.CLOSED else cfg.probe_ejected_interval_seconds
            last = self._last_at.get(backend.name)
            if last is None or now - last >= interval or now < last:
                due.append(backend)
                self._last_at[backend.name] = now
        if not due:
            return {}
        assert self._client is not None
        results = await asyncio.gather(*(self._probe(b, cfg.probe_timeout_seconds) for b in due))
        out: dict[str, ProbeResult] = {}
        for backend, result in zip(due, results):
            self.probes_total += 1
            out[backend.name] = result
            if result.ok:
                balancer.on_probe(backend.name, True)
            elif result.status in (429, 503):
                balancer.on_finish(backend.name, result.status, result.detail)
            else:
                self.failures_total += 1
                log.info("probe of %s failed: %s", backend.name, result.detail or result.status)
                balancer.on_probe(backend.name, False, refused=result.refused)
        return out

    async def _probe(self, backend: Backend, timeout: float) -> ProbeResult:
        assert self._client is not None
        model = backend.models[0] if backend.models else None
        try:
            return await asyncio.wait_for(self._client.probe(backend, model, timeout), timeout + 1.0)
        except asyncio.TimeoutError:
            return ProbeResult(False, None, None, f"timeout after {timeout:g} s")
        except Exception as exc:  # noqa: BLE001 - a broken probe must not stop probing the others
            return ProbeResult(False, None, None, f"{type(exc).__name__}: {exc}")

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except Exception:  # noqa: BLE001 - keep probing; one bad round must not end health checking
                log.exception("probe round failed")
            await asyncio.sleep(self._tick)
