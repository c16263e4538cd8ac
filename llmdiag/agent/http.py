"""The agent's HTTP endpoints (aiohttp), SPEC 3.4 and 6.4.

=================  ==========================================================  =====
path               body                                                        token
=================  ==========================================================  =====
``/metrics``       Prometheus text (:mod:`llmdiag.exporters.prometheus`)      yes
``/v1/penalties``  ``llmdiag.penalties/v1``                                    yes
``/v1/state``      ``llmdiag.state/v1`` (:class:`llmdiag.agent.loop.AgentState`) yes
``/healthz``       ``ok`` (200) while ticks are fresh, else 503 with the reason  no
=================  ==========================================================  =====

With a bearer token configured, every path but ``/healthz`` answers 401 without
``Authorization: Bearer <token>``. Handlers only read the latest immutable state.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

__all__ = ["build_app"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _dumps(obj: Any) -> str:
    """Strict JSON; a non-finite number anywhere (a rule's evidence, say) becomes null, never a 500."""
    try:
        return json.dumps(obj, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, separators=(",", ":"))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=_dumps(obj), status=status, content_type="application/json")


def build_app(agent: Any, registry: CollectorRegistry, token: str | None) -> web.Application:
    """The aiohttp application over ``agent`` (:class:`llmdiag.agent.daemon.Agent`)."""
    expected = f"Bearer {token}".encode() if token else None

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path != "/healthz":
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, expected):
                agent.count_unauthorized()
                return web.Response(status=401, text="bearer token required\n",
                                    headers={"WWW-Authenticate": 'Bearer realm="llmdiag"'})
        return await handler(request)

    # Rendering a large state takes milliseconds: off the event loop, so that agent-check
    # answers never wait behind a scrape.
    async def metrics(request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def penalties(request: web.Request) -> web.Response:
        return _json(agent.state.penalties(agent.config.agent.penalties_ttl_seconds).to_json())

    async def state(request: web.Request) -> web.Response:
        snapshot = agent.state  # one state for the whole answer
        text = await asyncio.get_running_loop().run_in_executor(None, _dumps, snapshot.to_json())
        return web.Response(text=text, content_type="application/json")

    async def healthz(request: web.Request) -> web.Response:
        ok, reason = agent.health()
        return web.Response(status=200 if ok else 503, text=reason + "\n")

    app = web.Application(middlewares=[auth], client_max_size=64 * 1024)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/penalties", penalties)
    app.router.add_get("/v1/state", state)
    app.router.add_get("/healthz", healthz)
    return app
