"""Backends from DNS: the addresses of a name, re-resolved on an interval.

In Kubernetes a headless Service (``clusterIP: None``) whose selector matches
an InferencePool's model-server pods resolves to the IPs of those pods that
are ready, so the picker follows scale-ups, restarts and evictions without
talking to the API server. Each address becomes a backend
``http://IP:PORT`` named ``IP:PORT`` serving ``models``.

A failed resolution (no such name, timeout) keeps the last known set: a
DNS hiccup must not empty the pool. An answer with no addresses is taken as
it is (the pool really is empty; requests get 503 with a reason).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from llmdiag.config.picker import split_listen
from llmdiag.model import Backend

__all__ = ["DnsBackends"]

log = logging.getLogger("llmdiag.picker")

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def _resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


class DnsBackends:
    """``target`` is ``HOST:PORT``; :meth:`poll` resolves it once, :meth:`run` keeps doing it."""

    def __init__(self, target: str, models: Iterable[str] = (), interval: float = 5.0, timeout: float = 2.0,
                 resolve: Resolver = _resolve) -> None:
        self.host, self.port = split_listen(target, "discover")
        self.models = tuple(models)
        self.interval = interval
        self.timeout = timeout
        self._resolve = resolve
        self.backends: list[Backend] | None = None  # None until the first good answer
        self.errors_total = 0
        self._last_error = ""

    async def poll(self) -> bool:
        """Resolve once; True when the backend set changed."""
        try:
            addresses = await asyncio.wait_for(self._resolve(self.host, self.port), self.timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            self.errors_total += 1
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if why != self._last_error:
                log.warning("resolving %s failed (%s); keeping the %s backends known", self.host, why,
                            len(self.backends or ()))
            self._last_error = why
            return False
        self._last_error = ""
        seen: dict[str, Backend] = {}
        for ip in addresses:
            url = f"http://[{ip}]:{self.port}" if ":" in ip else f"http://{ip}:{self.port}"
            backend = Backend.from_url(url, models=self.models)
            seen.setdefault(backend.name, backend)
        backends = sorted(seen.values(), key=lambda b: b.name)
        if self.backends is not None and [b.name for b in backends] == [b.name for b in self.backends]:
            return False
        if self.backends is not None or backends:
            log.info("%s resolves to %d backends: %s", self.host, len(backends), ", ".join(b.name for b in backends))
        self.backends = backends
        return True

    async def run(self, apply: Callable[[list[Backend]], Any], stop: asyncio.Event) -> None:
        """Re-resolve every ``interval`` until ``stop``; ``apply(backends)`` after each change."""
        while not stop.is_set():
            if await self.poll():
                apply(list(self.backends or ()))
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
