"""The gateway's upstream connection pool against raw HTTP/1.1 servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket

import pytest

from llmdiag.gateway.upstream import ConnectFailed, UpstreamPool

pytestmark = pytest.mark.integration

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class _Server:
    """Answers each request (one per line-less read) with ``answer``; counts connections; can close idle ones."""

    def __init__(self, answer: bytes = ANSWER, delay: float = 0.0) -> None:
        self.answer = answer
        self.delay = delay
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                await asyncio.sleep(self.delay)
                writer.write(self.answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        for w in self.writers:
            w.close()
        self.server.close()


async def _exchange(pool: UpstreamPool, url: str) -> bytes:
    conn = await pool.acquire(url)
    try:
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 5.0, asyncio.get_running_loop().time() + 5.0)
        head = await conn.read_head()
        assert head.status == 200
        return await conn.read_body(1 << 20)
    finally:
        pool.release(conn)


async def test_connections_are_reused_and_bounded() -> None:
    server = _Server(delay=0.05)
    async with server as url:
        pool = UpstreamPool(limit_per_backend=2, keepalive_seconds=30, connect_timeout=2)
        assert [await _exchange(pool, url) for _ in range(5)] == [b"ok"] * 5
        assert server.connections == 1  # one kept-alive connection for sequential requests
        # Six at once with a limit of two: they queue for the two connections.
        assert await asyncio.gather(*(_exchange(pool, url) for _ in range(6))) == [b"ok"] * 6
        assert server.connections == 2
        await pool.close()


async def test_a_connection_the_backend_closed_is_not_reused() -> None:
    server = _Server()
    async with server as url:
        pool = UpstreamPool(limit_per_backend=4, keepalive_seconds=30, connect_timeout=2)
        assert await _exchange(pool, url) == b"ok"
        for w in server.writers:  # the backend's keep-alive timeout
            w.close()
        await asyncio.sleep(0.05)
        assert await _exchange(pool, url) == b"ok"
        assert server.connections == 2
        await pool.close()


async def test_idle_connections_expire_after_keepalive() -> None:
    server = _Server()
    async with server as url:
        pool = UpstreamPool(limit_per_backend=4, keepalive_seconds=0.1, connect_timeout=2)
        assert await _exchange(pool, url) == b"ok"
        await asyncio.sleep(0.3)
        assert await _exchange(pool, url) == b"ok"
        assert server.connections == 2
        await pool.close()


async def test_refused_connection_is_a_connect_failure_and_frees_its_slot() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = UpstreamPool(limit_per_backend=1, keepalive_seconds=30, connect_timeout=2)
    for _ in range(3):  # the slot is given back each time, or the second attempt would wait forever
        with pytest.raises(ConnectFailed):
            await asyncio.wait_for(pool.acquire(f"http://127.0.0.1:{port}"), 2.0)
    await pool.close()
