"""Sampled traffic mirroring to a shadow backend (seed 002).

A mirrored request is a copy sent on its own task: its answer is read and
thrown away, its failures are counted, and nothing about it can reach, delay
or change the client's response. At most ``max_in_flight`` copies run at once;
beyond that copies are dropped (counted), so a slow shadow cannot pile up
memory or sockets in the gateway.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["Mirror"]

log = logging.getLogger(__name__)


class Mirror:
    def __init__(self, url: str, fraction: float, max_in_flight: int, session: Any, timeout: float, rng: Any,
                 counter: Any = None) -> None:
        self.url = url.rstrip("/")
        self.fraction = fraction
        self.max_in_flight = max_in_flight
        self._session = session
        self._timeout = timeout
        self._rng = rng
        self._counter = counter  # prometheus Counter with an ``outcome`` label, or None
        self._tasks: set[asyncio.Task[None]] = set()
        self.outcomes: dict[str, int] = {"sent": 0, "ok": 0, "error": 0, "dropped": 0}

    def maybe(self, path: str, body: bytes, headers: list[tuple[str, str]]) -> bool:
        """Mirror this request with probability ``fraction``; never blocks. Returns whether a copy was started."""
        if self.fraction <= 0.0 or self._rng.random() >= self.fraction:
            return False
        if len(self._tasks) >= self.max_in_flight:
            self._count("dropped")
            return False
        self._count("sent")
        task = asyncio.get_running_loop().create_task(self._send(path, body, headers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _send(self, path: str, body: bytes, headers: list[tuple[str, str]]) -> None:
        import aiohttp

        try:
            timeout = aiohttp.ClientTimeout(total=self._timeout)
            async with self._session.post(self.url + path, data=body, headers=headers, timeout=timeout) as resp:
                while await resp.content.readany():
                    pass
                self._count("ok" if resp.status < 400 else "error")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a shadow's failure is only ever counted
            log.debug("mirror to %s failed: %s", self.url, exc)
            self._count("error")

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        if self._counter is not None:
            self._counter.labels(outcome).inc()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
