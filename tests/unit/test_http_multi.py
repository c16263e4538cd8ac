"""MultiFetcher: many GETs from one thread over non-blocking sockets, against real servers on 127.0.0.1.

Servers here speak raw bytes (chunked bodies, bodies that end at the close, garbage, a hang, a drip)
so that every path of the response reader is exercised on a real socket.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from engine_http import SHARED_ENGINES, ScriptedServer

from llmdiag.collectors.http_multi import MultiFetcher, direct_target
from llmdiag.collectors.own_sockets import OwnPorts

SYNTH_TEXT = (SHARED_ENGINES / "vllm_SYNTHETIC_current_v1_names_text0.0.4.prom").read_text()


@contextlib.contextmanager
def raw_server(handler: Callable[[socket.socket], None]) -> Iterator[str]:
    """A TCP server on 127.0.0.1 running ``handler(connection)`` for each connection, in a thread."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            conns.append(conn)
            threading.Thread(target=_guard, args=(handler, conn), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
    finally:
        stop.set()
        thread.join(2)
        listener.close()
        for conn in conns:
            conn.close()


def _guard(handler: Callable[[socket.socket], None], conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        _read_request(conn)
        handler(conn)


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def answer(raw: bytes, close: bool = True) -> Callable[[socket.socket], None]:
    def handler(conn: socket.socket) -> None:
        conn.sendall(raw)
        if close:
            conn.shutdown(socket.SHUT_WR)
            time.sleep(0.2)
    return handler


def fetch(fetcher: MultiFetcher, urls: list[str], timeout: float = 1.0, max_bytes: int = 1 << 20) -> dict:
    return dict(fetcher.fetch_all(urls, timeout, max_bytes))


def test_content_length_chunked_and_read_to_close_bodies() -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"6\r\nvllm:a\r\n4;ext=1\r\n 1.0\r\n0\r\nTrailer: x\r\n\r\n")
    to_close = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nvllm:b 2.0\n"
    with ScriptedServer({"/metrics": [SYNTH_TEXT]}, keep_alive=True) as plain, \
            raw_server(answer(chunked, close=False)) as chunks, raw_server(answer(to_close)) as closing:
        fetcher = MultiFetcher(OwnPorts())
        got = fetch(fetcher, [f"{plain.url}/metrics", chunks, closing])
        fetcher.close()
    assert got[0].status == 200 and got[0].body == SYNTH_TEXT and got[0].content_type.startswith("text/plain")
    assert got[1].status == 200 and got[1].body == "vllm:a 1.0"
    assert got[2].status == 200 and got[2].body == "vllm:b 2.0\n"


def test_one_kept_alive_connection_per_origin_and_a_dropped_one_is_retried() -> None:
    with ScriptedServer({"/metrics": [SYNTH_TEXT]}, keep_alive=True) as kept, \
            ScriptedServer({"/metrics": [SYNTH_TEXT]}, keep_alive=True, drop_idle=True) as dropping:
        fetcher = MultiFetcher(OwnPorts())
        rounds = [fetch(fetcher, [f"{kept.url}/metrics", f"{dropping.url}/metrics"]) for _ in range(4)]
        fetcher.close()
    assert all(r[0].status == 200 and r[1].status == 200 for r in rounds)
    assert len(kept.peers) == 4 and len(set(kept.peers)) == 1  # four GETs, one connection
    # The server closes each connection after answering without saying so: the next GET finds it
    # closed and goes again on a new one, within the same call.
    assert len(set(dropping.peers)) == 4
    assert fetcher.opened_total == 1 + 4


def test_each_failure_has_its_reason_and_a_hung_engine_stalls_no_other() -> None:
    def hang(conn: socket.socket) -> None:
        time.sleep(3)  # accepts, reads the request, never answers

    def drip(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(30):
            conn.sendall(b"x")
            time.sleep(0.1)

    never_ending = b"HTTP/1.1 200 OK\r\n\r\n" + b"y" * 300_000
    with ScriptedServer({"/metrics": [SYNTH_TEXT]}, keep_alive=True) as good, raw_server(hang) as hung, \
            raw_server(drip) as dripping, raw_server(answer(never_ending)) as huge, \
            raw_server(answer(b"SSH-2.0-OpenSSH_9.2\r\n")) as not_http, \
            raw_server(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 5000000\r\n\r\n")) as declared_huge, \
            raw_server(answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")) as bad_chunk, \
            raw_server(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")) as cut:
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{free.getsockname()[1]}/metrics"
        free.close()
        urls = [hung, dripping, f"{good.url}/metrics", huge, not_http, declared_huge, bad_chunk, cut, refused,
                "http://127.0.0.1:99999/metrics", "ftp://127.0.0.1/metrics"]
        fetcher = MultiFetcher(OwnPorts())
        order = list(fetcher.fetch_all(urls, 1.0, 100_000))
        fetcher.close()
    got = dict(order)
    assert len(order) == len(urls)
    failures = {urls[i].split("//")[1][:30]: (r.failure, r.error) for i, r in got.items()}
    assert got[2].status == 200 and got[2].body == SYNTH_TEXT, failures
    assert got[0].failure == "timeout" and got[0].error == "timed out after 1 s"
    assert got[1].failure == "timeout"
    assert got[3].failure == "too_large" and got[5].failure == "too_large"
    assert got[4].failure == "bad_response" and "not HTTP" in got[4].error
    assert got[6].failure == "bad_response" and "chunk size" in got[6].error
    assert got[7].failure == "bad_response" and "mid-response" in got[7].error
    assert got[8].failure == "connection_refused" and got[8].error == "connection refused"
    assert got[9].failure == "bad_url" and got[10].failure == "bad_url"
    # The good engine's answer came out before the hung and the dripping ones were given up on.
    position = [i for i, _ in order]
    assert position.index(2) < position.index(0) and position.index(2) < position.index(1)


def test_http_errors_keep_the_status_and_a_short_body() -> None:
    with ScriptedServer({"/metrics": [(503, "engine is starting " * 40)]}, keep_alive=True) as server:
        fetcher = MultiFetcher(OwnPorts())
        (result,) = fetch(fetcher, [f"{server.url}/metrics"]).values()
        fetcher.close()
    assert result.status == 503 and result.failure == "http_status"
    assert result.error == "HTTP 503 Service Unavailable" and len(result.body) == 200


def test_connections_are_registered_as_ours_before_connecting_and_released_on_close() -> None:
    registry = OwnPorts(linger_seconds=0)
    seen: list[tuple[tuple[int, int], bool]] = []
    registry.subscribe(lambda pair, added: seen.append((pair, added)))
    with ScriptedServer({"/metrics": [SYNTH_TEXT]}, keep_alive=True) as server:
        fetcher = MultiFetcher(registry)
        assert fetch(fetcher, [f"{server.url}/metrics"])[0].status == 200
        pair = (server.peers[0], server.port)
        assert seen == [(pair, True)] and registry.pairs() == {pair}  # open, kept alive
        fetcher.close()
    assert registry.pairs() == frozenset()  # closed (and no linger in this registry)


def test_an_abandoned_call_closes_what_was_in_flight() -> None:
    registry = OwnPorts(linger_seconds=0)

    def hang(conn: socket.socket) -> None:
        time.sleep(2)

    with raw_server(hang) as hung, ScriptedServer({"/metrics": [SYNTH_TEXT]}) as good:
        fetcher = MultiFetcher(registry)
        answers = fetcher.fetch_all([hung, f"{good.url}/metrics"], 5.0, 1 << 20)
        index, first = next(answers)
        assert index == 1 and first.status == 200
        answers.close()  # the caller stops reading: the hung exchange is dropped, not kept
        fetcher.close()
    assert registry.pairs() == frozenset()


@pytest.mark.parametrize(("url", "direct"), [
    ("http://127.0.0.1:8000/metrics", True),
    ("http://[::1]:8000/metrics", True),
    ("http://10.0.0.7/metrics", True),
    ("https://127.0.0.1:8000/metrics", False),
    ("http://vllm-0.llm.svc:8000/metrics", False),
    ("http://127.0.0.1:99999/metrics", False),
])
def test_direct_targets_are_http_at_an_ip_address(url: str, direct: bool) -> None:
    assert direct_target(url) is direct
