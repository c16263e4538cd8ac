"""http2 collector against a real grpcio server and client on loopback (SPEC 4 "http2").

The server runs in this process (so this process is the traced backend pid);
the methods are generic handlers with bytes (de)serializers, no protoc.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent import futures

import pytest

from llmdiag.config.http2 import Http2Config
from llmdiag.model import Backend, Labelled

import grpc  # noqa: E402 - a dev dependency: a missing grpcio must fail CI, not skip it

pytestmark = pytest.mark.root

IDENT = lambda b: b  # noqa: E731 - bytes in, bytes out


def _unary(request: bytes, context) -> bytes:
    return b"pong:" + request


def _slow(request: bytes, context) -> bytes:
    time.sleep(1.0)
    return b"late"


def _ticks(request: bytes, context) -> Iterator[bytes]:
    while context.is_active():
        yield b"t" * 100
        time.sleep(0.01)


def _flood(request: bytes, context) -> Iterator[bytes]:
    # Faster than a slow consumer reads: the stream's send window runs out.
    while context.is_active():
        yield b"x" * 16384


HANDLER = grpc.method_handlers_generic_handler("llmdiag.test.H2", {
    "Unary": grpc.unary_unary_rpc_method_handler(_unary, request_deserializer=IDENT, response_serializer=IDENT),
    "Slow": grpc.unary_unary_rpc_method_handler(_slow, request_deserializer=IDENT, response_serializer=IDENT),
    "Ticks": grpc.unary_stream_rpc_method_handler(_ticks, request_deserializer=IDENT, response_serializer=IDENT),
    "Flood": grpc.unary_stream_rpc_method_handler(_flood, request_deserializer=IDENT, response_serializer=IDENT),
})


@pytest.fixture
def server():
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    srv.add_generic_rpc_handlers((HANDLER,))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield srv, port
    srv.stop(None)


@pytest.fixture
def collector_for():
    from llmdiag.collectors.h2_kernel import H2Kernel
    from llmdiag.collectors.http2 import Http2Collector

    made = []

    def make(port: int, config: Http2Config | None = None) -> Http2Collector:
        config = config or Http2Config()
        collector = Http2Collector([Backend.from_url(f"grpc://127.0.0.1:{port}", name="grpc-0")],
                                   H2Kernel.load(config), config)
        collector.refresh()
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.close()


def _signals(collector, backend: str = "grpc-0") -> dict:
    return {s.name: s.value for s in collector.collect(time.time()) if s.subject == backend}


def _wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)


def _method(channel, name: str, streaming: bool = False):
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(f"/llmdiag.test.H2/{name}", request_serializer=IDENT, response_deserializer=IDENT)


def test_unary_calls_open_and_close_streams(server, collector_for) -> None:
    _, port = server
    collector = collector_for(port)
    calls = 9
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = _method(channel, "Unary")
        for i in range(calls):
            assert unary(b"%d" % i) == b"pong:%d" % i
        _wait_for(lambda: _signals(collector).get("h2_streams_closed_total") == calls)
        signals = _signals(collector)
    assert signals["h2_streams_opened_total"] == calls
    assert signals["h2_streams_closed_total"] == calls
    assert signals["grpc_connections"] == 1
    assert signals["h2_rst_stream_total"] == Labelled()
    assert signals["h2_parse_resyncs_total"] == 0
    assert signals["h2_settings_total"]["direction=received"] >= 1
    assert collector.status().status.value == "ok", collector.status()


def test_cancelled_streams_are_exactly_rst_cancel_received(server, collector_for) -> None:
    _, port = server
    collector = collector_for(port)
    cancelled = 5
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        ticks = _method(channel, "Ticks", streaming=True)
        for _ in range(cancelled):
            call = ticks(b"go")
            next(call)  # the stream is open and flowing
            call.cancel()
        _wait_for(lambda: _signals(collector).get("h2_streams_closed_total") == cancelled)
        signals = _signals(collector)
        events = collector.recent_events()
    assert signals["h2_rst_stream_total"] == {"code=CANCEL,direction=received": cancelled}
    assert signals["h2_streams_opened_total"] == cancelled
    assert signals["h2_streams_closed_total"] == cancelled
    assert [(e.frame, e.code, e.direction) for e in events] == [("RST_STREAM", "CANCEL", "received")] * cancelled
    assert len({e.stream_id for e in events}) == cancelled
    assert all(e.stream_id % 2 == 1 and e.backend == "grpc-0" for e in events)
    assert len({e.connection for e in events}) == 1
    assert all(abs(e.ts - time.time()) < 30 for e in events)
    assert signals["h2_stall_then_reset_total"] == 0  # plain cancels of flowing streams: no stall before them


def test_expired_deadlines_reset_their_streams(server, collector_for) -> None:
    _, port = server
    collector = collector_for(port)
    expired = 3
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        slow = _method(channel, "Slow")
        for _ in range(expired):
            with pytest.raises(grpc.RpcError) as info:
                slow(b"x", timeout=0.2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _wait_for(lambda: len({e.stream_id for e in collector.recent_events()}) >= expired)
        time.sleep(1.2)  # the handlers finish; nothing more may be reset
        signals = _signals(collector)
        events = collector.recent_events()
    # On expiry the server ends the stream with RST_STREAM(NO_ERROR) after its
    # DEADLINE_EXCEEDED trailers, and the client may also cancel
    # (RST_STREAM(CANCEL)) when its own timer fires first. Each expired stream
    # is reset at least once, and only with the code its side uses.
    assert {(e.code, e.direction) for e in events} <= {("NO_ERROR", "sent"), ("CANCEL", "received")}
    assert len({e.stream_id for e in events}) == expired
    assert sum(signals["h2_rst_stream_total"].values()) == len(events)
    assert signals["h2_streams_opened_total"] == expired
    assert signals["h2_streams_closed_total"] == expired


def test_graceful_shutdown_sends_goaway(server, collector_for) -> None:
    srv, port = server
    collector = collector_for(port)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        pending = _method(channel, "Slow").future(b"x")
        time.sleep(0.3)  # the call is in flight when the shutdown starts
        srv.stop(grace=3).wait()
        assert pending.result() == b"late"  # grace let it finish
    _wait_for(lambda: bool(_signals(collector).get("h2_goaway_total")))
    signals = _signals(collector)
    goaways = [e for e in collector.recent_events() if e.frame == "GOAWAY"]
    assert signals["h2_goaway_total"].get("code=NO_ERROR,direction=sent", 0) >= 1
    assert goaways and all(e.code == "NO_ERROR" and e.direction == "sent" for e in goaways)
    assert sum(signals["h2_goaway_total"].values()) == len(goaways)
    assert signals["h2_streams_closed_total"] == 1


def test_slow_consumer_stall_then_cancel_on_the_same_connection(server, collector_for) -> None:
    _, port = server
    collector = collector_for(port, Http2Config(stall_seconds=0.2))
    # A small stream window and no BDP probing: the server's send window runs out at once.
    options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        call = _method(channel, "Flood", streaming=True)(b"go")
        next(call)
        time.sleep(0.8)  # the consumer does not read: the server is blocked on a zero window
        call.cancel()
        _wait_for(lambda: bool(collector.recent_events()))
        signals = _signals(collector)
        events = collector.recent_events()
        connections = collector.connections()
    assert signals["h2_flow_control_stalls_total"] >= 1
    [cancel] = [e for e in events if e.frame == "RST_STREAM"]
    assert (cancel.code, cancel.direction) == ("CANCEL", "received")
    # correlation input: the cancel carries the stall on its own connection and stream
    assert cancel.connection_stalls >= 1
    assert cancel.stream_stalled_seconds >= 0.5
    [conn] = [c for c in connections if (c.pid, c.fd) == cancel.connection]
    assert conn.stalls == cancel.connection_stalls and conn.rst_stream == 1
    # the per-connection join the grpc_flow_control_stall diagnosis reads
    assert signals["h2_stall_then_reset_total"] == 1


def test_connection_older_than_the_collector_resyncs(server, collector_for) -> None:
    _, port = server
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = _method(channel, "Unary")
        assert unary(b"before") == b"pong:before"  # preface exchanged before the program exists
        collector = collector_for(port)
        assert collector.connections(), "the /proc scan should have pushed the open connection"
        for _ in range(20):
            unary(b"after")
        time.sleep(0.3)
        signals = _signals(collector)
    # Nothing is counted before a direction re-syncs on a call that is a whole
    # number of frames; gRPC writes whole frames, so most calls are counted.
    assert signals["grpc_connections"] == 1
    assert 1 <= signals["h2_streams_opened_total"] <= 20
    assert signals["h2_streams_closed_total"] <= signals["h2_streams_opened_total"]
