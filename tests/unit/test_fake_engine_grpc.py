"""The fake engine's h2c gRPC Generate method: streams tokens from the same engine model, and a
client that cancels (deadline) has its request aborted in the engine, as vLLM aborts it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmdiag.sim.fake_engine import FakeEngine, FakeEngineOptions
from llmdiag.sim.fake_engine_grpc import GENERATE_METHOD, generate


def _aborts(engine: FakeEngine) -> float:
    for family in text_string_to_metric_families(generate_latest(engine.registry).decode()):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total" and sample.labels.get("finished_reason") == "abort":
                return sample.value
    return 0.0


async def test_grpc_generate_streams_and_cancels_abort_in_the_engine() -> None:
    engine = FakeEngine(FakeEngineOptions(port=0, grpc_port=0, profile="llama3-8b-h100"))
    await engine.start()
    try:
        assert engine.grpc_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{engine.grpc_port}") as channel:
            messages = [m async for m in generate(channel, 64, 4)]
            assert sum(m.get("tokens", 0) for m in messages) == 4
            assert messages[-1] == {"finish_reason": "length", "completion_tokens": 4}
            with pytest.raises(grpc.aio.AioRpcError) as cancelled:
                async for _ in generate(channel, 64, 100_000, timeout=0.2):
                    pass
            assert cancelled.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            bad = channel.unary_stream(GENERATE_METHOD)
            with pytest.raises(grpc.aio.AioRpcError) as invalid:
                async for _ in bad(b"not json"):
                    pass
            assert invalid.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        for _ in range(50):
            if _aborts(engine) >= 1 and engine.model.num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert _aborts(engine) == 1  # the cancelled stream, freed in the engine
        assert engine.model.num_running == 0 and engine.model.num_waiting == 0
    finally:
        await engine.stop()
    with pytest.raises(Exception):  # noqa: B017 - the port is closed after stop()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{engine.grpc_port}") as channel:
            async for _ in generate(channel, 8, 1, timeout=1.0):
                pass
