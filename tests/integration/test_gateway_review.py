"""Adversarial cases for the gateway's own HTTP/1.1 stack (issue 17): raw-byte backends and clients on 127.0.0.1.

Each backend here is a plain socket server that answers with scripted bytes,
so it can say what no HTTP library would: garbage, bare LFs, both framings.
Every test also checks the balancer's books: every pick ends with exactly one
``on_finish``.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import Backend

from gateway_support import MODEL, gateway

pytestmark = pytest.mark.integration

_BODY = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
_REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY))

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class RawBackend:
    """Answers each completion request with ``answer(reader, writer, n)`` (n: 0, 1, ...); a GET on a
    connection of its own (model lists, engine metrics) normally."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests = 0
        self.connections: list[int] = []  # the connection number of each completion request
        self._conns = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> RawBackend:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns += 1
        conn = self._conns
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if not head.startswith(b"POST "):  # the gateway's model lists and engine-metrics scrapes
                    body = json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()
                    status = b"200 OK" if head.startswith(b"GET /v1/models ") else b"404 Not Found"
                    writer.write(b"HTTP/1.1 %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                                 % (status, len(body), body))
                    await writer.drain()
                    break
                n = self.requests
                self.requests += 1
                self.connections.append(conn)
                await self.answer(reader, writer, n)
                if writer.is_closing():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


def _count_finishes(balancer: Any) -> list[Any]:
    """Wraps ``balancer.on_finish``: the returned list gets each call's status."""
    calls: list[Any] = []
    original = balancer.on_finish

    def on_finish(backend: Any, status: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(status)
        return original(backend, status, *args, **kwargs)

    balancer.on_finish = on_finish
    return calls


async def _read_response(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes, bool]:
    """Status line, headers, body, and whether the body ended cleanly (False: the connection closed early)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head[:-4].split(b"\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
    body = b""
    try:
        if b"content-length" in headers:
            body = await asyncio.wait_for(reader.readexactly(int(headers[b"content-length"])), 10)
        elif headers.get(b"transfer-encoding") == b"chunked":
            while True:
                size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10))[:-2], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                body += (await reader.readexactly(size + 2))[:-2]
        elif not lines[0].split(b" ")[1].startswith((b"204", b"304")):
            body = await asyncio.wait_for(reader.read(), 10)
    except asyncio.IncompleteReadError as exc:
        return lines[0], headers, body + exc.partial, False
    return lines[0], headers, body, True


async def _settle(balancer: Any, name: str) -> None:
    for _ in range(250):
        if balancer.load(name) == 0:
            return
        await asyncio.sleep(0.02)


def _fixed(data: bytes, close: bool = False) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(data)
        await writer.drain()
        if close:
            writer.close()
    return answer


# ------------------------------------------------------------------ what a backend answers


@pytest.mark.parametrize(("wire", "client_sees"), [
    (b"garbage\r\n\r\n", b"502"),
    (b"HTTP/1.1 200 OK\r\nX-A: a\nInjected: 1\r\nContent-Length: 2\r\n\r\nok", b"502"),  # bare LF: splitting
    (b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\nok", b"502"),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", b"502"),  # never asked for
])
async def test_a_backend_answering_garbage_is_a_502_and_one_finish(wire: bytes, client_sees: bytes) -> None:
    backend = await RawBackend(_fixed(wire)).start()
    try:
        async with gateway([Backend("r", backend.url, models=(MODEL,))], BalancerConfig(max_retries=0)) as gw:
            finishes = _count_finishes(gw.balancer)
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(_REQUEST)
            line, headers, body, _ = await _read_response(reader)
            assert line.split(b" ")[1] == client_sees
            assert b"injected" not in headers
            writer.close()
            await _settle(gw.balancer, "r")
            assert gw.balancer.load("r") == 0 and len(finishes) == 1
    finally:
        await backend.stop()


@pytest.mark.parametrize("wire", [
    # Both framings: Transfer-Encoding wins (RFC 9112 6.3), and the connection is not trusted again.
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    # A coding other than chunked last: the body ends with the connection.
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: identity\r\n\r\nok",
])
async def test_ambiguous_framing_from_a_backend_is_read_by_te_and_the_connection_not_reused(wire: bytes) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(wire)
        await writer.drain()
        if b"identity" in wire:
            writer.close()

    backend = await RawBackend(answer).start()
    try:
        async with gateway([Backend("r", backend.url, models=(MODEL,))]) as gw:
            finishes = _count_finishes(gw.balancer)
            for _ in range(2):
                reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
                writer.write(_REQUEST)
                line, _, body, clean = await _read_response(reader)
                assert line == b"HTTP/1.1 200 OK" and body == b"ok" and clean
                writer.close()
                await _settle(gw.balancer, "r")
            assert len(backend.connections) == 2 and backend.connections[0] != backend.connections[1]
            assert finishes == [200, 200]
    finally:
        await backend.stop()


@pytest.mark.parametrize("wire", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",  # closed mid-chunk
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",  # closed before the last chunk
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello",  # closed before Content-Length
])
async def test_a_backend_closing_mid_body_is_a_truncated_stream_for_the_client(wire: bytes) -> None:
    backend = await RawBackend(_fixed(wire, close=True)).start()
    try:
        async with gateway([Backend("r", backend.url, models=(MODEL,))]) as gw:
            finishes = _count_finishes(gw.balancer)
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(_REQUEST)
            line, _, body, clean = await _read_response(reader)
            assert line == b"HTTP/1.1 200 OK" and not clean  # never a clean end
            assert body.startswith(b"hel")
            writer.close()
            await _settle(gw.balancer, "r")
            assert len(finishes) == 1 and finishes[0] == 502
    finally:
        await backend.stop()


async def test_longer_than_declared_1xx_and_connection_close_from_the_backend() -> None:
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA",  # more than declared: cut, connection dropped
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",  # 1xx skipped; then not reused
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",  # reused: the previous answer was clean
    ]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(answers[n])
        await writer.drain()

    backend = await RawBackend(answer).start()
    try:
        async with gateway([Backend("r", backend.url, models=(MODEL,))]) as gw:
            finishes = _count_finishes(gw.balancer)
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            for _ in answers:
                writer.write(_REQUEST)
                line, _, body, clean = await _read_response(reader)
                assert (line, body, clean) == (b"HTTP/1.1 200 OK", b"ok", True)
                await _settle(gw.balancer, "r")
                await asyncio.sleep(0.05)  # the backend's close reaches the pool
            c = backend.connections
            assert c[1] != c[0] and c[2] != c[1] and c[3] == c[2]
            assert finishes == [200] * 4
            writer.close()
    finally:
        await backend.stop()


async def test_a_204_from_the_backend_reaches_the_client_without_a_body() -> None:
    backend = await RawBackend(_fixed(b"HTTP/1.1 204 No Content\r\n\r\n")).start()
    try:
        async with gateway([Backend("r", backend.url, models=(MODEL,))], BalancerConfig(max_retries=0)) as gw:
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(_REQUEST + b"GET /healthz HTTP/1.1\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 204") and b"Content-Length" not in head
            line, _, body, _ = await _read_response(reader)  # the next answer starts right after the head
            assert line == b"HTTP/1.1 200 OK" and body == b"ok\n"
            writer.close()
    finally:
        await backend.stop()


# ------------------------------------------------------------------ the client side, through the gateway


async def test_a_client_that_never_reads_is_ended_by_the_request_timeout() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"data: " + b"x" * 65_000 + b"\n\n"
        frame = b"%x\r\n%s\r\n" % (len(piece), piece)
        while True:
            writer.write(frame)
            await writer.drain()

    backend = await RawBackend(endless).start()
    try:
        async with gateway([Backend("r", backend.url, models=(MODEL,))], request_timeout_seconds=1.0) as gw:
            finishes = _count_finishes(gw.balancer)
            loop = asyncio.get_running_loop()
            # A bare socket, not a StreamReader (which would keep reading into its own buffer).
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", gw.port))
            await loop.sock_sendall(sock, _REQUEST)
            await asyncio.sleep(3.0)  # reading nothing, well past the 1 s request timeout
            # The gateway gave up on the exchange: the backend got its cancel, the balancer its on_finish,
            # and the client's connection was closed (what it reads now ends without a clean end).
            assert finishes == ["timeout"]
            assert gw.balancer.load("r") == 0
            data = b""
            while piece := await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10):
                data += piece
            assert data.startswith(b"HTTP/1.1 200 OK") and not data.endswith(b"0\r\n\r\n")
            sock.close()
    finally:
        await backend.stop()


async def test_a_gateway_bug_after_the_pick_still_ends_the_pick_once(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = await RawBackend(_fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")).start()
    try:
        async with gateway([Backend("r", backend.url, models=(MODEL,))]) as gw:
            finishes = _count_finishes(gw.balancer)

            def broken(*args: Any, **kwargs: Any) -> float:
                raise RuntimeError("a bug")

            monkeypatch.setattr(gw.balancer, "score", broken)
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(_REQUEST)
            line, _, _, _ = await _read_response(reader)
            assert line == b"HTTP/1.1 500 Internal Server Error"
            writer.close()
            await _settle(gw.balancer, "r")
            assert gw.balancer.load("r") == 0 and len(finishes) == 1
    finally:
        await backend.stop()


async def test_a_backend_that_never_answers_is_a_504_and_one_finish() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await asyncio.sleep(30)

    backend = await RawBackend(silent).start()
    try:
        async with gateway([Backend("r", backend.url, models=(MODEL,))], BalancerConfig(max_retries=0),
                           request_timeout_seconds=0.5) as gw:
            finishes = _count_finishes(gw.balancer)
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(_REQUEST)
            line, _, _, _ = await _read_response(reader)
            assert line.split(b" ")[1] == b"504"
            writer.close()
            await _settle(gw.balancer, "r")
            assert finishes == ["timeout"] and gw.balancer.load("r") == 0
    finally:
        await backend.stop()


async def test_a_pooled_connection_closed_under_a_request_is_retried_elsewhere_before_any_byte() -> None:
    # Backend "a" answers once on a kept-alive connection, then closes it when the next request arrives
    # on it, answering nothing (the race of an idle-close with a reuse). Nothing reached the client yet,
    # so the request goes to "b" (SPEC 6.3); "a" gets its one on_finish (connect_error).
    async def once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 0:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        else:
            writer.transport.abort()

    a = await RawBackend(once_then_close).start()
    b = await RawBackend(_fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")).start()
    try:
        async with gateway([Backend("a", a.url, models=(MODEL,)), Backend("b", b.url, models=(MODEL,))],
                           BalancerConfig(choices=0)) as gw:
            gw.balancer.set_penalty("b", 0.9)  # "a" is the pick while healthy
            finishes = _count_finishes(gw.balancer)
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            for _ in range(2):
                writer.write(_REQUEST)
                line, headers, body, clean = await _read_response(reader)
                assert (line, body, clean) == (b"HTTP/1.1 200 OK", b"ok", True)
            assert headers[b"x-llmdiag-backend"] == b"b"
            assert a.connections == [a.connections[0]] * 2 and b.requests == 1
            assert finishes == [200, "connect_error", 200]
            writer.close()
    finally:
        await a.stop()
        await b.stop()


async def test_a_gateway_bug_in_the_inline_send_still_ends_the_pick_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmdiag.gateway.proxy import Gateway

    backend = await RawBackend(_fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")).start()
    try:
        async with gateway([Backend("r", backend.url, models=(MODEL,))]) as gw:
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(_REQUEST)  # leaves a pooled connection: the next request is sent from data_received
            assert (await _read_response(reader))[0] == b"HTTP/1.1 200 OK"
            await _settle(gw.balancer, "r")
            finishes = _count_finishes(gw.balancer)

            def broken(*args: Any, **kwargs: Any) -> bytes:
                raise RuntimeError("a bug")

            monkeypatch.setattr(Gateway, "_request_bytes", broken)
            writer.write(_REQUEST)
            assert (await _read_response(reader))[0] == b"HTTP/1.1 500 Internal Server Error"
            writer.close()
            await _settle(gw.balancer, "r")
            assert gw.balancer.load("r") == 0 and len(finishes) == 1
    finally:
        await backend.stop()


# ------------------------------------------------------------------ client-side limits from [gateway]

async def test_the_client_side_limits_come_from_the_gateway_config() -> None:
    """``head_timeout_seconds`` and ``max_client_connections`` reach the server (they were fixed at 10 s and 10 000)."""
    backend = await RawBackend(_fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")).start()
    try:
        async with gateway([Backend(name="b", url=backend.url)], head_timeout_seconds=0.3,
                           max_client_connections=2, linger_seconds=0.5) as gwy:
            slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", gwy.port)
            slow_writer.write(b"GET /v1/models HTTP/1.1\r\nX-Slow: ")  # never completes its head
            held_reader, held_writer = await asyncio.open_connection("127.0.0.1", gwy.port)
            over_reader, over_writer = await asyncio.open_connection("127.0.0.1", gwy.port)
            line, headers, _, _ = await _read_response(over_reader)
            assert line.split(b" ")[1] == b"503" and headers[b"connection"] == b"close"
            over_writer.close()
            line, _, _, _ = await _read_response(slow_reader)  # 0.3 s, not 10 s
            assert line.split(b" ")[1] == b"408"
            for w in (slow_writer, held_writer):
                w.close()
    finally:
        await backend.stop()


def test_bad_client_side_limits_are_refused() -> None:
    from llmdiag.config.gateway import GatewayConfig

    for bad in ({"head_timeout_seconds": 0}, {"body_timeout_seconds": -1}, {"linger_seconds": float("nan")}, {"max_client_connections": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GatewayConfig(**bad)
