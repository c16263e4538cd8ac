"""The fake engine over real HTTP on 127.0.0.1: OpenAI API, vLLM metrics, faults."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmdiag.sim.fake_engine import FakeEngine, FakeEngineOptions
from llmdiag.sim.faults import parse_faults


async def _metrics(session: aiohttp.ClientSession, engine: FakeEngine) -> dict[str, float]:
    async with session.get(f"{engine.url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "finished_reason" in sample.labels:
                key += f"[{sample.labels['finished_reason']}]"
            out[key] = sample.value
    return out


@pytest.fixture
async def engine():
    eng = FakeEngine(FakeEngineOptions(port=0, kv_capacity_tokens=8000, queue_limit=4))
    await eng.start()
    yield eng
    await eng.stop()


async def test_streaming_completion_yields_every_token(engine: FakeEngine) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "fake/llama3-8b", "prompt": "x" * 400, "max_tokens": 7, "stream": True}
        chunks = []
        async with session.post(f"{engine.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            async for line in resp.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        tokens = [c for c in chunks if c["choices"][0]["text"]]
        assert len(tokens) == 7
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"] == {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}
        metrics = await _metrics(session, engine)
    assert metrics["vllm:prompt_tokens_total"] == 100  # 400 characters / 4
    assert metrics["vllm:generation_tokens_total"] == 7
    assert metrics["vllm:request_success_total[length]"] == 1
    assert metrics["vllm:time_to_first_token_seconds_count"] == 1
    assert metrics["vllm:inter_token_latency_seconds_count"] == 6
    assert metrics["vllm:num_requests_running"] == 0


async def test_process_start_time_is_the_origin_of_the_fault_clock() -> None:
    """A benchmark lines its load up with a scheduled fault through process_start_time_seconds."""
    before = time.time()
    eng = FakeEngine(FakeEngineOptions(port=0, faults=parse_faults("slowdown:start=30,speed=0.5")))
    await eng.start()
    after = time.time()
    try:
        async with aiohttp.ClientSession() as session:
            metrics = await _metrics(session, eng)
        start = metrics["process_start_time_seconds"]
        assert before <= start <= after
        assert start == eng.started_at_unix
        # The engine clock (faults count on it) reads the seconds since that instant.
        assert abs(eng.now() - (time.time() - start)) < 0.5
    finally:
        await eng.stop()


async def test_chat_and_full_response(engine: FakeEngine) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "prompt_tokens": 50}
        async with session.post(f"{engine.url}/v1/chat/completions", json=body) as resp:
            doc = await resp.json()
        assert doc["usage"] == {"prompt_tokens": 50, "completion_tokens": 3, "total_tokens": 53}
        assert doc["choices"][0]["message"]["content"].count("tok") == 3
        async with session.post(f"{engine.url}/v1/completions", json={"max_tokens": 0}) as resp:
            assert resp.status == 400
        async with session.post(f"{engine.url}/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400
        async with session.post(f"{engine.url}/v1/completions", json={"model": "other", "max_tokens": 1}) as resp:
            assert resp.status == 404


async def test_client_disconnect_aborts_and_frees_kv(engine: FakeEngine) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"prompt_tokens": 2000, "max_tokens": 100000 // 100, "stream": True}
        resp = await session.post(f"{engine.url}/v1/completions", json=body)
        await resp.content.readline()  # first token arrived
        assert engine.model.kv_usage > 0.2
        resp.close()  # the client goes away mid-stream
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.model.kv_usage == 0:
                break
        metrics = await _metrics(session, engine)
    assert engine.model.kv_usage == 0
    assert metrics["vllm:request_success_total[abort]"] == 1


async def test_crash_closes_the_port_and_restart_resets_counters() -> None:
    eng = FakeEngine(FakeEngineOptions(port=0, faults=parse_faults("crash:start=0.3,down=0.4,warmup_s=0")))
    await eng.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{eng.url}/v1/completions", json={"max_tokens": 2}) as resp:
                assert resp.status == 200
            assert (await _metrics(session, eng))["vllm:request_success_total[length]"] == 1
            await asyncio.sleep(0.45)
            with pytest.raises(aiohttp.ClientConnectorError):
                await session.get(f"{eng.url}/health")
            await asyncio.sleep(0.5)
            async with session.get(f"{eng.url}/health") as resp:
                assert resp.status == 200
            metrics = await _metrics(session, eng)
        assert "vllm:request_success_total[length]" not in metrics  # a restarted engine starts from zero
    finally:
        await eng.stop()


async def test_client_that_gives_up_while_waiting_is_aborted() -> None:
    """A client that hangs up before its first token is aborted at once, streaming or not (as vLLM does)."""
    eng = FakeEngine(FakeEngineOptions(port=0, kv_capacity_tokens=2000))
    await eng.start()
    try:
        async with aiohttp.ClientSession() as session:
            hog = asyncio.create_task(session.post(f"{eng.url}/v1/completions", json={"prompt_tokens": 1900, "max_tokens": 300}))
            while eng.model.num_running < 1:
                await asyncio.sleep(0.005)
            body = {"prompt_tokens": 1500, "max_tokens": 5}
            with pytest.raises(asyncio.TimeoutError):  # no answer until done: the client gives up
                await asyncio.wait_for(session.post(f"{eng.url}/v1/completions", json=body), timeout=0.3)
            resp = await session.post(f"{eng.url}/v1/completions", json={**body, "stream": True})
            with pytest.raises(asyncio.TimeoutError):  # headers came, no token yet: the client gives up
                await asyncio.wait_for(resp.content.readline(), timeout=0.3)
            resp.close()
            for _ in range(100):
                if eng.model.num_waiting == 0:
                    break
                await asyncio.sleep(0.01)
            assert eng.model.num_waiting == 0  # both impatient requests left the queue
            metrics = await _metrics(session, eng)
            assert metrics["vllm:request_success_total[abort]"] == 2
            hog.cancel()
    finally:
        await eng.stop()



async def test_http_requests_total_counts_answers_by_grouped_status_as_vllm_does() -> None:
    eng = FakeEngine(FakeEngineOptions(port=0, faults=parse_faults("error_5xx:start=0,ratio=1")))
    await eng.start()
    try:
        async with aiohttp.ClientSession() as session:
            for body in ({"max_tokens": 2}, {"max_tokens": 2}, {"model": "nope", "max_tokens": 2}):
                async with session.post(f"{eng.url}/v1/completions", json=body) as resp:
                    await resp.read()
            async with session.get(f"{eng.url}/health") as resp:
                assert resp.status == 200
            await _metrics(session, eng)
            async with session.get(f"{eng.url}/metrics") as resp:
                text = await resp.text()
    finally:
        await eng.stop()
    http = {
        (s.labels["handler"], s.labels["method"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "http_requests_total"
    }
    # Every request fails with 500 (ratio 1); the unknown model is a 404; /health and /metrics are not counted.
    assert http == {("/v1/completions", "POST", "5xx"): 2, ("/v1/completions", "POST", "4xx"): 1}
