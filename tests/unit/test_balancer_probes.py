"""Active probes against a real aiohttp server on 127.0.0.1 (SPEC 6.3, seed 002)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from aiohttp import web

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import Backend, BackendState
from llmdiag.router_feedback.balancer import Balancer
from llmdiag.router_feedback.probes import AiohttpProbeClient, ProbeResult, ProbeRunner

from balancer_support import VirtualClock


class FakeEngine:
    """An OpenAI-style completions endpoint whose behaviour the test switches: ok, fail, slow, garbage."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.mode = "ok"
        self.requests: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def completions(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        if self.mode == "fail":
            return web.json_response({"error": "CUDA error: an illegal memory access"}, status=500)
        if self.mode == "slow":
            await asyncio.sleep(2.0)
        if self.mode == "garbage":
            return web.Response(text="<html>hello</html>")
        return web.json_response({"id": "cmpl-1", "object": "text_completion",
                                  "choices": [{"index": 0, "text": "!", "finish_reason": "length"}]})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny-model", "object": "model"}]})

    async def __aenter__(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the ephemeral port
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_probes_bring_an_ejected_backend_back() -> None:
    async with FakeEngine() as engine:
        clock = VirtualClock()
        backend = Backend("e0", engine.url, engine="vllm", models=("tiny-model",))
        balancer = Balancer([backend], clock=clock, rng=random.Random(1))
        clock.advance(60)
        for _ in range(3):
            balancer.on_finish("e0", 502)  # a server fault, not a refused connection
        assert balancer.state("e0") is BackendState.EJECTED
        client = AiohttpProbeClient()
        runner = ProbeRunner(balancer, client)
        try:
            results = await runner.run_once()
            assert results["e0"].ok and results["e0"].status == 200 and not results["e0"].refused
            assert balancer.state("e0") is BackendState.EJECTED  # one success is not enough
            assert await runner.run_once() == {}  # not due yet
            clock.advance(5.0)  # ejected backends are probed every 5 s
            assert (await runner.run_once())["e0"].ok
            assert balancer.state("e0") is BackendState.HALF_OPEN  # 2 successes: at once, well before 15 s
            clock.advance(5.0)
            await runner.run_once()
            clock.advance(5.0)
            await runner.run_once()
            assert balancer.state("e0") not in (BackendState.EJECTED, BackendState.HALF_OPEN)
            assert engine.requests[0] == {"prompt": "ping", "max_tokens": 1, "temperature": 0, "stream": False,
                                          "model": "tiny-model"}
            assert runner.probes_total == 4 and runner.probe_failures_total == 0
        finally:
            await runner.close()


async def test_one_good_probe_after_a_refused_connection_readmits() -> None:
    # The engine's port refuses (nothing listens): the probe says so; once it answers, one good probe is
    # enough to go half-open (issue 14: a restarted engine must not wait for two probe rounds).
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: connections to it are refused
    clock = VirtualClock()
    balancer = Balancer([Backend("e0", f"http://127.0.0.1:{port}", models=("tiny-model",))], clock=clock,
                        rng=random.Random(1))
    clock.advance(60)
    for _ in range(3):
        balancer.on_finish("e0", 502)
    runner = ProbeRunner(balancer, AiohttpProbeClient())
    try:
        result = (await runner.run_once())["e0"]
        assert not result.ok and result.refused
        for _ in range(3):  # probed every 5 s while ejected
            clock.advance(5.0)
            assert not (await runner.run_once())["e0"].ok
        # The 15 s ejection is over, but the latest probe found the engine down: no trial request.
        assert balancer.state("e0") is BackendState.EJECTED
        async with FakeEngine(port=port) as engine:
            clock.advance(5.0)
            result = (await runner.run_once())["e0"]
            assert result.ok
            assert balancer.state("e0") is BackendState.HALF_OPEN  # one good probe after a refusal
            assert len(engine.requests) == 1
    finally:
        await runner.close()


async def test_failing_probes_eject_a_backend_without_traffic() -> None:
    async with FakeEngine() as engine:
        engine.mode = "fail"
        clock = VirtualClock()
        balancer = Balancer([Backend("e0", engine.url, models=("tiny-model",))], clock=clock, rng=random.Random(2))
        runner = ProbeRunner(balancer, AiohttpProbeClient())
        try:
            for i in range(3):
                if i:
                    assert await runner.run_once() == {}
                    clock.advance(30.0)  # healthy backends are probed every 30 s
                result = (await runner.run_once())["e0"]
                assert not result.ok and result.status == 500 and "illegal memory access" in result.detail
            assert balancer.state("e0") is BackendState.EJECTED
            assert runner.probe_failures_total == 3
        finally:
            await runner.close()


async def test_probe_timeout_and_bad_answers() -> None:
    async with FakeEngine() as engine:
        backend = Backend("e0", engine.url)  # no models declared: the probe asks /v1/models
        client = AiohttpProbeClient()
        try:
            engine.mode = "garbage"
            result = await client.probe(backend, None, 2.0)
            assert not result.ok and result.detail == "answer is not JSON"
            assert engine.requests[-1]["model"] == "tiny-model"
            engine.mode = "slow"
            started = time.monotonic()
            result = await client.probe(backend, "tiny-model", 0.3)
            assert not result.ok and "timeout" in result.detail
            assert time.monotonic() - started < 1.5
        finally:
            await client.close()


async def test_connection_refused_is_a_failed_probe() -> None:
    async with FakeEngine() as engine:
        url = engine.url
    client = AiohttpProbeClient()  # the server is gone: nothing listens on that port now
    try:
        result = await client.probe(Backend("gone", url), "m", 1.0)
    finally:
        await client.close()
    assert not result.ok and result.status is None and result.detail


class BrokenClient:
    async def probe(self, backend: Backend, model: str | None, timeout: float) -> ProbeResult:
        raise RuntimeError("client bug")

    async def close(self) -> None:
        pass


async def test_a_broken_client_counts_as_failure_not_a_crash() -> None:
    clock = VirtualClock()
    balancer = Balancer([Backend("e0", "http://127.0.0.1:9")], clock=clock)
    runner = ProbeRunner(balancer, BrokenClient())
    result = (await runner.run_once())["e0"]
    assert not result.ok and "client bug" in result.detail


async def test_runner_task_probes_on_its_own_and_stops() -> None:
    async with FakeEngine() as engine:
        cfg = BalancerConfig(probe_interval_seconds=0.05)
        balancer = Balancer([Backend("e0", engine.url, models=("tiny-model",))], config=cfg, clock=time.monotonic)
        runner = ProbeRunner(balancer, AiohttpProbeClient(), tick_seconds=0.01)
        task = runner.start()
        try:
            for _ in range(200):
                if runner.probes_total >= 3:
                    break
                await asyncio.sleep(0.02)
            assert runner.probes_total >= 3
        finally:
            await runner.close()
        assert task.done()
        seen = len(engine.requests)
        await asyncio.sleep(0.1)
        assert len(engine.requests) == seen
        assert all(json.dumps(r) for r in engine.requests)


@pytest.mark.parametrize("key", ["probe_timeout_seconds", "probe_interval_seconds"])
def test_probe_config_validation(key: str) -> None:
    with pytest.raises(ValueError, match=key):
        BalancerConfig(**{key: 0})
