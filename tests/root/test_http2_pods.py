"""The http2 collector traces gRPC engines in pods: network namespaces of their own, all on one port.

Two pod-like namespaces each run a real ``llmdiag fake-engine`` with gRPC on the same port, as
Triton or TensorRT-LLM pods do on one node. Their sockets are not in the agent's ``/proc/net/tcp``;
the collector finds each engine's process at its pod address and counts each pod apart: the
clients of one pod cancel mid-stream (RST_STREAM CANCEL), the other pod's streams finish."""

from __future__ import annotations

import asyncio
import json
import time

import grpc  # noqa: F401 - a dev dependency: a missing grpcio must fail CI, not skip it
import pytest
from pod_support import fake_engine_argv, network_namespace_pod

from llmdiag.collectors.h2_kernel import H2Kernel
from llmdiag.collectors.http2 import Http2Collector
from llmdiag.config.http2 import Http2Config
from llmdiag.model import Backend, Snapshot
from llmdiag.sim.fake_engine_grpc import GENERATE_METHOD, generate

pytestmark = pytest.mark.root

HTTP_PORT, GRPC_PORT = 18131, 18132  # the namespaces are new and empty: no port in them can be taken


async def _calls(address: str, count: int, max_tokens: int, give_up: bool) -> dict[str, int]:
    """``count`` Generate calls one after the other; with ``give_up`` the client cancels each after
    its first message (a RST_STREAM(CANCEL) that the engine receives; no deadline, so the engine
    never ends the stream first)."""
    outcomes: dict[str, int] = {}
    async with grpc.aio.insecure_channel(f"{address}:{GRPC_PORT}") as channel:
        for _ in range(count):
            if give_up:
                call = channel.unary_stream(GENERATE_METHOD, request_serializer=_bytes, response_deserializer=_bytes)(
                    json.dumps({"prompt_tokens": 64, "max_tokens": max_tokens}).encode())
                await call.read()
                call.cancel()
                outcome = "cancelled"
            else:
                async for _message in generate(channel, 64, max_tokens):
                    pass
                outcome = "ok"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        await asyncio.sleep(0.2)  # the last RST_STREAM on the wire before the channel closes
    return outcomes


def _bytes(data: bytes) -> bytes:
    return data


def _snapshot(collector: Http2Collector) -> Snapshot:
    snap = Snapshot(ts=time.time())
    snap.extend(collector.collect(snap.ts))
    return snap


def test_pod_engines_on_one_port_are_traced_and_counted_apart() -> None:
    engine = fake_engine_argv("0.0.0.0", HTTP_PORT, "--grpc-port", str(GRPC_PORT))
    with network_namespace_pod([(engine, GRPC_PORT)], {}, tag="a") as pod_a, \
            network_namespace_pod([(engine, GRPC_PORT)], {}, tag="b") as pod_b:
        backends = [Backend.from_url(f"grpc://{pod_a.address}:{GRPC_PORT}", name="pod-a"),
                    Backend.from_url(f"grpc://{pod_b.address}:{GRPC_PORT}", name="pod-b")]
        config = Http2Config()
        collector = Http2Collector(backends, H2Kernel.load(config), config)
        try:
            collector.refresh()
            assert collector.status().reason is not None and "no local process listens" not in collector.status().reason
            # pod-a's clients give up during a long generation; pod-b's calls finish.
            impatient = asyncio.run(_calls(pod_a.address, 3, 4000, give_up=True))
            patient = asyncio.run(_calls(pod_b.address, 4, 4, give_up=False))
            deadline = time.monotonic() + 10
            while True:  # the frames of the last calls may still be on their way
                snap = _snapshot(collector)
                a, b = snap.backends["pod-a"], snap.backends["pod-b"]
                if (a["h2_rst_stream_total"].get("code=CANCEL,direction=received", 0) >= 3
                        and b["h2_streams_closed_total"] >= 4) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            collector.close()
    assert impatient == {"cancelled": 3} and patient == {"ok": 4}
    assert a["h2_streams_opened_total"] == 3 and b["h2_streams_opened_total"] == 4
    assert a["h2_rst_stream_total"]["code=CANCEL,direction=received"] == 3
    assert b["h2_rst_stream_total"].get("code=CANCEL,direction=received", 0) == 0
    assert b["h2_streams_closed_total"] == 4
