"""The gateway's client-facing HTTP/1.1 server, spoken to with raw bytes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from llmdiag.gateway.server import Exchange, HttpServer

pytestmark = pytest.mark.integration


class _Echo:
    """Answers with what it received; ``/stream`` streams three pieces; ``/hang`` waits; ``/boom`` raises."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.seen: list[tuple[str, str, bytes]] = []

    def dispatch(self, exchange: Exchange) -> Any:
        return self._answer(exchange)

    async def _answer(self, exchange: Exchange) -> None:
        self.seen.append((exchange.method, exchange.path, exchange.body))
        if exchange.path == "/stream":
            exchange.start(200, [("Content-Type", "text/event-stream")], None)
            for piece in (b"one ", b"two ", b"three"):
                exchange.write([piece])
                await asyncio.sleep(0)
            exchange.end()
        elif exchange.path == "/hang":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        elif exchange.path == "/boom":
            raise RuntimeError("handler bug")
        else:
            body = json.dumps({"path": exchange.path, "query": exchange.query, "body": exchange.body.decode(),
                               "x": (exchange.header(b"x-test") or b"").decode()}).encode()
            exchange.respond(200, body)


async def _server(keepalive: float = 75.0, max_body: int = 1000) -> tuple[HttpServer, _Echo]:
    echo = _Echo()
    server = HttpServer(echo, max_body_bytes=max_body, keepalive_seconds=keepalive)
    await server.start("127.0.0.1", 0)
    return server, echo


async def _read_response(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head[:-4].split(b"\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
    if b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            body += (await reader.readexactly(size + 2))[:-2]
    else:
        body = await asyncio.wait_for(reader.read(), 5)
    return lines[0], headers, body


async def test_keep_alive_pipelining_and_bodies() -> None:
    server, echo = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    # Two requests in one write (pipelined): a Content-Length body and a chunked one.
    writer.write(b"POST /a?q=1 HTTP/1.1\r\nHost: x\r\nX-Test: yes\r\nContent-Length: 5\r\n\r\nhello"
                 b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;ext\r\nde\r\n0\r\n\r\n")
    status, _, body = await _read_response(reader)
    assert status == b"HTTP/1.1 200 OK"
    assert json.loads(body) == {"path": "/a", "query": "q=1", "body": "hello", "x": "yes"}
    status, _, body = await _read_response(reader)
    assert json.loads(body)["body"] == "abcde"
    # The same connection serves a streamed answer, chunked.
    writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = await _read_response(reader)
    assert headers[b"transfer-encoding"] == b"chunked" and body == b"one two three"
    writer.close()
    await server.stop()


async def test_expect_100_continue_and_http_1_0() -> None:
    server, _ = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"ok")
    assert json.loads((await _read_response(reader))[2])["body"] == "ok"
    writer.close()
    # HTTP/1.0: a streamed answer is not chunked; the close ends it.
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /stream HTTP/1.0\r\n\r\n")
    status, headers, body = await _read_response(reader)
    assert b"transfer-encoding" not in headers and headers[b"connection"] == b"close" and body == b"one two three"
    writer.close()
    await server.stop()


@pytest.mark.parametrize(("target", "path", "query"), [
    (b"http://gw.example/v1/models", "/v1/models", ""),
    (b"HTTPS://gw.example:8443/a?b=1", "/a", "b=1"),
    (b"http://gw.example", "/", ""),
    (b"http://gw.example?x", "/", "x"),
])
async def test_an_absolute_form_target_is_served_by_its_path(target: bytes, path: str, query: str) -> None:
    """RFC 9112 3.2.2: a server must accept the absolute-form; the authority is dropped."""
    server, echo = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET " + target + b" HTTP/1.1\r\nHost: gw.example\r\n\r\n")
    line, _, body = await _read_response(reader)
    assert line == b"HTTP/1.1 200 OK"
    assert echo.seen[-1][:2] == ("GET", path) and json.loads(body)["query"] == query
    writer.close()
    await server.stop()


async def _assert_refused_and_closed(request_bytes: bytes, status: bytes) -> None:
    """``request_bytes`` is answered ``status`` with ``Connection: close``, the connection closes, and
    the handler never sees a request."""
    server, echo = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(request_bytes)
    line, headers, _ = await _read_response(reader)
    assert line.split(b" ")[1] == status
    assert headers[b"connection"] == b"close"
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
    assert echo.seen == []
    writer.close()
    await server.stop()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"POST /a HTTP/1.1\r\nContent-Length: 5000\r\n\r\n", b"413"),
    (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n7D0\r\n" + b"x" * 2000 + b"\r\n", b"413"),
    (b"GET /a HTTP/1.1\r\nX: " + b"a" * 70_000, b"431"),
    (b"POST /a HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", b"400"),
    (b"POST /a HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", b"501"),
    (b"GARBAGE\r\n\r\n", b"400"),
    (b"GET http://user@elsewhere/ HTTP/1.1\r\n\r\n", b"400"),
    (b"GET http:///a HTTP/1.1\r\n\r\n", b"400"),
    (b"OPTIONS * HTTP/1.1\r\n\r\n", b"400"),
    (b"CONNECT elsewhere:443 HTTP/1.1\r\n\r\n", b"400"),
    (b"GET /a HTTP/1.1\r\nBad Header: x\r\n\r\n", b"400"),
    (b"POST /a HTTP/1.1\r\nContent-Length: +3\r\n\r\nabc", b"400"),
    (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n", b"400"),
])
async def test_malformed_or_oversized_requests_are_refused_and_closed(request_bytes: bytes, status: bytes) -> None:
    await _assert_refused_and_closed(request_bytes, status)


async def test_client_gone_cancels_the_handler_and_a_handler_bug_is_a_500() -> None:
    server, echo = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /hang HTTP/1.1\r\n\r\n")
    await asyncio.sleep(0.05)
    writer.close()
    await asyncio.wait_for(echo.cancelled.wait(), 5)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /boom HTTP/1.1\r\n\r\nGET /a HTTP/1.1\r\n\r\n")
    assert (await _read_response(reader))[0] == b"HTTP/1.1 500 Internal Server Error"
    assert (await _read_response(reader))[0] == b"HTTP/1.1 200 OK"  # the connection goes on
    writer.close()
    await server.stop()


async def test_idle_connections_are_closed_after_keepalive() -> None:
    server, _ = await _server(keepalive=0.1)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /a HTTP/1.1\r\n\r\n")
    await _read_response(reader)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server after 0.1 s idle
    # A head that never completes is closed the same way (a slow or stuck client).
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /a HTTP/1.1\r\nX: ")
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await server.stop()


# ---------------------------------------------------------------- adversarial review (issue 17)

@pytest.mark.parametrize(("request_bytes", "status"), [
    # A bare LF inside the query would reach the backend inside the request line (a smuggled header).
    (b"POST /a?x=1\nInjected:%20y HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"400"),
    (b"GET /a HTTP/1.1\r\nX: a\rb\r\n\r\n", b"400"),  # bare CR in a value
    (b"GET /a HTTP/1.1\r\nX: a\x00b\r\n\r\n", b"400"),  # NUL in a value
    (b"GET /a\tb HTTP/1.1\r\n\r\n", b"400"),  # control character in the target
    (b"GET /a HTTP/1.1\nHost: x\n\n", b"400"),  # LF-only line endings: refused at once, not left to time out
    (b"GET /a HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n", b"431"),  # header count
    (b"GET /a HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n", b"431"),  # over the limit, in one write
    (b"POST /a HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"400"),  # TE in HTTP/1.0
    (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"400"),
])
async def test_smuggling_shapes_are_refused_and_closed(request_bytes: bytes, status: bytes) -> None:
    await _assert_refused_and_closed(request_bytes, status)


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"POST /a HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", b"400"),  # differing
    (b"POST /a HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\nhello", b"400"),
    (b"POST /a HTTP/1.1\r\nContent-Length: -1\r\n\r\n", b"400"),
    (b"POST /a HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n", b"413"),
    (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", b"501"),
    (b"POST /a HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", b"501"),
    (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffff\r\n", b"400"),  # size overflow
    (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", b"400"),
    (b"GET /a HTTP/1.1\r\n folded: x\r\n\r\n", b"400"),  # obs-fold
    (b"GET /a HTTP/1.1\r\nX-A : x\r\n\r\n", b"400"),  # space before the colon
])
async def test_framing_errors_already_refused(request_bytes: bytes, status: bytes) -> None:
    await _assert_refused_and_closed(request_bytes, status)


async def test_a_chunk_extension_over_the_line_limit_is_refused_even_in_one_read() -> None:
    server, echo = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2;" + b"e" * 10_000 + b"\r\nab\r\n0\r\n\r\n")
    line, _, _ = await _read_response(reader)
    assert line.split(b" ")[1] == b"400"
    assert echo.seen == []
    writer.close()
    await server.stop()


async def test_chunk_extensions_trailers_and_connection_close() -> None:
    server, echo = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    # Extensions and a trailer are read past; "Connection: close" ends the connection after the answer,
    # and the request pipelined behind it is not served.
    writer.write(b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                 b"2;name=\"v\"\r\nab\r\n0\r\nX-Trailer: t\r\n\r\nGET /b HTTP/1.1\r\n\r\n")
    line, headers, body = await _read_response(reader)
    assert json.loads(body)["body"] == "ab" and headers[b"connection"] == b"close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert [p for _, p, _ in echo.seen] == ["/a"]
    writer.close()
    await server.stop()


async def test_http_1_0_keep_alive_is_answered_as_such_and_kept() -> None:
    server, echo = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    _, headers, _ = await _read_response(reader)
    assert headers[b"connection"] == b"keep-alive"  # else an HTTP/1.0 client would wait for the close
    writer.write(b"GET /b HTTP/1.0\r\n\r\n")  # without keep-alive: answered, then closed
    _, headers, _ = await _read_response(reader)
    assert headers[b"connection"] == b"close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await server.stop()


async def test_head_and_204_answers_carry_no_body() -> None:
    class _NoBody(_Echo):
        async def _answer(self, exchange: Exchange) -> None:
            exchange.respond(204 if exchange.path == "/nc" else 200, b'{"would":"desync"}')

    server = HttpServer(_NoBody(), max_body_bytes=1000)
    await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"HEAD /a HTTP/1.1\r\n\r\nGET /nc HTTP/1.1\r\n\r\nGET /a HTTP/1.1\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 18" in head
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)  # no body bytes before the next head
    assert head.startswith(b"HTTP/1.1 204") and b"Content-Length" not in head
    line, _, body = await _read_response(reader)
    assert line == b"HTTP/1.1 200 OK" and body == b'{"would":"desync"}'
    writer.close()
    await server.stop()


@pytest.mark.parametrize(("limits", "sent_at_once", "drip"), [
    ({"head_timeout_seconds": 0.3}, b"", b"GET /a HTTP/1.1\r\nX-Slow: " + b"a" * 10_000),  # a slow-loris head
    ({"body_timeout_seconds": 0.3, "max_body_bytes": 100_000},
     b"POST /a HTTP/1.1\r\nContent-Length: 50000\r\n\r\n", b"a" * 50_000),  # a body trickled byte by byte
], ids=["head", "body"])
async def test_a_request_trickled_byte_by_byte_is_cut_off_by_its_own_clock(limits: dict, sent_at_once: bytes,
                                                                           drip: bytes) -> None:
    server = HttpServer(_Echo(), **{"max_body_bytes": 1000, "keepalive_seconds": 30.0, **limits})
    await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(sent_at_once)

    async def trickle() -> None:
        for byte in drip:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.02)  # far below the keep-alive timeout: each byte would reset an idle timer

    sender = asyncio.create_task(trickle())
    try:
        line, _, _ = await _read_response(reader)  # long before the trickle (200 s or more) ends
        assert line.split(b" ")[1] == b"408"
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        sender.cancel()
        writer.close()
        await server.stop()


async def test_a_body_within_its_timeout_is_served_and_the_clock_restarts_per_request() -> None:
    server = HttpServer(_Echo(), max_body_bytes=1000, keepalive_seconds=30.0, body_timeout_seconds=0.4)
    await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for _ in range(3):  # 3 x 0.25 s of body on one connection: longer than one body timeout in all
        writer.write(b"POST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\n")
        for byte in b"hello":
            await asyncio.sleep(0.05)
            writer.write(bytes([byte]))
        line, _, _ = await _read_response(reader)
        assert line == b"HTTP/1.1 200 OK"
    writer.close()
    await server.stop()


async def test_connections_over_the_cap_are_refused() -> None:
    server = HttpServer(_Echo(), max_body_bytes=1000, max_connections=2)
    await server.start("127.0.0.1", 0)
    held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    line, headers, _ = await _read_response(reader)
    assert line.split(b" ")[1] == b"503" and headers[b"connection"] == b"close"
    writer.close()
    held[0][1].write(b"GET /a HTTP/1.1\r\n\r\n")  # the ones admitted work
    assert (await _read_response(held[0][0]))[0] == b"HTTP/1.1 200 OK"
    for _, w in held:
        w.close()
    await server.stop()


async def test_a_client_that_pipelines_and_never_reads_is_not_buffered_without_bound() -> None:
    import socket

    server, echo = await _server()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing: small window
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    total = 40_000
    writer.write(b"GET /a HTTP/1.1\r\n\r\n" * total)  # ~6 MB of answers asked for, none read
    seen = -1
    while len(echo.seen) != seen:  # until the server stops making progress
        seen = len(echo.seen)
        await asyncio.sleep(0.3)
    buffered = max(c.transport.get_write_buffer_size() for c in server._connections if c.transport is not None)
    assert len(echo.seen) < total
    assert buffered < 256 * 1024  # the transport's high-water mark plus one answer, not megabytes
    writer.transport.abort()
    await server.stop()


async def test_a_closing_connection_whose_client_never_reads_is_cut_off_after_the_linger() -> None:
    import socket

    answered = asyncio.Event()

    class _Big(_Echo):
        async def _answer(self, exchange: Exchange) -> None:
            exchange.respond(200, b"x" * (8 << 20))  # far more than the kernel's buffers take
            answered.set()

    server = HttpServer(_Big(), max_body_bytes=1000, linger_seconds=0.2)
    await server.start("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", server.port))
    await loop.sock_sendall(sock, b"GET /a HTTP/1.0\r\n\r\n")  # HTTP/1.0: the answer ends with a close
    await asyncio.wait_for(answered.wait(), 5)
    assert server._connections  # closing, with megabytes still to send
    for _ in range(250):  # never read: the server gives up on the buffered answer and lets the connection go
        if not server._connections:
            break
        await asyncio.sleep(0.02)
    assert not server._connections
    sock.close()
    await server.stop()
