"""Engines' own ``/metrics`` fed to the gateway's balancer (``update_signals``).

The node agent turns engine metrics into penalties; the balancer also reads
the raw queue, KV usage and TTFT window of each engine directly (SPEC 6.3's
``update_signals``), as the simulator's llmdiag policy does. This task scrapes
every backend with the real engine collector (:mod:`llmdiag.collectors.engine`,
in a worker thread: it blocks) every ``interval`` seconds and hands each
backend's aggregated signals to the balancer. A backend whose scrape fails
gets nothing (unknown, never zero): only ``up`` goes through, so a restart
(``up`` 0 -> 1) starts its warm-up ramp. Scrapes reuse one keep-alive
connection per backend (the collectors' :class:`~llmdiag.collectors.http_fetch.KeepAlivePool`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from llmdiag.collectors.engine import EngineCollector
from llmdiag.collectors.http_fetch import KeepAlivePool
from llmdiag.config.engine import EngineConfig
from llmdiag.model import Scope
from llmdiag.router_feedback.balancer import Balancer

__all__ = ["ROUTING_SIGNALS", "EngineSignals"]

log = logging.getLogger(__name__)

#: What the balancer reads from a backend's signals.
ROUTING_SIGNALS = ("requests_waiting", "kv_cache_usage", "ttft_seconds", "up")


class EngineSignals:
    def __init__(self, balancer: Balancer, config: EngineConfig | None = None, interval: float = 1.0) -> None:
        self.balancer = balancer
        self.config = config or EngineConfig()
        self.interval = interval
        self._collector: EngineCollector | None = None
        self._fetch = KeepAlivePool()  # one kept-alive connection per backend, across collector rebuilds
        self._names: tuple[str, ...] = ()
        self.rounds_total = 0

    def collect_once(self) -> dict[str, dict[str, Any]]:
        """One scrape of every HTTP backend (blocking); returns and applies name -> routing signals."""
        backends = [b for b in self.balancer.backends if b.scheme in ("http", "https")]
        names = tuple(b.name for b in backends)
        if self._collector is None or names != self._names or any(
                a is not b for a, b in zip(self._collector.backends, backends)):
            if self._collector is not None:
                self._collector.close()
            self._collector = EngineCollector(backends, self.config, fetch=self._fetch)
            self._names = names
        per: dict[str, dict[str, Any]] = {}
        for s in self._collector.collect(time.monotonic()):
            if s.scope is Scope.BACKEND and s.name in ROUTING_SIGNALS:
                per.setdefault(s.subject, {})[s.name] = s.value
        out = {name: _usable(signals) for name, signals in per.items()}
        for name, signals in out.items():
            self.balancer.update_signals(name, signals)
        self.rounds_total += 1
        return out

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not stop.is_set():
                try:
                    await loop.run_in_executor(None, self.collect_once)
                except Exception:  # noqa: BLE001 - signals are an input; routing goes on without them
                    log.exception("engine signals round failed")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
        finally:
            if self._collector is not None:
                self._collector.close()
            self._fetch.close()


def _usable(signals: Mapping[str, Any]) -> dict[str, Any]:
    # A failed scrape says nothing about the queue or the cache: pass only ``up``.
    if signals.get("up") != 1:
        return {"up": signals.get("up", 0)}
    return dict(signals)
