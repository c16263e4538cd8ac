"""AgentPenalties against real aiohttp agents on 127.0.0.1: good, stale, garbage, 500, hanging."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from llmdiag.model import Backend, BackendPenalty, BackendState, PenaltiesDocument, Reason, Severity
from llmdiag.router_feedback.agent_penalties import AgentPenalties
from llmdiag.router_feedback.balancer import Balancer

pytestmark = pytest.mark.integration

TOKEN = "s3cret"


def _document(ts: float, address: str, penalty: float) -> str:
    reason = Reason("queue_avalanche", Severity.CRITICAL, penalty, "waiting queue grows")
    entry = BackendPenalty("engine", address, 40.0, penalty, 40, BackendState.DEGRADED, (reason,))
    return PenaltiesDocument(ts=ts, host="node", ttl_seconds=5, backends=(entry,)).dumps()


class Agent:
    """One fake node agent whose ``/v1/penalties`` answer is chosen by ``mode``."""

    def __init__(self, mode: str, address: str, penalty: float = 0.4) -> None:
        self.mode, self.address, self.penalty = mode, address, penalty
        self.auth: list[str | None] = []
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.auth.append(request.headers.get("Authorization"))
        if self.mode == "good":
            return web.Response(text=_document(time.time(), self.address, self.penalty), content_type="application/json")
        if self.mode == "stale":
            return web.Response(text=_document(time.time() - 60, self.address, self.penalty), content_type="application/json")
        if self.mode == "garbage":
            return web.Response(text='{"schema": "llmdiag.penalties/v1", "ts": "soon", "backends": 7', content_type="application/json")
        if self.mode == "wrong-schema":
            return web.Response(text=json.dumps({"schema": "other/v9", "ts": time.time()}), content_type="application/json")
        if self.mode == "500":
            return web.Response(status=500, text="boom")
        # hanging: headers never come
        await self.release.wait()
        return web.Response(text="late")


@pytest.fixture
async def agents():
    started: list[tuple[web.AppRunner, Agent]] = []

    async def start(mode: str, address: str, penalty: float = 0.4) -> tuple[str, Agent]:
        agent = Agent(mode, address, penalty)
        app = web.Application()
        app.router.add_get("/v1/penalties", agent.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        started.append((runner, agent))
        return f"http://127.0.0.1:{port}", agent

    yield start
    for runner, agent in started:
        agent.release.set()
        await runner.cleanup()


def _balancer(n: int) -> Balancer:
    return Balancer([Backend(f"b{i}", f"http://10.0.0.{i}:8000", models=("m",)) for i in range(n)])


def _penalties(balancer: Balancer) -> dict[str, float]:
    return {s.name: s.penalty for s in balancer.snapshot_states()}


async def test_every_kind_of_agent_answer(agents) -> None:
    modes = ["good", "stale", "garbage", "wrong-schema", "500", "hanging"]
    urls = []
    for i, mode in enumerate(modes):
        url, _ = await agents(mode, f"10.0.0.{i}:8000", penalty=0.4)
        urls.append(url)
    balancer = _balancer(len(modes))
    poller = AgentPenalties(urls, timeout=0.3)
    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        await poller.poll(session)
        took = time.monotonic() - t0
    # Concurrent fetches: the hanging agent costs one timeout, not one per agent.
    assert took < 2.0
    assert poller.apply(balancer) == {"b0": 0.4}
    assert _penalties(balancer) == {"b0": 0.4, "b1": 0.0, "b2": 0.0, "b3": 0.0, "b4": 0.0, "b5": 0.0}
    errors = poller.fetch_errors
    assert errors[urls[0]] == 0 and errors[urls[1]] == 0
    assert all(errors[u] == 1 for u in urls[2:])
    assert "not a penalties document" in poller.agents[urls[2]].last_error
    assert "unknown penalties schema" in poller.agents[urls[3]].last_error
    assert poller.agents[urls[4]].last_error == "HTTP 500"
    assert "within 0.3 s" in poller.agents[urls[5]].last_error
    assert poller.stale_documents_total == 1


async def test_run_loop_applies_sends_token_and_fails_open_when_agent_turns_bad(agents) -> None:
    url, agent = await agents("good", "10.0.0.0:8000", penalty=0.5)
    balancer = _balancer(2)
    poller = AgentPenalties([url], token=TOKEN, interval=0.05, timeout=0.3)
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(poller.run(session, balancer, stop))
        for _ in range(100):
            if _penalties(balancer)["b0"] == 0.5:
                break
            await asyncio.sleep(0.02)
        assert _penalties(balancer)["b0"] == 0.5
        assert agent.auth[0] == f"Bearer {TOKEN}"
        # The agent now serves only stale documents: the penalty goes, routing goes on.
        agent.mode = "stale"
        for _ in range(100):
            if _penalties(balancer)["b0"] == 0.0:
                break
            await asyncio.sleep(0.02)
        assert _penalties(balancer)["b0"] == 0.0
        assert poller.stale_documents_total >= 1
        agent.mode = "good"
        for _ in range(100):
            if _penalties(balancer)["b0"] == 0.5:
                break
            await asyncio.sleep(0.02)
        assert _penalties(balancer)["b0"] == 0.5
        stop.set()
        await asyncio.wait_for(task, 2.0)
    # Shutdown takes our penalties back.
    assert _penalties(balancer)["b0"] == 0.0


async def test_unreachable_agent_counts_errors_and_keeps_last_document_until_ttl(agents) -> None:
    url, agent = await agents("good", "10.0.0.1:8000", penalty=0.3)
    balancer = _balancer(2)
    poller = AgentPenalties([url], timeout=0.3)
    async with aiohttp.ClientSession() as session:
        await poller.poll(session)
        assert poller.apply(balancer) == {"b1": 0.3}
        agent.mode = "500"
        await poller.poll(session)
        await poller.poll(session)
    assert poller.fetch_errors[url] == 2
    # The last good document is still within its ttl: it keeps applying...
    assert poller.apply(balancer) == {"b1": 0.3}
    # ...until it is older than its ttl.
    assert poller.apply(balancer, now=time.time() + 10) == {}
    assert _penalties(balancer)["b1"] == 0.0


async def test_refused_connection_is_a_fetch_error() -> None:
    # A port nobody listens on: bind one, close it, use it.
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    url = f"http://127.0.0.1:{port}"
    poller = AgentPenalties([url], timeout=0.5)
    async with aiohttp.ClientSession() as session:
        await poller.poll(session)
    assert poller.fetch_errors[url] == 1
    assert "Connect" in poller.agents[url].last_error
    assert poller.apply(_balancer(1)) == {}
