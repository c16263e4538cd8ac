"""The gateway's client-facing HTTP/1.1 server: one protocol object per client connection.

Why not aiohttp's server (which the gateway used first): on Python 3.11 it
reaches a handler two event-loop turns after the request's bytes arrived (the
connection's task wakes, then creates the handler's task), through a request
object, a router and middlewares; the response goes through a second writer.
Here a complete request is handed to :meth:`Handler.dispatch` from
``data_received`` (the gateway sends it upstream right there when a pooled
connection is idle), and a response is head bytes plus body writes straight to
the transport. Measured:
docs/benchmarks.md, "Gateway".

What it does: HTTP/1.1 and 1.0 requests with a Content-Length or chunked body
(bounded), ``Expect: 100-continue``, keep-alive and pipelining (one request at
a time per connection, in order), chunked or Content-Length responses (none
for HEAD, 204, 304), an idle timeout for connections between requests and
between body reads, a head timeout from a head's first byte (slow-loris:
408), a cap on open connections (503). Refused with an error status and the
connection closed: heads over 64 KiB or 128 lines (431), bodies over the
limit (413), both Content-Length and Transfer-Encoding, Transfer-Encoding in
HTTP/1.0, a CR, LF or NUL outside a CRLF, LF-only heads, control characters in
the target, an asterisk-form or authority-form target, or any other malformed
head (400),
transfer codings other than chunked (501). A client that does not read its
answers stops being read from (pipelined requests wait; a streamed answer
pauses its backend in the gateway). A client that goes away cancels its
handler's task (the gateway then cancels upstream).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterable
from typing import Any, Protocol

from llmdiag.gateway.chunked import ChunkedDecoder, ChunkedError

__all__ = ["Exchange", "Handler", "HttpServer", "MAX_HEAD_BYTES"]

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
#: Header lines per request head (a 64 KiB head of empty-valued headers would be ~16k of them): 431 above.
MAX_HEADERS = 128
_REASONS = {200: "OK", 204: "No Content", 304: "Not Modified", 400: "Bad Request", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout", 413: "Payload Too Large",
            429: "Too Many Requests", 431: "Request Header Fields Too Large", 499: "Client Closed Request",
            500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable",
            504: "Gateway Timeout"}
_INTERNAL_ERROR = b'{"object":"error","type":"internal_error","code":500,"message":"gateway error"}'
#: RFC 9110 5.6.2 token characters: what a method or a header name may be made of.
_TOKEN = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
#: Control characters and space: none may appear in a request target (it is forwarded upstream as is).
_CTL_SP = bytes(range(0x21)) + b"\x7f"


class Handler(Protocol):
    def dispatch(self, exchange: Exchange) -> Any:  # noqa: ANN401 - a coroutine, run as the exchange's task
        """Called from ``data_received`` once the request is complete; may start work right there.

        Returns the coroutine that answers ``exchange`` (ending with
        :meth:`Exchange.end` or :meth:`Exchange.respond`); it runs as the
        request's task, which is cancelled if the client goes away.
        """


class BadHead(ValueError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Exchange:
    """One request and its response. Writes go straight to the client's transport."""

    __slots__ = ("_chunked", "_conn", "_no_body", "body", "ended", "headers", "keep_alive", "method", "path", "query", "started",
                 "version")

    def __init__(self, conn: _ClientConnection, method: str, path: str, query: str, version: str,
                 headers: list[tuple[bytes, bytes]], body: bytes, keep_alive: bool) -> None:
        self._conn = conn
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        #: As received (bytes, case and order kept): forwarded upstream without decoding.
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.started = False  # the response head was written
        self.ended = False
        self._chunked = False
        self._no_body = False

    # ------------------------------------------------------------ facts

    @property
    def transport(self) -> asyncio.Transport | None:
        transport = self._conn.transport
        return None if transport is None or transport.is_closing() else transport

    @property
    def gone(self) -> bool:
        return self.transport is None

    @property
    def remote(self) -> str:
        return self._conn.remote

    def header(self, name: bytes) -> bytes | None:
        """The last value of header ``name`` (lower-case bytes), or ``None``."""
        found = None
        for k, v in self.headers:
            if k.lower() == name:
                found = v
        return found

    # ------------------------------------------------------------ response

    def start(self, status: int, headers: Iterable[tuple[str, str]], content_length: int | None) -> None:
        """Write the response head; the body is chunked when ``content_length`` is ``None`` (HTTP/1.1)."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"]
        for k, v in headers:
            lines.append(f"{k}: {v}\r\n")
        if status in (204, 304) or self.method == "HEAD":
            # RFC 9110 6.4.1: these answers have no body whatever the head says; writing one would be read
            # by the client as the start of the next response.
            self._no_body = True
            if content_length is not None and status != 204:
                lines.append(f"Content-Length: {content_length}\r\n")
        elif content_length is not None:
            lines.append(f"Content-Length: {content_length}\r\n")
        elif self.version == "HTTP/1.1":
            self._chunked = True
            lines.append("Transfer-Encoding: chunked\r\n")
        else:
            self.keep_alive = False  # an HTTP/1.0 client learns the end from the close
        if not self.keep_alive:
            lines.append("Connection: close\r\n")
        elif self.version == "HTTP/1.0":
            lines.append("Connection: keep-alive\r\n")  # else an HTTP/1.0 client assumes the close (RFC 9112 9.3)
        lines.append("\r\n")
        transport = self.transport
        if transport is not None:
            transport.write("".join(lines).encode("utf-8", "surrogateescape"))

    def write(self, pieces: list[bytes]) -> int:
        """Write body pieces (framed as the head said) in one transport write; returns the client's buffered bytes,
        or -1 when the client is gone."""
        transport = self.transport
        if transport is None:
            return -1
        if self._no_body:
            return transport.get_write_buffer_size()
        if self._chunked:
            frames: list[bytes] = []
            for piece in pieces:
                if piece:
                    frames += (b"%x\r\n" % len(piece), piece, b"\r\n")
            if frames:
                transport.write(b"".join(frames))
        else:
            transport.write(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        return transport.get_write_buffer_size()

    def end(self) -> None:
        """The body is complete: the last chunk, then the next request (keep-alive) or the close."""
        if self.ended:
            return
        self.ended = True
        transport = self.transport
        if transport is not None and self._chunked:
            transport.write(b"0\r\n\r\n")
        self._conn.exchange_done(self)

    def abort(self) -> None:
        """End the client's connection without a clean end of body, so a truncated stream reads as one."""
        self.ended = True
        self.keep_alive = False
        self._conn.close()

    def respond(self, status: int, body: bytes, headers: Iterable[tuple[str, str]] = (),
                content_type: str = "application/json") -> None:
        """A whole response at once."""
        self.start(status, [("Content-Type", content_type), *headers], len(body))
        transport = self.transport
        if transport is not None and body and not self._no_body:
            transport.write(body)
        self.end()


def _origin_form(target: bytes) -> bytes:
    """The path and query of an absolute-form target (``http://host/v1/models?x``), which a server must
    accept (RFC 9112 3.2.2) though clients send it only to forward proxies; the authority is dropped
    (the gateway picks the backend). Anything else that is not a path is refused."""
    lowered = target[:8].lower()
    if lowered.startswith(b"http://"):
        rest = target[7:]
    elif lowered.startswith(b"https://"):
        rest = target[8:]
    else:
        raise BadHead(400, "request target must be a path")
    cut = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:]
    if not authority or b"@" in authority:  # no host, or userinfo (deprecated, a phishing vector)
        raise BadHead(400, "bad absolute-form request target")
    return path if path.startswith(b"/") else b"/" + path


class _ClientConnection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.remote = "-"
        self._buf = b""
        self._exchange: Exchange | None = None
        self._running: Exchange | None = None  # the exchange whose task has started
        self._task: asyncio.Task[Any] | None = None
        self._paused = False  # reading paused: see data_received
        self._write_paused = False  # the client's write buffer is over the transport's high-water mark
        self._head_started = 0.0  # loop time the first byte of a still incomplete head arrived (0: none)
        self._body_started = 0.0  # loop time the head of a request whose body is still arriving completed (0: none)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._last_activity = 0.0
        # A request whose body is still arriving.
        self._pending_head: tuple[str, str, str, str, list[tuple[bytes, bytes]], bool] | None = None
        self._body_length = 0
        self._body_chunks: ChunkedDecoder | None = None
        self._body_parts: list[bytes] = []
        self._body_size = 0

    # ------------------------------------------------------------ protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.remote = str(peer[0])
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self._server._connections) >= self._server.max_connections:
            # Over the cap: each connection may hold a head and a body in memory. Refused at once, so a
            # flood of connections costs a bounded amount (the kernel's backlog holds the rest).
            self._refuse(503, "too many connections")
            return
        self._server._connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._server._connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        task = self._task
        if task is not None and not task.done() and self._running is self._exchange:
            task.cancel()  # the client went away: the handler cancels its upstream request (see _run)

    def data_received(self, data: bytes) -> None:
        self._last_activity = self._loop.time()
        self._buf = self._buf + data if self._buf else data
        if self._exchange is None and not self._write_paused:
            self._process()
        elif not self._paused and (self._write_paused or len(self._buf) > self._server.max_body_bytes + MAX_HEAD_BYTES):
            # Pipelined requests pile up while one is answered, or the client does not read what it asked
            # for: stop reading until the answer is done / the client drained (exchange_done, resume_writing).
            self._paused = True
            if self.transport is not None:
                self.transport.pause_reading()

    def pause_writing(self) -> None:
        # The transport's buffer toward the client is over its high-water mark. A streamed answer has its
        # own bound (the gateway pauses the backend); this one stops the next pipelined request, so a client
        # that sends requests and never reads the answers cannot grow the buffer without bound.
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._exchange is None and self.transport is not None:
            if self._paused:
                self._paused = False
                self.transport.resume_reading()
            if self._buf:
                self._loop.call_soon(self._process)

    def eof_received(self) -> bool:
        # HTTP clients do not half-close to wait for an answer: an EOF is a client that went away, and
        # closing here (connection_lost) is what cancels its request upstream. (aiohttp does the same.)
        return False

    # ------------------------------------------------------------ requests

    def _process(self) -> None:
        """Parse what is buffered into the next request; start it when its body is complete."""
        while (self._exchange is None and not self._write_paused and self.transport is not None
               and not self.transport.is_closing()):
            if self._pending_head is None:
                # Bounded search: a head over the limit is refused even when it arrived in one read.
                end = self._buf.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
                if end < 0:
                    if len(self._buf) > MAX_HEAD_BYTES:
                        self._refuse(431, "request head too large")
                    elif b"\n\n" in self._buf or b"\n\r\n" in self._buf:
                        self._refuse(400, "header lines must end with CRLF")  # an LF-only head: never waits
                    elif self._buf and not self._head_started:
                        self._start_head_clock()
                    return
                self._head_started = 0.0
                try:
                    expect = self._start_head(self._buf[:end])
                except BadHead as exc:
                    self._refuse(exc.status, str(exc))
                    return
                self._buf = self._buf[end + 4:]
                if expect and (self._body_chunks is not None or self._body_length > len(self._buf)):
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the client waits for this to send the body
            if not self._read_body():
                if not self._body_started and self._pending_head is not None:
                    self._start_body_clock()
                return
            self._body_started = 0.0
            method, path, query, version, headers, keep_alive = self._pending_head  # type: ignore[misc]
            body = b"".join(self._body_parts)
            self._pending_head = None
            self._body_parts = []
            exchange = Exchange(self, method, path, query, version, headers, body, keep_alive)
            self._exchange = exchange
            try:
                # Synchronous on purpose: the handler may start its work (the gateway sends the request
                # upstream) in this very turn; what it returns then runs as the request's task.
                coro = self._server.handler.dispatch(exchange)
            except Exception:  # noqa: BLE001 - one request's bug must not take the server down
                log.exception("handling %s %s failed", exchange.method, exchange.path)
                exchange.respond(500, _INTERNAL_ERROR)
                continue
            self._task = self._loop.create_task(self._run(exchange, coro))

    def _start_head(self, head: bytes) -> bool:
        """Parse a request head into ``_pending_head``; returns whether the client expects ``100 Continue``."""
        lines = head.split(b"\r\n")
        # A CR or LF not part of a CRLF, or a NUL, anywhere in the head: refused (RFC 9112 2.2, 5.5). A bare
        # LF in the query would otherwise reach the backend inside the request line: a smuggled header.
        if head.count(b"\n") != len(lines) - 1 or head.count(b"\r") != len(lines) - 1 or b"\0" in head:
            raise BadHead(400, "bare CR, LF or NUL in the request head")
        if len(lines) > MAX_HEADERS + 1:
            raise BadHead(431, f"more than {MAX_HEADERS} header lines")
        parts = lines[0].split(b" ")
        if len(parts) != 3:
            raise BadHead(400, "bad request line")
        method_b, target_b, version_b = parts
        if version_b not in (b"HTTP/1.1", b"HTTP/1.0") or not method_b or method_b.translate(None, _TOKEN):
            raise BadHead(400, "bad request line")
        if len(target_b.translate(None, _CTL_SP)) != len(target_b):
            raise BadHead(400, "control character in the request target")
        if not target_b.startswith(b"/"):
            target_b = _origin_form(target_b)
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        chunked = False
        connection = b""
        expect = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            # translate(None, _TOKEN) deletes the token characters: anything left is not a header name.
            if not sep or not name or name.translate(None, _TOKEN):
                raise BadHead(400, "bad header line")
            value = value.strip(b" \t")
            headers.append((name, value))
            lname = name.lower()
            if lname == b"content-length":
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise BadHead(400, "bad Content-Length")
                length = int(value)
            elif lname == b"transfer-encoding":
                if value.lower() != b"chunked":
                    raise BadHead(501, "only the chunked transfer coding is supported")
                if chunked:  # a second "chunked" would mean chunked twice (RFC 9112 6.1)
                    raise BadHead(400, "Transfer-Encoding repeated")
                chunked = True
            elif lname == b"connection":
                connection += b"," + value.lower()
            elif lname == b"expect" and value.lower() == b"100-continue":
                expect = True
        if chunked and length is not None:
            raise BadHead(400, "both Content-Length and Transfer-Encoding")  # RFC 9112 6.1: a smuggling sign
        if chunked and version_b == b"HTTP/1.0":
            raise BadHead(400, "Transfer-Encoding in an HTTP/1.0 request")  # RFC 9112 6.1: faulty framing
        if length is not None and length > self._server.max_body_bytes:
            raise BadHead(413, f"request body larger than {self._server.max_body_bytes} bytes")
        version = version_b.decode()
        tokens = {t.strip() for t in connection.split(b",")}
        keep_alive = b"close" not in tokens if version == "HTTP/1.1" else b"keep-alive" in tokens
        target = target_b.decode("utf-8", "surrogateescape")
        path, _, query = target.partition("?")
        self._pending_head = (method_b.decode(), path, query, version, headers, keep_alive)
        self._body_length = length or 0
        self._body_chunks = ChunkedDecoder() if chunked else None
        self._body_parts = []
        self._body_size = 0
        return expect

    def _read_body(self) -> bool:
        """Move body bytes from the buffer; ``True`` once the body is complete."""
        decoder = self._body_chunks
        if decoder is None:
            need = self._body_length - self._body_size
            if need <= 0:
                return True
            if len(self._buf) < need:
                if self._buf:
                    self._body_parts.append(self._buf)
                    self._body_size += len(self._buf)
                    self._buf = b""
                return False
            self._body_parts.append(self._buf[:need])
            self._body_size += need
            self._buf = self._buf[need:]
            return True
        data, self._buf = self._buf, b""
        try:
            pieces = decoder.feed(data)
        except ChunkedError as exc:
            self._refuse(400, str(exc))
            return False
        for piece in pieces:
            self._body_size += len(piece)
            self._body_parts.append(piece)
        if self._body_size > self._server.max_body_bytes:
            self._refuse(413, f"request body larger than {self._server.max_body_bytes} bytes")
            return False
        if decoder.done:
            if decoder.extra:
                self._buf = data[len(data) - decoder.extra:]  # the next pipelined request
            return True
        return False

    async def _run(self, exchange: Exchange, coro: Any) -> None:
        self._running = exchange
        if self.transport is None:
            # The client left before this task ran. It was not cancelled then (a coroutine cancelled
            # before its first step runs no cleanup, and the handler may have sent upstream already):
            # cancel now, so the handler's cleanup sees a CancelledError at its first await.
            task = asyncio.current_task()
            if task is not None:
                task.cancel()
        try:
            await coro
        except asyncio.CancelledError:
            exchange.keep_alive = False
            raise
        except Exception:  # noqa: BLE001 - one request's bug must not take the server down
            log.exception("handling %s %s failed", exchange.method, exchange.path)
            if not exchange.started and not exchange.gone:
                exchange.respond(500, _INTERNAL_ERROR)
            else:
                exchange.abort()
        finally:
            if not exchange.ended:
                exchange.abort()
                self.exchange_done(exchange)

    def exchange_done(self, exchange: Exchange) -> None:
        if self._exchange is not exchange:
            return
        self._exchange = None
        self._task = None
        if not exchange.keep_alive:
            self.close()
            return
        if self._paused and not self._write_paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._arm_idle()
        if self._buf:
            self._loop.call_soon(self._process)  # a pipelined request, on its own turn

    def _refuse(self, status: int, message: str) -> None:
        transport = self.transport
        if transport is None:
            return
        body = ('{"object":"error","type":"invalid_request_error","code":%d,"message":"%s"}'
                % (status, message.replace('"', "'"))).encode()
        transport.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        self.close()

    def close(self) -> None:
        """Close after what is buffered was sent; a client that does not take it within ``linger_seconds``
        is cut off (else a client that never reads would hold the connection and its buffer forever)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.close()
        if transport.get_write_buffer_size():
            self._loop.call_later(self._server.linger_seconds, transport.abort)  # a no-op once closed

    # ------------------------------------------------------------ idle connections

    def _arm_idle(self) -> None:
        self._last_activity = self._loop.time()
        if self._idle_timer is None:
            self._idle_timer = self._loop.call_at(self._last_activity + self._server.keepalive_seconds, self._check_idle)

    def _start_head_clock(self) -> None:
        """A head started arriving: it has ``head_timeout_seconds`` to complete, however its bytes trickle in."""
        self._head_started = self._loop.time()
        self._check_idle_by(self._head_started + self._server.head_timeout_seconds)

    def _start_body_clock(self) -> None:
        """A head is complete and its body still arriving: the body has ``body_timeout_seconds`` to complete."""
        self._body_started = self._loop.time()
        self._check_idle_by(self._body_started + self._server.body_timeout_seconds)

    def _check_idle_by(self, due: float) -> None:
        """Make the idle timer fire no later than ``due``."""
        if self._idle_timer is not None and self._idle_timer.when() > due:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._idle_timer is None:
            self._idle_timer = self._loop.call_at(due, self._check_idle)

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self.transport is None or self._exchange is not None:
            return  # a request in progress has its own timeouts; this timer re-arms when it ends
        now = self._loop.time()
        if self._body_started and self._pending_head is not None:
            # A body trickled a byte at a time would keep the idle timer from ever firing: like the
            # head, the whole body has its own clock, from the end of its head.
            request_due = self._body_started + self._server.body_timeout_seconds
            if now >= request_due:
                self._refuse(408, "request body not received in time")
                return
        elif self._head_started and self._pending_head is None:
            # A slow-loris client sends a head a byte at a time: each byte would reset an idle timer,
            # so the head's own clock runs from its first byte.
            request_due = self._head_started + self._server.head_timeout_seconds
            if now >= request_due:
                self._refuse(408, "request head not received in time")
                return
        else:
            request_due = float("inf")
        due = self._last_activity + self._server.keepalive_seconds
        if now >= due:
            self.close()  # idle between requests, or a body that stopped arriving
        else:
            self._idle_timer = self._loop.call_at(min(due, request_due), self._check_idle)


class HttpServer:
    """Listens on ``host:port`` (0: any free port, see :attr:`port`) and hands requests to ``handler``."""

    def __init__(self, handler: Handler, *, max_body_bytes: int, keepalive_seconds: float = 75.0,
                 head_timeout_seconds: float = 10.0, body_timeout_seconds: float = 60.0,
                 max_connections: int = 10_000, linger_seconds: float = 10.0) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        #: Idle time allowed between requests, and between the reads of a request body.
        self.keepalive_seconds = keepalive_seconds
        #: Time allowed for a request head, from its first byte (header read timeout).
        self.head_timeout_seconds = head_timeout_seconds
        #: Time allowed for a request body, from the end of its head (then: 408).
        self.body_timeout_seconds = body_timeout_seconds
        #: Open client connections at most; one more is answered 503 and closed.
        self.max_connections = max_connections
        #: How long a closing connection may take to send what is buffered before it is aborted.
        self.linger_seconds = linger_seconds
        self._server: asyncio.Server | None = None
        self._connections: set[_ClientConnection] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ClientConnection(self), host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self, grace: float = 1.0) -> None:
        """Stop listening; requests in progress get ``grace`` seconds, then their connections close."""
        if self._server is None:
            return
        self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(c._exchange is not None for c in self._connections) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self._connections):
            if conn.transport is not None:
                conn.transport.close()
        await asyncio.sleep(0)
        self._server = None
