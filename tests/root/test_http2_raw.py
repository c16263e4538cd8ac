"""http2 collector on hand-written byte streams: exact counts, splits, garbage.

The "backend" is a plain TCP listener in this process that reads whatever
arrives (recv -> recvfrom); the client writes a real HTTP/2 byte stream whose
every byte the test controls, with pauses so the pieces arrive in separate
reads.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import pytest

from llmdiag.config.http2 import Http2Config
from llmdiag.model import Backend

pytestmark = pytest.mark.root

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, HEADERS, RST_STREAM, GOAWAY, WINDOW_UPDATE, DATA = 4, 1, 3, 7, 8, 0
END_STREAM, END_HEADERS = 0x1, 0x4
CANCEL, ENHANCE_YOUR_CALM, REFUSED_STREAM = 8, 11, 7
PAUSE = 0.05


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


class ReadingBackend:
    """Accepts connections and reads them until EOF (the traced side)."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.accepted = threading.Semaphore(0)
        self.received = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.release()
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        with conn:
            while chunk := conn.recv(65536):
                self.received += len(chunk)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def backend():
    server = ReadingBackend()
    yield server
    server.close()


@pytest.fixture
def collector(backend):
    from llmdiag.collectors.h2_kernel import H2Kernel
    from llmdiag.collectors.http2 import Http2Collector

    config = Http2Config()
    collector = Http2Collector([Backend.from_url(f"grpc://127.0.0.1:{backend.port}", name="raw")],
                               H2Kernel.load(config), config)
    collector.refresh()
    yield collector
    collector.close()


def _signals(collector) -> dict:
    return {s.name: s.value for s in collector.collect(time.time()) if s.subject == "raw"}


def _connect(backend: ReadingBackend) -> socket.socket:
    client = socket.create_connection(("127.0.0.1", backend.port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    assert backend.accepted.acquire(timeout=5)
    return client


def _send_in_pieces(client: socket.socket, pieces: list[bytes]) -> None:
    for piece in pieces:
        client.sendall(piece)
        time.sleep(PAUSE)  # arrives as its own read on the backend


def _stream_with_splits() -> list[bytes]:
    headers = frame(HEADERS, END_HEADERS, 1, b"\x82\x86\x84\x41\x0fwww.example.com")
    data = frame(DATA, 0, 1, b"d" * 300)
    rst = frame(RST_STREAM, 0, 1, struct.pack(">I", CANCEL))
    goaway = frame(GOAWAY, 0, 0, struct.pack(">II", 1, ENHANCE_YOUR_CALM) + b"debug")
    return [
        PREFACE[:10],                          # the preface split across two writes
        PREFACE[10:] + frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 1 << 20)),
        headers[:5],                           # a frame header split across writes
        headers[5:] + data[:100],              # a frame payload split across writes
        data[100:] + rst[:11],                 # RST_STREAM: its error code split across writes
        rst[11:] + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1000)),
        goaway,
    ]


def _assert_exact(signals: dict) -> None:
    assert signals["h2_streams_opened_total"] == 1
    assert signals["h2_streams_closed_total"] == 1  # by the RST_STREAM
    assert signals["h2_rst_stream_total"] == {"code=CANCEL,direction=received": 1}
    assert signals["h2_goaway_total"] == {"code=ENHANCE_YOUR_CALM,direction=received": 1}
    assert signals["h2_settings_total"] == {"direction=received": 1, "direction=sent": 0}
    assert signals["h2_window_update_total"] == {"direction=received": 1, "direction=sent": 0}
    assert signals["h2_parse_resyncs_total"] == 0
    assert signals["grpc_connections"] == 1


def test_split_preface_and_frames_on_a_connection_adopted_by_its_preface(backend, collector) -> None:
    # no /proc refresh between connect and the preface: the program adopts the fd itself
    with _connect(backend) as client:
        _send_in_pieces(client, _stream_with_splits())
        signals = _signals(collector)
        events = collector.recent_events()
    _assert_exact(signals)
    assert [(e.frame, e.code, e.stream_id, e.last_stream_id) for e in events] == [
        ("RST_STREAM", "CANCEL", 1, 0), ("GOAWAY", "ENHANCE_YOUR_CALM", 0, 1)]
    assert events[0].connection == events[1].connection
    assert collector.kernel.errors()["read"] == 0


def test_split_preface_on_a_connection_pushed_from_proc(backend, collector) -> None:
    with _connect(backend) as client:
        collector.refresh()  # /proc scan finds the accepted socket before any byte arrives
        [pushed] = collector.connections()
        assert not pushed.confirmed
        _send_in_pieces(client, _stream_with_splits())
        _assert_exact(_signals(collector))


def test_garbage_on_a_backend_port_counts_nothing(backend, collector) -> None:
    rng = random.Random(20261202)
    garbage_streams = [
        [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", rng.randbytes(70000)],
        [b"PRI * HTTP/1.1\r\n\r\n", rng.randbytes(5000)],  # looks like a preface for 8 bytes
        [b"PRI", b" * HTTP/2.0\r\n\r\nXX\r\n\r\n", frame(RST_STREAM, 0, 1, struct.pack(">I", CANCEL))],
        [b"\x00" * 4096, bytes(range(256)) * 64],
        [rng.randbytes(9), rng.randbytes(1), rng.randbytes(40000)],
    ]
    for i, pieces in enumerate(garbage_streams):
        with _connect(backend) as client:
            if i % 2:
                collector.refresh()  # half of them pushed from /proc, half left to the program
            _send_in_pieces(client, pieces)
            signals = _signals(collector)
            assert signals["grpc_connections"] == 0, pieces[0][:20]
    assert signals["h2_streams_opened_total"] == 0
    assert signals["h2_streams_closed_total"] == 0
    assert signals["h2_rst_stream_total"] == {} and signals["h2_goaway_total"] == {}
    assert signals["h2_settings_total"] == {"direction=received": 0, "direction=sent": 0}
    assert collector.recent_events() == []
    errors = collector.kernel.errors()
    assert errors["tail_call"] == 0 and errors["map_full"] == 0
    # the program is still alive and exact after the garbage
    with _connect(backend) as client:
        _send_in_pieces(client, _stream_with_splits())
        _assert_exact(_signals(collector))


def test_closed_connection_leaves_the_map_and_keeps_the_counts(backend, collector) -> None:
    with _connect(backend) as client:
        _send_in_pieces(client, [PREFACE + frame(SETTINGS, 0, 0),
                                 frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x82"),
                                 frame(RST_STREAM, 0, 1, struct.pack(">I", REFUSED_STREAM))])
        assert _signals(collector)["grpc_connections"] == 1
    deadline = time.monotonic() + 5
    while _signals(collector)["grpc_connections"] and time.monotonic() < deadline:
        time.sleep(0.05)
    signals = _signals(collector)
    assert signals["grpc_connections"] == 0  # close() removed it
    assert signals["h2_rst_stream_total"] == {"code=REFUSED_STREAM,direction=received": 1}
    assert signals["h2_streams_opened_total"] == 1 and signals["h2_streams_closed_total"] == 1
