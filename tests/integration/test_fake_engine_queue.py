"""The fake engine's queue limit on the wall clock: 429 with vLLM's saturation body once the queue is full."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from llmdiag.sim.fake_engine import FakeEngine, FakeEngineOptions

# Real requests through a real engine model at wall-clock speed (~15 s): the integration tier.
pytestmark = pytest.mark.integration


@pytest.fixture
async def engine():
    eng = FakeEngine(FakeEngineOptions(port=0, kv_capacity_tokens=8000, queue_limit=4))
    await eng.start()
    yield eng
    await eng.stop()


async def test_queue_limit_answers_429_with_saturation_body(engine: FakeEngine) -> None:
    async with aiohttp.ClientSession() as session:
        # 8000-token KV cache, 6000-token prompts: one runs, the rest wait; the 4-deep queue then overflows.
        body = {"prompt_tokens": 6000, "max_tokens": 400}
        first = asyncio.create_task(session.post(f"{engine.url}/v1/completions", json=body))
        while engine.model.num_running < 1:
            await asyncio.sleep(0.005)
        tasks = [asyncio.create_task(session.post(f"{engine.url}/v1/completions", json=body)) for _ in range(7)]
        responses = [await first, *await asyncio.gather(*tasks)]
        statuses = sorted(r.status for r in responses)
        rejected = [await r.text() for r in responses if r.status == 429]
        for r in responses:
            r.release()
    assert statuses.count(200) == 5 and statuses.count(429) == 3, statuses
    assert all("queue full" in text for text in rejected)
