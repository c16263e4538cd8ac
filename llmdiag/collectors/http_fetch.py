"""A small synchronous HTTP GET with a hard deadline and a size cap, one-shot or kept alive.

``urllib``'s timeout applies to each socket operation, so an engine that
drips one byte a second would hold a scrape for minutes. :func:`http_get`
instead re-arms the socket timeout with the time left before one deadline
on every read, and stops reading past ``max_bytes``. It never raises: every
failure is a :class:`FetchResult` with ``error`` set for people (``connection
refused``, ``timed out after 1.0 s``, ``HTTP 503``, ``response larger than
4194304 bytes``) and ``failure`` set for programs: one of :data:`FAILURES`.

:class:`KeepAlivePool` is the same GET over kept-alive HTTP/1.1 connections,
one per origin: what the engine collector scrapes with every tick, so that
its own scrapes open no new connection per tick (and leave no TIME_WAIT
socket per scrape). A kept connection the server closed meanwhile (its idle
timeout) is retried once on a fresh one. Every connection binds its local
port first and registers it in :data:`~llmdiag.collectors.own_sockets.OWN_PORTS`,
so the tcp and timewait collectors leave llmdiag's own sockets out.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from llmdiag.collectors.own_sockets import OWN_PORTS, OwnPorts, bound_connection

__all__ = ["FAILURES", "FetchFunction", "FetchResult", "KeepAlivePool", "PROMETHEUS_ACCEPT", "SCRAPE_SHARE_OF_TICK", "http_get"]

#: A scrape made during a tick has at most this share of the tick interval for all of its reads:
#: a tick waits for its slowest collector, so a reader allowed a whole interval or more (a hung
#: engine or Envoy admin at the default 1 s timeout, with 1 s ticks) makes the agent miss ticks.
SCRAPE_SHARE_OF_TICK = 0.8

#: Ask for the classic text format: it is what every engine serves, and its
#: parser is prometheus_client's text parser.
PROMETHEUS_ACCEPT = "text/plain; version=0.0.4"

_CHUNK = 65536

#: Why a GET failed, as :attr:`FetchResult.failure` gives it.
FAILURES = (
    "connection_refused",  # nothing listens on the port (the process is gone)
    "timeout",  # no complete answer before the deadline (hung, or drowning)
    "name_not_resolved",  # the host name does not resolve (DNS, a deleted pod)
    "unreachable",  # any other socket error: no route, reset, ...
    "http_status",  # an HTTP answer other than 200 (``status`` says which)
    "bad_response",  # something answered, but not HTTP
    "too_large",  # the body passed max_bytes
    "bad_url",  # not an http(s) URL
)


@dataclass(frozen=True, slots=True)
class FetchResult:
    """The outcome of one GET: ``body`` when ``error`` is None."""

    url: str
    status: int | None = None
    body: str = ""
    content_type: str = ""
    error: str | None = None
    elapsed_seconds: float = 0.0
    #: One of :data:`FAILURES` when ``error`` is set (``None`` from a fetch that does not classify).
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


#: ``fetch(url, timeout_seconds, max_bytes, accept) -> FetchResult``: what the engine collector calls.
FetchFunction = Callable[[str, float, int, str], FetchResult]


def http_get(url: str, timeout: float, max_bytes: int, accept: str = PROMETHEUS_ACCEPT) -> FetchResult:
    """GET ``url`` within ``timeout`` seconds in total, reading at most ``max_bytes``, on a
    connection of its own that is closed afterwards."""
    return _get(url, timeout, max_bytes, accept, None)


class KeepAlivePool:
    """Kept-alive connections, at most one idle per origin; call it like :func:`http_get`.

    Thread-safe: a connection in use is out of the pool, so two scrapes of one origin at
    once (a timed-out scrape still finishing) use two connections. ``opened_total`` counts
    the connections it ever opened (the keep-alive test and benchmark read it)."""

    def __init__(self, registry: OwnPorts = OWN_PORTS) -> None:
        self.registry = registry
        self._idle: dict[tuple[str, str, int], http.client.HTTPConnection] = {}
        self._lock = threading.Lock()
        self.opened_total = 0
        self._closed = False

    def __call__(self, url: str, timeout: float, max_bytes: int, accept: str = PROMETHEUS_ACCEPT) -> FetchResult:
        return _get(url, timeout, max_bytes, accept, self)

    def _checkout(self, origin: tuple[str, str, int]) -> http.client.HTTPConnection | None:
        with self._lock:
            return self._idle.pop(origin, None)

    def _checkin(self, origin: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and origin not in self._idle:
                self._idle[origin] = conn
                return
        conn.close()

    def _opened(self) -> None:
        with self._lock:
            self.opened_total += 1

    def close(self) -> None:
        """Close every idle connection; later GETs still work, one-shot."""
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle.values()), {}
        for conn in idle:
            conn.close()


class _ReleaseOnClose:
    """Mixin: give the local port back to the registry when the connection closes."""

    _registry: OwnPorts
    sock: socket.socket | None

    def close(self) -> None:
        local = None
        if self.sock is not None:
            try:
                local = self.sock.getsockname()[1]
            except OSError:
                local = None
        super().close()  # type: ignore[misc]
        if local is not None:
            self._registry.release(local, self.port)  # type: ignore[attr-defined]


class _OwnHTTPConnection(_ReleaseOnClose, http.client.HTTPConnection):
    pass


class _OwnHTTPSConnection(_ReleaseOnClose, http.client.HTTPSConnection):
    pass


def _own_connection(scheme: str, host: str, port: int | None, timeout: float, registry: OwnPorts) -> http.client.HTTPConnection:
    """A connection whose local port is bound and registered as llmdiag's own before it connects
    (HTTPConnection.connect, and so HTTPSConnection.connect, call ``_create_connection``)."""
    cls = _OwnHTTPSConnection if scheme == "https" else _OwnHTTPConnection
    conn = cls(host, port, timeout=timeout)
    conn._registry = registry
    conn._create_connection = lambda address, timeout, source: bound_connection(address, timeout, source, registry=registry)  # type: ignore[attr-defined]
    return conn


# Errors that mean "the server closed the kept-alive connection while it was idle".
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def _get(url: str, timeout: float, max_bytes: int, accept: str, pool: KeepAlivePool | None) -> FetchResult:
    start = time.monotonic()
    deadline = start + timeout

    def result(**kwargs) -> FetchResult:
        return FetchResult(url=url, elapsed_seconds=time.monotonic() - start, **kwargs)

    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        return result(error=f"bad URL: {exc}", failure="bad_url")
    if parts.scheme not in ("http", "https") or not host:
        return result(error=f"cannot scrape {url!r}: only http(s) URLs", failure="bad_url")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    origin = (parts.scheme, host, port or (443 if parts.scheme == "https" else 80))
    registry = pool.registry if pool is not None else OWN_PORTS
    headers = {"Accept": accept, "User-Agent": "llmdiag"}
    if pool is None:
        headers["Connection"] = "close"

    def fresh() -> http.client.HTTPConnection:
        if pool is not None:
            pool._opened()
        return _own_connection(parts.scheme, host, port, max(0.001, deadline - time.monotonic()), registry)

    conn = pool._checkout(origin) if pool is not None else None
    reused = conn is not None
    if conn is None:
        conn = fresh()
    try:
        try:
            _arm(conn, deadline)
            conn.request("GET", path, headers=headers)
            _arm(conn, deadline)
            response = conn.getresponse()
        except _STALE:
            if not reused:
                raise
            conn.close()  # the server dropped the idle connection: once more on a new one
            conn = fresh()
            conn.request("GET", path, headers=headers)
            _arm(conn, deadline)
            response = conn.getresponse()
        chunks: list[bytes] = []
        size = 0
        while True:
            _arm(conn, deadline)
            chunk = response.read1(_CHUNK) if hasattr(response, "read1") else response.read(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                return result(status=response.status, error=f"response larger than {max_bytes} bytes", failure="too_large")
            chunks.append(chunk)
        response.close()  # read to the end; http.client sends the next request only after this
        content_type = response.getheader("Content-Type", "") or ""
        body = b"".join(chunks).decode("utf-8", errors="replace")
        if pool is not None and not response.will_close:
            pool._checkin(origin, conn)  # read to the end: the connection can serve the next scrape
            conn = None
        if response.status != 200:
            return result(status=response.status, body=body[:200], content_type=content_type,
                          error=f"HTTP {response.status} {response.reason}".strip(), failure="http_status")
        return result(status=200, body=body, content_type=content_type)
    except ConnectionRefusedError:
        return result(error="connection refused", failure="connection_refused")
    except (TimeoutError, socket.timeout):
        return result(error=f"timed out after {timeout:g} s", failure="timeout")
    except socket.gaierror as exc:
        return result(error=f"host name {host!r} does not resolve: {exc.strerror or exc}", failure="name_not_resolved")
    except OSError as exc:
        return result(error=f"{type(exc).__name__}: {exc.strerror or exc}", failure="unreachable")
    except (http.client.HTTPException, ValueError) as exc:
        return result(error=f"bad HTTP response: {type(exc).__name__}: {exc}", failure="bad_response")
    finally:
        if conn is not None:
            conn.close()


def _arm(conn: http.client.HTTPConnection, deadline: float) -> None:
    """Give the next socket operation only the time left before the deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if conn.sock is not None:
        conn.sock.settimeout(left)
