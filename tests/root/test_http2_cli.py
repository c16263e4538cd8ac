"""`llmdiag collect --collectors http2` shows the counts of a real gRPC backend (SPEC 3.2 encoding)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent import futures

import pytest

import grpc  # noqa: E402 - a dev dependency: a missing grpcio must fail CI, not skip it

pytestmark = pytest.mark.root

IDENT = lambda b: b  # noqa: E731


def _ticks(request: bytes, context):
    while context.is_active():
        yield b"t" * 64
        time.sleep(0.01)


def test_collect_json_shows_rst_stream_counts() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("llmdiag.test.Cli", {
        "Ticks": grpc.unary_stream_rpc_method_handler(_ticks, request_deserializer=IDENT, response_serializer=IDENT),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    url = f"grpc://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmdiag.cli", "--backend", url, "collect", "--duration", "8",
         "--collectors", "http2", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    first = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert first.wait(60), f"no snapshot from collect: {proc.stderr.read() if proc.poll() is not None else ''}"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            ticks = channel.unary_stream("/llmdiag.test.Cli/Ticks", request_serializer=IDENT, response_deserializer=IDENT)
            for _ in range(5):
                call = ticks(b"go")
                next(call)
                call.cancel()
            assert proc.wait(timeout=60) == 0, proc.stderr.read()  # type: ignore[union-attr]
        reader.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop(None)
    last = json.loads(lines[-1])
    assert last["collectors"]["http2"]["status"] == "ok", last["collectors"]
    signals = last["backends"][f"127.0.0.1:{port}"]
    assert signals["h2_rst_stream_total"] == {"code=CANCEL,direction=received": 5}
    assert signals["h2_streams_opened_total"] == 5
    assert signals["h2_streams_closed_total"] == 5
    assert signals["grpc_connections"] == 1
    assert isinstance(signals["h2_flow_control_stalls_total"], int)
