"""Pooled HTTP/1.1 connections from the gateway to its backends: the request path's client.

Why not aiohttp's client (which the gateway still uses for probes, ``/v1/models``,
agents and the mirror): on the request path every microsecond before the first
token is added TTFT. aiohttp's client builds a request object, a URL, cookie and
timeout machinery per request, writes the body from a second task (one more
event-loop turn), and hands each body chunk to the handler through a stream
reader (another turn per chunk). Here a request is one ``transport.write`` of
bytes prepared by the caller, and each body piece is handed to a callback from
``data_received``, so a streamed token can be written to the client in the
same loop turn that read it. Measured: docs/benchmarks.md, "Gateway".

Scope, on purpose no wider than the gateway's backends need: a request whose
body length is known; responses framed by ``Content-Length``, by the chunked
transfer coding, or by the connection's close; 1xx answers skipped; keep-alive
reuse with a bounded pool per backend. No redirects, cookies, proxies, HTTP/2,
and no decompression (bodies pass through as the backend sent them).

Errors, as the gateway classifies them (SPEC 6.3):

- :class:`ConnectFailed`: refused, reset, or a pooled connection that the
  backend had closed, before any byte of an answer (nothing was processed);
- :class:`UpstreamTimeout`: connecting, or silence between reads longer than
  the idle timeout, or the whole exchange past its deadline;
- :class:`ProtocolError`: an answer that is not HTTP/1.x, or a body cut short.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from llmdiag.gateway.chunked import ChunkedDecoder, ChunkedError

__all__ = ["ConnectFailed", "ProtocolError", "ResponseHead", "UpstreamConnection", "UpstreamError", "UpstreamPool",
           "UpstreamTimeout"]

#: Longest response head (status line and headers) accepted from a backend.
MAX_HEAD_BYTES = 64 * 1024

# Connection states.
_IDLE, _HEAD, _BODY, _DONE, _CLOSED = range(5)


class UpstreamError(Exception):
    """A failed exchange with a backend."""


class ConnectFailed(UpstreamError):
    """No answer started: refused, reset, or a kept-alive connection the backend had closed (safe to retry)."""


class UpstreamTimeout(UpstreamError):
    """Connect timeout, idle timeout between reads, or the exchange's deadline."""


class ProtocolError(UpstreamError):
    """An answer that is not valid HTTP/1.x, or a body cut short."""


@dataclass(slots=True)
class ResponseHead:
    status: int
    reason: str
    #: As received: names' case, order and repeats kept.
    headers: list[tuple[str, str]]
    #: Body length when framed by Content-Length; ``None`` for chunked or read-until-close.
    content_length: int | None
    chunked: bool
    #: The connection may carry another request after this answer's body.
    keep_alive: bool

    def header_map(self) -> dict[str, str]:
        """Lower-cased names -> value (the last one wins): enough for classification."""
        return {k.lower(): v for k, v in self.headers}


def parse_head(data: bytes | bytearray) -> ResponseHead:
    """Status line and headers (without the blank line); raises :class:`ProtocolError`."""
    raw = bytes(data)
    # A CR or LF outside a CRLF, or a NUL (RFC 9112 2.2, 5.5): the headers are forwarded to the client, where
    # a bare LF inside a value would start a header (or a response) of the backend's making.
    crlf = raw.count(b"\r\n")
    if raw.count(b"\n") != crlf or raw.count(b"\r") != crlf or b"\0" in raw:
        raise ProtocolError("bare CR, LF or NUL in the response head")
    # As aiohttp's parser does: UTF-8, and bytes that are not pass through unchanged (surrogateescape).
    text = raw.decode("utf-8", "surrogateescape")
    lines = text.split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise ProtocolError(f"bad status line {lines[0][:80]!r}")
    headers: list[tuple[str, str]] = []
    content_length: int | None = None
    chunked = False
    connection = ""
    coded = False  # a Transfer-Encoding was present (chunked or not)
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or " " in name or "\t" in name:
            raise ProtocolError(f"bad header line {line[:80]!r}")
        value = value.strip(" \t")
        headers.append((name, value))
        lname = name.lower()
        if lname == "content-length":
            if not (value.isascii() and value.isdigit()) or (content_length is not None and int(value) != content_length):
                raise ProtocolError(f"bad Content-Length {value[:40]!r}")
            content_length = int(value)
        elif lname == "transfer-encoding":
            # RFC 9112 6.1: chunked must be the last coding; then it frames the body and Content-Length is ignored.
            chunked = value.lower().rsplit(",", 1)[-1].strip() == "chunked"
            coded = True
        elif lname == "connection":
            connection += "," + value.lower()
    status = int(code)
    tokens = {t.strip() for t in connection.split(",")}
    keep_alive = "close" not in tokens if version == "HTTP/1.1" else "keep-alive" in tokens
    if coded:
        # RFC 9112 6.3: Transfer-Encoding wins over Content-Length; chunked not last: the body ends with the
        # connection. Both headers at once may be a response-splitting attempt: never reuse that connection.
        if content_length is not None or not chunked:
            keep_alive = False
        content_length = None
    if not chunked and content_length is None and not (status < 200 or status in (204, 304)):
        keep_alive = False  # the body ends with the connection
    return ResponseHead(status, reason, headers, content_length, chunked, keep_alive)


class UpstreamConnection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection to a backend; one exchange at a time.

    Use: :meth:`send` the request bytes, ``await`` :meth:`read_head`, then
    either :meth:`stream_body` (pieces go to a callback as they arrive, from
    ``data_received``) or :meth:`read_body` (collected, capped), and give the
    connection back with :meth:`UpstreamPool.release`.
    """

    def __init__(self, pool: UpstreamPool | None, key: str) -> None:
        self._pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._state = _IDLE
        self._buf = bytearray()
        self._head: ResponseHead | None = None
        self._waiter: asyncio.Future[None] | None = None  # head, then the body's end (or a pause)
        self._error: UpstreamError | None = None
        self._got_bytes = False
        # Body framing
        self._remaining = 0  # Content-Length left
        self._chunks: ChunkedDecoder | None = None
        self._pending: list[bytes] = []
        self._sink: Callable[[list[bytes]], None] | None = None
        self._extra_bytes = False
        # Timeouts: one timer per exchange, re-armed lazily from the time of the last read.
        self._idle_timeout = 0.0
        self._deadline = 0.0
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.idle_since = 0.0

    # ------------------------------------------------------------ protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # The first token is a small write; without this the kernel may hold it back (Nagle).
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        state = self._state
        self._state = _CLOSED
        self._cancel_timer()
        if state == _HEAD:
            if self._got_bytes:
                self._fail(ProtocolError("connection closed in the middle of the response head"))
            else:
                self._fail(ConnectFailed(f"connection closed before an answer ({exc or 'EOF'})"))
        elif state == _BODY:
            if self._head is not None and not self._head.chunked and self._head.content_length is None:
                self._finish()  # read-until-close framing: the close is the end
            else:
                self._fail(ProtocolError(f"connection closed in the middle of the body ({exc or 'EOF'})"))
        if self._pool is not None:
            self._pool._lost(self, state)

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        self._last_read = self._loop.time()
        state = self._state
        if state == _BODY:
            self._body(data)
        elif state == _HEAD:
            self._buf += data
            self._parse_heads()
        else:  # bytes nobody asked for: the connection cannot be trusted for reuse
            self._extra_bytes = True
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost decides what the EOF meant

    def pause_writing(self) -> None:  # a request body larger than the socket buffer: the kernel catches up
        pass

    def resume_writing(self) -> None:
        pass

    # ------------------------------------------------------------ exchange

    @property
    def reusable(self) -> bool:
        return (self._state == _DONE and self._head is not None and self._head.keep_alive and not self._extra_bytes
                and self.transport is not None and not self.transport.is_closing())

    @property
    def failed(self) -> bool:
        """The exchange failed (timeout, protocol error, close); :meth:`wait_body` raises why."""
        return self._error is not None

    @property
    def head(self) -> ResponseHead | None:
        return self._head

    def send(self, data: bytes, idle_timeout: float, deadline: float) -> None:
        """Write one request (head and body in one piece); ``deadline`` is on the loop's clock."""
        if self._state != _IDLE or self.transport is None or self.transport.is_closing():
            raise ConnectFailed("connection is not usable")
        self._state = _HEAD
        self._buf.clear()
        self._head = None
        self._error = None
        self._got_bytes = False
        self._pending = []
        self._sink = None
        self._chunks = None
        self._remaining = 0
        self._idle_timeout = idle_timeout
        self._deadline = deadline
        self._last_read = now = self._loop.time()
        self._timer = self._loop.call_at(min(now + idle_timeout, deadline), self._check_timeout)
        self.transport.write(data)

    async def read_head(self) -> ResponseHead:
        if self._head is None and self._error is None:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error
        assert self._head is not None
        return self._head

    def stream_body(self, sink: Callable[[list[bytes]], None]) -> None:
        """From now on body pieces go to ``sink`` as they arrive (pieces already read go at once)."""
        self._sink = sink
        if self._pending:
            pending, self._pending = self._pending, []
            sink(pending)

    async def wait_body(self) -> bool:
        """Until the body ended (``True``) or reading was paused (``False``, see :meth:`pause`); raises on failure."""
        while True:
            if self._error is not None:
                raise self._error
            if self._state in (_DONE, _CLOSED):
                return True
            if self.paused:
                return False
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read_body(self, limit: int) -> bytes:
        """The body, up to ``limit`` bytes (then the connection is closed: the rest stays unread)."""
        chunks: list[bytes] = []
        size = 0

        def collect(pieces: list[bytes]) -> None:
            nonlocal size
            for piece in pieces:
                if size < limit:
                    chunks.append(piece)
                    size += len(piece)
            if size >= limit:
                self.close()
                self._finish()

        self.stream_body(collect)
        await self.wait_body()
        return b"".join(chunks)[:limit]

    def pause(self) -> None:
        """Stop reading (the client is slower than the backend); the idle timeout does not run meanwhile."""
        if not self.paused and self.transport is not None and not self.transport.is_closing():
            self.paused = True
            self.transport.pause_reading()
            self._wake()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self._last_read = self._loop.time()
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    def close(self) -> None:
        """Drop the connection (a cancel for the backend: HTTP/1.1 has no other)."""
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------ parsing

    def _parse_heads(self) -> None:
        buf = self._buf
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    self._fail(ProtocolError(f"response head longer than {MAX_HEAD_BYTES} bytes"))
                    self.close()
                return
            try:
                head = parse_head(buf[:end])
            except ProtocolError as exc:
                self._fail(exc)
                self.close()
                return
            del buf[: end + 4]
            if head.status == 101:  # the gateway never asks to switch protocols
                self._fail(ProtocolError("unexpected 101 Switching Protocols"))
                self.close()
                return
            if 100 <= head.status < 200:
                continue  # 100 Continue and friends: the real answer follows
            self._head = head
            self._state = _BODY
            if head.chunked:
                self._chunks = ChunkedDecoder()
            elif head.content_length is not None:
                self._remaining = head.content_length
            if head.status in (204, 304) or head.content_length == 0:
                self._finish()
            rest = bytes(buf)
            buf.clear()
            self._wake()
            if rest and self._state == _BODY:
                self._body(rest)
            elif rest:
                self._extra_bytes = True
            return

    def _body(self, data: bytes) -> None:
        head = self._head
        assert head is not None
        if self._chunks is not None:
            try:
                pieces = self._chunks.feed(data)
            except ChunkedError as exc:
                self._protocol_error(str(exc))
                return
            if self._chunks.done:
                self._state = _DONE
                self._extra_bytes = self._extra_bytes or self._chunks.extra > 0
        elif head.content_length is not None:
            take = self._remaining
            if len(data) > take:
                self._extra_bytes = True
                data = data[:take]
            self._remaining = take - len(data)
            pieces = [data] if data else []
            if self._remaining == 0:
                self._state = _DONE
        else:
            pieces = [data]
        if pieces:
            if self._sink is not None:
                self._sink(pieces)
            else:
                self._pending.extend(pieces)
        if self._state == _DONE:
            self._finish()

    def _protocol_error(self, why: str) -> None:
        self._fail(ProtocolError(why))
        self.close()

    # ------------------------------------------------------------ completion

    def _finish(self) -> None:
        if self._state == _BODY:
            self._state = _DONE
        self._cancel_timer()
        self._wake()

    def _fail(self, exc: UpstreamError) -> None:
        if self._error is None and self._state != _DONE:
            self._error = exc
        self._cancel_timer()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_timeout(self) -> None:
        self._timer = None
        if self._state not in (_HEAD, _BODY):
            return
        now = self._loop.time()
        if now >= self._deadline:
            self._fail(UpstreamTimeout("the request took longer than its timeout"))
            self.close()
            return
        if self.paused:
            self._last_read = now  # waiting for the client is not the backend's silence
        idle_end = self._last_read + self._idle_timeout
        if now >= idle_end:
            self._fail(UpstreamTimeout(f"backend silent for {self._idle_timeout:g} s"))
            self.close()
            return
        self._timer = self._loop.call_at(min(idle_end, self._deadline), self._check_timeout)


class _Host:
    __slots__ = ("address", "idle", "open", "sweep", "waiters")

    def __init__(self, address: tuple[str, int, bool]) -> None:
        self.address = address  # host, port, tls
        self.idle: list[UpstreamConnection] = []
        self.open = 0  # connections open or being opened
        self.waiters: deque[asyncio.Future[UpstreamConnection | None]] = deque()
        self.sweep: asyncio.TimerHandle | None = None


class UpstreamPool:
    """Kept-alive connections per backend URL (``scheme://host:port``), at most ``limit_per_backend`` each.

    A request over the limit waits for a connection to come back (FIFO).
    Connections idle for ``keepalive_seconds`` are closed; the most recently
    used one is reused first, so a quiet period lets the others expire.
    """

    def __init__(self, *, limit_per_backend: int, keepalive_seconds: float, connect_timeout: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.limit = limit_per_backend
        self.keepalive = keepalive_seconds
        self.connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._hosts: dict[str, _Host] = {}
        self._closed = False
        self.connections_opened_total = 0

    def _host(self, url: str) -> _Host:
        host = self._hosts.get(url)
        if host is None:
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            host = _Host((parts.hostname or "", parts.port or (443 if tls else 80), tls))
            self._hosts[url] = host
        return host

    def try_acquire(self, url: str) -> UpstreamConnection | None:
        """An idle kept-alive connection to ``url`` now, or ``None`` (then :meth:`acquire` waits or connects)."""
        host = self._hosts.get(url)
        if host is None or self._closed:
            return None
        now = asyncio.get_running_loop().time()
        while host.idle:
            conn = host.idle.pop()
            if conn.reusable and now - conn.idle_since < self.keepalive:
                conn._state = _IDLE
                return conn
            conn.close()
        return None

    async def acquire(self, url: str) -> UpstreamConnection:
        if self._closed:
            raise ConnectFailed("the gateway is stopping")
        host = self._host(url)
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise ConnectFailed("the gateway is stopping")
            while host.idle:
                conn = host.idle.pop()
                if conn.reusable and loop.time() - conn.idle_since < self.keepalive:
                    conn._state = _IDLE
                    return conn
                conn.close()
            if host.open < self.limit:
                host.open += 1
                return await self._connect(url, host)
            waiter: asyncio.Future[UpstreamConnection | None] = loop.create_future()
            host.waiters.append(waiter)
            try:
                conn = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                    self.release(waiter.result())  # handed over as we were cancelled: pass it on
                raise
            if conn is not None:
                conn._state = _IDLE
                return conn
            # None: a connection closed, so there is room to open one: loop.

    async def _connect(self, url: str, host: _Host) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        hostname, port, tls = host.address
        ctx = None
        if tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ctx = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: UpstreamConnection(self, url), hostname, port,
                                                       ssl=ctx, server_hostname=hostname if tls else None)
        except TimeoutError:
            self._room(host)
            raise UpstreamTimeout(f"connecting to {url} took longer than {self.connect_timeout:g} s") from None
        except OSError as exc:
            self._room(host)
            raise ConnectFailed(f"cannot connect to {url}: {exc.strerror or exc}") from None
        except BaseException:
            self._room(host)
            raise
        self.connections_opened_total += 1
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        """Give a connection back: reused if its exchange ended cleanly, else closed."""
        host = self._hosts.get(conn.key)
        if host is None or self._closed or not conn.reusable:
            conn.close()
            return
        while host.waiters:
            waiter = host.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        loop = asyncio.get_running_loop()
        conn.idle_since = loop.time()
        host.idle.append(conn)
        if host.sweep is None:
            host.sweep = loop.call_later(self.keepalive, self._sweep, host)

    def _sweep(self, host: _Host) -> None:
        host.sweep = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        keep = []
        for conn in host.idle:
            if now - conn.idle_since >= self.keepalive or not conn.reusable:
                conn.close()
            else:
                keep.append(conn)
        host.idle = keep
        if keep:
            oldest = min(c.idle_since for c in keep)
            host.sweep = loop.call_at(oldest + self.keepalive, self._sweep, host)

    def _lost(self, conn: UpstreamConnection, state: int) -> None:
        host = self._hosts.get(conn.key)
        if host is None:
            return
        if conn in host.idle:
            host.idle.remove(conn)
        self._room(host)

    def _room(self, host: _Host) -> None:
        """A connection closed (or failed to open): one waiter may open a new one."""
        host.open = max(0, host.open - 1)
        while host.waiters:
            waiter = host.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        self._closed = True
        for host in self._hosts.values():
            if host.sweep is not None:
                host.sweep.cancel()
            for conn in host.idle:
                conn.close()
            host.idle = []
            for waiter in host.waiters:
                if not waiter.done():
                    waiter.set_result(None)
        await asyncio.sleep(0)  # let the transports' close callbacks run
