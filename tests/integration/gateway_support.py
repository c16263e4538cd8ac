"""Helpers for the gateway and LiteLLM integration tests: fake engines, scripted upstreams, a gateway, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from llmdiag.config.balancer import BalancerConfig
from llmdiag.config.gateway import GatewayConfig
from llmdiag.gateway.proxy import Gateway
from llmdiag.model import Backend
from llmdiag.router_feedback.balancer import Balancer
from llmdiag.sim.fake_engine import FakeEngine, FakeEngineOptions
from llmdiag.sim.faults import parse_faults

MODEL = "fake/llama3-8b"


def normalise_ids(body: bytes) -> bytes:
    """Fake-engine answers differ only by their request id (``cmpl-N``)."""
    return re.sub(rb"cmpl-\d+", b"cmpl-N", body)


async def start_engine(faults: str = "", **kwargs: Any) -> FakeEngine:
    engine = FakeEngine(FakeEngineOptions(port=0, model=MODEL, faults=parse_faults(faults), **kwargs))
    await engine.start()
    return engine


def aborts(engine: FakeEngine) -> float:
    """The engine's ``vllm:request_success_total{finished_reason="abort"}`` (client went away)."""
    value = engine.registry.get_sample_value(
        "vllm:request_success_total", {"model_name": MODEL, "engine": "0", "finished_reason": "abort"})
    return value or 0.0


class Scripted:
    """An upstream whose completions answer is a coroutine ``handler(request, self)``; records request bodies."""

    def __init__(self, handler: Callable[[web.Request, Scripted], Awaitable[web.StreamResponse]]) -> None:
        self.handler = handler
        self.bodies: list[bytes] = []
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.release = asyncio.Event()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.read())
        return await self.handler(request, self)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def start(self) -> Scripted:
        app = web.Application()
        app.router.add_post("/v1/completions", self._serve)
        app.router.add_post("/v1/chat/completions", self._serve)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()


@asynccontextmanager
async def gateway(backends: list[Backend], balancer_config: BalancerConfig | None = None, **gw: Any):
    """A started gateway on an ephemeral port (probes off unless asked, no access log)."""
    gw.setdefault("probes", False)
    balancer = Balancer(backends, balancer_config or BalancerConfig())
    gwy = Gateway(GatewayConfig(listen="127.0.0.1:0", **gw), balancer)
    await gwy.start()
    try:
        yield gwy
    finally:
        await gwy.stop()
