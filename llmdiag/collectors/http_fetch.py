"""A small synchronous HTTP GET with a hard deadline and a size cap.

``urllib``'s timeout applies to each socket operation, so an engine that
drips one byte a second would hold a scrape for minutes. :func:`http_get`
instead re-arms the socket timeout with the time left before one deadline
on every read, and stops reading past ``max_bytes``. It never raises: every
failure is a :class:`FetchResult` with ``error`` set for people (``connection
refused``, ``timed out after 1.0 s``, ``HTTP 503``, ``response larger than
4194304 bytes``) and ``failure`` set for programs: one of :data:`FAILURES`.
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["FAILURES", "PROMETHEUS_ACCEPT", "FetchFunction", "FetchResult", "http_get"]

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
    """GET ``url`` within ``timeout`` seconds in total, reading at most ``max_bytes``."""
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
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Accept": accept, "User-Agent": "llmdiag", "Connection": "close"})
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
        content_type = response.getheader("Content-Type", "") or ""
        body = b"".join(chunks).decode("utf-8", errors="replace")
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
        conn.close()


def _arm(conn: http.client.HTTPConnection, deadline: float) -> None:
    """Give the next socket operation only the time left before the deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if conn.sock is not None:
        conn.sock.settimeout(left)
