"""A real LiteLLM Router routing with the llmdiag strategy over fake engines on 127.0.0.1.

LiteLLM's import takes several seconds, so it happens once per module; it runs
offline (no cost-map or tokenizer downloads).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import Counter

import pytest
from aiohttp import web

from llmdiag.config.balancer import BalancerConfig, ScoreConfig
from llmdiag.model import BackendPenalty, BackendState, PenaltiesDocument, Reason, Severity

from gateway_support import MODEL, start_engine

pytestmark = pytest.mark.integration

FAST_START = BalancerConfig(score=ScoreConfig(warming_start_score=100.0))


@pytest.fixture(scope="module")
def litellm_module():
    os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    saved = list(litellm.callbacks or [])
    yield litellm
    litellm.callbacks = saved


def _model_list(urls: list[str]) -> list[dict]:
    return [{"model_name": "llama", "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"{u}/v1", "api_key": "x"},
             "model_info": {"id": f"dep-{i}"}} for i, u in enumerate(urls)]


async def _agent(penalties: dict[str, float]) -> tuple[str, web.AppRunner]:
    """A node agent serving fresh penalties for the given ``ip:port`` addresses."""

    async def handle(request: web.Request) -> web.Response:
        entries = tuple(
            BackendPenalty(f"engine-{addr}", addr, 100 * (1 - p), p, int(100 * (1 - p)), BackendState.DEGRADED,
                           (Reason("gpu_fault", Severity.CRITICAL, p, "XID 79 on the GPU"),))
            for addr, p in penalties.items())
        doc = PenaltiesDocument(ts=time.time(), host="node", ttl_seconds=5, backends=entries)
        return web.Response(text=doc.dumps(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/penalties", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", runner  # type: ignore[union-attr]


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _served(engine) -> float:
    return engine.registry.get_sample_value(
        "vllm:request_success_total", {"model_name": MODEL, "engine": "0", "finished_reason": "length"}) or 0.0


async def test_degraded_engine_share_follows_scores(litellm_module) -> None:
    from llmdiag.gateway.litellm_strategy import install, uninstall

    engines = [await start_engine(), await start_engine(), await start_engine("slowdown:start=0,speed=0.3")]
    agent_url, agent = await _agent({f"127.0.0.1:{engines[2].port}": 0.5})
    router = litellm_module.Router(model_list=_model_list([e.url for e in engines]))
    routing = install(router, agents=[agent_url], balancer_config=FAST_START, poll_seconds=0.1)
    try:
        await _until(lambda: routing.agents.applied == {"dep-2": 0.5})
        calls = iter(range(400))
        statuses: Counter[str] = Counter()

        async def client() -> None:
            for i in calls:
                stream = i % 4 == 0
                resp = await router.acompletion(model="llama", messages=[{"role": "user", "content": "hello " * 50}],
                                                max_tokens=2, stream=stream)
                if stream:
                    async for _ in resp:
                        pass
                statuses["ok"] += 1

        await asyncio.gather(*(client() for _ in range(8)))
        assert statuses["ok"] == 400
        await _until(lambda: sum(routing.picks.values()) == sum(_served(e) for e in engines))
        served = [_served(e) for e in engines]
        # The strategy's picks are what the engines served.
        assert [routing.picks.get(f"dep-{i}", 0) for i in range(3)] == served
        scores = {f"dep-{i}": routing.balancer.score(f"dep-{i}") for i in range(3)}
        share = [s / 400 for s in served]
        # Lowest score, lowest share: well under what the healthy engines get.
        assert min(scores, key=scores.get) == "dep-2", scores
        assert share[2] < 0.5 * min(share[0], share[1]), (share, scores)
        assert share[2] > 0.0  # degraded, not dead: still gets some work (in-flight load spreads it)
    finally:
        uninstall(routing)
        await agent.cleanup()
        for e in engines:
            await e.stop()


async def test_unreachable_agent_falls_back_without_errors(litellm_module) -> None:
    from llmdiag.gateway.litellm_strategy import install, uninstall

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead_agent = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    engines = [await start_engine(), await start_engine()]
    router = litellm_module.Router(model_list=_model_list([e.url for e in engines]))
    routing = install(router, agents=[dead_agent], balancer_config=FAST_START, poll_seconds=0.1)
    try:
        await _until(lambda: routing.agents.fetch_errors[dead_agent] >= 1)
        for _ in range(30):
            resp = await router.acompletion(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
            assert resp.choices
        assert routing.agents.applied == {}
        assert set(routing.picks) == {"dep-0", "dep-1"}
        # Success callbacks run just after each call returns.
        await _until(lambda: routing.balancer.counters["responses_ok_total"] == 30)
    finally:
        uninstall(routing)
        for e in engines:
            await e.stop()


async def test_cooled_down_deployment_is_skipped(litellm_module) -> None:
    from llmdiag.gateway.litellm_strategy import install, uninstall

    live, dead = await start_engine(), await start_engine()
    dead_url = dead.url
    await dead.stop()  # connections refused from now on
    # The node agent says the live engine is in trouble, so the balancer prefers the dead one:
    # only LiteLLM's cooldown (allowed_fails=0: one failure) keeps requests away from it.
    agent_url, agent = await _agent({f"127.0.0.1:{live.port}": 0.9})
    router = litellm_module.Router(model_list=_model_list([live.url, dead_url]), allowed_fails=0, cooldown_time=60,
                                   num_retries=2)
    routing = install(router, agents=[agent_url], balancer_config=FAST_START, poll_seconds=0.1)
    try:
        await _until(lambda: routing.agents.applied == {"dep-0": 0.9})
        for _ in range(12):
            resp = await router.acompletion(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
            assert resp.choices
        assert routing.picks.get("dep-1") == 1  # tried once, failed, cooled down, never again
        assert routing.picks["dep-0"] == 12
        assert routing.balancer.score("dep-1") > routing.balancer.score("dep-0")  # the balancer alone would pick it
        assert routing.cooled_down_skipped_total >= 11
    finally:
        uninstall(routing)
        await agent.cleanup()
        await live.stop()
