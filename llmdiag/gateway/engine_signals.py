"""Engines' own ``/metrics`` fed to the gateway's balancer (``update_signals``).

The node agent turns engine metrics into penalties; the balancer also reads
the raw queue, KV usage and TTFT window of each engine directly (SPEC 6.3's
``update_signals``), as the simulator's llmdiag policy does. This task scrapes
every backend with the real engine collector (:mod:`llmdiag.collectors.engine`,
in a worker thread: it blocks) every ``interval`` seconds and hands each
backend's aggregated signals to the balancer. A backend whose scrape fails
gets nothing (unknown, never zero): only ``up`` goes through, so a restart
(``up`` 0 -> 1) starts its warm-up ramp. Scrapes reuse one keep-alive
connection per backend (:class:`KeepAliveFetch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from llmdiag.collectors.engine import EngineCollector
from llmdiag.collectors.http_fetch import PROMETHEUS_ACCEPT, FetchResult
from llmdiag.config.engine import EngineConfig
from llmdiag.model import Scope
from llmdiag.router_feedback.balancer import Balancer

__all__ = ["ROUTING_SIGNALS", "EngineSignals", "KeepAliveFetch"]

log = logging.getLogger(__name__)

#: What the balancer reads from a backend's signals.
ROUTING_SIGNALS = ("requests_waiting", "kv_cache_usage", "ttft_seconds", "up")


class KeepAliveFetch:
    """The engine collector's ``fetch`` over one persistent HTTP/1.1 connection per backend.

    The collector's default GET opens and closes a connection per scrape; once a second per
    backend, the gateway would keep ~60 sockets per backend in TIME_WAIT. This keeps one
    connection per ``host:port`` alive and reconnects after any error. Same contract as
    :func:`~llmdiag.collectors.http_fetch.http_get`: a deadline for the whole GET, a size cap,
    never raises. The collector fetches each backend from one worker at a time.
    """

    def __init__(self) -> None:
        self._conns: dict[tuple[str, str, int | None], http.client.HTTPConnection] = {}
        self._lock = threading.Lock()

    def __call__(self, url: str, timeout: float, max_bytes: int, accept: str = PROMETHEUS_ACCEPT) -> FetchResult:
        start = time.monotonic()
        deadline = start + timeout

        def result(**kwargs: Any) -> FetchResult:
            return FetchResult(url=url, elapsed_seconds=time.monotonic() - start, **kwargs)

        try:
            parts = urlsplit(url)
            key = (parts.scheme, parts.hostname or "", parts.port)
        except ValueError as exc:
            return result(error=f"bad URL: {exc}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return result(error=f"cannot scrape {url!r}: only http(s) URLs")
        with self._lock:
            conn = self._conns.pop(key, None)
        if conn is None:
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = cls(parts.hostname, parts.port, timeout=timeout)
        keep = False
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = {"Accept": accept, "User-Agent": "llmdiag-gateway"}
        try:
            conn.timeout = timeout
            try:
                conn.request("GET", path, headers=headers)
                response = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # The backend closed the idle kept-alive connection: once more on a fresh one
                # (a missed scrape would read as the engine going down and coming back).
                conn.close()
                conn.request("GET", path, headers=headers)
                response = conn.getresponse()
            chunks: list[bytes] = []
            size = 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                if conn.sock is not None:
                    conn.sock.settimeout(left)
                chunk = response.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    return result(status=response.status, error=f"response larger than {max_bytes} bytes")
                chunks.append(chunk)
            keep = not response.will_close
            body = b"".join(chunks).decode("utf-8", errors="replace")
            content_type = response.getheader("Content-Type", "") or ""
            if response.status != 200:
                return result(status=response.status, body=body[:200], content_type=content_type,
                              error=f"HTTP {response.status} {response.reason}".strip())
            return result(status=200, body=body, content_type=content_type)
        except ConnectionRefusedError:
            return result(error="connection refused")
        except (TimeoutError, socket.timeout):
            return result(error=f"timed out after {timeout:g} s")
        except OSError as exc:
            return result(error=f"{type(exc).__name__}: {exc.strerror or exc}")
        except (http.client.HTTPException, ValueError) as exc:
            return result(error=f"bad HTTP response: {type(exc).__name__}: {exc}")
        finally:
            if keep:
                with self._lock:
                    self._conns[key] = conn
            else:
                conn.close()

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()


class EngineSignals:
    def __init__(self, balancer: Balancer, config: EngineConfig | None = None, interval: float = 1.0) -> None:
        self.balancer = balancer
        self.config = config or EngineConfig()
        self.interval = interval
        self._collector: EngineCollector | None = None
        self._fetch = KeepAliveFetch()
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
