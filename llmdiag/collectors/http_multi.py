"""Many HTTP GETs at once from one thread: non-blocking sockets under one selector.

The engine collector scrapes every backend each tick. With one thread per
scrape, each tick paid a thread hand-off per backend (futures, condition
variables, GIL switches: ~5 % of the agent's CPU with 16 backends) and
``http.client``'s per-request machinery (``email`` header parsing, buffered
file objects). :class:`MultiFetcher` instead sends every request from the
calling thread and answers them as they complete (:meth:`MultiFetcher.fetch_all`
yields each :class:`~llmdiag.collectors.http_fetch.FetchResult` as soon as its
response is whole, so the caller parses one while the others are still on the
wire), with the same contract as :func:`~llmdiag.collectors.http_fetch.http_get`:

* one deadline for every GET of the call (``timeout`` seconds from the call):
  an engine that hangs, drips or never ends its body is cut off there with
  ``failure`` ``"timeout"``, and stalls none of the others beyond it;
* ``max_bytes`` caps each body (``"too_large"``); anything that is not HTTP is
  ``"bad_response"``; a refused connection is ``"connection_refused"``; never raises;
* one kept-alive HTTP/1.1 connection per origin, reused across calls; one the
  server closed while idle (its keep-alive timeout) is retried once on a new
  connection within the same deadline;
* every connection binds its local port first and registers it in
  :data:`~llmdiag.collectors.own_sockets.OWN_PORTS` before it connects (as
  :func:`~llmdiag.collectors.own_sockets.bound_connection` does), so the tcp
  and timewait collectors leave llmdiag's own scrapes out.

It serves ``http://`` URLs whose host is an IP address (:func:`direct_target`):
no TLS, and no name resolution, which would block every scrape of the tick
behind one slow DNS answer. Others go through
:class:`~llmdiag.collectors.http_fetch.KeepAlivePool` in threads.
Responses may use ``Content-Length``, chunked transfer coding, or end at the
connection's close. Not thread-safe: one thread calls it.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import selectors
import socket
import time
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

from llmdiag.collectors.http_fetch import PROMETHEUS_ACCEPT, FetchResult
from llmdiag.collectors.own_sockets import OWN_PORTS, OwnPorts

__all__ = ["MultiFetcher", "direct_target"]

_RECV = 65536
_MAX_HEAD = 65536  # status line + headers


def direct_target(url: str) -> bool:
    """Whether :class:`MultiFetcher` serves ``url``: ``http://`` with an IP-address host."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return False
    if parts.scheme != "http" or not host:
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _Conn:
    """A non-blocking TCP connection of ours; its ``(local port, remote port)`` stays registered
    until :meth:`close`."""

    __slots__ = ("sock", "local", "remote_port", "registry")

    def __init__(self, address: tuple[str, int], registry: OwnPorts) -> None:
        host, port = address
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.registry = registry
        self.remote_port = port
        self.local: int | None = None
        try:
            self.sock.setblocking(False)
            self.sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
            self.local = self.sock.getsockname()[1]
            registry.add(self.local, port)  # before the SYN: the tcp collector sees the handshake as ours
        except OSError:
            self.close()
            raise

    def connect(self, address: tuple[str, int]) -> int:
        """Start connecting; returns 0, EINPROGRESS, or the error number (ECONNREFUSED on loopback)."""
        return self.sock.connect_ex(address)

    def close(self) -> None:
        self.sock.close()
        if self.local is not None:
            self.registry.release(self.local, self.remote_port)
            self.local = None


class _Failed(Exception):
    """This exchange is over: ``failure`` (one of http_fetch.FAILURES) and a message for people."""

    def __init__(self, failure: str, error: str) -> None:
        super().__init__(error)
        self.failure, self.error = failure, error


class _Stale(Exception):
    """A reused connection turned out closed by the server: retry once on a new one."""


class _Response:
    """An HTTP/1.x response read incrementally from a byte stream."""

    __slots__ = ("buf", "status", "reason", "headers", "will_close", "length", "chunked", "body",
                 "body_size", "pos", "done", "extra", "max_bytes", "_chunk_left")

    def __init__(self, max_bytes: int) -> None:
        self.buf = bytearray()  # raw bytes not consumed yet
        self.status: int | None = None
        self.reason = ""
        self.headers: dict[str, str] = {}
        self.will_close = False
        self.length: int | None = None
        self.chunked = False
        self.body = bytearray()
        self.body_size = 0
        self.pos = 0
        self.done = False
        self.extra = False  # bytes after the end of the response: the connection is not reusable
        self.max_bytes = max_bytes
        self._chunk_left: int | None = None  # bytes left in the current chunk (None: a size line is next)

    @property
    def started(self) -> bool:
        return bool(self.buf) or self.status is not None

    def feed(self, data: bytes) -> None:
        """Take more bytes; raises :class:`_Failed` for what is not HTTP or is too large."""
        self.buf += data
        if self.status is None and not self._head():
            return
        if self.chunked:
            self._chunks()
        else:
            self._plain()

    def eof(self) -> None:
        """The server closed the connection; raises :class:`_Failed` unless that ends the response."""
        if self.done:
            return
        if self.status is not None and self.length is None and not self.chunked:
            self.done = True  # the body runs to the close
            return
        raise _Failed("bad_response", "connection closed mid-response")

    # -- parts -------------------------------------------------------------------
    def _head(self) -> bool:
        while True:
            if len(self.buf) >= 5 and not self.buf.startswith(b"HTTP/"):
                raise _Failed("bad_response", f"bad HTTP response: not HTTP: {bytes(self.buf[:40])!r}")
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > _MAX_HEAD:
                    raise _Failed("bad_response", "bad HTTP response: headers over 64 KiB")
                return False
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            del self.buf[: end + 4]
            version, _, rest = lines[0].partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
                raise _Failed("bad_response", f"bad HTTP response: status line {lines[0][:80]!r}")
            status = int(code)
            if 100 <= status < 200:
                continue  # an interim answer (100 Continue): the real one follows
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    raise _Failed("bad_response", f"bad HTTP response: header line {line[:80]!r}")
                headers[name.strip().lower()] = value.strip()
            self.status, self.reason, self.headers = status, reason.strip(), headers
            connection = headers.get("connection", "").lower()
            self.will_close = "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection)
            self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            if status in (204, 304):
                self.length = 0
            elif not self.chunked and "content-length" in headers:
                try:
                    self.length = int(headers["content-length"])
                except ValueError:
                    raise _Failed("bad_response", "bad HTTP response: bad Content-Length") from None
                if self.length < 0:
                    raise _Failed("bad_response", "bad HTTP response: bad Content-Length")
            if self.length is None and not self.chunked:
                self.will_close = True  # the body ends at the close
            return True

    def _take(self, data: bytes | bytearray) -> None:
        self.body_size += len(data)
        if self.body_size > self.max_bytes:
            raise _Failed("too_large", f"response larger than {self.max_bytes} bytes")
        self.body += data

    def _plain(self) -> None:
        if self.length is None:
            self._take(self.buf)
            self.buf.clear()
            return
        want = self.length - self.body_size
        if want > self.max_bytes - self.body_size:
            raise _Failed("too_large", f"response larger than {self.max_bytes} bytes")
        self._take(self.buf[:want])
        self.extra = len(self.buf) > want
        del self.buf[:want]
        if self.body_size >= self.length:
            self.done = True

    def _chunks(self) -> None:
        while not self.done:
            if self._chunk_left is None:
                end = self.buf.find(b"\r\n")
                if end < 0:
                    if len(self.buf) > 1024:
                        raise _Failed("bad_response", "bad HTTP response: chunk size line too long")
                    return
                size_text = bytes(self.buf[:end]).split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise _Failed("bad_response", f"bad HTTP response: chunk size {size_text[:20]!r}") from None
                if size == 0:
                    # The last chunk, then trailer lines (usually none), then an empty line.
                    rest = self.buf[end + 2:]
                    if rest.startswith(b"\r\n"):
                        over = len(rest) - 2
                    else:
                        tail = rest.find(b"\r\n\r\n")
                        if tail < 0:
                            return
                        over = len(rest) - tail - 4
                    self.extra = over > 0
                    self.buf.clear()
                    self.done = True
                    return
                del self.buf[: end + 2]
                self._chunk_left = size
            if self._chunk_left > 0:
                piece = self.buf[: self._chunk_left]
                if not piece:
                    return
                self._take(piece)
                del self.buf[: len(piece)]
                self._chunk_left -= len(piece)
                if self._chunk_left > 0:
                    return
            if len(self.buf) < 2:
                return
            if self.buf[:2] != b"\r\n":
                raise _Failed("bad_response", "bad HTTP response: chunk not followed by CRLF")
            del self.buf[:2]
            self._chunk_left = None


class _Exchange:
    """One GET in flight: its connection, what is left to send, the response so far."""

    __slots__ = ("index", "url", "origin", "address", "request", "conn", "reused", "sent", "response", "connecting")

    def __init__(self, index: int, url: str, origin: tuple[str, int], request: bytes) -> None:
        self.index, self.url, self.origin, self.address = index, url, origin, origin
        self.request = request
        self.conn: _Conn | None = None
        self.reused = False
        self.sent = 0
        self.response: _Response | None = None
        self.connecting = False


class MultiFetcher:
    """Concurrent GETs from the calling thread over kept-alive connections (see the module docstring).

    ``opened_total`` counts the connections it ever opened (the keep-alive tests read it)."""

    def __init__(self, registry: OwnPorts = OWN_PORTS) -> None:
        self.registry = registry
        self._idle: dict[tuple[str, int], _Conn] = {}
        self._selector: selectors.BaseSelector | None = None
        self.opened_total = 0
        self._plans: dict[tuple[str, str], tuple[tuple[str, int], bytes] | _Failed] = {}

    def close(self) -> None:
        """Close every idle connection (later calls open new ones)."""
        idle, self._idle = list(self._idle.values()), {}
        for conn in idle:
            conn.close()
        if self._selector is not None:
            self._selector.close()
            self._selector = None

    def fetch_all(self, urls: Sequence[str], timeout: float, max_bytes: int,
                  accept: str = PROMETHEUS_ACCEPT) -> Iterator[tuple[int, FetchResult]]:
        """GET every URL at once; yields ``(index in urls, result)`` as each one completes, all of
        them within ``timeout`` seconds of the call. Closing the iterator early abandons the rest
        (their connections are closed)."""
        start = time.monotonic()
        deadline = start + timeout
        if self._selector is None:
            self._selector = selectors.DefaultSelector()
        selector = self._selector
        flying: dict[int, _Exchange] = {}

        def result(ex: _Exchange, **kwargs: object) -> tuple[int, FetchResult]:
            return ex.index, FetchResult(url=ex.url, elapsed_seconds=time.monotonic() - start, **kwargs)  # type: ignore[arg-type]

        def finish(ex: _Exchange, keep: bool) -> None:
            flying.pop(ex.index, None)
            conn, ex.conn = ex.conn, None
            if conn is None:
                return
            try:
                selector.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
            if keep and ex.origin not in self._idle:
                self._idle[ex.origin] = conn
            else:
                conn.close()

        ready: list[tuple[int, FetchResult]] = []
        try:
            for index, url in enumerate(urls):
                try:
                    ex = self._exchange(index, url, accept)
                except _Failed as exc:
                    ready.append((index, FetchResult(url=url, error=exc.error, failure=exc.failure)))
                    continue
                flying[index] = ex
                try:
                    self._start(ex, selector, max_bytes)
                except _Failed as exc:
                    finish(ex, keep=False)
                    ready.append(result(ex, error=exc.error, failure=exc.failure))
            yield from ready
            while flying:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for key, mask in selector.select(left):
                    ex = key.data
                    try:
                        done = self._step(ex, mask, selector, max_bytes)
                    except _Failed as exc:
                        finish(ex, keep=False)
                        yield result(ex, error=exc.error, failure=exc.failure)
                        continue
                    if done:
                        response = ex.response
                        assert response is not None
                        finish(ex, keep=not (response.will_close or response.extra))
                        yield result(ex, **_outcome(response))
            for ex in list(flying.values()):
                finish(ex, keep=False)
                yield result(ex, error=f"timed out after {timeout:g} s", failure="timeout")
        finally:
            for ex in list(flying.values()):  # abandoned by the caller: nothing half-read is kept
                finish(ex, keep=False)

    # -- one exchange ------------------------------------------------------------------
    def _exchange(self, index: int, url: str, accept: str) -> _Exchange:
        """A new exchange for ``url``; its address and request bytes are worked out once per URL
        (the engine collector asks for the same URLs every tick)."""
        plan = self._plans.get((url, accept))
        if plan is None:
            if len(self._plans) >= 1024:  # a caller with ever new URLs: stay bounded
                self._plans.clear()
            plan = self._plans[(url, accept)] = self._plan(url, accept)
        if isinstance(plan, _Failed):
            raise _Failed(plan.failure, plan.error)
        return _Exchange(index, url, *plan)

    @staticmethod
    def _plan(url: str, accept: str) -> tuple[tuple[str, int], bytes] | _Failed:
        """``(origin, request bytes)`` of a GET of ``url``, or why it cannot be made."""
        try:
            parts = urlsplit(url)
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            return _Failed("bad_url", f"bad URL: {exc}")
        if parts.scheme != "http" or not host:
            return _Failed("bad_url", f"cannot scrape {url!r}: only http URLs with an IP address here")
        port = port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host_header = parts.netloc.rpartition("@")[2]
        request = (f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nAccept: {accept}\r\n"
                   f"User-Agent: llmdiag\r\n\r\n").encode("latin-1", "replace")
        return (host, port), request

    def _start(self, ex: _Exchange, selector: selectors.BaseSelector, max_bytes: int, fresh: bool = False) -> None:
        ex.response = _Response(max_bytes)
        ex.sent = 0
        conn = None if fresh else self._idle.pop(ex.origin, None)
        ex.reused = conn is not None
        if conn is None:
            try:
                conn = _Conn(ex.address, self.registry)
            except OSError as exc:
                raise _Failed("unreachable", f"{type(exc).__name__}: {exc.strerror or exc}") from None
            self.opened_total += 1
            ex.conn = conn
            code = conn.connect(ex.address)
            if code not in (0, errno.EINPROGRESS, errno.EAGAIN):
                raise _failure_of_errno(code)
            ex.connecting = code != 0
        else:
            ex.conn = conn
            ex.connecting = False
            # A kept-alive connection is open and its send buffer empty: the small request goes out
            # at once, and the socket waits for the answer only (one epoll_ctl, one wake-up and one
            # _step fewer than waiting to be writable first). A connection the server closed while
            # idle fails here or on the first read, and is retried on a fresh one either way.
            try:
                ex.sent = conn.sock.send(ex.request)
            except (BlockingIOError, InterruptedError):
                ex.sent = 0
            except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
                ex.conn = None
                conn.close()
                self._start(ex, selector, max_bytes, fresh=True)
                return
            except OSError as exc:
                raise _failure_of_errno(exc.errno or 0, exc) from None
            if ex.sent >= len(ex.request):
                selector.register(conn.sock, selectors.EVENT_READ, ex)
                return
        selector.register(conn.sock, selectors.EVENT_WRITE, ex)

    def _retry(self, ex: _Exchange, selector: selectors.BaseSelector, max_bytes: int) -> None:
        """The reused connection was closed by the server while idle: once more on a new one."""
        if ex.conn is not None:
            try:
                selector.unregister(ex.conn.sock)
            except (KeyError, ValueError):
                pass
            ex.conn.close()
            ex.conn = None
        self._start(ex, selector, max_bytes, fresh=True)

    def _step(self, ex: _Exchange, mask: int, selector: selectors.BaseSelector, max_bytes: int) -> bool:
        """Advance one exchange on a readiness event; True once its response is whole."""
        conn, response = ex.conn, ex.response
        assert conn is not None and response is not None
        try:
            if ex.connecting:
                code = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise _failure_of_errno(code)
                ex.connecting = False
            if mask & selectors.EVENT_WRITE and ex.sent < len(ex.request):
                ex.sent += conn.sock.send(ex.request[ex.sent:])
                if ex.sent >= len(ex.request):
                    selector.modify(conn.sock, selectors.EVENT_READ, ex)
                return False
            if mask & selectors.EVENT_READ:
                data = conn.sock.recv(_RECV)
                if not data:
                    if ex.reused and not response.started:
                        raise _Stale
                    if not response.started:
                        raise _Failed("unreachable", "connection closed without a response")
                    response.eof()
                    return True
                response.feed(data)
                return response.done
            return False
        except (BlockingIOError, InterruptedError):
            return False
        except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, _Stale) as exc:
            if ex.reused and not response.started:
                self._retry(ex, selector, max_bytes)
                return False
            if isinstance(exc, _Stale):
                raise _Failed("unreachable", "connection closed without a response") from None
            raise _Failed("unreachable", f"{type(exc).__name__}: {exc.strerror or exc}") from None
        except OSError as exc:
            raise _failure_of_errno(exc.errno or 0, exc) from None


def _failure_of_errno(code: int, exc: OSError | None = None) -> _Failed:
    if code == errno.ECONNREFUSED:
        return _Failed("connection_refused", "connection refused")
    if code == errno.ETIMEDOUT:
        return _Failed("timeout", "connect timed out")
    text = (exc.strerror if exc is not None else None) or os.strerror(code)
    return _Failed("unreachable", f"OSError: {text}")


def _outcome(response: _Response) -> dict[str, object]:
    """FetchResult fields for a whole response (what http_fetch gives for the same answer)."""
    status = response.status
    body = response.body.decode("utf-8", errors="replace")  # bytearray decodes as it is: no copy first
    content_type = response.headers.get("content-type", "")
    if status != 200:
        return {"status": status, "body": body[:200], "content_type": content_type,
                "error": f"HTTP {status} {response.reason}".strip(), "failure": "http_status"}
    return {"status": 200, "body": body, "content_type": content_type}
