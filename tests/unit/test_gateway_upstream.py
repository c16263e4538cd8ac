"""The gateway's upstream HTTP/1.1 client, driven byte by byte without sockets."""

from __future__ import annotations

import asyncio

import pytest

from llmdiag.gateway.upstream import (ConnectFailed, ProtocolError, UpstreamConnection, UpstreamTimeout, parse_head)


class _Transport(asyncio.Transport):
    """Records writes; closing calls the protocol's connection_lost like a socket transport would."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closing = False
        self.reading = True
        self.protocol: UpstreamConnection | None = None

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            assert self.protocol is not None
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


def _conn() -> tuple[UpstreamConnection, _Transport]:
    conn = UpstreamConnection(None, "http://x")
    transport = _Transport()
    transport.protocol = conn
    conn.connection_made(transport)
    return conn, transport


def _stream(conn: UpstreamConnection) -> list[bytes]:
    got: list[bytes] = []
    conn.stream_body(got.extend)
    return got


# ------------------------------------------------------------------ the head


def test_parse_head_framing_and_keep_alive() -> None:
    head = parse_head(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\nX-A: 2")
    assert (head.status, head.reason, head.chunked, head.content_length, head.keep_alive) == (200, "OK", True, None, True)
    assert head.headers == [("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked"), ("X-A", "1"),
                            ("X-A", "2")]
    assert head.header_map()["x-a"] == "2"
    # Chunked wins over Content-Length (RFC 9112 6.3); Connection: close ends reuse.
    head = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: gzip, chunked\r\nConnection: close")
    assert (head.chunked, head.content_length, head.keep_alive) == (True, None, False)
    # HTTP/1.0 reuses only on request; no length and no chunking: the body ends with the connection.
    assert parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 2").keep_alive is False
    assert parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive").keep_alive is True
    assert parse_head(b"HTTP/1.1 200 OK").keep_alive is False
    assert parse_head(b"HTTP/1.1 204 No Content").keep_alive is True


def test_parse_head_ambiguous_framing_is_read_by_te_and_never_reused() -> None:
    # Both framings without Connection: close: TE frames the body, and the connection is not trusted again.
    head = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked")
    assert (head.chunked, head.content_length, head.keep_alive) == (True, None, False)
    # A coding other than chunked last: read until the close, whatever Content-Length says.
    head = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: gzip")
    assert (head.chunked, head.content_length, head.keep_alive) == (False, None, False)


@pytest.mark.parametrize("head", [
    b"HTTP/2 200 OK", b"ICY 200 OK", b"HTTP/1.1 2000 OK", b"HTTP/1.1 20x OK",
    b"HTTP/1.1 200 OK\r\nno-colon", b"HTTP/1.1 200 OK\r\n folded: x", b"HTTP/1.1 200 OK\r\nName : x",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1", b"HTTP/1.1 200 OK\r\nContent-Length: \xc2\xb2",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2",
    # Bare LF, bare CR, NUL: would be forwarded to the client inside a header (response splitting).
    b"HTTP/1.1 200 OK\r\nX-A: a\nInjected: 1", b"HTTP/1.1 200 OK\r\nX-A: a\rb", b"HTTP/1.1 200 OK\r\nX-A: a\x00b",
    b"HTTP/1.1 200 OK\nX-A: a", b"HTTP/1.1 200 OK\r\nBad Name: x",
])
def test_parse_head_rejects_what_is_not_http_1(head: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_head(head)


# ------------------------------------------------------------------ bodies


async def test_chunked_body_split_at_every_byte_is_reassembled() -> None:
    wire = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n1\r\n \r\nA\r\n0123456789\r\n0\r\nTrailer: x\r\n\r\n")
    for cut in range(1, 8):  # every split of the wire into pieces of `cut` bytes
        conn, transport = _conn()
        conn.send(b"POST / HTTP/1.1\r\n\r\n", 5.0, asyncio.get_running_loop().time() + 5.0)
        for i in range(0, len(wire), cut):
            conn.data_received(wire[i:i + cut])
        head = await conn.read_head()
        got = _stream(conn)
        assert await conn.wait_body() is True
        assert head.status == 200 and b"".join(got) == b"hello 0123456789"
        assert conn.reusable and transport.written == [b"POST / HTTP/1.1\r\n\r\n"]


async def test_pieces_reach_the_sink_as_they_arrive() -> None:
    conn, _ = _conn()
    conn.send(b"req", 5.0, asyncio.get_running_loop().time() + 5.0)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\ntok1\r\n")
    await conn.read_head()
    calls: list[list[bytes]] = []
    conn.stream_body(calls.append)
    assert calls == [[b"tok1"]]  # read before the sink existed: handed over at once
    conn.data_received(b"4\r\ntok2\r\n4\r\ntok3\r\n")
    assert calls[-1] == [b"tok2", b"tok3"]  # one call per read, in the same turn
    conn.data_received(b"0\r\n\r\n")
    assert await conn.wait_body() is True


async def test_content_length_body_and_bytes_past_it() -> None:
    conn, transport = _conn()
    conn.send(b"req", 5.0, asyncio.get_running_loop().time() + 5.0)
    conn.data_received(b"HTTP/1.1 429 Too Many\r\nContent-Length: 4\r\nRetry-After: 1\r\n\r\nbu")
    head = await conn.read_head()
    assert head.status == 429 and head.content_length == 4
    conn.data_received(b"syEXTRA")
    assert await conn.read_body(1024) == b"busy"
    assert not conn.reusable  # bytes past the end: not trusted for the next request


async def test_1xx_is_skipped_and_read_until_close_ends_at_eof() -> None:
    conn, transport = _conn()
    conn.send(b"req", 5.0, asyncio.get_running_loop().time() + 5.0)
    conn.data_received(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\n\r\nall of it")
    head = await conn.read_head()
    got = _stream(conn)
    conn.connection_lost(None)
    assert await conn.wait_body() is True
    assert head.status == 200 and got == [b"all of it"] and not conn.reusable


async def test_read_body_is_capped_and_closes() -> None:
    conn, transport = _conn()
    conn.send(b"req", 5.0, asyncio.get_running_loop().time() + 5.0)
    conn.data_received(b"HTTP/1.1 500 Oops\r\nContent-Length: 100\r\n\r\n" + b"x" * 40)
    await conn.read_head()
    assert await conn.read_body(10) == b"x" * 10
    assert transport.closing


@pytest.mark.parametrize("body", [b"zz\r\n", b"0x5\r\nhello\r\n", b"+5\r\nhello\r\n", b"1_0\r\n", b"5\r\nhelloXX"])
async def test_bad_chunking_is_a_protocol_error(body: bytes) -> None:
    conn, transport = _conn()
    conn.send(b"req", 5.0, asyncio.get_running_loop().time() + 5.0)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    await conn.read_head()
    _stream(conn)
    conn.data_received(body)
    with pytest.raises(ProtocolError):
        await conn.wait_body()
    assert transport.closing


# ------------------------------------------------------------------ failures


async def test_close_before_any_answer_is_a_connect_failure_and_mid_body_a_protocol_error() -> None:
    conn, _ = _conn()
    conn.send(b"req", 5.0, asyncio.get_running_loop().time() + 5.0)
    conn.connection_lost(ConnectionResetError())
    with pytest.raises(ConnectFailed):
        await conn.read_head()
    conn, _ = _conn()
    conn.send(b"req", 5.0, asyncio.get_running_loop().time() + 5.0)
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    await conn.read_head()
    _stream(conn)
    conn.connection_lost(None)
    with pytest.raises(ProtocolError):
        await conn.wait_body()


async def test_head_too_long_is_refused() -> None:
    conn, transport = _conn()
    conn.send(b"req", 5.0, asyncio.get_running_loop().time() + 5.0)
    conn.data_received(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000)
    with pytest.raises(ProtocolError, match="longer than"):
        await conn.read_head()
    assert transport.closing


async def test_idle_timeout_and_deadline() -> None:
    loop = asyncio.get_running_loop()
    conn, transport = _conn()
    conn.send(b"req", 0.05, loop.time() + 5.0)
    with pytest.raises(UpstreamTimeout, match="silent"):
        await conn.read_head()
    assert transport.closing
    # Bytes keep coming, but the whole exchange has a deadline.
    conn, transport = _conn()
    conn.send(b"req", 0.2, loop.time() + 0.15)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    await conn.read_head()
    _stream(conn)
    for _ in range(5):
        await asyncio.sleep(0.04)
        conn.data_received(b"1\r\nx\r\n")
    with pytest.raises(UpstreamTimeout, match="longer than"):
        await conn.wait_body()


async def test_pause_stops_reading_and_the_idle_clock() -> None:
    loop = asyncio.get_running_loop()
    conn, transport = _conn()
    conn.send(b"req", 0.05, loop.time() + 5.0)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    await conn.read_head()
    _stream(conn)
    conn.pause()
    assert transport.reading is False
    assert await conn.wait_body() is False  # paused: the caller drains the client, then resumes
    await asyncio.sleep(0.12)  # longer than the idle timeout, but we were the ones not reading
    conn.resume()
    assert transport.reading is True
    conn.data_received(b"0\r\n\r\n")
    assert await conn.wait_body() is True
